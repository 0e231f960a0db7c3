//! Multi-head latent attention in the decompressed form, for a run of tokens of one sequence
//! (a prefill). The absorbed form (what llama.cpp runs, and tandem for decoding) attends over the
//! cached latent: per token, head and cached row it spends `kv_lora + n_rot` multiply-adds on the
//! score and `kv_lora` on the value. Here every cached row's key and value are first rebuilt per
//! head (`k_nope = W_kb^T latent`, `v = W_vb latent`, by the caller, as exact f32 products), once
//! for the whole run, and then the run attends as ordinary multi-head attention with
//! `nope + n_rot` and `dv` per row: at a depth of thousands of rows and a few hundred tokens that
//! is two to three times fewer operations. The attention's products are f32 matrix products
//! ([`crate::gemm`]) with the cached rows as the long dimension of every operand (no transposed
//! copy of the latent), and the softmax runs down the columns of the scores, 16 (or 8) tokens per
//! vector, with ggml's vector exp.

use crate::attention::KvType;
use crate::gemm::{gemm, Dims};
use crate::vmath::Level;
use rayon::prelude::*;

/// Tokens per block of scores.
const TB: usize = 64;

/// The heads of multi-head latent attention: `n_head` queries of `nope + n_rot` values (the part
/// without rope, then the rotary part), cached rows of a `kv_lora`-value latent and the shared
/// `n_rot`-value rotary key, values of `dv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaHeads {
    pub n_head: usize,
    pub nope: usize,
    pub n_rot: usize,
    pub kv_lora: usize,
    pub dv: usize,
}

/// The decompressed attention of `n = n_kv.len()` tokens of one sequence.
pub struct MlaPrefill<'a> {
    /// `[n][n_head][nope + n_rot]`: the queries after rope.
    pub q: &'a [f32],
    pub heads: MlaHeads,
    /// The cached rows as f32, `[rows][kv_lora + n_rot]`: the latent, then the rotary key
    /// ([`cache_rows_f32`]).
    pub kv: &'a [f32],
    /// The keys rebuilt from the latent (`attn_k_b` transposed times each cached latent), per
    /// head `[rows][nope]` (at least `rows` rows): consecutive rows, as the products read them.
    pub k: &'a [&'a [f32]],
    /// The values rebuilt from the latent (`attn_v_b` times each cached latent), per head
    /// `[rows][dv]`.
    pub v: &'a [&'a [f32]],
    /// Rows each token attends (its position + 1), each in `1..=rows`.
    pub n_kv: &'a [usize],
    pub scale: f32,
}

impl MlaPrefill<'_> {
    fn dk(&self) -> usize {
        self.heads.nope + self.heads.n_rot
    }

    fn check(&self, out: &[f32]) -> crate::Result<usize> {
        let n = self.n_kv.len();
        let row = self.heads.kv_lora + self.heads.n_rot;
        let rows = self.kv.len() / row.max(1);
        let heads = self.heads.n_head;
        let ok = row > 0
            && self.heads.nope > 0
            && self.heads.dv > 0
            && Some(self.q.len()) == n.checked_mul(heads * self.dk())
            && Some(out.len()) == n.checked_mul(heads * self.heads.dv)
            && self.k.len() == heads
            && self.v.len() == heads
            && rows.checked_mul(self.heads.nope).is_some_and(|need| self.k.iter().all(|k| k.len() >= need))
            && rows.checked_mul(self.heads.dv).is_some_and(|need| self.v.iter().all(|v| v.len() >= need))
            && self.n_kv.iter().all(|&k| (1..=rows).contains(&k));
        if !ok {
            return Err(crate::Error::Shape(format!(
                "decompressed MLA attention of {n} tokens ({heads} heads, nope {}, rope {}, latent {}, dv {}) over {rows} rows: shapes do not agree",
                self.heads.nope, self.heads.n_rot, self.heads.kv_lora, self.heads.dv
            )));
        }
        Ok(self.n_kv.iter().copied().max().unwrap_or(0))
    }
}

