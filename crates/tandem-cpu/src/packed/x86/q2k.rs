//! Q2_K's packed group kernels for x86-64 (AVX-512 VNNI, AVX2 and its AVX-VNNI twin); layout and
//! arithmetic in `packed/q2k.rs`.

use super::{bcast, planes_dot, planes_dot8};
use crate::packed::q2k::{D, DMIN, GROUP_BLOCK, QS, SM};
use crate::packed::{Q8K_BSUMS, Q8K_QS};
use std::arch::x86_64::*;

q8k_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    group_vnni => group<>("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, i, isum, imin, t|
    setup {
        let three = _mm512_set1_epi8(3);
        let low4 = _mm512_set1_epi32(0x0F);
    }
    block {}
    step {
        let mut sc = [_mm512_setzero_si512(); 2];
        let mut m = [_mm512_setzero_si512(); 2];
        let mut planes = [[_mm512_setzero_si512(); 4]; 2];
        for h in 0..2 {
            let s = 2 * i + h;
            let sm = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(SM + 16 * s) as *const __m128i));
            sc[h] = _mm512_and_si512(sm, low4);
            m[h] = _mm512_srli_epi32::<4>(sm);
            let raw = _mm512_loadu_si512(wb.add(QS + 64 * s) as *const __m512i);
            planes[h] = [
                _mm512_and_si512(raw, three),
                _mm512_and_si512(_mm512_srli_epi16::<2>(raw), three),
                _mm512_and_si512(_mm512_srli_epi16::<4>(raw), three),
                _mm512_and_si512(_mm512_srli_epi16::<6>(raw), three),
            ];
        }
        // (m of group 2i, m of group 2i + 1) as an i16 pair per lane, against the pair
        // (bsums[2i], bsums[2i + 1]).
        let mm = _mm512_or_si512(m[0], _mm512_slli_epi32::<16>(m[1]));
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * i);
            let sums = [planes_dot(&planes[0], q, sc[0]), planes_dot(&planes[1], q.add(16), sc[1])];
            isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(sums[0], sums[1]));
            imin[t] = _mm512_dpwssd_epi32(imin[t], mm, bcast(y[t].add(Q8K_BSUMS + 4 * i)));
        }
    }
    after {}
    finish {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
        let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(DMIN) as *const __m256i));
    }
    value _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[t]), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), d))
}

q8k_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; `vpmaddubsw` on
    /// the 2-bit levels (four of its i16 pair sums added stay far below 2^15) and one `vpmaddwd`
    /// against the (scale, scale) pair per group give the VNNI kernel's exact integer sums.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<>("avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, i, isum, imin, t|
    setup {
        let three = _mm256_set1_epi8(3);
        let low4 = _mm256_set1_epi32(0x0F);
    }
    block {}
    step {
        let mut scsc = [_mm256_setzero_si256(); 2];
        let mut m = [_mm256_setzero_si256(); 2];
        let mut planes = [[_mm256_setzero_si256(); 4]; 2];
        for h in 0..2 {
            let s = 2 * i + h;
            let sm = _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(SM + 16 * s + 8 * hf) as *const __m128i));
            let sc = _mm256_and_si256(sm, low4);
            // (sc, sc) as an i16 pair per lane
            scsc[h] = _mm256_or_si256(sc, _mm256_slli_epi32::<16>(sc));
            m[h] = _mm256_srli_epi32::<4>(sm);
            let raw = _mm256_loadu_si256(wb.add(QS + 64 * s + 32 * hf) as *const __m256i);
            planes[h] = [
                _mm256_and_si256(raw, three),
                _mm256_and_si256(_mm256_srli_epi16::<2>(raw), three),
                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), three),
                _mm256_and_si256(_mm256_srli_epi16::<6>(raw), three),
            ];
        }
        // (m of group 2i, m of group 2i + 1) as an i16 pair per lane.
        let mm = _mm256_or_si256(m[0], _mm256_slli_epi32::<16>(m[1]));
        for t in 0..NY {
            for h in 0..2 {
                let s = planes_dot8::<VNNI>(&planes[h], y[t].add(Q8K_QS + 16 * (2 * i + h)), scsc[h]);
                isum[t] = _mm256_add_epi32(isum[t], s);
            }
            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * i) as *const i32).read_unaligned());
            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mm, bs));
        }
    }
    after {}
    finish {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(DMIN + 16 * hf) as *const __m128i));
    }
    value _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[t]), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(isum[t]), d))
}
