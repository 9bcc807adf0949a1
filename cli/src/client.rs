//! Where the CLI connects and who it is.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, bail};
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcSupervisor, SupervisorHandle};
use convene_mesh::policy_file::dev_credential_path;
use tonic::{Code, Status};

/// The endpoint `convene up` serves on by default.
pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:7400";
/// The data directory used when neither `--data-dir` nor `CONVENE_DATA_DIR` is given.
pub const DEFAULT_DATA_DIR: &str = ".convene";
/// File in the credentials directory naming the principal the CLI acts as by default.
pub const DEFAULT_PRINCIPAL_FILE: &str = "default-principal";

/// How the CLI reaches convene and as whom.
#[derive(Debug, Clone)]
pub struct Client {
    /// The gRPC endpoint (every service in `convene up`).
    pub endpoint: String,
    /// Endpoint of the approval service (the same in `convene up`).
    pub approval_endpoint: String,
    /// The bearer credential.
    pub credential: String,
    /// The principal the credential belongs to, when known.
    pub principal: String,
}

impl Client {
    /// Resolves the credential: `credential` if given; else the development credential
    /// of `as_principal` (or of the default principal `convene up` recorded) from
    /// `<data_dir>/credentials`.
    pub fn resolve(
        endpoint: String,
        approval_endpoint: Option<String>,
        data_dir: &Path,
        as_principal: Option<&str>,
        credential: Option<String>,
    ) -> anyhow::Result<Self> {
        let dir = data_dir.join("credentials");
        let principal = match as_principal {
            Some(p) => p.to_owned(),
            None => std::fs::read_to_string(dir.join(DEFAULT_PRINCIPAL_FILE))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default(),
        };
        let credential = match credential {
            Some(c) => c,
            None => {
                if principal.is_empty() {
                    bail!(
                        "no credential: pass --credential (or CONVENE_CREDENTIAL), or start `convene up` with data directory {} so it creates development credentials",
                        data_dir.display()
                    );
                }
                let path: PathBuf = dev_credential_path(&dir, &principal);
                std::fs::read_to_string(&path)
                    .with_context(|| {
                        format!(
                            "no credential for {principal} at {}: is this the data directory `convene up` uses (--data-dir / CONVENE_DATA_DIR)? Or pass --credential",
                            path.display()
                        )
                    })?
                    .trim()
                    .to_owned()
            }
        };
        Ok(Self {
            approval_endpoint: approval_endpoint.unwrap_or_else(|| endpoint.clone()),
            endpoint,
            credential,
            principal,
        })
    }

    /// The supervisor.
    pub fn supervisor(&self) -> anyhow::Result<SupervisorHandle> {
        Ok(Arc::new(GrpcSupervisor::connect(&self.endpoint)?))
    }

    /// The approval service.
    pub fn approval(&self) -> anyhow::Result<GrpcApproval> {
        Ok(GrpcApproval::connect(&self.approval_endpoint)?)
    }

    /// The evidence store.
    pub fn evidence(&self) -> anyhow::Result<GrpcEvidenceStore> {
        Ok(GrpcEvidenceStore::connect(&self.endpoint)?)
    }

    /// A request carrying the credential.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        convene_mesh::auth::request(message, &self.credential)
    }

    /// Turns a status into an error that says what to do.
    pub fn explain(&self, status: &Status) -> anyhow::Error {
        let msg = status.message();
        match status.code() {
            Code::Unavailable
                if msg.contains("connect")
                    || msg.contains("error trying")
                    || msg.contains("transport") =>
            {
                anyhow::anyhow!(
                    "cannot reach convene at {}: is `convene up` running? ({msg})",
                    self.endpoint
                )
            }
            Code::Unauthenticated => {
                anyhow::anyhow!("not authenticated{}: {msg}", self.acting_as())
            }
            Code::PermissionDenied => anyhow::anyhow!(
                "not permitted{}: {msg} (act as a principal that may, with --as PRINCIPAL)",
                self.acting_as()
            ),
            code => anyhow::anyhow!("{msg} ({code:?})"),
        }
    }

    /// ` as <principal>` when the principal is known, for messages.
    fn acting_as(&self) -> String {
        if self.principal.is_empty() {
            String::new()
        } else {
            format!(" as {}", self.principal)
        }
    }
}
