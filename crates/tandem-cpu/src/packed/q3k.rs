//! Packed Q3_K against Q8_K activations. Each level is stored as `u = q + 4` (0..=7: the two low
//! bits and ggml's `hmask` bit, which is set where ggml does not subtract 4). Per (row, token,
//! block) the integer sums `isum = sum_s (sc_s - 32) * sum_e u_e * a_e` and `ibias = sum_s (sc_s -
//! 32) * bsum_s` (16 groups of 16) are exact, then `v = (isum - 4 * ibias) * d` and `acc = v * yd +
//! acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[16 groups][16 rows][4 bytes]` (bits `2p..2p + 2` of byte `k` of lane `r` in vector `s`: the
//! low bits of element `16s + 4p + k`), then `qh[8 pairs of groups][16 rows][4 bytes]` (bit `4h +
//! p` of byte `k` of lane `r` in vector `i`: the third bit of element `4p + k` of group `2i + h`),
//! then `sc[16 groups][16 rows]` (the 6-bit scales, biased by 32), then `d[16]` (fp16), then 32
//! bytes of padding to a whole number of cache lines.

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS};
use tandem_quant::blocks::BlockQ3K;
use tandem_quant::{unpack_q3k_scales, QK_K};

const SUBS: usize = QK_K / 16;
const QS: usize = 0;
const QH: usize = QS + QK_K / 4 * PACK_ROWS;
const SC: usize = QH + QK_K / 8 * PACK_ROWS;
const D: usize = SC + SUBS * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (1856, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = (D + 2 * PACK_ROWS).next_multiple_of(64);
const _: () = assert!(GROUP_BLOCK == 1856);
const Q3K_BYTES: usize = std::mem::size_of::<BlockQ3K>();
const Q3K_HMASK: usize = std::mem::offset_of!(BlockQ3K, hmask);
const Q3K_QS: usize = std::mem::offset_of!(BlockQ3K, qs);
const Q3K_SCALES: usize = std::mem::offset_of!(BlockQ3K, scales);
const Q3K_D: usize = std::mem::offset_of!(BlockQ3K, d);

/// One group: 16 rows of `nb` Q3_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * Q3K_BYTES..r * rb + (b + 1) * Q3K_BYTES];
            out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q3K_D..Q3K_D + 2]);
            let scales = unpack_q3k_scales(blk[Q3K_SCALES..Q3K_SCALES + 12].try_into().expect("12 bytes"));
            for s in 0..SUBS {
                out[SC + PACK_ROWS * s + r] = scales[s] as u8;
                // ggml: group s = 8n + 2j + h reads bits 2j of qs[32n + 16h + l] and bit 4n + j of
                // hmask[16h + l], l = 0..16.
                let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
                for l in 0..16 {
                    let q = (blk[Q3K_QS + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                    let hb = (blk[Q3K_HMASK + 16 * h + l] >> (4 * n + j)) & 1;
                    out[QS + 64 * s + 4 * r + l % 4] |= q << (2 * (l / 4));
                    out[QH + 64 * (s / 2) + 4 * r + l % 4] |= hb << (4 * (s % 2) + l / 4);
                }
            }
        }
    }
}

/// Level `e` (0..16) of group `s` of row `r` in a packed block, as `u = q + 4`.
#[inline]
fn level(blk: &[u8], s: usize, r: usize, e: usize) -> i32 {
    let low = (blk[QS + 64 * s + 4 * r + e % 4] >> (2 * (e / 4))) & 3;
    let high = (blk[QH + 64 * (s / 2) + 4 * r + e % 4] >> (4 * (s % 2) + e / 4)) & 1;
    (low | high << 2) as i32
}

