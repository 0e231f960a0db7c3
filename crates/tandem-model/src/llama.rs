//! `llama`: dense transformer with grouped-query attention (llama.cpp src/models/llama.cpp).
//! SmolLM2-135M-Instruct is the real model this is checked against.

use crate::common::{AttnShape, Ffn, Ubatch};
use crate::config::{Arch, Keys, RopeConfig, MAX_CTX, MAX_WIDTH};
use crate::context::Layers;
use crate::device::AttnCall;
use crate::exec::{DevId, Exec, Heads, Rows, Tensor};
use crate::kv_cache::{KvCache, KvLayout};
use crate::moe::Moe;
use crate::weights::{Vector, Weight, WeightLoader};
use crate::Result;
use tandem_cpu::RopeStyle;

/// The attention weights of a llama-style layer (llama, qwen3moe).
pub(crate) struct GqaWeights {
    pub attn_norm: Vector,
    pub wq: Weight, // [n_embd] -> [n_head * head_dim]
    pub wk: Weight, // [n_embd] -> [n_head_kv * head_dim]
    pub wv: Weight, // [n_embd] -> [n_head_kv * head_dim]
    pub wo: Weight, // [n_head * head_dim] -> [n_embd]
    /// Per-head RMS norms of Q and K before rope (qwen3's QK-norm).
    pub qk_norm: Option<(Vector, Vector)>,
}

impl GqaWeights {
    pub fn load(l: &WeightLoader, il: usize, n_embd: usize, s: AttnShape, qk_norm: bool) -> Result<GqaWeights> {
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        Ok(GqaWeights {
            attn_norm: l.vector(&p("attn_norm"), n_embd)?,
            wq: l.get(&p("attn_q"), &[n_embd, s.n_head * s.dk])?,
            wk: l.get(&p("attn_k"), &[n_embd, s.n_head_kv * s.dk])?,
            wv: l.get(&p("attn_v"), &[n_embd, s.n_head_kv * s.dv])?,
            wo: l.get(&p("attn_output"), &[s.n_head * s.dv, n_embd])?,
            qk_norm: match qk_norm {
                true => Some((l.vector(&p("attn_q_norm"), s.dk)?, l.vector(&p("attn_k_norm"), s.dk)?)),
                false => None,
            },
        })
    }
}

/// Grouped-query attention with rotary embeddings, shared by llama and qwen3moe.
pub(crate) struct Gqa {
    pub shape: AttnShape,
    pub eps: f32,
    pub rope: RopeConfig,
}

impl Gqa {
    pub fn layout(&self, n_layer: usize) -> KvLayout {
        let s = self.shape;
        KvLayout { n_layer, k_row: s.n_head_kv * s.dk, v_row: s.n_head_kv * s.dv, k_head: s.dk, v_head: s.dv }
    }

    /// `x += attn_output(attention(attn_norm(x)))` for layer `il`.
    pub fn residual(
        &self,
        w: &GqaWeights,
        il: usize,
        ex: &Exec,
        cache: &mut KvCache,
        ub: &Ubatch,
        x: &mut Tensor,
    ) -> Result<()> {
        let (s, n) = (self.shape, ub.len());
        ex.move_to(x, ex.dev_of(&w.attn_norm.name))?;
        let h = ex.rmsnorm(x, &w.attn_norm, self.eps)?;
        let mut r = ex.matmul_same_input(&[&w.wq, &w.wk, &w.wv], &h)?.into_iter();
        let (Some(mut q), Some(mut k), Some(v)) = (r.next(), r.next(), r.next()) else {
            unreachable!("three products asked")
        };
        if let Some((qn, kn)) = &w.qk_norm {
            ex.rmsnorm_in_place(&mut q, qn, Rows::dense(s.dk), self.eps)?;
            ex.rmsnorm_in_place(&mut k, kn, Rows::dense(s.dk), self.eps)?;
        }
        let style = self.rope.params.style;
        ex.rope(&mut q, ub, Heads { row: s.n_head * s.dk, n_heads: s.n_head, head: s.dk, off: 0 }, style)?;
        ex.rope(&mut k, ub, Heads { row: s.n_head_kv * s.dk, n_heads: s.n_head_kv, head: s.dk, off: 0 }, style)?;
        ex.kv_store(cache, il, ub, &k, Some(&v))?;
        let tokens: Vec<usize> = (0..n).collect();
        let o = ex.attention(cache, &q, &AttnCall { il, ub, tokens: &tokens, s, separate_v: true })?;
        let attn = ex.matmul(&w.wo, &o)?;
        ex.add(x, &attn)
    }
}

