//! Packed Q4_K against Q8_K activations. Per (row, token, block) the integer sums
//! `isum = sum_j sc_j * sum_e q_e * a_e` and `imin = sum_j m_j * bsum_j` are exact, then
//! `v = isum * d - imin * dmin` (one fused multiply-add) and `acc = v * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of lane `r` in load `l` of group `j` holds
//! element `8l + k` in its low nibble and `8l + 4 + k` in its high one), then `sc[8][16]` and
//! `m[8][16]` (the 6-bit scales and mins, one byte each), then `d[16]` and `dmin[16]` (fp16).

use super::{GroupActs, GroupFn, PACK_ROWS};
use tandem_quant::blocks::{BlockQ4K, BlockQ8K};
use tandem_quant::{get_scale_min_k4, QK_K};

const SUBS: usize = QK_K / 32;
const QS: usize = 0;
const SC: usize = QS + QK_K / 2 * PACK_ROWS;
const MN: usize = SC + SUBS * PACK_ROWS;
const D: usize = MN + SUBS * PACK_ROWS;
const DMIN: usize = D + 2 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (2368, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = DMIN + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == 2368 && GROUP_BLOCK.is_multiple_of(64));

/// ggml block_q8_K: f32 d, i8 qs[256], i16 bsums[16].
const Q8K_BYTES: usize = std::mem::size_of::<BlockQ8K>();
const Q8K_QS: usize = std::mem::offset_of!(BlockQ8K, qs);
const Q8K_BSUMS: usize = std::mem::offset_of!(BlockQ8K, bsums);
const Q4K_BYTES: usize = std::mem::size_of::<BlockQ4K>();

/// One group: 16 rows of `nb` Q4_K blocks (`rb` bytes each) into `dst` (zeroed).
pub(super) fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    for b in 0..nb {
        let out = &mut dst[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for r in 0..PACK_ROWS {
            let blk = &src[r * rb + b * Q4K_BYTES..r * rb + (b + 1) * Q4K_BYTES];
            out[D + 2 * r..D + 2 * r + 2].copy_from_slice(&blk[0..2]);
            out[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&blk[2..4]);
            let scales: &[u8; 12] = blk[4..16].try_into().expect("12 bytes");
            let qs = &blk[16..Q4K_BYTES];
            for j in 0..SUBS {
                let (sc, m) = get_scale_min_k4(j, scales);
                out[SC + PACK_ROWS * j + r] = sc;
                out[MN + PACK_ROWS * j + r] = m;
                for e in 0..32 {
                    let q = (qs[32 * (j / 2) + e] >> (4 * (j % 2))) & 0x0F;
                    out[qs_at(j, r, e)] |= q << (4 * ((e % 8) / 4));
                }
            }
        }
    }
}

/// The byte of a packed block holding element `e` of group `j` of row `r` (nibble `(e % 8) / 4`).
#[inline]
fn qs_at(j: usize, r: usize, e: usize) -> usize {
    QS + 256 * j + 64 * (e / 8) + 4 * r + e % 4
}

