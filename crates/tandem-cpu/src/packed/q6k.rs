//! Packed Q6_K against Q8_K activations. Per (row, token, block) the integer sums
//! `isum = sum_g sc_g * sum_{e in g} u_e * a_e` (`u` the 6-bit code, 0..=63) and
//! `imin = 32 * sum_g sc_g * bsum_g` are exact, then `v = (isum - imin) * d` and
//! `acc = v * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes (the
//! 16 rows' own 3360): the low four bits as Q4_K's levels (`ql[8 groups of 32][4][16 rows][4]`,
//! element `8l + k` in the low nibble of byte `k` of load `l`, `8l + 4 + k` in the high one), the
//! high two bits `qh[8][2][16 rows][4]` (load `h`, byte `k`, bits `2l..2l+2`: element
//! `8l + 4h + k`), the scales `sc[8][16 rows][2]` (groups `2j`, `2j + 1` of 16 elements, i8), then
//! `d[16]` (fp16).

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS};
use std::mem::{offset_of, size_of};
use tandem_quant::blocks::BlockQ6K;
use tandem_quant::QK_K;

const SUBS: usize = QK_K / 32;
const QL: usize = 0;
const QH: usize = QL + QK_K / 2 * PACK_ROWS;
const SC: usize = QH + QK_K / 4 * PACK_ROWS;
const D: usize = SC + QK_K / 16 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows.
pub(super) const GROUP_BLOCK: usize = D + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == PACK_ROWS * size_of::<BlockQ6K>());

const Q6K_BYTES: usize = size_of::<BlockQ6K>();
const Q6K_QH: usize = offset_of!(BlockQ6K, qh);
const Q6K_SC: usize = offset_of!(BlockQ6K, scales);
const Q6K_D: usize = offset_of!(BlockQ6K, d);

/// Element `e` of a Q6_K block as its 6-bit code (ggml `dequantize_row_q6_K`: 128-element halves,
/// `ql` low nibbles for elements `l` and `l + 32`, high nibbles for `l + 64`, `l + 96`; `qh` two
/// bits each).
#[cfg(test)]
fn code(blk: &[u8], e: usize) -> u8 {
    let (half, i) = (e / 128, e % 128);
    let (quarter, l) = (i / 32, i % 32);
    let ql = blk[64 * half + l + 32 * (quarter % 2)];
    let low = if quarter < 2 { ql & 0x0F } else { ql >> 4 };
    let high = (blk[Q6K_QH + 32 * half + l] >> (2 * quarter)) & 3;
    low | (high << 4)
}

/// The 256 6-bit codes of a Q6_K block, in element order (as ggml's `dequantize_row_q6_K` reads
/// them: four elements per pair of a `ql` and a `qh` byte).
fn codes(blk: &[u8]) -> [u8; QK_K] {
    let mut u = [0u8; QK_K];
    for half in 0..2 {
        let (ql, qh) = (&blk[64 * half..64 * half + 64], &blk[Q6K_QH + 32 * half..Q6K_QH + 32 * half + 32]);
        let u = &mut u[128 * half..128 * half + 128];
        for l in 0..32 {
            u[l] = (ql[l] & 0x0F) | (qh[l] & 3) << 4;
            u[l + 32] = (ql[l + 32] & 0x0F) | ((qh[l] >> 2) & 3) << 4;
            u[l + 64] = (ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4;
            u[l + 96] = (ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4;
        }
    }
    u
}

/// One group: 16 rows of `nb` Q6_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * Q6K_BYTES..r * rb + (b + 1) * Q6K_BYTES];
            out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q6K_D..Q6K_D + 2]);
            let u = codes(blk);
            for j in 0..SUBS {
                out[SC + 32 * j + 2 * r] = blk[Q6K_SC + 2 * j];
                out[SC + 32 * j + 2 * r + 1] = blk[Q6K_SC + 2 * j + 1];
                let u = &u[32 * j..32 * j + 32];
                for l in 0..4 {
                    for k in 0..4 {
                        // Low nibbles: elements 8l + k and 8l + 4 + k share byte k of load l.
                        out[QL + 256 * j + 64 * l + 4 * r + k] = (u[8 * l + k] & 0x0F) | (u[8 * l + 4 + k] & 0x0F) << 4;
                    }
                }
                for h in 0..2 {
                    for k in 0..4 {
                        // High bits: element 8l + 4h + k in bits 2l..2l + 2 of byte k of load h.
                        out[QH + 128 * j + 64 * h + 4 * r + k] =
                            (0..4).fold(0, |b, l| b | (u[8 * l + 4 * h + k] >> 4) << (2 * l));
                    }
                }
            }
        }
    }
}

