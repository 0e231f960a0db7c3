//! The packed group kernels of Q8_0, Q5_0 and Q5_1 for x86-64 (AVX-512 VNNI, AVX2); layout and
//! arithmetic in `packed/b32.rs`.

use super::{bcast, bcast8, half, nibble_dot8, nibbles8, prefetch_ahead};
use crate::packed::b32::{sizes, LEVELS, Q5_1_OFF, Q8_1_S};
use crate::packed::{GroupActs, PACK_ROWS};
use std::arch::x86_64::*;

/// A [`crate::packed::GroupFn`] for AVX-512 VNNI (`OFF` 128 for Q8_0, 16 for Q5_0, [`Q5_1_OFF`] for
/// Q5_1).
///
/// # Safety
/// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; Q8_1 activations for Q5_1),
/// and the machine has AVX-512 VNNI.
pub(super) unsafe fn group_vnni<const OFF: i32>(
    nb: usize,
    w: *const u8,
    a: GroupActs,
    ny: usize,
    out: *mut f32,
    ostride: usize,
) {
    // Q8_0 (`OFF` 128) streams with the hint for the kernels with the least work per byte.
    let hint = if OFF == 128 { crate::prefetch::light_hint_index() } else { crate::prefetch::hint_index() };
    // SAFETY: forwarded from the caller, who checked that the machine has AVX-512 VNNI.
    unsafe { by_ny_pf!(hint = hint, ny, group[OFF](nb, w, a, out, ostride)) }
}

/// # Safety
/// As [`group_vnni`] with `ny == NY`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // t indexes several arrays at once
unsafe fn group<const OFF: i32, const PF: u8, const NY: usize>(
    nb: usize,
    w: *const u8,
    a: GroupActs,
    out: *mut f32,
    ostride: usize,
) {
    let (_, ab, qs) = const { sizes(OFF) };
    let mut acc = [_mm512_setzero_ps(); NY];
    // SAFETY: the factors follow the levels of all `nb` blocks, Q5_1's minimums the factors
    // (see the layout).
    let factors = unsafe { w.add(nb * LEVELS) };
    let mins = factors.wrapping_add(nb * 2 * PACK_ROWS);
    for b in 0..nb {
        // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
        unsafe {
            let wb = w.add(b * LEVELS);
            if NY == 1 {
                prefetch_ahead::<PF>(wb, LEVELS);
            }
            let mut wv = [_mm512_setzero_si512(); 8];
            for (q, v) in wv.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(wb.add(64 * q) as *const __m512i);
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(factors.add(b * 2 * PACK_ROWS) as *const __m256i));
            let m = if OFF == Q5_1_OFF {
                _mm512_cvtph_ps(_mm256_loadu_si256(mins.add(b * 2 * PACK_ROWS) as *const __m256i))
            } else {
                d
            };
            for t in 0..NY {
                let y = a.ys.add(t * a.yb + b * ab);
                let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for q in (0..8).step_by(2) {
                    s0 = _mm512_dpbusd_epi32(s0, wv[q], bcast(y.add(qs + 4 * q)));
                    s1 = _mm512_dpbusd_epi32(s1, wv[q + 1], bcast(y.add(qs + 4 * q + 4)));
                }
                let isum = if OFF == Q5_1_OFF {
                    _mm512_add_epi32(s0, s1)
                } else {
                    let corr = _mm512_set1_epi32(OFF * *a.sums.add(t * nb + b));
                    _mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr)
                };
                let da = half(y);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(da)), _mm512_cvtepi32_ps(isum), acc[t]);
                if OFF == Q5_1_OFF {
                    acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(half(y.add(Q8_1_S))), acc[t]);
                }
            }
        }
    }
    // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
    unsafe { super::store(&acc, out, ostride) };
}

group_entry! {
    /// A [`crate::packed::GroupFn`] for AVX2 (`OFF` 128 for Q8_0, 16 for Q5_0, [`Q5_1_OFF`] for Q5_1):
    /// each half of the 16 rows in a ymm register; `vpmaddubsw` takes the 5-bit levels (<= 31,
    /// so four of its i16 pair sums added stay below 2^15) and one `vpmaddwd` by ones per four
    /// makes them the exact integer sums of the VNNI kernel. Q8_0's levels (up to 255) would
    /// overflow the pair sums: they go in as their two nibbles ([`nibble_dot8`]).
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; Q8_1 activations for Q5_1),
    /// and the machine has AVX2.
    group_avx2<const OFF: i32> => group2, acts
}

/// # Safety
/// As [`group_avx2`] with `ny == NY`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // t indexes several arrays at once
unsafe fn group2<const OFF: i32, const PF: u8, const NY: usize>(
    nb: usize,
    w: *const u8,
    a: GroupActs,
    out: *mut f32,
    ostride: usize,
) {
    let (_, ab, qs) = const { sizes(OFF) };
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; NY];
    // SAFETY: the factors follow the levels of all `nb` blocks, Q5_1's minimums the factors
    // (see the layout).
    let factors = unsafe { w.add(nb * LEVELS) };
    let mins = factors.wrapping_add(nb * 2 * PACK_ROWS);
    for b in 0..nb {
        // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
        unsafe {
            let wb = w.add(b * LEVELS);
            if NY == 1 {
                prefetch_ahead::<PF>(wb, LEVELS);
            }
            for hf in 0..2 {
                let mut wv = [_mm256_setzero_si256(); 8];
                // Q8_0's levels in nibbles
                let mut nib = [[_mm256_setzero_si256(); 8]; 2];
                for (q, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_si256(wb.add(64 * q + 32 * hf) as *const __m256i);
                    if OFF == 128 {
                        [nib[0][q], nib[1][q]] = nibbles8(*v);
                    }
                }
                let d = _mm256_cvtph_ps(_mm_loadu_si128(factors.add(b * 2 * PACK_ROWS + 16 * hf) as *const __m128i));
                let m = if OFF == Q5_1_OFF {
                    _mm256_cvtph_ps(_mm_loadu_si128(mins.add(b * 2 * PACK_ROWS + 16 * hf) as *const __m128i))
                } else {
                    d
                };
                for t in 0..NY {
                    let y = a.ys.add(t * a.yb + b * ab);
                    let sum = if OFF == 128 {
                        nibble_dot8(&nib[0], &nib[1], y.add(qs), ones)
                    } else {
                        let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for q in 0..4 {
                            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[q], bcast8(y.add(qs + 4 * q))));
                            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[q + 4], bcast8(y.add(qs + 16 + 4 * q))));
                        }
                        _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones))
                    };
                    let isum = if OFF == Q5_1_OFF {
                        sum
                    } else {
                        _mm256_sub_epi32(sum, _mm256_set1_epi32(OFF * *a.sums.add(t * nb + b)))
                    };
                    let da = half(y);
                    acc[t][hf] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(da)), _mm256_cvtepi32_ps(isum), acc[t][hf]);
                    if OFF == Q5_1_OFF {
                        acc[t][hf] = _mm256_fmadd_ps(m, _mm256_set1_ps(half(y.add(Q8_1_S))), acc[t][hf]);
                    }
                }
            }
        }
    }
    // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
    unsafe { super::store_halves(&acc, out, ostride) };
}
