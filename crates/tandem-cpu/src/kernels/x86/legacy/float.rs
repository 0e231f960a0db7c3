//! F32, F16 and BF16 weights against activations of the same type (ggml-cpu/vec.cpp
//! `ggml_vec_dot_f32/_f16/_bf16`): f32 FMA accumulation in several independent registers, the
//! last `n mod step` elements summed in f64 as the scalar reference does.

// Block and row indices address several arrays at once (weights, rows, scales, accumulators).
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

/// One element type, loaded 8 or 16 at a time as f32.
pub(super) trait Elem {
    const SIZE: usize;
    unsafe fn load8(p: *const u8) -> __m256;
    unsafe fn load16(p: *const u8) -> __m512;
    unsafe fn scalar(p: *const u8) -> f32;
}

pub(super) struct F32;
impl Elem for F32 {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 readable bytes at `p`; AVX.
        unsafe { _mm256_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 64 readable bytes at `p`; AVX-512F.
        unsafe { _mm512_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn scalar(p: *const u8) -> f32 {
        // SAFETY: 4 readable bytes at `p`.
        unsafe { (p as *const f32).read_unaligned() }
    }
}

pub(super) struct F16;
impl Elem for F16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at `p`; F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p`; AVX-512F.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn scalar(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes at `p`.
        half::f16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
    }
}

pub(super) struct BF16;
impl Elem for BF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at `p`; AVX2. A bf16 is the high half of an f32.
        unsafe {
            let v = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v))
        }
    }
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p`; AVX-512F.
        unsafe {
            let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
        }
    }
    #[inline(always)]
    unsafe fn scalar(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes at `p`.
        f32::from_bits((unsafe { (p as *const u16).read_unaligned() } as u32) << 16)
    }
}

/// The f64 sum of the products of elements `from..n` (the tail the vector loop leaves).
#[inline(always)]
unsafe fn tail<E: Elem>(from: usize, n: usize, w: *const u8, y: *const u8) -> f64 {
    let mut s = 0f64;
    for i in from..n {
        // SAFETY: `i < n` and both rows hold `n` elements.
        s += unsafe { (E::scalar(w.add(i * E::SIZE)) * E::scalar(y.add(i * E::SIZE))) as f64 };
    }
    s
}

