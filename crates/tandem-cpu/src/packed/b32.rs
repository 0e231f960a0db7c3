//! Packed Q8_0 and Q5_0 (32-element blocks) against Q8_0 activations. Each level is stored as an
//! unsigned byte `u = q + OFF` (Q8_0: `q + 128`, Q5_0: the 5-bit code, `OFF = 16`), so `vpdpbusd`
//! takes it as it is. Per (row, token, block) the integer sum `isum = sum_e u_e * a_e - OFF *
//! sum_e a_e` is exact, then `acc = (dw * da) * isum + acc` (the factor product rounded, the rest
//! fused).
//!
//! Layout of one group of 16 rows: first every block's levels, `[block][8 quads][16 rows][4]`
//! (element `4q + k` of row `r` at byte `64q + 4r + k`), then every block's factors `d[block][16]`
//! (fp16). Q8_0 keeps its 34 bytes per row and block; Q5_0 grows from 22 to 34.

use super::{f16_at, GroupActs, GroupFn, PACK_ROWS};
use tandem_quant::blocks::BlockQ8_0;
use tandem_quant::GgmlType;

/// Bytes of one block of one group of 16 rows: 512 of levels, 32 of factors.
pub(super) const GROUP_BLOCK: usize = LEVELS + 2 * PACK_ROWS;
const LEVELS: usize = 32 * PACK_ROWS;
/// ggml block_q8_0 (the activations): fp16 d, i8 qs[32].
pub(super) const Q8_0_BYTES: usize = std::mem::size_of::<BlockQ8_0>();
const Q8_0_QS: usize = std::mem::offset_of!(BlockQ8_0, qs);

/// One group: 16 rows of `nb` blocks of `ty` (`rb` bytes per row) into `dst`.
pub(super) fn pack_group(ty: GgmlType, src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    let bs = ty.type_size();
    for r in 0..PACK_ROWS {
        for b in 0..nb {
            let blk = &src[r * rb + b * bs..r * rb + (b + 1) * bs];
            let d = nb * LEVELS + b * 2 * PACK_ROWS + 2 * r;
            dst[d..d + 2].copy_from_slice(&blk[0..2]);
            let lv = levels(ty, blk);
            for i in 0..8 {
                // Elements 4i..4i + 4 are the four bytes of row r's lane in load i.
                let at = b * LEVELS + level_at(r, 4 * i);
                dst[at..at + 4].copy_from_slice(&lv[4 * i..4 * i + 4]);
            }
        }
    }
}

/// The 32 elements of a block of `ty` as the unsigned bytes `q + OFF`.
fn levels(ty: GgmlType, blk: &[u8]) -> [u8; 32] {
    let mut lv = [0u8; 32];
    match ty {
        GgmlType::Q8_0 => lv.iter_mut().zip(&blk[2..34]).for_each(|(l, &q)| *l = q ^ 0x80),
        _ => {
            // Q5_0: fp16 d, qh (bit e = high bit of element e), qs (low nibbles of 0..16, high of
            // 16..32). Eight elements at a time: their low nibbles are a mask (and a shift) of a
            // word of qs, their high bits a byte of qh spread over the word by [`SPREAD`].
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let w = |i: usize| u64::from_le_bytes(blk[6 + 8 * i..14 + 8 * i].try_into().unwrap());
            let (w0, w1, m) = (w(0), w(1), 0x0F0F_0F0F_0F0F_0F0Fu64);
            let low = [w0 & m, w1 & m, (w0 >> 4) & m, (w1 >> 4) & m];
            for (i, (l, low)) in lv.chunks_exact_mut(8).zip(low).enumerate() {
                let high = SPREAD[(qh >> (8 * i)) as usize & 0xFF];
                l.copy_from_slice(&(low | high).to_le_bytes());
            }
        }
    }
    lv
}

/// For each byte `b`, the word whose byte `k` is 16 if bit `k` of `b` is set, else 0: eight
/// Q5_0 high bits in place above their low nibbles.
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut k = 0;
        while k < 8 {
            t[b] |= (((b >> k) & 1) as u64) << (8 * k + 4);
            k += 1;
        }
        b += 1;
    }
    t
};

/// The byte of a block's levels holding element `e` of row `r`.
#[inline]
fn level_at(r: usize, e: usize) -> usize {
    64 * (e / 4) + 4 * r + e % 4
}

/// The sum of the 32 quants of the Q8_0 block at the start of `y`.
pub(super) fn block_sum(y: &[u8]) -> i32 {
    y[Q8_0_QS..Q8_0_QS + 32].iter().map(|&q| q as i8 as i32).sum()
}

/// The AVX-512 VNNI kernels, where this build has them.
#[cfg(target_arch = "x86_64")]
pub(super) const SIMD_Q8_0: Option<GroupFn> = Some(x86::group_vnni::<128>);
#[cfg(target_arch = "x86_64")]
pub(super) const SIMD_Q5_0: Option<GroupFn> = Some(x86::group_vnni::<16>);
#[cfg(not(target_arch = "x86_64"))]
pub(super) const SIMD_Q8_0: Option<GroupFn> = None;
#[cfg(not(target_arch = "x86_64"))]
pub(super) const SIMD_Q5_0: Option<GroupFn> = None;

