//! `qwen3moe`: grouped-query attention with per-head RMS norms on Q and K (QK-norm), NeoX rotary
//! embeddings, and softmax-routed experts with normalized weights and no shared expert
//! (llama.cpp src/models/qwen3moe.cpp).

use crate::common::AttnShape;
use crate::config::{Arch, Keys, RopeConfig};
use crate::llama::{Gqa, GqaFfn, GqaLayer, GqaLayers, GqaWeights};
use crate::moe::{Gating, Moe, Routing};
use crate::weights::WeightLoader;
use crate::Result;
use tandem_cpu::RopeStyle;

pub(crate) struct Qwen3Moe;

impl Qwen3Moe {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<GqaLayers> {
        let n_layer = keys.u32("block_count")?;
        let n_head = keys.u32("attention.head_count")?;
        let n_head_kv = keys.uniform_u32("attention.head_count_kv")?.unwrap_or(n_head);
        let head_dim = keys.opt_u32("attention.key_length")?.unwrap_or(n_embd / n_head.max(1));
        let eps = keys.f32("attention.layer_norm_rms_epsilon")?;
        let n_ctx_train = keys.u32("context_length")?;
        let n_rot = keys.opt_u32("rope.dimension_count")?.unwrap_or(head_dim);
        let rope = RopeConfig::load(keys, Arch::Qwen3Moe, n_rot, RopeStyle::Neox, n_ctx_train)?;
        let routing = Routing {
            n_expert: keys.u32("expert_count")?,
            n_used: keys.u32("expert_used_count")?,
            gating: Gating::Softmax,
            norm_weights: true,
            // llama.cpp's qwen3moe never reads expert_weights_scale: weights are not scaled.
            scale: 0.0,
            n_group: 0,
            n_group_used: 0,
        };
        let n_ff_exp = keys.u32("expert_feed_forward_length")?;
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
