//! Memory that is not weights: the KV cache for `-c`, `-ctk/-ctv` and `-np`, and the compute
//! buffers for `-ub`. The KV formulas follow llama.cpp; the compute-buffer formula is tandem's
//! own estimate of its executor's scratch, stated in [`compute_bytes`].

use crate::model::{Attention, Hparams, TensorEntry};
use crate::{Error, Result};
use serde::Serialize;
use tandem_gguf::GgmlType;

/// The KV cache types llama.cpp accepts for `-ctk/-ctv` (common/arg.cpp `kv_cache_types`).
pub const KV_CACHE_TYPES: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::IQ4_NL,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
];

/// llama.cpp pads the context (and each sequence's share of it) to a multiple of 256 cells.
pub const KV_PAD: u64 = 256;

/// Attention scores are computed in chunks of this many cached positions (flash-attention
/// style, like ik_llama.cpp's `-amb`), so the score scratch does not grow with `-c`.
pub const ATTN_KV_CHUNK: u64 = 4096;

const F32_BYTES: u64 = 4;

/// Parses a `-ctk/-ctv` value.
pub fn parse_cache_type(flag: &str, value: &str) -> Result<GgmlType> {
    match GgmlType::from_name(value).filter(|t| KV_CACHE_TYPES.contains(t)) {
        Some(t) => Ok(t),
        None => {
            let names: Vec<&str> = KV_CACHE_TYPES.iter().map(|t| t.name()).collect();
            Err(Error::bad_value(flag, value, format!("not a KV cache type; use one of {}", names.join(", "))))
        }
    }
}

/// The KV cache asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvConfig {
    /// `-c`: context tokens in all; 0 = the model's training context.
    pub ctx: u32,
    pub type_k: GgmlType,
    pub type_v: GgmlType,
    /// `-np`: sequences (server slots) sharing the context.
    pub parallel: u32,
    /// `false` with `-nkvo/--no-kv-offload`: the cache stays in host memory.
    pub offload: bool,
}

impl Default for KvConfig {
    fn default() -> Self {
        KvConfig { ctx: 4096, type_k: GgmlType::F16, type_v: GgmlType::F16, parallel: 1, offload: true }
    }
}

/// Cells of the cache, as llama.cpp's llama_context sizes it: `n_ctx` is padded to 256; with
/// `-np N` each sequence gets its own stream of `pad(n_ctx / N, 256)` cells (the default
/// non-unified cache), so the total is N times that — `-c` is shared, not multiplied. Returns
/// (total cells, cells per sequence).
pub fn kv_cells(ctx: u64, parallel: u32) -> (u64, u64) {
    let pad = |n: u64| n.div_ceil(KV_PAD) * KV_PAD;
    let np = u64::from(parallel.max(1));
    let n_ctx = pad(ctx.max(1));
    if np == 1 {
        return (n_ctx, n_ctx);
    }
    let per_seq = pad(n_ctx / np).max(KV_PAD);
    (per_seq * np, per_seq)
}

/// Bytes of layer `layer`'s cache for `cells` cells: K rows of `k_per_token` elements of
/// `type_k`, plus V rows of `v_per_token` elements of `type_v` (none for MLA, see
/// [`crate::model::Attention::Mla`]).
pub fn kv_layer_bytes(h: &Hparams, layer: usize, cells: u64, kv: &KvConfig) -> Result<u64> {
    let row = |flag: &str, ty: GgmlType, n: u32| -> Result<u64> {
        if n == 0 {
            return Ok(0);
        }
        ty.row_bytes(u64::from(n)).ok_or_else(|| {
            Error::bad_value(
                flag,
                ty.name(),
                format!("rows of {n} elements are not whole {ty} blocks of {}", ty.block_size()),
            )
        })
    };
    let per_token = |v: &[u32]| v.get(layer).copied().unwrap_or(0);
    let k = row("--cache-type-k", kv.type_k, per_token(&h.k_per_token))?;
    let v = row("--cache-type-v", kv.type_v, per_token(&h.v_per_token))?;
    Ok((k + v) * cells)
}

/// What runs on a device, which decides its compute buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Roles {
    /// Attention of at least one layer (with its norms and router).
    pub attention: bool,
    /// A dense FFN or a shared expert.
    pub ffn: bool,
    pub routed_experts: bool,
    /// The output head (logits).
    pub output: bool,
    /// Host side of GPU execution: pinned staging of hidden states.
    pub staging: bool,
}

