//! `deepseek2`: Kimi K2 / K2.5, DeepSeek V3 / R1 (llama.cpp src/models/deepseek2.cpp).
//!
//! Multi-head latent attention in both GGUF flavours: mainline MLA files carry `attn_k_b` and
//! `attn_v_b` and are run in the absorbed form over a latent cache (one row of
//! `kv_lora_rank + n_rot` values per position, V read from its latent part); legacy files carry
//! `attn_kv_b` and are run as ordinary multi-head attention. MoE layers after
//! `leading_dense_block_count` dense ones, with shared experts.

use crate::common::{AttnShape, Ffn, Ubatch};
use crate::config::{Arch, Keys, RopeConfig, MAX_CTX, MAX_EXPERTS, MAX_HEADS, MAX_HEAD_DIM, MAX_WIDTH};
use crate::context::Layers;
use crate::device::{AttnCall, MlaCall};
use crate::exec::{Copy2d, DevId, Exec, Heads, MlaShape, Rows, Tensor};
use crate::kv_cache::{KvCache, KvLayout};
use crate::moe::{Moe, RouterParams};
use crate::weights::{Vector, Weight, WeightLoader};
use crate::{model_err, MlaMode, Result};
use tandem_cpu::RopeStyle;

enum Query {
    /// `attn_q_a` [n_embd] -> [q_lora], its norm, `attn_q_b` [q_lora] -> [n_head * dk].
    Lora { a: Weight, norm: Vector, b: Weight },
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
    attn_norm: Vector,
    q: Query,
    kv_a: Weight, // [n_embd] -> [kv_lora + n_rot]
    kv_a_norm: Vector,
    kv_up: KvUp,
    wo: Weight, // [n_head * dv] -> [n_embd]
    ffn_norm: Vector,
    ffn: Ffw,
}

pub(crate) struct Deepseek2 {
    layers: Vec<Layer>,
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
        let n_layer = keys.block_count(l)?;
        let n_head = keys.uniform_u32("attention.head_count")?.ok_or_else(|| model_err("missing head_count"))?;
        let n_head = keys.in_range("attention.head_count", n_head, 1, MAX_HEADS)?;
        let kv_lora = keys.count("attention.kv_lora_rank", 1, MAX_WIDTH)?;
        let q_lora = keys.opt_count("attention.q_lora_rank", 0, MAX_WIDTH)?.unwrap_or(0);
        let k_mla = keys.opt_count("attention.key_length_mla", 0, MAX_HEAD_DIM)?.unwrap_or(0);
        let v_mla = keys.opt_count("attention.value_length_mla", 0, MAX_HEAD_DIM)?.unwrap_or(0);
        let mla = k_mla != 0 && v_mla != 0;
        let (dk, dv) = if mla {
            (k_mla, v_mla)
        } else {
            (
                keys.count("attention.key_length", 1, MAX_HEAD_DIM)?,
                keys.count("attention.value_length", 1, MAX_HEAD_DIM)?,
            )
        };
        let n_rot = keys.rope_dims(dk)?;
        if dk <= n_rot {
            return Err(model_err(format!("deepseek2: key length {dk} must exceed the rope dimension {n_rot}")));
        }
        let nope = dk - n_rot;
        let eps = keys.eps()?;
        let n_ctx_train = keys.count("context_length", 1, MAX_CTX)?;
        let rope = RopeConfig::load(keys, Arch::Deepseek2, n_rot, RopeStyle::Norm, n_ctx_train)?;
        // llama.cpp pre-scales kq_scale for YaRN (deepseek2.cpp, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
        let inv_fs_ln = (1.0 / rope.params.freq_scale).ln();
        let attn_factor_org = rope.params.attn_factor * (1.0 + 0.1 * inv_fs_ln);
        let mscale = attn_factor_org * (1.0 + 0.1 * rope.yarn_log_mul * inv_fs_ln);
        let kq_scale = mscale * mscale / (dk as f32).sqrt();

        let n_dense = keys.opt_count("leading_dense_block_count", 0, n_layer)?.unwrap_or(0);
        let n_ff = keys.opt_count("feed_forward_length", 0, MAX_WIDTH)?.unwrap_or(0);
        let n_expert = keys.opt_count("expert_count", 0, MAX_EXPERTS)?.unwrap_or(0);
        let routing = RouterParams {
            n_expert,
            n_used: keys.opt_count("expert_used_count", 0, MAX_EXPERTS)?.unwrap_or(0),
            gating: crate::moe::gating_from_id(keys.opt_u32("expert_gating_func")?.unwrap_or(0))?,
            norm: keys.opt_bool("expert_weights_norm")?.unwrap_or(false),
            scale: keys.opt_f32("expert_weights_scale")?.unwrap_or(0.0),
            n_group: keys.opt_count("expert_group_count", 0, MAX_EXPERTS)?.unwrap_or(0),
            n_group_used: keys.opt_count("expert_group_used_count", 0, MAX_EXPERTS)?.unwrap_or(0),
        };
        let n_ff_exp = keys.uniform_u32("expert_feed_forward_length")?.unwrap_or(0);
        let n_ff_exp = keys.in_range("expert_feed_forward_length", n_ff_exp, 0, MAX_WIDTH)?;
        let n_shared = keys.opt_count("expert_shared_count", 0, 64)?.unwrap_or(0);