/// The feed-forward part of a grouped-query-attention layer.
pub(crate) enum GqaFfn {
    Dense(Box<Ffn>),
    Moe(Box<Moe>),
}

pub(crate) struct GqaLayer {
    pub attn: GqaWeights,
    pub ffn_norm: Vector,
    pub ffn: GqaFfn,
}

/// A stack of `attention + FFN` layers: llama (dense FFN) and qwen3moe (routed experts).
pub(crate) struct GqaLayers {
    pub layers: Vec<GqaLayer>,
    pub gqa: Gqa,
}

impl Layers for GqaLayers {
    fn layout(&self) -> KvLayout {
        self.gqa.layout(self.layers.len())
    }

    fn forward_layer(&self, il: usize, ex: &Exec, cache: &mut KvCache, ub: &Ubatch, x: &mut Tensor) -> Result<()> {
        let ly = &self.layers[il];
        self.gqa.residual(&ly.attn, il, ex, cache, ub, x)?;
        let h = ex.rmsnorm(x, &ly.ffn_norm, self.gqa.eps)?;
        let out = match &ly.ffn {
            GqaFfn::Dense(f) => ex.ffn(f, &h)?,
            GqaFfn::Moe(m) => ex.moe(m, None, &h)?,
        };
        ex.add(x, &out)
    }

    fn kv_device(&self, il: usize, ex: &Exec) -> DevId {
        ex.kv_device(ex.dev_of(&self.layers[il].attn.wk.name))
    }

    fn first_device(&self, ex: &Exec) -> DevId {
        self.layers.first().map_or(crate::exec::CPU, |l| ex.dev_of(&l.attn.attn_norm.name))
    }

    fn rope(&self) -> &RopeConfig {
        &self.gqa.rope
    }

    fn eps(&self) -> f32 {
        self.gqa.eps
    }
}

pub(crate) struct Llama;

impl Llama {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<GqaLayers> {
        let n_layer = keys.block_count(l)?;
        let (n_head, n_head_kv, head_dim) = keys.gqa_heads(n_embd)?;
        let n_ff = keys.count("feed_forward_length", 1, MAX_WIDTH)?;
        let eps = keys.eps()?;
        let n_ctx_train = keys.count("context_length", 1, MAX_CTX)?;
        let n_rot = keys.rope_dims(head_dim)?;
        let mut rope = RopeConfig::load(keys, Arch::Llama, n_rot, RopeStyle::Norm, n_ctx_train)?;
        rope.freq_factors = l.opt_vec("rope_freqs.weight", n_rot / 2)?;
        let attn_scale = keys.opt_f32("attention.scale")?.filter(|&s| s != 0.0);
        let shape = AttnShape {
            n_head,
            n_head_kv,
            dk: head_dim,
            dv: head_dim,
            scale: attn_scale.unwrap_or(1.0 / (head_dim as f32).sqrt()),
        };
        let mut layers = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            layers.push(GqaLayer {
                attn: GqaWeights::load(l, il, n_embd, shape, false)?,
                ffn_norm: l.vector(&format!("blk.{il}.ffn_norm.weight"), n_embd)?,
                ffn: GqaFfn::Dense(Box::new(Ffn::load(l, il, "", n_embd, n_ff)?)),
            });
        }
        Ok(GqaLayers { layers, gqa: Gqa { shape, eps, rope } })
    }
}
