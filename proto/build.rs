//! Compiles `dtx/v1/*.proto` with protox (a pure-Rust protobuf compiler), so
//! building needs no system `protoc`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "dtx/v1/coordinator.proto",
        "dtx/v1/participant.proto",
        "dtx/v1/raft.proto",
        "dtx/v1/admin.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
