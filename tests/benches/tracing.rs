//! What tracing costs: the payment incident through an in-process mesh (`convene up`'s
//! code, reached over its gRPC listener like any client), run after run, with telemetry
//! off (no OpenTelemetry layer: convene's spans are disabled at their call sites) and on
//! (every span exported in batches over OTLP/gRPC to a receiver in this process).
//!
//! Two measurements of each setting, as criterion throughput (`elem/s` = runs/s):
//!
//! - `payment_incident`: wall-clock runs/s, one run at a time and 8 runs in flight;
//! - `payment_incident_cpu`: runs per CPU-second of this process (8 in flight), which is
//!   what tracing adds in work, independent of what the runs wait for (storage commits)
//!   and of other load on the machine.
//!
//! Run it with `cargo bench -p convene-tests --bench tracing`; it takes about two
//! minutes. Wall-clock results on a shared machine drift by more than tracing costs;
//! with `CONVENE_TRACING_RUNS=<off|on>:<N>` the binary instead runs N incidents in one
//! setting, for counting instructions under callgrind (see `count`).
//!
//! Each setting gets its own Tokio runtime whose threads have that setting's subscriber
//! as their default, so both live in one process without a global subscriber. The
//! receiver runs on a runtime of its own, but on the same cores and in the same process
//! (its decoding counts in the CPU measurement): a collector on another host would cost
//! the mesh less than it does here.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use convene_cli::up::{self, Mesh};
use convene_mesh::auth::request;
use convene_mesh::handles::{GrpcSupervisor, SupervisorHandle};
use convene_mesh::policy_file::dev_credential;
use convene_proto::v1::{self, run_event::Kind};
use convene_server::Shutdown;
use convene_telemetry::test_util::OtlpReceiver;
use convene_telemetry::{Settings, Telemetry};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use futures::StreamExt as _;
use tracing::level_filters::LevelFilter;

// The bench takes only the example's data and run spec from the tests' harness.
#[path = "../harness/mod.rs"]
#[allow(dead_code, unused_imports)]
mod harness;

const PRINCIPAL: &str = "oncall@acme";

/// The allocator the shipped binaries use: allocation is a large share of a run's CPU,
/// and of a span's, so the system allocator would misstate both.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

thread_local! {
    /// The benchmark's subscriber on each runtime thread.
    static SUBSCRIBER: RefCell<Option<tracing::subscriber::DefaultGuard>> =
        const { RefCell::new(None) };
}

/// One setting: a mesh on a runtime whose threads use `dispatch`.
struct Setup {
    runtime: tokio::runtime::Runtime,
    dispatch: tracing::Dispatch,
    mesh: Mesh,
    client: SupervisorHandle,
    credential: String,
    telemetry: Telemetry,
    next_key: AtomicU64,
    _dir: tempfile::TempDir,
}

impl Setup {
    fn new(name: &str, dispatch: tracing::Dispatch, telemetry: Telemetry) -> Self {
        let on_start = dispatch.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name(format!("bench-{name}"))
            .on_thread_start(move || {
                let guard = tracing::dispatcher::set_default(&on_start);
                SUBSCRIBER.with(|s| *s.borrow_mut() = Some(guard));
            })
            .on_thread_stop(|| SUBSCRIBER.with(|s| drop(s.borrow_mut().take())))
            .build()
            .expect("a runtime");
        let dir = tempfile::tempdir().expect("a temporary directory");
        let data = dir.path().to_owned();
        let (mesh, client, credential) = tracing::dispatcher::with_default(&dispatch, || {
            runtime.block_on(async {
                let mut args = up::UpArgs::defaults("127.0.0.1:0".parse().expect("address"));
                args.tools_data_dir = harness::example_data();
                let mesh = up::start(&args, &data, Shutdown::new())
                    .await
                    .expect("the in-process mesh starts");
                let client: SupervisorHandle = Arc::new(
                    GrpcSupervisor::connect(&format!("http://{}", mesh.addr)).expect("endpoint"),
                );
                let credential = dev_credential(&data.join("credentials"), PRINCIPAL)
                    .expect("the principal's credential");
                (mesh, client, credential)
            })
        });
        Self {
            runtime,
            dispatch,
            mesh,
            client,
            credential,
            telemetry,
            next_key: AtomicU64::new(0),
            _dir: dir,
        }
    }

    /// Runs `total` payment incidents, `in_flight` at a time, each from StartRun to its
    /// terminal event; returns the time they took, wall-clock or on the CPU.
    fn run(&self, total: u64, in_flight: u64, clock: Clock) -> Duration {
        tracing::dispatcher::with_default(&self.dispatch, || {
            self.runtime.block_on(async {
                // The CPU clock only when asked for: rustix reads it through the vDSO,
                // which valgrind (see `count`) does not provide.
                let (wall, cpu) = (Instant::now(), matches!(clock, Clock::Cpu).then(cpu_time));
                futures::stream::iter(0..total)
                    .for_each_concurrent(usize::try_from(in_flight).unwrap_or(1), |_| {
                        self.one_run()
                    })
                    .await;
                match clock {
                    Clock::Wall => wall.elapsed(),
                    Clock::Cpu => cpu_time().saturating_sub(cpu.unwrap_or_default()),
                }
            })
        })
    }

