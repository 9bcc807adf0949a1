//! Decoding stored rows.

use convene_store::Row;

use crate::store::StoreError;

pub(super) fn decode<M: prost::Message + Default>(row: &Row, table: &str) -> Result<M, StoreError> {
    let bytes: Vec<u8> = row.get("body")?;
    M::decode(bytes.as_slice())
        .map_err(|e| StoreError::Backend(format!("a stored {table} record does not decode: {e}")))
}

pub(super) fn narrow<T: TryFrom<i64>>(v: i64, column: &str) -> Result<T, StoreError> {
    T::try_from(v).map_err(|_| StoreError::Backend(format!("{column} holds {v}, out of range")))
}

pub(super) fn ts_micros(ts: Option<&prost_types::Timestamp>) -> i64 {
    ts.map_or(0, |t| {
        t.seconds
            .saturating_mul(1_000_000)
            .saturating_add(i64::from(t.nanos) / 1_000)
    })
}
