//! The dot loops over unpacked blocks ([`super::unpack`]), one per x86 level, generic over the weight
//! type and the number of activation rows `NY` (a weight block is unpacked once for all `NY` rows).

use super::unpack::{Factors, KQuant, Unpacked};
use crate::kernels::MAX_WIDE;
use std::arch::x86_64::*;
use std::mem::{offset_of, size_of};
use tandem_quant::blocks::BlockQ8K;

/// ggml block_q8_K: f32 d, i8 qs[256], i16 bsums[16] (292 bytes).
const Q8K_BYTES: usize = size_of::<BlockQ8K>();
const Q8K_QS: usize = offset_of!(BlockQ8K, qs);
const Q8K_BSUMS: usize = offset_of!(BlockQ8K, bsums);
const _: () = assert!(Q8K_BYTES == 292 && Q8K_QS == 4 && Q8K_BSUMS == 260 && offset_of!(BlockQ8K, d) == 0);

#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

#[inline(always)]
unsafe fn yd(y: *const u8) -> f32 {
    // SAFETY: the caller guarantees a whole Q8_K block at `y`.
    unsafe { (y as *const f32).read_unaligned() }
}

/// How far ahead of the block being multiplied a single-token dot asks for weight bytes.
const AHEAD: usize = 12 * 1024;

/// Prefetch hints ([`crate::Prefetch`]) for the cache lines of the `T::BYTES` bytes [`AHEAD`] past the
/// block at `p`: one block's few lines per block, so the requests stay spread over the row and the
/// rows after it (a single token streams the weights once; the hardware prefetchers stop at page
/// boundaries). A burst of a whole row's lines before each row, as the caller used to ask, kept a
/// 2-thread product of a large Q4_K matrix at 55-58 GB/s; spread, 12 KiB ahead, it ran at 72-73
/// (8 KiB: 59-60, 16 KiB: 62; Q6_K 63 against 74; docs/perf/HISTORY.md).
/// (A block's last line, where it straddles two, is the next block's first.)
#[inline(always)]
fn prefetch_block<T: KQuant>(p: *const u8) {
    crate::prefetch_stream(p.wrapping_add(AHEAD), T::BYTES);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// One block's float term of a row (ymm lanes): the integer sum `t` less the `m` term (`bsums`
/// times `m`) in integers, times `d`, for [`KQuant::FOLD`] types; else `t * d - (bsums . m) * dmin`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_term256<T: KQuant>(t: __m256i, bsums: __m256i, m: __m256i, dv: __m256, dmv: __m256) -> __m256 {
    let mi = _mm256_madd_epi16(bsums, m);
    if T::FOLD {
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(t, mi)), dv)
    } else {
        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), dmv, _mm256_mul_ps(_mm256_cvtepi32_ps(t), dv))
    }
}

/// [`block_term256`] for a zmm integer sum (the `m` term in the low 8 lanes).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn block_term512<T: KQuant>(t: __m512i, bsums: __m256i, m: __m256i, dv: __m512, dmv: __m512) -> __m512 {
    let mi = _mm512_zextsi256_si512(_mm256_madd_epi16(bsums, m));
    if T::FOLD {
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(t, mi)), dv)
    } else {
        _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mi), dmv, _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv))
    }
}

/// Per-32-element i16 scale vectors for `vpmaddubsw` output: low half group 2k, high half 2k+1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_256(sc: __m256i) -> [__m256i; 8] {
    let lo = _mm256_permute2x128_si256(sc, sc, 0x00);
    let hi = _mm256_permute2x128_si256(sc, sc, 0x11);
    let mut s = [_mm256_setzero_si256(); 8];
    for (k, v) in s.iter_mut().enumerate() {
        // Bytes of i16 `2m` (group 2k) in the low half, of i16 `2m+1` (group 2k+1) in the high half.
        let m = (k % 4) as i8;
        let pat: [i8; 32] = std::array::from_fn(|i| 4 * m + 2 * (i / 16) as i8 + (i % 2) as i8);
        // SAFETY: 32 bytes read from a 32-byte array.
        let pat = unsafe { _mm256_loadu_si256(pat.as_ptr() as *const __m256i) };
        *v = _mm256_shuffle_epi8(if k < 4 { lo } else { hi }, pat);
    }
    s
}