/// The scalar reference: the arithmetic of the module docs, spelled out (`OFF` 128 for Q8_0, 16
/// for Q5_0). Computes the block sums itself (`a.sums` is not read).
///
/// # Safety
/// As [`GroupFn`] (Q8_0 activations).
pub(super) unsafe fn group_scalar<const OFF: i32>(
    nb: usize,
    w: *const u8,
    a: GroupActs,
    ny: usize,
    out: *mut f32,
    ostride: usize,
) {
    // SAFETY: forwarded from the caller.
    let (w, ys) = unsafe { super::scalar_views(nb, w, GROUP_BLOCK, &a, ny, Q8_0_BYTES) };
    for t in 0..ny {
        let mut acc = [0f32; PACK_ROWS];
        for b in 0..nb {
            let y = &ys[t * a.yb + b * Q8_0_BYTES..t * a.yb + (b + 1) * Q8_0_BYTES];
            let corr = OFF * block_sum(y);
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for e in 0..32 {
                    isum += w[b * LEVELS + level_at(r, e)] as i32 * y[Q8_0_QS + e] as i8 as i32;
                }
                let dd = f16_at(w, nb * LEVELS + b * 2 * PACK_ROWS + 2 * r) * f16_at(y, 0);
                *acc = dd.mul_add((isum - corr) as f32, *acc);
            }
        }
        // SAFETY: t < ny (see `GroupFn`).
        unsafe { super::store_scalar(out, t, ostride, &acc) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::x86::{bcast, prefetch_ahead};
    use super::{GroupActs, LEVELS, PACK_ROWS, Q8_0_BYTES, Q8_0_QS};
    use std::arch::x86_64::*;

    /// A [`super::GroupFn`] for AVX-512 VNNI (`OFF` 128 for Q8_0, 16 for Q5_0).
    ///
    /// # Safety
    /// As [`super::GroupFn`] (Q8_0 activations with their block sums), and the machine has
    /// AVX-512 VNNI.
    pub(super) unsafe fn group_vnni<const OFF: i32>(
        nb: usize,
        w: *const u8,
        a: GroupActs,
        ny: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        // SAFETY: forwarded from the caller, who checked that the machine has AVX-512 VNNI.
        unsafe { by_ny_pf!(ny, group[OFF](nb, w, a, out, ostride)) }
    }

    /// # Safety
    /// As [`group_vnni`] with `ny == NY`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // t indexes several arrays at once
    unsafe fn group<const OFF: i32, const PF: u8, const NY: usize>(
        nb: usize,
        w: *const u8,
        a: GroupActs,
        out: *mut f32,
        ostride: usize,
    ) {
        let mut acc = [_mm512_setzero_ps(); NY];
        // SAFETY: the factors follow the levels of all `nb` blocks (see the layout).
        let factors = unsafe { w.add(nb * LEVELS) };
        for b in 0..nb {
            // SAFETY: block `b` of the group and of each token row is in bounds (see `GroupFn`).
            unsafe {
                let wb = w.add(b * LEVELS);
                if NY == 1 {
                    prefetch_ahead::<PF>(wb, LEVELS);
                }
                let mut wv = [_mm512_setzero_si512(); 8];
                for (q, v) in wv.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(wb.add(64 * q) as *const __m512i);
                }
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(factors.add(b * 2 * PACK_ROWS) as *const __m256i));
                for t in 0..NY {
                    let y = a.ys.add(t * a.yb + b * Q8_0_BYTES);
                    let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for q in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[q], bcast(y.add(Q8_0_QS + 4 * q)));
                        s1 = _mm512_dpbusd_epi32(s1, wv[q + 1], bcast(y.add(Q8_0_QS + 4 * q + 4)));
                    }
                    let corr = _mm512_set1_epi32(OFF * *a.sums.add(t * nb + b));
                    let isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), corr);
                    let da = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128((y as *const u16).read_unaligned() as i32)));
                    acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(da)), _mm512_cvtepi32_ps(isum), acc[t]);
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
    use tandem_quant::row_size;

    #[test]
    fn the_layout_keeps_every_level_and_factor() {
        // level - OFF times d, read back by the layout, is ggml's dequantized value exactly.
        for (ty, off) in [(GgmlType::Q8_0, 128i32), (GgmlType::Q5_0, 16)] {
            let (rows, n) = (32, 128);
            let mut rng = Rng(5);
            let w = random_rows(ty, rows, n, &mut rng);
            let p = pack(ty, rows, n, &w).unwrap();
            let (rb, gb, nb) = (row_size(ty, n).unwrap(), group_bytes(ty, n), n / 32);
            for row in 0..rows {
                let mut want = vec![0f32; n];
                tandem_quant::dequantize_row(ty, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
                let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
                let grp = &p.bytes()[g * gb..(g + 1) * gb];
                for b in 0..nb {
                    let d = f16_at(grp, nb * LEVELS + b * 2 * PACK_ROWS + 2 * r);
                    for e in 0..32 {
                        let q = grp[b * LEVELS + level_at(r, e)] as i32 - off;
                        assert_eq!(q as f32 * d, want[b * 32 + e], "{ty} row {row} block {b} element {e}");
                    }
                }
            }
        }
    }
}
