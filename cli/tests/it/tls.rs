//! TLS as a user meets it: plaintext off loopback refused at start unless `--insecure`,
//! and a mesh served over TLS that client commands reach with `--tls-ca` only, whose
//! console marks its session cookie Secure.

use std::process::Stdio;
use std::time::Duration;

use convene_server::test_util::free_port;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

use crate::support::{convene, wait_until};

#[test]
fn plaintext_off_loopback_is_refused_at_start_unless_insecure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let out = convene()
        .args([
            "up",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--http-listen",
            "off",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("CONVENE_INSECURE")
        .output()
        .expect("convene runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("0.0.0.0:{port}"))
            && stderr.contains("--insecure")
            && stderr.contains("--tls-cert"),
        "{stderr}"
    );

    // A service binary (here through `convene serve`) refuses the same way, the gateway's
    // HTTP listener too.
    let out = convene()
        .args([
            "serve",
            "policy",
            "--listen",
            &format!("0.0.0.0:{}", free_port()),
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("CONVENE_INSECURE")
        .output()
        .expect("convene runs");
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = convene()
        .args(["up", "--http-listen", &format!("0.0.0.0:{}", free_port())])
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(dir.path())
        .env_remove("CONVENE_INSECURE")
        .output()
        .expect("convene runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--http-listen"), "{stderr}");

    // With --insecure it starts, and says what it does.
    let mut up = convene()
        .args([
            "up",
            "--listen",
            &format!("0.0.0.0:{port}"),
            "--http-listen",
            "off",
            "--insecure",
        ])
        .arg("--data-dir")
        .arg(dir.path())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("convene up starts");
    wait_until("convene up to listen", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let _ = up.kill();
    let out = up.wait_with_output().expect("convene up stops");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("plaintext on a non-loopback address"),
        "{stderr}"
    );
}

#[test]
fn a_mesh_over_tls_is_reached_with_the_ca_and_refused_without_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca =
        CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("key")).expect("CA");
    let key = KeyPair::generate().expect("key");
    let cert = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("params")
        .signed_by(&key, &ca)
        .expect("certificate");
    let tls = dir.path().join("tls");
    std::fs::create_dir_all(&tls).expect("dir");
    std::fs::write(tls.join("tls.crt"), cert.pem()).expect("write");
    std::fs::write(tls.join("tls.key"), key.serialize_pem()).expect("write");
    std::fs::write(tls.join("ca.crt"), ca.pem()).expect("write");

    let port = free_port();
    let http = free_port();
    let data = dir.path().join("data");
    let mut up = convene()
        .args([
            "up",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http-listen",
            &format!("127.0.0.1:{http}"),
        ])
        .arg("--tls-cert")
        .arg(tls.join("tls.crt"))
        .arg("--tls-key")
        .arg(tls.join("tls.key"))
        .arg("--data-dir")
        .arg(&data)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .expect("convene up starts");
    wait_until("convene up to listen", Duration::from_secs(60), || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
            && std::net::TcpStream::connect(("127.0.0.1", http)).is_ok()
            && data.join("credentials/default-principal").exists()
    });
    let endpoint = format!("https://127.0.0.1:{port}");

    // The console over TLS: its session cookie is Secure as well.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let credential =
        convene_mesh::policy_file::dev_credential(&data.join("credentials"), "oncall@acme")
            .expect("a development credential");
    let set_cookie = tokio::runtime::Runtime::new()
        .expect("a runtime")
        .block_on(async {
            reqwest::Client::builder()
                .add_root_certificate(
                    reqwest::Certificate::from_pem(ca.pem().as_bytes()).expect("the CA"),
                )
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .expect("a client")
                .post(format!("https://localhost:{http}/console/sign-in"))
                .form(&[("credential", credential)])
                .send()
                .await
                .expect("the console answers over TLS")
                .headers()[reqwest::header::SET_COOKIE]
                .to_str()
                .expect("ASCII")
                .to_owned()
        });
    for flag in ["Secure", "HttpOnly", "SameSite=Strict"] {
        assert!(set_cookie.contains(flag), "{flag} in {set_cookie}");
    }
    let runs = |extra: &[&std::ffi::OsStr]| {
        convene()
            .args(["runs", "list", "--endpoint", &endpoint])
            .args(extra)
            .arg("--data-dir")
            .arg(&data)
            .output()
            .expect("convene runs")
    };
    let ok = runs(&["--tls-ca".as_ref(), tls.join("ca.crt").as_os_str()]);
    assert!(
        ok.status.success(),
        "over TLS with the CA: {}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let refused = runs(&[]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "without the CA it cannot verify the server"
    );
    assert!(stderr.contains("--tls-ca"), "{stderr}");
    // Plaintext to a TLS listener fails too.
    let plain = convene()
        .args([
            "runs",
            "list",
            "--endpoint",
            &format!("http://127.0.0.1:{port}"),
        ])
        .arg("--data-dir")
        .arg(&data)
        .output()
        .expect("convene runs");
    assert!(!plain.status.success());
    let _ = up.kill();
    let _ = up.wait();
}
