//! `llama`: dense transformer with grouped-query attention (llama.cpp src/models/llama.cpp).
//! SmolLM2-135M-Instruct is the real model this is checked against.

use crate::backend::Backend;
use crate::common::{attend, AttnShape, Ffn, Qkv, Ubatch};
use crate::config::{Arch, Keys, RopeConfig};
use crate::context::Layers;
use crate::kv_cache::{KvCache, KvLayout};
use crate::weights::{Weight, WeightLoader};
use crate::Result;
use tandem_cpu::RopeStyle;

struct Layer {
    attn_norm: Vec<f32>,
    wq: Weight, // [n_embd] -> [n_head * head_dim]
    wk: Weight, // [n_embd] -> [n_head_kv * head_dim]
    wv: Weight, // [n_embd] -> [n_head_kv * head_dim]
    wo: Weight, // [n_head * head_dim] -> [n_embd]
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

pub(crate) struct Llama {
    layers: Vec<Layer>,
    n_embd: usize,
    shape: AttnShape,
    eps: f32,
    rope: RopeConfig,
}

impl Llama {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<Llama> {
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
            let p = |n: &str| format!("blk.{il}.{n}.weight");
            layers.push(Layer {
                attn_norm: l.vec(&p("attn_norm"), n_embd)?,
                wq: l.get(&p("attn_q"), &[n_embd, n_head * head_dim])?,
                wk: l.get(&p("attn_k"), &[n_embd, n_head_kv * head_dim])?,
                wv: l.get(&p("attn_v"), &[n_embd, n_head_kv * head_dim])?,
                wo: l.get(&p("attn_output"), &[n_head * head_dim, n_embd])?,
                ffn_norm: l.vec(&p("ffn_norm"), n_embd)?,
                ffn: Ffn::load(l, il, "", n_embd, n_ff)?,
            });
        }
        Ok(Llama { layers, n_embd, shape, eps, rope })
    }
}

/// Q/K/V projections with rotary embeddings applied to every head of Q and K.
pub(crate) fn qkv_roped(
    b: &dyn Backend,
    ub: &Ubatch,
    h: &[f32],
    (wq, wk, wv): (&Weight, &Weight, &Weight),
    (q_norm, k_norm, eps): (Option<&[f32]>, Option<&[f32]>, f32),
    s: AttnShape,
    rope: &RopeConfig,
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let n = ub.len();
    let mut q = vec![0f32; n * s.n_head * s.dk];
    let mut k = vec![0f32; n * s.n_head_kv * s.dk];
    let mut v = vec![0f32; n * s.n_head_kv * s.dv];
    b.matmul(wq, h, &mut q)?;
    b.matmul(wk, h, &mut k)?;
    b.matmul(wv, h, &mut v)?;
    if let Some(w) = q_norm {
        b.rmsnorm(&mut q, s.dk, Some(w), eps);
    }
    if let Some(w) = k_norm {
        b.rmsnorm(&mut k, s.dk, Some(w), eps);
    }
    for t in 0..n {
        let cache = rope.cache(ub.pos[t]);
        for head in q[t * s.n_head * s.dk..(t + 1) * s.n_head * s.dk].chunks_exact_mut(s.dk) {
            b.rope(head, &cache, rope.params.style);
        }
        for head in k[t * s.n_head_kv * s.dk..(t + 1) * s.n_head_kv * s.dk].chunks_exact_mut(s.dk) {
            b.rope(head, &cache, rope.params.style);
        }
    }
    Ok((q, k, v))
}

impl Layers for Llama {
    fn layout(&self) -> KvLayout {
        let s = self.shape;
        KvLayout {
            n_layer: self.layers.len(),
            k_row: s.n_head_kv * s.dk,
            v_row: s.n_head_kv * s.dv,
            k_head: s.dk,
            v_head: s.dv,
        }
    }

    fn forward_layer(&self, il: usize, b: &dyn Backend, cache: &mut KvCache, ub: &Ubatch, x: &mut [f32]) -> Result<()> {
        let ly = &self.layers[il];
        let n = ub.len();
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.n_embd, Some(&ly.attn_norm), self.eps);
        let (q, k, v) = qkv_roped(b, ub, &h, (&ly.wq, &ly.wk, &ly.wv), (None, None, self.eps), self.shape, &self.rope)?;
        let o = attend(b, cache, il, ub, Qkv { q: &q, k: &k, v: Some(&v) }, self.shape)?;
        let mut attn = vec![0f32; n * self.n_embd];
        b.matmul(&ly.wo, &o, &mut attn)?;
        b.add(x, &attn);
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.n_embd, Some(&ly.ffn_norm), self.eps);
        let ffn = ly.ffn.forward(b, &h, n)?;
        b.add(x, &ffn);
        Ok(())
    }

    fn eps(&self) -> f32 {
        self.eps
    }
}