    async fn one_run(&self) {
        let mut spec = harness::example_spec();
        spec.idempotency_key = format!("bench-{}", self.next_key.fetch_add(1, Ordering::Relaxed));
        let run = self
            .client
            .start_run(request(
                v1::StartRunRequest {
                    spec: Some(spec),
                    wait: false,
                    ..Default::default()
                },
                &self.credential,
            ))
            .await
            .expect("StartRun")
            .into_inner()
            .run
            .expect("a run");
        let mut events = self
            .client
            .watch_run(request(
                v1::WatchRunRequest {
                    run_id: run.run_id,
                    after_sequence: 0,
                },
                &self.credential,
            ))
            .await
            .expect("WatchRun")
            .into_inner();
        while let Some(event) = events.next().await {
            let event = event.expect("an event").event.expect("event set");
            if let Some(Kind::Waiting(w)) = event.kind {
                assert_eq!(
                    w.state,
                    v1::RunState::WaitingInput as i32,
                    "the payment incident stops waiting for a person to settle its conflict"
                );
                break;
            }
        }
    }

    fn stop(self) {
        let Self {
            runtime,
            mesh,
            telemetry,
            dispatch,
            ..
        } = self;
        tracing::dispatcher::with_default(&dispatch, || {
            runtime.block_on(async {
                mesh.shutdown.trigger();
                let _ = mesh.stopped().await;
                telemetry.shutdown().await;
            });
        });
    }
}

/// What a measurement counts.
#[derive(Clone, Copy, Debug)]
enum Clock {
    /// Elapsed time.
    Wall,
    /// CPU time of this process, every thread.
    Cpu,
}

fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(
        u64::try_from(t.tv_sec).unwrap_or_default(),
        u32::try_from(t.tv_nsec).unwrap_or_default(),
    )
}

/// The measurements of one setting.
fn measure(c: &mut Criterion, setting: &str, setup: &Setup) {
    let mut group = c.benchmark_group("payment_incident");
    group
        .throughput(Throughput::Elements(1))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(12));
    for in_flight in [1, 8] {
        group.bench_with_input(
            BenchmarkId::new(setting, format!("{in_flight}_in_flight")),
            &in_flight,
            |b, &n| b.iter_custom(|runs| setup.run(runs, n, Clock::Wall)),
        );
    }
    group.finish();
    let mut group = c.benchmark_group("payment_incident_cpu");
    group
        .throughput(Throughput::Elements(1))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(6));
    group.bench_function(BenchmarkId::new(setting, "8_in_flight"), |b| {
        b.iter_custom(|runs| setup.run(runs, 8, Clock::Cpu));
    });
    group.finish();
}

fn quiet() -> Settings {
    Settings::default().with_default_log_level(LevelFilter::WARN)
}

/// The setting with export off. Build it before any exporting subscriber exists: while
/// none does, convene's span call sites are disabled for good, which is exactly the
/// production setting without a collector.
fn off() -> Setup {
    let (dispatch, telemetry) = convene_telemetry::dispatch("convene", &quiet());
    Setup::new("off", dispatch, telemetry)
}

/// The setting with export on, to a receiver on a runtime of its own (returned with it:
/// drop the receiver before the runtime).
fn on() -> (Setup, OtlpReceiver, tokio::runtime::Runtime) {
    let collector = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .thread_name("bench-collector")
        .build()
        .expect("a runtime");
    let receiver = collector.block_on(OtlpReceiver::start_counting());
    // The exporter's channel is driven by the collector's runtime.
    let (dispatch, telemetry) = {
        let _entered = collector.enter();
        convene_telemetry::dispatch("convene", &quiet().with_otlp_endpoint(receiver.endpoint()))
    };
    assert!(
        telemetry.exporting_to().is_some(),
        "the benchmark's exporter could not be built"
    );
    (Setup::new("on", dispatch, telemetry), receiver, collector)
}

fn bench(c: &mut Criterion) {
    {
        let off = off();
        measure(c, "tracing_off", &off);
        off.stop();
    }
    let (on, receiver, collector) = on();
    measure(c, "tracing_on", &on);
    on.stop();
    let received = receiver.received();
    assert!(received > 0, "the receiver got no spans: export is broken");
    println!("tracing on: {received} spans reached the OTLP receiver");
    drop(receiver);
    drop(collector);
}

/// `CONVENE_TRACING_RUNS=<off|on>:<N>`: instead of criterion's measurements, start one
/// setting's mesh, run N payment incidents (8 in flight) and stop. For counting
/// instructions, which wall-clock noise does not touch: run it under
/// `valgrind --tool=callgrind` for two values of N, and the difference of the totals
/// divided by the difference of the N is what one run costs (start-up cancels out).
fn count(spec: &str) {
    let (setting, runs) = spec
        .split_once(':')
        .and_then(|(s, n)| Some((s, n.parse::<u64>().ok()?)))
        .expect("CONVENE_TRACING_RUNS is <off|on>:<number of runs>, e.g. on:40");
    let spans = match setting {
        "off" => {
            let off = off();
            off.run(runs, 8, Clock::Wall);
            off.stop();
            0
        }
        "on" => {
            let (on, receiver, collector) = on();
            on.run(runs, 8, Clock::Wall);
            on.stop();
            let received = receiver.received();
            drop(receiver);
            drop(collector);
            received
        }
        other => panic!("CONVENE_TRACING_RUNS: unknown setting {other:?}; use off or on"),
    };
    println!("tracing {setting}: {runs} runs, {spans} spans exported");
}

criterion_group!(benches, bench);

fn main() {
    match std::env::var("CONVENE_TRACING_RUNS") {
        Ok(spec) => count(&spec),
        Err(_) => {
            benches();
            Criterion::default().configure_from_args().final_summary();
        }
    }
}
