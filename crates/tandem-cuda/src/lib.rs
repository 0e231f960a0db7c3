//! CUDA backend on cudarc with dynamic loading: the binary starts on machines without libcuda and
//! reports why there is no GPU instead of failing to link.
//!
//! * With the `cuda` feature, [`Runtime::open`] loads the driver, opens one device, loads the
//!   kernel images the root package embedded (kernels/ABI.md: the cubin of the device's
//!   architecture, else the newest PTX the device can JIT), and offers device buffers, typed
//!   launches of every ABI entry point, cuBLAS gemm for prefill and pinned staging for host copies.
//! * Without it, this crate is the same-named stand-in (STYLE.md 2): [`init`], [`devices`] and
//!   [`Runtime::open`] answer [`Error::BuiltWithoutCuda`], so callers never write
//!   `#[cfg(feature = "cuda")]`.

mod error;
mod image;

#[cfg(feature = "cuda")]
mod runtime;
#[cfg(not(feature = "cuda"))]
#[path = "stub.rs"]
mod runtime;

pub use error::{Error, Result};
pub use half::f16;
pub use image::{Image, ImageKind};
pub use runtime::{devices, init, DeviceBuffer, Runtime};
pub use tandem_quant::GgmlType;

/// Whether this build has the CUDA runtime (the `cuda` feature).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// Most tokens one `tandem_matvec_*` launch handles (kernels/ABI.md); more go through cuBLAS.
pub const MAX_MATVEC_TOKENS: usize = 8;

/// Largest `dk` and `dv` of `tandem_attn_f16` (its shared-memory tiles; kernels/attention.cu).
pub const ATTN_MAX_HEAD_DIM: usize = 1024;
/// Most experts `tandem_router_f32` handles (kernels/router.cu).
pub const ROUTER_MAX_EXPERT: usize = 1024;

/// Weight types with a `tandem_matvec_<t>` and a `tandem_dequant_<t>_f16` kernel.
pub const MATVEC_TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// One CUDA device as the driver describes it; the planner can use `free_bytes` as the budget
/// when no `--gpu CUDAn=SIZE` is declared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `n` of `CUDAn`.
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0) for an H100/H200.
    pub compute_capability: (u32, u32),
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl DeviceInfo {
    /// `major * 10 + minor`, as in `sm_90`.
    pub fn sm(&self) -> u32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }

    /// `CUDA0 (NVIDIA H200, sm_90, 139.8 GiB free of 140.4 GiB)`.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "CUDA{} ({}, sm_{}, {:.1} GiB free of {:.1} GiB)",
            self.ordinal,
            self.name,
            self.sm(),
            gib(self.free_bytes),
            gib(self.total_bytes)
        )
    }
}

/// Element types of device buffers. Sealed: only the types the kernels take.
#[cfg(feature = "cuda")]
pub trait Elem:
    sealed::Sealed + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + Send + Sync + 'static
{
}
/// Element types of device buffers. Sealed: only the types the kernels take.
#[cfg(not(feature = "cuda"))]
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for u8 {}
impl Elem for i32 {}
impl Elem for half::f16 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u8 {}
    impl Sealed for i32 {}
    impl Sealed for half::f16 {}
}

/// Expert gating of [`Runtime::router`] (the ABI's `gating`: 1 softmax, 2 sigmoid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax = 1,
    Sigmoid = 2,
}

/// How [`Runtime::router`] picks experts; exactly `Moe::route` of tandem-model.
#[derive(Clone, Copy, Debug)]
pub struct RouterParams {
    pub n_expert: usize,
    pub n_used: usize,
    pub gating: Gating,
    pub n_group: usize,
    pub n_group_used: usize,
    pub norm: bool,
    pub scale: f32,
}

/// Shapes of one [`Runtime::attention`] call (kernels/ABI.md `tandem_attn_f16`).
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_tokens: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    /// Elements between K rows (`n_head_kv * dk` for a dense cache).
    pub k_stride: usize,
    /// Elements between V rows; ignored when V is read from K (MLA).
    pub v_stride: usize,
    pub scale: f32,
    /// Parts the rows are split into (flash-decoding); 1 or more.
    pub n_split: usize,
}

/// The file and entry point of every kernel the runtime launches (kernels/ABI.md).
pub fn entry_points() -> Vec<(&'static str, String)> {
    let mut v: Vec<(&'static str, String)> = vec![
        ("rmsnorm", "tandem_rmsnorm_f32".into()),
        ("rope", "tandem_rope_f32".into()),
        ("swiglu", "tandem_swiglu_f32".into()),
        ("add", "tandem_add_f32".into()),
        ("add", "tandem_scale_add_f32".into()),
        ("add", "tandem_scale_f32".into()),
        ("router", "tandem_router_f32".into()),
        ("dequant", "tandem_f32_to_f16".into()),
        ("attention", "tandem_attn_f16".into()),
        ("attention", "tandem_attn_combine".into()),
    ];
    for t in MATVEC_TYPES {
        v.push(("matvec", matvec_name(t)));
        v.push(("dequant", dequant_name(t)));
    }
    v
}

/// `tandem_matvec_<t>`.
pub fn matvec_name(t: GgmlType) -> String {
    format!("tandem_matvec_{}", t.name())
}

/// `tandem_dequant_<t>_f16`.
pub fn dequant_name(t: GgmlType) -> String {
    format!("tandem_dequant_{}_f16", t.name())
}

/// Bytes of `n` elements of weight type `t`, or an error naming the shape.
pub fn weight_bytes(t: GgmlType, rows: usize, cols: usize) -> Result<usize> {
    let row = t
        .row_bytes(cols as u64)
        .ok_or_else(|| Error::Shape(format!("{t}: a row of {cols} values is not a whole number of blocks")))?;
    usize::try_from(row)
        .ok()
        .and_then(|r| r.checked_mul(rows))
        .ok_or_else(|| Error::Shape(format!("{t}: {rows} x {cols} is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_follow_the_abi() {
        let e = entry_points();
        assert!(e.iter().any(|(f, n)| *f == "matvec" && n == "tandem_matvec_q4_K"));
        assert!(e.iter().any(|(f, n)| *f == "dequant" && n == "tandem_dequant_iq4_xs_f16"));
        assert!(e.iter().any(|(f, n)| *f == "attention" && n == "tandem_attn_combine"));
        assert_eq!(e.len(), 10 + 2 * MATVEC_TYPES.len());
    }

    #[test]
    fn device_description() {
        let d = DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            total_bytes: 140 << 30,
            free_bytes: 139 << 30,
        };
        assert_eq!(d.sm(), 90);
        assert_eq!(d.describe(), "CUDA0 (NVIDIA H200, sm_90, 139.0 GiB free of 140.0 GiB)");
    }

    #[test]
    fn weight_bytes_need_whole_blocks() {
        assert_eq!(weight_bytes(GgmlType::Q4_K, 2, 256).unwrap(), 288);
        assert!(weight_bytes(GgmlType::Q4_K, 2, 100).unwrap_err().to_string().contains("whole number of blocks"));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn the_stand_in_says_why() {
        assert_eq!(init().unwrap_err().to_string(), "tandem was built without CUDA support");
        assert!(matches!(Runtime::open(&[], 0), Err(Error::BuiltWithoutCuda)));
        assert!(matches!(devices(), Err(Error::BuiltWithoutCuda)));
    }
}
