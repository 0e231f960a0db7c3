//! `--repack`: weights rearranged once at load so that one zmm register holds the same four
//! elements of 16 rows. A product then broadcasts four activation bytes to all 16 lanes and
//! `vpdpbusd` accumulates 16 rows at once: no per-row horizontal sums, no scale shuffles, each
//! weight vector serves up to [`crate::MAX_NY`] tokens, and 16 results are stored at once.
//! (ik_llama.cpp's `_R4`/`_R8` layouts do the same for its own kernels.)
//!
//! Each type fixes its arithmetic per (row, token, block), independent of how rows map to lanes:
//! exact integer sums, then the same float steps block after block (`q4k.rs`, `q6k.rs`,
//! `b32.rs`). So the scalar reference, the SIMD kernel, one token or a batch and any number of
//! threads give the same bits. It is not the arithmetic of the row-major kernels (those keep 16 or 8 lanes of partial
//! sums and add them at the end), so packed products differ from unpacked ones by rounding.
//!
//! Types: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (`q2k.rs`, `q3k.rs`, `q4k.rs`, `q6k.rs`,
//! `iq4xs.rs`, against Q8_K activations), Q8_0 and Q5_0 (`b32.rs`), Q4_0 and IQ4_NL (`q40.rs`,
//! against Q8_0), Q4_1 (`q40.rs`) and Q5_1 (`b32.rs`), against Q8_1.
//!
//! Files by concern, then by architecture: each family's file holds its layout, packing and scalar
//! reference; its SIMD kernels live in `x86/` under the same name (`x86/mod.rs`: the helpers they
//! share and the table [`group_kernel`] picks from). Another architecture adds its own directory
//! and one `simd_kernels` line here, and touches no family file.

mod b32;
mod iq4xs;
mod q2k;
mod q3k;
mod q40;
mod q4k;
mod q6k;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(target_arch = "x86_64")]
use x86::simd_kernels;

/// No SIMD group kernels on this architecture: only the scalar references run.
#[cfg(not(target_arch = "x86_64"))]
fn simd_kernels(_ty: GgmlType) -> [Option<(crate::Isa, GroupFn)>; 3] {
    [None; 3]
}

use crate::{Error, Result, WeightRef};
use rayon::prelude::*;
use tandem_quant::{row_size, GgmlType};

/// Rows per packed group.
pub const PACK_ROWS: usize = 16;

/// The packing loop of the k-quant and IQ4_XS layouts: `f(out, r, blk)` for each of the `nb`
/// blocks of a group and each of its rows, `out` the group's packed block (`out_bytes`, zeroed),
/// `blk` row `r`'s block (`in_bytes`; rows `rb` bytes apart in `src`).
fn pack_blocks(
    src: &[u8],
    rb: usize,
    nb: usize,
    dst: &mut [u8],
    (in_bytes, out_bytes): (usize, usize),
    mut f: impl FnMut(&mut [u8], usize, &[u8]),
) {
    for b in 0..nb {
        let out = &mut dst[b * out_bytes..(b + 1) * out_bytes];
        for r in 0..PACK_ROWS {
            f(out, r, &src[r * rb + b * in_bytes..r * rb + (b + 1) * in_bytes]);
        }
    }
}

/// A weight tensor in the packed layout, in anonymous memory (page-aligned, advised for
/// transparent huge pages: decode streams it once per token).
pub struct Packed {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    mem: memmap2::Mmap,
}

impl std::fmt::Debug for Packed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Packed({} {} x {})", self.ty, self.rows, self.cols)
    }
}

impl Packed {
    pub fn bytes(&self) -> &[u8] {
        &self.mem
    }

    /// The tensor as a matrix for [`crate::matmul`] and [`crate::matmul_jobs`].
    pub fn weight_ref(&self) -> WeightRef<'_> {
        WeightRef { ty: self.ty, rows: self.rows, cols: self.cols, data: self.bytes(), packed: true }
    }
}

/// The types with a packed layout.
pub const PACKED_TYPES: [GgmlType; 12] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::Q4_1,
];

/// Whether a `rows x cols` tensor of `ty` has a packed layout: one of [`PACKED_TYPES`], whole
/// groups of 16 rows.
pub fn packable(ty: GgmlType, rows: usize, cols: usize) -> bool {
    PACKED_TYPES.contains(&ty)
        && rows > 0
        && rows.is_multiple_of(PACK_ROWS)
        && cols > 0
        && cols.is_multiple_of(ty.block_size())
}

