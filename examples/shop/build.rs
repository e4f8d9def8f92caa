//! Compiles the shop's own APIs (`proto/shop/v1/shop.proto`) with protox:
//! no system protoc, as for the coordinator's contract.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/shop/v1/shop.proto";
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