/// Rows `0..rows` of a cache (`row` values each, in `ty`) as f32, converted on `pool`.
pub fn cache_rows_f32(
    pool: &rayon::ThreadPool,
    bytes: &[u8],
    ty: KvType,
    rows: usize,
    row: usize,
) -> crate::Result<Vec<f32>> {
    let row_bytes = ty.bytes(row);
    if row == 0 || !row.is_multiple_of(ty.block()) || rows.checked_mul(row_bytes).is_none_or(|n| bytes.len() < n) {
        return Err(crate::Error::Shape(format!(
            "{rows} cached rows of {row} {ty:?} values: cache too short or rows not whole blocks"
        )));
    }
    // Rows per task.
    const RB: usize = 64;
    let mut out = vec![0f32; rows * row];
    pool.install(|| {
        out.par_chunks_mut(RB * row).zip(bytes[..rows * row_bytes].par_chunks(RB * row_bytes)).for_each(|(o, b)| {
            let mut h = vec![half::f16::ZERO; if ty == KvType::F16 { row } else { 0 }];
            for (o, b) in o.chunks_exact_mut(row).zip(b.chunks_exact(row_bytes)) {
                if ty == KvType::F16 {
                    // The vector conversion (F16C where the machine has it): the same values, 2-3x faster.
                    use half::slice::HalfFloatSliceExt;
                    for (v, c) in h.iter_mut().zip(b.chunks_exact(2)) {
                        *v = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                    }
                    h.convert_to_f32_slice(o);
                } else {
                    crate::attention::row_f32(ty, b, o);
                }
            }
        })
    });
    Ok(out)
}

/// Computes `out` (`[n][n_head][dv]`) on `pool`, one head per task: each head's arithmetic is
/// the same on any number of threads, and each token's result depends only on its query, its
/// `n_kv` and the rows (not on the other tokens of the run).
pub fn mla_prefill(pool: &rayon::ThreadPool, a: &MlaPrefill, out: &mut [f32]) -> crate::Result<()> {
    mla_prefill_at(pool, a, out, Level::detected())
}

