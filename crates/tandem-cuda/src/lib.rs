//! The CUDA backend: a [`Runtime`] per device with tandem's kernels (kernels/*.cu, kernels/ABI.md),
//! device memory from a caching pool, copies, typed launches that check every shape, and a
//! [`Ledger`] of launches, copies and host waits.
//!
//! * With the `cuda` feature, [`Runtime::open`] drives a GPU through cudarc with dynamic loading
//!   (the binary starts on machines without libcuda and says why there is no GPU), loading the
//!   kernel images the root package embedded.
//! * With the `emulate` feature, [`Runtime::emulated`] runs the same kernels compiled for the host
//!   (kernels/host/), so the runtime, the kernels and the executor above them are tested on
//!   machines without a GPU.
//! * Without either, [`init`], [`devices`] and [`Runtime::open`] answer
//!   [`Error::BuiltWithoutCuda`] (STYLE.md 2): callers never write `#[cfg(feature = "cuda")]`.

#![cfg_attr(not(any(feature = "cuda", feature = "emulate")), allow(dead_code))]

mod driver;
mod entry_points;
mod error;
mod image;
mod ledger;
mod memory;
mod runtime;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "emulate")]
mod emu;

pub use entry_points::{all_entry_points as entry_points, CACHE_TYPE_NAMES, MATVEC_TYPE_NAMES};
pub use error::{Error, Result};
pub use half::f16;
pub use image::{Image, ImageKind};
pub use ledger::{Counts, Ledger};
pub use memory::{DeviceBuffer, Span};
pub use runtime::{DequantOut, GemmPrecision, Packet, Reading, Runtime};
pub use tandem_quant::GgmlType;

/// Whether this build has the CUDA runtime (the `cuda` feature).
pub const BUILT_WITH_CUDA: bool = cfg!(feature = "cuda");

/// Loads the driver and checks that it initializes.
pub fn init() -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        cuda::init()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::BuiltWithoutCuda)
    }
}

/// Every CUDA device with its name, compute capability and memory.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    #[cfg(feature = "cuda")]
    {
        cuda::devices()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(Error::BuiltWithoutCuda)
    }
}

/// Most tokens one `tandem_matvec_*` launch handles (kernels/ABI.md); more go through cuBLAS.
pub const MAX_MATVEC_TOKENS: usize = 8;

/// Largest `dk` and `dv` of `tandem_attn_*` (its shared-memory tiles; kernels/attention.cu).
pub const ATTN_MAX_HEAD_DIM: usize = 1024;
/// Query heads per block of `tandem_attn_mla_*`, and its largest latent row and value
/// (kernels/attention.cu).
pub const MLA_HEADS: usize = 4;
pub const MLA_MAX_DK: usize = 576;
pub const MLA_MAX_DV: usize = 512;
/// Most experts `tandem_router_f32` handles (kernels/router.cu).
pub const ROUTER_MAX_EXPERT: usize = 1024;
/// Bytes of a [`KvMeta`].
pub const KV_META_BYTES: usize = 16;

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

/// Element types of device buffers. Sealed: only the plain value types the kernels take.
pub trait Elem: sealed::Sealed + Copy + Default + Send + Sync + 'static {}
impl Elem for f32 {}
impl Elem for u8 {}
impl Elem for u16 {}
impl Elem for i32 {}
impl Elem for half::f16 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for u8 {}
    impl Sealed for u16 {}
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

/// Shapes of one [`Runtime::attention`] call.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_tokens: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    pub scale: f32,
    /// Parts the rows are split into (flash-decoding); 1 or more.
    pub n_split: usize,
}

/// The formats of the KV cache on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheKind {
    F16,
    BF16,
    Q8_0,
}

impl CacheKind {
    pub fn of(ty: GgmlType) -> Option<CacheKind> {
        match ty {
            GgmlType::F16 => Some(CacheKind::F16),
            GgmlType::BF16 => Some(CacheKind::BF16),
            GgmlType::Q8_0 => Some(CacheKind::Q8_0),
            _ => None,
        }
    }

    /// The kernels' suffix.
    pub fn name(self) -> &'static str {
        match self {
            CacheKind::F16 => "f16",
            CacheKind::BF16 => "bf16",
            CacheKind::Q8_0 => "q8_0",
        }
    }

    /// Bytes of `n` values (`None` for q8_0 when `n` is not whole blocks of 32).
    pub fn bytes(self, n: usize) -> Option<usize> {
        match self {
            CacheKind::F16 | CacheKind::BF16 => n.checked_mul(2),
            CacheKind::Q8_0 => n.is_multiple_of(32).then(|| n / 32 * 34),
        }
    }
}

/// A token's place in the KV cache, as the kernels read it (kernels/common.cuh `KvMeta`): its
/// sequence's rows start at `base`, layer `l`'s at `base + l * cap * row_bytes`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvMeta {
    pub base: u64,
    pub cap: u32,
    pub pos: u32,
}

const _: () = assert!(std::mem::size_of::<KvMeta>() == KV_META_BYTES);

