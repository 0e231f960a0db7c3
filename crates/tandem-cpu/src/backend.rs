//! [`CpuBackend`]: the operations of a forward pass on the CPU, over host slices and weights in
//! place from the memory map (or their packed copies). tandem-model's host device calls it; it
//! knows nothing of models, only of matrices, activations and cached rows.

use crate::attention::{Attn, KvType};
use crate::gemm::{gemm, Dims};
use crate::jobs::{ffn_jobs, matmul_jobs, FfnJob, MatJob};
use crate::matmul::{quantize_activations, QuantizedActs, WeightRef};
use crate::mla::{cache_rows_f32, mla_prefill, MlaHeads, MlaPrefill};
use crate::vmath::Level;
use crate::{Error, Result, Threads};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tandem_quant::{dequantize_row, row_size, vec_dot_type};

/// Multi-head latent attention in the decompressed form for a run of tokens of one sequence:
/// every cached row's key and value rebuilt per head from the latent (`attn_k_b`, `attn_v_b`),
/// then ordinary attention ([`crate::mla_prefill`]).
pub struct MlaDecompressed<'a> {
    /// `[n][n_head][nope + n_rot]`, after rope.
    pub q: &'a [f32],
    pub heads: MlaHeads,
    /// The sequence's cached rows, `kv_lora + n_rot` values each.
    pub kv: &'a [u8],
    pub kv_type: KvType,
    /// Rows each token attends (its position + 1).
    pub n_kv: &'a [usize],
    /// `attn_k_b` as stored (`[n_head * kv_lora]` rows of `nope`), never a packed copy: made f32
    /// from these bytes once and kept under `k_b_key` ([`MlaWeights`]).
    pub k_b: WeightRef<'a>,
    pub k_b_key: &'a str,
    /// `attn_v_b` as stored, `[n_head * dv]` rows of `kv_lora`, never a packed copy (kept with
    /// `attn_k_b`'s).
    pub v_b: WeightRef<'a>,
    pub scale: f32,
}

/// Parts below which [`CpuBackend::for_parts`] stays on the calling thread.
pub const PAR_PARTS: usize = 32;

/// Everything on the CPU: the thread pools and the per-weight matrices the decompressed MLA form
/// makes once.
pub struct CpuBackend {
    threads: Threads,
    /// Per layer (by `attn_k_b`'s key): the matrices that rebuild the decompressed MLA's keys
    /// and values, made on first use ([`MlaWeights`]).
    mla: Mutex<HashMap<String, Arc<MlaWeights>>>,
}

impl CpuBackend {
    pub fn new(threads: Threads) -> CpuBackend {
        CpuBackend { threads, mla: Mutex::new(HashMap::new()) }
    }

    pub fn threads(&self) -> &Threads {
        &self.threads
    }

    /// Runs `f` (the forward pass of a micro-batch of `n_tokens`) on a thread of the pool, so each
    /// op's fork and join is between spinning workers instead of a wake-up from outside.
    pub fn run_step<R: Send>(&self, n_tokens: usize, f: impl FnOnce() -> R + Send) -> R {
        self.threads.run_step(n_tokens, f)
    }

    /// Runs `f(i, part)` for every part `i` of `x` (`part` values each, the last one shorter when
    /// `x` is not whole parts): on the pool for a batch of tokens, on this thread for fewer than
    /// [`PAR_PARTS`] parts (a hand-off costs more than a few rows). Each part is one call, so the
    /// result does not depend on the threads. For the row-wise steps between the products (norms,
    /// rope, sums): done on the leading thread alone, they were 3-4% of a Zen 3 prefill while the
    /// other thread waited.
    pub fn for_parts(&self, x: &mut [f32], part: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        if part == 0 {
            return;
        }
        let n = x.len().div_ceil(part);
        if n < PAR_PARTS {
            x.chunks_mut(part).enumerate().for_each(|(i, p)| f(i, p));
            return;
        }
        let pool = self.threads.for_tokens(n);
        // A few pieces per thread, so that one slow thread does not hold the others.
        let per = n.div_ceil(4 * pool.current_num_threads());
        pool.install(|| {
            x.par_chunks_mut(per * part).enumerate().for_each(|(c, ps)| {
                ps.chunks_mut(part).enumerate().for_each(|(j, p)| f(c * per + j, p));
            })
        });
    }

    /// `y[t] = W x[t]`.
    pub fn matmul(&self, w: &WeightRef, x: &[f32], y: &mut [f32]) -> Result<()> {
        let n_tokens = x.len() / w.cols.max(1);
        crate::matmul(self.threads.for_tokens(n_tokens), w, x, y)
    }

