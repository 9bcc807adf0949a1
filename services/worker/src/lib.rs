//! A convene worker: serves worker profiles and runs the delegations the supervisor
//! sends it.
//!
//! A worker owns nothing global. For each delegation it runs a bounded agent loop
//! ([`agent`]) in which a model ([`provider`]; by default the deterministic
//! [`playbook`]) asks for tool calls; every call is authorized by the policy service and
//! its raw output is stored with its evidence record in the evidence store; the model's
//! final report becomes the [`v1::TaskResult`](convene_proto::v1::TaskResult) whose
//! claims cite that evidence ([`report`]). The worker registers its profiles and
//! capacity with the supervisor's worker registry and heartbeats ([`registration`]).
//!
//! - [`WorkerService`]: the `convene.v1.Worker` service and its in-process handle;
//!   its PlanTurn asks a planner profile's model for one turn of a run's planner.
//! - [`Config`], [`run`]: the standalone binary's configuration and main loop.
//! - [`profiles`]: the profiles file, and the registry that builds each profile's model
//!   provider by name; [`tools`]: the read-only tools, `delegate@1` (nested delegation
//!   through the supervisor) and the evidence-kind argument every tool takes.
//! - [`a2a`]: profiles served by a remote A2A 1.0 agent: the delegation goes to the
//!   agent, its artifacts become evidence and claims; the worker's `a2a` configuration
//!   says which agents (URL prefixes, non-public addresses) it may call.
//! - [`hold`]: the bench's `hold` (delegations wait for a release file), in every build.
//! - [`faults`]: fault injection for tests, only with the `test-faults` cargo feature
//!   (enabled by the test suites' dev-dependencies); a build without it refuses a
//!   profile that asks for a fault.
//!
//! The modules depend on each other in one direction: [`provider`] on none of them,
//! [`tools`] on [`provider`], [`report`] on [`provider`] and [`faults`], [`playbook`] on
//! those three, [`a2a`] on [`provider`], [`openai`] (its TLS set-up) and [`tools`],
//! [`profiles`] on [`playbook`], [`a2a`], [`provider`], [`faults`] and [`hold`], and
//! [`agent`] on [`profiles`], [`provider`], [`report`] and [`tools`].
#![forbid(unsafe_code)]

pub mod a2a;
pub mod agent;
pub mod config;
mod error;
pub mod faults;
pub mod guard;
pub mod hold;
pub mod model_server;
pub mod models;
pub mod openai;
mod planner;
pub mod playbook;
pub mod profiles;
pub mod provider;
pub mod registration;
pub mod registries;
pub mod report;
mod service;
pub mod tools;

use std::sync::Arc;

use convene_mesh::batch::{BatchingEvidence, BatchingPolicy};
use convene_mesh::handles::{
    EvidenceHandle, GrpcEvidenceStore, GrpcPolicy, GrpcSupervisor, PolicyHandle, RegistryHandle,
    SupervisorHandle,
};
use convene_server::{GrpcServer, Shutdown};

pub use config::Config;
pub use error::Error;
pub use registration::{Registrar, Registration};
pub use service::{RESULT_CACHE, RESULT_CACHE_BYTES, SetupError, WorkerOptions, WorkerService};

impl WorkerService {
    /// A worker as `config` describes it (profiles, tools, id, capacity), with the
    /// built-in model providers, calling the policy service and the evidence store
    /// through `policy` and `evidence`. `exit_process_on_fault` is for the standalone
    /// binary only (see [`WorkerOptions`]). Add the supervisor `delegate@1` calls with
    /// [`WorkerService::with_supervisor`].
    ///
    /// # Errors
    ///
    /// Invalid configuration or profiles, a missing tool data directory, or a profile
    /// naming an unknown provider or tool.
    pub fn from_config(
        config: &Config,
        policy: PolicyHandle,
        evidence: EvidenceHandle,
        exit_process_on_fault: bool,
    ) -> Result<Self, Error> {
        config.validate()?;
        let tools = config.tools()?;
        Self::from_config_with_tools(config, tools, policy, evidence, exit_process_on_fault)
    }

