//! Hyperparameters shared by the architectures, read from GGUF metadata as llama.cpp reads them
//! (src/llama-model.cpp `load_hparams`, src/llama-context.cpp for the YaRN attention factor).

use crate::weights::WeightLoader;
use crate::{model_err, Result};
use tandem_cpu::{RopeParams, RopeStyle};
use tandem_gguf::Metadata;

/// The architectures tandem runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Deepseek2,
    Qwen3Moe,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "deepseek2" => Ok(Arch::Deepseek2),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            other => Err(crate::Error::UnsupportedArch(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Deepseek2 => "deepseek2",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }
}

/// Bounds of hyperparameters (`Keys::count`): far above any real model (Kimi K2: 7168 wide, 64
/// heads of 192, 384 experts of 2048), far below what would overflow or exhaust memory when
/// multiplied together.
pub(crate) const MAX_WIDTH: usize = 1 << 20;
pub(crate) const MAX_HEADS: usize = 1 << 12;
pub(crate) const MAX_HEAD_DIM: usize = 1 << 12;
pub(crate) const MAX_EXPERTS: usize = 1 << 16;
pub(crate) const MAX_CTX: usize = 1 << 30;

/// Reads `{arch}.KEY` keys.
pub(crate) struct Keys<'a> {
    pub md: &'a Metadata,
    pub arch: &'static str,
}

impl Keys<'_> {
    pub fn k(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }
    pub fn u32(&self, key: &str) -> Result<usize> {
        Ok(self.md.get_u32(&self.k(key))? as usize)
    }
    pub fn opt_u32(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.md.opt_u32(&self.k(key))?.map(|v| v as usize))
    }
    /// A float hyperparameter: every one of them must be a finite number.
    pub fn f32(&self, key: &str) -> Result<f32> {
        self.finite(key, self.md.get_f32(&self.k(key))?)
    }
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.md.opt_f32(&self.k(key))?.map(|v| self.finite(key, v)).transpose()
    }
    fn finite(&self, key: &str, v: f32) -> Result<f32> {
        if v.is_finite() {
            Ok(v)
        } else {
            Err(model_err(format!("{} = {v}: not a finite number", self.k(key))))
        }
    }
    /// A count or size that must lie in `min..=max`: the bounds no real model comes near, so a
    /// corrupt value is refused before anything is sized from it.
    pub fn count(&self, key: &str, min: usize, max: usize) -> Result<usize> {
        let v = self.u32(key)?;
        self.in_range(key, v, min, max)
    }
    pub fn opt_count(&self, key: &str, min: usize, max: usize) -> Result<Option<usize>> {
        self.opt_u32(key)?.map(|v| self.in_range(key, v, min, max)).transpose()
    }
    pub fn in_range(&self, key: &str, v: usize, min: usize, max: usize) -> Result<usize> {
        if (min..=max).contains(&v) {
            Ok(v)
        } else {
            Err(model_err(format!("{} = {v}: must be between {min} and {max}", self.k(key))))
        }
    }
    /// `block_count`: at least one layer, and no more than the file has tensors for (`blk.N.`).
    pub fn block_count(&self, l: &WeightLoader) -> Result<usize> {
        let in_file = l
            .gguf()
            .tensors()
            .filter_map(|t| t.info.name.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |m| m + 1);
        let n = self.u32("block_count")?;
        if n == 0 || n > in_file {
            return Err(model_err(format!(
                "{} = {n}: the file has tensors for {in_file} layers (blk.0 .. blk.{})",
                self.k("block_count"),
                in_file.saturating_sub(1)
            )));
        }
        Ok(n)
    }
    /// `(n_head, n_head_kv, head_dim)` of grouped-query attention: KV heads that divide the heads,
    /// the head size `key_length` or `n_embd / n_head`.
    pub fn gqa_heads(&self, n_embd: usize) -> Result<(usize, usize, usize)> {
        let n_head = self.count("attention.head_count", 1, MAX_HEADS)?;
        let n_head_kv = match self.uniform_u32("attention.head_count_kv")? {
            Some(n) => self.in_range("attention.head_count_kv", n, 1, n_head)?,
            None => n_head,
        };
        if !n_head.is_multiple_of(n_head_kv) {
            return Err(model_err(format!(
                "{} = {n_head_kv}: must divide the {n_head} heads",
                self.k("attention.head_count_kv")
            )));
        }
        let head_dim = match self.opt_u32("attention.key_length")? {
            Some(d) => d,
            None => n_embd / n_head,
        };
        let head_dim = self.in_range("attention.key_length", head_dim, 1, MAX_HEAD_DIM)?;
        Ok((n_head, n_head_kv, head_dim))
    }
    /// `layer_norm_rms_epsilon`: finite and positive.
    pub fn eps(&self) -> Result<f32> {
        let key = "attention.layer_norm_rms_epsilon";
        let eps = self.f32(key)?;
        if eps > 0.0 && eps < 1.0 {
            Ok(eps)
        } else {
            Err(model_err(format!("{} = {eps}: must be above 0 and below 1", self.k(key))))
        }
    }
    /// `rope.dimension_count` of a head of `head_dim` values: even and at most the head.
    pub fn rope_dims(&self, head_dim: usize) -> Result<usize> {
        let key = "rope.dimension_count";
        let n_rot = self.opt_u32(key)?.unwrap_or(head_dim);
        if n_rot % 2 != 0 || n_rot > head_dim {
            return Err(model_err(format!(
                "{} = {n_rot}: must be even and at most the head size {head_dim}",
                self.k(key)
            )));
        }
        Ok(n_rot)
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        Ok(self.md.opt_bool(&self.k(key))?)
    }
    /// A per-model value that llama.cpp also accepts as a per-layer array; all layers must agree.
    pub fn uniform_u32(&self, key: &str) -> Result<Option<usize>> {
        let k = self.k(key);
        if !self.md.contains(&k) {
            return Ok(None);
        }
        let v = self.md.get_u32_list(&k)?;
        match v.first() {
            Some(&first) if v.iter().all(|&x| x == first) => Ok(Some(first as usize)),
            _ => Err(model_err(format!("{k}: per-layer values that differ are not supported yet"))),
        }
    }
}