/// Whether packing pays on this machine for some type (see [`packing_pays_for`]): every type has
/// an AVX-512 VNNI kernel and an AVX2 one.
pub fn packing_pays() -> bool {
    !paying_types().is_empty()
}

/// The types packing pays for on this machine.
pub fn paying_types() -> Vec<GgmlType> {
    PACKED_TYPES.into_iter().filter(|&ty| packing_pays_for(ty)).collect()
}

/// Bytes of the packed layout of a `rows x cols` tensor of `ty` (0 where it has none).
pub fn packed_size(ty: GgmlType, rows: usize, cols: usize) -> usize {
    if !packable(ty, rows, cols) {
        return 0;
    }
    rows / PACK_ROWS * group_bytes(ty, cols)
}

/// Bytes of one packed group of 16 rows of `cols` elements of `ty`.
pub(crate) fn group_bytes(ty: GgmlType, cols: usize) -> usize {
    let nb = cols / ty.block_size().max(1);
    match ty {
        GgmlType::Q4_K => nb * q4k::GROUP_BLOCK,
        GgmlType::Q5_K => nb * q4k::GROUP_BLOCK_Q5K,
        GgmlType::Q6_K => nb * q6k::GROUP_BLOCK,
        GgmlType::IQ4_XS => nb * iq4xs::GROUP_BLOCK,
        GgmlType::Q2_K => nb * q2k::GROUP_BLOCK,
        GgmlType::Q3_K => nb * q3k::GROUP_BLOCK,
        GgmlType::Q4_0 | GgmlType::IQ4_NL => nb * q40::GROUP_BLOCK,
        GgmlType::Q4_1 => nb * q40::GROUP_BLOCK_Q4_1,
        GgmlType::Q5_1 => nb * b32::GROUP_BLOCK_Q5_1,
        _ => nb * b32::GROUP_BLOCK,
    }
}

/// Rearranges a row-major `rows x cols` tensor of `ty` (ggml blocks) into the packed layout, groups
/// in parallel on the current rayon pool.
pub fn pack(ty: GgmlType, rows: usize, cols: usize, data: &[u8]) -> Result<Packed> {
    if !packable(ty, rows, cols) {
        return Err(Error::Shape(format!("no packed layout for a {rows} x {cols} {ty} tensor")));
    }
    let rb = row_size(ty, cols)?;
    if rb.checked_mul(rows) != Some(data.len()) {
        return Err(Error::Shape(format!(
            "{ty} weight of {rows} x {cols} needs {} bytes, got {}",
            rb * rows,
            data.len()
        )));
    }
    let gb = group_bytes(ty, cols);
    let alloc = |e: std::io::Error| {
        Error::Memory(format!("{rows} x {cols} {ty}: cannot allocate {} bytes to repack: {e}", rows / PACK_ROWS * gb))
    };
    let mut mem = memmap2::MmapOptions::new().len(rows / PACK_ROWS * gb).map_anon().map_err(alloc)?;
    #[cfg(target_os = "linux")]
    // Best effort: without transparent huge pages the memory is ordinary pages.
    let _ = mem.advise(memmap2::Advice::HugePage);
    let nb = cols / ty.block_size();
    mem.par_chunks_mut(gb).zip(data.par_chunks(rb * PACK_ROWS)).for_each(|(dst, src)| match ty {
        GgmlType::Q4_K => q4k::pack_group::<false>(src, rb, nb, dst),
        GgmlType::Q5_K => q4k::pack_group::<true>(src, rb, nb, dst),
        GgmlType::Q6_K => q6k::pack_group(src, rb, nb, dst),
        GgmlType::IQ4_XS => iq4xs::pack_group(src, rb, nb, dst),
        GgmlType::Q2_K => q2k::pack_group(src, rb, nb, dst),
        GgmlType::Q3_K => q3k::pack_group(src, rb, nb, dst),
        GgmlType::Q4_0 | GgmlType::IQ4_NL => q40::pack_group::<false>(src, rb, nb, dst),
        GgmlType::Q4_1 => q40::pack_group::<true>(src, rb, nb, dst),
        _ => b32::pack_group(ty, src, rb, nb, dst),
    });
    Ok(Packed { ty, rows, cols, mem: mem.make_read_only().map_err(alloc)? })
}

/// The activations a group kernel reads: token rows (of the weight type's `vec_dot_type`) `yb`
/// bytes apart, and for the Q8_0-family types the sum of each block's quants (`nb` per token).
#[derive(Clone, Copy)]
pub(crate) struct GroupActs {
    pub ys: *const u8,
    pub yb: usize,
    /// `[token][block]`, or null where the type does not use it.
    pub sums: *const i32,
}

