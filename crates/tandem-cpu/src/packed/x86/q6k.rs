//! Q6_K's packed group kernels for x86-64 (AVX-512 VNNI with and without GFNI, AVX2 and its AVX-VNNI
//! twin); layout and arithmetic in `packed/q6k.rs`.

use super::{bcast, bcast8, dpbusd8};
use crate::packed::q6k::{D, GROUP_BLOCK, QH, QL, SC};
use crate::packed::{GroupFn, Q8K_BSUMS, Q8K_QS};
use std::arch::x86_64::*;

/// The AVX-512 VNNI kernel: the GFNI copy where the machine has GFNI (chosen with the kernel, not
/// at every call).
pub(super) fn simd() -> GroupFn {
    if std::arch::is_x86_feature_detected!("gfni") {
        group_gfni
    } else {
        group_plain
    }
}

/// Both copies of the AVX-512 VNNI kernel, each with whether this machine runs it (besides AVX-512
/// VNNI), for the tests to check each whatever the machine picks.
#[cfg(test)]
pub(in crate::packed) fn simd_variants() -> [(&'static str, GroupFn, bool); 2] {
    [("without GFNI", group_plain, true), ("GFNI", group_gfni, std::arch::is_x86_feature_detected!("gfni"))]
}

/// The kernel, without (`group_plain`) and with (`group_gfni`) GFNI: two copies compiled for their
/// target features (a function built with GFNI may use it anywhere).
macro_rules! group_fn {
    ($(#[$doc:meta])* $entry:ident => $name:ident, $features:literal, $gf:expr) => {
        q8k_group! { zmm
            $(#[$doc])*
            $entry => $name<>($features, GROUP_BLOCK)
            |wb, y, hf, j, isum, imin, t|
            setup {
                const GF: bool = $gf;
                let nib = _mm512_set1_epi8(0x0F);
                let two = _mm512_set1_epi8(0x30);
                // Bits 2l..2l+2 of a high-bit byte moved to bits 4..6.
                let high = |h, l: usize| _mm512_and_si512(to_bit!(h, 2 * l, 4, _mm512_slli_epi16, _mm512_srli_epi16), two);
            }
            block {}
            step {
                // (sc[2j], sc[2j + 1]) as an i16 pair per lane, and each alone as i32.
                let pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(wb.add(SC + 32 * j) as *const __m256i));
                let sc0 = _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair));
                let sc1 = _mm512_srai_epi32::<16>(pair);
                let h0 = _mm512_loadu_si512(wb.add(QH + 128 * j) as *const __m512i);
                let h1 = _mm512_loadu_si512(wb.add(QH + 128 * j + 64) as *const __m512i);
                let mut lo = [_mm512_setzero_si512(); 4];
                let mut hi = [_mm512_setzero_si512(); 4];
                for l in 0..4 {
                    let raw = _mm512_loadu_si512(wb.add(QL + 256 * j + 64 * l) as *const __m512i);
                    if GF {
                        // (raw & 0x0F) | h and ((raw >> 4) & 0x0F) | h, h the pair moved by GFNI.
                        let (h0, h1) = (gf_high(h0, l), gf_high(h1, l));
                        lo[l] = _mm512_ternarylogic_epi32::<0xEA>(raw, nib, h0);
                        hi[l] = _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi16::<4>(raw), nib, h1);
                    } else {
                        lo[l] = _mm512_or_si512(_mm512_and_si512(raw, nib), high(h0, l));
                        hi[l] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib), high(h1, l));
                    }
                }
                for t in 0..NY {
                    let q = y[t].add(Q8K_QS + 32 * j);
                    // Elements 0..16 (loads 0, 1) and 16..32 (loads 2, 3): the two scale groups.
                    let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for l in 0..2 {
                        s0 = _mm512_dpbusd_epi32(s0, lo[l], bcast(q.add(8 * l)));
                        s0 = _mm512_dpbusd_epi32(s0, hi[l], bcast(q.add(8 * l + 4)));
                        s1 = _mm512_dpbusd_epi32(s1, lo[l + 2], bcast(q.add(8 * l + 16)));
                        s1 = _mm512_dpbusd_epi32(s1, hi[l + 2], bcast(q.add(8 * l + 20)));
                    }
                    let s = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
                    isum[t] = _mm512_add_epi32(isum[t], s);
                    imin[t] = _mm512_dpwssd_epi32(imin[t], pair, bcast(y[t].add(Q8K_BSUMS + 4 * j)));
                }
            }
            after {}
            finish {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
            }
            value _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t], _mm512_slli_epi32::<5>(imin[t]))), d)
        }
    };
}
group_fn! {
    /// A [`crate::packed::GroupFn`] for AVX-512 VNNI without GFNI: each high-bit pair shifted into place
    /// and masked.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    group_plain => group, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", false
}
group_fn! {
    /// [`group_plain`] on a machine with GFNI: each high-bit pair moved into place and masked by
    /// one `vgf2p8affineqb`.
    ///
    /// # Safety
    /// As [`group_plain`], and the machine has GFNI.
    group_gfni => group_gf, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,gfni", true
}

