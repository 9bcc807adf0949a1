//! Signing and verifying a realistic task token (three scopes, two tools, a data scope).

use std::hint::black_box;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use convene_core::permissions::{DataConstraints, Permission, PermissionSet, TimeWindow};
use convene_tokens::{Claims, Signer, SigningKey, Verifier};
use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use ed25519_dalek::pkcs8::EncodePrivateKey as _;

fn claims() -> Claims {
    let window = TimeWindow {
        start: Some(UNIX_EPOCH + Duration::from_secs(1_784_768_700)),
        end: Some(UNIX_EPOCH + Duration::from_secs(1_784_770_200)),
    };
    let scopes = PermissionSet::from_permissions([
        Permission::new("logs:read", "service/*")
            .expect("pattern")
            .with_data(DataConstraints {
                time: window,
                max_rows: Some(50_000),
            }),
        Permission::new("metrics:read", "metric/payment.*").expect("pattern"),
        Permission::new("evidence:*", "evidence").expect("pattern"),
    ]);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    let mut c = Claims {
        issuer: "convene-policy".into(),
        subject: "oncall@acme".into(),
        audience: vec![
            "worker:logs-investigator".into(),
            "convene-evidence-store".into(),
        ],
        issued_at: now,
        not_before: now,
        expires_at: now + 900,
        token_id: convene_tokens::new_token_id(),
        tenant: "acme-payments".into(),
        run_id: "01a22aff-50be-713f-8f61-87af715a573c".into(),
        delegation_id: "del-6311c4329e999497688f7c25".into(),
        profile_id: "logs-investigator".into(),
        depth: 1,
        scopes: Vec::new(),
        tools: vec!["search_logs@1".into(), "query_metrics@1".into()],
        max_calls: 32,
        may_redelegate: false,
        parent_token_id: None,
        lease_epoch: 0,
    };
    c.set_permissions(&scopes);
    c
}

fn bench_tokens(c: &mut Criterion) {
    let secret = [7u8; 32];
    let key = SigningKey::from_secret_bytes(&secret);
    let verifier = Verifier::from_jwks(&[key.public_jwk()]).expect("a verifier");
    let kid = key.kid().to_owned();
    let signer = Signer::new(key);
    let claims = claims();
    let token = signer.sign(&claims).expect("signed");
    c.bench_function("token.sign", |b| {
        b.iter(|| black_box(signer.sign(black_box(&claims)).expect("signed")))
    });
    // A token signed elsewhere (another process) and seen for the first time: the full
    // check, signature included. Each iteration gets a token of its own, made by plain
    // jsonwebtoken outside the timing.
    let der = ed25519_dalek::SigningKey::from_bytes(&secret)
        .to_pkcs8_der()
        .expect("pkcs8");
    let encoding = jsonwebtoken::EncodingKey::from_ed_der(der.as_bytes());
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
    header.kid = Some(kid);
    c.bench_function("token.verify.first", |b| {
        b.iter_batched(
            || {
                let mut fresh = claims.clone();
                fresh.token_id = convene_tokens::new_token_id();
                jsonwebtoken::encode(&header, &fresh, &encoding).expect("encoded")
            },
            |token| black_box(verifier.verify(&token, SystemTime::now()).expect("valid")),
            BatchSize::SmallInput,
        )
    });
    // A token this process signed or checked before: the time checks only.
    c.bench_function("token.verify.again", |b| {
        b.iter(|| {
            black_box(
                verifier
                    .verify(black_box(&token), SystemTime::now())
                    .expect("valid"),
            )
        })
    });
}

criterion_group!(benches, bench_tokens);
criterion_main!(benches);
