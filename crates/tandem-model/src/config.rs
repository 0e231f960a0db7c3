//! Hyperparameters shared by the architectures, read from GGUF metadata as llama.cpp reads them
//! (src/llama-model.cpp `load_hparams`, src/llama-context.cpp for the YaRN attention factor).

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
    pub fn f32(&self, key: &str) -> Result<f32> {
        Ok(self.md.get_f32(&self.k(key))?)
    }
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        Ok(self.md.opt_f32(&self.k(key))?)
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
        let scaling = keys.md.opt_str(&keys.k("rope.scaling.type"))?.unwrap_or("linear").to_string();
        let factor = match keys.opt_f32("rope.scaling.factor")? {
            Some(f) => f,
            None => keys.opt_f32("rope.scale_linear")?.unwrap_or(0.0),
        };
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
        let n_ctx_orig = keys.opt_u32("rope.scaling.original_context_length")?.unwrap_or(n_ctx_train);
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
