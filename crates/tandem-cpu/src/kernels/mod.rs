//! Dot-product kernels chosen at run time: one weight row against up to [`MAX_NY`] activation rows
//! (quantized to the weight type's `vec_dot_type`), so a weight block unpacked once serves several
//! tokens of a batch. Every type has the scalar reference of tandem-quant; SIMD versions exist per
//! type and instruction set, and [`kernel`] picks the best one the machine can run, never above the
//! level `TANDEM_CPU_ISA` allows (`scalar`, `avx2`, `avxvnni`, `avx512`, `avx512vnni`, `avx512vbmi`,
//! `avx512bf16`).
//!
//! SIMD kernels sum the same integer products exactly but combine per-block float terms in another
//! order (with FMA), as ggml's own SIMD kernels do, so they agree with the scalar reference within a
//! few ulp of the accumulated magnitude, not bit for bit.

mod kquants;
mod legacy;

/// The SIMD kernels of this architecture, by family (`kquants`, `legacy`), each with the tables
/// its family file dispatches from. Another architecture adds a sibling of `x86/` and a line here.
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
use x86 as arch;

/// No SIMD kernels off x86-64: every table answers none, and the scalar references run.
#[cfg(not(target_arch = "x86_64"))]
mod arch {
    /// No kernel for any type and level (a [`super::TileFn`] is a [`super::KernelFn`] by type).
    pub(crate) fn none(_ty: tandem_quant::GgmlType, _isa: super::Isa) -> Option<super::KernelFn> {
        None
    }
    pub(super) mod kquants {
        pub(crate) use super::{none as lookup, none as lookup_tile, none as lookup_wide, none as lookup_wide_tile};
    }
    pub(super) mod legacy {
        pub(crate) use super::{none as lookup, none as lookup_tile};
    }
}

use std::sync::OnceLock;
use tandem_quant::{row_size, vec_dot, vec_dot_type, GgmlType};

/// Most activation rows one kernel call takes.
pub const MAX_NY: usize = 8;

/// Most activation rows one call of a kernel with a wide variant takes ([`Kernel::max_tokens`]).
pub const MAX_WIDE: usize = kquants::MAX_WIDE;

/// Instruction-set levels, each including the ones below it but `AvxVnni`: the AVX-512 levels
/// bring their own VNNI and do not need it (Zen 4 has AVX-512 VNNI without AVX-VNNI). A cap of
/// `TANDEM_CPU_ISA` picks the best level at or below it that the machine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 with AVX-VNNI (`vpdpbusd` on ymm, VEX-encoded): Alder Lake and later client cores,
    /// Sierra Forest, Zen 5; also Sapphire Rapids, under its AVX-512.
    AvxVnni,
    /// AVX-512 F/BW/VL/DQ.
    Avx512,
    /// AVX-512 with VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AVX-512 VNNI with VBMI and BITALG (byte permutes, `vpmultishiftqb`, `vpopcntb`): Ice Lake,
    /// Zen 4 and later.
    Avx512Vbmi,
    /// All of the above with BF16 (`vdpbf16ps`): Sapphire Rapids, Zen 4 and later (Cooper Lake
    /// has BF16 without VBMI, so it stops at `avx512vnni`).
    Avx512Bf16,
}

