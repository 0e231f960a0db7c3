//! Packed Q4_K and Q5_K against Q8_K activations (`HIGH`: the fifth bit of Q5_K's levels). Per
//! (row, token, block) the integer sums `isum = sum_j sc_j * sum_e q_e * a_e` and `imin = sum_j
//! m_j * bsum_j` are exact, then `v = isum * d - imin * dmin` (one fused multiply-add) and `acc = v
//! * yd + acc` (fused).
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] (Q4_K) or
//! [`GROUP_BLOCK_Q5K`] bytes: `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of lane `r` in
//! load `l` of group `j` holds element `8l + k` in its low nibble and `8l + 4 + k` in its high
//! one); for Q5_K then `qh[8 groups][16 rows][4 bytes]`, the fifth bits: bit `2l + n` of byte `k`
//! of lane `r` in group `j` is the fifth bit of the level in nibble `n` of that byte of load `l`
//! (one vector per group: shifted to bit 4 and merged into each nibble vector); then `sc[8][16]`
//! (the 6-bit scales, one byte each), `m[4][16][2]` (the 6-bit mins of groups `2k` and `2k + 1`
//! side by side for each row: one `vpmovzxbw` gives every row's pair, for one `vpdpwssd` per two
//! groups against the pair of their activation sums), then `d[16]` and `dmin[16]` (fp16).

use super::{f16_at, GroupCall, PACK_ROWS};
use tandem_quant::blocks::{BlockQ4K, BlockQ5K};
use tandem_quant::{get_scale_min_k4, QK_K};

pub(super) const SUBS: usize = QK_K / 32;
const QS: usize = 0;

/// Where the parts of a packed block lie, without (Q4_K) or with (Q5_K) the fifth bits.
pub(super) struct Layout {
    pub(super) qh: usize,
    pub(super) sc: usize,
    pub(super) mn: usize,
    pub(super) d: usize,
    pub(super) dmin: usize,
    pub(super) size: usize,
}

pub(super) const fn layout(high: bool) -> Layout {
    let qh = QS + QK_K / 2 * PACK_ROWS;
    let sc = qh + if high { QK_K / 8 * PACK_ROWS } else { 0 };
    let mn = sc + SUBS * PACK_ROWS;
    let d = mn + SUBS * PACK_ROWS;
    let dmin = d + 2 * PACK_ROWS;
    Layout { qh, sc, mn, d, dmin, size: dmin + 2 * PACK_ROWS }
}

/// Bytes of one Q4_K block of one group of 16 rows (2368, a whole number of cache lines).
pub(super) const GROUP_BLOCK: usize = layout(false).size;
/// Bytes of one Q5_K block of one group of 16 rows (2880, a whole number of cache lines).
pub(super) const GROUP_BLOCK_Q5K: usize = layout(true).size;
const _: () = assert!(GROUP_BLOCK == 2368 && GROUP_BLOCK_Q5K == 2880 && GROUP_BLOCK_Q5K.is_multiple_of(64));

const Q4K_BYTES: usize = std::mem::size_of::<BlockQ4K>();
const Q5K_BYTES: usize = std::mem::size_of::<BlockQ5K>();
const Q5K_QH: usize = std::mem::offset_of!(BlockQ5K, qh);
const Q5K_QS: usize = std::mem::offset_of!(BlockQ5K, qs);

