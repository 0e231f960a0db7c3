//! Several matrix products in one parallel step. A decode step of a MoE layer multiplies many
//! small matrices (six experts' gate and up, then their down, a shared expert, per-head MLA
//! projections); running each as its own parallel op costs a thread synchronization apiece and
//! leaves threads idle at every tail. Here the products of a step are cut into row blocks and
//! handed to the pool together: one synchronization per step.

use crate::kernels::{best_kernel, MAX_NY, MAX_TILE_ROWS, MAX_WIDE};
use crate::matmul::{quantize_activations, QuantizedActs, WeightRef};
use crate::packed::{act_sums, group_bytes, group_kernel, packable, GroupActs, GroupCall, PACK_ROWS};
use crate::{Error, Result};
use rayon::prelude::*;
use tandem_quant::vec_dot_type;

/// `out[t][r] = dot(w[r], acts[t])`.
pub struct MatJob<'a> {
    pub w: WeightRef<'a>,
    pub acts: &'a QuantizedActs,
    /// `[acts.n_rows()][w.rows]`
    pub out: &'a mut [f32],
}

/// One row block of a job: rows `r0..r0 + w.rows` of the job's weight, writing column `r0 + r` of
/// every token's output row.
#[derive(Clone, Copy)]
struct Piece<'a> {
    w: WeightRef<'a>,
    acts: &'a QuantizedActs,
    /// For a packed Q8_0-family weight: each activation block's quant sum (`[token][block]`).
    sums: &'a [i32],
    out: OutPtr,
    /// Output row length (the job's weight rows).
    stride: usize,
    r0: usize,
}

/// The output of a job, written by several pieces at once. Each piece writes only its own columns
/// (`r0 .. r0 + rows` of every token row), so the writes never overlap.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: pieces write disjoint elements (see `OutPtr`), and `matmul_jobs` keeps the borrowed
// output alive until every piece has finished.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Runs every job in one parallel step over `pool`.
pub fn matmul_jobs(pool: &rayon::ThreadPool, mut jobs: Vec<MatJob>) -> Result<()> {
    for j in &jobs {
        let n = j.acts.n_rows();
        if j.acts.cols != j.w.cols || j.acts.ty != vec_dot_type(j.w.ty) || j.out.len() != n * j.w.rows {
            return Err(Error::Shape(format!(
                "matmul of a {} x {} {} weight with {n} rows of {} {} into {} outputs",
                j.w.rows,
                j.w.cols,
                j.w.ty,
                j.acts.cols,
                j.acts.ty,
                j.out.len()
            )));
        }
        if j.w.packed
            && (!packable(j.w.ty, j.w.rows, j.w.cols)
                || j.w.data.len() != j.w.rows / PACK_ROWS * group_bytes(j.w.ty, j.w.cols))
        {
            return Err(Error::Shape(format!(
                "a packed {} x {} {} weight of {} bytes",
                j.w.rows,
                j.w.cols,
                j.w.ty,
                j.w.data.len()
            )));
        }
        if best_kernel(j.w.ty).is_none() {
            return Err(Error::Quant(tandem_quant::Error::UnsupportedType { ty: j.w.ty, op: "vec_dot" }));
        }
    }
    let threads = pool.current_num_threads().max(1);
    let one_token = jobs.iter().all(|j| j.acts.n_rows() <= 1);
    // The activation block sums the packed Q8_0-family kernels need, once per job for all its pieces.
    let sums: Vec<Vec<i32>> = jobs
        .iter()
        .map(|j| match j.w.packed {
            true => act_sums(j.w.ty, &j.acts.data, j.acts.row_bytes, j.w.cols / j.w.ty.block_size()),
            false => Vec::new(),
        })
        .collect();
    let weights: Vec<(WeightRef, bool)> = jobs.iter().map(|j| (j.w, j.acts.n_rows() > 0)).collect();
    let blocks = row_blocks(&weights, threads, one_token);
    let outs: Vec<OutPtr> = jobs.iter_mut().map(|j| OutPtr(j.out.as_mut_ptr())).collect();
    let mut pieces = Vec::with_capacity(blocks.len());
    for (j, r0, nr) in blocks {
        let job = &jobs[j];
        pieces.push(Piece {
            w: job.w.rows(r0, nr)?,
            acts: job.acts,
            sums: &sums[j],
            out: outs[j],
            stride: job.w.rows,
            r0,
        });
    }
    if pieces.len() == 1 || threads == 1 {
        pieces.into_iter().for_each(run_piece);
    } else {
        // A single token's pieces stream their weights once: the threads may fetch the start of
        // their runs ahead of time in the next step (`pool::Forecast`).
        let bytes = |i: usize| (pieces[i].w.data.as_ptr() as usize, pieces[i].w.data.len());
        let run = |i: usize| run_piece(pieces[i]);
        crate::pool::for_each_piece_reading(pool, pieces.len(), &run, one_token.then_some(&bytes));
    }
    Ok(())
}

