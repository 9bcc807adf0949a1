//! The operator's files: the policy file and the worker profiles.

use convene_mesh::policy_file::PolicyFile;

/// The policy file loader (`Policy::load`'s parse and compile), as YAML and as TOML;
/// a policy that compiles is asked what its services ask of it.
pub fn policy_file(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    for extension in ["yaml", "toml"] {
        let Ok(file) = PolicyFile::parse(text, Some(extension), "policy") else {
            continue;
        };
        let Ok(policy) = file.compile("policy") else {
            continue;
        };
        let _ = policy.principal_by_credential("credential");
        for profile in policy.profiles.values() {
            for tool in policy.tools.values() {
                let _ = policy.denying_rule(profile, tool);
                let _ = policy.risk_of(&tool.name);
            }
        }
    }
}

/// The worker's profiles loader (`profiles::parse`, which validates every profile,
/// its playbook or planner included).
pub fn worker_profiles(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    let _ = convene_worker::profiles::parse(text, "profiles.yaml");
}