#[inline(always)]
unsafe fn hsum256(v: __m256) -> f32 {
    // SAFETY: register-only AVX ops; the caller runs with AVX2.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// A body of `$lanes`-lane f32 vectors `$v` with `U` accumulators per row: `dot8` (256-bit) and
/// `dot16` (512-bit) from one source, the width's zero, load, FMA, add and sum named.
macro_rules! width_dot {
    ($(#[$doc:meta])* $name:ident, $lanes:literal, $zero:ident, $load:ident, $fmadd:ident, $add:ident, $hsum:ident) => {
        $(#[$doc])*
        #[inline(always)]
        unsafe fn $name<E: Elem, const NY: usize, const U: usize>(n: usize, w: *const u8, ys: *const u8, out: &mut [f32]) {
            let step = $lanes * U;
            let main = n - n % step;
            let yrow = n * E::SIZE;
            // SAFETY: `Kernel::run` checked `w` holds `n` elements and `ys` `NY` rows of `n`.
            unsafe {
                let mut acc = [[$zero(); U]; NY];
                let mut i = 0;
                while i < main {
                    let mut x = [$zero(); U];
                    for (u, xu) in x.iter_mut().enumerate() {
                        *xu = E::$load(w.add((i + $lanes * u) * E::SIZE));
                    }
                    for (j, aj) in acc.iter_mut().enumerate() {
                        for u in 0..U {
                            let y = E::$load(ys.add(j * yrow + (i + $lanes * u) * E::SIZE));
                            aj[u] = $fmadd(x[u], y, aj[u]);
                        }
                    }
                    i += step;
                }
                for j in 0..NY {
                    let mut s = acc[j][0];
                    for u in 1..U {
                        s = $add(s, acc[j][u]);
                    }
                    out[j] = ($hsum(s) as f64 + tail::<E>(main, n, w, ys.add(j * yrow))) as f32;
                }
            }
        }
    };
}

width_dot!(
    /// 256-bit body: `U` accumulators per row of 8 lanes.
    dot8, 8, _mm256_setzero_ps, load8, _mm256_fmadd_ps, _mm256_add_ps, hsum256
);
width_dot!(
    /// 512-bit body: `U` accumulators per row of 16 lanes.
    dot16, 16, _mm512_setzero_ps, load16, _mm512_fmadd_ps, _mm512_add_ps, _mm512_reduce_add_ps
);

/// BF16 with `vdpbf16ps` (two products per lane per op): `U` accumulators per row of 16 lanes.
#[inline(always)]
unsafe fn dot_bf16<const NY: usize, const U: usize>(n: usize, w: *const u8, ys: *const u8, out: &mut [f32]) {
    let step = 32 * U;
    let main = n - n % step;
    let yrow = n * 2;
    // SAFETY: `Kernel::run` checked `w` holds `n` elements and `ys` `NY` rows of `n`.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); U]; NY];
        let mut i = 0;
        while i < main {
            let mut x = [_mm512_setzero_si512(); U];
            for (u, xu) in x.iter_mut().enumerate() {
                *xu = _mm512_loadu_si512(w.add((i + 32 * u) * 2) as *const __m512i);
            }
            for (j, aj) in acc.iter_mut().enumerate() {
                for u in 0..U {
                    let y = _mm512_loadu_si512(ys.add(j * yrow + (i + 32 * u) * 2) as *const __m512i);
                    aj[u] = _mm512_dpbf16_ps(
                        aj[u],
                        std::mem::transmute::<__m512i, __m512bh>(x[u]),
                        std::mem::transmute::<__m512i, __m512bh>(y),
                    );
                }
            }
            i += step;
        }
        for j in 0..NY {
            let mut s = acc[j][0];
            for u in 1..U {
                s = _mm512_add_ps(s, acc[j][u]);
            }
            out[j] = (_mm512_reduce_add_ps(s) as f64 + tail::<BF16>(main, n, w, ys.add(j * yrow))) as f32;
        }
    }
}

/// Defines a [`super::KernelFn`] running `$body` with `ny` as a constant. The number of
/// accumulators per row is the same for every `ny`, so a row's sum is added in the same order
/// whichever other rows share the call (batch invariance; see tests/simd.rs).
macro_rules! entry {
    ($name:ident, $feat:literal, $body:ident $(::<$($g:ty),*>)?, [$u1:literal, $u2:literal, $u3:literal, $u4:literal]) => {
        /// # Safety
        /// The contract of `KernelFn`: lengths checked by `Kernel::run`; the machine has the
        /// target features enabled here.
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
            let (w, ys) = (w.as_ptr(), ys.as_ptr());
            // SAFETY: this function's contract, forwarded.
            unsafe {
                match ny {
                    1 => $body::<$($($g,)*)? 1, $u1>(n, w, ys, out),
                    2 => $body::<$($($g,)*)? 2, $u2>(n, w, ys, out),
                    3 => $body::<$($($g,)*)? 3, $u3>(n, w, ys, out),
                    4 => $body::<$($($g,)*)? 4, $u4>(n, w, ys, out),
                    5 => $body::<$($($g,)*)? 5, $u4>(n, w, ys, out),
                    6 => $body::<$($($g,)*)? 6, $u4>(n, w, ys, out),
                    7 => $body::<$($($g,)*)? 7, $u4>(n, w, ys, out),
                    8 => $body::<$($($g,)*)? 8, $u4>(n, w, ys, out),
                    _ => {}
                }
            }
        }
    };
}

entry!(f32_avx2, "avx2,fma,f16c", dot8::<F32>, [1, 1, 1, 1]);
entry!(f16_avx2, "avx2,fma,f16c", dot8::<F16>, [1, 1, 1, 1]);
entry!(bf16_avx2, "avx2,fma,f16c", dot8::<BF16>, [1, 1, 1, 1]);
entry!(f32_avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq", dot16::<F32>, [2, 2, 2, 2]);
entry!(f16_avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq", dot16::<F16>, [2, 2, 2, 2]);
entry!(bf16_avx512, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq", dot16::<BF16>, [2, 2, 2, 2]);
entry!(
    bf16_avx512bf16,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16",
    dot_bf16,
    [2, 2, 2, 2]
);
