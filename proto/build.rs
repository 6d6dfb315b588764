//! Generates the `fence.v1` types and stubs with `protox` (a pure-Rust protobuf compiler), so
//! building Fence never needs a system `protoc`.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=fence");
    let fds = protox::compile(["fence/v1/fence.proto"], ["."])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("fence_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Prost's codec, but a request that does not decode is INVALID_ARGUMENT (src/codec.rs).
        .codec_path("crate::codec::FenceCodec")
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
