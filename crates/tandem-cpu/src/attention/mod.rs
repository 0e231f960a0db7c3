//! Attention of one token over a KV cache of f16, bf16, f32, q8_0 or q4_0 rows, as ggml's non-flash
//! path computes it (`kq = mul_mat(k, q)` with q converted to the cache's dot type: f16, bf16 or
//! Q8_0 blocks (for q8_0 and q4_0 rows); `soft_max_ext` with the scale; the probabilities converted to V's dot type, f16 or
//! bf16, for `kqv = mul_mat(v, kq)`), but organized for speed: every cached row is read once for
//! all the heads that share it (all of them under MLA), beyond [`FLASH_MIN`] rows the rows are
//! split into chunks with a softmax each that run in parallel and are combined at the end
//! (flash-decoding), and the inner loops are AVX-512 or AVX2 when the machine has them (every row
//! format converted to f32 on the fly, q8_0 as `d * q`, q4_0 as `d * (q - 8)`).
//!
//! * this file: the row formats ([`KvType`]), a token's inputs ([`Attn`]), the entry points
//!   [`attention`] and [`attention_many`], and how a token's heads are split over the threads;
//! * `heads`: a block of heads over a run of rows (scores, softmax, weighted values), by the
//!   scalar code or the kernels of [`crate::vmath::Level`];
//! * `flash`: a long cache by chunks of rows, each with its own softmax (flash-decoding);
//! * `x86`: the AVX-512 and AVX2 kernels of the scores, the weighted values and the rounding of
//!   the probabilities;
//! * `tests`: the unit tests.
//!
//! The f32 vector math shared with the rest of the crate (the kernel level, ggml's vector exp,
//! the softmax's maximum and exponentials) is in [`crate::vmath`].

mod flash;
mod heads;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use heads::row_f32;

use crate::vmath::Level;
use flash::flash;
use half::f16;
use heads::heads;
use rayon::prelude::*;
use tandem_quant::GgmlType;

/// Rows per chunk: the unit of parallel work and of the partial sums.
const CHUNK: usize = 256;

/// Multiply-adds (heads x rows x (dk + dv)) from which one token's heads are split over the
/// threads: about 4 us of work on one core, against 1-2 us for a fork and join. Before, a token
/// stayed on one thread below 512 rows: at depth 0 that was 4% of a 2-thread decode step, with
/// the other thread idle.
const SPLIT_WORK: usize = 1 << 19;

/// The formats of cached rows the fast path reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
}

impl KvType {
    /// The fast path's format for a cache type, if it has one.
    pub fn of(ty: GgmlType) -> Option<KvType> {
        match ty {
            GgmlType::F32 => Some(KvType::F32),
            GgmlType::F16 => Some(KvType::F16),
            GgmlType::BF16 => Some(KvType::BF16),
            GgmlType::Q8_0 => Some(KvType::Q8_0),
            GgmlType::Q4_0 => Some(KvType::Q4_0),
            _ => None,
        }
    }

    /// The ggml type of the rows.
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F32 => GgmlType::F32,
            KvType::F16 => GgmlType::F16,
            KvType::BF16 => GgmlType::BF16,
            KvType::Q8_0 => GgmlType::Q8_0,
            KvType::Q4_0 => GgmlType::Q4_0,
        }
    }

    /// Values per block: heads and rows start at whole blocks.
    pub fn block(self) -> usize {
        match self {
            KvType::Q8_0 | KvType::Q4_0 => 32,
            _ => 1,
        }
    }

    /// Bytes of `n` values, `n` a whole number of blocks.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 | KvType::BF16 => 2 * n,
            KvType::Q8_0 => n / 32 * 34,
            KvType::Q4_0 => n / 32 * 18,
        }
    }
}

/// One token's attention over rows `0..n_kv` of a cache.
pub struct Attn<'a> {
    /// `[n_head][dk]`
    pub q: &'a [f32],
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    /// K rows, `k_row` values apart; head `kvh` starts at value `kvh * dk` of a row.
    pub k: &'a [u8],
    pub k_type: KvType,
    pub k_row: usize,
    /// V rows, `v_row` values apart, head `kvh` at `kvh * dv`; `None`: V is the first `dv`
    /// values of each K head (MLA), and `v_type` is `k_type`.
    pub v: Option<&'a [u8]>,
    pub v_type: KvType,
    pub v_row: usize,
    pub n_kv: usize,
    pub scale: f32,
}

