//! Model architectures and the forward pass, written once over the executor ([`Exec`]):
//! `deepseek2` (Kimi K2 / K2.5, DeepSeek V3 / R1; mainline MLA and legacy GGUFs), `llama` and
//! `qwen3moe`. Hyperparameters come from GGUF metadata, weights are bound by GGUF tensor name and
//! used in place from the memory map. The computation follows llama.cpp's graphs
//! (src/models/*.cpp, src/llama-graph.cpp) so logits agree with llama.cpp.

mod common;
mod config;
mod context;
mod cuda;
mod deepseek2;
pub mod demo;
mod device;
mod exec;
mod host;
mod kv_cache;
mod llama;
mod moe;
mod qwen3moe;
mod state;
mod weights;

pub use config::{Arch, RopeConfig};
pub use context::{Batch, Context, ContextParams, MlaMode, Model, PackReport, PackedSources, DEFAULT_MLA_CACHE_BYTES};
pub use exec::{Counts, DevId, Exec, Ledger, Tensor, CPU};
pub use kv_cache::{CacheType, KvCache};
pub use moe::route;
pub use state::fingerprint;
/// What the engine and its tests name of the file layer: models open through these.
pub use tandem_gguf::{guard, GgufModel, LoadOptions};
pub use weights::{Vector, Weight, WeightLoader};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] tandem_gguf::Error),
    #[error(transparent)]
    Quant(#[from] tandem_quant::Error),
    #[error(transparent)]
    Cpu(#[from] tandem_cpu::Error),
    #[error("unsupported architecture '{0}' (supported: deepseek2, llama, qwen3moe)")]
    UnsupportedArch(String),
    #[error("{0}")]
    Model(String),
    #[error("{0}")]
    Batch(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn model_err(msg: impl Into<String>) -> Error {
    Error::Model(msg.into())
}