        let mut layers = Vec::with_capacity(n_layer);
        for il in 0..n_layer {
            let p = |n: &str| format!("blk.{il}.{n}.weight");
            let q = if q_lora > 0 {
                Query::Lora {
                    a: l.get(&p("attn_q_a"), &[n_embd, q_lora])?,
                    norm: l.vector(&p("attn_q_a_norm"), q_lora)?,
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
                attn_norm: l.vector(&p("attn_norm"), n_embd)?,
                q,
                kv_a: l.get(&p("attn_kv_a_mqa"), &[n_embd, kv_lora + n_rot])?,
                kv_a_norm: l.vector(&p("attn_kv_a_norm"), kv_lora)?,
                kv_up,
                wo: l.get(&p("attn_output"), &[n_head * dv, n_embd])?,
                ffn_norm: l.vector(&p("ffn_norm"), n_embd)?,
                ffn,
            });
        }
        Ok(Deepseek2 { layers, n_head, dk, dv, n_rot, kv_lora, mla, kq_scale, eps, rope })
    }

    fn mla_shape(&self) -> MlaShape {
        MlaShape {
            n_head: self.n_head,
            nope: self.dk - self.n_rot,
            n_rot: self.n_rot,
            kv_lora: self.kv_lora,
            dv: self.dv,
        }
    }

    /// Attention of one layer: returns `[n][n_head * dv]` before `attn_output`.
    fn attention(
        &self,
        ly: &Layer,
        il: usize,
        ex: &Exec,
        cache: &mut KvCache,
        ub: &Ubatch,
        h: &Tensor,
    ) -> Result<Tensor> {
        let n = ub.len();
        let (nh, dk, dv, nr, kl) = (self.n_head, self.dk, self.dv, self.n_rot, self.kv_lora);
        let nope = dk - nr;
        // q: [n][n_head * dk]; kv: [n][kv_lora + n_rot], the latent and the shared rotary key,
        // computed with the first projection of the query, which takes the same input.
        let (mut q, mut kv) = match &ly.q {
            Query::Lora { a, norm, b: wb } => {
                let mut r = ex.matmul_same_input(&[a, &ly.kv_a], h)?.into_iter();
                let (Some(mut qa), Some(kv)) = (r.next(), r.next()) else { unreachable!("two products asked") };
                ex.rmsnorm_in_place(&mut qa, norm, Rows::dense(a.rows()), self.eps)?;
                (ex.matmul(wb, &qa)?, kv)
            }
            Query::Full(w) => {
                let mut r = ex.matmul_same_input(&[w, &ly.kv_a], h)?.into_iter();
                let (Some(q), Some(kv)) = (r.next(), r.next()) else { unreachable!("two products asked") };
                (q, kv)
            }
        };
        let row = kl + nr;
        ex.rope(&mut kv, ub, Heads { row, n_heads: 1, head: row, off: kl }, RopeStyle::Norm)?;
        ex.rmsnorm_in_place(&mut kv, &ly.kv_a_norm, Rows { stride: row, off: 0, dim: kl }, self.eps)?;
        ex.rope(&mut q, ub, Heads { row: nh * dk, n_heads: nh, head: dk, off: nope }, RopeStyle::Norm)?;
        match &ly.kv_up {
            KvUp::Mla { k_b, v_b } => {
                ex.kv_store(cache, il, ub, &kv, None)?;
                let shape = self.mla_shape();
                // Each sequence's run of tokens in the form that costs less; the rest absorbed.
                // Under the default (absorbed) form there is nothing to choose per sequence.
                let runs = if ub.mla == MlaMode::Absorbed { Vec::new() } else { by_sequence(ub) };
                if runs.is_empty() {
                    let tokens: Vec<usize> = (0..n).collect();
                    return self.absorbed(ex, cache, il, ub, &tokens, &q, k_b, v_b);
                }
                let mut o = ex.zeros(q.dev(), n * nh * dv)?;
                let mut absorbed: Vec<usize> = Vec::new();
                for (seq, tokens) in runs {
                    let n_kv: Vec<usize> = tokens.iter().map(|&t| ub.pos[t] as usize + 1).collect();
                    if self.decompress(ub.mla, &n_kv, cache.rebuilt_rows(il, seq)) {
                        let qs = ex.gather_rows(&q, nh * dk, &tokens)?;
                        let c = MlaCall { il, seq, n_kv: &n_kv, k_b, v_b, s: shape, scale: self.kq_scale };
                        if let Some(out) = ex.mla_decompressed(cache, &qs, &c)? {
                            ex.scatter_rows(&mut o, &out, nh * dv, &tokens)?;
                            continue;
                        }
                    }
                    absorbed.extend(tokens);
                }
                if !absorbed.is_empty() {
                    let qs = ex.gather_rows(&q, nh * dk, &absorbed)?;
                    let out = self.absorbed(ex, cache, il, ub, &absorbed, &qs, k_b, v_b)?;
                    ex.scatter_rows(&mut o, &out, nh * dv, &absorbed)?;
                }
                Ok(o)
            }
            KvUp::Legacy(kv_b) => {
                // The latent, up-projected to each head's nope key and value.
                let mut latent = ex.zeros(kv.dev(), n * kl)?;
                let c =
                    Copy2d { rows: n, width: kl, src_stride: row, src_off: 0, src_rep: 1, dst_stride: kl, dst_off: 0 };
                ex.copy_rows(&mut latent, &kv, c)?;
                let up = ex.matmul(kv_b, &latent)?;
                let (d, hw) = (up.dev(), nope + dv);
                let mut k = ex.zeros(d, n * nh * dk)?;
                let mut v = ex.zeros(d, n * nh * dv)?;
                let rows = n * nh;
                let c =
                    Copy2d { rows, width: nope, src_stride: hw, src_off: 0, src_rep: 1, dst_stride: dk, dst_off: 0 };
                ex.copy_rows(&mut k, &up, c)?;
                // The shared rotary key into every head.
                let c = Copy2d {
                    rows,
                    width: nr,
                    src_stride: row,
                    src_off: kl,
                    src_rep: nh,
                    dst_stride: dk,
                    dst_off: nope,
                };
                ex.copy_rows(&mut k, &kv, c)?;
                let c =
                    Copy2d { rows, width: dv, src_stride: hw, src_off: nope, src_rep: 1, dst_stride: dv, dst_off: 0 };
                ex.copy_rows(&mut v, &up, c)?;
                ex.kv_store(cache, il, ub, &k, Some(&v))?;
                let shape = AttnShape { n_head: nh, n_head_kv: nh, dk, dv, scale: self.kq_scale };
                let tokens: Vec<usize> = (0..n).collect();
                ex.attention(cache, &q, &AttnCall { il, ub, tokens: &tokens, s: shape, separate_v: true })
            }
        }
    }

    /// Absorbed MLA for `tokens` of the micro-batch (rows cached; `q` holds their queries):
    /// `q_h' = [W_kb,h q_nope,h ; q_pe,h]` against the cached `[latent ; k_pe]`, each head's latent
    /// output decompressed by `W_vb,h`. Returns `[tokens.len()][n_head * dv]`.
    #[allow(clippy::too_many_arguments)]
    fn absorbed(
        &self,
        ex: &Exec,
        cache: &KvCache,
        il: usize,
        ub: &Ubatch,
        tokens: &[usize],
        q: &Tensor,
        k_b: &Weight,
        v_b: &Weight,
    ) -> Result<Tensor> {
        let s = self.mla_shape();
        let qcur = ex.mla_q(k_b, q, s)?;
        let shape =
            AttnShape { n_head: s.n_head, n_head_kv: 1, dk: s.kv_lora + s.n_rot, dv: s.kv_lora, scale: self.kq_scale };
        let lat = ex.attention(cache, &qcur, &AttnCall { il, ub, tokens, s: shape, separate_v: false })?;
        ex.mla_out(v_b, &lat, s)
    }

    /// Whether a run of tokens attending `n_kv` rows each takes the decompressed form: by `mode`,
    /// or under `Auto` when it costs fewer multiply-adds per head than the absorbed form, products
    /// of quantized weights (int8) counted at a third of an f32 one. Absorbed: `2 kv_lora +
    /// n_rot` per token and row, plus `W_kb` on each query and `W_vb` on each output (quantized).
    /// Decompressed: `nope + n_rot + dv` per token and row, plus rebuilding the key and value of
    /// every row but the `kept` ones (f32 products since `CpuBackend` rebuilds them exactly),
    /// plus reading the kept ones from memory once per 64 tokens, counted at
    /// [`KEPT_READ_COST`] a value. So without kept rows the model switches at about 180 tokens
    /// at depth 3072 (on the bench model with 2 threads, Zen 4, 2026-12-05: the forms measured
    /// alike at 192 tokens, absorbed 1.3x faster at 128 and decompressed 1.13x at 256, 1.54x at
    /// 512), and with the rows of that depth kept at about 12 tokens (Zen 3, 2026-12-07:
    /// absorbed 38.8 t/s against 24.7 at 8 tokens, 29.6 against 44.8 at 16, 32.7 against 57.2
    /// at 32).
    fn decompress(&self, mode: MlaMode, n_kv: &[usize], kept: usize) -> bool {
        match mode {
            MlaMode::Absorbed => false,
            MlaMode::Decompressed => true,
            MlaMode::Auto => decompress_pays(self.kv_lora, self.n_rot, self.dk - self.n_rot, self.dv, n_kv, kept),
        }
    }
}