/// Bits `2l` and `2l + 1` of every byte of `h` moved to bits 4 and 5, the others cleared: one
/// `vgf2p8affineqb`, whose matrix takes output bit `i` from row byte `7 - i`.
///
/// # Safety
/// Only called from functions enabling AVX-512 BW and GFNI.
#[inline(always)]
unsafe fn gf_high(h: __m512i, l: usize) -> __m512i {
    let matrix = ((1u64 << (2 * l + 1)) << 16) | ((1u64 << (2 * l)) << 24);
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_gf2p8affine_epi64_epi8::<0>(h, _mm512_set1_epi64(matrix as i64)) }
}

q8k_group! { ymm
    /// A [`crate::packed::GroupFn`] for AVX2: each half of the 16 rows in a ymm register. `vpmaddubsw`
    /// takes the 6-bit codes (<= 63) against the activations; two of its i16 pair sums added
    /// stay within i16 (2 x 2 x 63 x 128 = 32256), then one `vpmaddwd` against the (scale,
    /// scale) pair makes them i32: the exact integer sums of the VNNI kernel.
    ///
    /// # Safety
    /// As [`crate::packed::GroupFn`] (Q8_K activations), and the machine has AVX2.
    group_avx2 => group2, vnni group_avxvnni => group2v<>("avx2,fma,f16c", GROUP_BLOCK)
    |wb, y, hf, j, isum, imin, t|
    setup {
        let nib = _mm256_set1_epi8(0x0F);
        let two = _mm256_set1_epi8(0x30);
        let low16 = _mm256_set1_epi32(0xFFFF);
        // Bits 2l..2l+2 of a high-bit byte moved to bits 4..6.
        let high = |h, l: usize| _mm256_and_si256(to_bit!(h, 2 * l, 4, _mm256_slli_epi16, _mm256_srli_epi16), two);
    }
    block {}
    step {
        // (sc[2j], sc[2j + 1]) of this half's 8 rows as an i16 pair per lane; each
        // alone as the pair (sc, sc) for `vpmaddwd`.
        let pair = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(SC + 32 * j + 16 * hf) as *const __m128i));
        let sc0 = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pair));
        let sc1 = _mm256_srai_epi32::<16>(pair);
        let scsc0 = _mm256_or_si256(_mm256_and_si256(sc0, low16), _mm256_slli_epi32::<16>(sc0));
        let scsc1 = _mm256_or_si256(_mm256_and_si256(sc1, low16), _mm256_slli_epi32::<16>(sc1));
        let h0 = _mm256_loadu_si256(wb.add(QH + 128 * j + 32 * hf) as *const __m256i);
        let h1 = _mm256_loadu_si256(wb.add(QH + 128 * j + 64 + 32 * hf) as *const __m256i);
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        for l in 0..4 {
            let raw = _mm256_loadu_si256(wb.add(QL + 256 * j + 64 * l + 32 * hf) as *const __m256i);
            lo[l] = _mm256_or_si256(_mm256_and_si256(raw, nib), high(h0, l));
            hi[l] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib), high(h1, l));
        }
        for t in 0..NY {
            let q = y[t].add(Q8K_QS + 32 * j);
            // Loads 0, 1: elements 0..16 (scale sc0); loads 2, 3: 16..32 (sc1).
            let mut s = _mm256_setzero_si256();
            if VNNI {
                // The sums of 16 in i32 (|.| <= 16 * 63 * 128), each times its scale.
                let mut part = [_mm256_setzero_si256(); 2];
                for l in 0..4 {
                    part[l / 2] = dpbusd8(part[l / 2], lo[l], q.add(8 * l));
                    part[l / 2] = dpbusd8(part[l / 2], hi[l], q.add(8 * l + 4));
                }
                s = _mm256_add_epi32(_mm256_mullo_epi32(part[0], sc0), _mm256_mullo_epi32(part[1], sc1));
            } else {
                for l in 0..4 {
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo[l], bcast8(q.add(8 * l))),
                        _mm256_maddubs_epi16(hi[l], bcast8(q.add(8 * l + 4))),
                    );
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, if l < 2 { scsc0 } else { scsc1 }));
                }
            }
            isum[t] = _mm256_add_epi32(isum[t], s);
            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * j) as *const i32).read_unaligned());
            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(pair, bs));
        }
    }
    after {}
    finish {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
    }
    value _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(imin[t]))), d)
}
