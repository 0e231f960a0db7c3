//! Multi-head latent attention in the decompressed form, for a run of tokens of one sequence
//! (a prefill). The absorbed form (what llama.cpp runs, and tandem for decoding) attends over the
//! cached latent: per token, head and cached row it spends `kv_lora + n_rot` multiply-adds on the
//! score and `kv_lora` on the value. Here every cached row's key and value are first rebuilt per
//! head (`k_nope = W_kb^T latent`, `v = W_vb latent`), once for the whole run, and then the run
//! attends as ordinary multi-head attention with `nope + n_rot` and `dv` per row: at a depth of
//! thousands of rows and a few hundred tokens that is two to three times fewer operations. The
//! products are f32 matrix products ([`crate::gemm`]), the softmax is the fast path's.

use crate::attention::{softmax_rows, KvType, Level};
use crate::gemm::{gemm, Dims};
use rayon::prelude::*;

/// Tokens per block of scores.
const TB: usize = 64;

/// The decompressed attention of `n = n_kv.len()` tokens of one sequence.
pub struct MlaPrefill<'a> {
    /// `[n][n_head][nope + n_rot]`: the queries after rope.
    pub q: &'a [f32],
    pub n_head: usize,
    pub nope: usize,
    pub n_rot: usize,
    pub kv_lora: usize,
    pub dv: usize,
    /// The cached rows as f32, `[rows][kv_lora + n_rot]`: the latent, then the rotary key
    /// ([`cache_rows_f32`]).
    pub kv: &'a [f32],
    /// `W_kb` (`attn_k_b`) as f32, `[n_head][kv_lora][nope]`.
    pub k_b: &'a [f32],
    /// The values rebuilt from the latent (`attn_v_b` times each cached latent), `[rows][n_head][dv]`.
    pub v: &'a [f32],
    /// Rows each token attends (its position + 1), each in `1..=rows`.
    pub n_kv: &'a [usize],
    pub scale: f32,
}

impl MlaPrefill<'_> {
    fn dk(&self) -> usize {
        self.nope + self.n_rot
    }

    fn check(&self, out: &[f32]) -> crate::Result<usize> {
        let n = self.n_kv.len();
        let row = self.kv_lora + self.n_rot;
        let rows = self.kv.len() / row.max(1);
        let heads = self.n_head;
        let ok = row > 0
            && self.nope > 0
            && self.dv > 0
            && Some(self.q.len()) == n.checked_mul(heads * self.dk())
            && Some(out.len()) == n.checked_mul(heads * self.dv)
            && Some(self.k_b.len()) == heads.checked_mul(self.kv_lora * self.nope)
            && rows.checked_mul(heads * self.dv).is_some_and(|need| self.v.len() >= need)
            && self.n_kv.iter().all(|&k| (1..=rows).contains(&k));
        if !ok {
            return Err(crate::Error::Shape(format!(
                "decompressed MLA attention of {n} tokens ({heads} heads, nope {}, rope {}, latent {}, dv {}) over {rows} rows: shapes do not agree",
                self.nope, self.n_rot, self.kv_lora, self.dv
            )));
        }
        Ok(self.n_kv.iter().copied().max().unwrap_or(0))
    }
}