/// Where element `e` of group `j` of row `r` lives: (byte, shift) of its low four bits and of its
/// high two bits.
#[inline]
fn at(j: usize, r: usize, e: usize) -> ((usize, u32), (usize, u32)) {
    let (l, h, k) = (e / 8, (e % 8) / 4, e % 4);
    ((QL + 256 * j + 64 * l + 4 * r + k, 4 * h as u32), (QH + 128 * j + 64 * h + 4 * r + k, 2 * l as u32))
}

/// The AVX-512 VNNI kernel, where this build has one: the GFNI copy where the machine has GFNI
/// (chosen with the kernel, not at every call).
#[cfg(target_arch = "x86_64")]
pub(super) fn simd() -> Option<GroupFn> {
    Some(if std::arch::is_x86_feature_detected!("gfni") { x86::group_gfni } else { x86::group_plain })
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn simd() -> Option<GroupFn> {
    None
}

x86_kernels! {
    /// The AVX2 kernel, where this build has one.
    AVX2 = x86::group_avx2;
}

/// Both copies of the AVX-512 VNNI kernel, each with whether this machine runs it (besides AVX-512
/// VNNI), for the tests to check each whatever the machine picks.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn simd_variants() -> [(&'static str, GroupFn, bool); 2] {
    [("without GFNI", x86::group_plain, true), ("GFNI", x86::group_gfni, std::arch::is_x86_feature_detected!("gfni"))]
}
#[cfg(all(test, not(target_arch = "x86_64")))]
pub(super) fn simd_variants() -> [(&'static str, GroupFn, bool); 0] {
    []
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`] (Q8_K activations).
pub(super) unsafe fn group_scalar(nb: usize, w: *const u8, a: GroupActs, ny: usize, out: *mut f32, ostride: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(nb, w, GROUP_BLOCK, a, ny, out, ostride, |blk, y, r| {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in 0..SUBS {
                for half in 0..2 {
                    let sc = blk[SC + 32 * j + 2 * r + half] as i8 as i32;
                    let mut s = 0i32;
                    for e in 16 * half..16 * half + 16 {
                        let (lo, hi) = at(j, r, e);
                        let u = ((blk[lo.0] >> lo.1) & 0x0F) | (((blk[hi.0] >> hi.1) & 3) << 4);
                        s += u as i32 * y.q(32 * j + e);
                    }
                    isum += sc * s;
                    imin += sc * y.bsum(2 * j + half);
                }
            }
            (isum - 32 * imin) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, bcast8, prefetch_part, token_blocks};
    use super::{GroupActs, D, GROUP_BLOCK, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, QH, QL, SC, SUBS};
    use std::arch::x86_64::*;

    group_entry! {
        /// A [`super::GroupFn`] for AVX-512 VNNI without GFNI: each high-bit pair shifted into place
        /// and masked.
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
        group_plain => group, acts
    }

    group_entry! {
        /// [`group_plain`] on a machine with GFNI: each high-bit pair moved into place and masked by
        /// one `vgf2p8affineqb`.
        ///
        /// # Safety
        /// As [`group_plain`], and the machine has GFNI.
        group_gfni => group_gf, acts
    }

    /// The kernel, without (`group`) and with (`group_gf`) GFNI: two copies compiled for their
    /// target features (a function built with GFNI may use it anywhere).
    macro_rules! group_fn {
        ($name:ident, $features:literal, $gf:expr) => {
            /// # Safety
            /// As [`group_plain`] with `ny == NY` (and for `group_gf` the machine has GFNI).
            #[target_feature(enable = $features)]
            #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
            unsafe fn $name<const PF: u8, const NY: usize>(
                nb: usize,
                w: *const u8,
                a: GroupActs,
                out: *mut f32,
                ostride: usize,
            ) {
                const GF: bool = $gf;
                let nib = _mm512_set1_epi8(0x0F);
                let two = _mm512_set1_epi8(0x30);
                let mut acc = [_mm512_setzero_ps(); NY];
                for b in 0..nb {
                    // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
                    unsafe {
                        let wb = w.add(b * GROUP_BLOCK);
                        let y: [*const u8; NY] = token_blocks(a.ys, a.yb, b, Q8K_BYTES);
                        let mut isum = [_mm512_setzero_si512(); NY];
                        let mut imin = [_mm512_setzero_si512(); NY];
                        for j in 0..SUBS {
                            if NY == 1 {
                                prefetch_part::<PF>(wb, GROUP_BLOCK, j, SUBS);
                            }
                            // (sc[2j], sc[2j + 1]) as an i16 pair per lane, and each alone as i32.
                            let pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(wb.add(SC + 32 * j) as *const __m256i));
                            let sc0 = _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair));
                            let sc1 = _mm512_srai_epi32::<16>(pair);
                            let h0 = _mm512_loadu_si512(wb.add(QH + 128 * j) as *const __m512i);
                            let h1 = _mm512_loadu_si512(wb.add(QH + 128 * j + 64) as *const __m512i);
                            // Bits 2l..2l+2 of a high-bit byte moved to bits 4..6.
                            let high = |h: __m512i, l: usize| -> __m512i {
                                let s = match l {
                                    0 => _mm512_slli_epi16::<4>(h),
                                    1 => _mm512_slli_epi16::<2>(h),
                                    2 => h,
                                    _ => _mm512_srli_epi16::<2>(h),
                                };
                                _mm512_and_si512(s, two)
                            };
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
                                    hi[l] = _mm512_or_si512(
                                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib),
                                        high(h1, l),
                                    );
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
                        let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
                        for t in 0..NY {
                            let v = _mm512_mul_ps(
                                _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t], _mm512_slli_epi32::<5>(imin[t]))),
                                d,
                            );
                            let yd = _mm512_set1_ps((y[t] as *const f32).read_unaligned());
                            acc[t] = _mm512_fmadd_ps(v, yd, acc[t]);
                        }
                    }
                }
                // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
                unsafe { super::super::x86::store(&acc, out, ostride) };
            }
        };
    }
    group_fn!(group, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c", false);
    group_fn!(group_gf, "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,gfni", true);

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

    group_entry! {
        /// A [`super::GroupFn`] for AVX2: each half of the 16 rows in a ymm register. `vpmaddubsw`
        /// takes the 6-bit codes (<= 63) against the activations; two of its i16 pair sums added
        /// stay within i16 (2 x 2 x 63 x 128 = 32256), then one `vpmaddwd` against the (scale,
        /// scale) pair makes them i32: the exact integer sums of the VNNI kernel.
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX2.
        group_avx2 => group2, acts
    }

    /// # Safety
    /// As [`group_avx2`] with `ny == NY`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group2<const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        a: GroupActs,
        out: *mut f32,
        ostride: usize,
    ) {
        let nib = _mm256_set1_epi8(0x0F);
        let two = _mm256_set1_epi8(0x30);
        let low16 = _mm256_set1_epi32(0xFFFF);
        let mut acc = [[_mm256_setzero_ps(); 2]; NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(a.ys, a.yb, b, Q8K_BYTES);
                for hf in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); NY];
                    let mut imin = [_mm256_setzero_si256(); NY];
                    for j in 0..SUBS {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, GROUP_BLOCK, hf * SUBS + j, 2 * SUBS);
                        }
                        // (sc[2j], sc[2j + 1]) of this half's 8 rows as an i16 pair per lane; each
                        // alone as the pair (sc, sc) for `vpmaddwd`.
                        let pair =
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(wb.add(SC + 32 * j + 16 * hf) as *const __m128i));
                        let sc0 = _mm256_srai_epi32::<16>(_mm256_slli_epi32::<16>(pair));
                        let sc1 = _mm256_srai_epi32::<16>(pair);
                        let scsc0 = _mm256_or_si256(_mm256_and_si256(sc0, low16), _mm256_slli_epi32::<16>(sc0));
                        let scsc1 = _mm256_or_si256(_mm256_and_si256(sc1, low16), _mm256_slli_epi32::<16>(sc1));
                        let h0 = _mm256_loadu_si256(wb.add(QH + 128 * j + 32 * hf) as *const __m256i);
                        let h1 = _mm256_loadu_si256(wb.add(QH + 128 * j + 64 + 32 * hf) as *const __m256i);
                        // Bits 2l..2l+2 of a high-bit byte moved to bits 4..6.
                        let high = |h: __m256i, l: usize| -> __m256i {
                            let s = match l {
                                0 => _mm256_slli_epi16::<4>(h),
                                1 => _mm256_slli_epi16::<2>(h),
                                2 => h,
                                _ => _mm256_srli_epi16::<2>(h),
                            };
                            _mm256_and_si256(s, two)
                        };
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
                            for l in 0..4 {
                                let p = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(lo[l], bcast8(q.add(8 * l))),
                                    _mm256_maddubs_epi16(hi[l], bcast8(q.add(8 * l + 4))),
                                );
                                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, if l < 2 { scsc0 } else { scsc1 }));
                            }
                            isum[t] = _mm256_add_epi32(isum[t], s);
                            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * j) as *const i32).read_unaligned());
                            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(pair, bs));
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
                    for t in 0..NY {
                        let v = _mm256_mul_ps(
                            _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(imin[t]))),
                            d,
                        );
                        let yd = _mm256_set1_ps((y[t] as *const f32).read_unaligned());
                        acc[t][hf] = _mm256_fmadd_ps(v, yd, acc[t][hf]);
                    }
                }
            }
        }
        // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
        unsafe { super::super::x86::store_halves(&acc, out, ostride) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_rows, Rng};
    use super::super::{group_bytes, pack};
    use super::*;
    use tandem_quant::{row_size, GgmlType};

    #[test]
    fn a_block_s_codes_are_its_elements_codes() {
        let mut rng = Rng(5);
        for blk in random_rows(GgmlType::Q6_K, 8, QK_K, &mut rng).chunks_exact(Q6K_BYTES) {
            for (e, &u) in codes(blk).iter().enumerate() {
                assert_eq!(u, code(blk, e), "element {e}");
            }
        }
    }

    #[test]
    fn the_layout_keeps_every_code_scale_and_factor() {
        // (code - 32) * scale * d, read back by the layout, is ggml's dequantized value exactly.
        let (rows, n) = (32, 512);
        let mut rng = Rng(3);
        let w = random_rows(GgmlType::Q6_K, rows, n, &mut rng);
        let p = pack(GgmlType::Q6_K, rows, n, &w).unwrap();
        let (rb, gb) = (row_size(GgmlType::Q6_K, n).unwrap(), group_bytes(GgmlType::Q6_K, n));
        for row in 0..rows {
            let mut want = vec![0f32; n];
            tandem_quant::dequantize_row(GgmlType::Q6_K, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
            for b in 0..n / QK_K {
                let blk = &p.bytes()[g * gb + b * GROUP_BLOCK..g * gb + (b + 1) * GROUP_BLOCK];
                let d = half::f16::from_bits(u16::from_le_bytes([blk[D + 2 * r], blk[D + 2 * r + 1]])).to_f32();
                for j in 0..SUBS {
                    for e in 0..32 {
                        let (lo, hi) = at(j, r, e);
                        let u = ((blk[lo.0] >> lo.1) & 0x0F) | (((blk[hi.0] >> hi.1) & 3) << 4);
                        let sc = blk[SC + 32 * j + 2 * r + e / 16] as i8 as f32;
                        assert_eq!(
                            d * sc * (u as i32 - 32) as f32,
                            want[b * QK_K + 32 * j + e],
                            "row {row} block {b} element {}",
                            32 * j + e
                        );
                    }
                }
            }
        }
    }
}