/// The row blocks [`matmul_jobs`] cuts its weights into, in order: (job, first row, rows). A job
/// without tokens (`false`) counts toward the block size but gets no block.
fn row_blocks(weights: &[(WeightRef, bool)], threads: usize, one_token: bool) -> Vec<(usize, usize, usize)> {
    let total_rows: usize = weights.iter().map(|(w, _)| w.rows).sum();
    // Pieces per thread. A single token's step is short (30-700 us here) and its pieces are
    // taken by whichever thread is free, so the last one to finish keeps the others waiting:
    // sixteen per thread left less of that tail than four (2-thread decode 1.6-2.6% faster
    // per token, alternating token by token; docs/perf/HISTORY.md). A batch's pieces each pass
    // over all the batch's activations, so it keeps four.
    let per_thread = if one_token { 16 } else { 4 };
    let block = (total_rows / (threads.max(1) * per_thread)).clamp(4, 512);
    let mut blocks = Vec::new();
    for (j, (w, active)) in weights.iter().enumerate() {
        if !active {
            continue;
        }
        // A packed weight is cut only between its groups of 16 rows.
        let block = if w.packed { block.next_multiple_of(PACK_ROWS) } else { block };
        let mut r0 = 0;
        while r0 < w.rows {
            let nr = block.min(w.rows - r0);
            blocks.push((j, r0, nr));
            r0 += nr;
        }
    }
    blocks
}

/// Rows in tiles of `ROW_TILE` against tokens in groups of [`MAX_NY`] (of [`MAX_WIDE`] for the
/// kernels with a wide variant): a tile of weight rows stays in cache while every token group
/// passes over it, and each unpacked weight block serves a whole group.
fn run_piece(p: Piece) {
    const ROW_TILE: usize = 16;
    if p.w.packed {
        return run_packed_piece(p);
    }
    let Some(kernel) = best_kernel(p.w.ty) else { return };
    let n = p.acts.n_rows();
    let yb = p.acts.row_bytes;
    let rb = p.w.data.len() / p.w.rows.max(1);
    // Checked once here for every kernel call below.
    let rows_ok = tandem_quant::row_size(p.w.ty, p.w.cols).is_ok_and(|b| b == rb && rb * p.w.rows == p.w.data.len());
    let acts_ok = tandem_quant::row_size(p.acts.ty, p.w.cols).is_ok_and(|b| b == yb && yb * n == p.acts.data.len());
    assert!(rows_ok && acts_ok && p.acts.ty == vec_dot_type(p.w.ty) && p.r0 + p.w.rows <= p.stride);
    // Room for a tile of MAX_TILE_ROWS rows of MAX_NY tokens or of up to 4 rows of MAX_WIDE tokens.
    const TMP: usize = if MAX_WIDE > MAX_NY { 4 * MAX_WIDE } else { MAX_NY * MAX_TILE_ROWS };
    let mut tmp = [0f32; TMP];
    let group = kernel.max_tokens();
    for tile in (0..p.w.rows).step_by(ROW_TILE) {
        let end = (tile + ROW_TILE).min(p.w.rows);
        for t0 in (0..n).step_by(group) {
            let nt = group.min(n - t0);
            let ys = &p.acts.data[t0 * yb..(t0 + nt) * yb];
            let mut r = tile;
            // Several weight rows per call share each activation block; bit-identical to the
            // single-row kernel, which serves the remaining rows and single tokens (decode).
            if let Some(nr) = kernel.tile_rows(nt) {
                while r + nr <= end {
                    let w = &p.w.data[r * rb..(r + nr) * rb];
                    // SAFETY: the lengths were checked for the whole piece above; `tile_rows`
                    // gives one of TILE_ROWS (at most MAX_TILE_ROWS).
                    unsafe { kernel.run_tile_unchecked(p.w.cols, w, ys, nt, &mut tmp[..nr * nt]) };
                    for i in 0..nt {
                        for dr in 0..nr {
                            // SAFETY: as below, for columns `r0 + r .. r0 + r + nr` of this piece.
                            unsafe { *p.out.0.add((t0 + i) * p.stride + p.r0 + r + dr) = tmp[dr * nt + i] };
                        }
                    }
                    r += nr;
                }
            }
            for r in r..end {
                let wrow = &p.w.data[r * rb..(r + 1) * rb];
                #[cfg(target_arch = "x86_64")]
                if n == 1 && !kernel.prefetches() {
                    // Decode streams the weights once: ask for the bytes PREFETCH ahead of this row
                    // (the hardware prefetchers stop at every 4 KiB page), unless the kernel does.
                    prefetch(p.w.data, (r + 1) * rb, rb);
                }
                // SAFETY: the lengths were checked for the whole piece above.
                unsafe { kernel.run_unchecked(p.w.cols, wrow, ys, &mut tmp[..nt]) };
                for (i, v) in tmp[..nt].iter().enumerate() {
                    // SAFETY: `matmul_jobs` checked that the output holds n rows of `stride`;
                    // this piece alone writes column `r0 + r` (see `OutPtr`).
                    unsafe { *p.out.0.add((t0 + i) * p.stride + p.r0 + r) = *v };
                }
            }
        }
    }
}