impl Isa {
    pub const ALL: [Isa; 7] =
        [Isa::Scalar, Isa::Avx2, Isa::AvxVnni, Isa::Avx512, Isa::Avx512Vnni, Isa::Avx512Vbmi, Isa::Avx512Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avxvnni",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx512Bf16 => "avx512bf16",
            Isa::Avx512Vbmi => "avx512vbmi",
        }
    }

    pub fn parse(s: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|i| i.name().eq_ignore_ascii_case(s.trim()))
    }

    /// Whether this machine can run code of this level.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq");
            let vbmi = avx512 && has!("avx512vnni") && has!("avx512vbmi") && has!("avx512bitalg");
            match self {
                Isa::Scalar => true,
                Isa::Avx2 => avx2,
                Isa::AvxVnni => avx2 && has!("avxvnni"),
                Isa::Avx512 => avx512,
                Isa::Avx512Vnni => avx512 && has!("avx512vnni"),
                Isa::Avx512Vbmi => vbmi,
                Isa::Avx512Bf16 => vbmi && has!("avx512bf16"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Isa::Scalar
        }
    }

    /// The best level this machine runs, capped by `TANDEM_CPU_ISA` when set (read once).
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let cap = std::env::var("TANDEM_CPU_ISA").ok().and_then(|s| {
                let cap = Isa::parse(&s);
                if cap.is_none() {
                    let names: Vec<&str> = Isa::ALL.iter().map(|i| i.name()).collect();
                    tracing::warn!("TANDEM_CPU_ISA={s:?} is not one of {}; ignored", names.join(", "));
                }
                cap
            });
            Isa::best_within(cap)
        })
    }

    /// The best level this machine runs at or below `cap`.
    pub fn best_within(cap: Option<Isa>) -> Isa {
        let fits = |i: &Isa| cap.is_none_or(|c| *i <= c) && i.supported();
        Isa::ALL.into_iter().rev().find(fits).unwrap_or(Isa::Scalar)
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `out[j] = dot(w, y_j)` for the `ny` activation rows laid out back to back in `ys`.
///
/// # Safety
/// The caller has checked what [`Kernel::run`] checks, and the machine supports the kernel's [`Isa`].
pub type KernelFn = unsafe fn(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]);

/// `out[r * ny + j] = dot(w_r, y_j)` for `nr = out.len() / ny` weight rows `w_r` (one of
/// [`TILE_ROWS`]) back to back in `w` and the `ny` activation rows back to back in `ys`. Each
/// activation block is loaded once for all `nr` weight rows; each result is bit-identical to the
/// single-row [`KernelFn`] of the same type and level.
///
/// # Safety
/// The caller has checked what [`Kernel::run_tile`] checks, and the machine supports the kernel's [`Isa`].
pub type TileFn = unsafe fn(n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]);

/// The weight rows a tile kernel takes per call.
pub const TILE_ROWS: [usize; 2] = [2, 4];

/// Most weight rows a tile kernel takes.
pub const MAX_TILE_ROWS: usize = 4;

/// Weight rows per call of a wide multi-row kernel (for more than [`MAX_NY`] tokens); it also
/// takes 4.
pub const WIDE_TILE_ROWS: usize = 2;

/// A dot-product kernel for one weight type.
#[derive(Clone, Copy)]
pub struct Kernel {
    pub ty: GgmlType,
    /// The level of the code that runs (may be below the level asked for).
    pub isa: Isa,
    /// None: the scalar reference of tandem-quant.
    f: Option<KernelFn>,
    /// A multi-row kernel of the same level.
    tile: Option<TileFn>,
    /// A single-row kernel of the same level for up to [`MAX_WIDE`] rows (each weight block
    /// unpacked once for all of them), bit-identical to `f`.
    wide: Option<KernelFn>,
    /// A multi-row kernel of the same level for more than [`MAX_NY`] (up to [`MAX_WIDE`]) tokens,
    /// taking each of [`WIDE_TILE_ROWS`] weight rows, bit-identical to `wide`.
    wide_tile: Option<TileFn>,
    /// The single-row kernel asks for the weight bytes ahead of what it reads itself (for one token).
    prefetches: bool,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({} {})", self.ty, self.isa)
    }
}

impl Kernel {
    /// `out[j] = dot(w, ys[j])` for `out.len()` activation rows of `n` elements.
    ///
    /// Panics when the lengths do not match `n` (callers validate shapes once per matrix).
    #[inline]
    pub fn run(&self, n: usize, w: &[u8], ys: &[u8], out: &mut [f32]) {
        let ny = out.len();
        let wb = row_size(self.ty, n).unwrap_or(usize::MAX);
        let yb = row_size(vec_dot_type(self.ty), n).unwrap_or(usize::MAX);
        assert!(
            (1..=self.max_tokens()).contains(&ny) && w.len() == wb && Some(ys.len()) == yb.checked_mul(ny),
            "kernel {} {}: {n} elements, {} weight bytes, {} activation bytes for {ny} rows",
            self.ty,
            self.isa,
            w.len(),
            ys.len()
        );
        // SAFETY: lengths checked above.
        unsafe { self.run_unchecked(n, w, ys, out) }
    }