/// Estimated compute-buffer bytes of a device for micro-batches of `ubatch` tokens. Buffers are
/// reused from layer to layer, so this is one layer's peak, all f32:
///
/// * attention: `ub * 4 * (3*n_embd + n_head*head_dim_k + latent + n_head*head_dim_v + n_expert
///   + n_head*min(cells_per_seq, 4096))`; the last term is the score chunk ([`ATTN_KV_CHUNK`]);
/// * `latent` is `n_head*(2*kv_lora + rope) + kv_lora + rope` for MLA (absorbed queries,
///   per-head latent outputs, the new latent) and `k + v` per token otherwise;
/// * dense FFN / shared expert: `ub * 4 * 2 * max(n_ff, n_ff_exp * n_shared)` (gate and up);
/// * routed experts: `ub * 4 * (n_expert_used * 2 * n_ff_exp + 3 * n_embd)`;
/// * output head: `ub * 4 * n_vocab` (logits of every position, as `tandem logits` needs);
/// * staging: `2 * ub * 4 * n_embd` of pinned host memory.
pub fn compute_bytes(h: &Hparams, ubatch: u32, cells_per_seq: u64, roles: Roles) -> u64 {
    let ub = u64::from(ubatch.max(1));
    let (n_embd, n_head) = (u64::from(h.n_embd), u64::from(h.n_head));
    let mut per_token = 0u64;
    if roles.attention {
        let latent = match h.attention {
            Attention::Mla { kv_lora_rank, rope_dim } => {
                let (r, p) = (u64::from(kv_lora_rank), u64::from(rope_dim));
                n_head * (2 * r + p) + r + p
            }
            Attention::Standard => {
                let k = h.k_per_token.iter().copied().max().unwrap_or(0);
                let v = h.v_per_token.iter().copied().max().unwrap_or(0);
                u64::from(k) + u64::from(v)
            }
        };
        per_token += 3 * n_embd
            + n_head * u64::from(h.head_dim_k)
            + latent
            + n_head * u64::from(h.head_dim_v)
            + u64::from(h.n_expert)
            + n_head * cells_per_seq.min(ATTN_KV_CHUNK);
    }
    if roles.ffn {
        let shared = u64::from(h.n_ff_exp) * u64::from(h.n_expert_shared);
        per_token += 2 * u64::from(h.n_ff).max(shared);
    }
    if roles.routed_experts {
        per_token += u64::from(h.n_expert_used) * 2 * u64::from(h.n_ff_exp) + 3 * n_embd;
    }
    if roles.output {
        per_token += u64::from(h.n_vocab);
    }
    if roles.staging {
        per_token += 2 * n_embd;
    }
    per_token * ub * F32_BYTES
}

/// Most bytes of rebuilt keys and values the CPU's decompressed MLA holds at once (tandem-cpu's
/// `MLA_VALUE_BYTES`: beyond it the heads go in groups).
pub const MLA_REBUILT_MAX: u64 = 1 << 30;

/// The CPU memory of MLA attention run decompressed (`--mla auto`, the default, for prompts), on
/// top of [`compute_bytes`]: the f32 copy of every `attn_k_b` and `attn_v_b` among `on_cpu`
/// (made at a layer's first decompressed prompt and kept: 33.5 MB per layer at Kimi K2's shape),
/// and one layer's scratch, the cached latents as f32 (`cells * (kv_lora + rope) * 4`) and the
/// rebuilt keys and values (`cells * n_head * (nope + dv) * 4`, at most [`MLA_REBUILT_MAX`]).
/// 0 for other attention, or when no `attn_k_b` is on the CPU.
pub fn mla_decompressed_bytes<'t>(
    h: &Hparams,
    on_cpu: impl Iterator<Item = &'t TensorEntry>,
    cells_per_seq: u64,
) -> u64 {
    let Attention::Mla { kv_lora_rank, rope_dim } = h.attention else { return 0 };
    let weights: u64 = on_cpu
        .filter(|t| t.name.ends_with(".attn_k_b.weight") || t.name.ends_with(".attn_v_b.weight"))
        .map(|t| t.dims.iter().product::<u64>() * F32_BYTES)
        .sum();
    if weights == 0 {
        return 0;
    }
    let (r, p) = (u64::from(kv_lora_rank), u64::from(rope_dim));
    let nope = u64::from(h.head_dim_k).saturating_sub(p);
    let latent = cells_per_seq * (r + p) * F32_BYTES;
    let rebuilt =
        (cells_per_seq * u64::from(h.n_head) * (nope + u64::from(h.head_dim_v)) * F32_BYTES).min(MLA_REBUILT_MAX);
    weights + latent + rebuilt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_pad_like_llama_cpp() {
        assert_eq!(kv_cells(131072, 1), (131072, 131072));
        assert_eq!(kv_cells(1000, 1), (1024, 1024));
        // -c 131072 -np 4: four streams of 32768, not four times 131072.
        assert_eq!(kv_cells(131072, 4), (131072, 32768));
        // -c 4096 -np 3: n_ctx_seq = pad(1365, 256) = 1536, so 4608 cells in all.
        assert_eq!(kv_cells(4096, 3), (4608, 1536));
        assert_eq!(kv_cells(0, 0), (256, 256));
    }

    #[test]
    fn cache_types() {
        assert_eq!(parse_cache_type("--cache-type-k", "q8_0").unwrap(), GgmlType::Q8_0);
        assert_eq!(parse_cache_type("--cache-type-k", "F16").unwrap(), GgmlType::F16);
        assert_eq!(
            parse_cache_type("--cache-type-v", "q4_K").unwrap_err().to_string(),
            "--cache-type-v 'q4_K': not a KV cache type; use one of f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
        );
    }
}
