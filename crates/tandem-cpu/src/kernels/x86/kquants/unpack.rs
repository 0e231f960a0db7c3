//! Weight-block unpacking shared by every x86 level: each k-quant block becomes 256 unsigned levels
//! (bytes, in element order) plus one signed 16-bit scale per group of 16 and a multiplier per group
//! for the activations' `bsums`, so one dot loop serves all five types:
//!
//! `dot = d * yd * (sum_g sc[g] * sum_{e in g} u[e] * q8[e]) - dmin * yd * sum_g m[g] * bsums[g]`,
//!
//! where `u` is the level made non-negative (for `vpmaddubsw`). Types whose levels are signed (Q6_K:
//! `u - 32`, Q3_K: `u - 4`) fold the offset into `m = offset * sc` and `dmin = d` ([`KQuant::FOLD`]),
//! so the correction is subtracted in integers. With `u <= 63` and `q8 >= -128`, a `vpmaddubsw` pair
//! sum is at most 2 * 63 * 128 < 2^15, so it never saturates.

use std::arch::x86_64::*;
use std::mem::{offset_of, size_of};
use tandem_quant::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K};

/// One unpacked weight block (256 elements).
#[derive(Clone, Copy)]
pub(crate) struct Unpacked {
    /// Levels of elements `32k..32k+32` (each 0..=63).
    pub w: [__m256i; 8],
    pub f: Factors,
}

/// The scales and factors of one block.
#[derive(Clone, Copy)]
pub(crate) struct Factors {
    /// Scale of each group of 16 elements, i16.
    pub sc: __m256i,
    /// Multiplier of each group's activation sum, i16 (subtracted).
    pub m: __m256i,
    pub d: f32,
    /// Factor of the `m` term; equal to `d` when [`KQuant::FOLD`].
    pub dmin: f32,
}

/// A k-quant weight type the x86 kernels handle.
pub(crate) trait KQuant {
    /// Bytes of one block.
    const BYTES: usize;
    /// The `m` term carries the factor `d` (subtract it from the integer sum).
    const FOLD: bool;
    /// Levels of at most 63, so the VNNI kernels' sums of four products pack to i16 exactly.
    const VNNI: bool = true;
    /// [`Self::unpack_vbmi`] is the type's own (the `avx512vbmi` kernels exist for it).
    const OWN_VBMI: bool = false;
    /// Multi-row tile kernels pay for this type.
    const TILES: bool = true;
    /// # Safety
    /// `p` points at `BYTES` readable bytes; the machine has AVX2, FMA and F16C.
    unsafe fn unpack(p: *const u8) -> Unpacked;

    /// The levels as 4 zmm vectors (elements `64k..64k+64`) and the factors of [`Self::unpack`].
    ///
    /// # Safety
    /// As [`Self::unpack`], and the machine has AVX-512 F/BW/VL/DQ.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn unpack512(p: *const u8) -> ([__m512i; 4], Factors) {
        // SAFETY: forwarded from the caller.
        let u = unsafe { Self::unpack(p) };
        let w = std::array::from_fn(|k| _mm512_inserti64x4(_mm512_castsi256_si512(u.w[2 * k]), u.w[2 * k + 1], 1));
        (w, u.f)
    }

    /// [`Self::unpack512`] with AVX-512 VBMI and BITALG as well (byte permutes and shifts), where a
    /// type gains from them; the same levels and factors.
    ///
    /// # Safety
    /// As [`Self::unpack512`], and the machine has AVX-512 VBMI and BITALG.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bitalg,avx2,fma,f16c")]
    unsafe fn unpack_vbmi(p: *const u8) -> ([__m512i; 4], Factors) {
        // SAFETY: forwarded from the caller.
        unsafe { Self::unpack512(p) }
    }
}

#[inline(always)]
unsafe fn rd_u32(p: *const u8) -> u32 {
    // SAFETY: the caller guarantees 4 readable bytes.
    unsafe { u32::from_le((p as *const u32).read_unaligned()) }
}

/// Two adjacent fp16 values (d, dmin) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(rd_u32(p) as i32));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

/// One fp16 value as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_one(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le(bits) as i32)))
}