/// [`mla_prefill`] at `level`.
fn mla_prefill_at(pool: &rayon::ThreadPool, a: &MlaPrefill, out: &mut [f32], level: Level) -> crate::Result<()> {
    let cols = a.check(out)?;
    let (n, nh, dv) = (a.n_kv.len(), a.heads.n_head, a.heads.dv);
    if n == 0 {
        return Ok(());
    }
    let per_head: Vec<Vec<f32>> =
        pool.install(|| (0..nh).into_par_iter().with_max_len(1).map(|h| one_head(a, h, cols, level)).collect());
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..n {
            out[(t * nh + h) * dv..(t * nh + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    Ok(())
}

/// Head `h` for every token: `[n][dv]`. Everything is kept with the cached rows as the long
/// dimension (keys `[cols][nope]`, scores `[cols][tokens]`), so no operand is transposed but a
/// block of queries, and the softmax runs down the columns, one token per lane.
fn one_head(a: &MlaPrefill, h: usize, cols: usize, level: Level) -> Vec<f32> {
    let (n, nh, nope, nr, kl, dv, dk) =
        (a.n_kv.len(), a.heads.n_head, a.heads.nope, a.heads.n_rot, a.heads.kv_lora, a.heads.dv, a.dk());
    let row = kl + nr;
    // This head's keys `[rows][nope]` and values `[rows][dv]`, consecutive rows (the products
    // read rows `nh * dv` apart 30% slower).
    let (kb, ldk) = (a.k[h], nope);
    let (vb, ldv) = (a.v[h], dv);
    let mut o = vec![0f32; n * dv];
    let mut qt = vec![0f32; dk * TB];
    let mut st = vec![0f32; cols * TB.min(n)];
    for t0 in (0..n).step_by(TB) {
        let t1 = (t0 + TB).min(n);
        let tb = t1 - t0;
        let n_kv = &a.n_kv[t0..t1];
        let nk = n_kv.iter().copied().max().unwrap_or(0);
        // The block's queries transposed, `[dk][tb]`.
        let qt = &mut qt[..dk * tb];
        for t in 0..tb {
            let q = &a.q[((t0 + t) * nh + h) * dk..][..dk];
            for (i, v) in q.iter().enumerate() {
                qt[i * tb + t] = *v;
            }
        }
        // Scores `[nk][tb]`: the rebuilt keys, then the rotary keys, one chain per score.
        let st = &mut st[..nk * tb];
        st.fill(0.0);
        gemm(Dims { m: nk, n: tb, k: nope, lda: ldk, ka: 1, ldb: tb, ldc: tb }, kb, qt, st, level);
        gemm(Dims { m: nk, n: tb, k: nr, lda: row, ka: 1, ldb: tb, ldc: tb }, &a.kv[kl..], &qt[nope * tb..], st, level);
        let inv = softmax_columns(st, n_kv, a.scale, level);
        // The weighted values of the unnormalized probabilities, then 1 / sum per token.
        let o = &mut o[t0 * dv..t1 * dv];
        gemm(Dims { m: tb, n: dv, k: nk, lda: 1, ka: tb, ldb: ldv, ldc: dv }, st, vb, o, level);
        for (o, s) in o.chunks_exact_mut(dv).zip(&inv) {
            o.iter_mut().for_each(|v| *v *= s);
        }
    }
    o
}

/// Rows summed in f32 before each addition to a token's f64 sum.
const SUM_ROWS: usize = 32;

/// `s` is `[rows][tokens]` (`tokens = n_kv.len()`): token `t` attends rows `0..n_kv[t]`.
/// Replaces each attended score by `e^(scale s - max)` (the token's largest `scale s`), every
/// other by 0, and returns each token's `1 / sum`. A token's lane sees only its own column, in
/// row order, so its result does not depend on the other tokens or on the level (AVX-512 and
/// AVX2 give the same bits; the scalar code differs only in its `exp`).
fn softmax_columns(s: &mut [f32], n_kv: &[usize], scale: f32, level: Level) -> Vec<f32> {
    let tb = n_kv.len();
    let mut max = vec![f32::NEG_INFINITY; tb];
    let mut sum = vec![0f64; tb];
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar {
        // SAFETY: the level's instructions are present (Level::detected or a test that checked).
        unsafe { x86::softmax_columns(s, n_kv, scale, &mut max, &mut sum, level == Level::Avx2) };
        return sum.iter().map(|&x| (1.0 / x) as f32).collect();
    }
    let _ = level;
    for (r, sr) in s.chunks_exact(tb).enumerate() {
        for ((m, &v), &len) in max.iter_mut().zip(sr).zip(n_kv) {
            if r < len {
                *m = m.max(v * scale);
            }
        }
    }
    let mut part = vec![0f32; tb];
    for (r, sr) in s.chunks_exact_mut(tb).enumerate() {
        for (t, v) in sr.iter_mut().enumerate() {
            *v = if r < n_kv[t] { (*v * scale - max[t]).exp() } else { 0.0 };
            part[t] += *v;
        }
        if (r + 1) % SUM_ROWS == 0 {
            sum.iter_mut().zip(&mut part).for_each(|(s, p)| *s += std::mem::take(p) as f64);
        }
    }
    sum.iter_mut().zip(&part).for_each(|(s, p)| *s += *p as f64);
    sum.iter().map(|&x| (1.0 / x) as f32).collect()
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        crate::test_data(seed, n).into_iter().map(|v| v * scale).collect()
    }

    struct Case {
        q: Vec<f32>,
        kv: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        n_kv: Vec<usize>,
        /// Each head's part of `k` and `v`.
        k_heads: Vec<std::ops::Range<usize>>,
        v_heads: Vec<std::ops::Range<usize>>,
    }

    const NH: usize = 3;
    const NOPE: usize = 24;
    const NR: usize = 8;
    const KL: usize = 40;
    const DV: usize = 20;

    fn case(n_kv: Vec<usize>) -> Case {
        let rows = n_kv.iter().copied().max().unwrap();
        let kv = rand(2, rows * (KL + NR), 1.0);
        // The keys and values rebuilt from the latent, as the caller's products give them.
        // `[head][row][d]`
        let rebuilt = |w: &[f32], d: usize| {
            let mut x = vec![0f32; rows * NH * d];
            for h in 0..NH {
                for r in 0..rows {
                    for i in 0..d {
                        let hd = h * d + i;
                        x[(h * rows + r) * d + i] = (0..KL).map(|j| w[hd * KL + j] * kv[r * (KL + NR) + j]).sum();
                    }
                }
            }
            x
        };
        let (k, v) = (rebuilt(&rand(3, NH * NOPE * KL, 0.3), NOPE), rebuilt(&rand(5, NH * DV * KL, 0.3), DV));
        let heads = |d: usize| (0..NH).map(|h| h * rows * d..(h + 1) * rows * d).collect();
        let (k_heads, v_heads) = (heads(NOPE), heads(DV));
        Case { q: rand(1, n_kv.len() * NH * (NOPE + NR), 1.0), kv, k, v, n_kv, k_heads, v_heads }
    }

    /// Each head's keys and values as slices of the case's.
    fn heads(c: &Case) -> (Vec<&[f32]>, Vec<&[f32]>) {
        (c.k_heads.iter().map(|r| &c.k[r.clone()]).collect(), c.v_heads.iter().map(|r| &c.v[r.clone()]).collect())
    }

    fn input<'a>(c: &'a Case, kh: &'a [&'a [f32]], vh: &'a [&'a [f32]]) -> MlaPrefill<'a> {
        MlaPrefill {
            q: &c.q,
            heads: MlaHeads { n_head: NH, nope: NOPE, n_rot: NR, kv_lora: KL, dv: DV },
            kv: &c.kv,
            k: kh,
            v: vh,
            n_kv: &c.n_kv,
            scale: 0.3,
        }
    }

    /// The textbook computation in f64 from the rebuilt keys and values: scores, softmax, weighted
    /// sum.
    fn reference(c: &Case) -> Vec<f64> {
        let dk = NOPE + NR;
        let rows = c.kv.len() / (KL + NR);
        let mut out = vec![0f64; c.n_kv.len() * NH * DV];
        for (t, &len) in c.n_kv.iter().enumerate() {
            for h in 0..NH {
                let q = &c.q[(t * NH + h) * dk..(t * NH + h + 1) * dk];
                let scores: Vec<f64> = (0..len)
                    .map(|r| {
                        let lat = &c.kv[r * (KL + NR)..(r + 1) * (KL + NR)];
                        let k = &c.k[(h * rows + r) * NOPE..(h * rows + r + 1) * NOPE];
                        let nope: f64 = (0..NOPE).map(|i| k[i] as f64 * q[i] as f64).sum();
                        let pe: f64 = (0..NR).map(|i| q[NOPE + i] as f64 * lat[KL + i] as f64).sum();
                        0.3 * (nope + pe)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..DV {
                    out[(t * NH + h) * DV + d] =
                        (0..len).map(|r| e[r] / sum * c.v[(h * rows + r) * DV + d] as f64).sum::<f64>();
                }
            }
        }
        out
    }

    fn levels() -> Vec<Level> {
        let mut l = vec![Level::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            let isa = crate::Isa::detected();
            if isa >= crate::Isa::Avx2 {
                l.push(Level::Avx2);
            }
            if isa >= crate::Isa::Avx512 {
                l.push(Level::Avx512);
            }
        }
        l
    }

    /// Against the f64 textbook computation; every level on one and two threads gives the bits of
    /// one thread at that level, and AVX-512 gives AVX2's (same chains, same softmax); a token's
    /// result does not depend on the run it is in.
    #[test]
    fn decompressed_attention_matches_the_textbook_and_is_invariant() {
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        // A prefill at depth 100 (positions 100..230), and a run whose positions are not in order.
        for n_kv in [(101..231).collect::<Vec<_>>(), vec![5, 1, 77, 3, 64, 65]] {
            let c = case(n_kv);
            let (kh, vh) = heads(&c);
            let want = reference(&c);
            let mut base = Vec::new();
            for level in levels() {
                let mut got = vec![0f32; want.len()];
                mla_prefill_at(&one, &input(&c, &kh, &vh), &mut got, level).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((*g as f64 - w).abs() < 2e-5, "{level:?} [{i}]: {g} vs {w}");
                }
                let mut par = vec![0f32; want.len()];
                mla_prefill_at(&two, &input(&c, &kh, &vh), &mut par, level).unwrap();
                assert!(par == got, "{level:?}: two threads differ from one");
                if level != Level::Scalar {
                    if base.is_empty() {
                        base = got;
                    } else {
                        assert!(base == got, "{level:?} differs from AVX2");
                    }
                }
                // Token 1 alone gives its bits in the run.
                let t = 1;
                let dk = NOPE + NR;
                let q1 = c.q[t * NH * dk..(t + 1) * NH * dk].to_vec();
                let n1 = [c.n_kv[t]];
                let single = MlaPrefill { q: &q1, n_kv: &n1, ..input(&c, &kh, &vh) };
                let mut alone = vec![0f32; NH * DV];
                mla_prefill_at(&one, &single, &mut alone, level).unwrap();
                let mut run = vec![0f32; want.len()];
                mla_prefill_at(&one, &input(&c, &kh, &vh), &mut run, level).unwrap();
                assert!(
                    alone[..] == run[t * NH * DV..(t + 1) * NH * DV],
                    "{level:?}: token alone differs from the run"
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let c = case(vec![3, 4]);
        let (kh, vh) = heads(&c);
        let mut out = vec![0f32; 2 * NH * DV];
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for n_kv in [vec![0usize, 4], vec![3, 5]] {
            let a = MlaPrefill { n_kv: &n_kv, ..input(&c, &kh, &vh) };
            assert!(mla_prefill(&pool, &a, &mut out).is_err(), "{n_kv:?}");
        }
        // A head's keys too short, and a head missing.
        let short = [0f32; 7];
        let k = [kh[0], &short[..], kh[2]];
        assert!(mla_prefill(&pool, &MlaPrefill { k: &k, ..input(&c, &kh, &vh) }, &mut out).is_err());
        assert!(mla_prefill(&pool, &MlaPrefill { v: &vh[1..], ..input(&c, &kh, &vh) }, &mut out).is_err());
        assert!(mla_prefill(&pool, &input(&c, &kh, &vh), &mut out[1..]).is_err());
        assert!(cache_rows_f32(&pool, &[0u8; 10], KvType::F16, 3, 2).is_err());
        assert!(cache_rows_f32(&pool, &[0u8; 34], KvType::Q8_0, 1, 16).is_err());
        assert_eq!(cache_rows_f32(&pool, &[0u8, 0x3c, 0, 0xc0], KvType::F16, 2, 1).unwrap(), vec![1.0, -2.0]);
    }
}