/// Rows `0..rows` of a cache (`row` values each, in `ty`) as f32.
pub fn cache_rows_f32(bytes: &[u8], ty: KvType, rows: usize, row: usize) -> crate::Result<Vec<f32>> {
    let row_bytes = ty.bytes(row);
    if !row.is_multiple_of(ty.block()) || rows.checked_mul(row_bytes).is_none_or(|n| bytes.len() < n) {
        return Err(crate::Error::Shape(format!(
            "{rows} cached rows of {row} {ty:?} values: cache too short or rows not whole blocks"
        )));
    }
    let mut out = vec![0f32; rows * row];
    let mut h = vec![half::f16::ZERO; if ty == KvType::F16 { row } else { 0 }];
    for (o, b) in out.chunks_exact_mut(row.max(1)).zip(bytes.chunks_exact(row_bytes.max(1))) {
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
    Ok(out)
}

/// Computes `out` (`[n][n_head][dv]`) on `pool`, one head per task: each head's arithmetic is
/// the same on any number of threads, and each token's result depends only on its query, its
/// `n_kv` and the rows (not on the other tokens of the run).
pub fn mla_prefill(pool: &rayon::ThreadPool, a: &MlaPrefill, out: &mut [f32]) -> crate::Result<()> {
    mla_prefill_at(pool, a, out, Level::detected())
}

fn mla_prefill_at(pool: &rayon::ThreadPool, a: &MlaPrefill, out: &mut [f32], level: Level) -> crate::Result<()> {
    let cols = a.check(out)?;
    let (n, nh, kl, nr, dv) = (a.n_kv.len(), a.n_head, a.kv_lora, a.n_rot, a.dv);
    if n == 0 {
        return Ok(());
    }
    // The latent and the rotary key transposed, `[kv_lora][cols]` and `[n_rot][cols]`: the
    // right-hand operands of the key products.
    let row = kl + nr;
    let mut ct = vec![0f32; row * cols];
    for (j, r) in a.kv.chunks_exact(row).take(cols).enumerate() {
        for (i, v) in r.iter().enumerate() {
            ct[i * cols + j] = *v;
        }
    }
    let per_head: Vec<Vec<f32>> =
        pool.install(|| (0..nh).into_par_iter().with_max_len(1).map(|h| one_head(a, h, &ct, cols, level)).collect());
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..n {
            out[(t * nh + h) * dv..(t * nh + h + 1) * dv].copy_from_slice(&o[t * dv..(t + 1) * dv]);
        }
    }
    Ok(())
}

