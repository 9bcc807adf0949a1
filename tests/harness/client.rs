//! Talking to a mesh as a caller would: gRPC clients of its services, its database, and
//! the run calls the tests repeat (start a run, read it, wait for its end, its events).

use std::sync::Arc;
use std::time::Duration;

use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcApproval, GrpcEvidenceStore, GrpcSupervisor, SupervisorHandle};
use convene_proto::v1;

use super::{TestMesh, wait_for};

impl TestMesh {
    /// The in-process supervisor (InProcess mode only).
    pub fn supervisor_service(&self) -> &convene_supervisor::SupervisorService {
        &self
            .in_process
            .as_ref()
            .expect("InProcess mode")
            .1
            .supervisor
    }

    /// A gRPC client of the supervisor.
    pub fn supervisor(&self) -> SupervisorHandle {
        Arc::new(GrpcSupervisor::connect(&self.supervisor_endpoint).expect("endpoint"))
    }

    /// A gRPC client of the supervisor replica at `endpoint` (see
    /// [`spawn_supervisor`](Self::spawn_supervisor)).
    pub fn supervisor_at(&self, endpoint: &str) -> SupervisorHandle {
        Arc::new(GrpcSupervisor::connect(endpoint).expect("endpoint"))
    }

    /// The database the mesh's services share, opened for a test to read what they
    /// stored (the SQLite file in the data directory unless
    /// [`database_url`](Self::database_url) names another).
    pub async fn open_database(&self) -> convene_store::Database {
        convene_store::open(self.database_url(), &self.data_dir())
            .await
            .expect("the mesh's database opens")
            .expect("the mesh keeps its state in a database")
    }

    /// A gRPC client of the approval service.
    pub fn approval(&self) -> GrpcApproval {
        GrpcApproval::connect(&self.approval_endpoint).expect("endpoint")
    }

    /// A gRPC client of the evidence store.
    pub fn evidence(&self) -> GrpcEvidenceStore {
        GrpcEvidenceStore::connect(&self.evidence_endpoint).expect("endpoint")
    }

    /// Starts a run as `principal`.
    pub async fn start_run(
        &self,
        principal: &str,
        spec: v1::RunSpec,
    ) -> Result<v1::StartRunResponse, tonic::Status> {
        self.supervisor()
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait: false,
                    ..Default::default()
                },
                &self.credential(principal),
            ))
            .await
            .map(tonic::Response::into_inner)
    }

    /// Starts a run as `principal` and returns its id.
    ///
    /// # Panics
    ///
    /// When the supervisor refuses it.
    pub async fn start_run_id(&self, principal: &str, spec: v1::RunSpec) -> String {
        self.start_run(principal, spec)
            .await
            .expect("StartRun")
            .run
            .expect("a run")
            .run_id
    }

    /// The run, as `principal` sees it.
    pub async fn get_run(&self, principal: &str, run_id: &str) -> v1::Run {
        self.supervisor()
            .get_run(request(
                v1::GetRunRequest {
                    run_id: run_id.to_owned(),
                },
                &self.credential(principal),
            ))
            .await
            .expect("GetRun")
            .into_inner()
            .run
            .expect("a run")
    }

    /// Waits until the run is terminal (at most `limit`) and returns it.
    pub async fn wait_terminal(&self, principal: &str, run_id: &str, limit: Duration) -> v1::Run {
        wait_for(&format!("run {run_id} to end"), limit, async || {
            let run = self.get_run(principal, run_id).await;
            if convene_supervisor::store::is_terminal(run.state) {
                Ok(run)
            } else {
                Err(run)
            }
        })
        .await
    }

    /// Every event of a run, in order (after it ended).
    pub async fn run_events(&self, principal: &str, run_id: &str) -> Vec<v1::RunEvent> {
        use futures::StreamExt as _;
        let mut stream = self
            .supervisor()
            .watch_run(request(
                v1::WatchRunRequest {
                    run_id: run_id.to_owned(),
                    after_sequence: 0,
                },
                &self.credential(principal),
            ))
            .await
            .expect("WatchRun")
            .into_inner();
        let mut events = Vec::new();
        while let Some(e) = stream.next().await {
            events.push(e.expect("an event").event.expect("event set"));
        }
        events
    }
}
