//! Where a policy comes from: a file or the embedded example ([`PolicySource`]), and the
//! development credentials of principals the file lists without one.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use super::{Error, Policy, PolicyFile};

impl Policy {
    /// Gives every principal that has no credential listed a development credential,
    /// created once in `dir` (`<dir>/<principal>.secret`, mode 0600) and reused after.
    /// Returns the principals that received one.
    pub fn with_dev_credentials(&mut self, dir: &Path) -> Result<Vec<String>, Error> {
        let io = |source: std::io::Error| Error::Read {
            path: dir.display().to_string(),
            source,
        };
        let listed: BTreeSet<&String> = self.credentials.values().collect();
        let missing: Vec<String> = self
            .principals
            .keys()
            .filter(|id| !listed.contains(id))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(missing);
        }
        std::fs::create_dir_all(dir).map_err(io)?;
        for id in &missing {
            let secret = dev_credential(dir, id).map_err(io)?;
            self.credentials
                .insert(credential_hash(&secret), id.clone());
        }
        Ok(missing)
    }
}

/// The policy of the payment-incident example, built into every binary so a service
/// runs from any directory without a policy file.
pub const EXAMPLE_POLICY: &str = include_str!("../../../../examples/payment-incident/policy.yaml");

/// How the embedded example policy is named in errors and logs.
pub const EXAMPLE_POLICY_NAME: &str = "<embedded payment-incident example policy>";

/// Where a service's policy comes from: a file, or the embedded example; and where the
/// principals without a listed credential get a development credential, if anywhere.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicySource {
    /// The policy file (YAML or TOML, by extension). `None`: [`EXAMPLE_POLICY`].
    pub file: Option<PathBuf>,
    /// Directory of development credentials (`<dir>/<principal>.secret`), created when
    /// needed. `None`: every principal needs a credential hash listed in the file.
    pub dev_credentials: Option<PathBuf>,
}

impl PolicySource {
    /// The policy in `file` (`None`: the embedded example), with development credentials
    /// in `dev_credentials` when given.
    pub fn new(file: Option<PathBuf>, dev_credentials: Option<PathBuf>) -> Self {
        Self {
            file,
            dev_credentials,
        }
    }

    /// How the policy is named in logs: the file's path, or [`EXAMPLE_POLICY_NAME`].
    pub fn name(&self) -> String {
        self.file.as_deref().map_or_else(
            || EXAMPLE_POLICY_NAME.to_owned(),
            |p| p.display().to_string(),
        )
    }

    /// Loads and compiles the policy, then gives the principals without a listed
    /// credential a development credential when [`dev_credentials`](Self::dev_credentials)
    /// names a directory, and says so in the log. Returns the policy and the principals
    /// that received one.
    ///
    /// # Errors
    ///
    /// The file cannot be read, does not parse or is invalid (each error names the file,
    /// and the field when there is one), or the credentials directory cannot be written.
    pub fn load(&self) -> Result<(Policy, Vec<String>), Error> {
        let mut policy = match &self.file {
            Some(path) => Policy::load(path)?,
            None => PolicyFile::parse(EXAMPLE_POLICY, Some("yaml"), EXAMPLE_POLICY_NAME)?
                .compile(EXAMPLE_POLICY_NAME)?,
        };
        let created = match &self.dev_credentials {
            Some(dir) => policy.with_dev_credentials(dir)?,
            None => Vec::new(),
        };
        if let (Some(dir), false) = (&self.dev_credentials, created.is_empty()) {
            tracing::info!(
                dir = %dir.display(),
                principals = ?created,
                "development credentials in use, one <principal>.secret file each"
            );
        }
        Ok((policy, created))
    }
}

/// Path of a principal's development credential in `dir`.
pub fn dev_credential_path(dir: &Path, principal: &str) -> std::path::PathBuf {
    let safe: String = principal
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "@._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{safe}.secret"))
}

/// Reads a principal's development credential from `dir`, creating it when absent.
pub fn dev_credential(dir: &Path, principal: &str) -> std::io::Result<String> {
    let path = dev_credential_path(dir, principal);
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let secret = format!(
        "cvn_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    );
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            options.mode(0o600);
        }
        let mut f = options.open(&tmp)?;
        std::io::Write::write_all(&mut f, secret.as_bytes())?;
        f.sync_all()?;
    }
    // Another process may have created it meanwhile: the first one wins.
    match std::fs::hard_link(&tmp, &path) {
        Ok(()) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(secret)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let _ = std::fs::remove_file(&tmp);
            Ok(std::fs::read_to_string(&path)?.trim().to_owned())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Hex SHA-256 of a credential, as stored in `credential_sha256`.
pub fn credential_hash(credential: &str) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(credential.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_source_loads_the_example_or_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let example = PolicySource::new(None, Some(dir.path().join("credentials")));
        assert_eq!(example.name(), EXAMPLE_POLICY_NAME);
        let (policy, created) = example.load().expect("the embedded example compiles");
        assert!(created.contains(&"oncall@acme".to_owned()), "{created:?}");
        let secret = dev_credential(&dir.path().join("credentials"), "oncall@acme").unwrap();
        assert_eq!(
            policy
                .principal_by_credential(&secret)
                .map(|p| p.id.as_str()),
            Some("oncall@acme")
        );

        let (_, created) = PolicySource::default().load().unwrap();
        assert!(
            created.is_empty(),
            "no directory, no development credentials"
        );

        let missing = PolicySource::new(Some(dir.path().join("absent.yaml")), None);
        assert!(missing.name().ends_with("absent.yaml"));
        let err = missing.load().unwrap_err().to_string();
        assert!(err.contains("absent.yaml"), "{err}");
    }
}
