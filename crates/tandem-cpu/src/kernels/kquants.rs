//! SIMD kernels of the k-quants (Q2_K..Q6_K against Q8_K activations) for x86: AVX2, AVX-512 and
//! AVX-512 VNNI. Each weight block is unpacked once into registers (levels, group scales, min
//! terms; see `unpack`) and dotted with all `ny` activation rows, as ik_llama.cpp's iqk_mul_mat does
//! for batched prefill. Integer sums are exact; per-block float terms are combined with FMA.

#[cfg(target_arch = "x86_64")]
mod dot;
#[cfg(target_arch = "x86_64")]
mod iq;
#[cfg(target_arch = "x86_64")]
mod iq_vbmi;
#[cfg(target_arch = "x86_64")]
mod unpack;

use super::{Isa, KernelFn, TileFn};
use tandem_quant::GgmlType;

/// The kernel for `ty` written for exactly `isa`, if any.
pub(super) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::lookup(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// The kernel for `ty` written for exactly `isa` that takes up to [`MAX_WIDE`] tokens, if any.
pub(super) fn lookup_wide(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::lookup_wide(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use dot::MAX_WIDE;
/// Most tokens a wide kernel takes.
#[cfg(not(target_arch = "x86_64"))]
pub(super) const MAX_WIDE: usize = 64;

/// The multi-row kernel for `ty` written for exactly `isa` that takes more than `MAX_NY` (up to
/// [`MAX_WIDE`]) tokens and each of `super::WIDE_TILE_ROWS` rows, if any.
pub(super) fn lookup_wide_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::lookup_wide_tile(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

/// The multi-row kernel for `ty` written for exactly `isa` (taking each of `super::TILE_ROWS`), if any.
pub(super) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
    #[cfg(target_arch = "x86_64")]
    {
        x86::lookup_tile(ty, isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, isa);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::dot::{
        dot_avx2, dot_avx512, dot_avx512vbmi, dot_avx512vbmi_vnni, dot_avx512vnni, dot_wide_avx2, tile_avx2,
        tile_avx512, tile_avx512vnni, wide_avx512, wide_avx512vbmi, wide_avx512vbmi_vnni, wide_avx512vnni,
    };
    use super::iq::{IQ1M, IQ1S, IQ2S, IQ2XS, IQ2XXS, IQ3S, IQ3XXS};
    use super::unpack::{KQuant, Q2K, Q3K, Q4K, Q5K, Q6K};
    use crate::kernels::{Isa, KernelFn, TileFn};
    use tandem_quant::GgmlType;

    /// A `KernelFn` from a dot loop generic over `NY`: picks the instance for `ny`.
    macro_rules! entry {
        ($name:ident, $dot:ident) => {
            /// # Safety
            /// As [`KernelFn`]: lengths checked by `Kernel::run`, the machine runs this level.
            unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
                let (w, ys, o) = (w.as_ptr(), ys.as_ptr(), out.as_mut_ptr());
                // SAFETY: `Kernel::run` checked w, ys and out against n and ny (1..=8).
                unsafe {
                    match ny {
                        1 => $dot::<T, 1>(n, w, ys, o),
                        2 => $dot::<T, 2>(n, w, ys, o),
                        3 => $dot::<T, 3>(n, w, ys, o),
                        4 => $dot::<T, 4>(n, w, ys, o),
                        5 => $dot::<T, 5>(n, w, ys, o),
                        6 => $dot::<T, 6>(n, w, ys, o),
                        7 => $dot::<T, 7>(n, w, ys, o),
                        8 => $dot::<T, 8>(n, w, ys, o),
                        _ => out.fill(f32::NAN),
                    }
                }
            }
        };
    }
    entry!(avx2, dot_avx2);
    entry!(avx512, dot_avx512);
    entry!(avx512vnni, dot_avx512vnni);
    entry!(avx512vbmi, dot_avx512vbmi);
    entry!(avx512vbmi_vnni, dot_avx512vbmi_vnni);

    /// A `KernelFn` for up to `MAX_WIDE` rows from a wide dot loop (the zmm ones with one weight
    /// row: `(n, w, wstride, ys, ny, out)`).
    macro_rules! wide_entry {
        ($name:ident, $dot:ident::<T>) => {
            /// # Safety
            /// As [`KernelFn`] with up to `MAX_WIDE` rows: lengths checked by the caller.
            unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
                // SAFETY: forwarded from the caller.
                unsafe { $dot::<T>(n, w.as_ptr(), ys.as_ptr(), ny.min(out.len()), out.as_mut_ptr()) }
            }
        };
        ($name:ident, $dot:ident::<T, 1>) => {
            /// # Safety
            /// As [`KernelFn`] with up to `MAX_WIDE` rows: lengths checked by the caller.
            unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
                // SAFETY: forwarded from the caller (one weight row).
                unsafe { $dot::<T, 1>(n, w.as_ptr(), 0, ys.as_ptr(), ny.min(out.len()), out.as_mut_ptr()) }
            }
        };
    }
    wide_entry!(wide256, dot_wide_avx2::<T>);
    wide_entry!(wide512, wide_avx512::<T, 1>);
    wide_entry!(wide512vnni, wide_avx512vnni::<T, 1>);
    wide_entry!(wide_vbmi, wide_avx512vbmi::<T, 1>);
    wide_entry!(wide_vbmi_vnni, wide_avx512vbmi_vnni::<T, 1>);

    /// The wide kernel of a grid type at `isa`.
    fn wide_for_type<T: KQuant>(isa: Isa) -> Option<KernelFn> {
        match isa {
            Isa::Avx2 => Some(wide256::<T>),
            Isa::Avx512 => Some(wide512::<T>),
            Isa::Avx512Vnni if T::VNNI => Some(wide512vnni::<T>),
            Isa::Avx512Vbmi if T::VNNI => Some(wide_vbmi_vnni::<T>),
            Isa::Avx512Vbmi => Some(wide_vbmi::<T>),
            _ => None,
        }
    }

    /// The grid types' wide kernels, at every level: their unpacking (table loads, 29-50 ns per
    /// block below the `avx512vbmi` level, 9-31 ns at it) costs more than the activations of more
    /// than 8 tokens falling out of L1. At the `avx512vbmi` level IQ2_XXS, IQ2_XS and IQ3_XXS,
    /// whose blocks unpack fastest, took calls of 8 tokens until the two-row wide kernels below
    /// (single-row wide, IQ2_XXS prefilled 256 tokens at 180-219 against 191-251 t/s).
    pub(super) fn lookup_wide(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
        match ty {
            GgmlType::IQ2_XXS => wide_for_type::<IQ2XXS>(isa),
            GgmlType::IQ2_XS => wide_for_type::<IQ2XS>(isa),
            GgmlType::IQ3_XXS => wide_for_type::<IQ3XXS>(isa),
            GgmlType::IQ2_S => wide_for_type::<IQ2S>(isa),
            GgmlType::IQ3_S => wide_for_type::<IQ3S>(isa),
            GgmlType::IQ1_S => wide_for_type::<IQ1S>(isa),
            GgmlType::IQ1_M => wide_for_type::<IQ1M>(isa),
            _ => None,
        }
    }

    /// A `TileFn` from a wide tile loop generic over the weight rows `NR` (2 or 4, from
    /// `out.len() / ny`), for up to `MAX_WIDE` tokens.
    macro_rules! wide_tile_entry {
        ($name:ident, $tile:ident) => {
            /// # Safety
            /// As [`TileFn`] with up to `MAX_WIDE` tokens: lengths checked by `Kernel::run_tile`.
            unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
                let nr = out.len() / ny.max(1);
                let ws = w.len() / nr.max(1);
                let (w, ys, o) = (w.as_ptr(), ys.as_ptr(), out.as_mut_ptr());
                // SAFETY: forwarded from the caller (nr rows of ws bytes, ny tokens, nr * ny outputs).
                unsafe {
                    match nr {
                        2 => $tile::<T, 2>(n, w, ws, ys, ny, o),
                        4 => $tile::<T, 4>(n, w, ws, ys, ny, o),
                        _ => out.fill(f32::NAN),
                    }
                }
            }
        };
    }
    wide_tile_entry!(wide_tile_vbmi, wide_avx512vbmi);
    wide_tile_entry!(wide_tile_vbmi_vnni, wide_avx512vbmi_vnni);

    fn wide_tile_for_type<T: KQuant>(isa: Isa) -> Option<TileFn> {
        match isa {
            Isa::Avx512Vbmi if T::VNNI => Some(wide_tile_vbmi_vnni::<T>),
            Isa::Avx512Vbmi => Some(wide_tile_vbmi::<T>),
            _ => None,
        }
    }

    /// The grid types' two-row wide kernels, at the `avx512vbmi` level only: each activation
    /// block loaded once for two weight rows. Prefill of 256 tokens on the bench models (Zen 5,
    /// alternating binaries, against single-row wide kernels for IQ1_S and IQ3_S and calls of 8
    /// tokens for IQ2_XXS): IQ1_S 158-161 against 149, IQ3_S 152-154 against 136-138, IQ2_XXS
    /// 167-173 against 125-141 t/s; four rows at once were slower (IQ1_S 138-149, IQ2_XXS
    /// 131-143 against 156-169). Below that level, where the unpacking takes more registers, two
    /// rows were as often slower as faster (IQ3_S 7.2 against 6.7 ns per block and token with 24
    /// tokens, IQ1_S 5.0 against 6.5).
    pub(super) fn lookup_wide_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
        match ty {
            GgmlType::IQ2_XXS => wide_tile_for_type::<IQ2XXS>(isa),
            GgmlType::IQ2_XS => wide_tile_for_type::<IQ2XS>(isa),
            GgmlType::IQ3_XXS => wide_tile_for_type::<IQ3XXS>(isa),
            GgmlType::IQ2_S => wide_tile_for_type::<IQ2S>(isa),
            GgmlType::IQ3_S => wide_tile_for_type::<IQ3S>(isa),
            GgmlType::IQ1_S => wide_tile_for_type::<IQ1S>(isa),
            GgmlType::IQ1_M => wide_tile_for_type::<IQ1M>(isa),
            _ => None,
        }
    }

    /// A `TileFn` from a tile loop generic over the weight rows `NR` (2 or 4, from `out.len() / ny`)
    /// and `NY`.
    macro_rules! tile_entry {
        ($name:ident, $tile:ident) => {
            /// # Safety
            /// As [`TileFn`]: lengths checked by `Kernel::run_tile`, the machine runs this level.
            unsafe fn $name<T: KQuant>(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
                tile_body!($tile::<T>, n, w, ys, ny, out)
            }
        };
    }
    tile_entry!(tile256, tile_avx2);
    tile_entry!(tile512, tile_avx512);
    tile_entry!(tile512vnni, tile_avx512vnni);

    fn tile_for_type<T: KQuant>(isa: Isa) -> Option<TileFn> {
        if !T::TILES {
            return None;
        }
        match isa {
            Isa::Avx2 => Some(tile256::<T>),
            Isa::Avx512 => Some(tile512::<T>),
            Isa::Avx512Vnni if T::VNNI => Some(tile512vnni::<T>),
            Isa::Scalar | Isa::Avx512Vnni | Isa::Avx512Vbmi | Isa::Avx512Bf16 => None,
        }
    }

    pub(super) fn lookup_tile(ty: GgmlType, isa: Isa) -> Option<TileFn> {
        match ty {
            GgmlType::Q2_K => tile_for_type::<Q2K>(isa),
            GgmlType::Q3_K => tile_for_type::<Q3K>(isa),
            GgmlType::Q4_K => tile_for_type::<Q4K>(isa),
            GgmlType::Q5_K => tile_for_type::<Q5K>(isa),
            GgmlType::Q6_K => tile_for_type::<Q6K>(isa),
            GgmlType::IQ2_XXS => tile_for_type::<IQ2XXS>(isa),
            GgmlType::IQ2_XS => tile_for_type::<IQ2XS>(isa),
            GgmlType::IQ2_S => tile_for_type::<IQ2S>(isa),
            GgmlType::IQ3_XXS => tile_for_type::<IQ3XXS>(isa),
            GgmlType::IQ3_S => tile_for_type::<IQ3S>(isa),
            GgmlType::IQ1_S => tile_for_type::<IQ1S>(isa),
            GgmlType::IQ1_M => tile_for_type::<IQ1M>(isa),
            _ => None,
        }
    }

    fn for_type<T: KQuant>(isa: Isa) -> Option<KernelFn> {
        match isa {
            Isa::Avx2 => Some(avx2::<T>),
            Isa::Avx512 => Some(avx512::<T>),
            Isa::Avx512Vnni if T::VNNI => Some(avx512vnni::<T>),
            Isa::Avx512Vbmi if T::OWN_VBMI && T::VNNI => Some(avx512vbmi_vnni::<T>),
            Isa::Avx512Vbmi if T::OWN_VBMI => Some(avx512vbmi::<T>),
            Isa::Scalar | Isa::Avx512Vnni | Isa::Avx512Bf16 | Isa::Avx512Vbmi => None,
        }
    }

    pub(super) fn lookup(ty: GgmlType, isa: Isa) -> Option<KernelFn> {
        match ty {
            GgmlType::Q2_K => for_type::<Q2K>(isa),
            GgmlType::Q3_K => for_type::<Q3K>(isa),
            GgmlType::Q4_K => for_type::<Q4K>(isa),
            GgmlType::Q5_K => for_type::<Q5K>(isa),
            GgmlType::Q6_K => for_type::<Q6K>(isa),
            GgmlType::IQ2_XXS => for_type::<IQ2XXS>(isa),
            GgmlType::IQ2_XS => for_type::<IQ2XS>(isa),
            GgmlType::IQ2_S => for_type::<IQ2S>(isa),
            GgmlType::IQ3_XXS => for_type::<IQ3XXS>(isa),
            GgmlType::IQ3_S => for_type::<IQ3S>(isa),
            GgmlType::IQ1_S => for_type::<IQ1S>(isa),
            GgmlType::IQ1_M => for_type::<IQ1M>(isa),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kernels::{kernel, simd_levels, Isa, MAX_NY};
    use tandem_quant::{row_size, vec_dot, GgmlType};

    const TYPES: [GgmlType; 5] = [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Offsets of the fp16 factors (d, and dmin where present) in each block.
    fn f16_offsets(ty: GgmlType) -> Vec<usize> {
        use std::mem::offset_of;
        use tandem_quant::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K};
        match ty {
            GgmlType::Q2_K => vec![offset_of!(BlockQ2K, d), offset_of!(BlockQ2K, dmin)],
            GgmlType::Q3_K => vec![offset_of!(BlockQ3K, d)],
            GgmlType::Q4_K => vec![offset_of!(BlockQ4K, d), offset_of!(BlockQ4K, dmin)],
            GgmlType::Q5_K => vec![offset_of!(BlockQ5K, d), offset_of!(BlockQ5K, dmin)],
            _ => vec![offset_of!(BlockQ6K, d)],
        }
    }

    /// Random bit patterns for every level, scale and mask bit; finite fp16 factors in [2^-10, 2^-9).
    fn random_weights(ty: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
        let bytes = row_size(ty, n).unwrap();
        let mut w: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
        let block = bytes / (n / 256);
        for b in w.chunks_exact_mut(block) {
            for o in f16_offsets(ty) {
                let bits = 0x1400u16 | (rng.next() as u16 & 0x03FF) | (rng.next() as u16 & 0x8000);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
        }
        w
    }

    /// Q8_K rows with every quant value including -128 (extremes of `vpmaddubsw`), consistent bsums.
    fn random_q8k(n: usize, rows: usize, rng: &mut Rng) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * (n / 256) {
            let d = 0.001 + (rng.next() % 1000) as f32 * 1e-5;
            let qs: Vec<i8> =
                (0..256).map(|_| if rng.next().is_multiple_of(5) { -128 } else { rng.next() as i8 }).collect();
            out.extend_from_slice(&d.to_le_bytes());
            out.extend(qs.iter().map(|&q| q as u8));
            for g in qs.chunks_exact(16) {
                out.extend_from_slice(&g.iter().map(|&q| q as i16).sum::<i16>().to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn random_bit_patterns_match_the_scalar_reference() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for ty in TYPES {
            for isa in simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                assert_eq!(k.isa, isa);
                for n in [256, 1024] {
                    let w = random_weights(ty, n, &mut rng);
                    let ys = random_q8k(n, MAX_NY, &mut rng);
                    let yb = ys.len() / MAX_NY;
                    for ny in 1..=MAX_NY {
                        let mut out = vec![0f32; ny];
                        k.run(n, &w, &ys[..ny * yb], &mut out);
                        for (j, got) in out.iter().enumerate() {
                            let want = vec_dot(ty, n, &w, &ys[j * yb..(j + 1) * yb]).unwrap();
                            // Integer sums are exact; only the float combination of blocks differs.
                            let tol = 1e-5 * want.abs().max(1.0);
                            assert!((got - want).abs() <= tol, "{ty} {isa} n={n} ny={ny} row {j}: {got} vs {want}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_rows_give_zero() {
        for ty in TYPES {
            for isa in simd_levels(ty).into_iter().filter(|l| l.supported()) {
                let mut out = [f32::NAN; 3];
                kernel(ty, isa).unwrap().run(0, &[], &[], &mut out);
                assert_eq!(out, [0.0; 3], "{ty} {isa}");
            }
        }
    }

    #[test]
    fn every_k_quant_has_all_x86_levels() {
        for ty in TYPES {
            let want: Vec<Isa> =
                if cfg!(target_arch = "x86_64") { vec![Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni] } else { vec![] };
            assert_eq!(simd_levels(ty), want, "{ty}");
        }
    }

    /// Single-row against tile kernels on the same rows, weight bytes from L2 (`cargo test -p
    /// tandem-cpu --release tile_throughput -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn tile_throughput() {
        let mut rng = Rng(7);
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0] {
            let n = 7168;
            let rb = row_size(ty, n).unwrap();
            let rows = (512 * 1024 / rb) & !3; // a whole number of tiles of 2 and 4 rows
            let w: Vec<u8> = (0..rows).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let ys = if ty == GgmlType::Q8_0 {
                let x: Vec<f32> = (0..n * MAX_NY).map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0).collect();
                crate::quantize_activations(ty, &x, n).unwrap().data
            } else {
                random_q8k(n, MAX_NY, &mut rng)
            };
            let yb = ys.len() / MAX_NY;
            let mut line = format!("{ty} n={n}:");
            for isa in [Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|l| l.supported()) {
                let k = kernel(ty, isa).unwrap();
                if !k.has_tile() {
                    continue;
                }
                for (ny, nr) in [(2usize, 2usize), (2, 4), (4, 2), (4, 4), (6, 2), (6, 4), (8, 2), (8, 4)] {
                    let mut out = vec![0f32; nr * ny];
                    let (mut single, mut tile) = (f64::MAX, f64::MAX);
                    for _ in 0..20 {
                        let t = std::time::Instant::now();
                        for r in w.chunks_exact(rb) {
                            k.run(n, r, &ys[..ny * yb], &mut out[..ny]);
                        }
                        single = single.min(t.elapsed().as_secs_f64());
                        let t = std::time::Instant::now();
                        for r in w.chunks_exact(nr * rb) {
                            k.run_tile(n, r, &ys[..ny * yb], &mut out);
                        }
                        tile = tile.min(t.elapsed().as_secs_f64());
                        std::hint::black_box(&out);
                    }
                    let gb = w.len() as f64 / 1e9;
                    line += &format!("\n  {isa} ny={ny} single {:.2} tile{nr} {:.2} GB/s", gb / single, gb / tile);
                }
            }
            println!("{line}");
        }
    }

    /// A whole Q4_K product on one thread (`matmul`, with tile kernels) against the same row tiles
    /// and token groups with single-row calls only (`cargo test -p tandem-cpu --release
    /// matmul_tile_speedup -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn matmul_tile_speedup() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let mut rng = Rng(9);
        for (rows, n, tokens) in [(512usize, 2048usize, 32usize), (2048, 2048, 256)] {
            let ty = GgmlType::Q4_K;
            let rb = row_size(ty, n).unwrap();
            let w: Vec<u8> = (0..rows).flat_map(|_| random_weights(ty, n, &mut rng)).collect();
            let x: Vec<f32> = (0..n * tokens).map(|_| (rng.next() % 2001) as f32 / 1000.0 - 1.0).collect();
            let acts = crate::quantize_activations(ty, &x, n).unwrap();
            let wr = crate::WeightRef::new(ty, rows, n, &w).unwrap();
            let k = crate::best_kernel(ty).unwrap();
            let mut y = vec![0f32; rows * tokens];
            let (mut tiled, mut single) = (f64::MAX, f64::MAX);
            for _ in 0..5 {
                let t = std::time::Instant::now();
                crate::matmul_quantized(&pool, &wr, &acts, &mut y).unwrap();
                tiled = tiled.min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                let mut tmp = [0f32; MAX_NY];
                for tile in (0..rows).step_by(16) {
                    for t0 in (0..tokens).step_by(MAX_NY) {
                        let nt = MAX_NY.min(tokens - t0);
                        for r in tile..tile + 16 {
                            k.run(
                                n,
                                &w[r * rb..(r + 1) * rb],
                                &acts.data[t0 * acts.row_bytes..(t0 + nt) * acts.row_bytes],
                                &mut tmp[..nt],
                            );
                            for i in 0..nt {
                                y[(t0 + i) * rows + r] = tmp[i];
                            }
                        }
                    }
                }
                single = single.min(t.elapsed().as_secs_f64());
            }
            let gb = (w.len() * tokens) as f64 / 1e9;
            println!(
                "{ty} {rows}x{n}, {tokens} tokens, {}: single-row {:.1} ms ({:.1} token-GB/s), tiled {:.1} ms ({:.1} token-GB/s)",
                k.isa,
                single * 1e3,
                gb / single,
                tiled * 1e3,
                gb / tiled
            );
        }
    }

    /// Throughput of weight bytes from L2 (`cargo test -p tandem-cpu --release kquant_throughput -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn kquant_throughput() {
        let mut rng = Rng(42);
        for ty in TYPES {
            for n in [2048usize, 7168] {
                let rows = (512 * 1024 / row_size(ty, n).unwrap()).max(1);
                let ws: Vec<Vec<u8>> = (0..rows).map(|_| random_weights(ty, n, &mut rng)).collect();
                let ys = random_q8k(n, MAX_NY, &mut rng);
                let yb = ys.len() / MAX_NY;
                let bytes = (rows * row_size(ty, n).unwrap()) as f64;
                let mut line = format!("{ty} n={n:5}:");
                for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Vnni].into_iter().filter(|l| l.supported())
                {
                    let k = kernel(ty, isa).unwrap();
                    for ny in [1usize, 2, 4, 8] {
                        let mut out = vec![0f32; ny];
                        let reps = if isa == Isa::Scalar { 5 } else { 40 };
                        let mut best = f64::MAX;
                        for _ in 0..reps {
                            let t = std::time::Instant::now();
                            for w in &ws {
                                k.run(n, w, &ys[..ny * yb], &mut out);
                            }
                            best = best.min(t.elapsed().as_secs_f64());
                            std::hint::black_box(&out);
                        }
                        line += &format!(" {isa} ny={ny} {:6.2} GB/s", bytes / best / 1e9);
                    }
                }
                println!("{line}");
            }
        }
    }
}