/// Rotary embedding of an architecture, with YaRN applied as llama.cpp applies it.
#[derive(Clone, Debug)]
pub struct RopeConfig {
    pub params: RopeParams,
    /// `rope_yarn_log_mul` after llama.cpp's deepseek2 fix-up (the converter's 0.1 cancelled).
    pub yarn_log_mul: f32,
    /// Per-pair frequency divisors (`rope_freqs.weight`, llama 3).
    pub freq_factors: Option<Vec<f32>>,
}

fn get_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeConfig {
    pub(crate) fn load(
        keys: &Keys,
        arch: Arch,
        n_rot: usize,
        style: RopeStyle,
        n_ctx_train: usize,
    ) -> Result<RopeConfig> {
        let freq_base = keys.opt_f32("rope.freq_base")?.unwrap_or(10000.0);
        if freq_base <= 0.0 {
            return Err(model_err(format!("{} = {freq_base}: must be above 0", keys.k("rope.freq_base"))));
        }
        let scaling = keys.md.opt_str(&keys.k("rope.scaling.type"))?.unwrap_or("linear").to_string();
        let factor = match keys.opt_f32("rope.scaling.factor")? {
            Some(f) => f,
            None => keys.opt_f32("rope.scale_linear")?.unwrap_or(0.0),
        };
        if factor < 0.0 {
            return Err(model_err(format!("{} = {factor}: must not be negative", keys.k("rope.scaling.factor"))));
        }
        let mut freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
        let yarn = match scaling.as_str() {
            "none" => {
                freq_scale = 1.0;
                false
            }
            "linear" => false,
            "yarn" => true,
            other => {
                return Err(model_err(format!(
                    "{}: rope scaling '{other}' is not supported yet",
                    keys.k("rope.scaling.type")
                )))
            }
        };
        let n_ctx_orig = keys.opt_count("rope.scaling.original_context_length", 1, MAX_CTX)?.unwrap_or(n_ctx_train);
        let rope_attn_factor = keys.opt_f32("rope.scaling.attn_factor")?.unwrap_or(1.0);
        let mut yarn_log_mul = keys.opt_f32("rope.scaling.yarn_log_multiplier")?.unwrap_or(0.0);
        if arch == Arch::Deepseek2 && keys.md.contains(&keys.k("rope.scaling.yarn_log_multiplier")) {
            // [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: llama.cpp cancels the converter's factor of 0.1.
            yarn_log_mul /= 0.1;
        }
        let ext_factor = if yarn { 1.0f32 } else { 0.0 };
        let mut attn_factor = 1.0f32;
        if ext_factor != 0.0 {
            let factor = 1.0 / freq_scale;
            attn_factor = if yarn_log_mul != 0.0 {
                let mscale_all_dims = yarn_log_mul;
                let mscale = if arch == Arch::Deepseek2 && mscale_all_dims != 1.0 { mscale_all_dims } else { 1.0 };
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dims)
            } else {
                get_mscale(factor, 1.0)
            };
            // Cancels the magnitude correction ggml's rope applies with YaRN.
            attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
        }
        attn_factor *= rope_attn_factor;
        Ok(RopeConfig {
            params: RopeParams {
                n_dims: n_rot,
                style,
                freq_base,
                freq_scale,
                ext_factor,
                attn_factor,
                beta_fast: 32.0,
                beta_slow: 1.0,
                n_ctx_orig: n_ctx_orig as u32,
            },
            yarn_log_mul,
            freq_factors: None,
        })
    }

    /// cos/sin for position `pos`.
    pub fn cache(&self, pos: u32) -> Vec<f32> {
        self.params.cache(pos, self.freq_factors.as_deref())
    }
}