    /// `ys[i] = ws[i] x` for weights that take the same input, in one parallel step with the input
    /// quantized once per activation type.
    pub fn matmul_same_input(&self, ws: &[WeightRef], x: &[f32], ys: &mut [&mut [f32]]) -> Result<()> {
        if ws.len() != ys.len() {
            return Err(Error::Shape(format!("{} outputs for {} weights", ys.len(), ws.len())));
        }
        let mut acts: Vec<QuantizedActs> = Vec::new();
        for m in ws {
            if !acts.iter().any(|a| a.ty == vec_dot_type(m.ty)) {
                acts.push(quantize_activations(m.ty, x, m.cols)?);
            }
        }
        let n = x.len() / ws.first().map_or(1, |m| m.cols.max(1));
        let mut jobs = Vec::with_capacity(ws.len());
        for (m, y) in ws.iter().zip(ys.iter_mut()) {
            let Some(a) = acts.iter().find(|a| a.ty == vec_dot_type(m.ty)) else {
                return Err(Error::Shape(format!("no activations quantized for {}", m.ty)));
            };
            jobs.push(MatJob { w: *m, acts: a, out: y });
        }
        matmul_jobs(self.threads.for_tokens(n), jobs)
    }

    /// `ys[g] = W[rows of group g] xs[g]` for groups `(first_row, n_rows)` of one weight (the
    /// per-head matrices of MLA), in one parallel step.
    pub fn matmul_groups(
        &self,
        w: &WeightRef,
        groups: &[(usize, usize)],
        xs: &[&[f32]],
        ys: &mut [Vec<f32>],
    ) -> Result<()> {
        let mut acts = Vec::with_capacity(groups.len());
        for x in xs {
            acts.push(quantize_activations(w.ty, x, w.cols)?);
        }
        let n = acts.iter().map(|a| a.n_rows()).max().unwrap_or(0);
        if ys.len() != groups.len()
            || xs.len() != groups.len()
            || groups.iter().zip(&acts).zip(ys.iter()).any(|((g, a), y)| y.len() != g.1 * a.n_rows())
        {
            return Err(Error::Shape("grouped matmul outputs do not match the groups".into()));
        }
        let mut jobs = Vec::with_capacity(groups.len());
        for ((&(first, rows), a), out) in groups.iter().zip(&acts).zip(ys.iter_mut()) {
            jobs.push(MatJob { w: w.rows(first, rows)?, acts: a, out });
        }
        matmul_jobs(self.threads.for_tokens(n), jobs)
    }

    /// `down(silu(gate x_t) * up x_t)` for each job and each of its tokens (`x` is `[n][cols]`):
    /// per job `[tokens.len()][down.rows]`, all of them in two parallel steps.
    pub fn ffn(&self, x: &[f32], cols: usize, jobs: &[FfnJob]) -> Result<Vec<Vec<f32>>> {
        let n = x.len() / cols.max(1);
        ffn_jobs(self.threads.for_tokens(n), x, cols, jobs)
    }

    /// Attention of several tokens; `out` is `[items.len()][n_head][dv]`.
    pub fn attention(&self, items: &[Attn], out: &mut [f32]) -> Result<()> {
        let per = out.len() / items.len().max(1);
        if per * items.len() != out.len() {
            return Err(Error::Shape(format!("attention of {} tokens into {} outputs", items.len(), out.len())));
        }
        if let [a] = items {
            return crate::attention(self.threads.for_tokens(1), a, out);
        }
        let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(per.max(1)).collect();
        crate::attention_many(self.threads.for_tokens(items.len()), items, &mut outs)
    }