/// The activation bytes [`run_packed_piece`] passes every group of rows over at a time: all of
/// a prefill's (1.2 MB for 512 tokens of 2048 columns) came from the third-level cache for each
/// group on a Zen 3 (512 KiB of L2); in chunks of 128 KiB prefill of 512 tokens of the Q4_K_M
/// bench model ran 3-4% faster there (AVX2 only, 2 threads).
const ACT_CHUNK_BYTES: usize = 128 << 10;

/// [`run_piece`] of a packed weight: each group of 16 rows against the tokens in groups of
/// [`MAX_NY`], writing 16 columns of each token's output row at once; the tokens in chunks of
/// [`ACT_CHUNK_BYTES`].
fn run_packed_piece(p: Piece) {
    let n = p.acts.n_rows();
    let yb = p.acts.row_bytes;
    let gb = group_bytes(p.w.ty, p.w.cols);
    let nb = p.w.cols / p.w.ty.block_size();
    let acts_ok = tandem_quant::row_size(p.acts.ty, p.w.cols).is_ok_and(|b| b == yb && yb * n == p.acts.data.len());
    // Checked once here for every kernel call below (`matmul_jobs` checked the packed size).
    assert!(
        acts_ok
            && p.acts.ty == vec_dot_type(p.w.ty)
            && p.w.data.len() == p.w.rows / PACK_ROWS * gb
            && p.r0 + p.w.rows <= p.stride
    );
    let Some(kernel) = group_kernel(p.w.ty) else { return };
    let sums = p.sums;
    assert!(sums.is_empty() || sums.len() == n * nb);
    // Tokens in chunks whose activations stay in the second-level cache while every group of
    // rows passes over them; groups of MAX_NY from each chunk's start, as without chunks.
    let chunk = (ACT_CHUNK_BYTES / yb.max(1) / MAX_NY).max(1) * MAX_NY;
    for c0 in (0..n).step_by(chunk) {
        let cend = (c0 + chunk).min(n);
        for (g, w) in p.w.data.chunks_exact(gb).enumerate() {
            for t0 in (c0..cend).step_by(MAX_NY) {
                let nt = MAX_NY.min(cend - t0);
                // SAFETY: one whole group (checked above); tokens t0..t0 + nt of the checked
                // activations and their block sums (`nb` per token, or none where the type has no
                // use for them); `matmul_jobs` checked that the output holds n rows of `stride`,
                // and this piece alone writes columns r0 + 16g .. r0 + 16g + 16 (see `OutPtr`).
                unsafe {
                    let a = GroupActs {
                        ys: p.acts.data.as_ptr().add(t0 * yb),
                        yb,
                        sums: if sums.is_empty() { std::ptr::null() } else { sums.as_ptr().add(t0 * nb) },
                    };
                    let out = p.out.0.add(t0 * p.stride + p.r0 + g * PACK_ROWS);
                    kernel(GroupCall { nb, w: w.as_ptr(), a, ny: nt, out, ostride: p.stride });
                }
            }
        }
    }
}

