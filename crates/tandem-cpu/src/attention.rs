//! Attention of one token over a KV cache of f16, bf16, f32 or q8_0 rows, as ggml's non-flash
//! path computes it (`kq = mul_mat(k, q)` with q converted to the cache's dot type: f16, bf16 or
//! Q8_0 blocks; `soft_max_ext` with the scale; the probabilities converted to V's dot type, f16 or
//! bf16, for `kqv = mul_mat(v, kq)`), but organized for speed: every cached row is read once for
//! all the heads that share it (all of them under MLA), beyond [`FLASH_MIN`] rows the rows are
//! split into chunks with a softmax each that run in parallel and are combined at the end
//! (flash-decoding), and the inner loops are AVX-512 when the machine has it (every row format
//! converted to f32 on the fly, q8_0 as `d * q`).

use crate::kernels::Isa;
use half::f16;
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
}

impl KvType {
    /// The fast path's format for a cache type, if it has one.
    pub fn of(ty: GgmlType) -> Option<KvType> {
        match ty {
            GgmlType::F32 => Some(KvType::F32),
            GgmlType::F16 => Some(KvType::F16),
            GgmlType::BF16 => Some(KvType::BF16),
            GgmlType::Q8_0 => Some(KvType::Q8_0),
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
        }
    }

    /// Values per block: heads and rows start at whole blocks.
    pub fn block(self) -> usize {
        if self == KvType::Q8_0 {
            32
        } else {
            1
        }
    }

    /// Bytes of `n` values, `n` a whole number of blocks.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvType::F32 => 4 * n,
            KvType::F16 | KvType::BF16 => 2 * n,
            KvType::Q8_0 => n / 32 * 34,
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
    /// blocks (as llama.cpp's x86 build quantizes activations) and each value taken as `d * q`.
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
            KvType::Q8_0 => {
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
/// rows are cut into chunks ([`flash_rows`]), each with its own softmax, and the chunks' sums are
/// combined at the end (flash-decoding): the threads split the rows, so each core reads only its
/// share of the cache, and once, instead of every thread reading all of it for its heads.
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

/// Bytes of partial sums [`flash`] keeps for a token at most (`[chunk][head][dv]` f32): with many
/// heads (128 under DeepSeek V3) the chunks grow instead, so that writing and reading the partial
/// sums stays small next to reading the cache.
const FLASH_PARTS: usize = 2 << 20;

/// Rows per chunk of [`flash`]: [`CHUNK`], or more where [`FLASH_PARTS`] would not hold the
/// partial sums. It depends on the shape and the rows alone, never on the threads.
fn flash_rows(a: &Attn) -> usize {
    let max_chunks = (FLASH_PARTS / (4 * a.n_head * a.dv).max(1)).max(1);
    CHUNK.max(a.n_kv.div_ceil(max_chunks))
}

/// One token's attention by chunks of [`flash_rows`] rows: for each chunk and block of heads, the
/// scores, their maximum `m` and `l = sum exp(s - m)`, and the values weighted by `exp(s - m)`;
/// then for each head the chunks combined in order, each scaled by `exp(m - max m) / sum l`.
/// With a pool the units run in parallel in chunk order, so each thread takes a run of rows (the
/// next block of heads of a chunk finds its rows in the thread's cache). A head's arithmetic does
/// not depend on which heads share its unit.
fn flash(pool: Option<&rayon::ThreadPool>, a: &Attn, qr: &[f32], out: &mut [f32], level: Level) {
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

/// Which kernels run: AVX-512, AVX2 (with FMA and F16C) or the scalar code. Each level has its
/// own arithmetic (lane counts); within a level a head's result depends only on its query and the
/// cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Scalar,
    Avx2,
    Avx512,
}

impl Level {
    pub(crate) fn detected() -> Level {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = Isa::detected();
            if isa >= Isa::Avx512 {
                return Level::Avx512;
            }
            if isa >= Isa::Avx2 {
                return Level::Avx2;
            }
        }
        Level::Scalar
    }
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

/// Heads `hs` (numbered within KV head `kvh`'s group) of one token over all rows; `out` holds
/// their `dv` values each. Each head's result depends on nothing but its own query and the cache.
fn heads(a: &Attn, qr: &[f32], kvh: usize, hs: std::ops::Range<usize>, out: &mut [f32], level: Level) {
    let n = hs.len();
    let first = kvh * a.group() + hs.start;
    let q = &qr[first * a.dk..(first + n) * a.dk];
    let stride = a.n_kv.max(1);
    let mut s = vec![0f32; n * stride];
    scores(a, kvh, q, n, 0..a.n_kv, &mut s, stride, level);
    softmax_rows(a.n_kv, &mut s, stride, a.v_type, level);
    weighted_values(a, kvh, &s, n, stride, 0..a.n_kv, out, level);
}

/// Softmax over the first `n_kv` scores of each head's row of `stride` (`s` is `[head][stride]`),
/// then rounded to f16 or bf16 as ggml converts the probabilities for the V product (kept as they
/// are for f32 and q8_0 V rows).
fn softmax_rows(n_kv: usize, s: &mut [f32], stride: usize, v_type: KvType, level: Level) {
    for row in s.chunks_exact_mut(stride.max(1)) {
        let r = &mut row[..n_kv];
        let max = max_of(r, level);
        let inv = (1.0 / exp_sub(r, max, level)) as f32;
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 {
            // SAFETY: AVX-512 is present.
            unsafe { x86::scale_round(r, inv, v_type) };
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx2 {
            // SAFETY: AVX2 and F16C are present.
            unsafe { x86::scale_round_avx2(r, inv, v_type) };
            continue;
        }
        for v in r.iter_mut() {
            *v = round_p(*v * inv, v_type);
        }
    }
}

/// The largest of `r` (`f32::max`'s: NaN ignored), in sixteen lanes: the same value as a fold
/// in order (the lanes can differ from it only by the sign of a zero maximum, which no
/// `exp(s - max)` sees), without its chain of one dependent comparison per score.
fn max_of(r: &[f32], level: Level) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::max_of(r) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 is present.
        return unsafe { x86::max_of_avx2(r) };
    }
    max_lanes(r)
}

#[inline(always)]
fn max_lanes(r: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut c = r.chunks_exact(16);
    for ch in &mut c {
        for (m, v) in m.iter_mut().zip(ch) {
            *m = m.max(*v);
        }
    }
    for (m, v) in m.iter_mut().zip(c.remainder()) {
        *m = m.max(*v);
    }
    m.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `r[i] = exp(r[i] - max)`, returning their sum.
fn exp_sub(r: &mut [f32], max: f32, level: Level) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 is present.
        return unsafe { x86::exp_sub(r, max) };
    }
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx2 {
        // SAFETY: AVX2 and FMA are present.
        return unsafe { x86::exp_sub_avx2(r, max) };
    }
    let mut sum = 0f64;
    for v in r.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    sum
}

