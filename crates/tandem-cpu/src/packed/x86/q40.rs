//! The packed group kernels of Q4_0, IQ4_NL and Q4_1 for x86-64 (AVX-512 VNNI, AVX2 and its AVX-VNNI
//! twin); layout and arithmetic in `packed/q40.rs`.

use super::{bcast, bcast8, byte_dot8, nibble_dot8, nibbles8, nl_levels8, nl_nibbles8};
use crate::packed::q40::{sizes, CODES, NL_LEVELS};
use std::arch::x86_64::*;

q8_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI (Q4_0, with `NL` IQ4_NL, with `MIN` Q4_1).
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; Q8_1 for Q4_1), and the
    /// machine has AVX-512 VNNI.
    group_vnni => group<const NL: bool, const MIN: bool>("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", CODES)
    |wb, hf, y, qs|
    setup {
        let nib = _mm512_set1_epi8(0x0F);
        // SAFETY: 16 readable bytes.
        let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(NL_LEVELS.as_ptr() as *const __m128i) });
    }
    sizes sizes(MIN), off if NL { 128 } else { 8 }, min MIN,
    load {
        let mut lo = [_mm512_setzero_si512(); 4];
        let mut hi = [_mm512_setzero_si512(); 4];
        for v in 0..4 {
            let raw = _mm512_loadu_si512(wb.add(64 * v) as *const __m512i);
            lo[v] = _mm512_and_si512(raw, nib);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
            if NL {
                lo[v] = _mm512_shuffle_epi8(table, lo[v]);
                hi[v] = _mm512_shuffle_epi8(table, hi[v]);
            }
        }
    }
    dot {
        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for v in 0..4 {
            s0 = _mm512_dpbusd_epi32(s0, lo[v], bcast(y.add(qs + 4 * v)));
            s1 = _mm512_dpbusd_epi32(s1, hi[v], bcast(y.add(qs + 16 + 4 * v)));
        }
        _mm512_add_epi32(s0, s1)
    }
}

q8_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2 (Q4_0, with `NL` IQ4_NL, with `MIN` Q4_1): each half of
    /// the 16 rows in a ymm register, `vpmaddubsw` (codes <= 15, so the i16 pair sums of eight
    /// of them stay below 2^15) and one `vpmaddwd` per block give the same exact integer sums
    /// as `vpdpbusd`. IQ4_NL's levels (up to 241) would overflow the pair sums: two byte
    /// shuffles give each level's two nibbles instead, for [`nibble_dot8`].
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; with `MIN`, Q4_1, Q8_1
    /// activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<const NL: bool, const MIN: bool>("avx2,fma,f16c", CODES)
    |wb, hf, y, qs|
    setup {
        let ones = _mm256_set1_epi16(1);
    }
    sizes sizes(MIN), off if NL { 128 } else { 8 }, min MIN,
    load {
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        // IQ4_NL's levels in nibbles: the low codes' (elements 4v..) then the high ones'
        let mut nl = [[_mm256_setzero_si256(); 8]; 2];
        // With VNNI: the levels (IQ4_NL's plus 128) whole, as `byte_dot8` takes them
        let mut u = [_mm256_setzero_si256(); 8];
        for v in 0..4 {
            [lo[v], hi[v]] = nibbles8(_mm256_loadu_si256(wb.add(64 * v + 32 * hf) as *const __m256i));
            if VNNI {
                [u[v], u[v + 4]] = if NL { [nl_levels8(lo[v]), nl_levels8(hi[v])] } else { [lo[v], hi[v]] };
            } else if NL {
                [nl[0][v], nl[1][v]] = nl_nibbles8(lo[v]);
                [nl[0][v + 4], nl[1][v + 4]] = nl_nibbles8(hi[v]);
            }
        }
    }
    dot {
        if VNNI {
            byte_dot8(&u, y.add(qs))
        } else if NL {
            nibble_dot8(&nl[0], &nl[1], y.add(qs), ones)
        } else {
            let mut s = _mm256_setzero_si256();
            for v in 0..4 {
                let q = y.add(qs + 4 * v);
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[v], bcast8(q)));
                s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[v], bcast8(q.add(16))));
            }
            _mm256_madd_epi16(s, ones)
        }
    }
}
