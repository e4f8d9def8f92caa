//! Compiles `dtx/v1/*.proto` with protox (a pure-Rust protobuf compiler), so
//! building needs no system `protoc`. The compiled descriptor set is also
//! written to `$OUT_DIR/dtx_v1_descriptor.bin` for server reflection
//! (`dtx_proto::FILE_DESCRIPTOR_SET`).
use protox::prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "dtx/v1/coordinator.proto",
        "dtx/v1/participant.proto",
        "dtx/v1/raft.proto",
        "dtx/v1/admin.proto",
        "dtx/v1/saga.proto",
    ];
    println!("cargo:rerun-if-changed=build.rs");
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("dtx_v1_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
