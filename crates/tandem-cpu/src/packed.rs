//! `--repack`: Q4_K weights rearranged once at load so that one zmm register holds the same four
//! elements of 16 rows. A product then broadcasts four activation bytes to all 16 lanes and
//! `vpdpbusd` accumulates 16 rows at once: no per-row horizontal sums, no scale shuffles, and each
//! unpacked weight vector serves up to [`crate::MAX_NY`] tokens. (ik_llama.cpp's `_R4`/`_R8`
//! layouts do the same for its own kernels.)
//!
//! The arithmetic is fixed per (row, token, block) and independent of the layout of the lanes: the
//! integer sums `isum = sum_j sc_j * sum_e q_e * a_e` and `imin = sum_j m_j * bsum_j` are exact,
//! then `v = isum * d - imin * dmin` (one fused multiply-add) and `acc = v * yd + acc` (fused), block
//! after block. So the scalar reference, the SIMD kernel, one token or a batch, any number of threads
//! all give the same bits. It is not the arithmetic of the row-major kernels (those sum 16 lanes of
//! partial block sums at the end), so repacked products differ from unpacked ones by rounding.
//!
//! Layout of one group of 16 rows: its blocks one after another, each [`GROUP_BLOCK`] bytes:
//! `qs[8 groups of 32][4][16 rows][4 bytes]` (byte `k` of lane `r` in load `l` of group `j` holds
//! element `8l + k` in its low nibble and `8l + 4 + k` in its high one), then `sc[8][16]` and
//! `m[8][16]` (the 6-bit scales and mins, one byte each), then `d[16]` and `dmin[16]` (fp16).

use crate::{Error, Result, WeightRef};
use rayon::prelude::*;
use tandem_quant::blocks::{BlockQ4K, BlockQ8K};
use tandem_quant::{get_scale_min_k4, row_size, GgmlType, QK_K};

/// Rows per packed group.
pub const PACK_ROWS: usize = 16;

const SUBS: usize = QK_K / 32;
const QS: usize = 0;
const SC: usize = QS + QK_K / 2 * PACK_ROWS;
const MN: usize = SC + SUBS * PACK_ROWS;
const D: usize = MN + SUBS * PACK_ROWS;
const DMIN: usize = D + 2 * PACK_ROWS;
/// Bytes of one block of one group of 16 rows (2368, a whole number of cache lines).
pub const GROUP_BLOCK: usize = DMIN + 2 * PACK_ROWS;
const _: () = assert!(GROUP_BLOCK == 2368 && GROUP_BLOCK.is_multiple_of(64));

/// ggml block_q8_K: f32 d, i8 qs[256], i16 bsums[16].
const Q8K_BYTES: usize = std::mem::size_of::<BlockQ8K>();
const Q8K_QS: usize = std::mem::offset_of!(BlockQ8K, qs);
const Q8K_BSUMS: usize = std::mem::offset_of!(BlockQ8K, bsums);
const Q4K_BYTES: usize = std::mem::size_of::<BlockQ4K>();

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

/// Whether a `rows x cols` tensor of `ty` has a packed layout (Q4_K, whole groups of 16 rows).
pub fn packable(ty: GgmlType, rows: usize, cols: usize) -> bool {
    ty == GgmlType::Q4_K && rows > 0 && rows.is_multiple_of(PACK_ROWS) && cols > 0 && cols.is_multiple_of(QK_K)
}

/// Whether packing pays on this machine: its kernel needs AVX-512 VNNI (within `TANDEM_CPU_ISA`);
/// elsewhere only the scalar reference would run it.
pub fn packing_pays() -> bool {
    cfg!(target_arch = "x86_64") && crate::Isa::detected() >= crate::Isa::Avx512Vnni
}

