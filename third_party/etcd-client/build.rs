//! punchclock's only change to etcd-client (scripts/vendor-etcd-client.sh):
//! the .proto files are compiled by protox, which bundles the well-known
//! types, instead of a system `protoc`; the generated code is the same.
#[cfg(feature = "build-server")]
fn should_build_server() -> bool {
    true
}

#[cfg(not(feature = "build-server"))]
fn should_build_server() -> bool {
    false
}

fn main() {
    let proto_root = "proto";
    println!("cargo:rerun-if-changed={proto_root}");

    let fds = protox::compile(
        [
            "etcd/api/authpb/auth.proto",
            "etcd/api/etcdserverpb/rpc.proto",
            "etcd/api/mvccpb/kv.proto",
            "etcd/server/etcdserver/api/v3election/v3electionpb/v3election.proto",
            "etcd/server/etcdserver/api/v3lock/v3lockpb/v3lock.proto",
        ],
        [proto_root],
    )
    .expect("Failed to compile proto files");
    tonic_prost_build::configure()
        .build_server(should_build_server())
        .compile_fds(fds)
        .expect("Failed to generate code from proto files");
}
