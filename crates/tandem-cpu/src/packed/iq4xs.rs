//! Packed IQ4_XS against Q8_K activations. The 4-bit indices stay nibbles; a byte shuffle turns
//! them into the non-linear levels plus 128 (`KVALUES_IQ4NL[i] + 128`, 1..=241, unsigned for
//! `vpdpbusd`). Per (row, token, block) the integer sums `isum = sum_j (ls_j - 32) * sum_e (k_e +
//! 128) * a_e` and `ibias = sum_j (ls_j - 32) * bsum_j` are exact, then `v = (isum - 128 * ibias)
//! * d` and `acc = v * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of row `r` in vector `v` of group `j` is
//! byte `4v + k` of the row's group: element `4v + k` in its low nibble, `16 + 4v + k` in its
//! high one), then `ls[8][16]` (the 6-bit group scales, one byte each), then `d[16]` (fp16), then
//! 32 bytes of padding to a whole number of cache lines.
//!
//! Kernels: AVX-512 VNNI and AVX2 (two byte shuffles give each level's two nibbles, which
//! `vpmaddubsw` takes without overflowing its i16 pair sums; see `x86::nibble_dot8` in `mod.rs`).

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS};
use tandem_quant::blocks::{BlockIQ4XS, KVALUES_IQ4NL};
use tandem_quant::QK_K;

const SUBS: usize = QK_K / 32;
const QS: usize = 0;
const LS: usize = QS + QK_K / 2 * PACK_ROWS;
const D: usize = LS + SUBS * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (2240, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = (D + 2 * PACK_ROWS).next_multiple_of(64);
const _: () = assert!(GROUP_BLOCK == 2240);
const IQ4XS_BYTES: usize = std::mem::size_of::<BlockIQ4XS>();
const IQ4XS_QS: usize = std::mem::offset_of!(BlockIQ4XS, qs);

/// One group: 16 rows of `nb` IQ4_XS blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * IQ4XS_BYTES..r * rb + (b + 1) * IQ4XS_BYTES];
            out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[0..2]);
            let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
            for j in 0..SUBS {
                let low = (blk[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
                out[LS + PACK_ROWS * j + r] = low | ((((scales_h >> (2 * j)) & 3) as u8) << 4);
                for v in 0..4 {
                    let at = QS + 256 * j + 64 * v + 4 * r;
                    let from = IQ4XS_QS + 16 * j + 4 * v;
                    out[at..at + 4].copy_from_slice(&blk[from..from + 4]);
                }
            }
        }
    }
}

/// The level index (0..16) of element `e` of group `j` of row `r` in a packed block.
#[inline]
fn index(blk: &[u8], j: usize, r: usize, e: usize) -> usize {
    let byte = blk[QS + 256 * j + 64 * ((e % 16) / 4) + 4 * r + e % 4];
    (if e < 16 { byte & 0x0F } else { byte >> 4 }) as usize
}