#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Bit `b` of every byte of `h`, moved to bit `pos` (other bits zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bit_to(h: __m256i, b: u32, pos: u32) -> __m256i {
    // 16-bit shifts: bits crossing a byte boundary land outside the mask.
    let moved = if b <= pos {
        _mm256_sll_epi16(h, _mm_cvtsi32_si128((pos - b) as i32))
    } else {
        _mm256_srl_epi16(h, _mm_cvtsi32_si128((b - pos) as i32))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(1 << pos))
}

/// 8 i16 values, each repeated for two groups of 16 (Q4_K / Q5_K sub-blocks of 32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pairs(v: __m128i) -> __m256i {
    _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v))
}

/// Scales and mins of Q4_K / Q5_K (ggml's `utmp`/`kmask` unpacking): (scales, mins) as i16 per group of 16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_scales(p: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller upholds this function's `# Safety` contract.
    unsafe {
        const KMASK1: u32 = 0x3f3f_3f3f;
        const KMASK2: u32 = 0x0f0f_0f0f;
        const KMASK3: u32 = 0x0303_0303;
        let (u0, u1, u2) = (rd_u32(p), rd_u32(p.add(4)), rd_u32(p.add(8)));
        let s0 = u0 & KMASK1;
        let s1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
        let m0 = u1 & KMASK1;
        let m1 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
        let s = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, s1 as i32, s0 as i32));
        let m = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, m1 as i32, m0 as i32));
        (pairs(s), pairs(m))
    }
}

pub(crate) struct Q2K;
pub(crate) struct Q3K;
pub(crate) struct Q4K;
pub(crate) struct Q5K;
pub(crate) struct Q6K;

/// ggml block_q4_K: d, dmin (fp16), scales[12], qs[128].
impl KQuant for Q4K {
    const BYTES: usize = size_of::<BlockQ4K>();
    const FOLD: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> Unpacked {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let (d, dmin) = f16_pair(p.add(offset_of!(BlockQ4K, d)));
            let (sc, m) = k4_scales(p.add(offset_of!(BlockQ4K, scales)));
            let low = _mm256_set1_epi8(0x0F);
            let mut w = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                let q = ld(p.add(offset_of!(BlockQ4K, qs) + 32 * j));
                w[2 * j] = _mm256_and_si256(q, low);
                w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
            }
            Unpacked { w, f: Factors { sc, m, d, dmin } }
        }
    }

    /// Each 32-byte chunk broadcast to both halves of a zmm: low nibbles below, high nibbles above.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
    unsafe fn unpack512(p: *const u8) -> ([__m512i; 4], Factors) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let (d, dmin) = f16_pair(p.add(offset_of!(BlockQ4K, d)));
            let (sc, m) = k4_scales(p.add(offset_of!(BlockQ4K, scales)));
            let shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
            let low = _mm512_set1_epi8(0x0F);
            let w = std::array::from_fn(|k| {
                let q = _mm512_broadcast_i64x4(ld(p.add(offset_of!(BlockQ4K, qs) + 32 * k)));
                _mm512_and_si512(_mm512_srlv_epi64(q, shift), low)
            });
            (w, Factors { sc, m, d, dmin })
        }
    }
}

/// ggml block_q5_K: d, dmin (fp16), scales[12], qh[32], qs[128].
impl KQuant for Q5K {
    const BYTES: usize = size_of::<BlockQ5K>();
    const FOLD: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> Unpacked {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let (d, dmin) = f16_pair(p.add(offset_of!(BlockQ5K, d)));
            let (sc, m) = k4_scales(p.add(offset_of!(BlockQ5K, scales)));
            let hb = ld(p.add(offset_of!(BlockQ5K, qh)));
            let low = _mm256_set1_epi8(0x0F);
            let mut w = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                let q = ld(p.add(offset_of!(BlockQ5K, qs) + 32 * j));
                let lo = _mm256_and_si256(q, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                w[2 * j] = _mm256_or_si256(lo, bit_to(hb, 2 * j as u32, 4));
                w[2 * j + 1] = _mm256_or_si256(hi, bit_to(hb, 2 * j as u32 + 1, 4));
            }
            Unpacked { w, f: Factors { sc, m, d, dmin } }
        }
    }
}

