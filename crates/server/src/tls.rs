//! TLS for every listener and every client of the mesh (rustls, with ring).
//!
//! - **Flags** ([`TlsArgs`], on every binary and on `convene up`): `--tls-cert FILE
//!   --tls-key FILE` serve TLS; `--tls-client-ca FILE` also requires client
//!   certificates signed by that CA (mutual TLS); `--tls-ca FILE` is the CA clients
//!   verify servers with; `--insecure` allows plaintext on an address other than
//!   loopback. Their environment twins (`CONVENE_TLS_CERT`, `CONVENE_TLS_KEY`,
//!   `CONVENE_TLS_CLIENT_CA`, `CONVENE_TLS_CA`, `CONVENE_INSECURE`) are read by the flags
//!   themselves, not by the config loader.
//! - **Servers** present the certificate through a resolver that reads the files again
//!   when they change (checked at most once a second, at a handshake), so a rotated
//!   Kubernetes Secret is picked up without a restart; a file that does not parse leaves
//!   the previous certificate in use, with a warning.
//! - **Clients** use TLS for `https://` endpoints, verifying the server against
//!   `--tls-ca`, and present `--tls-cert`/`--tls-key` as their own identity when given.
//! - **Plaintext** stays the default on loopback. A process asked to serve plaintext on
//!   any other address ([`check_listeners`]) refuses to start unless `--insecure`.
//!
//! A process installs its settings once ([`install`]); servers and channels that are not
//! given settings of their own use those.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How often a server looks at its certificate files for a change, at most.
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// How long a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS flags every binary takes.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate chain to serve TLS with (and to present as a client for mutual
    /// TLS); needs --tls-key. Reloaded when the file changes.
    #[arg(
        long,
        env = "CONVENE_TLS_CERT",
        value_name = "FILE",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(
        long,
        env = "CONVENE_TLS_KEY",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates that client certificates must chain to: with it, servers
    /// require a client certificate (mutual TLS). Needs --tls-cert.
    #[arg(
        long,
        env = "CONVENE_TLS_CLIENT_CA",
        value_name = "FILE",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// PEM CA certificates this process verifies the servers it calls with (https://
    /// endpoints).
    #[arg(long, env = "CONVENE_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Serve plaintext on an address other than loopback (e.g. 0.0.0.0). Without TLS
    /// such a listener is refused at start unless this is given; a warning is printed.
    #[arg(long, env = "CONVENE_INSECURE")]
    pub insecure: bool,
}

/// A TLS setting that cannot be used, naming the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("TLS {what} {path}: {detail}")]
pub struct TlsError {
    /// Which file it is (`certificate`, `key`, `client CA`, `CA`).
    pub what: &'static str,
    /// The file.
    pub path: String,
    /// What is wrong, and what to fix.
    pub detail: String,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError {
        what,
        path: path.display().to_string(),
        detail: format!("cannot read it: {e}"),
    })
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError {
            what,
            path: path.display().to_string(),
            detail: format!("not PEM certificates: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError {
            what,
            path: path.display().to_string(),
            detail: "holds no `-----BEGIN CERTIFICATE-----` block".to_owned(),
        });
    }
    Ok(certs)
}

fn roots(what: &'static str, path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates(what, path)? {
        roots.add(cert).map_err(|e| TlsError {
            what,
            path: path.display().to_string(),
            detail: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(roots)
}

/// The certificate and key files as one certified key.
fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates("certificate", cert)?;
    let pem = read("key", key)?;
    let der = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError {
        what: "key",
        path: key.display().to_string(),
        detail: format!("not a PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
    })?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| TlsError {
            what: "key",
            path: key.display().to_string(),
            detail: format!("unusable private key: {e}"),
        })?;
    let certified = CertifiedKey::new(chain, signing);
    certified.keys_match().map_err(|e| TlsError {
        what: "key",
        path: key.display().to_string(),
        detail: format!("does not belong to the certificate {}: {e}", cert.display()),
    })?;
    Ok(certified)
}

/// A file's modification time and length, to notice a change; None when unreadable.
type Stamp = Option<(SystemTime, u64)>;

/// The files' stamps.
fn stamp(paths: &[&Path]) -> Vec<Stamp> {
    paths
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| m.modified().ok().map(|t| (t, m.len())))
        })
        .collect()
}

