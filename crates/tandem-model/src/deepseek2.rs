//! `deepseek2`: Kimi K2 / K2.5, DeepSeek V3 / R1 (llama.cpp src/models/deepseek2.cpp).
//!
//! Multi-head latent attention in both GGUF flavours: mainline MLA files carry `attn_k_b` and
//! `attn_v_b` and are run in the absorbed form over a latent cache (one row of
//! `kv_lora_rank + n_rot` values per position, V read from its latent part); legacy files carry
//! `attn_kv_b` and are run as ordinary multi-head attention. MoE layers after
//! `leading_dense_block_count` dense ones, with shared experts.

use crate::backend::{Backend, MlaInput};
use crate::common::{attend, attend_cached, push_rows, AttnShape, Ffn, Qkv, Ubatch};
use crate::config::{Arch, Keys, RopeConfig};
use crate::context::Layers;
use crate::kv_cache::{KvCache, KvLayout};
use crate::moe::{Gating, Moe, Routing};
use crate::weights::{Weight, WeightLoader};
use crate::{model_err, MlaMode, Result};
use tandem_cpu::RopeStyle;

enum Query {
    /// `attn_q_a` [n_embd] -> [q_lora], its norm, `attn_q_b` [q_lora] -> [n_head * dk].
    Lora { a: Weight, norm: Vec<f32>, b: Weight },
    /// `attn_q` [n_embd] -> [n_head * dk] (models without `q_lora_rank`).
    Full(Weight),
}

enum KvUp {
    /// `attn_k_b` [nope, kv_lora, n_head] and `attn_v_b` [kv_lora, dv, n_head].
    Mla { k_b: Weight, v_b: Weight },
    /// `attn_kv_b` [kv_lora] -> [n_head * (nope + dv)].
    Legacy(Weight),
}

enum Ffw {
    Dense(Ffn),
    Moe { moe: Box<Moe>, shared: Option<Ffn> },
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Query,
    kv_a: Weight, // [n_embd] -> [kv_lora + n_rot]
    kv_a_norm: Vec<f32>,
    kv_up: KvUp,
    wo: Weight, // [n_head * dv] -> [n_embd]
    ffn_norm: Vec<f32>,
    ffn: Ffw,
}

pub(crate) struct Deepseek2 {
    layers: Vec<Layer>,
    n_embd: usize,
    n_head: usize,
    /// Per-head K and V sizes after decompression (`key_length_mla` / `value_length_mla`).
    dk: usize,
    dv: usize,
    n_rot: usize,
    kv_lora: usize,
    mla: bool,
    kq_scale: f32,
    eps: f32,
    rope: RopeConfig,
}