/// A probability as V's dot type holds it.
fn round_p(p: f32, v_type: KvType) -> f32 {
    match v_type {
        KvType::F16 => f16::from_f32(p).to_f32(),
        KvType::BF16 => tandem_quant::bf16_to_f32(tandem_quant::f32_to_bf16(p)),
        KvType::F32 | KvType::Q8_0 => p,
    }
}

/// `s[h * stride + (j - rows.start)] = scale * dot(q_h, k_j)` for the `n` heads of `q` (all
/// sharing K head `kvh`) and the rows given.
#[allow(clippy::too_many_arguments)]
fn scores(
    a: &Attn,
    kvh: usize,
    q: &[f32],
    n: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    stride: usize,
    level: Level,
) {
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar && a.dk.is_multiple_of(16) {
        // SAFETY: the level's instructions are present; `check` bounded every row read below.
        unsafe { x86::scores(a, kvh, q, n, rows, out, stride, level == Level::Avx2) };
        return;
    }
    let mut kf = vec![0f32; a.dk];
    for j in rows.clone() {
        let at = a.k_type.bytes(j * a.k_row + kvh * a.dk);
        row_f32(a.k_type, &a.k[at..at + a.k_type.bytes(a.dk)], &mut kf);
        for (h, qh) in q.chunks_exact(a.dk).take(n).enumerate() {
            out[h * stride + j - rows.start] = dot(qh, &kf) * a.scale;
        }
    }
}

/// `out[h] = sum_j p[h][j] * v_j` over the rows given for the `n` heads of `p` (`out` is
/// `[n][dv]`, overwritten), all reading V head `kvh`.
#[allow(clippy::too_many_arguments)]
fn weighted_values(
    a: &Attn,
    kvh: usize,
    p: &[f32],
    n: usize,
    stride: usize,
    rows: std::ops::Range<usize>,
    out: &mut [f32],
    level: Level,
) {
    let (v, v_row, v_head) = a.v_rows();
    out.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if level != Level::Scalar && a.dv.is_multiple_of(32) {
        let avx2 = level == Level::Avx2;
        // SAFETY: the level's instructions are present; `check` bounded every row read below.
        unsafe { x86::weighted_values(v, a.v_type, v_row, kvh * v_head, a.dv, p, n, stride, rows, out, avx2) };
        return;
    }
    let mut vf = vec![0f32; a.dv];
    for j in rows.clone() {
        let at = a.v_type.bytes(j * v_row + kvh * v_head);
        row_f32(a.v_type, &v[at..at + a.v_type.bytes(a.dv)], &mut vf);
        for h in 0..n {
            let pj = p[h * stride + j - rows.start];
            for (o, v) in out[h * a.dv..(h + 1) * a.dv].iter_mut().zip(&vf) {
                *o += pj * v;
            }
        }
    }
}

/// Cached values as f32 (`out.len()` of them, a whole number of blocks).
pub(crate) fn row_f32(ty: KvType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        KvType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        KvType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = tandem_quant::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        KvType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(32).zip(bytes.chunks_exact(34)) {
                let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                for (o, q) in o.iter_mut().zip(&b[2..]) {
                    *o = d * (*q as i8) as f32;
                }
            }
        }
    }
}