impl KvMeta {
    /// The 16 bytes as the four f32 values a step's upload carries them in.
    pub fn to_f32s(self) -> [f32; 4] {
        let b = self.to_bytes();
        std::array::from_fn(|i| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]))
    }

    /// The 16 bytes the kernels read.
    pub fn to_bytes(self) -> [u8; KV_META_BYTES] {
        let mut b = [0u8; KV_META_BYTES];
        b[..8].copy_from_slice(&self.base.to_le_bytes());
        b[8..12].copy_from_slice(&self.cap.to_le_bytes());
        b[12..].copy_from_slice(&self.pos.to_le_bytes());
        b
    }
}

/// A strided copy ([`Runtime::copy_rows`]): for `r < rows`, `width` values from src at `(r /
/// src_rep) * src_stride` to dst at `r * dst_stride`.
#[derive(Clone, Copy, Debug)]
pub struct CopyRows {
    pub rows: usize,
    pub width: usize,
    pub src_stride: usize,
    pub src_rep: usize,
    pub dst_stride: usize,
}

/// How a [`Runtime::matvec`] batches: token `t` of group `g` reads x at `t * x_tok + (g /
/// x_grp_div) * x_grp`, multiplies matrix `g` (or the one `ids` names) and writes y at
/// `t * y_tok + g * y_grp`; matrices are `w_grp_bytes` apart, `n_mats` of them.
#[derive(Clone, Debug)]
pub struct Batched<'a> {
    pub n_tokens: usize,
    pub n_groups: usize,
    pub x_tok: usize,
    pub x_grp: usize,
    pub x_grp_div: usize,
    pub y_tok: usize,
    pub y_grp: usize,
    pub w_grp_bytes: usize,
    pub n_mats: usize,
    /// Expert ids (f32) and where: `(values, ids per row, row stride)`; group `g` takes id
    /// `[(g / per) * row + g % per]`.
    pub ids: Option<(Span<'a, f32>, usize, usize)>,
}

impl Batched<'_> {
    /// One matrix, `n` tokens of contiguous rows.
    pub fn plain(n: usize, rows: usize, cols: usize) -> Batched<'static> {
        Batched {
            n_tokens: n,
            n_groups: 1,
            x_tok: cols,
            x_grp: 0,
            x_grp_div: 1,
            y_tok: rows,
            y_grp: 0,
            w_grp_bytes: 0,
            n_mats: 1,
            ids: None,
        }
    }

    /// One matrix per head, `w_head_bytes` apart: head `h` of token `t` reads `x_head` values at
    /// `(t * n_heads + h) * x_head` and writes `y_head` values at `(t * n_heads + h) * y_head`.
    pub fn per_head(n: usize, n_heads: usize, x_head: usize, y_head: usize, w_head_bytes: usize) -> Batched<'static> {
        Batched {
            n_tokens: n,
            n_groups: n_heads,
            x_tok: n_heads * x_head,
            x_grp: x_head,
            x_grp_div: 1,
            y_tok: n_heads * y_head,
            y_grp: y_head,
            w_grp_bytes: w_head_bytes,
            n_mats: n_heads,
            ids: None,
        }
    }
}

/// `tandem_matvec_<t>`.
pub fn matvec_name(t: GgmlType) -> String {
    format!("tandem_matvec_{}", t.name())
}

/// `tandem_dequant_<t>_f16`, or `_f32` with `f32`.
pub fn dequant_name(t: GgmlType, f32: bool) -> String {
    format!("tandem_dequant_{}_{}", t.name(), if f32 { "f32" } else { "f16" })
}

/// Bytes of `rows` rows of `cols` values of weight type `t`, or an error naming the shape.
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
        assert!(e.iter().any(|(f, n)| *f == "attention" && n == "tandem_attn_mla_q8_0"));
        assert!(e.iter().any(|(f, n)| *f == "kv" && n == "tandem_kv_store_bf16"));
        assert!(e.iter().any(|(f, n)| *f == "dequant" && n == "tandem_dequant_q6_K_f32"));
        // matvec, dequant to f16 and to f32 per weight type; store, attn and attn_mla per cache type.
        assert_eq!(e.len(), 18 + 3 * MATVEC_TYPE_NAMES.len() + 3 * CACHE_TYPE_NAMES.len());
        for (t, n) in MATVEC_TYPES.iter().zip(MATVEC_TYPE_NAMES) {
            assert_eq!(t.name(), n);
        }
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

    #[test]
    fn kv_meta_is_what_the_kernels_read() {
        let m = KvMeta { base: 0x1122_3344_5566_7788, cap: 9, pos: 0x0102_0304 };
        let b = m.to_bytes();
        assert_eq!(&b[..8], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[8..12], &9u32.to_le_bytes());
        assert_eq!(&b[12..], &0x0102_0304u32.to_le_bytes());
        assert_eq!(CacheKind::Q8_0.bytes(576), Some(612));
        assert_eq!(CacheKind::Q8_0.bytes(40), None);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn the_stand_in_says_why() {
        assert_eq!(init().unwrap_err().to_string(), "tandem was built without CUDA support");
        assert!(matches!(Runtime::open(&[], 0), Err(Error::BuiltWithoutCuda)));
        assert!(matches!(devices(), Err(Error::BuiltWithoutCuda)));
    }
}