/// Serves the certificate of two files, reading them again when they change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// When the files were last looked at, and what they were like then.
    seen: Mutex<(Instant, Vec<Stamp>)>,
}

impl ReloadingCert {
    /// Loads the certificate chain and key.
    ///
    /// # Errors
    ///
    /// A [`TlsError`] naming the file that cannot be read or used.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let seen = stamp(&[cert, key]);
        Ok(Self {
            current: RwLock::new(Arc::new(certified_key(cert, key)?)),
            seen: Mutex::new((Instant::now(), seen)),
            cert: cert.to_owned(),
            key: key.to_owned(),
        })
    }

    /// Reads the files again if they changed since the last look (at most once per
    /// [`RELOAD_CHECK_INTERVAL`]); keeps the current certificate if they do not load.
    fn refresh(&self) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.0.elapsed() < RELOAD_CHECK_INTERVAL {
            return;
        }
        seen.0 = Instant::now();
        let now = stamp(&[&self.cert, &self.key]);
        if now == seen.1 {
            return;
        }
        match certified_key(&self.cert, &self.key) {
            Ok(key) => {
                *self
                    .current
                    .write()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(key);
                seen.1 = now;
                tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
            }
            // A half-written pair (the certificate renewed, the key not yet) loads at a
            // later look.
            Err(e) => {
                tracing::warn!(error = %e, "TLS certificate changed but does not load; still serving the previous one")
            }
        }
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.refresh();
        Some(
            self.current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
    }
}

/// What a server needs to serve TLS.
#[derive(Debug, Clone)]
pub struct ServerTls {
    cert: Arc<ReloadingCert>,
    client_ca: Option<Arc<rustls::RootCertStore>>,
}

impl ServerTls {
    /// The certificate and key files, and the CA client certificates must chain to
    /// (mutual TLS) when given.
    ///
    /// # Errors
    ///
    /// A [`TlsError`] naming the file that cannot be read or used.
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Self, TlsError> {
        Ok(Self {
            cert: Arc::new(ReloadingCert::load(cert, key)?),
            client_ca: client_ca
                .map(|p| roots("client CA", p).map(Arc::new))
                .transpose()?,
        })
    }

    /// The same certificate, with clients required to present one that chains to
    /// `client_ca` (a listener of the process that only the mesh calls).
    ///
    /// # Errors
    ///
    /// A [`TlsError`] naming the file when it holds no usable CA certificate.
    pub fn with_client_ca(&self, client_ca: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert: self.cert.clone(),
            client_ca: Some(Arc::new(roots("client CA", client_ca)?)),
        })
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_certificates(&self) -> bool {
        self.client_ca.is_some()
    }

    /// A rustls server configuration offering `alpn` (e.g. `h2` for gRPC).
    ///
    /// # Panics
    ///
    /// Never for the ring provider's defaults.
    pub fn config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions");
        let builder = match &self.client_ca {
            Some(roots) => builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
                    .build()
                    .expect("a non-empty set of client CA roots"),
            ),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(self.cert.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

/// What a client needs to call `https://` endpoints.
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// PEM CA certificates servers are verified with.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM certificate chain and key presented to servers that ask (mutual TLS).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

/// A process's TLS settings, loaded from its flags.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// Set when the process serves TLS.
    pub server: Option<ServerTls>,
    /// Set when the process calls `https://` endpoints or presents a client identity.
    pub client: Option<ClientTls>,
    /// Plaintext is allowed on addresses other than loopback.
    pub insecure: bool,
}

impl Tls {
    /// Loads the files the flags name.
    ///
    /// # Errors
    ///
    /// A [`TlsError`] naming the file that cannot be read or used.
    pub fn load(args: &TlsArgs) -> Result<Self, TlsError> {
        let server = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => {
                Some(ServerTls::load(cert, key, args.tls_client_ca.as_deref())?)
            }
            _ => None,
        };
        let identity = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some((read("certificate", cert)?, read("key", key)?)),
            _ => None,
        };
        let ca_pem = args
            .tls_ca
            .as_deref()
            .map(|path| {
                roots("CA", path)?;
                read("CA", path)
            })
            .transpose()?;
        let client =
            (ca_pem.is_some() || identity.is_some()).then_some(ClientTls { ca_pem, identity });
        Ok(Self {
            server,
            client,
            insecure: args.insecure,
        })
    }
}