/// AVX2: `out[j] = dot(w, y_j)` for `NY` rows.
///
/// # Safety
/// `w` holds `n / 256` blocks of `T`, `ys` holds `NY` rows of `n / 256` Q8_K blocks, `out` has `NY`
/// elements; the machine has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_avx2<T: KQuant, const NY: usize>(n: usize, w: *const u8, ys: *const u8, out: *mut f32) {
    let nb = n / tandem_quant::QK_K;
    let row = nb * Q8K_BYTES;
    let mut acc = [_mm256_setzero_ps(); NY];
    for i in 0..nb {
        // SAFETY: block `i` of the weight row and of each of the NY activation rows is in bounds.
        unsafe {
            if NY == 1 {
                prefetch_block::<T>(w.add(i * T::BYTES));
            }
            let Unpacked { w: wb, f } = T::unpack(w.add(i * T::BYTES));
            let s = scales_256(f.sc);
            let (dv, dmv) = (_mm256_set1_ps(f.d), _mm256_set1_ps(f.dmin));
            // k outer, rows inner: the NY integer sums stay in registers (16 ymm), each weight and
            // scale vector is loaded once per block.
            let y: [*const u8; NY] = std::array::from_fn(|j| ys.add(j * row + i * Q8K_BYTES));
            let mut t = [_mm256_setzero_si256(); NY];
            for (k, (wk, sk)) in wb.iter().zip(&s).enumerate() {
                if NY > 4 {
                    // Scheduling barrier: without it LLVM puts rows outermost and reloads all weight
                    // and scale vectors from the stack for every row (measured ~5-10% slower at
                    // NY=8; at NY<=4 the barrier was not better).
                    std::arch::asm!("", options(nostack, preserves_flags));
                }
                for (tt, yy) in t.iter_mut().zip(y) {
                    let q = ld(yy.add(Q8K_QS + 32 * k));
                    *tt = _mm256_add_epi32(*tt, _mm256_madd_epi16(_mm256_maddubs_epi16(*wk, q), *sk));
                }
            }
            for ((a, tt), yy) in acc.iter_mut().zip(t).zip(y) {
                let v = block_term256::<T>(tt, ld(yy.add(Q8K_BSUMS)), f.m, dv, dmv);
                *a = _mm256_fmadd_ps(v, _mm256_set1_ps(yd(yy)), *a);
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        // SAFETY: `out` has NY elements.
        unsafe { *out.add(j) = hsum256(*a) };
    }
}

/// AVX2 for up to [`MAX_WIDE`] rows, each weight block unpacked once for all of them, the
/// accumulators in memory: per row the operations of [`dot_avx2`], so bit-identical to it.
///
/// # Safety
/// As [`dot_avx2`] with `ny` (at most [`MAX_WIDE`]) rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_wide_avx2<T: KQuant>(n: usize, w: *const u8, ys: *const u8, ny: usize, out: *mut f32) {
    let nb = n / tandem_quant::QK_K;
    let row = nb * Q8K_BYTES;
    let ny = ny.min(MAX_WIDE);
    if nb == 0 {
        // SAFETY: `out` has ny elements.
        unsafe { std::ptr::write_bytes(out, 0, ny) };
        return;
    }
    // Token j's sum at `acc[j]`, written by block 0 (so nothing is zeroed beforehand: zeroing the
    // whole array was a memset of 2-4 KiB per call).
    let mut store = [const { std::mem::MaybeUninit::<__m256>::uninit() }; MAX_WIDE];
    let acc = store.as_mut_ptr() as *mut __m256;
    for i in 0..nb {
        // SAFETY: block `i` of the weight row and of each of the ny activation rows is in bounds.
        unsafe {
            let Unpacked { w: wb, f } = T::unpack(w.add(i * T::BYTES));
            let s = scales_256(f.sc);
            let (dv, dmv) = (_mm256_set1_ps(f.d), _mm256_set1_ps(f.dmin));
            for j in 0..ny {
                let yy = ys.add(j * row + i * Q8K_BYTES);
                let mut t = _mm256_setzero_si256();
                for (k, (wk, sk)) in wb.iter().zip(&s).enumerate() {
                    let q = ld(yy.add(Q8K_QS + 32 * k));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(*wk, q), *sk));
                }
                let v = block_term256::<T>(t, ld(yy.add(Q8K_BSUMS)), f.m, dv, dmv);
                let a = acc.add(j);
                let prev = if i == 0 { _mm256_setzero_ps() } else { *a };
                *a = _mm256_fmadd_ps(v, _mm256_set1_ps(yd(yy)), prev);
            }
        }
    }
    for j in 0..ny {
        // SAFETY: `out` has ny elements; block 0 wrote every accumulator.
        unsafe { *out.add(j) = hsum256(*acc.add(j)) };
    }
}