/// One group: 16 rows of `nb` Q4_K (or, with `HIGH`, Q5_K) blocks (`rb` bytes each) into `dst`
/// (zeroed).
pub(super) fn pack_group<const HIGH: bool>(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
    let l = layout(HIGH);
    let (bs, qs_at_src) = if HIGH { (Q5K_BYTES, Q5K_QS) } else { (Q4K_BYTES, 16) };
    super::pack_blocks(src, rb, nb, dst, (bs, l.size), |out, r, blk| {
        out[l.d + 2 * r..l.d + 2 * r + 2].copy_from_slice(&blk[0..2]);
        out[l.dmin + 2 * r..l.dmin + 2 * r + 2].copy_from_slice(&blk[2..4]);
        let scales: &[u8; 12] = blk[4..16].try_into().expect("12 bytes");
        let qs = &blk[qs_at_src..bs];
        for j in 0..SUBS {
            let (sc, m) = get_scale_min_k4(j, scales);
            out[l.sc + PACK_ROWS * j + r] = sc;
            out[l.mn + mn_at(j, r)] = m;
            for ld in 0..4 {
                // Elements 8ld..8ld + 8 of the group, one nibble per byte: the four bytes of
                // the load take the first four in their low nibbles, the next four in the high.
                let at = 32 * (j / 2) + 8 * ld;
                let x = u64::from_le_bytes(qs[at..at + 8].try_into().expect("8 bytes"));
                let n = (x >> (4 * (j % 2))) & 0x0F0F_0F0F_0F0F_0F0F;
                let word = n as u32 | ((n >> 32) as u32) << 4;
                let to = qs_at(j, r, 8 * ld);
                out[to..to + 4].copy_from_slice(&word.to_le_bytes());
            }
            if HIGH {
                for e in 0..32 {
                    if (blk[Q5K_QH + e] >> j) & 1 == 1 {
                        let (byte, bit) = qh_at(j, r, e);
                        out[l.qh + byte] |= 1 << bit;
                    }
                }
            }
        }
    });
}

/// The byte of a packed block holding element `e` of group `j` of row `r` (nibble `(e % 8) / 4`).
#[inline]
fn qs_at(j: usize, r: usize, e: usize) -> usize {
    QS + 256 * j + 64 * (e / 8) + 4 * r + e % 4
}

/// The byte (from the start of `m`) holding the min of group `j` of row `r`.
#[inline]
fn mn_at(j: usize, r: usize) -> usize {
    2 * PACK_ROWS * (j / 2) + 2 * r + j % 2
}

/// The byte (from the start of `qh`) and bit holding the fifth bit of element `e` of group `j` of
/// row `r`: the byte of [`qs_at`]'s within its load, bit `2 * load + nibble`.
#[inline]
fn qh_at(j: usize, r: usize, e: usize) -> (usize, usize) {
    (64 * j + 4 * r + e % 4, 2 * (e / 8) + (e % 8) / 4)
}

/// Level `e` (0..32) of group `j` of row `r` in a packed block.
#[inline]
fn level<const HIGH: bool>(blk: &[u8], j: usize, r: usize, e: usize) -> i32 {
    let q = (blk[qs_at(j, r, e)] >> (4 * ((e % 8) / 4))) & 0x0F;
    let h = if HIGH {
        let (byte, bit) = qh_at(j, r, e);
        (blk[layout(true).qh + byte] >> bit) & 1
    } else {
        0
    };
    (q | h << 4) as i32
}

/// The scalar reference: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`].
pub(super) unsafe fn group_scalar<const HIGH: bool>(c: GroupCall) {
    let l = layout(HIGH);
    // SAFETY: forwarded from the caller.
    unsafe {
        super::q8k_scalar(c, l.size, |blk, y, r| {
            let (mut isum, mut imin) = (0i32, 0i32);
            for j in 0..SUBS {
                let s: i32 = (0..32).map(|e| level::<HIGH>(blk, j, r, e) * y.q(32 * j + e)).sum();
                isum += blk[l.sc + PACK_ROWS * j + r] as i32 * s;
                imin += blk[l.mn + mn_at(j, r)] as i32 * (y.bsum(2 * j) + y.bsum(2 * j + 1));
            }
            let (d, dmin) = (f16_at(blk, l.d + 2 * r), f16_at(blk, l.dmin + 2 * r));
            (-(imin as f32)).mul_add(dmin, isum as f32 * d)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::each_packed_block;
    use super::*;
    use tandem_quant::GgmlType;

    #[test]
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        fn check<const HIGH: bool>(ty: GgmlType) {
            let l = layout(HIGH);
            each_packed_block(ty, 7, l.size, |r, blk, want, at| {
                for j in 0..SUBS {
                    let d = f16_at(blk, l.d + 2 * r) * blk[l.sc + 16 * j + r] as f32;
                    let m = f16_at(blk, l.dmin + 2 * r) * blk[l.mn + mn_at(j, r)] as f32;
                    for e in 0..32 {
                        let got = d * level::<HIGH>(blk, j, r, e) as f32 - m;
                        assert_eq!(got, want[32 * j + e], "{at} group {j} element {e}");
                    }
                }
            });
        }
        check::<false>(GgmlType::Q4_K);
        check::<true>(GgmlType::Q5_K);
    }
}
