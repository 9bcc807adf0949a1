//! What every target holds fixed, so that one input always takes the same path: the
//! instant "now", the example policy and templates, and one signing key.

use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use convene_mesh::policy_file::{EXAMPLE_POLICY, EXAMPLE_POLICY_NAME, Policy, PolicyFile};
use convene_tokens::{Claims, Signer, SigningKey, Verifier};
use ed25519_dalek::Signer as _;

/// "Now" for every target: 2026-07-23T02:00:00Z, inside the example incident's window.
pub fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(NOW_UNIX)
}

/// [`now`] in Unix seconds.
pub const NOW_UNIX: u64 = 1_784_772_000;

/// The secret of the one key the targets sign and verify task tokens with.
const SECRET: [u8; 32] = [7; 32];

/// The compiled example policy (the one `convene up` embeds).
pub fn policy() -> &'static Policy {
    static POLICY: OnceLock<Policy> = OnceLock::new();
    POLICY.get_or_init(|| {
        PolicyFile::parse(EXAMPLE_POLICY, Some("yaml"), EXAMPLE_POLICY_NAME)
            .and_then(|file| file.compile(EXAMPLE_POLICY_NAME))
            .expect("the embedded example policy compiles")
    })
}

/// The example run templates, over the example policy.
pub fn templates() -> &'static convene_supervisor::Templates {
    static TEMPLATES: OnceLock<convene_supervisor::Templates> = OnceLock::new();
    TEMPLATES.get_or_init(|| {
        convene_supervisor::Templates::example(policy()).expect("the example templates load")
    })
}

/// The signing key of every token a target makes.
pub fn signing_key() -> SigningKey {
    SigningKey::from_secret_bytes(&SECRET)
}

/// A verifier trusting exactly [`signing_key`].
pub fn verifier() -> &'static Verifier {
    static VERIFIER: OnceLock<Verifier> = OnceLock::new();
    VERIFIER.get_or_init(|| Verifier::from_signing_keys([&signing_key()]))
}

/// The signer of [`signing_key`].
pub fn signer() -> &'static Signer {
    static SIGNER: OnceLock<Signer> = OnceLock::new();
    SIGNER.get_or_init(|| Signer::new(signing_key()))
}

/// A compact JWS over the exact `header` and `payload` bytes, signed with
/// [`signing_key`]: lets a target reach the header and claims parsers past the
/// signature check, which random bytes never pass.
pub fn sign_raw(header: &[u8], payload: &[u8]) -> String {
    let key = ed25519_dalek::SigningKey::from_bytes(&SECRET);
    let signed = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(payload)
    );
    let signature = key.sign(signed.as_bytes());
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.to_bytes()))
}

/// The header of a token signed with [`signing_key`], as `jsonwebtoken` writes it.
pub fn header() -> String {
    format!(
        r#"{{"typ":"JWT","alg":"EdDSA","kid":"{}"}}"#,
        signing_key().kid()
    )
}

/// Claims of a task token of the example's logs investigator, valid at [`now`].
pub fn claims() -> Claims {
    Claims {
        issuer: "convene-policy".into(),
        subject: "oncall@acme".into(),
        audience: vec![
            "worker:logs-investigator".into(),
            "convene-evidence-store".into(),
        ],
        issued_at: NOW_UNIX - 60,
        not_before: NOW_UNIX - 60,
        expires_at: NOW_UNIX + 900,
        token_id: "0190f0f0-0000-7000-8000-000000000001".into(),
        tenant: "acme-payments".into(),
        run_id: "run-1".into(),
        delegation_id: "del-1".into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        scopes: Vec::new(),
        tools: vec!["search_logs@1".into()],
        max_calls: 32,
        may_redelegate: false,
        parent_token_id: None,
        lease_epoch: 0,
    }
}
