//! Q4_K's and Q5_K's packed group kernels for x86-64 (AVX-512 VNNI, AVX2, AVX-VNNI for Q5_K); layout
//! and arithmetic in `packed/q4k.rs`.

use super::{bcast, bcast8, dpbusd8, words8};
use crate::packed::q4k::{layout, SUBS};
use crate::packed::{Q8K_BSUMS, Q8K_QS};
use std::arch::x86_64::*;

/// `vpshufb` control: 32-bit lane `r` gets byte `r` of its 128-bit lane twice, as two u16.
static PAIRS: [u8; 64] = {
    let mut c = [0x80u8; 64];
    let mut r = 0;
    while r < 16 {
        c[4 * r] = r as u8;
        c[4 * r + 2] = r as u8;
        r += 1;
    }
    c
};
/// The low 16 bits of every 32-bit lane.
const LOW_HALVES: i32 = 0xFFFF;

/// The sums of the quants of the 8 groups of 32 of a Q8_K block (`y`), as the i16 pairs
/// `(sum_2k, sum_2k + 1)` in `pairs[k]`, for `vpdpwssd` against the mins' pairs.
///
/// # Safety
/// `y` points at a Q8_K block; the machine has AVX2.
#[inline(always)]
unsafe fn group_sum_pairs(y: *const u8) -> [i32; 4] {
    // SAFETY: as the caller guarantees. The sums of 32 quants (|.| <= 4064) fit an i16.
    unsafe {
        let bs = _mm256_madd_epi16(_mm256_loadu_si256(y.add(Q8K_BSUMS) as *const __m256i), _mm256_set1_epi16(1));
        // Per 128-bit lane: the four i32 sums packed to i16 twice; dwords 0, 1, 4, 5 are the pairs.
        let mut both = [0i32; 8];
        _mm256_storeu_si256(both.as_mut_ptr() as *mut __m256i, _mm256_packs_epi32(bs, bs));
        [both[0], both[1], both[4], both[5]]
    }
}

/// The 16 bytes at `p` (one per row), each as the u16 pair (b, b) in its row's lane.
///
/// # Safety
/// 16 readable bytes at `p`; the machine has AVX-512 BW.
#[inline(always)]
unsafe fn pairs_of(p: *const u8, pairs: __m512i) -> __m512i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(p as *const __m128i)), pairs) }
}

q8k_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI (Q4_K, or with `HIGH` Q5_K).
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    group_vnni => group<const HIGH: bool>("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", lay.size)
    |wb, y, hf, j, isum, imin, t|
    setup {
        let lay = const { layout(HIGH) };
        let nib = _mm512_set1_epi8(0x0F);
        let bit4 = _mm512_set1_epi8(0x10);
        // SAFETY: 64 readable bytes.
        let pairs = unsafe { _mm512_loadu_si512(PAIRS.as_ptr() as *const __m512i) };
        let low = _mm512_set1_epi32(LOW_HALVES);
    }
    block {}
    step {
        // The levels of the group's four loads, low and high nibbles. Q4_K keeps its
        // high nibbles in place: 16 times the level, at no shift.
        let mut lo = [_mm512_setzero_si512(); 4];
        let mut hi = [_mm512_setzero_si512(); 4];
        let fifth = if HIGH { _mm512_loadu_si512(wb.add(lay.qh + 64 * j) as *const __m512i) } else { nib };
        for l in 0..4 {
            let raw = _mm512_loadu_si512(wb.add(256 * j + 64 * l) as *const __m512i);
            lo[l] = _mm512_and_si512(raw, nib);
            hi[l] = if HIGH {
                // level | (bit 2l (+1) of `fifth`, moved to bit 4 of its byte)
                lo[l] = _mm512_ternarylogic_epi32::<0xF8>(lo[l], to_bit4(fifth, 2 * l), bit4);
                let h = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
                _mm512_ternarylogic_epi32::<0xF8>(h, to_bit4(fifth, 2 * l + 1), bit4)
            } else {
                _mm512_andnot_si512(nib, raw)
            };
        }
        let scales = wb.add(lay.sc + 16 * j);
        let (sc, scsc) = match HIGH {
            true => (_mm512_cvtepu8_epi32(_mm_loadu_si128(scales as *const __m128i)), nib),
            false => (nib, pairs_of(scales, pairs)),
        };
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * j);
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for l in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, lo[l], bcast(q.add(8 * l)));
                s1 = _mm512_dpbusd_epi32(s1, hi[l], bcast(q.add(8 * l + 4)));
            }
            isum[t] = if HIGH {
                // Levels up to 31: the sums of 16 need not fit an i16.
                _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc))
            } else {
                // s0 and s1 / 16 are sums of 16 products of a level <= 15 and an i8:
                // |.| <= 30720, exact as i16. As the pair (s0, s1 / 16) per lane,
                // `vpdpwssd` against (sc, sc) adds sc * (s0 + s1 / 16) exactly. s1
                // is a multiple of 16, so s1 << 12 is s1 / 16 in the high half.
                let both = _mm512_ternarylogic_epi32::<0xD8>(_mm512_slli_epi32::<12>(s1), s0, low);
                _mm512_dpwssd_epi32(isum[t], both, scsc)
            };
        }
    }
    after {
        // The mins, once per block: (m_2k, m_2k+1) per row against the pair of the two
        // groups' activation sums.
        let sums: [[i32; 4]; NY] = std::array::from_fn(|t| group_sum_pairs(y[t]));
        for k in 0..SUBS / 2 {
            let mm = _mm512_cvtepu8_epi16(_mm256_loadu_si256(wb.add(lay.mn + 32 * k) as *const __m256i));
            for t in 0..NY {
                imin[t] = _mm512_dpwssd_epi32(imin[t], mm, _mm512_set1_epi32(sums[t][k]));
            }
        }
    }
    finish {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(lay.d) as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(lay.dmin) as *const __m256i));
    }
    value _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[t]), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), d))
}