    /// MLA attention in the decompressed form; `out` is `[n][n_head][dv]`. `Ok(false)` (and `out`
    /// untouched) where the shapes do not allow it (a latent that is not whole Q8_0 blocks).
    /// `keep`: the sequence's rebuilt rows of this layer kept from earlier runs, and the most rows
    /// it may hold: its rows are not made again, and it takes this run's new rows up to that
    /// many. The result is the same with or without it.
    pub fn mla_decompressed(
        &self,
        a: &MlaDecompressed,
        keep: Option<(&mut RebuiltRows, usize)>,
        out: &mut [f32],
    ) -> Result<bool> {
        let row = a.heads.kv_lora + a.heads.n_rot;
        if !row.is_multiple_of(a.kv_type.block()) {
            return Ok(false);
        }
        let (nh, kl) = (a.heads.n_head, a.heads.kv_lora);
        if a.k_b.packed
            || a.v_b.packed
            || a.k_b.rows != nh * kl
            || a.k_b.cols != a.heads.nope
            || a.v_b.rows != nh * a.heads.dv
            || a.v_b.cols != kl
        {
            return Err(Error::Shape(format!("{}: attn_k_b / attn_v_b shapes do not fit the attention", a.k_b_key)));
        }
        let (n, dk, dv, nope) = (a.n_kv.len(), a.heads.nope + a.heads.n_rot, a.heads.dv, a.heads.nope);
        if a.q.len() != n * nh * dk || out.len() != n * nh * dv {
            return Err(Error::Shape(format!("decompressed MLA attention of {n} tokens: query or output size wrong")));
        }
        let w = self.mla_weights(a)?;
        let rows = a.n_kv.iter().copied().max().unwrap_or(0);
        let pool = self.threads.for_tokens(n);
        let kv = cache_rows_f32(pool, a.kv, a.kv_type, rows, row)?;
        let mut latent = Vec::with_capacity(rows * kl);
        for r in kv.chunks_exact(row) {
            latent.extend_from_slice(&r[..kl]);
        }
        // Each head's q_nope as the absorbed form hands it to attn_k_b (rounded to the weight's
        // dot type: Q8 blocks, f16), so the scores are llama.cpp's up to the order of the sums.
        let mut q = a.q.to_vec();
        let dot_ty = vec_dot_type(a.k_b.ty);
        pool.install(|| {
            q.par_chunks_mut(Q_ROUND_TOKENS * nh * dk).try_for_each(|qc| -> Result<()> {
                let mut q_nope = Vec::with_capacity(qc.len() / dk * nope);
                for h in qc.chunks_exact(dk) {
                    q_nope.extend_from_slice(&h[..nope]);
                }
                let acts = quantize_activations(a.k_b.ty, &q_nope, nope)?;
                for (i, h) in qc.chunks_exact_mut(dk).enumerate() {
                    dequantize_row(dot_ty, acts.row(i), &mut h[..nope])?;
                }
                Ok(())
            })
        })?;
        // Keys and values: every cached latent times attn_k_b and attn_v_b as f32 (exact
        // products of the weights' own values, as llama.cpp's absorbed form multiplies them).
        // Rows `0..kept` come from `keep` (made by earlier runs or now, up to its most rows),
        // the rest are made for this run only. Each element is one chain of products over the
        // latent, so a row's key and value have the same bits whichever run made them.
        let mut none = RebuiltRows::default();
        let (kept, most) = match keep {
            Some((r, most)) => (r, most),
            None => (&mut none, 0),
        };
        kept.fit(a.heads, rows);
        let have = kept.rows;
        let upto = rows.min(most).max(have);
        if upto > have {
            let new = &latent[have * kl..upto * kl];
            let k = rebuild(pool, new, &w.k, kl, nope);
            let v = rebuild(pool, new, &w.v, kl, dv);
            let (kn, vn) = ((upto - have) * nope, (upto - have) * dv);
            for (h, (hk, hv)) in kept.k.iter_mut().zip(kept.v.iter_mut()).enumerate() {
                // Exactly: the holder counts what these take against its budget.
                hk.reserve_exact(kn);
                hv.reserve_exact(vn);
                hk.extend_from_slice(&k[h * kn..(h + 1) * kn]);
                hv.extend_from_slice(&v[h * vn..(h + 1) * vn]);
            }
            kept.rows = upto;
        }
        let fresh = rows - upto;
        // Heads in groups whose keys and values made for this run take at most MLA_VALUE_BYTES
        // (one head per thread at least): at Kimi's 64 heads and 128K rows all values would be
        // 4 GiB per layer.
        let per_head = rows * (nope + dv) * std::mem::size_of::<f32>();
        let hg = if fresh == 0 { nh } else { (MLA_VALUE_BYTES / per_head.max(1)).max(pool.current_num_threads()) };
        let hg = hg.clamp(1, nh);
        for h0 in (0..nh).step_by(hg) {
            let h1 = (h0 + hg).min(nh);
            let g = h1 - h0;
            // Each head's rows: the kept ones, the ones made now, or (where the kept ones stop
            // short) a copy of the kept ones followed by the ones made now.
            let (mut k, mut v) = (Vec::new(), Vec::new());
            if fresh > 0 {
                let new = &latent[upto * kl..rows * kl];
                k = rebuild(pool, new, &w.k[h0 * kl * nope..h1 * kl * nope], kl, nope);
                v = rebuild(pool, new, &w.v[h0 * kl * dv..h1 * kl * dv], kl, dv);
                if upto > 0 {
                    let join = |kept: &[Vec<f32>], new: &[f32], d: usize| -> Vec<f32> {
                        (h0..h1)
                            .zip(new.chunks_exact(fresh * d))
                            .flat_map(|(h, n)| [&kept[h][..], n].concat())
                            .collect()
                    };
                    (k, v) = (join(&kept.k, &k, nope), join(&kept.v, &v, dv));
                }
            }
            fn heads<'a>(kept: &'a [Vec<f32>], made: &'a [f32], per: usize) -> Vec<&'a [f32]> {
                match per {
                    0 => kept.iter().map(Vec::as_slice).collect(),
                    _ => made.chunks_exact(per).collect(),
                }
            }
            // `per`: each head's values made now (0: none, the kept rows are all).
            let (pk, pv) = if fresh == 0 { (0, 0) } else { (rows * nope, rows * dv) };
            let (kh, vh) = (heads(&kept.k[h0..h1], &k, pk), heads(&kept.v[h0..h1], &v, pv));
            let qg: Vec<f32> = if g == nh {
                std::mem::take(&mut q)
            } else {
                q.chunks_exact(nh * dk).flat_map(|t| t[h0 * dk..h1 * dk].iter().copied()).collect()
            };
            let p = MlaPrefill {
                q: &qg,
                heads: MlaHeads { n_head: g, ..a.heads },
                kv: &kv,
                k: &kh,
                v: &vh,
                n_kv: a.n_kv,
                scale: a.scale,
            };
            if g == nh {
                mla_prefill(pool, &p, out)?;
            } else {
                let mut og = vec![0f32; n * g * dv];
                mla_prefill(pool, &p, &mut og)?;
                for (o, r) in out.chunks_exact_mut(nh * dv).zip(og.chunks_exact(g * dv)) {
                    o[h0 * dv..h1 * dv].copy_from_slice(r);
                }
            }
        }
        Ok(true)
    }

