//! Packed Q2_K against Q8_K activations. Per (row, token, block) the integer sums `isum = sum_s
//! sc_s * sum_e q_e * a_e` and `imin = sum_s m_s * bsum_s` (16 groups of 16) are exact, then `v =
//! isum * d - imin * dmin` (one fused multiply-add) and `acc = v * yd + acc` (fused): the
//! arithmetic of the Q4_K layout (`q4k.rs`) with groups of 16.
//!
//! Layout of one group of 16 rows, as large as the original: its blocks one after another, each
//! [`GROUP_BLOCK`] bytes: `qs[16 groups][16 rows][4 bytes]` (bits `2p..2p + 2` of byte `k` of lane
//! `r` in vector `s` hold element `16s + 4p + k`), then `sm[16 groups][16 rows]` (ggml's scale
//! byte: scale in the low nibble, min in the high one), then `d[16]` and `dmin[16]` (fp16).

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS};
use tandem_quant::blocks::BlockQ2K;
use tandem_quant::QK_K;

const SUBS: usize = QK_K / 16;
const QS: usize = 0;
const SM: usize = QS + QK_K / 4 * PACK_ROWS;
const D: usize = SM + SUBS * PACK_ROWS;
const DMIN: usize = D + 2 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (1344, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = DMIN + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == 1344 && GROUP_BLOCK.is_multiple_of(64));
const Q2K_BYTES: usize = std::mem::size_of::<BlockQ2K>();
const Q2K_QS: usize = std::mem::offset_of!(BlockQ2K, qs);
const Q2K_D: usize = std::mem::offset_of!(BlockQ2K, d);

/// One group: 16 rows of `nb` Q2_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * Q2K_BYTES..r * rb + (b + 1) * Q2K_BYTES];
            out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[Q2K_D..Q2K_D + 2]);
            out[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&blk[Q2K_D + 2..Q2K_D + 4]);
            for s in 0..SUBS {
                out[SM + PACK_ROWS * s + r] = blk[s];
                // ggml: group s = 8n + 2j + h reads bits 2j of qs[32n + 16h + l], l = 0..16.
                let (n, j, h) = (s / 8, (s % 8) / 2, s % 2);
                for l in 0..16 {
                    let q = (blk[Q2K_QS + 32 * n + 16 * h + l] >> (2 * j)) & 3;
                    out[QS + 64 * s + 4 * r + l % 4] |= q << (2 * (l / 4));
                }
            }
        }
    }
}

/// Level `e` (0..16) of group `s` of row `r` in a packed block.
#[inline]
fn level(blk: &[u8], s: usize, r: usize, e: usize) -> i32 {
    ((blk[QS + 64 * s + 4 * r + e % 4] >> (2 * (e / 4))) & 3) as i32
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
            let (mut isum, mut imin) = (0i32, 0i32);
            for s in 0..SUBS {
                let sum: i32 = (0..16).map(|e| level(blk, s, r, e) * y.q(16 * s + e)).sum();
                let sm = blk[SM + PACK_ROWS * s + r];
                isum += (sm & 0x0F) as i32 * sum;
                imin += (sm >> 4) as i32 * y.bsum(s);
            }
            let (d, dmin) = (f16_at(blk, D + 2 * r), f16_at(blk, DMIN + 2 * r));
            (-(imin as f32)).mul_add(dmin, isum as f32 * d)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, bcast8, prefetch_part, token_blocks};
    use super::{GroupActs, D, DMIN, GROUP_BLOCK, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, QS, SM, SUBS};
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
        let low4 = _mm512_set1_epi32(0x0F);
        let mut acc = [_mm512_setzero_ps(); NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                let mut isum = [_mm512_setzero_si512(); NY];
                let mut imin = [_mm512_setzero_si512(); NY];
                for i in 0..SUBS / 2 {
                    if NY == 1 {
                        prefetch_part::<PF>(wb, GROUP_BLOCK, i, SUBS / 2);
                    }
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
                        imin[t] = _mm512_dpwssd_epi32(imin[t], mm, bcast(y[t].add(Q8K_BSUMS + 4 * i)));
                    }
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(DMIN) as *const __m256i));
                for t in 0..NY {
                    let v = _mm512_fnmadd_ps(
                        _mm512_cvtepi32_ps(imin[t]),
                        dmin,
                        _mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), d),
                    );
                    let yd = _mm512_set1_ps((y[t] as *const f32).read_unaligned());
                    acc[t] = _mm512_fmadd_ps(v, yd, acc[t]);
                }
            }
        }
        // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
        unsafe { super::super::x86::store(&acc, out, ostride) };
    }

    group_entry! {
        /// A [`super::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; `vpmaddubsw` on
        /// the 2-bit levels (four of its i16 pair sums added stay far below 2^15) and one `vpmaddwd`
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
        let low4 = _mm256_set1_epi32(0x0F);
        let mut acc = [[_mm256_setzero_ps(); 2]; NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                for hf in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); NY];
                    let mut imin = [_mm256_setzero_si256(); NY];
                    for i in 0..SUBS / 2 {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, GROUP_BLOCK, hf * SUBS / 2 + i, SUBS);
                        }
                        let mut scsc = [_mm256_setzero_si256(); 2];
                        let mut m = [_mm256_setzero_si256(); 2];
                        let mut planes = [[_mm256_setzero_si256(); 4]; 2];
                        for h in 0..2 {
                            let s = 2 * i + h;
                            let sm =
                                _mm256_cvtepu8_epi32(_mm_loadl_epi64(wb.add(SM + 16 * s + 8 * hf) as *const __m128i));
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
                                let q = y[t].add(Q8K_QS + 16 * (2 * i + h));
                                let mut s = _mm256_maddubs_epi16(planes[h][0], bcast8(q));
                                for k in 1..4 {
                                    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(planes[h][k], bcast8(q.add(4 * k))));
                                }
                                isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s, scsc[h]));
                            }
                            let bs = _mm256_set1_epi32((y[t].add(Q8K_BSUMS + 4 * i) as *const i32).read_unaligned());
                            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mm, bs));
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(DMIN + 16 * hf) as *const __m128i));
                    for t in 0..NY {
                        let v = _mm256_fnmadd_ps(
                            _mm256_cvtepi32_ps(imin[t]),
                            dmin,
                            _mm256_mul_ps(_mm256_cvtepi32_ps(isum[t]), d),
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
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        let (rows, n) = (32, 512);
        let mut rng = Rng(31);
        let ty = GgmlType::Q2_K;
        let w = random_rows(ty, rows, n, &mut rng);
        let p = pack(ty, rows, n, &w).unwrap();
        let (rb, gb) = (row_size(ty, n).unwrap(), group_bytes(ty, n));
        assert_eq!(gb * (rows / PACK_ROWS), w.len(), "as large as the original");
        for row in 0..rows {
            let mut want = vec![0f32; n];
            tandem_quant::dequantize_row(ty, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
            for b in 0..n / QK_K {
                let blk = &p.bytes()[g * gb + b * GROUP_BLOCK..g * gb + (b + 1) * GROUP_BLOCK];
                let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
                for s in 0..SUBS {
                    let sm = blk[SM + 16 * s + r];
                    let d = f16(D + 2 * r) * (sm & 0x0F) as f32;
                    let m = f16(DMIN + 2 * r) * (sm >> 4) as f32;
                    for e in 0..16 {
                        assert_eq!(
                            d * level(blk, s, r, e) as f32 - m,
                            want[b * QK_K + 16 * s + e],
                            "row {row} block {b} group {s} element {e}"
                        );
                    }
                }
            }
        }
    }
}
