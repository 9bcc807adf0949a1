//! The Agent Card: who the gateway is, where its two bindings are, how callers
//! authenticate, and one skill per run template.

use std::collections::HashMap;

use a2a::{
    AgentCapabilities, AgentCard, AgentInterface, AgentSkill, HttpAuthSecurityScheme,
    SecurityScheme, TRANSPORT_PROTOCOL_HTTP_JSON, TRANSPORT_PROTOCOL_JSONRPC,
};
use convene_supervisor::templates::Templates;

/// Where the JSON-RPC binding is served, below the public URL.
pub const JSONRPC_PATH: &str = "/a2a/jsonrpc";
/// Where the HTTP+JSON binding is served, below the public URL.
pub const REST_PATH: &str = "/a2a/rest";
/// The name of the card's security scheme.
pub const BEARER_SCHEME: &str = "bearer";
/// The tag of a skill whose runs only read.
pub const READ_ONLY_TAG: &str = "read-only";

/// The card for a gateway reachable at `base` (no trailing slash) offering `templates`.
pub fn agent_card(templates: &Templates, base: &str) -> AgentCard {
    let modes = vec!["text/plain".to_owned(), "application/json".to_owned()];
    let skills = templates
        .ids()
        .into_iter()
        .filter_map(|id| templates.get(id))
        .map(|t| {
            let mut tags: Vec<String> = t
                .tags
                .iter()
                .filter(|tag| tag.as_str() != READ_ONLY_TAG)
                .cloned()
                .collect();
            if t.read_only {
                tags.push(READ_ONLY_TAG.to_owned());
            }
            let inputs: Vec<String> = t
                .inputs
                .iter()
                .map(|i| {
                    let required = if i.required { ", required" } else { "" };
                    format!("{} ({}{required})", i.name, i.description)
                })
                .collect();
            AgentSkill {
                id: t.id.clone(),
                name: t.name.clone(),
                description: format!(
                    "{} Inputs: {}. Text parts become `note`; a data part's fields the other inputs. \
                     Name this skill with message metadata `skill`.",
                    t.description.trim(),
                    inputs.join("; ")
                ),
                tags,
                examples: None,
                input_modes: Some(modes.clone()),
                output_modes: Some(modes.clone()),
                security_requirements: None,
            }
        })
        .collect();
    AgentCard {
        name: "convene".to_owned(),
        description: "Supervised multi-agent runs: a supervisor fans bounded, evidence-backed \
                      delegations out to specialist workers under scoped task tokens, a \
                      deterministic join decides, and risky actions wait for human approval. \
                      Each skill is a run template; a task is one run."
            .to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        supported_interfaces: vec![
            AgentInterface::new(format!("{base}{JSONRPC_PATH}"), TRANSPORT_PROTOCOL_JSONRPC),
            AgentInterface::new(format!("{base}{REST_PATH}"), TRANSPORT_PROTOCOL_HTTP_JSON),
        ],
        capabilities: AgentCapabilities {
            streaming: Some(true),
            push_notifications: Some(false),
            extensions: None,
            extended_agent_card: Some(false),
        },
        default_input_modes: modes.clone(),
        default_output_modes: modes,
        skills,
        provider: None,
        documentation_url: None,
        icon_url: None,
        security_schemes: Some(HashMap::from([(
            BEARER_SCHEME.to_owned(),
            SecurityScheme::HttpAuth(HttpAuthSecurityScheme {
                scheme: "bearer".to_owned(),
                description: Some(
                    "A convene principal credential, as the gRPC API takes it \
                     (Authorization: Bearer <credential>)."
                        .to_owned(),
                ),
                bearer_format: None,
            }),
        )])),
        security_requirements: Some(vec![HashMap::from([(
            BEARER_SCHEME.to_owned(),
            Vec::new(),
        )])]),
        signatures: None,
    }
}

#[cfg(test)]
mod tests {
    use convene_mesh::policy_file::PolicySource;

    use super::*;

    #[test]
    fn the_example_template_is_a_read_only_skill_on_both_bindings() {
        let policy = PolicySource::new(None, None).load().expect("policy").0;
        let card = agent_card(
            &Templates::example(&policy).expect("templates"),
            "https://agents.example.com/convene",
        );
        let skill = &card.skills[0];
        assert_eq!(skill.id, "payment-incident-triage");
        assert_eq!(
            skill.tags.iter().filter(|t| *t == READ_ONLY_TAG).count(),
            1,
            "{:?}",
            skill.tags
        );
        let urls: Vec<&str> = card
            .supported_interfaces
            .iter()
            .map(|i| i.url.as_str())
            .collect();
        assert_eq!(
            urls,
            [
                "https://agents.example.com/convene/a2a/jsonrpc",
                "https://agents.example.com/convene/a2a/rest"
            ]
        );
        assert!(
            card.supported_interfaces
                .iter()
                .all(|i| i.protocol_version == "1.0")
        );
    }
}