    /// A layer's [`MlaWeights`]: made once per `attn_k_b` key and kept.
    fn mla_weights(&self, a: &MlaDecompressed) -> Result<Arc<MlaWeights>> {
        let mut all = self.mla.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = all.get(a.k_b_key) {
            return Ok(w.clone());
        }
        let (kl, nope, dv) = (a.heads.kv_lora, a.heads.nope, a.heads.dv);
        let pool = self.threads.for_tokens(2);
        // attn_k_b is `[n_head][kv_lora][nope]` already; attn_v_b is `[n_head][dv][kv_lora]`,
        // each head's matrix transposed to `[kv_lora][dv]`.
        let k = dequantized(pool, &a.k_b, kl * nope, |raw, o| o.copy_from_slice(raw))?;
        let v = dequantized(pool, &a.v_b, kl * dv, |raw, o| {
            for (d, row) in raw.chunks_exact(kl).enumerate() {
                for (j, x) in row.iter().enumerate() {
                    o[j * dv + d] = *x;
                }
            }
        })?;
        let w = Arc::new(MlaWeights { k, v });
        all.insert(a.k_b_key.to_string(), w.clone());
        Ok(w)
    }
}

/// The keys and values the decompressed MLA attention rebuilt from rows `0..rows` of one
/// sequence's cached latent in one layer, kept for its next runs so that a prompt at depth (the
/// next turn of a conversation, the next micro-batch of a long prompt) rebuilds only its own rows:
/// at depth 3072 and 256 new tokens the rebuild is 13 times this run's keys and values. The
/// holder keeps them in step with the cache: [`RebuiltRows::truncate`] where the cache forgets
/// positions.
#[derive(Default)]
pub struct RebuiltRows {
    /// Per head, `[rows][nope]`.
    k: Vec<Vec<f32>>,
    /// Per head, `[rows][dv]`.
    v: Vec<Vec<f32>>,
    rows: usize,
    heads: Option<MlaHeads>,
}

impl RebuiltRows {
    /// Rows held (positions `0..rows` of the sequence).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Forgets rows `n..`.
    pub fn truncate(&mut self, n: usize) {
        if n >= self.rows {
            return;
        }
        if let Some(h) = self.heads {
            self.k.iter_mut().for_each(|k| k.truncate(n * h.nope));
            self.v.iter_mut().for_each(|v| v.truncate(n * h.dv));
        }
        self.rows = n;
    }