/// ggml block_q6_K: ql[128], qh[64], scales[16] (i8), d (fp16); level = u - 32.
impl KQuant for Q6K {
    const BYTES: usize = size_of::<BlockQ6K>();
    const FOLD: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> Unpacked {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let d = f16_one(p.add(offset_of!(BlockQ6K, d)));
            // SAFETY: the 16 scale bytes.
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(p.add(offset_of!(BlockQ6K, scales)) as *const __m128i));
            let m = _mm256_slli_epi16(sc, 5);
            let (low, two) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
            let mut w = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                let ql0 = ld(p.add(offset_of!(BlockQ6K, ql) + 64 * n));
                let ql1 = ld(p.add(offset_of!(BlockQ6K, ql) + 64 * n + 32));
                let qh = ld(p.add(offset_of!(BlockQ6K, qh) + 32 * n));
                let h = |v: __m256i| _mm256_and_si256(v, two);
                w[4 * n] = _mm256_or_si256(_mm256_and_si256(ql0, low), h(_mm256_slli_epi16(qh, 4)));
                w[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low), h(_mm256_slli_epi16(qh, 2)));
                w[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), h(qh));
                w[4 * n + 3] =
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), h(_mm256_srli_epi16(qh, 2)));
            }
            Unpacked { w, f: Factors { sc, m, d, dmin: d } }
        }
    }
}

/// ggml block_q3_K: hmask[32], qs[64], scales[12], d (fp16); level = u - 4 with u = low | hbit << 2.
impl KQuant for Q3K {
    const BYTES: usize = size_of::<BlockQ3K>();
    const FOLD: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> Unpacked {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            const KMASK1: u32 = 0x0303_0303;
            const KMASK2: u32 = 0x0f0f_0f0f;
            let d = f16_one(p.add(offset_of!(BlockQ3K, d)));
            let sp = p.add(offset_of!(BlockQ3K, scales));
            let (a0, a1, a2) = (rd_u32(sp), rd_u32(sp.add(4)), rd_u32(sp.add(8)));
            let s = _mm_set_epi32(
                (((a1 >> 4) & KMASK2) | (((a2 >> 6) & KMASK1) << 4)) as i32,
                (((a0 >> 4) & KMASK2) | (((a2 >> 4) & KMASK1) << 4)) as i32,
                ((a1 & KMASK2) | (((a2 >> 2) & KMASK1) << 4)) as i32,
                ((a0 & KMASK2) | ((a2 & KMASK1) << 4)) as i32,
            );
            let sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(s, _mm_set1_epi8(32)));
            let m = _mm256_slli_epi16(sc, 2);
            let hm = ld(p.add(offset_of!(BlockQ3K, hmask)));
            let three = _mm256_set1_epi8(3);
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..2 {
                let q = ld(p.add(offset_of!(BlockQ3K, qs) + 32 * c));
                for k in 0..4 {
                    let lo = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * k as i32)), three);
                    w[4 * c + k] = _mm256_or_si256(lo, bit_to(hm, (4 * c + k) as u32, 2));
                }
            }
            Unpacked { w, f: Factors { sc, m, d, dmin: d } }
        }
    }
}

/// ggml block_q2_K: scales[16] (scale low nibble, min high nibble), qs[64], d, dmin (fp16).
impl KQuant for Q2K {
    const BYTES: usize = size_of::<BlockQ2K>();
    const FOLD: bool = false;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(p: *const u8) -> Unpacked {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            let (d, dmin) = f16_pair(p.add(offset_of!(BlockQ2K, d)));
            // SAFETY: the 16 scale bytes.
            let s = _mm_loadu_si128(p.add(offset_of!(BlockQ2K, scales)) as *const __m128i);
            let low = _mm_set1_epi8(0x0F);
            let sc = _mm256_cvtepu8_epi16(_mm_and_si128(s, low));
            let m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s, 4), low));
            let three = _mm256_set1_epi8(3);
            let mut w = [_mm256_setzero_si256(); 8];
            for c in 0..2 {
                let q = ld(p.add(offset_of!(BlockQ2K, qs) + 32 * c));
                for k in 0..4 {
                    w[4 * c + k] = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(2 * k as i32)), three);
                }
            }
            Unpacked { w, f: Factors { sc, m, d, dmin } }
        }
    }
}

// d and dmin adjacent (read as one pair) in the types that have both.
const _: () = assert!(offset_of!(BlockQ4K, dmin) == offset_of!(BlockQ4K, d) + 2);
const _: () = assert!(offset_of!(BlockQ5K, dmin) == offset_of!(BlockQ5K, d) + 2);
const _: () = assert!(offset_of!(BlockQ2K, dmin) == offset_of!(BlockQ2K, d) + 2);