    /// [`Kernel::run`] without the length checks, for callers that checked a whole matrix once.
    ///
    /// # Safety
    /// `w.len() == row_size(ty, n)`, `ys.len() == out.len() * row_size(vec_dot_type(ty), n)` and
    /// `1 <= out.len() <= self.max_tokens()`.
    #[inline]
    pub unsafe fn run_unchecked(&self, n: usize, w: &[u8], ys: &[u8], out: &mut [f32]) {
        let ny = out.len();
        match (self.f, self.wide) {
            // SAFETY: the caller checked the lengths; `kernel` only hands out code the machine
            // supports.
            (_, Some(wide)) if ny > MAX_NY => unsafe { wide(n, w, ys, ny, out) },
            // SAFETY: as above.
            (Some(f), _) => unsafe { f(n, w, ys, ny, out) },
            (None, _) => {
                let yb = ys.len() / ny.max(1);
                for (o, y) in out.iter_mut().zip(ys.chunks_exact(yb.max(1))) {
                    *o = vec_dot(self.ty, n, w, y).unwrap_or(f32::NAN);
                }
            }
        }
    }
}

impl Kernel {
    /// Most activation rows [`Kernel::run`] takes: [`MAX_WIDE`] where the kernel has a wide
    /// variant (the IQ1/IQ2/IQ3 types), else [`MAX_NY`].
    #[inline]
    pub fn max_tokens(&self) -> usize {
        if self.wide.is_some() {
            MAX_WIDE
        } else {
            MAX_NY
        }
    }

    /// Whether a single-token call asks for the weight bytes ahead of the ones it reads itself
    /// (the k-quants' SIMD kernels, a few lines per block); otherwise the caller may.
    #[inline]
    pub fn prefetches(&self) -> bool {
        self.prefetches
    }

    /// Whether this kernel has a multi-row (tile) kernel of its own ([`Kernel::run_tile`] takes
    /// every count of [`TILE_ROWS`] then).
    #[inline]
    pub fn has_tile(&self) -> bool {
        self.tile.is_some()
    }

    /// The weight rows per call (one of [`TILE_ROWS`], or [`WIDE_TILE_ROWS`] beyond [`MAX_NY`]
    /// tokens) for `ny` tokens, where this kernel has a multi-row (tile) kernel that beats the
    /// single-row one there: none for one token (decode).
    #[inline]
    pub fn tile_rows(&self, ny: usize) -> Option<usize> {
        if ny > MAX_NY {
            return self.wide_tile.map(|_| WIDE_TILE_ROWS);
        }
        // Measured on Zen 4 (Q4_K/Q6_K, `tile_throughput`): zmm with 4 rows wins 10-25% from 6
        // tokens on; below, 2 rows are even (VNNI) or 3-5% behind (AVX-512). AVX2 (16 ymm, the
        // NR x NY accumulators live in memory): 4 rows win at 2-7 tokens, lose 5-10% at 8.
        // The 32-element block types (VNNI only), measured the same way on Zen 5 (Q8_0): 4 rows win
        // ~30% at 2 and 8 tokens, 2 rows ~10% at 3-5, neither at 6-7.
        if self.tile.is_some() && self.ty.block_size() == 32 {
            return match ny {
                2 | 8 => Some(4),
                3..=5 => Some(2),
                _ => None,
            };
        }
        self.tile.and(match (self.isa, ny) {
            (_, 0 | 1) => None,
            (Isa::Avx2, 2..MAX_NY) => Some(4),
            (Isa::Avx2, _) => None,
            (Isa::Avx512, 2..6) => None,
            (_, 2..6) => Some(2),
            _ => Some(4),
        })
    }

