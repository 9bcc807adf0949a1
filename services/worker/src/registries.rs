//! Staying registered with every supervisor replica.
//!
//! Each replica keeps its own registry of live workers, so a worker registers with all
//! of them: every URL of `registry_endpoints` whose host is a name (a headless Service
//! in a cluster) is resolved to every address, again every [`RESOLVE_INTERVAL`], and a
//! [`Registrar`] keeps the worker registered at each address. A replica that leaves the
//! name is deregistered from; one that joins is registered with. An IP literal or
//! `localhost` is one replica, used as given.
//!
//! [`RESOLVE_INTERVAL`]: convene_mesh::resolve::RESOLVE_INTERVAL

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use convene_mesh::handles::{GrpcWorkerRegistry, RegistryHandle};
use convene_mesh::resolve::{self, Followed, Resolver};
use convene_server::Shutdown;
use tokio::task::JoinHandle;

use crate::Registrar;

/// Makes the registrar for one registry endpoint URL.
pub type MakeRegistrar = Arc<dyn Fn(RegistryHandle) -> Registrar + Send + Sync>;

/// One registrar running against one replica.
struct Running {
    stop: Shutdown,
    task: JoinHandle<()>,
}

impl Running {
    fn start(url: &str, make: &MakeRegistrar) -> Option<Self> {
        let registry: RegistryHandle = match GrpcWorkerRegistry::connect(url) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::warn!(error = %e, "a registry endpoint cannot be used");
                return None;
            }
        };
        let stop = Shutdown::new();
        let task = tokio::spawn(make(registry).run(stop.clone()));
        Some(Self { stop, task })
    }

    /// Stops the registrar, which deregisters on its way out.
    async fn stop(self) {
        self.stop.trigger();
        let _ = self.task.await;
    }
}

/// Keeps the worker registered with every replica behind `urls` until `shutdown`
/// triggers, then deregisters from each.
pub async fn register_everywhere(
    urls: Vec<String>,
    make: MakeRegistrar,
    resolver: Resolver,
    every: Duration,
    shutdown: Shutdown,
) {
    // Replicas by the URL they are reached at.
    let mut running: BTreeMap<String, Running> = BTreeMap::new();
    let mut names: Vec<Followed> = Vec::new();
    for url in urls {
        match resolve::named(&url) {
            Some(name) => names.push(Followed::new(name)),
            None => {
                if let Some(r) = Running::start(&url, &make) {
                    running.insert(url, r);
                }
            }
        }
    }
    loop {
        let mut wait = every;
        for followed in &mut names {
            if let Some(diff) = followed
                .refresh(&resolver, "supervisor replicas to register with")
                .await
            {
                for addr in diff.removed {
                    if let Some(r) = running.remove(&followed.name.url_of(addr)) {
                        r.stop().await;
                    }
                }
                for addr in diff.added {
                    let url = followed.name.url_of(addr);
                    if let Some(r) = Running::start(&url, &make) {
                        running.insert(url, r);
                    }
                }
            }
            wait = wait.min(followed.next_in(every));
        }
        if names.is_empty() {
            shutdown.wait().await;
            break;
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = shutdown.wait() => break,
        }
    }
    futures::future::join_all(running.into_values().map(Running::stop)).await;
}