static INSTALLED: OnceLock<Tls> = OnceLock::new();

/// Makes `tls` the process's settings, for servers and channels given none of their own.
/// The first call wins; later ones are ignored (and return false).
pub fn install(tls: Tls) -> bool {
    INSTALLED.set(tls).is_ok()
}

/// The process's settings, if [`install`]ed.
pub fn installed() -> Option<&'static Tls> {
    INSTALLED.get()
}

/// Loads the files `args` names, checks `listeners` against them ([`check_listeners`])
/// and [`install`]s them for the process.
///
/// # Errors
///
/// The message to exit with (status 2): a file that cannot be used, or a plaintext
/// listener off loopback without `--insecure`. On success, the warnings to print.
pub fn prepare(args: &TlsArgs, listeners: &[(&str, SocketAddr)]) -> Result<Vec<String>, String> {
    let tls = Tls::load(args).map_err(|e| e.to_string())?;
    let warnings = check_listeners(listeners, tls.server.is_some(), tls.insecure)?;
    install(tls);
    Ok(warnings)
}

/// Checks that every plaintext listener of a process is on loopback, unless `insecure`.
/// Returns the warnings to print for plaintext listeners elsewhere that `insecure`
/// allows.
///
/// # Errors
///
/// The message to exit with: which listener, and what to pass.
pub fn check_listeners(
    listeners: &[(&str, SocketAddr)],
    tls: bool,
    insecure: bool,
) -> Result<Vec<String>, String> {
    let mut warnings = Vec::new();
    for (name, addr) in listeners {
        if tls || addr.ip().is_loopback() {
            continue;
        }
        if !insecure {
            return Err(format!(
                "{name} {addr} is not a loopback address and no TLS is configured: pass \
                 --tls-cert FILE --tls-key FILE (CONVENE_TLS_CERT, CONVENE_TLS_KEY) to serve \
                 TLS, or --insecure (CONVENE_INSECURE=true) to serve plaintext there anyway"
            ));
        }
        warnings.push(format!(
            "{name} {addr} serves plaintext on a non-loopback address (--insecure): \
             credentials and task tokens cross the network unencrypted"
        ));
    }
    Ok(warnings)
}

/// Accepts TCP connections on `listener` and completes their TLS handshakes (each in a
/// task of its own, so a slow client delays nobody), until the receiver is dropped.
/// Failed handshakes are logged and dropped.
pub fn incoming(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
) -> mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)> {
    let (tx, rx) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                () = tx.closed() => return,
            };
            let (tcp, peer) = match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = acceptor.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send((stream, peer)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    rx
}

/// An axum listener over [`incoming`]: HTTP over TLS.
#[derive(Debug)]
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// TLS on `listener` with `tls`, offering HTTP/1.1.
    ///
    /// # Errors
    ///
    /// When the listener's address cannot be read.
    pub fn new(listener: TcpListener, tls: &ServerTls) -> io::Result<Self> {
        let local = listener.local_addr()?;
        Ok(Self {
            rx: incoming(listener, tls.config(&[b"http/1.1"])),
            local,
        })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(accepted) => accepted,
            // The accept loop ended: nothing will come any more.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_off_loopback_needs_insecure_and_says_what_to_pass() {
        let any: SocketAddr = "0.0.0.0:7401".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:7401".parse().unwrap();
        let v6: SocketAddr = "[::]:7401".parse().unwrap();
        assert!(
            check_listeners(&[("gRPC", lo)], false, false)
                .unwrap()
                .is_empty()
        );
        let err = check_listeners(&[("gRPC", lo), ("gRPC", any)], false, false).unwrap_err();
        assert!(
            err.contains("0.0.0.0:7401") && err.contains("--insecure"),
            "{err}"
        );
        assert!(check_listeners(&[("HTTP", v6)], false, false).is_err());
        assert!(
            check_listeners(&[("gRPC", any)], true, false)
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            check_listeners(&[("gRPC", any)], false, true)
                .unwrap()
                .len(),
            1
        );
    }
}
