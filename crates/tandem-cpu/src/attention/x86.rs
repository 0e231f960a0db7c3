//! The AVX-512 and AVX2 kernels of attention: the scores and weighted values of up to eight heads
//! at a time, every cached row converted to f32 on the fly (q8_0 as `d * q`, q4_0 as `d * (q - 8)`),
//! and the scaling and
//! rounding of the probabilities. The AVX2 kernels keep the AVX-512 kernels' lanes and orders of
//! addition: the same bits.

use super::{Attn, KvType};
use std::arch::x86_64::*;

/// Defines a `scale_round` kernel on one register width, from one source for both: `$w` lanes,
/// the intrinsics of that width, `$ph` the f16 rounding's immediate.
macro_rules! scale_round_fn {
    ($(#[$doc:meta])* $name:ident $feat:literal $w:literal [$set1:ident $mul:ident $loadu:ident $storeu:ident $to_ph:ident $from_ph:ident ($($ph:tt)*)] [$cast:ident $uncast:ident $and:ident $srli:ident $add:ident $set1i:ident]) => {
        $(#[$doc])*
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(x: &mut [f32], s: f32, v_type: KvType) {
            // SAFETY: the caller upholds this function's `# Safety` contract.
            unsafe {
                let sv = $set1(s);
                let mut chunks = x.chunks_exact_mut($w);
                for c in &mut chunks {
                    let v = $mul($loadu(c.as_ptr()), sv);
                    let r = match v_type {
                        KvType::F16 => $from_ph($to_ph::<{ $($ph)* }>(v)),
                        KvType::BF16 => {
                            // ggml_compute_fp32_to_bf16 for the finite values probabilities are.
                            let u = $cast(v);
                            let odd = $and($srli::<16>(u), $set1i(1));
                            let up = $add(u, $add($set1i(0x7fff), odd));
                            $uncast($and(up, $set1i(0xffff_0000u32 as i32)))
                        }
                        KvType::F32 | KvType::Q8_0 | KvType::Q4_0 => v,
                    };
                    $storeu(c.as_mut_ptr(), r);
                }
                for v in chunks.into_remainder() {
                    *v = super::heads::round_p(*v * s, v_type);
                }
            }
        }
    };
}

scale_round_fn!(
    /// `x = x * s` as V's dot type holds it: rounded to nearest even f16 or bf16 (ggml's
    /// conversions), or kept.
    ///
    /// # Safety
    /// The machine has AVX-512 F, DQ and F16C.
    scale_round "avx512f,avx512dq,f16c" 16
    [_mm512_set1_ps _mm512_mul_ps _mm512_loadu_ps _mm512_storeu_ps _mm512_cvtps_ph _mm512_cvtph_ps (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)]
    [_mm512_castps_si512 _mm512_castsi512_ps _mm512_and_si512 _mm512_srli_epi32 _mm512_add_epi32 _mm512_set1_epi32]
);
scale_round_fn!(
    /// [`scale_round`] with AVX2 and F16C: the same bits.
    ///
    /// # Safety
    /// The machine has AVX2 and F16C.
    scale_round_avx2 "avx2,f16c" 8
    [_mm256_set1_ps _mm256_mul_ps _mm256_loadu_ps _mm256_storeu_ps _mm256_cvtps_ph _mm256_cvtph_ps (_MM_FROUND_TO_NEAREST_INT)]
    [_mm256_castps_si256 _mm256_castsi256_ps _mm256_and_si256 _mm256_srli_epi32 _mm256_add_epi32 _mm256_set1_epi32]
);

/// Row formats as constants, for kernels compiled once per format.
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;
const Q8_0: u8 = 3;
const Q4_0: u8 = 4;

/// Calls `$f::<T, HB>(...)` with the row format `$t` as the constant `T` and the head count
/// `$hb` (1..=8) as the constant `HB`.
macro_rules! by_kv {
    ($t:expr, $hb:expr, $f:ident($($a:expr),*)) => {
        match $t {
            KvType::F32 => by_ny!($hb, $f[F32]($($a),*)),
            KvType::F16 => by_ny!($hb, $f[F16]($($a),*)),
            KvType::BF16 => by_ny!($hb, $f[BF16]($($a),*)),
            KvType::Q8_0 => by_ny!($hb, $f[Q8_0]($($a),*)),
            KvType::Q4_0 => by_ny!($hb, $f[Q4_0]($($a),*)),
        }
    };
}

/// Bytes of `n` values of format `T` (`n` a whole number of blocks).
#[inline(always)]
fn bytes<const T: u8>(n: usize) -> usize {
    match T {
        F32 => 4 * n,
        F16 | BF16 => 2 * n,
        Q4_0 => n / 32 * 18,
        _ => n / 32 * 34,
    }
}

/// Where value `d` of a row of format `T` lies (for prefetching).
#[inline(always)]
fn offset<const T: u8>(d: usize) -> usize {
    match T {
        F32 => 4 * d,
        F16 | BF16 => 2 * d,
        Q4_0 => d / 32 * 18 + 2 + d % 16,
        _ => d / 32 * 34 + 2 + d % 32,
    }
}

/// Defines a loader of one register of values of a row of format `T` as f32 (`d` a multiple of
/// the lane count): exact conversions, q8_0 as `d * q`, q4_0 as `d * (q - 8)` (values 0..16 of a
/// block in the low nibbles of its 16 bytes, 16..32 in the high ones). One source for both widths: `$v` and the
/// intrinsics of that width, `$half` the register holding as many 16-bit values.
macro_rules! load_fn {
    ($(#[$doc:meta])* $name:ident $feat:literal -> $v:ty [$loadu:ident $cvtph:ident $cvtepu16:ident $uncast:ident $slli:ident] [$bcast:ident $mul:ident $cvtepi32:ident $cvtepi8:ident] [$half:ty, $loadh:ident, $loadq:ident]) => {
        $(#[$doc])*
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const T: u8>(row: *const u8, d: usize) -> $v {
            // SAFETY: the caller upholds this function's `# Safety` contract.
            unsafe {
                match T {
                    F32 => $loadu(row.add(4 * d) as *const f32),
                    F16 => $cvtph($loadh(row.add(2 * d) as *const $half)),
                    BF16 => {
                        let h = $cvtepu16($loadh(row.add(2 * d) as *const $half));
                        $uncast($slli::<16>(h))
                    }
                    Q4_0 => {
                        let b = row.add(d / 32 * 18);
                        let scale = (b as *const u16).read_unaligned();
                        let d16 = $bcast(_mm_cvtph_ps(_mm_cvtsi32_si128(scale as i32)));
                        let e = d % 32;
                        let raw = $loadq(b.add(2 + e % 16) as *const __m128i);
                        let nib = if e < 16 { raw } else { _mm_srli_epi16::<4>(raw) };
                        let q = _mm_sub_epi8(_mm_and_si128(nib, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
                        $mul($cvtepi32($cvtepi8(q)), d16)
                    }
                    _ => {
                        let b = row.add(d / 32 * 34);
                        let scale = (b as *const u16).read_unaligned();
                        let d16 = $bcast(_mm_cvtph_ps(_mm_cvtsi32_si128(scale as i32)));
                        let q = $loadq(b.add(2 + d % 32) as *const __m128i);
                        $mul($cvtepi32($cvtepi8(q)), d16)
                    }
                }
            }
        }
    };
}

load_fn!(
    /// Values `d..d + 16` of a row of format `T` as f32 (`d` a multiple of 16): exact
    /// conversions, q8_0 as `d * q`, q4_0 as `d * (q - 8)`.
    load16 "avx512f,avx512bw,f16c" -> __m512
    [_mm512_loadu_ps _mm512_cvtph_ps _mm512_cvtepu16_epi32 _mm512_castsi512_ps _mm512_slli_epi32]
    [_mm512_broadcastss_ps _mm512_mul_ps _mm512_cvtepi32_ps _mm512_cvtepi8_epi32] [__m256i, _mm256_loadu_si256, _mm_loadu_si128]
);
load_fn!(
    /// Values `d..d + 8` of a row of format `T` as f32 (`d` a multiple of 8), as [`load16`].
    load8 "avx2,fma,f16c" -> __m256
    [_mm256_loadu_ps _mm256_cvtph_ps _mm256_cvtepu16_epi32 _mm256_castsi256_ps _mm256_slli_epi32]
    [_mm256_broadcastss_ps _mm256_mul_ps _mm256_cvtepi32_ps _mm256_cvtepi8_epi32] [__m128i, _mm_loadu_si128, _mm_loadl_epi64]
);

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
            let s = Scores { a, kvh, q: q.as_ptr(), out: o.as_mut_ptr(), stride };
            if avx2 {
                by_kv!(a.k_type, hb, scores_heads_avx2(&s, rows.clone()));
            } else {
                by_kv!(a.k_type, hb, scores_heads(&s, rows.clone()));
            }
        }
        h0 += hb;
    }
}

/// One [`scores`] call's heads: `q` (`[head][dk]`) against K head `kvh` of the rows, the
/// scores into `out`, a head's `stride` floats apart.
struct Scores<'a> {
    a: &'a Attn<'a>,
    kvh: usize,
    q: *const f32,
    out: *mut f32,
    stride: usize,
}

impl Scores<'_> {
    /// Row `j`'s keys of this head, of format `T`.
    ///
    /// # Safety
    /// Row `j` is in the cache.
    #[inline(always)]
    unsafe fn row<const T: u8>(&self, j: usize) -> *const u8 {
        // SAFETY: the caller keeps `j` in bounds.
        unsafe { self.a.k.as_ptr().add(bytes::<T>(j * self.a.k_row + self.kvh * self.a.dk)) }
    }

    /// Head `h`'s score of row `at` (counted from the call's first row), scaled.
    ///
    /// # Safety
    /// `h` and `at` are within the call's heads and rows.
    #[inline(always)]
    unsafe fn put(&self, h: usize, at: usize, dot: f32) {
        // SAFETY: the caller keeps `h` and `at` in bounds.
        unsafe { *self.out.add(h * self.stride + at) = dot * self.a.scale };
    }
}

/// A prefetch per this many values of a row of format `T`: one per 64 bytes (q8_0: per 34-byte
/// block, which touches every line).
const fn pf_every<const T: u8>() -> usize {
    if T == F32 {
        16
    } else {
        32
    }
}

/// [`scores`] for `HB` heads and rows of format `T`: the accumulators stay in registers (a
/// loop bound known at compile time), and with eight heads the sixteen sums of two rows are
/// reduced together.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")]
unsafe fn scores_heads<const T: u8, const HB: usize>(s: &Scores, rows: std::ops::Range<usize>) {
    let (dk, qb) = (s.a.dk, s.q);
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let mut j = rows.start;
        while j < rows.end {
            let two = j + 1 < rows.end;
            let (k0, k1) = (s.row::<T>(j), s.row::<T>(if two { j + 1 } else { j }));
            let mut acc0 = [_mm512_setzero_ps(); HB];
            let mut acc1 = [_mm512_setzero_ps(); HB];
            // The rows stream from memory: ask for the pair eight rows ahead (the hardware
            // prefetchers stop at every 4 KiB page).
            let ahead = (j + 8).min(rows.end - 1);
            let (p0, p1) = (s.row::<T>(ahead), s.row::<T>((ahead + 1).min(rows.end - 1)));
            let mut d = 0;
            while d < dk {
                if d % pf_every::<T>() == 0 {
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
                _mm512_storeu_ps(sums.as_mut_ptr(), reduce16(&v));
                for h in 0..8 {
                    s.put(h, at, sums[h]);
                    s.put(h, at + 1, sums[8 + h]);
                }
            } else {
                for h in 0..HB {
                    s.put(h, at, hsum(acc0[h]));
                    if two {
                        s.put(h, at + 1, hsum(acc1[h]));
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

/// Defines a [`weighted_values`] kernel for `HB` heads and rows of format `T`, accumulators in
/// registers, on one register width (`$w` lanes, `$load` and the intrinsics of that width): one
/// source for both.
macro_rules! values_heads_fn {
    ($(#[$doc:meta])* $name:ident $feat:literal $w:literal $load:ident [$zero:ident $set1:ident $fmadd:ident $loadu:ident $storeu:ident $add:ident]) => {
        $(#[$doc])*
        #[allow(clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const T: u8, const HB: usize>(v: &[u8], v_row: usize, head_off: usize, dv: usize, p: &[f32], stride: usize, rows: std::ops::Range<usize>, o: &mut [f32]) {
            // SAFETY: the caller upholds this function's `# Safety` contract.
            unsafe {
                let vp = v.as_ptr();
                let row_ptr = |j: usize| vp.add(bytes::<T>(j * v_row + head_off));
                let pp: [*const f32; HB] = std::array::from_fn(|h| p.as_ptr().wrapping_add(h * stride));
                // Blocks of rows small enough to stay in the first-level cache while every 32
                // values of them are added into the output; the next block is fetched meanwhile.
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
                        let mut acc = [[$zero(); 2]; HB];
                        for j in b0..b1 {
                            let i = j - rows.start;
                            let r = row_ptr(j);
                            let (x0, x1) = ($load::<T>(r, d), $load::<T>(r, d + $w));
                            for h in 0..HB {
                                let pj = $set1(*pp[h].add(i));
                                acc[h][0] = $fmadd(pj, x0, acc[h][0]);
                                acc[h][1] = $fmadd(pj, x1, acc[h][1]);
                            }
                        }
                        for (h, acc) in acc.iter().enumerate() {
                            let dst = o.as_mut_ptr().add(h * dv + d);
                            $storeu(dst, $add($loadu(dst), acc[0]));
                            $storeu(dst.add($w), $add($loadu(dst.add($w)), acc[1]));
                        }
                        d += 2 * $w;
                    }
                    b0 = b1;
                }
            }
        }
    };
}

values_heads_fn!(
    /// [`weighted_values`] for `HB` heads and rows of format `T`, accumulators in registers.
    values_heads "avx512f,avx512bw,avx512vl,avx512dq,f16c,fma" 16 load16
    [_mm512_setzero_ps _mm512_set1_ps _mm512_fmadd_ps _mm512_loadu_ps _mm512_storeu_ps _mm512_add_ps]
);
values_heads_fn!(
    /// [`values_heads`] with AVX2: 16 values of V at a time, the same bits.
    values_heads_avx2 "avx2,fma,f16c" 8 load8
    [_mm256_setzero_ps _mm256_set1_ps _mm256_fmadd_ps _mm256_loadu_ps _mm256_storeu_ps _mm256_add_ps]
);

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

/// [`scores_heads`] with AVX2: [`SR`] rows at a time, each sum kept in two 8-lane halves of the
/// AVX-512 kernel's 16 lanes (the even and the odd runs of 8 values, one pass over the rows each, so
/// that one half's accumulators of all the rows and heads fit the 16 registers) and reduced in its
/// order: the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_heads_avx2<const T: u8, const HB: usize>(s: &Scores, rows: std::ops::Range<usize>) {
    let dk = s.a.dk;
    for j in rows.clone().step_by(SR) {
        let n = (rows.end - j).min(SR);
        // SAFETY: rows `j..j + n` and the prefetched ones are in bounds (the caller's contract).
        unsafe {
            let k: [*const u8; SR] = std::array::from_fn(|r| s.row::<T>(j + r.min(n - 1)));
            let lo = scores_pass::<T, HB>(k, s.q, dk, 0);
            let hi = scores_pass::<T, HB>(k, s.q, dk, 8);
            for r in 0..SR {
                let pf = s.row::<T>((j + 8 + r).min(rows.end - 1));
                for d in (0..dk).step_by(pf_every::<T>()) {
                    _mm_prefetch::<_MM_HINT_T0>(pf.add(offset::<T>(d)) as *const i8);
                }
            }
            for (r, (lo, hi)) in lo.iter().zip(&hi).enumerate().take(n) {
                for (h, (lo, hi)) in lo.iter().zip(hi).enumerate() {
                    s.put(h, j + r - rows.start, hsum16(*lo, *hi));
                }
            }
        }
    }
}

/// Rows per pass of [`scores_heads_avx2`].
const SR: usize = 3;

/// One half (`first` 0: values 0-7 of every 16, 8: values 8-15) of the scores of `SR` rows `k`
/// against `HB` heads of `q`: the 8-lane sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // constant indices keep the sums in registers
unsafe fn scores_pass<const T: u8, const HB: usize>(
    k: [*const u8; SR],
    qb: *const f32,
    dk: usize,
    first: usize,
) -> [[__m256; HB]; SR] {
    // SAFETY: the caller's rows and queries hold `dk` values each.
    unsafe {
        let mut sums = [[_mm256_setzero_ps(); HB]; SR];
        let mut d = first;
        while d < dk {
            let x: [__m256; SR] = std::array::from_fn(|r| load8::<T>(k[r], d));
            for h in 0..HB {
                let qv = _mm256_loadu_ps(qb.add(h * dk + d));
                for r in 0..SR {
                    sums[r][h] = _mm256_fmadd_ps(x[r], qv, sums[r][h]);
                }
            }
            d += 16;
        }
        sums
    }
}
