//! Helpers for tests that run real servers on loopback sockets (feature `test-util`).

use std::{net::SocketAddr, time::Duration};

use tokio::{net::TcpListener, task::JoinHandle};
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::{GrpcServer, ServeError, Shutdown};

/// How long [`wait_ready`] waits for a server to report `SERVING`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Loopback ports handed out in this process, by [`pick_listener`] or [`free_port`].
static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// Records `port` as handed out; false if it was before.
fn hand_out(port: u16) -> bool {
    HANDED_OUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(port)
}

/// A listener on a free loopback port, never handed out before in this process.
///
/// # Panics
///
/// If no loopback port can be bound.
pub async fn pick_listener() -> TcpListener {
    loop {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .await
            .expect("bind a free loopback port");
        let port = listener.local_addr().expect("a bound address").port();
        if hand_out(port) {
            return listener;
        }
    }
}

/// A loopback port nobody listens on, never handed out before in this process, for a
/// server in another process to bind.
///
/// The port is free when it is picked, not reserved: the process binds it a moment later,
/// and binds it again when it restarts after a crash. Without the record, a test picking
/// a port in that moment could be given the same one, and its server would answer the
/// first test's calls (as `UNIMPLEMENTED`).
///
/// # Panics
///
/// If no loopback port can be bound.
pub fn free_port() -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free loopback port");
        if hand_out(port) {
            return port;
        }
    }
}

