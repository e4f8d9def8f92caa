//! Compiles `proto/etcd_kv.proto` (the part of etcd's v3 API the bench uses)
//! with protox, a pure-Rust protobuf compiler, as proto/ does: building
//! needs no system `protoc`. Client stubs only.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/etcd_kv.proto");
    let fds = protox::compile(["etcd_kv.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
