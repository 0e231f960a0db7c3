//! GGUF v2/v3 reader over a read-only memory map, with split shards and strict validation of
//! hostile input, and a writer. Format: ggml/docs/gguf.md.
//!
//! ```no_run
//! use tandem_gguf::{GgufModel, LoadOptions};
//! let model = GgufModel::open("Kimi-K2-00001-of-00013.gguf", LoadOptions::default())?;
//! let n_layers = model.metadata().get_u32("deepseek2.block_count")?;
//! let w = model.tensor_data("blk.0.attn_q_a.weight")?; // zero-copy view
//! # Ok::<(), tandem_gguf::Error>(())
//! ```

mod error;
mod file;
mod ggml_type;
pub mod guard;
mod metadata;
mod model;
pub mod naming;
mod parse;
pub mod read_ahead;
mod value;
mod writer;

pub use error::{Error, Result};
pub use file::{GgufFile, LoadOptions};
pub use ggml_type::{GgmlType, QK_K};
pub use metadata::{parse_kv_override, Metadata};
pub use model::{
    parse_split_name, split_path, GgufModel, TensorRef, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT,
};
pub use naming::TensorCategory;
pub use parse::{
    TensorInfo, DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAX_ARRAY_NESTING, MAX_DIMS, MAX_KVS, MAX_NAME_LEN, MAX_STRING_LEN,
    MAX_TENSORS,
};
pub use value::{Array, Value, ValueType};
pub use writer::GgufWriter;