/// `out[t * ostride + r] = dot(row r of the group, token t)` for the 16 rows of one packed group
/// (`nb` blocks at `w`) and `ny` activation rows.
///
/// # Safety
/// `w` holds a whole group of `nb` blocks, `a` `ny` rows of `nb` blocks (and their sums where the
/// type uses them), `out` `ny` rows of 16 writable floats `ostride` apart; `1 <= ny <= MAX_NY`;
/// the machine runs the kernel's instructions.
pub(crate) type GroupFn = unsafe fn(GroupCall);

/// One [`GroupFn`] call: `nb` blocks of one packed group at `w`, `ny` activation rows `a`, and the
/// outputs, `ny` rows of 16 floats `ostride` apart from `out`.
#[derive(Clone, Copy)]
pub(crate) struct GroupCall {
    pub nb: usize,
    pub w: *const u8,
    pub a: GroupActs,
    pub ny: usize,
    pub out: *mut f32,
    pub ostride: usize,
}

/// A scalar kernel's view of its inputs: the `nb` blocks of one group (`group_block` bytes each) and
/// the `ny` activation rows (`act_block` bytes per block).
///
/// # Safety
/// As [`GroupFn`].
unsafe fn scalar_views<'a>(c: &GroupCall, group_block: usize, act_block: usize) -> (&'a [u8], &'a [u8]) {
    // SAFETY: the caller guarantees the extents (see `GroupFn`).
    unsafe {
        (
            std::slice::from_raw_parts(c.w, c.nb * group_block),
            std::slice::from_raw_parts(c.a.ys, (c.ny - 1) * c.a.yb + c.nb * act_block),
        )
    }
}

/// The loop the scalar kernels of the 32-element types share, against Q8_0 (or with `min`, Q8_1)
/// activations of `sizes` (group block, activation block, offset of the quants): `level(w, b, r,
/// e)` is row `r`'s level of element `e` of block `b`; the factors follow the `levels` bytes of
/// every block's levels (then, with `min`, the minimums). Per row and block, `acc = (dw * da) *
/// (isum - off * the block's quant sum) + acc`, or with `min`, `isum` alone, then `acc = mw * s +
/// acc` (Q8_1's `s`), fused, in block order.
///
/// # Safety
/// As [`GroupFn`].
unsafe fn q8_scalar(
    c: GroupCall,
    (gb, ab, qs): (usize, usize, usize),
    levels: usize,
    min: bool,
    off: i32,
    level: impl Fn(&[u8], usize, usize, usize) -> i32,
) {
    let GroupCall { nb, a, ny, out, ostride, .. } = c;
    // SAFETY: forwarded from the caller.
    let (w, ys) = unsafe { scalar_views(&c, gb, ab) };
    for t in 0..ny {
        let mut acc = [0f32; PACK_ROWS];
        for b in 0..nb {
            let y = &ys[t * a.yb + b * ab..t * a.yb + (b + 1) * ab];
            // Q8_1 blocks have no offset (`block_sum` would not find their quants).
            let corr = if min { 0 } else { off * b32::block_sum(y) };
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut isum = 0i32;
                for e in 0..32 {
                    isum += level(w, b, r, e) * y[qs + e] as i8 as i32;
                }
                let dat = nb * levels + b * 2 * PACK_ROWS + 2 * r;
                let dd = f16_at(w, dat) * f16_at(y, 0);
                *acc = dd.mul_add((isum - corr) as f32, *acc);
                if min {
                    *acc = f16_at(w, dat + nb * 2 * PACK_ROWS).mul_add(f16_at(y, b32::Q8_1_S), *acc);
                }
            }
        }
        // SAFETY: t < ny (see `GroupFn`).
        unsafe { store_scalar(out, t, ostride, &acc) };
    }
}

/// ggml block_q8_K (the activations of the k-quant and IQ4_XS kernels): f32 d, i8 qs[256],
/// i16 bsums[16].
pub(super) const Q8K_BYTES: usize = std::mem::size_of::<tandem_quant::blocks::BlockQ8K>();
pub(super) const Q8K_QS: usize = std::mem::offset_of!(tandem_quant::blocks::BlockQ8K, qs);
pub(super) const Q8K_BSUMS: usize = std::mem::offset_of!(tandem_quant::blocks::BlockQ8K, bsums);

/// One Q8_K activation block, as the scalar kernels read it.
pub(super) struct Q8k<'a>(&'a [u8]);