/// Multi-row kernels: `NR` weight rows (`wstride` bytes apart) against `NY` activation rows, on
/// the registers of `$rows` (`rows_256!`, `rows_512!`, which take `$rargs` and the block): each
/// activation block is loaded once and serves all `NR` unpacked weight blocks; every (row, token)
/// result goes through exactly the operations of the single-row kernel of its width, so it is
/// bit-identical to it.
macro_rules! tile {
    (
        $(#[$doc:meta])* $name:ident, $features:literal, [$zero:ident, $fmadd:ident, $reduce:path],
        $rows:ident!($($rargs:tt)*)
    ) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `w` holds `NR` rows of `n / 256` blocks of `T`, `wstride` bytes apart; `ys` holds `NY` rows
        /// of `n / 256` Q8_K blocks; `out` has `NR * NY` elements (`out[r * NY + j]`); the machine has
        /// the features named.
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)] // r, j and k index several arrays at once
        pub(crate) unsafe fn $name<T: KQuant, const NR: usize, const NY: usize>(
            n: usize,
            w: *const u8,
            wstride: usize,
            ys: *const u8,
            out: *mut f32,
        ) {
            let nb = n / tandem_quant::QK_K;
            let row = nb * Q8K_BYTES;
            let mut acc = [[$zero(); NY]; NR];
            for i in 0..nb {
                // SAFETY: block `i` of each of the NR weight rows and NY activation rows is in bounds.
                unsafe {
                    $rows!($($rargs)* (w, wstride, ys, row, i), NY, |r, j, v, ydv| {
                        acc[r][j] = $fmadd(v, ydv, acc[r][j]);
                    });
                }
            }
            for (r, a) in acc.iter().enumerate() {
                for (j, a) in a.iter().enumerate() {
                    // SAFETY: `out` has NR * NY elements.
                    unsafe { *out.add(r * NY + j) = $reduce(*a) };
                }
            }
        }
    };
}

/// Block `$i` of `NR` weight rows against the `$ny` activation rows of [`tile!`] with AVX2, as
/// [`dot_avx2`] computes each: per token, each activation vector loaded once for the `NR` rows;
/// then `$acc` with row `$r`, token `$j`, the block's value `$v` and the token's factor `$ydv`.
macro_rules! rows_256 {
    (($w:ident, $wstride:ident, $ys:ident, $row:ident, $i:ident), $ny:expr, |$r:ident, $j:ident, $v:ident, $ydv:ident| $acc:block) => {
        let zero = Factors { sc: _mm256_setzero_si256(), m: _mm256_setzero_si256(), d: 0.0, dmin: 0.0 };
        let mut u = [Unpacked { w: [_mm256_setzero_si256(); 8], f: zero }; NR];
        let mut s = [[_mm256_setzero_si256(); 8]; NR];
        for r in 0..NR {
            u[r] = T::unpack($w.add(r * $wstride + $i * T::BYTES));
            s[r] = scales_256(u[r].f.sc);
        }
        for $j in 0..$ny {
            let y = $ys.add($j * $row + $i * Q8K_BYTES);
            let mut t = [_mm256_setzero_si256(); NR];
            for k in 0..8 {
                let q = ld(y.add(Q8K_QS + 32 * k));
                for r in 0..NR {
                    t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u[r].w[k], q), s[r][k]));
                }
            }
            let bs = ld(y.add(Q8K_BSUMS));
            let $ydv = _mm256_set1_ps(yd(y));
            for $r in 0..NR {
                let f = u[$r].f;
                let (dv, dmv) = (_mm256_set1_ps(f.d), _mm256_set1_ps(f.dmin));
                let $v = block_term256::<T>(t[$r], bs, f.m, dv, dmv);
                $acc
            }
        }
    };
}

tile!(
    /// AVX2 (ymm): `out[r * NY + j] = dot(w_r, y_j)`, each bit-identical to [`dot_avx2`].
    tile_avx2, "avx2,fma,f16c", [_mm256_setzero_ps, _mm256_fmadd_ps, hsum256], rows_256!()
);

