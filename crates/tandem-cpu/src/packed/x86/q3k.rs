//! Q3_K's packed group kernels for x86-64 (AVX-512 VNNI, AVX2 and its AVX-VNNI twin); layout and
//! arithmetic in `packed/q3k.rs`.

use super::{bcast, planes_dot, planes_dot8};
use crate::packed::q3k::{D, GROUP_BLOCK, QH, QS, SC};
use crate::packed::{Q8K_BSUMS, Q8K_QS};
use std::arch::x86_64::*;

q8k_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    group_vnni => group<>("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, i, isum, ibias, t|
    setup {
        let three = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        let off32 = _mm512_set1_epi32(32);
    }
    block {}
    step {
        let hv = _mm512_loadu_si512(wb.add(QH + 64 * i) as *const __m512i);
        let mut sc = [_mm512_setzero_si512(); 2];
        let mut planes = [[_mm512_setzero_si512(); 4]; 2];
        for h in 0..2 {
            let s = 2 * i + h;
            let raw_sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(SC + 16 * s) as *const __m128i));
            sc[h] = _mm512_sub_epi32(raw_sc, off32);
            let raw = _mm512_loadu_si512(wb.add(QS + 64 * s) as *const __m512i);
            let low = [raw, _mm512_srli_epi16::<2>(raw), _mm512_srli_epi16::<4>(raw), _mm512_srli_epi16::<6>(raw)];
            for p in 0..4 {
                // (low & 3) | (third bit, moved to bit 2)
                let high = _mm512_and_si512(to_bit2(hv, 4 * h + p), four);
                planes[h][p] = _mm512_ternarylogic_epi32::<0xF8>(high, low[p], three);
            }
        }
        // (sc of group 2i, sc of group 2i + 1) as an i16 pair per lane, against the
        // pair (bsums[2i], bsums[2i + 1]).
        let ss = _mm512_or_si512(_mm512_and_si512(sc[0], _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(sc[1]));
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * i);
            let sums = [planes_dot(&planes[0], q, sc[0]), planes_dot(&planes[1], q.add(16), sc[1])];
            isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(sums[0], sums[1]));
            ibias[t] = _mm512_dpwssd_epi32(ibias[t], ss, bcast(y[t].add(Q8K_BSUMS + 4 * i)));
        }
    }
    after {}
    finish {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
    }
    value _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t], _mm512_slli_epi32::<2>(ibias[t]))), d)
}

/// `v` shifted so that bit `p` of every byte lands on bit 2 of that byte (other bits are
/// garbage for the caller to mask off).
#[inline(always)]
unsafe fn to_bit2(v: __m512i, p: usize) -> __m512i {
    // SAFETY: only called from functions enabling AVX-512 BW.
    unsafe { to_bit!(v, p, 2, _mm512_slli_epi16, _mm512_srli_epi16) }
}

/// [`to_bit2`] on a ymm register.
#[inline(always)]
unsafe fn to_bit2_256(v: __m256i, p: usize) -> __m256i {
    // SAFETY: only called from functions enabling AVX2.
    unsafe { to_bit!(v, p, 2, _mm256_slli_epi16, _mm256_srli_epi16) }
}

q8k_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; `vpmaddubsw` on
    /// the 3-bit levels (four of its i16 pair sums added stay far below 2^15) and one `vpmaddwd`
    /// against the (scale, scale) pair per group give the VNNI kernel's exact integer sums.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<>("avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, i, isum, ibias, t|
    setup {
        let three = _mm256_set1_epi8(3);
        let four = _mm256_set1_epi8(4);
        let off32 = _mm256_set1_epi32(32);
        let low16 = _mm256_set1_epi32(0xFFFF);
    }
    block {}
    step {
        let hv = _mm256_loadu_si256(wb.add(QH + 64 * i + 32 * hf) as *const __m256i);
        let mut sc = [_mm256_setzero_si256(); 2];
        let mut planes = [[_mm256_setzero_si256(); 4]; 2];
        for h in 0..2 {
            let s = 2 * i + h;
            let raw_sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(SC + 16 * s + 8 * hf) as *const __m128i));
            sc[h] = _mm256_sub_epi32(raw_sc, off32);
            let raw = _mm256_loadu_si256(wb.add(QS + 64 * s + 32 * hf) as *const __m256i);
            let low = [raw, _mm256_srli_epi16::<2>(raw), _mm256_srli_epi16::<4>(raw), _mm256_srli_epi16::<6>(raw)];
            for p in 0..4 {
                // (low & 3) | (third bit, moved to bit 2)
                let high = _mm256_and_si256(to_bit2_256(hv, 4 * h + p), four);
                planes[h][p] = _mm256_or_si256(high, _mm256_and_si256(low[p], three));
            }
        }
        // each scale as the pair (sc, sc), and the two as (sc of 2i, sc of 2i + 1)
        let pair = |v: __m256i| _mm256_or_si256(_mm256_and_si256(v, low16), _mm256_slli_epi32::<16>(v));
        let scsc = [pair(sc[0]), pair(sc[1])];
        let ss = _mm256_or_si256(_mm256_and_si256(sc[0], low16), _mm256_slli_epi32::<16>(sc[1]));
        for t in 0..NY {
            for h in 0..2 {
                let s = planes_dot8::<VNNI>(&planes[h], y[t].add(Q8K_QS + 16 * (2 * i + h)), scsc[h]);
                isum[t] = _mm256_add_epi32(isum[t], s);
            }
            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * i) as *const i32).read_unaligned());
            ibias[t] = _mm256_add_epi32(ibias[t], _mm256_madd_epi16(ss, bs));
        }
    }
    after {}
    finish {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
    }
    value _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_slli_epi32::<2>(ibias[t]))), d)
}