x86_kernels! {
    /// The AVX2 kernel, where this build has one.
    AVX2 = x86::group_avx2;
    /// The AVX-512 VNNI kernel, where this build has one.
    SIMD = x86::group_vnni;
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`] (Q8_K activations).
pub(super) unsafe fn group_scalar(nb: usize, w: *const u8, a: GroupActs, ny: usize, out: *mut f32, ostride: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(nb, w, GROUP_BLOCK, a, ny, out, ostride, |blk, y, r| {
            let (mut isum, mut ibias) = (0i32, 0i32);
            for s in 0..SUBS {
                let sum: i32 = (0..16).map(|e| level(blk, s, r, e) * y.q(16 * s + e)).sum();
                let sc = blk[SC + PACK_ROWS * s + r] as i32 - 32;
                isum += sc * sum;
                ibias += sc * y.bsum(s);
            }
            (isum - 4 * ibias) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, bcast8, prefetch_part, token_blocks};
    use super::{GroupActs, D, GROUP_BLOCK, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, QH, QS, SC, SUBS};
    use std::arch::x86_64::*;

    group_entry! {
        /// A [`super::GroupFn`] for AVX-512 VNNI.
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
        group_vnni => group, q8k
    }

    /// # Safety
    /// As [`super::GroupFn`] with `ny == NY`, and the machine has AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group<const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        ys: *const u8,
        yb: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let three = _mm512_set1_epi8(3);
        let four = _mm512_set1_epi8(4);
        let off32 = _mm512_set1_epi32(32);
        let mut acc = [_mm512_setzero_ps(); NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                let mut isum = [_mm512_setzero_si512(); NY];
                let mut ibias = [_mm512_setzero_si512(); NY];
                for i in 0..SUBS / 2 {
                    if NY == 1 {
                        prefetch_part::<PF>(wb, GROUP_BLOCK, i, SUBS / 2);
                    }
                    let hv = _mm512_loadu_si512(wb.add(QH + 64 * i) as *const __m512i);
                    let mut sc = [_mm512_setzero_si512(); 2];
                    let mut planes = [[_mm512_setzero_si512(); 4]; 2];
                    for h in 0..2 {
                        let s = 2 * i + h;
                        let raw_sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(SC + 16 * s) as *const __m128i));
                        sc[h] = _mm512_sub_epi32(raw_sc, off32);
                        let raw = _mm512_loadu_si512(wb.add(QS + 64 * s) as *const __m512i);
                        let low = [
                            raw,
                            _mm512_srli_epi16::<2>(raw),
                            _mm512_srli_epi16::<4>(raw),
                            _mm512_srli_epi16::<6>(raw),
                        ];
                        for p in 0..4 {
                            // (low & 3) | (third bit, moved to bit 2)
                            let high = _mm512_and_si512(to_bit2(hv, 4 * h + p), four);
                            planes[h][p] = _mm512_ternarylogic_epi32::<0xF8>(high, low[p], three);
                        }
                    }
                    // (sc of group 2i, sc of group 2i + 1) as an i16 pair per lane, against the
                    // pair (bsums[2i], bsums[2i + 1]).
                    let ss = _mm512_or_si512(
                        _mm512_and_si512(sc[0], _mm512_set1_epi32(0xFFFF)),
                        _mm512_slli_epi32::<16>(sc[1]),
                    );
                    for t in 0..NY {
                        let mut sums = [_mm512_setzero_si512(); 2];
                        for h in 0..2 {
                            let q = y[t].add(Q8K_QS + 16 * (2 * i + h));
                            let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                            s0 = _mm512_dpbusd_epi32(s0, planes[h][0], bcast(q));
                            s1 = _mm512_dpbusd_epi32(s1, planes[h][1], bcast(q.add(4)));
                            s0 = _mm512_dpbusd_epi32(s0, planes[h][2], bcast(q.add(8)));
                            s1 = _mm512_dpbusd_epi32(s1, planes[h][3], bcast(q.add(12)));
                            sums[h] = _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc[h]);
                        }
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(sums[0], sums[1]));
                        ibias[t] = _mm512_dpwssd_epi32(ibias[t], ss, bcast(y[t].add(Q8K_BSUMS + 4 * i)));
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
                for t in 0..NY {
                    let i = _mm512_sub_epi32(isum[t], _mm512_slli_epi32::<2>(ibias[t]));
                    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(i), d);
                    let yd = _mm512_set1_ps((y[t] as *const f32).read_unaligned());
                    acc[t] = _mm512_fmadd_ps(v, yd, acc[t]);
                }
            }
        }
        // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
        unsafe { super::super::x86::store(&acc, out, ostride) };
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

    group_entry! {
        /// A [`super::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; `vpmaddubsw` on
        /// the 3-bit levels (four of its i16 pair sums added stay far below 2^15) and one `vpmaddwd`
        /// against the (scale, scale) pair per group give the VNNI kernel's exact integer sums.
        ///
        /// # Safety
        /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX2.
        group_avx2 => group2, q8k
    }

    /// # Safety
    /// As [`group_avx2`] with `ny == NY`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group2<const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        ys: *const u8,
        yb: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let three = _mm256_set1_epi8(3);
        let four = _mm256_set1_epi8(4);
        let off32 = _mm256_set1_epi32(32);
        let low16 = _mm256_set1_epi32(0xFFFF);
        let mut acc = [[_mm256_setzero_ps(); 2]; NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                for hf in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); NY];
                    let mut ibias = [_mm256_setzero_si256(); NY];
                    for i in 0..SUBS / 2 {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, GROUP_BLOCK, hf * SUBS / 2 + i, SUBS);
                        }
                        let hv = _mm256_loadu_si256(wb.add(QH + 64 * i + 32 * hf) as *const __m256i);
                        let mut sc = [_mm256_setzero_si256(); 2];
                        let mut planes = [[_mm256_setzero_si256(); 4]; 2];
                        for h in 0..2 {
                            let s = 2 * i + h;
                            let raw_sc =
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(SC + 16 * s + 8 * hf) as *const __m128i));
                            sc[h] = _mm256_sub_epi32(raw_sc, off32);
                            let raw = _mm256_loadu_si256(wb.add(QS + 64 * s + 32 * hf) as *const __m256i);
                            let low = [
                                raw,
                                _mm256_srli_epi16::<2>(raw),
                                _mm256_srli_epi16::<4>(raw),
                                _mm256_srli_epi16::<6>(raw),
                            ];
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
                                let q = y[t].add(Q8K_QS + 16 * (2 * i + h));
                                let mut s = _mm256_maddubs_epi16(planes[h][0], bcast8(q));
                                for k in 1..4 {
                                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(planes[h][k], bcast8(q.add(4 * k))));
                                }
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, scsc[h]));
                            }
                            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * i) as *const i32).read_unaligned());
                            ibias[t] = _mm256_add_epi32(ibias[t], _mm256_madd_epi16(ss, bs));
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
                    for t in 0..NY {
                        let i = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<2>(ibias[t]));
                        let v = _mm256_mul_ps(_mm256_cvtepi32_ps(i), d);
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
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        let (rows, n) = (32, 512);
        let mut rng = Rng(37);
        let ty = GgmlType::Q3_K;
        let w = random_rows(ty, rows, n, &mut rng);
        let p = pack(ty, rows, n, &w).unwrap();
        let (rb, gb) = (row_size(ty, n).unwrap(), group_bytes(ty, n));
        for row in 0..rows {
            let mut want = vec![0f32; n];
            tandem_quant::dequantize_row(ty, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
            for b in 0..n / QK_K {
                let blk = &p.bytes()[g * gb + b * GROUP_BLOCK..g * gb + (b + 1) * GROUP_BLOCK];
                let d = half::f16::from_bits(u16::from_le_bytes([blk[D + 2 * r], blk[D + 2 * r + 1]])).to_f32();
                for s in 0..SUBS {
                    let dl = d * (blk[SC + 16 * s + r] as i32 - 32) as f32;
                    for e in 0..16 {
                        assert_eq!(
                            dl * (level(blk, s, r, e) - 4) as f32,
                            want[b * QK_K + 16 * s + e],
                            "row {row} block {b} group {s} element {e}"
                        );
                    }
                }
            }
        }
    }
}