/// vpermw indices spreading 16 group scales over the 32 i16 lanes of `vpmaddubsw` on 64 elements.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn scales_512(sc: __m256i) -> [__m512i; 4] {
    let sc = _mm512_zextsi256_si512(sc);
    let mut s = [_mm512_setzero_si512(); 4];
    for (k, v) in s.iter_mut().enumerate() {
        // i16 lane i of the `vpmaddubsw` output covers elements 64k + 2i, 64k + 2i + 1: group 4k + i/8.
        let idx: [i16; 32] = std::array::from_fn(|i| (4 * k + i / 8) as i16);
        // SAFETY: 64 bytes read from a 32 x i16 array.
        *v = _mm512_permutexvar_epi16(unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }, sc);
    }
    s
}

/// AVX-512 integer sum of one row block: `vpmaddubsw` pairs, `vpmaddwd` by the group scales.
///
/// # Safety
/// `y` points at a whole Q8_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn row_madd(wz: &[__m512i; 4], s: &[__m512i; 4], y: *const u8) -> __m512i {
    // SAFETY: forwarded from the caller.
    row_madd_q(wz, s, &unsafe { load_q(y) })
}

/// [`row_madd`] on the block's quants already loaded ([`load_q`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn row_madd_q(wz: &[__m512i; 4], s: &[__m512i; 4], q: &[__m512i; 4]) -> __m512i {
    let mut t = _mm512_setzero_si512();
    for k in 0..4 {
        t = _mm512_add_epi32(t, _mm512_madd_epi16(_mm512_maddubs_epi16(wz[k], q[k]), s[k]));
    }
    t
}

/// The 256 quants of the Q8_K block at `y` as 4 zmm.
///
/// # Safety
/// `y` points at a whole Q8_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load_q(y: *const u8) -> [__m512i; 4] {
    let mut q = [_mm512_setzero_si512(); 4];
    for (k, v) in q.iter_mut().enumerate() {
        // SAFETY: 64 of the 256 quants of the block.
        *v = unsafe { _mm512_loadu_si512(y.add(Q8K_QS + 64 * k) as *const __m512i) };
    }
    q
}

/// Scale vectors for `vpdpwssd` on `vpackssdw(dp[2h], dp[2h+1])` of the per-4-element `vpdpbusd` sums
/// of zmm `k = 2h, 2h+1`: in 128-bit lane `L`, i16 0..4 come from group `4k+L`, 4..8 from `4k+4+L`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn scales_packed(sc: __m256i) -> [__m512i; 2] {
    let sc = _mm512_zextsi256_si512(sc);
    let mut s = [_mm512_setzero_si512(); 2];
    for (h, v) in s.iter_mut().enumerate() {
        let mut idx = [0i16; 32];
        for (i, x) in idx.iter_mut().enumerate() {
            let (l, p) = (i / 8, i % 8);
            *x = (8 * h + l + if p < 4 { 0 } else { 4 }) as i16;
        }
        // SAFETY: 64 bytes read from a 32 x i16 array.
        *v = _mm512_permutexvar_epi16(unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) }, sc);
    }
    s
}

/// AVX-512 VNNI integer sum of one row block: `vpdpbusd` sums of 4 products (at most 4 * 63 * 128
/// < 2^15, so they pack to i16 exactly), then `vpdpwssd` by the group scales: 6 multiplies per
/// 256 elements instead of 8.
///
/// # Safety
/// `y` points at a whole Q8_K block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
unsafe fn row_vnni(wz: &[__m512i; 4], s: &[__m512i; 2], y: *const u8) -> __m512i {
    // SAFETY: forwarded from the caller.
    row_vnni_q(wz, s, &unsafe { load_q(y) })
}

/// [`row_vnni`] on the block's quants already loaded ([`load_q`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
fn row_vnni_q(wz: &[__m512i; 4], s: &[__m512i; 2], q: &[__m512i; 4]) -> __m512i {
    let mut dp = [_mm512_setzero_si512(); 4];
    for (k, d) in dp.iter_mut().enumerate() {
        *d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wz[k], q[k]);
    }
    let t = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(dp[0], dp[1]), s[0]);
    _mm512_dpwssd_epi32(t, _mm512_packs_epi32(dp[2], dp[3]), s[1])
}

