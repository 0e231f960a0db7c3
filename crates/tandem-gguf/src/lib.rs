//! GGUF v2/v3 reader over a read-only memory map, with split shards and strict validation of
//! hostile input, and a writer.

mod ggml_type;

pub use ggml_type::{GgmlType, QK_K};