/// The `http://` URI of `addr`, as tonic clients want it.
pub fn endpoint(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A channel connected to `addr`.
///
/// # Panics
///
/// If the connection fails.
pub async fn connect(addr: SocketAddr) -> Channel {
    Channel::from_shared(endpoint(addr))
        .expect("a socket address is a valid URI")
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// Waits until the server at `addr` answers a health check for `""` with `SERVING`.
///
/// # Panics
///
/// If it does not within [`READY_TIMEOUT`].
pub async fn wait_ready(addr: SocketAddr) {
    let check = async {
        loop {
            let channel = Channel::from_shared(endpoint(addr))
                .expect("a socket address is a valid URI")
                .connect()
                .await;
            if let Ok(channel) = channel {
                let mut client = HealthClient::new(channel);
                let request = HealthCheckRequest {
                    service: String::new(),
                };
                if let Ok(response) = client.check(request).await
                    && response.into_inner().status == ServingStatus::Serving as i32
                {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(READY_TIMEOUT, check)
        .await
        .unwrap_or_else(|_| panic!("server at {addr} not SERVING within {READY_TIMEOUT:?}"));
}

/// A [`GrpcServer`] serving in a background task on a free loopback port.
///
/// Dropping it triggers its shutdown, so a failing test does not leave it running.
#[derive(Debug)]
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its shutdown handle.
    pub shutdown: Shutdown,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    /// Starts `server` and waits until it reports `SERVING`.
    ///
    /// # Panics
    ///
    /// If the server does not become ready (see [`wait_ready`]).
    pub async fn start(server: GrpcServer) -> Self {
        let started = Self::spawn(server).await;
        wait_ready(started.addr).await;
        started
    }

    /// Starts `server` without waiting for a health check, for a server that serves TLS
    /// (which [`wait_ready`]'s plaintext check cannot reach). Its port is bound before
    /// this returns, so a connection made at once waits for the server to accept it.
    pub async fn spawn(server: GrpcServer) -> Self {
        let listener = pick_listener().await;
        let addr = listener.local_addr().expect("listener has an address");
        let shutdown = Shutdown::new();
        let task = tokio::spawn(server.serve(listener, shutdown.clone()));
        Self {
            addr,
            shutdown,
            task: Some(task),
        }
    }

    /// A channel connected to the server.
    pub async fn channel(&self) -> Channel {
        connect(self.addr).await
    }

    /// Whether `serve` has returned.
    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Waits for `serve` to return (after [`Shutdown::trigger`]) and returns its result.
    ///
    /// # Panics
    ///
    /// If the serving task panicked or was already joined.
    pub async fn join(mut self) -> Result<(), ServeError> {
        self.task
            .take()
            .expect("the server task is joined once")
            .await
            .expect("the server task does not panic")
    }

    /// Triggers shutdown and waits for `serve` to return.
    ///
    /// # Panics
    ///
    /// As [`join`](Self::join).
    pub async fn stop(self) -> Result<(), ServeError> {
        self.shutdown.trigger();
        self.join().await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.trigger();
    }
}

/// Certificates made at test time (rcgen), for tests of TLS and of service identities
/// under mutual TLS: a CA for servers and one for clients, server certificates for
/// `localhost`, client certificates naming a service by its SPIFFE id
/// (`spiffe://convene.test/<service>`), their PEM files, and TLS channels that present
/// them.
pub mod pki {
    use std::net::SocketAddr;
    use std::path::{Path, PathBuf};

    use rcgen::string::Ia5String;
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType,
    };
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

    use crate::tls::ServerTls;

    /// The trust domain of the SPIFFE ids the certificates here carry.
    pub const TRUST_DOMAIN: &str = "convene.test";

    /// The SPIFFE id of `service` in [`TRUST_DOMAIN`]: `spiffe://convene.test/<service>`.
    pub fn spiffe_id(service: &str) -> String {
        format!("spiffe://{TRUST_DOMAIN}/{service}")
    }

    /// Writes `text` to `dir/name`; the file's path.
    ///
    /// # Panics
    ///
    /// If the file cannot be written.
    pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }

    /// A certificate and its private key, both PEM.
    #[derive(Debug, Clone)]
    pub struct TestCert {
        /// The certificate.
        pub cert: String,
        /// Its private key.
        pub key: String,
    }

    impl TestCert {
        /// The pair as a tonic identity, to present as a client.
        pub fn identity(&self) -> Identity {
            Identity::from_pem(&self.cert, &self.key)
        }

        /// Writes `dir/<stem>.crt` and `dir/<stem>.key`; their paths.
        pub fn write(&self, dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
            (
                write(dir, &format!("{stem}.crt"), &self.cert),
                write(dir, &format!("{stem}.key"), &self.key),
            )
        }
    }

    /// A certificate authority that signs certificates for tests.
    pub struct TestCa {
        issuer: CertifiedIssuer<'static, KeyPair>,
    }

    impl std::fmt::Debug for TestCa {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("TestCa").finish_non_exhaustive()
        }
    }

    impl TestCa {
        /// A new self-signed CA with `name` as its common name.
        ///
        /// # Panics
        ///
        /// If rcgen cannot make it.
        pub fn new(name: &str) -> Self {
            let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names");
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().expect("a key pair");
            Self {
                issuer: CertifiedIssuer::self_signed(params, key).expect("a CA certificate"),
            }
        }

        /// The CA's certificate, PEM.
        pub fn pem(&self) -> String {
            self.issuer.pem()
        }

        /// A certificate for the DNS names `dns` and the URI SANs `uris`.
        ///
        /// # Panics
        ///
        /// If a name is not valid in a certificate.
        pub fn leaf(&self, dns: &[&str], uris: &[&str]) -> TestCert {
            let mut params =
                CertificateParams::new(dns.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                    .expect("valid DNS names");
            for uri in uris {
                params.subject_alt_names.push(SanType::URI(
                    Ia5String::try_from(*uri).expect("an ASCII URI"),
                ));
            }
            let key = KeyPair::generate().expect("a key pair");
            let cert = params
                .signed_by(&key, &self.issuer)
                .expect("a signed certificate");
            TestCert {
                cert: cert.pem(),
                key: key.serialize_pem(),
            }
        }

        /// A certificate for `localhost` with no SPIFFE id (a server's, or a client's
        /// that names no service).
        pub fn localhost(&self) -> TestCert {
            self.leaf(&["localhost"], &[])
        }

        /// A certificate for `localhost` naming `service` by its SPIFFE id
        /// ([`spiffe_id`]).
        pub fn service(&self, service: &str) -> TestCert {
            self.leaf(&["localhost"], &[&spiffe_id(service)])
        }
    }

    /// The two CAs of a mesh under mutual TLS: servers' certificates are signed by
    /// `servers`, clients' by `clients`.
    #[derive(Debug)]
    pub struct TestPki {
        /// Signs the servers' certificates; clients verify servers against it.
        pub servers: TestCa,
        /// Signs the clients' certificates; servers under mutual TLS require them.
        pub clients: TestCa,
    }

    impl Default for TestPki {
        fn default() -> Self {
            Self::new()
        }
    }

    impl TestPki {
        /// Two new CAs.
        pub fn new() -> Self {
            Self {
                servers: TestCa::new("convene test servers"),
                clients: TestCa::new("convene test clients"),
            }
        }

        /// The TLS of a server presenting a `localhost` certificate of `servers`, its
        /// files written in `dir`; with `mutual`, it requires a client certificate of
        /// `clients` (as `--tls-client-ca` does).
        ///
        /// # Panics
        ///
        /// If the files cannot be written or loaded.
        pub fn server_tls(&self, dir: &Path, mutual: bool) -> ServerTls {
            let (cert, key) = self.servers.localhost().write(dir, "server");
            let client_ca = mutual.then(|| write(dir, "client-ca.crt", &self.clients.pem()));
            ServerTls::load(&cert, &key, client_ca.as_deref()).expect("usable server TLS files")
        }

        /// A channel to `addr` over TLS, verifying the server as `localhost` against
        /// `servers` and presenting `client` when given.
        ///
        /// # Errors
        ///
        /// The connection or the TLS handshake fails.
        ///
        /// # Panics
        ///
        /// If the client configuration is refused.
        pub async fn connect(
            &self,
            addr: SocketAddr,
            client: Option<&TestCert>,
        ) -> Result<Channel, tonic::transport::Error> {
            let mut tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(self.servers.pem()))
                .domain_name("localhost");
            if let Some(client) = client {
                tls = tls.identity(client.identity());
            }
            Endpoint::from_shared(format!("https://{addr}"))
                .expect("a socket address is a valid URI")
                .tls_config(tls)
                .expect("a valid client TLS configuration")
                .connect()
                .await
        }
    }
}
