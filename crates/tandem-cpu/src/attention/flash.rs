//! One token's attention over a long cache (beyond [`FLASH_MIN`](super::FLASH_MIN) rows) by
//! chunks of rows, each with its own softmax, the chunks combined at the end (flash-decoding).

use super::heads::{scores, weighted_values};
use super::{heads_per_unit, Attn, CHUNK};
use crate::vmath::{exp_sub, max_of, Level};

/// Bytes of partial sums [`flash`] keeps for a token at most (`[chunk][head][dv]` f32): with many
/// heads (128 under DeepSeek V3) the chunks grow instead, so that writing and reading the partial
/// sums stays small next to reading the cache.
const FLASH_PARTS: usize = 2 << 20;

/// Rows per chunk of [`flash`]: [`CHUNK`], or more where [`FLASH_PARTS`] would not hold the
/// partial sums. It depends on the shape and the rows alone, never on the threads.
pub(super) fn flash_rows(a: &Attn) -> usize {
    let max_chunks = (FLASH_PARTS / (4 * a.n_head * a.dv).max(1)).max(1);
    CHUNK.max(a.n_kv.div_ceil(max_chunks))
}

/// One token's attention by chunks of [`flash_rows`] rows: for each chunk and block of heads, the
/// scores, their maximum `m` and `l = sum exp(s - m)`, and the values weighted by `exp(s - m)`;
/// then for each head the chunks combined in order, each scaled by `exp(m - max m) / sum l`.
/// With a pool the units run in parallel in chunk order, so each thread takes a run of rows (the
/// next block of heads of a chunk finds its rows in the thread's cache). A head's arithmetic does
/// not depend on which heads share its unit.
pub(super) fn flash(pool: Option<&rayon::ThreadPool>, a: &Attn, qr: &[f32], out: &mut [f32], level: Level) {
    let (g, nh, dv) = (a.group(), a.n_head, a.dv);
    let chunk = flash_rows(a);
    let n_chunks = a.n_kv.div_ceil(chunk);
    let hb = heads_per_unit(g, n_chunks * a.n_head_kv, pool.map_or(1, |p| p.current_num_threads()));
    // [chunk][head][dv] and [chunk][head]: (m, l), every value written by its unit before it is
    // read, so the buffers of the thread's last call serve (no 400 KB zeroed per call).
    let (mut part, mut ml) = FLASH_SCRATCH.with(|s| s.take());
    part.resize(n_chunks * nh * dv, 0.0);
    ml.resize(n_chunks * nh, (0.0, 0.0));
    let mut units = Vec::with_capacity(n_chunks * a.n_head_kv * g.div_ceil(hb));
    for (c, (pc, mc)) in part.chunks_exact_mut(nh * dv).zip(ml.chunks_exact_mut(nh)).enumerate() {
        let rows = c * chunk..(c * chunk + chunk).min(a.n_kv);
        let (mut pc, mut mc) = (pc, mc);
        for kvh in 0..a.n_head_kv {
            for h0 in (0..g).step_by(hb) {
                let hs = h0..(h0 + hb).min(g);
                let (p, pr) = pc.split_at_mut(hs.len() * dv);
                let (m, mr) = mc.split_at_mut(hs.len());
                units.push(FlashUnit { kvh, hs, rows: rows.clone(), out: p, ml: m });
                (pc, mc) = (pr, mr);
            }
        }
    }
    let run = |u: FlashUnit| flash_unit(a, qr, u, level);
    match pool {
        Some(pool) => crate::pool::for_each_item(pool, units, &run),
        None => units.into_iter().for_each(run),
    }
    // Each head's chunks combined in order: the threads take a share of the heads each (the
    // partial sums, half of them in the other core's cache, are read at memory's pace).
    let combine = |(h0, o): (usize, &mut [f32])| {
        for (h, o) in (h0..).zip(o.chunks_exact_mut(dv)) {
            let top = (0..n_chunks).map(|c| ml[c * nh + h].0).fold(f32::NEG_INFINITY, f32::max);
            o.fill(0.0);
            let mut sum = 0f64;
            for c in 0..n_chunks {
                let (m, l) = ml[c * nh + h];
                let w = (m - top).exp();
                sum += w as f64 * l;
                for (o, p) in o.iter_mut().zip(&part[(c * nh + h) * dv..][..dv]) {
                    *o += w * p;
                }
            }
            let inv = (1.0 / sum) as f32;
            o.iter_mut().for_each(|v| *v *= inv);
        }
    };
    match pool {
        Some(pool) if pool.current_num_threads() > 1 && nh > 1 => {
            let per = nh.div_ceil(pool.current_num_threads()).max(1);
            let items: Vec<_> = out.chunks_mut(per * dv).enumerate().map(|(i, o)| (i * per, o)).collect();
            crate::pool::for_each_item(pool, items, &combine);
        }
        _ => combine((0, out)),
    }
    FLASH_SCRATCH.with(|s| s.set((part, ml)));
}

/// [`flash`]'s partial sums `[chunk][head][dv]` and `(m, l)` per `[chunk][head]`.
type FlashParts = (Vec<f32>, Vec<(f32, f64)>);

thread_local! {
    /// The buffers of this thread's last [`flash`], kept for the next one (at most about
    /// [`FLASH_PARTS`]).
    static FLASH_SCRATCH: std::cell::Cell<FlashParts> = const { std::cell::Cell::new((Vec::new(), Vec::new())) };
}

/// One unit of [`flash`]: heads `hs` of KV head `kvh` over `rows` (one chunk). `out` gets each
/// head's `dv` values weighted by `exp(s - m)`, `ml` each head's `(m, sum exp(s - m))`.
struct FlashUnit<'o> {
    kvh: usize,
    hs: std::ops::Range<usize>,
    rows: std::ops::Range<usize>,
    out: &'o mut [f32],
    ml: &'o mut [(f32, f64)],
}

fn flash_unit(a: &Attn, qr: &[f32], u: FlashUnit, level: Level) {
    let FlashUnit { kvh, hs, rows, out, ml } = u;
    let (n, len) = (hs.len(), rows.len());
    let first = kvh * a.group() + hs.start;
    let q = &qr[first * a.dk..(first + n) * a.dk];
    let mut s = vec![0f32; n * len];
    scores(a, kvh, q, n, rows.clone(), &mut s, len, level);
    for (r, ml) in s.chunks_exact_mut(len).zip(ml.iter_mut()) {
        let m = max_of(r, level);
        *ml = (m, exp_sub(r, m, level));
    }
    weighted_values(a, kvh, &s, n, len, rows, out, level);
}
