//! Compiles proto/tandem/v1/*.proto with protox (a protobuf compiler in Rust: no protoc needed)
//! into tonic server and client code, plus the encoded descriptor set that reflection serves.

use prost::Message;
use std::path::PathBuf;

fn main() -> Result<(), String> {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("tandem/v1/inference.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root]).map_err(|e| format!("compiling {}: {e}", file.display()))?;
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("tandem_v1_descriptor.bin"), fds.encode_to_vec())
        .map_err(|e| format!("writing the descriptor set: {e}"))?;
    tonic_prost_build::configure()
        .codec_path("crate::codec::ProtoCodec")
        .compile_fds(fds)
        .map_err(|e| format!("generating gRPC code: {e}"))
}