/// f32 dot product in 8 lanes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::{Attn, KvType};
    use std::arch::x86_64::*;

    /// ggml's `ggml_v_expf` (ggml-cpu/vec.h, AVX-512): e^x to about 1 ulp, with the same
    /// polynomial llama.cpp's softmax uses.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn expf(x: __m512) -> __m512 {
        let r = _mm512_set1_ps(f32::from_bits(0x4B40_0000)); // 0x1.8p23
        let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
        let n = _mm512_sub_ps(z, r);
        let b = _mm512_fnmadd_ps(
            n,
            _mm512_set1_ps(f32::from_bits(0x35BF_BE8E)), // 0x1.7f7d1cp-20
            _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
        );
        let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
        let u = _mm512_mul_ps(b, b);
        let j = _mm512_fmadd_ps(
            _mm512_fmadd_ps(
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3C07_2010)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3D2B_9F17)),
                ),
                u,
                _mm512_fmadd_ps(
                    _mm512_set1_ps(f32::from_bits(0x3E2A_AF33)),
                    b,
                    _mm512_set1_ps(f32::from_bits(0x3EFF_FEDB)),
                ),
            ),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3F7F_FFF6)), b, _mm512_set1_ps(1.0)),
        );
        let res = _mm512_scalef_ps(j, n);
        if d == 0 {
            return res;
        }
        let zero = _mm512_setzero_ps();
        let alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero), _mm512_set1_ps(f32::INFINITY), zero);
        _mm512_mask_blend_ps(d, res, alt)
    }

    /// `gate = silu(gate) * up` as `ggml_vec_swiglu_f32` computes it with AVX-512 (`ggml_v_silu`:
    /// `x / (1 + e^-x)` with the vector exp above). The last partial vector goes through the same
    /// vector code (masked), so every element gets the same bits wherever it sits in the buffer.
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(crate) unsafe fn swiglu(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let one = _mm512_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let m: __mmask16 = if n - i >= 16 { 0xFFFF } else { (1u16 << (n - i)) - 1 };
            // SAFETY: the mask covers only elements below `n` of both slices.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(i));
                let g = _mm512_maskz_loadu_ps(m, up.as_ptr().add(i));
                let e = expf(_mm512_sub_ps(_mm512_setzero_ps(), x));
                let silu = _mm512_div_ps(x, _mm512_add_ps(one, e));
                _mm512_mask_storeu_ps(gate.as_mut_ptr().add(i), m, _mm512_mul_ps(silu, g));
            }
            i += 16;
        }
    }

    /// [`super::max_lanes`] compiled for AVX-512.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn max_of(r: &[f32]) -> f32 {
        super::max_lanes(r)
    }

    /// [`super::max_lanes`] compiled for AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn max_of_avx2(r: &[f32]) -> f32 {
        super::max_lanes(r)
    }

    /// The sum of 16 lanes (`lo` then `hi`) in one fixed order, shared by the AVX-512 and AVX2
    /// softmax so that both give the same bits.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sum16(lo: __m256, hi: __m256) -> f32 {
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
    }

    /// [`expf`] on 8 lanes with AVX2 and FMA: the same operations, and `scalef` (absent before
    /// AVX-512) as two exact multiplications by powers of two, so every lane gets the bits
    /// [`expf`] gives it (a result below the normal range is rounded once, by the second factor).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn expf8(x: __m256) -> __m256 {
        let r = _mm256_set1_ps(f32::from_bits(0x4B40_0000)); // 0x1.8p23
        let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3FB8_AA3B)), r); // 0x1.715476p+0
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(
            n,
            _mm256_set1_ps(f32::from_bits(0x35BF_BE8E)), // 0x1.7f7d1cp-20
            _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3F31_7200)), x), // 0x1.62e4p-1
        );
        let abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs, _mm256_set1_ps(192.0));
        let u = _mm256_mul_ps(b, b);
        let j = _mm256_fmadd_ps(
            _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3C07_2010)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3D2B_9F17)),
                ),
                u,
                _mm256_fmadd_ps(
                    _mm256_set1_ps(f32::from_bits(0x3E2A_AF33)),
                    b,
                    _mm256_set1_ps(f32::from_bits(0x3EFF_FEDB)),
                ),
            ),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(f32::from_bits(0x3F7F_FFF6)), b, _mm256_set1_ps(1.0)),
        );
        // 2^n for |n| <= 192 as 2^n1 * 2^(n - n1), n1 = trunc(n / 2): both factors are normal.
        let ni = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-192.0)), _mm256_set1_ps(192.0)));
        let n1 = _mm256_srai_epi32::<1>(ni);
        let n2 = _mm256_sub_epi32(ni, n1);
        let pow2 =
            |k: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))));
        let res = _mm256_mul_ps(_mm256_mul_ps(j, pow2(n1)), pow2(n2));
        if _mm256_movemask_ps(d) == 0 {
            return res;
        }
        let le0 = _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps());
        let alt = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), _mm256_setzero_ps(), le0);
        _mm256_blendv_ps(res, alt, d)
    }

    /// [`exp_sub`] with AVX2: the same bits.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sub_avx2(x: &mut [f32], max: f32) -> f64 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let mut sum = 0f64;
            let m = _mm256_set1_ps(max);
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let p = c.as_mut_ptr();
                let lo = expf8(_mm256_sub_ps(_mm256_loadu_ps(p), m));
                let hi = expf8(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), m));
                _mm256_storeu_ps(p, lo);
                _mm256_storeu_ps(p.add(8), hi);
                sum += sum16(lo, hi) as f64;
            }
            for v in chunks.into_remainder() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            sum
        }
    }

    /// [`scale_round`] with AVX2 and F16C: the same bits.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn scale_round_avx2(x: &mut [f32], s: f32, v_type: KvType) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let sv = _mm256_set1_ps(s);
            let mut chunks = x.chunks_exact_mut(8);
            for c in &mut chunks {
                let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), sv);
                let r = match v_type {
                    KvType::F16 => _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)),
                    KvType::BF16 => {
                        let u = _mm256_castps_si256(v);
                        let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(u), _mm256_set1_epi32(1));
                        let up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
                        _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(0xffff_0000u32 as i32)))
                    }
                    KvType::F32 | KvType::Q8_0 => v,
                };
                _mm256_storeu_ps(c.as_mut_ptr(), r);
            }
            for v in chunks.into_remainder() {
                *v = super::round_p(*v * s, v_type);
            }
        }
    }

    /// [`swiglu`] with AVX2 and FMA: the same bits (the vector exp of [`expf8`], the tail through
    /// masked loads as well).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i < n {
            let left = (n - i).min(8) as i32;
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            // SAFETY: the mask covers only elements below `n` of both slices.
            unsafe {
                let x = _mm256_maskload_ps(gate.as_ptr().add(i), m);
                let g = _mm256_maskload_ps(up.as_ptr().add(i), m);
                let e = expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
                _mm256_maskstore_ps(gate.as_mut_ptr().add(i), m, _mm256_mul_ps(silu, g));
            }
            i += 8;
        }
    }

    /// `x = e^(x - max)` in place; returns the sum, as `ggml_vec_soft_max_f32` (AVX-512).
    #[target_feature(enable = "avx512f,avx512dq")]
    pub(super) unsafe fn exp_sub(x: &mut [f32], max: f32) -> f64 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let mut sum = 0f64;
            let m = _mm512_set1_ps(max);
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let v = expf(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
                _mm512_storeu_ps(c.as_mut_ptr(), v);
                sum += sum16(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v)) as f64;
            }
            for v in chunks.into_remainder() {
                *v = (*v - max).exp();
                sum += *v as f64;
            }
            sum
        }
    }

    /// `x = x * s` as V's dot type holds it: rounded to nearest even f16 or bf16 (ggml's
    /// conversions), or kept.
    #[target_feature(enable = "avx512f,avx512dq,f16c")]
    pub(super) unsafe fn scale_round(x: &mut [f32], s: f32, v_type: KvType) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let sv = _mm512_set1_ps(s);
            let mut chunks = x.chunks_exact_mut(16);
            for c in &mut chunks {
                let v = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), sv);
                let r = match v_type {
                    KvType::F16 => {
                        _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
                    }
                    KvType::BF16 => {
                        // ggml_compute_fp32_to_bf16 for the finite values probabilities are.
                        let u = _mm512_castps_si512(v);
                        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(u), _mm512_set1_epi32(1));
                        let up = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
                        _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(0xffff_0000u32 as i32)))
                    }
                    KvType::F32 | KvType::Q8_0 => v,
                };
                _mm512_storeu_ps(c.as_mut_ptr(), r);
            }
            for v in chunks.into_remainder() {
                *v = super::round_p(*v * s, v_type);
            }
        }
    }

    /// Row formats as constants, for kernels compiled once per format.
    const F32: u8 = 0;
    const F16: u8 = 1;
    const BF16: u8 = 2;
    const Q8_0: u8 = 3;

    /// Calls `$f::<T, HB>(...)` with the row format `$t` as the constant `T` and the head count
    /// `$hb` (1..=8) as the constant `HB`.
    macro_rules! by_kv {
        ($t:expr, $hb:expr, $f:ident($($a:expr),*)) => {
            match $t {
                KvType::F32 => by_ny!($hb, $f[F32]($($a),*)),
                KvType::F16 => by_ny!($hb, $f[F16]($($a),*)),
                KvType::BF16 => by_ny!($hb, $f[BF16]($($a),*)),
                KvType::Q8_0 => by_ny!($hb, $f[Q8_0]($($a),*)),
            }
        };
    }

    /// Bytes of `n` values of format `T` (`n` a whole number of blocks).
    #[inline(always)]
    fn bytes<const T: u8>(n: usize) -> usize {
        match T {
            F32 => 4 * n,
            F16 | BF16 => 2 * n,
            _ => n / 32 * 34,
        }
    }

    /// Where value `d` of a row of format `T` lies (for prefetching).
    #[inline(always)]
    fn offset<const T: u8>(d: usize) -> usize {
        match T {
            F32 => 4 * d,
            F16 | BF16 => 2 * d,
            _ => d / 32 * 34 + 2 + d % 32,
        }
    }

    /// Values `d..d + 16` of a row of format `T` as f32 (`d` a multiple of 16): exact
    /// conversions, q8_0 as `d * q`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn load16<const T: u8>(row: *const u8, d: usize) -> __m512 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            match T {
                F32 => _mm512_loadu_ps(row.add(4 * d) as *const f32),
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * d) as *const __m256i)),
                BF16 => {
                    let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(row.add(2 * d) as *const __m256i));
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
                }
                _ => {
                    let b = row.add(d / 32 * 34);
                    let scale = (b as *const u16).read_unaligned();
                    let d16 = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(scale as i32)));
                    let q = _mm_loadu_si128(b.add(2 + d % 32) as *const __m128i);
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d16)
                }
            }
        }
    }

    /// Sums of sixteen vectors: lane `i` of the result is the sum of the lanes of `v[i]`
    /// (15 pairwise steps, each two permutes and an add, instead of sixteen full reductions).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        // Lanes 2i and 2i+1 of every step's inputs always belong to the same original vector, so
        // adding the even lanes to the odd ones halves each vector's partial sums while keeping
        // them together, in order.
        let pair =
            |a: __m512, b: __m512| _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
        let l1: [__m512; 8] = std::array::from_fn(|i| pair(v[2 * i], v[2 * i + 1]));
        let l2: [__m512; 4] = std::array::from_fn(|i| pair(l1[2 * i], l1[2 * i + 1]));
        let l3: [__m512; 2] = std::array::from_fn(|i| pair(l2[2 * i], l2[2 * i + 1]));
        pair(l3[0], l3[1])
    }

    /// The sum of one vector's lanes added in the same order as [`reduce16`] adds them, so that a
    /// score has the same bits whichever way its heads and rows were blocked.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum(v: __m512) -> f32 {
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
        let mut x = v;
        for _ in 0..4 {
            x = _mm512_add_ps(_mm512_permutexvar_ps(even, x), _mm512_permutexvar_ps(odd, x));
        }
        _mm512_cvtss_f32(x)
    }

    /// Scores of `g` heads (q rows of `a.dk`) against K head `kvh` of each row: with AVX-512 two
    /// rows at a time against up to eight heads, with AVX2 (`avx2`) one row against up to four,
    /// every K chunk converted once for all of them.
    ///
    /// # Safety
    /// The machine has AVX-512 (AVX2, FMA and F16C with `avx2`); the rows are in bounds.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores(
        a: &Attn,
        kvh: usize,
        q: &[f32],
        g: usize,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
        avx2: bool,
    ) {
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(if avx2 { 4 } else { 8 });
            let (q, o) = (&q[h0 * a.dk..], &mut out[h0 * stride..]);
            // SAFETY: forwarded from the caller.
            unsafe {
                if avx2 {
                    by_kv!(a.k_type, hb, scores_heads_avx2(a, kvh, q, rows.clone(), o, stride));
                } else {
                    by_kv!(a.k_type, hb, scores_heads(a, kvh, q, rows.clone(), o, stride));
                }
            }
            h0 += hb;
        }
    }

    /// [`scores`] for `HB` heads and rows of format `T`: the accumulators stay in registers (a
    /// loop bound known at compile time), and with eight heads the sixteen sums of two rows are
    /// reduced together.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    unsafe fn scores_heads<const T: u8, const HB: usize>(
        a: &Attn,
        kvh: usize,
        q: &[f32],
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let dk = a.dk;
            let kp = a.k.as_ptr();
            let row_ptr = |j: usize| kp.add(bytes::<T>(j * a.k_row + kvh * dk));
            // A prefetch per 64 bytes of a row (q8_0: per 34-byte block, which touches every line).
            let pf_every = if T == F32 { 16 } else { 32 };
            let qb = q.as_ptr();
            let op = out.as_mut_ptr();
            let mut j = rows.start;
            while j < rows.end {
                let two = j + 1 < rows.end;
                let (k0, k1) = (row_ptr(j), row_ptr(if two { j + 1 } else { j }));
                let mut acc0 = [_mm512_setzero_ps(); HB];
                let mut acc1 = [_mm512_setzero_ps(); HB];
                // The rows stream from memory: ask for the pair eight rows ahead (the hardware
                // prefetchers stop at every 4 KiB page).
                let ahead = (j + 8).min(rows.end - 1);
                let (p0, p1) = (row_ptr(ahead), row_ptr((ahead + 1).min(rows.end - 1)));
                let mut d = 0;
                while d < dk {
                    if d % pf_every == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(p0.add(offset::<T>(d)) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(p1.add(offset::<T>(d)) as *const i8);
                    }
                    let x0 = load16::<T>(k0, d);
                    let x1 = load16::<T>(k1, d);
                    for h in 0..HB {
                        let qv = _mm512_loadu_ps(qb.add(h * dk + d));
                        acc0[h] = _mm512_fmadd_ps(x0, qv, acc0[h]);
                        acc1[h] = _mm512_fmadd_ps(x1, qv, acc1[h]);
                    }
                    d += 16;
                }
                let at = j - rows.start;
                if HB == 8 && two {
                    let v: [__m512; 16] = std::array::from_fn(|i| if i < 8 { acc0[i % HB] } else { acc1[i % HB] });
                    let mut sums = [0f32; 16];
                    _mm512_storeu_ps(sums.as_mut_ptr(), _mm512_mul_ps(reduce16(&v), _mm512_set1_ps(a.scale)));
                    for h in 0..8 {
                        *op.add(h * stride + at) = sums[h];
                        *op.add(h * stride + at + 1) = sums[8 + h];
                    }
                } else {
                    for h in 0..HB {
                        *op.add(h * stride + at) = hsum(acc0[h]) * a.scale;
                        if two {
                            *op.add(h * stride + at + 1) = hsum(acc1[h]) * a.scale;
                        }
                    }
                }
                j += 2;
            }
        }
    }

    /// `o[h] += sum_j p[h][j] v_j` for `g` heads, 32 values of V at a time against up to eight
    /// heads with AVX-512, 16 against up to four with AVX2 (`avx2`), every V chunk converted once
    /// for all of them.
    ///
    /// # Safety
    /// The machine has AVX-512 (AVX2, FMA and F16C with `avx2`); the rows are in bounds.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn weighted_values(
        v: &[u8],
        ty: KvType,
        v_row: usize,
        head_off: usize,
        dv: usize,
        p: &[f32],
        g: usize,
        stride: usize,
        rows: std::ops::Range<usize>,
        o: &mut [f32],
        avx2: bool,
    ) {
        let mut h0 = 0;
        while h0 < g {
            let hb = (g - h0).min(if avx2 { 4 } else { 8 });
            let (p, o) = (&p[h0 * stride..], &mut o[h0 * dv..]);
            let r = rows.clone();
            // SAFETY: forwarded from the caller.
            unsafe {
                if avx2 {
                    by_kv!(ty, hb, values_heads_avx2(v, v_row, head_off, dv, p, stride, r, o));
                } else {
                    by_kv!(ty, hb, values_heads(v, v_row, head_off, dv, p, stride, r, o));
                }
            }
            h0 += hb;
        }
    }

    /// [`weighted_values`] for `HB` heads and rows of format `T`, accumulators in registers.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
    unsafe fn values_heads<const T: u8, const HB: usize>(
        v: &[u8],
        v_row: usize,
        head_off: usize,
        dv: usize,
        p: &[f32],
        stride: usize,
        rows: std::ops::Range<usize>,
        o: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let vp = v.as_ptr();
            let row_ptr = |j: usize| vp.add(bytes::<T>(j * v_row + head_off));
            let pp: [*const f32; HB] = std::array::from_fn(|h| p.as_ptr().wrapping_add(h * stride));
            // Blocks of rows small enough to stay in the first-level cache while every 32 values of
            // them are added into the output; the next block is fetched meanwhile.
            const BLOCK: usize = 16;
            let mut b0 = rows.start;
            while b0 < rows.end {
                let b1 = (b0 + BLOCK).min(rows.end);
                let next = b1.min(rows.end - 1)..(b1 + BLOCK).min(rows.end);
                let mut d = 0;
                while d < dv {
                    for j in next.clone() {
                        _mm_prefetch::<_MM_HINT_T0>(row_ptr(j).add(offset::<T>(d)) as *const i8);
                        if T == F32 {
                            _mm_prefetch::<_MM_HINT_T0>(row_ptr(j).add(offset::<T>(d + 16)) as *const i8);
                        }
                    }
                    let mut acc = [[_mm512_setzero_ps(); 2]; HB];
                    for j in b0..b1 {
                        let i = j - rows.start;
                        let r = row_ptr(j);
                        let x0 = load16::<T>(r, d);
                        let x1 = load16::<T>(r, d + 16);
                        for h in 0..HB {
                            let pj = _mm512_set1_ps(*pp[h].add(i));
                            acc[h][0] = _mm512_fmadd_ps(pj, x0, acc[h][0]);
                            acc[h][1] = _mm512_fmadd_ps(pj, x1, acc[h][1]);
                        }
                    }
                    for (h, acc) in acc.iter().enumerate() {
                        let dst = o.as_mut_ptr().add(h * dv + d);
                        _mm512_storeu_ps(dst, _mm512_add_ps(_mm512_loadu_ps(dst), acc[0]));
                        _mm512_storeu_ps(dst.add(16), _mm512_add_ps(_mm512_loadu_ps(dst.add(16)), acc[1]));
                    }
                    d += 32;
                }
                b0 = b1;
            }
        }
    }

    /// Values `d..d + 8` of a row of format `T` as f32 (`d` a multiple of 8), as [`load16`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const T: u8>(row: *const u8, d: usize) -> __m256 {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            match T {
                F32 => _mm256_loadu_ps(row.add(4 * d) as *const f32),
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * d) as *const __m128i)),
                BF16 => {
                    let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(2 * d) as *const __m128i));
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
                }
                _ => {
                    let b = row.add(d / 32 * 34);
                    let scale = (b as *const u16).read_unaligned();
                    let d16 = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(scale as i32)));
                    let q = _mm_loadl_epi64(b.add(2 + d % 32) as *const __m128i);
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d16)
                }
            }
        }
    }

    /// The sum of the 16 lanes `lo`, `hi` in the order of [`hsum`] (pairs, then pairs of pairs),
    /// so that AVX2 scores have the bits of the AVX-512 ones.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum16(lo: __m256, hi: __m256) -> f32 {
        let h1 = _mm256_hadd_ps(lo, hi); // (0+1, 2+3, 8+9, 10+11 | 4+5, 6+7, 12+13, 14+15)
        let h2 = _mm256_hadd_ps(h1, h1); // (0..3, 8..11, .. | 4..7, 12..15, ..)
        let r = _mm_add_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps::<1>(h2)); // (0..7, 8..15, ..)
        _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
    }

    /// [`scores_heads`] with AVX2: one row at a time, each sum kept in two 8-lane halves of the
    /// AVX-512 kernel's 16 lanes and reduced in its order: the same bits.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_heads_avx2<const T: u8, const HB: usize>(
        a: &Attn,
        kvh: usize,
        q: &[f32],
        rows: std::ops::Range<usize>,
        out: &mut [f32],
        stride: usize,
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let dk = a.dk;
            let kp = a.k.as_ptr();
            let row_ptr = |j: usize| kp.add(bytes::<T>(j * a.k_row + kvh * dk));
            let pf_every = if T == F32 { 16 } else { 32 };
            let qb = q.as_ptr();
            let op = out.as_mut_ptr();
            for j in rows.clone() {
                let k = row_ptr(j);
                let pf = row_ptr((j + 8).min(rows.end - 1));
                let mut lo = [_mm256_setzero_ps(); HB];
                let mut hi = [_mm256_setzero_ps(); HB];
                let mut d = 0;
                while d < dk {
                    if d % pf_every == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(pf.add(offset::<T>(d)) as *const i8);
                    }
                    let (x0, x1) = (load8::<T>(k, d), load8::<T>(k, d + 8));
                    for h in 0..HB {
                        lo[h] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(qb.add(h * dk + d)), lo[h]);
                        hi[h] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(qb.add(h * dk + d + 8)), hi[h]);
                    }
                    d += 16;
                }
                for h in 0..HB {
                    *op.add(h * stride + j - rows.start) = hsum16(lo[h], hi[h]) * a.scale;
                }
            }
        }
    }

    /// [`values_heads`] with AVX2: 16 values of V at a time, the same bits.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values_heads_avx2<const T: u8, const HB: usize>(
        v: &[u8],
        v_row: usize,
        head_off: usize,
        dv: usize,
        p: &[f32],
        stride: usize,
        rows: std::ops::Range<usize>,
        o: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let vp = v.as_ptr();
            let row_ptr = |j: usize| vp.add(bytes::<T>(j * v_row + head_off));
            let pp: [*const f32; HB] = std::array::from_fn(|h| p.as_ptr().wrapping_add(h * stride));
            const BLOCK: usize = 16;
            let mut b0 = rows.start;
            while b0 < rows.end {
                let b1 = (b0 + BLOCK).min(rows.end);
                let next = b1.min(rows.end - 1)..(b1 + BLOCK).min(rows.end);
                let mut d = 0;
                while d < dv {
                    if d % 32 == 0 {
                        for j in next.clone() {
                            _mm_prefetch::<_MM_HINT_T0>(row_ptr(j).add(offset::<T>(d)) as *const i8);
                            if T == F32 {
                                _mm_prefetch::<_MM_HINT_T0>(row_ptr(j).add(offset::<T>(d + 16)) as *const i8);
                            }
                        }
                    }
                    let mut acc = [[_mm256_setzero_ps(); 2]; HB];
                    for j in b0..b1 {
                        let i = j - rows.start;
                        let r = row_ptr(j);
                        let x0 = load8::<T>(r, d);
                        let x1 = load8::<T>(r, d + 8);
                        for h in 0..HB {
                            let pj = _mm256_set1_ps(*pp[h].add(i));
                            acc[h][0] = _mm256_fmadd_ps(pj, x0, acc[h][0]);
                            acc[h][1] = _mm256_fmadd_ps(pj, x1, acc[h][1]);
                        }
                    }
                    for (h, acc) in acc.iter().enumerate() {
                        let dst = o.as_mut_ptr().add(h * dv + d);
                        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), acc[0]));
                        _mm256_storeu_ps(dst.add(8), _mm256_add_ps(_mm256_loadu_ps(dst.add(8)), acc[1]));
                    }
                    d += 16;
                }
                b0 = b1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-1, 1) from an xorshift generator seeded with `seed`.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// Rows of random values in a cache format.
    fn cache_rows(ty: KvType, x: &[f32]) -> Vec<u8> {
        match ty {
            KvType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            KvType::F16 => x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
            KvType::BF16 => x.iter().flat_map(|v| tandem_quant::f32_to_bf16(*v).to_le_bytes()).collect(),
            KvType::Q8_0 => {
                let mut out = vec![0u8; x.len() / 32 * 34];
                tandem_quant::quantize_row(GgmlType::Q8_0, x, &mut out).unwrap();
                out
            }
        }
    }

    /// Scores and weighted values have the same bits however the rows are cut into calls (at any
    /// row for scores, at whole blocks of 16 for values): a split of the rows between threads or
    /// into blocks may rely on it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn rows_cut_into_calls_give_the_same_bits() {
        let levels: Vec<bool> = match Level::detected() {
            Level::Avx512 => vec![false, true],
            Level::Avx2 => vec![true],
            Level::Scalar => {
                println!("SKIPPED attention row blocks: this machine has no AVX2");
                return;
            }
        };
        let mut rnd = uniform(5);
        let (nh, dk, dv, n) = (16usize, 576usize, 512usize, 300usize);
        let k = cache_rows(KvType::F16, &(0..n * dk).map(|_| rnd()).collect::<Vec<_>>());
        let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
        let p: Vec<f32> = (0..nh * n).map(|_| rnd().abs() / n as f32).collect();
        let a = Attn {
            q: &q,
            n_head: nh,
            n_head_kv: 1,
            dk,
            dv,
            k: &k,
            k_type: KvType::F16,
            k_row: dk,
            v: None,
            v_type: KvType::F16,
            v_row: dk,
            n_kv: n,
            scale: 0.1,
        };
        let (v, v_row, _) = a.v_rows();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for avx2 in levels {
            let (mut whole, mut cut) = (vec![0f32; nh * n], vec![0f32; nh * n]);
            // SAFETY: the level was detected; every row read is within the n rows of the cache.
            unsafe {
                x86::scores(&a, 0, &q, nh, 0..n, &mut whole, n, avx2);
                for (r0, r1) in [(0, 37), (37, 200), (200, n)] {
                    x86::scores(&a, 0, &q, nh, r0..r1, &mut cut[r0..], n, avx2);
                }
            }
            assert_eq!(bits(&whole), bits(&cut), "scores, avx2 {avx2}");
            let (mut whole, mut cut) = (vec![0f32; nh * dv], vec![0f32; nh * dv]);
            // SAFETY: as above; the outputs hold nh rows of dv.
            unsafe {
                x86::weighted_values(v, KvType::F16, v_row, 0, dv, &p, nh, n, 0..n, &mut whole, avx2);
                for (r0, r1) in [(0, 80), (80, 96), (96, n)] {
                    x86::weighted_values(v, KvType::F16, v_row, 0, dv, &p[r0..], nh, n, r0..r1, &mut cut, avx2);
                }
            }
            assert_eq!(bits(&whole), bits(&cut), "values, avx2 {avx2}");
        }
    }

    /// A prefill's tokens (each seeing one more row of the same cache, as a causal batch does),
    /// and tokens of another sequence, give in a batch exactly the bits they give one at a time,
    /// for every cache format.
    #[test]
    fn a_batch_of_tokens_equals_each_token_alone_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut rnd = uniform(11);
        // (n_head, n_head_kv, dk, dv, separate V)
        for &(nh, nkv, dk, dv, sep) in
            &[(16usize, 1usize, 576usize, 512usize, false), (12, 4, 64, 64, true), (6, 2, 48, 32, true)]
        {
            for ty in [KvType::F16, KvType::BF16, KvType::F32, KvType::Q8_0] {
                if !dk.is_multiple_of(ty.block()) {
                    continue;
                }
                let rows = 800;
                let mut values = |n: usize| -> Vec<u8> { cache_rows(ty, &(0..n).map(|_| rnd()).collect::<Vec<f32>>()) };
                let (k, v, k2) = (values(rows * nkv * dk), values(rows * nkv * dv), values(rows * nkv * dk));
                let n_tok = 37;
                let qs: Vec<Vec<f32>> = (0..n_tok).map(|_| (0..nh * dk).map(|_| rnd()).collect()).collect();
                let items: Vec<Attn> = (0..n_tok)
                    .map(|t| Attn {
                        q: &qs[t],
                        n_head: nh,
                        n_head_kv: nkv,
                        dk,
                        dv,
                        // The last tokens read another cache (another sequence).
                        k: if t < 30 { &k } else { &k2 },
                        k_type: ty,
                        k_row: nkv * dk,
                        v: sep.then_some(&v[..]),
                        v_type: ty,
                        v_row: nkv * dv,
                        // Depths from 100 to 767 rows.
                        n_kv: if t < 30 { 100 + 23 * t } else { 1 + 17 * (t - 30) },
                        scale: 0.125,
                    })
                    .collect();
                let mut batch = vec![vec![f32::NAN; nh * dv]; n_tok];
                let mut outs: Vec<&mut [f32]> = batch.iter_mut().map(|o| &mut o[..]).collect();
                attention_many(&pool, &items, &mut outs).unwrap();
                for (t, a) in items.iter().enumerate() {
                    let mut alone = vec![f32::NAN; nh * dv];
                    attention(&one, a, &mut alone).unwrap();
                    assert!(
                        batch[t].iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{ty:?} {nh}/{nkv}/{dk}/{dv} token {t}: batch differs from alone"
                    );
                    // Alone on two and three threads (its heads split over them where the work pays
                    // for it).
                    for (threads, p) in [(2, &pool), (3, &three)] {
                        let mut split = vec![f32::NAN; nh * dv];
                        attention(p, a, &mut split).unwrap();
                        assert!(
                            split.iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{ty:?} {nh}/{nkv}/{dk}/{dv} token {t}: {threads} threads differ from one"
                        );
                    }
                }
            }
        }
    }

    /// The AVX-512 kernels against the scalar code of this file, for every cache format (the
    /// reference that follows ggml's order is in tandem-model's backend tests).
    #[test]
    fn simd_kernels_match_the_scalar_code() {
        let mut levels = Vec::new();
        for (level, isa) in [(Level::Avx512, Isa::Avx512), (Level::Avx2, Isa::Avx2)] {
            if isa.supported() {
                levels.push(level);
            } else {
                println!("SKIPPED {isa} attention kernels: this machine does not run them");
            }
        }
        let mut rnd = uniform(5);
        for &(nh, nkv, dk, dv, sep, n_kv) in &[
            (16usize, 1usize, 576usize, 512usize, false, 300usize),
            // Past FLASH_MIN rows: by chunks, the last one partial.
            (16, 1, 576, 512, false, 700),
            (8, 2, 64, 64, true, 77),
            (2, 1, 32, 32, true, 1),
            (4, 4, 128, 128, true, 1000),
        ] {
            for ty in [KvType::F16, KvType::BF16, KvType::F32, KvType::Q8_0] {
                let mut values = |n: usize| -> Vec<u8> { cache_rows(ty, &(0..n).map(|_| rnd()).collect::<Vec<f32>>()) };
                let (k, v) = (values(n_kv * nkv * dk), values(n_kv * nkv * dv));
                let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
                let a = Attn {
                    q: &q,
                    n_head: nh,
                    n_head_kv: nkv,
                    dk,
                    dv,
                    k: &k,
                    k_type: ty,
                    k_row: nkv * dk,
                    v: sep.then_some(&v[..]),
                    v_type: ty,
                    v_row: nkv * dv,
                    n_kv,
                    scale: 0.125,
                };
                assert!(a.check(&vec![0f32; nh * dv]));
                let qr = a.prepared_q().unwrap();
                let mut slow = vec![0f32; nh * dv];
                one_token(&a, &qr, &mut slow, Level::Scalar);
                let max = slow.iter().fold(0f32, |m, v| m.max(v.abs()));
                let mut outs = Vec::new();
                for &level in &levels {
                    let mut fast = vec![0f32; nh * dv];
                    one_token(&a, &qr, &mut fast, level);
                    for (i, (f, s)) in fast.iter().zip(&slow).enumerate() {
                        assert!((f - s).abs() <= 1e-4 * max, "{level:?} {ty:?} {nh}/{nkv}/{dk}/{dv} [{i}]: {f} vs {s}");
                    }
                    outs.push(fast);
                }
                // The AVX2 kernels keep the AVX-512 kernels' lanes and orders: the same bits.
                if let [a512, a2] = &outs[..] {
                    assert!(
                        a512.iter().zip(a2).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{ty:?} {nh}/{nkv}/{dk}/{dv}: AVX2 differs from AVX-512 in bits"
                    );
                }
            }
        }
    }

    /// Past [`FLASH_MIN`] rows a token runs by chunks of [`CHUNK`] rows, and with many heads by
    /// larger chunks, so that the partial sums stay within [`FLASH_PARTS`]. The bits do not depend
    /// on the threads either way, and the result is the textbook softmax(q K) V.
    #[test]
    fn long_caches_run_by_chunks_the_same_on_any_threads() {
        let mut rnd = uniform(21);
        // (n_head, dk, dv, n_kv, rows per chunk): 16 heads of 512 values keep 32 KiB of partial
        // sums per chunk; 128 heads 256 KiB, so 2 MiB hold 8 chunks: 2100 rows in chunks of 263.
        for &(nh, dk, dv, n_kv, chunk) in &[(16usize, 64usize, 512usize, 1500usize, CHUNK), (128, 32, 512, 2100, 263)] {
            let k: Vec<f32> = (0..n_kv * dk).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..n_kv * dv).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
            let (kb, vb) = (cache_rows(KvType::F32, &k), cache_rows(KvType::F32, &v));
            let a = Attn {
                q: &q,
                n_head: nh,
                n_head_kv: 1,
                dk,
                dv,
                k: &kb,
                k_type: KvType::F32,
                k_row: dk,
                v: Some(&vb),
                v_type: KvType::F32,
                v_row: dv,
                n_kv,
                scale: 0.25,
            };
            assert_eq!(flash_rows(&a), chunk, "{nh} heads of {dv} over {n_kv} rows");
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut out = vec![f32::NAN; nh * dv];
                attention(&pool, &a, &mut out).unwrap();
                out
            };
            let one = run(1);
            for threads in [2, 3] {
                assert!(
                    run(threads).iter().zip(&one).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{nh} heads, {n_kv} rows: {threads} threads differ from one"
                );
            }
            for h in 0..nh {
                let s: Vec<f64> = (0..n_kv)
                    .map(|j| 0.25 * (0..dk).map(|d| q[h * dk + d] as f64 * k[j * dk + d] as f64).sum::<f64>())
                    .collect();
                let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - top).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..dv {
                    let want = (0..n_kv).map(|j| e[j] * v[j * dv + d] as f64).sum::<f64>() / sum;
                    let got = one[h * dv + d] as f64;
                    assert!((got - want).abs() <= 1e-5, "{nh} heads, {n_kv} rows, head {h} [{d}]: {got} vs {want}");
                }
            }
        }
    }

    /// Heads that are not whole q8_0 blocks, and caches too short for their rows, are refused.
    #[test]
    fn bad_shapes_are_refused() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let q = vec![0.5f32; 2 * 48];
        let k = vec![0u8; 10 * 48 * 4]; // ten f32 rows
        let a = |ty: KvType, n_kv: usize| Attn {
            q: &q,
            n_head: 2,
            n_head_kv: 1,
            dk: 48,
            dv: 32,
            k: &k,
            k_type: ty,
            k_row: 48,
            v: None,
            v_type: ty,
            v_row: 0,
            n_kv,
            scale: 1.0,
        };
        let mut out = vec![0f32; 64];
        assert!(attention(&pool, &a(KvType::F16, 10), &mut out).is_ok());
        let e = attention(&pool, &a(KvType::Q8_0, 10), &mut out).unwrap_err().to_string();
        assert!(e.contains("Q8_0") && e.contains("whole blocks"), "{e}");
        assert!(attention(&pool, &a(KvType::F32, 11), &mut out).is_err());
        assert!(attention(&pool, &a(KvType::F32, 10), &mut out).is_ok());
        let mut mixed = a(KvType::F16, 10);
        mixed.v_type = KvType::BF16;
        assert!(attention(&pool, &mixed, &mut out).is_err(), "MLA's V is K's rows: one format");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_swiglu_is_close_to_libm_and_independent_of_position() {
        if !super::Isa::Avx512.supported() {
            println!("AVX-512 not on this machine: vector SwiGLU not checked");
            return;
        }
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).chain([0.0, -90.0, 90.0, -0.0]).collect();
        let up: Vec<f32> = (0..x.len()).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut got = x.clone();
        // SAFETY: AVX-512 checked above.
        unsafe { super::x86::swiglu(&mut got, &up) };
        for ((x, u), g) in x.iter().zip(&up).zip(&got) {
            let want = x / (1.0 + (-x).exp()) * u;
            assert!(
                (g - want).abs() <= 4.0 * f32::EPSILON * want.abs() + f32::MIN_POSITIVE,
                "silu({x}) * {u} = {g}, libm {want}"
            );
        }
        if super::Isa::Avx2.supported() {
            let mut got2 = x.clone();
            // SAFETY: AVX2 and FMA checked.
            unsafe { super::x86::swiglu_avx2(&mut got2, &up) };
            assert!(got2.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "AVX2 differs from AVX-512");
        }
        // The same element at another offset (in the masked tail or not) gets the same bits.
        for start in [1usize, 5, 17, 990] {
            let mut part = x[start..].to_vec();
            // SAFETY: as above.
            unsafe { super::x86::swiglu(&mut part, &up[start..]) };
            assert!(part.iter().zip(&got[start..]).all(|(a, b)| a.to_bits() == b.to_bits()), "offset {start}");
        }
    }

    /// The softmax's maximum in lanes, at every level the machine has, is the ordered fold's
    /// value, with NaNs among the scores and at every length of the tail.
    #[test]
    fn the_lane_maximum_is_the_ordered_fold() {
        let mut u = uniform(77);
        for len in (0..70).chain([255, 256, 257, 3072]) {
            for nans in [0, 1, 3] {
                let mut r: Vec<f32> = (0..len).map(|_| u() * 50.0).collect();
                for k in 0..nans.min(len) {
                    r[(k * 7919) % len] = f32::NAN;
                }
                let want = r.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for level in [Level::Scalar, Level::Avx2, Level::Avx512] {
                    if level > Level::detected() {
                        println!("SKIPPED the {level:?} maximum: this machine lacks it");
                        continue;
                    }
                    let got = max_of(&r, level);
                    assert_eq!(got.to_bits(), want.to_bits(), "len {len}, {nans} NaN, {level:?}: {got} != {want}");
                }
            }
        }
        // All NaN or none: minus infinity, as the fold gives.
        assert_eq!(max_of(&[f32::NAN; 20], Level::detected()), f32::NEG_INFINITY);
        assert_eq!(max_of(&[], Level::detected()), f32::NEG_INFINITY);
    }

    /// The AVX2 softmax (exp, sum, scale and rounding) gives the AVX-512 one's bits, across the
    /// whole range a softmax sees (down to the flush to zero below e^-133 and through the
    /// subnormal results between).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_softmax_has_the_bits_of_the_avx512_one() {
        if !(super::Isa::Avx512.supported() && super::Isa::Avx2.supported()) {
            println!("SKIPPED AVX2 vs AVX-512 softmax: this machine lacks one of them");
            return;
        }
        let xs: Vec<f32> =
            (0..50_003).map(|i| -200.0 + i as f32 * 0.004).chain([0.0, -0.0, -1e-30, -87.5, -103.9]).collect();
        for ty in [KvType::F16, KvType::BF16, KvType::F32] {
            let (mut a, mut b) = (xs.clone(), xs.clone());
            // SAFETY: both levels checked above.
            let (sa, sb) = unsafe { (super::x86::exp_sub(&mut a, 0.0), super::x86::exp_sub_avx2(&mut b, 0.0)) };
            assert_eq!(sa.to_bits(), sb.to_bits(), "sums");
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "exp");
            // SAFETY: as above.
            unsafe {
                super::x86::scale_round(&mut a, 0.37, ty);
                super::x86::scale_round_avx2(&mut b, 0.37, ty);
            }
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ty:?} rounding");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_libm_to_a_few_ulp() {
        if !super::Isa::Avx512.supported() {
            println!("AVX-512 not on this machine: vector exp not checked");
            return;
        }
        let xs: Vec<f32> =
            (0..40_000).map(|i| -150.0 + i as f32 * 0.00397).chain([0.0, -0.0, -1e-30, -200.0, -90.0]).collect();
        let mut got = xs.clone();
        // SAFETY: AVX-512 checked above.
        let sum = unsafe { super::x86::exp_sub(&mut got, 0.0) };
        let want: Vec<f32> = xs.iter().map(|x| x.exp()).collect();
        for ((x, g), w) in xs.iter().zip(&got).zip(&want) {
            assert!((g - w).abs() <= 4.0 * f32::EPSILON * w.abs() + f32::MIN_POSITIVE, "exp({x}) = {g}, libm {w}");
        }
        let want_sum: f64 = want.iter().map(|&v| v as f64).sum();
        assert!((sum - want_sum).abs() <= 1e-5 * want_sum);
    }
}