x86_kernels! {
    /// The AVX-512 VNNI kernel, where this build has one.
    SIMD = x86::group_vnni;
    /// The AVX2 kernel, where this build has one.
    AVX2 = x86::group_avx2;
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
            for j in 0..SUBS {
                let s: i32 = (0..32).map(|e| (KVALUES_IQ4NL[index(blk, j, r, e)] as i32 + 128) * y.q(32 * j + e)).sum();
                let ls = blk[LS + PACK_ROWS * j + r] as i32 - 32;
                isum += ls * s;
                ibias += ls * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            (isum - 128 * ibias) as f32 * f16_at(blk, D + 2 * r)
        })
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::q40::NL_LEVELS;
    use super::super::x86::{bcast, bcast8, nibble_dot8, nibbles8, nl_nibbles8, prefetch_part, token_blocks};
    use super::{GroupActs, D, GROUP_BLOCK, LS, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, QS, SUBS};
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
        let nib = _mm512_set1_epi8(0x0F);
        // SAFETY: 16 readable bytes.
        let table = _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(NL_LEVELS.as_ptr() as *const __m128i) });
        let off32 = _mm512_set1_epi32(32);
        let mut acc = [_mm512_setzero_ps(); NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                let mut isum = [_mm512_setzero_si512(); NY];
                let mut ibias = [_mm512_setzero_si512(); NY];
                for j in 0..SUBS {
                    if NY == 1 {
                        prefetch_part::<PF>(wb, GROUP_BLOCK, j, SUBS);
                    }
                    let ls = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(LS + 16 * j) as *const __m128i));
                    let ls = _mm512_sub_epi32(ls, off32);
                    // (ls, ls) as an i16 pair per lane, against the pair (bsums[2j], bsums[2j + 1]).
                    let ll =
                        _mm512_or_si512(_mm512_and_si512(ls, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32::<16>(ls));
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
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(wb.add(D) as *const __m256i));
                for t in 0..NY {
                    let i = _mm512_sub_epi32(isum[t], _mm512_slli_epi32::<7>(ibias[t]));
                    let v = _mm512_mul_ps(_mm512_cvtepi32_ps(i), d);
                    let yd = _mm512_set1_ps((y[t] as *const f32).read_unaligned());
                    acc[t] = _mm512_fmadd_ps(v, yd, acc[t]);
                }
            }
        }
        // SAFETY: NY token rows of 16 writable floats (see `GroupFn`).
        unsafe { super::super::x86::store(&acc, out, ostride) };
    }

    group_entry! {
        /// A [`super::GroupFn`] for AVX2: each half of the 16 rows in a ymm register; the levels
        /// as their two nibbles (two byte shuffles of the indices) through [`nibble_dot8`], whose
        /// `vpmaddwd` takes the group scale, give the exact integer sums of the VNNI kernel.
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
        let off32 = _mm256_set1_epi16(32);
        let mut acc = [[_mm256_setzero_ps(); 2]; NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                let y: [*const u8; NY] = token_blocks(ys, yb, b, Q8K_BYTES);
                for hf in 0..2 {
                    let mut isum = [_mm256_setzero_si256(); NY];
                    let mut ibias = [_mm256_setzero_si256(); NY];
                    for j in 0..SUBS {
                        if NY == 1 {
                            prefetch_part::<PF>(wb, GROUP_BLOCK, hf * SUBS + j, 2 * SUBS);
                        }
                        // (ls - 32, ls - 32) as an i16 pair per lane: the factor of `nibble_dot8`,
                        // and against the pair (bsums[2j], bsums[2j + 1]).
                        let ls = _mm_loadl_epi64(wb.add(LS + 16 * j + 8 * hf) as *const __m128i);
                        let ll = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(ls, ls)), off32);
                        // the levels in nibbles: the low indices' (elements 4v..) then the high ones'
                        let mut nl = [[_mm256_setzero_si256(); 8]; 2];
                        for v in 0..4 {
                            let raw = _mm256_loadu_si256(wb.add(QS + 256 * j + 64 * v + 32 * hf) as *const __m256i);
                            let [lo, hi] = nibbles8(raw);
                            [nl[0][v], nl[1][v]] = nl_nibbles8(lo);
                            [nl[0][v + 4], nl[1][v + 4]] = nl_nibbles8(hi);
                        }
                        for t in 0..NY {
                            let s = nibble_dot8(&nl[0], &nl[1], y[t].add(Q8K_QS + 32 * j), ll);
                            isum[t] = _mm256_add_epi32(isum[t], s);
                            let bias = _mm256_madd_epi16(ll, bcast8(y[t].add(Q8K_BSUMS + 4 * j)));
                            ibias[t] = _mm256_add_epi32(ibias[t], bias);
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.add(D + 16 * hf) as *const __m128i));
                    for t in 0..NY {
                        let i = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<7>(ibias[t]));
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
        // Levels, group scales and factors read back by the layout give ggml's dequantized rows.
        let (rows, n) = (32, 512);
        let mut rng = Rng(29);
        let ty = GgmlType::IQ4_XS;
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
                for j in 0..SUBS {
                    let dl = d * (blk[LS + 16 * j + r] as i32 - 32) as f32;
                    for e in 0..32 {
                        let k = KVALUES_IQ4NL[index(blk, j, r, e)] as f32;
                        assert_eq!(dl * k, want[b * QK_K + 32 * j + e], "row {row} block {b} group {j} element {e}");
                    }
                }
            }
        }
    }
}
