//! Deterministic identities.
//!
//! A delegation id is derived from (run id, parent delegation, round, call index), so a
//! restarted or recovering supervisor addresses the same child and never creates
//! another one.

use sha2::{Digest, Sha256};

/// The id of the delegation at `call_index` of `round`, under `parent` (the delegating
/// delegation for nested calls; `None` at the top level).
///
/// The id is `del-` followed by 24 hex digits of a SHA-256 over the inputs, so it is
/// stable across processes and versions and reveals nothing but equality.
pub fn delegation_id(run_id: &str, parent: Option<&str>, round: u32, call_index: u32) -> String {
    let mut h = Sha256::new();
    h.update(b"convene.delegation.v1\0");
    h.update(run_id.as_bytes());
    h.update(b"\0");
    h.update(parent.unwrap_or("").as_bytes());
    h.update(b"\0");
    h.update(round.to_be_bytes());
    h.update(call_index.to_be_bytes());
    let digest = h.finalize();
    format!("del-{}", hex::encode(&digest[..12]))
}

/// `sha256:<hex>` of `bytes`, the content-hash format used across convene.
pub fn content_hash(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delegation_ids_are_deterministic_and_distinct() {
        let a = delegation_id("run-1", None, 0, 0);
        assert_eq!(a, delegation_id("run-1", None, 0, 0));
        assert!(a.starts_with("del-") && a.len() == 28);
        let others = [
            delegation_id("run-2", None, 0, 0),
            delegation_id("run-1", None, 1, 0),
            delegation_id("run-1", None, 0, 1),
            delegation_id("run-1", Some(&a), 0, 0),
        ];
        for o in &others {
            assert_ne!(&a, o);
        }
    }

    #[test]
    fn content_hash_format() {
        assert_eq!(
            content_hash(b""),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
