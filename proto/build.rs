//! Generates the tonic/prost code for `punchclock.v1` and a file descriptor
//! set for gRPC reflection.
//!
//! The `.proto` files are compiled by `protox`, a protobuf compiler in Rust
//! that bundles the well-known types (`google/protobuf/timestamp.proto`,
//! `struct.proto`, ...): the build needs no `protoc` and no system include
//! files, so it cannot depend on what happens to be installed (a missing
//! `libprotobuf-dev` broke every fresh clone once: issue 18).
use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // Source info keeps the .proto comments on the generated items; the
    // imports make the descriptor set self-contained for reflection clients.
    let fds = protox::Compiler::new(["proto"])?
        .include_imports(true)
        .include_source_info(true)
        .open_files(["punchclock/v1/punchclock.proto"])?
        .file_descriptor_set();
    std::fs::write(out.join("punchclock_descriptor.bin"), fds.encode_to_vec())?;
    // `build_transport(false)`: the generated `XClient::connect(addr)`
    // constructor would clash with the `RunnerService.Connect` RPC; clients
    // build a `Channel` and call `XClient::new(channel)` instead.
    tonic_prost_build::configure().build_transport(false).compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
