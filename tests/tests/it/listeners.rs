//! The supervisor's two listeners, as its own process serves them (`convene serve
//! supervisor`): the client API (convene.v1.Supervisor) on `--listen`, the worker
//! registry (convene.v1.WorkerRegistry) on `--internal-listen` and nowhere else; with
//! TLS, `--internal-client-ca` makes the internal listener require client certificates
//! while the client API asks for none.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use convene_proto::v1::worker_registry_client::WorkerRegistryClient;
use convene_proto::v1::{self, supervisor_client::SupervisorClient};
use convene_server::test_util::free_port;
use convene_server::test_util::pki::{TestPki, write};
use tokio::process::{Child, Command};
use tonic::Code;
use tonic::transport::Channel;

use crate::harness::{convene_bin, wait_until};

/// `convene serve supervisor` on loopback ports of its own, in memory, with `args`.
fn supervisor(dir: &Path, args: &[&str]) -> (Command, SocketAddr, SocketAddr) {
    let client: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let internal: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut cmd = Command::new(convene_bin());
    cmd.args(["serve", "supervisor", "--listen", &client.to_string()])
        .args(["--internal-listen", &internal.to_string()])
        .args(args)
        .arg("--data-dir")
        .arg(dir)
        .env("CONVENE_DATABASE_URL", "memory")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    (cmd, client, internal)
}

/// Starts `cmd` and waits until both listeners accept connections.
async fn start(mut cmd: Command, addrs: [SocketAddr; 2]) -> Child {
    let mut child = cmd.spawn().expect("convene serve supervisor starts");
    wait_until(
        "the supervisor's two listeners",
        Duration::from_secs(30),
        async || {
            assert!(
                child.try_wait().expect("a status").is_none(),
                "the supervisor exited"
            );
            addrs
                .iter()
                .all(|a| std::net::TcpStream::connect(a).is_ok())
        },
    )
    .await;
    child
}

/// The status of a Register call (no credential) through `channel`.
async fn register(channel: Channel) -> tonic::Status {
    WorkerRegistryClient::new(channel)
        .register(v1::RegisterRequest::default())
        .await
        .expect_err("no credential, no registration")
}

/// The status of a ListRuns call (no credential) through `channel`.
async fn list_runs(channel: Channel) -> tonic::Status {
    SupervisorClient::new(channel)
        .list_runs(v1::ListRunsRequest::default())
        .await
        .expect_err("no credential, no runs")
}

#[tokio::test]
async fn workers_register_on_the_internal_listener_and_clients_call_the_other() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (cmd, client, internal) = supervisor(dir.path(), &[]);
    let _child = start(cmd, [client, internal]).await;
    let connect = |addr| convene_server::test_util::connect(addr);

    // The registry is served on the internal listener only: it answers there (and
    // refuses the missing credential), and the client listener does not know it.
    assert_eq!(
        register(connect(internal).await).await.code(),
        Code::Unauthenticated
    );
    assert_eq!(
        register(connect(client).await).await.code(),
        Code::Unimplemented
    );
    // The client API the other way round.
    assert_eq!(
        list_runs(connect(client).await).await.code(),
        Code::Unauthenticated
    );
    assert_eq!(
        list_runs(connect(internal).await).await.code(),
        Code::Unimplemented
    );
}

#[tokio::test]
async fn the_internal_listener_requires_client_certificates_of_its_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = TestPki::new();
    let (cert, key) = pki.servers.localhost().write(dir.path(), "server");
    let client_ca = write(dir.path(), "client-ca.crt", &pki.clients.pem());
    let (cmd, client, internal) = supervisor(
        &dir.path().join("data"),
        &[
            "--tls-cert",
            &cert.display().to_string(),
            "--tls-key",
            &key.display().to_string(),
            "--internal-client-ca",
            &client_ca.display().to_string(),
        ],
    );
    let _child = start(cmd, [client, internal]).await;

    // The client API serves TLS and asks for no certificate: the bearer decides.
    let channel = pki
        .connect(client, None)
        .await
        .expect("TLS without a certificate");
    assert_eq!(list_runs(channel).await.code(), Code::Unauthenticated);

    // The internal listener refuses a client without a certificate before any call
    // reaches the registry.
    match pki.connect(internal, None).await {
        Err(_) => {}
        Ok(channel) => {
            let status = register(channel).await;
            assert!(
                ![
                    Code::Unauthenticated,
                    Code::Unimplemented,
                    Code::PermissionDenied
                ]
                .contains(&status.code()),
                "a client without a certificate reached the registry: {status:?}"
            );
        }
    }
    // A worker's certificate of the client CA gets through to the registry, which then
    // asks for the credential.
    let worker = pki.clients.service("worker");
    let channel = pki
        .connect(internal, Some(&worker))
        .await
        .expect("a worker's certificate is accepted");
    assert_eq!(register(channel).await.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn an_internal_client_ca_without_tls_is_refused_saying_what_to_add() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = write(dir.path(), "ca.crt", &TestPki::new().clients.pem());
    let (mut cmd, _, _) = supervisor(
        &dir.path().join("data"),
        &["--internal-client-ca", &ca.display().to_string()],
    );
    let out = cmd
        .stderr(Stdio::piped())
        .output()
        .await
        .expect("convene serve supervisor runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("internal_client_ca") && stderr.contains("--tls-cert"),
        "{stderr}"
    );
}