/// The AVX-512 VNNI kernel, where this build has one.
#[cfg(target_arch = "x86_64")]
pub(super) const SIMD: Option<GroupFn> = Some(x86::group_vnni);
#[cfg(not(target_arch = "x86_64"))]
pub(super) const SIMD: Option<GroupFn> = None;

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`].
pub(super) unsafe fn group_scalar(nb: usize, w: *const u8, a: GroupActs, ny: usize, out: *mut f32, ostride: usize) {
    let yb = a.yb;
    // SAFETY: forwarded from the caller.
    let (w, ys) = unsafe { super::scalar_views(nb, w, GROUP_BLOCK, &a, ny, Q8K_BYTES) };
    for t in 0..ny {
        let mut acc = [0f32; PACK_ROWS];
        for b in 0..nb {
            let blk = &w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
            let y = &ys[t * yb + b * Q8K_BYTES..t * yb + (b + 1) * Q8K_BYTES];
            let yd = f32::from_le_bytes(y[0..4].try_into().expect("4 bytes"));
            let bsum = |g: usize| i16::from_le_bytes([y[Q8K_BSUMS + 2 * g], y[Q8K_BSUMS + 2 * g + 1]]) as i32;
            for (r, acc) in acc.iter_mut().enumerate() {
                let (mut isum, mut imin) = (0i32, 0i32);
                for j in 0..SUBS {
                    let mut s = 0i32;
                    for e in 0..32 {
                        let q = (blk[qs_at(j, r, e)] >> (4 * ((e % 8) / 4))) & 0x0F;
                        s += q as i32 * y[Q8K_QS + 32 * j + e] as i8 as i32;
                    }
                    isum += blk[SC + PACK_ROWS * j + r] as i32 * s;
                    imin += blk[MN + PACK_ROWS * j + r] as i32 * (bsum(2 * j) + bsum(2 * j + 1));
                }
                let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
                let (d, dmin) = (f16(D + 2 * r), f16(DMIN + 2 * r));
                let v = (-(imin as f32)).mul_add(dmin, isum as f32 * d);
                *acc = v.mul_add(yd, *acc);
            }
        }
        // SAFETY: t < ny (see `GroupFn`).
        unsafe { super::store_scalar(out, t, ostride, &acc) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, prefetch_ahead};
    use super::{GroupActs, D, DMIN, GROUP_BLOCK, MN, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, SC, SUBS};
    use std::arch::x86_64::*;

    /// A [`super::GroupFn`] for AVX-512 VNNI.
    ///
    /// # Safety
    /// As [`super::GroupFn`] (Q8_K activations), and the machine has AVX-512 VNNI.
    pub(super) unsafe fn group_vnni(nb: usize, w: *const u8, a: GroupActs, ny: usize, out: *mut f32, ostride: usize) {
        let (ys, yb) = (a.ys, a.yb);
        // SAFETY: forwarded from the caller, who checked that the machine has AVX-512 VNNI.
        unsafe { by_ny!(ny, group[](nb, w, ys, yb, out, ostride)) }
    }

    /// # Safety
    /// As [`super::GroupFn`] with `ny == NY`, and the machine has AVX-512 VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group<const NY: usize>(nb: usize, w: *const u8, ys: *const u8, yb: usize, out: *mut f32, ostride: usize) {
        let nib = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); NY];
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * GROUP_BLOCK);
                if NY == 1 {
                    prefetch_ahead(wb, GROUP_BLOCK);
                }
                let y: [*const u8; NY] = std::array::from_fn(|t| ys.add(t * yb + b * Q8K_BYTES));
                let mut isum = [_mm512_setzero_si512(); NY];
                let mut imin = [_mm512_setzero_si512(); NY];
                for j in 0..SUBS {
                    let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(SC + 16 * j) as *const __m128i));
                    let mz = _mm512_cvtepu8_epi32(_mm_loadu_si128(wb.add(MN + 16 * j) as *const __m128i));
                    // (m, m) as an i16 pair per lane, against the pair (bsums[2j], bsums[2j + 1]).
                    let mm = _mm512_or_si512(mz, _mm512_slli_epi32::<16>(mz));
                    let mut lo = [_mm512_setzero_si512(); 4];
                    let mut hi = [_mm512_setzero_si512(); 4];
                    for l in 0..4 {
                        let raw = _mm512_loadu_si512(wb.add(256 * j + 64 * l) as *const __m512i);
                        lo[l] = _mm512_and_si512(raw, nib);
                        hi[l] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib);
                    }
                    for t in 0..NY {
                        let q = y[t].add(Q8K_QS + 32 * j);
                        let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                        for l in 0..4 {
                            s0 = _mm512_dpbusd_epi32(s0, lo[l], bcast(q.add(8 * l)));
                            s1 = _mm512_dpbusd_epi32(s1, hi[l], bcast(q.add(8 * l + 4)));
                        }
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), sc));
                        imin[t] = _mm512_dpwssd_epi32(imin[t], mm, bcast(y[t].add(Q8K_BSUMS + 4 * j)));
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
        let mut rng = Rng(7);
        let w = random_rows(GgmlType::Q4_K, rows, n, &mut rng);
        let p = pack(GgmlType::Q4_K, rows, n, &w).unwrap();
        let rb = row_size(GgmlType::Q4_K, n).unwrap();
        let gb = group_bytes(GgmlType::Q4_K, n);
        for row in 0..rows {
            let mut want = vec![0f32; n];
            tandem_quant::dequantize_row(GgmlType::Q4_K, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
            for b in 0..n / QK_K {
                let blk = &p.bytes()[g * gb + b * GROUP_BLOCK..g * gb + (b + 1) * GROUP_BLOCK];
                let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]])).to_f32();
                for j in 0..SUBS {
                    let d = f16(D + 2 * r) * blk[SC + 16 * j + r] as f32;
                    let m = f16(DMIN + 2 * r) * blk[MN + 16 * j + r] as f32;
                    for e in 0..32 {
                        let q = (blk[qs_at(j, r, e)] >> (4 * ((e % 8) / 4))) & 0x0F;
                        assert_eq!(
                            d * q as f32 - m,
                            want[b * QK_K + 32 * j + e],
                            "row {row} block {b} group {j} element {e}"
                        );
                    }
                }
            }
        }
    }
}