impl Q8k<'_> {
    /// Quant `i` (0..256).
    pub(super) fn q(&self, i: usize) -> i32 {
        self.0[Q8K_QS + i] as i8 as i32
    }

    /// The sum of the quants of group `g` of 16.
    pub(super) fn bsum(&self, g: usize) -> i32 {
        i16::from_le_bytes([self.0[Q8K_BSUMS + 2 * g], self.0[Q8K_BSUMS + 2 * g + 1]]) as i32
    }
}

/// The loop every scalar kernel against Q8_K activations shares: `value(blk, y, r)` is row `r`'s
/// value of one packed block (`group_block` bytes) against one activation block, before the
/// activation factor `yd`; the blocks accumulate as `acc = value * yd + acc`, in order.
///
/// # Safety
/// As [`GroupFn`] (Q8_K activations).
unsafe fn q8k_scalar(c: GroupCall, group_block: usize, value: impl Fn(&[u8], &Q8k, usize) -> f32) {
    let GroupCall { nb, a, ny, out, ostride, .. } = c;
    // SAFETY: forwarded from the caller.
    let (w, ys) = unsafe { scalar_views(&c, group_block, Q8K_BYTES) };
    for t in 0..ny {
        let mut acc = [0f32; PACK_ROWS];
        for b in 0..nb {
            let blk = &w[b * group_block..(b + 1) * group_block];
            let y = Q8k(&ys[t * a.yb + b * Q8K_BYTES..t * a.yb + (b + 1) * Q8K_BYTES]);
            let yd = f32::from_le_bytes(y.0[0..4].try_into().expect("4 bytes"));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = value(blk, &y, r).mul_add(yd, *acc);
            }
        }
        // SAFETY: t < ny (see `GroupFn`).
        unsafe { store_scalar(out, t, ostride, &acc) };
    }
}

/// The fp16 at byte `at` of `p`, as f32.
fn f16_at(p: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([p[at], p[at + 1]])).to_f32()
}

/// Token `t`'s 16 results of a scalar kernel into `out`.
///
/// # Safety
/// As [`GroupFn`], for a token `t < ny`.
unsafe fn store_scalar(out: *mut f32, t: usize, ostride: usize, acc: &[f32; PACK_ROWS]) {
    // SAFETY: the caller guarantees 16 writable floats per token row.
    unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(t * ostride), PACK_ROWS) };
}

/// The best group kernel for `ty` this machine runs (within `TANDEM_CPU_ISA`): AVX-512 VNNI, else
/// AVX-VNNI, else AVX2, else the scalar reference.
pub(crate) fn group_kernel(ty: GgmlType) -> Option<GroupFn> {
    PACKED_TYPES.contains(&ty).then(|| simd_kernel(ty).unwrap_or(scalar_kernel(ty)))
}

/// The SIMD group kernel of `ty` this machine runs (within `TANDEM_CPU_ISA`), if any.
fn simd_kernel(ty: GgmlType) -> Option<GroupFn> {
    best_of(simd_kernels(ty), crate::Isa::detected())
}

/// The first of `kernels` (best first) whose level is at most `isa` and runs here: AVX-VNNI is
/// no part of the AVX-512 levels (Zen 4 has AVX-512 VNNI without it), so it is asked for.
fn best_of(kernels: [Option<(crate::Isa, GroupFn)>; 3], isa: crate::Isa) -> Option<GroupFn> {
    kernels.into_iter().flatten().find(|(level, _)| *level <= isa && level.supported()).map(|(_, k)| k)
}

/// Whether packing `ty` pays on this machine: a SIMD group kernel of it runs here (within
/// `TANDEM_CPU_ISA`); elsewhere only the scalar reference would.
pub fn packing_pays_for(ty: GgmlType) -> bool {
    PACKED_TYPES.contains(&ty) && simd_kernel(ty).is_some()
}

/// The scalar reference group kernel of `ty` (one of [`PACKED_TYPES`]).
fn scalar_kernel(ty: GgmlType) -> GroupFn {
    match ty {
        GgmlType::Q2_K => q2k::group_scalar,
        GgmlType::Q3_K => q3k::group_scalar,
        GgmlType::Q4_K => q4k::group_scalar::<false>,
        GgmlType::Q5_K => q4k::group_scalar::<true>,
        GgmlType::Q6_K => q6k::group_scalar,
        GgmlType::IQ4_XS => iq4xs::group_scalar,
        GgmlType::Q4_0 => q40::group_scalar::<false, false>,
        GgmlType::IQ4_NL => q40::group_scalar::<true, false>,
        GgmlType::Q4_1 => q40::group_scalar::<false, true>,
        GgmlType::Q8_0 => b32::group_scalar::<128>,
        GgmlType::Q5_1 => b32::group_scalar::<{ b32::Q5_1_OFF }>,
        _ => b32::group_scalar::<16>,
    }
}

