//! Placement planner: a pure function from a model's GGUF headers, the devices and their memory
//! budgets, and llama.cpp-style placement flags to a [`Plan`] — a device for every tensor and a
//! memory report per device (weights by category, KV cache, compute buffers, total vs budget).
//! No device code and no weight reads: a 1T-parameter model plans in milliseconds.
//!
//! ```no_run
//! use tandem_plan::{plan, GpuBudget, ModelInfo, PlanRequest, Rule};
//! let gguf = tandem_gguf::GgufModel::open("Kimi-K2.5-Q4_K_M-00001-of-00013.gguf", Default::default())?;
//! let model = ModelInfo::from_gguf(&gguf, "Kimi-K2.5-Q4_K_M-00001-of-00013.gguf")?;
//! let req = PlanRequest {
//!     gpus: GpuBudget::parse_all(&["CUDA0=96GiB"])?,
//!     rules: Rule::parse_overrides(&["exps=CPU"])?,
//!     n_gpu_layers: Some("999".parse().unwrap()),
//!     ..PlanRequest::default()
//! };
//! println!("{}", plan(&model, &req)?.to_text(false));
//! # Ok::<(), tandem_plan::Error>(())
//! ```

mod device;
mod error;
mod fit;
mod memory;
mod model;
mod planner;
pub mod quant_mix;
pub mod replica;
mod report;
mod rules;

pub use device::{human, in_unit, parse_size, unit_for, Device, GpuBudget, GpuLayers, GIB, KIB, MIB, TIB};
pub use error::{Error, Result};
pub use memory::{
    compute_bytes, kv_cells, kv_layer_bytes, mla_decompressed_bytes, parse_cache_type, KvConfig, Roles, ATTN_KV_CHUNK,
    KV_CACHE_TYPES, KV_PAD, MLA_REBUILT_MAX,
};
pub use model::{Attention, Hparams, ModelInfo, TensorEntry};
pub use planner::{ngl_devices, plan, PlanRequest, DEFAULT_FIT_MARGIN};
pub use report::{ByCategory, DeviceReport, HostReport, KvReport, Plan, TensorPlacement};
pub use rules::{Matcher, Rule};
