//! Starting the mesh under test: in this process (`convene up`'s code) or as one
//! process per service and worker, the processes whose CPU and memory are measured,
//! and stopping it again.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use convene_server::Shutdown;
use serde::Serialize;

use super::{BenchArgs, Driver, Prepared, procs};
use crate::up;

/// Where the measured mesh runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum MeshMode {
    /// Every service in the bench's process.
    OneProcess,
    /// Every service and worker its own process.
    Processes,
    /// A mesh the bench did not start (--endpoint): no CPU or memory figures.
    Endpoint,
}

/// A process of the mesh whose CPU time and memory are reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// Its name in the report (`convene` in one process, else the service or worker).
    pub name: String,
    /// Its pid.
    pub pid: u32,
}

/// What a measured mesh is: where it runs, its processes (whose CPU time and peak RSS
/// are reported), and the bench's own pid when it is not one of them.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Where the mesh runs.
    pub mode: MeshMode,
    /// The mesh's processes.
    pub processes: Vec<Proc>,
    /// This process, when its client work is apart from the mesh.
    pub client: Option<u32>,
}

/// A mesh the bench started, stopped when the bench ends.
pub enum Started {
    /// Every service in this process.
    InProcess(up::Mesh),
    /// Every service and worker its own process.
    Processes(procs::ProcessMesh),
}

impl Started {
    /// Stops the mesh and waits for it.
    pub async fn stop(self) {
        match self {
            Started::InProcess(mesh) => {
                mesh.shutdown.trigger();
                if let Err(e) = mesh.stopped().await {
                    tracing::warn!(error = %format!("{e:#}"), "the mesh did not stop cleanly");
                }
            }
            Started::Processes(mesh) => mesh.stop(STOP_GRACE).await,
        }
    }
}

/// Time each mesh process gets to drain after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(15);

/// The default principal of the workloads' policy, whose runs the bench starts.
const PRINCIPAL: &str = "oncall@acme";

/// How the mesh is started: its files, workers and their capacity, and how many calls
/// each server takes at once (processes only).
pub(super) struct MeshPlan<'a> {
    pub(super) prepared: &'a Prepared,
    pub(super) dir: &'a Path,
    pub(super) capacity: u32,
    pub(super) concurrency_limit: Option<usize>,
    /// The supervisor's `max_active_runs`.
    pub(super) max_active_runs: usize,
}

/// Starts the mesh `args` asks for (in this process or as processes) and a driver of
/// its supervisor.
pub(super) async fn start_mesh(
    args: &BenchArgs,
    plan: &MeshPlan<'_>,
) -> anyhow::Result<(Driver, Measured, Started)> {
    let credentials = plan.dir.join("credentials");
    if args.processes {
        let options = procs::Options {
            bin: std::env::current_exe().context("cannot find the convene binary")?,
            data_dir: plan.dir.to_owned(),
            policy: plan.prepared.policy.clone(),
            profiles: plan.prepared.profiles.clone(),
            tools_data: plan.prepared.data.clone(),
            database_url: args.store_url(),
            workers: args.workers,
            capacity: plan.capacity,
            concurrency_limit: plan.concurrency_limit,
            max_active_runs: plan.max_active_runs,
            commit_linger: args.commit_linger,
        };
        let mesh = procs::ProcessMesh::start(&options).await?;
        let credential = convene_mesh::policy_file::dev_credential(&credentials, PRINCIPAL)
            .context("reading the bench principal's development credential")?;
        let driver = Driver::grpc(&mesh.supervisor_endpoint, credential)?;
        let measured = Measured {
            mode: MeshMode::Processes,
            processes: mesh
                .processes()
                .into_iter()
                .map(|(name, pid)| Proc { name, pid })
                .collect(),
            client: Some(std::process::id()),
        };
        Ok((driver, measured, Started::Processes(mesh)))
    } else {
        let mut up_args = up::UpArgs::defaults("127.0.0.1:0".parse()?);
        up_args.policy_file = Some(plan.prepared.policy.clone());
        up_args.profiles_file = Some(plan.prepared.profiles.clone());
        up_args.tools_data_dir = plan.prepared.data.clone();
        up_args.workers = args.workers;
        up_args.capacity = plan.capacity;
        up_args.database_url = args.store_url();
        up_args.default_principal = Some(PRINCIPAL.to_owned());
        up_args.commit_linger = args.commit_linger;
        up_args.max_active_runs = plan.max_active_runs;
        // The bench drives gRPC only.
        up_args.http_listen = convene_gateway::HttpListen(None);
        let mesh = up::start(&up_args, plan.dir, Shutdown::new()).await?;
        let credential = convene_mesh::policy_file::dev_credential(&credentials, PRINCIPAL)?;
        let driver = Driver {
            supervisor: Arc::new(mesh.supervisor.clone()),
            credential,
        };
        let measured = Measured {
            mode: MeshMode::OneProcess,
            processes: vec![Proc {
                name: "convene".to_owned(),
                pid: std::process::id(),
            }],
            client: None,
        };
        Ok((driver, measured, Started::InProcess(mesh)))
    }
}
