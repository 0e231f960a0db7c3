//! Pieces every architecture shares: embeddings and output head, the SwiGLU FFN, and attention
//! over the KV cache.

use crate::backend::{AttnInput, Backend, FfnSpec};
use crate::kv_cache::KvCache;
use crate::weights::{Weight, WeightLoader};
use crate::Result;

/// The tokens of one micro-batch.
pub(crate) struct Ubatch<'a> {
    pub tokens: &'a [u32],
    pub pos: &'a [u32],
    pub seq: &'a [usize],
    pub mla: crate::MlaMode,
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
    pub output_norm: Vec<f32>,
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
        let output_norm = l.vec("output_norm.weight", n_embd)?;
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

/// `down(silu(gate x) * up x)` (llama.cpp `build_ffn` with LLM_FFN_SILU, LLM_FFN_PAR).
pub(crate) struct Ffn {
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
}

impl Ffn {
    /// `blk.{il}.ffn_{gate,up,down}{suffix}.weight` of width `n_ff`.
    pub fn load(l: &WeightLoader, il: usize, suffix: &str, n_embd: usize, n_ff: usize) -> Result<Ffn> {
        Ok(Ffn {
            gate: l.get(&format!("blk.{il}.ffn_gate{suffix}.weight"), &[n_embd, n_ff])?,
            up: l.get(&format!("blk.{il}.ffn_up{suffix}.weight"), &[n_embd, n_ff])?,
            down: l.get(&format!("blk.{il}.ffn_down{suffix}.weight"), &[n_ff, n_embd])?,
        })
    }

    pub fn forward(&self, b: &dyn Backend, h: &[f32], n_tokens: usize) -> Result<Vec<f32>> {
        let spec = self.spec((0..n_tokens).collect());
        Ok(b.ffn_batch(h, self.gate.cols(), &[spec])?.swap_remove(0))
    }

    /// This FFN on the given tokens, for [`Backend::ffn_batch`].
    pub fn spec(&self, tokens: Vec<usize>) -> FfnSpec<'_> {
        FfnSpec {
            gate: &self.gate,
            up: &self.up,
            down: &self.down,
            expert: 0,
            n_ff: self.gate.rows(),
            n_out: self.down.rows(),
            tokens,
        }
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

/// The projected queries, keys and values of a micro-batch: `q` is `[n][n_head * dk]`, `k`
/// `[n][n_head_kv * dk]`, `v` `[n][n_head_kv * dv]` or `None` under MLA (V is read from K).
pub(crate) struct Qkv<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: Option<&'a [f32]>,
}

/// Appends each token's K (and V) row to its sequence's cache in layer `il`.
pub(crate) fn push_rows(
    cache: &mut KvCache,
    il: usize,
    ub: &Ubatch,
    k: &[f32],
    v: Option<&[f32]>,
    s: AttnShape,
) -> Result<()> {
    let (k_len, v_len) = (s.n_head_kv * s.dk, s.n_head_kv * s.dv);
    for t in 0..ub.len() {
        let vr = v.map(|v| &v[t * v_len..(t + 1) * v_len]);
        cache.push(ub.seq[t], il, &k[t * k_len..(t + 1) * k_len], vr)?;
    }
    Ok(())
}

/// Appends each token's K (and V) row to its sequence's cache in layer `il`, then attends every
/// token to the positions up to its own; returns `[n][n_head * dv]`.
pub(crate) fn attend(
    b: &dyn Backend,
    cache: &mut KvCache,
    il: usize,
    ub: &Ubatch,
    qkv: Qkv,
    s: AttnShape,
) -> Result<Vec<f32>> {
    push_rows(cache, il, ub, qkv.k, qkv.v, s)?;
    let tokens: Vec<usize> = (0..ub.len()).collect();
    attend_cached(b, cache, il, ub, &tokens, qkv.q, qkv.v.is_some(), s)
}

/// Attention of the tokens `tokens` of a micro-batch (their rows already cached) to the positions
/// up to their own; `q` is `[tokens.len()][n_head * dk]`; returns `[tokens.len()][n_head * dv]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_cached(
    b: &dyn Backend,
    cache: &KvCache,
    il: usize,
    ub: &Ubatch,
    tokens: &[usize],
    q: &[f32],
    separate_v: bool,
    s: AttnShape,
) -> Result<Vec<f32>> {
    let (k_type, v_type) = (cache.k_type(), cache.v_type());
    let q_len = s.n_head * s.dk;
    let mut out = vec![0f32; tokens.len() * s.n_head * s.dv];
    let items: Vec<AttnInput> = tokens
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let (kb, vb) = cache.rows(ub.seq[t], il);
            AttnInput {
                q: &q[i * q_len..(i + 1) * q_len],
                n_head: s.n_head,
                n_head_kv: s.n_head_kv,
                dk: s.dk,
                dv: s.dv,
                k: kb,
                k_type,
                v: separate_v.then_some(vb),
                v_type,
                n_kv: ub.pos[t] as usize + 1,
                scale: s.scale,
            }
        })
        .collect();
    if !items.is_empty() {
        b.attention_batch(&items, &mut out)?;
    }
    Ok(out)
}
