//! Compiles the bank's own API (`proto/bank/v1/bank.proto`) with protox:
//! no system protoc, as for the coordinator's contract.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/bank/v1/bank.proto";
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