    /// `out[r * ny + j] = dot(w_r, ys[j])` for `nr` weight rows back to back in `w` and `ny`
    /// activation rows of `n` elements, `out.len() == nr * ny`: bit-identical to [`Kernel::run`]
    /// on each weight row. `nr` is one of [`TILE_ROWS`] or, without a tile kernel, any count (one
    /// single-row call per row).
    ///
    /// Panics when the lengths do not match `n`, and for `n == 0` (no row count to read off `w`).
    pub fn run_tile(&self, n: usize, w: &[u8], ys: &[u8], out: &mut [f32]) {
        let wb = row_size(self.ty, n).unwrap_or(usize::MAX);
        let yb = row_size(vec_dot_type(self.ty), n).unwrap_or(usize::MAX);
        let nr = w.len().checked_div(wb).unwrap_or(usize::MAX);
        let ny = ys.len().checked_div(yb).unwrap_or(usize::MAX);
        let wide = ny > MAX_NY && self.wide_tile.is_some();
        assert!(
            (1..=self.max_tokens()).contains(&ny)
                && (if wide {
                    [2, 4].contains(&nr)
                } else if self.tile.is_some() {
                    TILE_ROWS.contains(&nr)
                } else {
                    nr >= 1
                })
                && w.len() == nr * wb
                && ys.len() == ny * yb
                && out.len() == nr * ny,
            "tile kernel {} {}: {n} elements, {} weight bytes, {} activation bytes, {} outputs",
            self.ty,
            self.isa,
            w.len(),
            ys.len(),
            out.len()
        );
        // SAFETY: lengths checked above.
        unsafe { self.run_tile_unchecked(n, w, ys, ny, out) }
    }

    /// [`Kernel::run_tile`] without the length checks.
    ///
    /// # Safety
    /// `1 <= ny <= MAX_NY`, `ys.len() == ny * row_size(vec_dot_type(ty), n)`, `out.len() == nr * ny`
    /// and `w.len() == nr * row_size(ty, n)` with `nr` in [`TILE_ROWS`] (any `nr >= 1` without a tile kernel).
    #[inline]
    pub unsafe fn run_tile_unchecked(&self, n: usize, w: &[u8], ys: &[u8], ny: usize, out: &mut [f32]) {
        match (self.tile, self.wide_tile) {
            // SAFETY: the caller checked the lengths; `kernel` only hands out code the machine
            // supports.
            (_, Some(f)) if ny > MAX_NY => unsafe { f(n, w, ys, ny, out) },
            // SAFETY: as above.
            (Some(f), _) if ny <= MAX_NY => unsafe { f(n, w, ys, ny, out) },
            _ => {
                let nr = out.len() / ny;
                let wb = w.len() / nr.max(1);
                for (r, o) in out.chunks_exact_mut(ny).enumerate() {
                    // SAFETY: one weight row of the `nr` the caller checked.
                    unsafe { self.run_unchecked(n, &w[r * wb..(r + 1) * wb], ys, o) }
                }
            }
        }
    }
}

/// The best kernel for `ty` at or below `isa` that this machine runs; None when tandem-quant has no
/// dot product for `ty`.
pub fn kernel(ty: GgmlType, isa: Isa) -> Option<Kernel> {
    if !tandem_quant::VEC_DOT_TYPES.contains(&ty) {
        return None;
    }
    for level in Isa::ALL.into_iter().rev().filter(|l| *l <= isa && l.supported()) {
        if level == Isa::Scalar {
            break;
        }
        let kq = kquants::lookup(ty, level);
        if let Some(f) = kq.or_else(|| legacy::lookup(ty, level)) {
            let tile = kquants::lookup_tile(ty, level).or_else(|| legacy::lookup_tile(ty, level));
            let wide = kquants::lookup_wide(ty, level);
            let wide_tile = wide.and(kquants::lookup_wide_tile(ty, level));
            return Some(Kernel { ty, isa: level, f: Some(f), tile, wide, wide_tile, prefetches: kq.is_some() });
        }
    }
    Some(Kernel { ty, isa: Isa::Scalar, f: None, tile: None, wide: None, wide_tile: None, prefetches: false })
}

/// The kernel [`Isa::detected`] selects for `ty`, cached per type.
pub fn best_kernel(ty: GgmlType) -> Option<Kernel> {
    static TABLE: OnceLock<Vec<(GgmlType, Kernel)>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        tandem_quant::VEC_DOT_TYPES.iter().filter_map(|&t| kernel(t, Isa::detected()).map(|k| (t, k))).collect()
    });
    table.iter().find(|(t, _)| *t == ty).map(|(_, k)| *k)
}

/// The levels at which `ty` has its own SIMD code (whether or not this machine runs them).
pub fn simd_levels(ty: GgmlType) -> Vec<Isa> {
    Isa::ALL[1..]
        .iter()
        .copied()
        .filter(|&l| kquants::lookup(ty, l).or_else(|| legacy::lookup(ty, l)).is_some())
        .collect()
}