impl Deepseek2 {
    pub fn load(keys: &Keys, l: &WeightLoader, n_embd: usize) -> Result<Deepseek2> {
        let n_layer = keys.u32("block_count")?;
        let n_head = keys.uniform_u32("attention.head_count")?.ok_or_else(|| model_err("missing head_count"))?;
        let n_rot = keys.u32("rope.dimension_count")?;
        let kv_lora = keys.u32("attention.kv_lora_rank")?;
        let q_lora = keys.opt_u32("attention.q_lora_rank")?.unwrap_or(0);
        let k_mla = keys.opt_u32("attention.key_length_mla")?.unwrap_or(0);
        let v_mla = keys.opt_u32("attention.value_length_mla")?.unwrap_or(0);
        let mla = k_mla != 0 && v_mla != 0;
        let (dk, dv) =
            if mla { (k_mla, v_mla) } else { (keys.u32("attention.key_length")?, keys.u32("attention.value_length")?) };
        if dk <= n_rot {
            return Err(model_err(format!("deepseek2: key length {dk} must exceed the rope dimension {n_rot}")));
        }
        let nope = dk - n_rot;
        let eps = keys.f32("attention.layer_norm_rms_epsilon")?;
        let n_ctx_train = keys.u32("context_length")?;
        let rope = RopeConfig::load(keys, Arch::Deepseek2, n_rot, RopeStyle::Norm, n_ctx_train)?;
        // llama.cpp pre-scales kq_scale for YaRN (deepseek2.cpp, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
        let inv_fs_ln = (1.0 / rope.params.freq_scale).ln();
        let attn_factor_org = rope.params.attn_factor * (1.0 + 0.1 * inv_fs_ln);
        let mscale = attn_factor_org * (1.0 + 0.1 * rope.yarn_log_mul * inv_fs_ln);
        let kq_scale = mscale * mscale / (dk as f32).sqrt();

        let n_dense = keys.opt_u32("leading_dense_block_count")?.unwrap_or(0);
        let n_ff = keys.opt_u32("feed_forward_length")?.unwrap_or(0);
        let n_expert = keys.opt_u32("expert_count")?.unwrap_or(0);
        let routing = Routing {
            n_expert,
            n_used: keys.opt_u32("expert_used_count")?.unwrap_or(0),
            gating: Gating::from_id(keys.opt_u32("expert_gating_func")?.unwrap_or(0))?,
            norm_weights: keys.opt_bool("expert_weights_norm")?.unwrap_or(false),
            scale: keys.opt_f32("expert_weights_scale")?.unwrap_or(0.0),
            n_group: keys.opt_u32("expert_group_count")?.unwrap_or(0),
            n_group_used: keys.opt_u32("expert_group_used_count")?.unwrap_or(0),
        };
        let n_ff_exp = keys.uniform_u32("expert_feed_forward_length")?.unwrap_or(0);
        let n_shared = keys.opt_u32("expert_shared_count")?.unwrap_or(0);

        let mut layers = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            let p = |n: &str| format!("blk.{il}.{n}.weight");
            let q = if q_lora > 0 {
                Query::Lora {
                    a: l.get(&p("attn_q_a"), &[n_embd, q_lora])?,
                    norm: l.vec(&p("attn_q_a_norm"), q_lora)?,
                    b: l.get(&p("attn_q_b"), &[q_lora, n_head * dk])?,
                }
            } else {
                Query::Full(l.get(&p("attn_q"), &[n_embd, n_head * dk])?)
            };
            let kv_up = if mla {
                KvUp::Mla {
                    k_b: l.get(&p("attn_k_b"), &[nope, kv_lora, n_head])?,
                    v_b: l.get(&p("attn_v_b"), &[kv_lora, dv, n_head])?,
                }
            } else {
                KvUp::Legacy(l.get(&p("attn_kv_b"), &[kv_lora, n_head * (nope + dv)])?)
            };
            let ffn = if il < n_dense {
                Ffw::Dense(Ffn::load(l, il, "", n_embd, n_ff)?)
            } else {
                Ffw::Moe {
                    moe: Box::new(Moe::load(l, il, n_embd, n_ff_exp, routing)?),
                    shared: match n_shared {
                        0 => None,
                        s => Some(Ffn::load(l, il, "_shexp", n_embd, n_ff_exp * s)?),
                    },
                }
            };
            layers.push(Layer {
                attn_norm: l.vec(&p("attn_norm"), n_embd)?,
                q,
                kv_a: l.get(&p("attn_kv_a_mqa"), &[n_embd, kv_lora + n_rot])?,
                kv_a_norm: l.vec(&p("attn_kv_a_norm"), kv_lora)?,
                kv_up,
                wo: l.get(&p("attn_output"), &[n_head * dv, n_embd])?,
                ffn_norm: l.vec(&p("ffn_norm"), n_embd)?,
                ffn,
            });
        }
        Ok(Deepseek2 { layers, n_embd, n_head, dk, dv, n_rot, kv_lora, mla, kq_scale, eps, rope })
    }

    /// Attention of one layer: returns `[n][n_head * dv]` before `attn_output`.
    fn attention(
        &self,
        ly: &Layer,
        il: usize,
        b: &dyn Backend,
        cache: &mut KvCache,
        ub: &Ubatch,
        h: &[f32],
    ) -> Result<Vec<f32>> {
        let n = ub.len();
        let (nh, dk, dv, nr, kl) = (self.n_head, self.dk, self.dv, self.n_rot, self.kv_lora);
        let nope = dk - nr;
        let mut q = vec![0f32; n * nh * dk];
        // [n][kv_lora + n_rot]: the latent, normalized, and the shared rotary key; computed with
        // the first projection of the query, which takes the same input.
        let mut kv = vec![0f32; n * (kl + nr)];
        match &ly.q {
            Query::Lora { a, norm, b: wb } => {
                let mut qa = vec![0f32; n * a.rows()];
                b.matmul_same_input(&[a, &ly.kv_a], h, &mut [&mut qa, &mut kv])?;
                b.rmsnorm(&mut qa, a.rows(), Some(norm), self.eps);
                b.matmul(wb, &qa, &mut q)?;
            }
            Query::Full(w) => b.matmul_same_input(&[w, &ly.kv_a], h, &mut [&mut q, &mut kv])?,
        }
        for t in 0..n {
            let cache_t = self.rope.cache(ub.pos[t]);
            let row = &mut kv[t * (kl + nr)..(t + 1) * (kl + nr)];
            b.rope(&mut row[kl..], &cache_t, RopeStyle::Norm);
            b.rmsnorm(&mut row[..kl], kl, Some(&ly.kv_a_norm), self.eps);
            for head in q[t * nh * dk..(t + 1) * nh * dk].chunks_exact_mut(dk) {
                b.rope(&mut head[nope..], &cache_t, RopeStyle::Norm);
            }
        }
        match &ly.kv_up {
            KvUp::Mla { k_b, v_b } => {
                let shape = AttnShape { n_head: nh, n_head_kv: 1, dk: kl + nr, dv: kl, scale: self.kq_scale };
                push_rows(cache, il, ub, &kv, None, shape)?;
                let mut o = vec![0f32; n * nh * dv];
                let row = nh * dv;
                // Each sequence's run of tokens in the form that costs less; the rest absorbed.
                // Under the default (absorbed) form there is nothing to choose per sequence.
                let runs = if ub.mla == MlaMode::Absorbed { Vec::new() } else { by_sequence(ub) };
                let mut absorbed: Vec<usize> = if runs.is_empty() { (0..n).collect() } else { Vec::new() };
                for (seq, tokens) in runs {
                    let n_kv: Vec<usize> = tokens.iter().map(|&t| ub.pos[t] as usize + 1).collect();
                    if self.decompress(ub.mla, &n_kv) {
                        let qs: Vec<f32> =
                            tokens.iter().flat_map(|&t| q[t * nh * dk..(t + 1) * nh * dk].iter().copied()).collect();
                        let mut out = vec![0f32; tokens.len() * row];
                        let input = MlaInput {
                            q: &qs,
                            n_head: nh,
                            nope,
                            n_rot: nr,
                            kv_lora: kl,
                            dv,
                            kv: cache.rows(seq, il).0,
                            kv_type: cache.k_type(),
                            n_kv: &n_kv,
                            k_b,
                            v_b,
                            scale: self.kq_scale,
                        };
                        if b.mla_decompressed(&input, &mut out)? {
                            for (&t, r) in tokens.iter().zip(out.chunks_exact(row)) {
                                o[t * row..(t + 1) * row].copy_from_slice(r);
                            }
                            continue;
                        }
                    }
                    absorbed.extend(tokens);
                }
                if !absorbed.is_empty() {
                    let out = self.absorbed(b, cache, il, ub, &absorbed, &q, k_b, v_b)?;
                    for (&t, r) in absorbed.iter().zip(out.chunks_exact(row)) {
                        o[t * row..(t + 1) * row].copy_from_slice(r);
                    }
                }
                Ok(o)
            }
            KvUp::Legacy(kv_b) => {
                let latent: Vec<f32> =
                    (0..n).flat_map(|t| kv[t * (kl + nr)..t * (kl + nr) + kl].iter().copied()).collect();
                let mut up = vec![0f32; n * nh * (nope + dv)];
                b.matmul(kv_b, &latent, &mut up)?;
                let mut k = vec![0f32; n * nh * dk];
                let mut v = vec![0f32; n * nh * dv];
                for t in 0..n {
                    let k_pe = &kv[t * (kl + nr) + kl..(t + 1) * (kl + nr)];
                    for hd in 0..nh {
                        let src = &up[(t * nh + hd) * (nope + dv)..(t * nh + hd + 1) * (nope + dv)];
                        let kd = &mut k[(t * nh + hd) * dk..(t * nh + hd + 1) * dk];
                        kd[..nope].copy_from_slice(&src[..nope]);
                        kd[nope..].copy_from_slice(k_pe);
                        v[(t * nh + hd) * dv..(t * nh + hd + 1) * dv].copy_from_slice(&src[nope..]);
                    }
                }
                let shape = AttnShape { n_head: nh, n_head_kv: nh, dk, dv, scale: self.kq_scale };
                attend(b, cache, il, ub, Qkv { q: &q, k: &k, v: Some(&v) }, shape)
            }
        }
    }

    /// Absorbed MLA for `tokens` of the micro-batch (rows cached): `q_h' = [W_kb,h q_nope,h ;
    /// q_pe,h]` against the cached `[latent ; k_pe]`, each head's latent output decompressed by
    /// `W_vb,h`. `q` is the whole micro-batch's; returns `[tokens.len()][n_head * dv]`.
    #[allow(clippy::too_many_arguments)]
    fn absorbed(
        &self,
        b: &dyn Backend,
        cache: &KvCache,
        il: usize,
        ub: &Ubatch,
        tokens: &[usize],
        q: &[f32],
        k_b: &Weight,
        v_b: &Weight,
    ) -> Result<Vec<f32>> {
        let n = tokens.len();
        let (nh, dk, dv, nr, kl) = (self.n_head, self.dk, self.dv, self.n_rot, self.kv_lora);
        let nope = dk - nr;
        let dq = kl + nr;
        let mut qcur = vec![0f32; n * nh * dq];
        // Each head's `q_nope` rows; for one token they are in place in `q`.
        let q_nope: Vec<Vec<f32>> = match tokens {
            [_] => Vec::new(),
            _ => (0..nh)
                .map(|hd| {
                    let mut v = Vec::with_capacity(n * nope);
                    for &t in tokens {
                        v.extend_from_slice(&q[(t * nh + hd) * dk..(t * nh + hd) * dk + nope]);
                    }
                    v
                })
                .collect(),
        };
        let xs: Vec<&[f32]> = match tokens {
            &[t] => (0..nh).map(|hd| &q[(t * nh + hd) * dk..(t * nh + hd) * dk + nope]).collect(),
            _ => q_nope.iter().map(|v| &v[..]).collect(),
        };
        let groups: Vec<(usize, usize)> = (0..nh).map(|hd| (hd * kl, kl)).collect();
        let mut absorbed = vec![vec![0f32; n * kl]; nh];
        b.matmul_groups(k_b, &groups, &xs, &mut absorbed)?;
        for (hd, absorbed) in absorbed.iter().enumerate() {
            for (i, &t) in tokens.iter().enumerate() {
                let dst = &mut qcur[(i * nh + hd) * dq..(i * nh + hd + 1) * dq];
                dst[..kl].copy_from_slice(&absorbed[i * kl..(i + 1) * kl]);
                dst[kl..].copy_from_slice(&q[(t * nh + hd) * dk + nope..(t * nh + hd + 1) * dk]);
            }
        }
        let shape = AttnShape { n_head: nh, n_head_kv: 1, dk: dq, dv: kl, scale: self.kq_scale };
        let lat = attend_cached(b, cache, il, ub, tokens, &qcur, false, shape)?;
        // Decompress each head's latent output with W_vb,h (for one token, in place in `lat`).
        let lat_h: Vec<Vec<f32>> = match n {
            1 => Vec::new(),
            _ => (0..nh)
                .map(|hd| {
                    let mut v = Vec::with_capacity(n * kl);
                    for i in 0..n {
                        v.extend_from_slice(&lat[(i * nh + hd) * kl..(i * nh + hd + 1) * kl]);
                    }
                    v
                })
                .collect(),
        };
        let xs: Vec<&[f32]> = match n {
            1 => lat.chunks_exact(kl).collect(),
            _ => lat_h.iter().map(|v| &v[..]).collect(),
        };
        let groups: Vec<(usize, usize)> = (0..nh).map(|hd| (hd * dv, dv)).collect();
        let mut ys = vec![vec![0f32; n * dv]; nh];
        b.matmul_groups(v_b, &groups, &xs, &mut ys)?;
        let mut o = vec![0f32; n * nh * dv];
        for (hd, y) in ys.iter().enumerate() {
            for i in 0..n {
                o[(i * nh + hd) * dv..(i * nh + hd + 1) * dv].copy_from_slice(&y[i * dv..(i + 1) * dv]);
            }
        }
        Ok(o)
    }

    /// Whether a run of tokens attending `n_kv` rows each takes the decompressed form: by `mode`,
    /// or under `Auto` when it costs fewer multiply-adds per head than the absorbed form, products
    /// of quantized weights (int8) counted at a third of an f32 one (on the bench model with 2
    /// threads the forms break even at about 100 tokens, at depth 0 and at 3072). Absorbed:
    /// `2 kv_lora + n_rot` per token and row, plus `W_kb` on each query and `W_vb` on each output.
    /// Decompressed: `nope + n_rot + dv` per token and row, plus rebuilding every row's key and
    /// value. The key rebuild is counted as an f32 product although it runs quantized since the
    /// keys' Q8_0 matrix (`CpuBackend`): so weighted, the model switches at 116 tokens at depth
    /// 3072, where the two forms measured alike at 96 tokens (Zen 5, 2 threads, 2026-12-02);
    /// counted at a third it would switch at 58, where the absorbed form was 20% faster (64
    /// tokens: 100-122 against 87-92 t/s).
    fn decompress(&self, mode: MlaMode, n_kv: &[usize]) -> bool {
        match mode {
            MlaMode::Absorbed => false,
            MlaMode::Decompressed => true,
            MlaMode::Auto => decompress_pays(self.kv_lora, self.n_rot, self.dk - self.n_rot, self.dv, n_kv),
        }
    }
}