/// [`quantize_activations`] of many rows, in parallel blocks of rows.
fn quantize_par(
    pool: &rayon::ThreadPool,
    weight_ty: tandem_quant::GgmlType,
    x: &[f32],
    cols: usize,
) -> Result<QuantizedActs> {
    let n = x.len() / cols.max(1);
    let per = n.div_ceil(4 * pool.current_num_threads()).max(1);
    let parts: Vec<QuantizedActs> = pool.install(|| {
        x.par_chunks(per * cols).map(|c| quantize_activations(weight_ty, c, cols)).collect::<Result<_>>()
    })?;
    let mut all = QuantizedActs {
        ty: vec_dot_type(weight_ty),
        cols,
        row_bytes: tandem_quant::row_size(vec_dot_type(weight_ty), cols)?,
        data: Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum()),
    };
    for p in &parts {
        all.data.extend_from_slice(&p.data);
    }
    Ok(all)
}

/// How far ahead of the row being multiplied a single-token product asks for weight bytes.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Prefetch hints for the cache lines of `data[at + PREFETCH .. at + PREFETCH + len]` that exist,
/// with the processor's hint for streamed weights, like the packed kernels' ([`crate::Prefetch`]).
#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch(data: &[u8], at: usize, len: usize) {
    let start = (at + PREFETCH).min(data.len());
    let end = (start + len).min(data.len());
    crate::prefetch_stream(data[start..].as_ptr(), end - start);
}

/// A SwiGLU feed-forward network applied to some of the tokens: one expert, a shared expert or a
/// dense FFN.
pub struct FfnJob<'a> {
    pub gate: WeightRef<'a>,
    pub up: WeightRef<'a>,
    pub down: WeightRef<'a>,
    /// Indices of the tokens (rows of `x`) it runs on.
    pub tokens: Vec<usize>,
}