#[cfg(test)]
impl<'a> Attn<'a> {
    /// A test's attention: `(n_head, n_head_kv, dk, dv)` over `n_kv` rows of `ty` packed back to
    /// back, K's heads in `k`, V's in `v` (or, without, in K's).
    pub(crate) fn case(
        q: &'a [f32],
        (n_head, n_head_kv, dk, dv): (usize, usize, usize, usize),
        k: &'a [u8],
        v: Option<&'a [u8]>,
        ty: KvType,
        n_kv: usize,
        scale: f32,
    ) -> Self {
        let v_row = if v.is_some() { n_head_kv * dv } else { n_head_kv * dk };
        Attn { q, n_head, n_head_kv, dk, dv, k, k_type: ty, k_row: n_head_kv * dk, v, v_type: ty, v_row, n_kv, scale }
    }
}

impl Attn<'_> {
    fn check(&self, out: &[f32]) -> bool {
        let (kt, vt) = (self.k_type, self.v_type);
        let (v_bytes, v_row, v_need_head) = match self.v {
            Some(v) => (v.len(), self.v_row, self.n_head_kv * self.dv),
            None => (self.k.len(), self.k_row, (self.n_head_kv - 1).saturating_mul(self.dk) + self.dv),
        };
        let whole = |t: KvType, n: usize| n.is_multiple_of(t.block());
        let need = |t: KvType, rows: usize, row: usize, head: usize| {
            rows.checked_mul(row).and_then(|n| n.checked_add(head)).map(|n| t.bytes(n))
        };
        let shape = self.n_head_kv > 0
            && self.n_head.is_multiple_of(self.n_head_kv)
            && self.q.len() == self.n_head * self.dk
            && out.len() == self.n_head * self.dv
            && whole(kt, self.dk)
            && whole(kt, self.k_row)
            && whole(vt, self.dv)
            && whole(vt, v_row)
            && (self.v.is_some() || (self.dv <= self.dk && vt == kt));
        shape
            && (self.n_kv == 0
                || (need(kt, self.n_kv - 1, self.k_row, self.n_head_kv * self.dk).is_some_and(|n| self.k.len() >= n)
                    && need(vt, self.n_kv - 1, v_row, v_need_head).is_some_and(|n| v_bytes >= n)))
    }

    fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    /// The V rows: bytes, values per row, values from one head to the next.
    fn v_rows(&self) -> (&[u8], usize, usize) {
        match self.v {
            Some(v) => (v, self.v_row, self.dv),
            None => (self.k, self.k_row, self.dk),
        }
    }

    /// q converted to K's dot type and back to f32: rounded to f16 or bf16, or quantized to Q8_0
    /// blocks (as llama.cpp's x86 build quantizes activations for q8_0 and q4_0 rows) and each
    /// value taken as `d * q`.
    fn prepared_q(&self) -> crate::Result<Vec<f32>> {
        let mut r = self.q.to_vec();
        match self.k_type {
            KvType::F32 => {}
            KvType::F16 => {
                use half::slice::HalfFloatSliceExt;
                let mut h = vec![f16::ZERO; r.len()];
                h.convert_from_f32_slice(&r);
                h.convert_to_f32_slice(&mut r);
            }
            KvType::BF16 => {
                r.iter_mut().for_each(|v| *v = tandem_quant::bf16_to_f32(tandem_quant::f32_to_bf16(*v)));
            }
            KvType::Q8_0 | KvType::Q4_0 => {
                let acts = crate::quantize_activations(GgmlType::Q8_0, self.q, self.dk)?;
                for (t, out) in r.chunks_exact_mut(self.dk).enumerate() {
                    tandem_quant::dequantize_row(GgmlType::Q8_0, acts.row(t), out)?;
                }
            }
        }
        Ok(r)
    }
}