/// The cost model of [`Deepseek2::decompress`] under `Auto`.
fn decompress_pays(kv_lora: usize, n_rot: usize, nope: usize, dv: usize, n_kv: &[usize]) -> bool {
    let (kl, nr, nope, dv) = (kv_lora as f64, n_rot as f64, nope as f64, dv as f64);
    let pairs: f64 = n_kv.iter().map(|&k| k as f64).sum();
    let (n, rows) = (n_kv.len() as f64, n_kv.iter().copied().max().unwrap_or(0) as f64);
    let absorbed = pairs * (2.0 * kl + nr) + n * (nope * kl + kl * dv) / 3.0;
    let decompressed = pairs * (nope + nr + dv) + rows * (nope * kl + kl * dv / 3.0);
    decompressed < absorbed
}

/// The micro-batch's token indices per sequence, in order of first appearance.
fn by_sequence(ub: &Ubatch) -> Vec<(usize, Vec<usize>)> {
    let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
    for t in 0..ub.len() {
        match out.iter_mut().find(|(s, _)| *s == ub.seq[t]) {
            Some((_, v)) => v.push(t),
            None => out.push((ub.seq[t], vec![t])),
        }
    }
    out
}

impl Layers for Deepseek2 {
    fn layout(&self) -> KvLayout {
        let n_layer = self.layers.len();
        if self.mla {
            let row = self.kv_lora + self.n_rot;
            KvLayout { n_layer, k_row: row, v_row: 0, k_head: row, v_head: self.kv_lora }
        } else {
            KvLayout {
                n_layer,
                k_row: self.n_head * self.dk,
                v_row: self.n_head * self.dv,
                k_head: self.dk,
                v_head: self.dv,
            }
        }
    }