q8k_group! { ymm
    /// A [`crate::packed::GroupFn`] for Q4_K (or with `HIGH` Q5_K) on AVX2: each half of the 16 rows in
    /// a ymm register; `vpmaddubsw` (Q4_K's levels <= 15, so the i16 pair sums of the eight of a
    /// group stay below 2^15; Q5_K's <= 31, so four at a time) and `vpmaddwd` against the group's
    /// scale give the exact integer sums of the VNNI kernel.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<const HIGH: bool>("avx2,fma,f16c", lay.size)
    |wb, y, hf, j, isum, imin, t|
    setup {
        let lay = const { layout(HIGH) };
        let nib = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
    }
    block {
        let sums: [[i32; 4]; NY] = std::array::from_fn(|t| group_sum_pairs(y[t]));
    }
    step {
        let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(lay.sc + 16 * j + 8 * hf) as *const __m128i));
        // (sc, sc) as an i16 pair per lane: `vpmaddwd` of the i16 pair sums of
        // `vpmaddubsw` with it is sc times their sum, exactly.
        let scsc = _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc));
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        let fifth = if HIGH { _mm256_loadu_si256(wb.add(lay.qh + 64 * j + 32 * hf) as *const __m256i) } else { nib };
        for l in 0..4 {
            let raw = _mm256_loadu_si256(wb.add(256 * j + 64 * l + 32 * hf) as *const __m256i);
            lo[l] = _mm256_and_si256(raw, nib);
            hi[l] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
            if HIGH {
                // level | (bit 2l (+1) of `fifth`, moved to bit 4 of its byte)
                lo[l] = _mm256_or_si256(lo[l], _mm256_and_si256(to_bit4_256(fifth, 2 * l), bit4));
                hi[l] = _mm256_or_si256(hi[l], _mm256_and_si256(to_bit4_256(fifth, 2 * l + 1), bit4));
            }
        }
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * j);
            if VNNI && HIGH {
                // Levels up to 31, the sums in i32 (no copy for Q4_K: see `simd_kernels`).
                let mut s = _mm256_setzero_si256();
                for l in 0..4 {
                    s = dpbusd8(s, lo[l], q.add(8 * l));
                    s = dpbusd8(s, hi[l], q.add(8 * l + 4));
                }
                isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(s, sc));
            } else if HIGH {
                // levels up to 31: four pair sums per i16 at most
                let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for l in 0..4 {
                    s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(lo[l], bcast8(q.add(8 * l))));
                    s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(hi[l], bcast8(q.add(8 * l + 4))));
                }
                let s = _mm256_add_epi32(_mm256_madd_epi16(s0, scsc), _mm256_madd_epi16(s1, scsc));
                isum[t] = _mm256_add_epi32(isum[t], s);
            } else {
                let mut s = _mm256_setzero_si256();
                // One token (decode) waits on the weights from memory, not on these loads: it
                // keeps the broadcast loads; a batch's loop is bound by them (`words8`).
                let a = if NY == 1 { std::array::from_fn(|k| bcast8(q.add(4 * k))) } else { words8(q) };
                for l in 0..4 {
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[l], a[2 * l]));
                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[l], a[2 * l + 1]));
                }
                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, scsc));
            }
        }
    }
    after {
        // The mins of this half's 8 rows, once per block (see `group`).
        for k in 0..SUBS / 2 {
            let at = wb.add(lay.mn + 32 * k + 16 * hf);
            let mm = _mm256_cvtepu8_epi16(_mm_loadu_si128(at as *const __m128i));
            for t in 0..NY {
                imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mm, _mm256_set1_epi32(sums[t][k])));
            }
        }
    }
    finish {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(lay.d + 16 * hf) as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(lay.dmin + 16 * hf) as *const __m128i));
    }
    value _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[t]), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(isum[t]), d))
}

/// [`to_bit4`] on a ymm register.
#[inline(always)]
unsafe fn to_bit4_256(v: __m256i, p: usize) -> __m256i {
    // SAFETY: only called from functions enabling AVX2.
    unsafe { to_bit!(v, p, 4, _mm256_slli_epi16, _mm256_srli_epi16) }
}

/// `v` shifted so that bit `p` of every byte lands on bit 4 of that byte (other bits are
/// garbage for the caller to mask off).
#[inline(always)]
unsafe fn to_bit4(v: __m512i, p: usize) -> __m512i {
    // SAFETY: only called from functions enabling AVX-512 BW.
    unsafe { to_bit!(v, p, 4, _mm512_slli_epi16, _mm512_srli_epi16) }
}
