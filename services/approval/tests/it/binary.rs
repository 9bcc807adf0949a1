//! The `convene-approval` binary, black-box: its configuration layers, its first log
//! line on the development settings, and a clean exit on SIGTERM.

use std::{
    io::{BufRead as _, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

const BIN: &str = env!("CARGO_BIN_EXE_convene-approval");

/// The binary with no `CONVENE_*` variables inherited from the test's environment.
fn command() -> Command {
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars() {
        if name.starts_with("CONVENE_") {
            command.env_remove(name);
        }
    }
    command
}

/// Kills the child it holds when dropped, so a failing test leaves nothing running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        // Harmless if it has exited already.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn dump_config_shows_defaults_environment_and_flags() {
    let output = command()
        .arg("--dump-config")
        .output()
        .expect("run the binary");
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    for line in [
        "listen = \"127.0.0.1:7403\"",
        "data_dir = \"./.convene\"",
        "default_ttl = \"1h\"",
        "expiry_sweep_interval = \"1s\"",
        "executor = \"record-only\"",
        "dev_credentials = true",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }

    let output = command()
        .args(["--dump-config=yaml", "--default-ttl", "30m"])
        .env("CONVENE_DATA_DIR", "/srv/convene")
        .output()
        .expect("run the binary");
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(text.contains("data_dir: /srv/convene"), "{text}");
    assert!(text.contains("default_ttl: 30m"), "{text}");
}

#[test]
fn unknown_configuration_keys_are_refused() {
    let output = command()
        .arg("--dump-config")
        .env("CONVENE_DATA_DIRR", "/srv/convene")
        .output()
        .expect("run the binary");
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("CONVENE_DATA_DIRR"), "{stderr}");
}

#[test]
fn starts_on_the_development_settings_and_stops_on_sigterm() {
    let data = tempfile::tempdir().unwrap();
    let mut child = Running(
        command()
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data.path())
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start the binary"),
    );
    let stderr = child.0.stderr.take().unwrap();
    let (lines_tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    // First the warning that development credentials are generated, then what the
    // development settings are.
    let warning = lines
        .recv_timeout(Duration::from_secs(20))
        .expect("a first log line");
    assert!(warning.contains("DEVELOPMENT CREDENTIALS"), "{warning}");
    let first = lines
        .recv_timeout(Duration::from_secs(20))
        .expect("a second log line");
    assert!(
        first.contains(
            "no --config given: using the development settings of the payment-incident example"
        ),
        "{first}"
    );
    assert!(
        first.contains(&data.path().display().to_string()),
        "{first}"
    );
    // It is serving once it says so; the development credentials exist by then.
    let listening = std::iter::from_fn(|| lines.recv_timeout(Duration::from_secs(20)).ok())
        .find(|line| line.contains("gRPC server listening"));
    assert!(listening.is_some(), "the server never reported listening");
    assert!(data.path().join("credentials/alice@acme.secret").is_file());

    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("send SIGTERM");
    assert!(status.success());
    let exit = child.0.wait().expect("the binary exits");
    assert!(exit.success(), "{exit:?}");
}
