//! CPU backend of tandem: quantized matrix multiplication with activations quantized to the type
//! ggml pairs with each weight type, attention over a KV cache, and the element-wise ops of a
//! transformer layer, as ggml's CPU backend computes them (ggml/src/ggml-cpu/ops.cpp), with
//! SIMD kernels selected at run time (AVX2 and AVX-512 levels, capped by `TANDEM_CPU_ISA`) and
//! checked against the scalar reference code.
//!
//! Modules, from the top down:
//!
//! * `backend`: [`CpuBackend`], the operations of a forward pass over host slices and weights in
//!   place from the memory map (or their packed copies): what tandem-model's host device calls.
//! * `pool`: [`Threads`], the thread pools for single-token steps and for batches.
//! * `jobs`: several matrix products of one step ([`MatJob`], [`FfnJob`]) cut into row blocks and
//!   run in one parallel step.
//! * `matmul`: quantized `y = W x` ([`matmul()`], [`WeightRef`]), activations quantized first
//!   ([`quantize_activations`]).
//! * [`kernels`]: the dot-product kernels of every weight type, scalar and SIMD, picked at run
//!   time ([`kernel`], [`Isa`]).
//! * [`packed`]: `--repack`, weights rearranged at load for the 16-rows-per-register kernels.
//! * `prefetch`: the software prefetch hint the single-token kernels use ([`Prefetch`]).
//! * `attention`: one token's attention over a cache of f32, f16, bf16 or q8_0 rows
//!   ([`attention()`], [`Attn`], [`KvType`]), by chunks past [`FLASH_MIN`] rows.
//! * `mla`: multi-head latent attention in the decompressed form for a prefill ([`mla_prefill`]),
//!   on the f32 matrix products of `gemm`.
//! * `gemm`: f32 matrix products with the same bits at every SIMD level.
//! * `vmath`: f32 vector math shared by the above: the SIMD level of the f32 kernels, ggml's vector
//!   exp, the softmax's pieces, SwiGLU.
//! * `ops`: the element-wise ops ([`rmsnorm`], [`rope`], [`silu_mul`], [`softmax_in_place`],
//!   [`add_assign`]).
//!
//! Each module keeps its portable code (the scalar reference, the layout, the dispatch by
//! [`Isa`]) in its own file and its x86 kernels in an `x86` submodule beside it
//! (`attention/x86.rs`, `gemm/x86.rs`, `mla/x86.rs`, `vmath/x86.rs`; `kernels/x86/` and
//! `packed/x86/` hold a file or directory per family), compiled only for x86_64: a second
//! architecture adds a sibling (`aarch64.rs`) and a dispatch arm, not edits across the kernels.

/// Calls `$f::<G.., NY>(args)` for `by_ny!(ny, f[G..](args))` with the run-time `ny` (1..=8,
/// checked by the callers) as the constant `NY`, so per-token accumulators live in registers; the
/// generic arguments `G` may be types or constants.
#[cfg(target_arch = "x86_64")]
macro_rules! by_ny {
    ($ny:expr, $f:ident[$($g:tt),*]($($a:expr),*)) => {
        match $ny {
            1 => $f::<$($g,)* 1>($($a),*),
            2 => $f::<$($g,)* 2>($($a),*),
            3 => $f::<$($g,)* 3>($($a),*),
            4 => $f::<$($g,)* 4>($($a),*),
            5 => $f::<$($g,)* 5>($($a),*),
            6 => $f::<$($g,)* 6>($($a),*),
            7 => $f::<$($g,)* 7>($($a),*),
            8 => $f::<$($g,)* 8>($($a),*),
            _ => {}
        }
    };
}

/// [`by_ny!`] for the single-token kernels that prefetch the weights they stream: also passes the
/// processor's prefetch hint (`crate::prefetch::PF_*`) as the constant before `NY`, read once per
/// call instead of at every prefetch. Batches (`NY > 1`) do not prefetch and get `PF_OFF`. With
/// `hint = EXPR,` first, the hint is `EXPR` instead of `crate::prefetch::hint_index()`.
#[cfg(target_arch = "x86_64")]
macro_rules! by_ny_pf {
    ($ny:expr, $f:ident[$($g:tt),*]($($a:expr),*)) => {
        by_ny_pf!(hint = crate::prefetch::hint_index(), $ny, $f[$($g),*]($($a),*))
    };
    (hint = $hint:expr, $ny:expr, $f:ident[$($g:tt),*]($($a:expr),*)) => {
        if $ny == 1 {
            match $hint {
                crate::prefetch::PF_NTA => $f::<$($g,)* { crate::prefetch::PF_NTA }, 1>($($a),*),
                crate::prefetch::PF_T0 => $f::<$($g,)* { crate::prefetch::PF_T0 }, 1>($($a),*),
                crate::prefetch::PF_T1 => $f::<$($g,)* { crate::prefetch::PF_T1 }, 1>($($a),*),
                _ => $f::<$($g,)* { crate::prefetch::PF_OFF }, 1>($($a),*),
            }
        } else {
            by_ny!($ny, $f[$($g,)* { crate::prefetch::PF_OFF }]($($a),*))
        }
    };
}

mod attention;
mod backend;
mod gemm;
mod jobs;
pub mod kernels;
mod matmul;
mod mla;
mod ops;
pub mod packed;
mod pool;
mod prefetch;
pub mod testing;
mod vmath;

/// The fastest of `reps` alternating runs of `a` and of `b` on `state`, in seconds each: the
/// speed tests' comparison of two ways to the same result.
#[cfg(test)]
pub(crate) fn fastest_of_two<S>(
    reps: usize,
    state: &mut S,
    mut a: impl FnMut(&mut S),
    mut b: impl FnMut(&mut S),
) -> (f64, f64) {
    let (mut ta, mut tb) = (f64::MAX, f64::MAX);
    for _ in 0..reps {
        let t = std::time::Instant::now();
        a(state);
        ta = ta.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        b(state);
        tb = tb.min(t.elapsed().as_secs_f64());
    }
    (ta, tb)
}

/// Values in [-1, 1) from an xorshift generator seeded with `seed`, shared by the unit tests.
#[cfg(test)]
pub(crate) fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut rng = testing::Rng(seed);
    move || rng.uniform()
}

/// [`testing::data`] for the unit tests.
#[cfg(test)]
pub(crate) use testing::data as test_data;

pub use attention::{attention, attention_many, Attn, KvType, FLASH_MIN};
pub use backend::{CpuBackend, MlaDecompressed, RebuiltRows};
pub use jobs::{ffn_jobs, matmul_jobs, FfnJob, MatJob};
pub use kernels::{best_kernel, kernel, Isa, Kernel, MAX_NY, MAX_WIDE};
pub use matmul::{matmul, matmul_quantized, quantize_activations, QuantizedActs, WeightRef};
pub use mla::{cache_rows_f32, mla_prefill, MlaHeads, MlaPrefill};
pub use ops::{add_assign, rmsnorm, rope, silu_mul, softmax_in_place, RopeParams, RopeStyle};
pub use pool::Threads;
#[cfg(target_arch = "x86_64")]
pub(crate) use prefetch::prefetch_stream;
pub use prefetch::Prefetch;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Quant(#[from] tandem_quant::Error),
    #[error("{0}")]
    Shape(String),
    #[error("{0}")]
    Memory(String),
    #[error("cannot start a pool of {threads} threads: {msg}")]
    Pool { threads: usize, msg: String },
}

pub type Result<T> = std::result::Result<T, Error>;
