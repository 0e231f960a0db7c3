//! Compiles proto/tandem/v1/*.proto with protox (a protobuf compiler in Rust: no protoc needed)
//! into tonic server and client code, plus the encoded descriptor set that reflection serves.

use prost::Message;
use std::path::PathBuf;

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("tandem/v1/inference.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = match protox::compile([&file], [&root]) {
        Ok(fds) => fds,
        Err(e) => {
            eprintln!("error: compiling {}: {e}", file.display());
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Err(e) = std::fs::write(out.join("tandem_v1_descriptor.bin"), fds.encode_to_vec()) {
        eprintln!("error: writing the descriptor set: {e}");
        std::process::exit(1);
    }
    if let Err(e) = tonic_prost_build::configure().codec_path("crate::codec::ProtoCodec").compile_fds(fds) {
        eprintln!("error: generating gRPC code: {e}");
        std::process::exit(1);
    }
}