/// The sums a group kernel of `ty` needs besides the activations: each Q8_0 block's quant sum
/// (`[token][block]`); empty for the k-quants (their Q8_K blocks carry `bsums`) and Q5_1 (its
/// Q8_1 blocks carry `s`).
pub(crate) fn act_sums(ty: GgmlType, ys: &[u8], yb: usize, nb: usize) -> Vec<i32> {
    if tandem_quant::vec_dot_type(ty) != GgmlType::Q8_0 || yb == 0 {
        return Vec::new();
    }
    ys.chunks_exact(yb).flat_map(|row| (0..nb).map(move |b| b32::block_sum(&row[b * b32::Q8_0_BYTES..]))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_NY;

    /// Each copy of the Q6_K AVX-512 VNNI kernel, with whether this machine runs it.
    #[cfg(target_arch = "x86_64")]
    fn q6k_variants() -> [(&'static str, GroupFn, bool); 2] {
        x86::q6k_variants()
    }
    #[cfg(not(target_arch = "x86_64"))]
    fn q6k_variants() -> [(&'static str, GroupFn, bool); 0] {
        []
    }

    pub(super) use crate::testing::Rng;

    /// Random rows of `ty`: every bit pattern of levels and scales, fp16 factors in [2^-10, 2^-9)
    /// (where each type keeps them).
    pub(super) fn random_rows(ty: GgmlType, rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
        let mut w: Vec<u8> = (0..rows * row_size(ty, n).unwrap()).map(|_| rng.next_u64() as u8).collect();
        let factors = factor_offsets(ty);
        for b in w.chunks_exact_mut(ty.type_size()) {
            for &o in factors {
                let bits = 0x1400u16 | (rng.next_u64() as u16 & 0x03FF) | (rng.next_u64() as u16 & 0x8000);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    /// Packs 32 random rows of `n` elements of `ty` and calls `check(r, grp, want, at)` for every
    /// row: `r` the row's lane in its group, `grp` the packed group, `want` ggml's dequantized row,
    /// `at` which row, for messages.
    pub(super) fn each_packed_row(ty: GgmlType, seed: u64, n: usize, check: impl Fn(usize, &[u8], &[f32], &str)) {
        let rows = 32;
        let w = random_rows(ty, rows, n, &mut Rng(seed));
        let p = pack(ty, rows, n, &w).unwrap();
        let (rb, gb) = (row_size(ty, n).unwrap(), group_bytes(ty, n));
        for row in 0..rows {
            let mut want = vec![0f32; n];
            tandem_quant::dequantize_row(ty, &w[row * rb..(row + 1) * rb], &mut want).unwrap();
            let (g, r) = (row / PACK_ROWS, row % PACK_ROWS);
            check(r, &p.bytes()[g * gb..(g + 1) * gb], &want, &format!("{ty} row {row}"));
        }
    }

    /// [`each_packed_row`] over rows of 512 elements of the k-quant `ty` (packed blocks of `block`
    /// bytes), block by block: `check(r, blk, want, at)` with `blk` the packed block and `want`
    /// the row's 256 dequantized values of it.
    pub(super) fn each_packed_block(ty: GgmlType, seed: u64, block: usize, check: impl Fn(usize, &[u8], &[f32], &str)) {
        let qk = tandem_quant::QK_K;
        each_packed_row(ty, seed, 2 * qk, |r, grp, want, at| {
            assert_eq!(grp.len(), 2 * block, "{at}");
            for (b, (blk, want)) in grp.chunks_exact(block).zip(want.chunks_exact(qk)).enumerate() {
                check(r, blk, want, &format!("{at} block {b}"));
            }
        });
    }

    /// Where the blocks of `ty` keep their fp16 factors.
    fn factor_offsets(ty: GgmlType) -> &'static [usize] {
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q5_1 | GgmlType::Q4_1 => &[0, 2],
            GgmlType::Q6_K => &[208],
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            _ => &[0],
        }
    }

    fn acts(ty: GgmlType, n: usize, ny: usize, rng: &mut Rng) -> Vec<u8> {
        let x: Vec<f32> = (0..n * ny).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0).collect();
        crate::quantize_activations(ty, &x, n).unwrap().data
    }

    /// Runs a group kernel on one packed group.
    #[allow(clippy::too_many_arguments)] // the kernel's own arguments, spelled out
    fn run(k: GroupFn, ty: GgmlType, p: &[u8], n: usize, ys: &[u8], ny: usize, out: &mut [f32], ostride: usize) {
        let nb = n / ty.block_size();
        let yb = ys.len() / ny;
        let sums = act_sums(ty, ys, yb, nb);
        let a = GroupActs { ys: ys.as_ptr(), yb, sums: if sums.is_empty() { std::ptr::null() } else { sums.as_ptr() } };
        assert!(out.len() >= (ny - 1) * ostride + PACK_ROWS && p.len() == group_bytes(ty, n));
        // SAFETY: one whole group, ny activation rows with their sums, outputs checked above.
        unsafe { k(GroupCall { nb, w: p.as_ptr(), a, ny, out: out.as_mut_ptr(), ostride }) };
    }

    #[test]
    fn the_scalar_group_kernels_match_ggml_vec_dot() {
        let mut rng = Rng(11);
        for ty in PACKED_TYPES {
            let (n, ny) = (1024, 3);
            let w = random_rows(ty, PACK_ROWS, n, &mut rng);
            let ys = acts(ty, n, ny, &mut rng);
            let p = pack(ty, PACK_ROWS, n, &w).unwrap();
            let (rb, yb) = (row_size(ty, n).unwrap(), ys.len() / ny);
            let mut out = vec![0f32; ny * PACK_ROWS];
            run(scalar_kernel(ty), ty, p.bytes(), n, &ys, ny, &mut out, PACK_ROWS);
            for t in 0..ny {
                for r in 0..PACK_ROWS {
                    let want =
                        tandem_quant::vec_dot(ty, n, &w[r * rb..(r + 1) * rb], &ys[t * yb..(t + 1) * yb]).unwrap();
                    let got = out[t * PACK_ROWS + r];
                    assert!(
                        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                        "{ty} token {t} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_simd_group_kernels_equal_the_scalar_ones_bit_for_bit() {
        let mut rng = Rng(13);
        for ty in PACKED_TYPES {
            let mut levels: Vec<_> = simd_kernels(ty).into_iter().flatten().map(|(i, k)| (i, "", k, true)).collect();
            if ty == GgmlType::Q6_K {
                // Each copy of the kernel, not only the one this machine picks.
                levels.extend(q6k_variants().map(|(name, k, runs)| (crate::Isa::Avx512Vnni, name, k, runs)));
            }
            for (isa, variant, k, runs) in levels {
                if !isa.supported() || !runs {
                    println!(
                        "SKIPPED {isa} {variant} packed {ty} kernel: this machine (or TANDEM_CPU_ISA) does not run it"
                    );
                    continue;
                }
                for n in [256, 2048] {
                    let w = random_rows(ty, PACK_ROWS, n, &mut rng);
                    let p = pack(ty, PACK_ROWS, n, &w).unwrap();
                    for ny in 1..=MAX_NY {
                        let mut ys = acts(ty, n, ny, &mut rng);
                        // An extreme activation too (-128 is never produced by the quantizers, but legal).
                        ys[if ty.block_size() == 256 { 4 } else { 2 }] = 0x80;
                        let (mut a, mut b) = (vec![0f32; ny * 20], vec![0f32; ny * 20]);
                        run(scalar_kernel(ty), ty, p.bytes(), n, &ys, ny, &mut a, 20);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        // A single token runs the kernel compiled for the processor's prefetch
                        // hint: every one of them.
                        let hints: &[u8] = if ny == 1 { &[0, 1, 2, 3] } else { &[0] };
                        for &h in hints {
                            let hint = crate::prefetch::set_hint(h);
                            run(k, ty, p.bytes(), n, &ys, ny, &mut b, 20);
                            drop(hint);
                            assert_eq!(
                                bits(&a),
                                bits(&b),
                                "{ty} {isa} {variant} n {n}, {ny} tokens, prefetch hint {h}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_simd_group_kernels_are_exact_at_the_extremes() {
        // Every level and scale at its largest (all bits set) against activations all at -128:
        // the largest partial sums the kernels keep in narrow lanes.
        let mut rng = Rng(17);
        for ty in PACKED_TYPES {
            let levels = simd_kernels(ty);
            let n = 512;
            let mut w = random_rows(ty, PACK_ROWS, n, &mut rng);
            let factors = factor_offsets(ty);
            for b in w.chunks_exact_mut(ty.type_size()) {
                for (i, byte) in b.iter_mut().enumerate() {
                    if !factors.iter().any(|&o| (o..o + 2).contains(&i)) {
                        *byte = 0xFF;
                    }
                }
            }
            let p = pack(ty, PACK_ROWS, n, &w).unwrap();
            for q in [-128i8, 127] {
                let ny = 2;
                let mut ys = crate::quantize_activations(ty, &vec![1.0; n * ny], n).unwrap().data;
                if ty.block_size() == 256 {
                    for b in ys.chunks_exact_mut(Q8K_BYTES) {
                        b[Q8K_QS..Q8K_QS + 256].fill(q as u8);
                        for g in 0..16 {
                            b[Q8K_BSUMS + 2 * g..Q8K_BSUMS + 2 * g + 2].copy_from_slice(&(16 * q as i16).to_le_bytes());
                        }
                    }
                } else if ty == GgmlType::Q5_1 || ty == GgmlType::Q4_1 {
                    // Q8_1: d, s = d * sum(qs), qs.
                    for b in ys.chunks_exact_mut(b32::Q8_1_BYTES) {
                        b[4..].fill(q as u8);
                        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                        b[2..4].copy_from_slice(&half::f16::from_f32(d * 32.0 * q as f32).to_le_bytes());
                    }
                } else {
                    for b in ys.chunks_exact_mut(b32::Q8_0_BYTES) {
                        b[2..].fill(q as u8);
                    }
                }
                let mut want = vec![0f32; ny * PACK_ROWS];
                run(scalar_kernel(ty), ty, p.bytes(), n, &ys, ny, &mut want, PACK_ROWS);
                let (rb, yb) = (row_size(ty, n).unwrap(), ys.len() / ny);
                for r in 0..PACK_ROWS {
                    let dot = tandem_quant::vec_dot(ty, n, &w[r * rb..(r + 1) * rb], &ys[..yb]).unwrap();
                    assert!((want[r] - dot).abs() <= 1e-5 * dot.abs().max(1.0), "{ty} row {r}: {} vs {dot}", want[r]);
                }
                for (isa, k) in levels.into_iter().flatten() {
                    if !isa.supported() {
                        println!("SKIPPED {isa} packed {ty} kernel at the extremes: this machine does not run it");
                        continue;
                    }
                    let mut got = vec![0f32; ny * PACK_ROWS];
                    run(k, ty, p.bytes(), n, &ys, ny, &mut got, PACK_ROWS);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{ty} {isa} activations {q}");
                }
            }
        }
    }

    #[test]
    fn the_kernel_follows_the_instruction_set() {
        let isa = crate::Isa::detected();
        for ty in PACKED_TYPES {
            let kernels = simd_kernels(ty);
            let runs = |level: crate::Isa| level <= isa && level.supported();
            let want = kernels.into_iter().flatten().find(|(level, _)| runs(*level)).map(|(_, k)| k);
            // Each level's kernel where it runs, even under another, better one's cap.
            for (level, k) in kernels.into_iter().flatten().filter(|(level, _)| level.supported()) {
                assert_eq!(best_of(kernels, level).map(|k| k as usize), Some(k as usize), "{ty} capped at {level}");
            }
            let got = group_kernel(ty).unwrap();
            assert_eq!(got as usize, want.unwrap_or(scalar_kernel(ty)) as usize, "{ty} at {isa}");
            assert_eq!(packing_pays_for(ty), want.is_some(), "{ty} at {isa}");
        }
        assert!(group_kernel(GgmlType::IQ2_XS).is_none() && !packing_pays_for(GgmlType::IQ2_XS));
    }

    #[test]
    fn a_packed_matrix_is_cut_only_between_groups() {
        let mut rng = Rng(19);
        for ty in PACKED_TYPES {
            let (rows, n) = (48, 256);
            let w = random_rows(ty, rows, n, &mut rng);
            let p = pack(ty, rows, n, &w).unwrap();
            let m = p.weight_ref();
            let e = m.rows(8, 16).unwrap_err().to_string();
            assert!(e.contains("rows 8..24 of a weight packed in groups of 16 rows"), "{e}");
            assert!(m.rows(16, 20).is_err());
            // Rows 16..48 alone give the same bits as those columns of the whole product.
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
            let x: Vec<f32> = (0..3 * n).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0).collect();
            let (mut all, mut part) = (vec![0f32; 3 * rows], vec![0f32; 3 * 32]);
            crate::matmul(&pool, &m, &x, &mut all).unwrap();
            crate::matmul(&pool, &m.rows(16, 32).unwrap(), &x, &mut part).unwrap();
            for t in 0..3 {
                assert_eq!(&all[t * rows + 16..t * rows + 48], &part[t * 32..(t + 1) * 32], "{ty} token {t}");
            }
        }
    }

    #[test]
    fn a_long_prompt_gives_the_bits_of_its_token_groups_alone() {
        // 1000 tokens of 256 columns pass over the rows in more than one chunk of activations.
        let mut rng = Rng(23);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for ty in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let (rows, n, tokens) = (32, 256, 1000);
            let w = random_rows(ty, rows, n, &mut rng);
            let p = pack(ty, rows, n, &w).unwrap();
            let x: Vec<f32> = (0..tokens * n).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0).collect();
            let mut all = vec![0f32; tokens * rows];
            crate::matmul(&pool, &p.weight_ref(), &x, &mut all).unwrap();
            for (t0, want) in all.chunks(crate::MAX_NY * rows).enumerate() {
                let xs = &x[t0 * crate::MAX_NY * n..][..want.len() / rows * n];
                let mut got = vec![0f32; want.len()];
                crate::matmul(&pool, &p.weight_ref(), xs, &mut got).unwrap();
                assert_eq!(got, want, "{ty} tokens from {}", t0 * crate::MAX_NY);
            }
        }
    }

    #[test]
    fn shapes_without_a_packed_layout_are_refused() {
        let e = pack(GgmlType::Q4_K, 8, 256, &[0u8; 8 * 144]).unwrap_err().to_string();
        assert!(e.contains("no packed layout for a 8 x 256 q4_K tensor"), "{e}");
        let e = pack(GgmlType::IQ2_XS, 16, 256, &[0u8; 16 * 74]).unwrap_err().to_string();
        assert!(e.contains("no packed layout"), "{e}");
        let e = pack(GgmlType::Q8_0, 16, 48, &[0u8; 16 * 34]).unwrap_err().to_string();
        assert!(e.contains("no packed layout for a 16 x 48 q8_0 tensor"), "{e}");
        let e = pack(GgmlType::Q4_K, 16, 256, &[0u8; 100]).unwrap_err().to_string();
        assert!(e.contains("needs 2304 bytes, got 100"), "{e}");
    }

    /// Products on one thread, packed against row-major (`cargo test -p tandem-cpu --release
    /// packed_speedup -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn packed_speedup() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut rng = Rng(17);
        // TANDEM_SPEEDUP_TYPES=Q4_K,Q6_K measures only those types.
        let only = std::env::var("TANDEM_SPEEDUP_TYPES").ok();
        let wanted = |ty: GgmlType| {
            only.as_deref().is_none_or(|o| o.split(',').any(|n| n.trim().eq_ignore_ascii_case(&ty.to_string())))
        };
        for ty in PACKED_TYPES.into_iter().filter(|&ty| wanted(ty)) {
            let shapes = [
                (65536usize, 2048usize, 1usize),
                (4096, 2048, 1),
                (768, 2048, 8),
                (2048, 2048, 64),
                (512, 128, 256),
                (2048, 2048, 256),
            ];
            for (rows, n, tokens) in shapes.into_iter().filter(|s| s.1.is_multiple_of(ty.block_size())) {
                let w = random_rows(ty, rows, n, &mut rng);
                let x: Vec<f32> = (0..n * tokens).map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 - 1.0).collect();
                let a = crate::quantize_activations(ty, &x, n).unwrap();
                let plain = crate::WeightRef::new(ty, rows, n, &w).unwrap();
                let p = pool.install(|| pack(ty, rows, n, &w)).unwrap();
                let mut y = vec![0f32; rows * tokens];
                let (tp, tk) = crate::fastest_of_two(
                    7,
                    &mut y,
                    |y| crate::matmul_quantized(&pool, &plain, &a, y).unwrap(),
                    |y| crate::matmul_quantized(&pool, &p.weight_ref(), &a, y).unwrap(),
                );
                let gb = (w.len() * tokens) as f64 / 1e9;
                println!(
                    "{ty} {rows}x{n}, {tokens} tokens: row-major {:.3} ms ({:.1} token-GB/s), packed {:.3} ms ({:.1} token-GB/s): {:.2}x",
                    tp * 1e3,
                    gb / tp,
                    tk * 1e3,
                    gb / tk,
                    tp / tk
                );
            }
        }
    }
}
