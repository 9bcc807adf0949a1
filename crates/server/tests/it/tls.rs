//! TLS over real sockets, with certificates made at test time: a good chain works; a
//! wrong CA, an expired certificate and a missing client certificate (mutual TLS) are
//! refused with errors that say so; a certificate replaced on disk is served without a
//! restart.

use std::error::Error as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use convene_server::test_util::pick_listener;
use convene_server::tls::ServerTls;
use convene_server::{GrpcServer, ServerSettings, Shutdown};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

/// A CA that signs certificates for tests.
struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        Self {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A leaf certificate for `names` (and its key), valid now unless `expired`.
    fn leaf(&self, names: &[&str], expired: bool) -> (String, String) {
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .unwrap();
        if expired {
            params.not_before = rcgen::date_time_ymd(2001, 1, 1);
            params.not_after = rcgen::date_time_ymd(2002, 1, 1);
        }
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Writes `cert` and `key` into `dir` (replacing what is there): the files' paths.
fn write_pair(dir: &Path, (cert, key): &(String, String)) -> (PathBuf, PathBuf) {
    let (cert_file, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&key_file, key).unwrap();
    std::fs::write(&cert_file, cert).unwrap();
    (cert_file, key_file)
}

/// A TLS server of `tls` on loopback, with health only: its address and shutdown.
async fn serve(tls: ServerTls) -> (std::net::SocketAddr, Shutdown) {
    let listener = pick_listener().await;
    let addr = listener.local_addr().unwrap();
    let shutdown = Shutdown::new();
    tokio::spawn(
        GrpcServer::new(ServerSettings::default())
            .with_tls(tls)
            .serve(listener, shutdown.clone()),
    );
    (addr, shutdown)
}

/// One health check over TLS trusting `ca`, presenting `identity` if given.
async fn check(
    addr: std::net::SocketAddr,
    ca: &str,
    identity: Option<&(String, String)>,
) -> Result<(), String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel: Channel = Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| chain(&e))?;
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|_| ())
        .map_err(|s| {
            format!(
                "{}: {}",
                s.message(),
                s.source().map(chain).unwrap_or_default()
            )
        })
}

/// An error with its sources, as a person would read them.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[tokio::test]
async fn a_good_chain_works_and_a_wrong_ca_or_an_expired_certificate_is_refused() {
    let ca = Ca::new("convene test CA");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(dir.path(), &ca.leaf(&["localhost", "127.0.0.1"], false));
    let (addr, shutdown) = serve(ServerTls::load(&cert, &key, None).unwrap()).await;
    check(addr, &ca.pem(), None)
        .await
        .expect("a good chain works");

    let other = Ca::new("another CA");
    let err = check(addr, &other.pem(), None).await.unwrap_err();
    assert!(
        err.contains("UnknownIssuer") || err.contains("certificate"),
        "{err}"
    );
    shutdown.trigger();

    let expired_dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(expired_dir.path(), &ca.leaf(&["localhost"], true));
    let (addr, shutdown) = serve(ServerTls::load(&cert, &key, None).unwrap()).await;
    let err = check(addr, &ca.pem(), None).await.unwrap_err();
    assert!(
        err.contains("expired"),
        "an expired certificate is refused as such: {err}"
    );
    shutdown.trigger();
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_of_the_client_ca() {
    let ca = Ca::new("servers");
    let clients = Ca::new("clients");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(dir.path(), &ca.leaf(&["localhost"], false));
    let client_ca = dir.path().join("client-ca.crt");
    std::fs::write(&client_ca, clients.pem()).unwrap();
    let tls = ServerTls::load(&cert, &key, Some(&client_ca)).unwrap();
    assert!(tls.requires_client_certificates());
    let (addr, shutdown) = serve(tls).await;

    let worker = clients.leaf(&["spiffe://convene.test/worker"], false);
    check(addr, &ca.pem(), Some(&worker))
        .await
        .expect("a client certificate of the client CA is accepted");
    assert!(
        check(addr, &ca.pem(), None).await.is_err(),
        "no client certificate is refused"
    );
    let stranger = Ca::new("stranger").leaf(&["spiffe://convene.test/worker"], false);
    assert!(
        check(addr, &ca.pem(), Some(&stranger)).await.is_err(),
        "a client certificate of another CA is refused"
    );
    shutdown.trigger();
}

#[tokio::test]
async fn a_certificate_replaced_on_disk_is_served_without_a_restart() {
    let first = Ca::new("first");
    let second = Ca::new("second");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = write_pair(dir.path(), &first.leaf(&["localhost"], false));
    let (addr, shutdown) = serve(ServerTls::load(&cert, &key, None).unwrap()).await;
    check(addr, &first.pem(), None)
        .await
        .expect("the first certificate");

    // Rotation, as a Secret update does it: new files, same paths.
    write_pair(dir.path(), &second.leaf(&["localhost"], false));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match check(addr, &second.pem(), None).await {
            Ok(()) => break,
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the rotated certificate is not served: {e}"),
        }
    }
    assert!(
        check(addr, &first.pem(), None).await.is_err(),
        "the old certificate is no longer served"
    );
    shutdown.trigger();
}

#[test]
fn unusable_files_are_named_with_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.crt");
    let err = ServerTls::load(&missing, &missing, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope.crt") && err.contains("cannot read"),
        "{err}"
    );
    let junk = dir.path().join("junk.crt");
    std::fs::write(&junk, "not a certificate").unwrap();
    let err = ServerTls::load(&junk, &junk, None).unwrap_err().to_string();
    assert!(
        err.contains("junk.crt") && err.contains("CERTIFICATE"),
        "{err}"
    );
    let ca = Ca::new("ca");
    let (cert, _) = write_pair(dir.path(), &ca.leaf(&["localhost"], false));
    let (_, other_key) = ca.leaf(&["localhost"], false);
    let key = dir.path().join("other.key");
    std::fs::write(&key, other_key).unwrap();
    let err = ServerTls::load(&cert, &key, None).unwrap_err().to_string();
    assert!(err.contains("does not belong"), "{err}");
}