/// `down(silu(gate x_t) * up x_t)` for every job and each of its tokens: returns per job
/// `[tokens.len()][down.rows]`. Two parallel steps in all (gate and up of every job, then down of
/// every job); activations are quantized once per weight type.
pub fn ffn_jobs(pool: &rayon::ThreadPool, x: &[f32], cols: usize, jobs: &[FfnJob]) -> Result<Vec<Vec<f32>>> {
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(Error::Shape(format!("{} activations are not rows of {cols}", x.len())));
    }
    let n = x.len() / cols;
    for j in jobs {
        if j.gate.cols != cols || j.up.cols != cols || j.up.rows != j.gate.rows || j.down.cols != j.gate.rows {
            return Err(Error::Shape(format!(
                "FFN of gate {}x{}, up {}x{}, down {}x{} on rows of {cols}",
                j.gate.rows, j.gate.cols, j.up.rows, j.up.cols, j.down.rows, j.down.cols
            )));
        }
        if let Some(&t) = j.tokens.iter().find(|&&t| t >= n) {
            return Err(Error::Shape(format!("FFN job for token {t} of {n}")));
        }
    }
    // All tokens quantized once per activation type, then gathered per job. With many tokens (a
    // prefill) the quantizing, gathering and the SwiGLU between the two steps run on the pool too:
    // done on one thread they left the others idle for a tenth of the time.
    let many = n >= 2 * pool.current_num_threads() && pool.current_num_threads() > 1;
    let mut quantized: Vec<QuantizedActs> = Vec::new();
    for j in jobs {
        for ty in [j.gate.ty, j.up.ty] {
            if !quantized.iter().any(|q| q.ty == vec_dot_type(ty)) {
                quantized.push(if many {
                    quantize_par(pool, ty, x, cols)?
                } else {
                    quantize_activations(ty, x, cols)?
                });
            }
        }
    }
    let acts_for = |ty, tokens: &[usize]| -> QuantizedActs {
        let all = quantized.iter().find(|q| q.ty == vec_dot_type(ty)).expect("quantized above");
        let mut data = Vec::with_capacity(tokens.len() * all.row_bytes);
        for &t in tokens {
            data.extend_from_slice(all.row(t));
        }
        QuantizedActs { ty: all.ty, cols, row_bytes: all.row_bytes, data }
    };
    let gather = |j: &FfnJob| {
        let up = (vec_dot_type(j.up.ty) != vec_dot_type(j.gate.ty)).then(|| acts_for(j.up.ty, &j.tokens));
        (acts_for(j.gate.ty, &j.tokens), up)
    };
    let (gate_acts, up_acts): (Vec<QuantizedActs>, Vec<Option<QuantizedActs>>) = if many {
        pool.install(|| jobs.par_iter().with_max_len(1).map(gather).unzip())
    } else {
        jobs.iter().map(gather).unzip()
    };
    // The outputs: tens of MB a layer in a prefill, zeroed on the pool there (by job: each is
    // a few hundred KB).
    let zeroed = |rows: &(dyn Fn(&FfnJob) -> usize + Sync)| -> Vec<Vec<f32>> {
        let out = |j: &FfnJob| vec![0f32; rows(j) * j.tokens.len()];
        match many {
            true => pool.install(|| jobs.par_iter().with_max_len(1).map(out).collect()),
            false => jobs.iter().map(out).collect(),
        }
    };
    let mut gate = zeroed(&|j| j.gate.rows);
    let mut up = zeroed(&|j| j.up.rows);
    let mut step = Vec::new();
    for (((j, g), u), (ga, ua)) in jobs.iter().zip(&mut gate).zip(&mut up).zip(gate_acts.iter().zip(&up_acts)) {
        step.push(MatJob { w: j.gate, acts: ga, out: g });
        step.push(MatJob { w: j.up, acts: ua.as_ref().unwrap_or(ga), out: u });
    }
    if n == 1 {
        // The down products are known now: the threads that wait at the end of the gate and up
        // step (and through the SwiGLU) fetch the start of their runs of them.
        let downs: Vec<(WeightRef, bool)> = jobs.iter().map(|j| (j.down, !j.tokens.is_empty())).collect();
        let blocks = row_blocks(&downs, pool.current_num_threads(), true);
        let bytes = |i: usize| {
            let (j, r0, nr) = blocks[i];
            downs[j].0.rows(r0, nr).map_or((0, 0), |w| (w.data.as_ptr() as usize, w.data.len()))
        };
        crate::pool::announce(pool, 1, blocks.len(), &bytes);
    }
    matmul_jobs(pool, step)?;
    // silu(gate) * up, quantized for down.
    let swiglu = |((j, g), u): ((&FfnJob, &mut Vec<f32>), &Vec<f32>)| -> Result<QuantizedActs> {
        crate::silu_mul(g, u);
        if j.tokens.is_empty() {
            Ok(QuantizedActs { ty: vec_dot_type(j.down.ty), cols: j.down.cols, row_bytes: 0, data: Vec::new() })
        } else {
            quantize_activations(j.down.ty, g, j.down.cols)
        }
    };
    let down_acts: Vec<QuantizedActs> = if many {
        pool.install(|| {
            jobs.par_iter()
                .zip(gate.par_iter_mut())
                .zip(up.par_iter())
                .with_max_len(1)
                .map(swiglu)
                .collect::<Result<_>>()
        })
    } else {
        jobs.iter().zip(gate.iter_mut()).zip(up.iter()).map(swiglu).collect()
    }?;
    let mut down = zeroed(&|j| j.down.rows);
    let step: Vec<MatJob> =
        jobs.iter().zip(&down_acts).zip(&mut down).map(|((j, a), out)| MatJob { w: j.down, acts: a, out }).collect();
    matmul_jobs(pool, step)?;
    Ok(down)
}
