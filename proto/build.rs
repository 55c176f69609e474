//! Generates the tonic/prost code for `punchclock.v1` and a file descriptor
//! set for gRPC reflection. Needs `protoc` on PATH (or `PROTOC`).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // `build_transport(false)`: the generated `XClient::connect(addr)`
    // constructor would clash with the `RunnerService.Connect` RPC; clients
    // build a `Channel` and call `XClient::new(channel)` instead.
    tonic_prost_build::configure()
        .build_transport(false)
        .file_descriptor_set_path(out.join("punchclock_descriptor.bin"))
        .compile_protos(&["proto/punchclock/v1/punchclock.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
