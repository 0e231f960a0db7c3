//! IQ4_XS's packed group kernels for x86-64 (AVX-512 VNNI, AVX2 and its AVX-VNNI twin); layout and
//! arithmetic in `packed/iq4xs.rs`.

use super::{bcast, bcast8, byte_dot8, nibble_dot8, nibbles8, nl_levels8, nl_nibbles8};
use crate::packed::iq4xs::{D, GROUP_BLOCK, LS, QS};
use crate::packed::q40::NL_LEVELS;
use crate::packed::{Q8K_BSUMS, Q8K_QS};
use std::arch::x86_64::*;

q8k_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    group_vnni => group<>("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, j, isum, ibias, t|
    setup {
        let nib = _mm512_set1_epi8(0x0F);
        // SAFETY: 16 readable bytes.
        let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(NL_LEVELS.as_ptr() as *const __m128i) });
        let off32 = _mm512_set1_epi32(32);
    }
    block {}
    step {
        let ls = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(LS + 16 * j) as *const __m128i));
        let ls = _mm512_sub_epi32(ls, off32);
        // (ls, ls) as an i16 pair per lane, against the pair (bsums[2j], bsums[2j + 1]).
        let ll = _mm512_or_si512(_mm512_and_si512(ls, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(ls));
        let mut lo = [_mm512_setzero_si512(); 4];
        let mut hi = [_mm512_setzero_si512(); 4];
        for v in 0..4 {
            let raw = _mm512_loadu_si512(wb.add(QS + 256 * j + 64 * v) as *const __m512i);
            lo[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, nib));
            hi[v] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib));
        }
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * j);
            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
            for v in 0..4 {
                s0 = _mm512_dpbusd_epi32(s0, lo[v], bcast(q.add(4 * v)));
                s1 = _mm512_dpbusd_epi32(s1, hi[v], bcast(q.add(16 + 4 * v)));
            }
            isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), ls));
            ibias[t] = _mm512_dpwssd_epi32(ibias[t], ll, bcast(y[t].add(Q8K_BSUMS + 4 * j)));
        }
    }
    after {}
    finish {
        let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
    }
    value _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t], _mm512_slli_epi32::<7>(ibias[t]))), d)
}

q8k_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; the levels
    /// as their two nibbles (two byte shuffles of the indices) through [`nibble_dot8`], whose
    /// `vpmaddwd` takes the group scale, give the exact integer sums of the VNNI kernel.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<>("avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, j, isum, ibias, t|
    setup {
        let off32 = _mm256_set1_epi16(32);
    }
    block {}
    step {
        // (ls - 32, ls - 32) as an i16 pair per lane: the factor of `nibble_dot8`,
        // and against the pair (bsums[2j], bsums[2j + 1]).
        let ls = _mm_loadl_epi64(wb.add(LS + 16 * j + 8 * hf) as *const __m128i);
        let ll = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(ls, ls)), off32);
        // the levels in nibbles: the low indices' (elements 4v..) then the high ones'
        let mut nl = [[_mm256_setzero_si256(); 8]; 2];
        // With VNNI: the levels whole, and ls - 32 as an i32 for `vpmulld`
        let mut u = [_mm256_setzero_si256(); 8];
        let ls32 = _mm256_srai_epi32::<16>(ll);
        for v in 0..4 {
            let raw = _mm256_loadu_si256(wb.add(QS + 256 * j + 64 * v + 32 * hf) as *const __m256i);
            let [lo, hi] = nibbles8(raw);
            if VNNI {
                [u[v], u[v + 4]] = [nl_levels8(lo), nl_levels8(hi)];
            } else {
                [nl[0][v], nl[1][v]] = nl_nibbles8(lo);
                [nl[0][v + 4], nl[1][v + 4]] = nl_nibbles8(hi);
            }
        }
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * j);
            let s = if VNNI {
                // |sum| <= 32 * 255 * 128, times |ls - 32| <= 32: exact in i32
                _mm256_mullo_epi32(byte_dot8(&u, q), ls32)
            } else {
                nibble_dot8(&nl[0], &nl[1], q, ll)
            };
            isum[t] = _mm256_add_epi32(isum[t], s);
            let bias = _mm256_madd_epi16(ll, bcast8(y[t].add(Q8K_BSUMS + 4 * j)));
            ibias[t] = _mm256_add_epi32(ibias[t], bias);
        }
    }
    after {}
    finish {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
    }
    value _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_slli_epi32::<7>(ibias[t]))), d)
}
