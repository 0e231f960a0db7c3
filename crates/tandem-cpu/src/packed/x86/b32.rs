//! The packed group kernels of Q8_0, Q5_0 and Q5_1 for x86-64 (AVX-512 VNNI, AVX2 and its AVX-VNNI
//! twin); layout and arithmetic in `packed/b32.rs`.

use super::{bcast, bcast8, byte_dot8, nibble_dot8, nibbles8};
use crate::packed::b32::{sizes, LEVELS, Q5_1_OFF};
use std::arch::x86_64::*;

q8_group! { zmm
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI (`OFF` 128 for Q8_0, 16 for Q5_0, [`Q5_1_OFF`] for
    /// Q5_1). Q8_0 streams with the hint for the kernels with the least work per byte.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; Q8_1 activations for Q5_1),
    /// and the machine has AVX-512 VNNI.
    group_vnni => group<const OFF: i32>(
        "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c",
        LEVELS,
        hint if OFF == 128 { crate::prefetch::light_hint_index() } else { crate::prefetch::hint_index() }
    )
    |wb, hf, y, qs|
    setup {}
    sizes sizes(OFF), off OFF, min OFF == Q5_1_OFF,
    load {
        let mut wv = [_mm512_setzero_si512(); 8];
        for (q, v) in wv.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(wb.add(64 * q) as *const __m512i);
        }
    }
    dot {
        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for q in (0..8).step_by(2) {
            s0 = _mm512_dpbusd_epi32(s0, wv[q], bcast(y.add(qs + 4 * q)));
            s1 = _mm512_dpbusd_epi32(s1, wv[q + 1], bcast(y.add(qs + 4 * q + 4)));
        }
        _mm512_add_epi32(s0, s1)
    }
}

q8_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2 (`OFF` 128 for Q8_0, 16 for Q5_0, [`Q5_1_OFF`] for Q5_1):
    /// each half of the 16 rows in a ymm register; `vpmaddubsw` takes the 5-bit levels (<= 31,
    /// so four of its i16 pair sums added stay below 2^15) and one `vpmaddwd` by ones per four
    /// makes them the exact integer sums of the VNNI kernel. Q8_0's levels (up to 255) would
    /// overflow the pair sums: they go in as their two nibbles ([`nibble_dot8`]).
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_0 activations with their block sums; Q8_1 activations for Q5_1),
    /// and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<const OFF: i32>("avx2,fma,f16c", LEVELS)
    |wb, hf, y, qs|
    setup {
        let ones = _mm256_set1_epi16(1);
    }
    sizes sizes(OFF), off OFF, min OFF == Q5_1_OFF,
    load {
        let mut wv = [_mm256_setzero_si256(); 8];
        // Q8_0's levels in nibbles
        let mut nib = [[_mm256_setzero_si256(); 8]; 2];
        for (q, v) in wv.iter_mut().enumerate() {
            *v = _mm256_loadu_si256(wb.add(64 * q + 32 * hf) as *const __m256i);
            if OFF == 128 && !VNNI {
                [nib[0][q], nib[1][q]] = nibbles8(*v);
            }
        }
    }
    dot {
        if VNNI {
            byte_dot8(&wv, y.add(qs))
        } else if OFF == 128 {
            nibble_dot8(&nib[0], &nib[1], y.add(qs), ones)
        } else {
            let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for q in 0..4 {
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wv[q], bcast8(y.add(qs + 4 * q))));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wv[q + 4], bcast8(y.add(qs + 16 + 4 * q))));
            }
            _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones))
        }
    }
}
