//! Pieces every architecture shares: embeddings and output head, the SwiGLU FFN, the micro-batch.

use crate::weights::{Vector, Weight, WeightLoader};
use crate::Result;

/// The tokens of one micro-batch.
pub(crate) struct Ubatch<'a> {
    pub tokens: &'a [u32],
    pub pos: &'a [u32],
    pub seq: &'a [usize],
    pub mla: crate::MlaMode,
    /// `[n][n_rot]`: the cos/sin rows of each token's position (`RopeConfig::cache`).
    pub rope: Vec<f32>,
    pub n_rot: usize,
}

impl Ubatch<'_> {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
}

/// Token embeddings, final norm and output head (tied to the embeddings when `output.weight` is
/// absent, as llama.cpp does).
pub(crate) struct Head {
    pub token_embd: Weight,
    pub output_norm: Vector,
    pub output: Weight,
    pub n_embd: usize,
    pub n_vocab: usize,
}

impl Head {
    pub fn load(l: &WeightLoader, n_embd: usize) -> Result<Head> {
        let n_vocab = l
            .gguf()
            .tensor("token_embd.weight")
            .map(|t| *t.info.dims.get(1).unwrap_or(&0) as usize)
            .ok_or_else(|| crate::model_err("missing tensor 'token_embd.weight'"))?;
        let token_embd = l.get_table("token_embd.weight", &[n_embd, n_vocab])?;
        let output_norm = l.vector("output_norm.weight", n_embd)?;
        let output = match l.opt("output.weight", &[n_embd, n_vocab])? {
            Some(w) => w,
            None => token_embd.clone(),
        };
        Ok(Head { token_embd, output_norm, output, n_embd, n_vocab })
    }

    /// `[n_tokens][n_embd]` embeddings (`ggml_get_rows`).
    pub fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut x = Vec::with_capacity(tokens.len() * self.n_embd);
        for &t in tokens {
            x.extend(self.token_embd.row_f32(t as usize)?);
        }
        Ok(x)
    }
}

/// `down(silu(gate x) * up x)` (llama.cpp `build_ffn` with LLM_FFN_SILU, LLM_FFN_PAR); for the
/// stacked experts of a MoE layer, expert `e` is rows `e * n_ff ..` of gate and up and `e * n_out
/// ..` of down.
pub(crate) struct Ffn {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    pub n_ff: usize,
    pub n_out: usize,
}

impl Ffn {
    /// `blk.{il}.ffn_{gate,up,down}{suffix}.weight` of width `n_ff`.
    pub fn load(l: &WeightLoader, il: usize, suffix: &str, n_embd: usize, n_ff: usize) -> Result<Ffn> {
        Ok(Ffn {
            gate: l.get(&format!("blk.{il}.ffn_gate{suffix}.weight"), &[n_embd, n_ff])?,
            up: l.get(&format!("blk.{il}.ffn_up{suffix}.weight"), &[n_embd, n_ff])?,
            down: l.get(&format!("blk.{il}.ffn_down{suffix}.weight"), &[n_ff, n_embd])?,
            n_ff,
            n_out: n_embd,
        })
    }

    /// Rows of gate and up per expert.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Rows of down per expert.
    pub fn n_out(&self) -> usize {
        self.n_out
    }
}

/// Head counts and sizes of an attention.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    pub scale: f32,
}
