//! Task tokens and the signing keys they are checked with.

use convene_proto::v1;
use convene_tokens::{Verifier, thumbprint};
use prost::Message;

use crate::fixtures;

/// Longest token text a target builds: longer than any token a verifier accepts, so the
/// length check is reached too.
const MAX_TOKEN_INPUT: usize = 16 * 1024;

/// A task token verified against a fixed key ring. The first byte says what the rest is:
///
/// - `0`: the token text itself;
/// - `1`: a claims payload, signed with the trusted key under a well-formed header;
/// - `2`: a header and a payload (split at the first newline), signed with the trusted
///   key, so the header parser is reached with any header.
///
/// A token that verifies has its audience and scopes read, and its claims signed again
/// must verify to the same claims.
pub fn task_token(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if rest.len() > MAX_TOKEN_INPUT {
        return;
    }
    let token = match mode % 3 {
        0 => match std::str::from_utf8(rest) {
            Ok(token) => token.to_owned(),
            Err(_) => return,
        },
        1 => fixtures::sign_raw(fixtures::header().as_bytes(), rest),
        _ => {
            let (header, payload) = match rest.iter().position(|&b| b == b'\n') {
                Some(i) => (&rest[..i], &rest[i + 1..]),
                None => (rest, &[][..]),
            };
            fixtures::sign_raw(header, payload)
        }
    };
    let now = fixtures::now();
    let Ok(claims) = fixtures::verifier().verify(&token, now) else {
        return;
    };
    let _ = claims.check_audience("worker:logs-investigator");
    let _ = claims.expiry();
    if let Ok(set) = claims.permissions() {
        let _ = set.check("logs:read", "service/payment-api", &Default::default());
    }
    let again = fixtures::signer()
        .sign(&claims)
        .unwrap_or_else(|e| panic!("verified claims cannot be signed again: {e}: {claims:?}"));
    match fixtures::verifier().verify(&again, now) {
        Ok(back) => assert_eq!(back, claims, "claims changed through signing again"),
        Err(e) => panic!("verified claims signed again do not verify: {e}: {claims:?}"),
    }
}

/// The public keys a service trusts, as `GetSigningKeys` returns them
/// (`GetSigningKeysResponse` bytes) to `Verifier::from_jwks`; a verifier built from them
/// then checks a token of the fixed key.
pub fn jwks(data: &[u8]) {
    if data.len() > crate::MAX_INPUT {
        return;
    }
    let Ok(response) = v1::GetSigningKeysResponse::decode(data) else {
        return;
    };
    for key in &response.keys {
        let _ = thumbprint(&key.x);
    }
    let Ok(verifier) = Verifier::from_jwks(&response.keys) else {
        return;
    };
    let _ = verifier.kids().count();
    let token = fixtures::sign_raw(
        fixtures::header().as_bytes(),
        serde_json::to_string(&fixtures::claims())
            .expect("claims serialize")
            .as_bytes(),
    );
    let _ = verifier.verify(&token, fixtures::now());
}
