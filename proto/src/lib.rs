//! Generated code for the `fence.v1` gRPC API (`proto/fence/v1/fence.proto`), shared by the
//! server, the Rust client and the benchmarks. Nothing here is written by hand: the `.proto` file
//! is the contract and its comments are the documentation; [`codec`] is the one hand-written
//! part (how a body that does not decode is answered).

pub mod codec;

/// The `fence.v1` package: messages, enums, client and server stubs.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    tonic::include_proto!("fence.v1");
}

/// The encoded `FileDescriptorSet` of the API, for the gRPC reflection service.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("fence_descriptor");
