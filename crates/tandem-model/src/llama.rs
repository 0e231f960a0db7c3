//! `llama`: dense transformer with grouped-query attention (llama.cpp src/models/llama.cpp).
//! SmolLM2-135M-Instruct is the real model this is checked against.

use crate::backend::Backend;
use crate::common::{attend, AttnShape, Ffn, Qkv, Ubatch};
use crate::config::{Arch, Keys, RopeConfig};
use crate::context::Layers;
use crate::kv_cache::{KvCache, KvLayout};
use crate::moe::Moe;
use crate::weights::{Weight, WeightLoader};
use crate::Result;
use tandem_cpu::RopeStyle;

/// The attention weights of a llama-style layer (llama, qwen3moe).
pub(crate) struct GqaWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Weight, // [n_embd] -> [n_head * head_dim]
    pub wk: Weight, // [n_embd] -> [n_head_kv * head_dim]
    pub wv: Weight, // [n_embd] -> [n_head_kv * head_dim]
    pub wo: Weight, // [n_head * head_dim] -> [n_embd]
    /// Per-head RMS norms of Q and K before rope (qwen3's QK-norm).
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

impl GqaWeights {
    pub fn load(l: &WeightLoader, il: usize, n_embd: usize, s: AttnShape, qk_norm: bool) -> Result<GqaWeights> {
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        Ok(GqaWeights {
            attn_norm: l.vec(&p("attn_norm"), n_embd)?,
            wq: l.get(&p("attn_q"), &[n_embd, s.n_head * s.dk])?,
            wk: l.get(&p("attn_k"), &[n_embd, s.n_head_kv * s.dk])?,
            wv: l.get(&p("attn_v"), &[n_embd, s.n_head_kv * s.dv])?,
            wo: l.get(&p("attn_output"), &[s.n_head * s.dv, n_embd])?,
            qk_norm: match qk_norm {
                true => Some((l.vec(&p("attn_q_norm"), s.dk)?, l.vec(&p("attn_k_norm"), s.dk)?)),
                false => None,
            },
        })
    }
}

/// Grouped-query attention with rotary embeddings, shared by llama and qwen3moe.
pub(crate) struct Gqa {
    pub n_embd: usize,
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
        b: &dyn Backend,
        cache: &mut KvCache,
        ub: &Ubatch,
        x: &mut [f32],
    ) -> Result<()> {
        let (s, n) = (self.shape, ub.len());
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.n_embd, Some(&w.attn_norm), self.eps);
        let mut q = vec![0f32; n * s.n_head * s.dk];
        let mut k = vec![0f32; n * s.n_head_kv * s.dk];
        let mut v = vec![0f32; n * s.n_head_kv * s.dv];
        b.matmul_same_input(&[&w.wq, &w.wk, &w.wv], &h, &mut [&mut q, &mut k, &mut v])?;
        if let Some((qn, kn)) = &w.qk_norm {
            b.rmsnorm(&mut q, s.dk, Some(qn), self.eps);
            b.rmsnorm(&mut k, s.dk, Some(kn), self.eps);
        }
        for t in 0..n {
            let cache_t = self.rope.cache(ub.pos[t]);
            let heads = q[t * s.n_head * s.dk..(t + 1) * s.n_head * s.dk].chunks_exact_mut(s.dk);
            for head in heads.chain(k[t * s.n_head_kv * s.dk..(t + 1) * s.n_head_kv * s.dk].chunks_exact_mut(s.dk)) {
                b.rope(head, &cache_t, self.rope.params.style);
            }
        }
        let o = attend(b, cache, il, ub, Qkv { q: &q, k: &k, v: Some(&v) }, s)?;
        let mut attn = vec![0f32; n * self.n_embd];
        b.matmul(&w.wo, &o, &mut attn)?;
        b.add(x, &attn);
        Ok(())
    }
}

/// The feed-forward part of a grouped-query-attention layer.
pub(crate) enum GqaFfn {
    Dense(Box<Ffn>),
    Moe(Box<Moe>),
}

pub(crate) struct GqaLayer {
    pub attn: GqaWeights,
    pub ffn_norm: Vec<f32>,
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

    fn forward_layer(&self, il: usize, b: &dyn Backend, cache: &mut KvCache, ub: &Ubatch, x: &mut [f32]) -> Result<()> {
        let ly = &self.layers[il];
        self.gqa.residual(&ly.attn, il, b, cache, ub, x)?;
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.gqa.n_embd, Some(&ly.ffn_norm), self.gqa.eps);
        let out = match &ly.ffn {
            GqaFfn::Dense(f) => f.forward(b, &h, ub.len())?,
            GqaFfn::Moe(m) => m.forward(b, &h, ub.len(), None)?,
        };
        b.add(x, &out);
        Ok(())
    }

    fn eps(&self) -> f32 {
        self.gqa.eps
    }
}

pub(crate) struct Llama;

impl Llama {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<GqaLayers> {
        let n_layer = keys.u32("block_count")?;
        let n_head = keys.u32("attention.head_count")?;
        let n_head_kv = keys.uniform_u32("attention.head_count_kv")?.unwrap_or(n_head);
        let head_dim = keys.opt_u32("attention.key_length")?.unwrap_or(n_embd / n_head.max(1));
        let n_ff = keys.u32("feed_forward_length")?;
        let eps = keys.f32("attention.layer_norm_rms_epsilon")?;
        let n_ctx_train = keys.u32("context_length")?;
        let n_rot = keys.opt_u32("rope.dimension_count")?.unwrap_or(head_dim);
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
                ffn_norm: l.vec(&format!("blk.{il}.ffn_norm.weight"), n_embd)?,
                ffn: GqaFfn::Dense(Box::new(Ffn::load(l, il, "", n_embd, n_ff)?)),
            });
        }
        Ok(GqaLayers { layers, gqa: Gqa { n_embd, shape, eps, rope } })
    }
}
