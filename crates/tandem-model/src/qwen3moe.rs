//! `qwen3moe`: grouped-query attention with per-head RMS norms on Q and K (QK-norm), NeoX rotary
//! embeddings, and softmax-routed experts with normalized weights and no shared expert
//! (llama.cpp src/models/qwen3moe.cpp).

use crate::common::AttnShape;
use crate::config::{Arch, Keys, RopeConfig, MAX_CTX, MAX_EXPERTS, MAX_WIDTH};
use crate::llama::{Gqa, GqaFfn, GqaLayer, GqaLayers, GqaWeights};
use crate::moe::{Gating, Moe, RouterParams};
use crate::weights::WeightLoader;
use crate::Result;
use tandem_cpu::RopeStyle;

pub(crate) struct Qwen3Moe;

impl Qwen3Moe {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<GqaLayers> {
        let n_layer = keys.block_count(l)?;
        let (n_head, n_head_kv, head_dim) = keys.gqa_heads(n_embd)?;
        let eps = keys.eps()?;
        let n_ctx_train = keys.count("context_length", 1, MAX_CTX)?;
        let n_rot = keys.rope_dims(head_dim)?;
        let rope = RopeConfig::load(keys, Arch::Qwen3Moe, n_rot, RopeStyle::Neox, n_ctx_train)?;
        let routing = RouterParams {
            n_expert: keys.count("expert_count", 1, MAX_EXPERTS)?,
            n_used: keys.count("expert_used_count", 1, MAX_EXPERTS)?,
            gating: Gating::Softmax,
            norm: true,
            // llama.cpp's qwen3moe never reads expert_weights_scale: weights are not scaled.
            scale: 0.0,
            n_group: 0,
            n_group_used: 0,
        };
        let n_ff_exp = keys.count("expert_feed_forward_length", 1, MAX_WIDTH)?;
        let shape = AttnShape { n_head, n_head_kv, dk: head_dim, dv: head_dim, scale: 1.0 / (head_dim as f32).sqrt() };
        let mut layers = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            layers.push(GqaLayer {
                attn: GqaWeights::load(l, il, n_embd, shape, true)?,
                ffn_norm: l.vector(&format!("blk.{il}.ffn_norm.weight"), n_embd)?,
                ffn: GqaFfn::Moe(Box::new(Moe::load(l, il, n_embd, n_ff_exp, routing)?)),
            });
        }
        Ok(GqaLayers { layers, gqa: Gqa { shape, eps, rope } })
    }
}