    /// A copy of rows `0..n` (all of them when it holds fewer), for another sequence that starts
    /// with the same positions.
    pub fn prefix(&self, n: usize) -> RebuiltRows {
        let Some(h) = self.heads else { return RebuiltRows::default() };
        let rows = n.min(self.rows);
        RebuiltRows {
            k: self.k.iter().map(|k| k[..rows * h.nope].to_vec()).collect(),
            v: self.v.iter().map(|v| v[..rows * h.dv].to_vec()).collect(),
            rows,
            heads: self.heads,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|x| x.capacity()).sum::<usize>() * std::mem::size_of::<f32>()
    }

    /// Bytes a row takes in every head of `heads`.
    pub fn row_bytes(heads: MlaHeads) -> usize {
        heads.n_head * (heads.nope + heads.dv) * std::mem::size_of::<f32>()
    }

    /// Ready for a run over `rows` rows of attention of `heads`: emptied if it held another
    /// shape, cut to `rows`.
    fn fit(&mut self, heads: MlaHeads, rows: usize) {
        if self.heads != Some(heads) {
            *self = RebuiltRows {
                k: vec![Vec::new(); heads.n_head],
                v: vec![Vec::new(); heads.n_head],
                rows: 0,
                heads: Some(heads),
            };
        }
        self.truncate(rows);
    }
}

/// `attn_k_b` and `attn_v_b` of one layer as f32, per head the matrix a cached latent multiplies
/// to give that head's keys, `k: [n_head][kv_lora][nope]`, and values, `v: [n_head][kv_lora][dv]`.
/// Exact f32 (not requantized, and the latent not quantized as activations): llama.cpp's absorbed
/// form multiplies the weights' own values with the f16 latent, and requantizing both operands to
/// Q8_0 put the decompressed form 1.24-1.31x llama.cpp's own flash-attention distance from its
/// logits, against 1.09-1.18x exact (tests/logits.rs `mla_forms_match_llama_cpp`). About 4 bytes
/// per value of the two weights: 33.5 MB per layer at Kimi K2's 64 heads, 2.0 GB for its 61
/// layers, made only when a prompt runs decompressed.
struct MlaWeights {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// A weight of `heads` matrices of `per` values each as f32: each head's values, dequantized in
/// the stored order, written out by `arrange` into the head's part of the result; on `pool`.
fn dequantized(
    pool: &rayon::ThreadPool,
    w: &WeightRef,
    per: usize,
    arrange: impl Fn(&[f32], &mut [f32]) + Sync,
) -> Result<Vec<f32>> {
    let bytes = row_size(w.ty, per)?;
    if bytes == 0 || !w.data.len().is_multiple_of(bytes) || w.data.len() / bytes * per != w.rows * w.cols {
        return Err(Error::Shape(format!("{} bytes of {} are not whole heads of {per} values", w.data.len(), w.ty)));
    }
    let mut out = vec![0f32; w.rows * w.cols];
    pool.install(|| {
        out.par_chunks_mut(per).zip(w.data.par_chunks(bytes)).try_for_each(|(o, b)| -> Result<()> {
            let mut raw = vec![0f32; per];
            dequantize_row(w.ty, b, &mut raw)?;
            arrange(&raw, o);
            Ok(())
        })
    })?;
    Ok(out)
}

/// `[g][rows][d]`: every row of `latent` (`[rows][kl]`) times each of the `g` matrices of `w`
/// (`[g][kl][d]`), each head's rows consecutive (as the attention's products read them), by f32
/// products of blocks of rows on `pool`.
fn rebuild(pool: &rayon::ThreadPool, latent: &[f32], w: &[f32], kl: usize, d: usize) -> Vec<f32> {
    // Rows per task: each head's matrix (256 KB at kv_lora 512 and d 128) passes over this many.
    const RB: usize = 192;
    let g = w.len() / (kl * d);
    let rows = latent.len() / kl;
    let mut out = crate::pool::zeros(pool, rows * g * d);
    let level = Level::detected();
    // (block of rows, head, its output), block by block: a thread's run of tasks keeps one block
    // of the latent in its cache while the heads' matrices pass over it.
    let mut tasks: Vec<(usize, usize, &mut [f32])> = out
        .chunks_mut((rows * d).max(1))
        .enumerate()
        .flat_map(|(h, o)| o.chunks_mut(RB * d).enumerate().map(move |(b, o)| (b, h, o)))
        .collect();
    tasks.sort_by_key(|t| (t.0, t.1));
    pool.install(|| {
        tasks.into_par_iter().for_each(|(b, h, o)| {
            let lat = &latent[b * RB * kl..][..o.len() / d * kl];
            let dims = Dims { m: o.len() / d, n: d, k: kl, lda: kl, ka: 1, ldb: d, ldc: d };
            gemm(dims, lat, &w[h * kl * d..(h + 1) * kl * d], o, level);
        })
    });
    out
}

/// Most bytes of rebuilt keys and values the decompressed MLA attention holds at once (see
/// [`CpuBackend::mla_decompressed`]).
const MLA_VALUE_BYTES: usize = 1 << 30;

/// Tokens per task when the decompressed MLA attention rounds the queries.
const Q_ROUND_TOKENS: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::packed::{pack, packable, packing_pays_for, Packed};
    use tandem_quant::{quantize_row, GgmlType};

    fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        crate::test_data(seed, n).into_iter().map(|v| v * scale).collect()
    }

    fn bytes(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; row_size(ty, x.len()).unwrap()];
        quantize_row(ty, x, &mut out).unwrap();
        out
    }

    /// The decompressed MLA attention keeping its rebuilt rows between runs gives the bits of
    /// the one that rebuilds every row each run: a prompt in three runs, all rows kept, some (the
    /// budget ends inside a run), none, and after the holder forgets rows.
    #[test]
    fn kept_rebuilt_rows_give_the_same_bits() {
        let heads = MlaHeads { n_head: 4, nope: 32, n_rot: 16, kv_lora: 64, dv: 32 };
        let (nh, kl, row, dk) = (heads.n_head, heads.kv_lora, heads.kv_lora + heads.n_rot, heads.nope + heads.n_rot);
        let rows = 150;
        let kv: Vec<u8> =
            rand(21, rows * row, 1.0).iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect();
        let k_b = bytes(GgmlType::Q8_0, &rand(22, nh * kl * heads.nope, 0.2));
        let v_b = bytes(GgmlType::Q8_0, &rand(23, nh * heads.dv * kl, 0.2));
        let q = rand(24, rows * nh * dk, 1.0);
        let b = CpuBackend::new(Threads::new(2, 2).unwrap());
        // Positions p0..p1 attending rows up to their own.
        let run = |p0: usize, p1: usize, keep: Option<(&mut RebuiltRows, usize)>| {
            let n_kv: Vec<usize> = (p0 + 1..=p1).collect();
            let a = MlaDecompressed {
                q: &q[p0 * nh * dk..p1 * nh * dk],
                heads,
                kv: &kv[..p1 * row * 2],
                kv_type: KvType::F16,
                n_kv: &n_kv,
                k_b: WeightRef::new(GgmlType::Q8_0, nh * kl, heads.nope, &k_b).unwrap(),
                k_b_key: "blk.0.attn_k_b.weight",
                v_b: WeightRef::new(GgmlType::Q8_0, nh * heads.dv, kl, &v_b).unwrap(),
                scale: 0.2,
            };
            let mut out = vec![0f32; (p1 - p0) * nh * heads.dv];
            assert!(b.mla_decompressed(&a, keep, &mut out).unwrap());
            out
        };
        let runs = [(0, 40), (40, 41), (41, 150)];
        let want: Vec<Vec<f32>> = runs.iter().map(|&(p0, p1)| run(p0, p1, None)).collect();
        for most in [usize::MAX, 60, 40, 0] {
            let mut kept = RebuiltRows::default();
            for (&(p0, p1), w) in runs.iter().zip(&want) {
                let got = run(p0, p1, Some((&mut kept, most)));
                assert!(got == *w, "keeping at most {most} rows: positions {p0}..{p1} differ");
                assert_eq!(kept.rows(), p1.min(most));
            }
            assert_eq!(kept.bytes(), kept.rows() * RebuiltRows::row_bytes(heads), "most {most}");
            // The holder forgets positions 30..: a run from 30 on attends rebuilt rows again.
            kept.truncate(30);
            assert_eq!(kept.rows(), 30.min(most));
            let again = run(30, 150, Some((&mut kept, most)));
            assert!(again == run(30, 150, None), "keeping at most {most} rows: after truncating");
        }
    }

    /// Products of several weights on one input in one parallel step: the same bits as each
    /// product alone (weights of two activation types, a packed copy, one and several tokens), and
    /// mismatched outputs refused.
    #[test]
    fn products_on_one_input_equal_each_alone() {
        let (cols, ra, rb, rc) = (512usize, 48usize, 80usize, 16usize);
        let data: Vec<(GgmlType, usize, Vec<u8>)> =
            [(GgmlType::Q4_K, ra, 11u64), (GgmlType::Q8_0, rb, 12), (GgmlType::F32, rc, 13)]
                .into_iter()
                .map(|(ty, rows, seed)| (ty, rows, bytes(ty, &rand(seed, rows * cols, 1.0))))
                .collect();
        let b = CpuBackend::new(Threads::new(2, 2).unwrap());
        let plain: Vec<WeightRef> =
            data.iter().map(|(ty, rows, d)| WeightRef::new(*ty, *rows, cols, d).unwrap()).collect();
        let packed: Vec<Option<Packed>> = data
            .iter()
            .map(|(ty, rows, d)| {
                (packing_pays_for(*ty) && packable(*ty, *rows, cols)).then(|| pack(*ty, *rows, cols, d).unwrap())
            })
            .collect();
        let repacked: Vec<WeightRef> =
            plain.iter().zip(&packed).map(|(w, p)| p.as_ref().map_or(*w, |p| p.weight_ref())).collect();
        for ws in [&plain, &repacked] {
            for n in [1usize, 3] {
                let x = rand(20 + n as u64, n * cols, 2.0);
                let alone: Vec<Vec<f32>> = ws
                    .iter()
                    .map(|w| {
                        let mut y = vec![0f32; n * w.rows];
                        b.matmul(w, &x, &mut y).unwrap();
                        y
                    })
                    .collect();
                let (mut ya, mut yb, mut yc) = (vec![0f32; n * ra], vec![0f32; n * rb], vec![0f32; n * rc]);
                b.matmul_same_input(ws, &x, &mut [&mut ya, &mut yb, &mut yc]).unwrap();
                assert!(ya == alone[0] && yb == alone[1] && yc == alone[2], "{n} tokens");
            }
            let mut short = vec![0f32; ra - 1];
            assert!(b.matmul_same_input(&ws[..1], &rand(1, cols, 1.0), &mut [&mut short]).is_err());
            let err = b.matmul_same_input(&ws[..2], &rand(1, cols, 1.0), &mut [&mut short]).unwrap_err().to_string();
            assert!(err.contains("1 outputs for 2 weights"), "{err}");
        }
    }
    fn cache_bytes(ty: KvType, x: &[f32]) -> Vec<u8> {
        match ty {
            KvType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            KvType::F16 => x.iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
            KvType::BF16 => x.iter().flat_map(|v| tandem_quant::f32_to_bf16(*v).to_le_bytes()).collect(),
            KvType::Q8_0 | KvType::Q4_0 => bytes(ty.ggml(), x),
        }
    }

    /// Rounds values to `ty` and back, as ggml converts an f32 operand to an f16/bf16 dot type.
    fn round_to(ty: GgmlType, x: &mut [f32]) {
        match ty {
            GgmlType::F16 => x.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
            GgmlType::BF16 => x.iter_mut().for_each(|v| *v = tandem_quant::bf16_to_f32(tandem_quant::f32_to_bf16(*v))),
            _ => {}
        }
    }

    /// ggml's non-flash attention in its own order: `softmax(scale * K q) V`, with q converted to
    /// the K cache's dot type and the probabilities to the V cache's (f16 for an f16 cache), as
    /// `ggml_mul_mat` does. The reference the fast path is checked against.
    fn reference(a: &Attn, out: &mut [f32]) {
        let (kt, vt) = (a.k_type.ggml(), a.v_type.ggml());
        let group = a.n_head / a.n_head_kv;
        let (v_bytes, v_row, v_head) = match a.v {
            Some(v) => (v, a.v_row, a.dv),
            None => (a.k, a.k_row, a.dk),
        };
        let q_acts = quantize_activations(kt, a.q, a.dk).unwrap();
        let p_type = vec_dot_type(vt);
        for (h, o) in out.chunks_mut(a.dv).enumerate() {
            let kvh = h / group;
            let mut scores = vec![0f32; a.n_kv];
            for (j, s) in scores.iter_mut().enumerate() {
                let at = a.k_type.bytes(j * a.k_row + kvh * a.dk);
                let kr = &a.k[at..at + a.k_type.bytes(a.dk)];
                *s = tandem_quant::vec_dot(kt, a.dk, kr, q_acts.row(h)).unwrap() * a.scale;
            }
            crate::softmax_in_place(&mut scores);
            round_to(p_type, &mut scores);
            o.fill(0.0);
            let mut v = vec![0f32; a.dv];
            for (j, p) in scores.iter().enumerate() {
                let at = a.v_type.bytes(j * v_row + kvh * v_head);
                dequantize_row(vt, &v_bytes[at..at + a.v_type.bytes(a.dv)], &mut v).unwrap();
                for (o, v) in o.iter_mut().zip(&v) {
                    *o += p * v;
                }
            }
        }
    }

    /// The fast path (SIMD, one pass per row for all heads, by chunks past FLASH_MIN rows) against
    /// ggml's order, for MLA, GQA and MHA shapes, every cache format it reads, with and without a
    /// thread split, alone and in a batch.
    #[test]
    fn fast_attention_matches_the_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let b = CpuBackend::new(Threads::new(2, 2).unwrap());
        // (n_head, n_head_kv, dk, dv, separate V, n_kv)
        for &(nh, nkv, dk, dv, sep, n_kv) in &[
            (16usize, 1usize, 576usize, 512usize, false, 700usize),
            (8, 2, 64, 64, true, 300),
            (4, 4, 192, 128, true, 1),
            (16, 1, 576, 512, false, 33),
            (6, 3, 40, 24, true, 600),
            (1, 1, 64, 64, true, 1000),
            (32, 8, 128, 128, true, 777),
        ] {
            for ty in [KvType::F16, KvType::BF16, KvType::F32, KvType::Q8_0, KvType::Q4_0] {
                if !dk.is_multiple_of(ty.block()) || !dv.is_multiple_of(ty.block()) {
                    continue;
                }
                let q = rand(1, nh * dk, 1.0);
                let k = cache_bytes(ty, &rand(2, n_kv * nkv * dk, 1.0));
                let v = cache_bytes(ty, &rand(3, n_kv * nkv * dv, 1.0));
                let a =
                    Attn::case(&q, (nh, nkv, dk, dv), &k, sep.then_some(&v[..]), ty, n_kv, 1.0 / (dk as f32).sqrt());
                let mut want = vec![0f32; nh * dv];
                reference(&a, &mut want);
                let mut alone = vec![0f32; nh * dv];
                crate::attention(&one, &a, &mut alone).unwrap();
                let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Past FLASH_MIN rows the fast path runs by chunks and keeps its probabilities in
                // f32, where ggml rounds them to an f16 or bf16 V's type: p(1 + d), |d| <= u,
                // moves an output by at most u * max |v| (the values here are within [-1, 1]).
                let rounding = match ty {
                    KvType::F16 if n_kv > crate::FLASH_MIN => 2f32.powi(-11),
                    KvType::BF16 if n_kv > crate::FLASH_MIN => 2f32.powi(-8),
                    _ => 0.0,
                };
                for p in [&pool, &one] {
                    let mut got = vec![0f32; nh * dv];
                    crate::attention(p, &a, &mut got).unwrap();
                    if nh >= 2 {
                        // Heads or rows split over the threads: every head computed exactly as on one thread.
                        assert!(
                            got == alone,
                            "{ty:?} {nh}/{nkv}/{dk}/{dv} n_kv {n_kv}: 2 threads differ from 1 in bits"
                        );
                    }
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 2e-3 * max + 1e-6 + rounding,
                            "{ty:?} {nh}/{nkv}/{dk}/{dv} n_kv {n_kv} [{i}]: {g} vs {w}"
                        );
                    }
                }
                let mut outs = vec![0f32; 5 * nh * dv];
                let items: Vec<Attn> = (0..5).map(|_| Attn { ..a }).collect();
                b.attention(&items, &mut outs).unwrap();
                for o in outs.chunks_exact(nh * dv) {
                    assert!(o == alone, "{ty:?} {nh}/{nkv}/{dk}/{dv} n_kv {n_kv}: a batch differs from one token");
                }
            }
        }
    }

    /// A cache too short for the rows asked, and a q8_0 cache whose heads are not whole blocks,
    /// are refused with an error.
    #[test]
    fn short_or_misaligned_caches_are_refused() {
        let b = CpuBackend::new(Threads::new(1, 1).unwrap());
        let q = vec![0f32; 2 * 48];
        let k = vec![0u8; 4096];
        let a = |ty: KvType, dk: usize, k: &'static [u8]| Attn::case(&q[..2 * dk], (2, 1, dk, dk), k, None, ty, 3, 1.0);
        let k: &'static [u8] = Box::leak(k.into_boxed_slice());
        let mut out = vec![0f32; 2 * 48];
        assert!(b.attention(&[a(KvType::Q8_0, 32, k)], &mut out[..64]).is_ok());
        assert!(b.attention(&[a(KvType::Q8_0, 48, k)], &mut out).is_err());
        assert!(b.attention(&[a(KvType::F16, 48, &k[..10])], &mut out).is_err());
    }
}
