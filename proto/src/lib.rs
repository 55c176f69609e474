//! Generated code for the `punchclock.v1` gRPC API (tonic + prost).
//!
//! The `.proto` source is `proto/punchclock/v1/punchclock.proto`; this crate
//! holds nothing but its generated types, clients and servers.

/// `punchclock.v1`: task, run, runner and cluster services.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("punchclock.v1");

    /// Encoded `FileDescriptorSet` of the API, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("punchclock_descriptor");
}

pub use v1::*;