/// What reading a kept rebuilt value (f32, from memory: 50 MB a layer for the bench model at
/// depth 3072) costs the decompressed form in multiply-adds, for [`decompress_pays`]: fitted to
/// the crossing measured at depth 3072 (see [`Deepseek2::decompress`]).
const KEPT_READ_COST: f64 = 32.0;

/// The cost model of [`Deepseek2::decompress`] under `Auto`.
fn decompress_pays(kv_lora: usize, n_rot: usize, nope: usize, dv: usize, n_kv: &[usize], kept: usize) -> bool {
    let (kl, nr, nope, dv) = (kv_lora as f64, n_rot as f64, nope as f64, dv as f64);
    let pairs: f64 = n_kv.iter().map(|&k| k as f64).sum();
    let n_rows = n_kv.iter().copied().max().unwrap_or(0);
    let (n, rows, kept) = (n_kv.len() as f64, n_rows as f64, kept.min(n_rows) as f64);
    let absorbed = pairs * (2.0 * kl + nr) + n * (nope * kl + kl * dv) / 3.0;
    let reads = (n / 64.0).ceil() * kept * (nope + dv) * KEPT_READ_COST;
    let decompressed = pairs * (nope + nr + dv) + (rows - kept) * (nope * kl + kl * dv) + reads;
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

    fn forward_layer(&self, il: usize, ex: &Exec, cache: &mut KvCache, ub: &Ubatch, x: &mut Tensor) -> Result<()> {
        let ly = &self.layers[il];
        // The residual stream lives where the layer's attention runs.
        ex.move_to(x, ex.dev_of(&ly.attn_norm.name))?;
        let h = ex.rmsnorm(x, &ly.attn_norm, self.eps)?;
        let o = self.attention(ly, il, ex, cache, ub, &h)?;
        let attn = ex.matmul(&ly.wo, &o)?;
        ex.add(x, &attn)?;
        let h = ex.rmsnorm(x, &ly.ffn_norm, self.eps)?;
        let out = match &ly.ffn {
            Ffw::Dense(f) => ex.ffn(f, &h)?,
            Ffw::Moe { moe, shared } => ex.moe(moe, shared.as_ref(), &h)?,
        };
        ex.add(x, &out)
    }

    fn kv_device(&self, il: usize, ex: &Exec) -> DevId {
        ex.kv_device(ex.dev_of(&self.layers[il].kv_a.name))
    }

    fn first_device(&self, ex: &Exec) -> DevId {
        self.layers.first().map_or(crate::exec::CPU, |l| ex.dev_of(&l.attn_norm.name))
    }

    fn rope(&self) -> &RopeConfig {
        &self.rope
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
    /// 512 tokens at depth 0 and 3072 are decompressed; 64 and 128 tokens at depth 3072 stay
    /// absorbed (decompressed was 1.3x slower at 128) unless the rows of that depth are kept,
    /// when 16 tokens are decompressed and 8 are not.
    #[test]
    fn auto_decompresses_long_runs_only() {
        let run = |depth: usize, n: usize| (depth + 1..=depth + n).collect::<Vec<_>>();
        let pays = |depth, n| decompress_pays(512, 64, 128, 128, &run(depth, n), 0);
        for depth in [0, 100, 3072, 100_000] {
            assert!(!pays(depth, 1), "decode at {depth}");
        }
        assert!(!pays(3072, 64) && !pays(3072, 128) && !pays(0, 16) && !pays(0, 64));
        assert!(pays(0, 256) && pays(0, 512) && pays(3072, 256) && pays(3072, 512));
        assert!(!decompress_pays(512, 64, 128, 128, &[], 0));
        // The depth's rows kept (more than the rows attended counts as all of them).
        let kept = |depth, n, kept| decompress_pays(512, 64, 128, 128, &run(depth, n), kept);
        for depth in [3072, 100_000] {
            assert!(!kept(depth, 1, depth) && !kept(depth, 8, depth), "decode at {depth}");
            assert!(kept(depth, 16, depth) && kept(depth, 64, depth) && kept(depth, 128, usize::MAX), "{depth}");
        }
        assert!(!kept(3072, 16, 0) && !kept(3072, 64, 1000));
    }
}