    /// Like [`from_config`](Self::from_config), with the tools built already: the
    /// built-in tools and the MCP tools mounted from `config.mcp`
    /// ([`Config::mount_tools`]), which `from_config` cannot mount.
    ///
    /// # Errors
    ///
    /// As [`from_config`](Self::from_config).
    pub fn from_config_with_tools(
        config: &Config,
        tools: tools::ToolRegistry,
        policy: PolicyHandle,
        evidence: EvidenceHandle,
        exit_process_on_fault: bool,
    ) -> Result<Self, Error> {
        config.validate()?;
        let mut profiles = config.load_profiles()?;
        if let Some(model) = config.model_override() {
            profiles::override_model(&mut profiles, &model);
        }
        let mut providers = profiles::ProviderRegistry::builtin(&config.models.client());
        providers.register_a2a(Arc::new(config.a2a.allowlist().map_err(Error::Config)?));
        let options = WorkerOptions {
            worker_id: config.worker_id.clone(),
            capacity: config.capacity,
            exit_process_on_fault,
            models: Arc::new(config.models.clone()),
            key_refresh: config.key_refresh,
        };
        Ok(Self::new(
            options, profiles, &providers, tools, policy, evidence,
        )?)
    }

    /// The registration this worker announces at `endpoint`.
    pub fn registration(&self, endpoint: String) -> Registration {
        Registration {
            worker_id: self.worker_id().to_owned(),
            endpoint,
            profiles: self.profiles(),
            capacity: self.capacity(),
        }
    }

    /// A registrar keeping this worker registered at `endpoint` in `registry`.
    pub fn registrar(
        &self,
        registry: RegistryHandle,
        credential: String,
        endpoint: String,
    ) -> Registrar {
        let this = self.clone();
        Registrar::new(
            registry,
            credential,
            self.registration(endpoint),
            Arc::new(move || this.in_flight()),
        )
    }
}

/// Runs a standalone worker until `shutdown` triggers: connects to the policy service,
/// the evidence store and the supervisor (for `delegate@1`, and its registry unless
/// `register` is off), serves `convene.v1.Worker` on `server.listen`, and deregisters on
/// the way out.
///
/// # Errors
///
/// Invalid configuration or profiles, a missing tool data directory or credential, an
/// address that cannot be bound, or a server failure.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<(), Error> {
    // Tool calls that arrive while one is on its way are authorized in one message.
    let policy: PolicyHandle = Arc::new(BatchingPolicy::new(
        Arc::new(GrpcPolicy::connect(&config.policy_endpoint)?),
        "worker",
        convene_mesh::batch::DEFAULT_SLOTS,
    ));
    // So are the outputs stored while one is on its way, each under its own token.
    let evidence: EvidenceHandle = Arc::new(BatchingEvidence::new(
        Arc::new(GrpcEvidenceStore::connect(&config.evidence_endpoint)?),
        "worker",
        convene_mesh::batch::DEFAULT_SLOTS,
    ));
    let supervisor: SupervisorHandle =
        Arc::new(GrpcSupervisor::connect(&config.supervisor_endpoint)?);
    // MCP tools are mounted before anything is served, as the policy service's tool
    // catalog declares them.
    let (tools, mcp) = config.mount_tools(&policy).await?;
    let worker = WorkerService::from_config_with_tools(&config, tools, policy, evidence, true)?
        .with_supervisor(supervisor);
    let listener = convene_server::bind(config.server.listen)
        .await
        .map_err(Error::Serve)?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::Serve(convene_server::ServeError::LocalAddr(e)))?;
    let endpoint = config.advertise_endpoint(bound);

    let registrar = if config.register {
        let credential = config.credential()?;
        let this = worker.clone();
        let advertised = endpoint.clone();
        let make: registries::MakeRegistrar = Arc::new(move |registry| {
            this.registrar(registry, credential.clone(), advertised.clone())
        });
        Some(tokio::spawn(registries::register_everywhere(
            config.registry_urls(),
            make,
            convene_mesh::resolve::dns(),
            convene_mesh::resolve::RESOLVE_INTERVAL,
            shutdown.clone(),
        )))
    } else {
        tracing::info!("registration is off: the supervisor must be told about this worker");
        None
    };
    tracing::info!(
        worker_id = %worker.worker_id(),
        %endpoint,
        profiles = ?worker.profiles().iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
        capacity = worker.capacity(),
        tools_data_dir = %config.tools_data_dir.display(),
        "worker ready"
    );
    let served = worker
        .add_to(GrpcServer::new(config.server.clone()))
        .serve(listener, shutdown.clone())
        .await;
    // A failed server must not leave the registrar heartbeating for a dead worker.
    shutdown.trigger();
    if let Some(registrar) = registrar
        && let Err(e) = registrar.await
    {
        tracing::warn!(error = %e, "the registrar task failed");
    }
    if let Some(mcp) = mcp {
        mcp.shutdown().await;
    }
    served.map_err(Error::from)
}
