//! convene's protobuf contracts (`proto/convene/v1`), generated at build time.
//!
//! Messages are plain prost structs; services come as tonic clients
//! (`supervisor_client::SupervisorClient`, ...) and server traits
//! (`supervisor_server::Supervisor`, ...). [`FILE_DESCRIPTOR_SET`] serves gRPC reflection,
//! and [`json`] converts any message to and from the canonical protobuf JSON mapping.
#![forbid(unsafe_code)]

pub mod json;

/// The `convene.v1` package.
pub mod v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("convene.v1");
}

/// Encoded `FileDescriptorSet` of every convene proto file (plus its imports).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/convene_descriptor.bin"));