/// Bytes of one packed group of 16 rows of `cols` elements.
pub(crate) fn group_bytes(cols: usize) -> usize {
    cols / QK_K * GROUP_BLOCK
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
    let gb = group_bytes(cols);
    let alloc = |e: std::io::Error| {
        Error::Memory(format!("{rows} x {cols} {ty}: cannot allocate {} bytes to repack: {e}", rows / PACK_ROWS * gb))
    };
    let mut mem = memmap2::MmapOptions::new().len(rows / PACK_ROWS * gb).map_anon().map_err(alloc)?;
    #[cfg(target_os = "linux")]
    // Best effort: without transparent huge pages the memory is ordinary pages.
    let _ = mem.advise(memmap2::Advice::HugePage);
    mem.par_chunks_mut(gb)
        .zip(data.par_chunks(rb * PACK_ROWS))
        .for_each(|(dst, src)| pack_group(src, rb, cols / QK_K, dst));
    Ok(Packed { ty, rows, cols, mem: mem.make_read_only().map_err(alloc)? })
}

/// One group: 16 rows of `nb` Q4_K blocks (`rb` bytes each) into `dst` (zeroed).
fn pack_group(src: &[u8], rb: usize, nb: usize, dst: &mut [u8]) {
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

/// `out[t * ostride + r] = dot(row r of the group, token t)` for the 16 rows of one packed group
/// (`nb` blocks at `w`) and `ny` Q8_K activation rows `yb` bytes apart at `ys`.
///
/// # Safety
/// `w` holds `nb * GROUP_BLOCK` bytes, `ys` `ny` rows of `nb` Q8_K blocks `yb` bytes apart, `out`
/// `ny` rows of 16 writable floats `ostride` apart; `1 <= ny <= MAX_NY`; the machine runs the
/// kernel's instructions.
pub(crate) type GroupFn =
    unsafe fn(nb: usize, w: *const u8, ys: *const u8, yb: usize, ny: usize, out: *mut f32, ostride: usize);

/// The best group kernel this machine runs (within `TANDEM_CPU_ISA`).
pub(crate) fn group_kernel() -> GroupFn {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detected() >= crate::Isa::Avx512Vnni {
        return x86::group_vnni;
    }
    group_scalar
}

/// The scalar reference of the group kernel: the arithmetic of the module docs, spelled out.
///
/// # Safety
/// As [`GroupFn`].
pub(crate) unsafe fn group_scalar(
    nb: usize,
    w: *const u8,
    ys: *const u8,
    yb: usize,
    ny: usize,
    out: *mut f32,
    ostride: usize,
) {
    // SAFETY: the caller guarantees the extents (see `GroupFn`).
    let (w, ys) = unsafe {
        (
            std::slice::from_raw_parts(w, nb * GROUP_BLOCK),
            std::slice::from_raw_parts(ys, (ny - 1) * yb + nb * Q8K_BYTES),
        )
    };
    for t in 0..ny {
        let mut acc = [0f32; PACK_ROWS];
        for b in 0..nb {
            let blk = &w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
            let y = &ys[t * yb + b * Q8K_BYTES..t * yb + (b + 1) * Q8K_BYTES];
            let yd = f32::from_le_bytes(y[0..4].try_into().expect("4 bytes"));
            let bsum = |g: usize| i16::from_le_bytes([y[Q8K_BSUMS + 2 * g], y[Q8K_BSUMS + 2 * g + 1]]) as i32;
            for (r, a) in acc.iter_mut().enumerate() {
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
                *a = v.mul_add(yd, *a);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            // SAFETY: the caller guarantees 16 writable floats per token row.
            unsafe { *out.add(t * ostride + r) = *a };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{D, DMIN, GROUP_BLOCK, MN, Q8K_BSUMS, Q8K_BYTES, Q8K_QS, SC, SUBS};
    use std::arch::x86_64::*;

    /// A [`super::GroupFn`] for AVX-512 VNNI.
    ///
    /// # Safety
    /// As [`super::GroupFn`].
    pub(super) unsafe fn group_vnni(
        nb: usize,
        w: *const u8,
        ys: *const u8,
        yb: usize,
        ny: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        // SAFETY: forwarded from the caller, who checked that the machine has AVX-512 VNNI.
        unsafe {
            match ny {
                1 => group::<1>(nb, w, ys, yb, out, ostride),
                2 => group::<2>(nb, w, ys, yb, out, ostride),
                3 => group::<3>(nb, w, ys, yb, out, ostride),
                4 => group::<4>(nb, w, ys, yb, out, ostride),
                5 => group::<5>(nb, w, ys, yb, out, ostride),
                6 => group::<6>(nb, w, ys, yb, out, ostride),
                7 => group::<7>(nb, w, ys, yb, out, ostride),
                _ => group::<8>(nb, w, ys, yb, out, ostride),
            }
        }
    }

    #[inline(always)]
    unsafe fn bcast(p: *const u8) -> __m512i {
        // SAFETY: the caller guarantees 4 readable bytes.
        _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
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
                    // One token streams the weights once: ask for the lines 4 KiB ahead (the
                    // hardware prefetchers stop at page boundaries).
                    for l in (0..GROUP_BLOCK).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(wb.add(l + 4096) as *const i8);
                    }
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
        for (t, a) in acc.iter().enumerate() {
            // SAFETY: 16 writable floats per token row (see `GroupFn`).
            unsafe { _mm512_storeu_ps(out.add(t * ostride), *a) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MAX_NY;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Random Q4_K rows: every bit pattern of levels and scales, fp16 factors in [2^-10, 2^-9).
    fn random_q4k(rows: usize, n: usize, rng: &mut Rng) -> Vec<u8> {
        let mut w: Vec<u8> = (0..rows * row_size(GgmlType::Q4_K, n).unwrap()).map(|_| rng.next() as u8).collect();
        for b in w.chunks_exact_mut(Q4K_BYTES) {
            for o in [0, 2] {
                let bits = 0x1400u16 | (rng.next() as u16 & 0x03FF) | (rng.next() as u16 & 0x8000);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    fn acts(n: usize, ny: usize, rng: &mut Rng) -> Vec<u8> {
        let x: Vec<f32> = (0..n * ny).map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0).collect();
        crate::quantize_activations(GgmlType::Q4_K, &x, n).unwrap().data
    }

    #[test]
    fn the_layout_keeps_every_level_scale_and_factor() {
        // Unpacking the packed bytes by the layout gives back ggml's dequantized rows exactly.
        let (rows, n) = (32, 512);
        let mut rng = Rng(7);
        let w = random_q4k(rows, n, &mut rng);
        let p = pack(GgmlType::Q4_K, rows, n, &w).unwrap();
        let rb = row_size(GgmlType::Q4_K, n).unwrap();
        let gb = group_bytes(n);
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

    #[test]
    fn the_scalar_group_kernel_matches_ggml_vec_dot() {
        let (rows, n, ny) = (16, 1024, 3);
        let mut rng = Rng(11);
        let w = random_q4k(rows, n, &mut rng);
        let ys = acts(n, ny, &mut rng);
        let p = pack(GgmlType::Q4_K, rows, n, &w).unwrap();
        let (rb, yb) = (row_size(GgmlType::Q4_K, n).unwrap(), row_size(GgmlType::Q8_K, n).unwrap());
        let mut out = vec![0f32; ny * PACK_ROWS];
        // SAFETY: one group, ny rows of activations, ny x 16 outputs.
        unsafe { group_scalar(n / QK_K, p.bytes().as_ptr(), ys.as_ptr(), yb, ny, out.as_mut_ptr(), PACK_ROWS) };
        for t in 0..ny {
            for r in 0..rows {
                let want =
                    tandem_quant::vec_dot(GgmlType::Q4_K, n, &w[r * rb..(r + 1) * rb], &ys[t * yb..(t + 1) * yb])
                        .unwrap();
                let got = out[t * PACK_ROWS + r];
                assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "token {t} row {r}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn the_simd_group_kernel_equals_the_scalar_one_bit_for_bit() {
        if group_kernel() as usize == group_scalar as usize {
            println!("SKIPPED AVX-512 VNNI packed Q4_K kernel: this machine (or TANDEM_CPU_ISA) does not run it");
            return;
        }
        let mut rng = Rng(13);
        for n in [256, 2048] {
            let w = random_q4k(PACK_ROWS, n, &mut rng);
            let p = pack(GgmlType::Q4_K, PACK_ROWS, n, &w).unwrap();
            let yb = row_size(GgmlType::Q8_K, n).unwrap();
            for ny in 1..=MAX_NY {
                let mut ys = acts(n, ny, &mut rng);
                // Extreme activations too (-128 is never produced by the quantizer, but is legal).
                ys[Q8K_QS] = 0x80;
                let (mut a, mut b) = (vec![0f32; ny * 20], vec![0f32; ny * 20]);
                // SAFETY: one group; ny rows of activations; outputs ny rows of 16 floats 20 apart.
                unsafe {
                    group_scalar(n / QK_K, p.bytes().as_ptr(), ys.as_ptr(), yb, ny, a.as_mut_ptr(), 20);
                    group_kernel()(n / QK_K, p.bytes().as_ptr(), ys.as_ptr(), yb, ny, b.as_mut_ptr(), 20);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "n {n}, {ny} tokens");
            }
        }
    }

    #[test]
    fn a_packed_matrix_is_cut_only_between_groups() {
        let (rows, n) = (48, 256);
        let mut rng = Rng(19);
        let w = random_q4k(rows, n, &mut rng);
        let p = pack(GgmlType::Q4_K, rows, n, &w).unwrap();
        let m = p.weight_ref();
        let e = m.rows(8, 16).unwrap_err().to_string();
        assert!(e.contains("rows 8..24 of a weight packed in groups of 16 rows"), "{e}");
        assert!(m.rows(16, 20).is_err());
        // Rows 16..48 alone give the same bits as those columns of the whole product.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let x: Vec<f32> = (0..3 * n).map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0).collect();
        let (mut all, mut part) = (vec![0f32; 3 * rows], vec![0f32; 3 * 32]);
        crate::matmul(&pool, &m, &x, &mut all).unwrap();
        crate::matmul(&pool, &m.rows(16, 32).unwrap(), &x, &mut part).unwrap();
        for t in 0..3 {
            assert_eq!(&all[t * rows + 16..t * rows + 48], &part[t * 32..(t + 1) * 32], "token {t}");
        }
    }

    #[test]
    fn shapes_without_a_packed_layout_are_refused() {
        let e = pack(GgmlType::Q4_K, 8, 256, &[0u8; 8 * 144]).unwrap_err().to_string();
        assert!(e.contains("no packed layout for a 8 x 256 q4_K tensor"), "{e}");
        let e = pack(GgmlType::Q6_K, 16, 256, &[0u8; 16 * 210]).unwrap_err().to_string();
        assert!(e.contains("no packed layout"), "{e}");
        let e = pack(GgmlType::Q4_K, 16, 256, &[0u8; 100]).unwrap_err().to_string();
        assert!(e.contains("needs 2304 bytes, got 100"), "{e}");
    }

    /// A Q4_K product on one thread, packed against row-major (`cargo test -p tandem-cpu --release
    /// packed_speedup -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn packed_speedup() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut rng = Rng(17);
        for (rows, n, tokens) in
            [(65536usize, 2048usize, 1usize), (4096, 2048, 1), (768, 2048, 8), (2048, 2048, 64), (2048, 2048, 256)]
        {
            let w = random_q4k(rows, n, &mut rng);
            let x: Vec<f32> = (0..n * tokens).map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0).collect();
            let a = crate::quantize_activations(GgmlType::Q4_K, &x, n).unwrap();
            let plain = crate::WeightRef::new(GgmlType::Q4_K, rows, n, &w).unwrap();
            let p = pool.install(|| pack(GgmlType::Q4_K, rows, n, &w)).unwrap();
            let mut y = vec![0f32; rows * tokens];
            let (mut tp, mut tk) = (f64::MAX, f64::MAX);
            for _ in 0..7 {
                let t = std::time::Instant::now();
                crate::matmul_quantized(&pool, &plain, &a, &mut y).unwrap();
                tp = tp.min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                crate::matmul_quantized(&pool, &p.weight_ref(), &a, &mut y).unwrap();
                tk = tk.min(t.elapsed().as_secs_f64());
            }
            let gb = (w.len() * tokens) as f64 / 1e9;
            println!(
                "Q4_K {rows}x{n}, {tokens} tokens: row-major {:.2} ms ({:.1} token-GB/s), packed {:.2} ms ({:.1} token-GB/s): {:.2}x",
                tp * 1e3,
                gb / tp,
                tk * 1e3,
                gb / tk,
                tp / tk
            );
        }
    }
}