/// Head `h` for every token: `[n][dv]`.
fn one_head(a: &MlaPrefill, h: usize, ct: &[f32], cols: usize, level: Level) -> Vec<f32> {
    let (n, nh, nope, kl, dv, dk) = (a.n_kv.len(), a.n_head, a.nope, a.kv_lora, a.dv, a.dk());
    // W_kb,h transposed, [nope][kv_lora], times the latent: the rebuilt keys [nope][cols].
    let wb = &a.k_b[h * kl * nope..(h + 1) * kl * nope];
    let mut wt = vec![0f32; nope * kl];
    for (j, r) in wb.chunks_exact(nope).enumerate() {
        for (i, v) in r.iter().enumerate() {
            wt[i * kl + j] = *v;
        }
    }
    let mut kt = vec![0f32; nope * cols];
    gemm(Dims { m: nope, n: cols, k: kl, lda: kl, ldb: cols, ldc: cols }, &wt, ct, &mut kt, level);
    let pt = &ct[kl * cols..];
    let mut o = vec![0f32; n * dv];
    let mut s = vec![0f32; TB.min(n) * cols];
    for t0 in (0..n).step_by(TB) {
        let t1 = (t0 + TB).min(n);
        let tb = t1 - t0;
        let nk = a.n_kv[t0..t1].iter().copied().max().unwrap_or(0);
        let s = &mut s[..tb * nk];
        s.fill(0.0);
        let q = &a.q[(t0 * nh + h) * dk..];
        let d = |k: usize| Dims { m: tb, n: nk, k, lda: nh * dk, ldb: cols, ldc: nk };
        gemm(d(nope), q, &kt, s, level);
        gemm(d(a.n_rot), &q[nope..], pt, s, level);
        for (r, sr) in s.chunks_exact_mut(nk).enumerate() {
            let len = a.n_kv[t0 + r];
            sr[..len].iter_mut().for_each(|v| *v *= a.scale);
            softmax_rows(len, 1, &mut sr[..len], 1, KvType::F32, level);
            sr[len..].fill(0.0);
        }
        let dp = Dims { m: tb, n: dv, k: nk, lda: nk, ldb: nh * dv, ldc: dv };
        gemm(dp, s, &a.v[h * dv..], &mut o[t0 * dv..t1 * dv], level);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        crate::test_data(seed, n).into_iter().map(|v| v * scale).collect()
    }

    struct Case {
        q: Vec<f32>,
        kv: Vec<f32>,
        k_b: Vec<f32>,
        v: Vec<f32>,
        n_kv: Vec<usize>,
    }

    const NH: usize = 3;
    const NOPE: usize = 24;
    const NR: usize = 8;
    const KL: usize = 40;
    const DV: usize = 20;

    fn case(n_kv: Vec<usize>) -> Case {
        let rows = n_kv.iter().copied().max().unwrap();
        let kv = rand(2, rows * (KL + NR), 1.0);
        let v_b = rand(5, NH * DV * KL, 0.3);
        let mut v = vec![0f32; rows * NH * DV];
        for r in 0..rows {
            for hd in 0..NH * DV {
                v[r * NH * DV + hd] = (0..KL).map(|j| v_b[hd * KL + j] * kv[r * (KL + NR) + j]).sum();
            }
        }
        Case { q: rand(1, n_kv.len() * NH * (NOPE + NR), 1.0), kv, k_b: rand(3, NH * KL * NOPE, 0.3), v, n_kv }
    }

    fn input(c: &Case) -> MlaPrefill<'_> {
        MlaPrefill {
            q: &c.q,
            n_head: NH,
            nope: NOPE,
            n_rot: NR,
            kv_lora: KL,
            dv: DV,
            kv: &c.kv,
            k_b: &c.k_b,
            v: &c.v,
            n_kv: &c.n_kv,
            scale: 0.3,
        }
    }

    /// The textbook computation in f64: keys and values rebuilt, softmax, weighted sum.
    fn reference(c: &Case) -> Vec<f64> {
        let dk = NOPE + NR;
        let mut out = vec![0f64; c.n_kv.len() * NH * DV];
        for (t, &len) in c.n_kv.iter().enumerate() {
            for h in 0..NH {
                let q = &c.q[(t * NH + h) * dk..(t * NH + h + 1) * dk];
                let scores: Vec<f64> = (0..len)
                    .map(|r| {
                        let lat = &c.kv[r * (KL + NR)..(r + 1) * (KL + NR)];
                        let nope: f64 = (0..NOPE)
                            .map(|i| {
                                let k: f64 =
                                    (0..KL).map(|j| c.k_b[(h * KL + j) * NOPE + i] as f64 * lat[j] as f64).sum();
                                k * q[i] as f64
                            })
                            .sum();
                        let pe: f64 = (0..NR).map(|i| q[NOPE + i] as f64 * lat[KL + i] as f64).sum();
                        0.3 * (nope + pe)
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..DV {
                    out[(t * NH + h) * DV + d] =
                        (0..len).map(|r| e[r] / sum * c.v[(r * NH + h) * DV + d] as f64).sum::<f64>();
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
            let want = reference(&c);
            let mut base = Vec::new();
            for level in levels() {
                let mut got = vec![0f32; want.len()];
                mla_prefill_at(&one, &input(&c), &mut got, level).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!((*g as f64 - w).abs() < 2e-5, "{level:?} [{i}]: {g} vs {w}");
                }
                let mut par = vec![0f32; want.len()];
                mla_prefill_at(&two, &input(&c), &mut par, level).unwrap();
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
                let single = MlaPrefill { q: &q1, n_kv: &n1, ..input(&c) };
                let mut alone = vec![0f32; NH * DV];
                mla_prefill_at(&one, &single, &mut alone, level).unwrap();
                let mut run = vec![0f32; want.len()];
                mla_prefill_at(&one, &input(&c), &mut run, level).unwrap();
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
        let mut out = vec![0f32; 2 * NH * DV];
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for n_kv in [vec![0usize, 4], vec![3, 5]] {
            let a = MlaPrefill { n_kv: &n_kv, ..input(&c) };
            assert!(mla_prefill(&pool, &a, &mut out).is_err(), "{n_kv:?}");
        }
        let k_b = vec![0f32; 7];
        assert!(mla_prefill(&pool, &MlaPrefill { k_b: &k_b, ..input(&c) }, &mut out).is_err());
        assert!(mla_prefill(&pool, &input(&c), &mut out[1..]).is_err());
        assert!(cache_rows_f32(&[0u8; 10], KvType::F16, 3, 2).is_err());
        assert!(cache_rows_f32(&[0u8; 34], KvType::Q8_0, 1, 16).is_err());
        assert_eq!(cache_rows_f32(&[0u8, 0x3c, 0, 0xc0], KvType::F16, 2, 1).unwrap(), vec![1.0, -2.0]);
    }
}