    fn forward_layer(&self, il: usize, b: &dyn Backend, cache: &mut KvCache, ub: &Ubatch, x: &mut [f32]) -> Result<()> {
        let ly = &self.layers[il];
        let n = ub.len();
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.n_embd, Some(&ly.attn_norm), self.eps);
        let o = self.attention(ly, il, b, cache, ub, &h)?;
        let mut attn = vec![0f32; n * self.n_embd];
        b.matmul(&ly.wo, &o, &mut attn)?;
        b.add(x, &attn);
        let mut h = x.to_vec();
        b.rmsnorm(&mut h, self.n_embd, Some(&ly.ffn_norm), self.eps);
        let out = match &ly.ffn {
            Ffw::Dense(f) => f.forward(b, &h, n)?,
            Ffw::Moe { moe, shared } => moe.forward(b, &h, n, shared.as_ref())?,
        };
        b.add(x, &out);
        Ok(())
    }

    fn eps(&self) -> f32 {
        self.eps
    }
}

#[cfg(test)]
mod tests {
    use super::decompress_pays;

    /// Kimi's shapes (latent 512, rope 64, nope 128, dv 128), as measured with `tandem bench
    /// --mla` on the bench model: decoding and short runs stay absorbed; prompt runs of 256 and
    /// 512 tokens at depth 0 and 3072 are decompressed; 64 tokens at depth 3072 stay absorbed
    /// (decompressed was 1.3x slower there); 160 tokens at 3072 are decompressed (1.2x faster).
    #[test]
    fn auto_decompresses_long_runs_only() {
        let run = |depth: usize, n: usize| (depth + 1..=depth + n).collect::<Vec<_>>();
        let pays = |depth, n| decompress_pays(512, 64, 128, 128, &run(depth, n));
        for depth in [0, 100, 3072, 100_000] {
            assert!(!pays(depth, 1), "decode at {depth}");
        }
        assert!(!pays(3072, 64) && !pays(0, 16) && !pays(0, 64));
        assert!(pays(3072, 160) && pays(0, 160));
        assert!(pays(0, 256) && pays(0, 512) && pays(3072, 256) && pays(3072, 512));
        assert!(!decompress_pays(512, 64, 128, 128, &[]));
    }
}