/// The zmm kernels differ only in how one row block's integer sum is formed (`$scales`, `$row`).
macro_rules! dot_512 {
    ($(#[$doc:meta])* $name:ident, $features:literal, $scales:ident, $row:ident) => {
        dot_512!($(#[$doc])* $name, $features, $scales, $row, unpack512);
    };
    ($(#[$doc:meta])* $name:ident, $features:literal, $scales:ident, $row:ident, $unpack:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// As [`dot_avx2`], and the machine has the features named.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<T: KQuant, const NY: usize>(n: usize, w: *const u8, ys: *const u8, out: *mut f32) {
            let nb = n / tandem_quant::QK_K;
            let row = nb * Q8K_BYTES;
            let mut acc = [_mm512_setzero_ps(); NY];
            for i in 0..nb {
                // SAFETY: block `i` of the weight row and of each of the NY activation rows is in bounds.
                unsafe {
                    if NY == 1 {
                        prefetch_block::<T>(w.add(i * T::BYTES));
                    }
                    let (wz, f) = T::$unpack(w.add(i * T::BYTES));
                    let s = $scales(f.sc);
                    let (dv, dmv) = (_mm512_set1_ps(f.d), _mm512_set1_ps(f.dmin));
                    for (j, a) in acc.iter_mut().enumerate() {
                        let y = ys.add(j * row + i * Q8K_BYTES);
                        let t = $row(&wz, &s, y);
                        let v = block_term512::<T>(t, ld(y.add(Q8K_BSUMS)), f.m, dv, dmv);
                        *a = _mm512_fmadd_ps(v, _mm512_set1_ps(yd(y)), *a);
                    }
                }
            }
            for (j, a) in acc.iter().enumerate() {
                // SAFETY: `out` has NY elements.
                unsafe { *out.add(j) = _mm512_reduce_add_ps(*a) };
            }
        }
    };
}

dot_512!(
    /// AVX-512 (zmm): `out[j] = dot(w, y_j)` for `NY` rows.
    dot_avx512, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", scales_512, row_madd
);
dot_512!(
    /// AVX-512 VNNI (zmm): `out[j] = dot(w, y_j)` for `NY` rows.
    dot_avx512vnni, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", scales_packed, row_vnni
);
dot_512!(
    /// AVX-512 VNNI with VBMI and BITALG (zmm), unpacking with [`KQuant::unpack_vbmi`] (types with
    /// [`KQuant::VNNI`]): `out[j] = dot(w, y_j)` for `NY` rows.
    dot_avx512vbmi_vnni, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx512bitalg,avx2,fma,f16c",
    scales_packed, row_vnni, unpack_vbmi
);
dot_512!(
    /// AVX-512 with VBMI and BITALG (zmm), unpacking with [`KQuant::unpack_vbmi`]: `out[j] = dot(w, y_j)`
    /// for `NY` rows.
    dot_avx512vbmi, "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c", scales_512, row_madd,
    unpack_vbmi
);

/// Block `$i` of the `NR` weight rows (`$wstride` bytes apart from `$w`, unpacked by `$unpack`)
/// against the tokens `0..$ny` (rows `$row` bytes apart from `$ys`), the body of the zmm kernels
/// of several weight rows (`wide_512!`, `tile!`): each activation block is loaded once for all
/// the rows, and every (row `$r`, token `$j`) gets the block's float term `$v` of `dot_512!` and the
/// token's factor `$ydv` to accumulate (`$acc`). The caller binds `T`, `NR` and the names given.
macro_rules! rows_512 {
    (
        T::$unpack:ident, $scales:ident, $rowq:ident, ($w:ident, $wstride:ident, $ys:ident, $row:ident, $i:ident),
        $ny:expr, |$r:ident, $j:ident, $v:ident, $ydv:ident| $acc:block
    ) => {
        // Plain loops, not `array::from_fn`: its closures were left as calls (not inlined) here,
        // with the unpacked vectors passed through memory.
        let zero = Factors { sc: _mm256_setzero_si256(), m: _mm256_setzero_si256(), d: 0.0, dmin: 0.0 };
        let mut u = [([_mm512_setzero_si512(); 4], zero); NR];
        let mut s = [[_mm512_setzero_si512(); _]; NR];
        for r in 0..NR {
            u[r] = T::$unpack($w.add(r * $wstride + $i * T::BYTES));
            s[r] = $scales(u[r].1.sc);
        }
        for $j in 0..$ny {
            let y = $ys.add($j * $row + $i * Q8K_BYTES);
            let q = load_q(y);
            let bs = ld(y.add(Q8K_BSUMS));
            let $ydv = _mm512_set1_ps(yd(y));
            for $r in 0..NR {
                let (wz, f) = &u[$r];
                let (dv, dmv) = (_mm512_set1_ps(f.d), _mm512_set1_ps(f.dmin));
                let t = $rowq(wz, &s[$r], &q);
                let $v = block_term512::<T>(t, bs, f.m, dv, dmv);
                $acc
            }
        }
    };
}

/// Wide zmm kernels: `NR` weight rows (`wstride` bytes apart; one row, or several where each
/// activation block loaded once for all of them pays) against up to [`MAX_WIDE`] tokens, each
/// weight block unpacked once for all of them (for the types whose unpacking costs more than a
/// token's dot product), the accumulators in memory. Every (row, token) result goes through
/// exactly the operations of `dot_512!`, so it is bit-identical to it.
macro_rules! wide_512 {
    ($(#[$doc:meta])* $name:ident, $features:literal, $scales:ident, $rowq:ident, $unpack:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `w` holds `NR` rows of `n / 256` blocks of `T`, `wstride` bytes apart; `ys` holds `ny`
        /// (at most [`MAX_WIDE`]) rows of `n / 256` Q8_K blocks; `out` has `NR * ny` elements
        /// (`out[r * ny + j]`); the machine has the features named.
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<T: KQuant, const NR: usize>(
            n: usize,
            w: *const u8,
            wstride: usize,
            ys: *const u8,
            ny: usize,
            out: *mut f32,
        ) {
            let nb = n / tandem_quant::QK_K;
            let row = nb * Q8K_BYTES;
            let ny = ny.min(MAX_WIDE);
            if nb == 0 {
                // SAFETY: `out` has NR * ny elements.
                unsafe { std::ptr::write_bytes(out, 0, NR * ny) };
                return;
            }
            // The sum of row r and token j at `acc[r * MAX_WIDE + j]`, written by block 0 (so
            // nothing is zeroed beforehand: zeroing the whole array was a memset of 8-16 KiB per call).
            let mut store = [[const { std::mem::MaybeUninit::<__m512>::uninit() }; MAX_WIDE]; NR];
            let acc = store.as_mut_ptr() as *mut __m512;
            for i in 0..nb {
                // SAFETY: block `i` of each of the NR weight rows and ny activation rows is in bounds.
                unsafe {
                    rows_512!(T::$unpack, $scales, $rowq, (w, wstride, ys, row, i), ny, |r, j, v, ydv| {
                        let a = acc.add(r * MAX_WIDE + j);
                        let prev = if i == 0 { _mm512_setzero_ps() } else { *a };
                        *a = _mm512_fmadd_ps(v, ydv, prev);
                    });
                }
            }
            for r in 0..NR {
                for j in 0..ny {
                    // SAFETY: `out` has NR * ny elements; block 0 wrote accumulator (r, j).
                    unsafe { *out.add(r * ny + j) = _mm512_reduce_add_ps(*acc.add(r * MAX_WIDE + j)) };
                }
            }
        }
    };
}

wide_512!(
    /// [`dot_avx512`] for up to [`MAX_WIDE`] tokens.
    wide_avx512, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c", scales_512, row_madd_q, unpack512
);
wide_512!(
    /// [`dot_avx512vnni`] for up to [`MAX_WIDE`] tokens.
    wide_avx512vnni, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", scales_packed, row_vnni_q,
    unpack512
);
wide_512!(
    /// [`dot_avx512vbmi`] for up to [`MAX_WIDE`] tokens.
    wide_avx512vbmi, "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c", scales_512,
    row_madd_q, unpack_vbmi
);
wide_512!(
    /// [`dot_avx512vbmi_vnni`] for up to [`MAX_WIDE`] tokens.
    wide_avx512vbmi_vnni,
    "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx512bitalg,avx2,fma,f16c",
    scales_packed, row_vnni_q, unpack_vbmi
);

tile!(
    /// AVX-512 (zmm): `out[r * NY + j] = dot(w_r, y_j)`.
    tile_avx512, "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c",
    [_mm512_setzero_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps], rows_512!(T::unpack512, scales_512, row_madd_q,)
);
tile!(
    /// AVX-512 VNNI (zmm): `out[r * NY + j] = dot(w_r, y_j)`.
    tile_avx512vnni, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
    [_mm512_setzero_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps], rows_512!(T::unpack512, scales_packed, row_vnni_q,)
);