/// Computes `out` (`[n_head][dv]`) for one token on `pool`.
///
/// Up to [`FLASH_MIN`] rows, ggml's order: all of a head's scores, their softmax, then the
/// weighted values; the heads are split over the threads when the work pays for it. Beyond, the
/// rows are cut into chunks ([`flash_rows`](flash::flash_rows)), each with its own softmax, and
/// the chunks' sums are combined at the end (flash-decoding): the threads split the rows, so each
/// core reads only its share of the cache, and once, instead of every thread reading all of it
/// for its heads.
///
/// Either way every head's arithmetic is what [`one_token`] does, so a token gets the same bits
/// alone or in a batch, on any number of threads.
pub fn attention(pool: &rayon::ThreadPool, a: &Attn, out: &mut [f32]) -> crate::Result<()> {
    if !a.check(out) {
        return Err(shape_error(a));
    }
    let qr = a.prepared_q()?;
    let level = Level::detected();
    let threads = pool.current_num_threads();
    if threads <= 1 || a.n_head * a.n_kv * (a.dk + a.dv) < SPLIT_WORK {
        one_token(a, &qr, out, level);
        return Ok(());
    }
    if a.n_kv > FLASH_MIN {
        flash(Some(pool), a, &qr, out, level);
        return Ok(());
    }
    let g = a.group();
    let hb = heads_per_unit(g, a.n_head_kv, threads);
    let mut units = Vec::with_capacity(a.n_head_kv * g.div_ceil(hb));
    let mut rest = out;
    for kvh in 0..a.n_head_kv {
        for h0 in (0..g).step_by(hb) {
            let hs = h0..(h0 + hb).min(g);
            let (o, r) = rest.split_at_mut(hs.len() * a.dv);
            units.push((kvh, hs, o));
            rest = r;
        }
    }
    crate::pool::for_each_item(pool, units, &|(kvh, hs, o)| heads(a, &qr, kvh, hs, o, level));
    Ok(())
}

/// Heads per unit of work for `groups` groups of `g` heads: at most eight (one register block),
/// fewer until every thread has a unit.
fn heads_per_unit(g: usize, groups: usize, threads: usize) -> usize {
    let mut hb = g.min(8);
    while hb > 1 && groups * g.div_ceil(hb) < threads {
        hb = hb.div_ceil(2);
    }
    hb
}

/// Rows beyond which a token's attention runs by chunks, each with its own softmax (`flash`):
/// the probabilities are then not rounded to V's dot type as ggml's non-flash path rounds them.
pub const FLASH_MIN: usize = 2 * CHUNK;

fn shape_error(a: &Attn) -> crate::Error {
    crate::Error::Shape(format!(
        "attention of {} heads ({} kv heads, dk {}, dv {}) over {} rows of a {:?}/{:?} cache: cache or output too short, or heads not whole blocks",
        a.n_head, a.n_head_kv, a.dk, a.dv, a.n_kv, a.k_type, a.v_type
    ))
}

/// Several tokens' attention (a micro-batch), one token per task when there are enough of them.
pub fn attention_many(pool: &rayon::ThreadPool, items: &[Attn], outs: &mut [&mut [f32]]) -> crate::Result<()> {
    if items.len() < 2 * pool.current_num_threads() {
        for (a, o) in items.iter().zip(outs.iter_mut()) {
            attention(pool, a, o)?;
        }
        return Ok(());
    }
    if let Some((a, _)) = items.iter().zip(outs.iter()).find(|(a, o)| !a.check(o)) {
        return Err(shape_error(a));
    }
    pool.install(|| {
        items.par_iter().zip(outs.par_iter_mut()).with_max_len(1).try_for_each(|(a, o)| {
            one_token(a, &a.prepared_q()?, o, Level::detected());
            Ok(())
        })
    })
}

/// The whole computation of one token on the calling thread.
fn one_token(a: &Attn, qr: &[f32], out: &mut [f32], level: Level) {
    if a.n_kv > FLASH_MIN {
        return flash(None, a, qr, out, level);
    }
    let g = a.group();
    for (kvh, o) in out.chunks_exact_mut(g * a.dv).enumerate() {
        heads(a, qr, kvh, 0..g, o, level);
    }
}
