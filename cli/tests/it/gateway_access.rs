//! The A2A gateway's own access check over real HTTP on `convene up`'s listener: an
//! HTTP+JSON route is classified as the binding routes it, after percent-decoding, so a
//! cancel spelled `%3Acancel` needs the role to cancel and is refused before the
//! binding sees it.

use reqwest::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use reqwest::{Client, Method, StatusCode};

use crate::mesh::{ALICE, Mesh, ONCALL};

fn client() -> Client {
    // The workspace's reqwest brings no crypto provider of its own.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Client::new()
}

fn credential(mesh: &Mesh, principal: &str) -> String {
    convene_mesh::policy_file::dev_credential(&mesh.data_dir().join("credentials"), principal)
        .expect("a development credential")
}

#[test]
fn a_percent_escaped_cancel_by_a_reader_is_refused_by_the_gateway() {
    let mesh = Mesh::start();
    // alice@acme reads runs (runs:read) and may not start or cancel them.
    let (reader, starter) = (credential(&mesh, ALICE), credential(&mesh, ONCALL));
    let task = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let call = |method: Method, path: String, credential: &str| {
            client()
                .request(method, format!("{}/a2a/rest{path}", mesh.a2a))
                .header(AUTHORIZATION, format!("Bearer {credential}"))
                .send()
        };
        for path in [
            format!("/tasks/{task}:cancel"),
            format!("/tasks/{task}%3Acancel"),
            format!("/tasks/{task}%3acancel"),
        ] {
            let refused = call(Method::POST, path.clone(), &reader).await.unwrap();
            assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{path}");
            let challenge = refused.headers()[WWW_AUTHENTICATE]
                .to_str()
                .unwrap()
                .to_owned();
            assert!(
                challenge.contains("insufficient_scope"),
                "{path}: {challenge}"
            );
            let body = refused.text().await.unwrap();
            assert!(
                body.contains("lacks the role to cancel tasks"),
                "the gateway's own refusal: {body}"
            );
            // A principal that may cancel passes the check; the binding then finds no
            // such task.
            let passed = call(Method::POST, path.clone(), &starter).await.unwrap();
            assert_eq!(passed.status(), StatusCode::NOT_FOUND, "{path}");
        }
        // `%2F` stays inside its segment, as the binding routes it: `ID/cancel` is one
        // task id, whose POST is no action the binding knows and whose GET finds none.
        for path in [
            format!("/tasks/{task}%2Fcancel"),
            format!("/tasks/{task}%2fcancel"),
        ] {
            for (method, credential) in [(Method::POST, &reader), (Method::GET, &reader)] {
                let answer = call(method.clone(), path.clone(), credential)
                    .await
                    .unwrap();
                assert!(
                    answer.status().is_client_error() && answer.status() != StatusCode::FORBIDDEN,
                    "{method} {path}: {}",
                    answer.status()
                );
            }
        }
        // Reading stays open to the reader.
        let read = call(Method::GET, format!("/tasks/{task}"), &reader)
            .await
            .unwrap();
        assert_eq!(read.status(), StatusCode::NOT_FOUND);
    });
}
