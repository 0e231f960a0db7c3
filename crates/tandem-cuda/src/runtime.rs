//! [`Runtime`]: one device (a GPU, or the host emulator) with tandem's kernels: memory from a
//! caching pool, copies, and a typed launch per kernel that checks every shape before it queues
//! the kernel (STYLE.md 4), counting launches, copies and host waits in its [`Ledger`].
//! Everything is queued on one stream; only [`Runtime::read`] and [`Runtime::synchronize`] wait.

use crate::driver::{Driver, Gemm};
use crate::memory::{DeviceBuffer, Pool};
use crate::{
    dequant_name, matvec_name, weight_bytes, AttnShape, Batched, CacheKind, CopyRows, DeviceInfo, Elem, Error, Image,
    Ledger, Result, RouterParams, ATTN_MAX_HEAD_DIM, MATVEC_TYPES, MAX_MATVEC_TOKENS, MLA_HEADS, MLA_MAX_DK,
    MLA_MAX_DV, ROUTER_MAX_EXPERT,
};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use tandem_quant::GgmlType;

/// Elements of a weight dequantized at once for a prefill gemm (64 MiB of f32).
const GEMM_CHUNK_ELEMS: usize = 16 << 20;
/// Threads per block of the 1-D kernels (kernels/ABI.md).
const BLOCK_1D: u32 = 256;
/// Most blocks of a grid-stride kernel.
const MAX_GRID_STRIDE_BLOCKS: usize = 1 << 16;
/// Block of tandem_attn_* and tandem_attn_combine, and of tandem_attn_mla_*.
const ATTN_THREADS: u32 = 128;
const MLA_THREADS: u32 = 256;

/// Argument pointers for a launch: each value must be a local of the exact C type.
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$(&$a as *const _ as *mut c_void),*] };
}

/// How a prefill gemm (more than [`MAX_MATVEC_TOKENS`] tokens) multiplies a quantized weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPrecision {
    /// The weight dequantized to f32 and an f32 gemm (cuBLAS `CUBLAS_COMPUTE_32F`, no TF32): the
    /// products of the values given, so activations rounded as the CPU rounds them
    /// (`Runtime::round_acts`) give the CPU's results up to float order. The default.
    F32,
    /// The weight dequantized to f16 and the activations scaled per token into f16's range, an
    /// f16 gemm with f32 accumulation (tensor cores): faster, but each value rounded to 11 bits,
    /// so prefill logits move by the rounding the CPU does not do (`TANDEM_CUDA_GEMM=f16`).
    F16,
}

impl GemmPrecision {
    /// `TANDEM_CUDA_GEMM`: `f32` (or unset) or `f16`.
    pub fn from_env() -> Result<GemmPrecision> {
        match std::env::var("TANDEM_CUDA_GEMM") {
            Err(_) => Ok(GemmPrecision::F32),
            Ok(v) if v == "f32" => Ok(GemmPrecision::F32),
            Ok(v) if v == "f16" => Ok(GemmPrecision::F16),
            Ok(v) => Err(Error::GemmSetting(v)),
        }
    }
}

/// Scratch of the prefill gemm: the dequantized weight chunk (f32, or f16 bits), and for the f16
/// gemm the scaled activations and their per-token scales.
#[derive(Default)]
struct GemmScratch {
    w32: Option<DeviceBuffer<f32>>,
    w: Option<DeviceBuffer<u16>>,
    x: Option<DeviceBuffer<u16>>,
    scales: Option<DeviceBuffer<f32>>,
}

/// The element types [`Runtime::dequant`] writes: f32, or f16 as its bits.
pub trait DequantOut {
    const F32: bool;
}
impl DequantOut for f32 {
    const F32: bool = true;
}
impl DequantOut for u16 {
    const F32: bool = false;
}

/// A copy to the host in flight ([`Runtime::read_begin`]).
#[derive(Debug)]
#[must_use = "a read begun is ended with Runtime::read_end"]
pub struct Reading {
    ticket: usize,
    bytes: usize,
}

/// One device with tandem's kernels loaded.
pub struct Runtime {
    drv: Arc<dyn Driver>,
    pool: Arc<Pool>,
    ledger: Ledger,
    emulated: bool,
    gemm: Mutex<GemmScratch>,
    precision: GemmPrecision,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({})", self.info().describe())
    }
}

/// A kernel's `int` argument, or a shape error when it does not fit.
fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Shape(format!("{what}: {v} does not fit a 32-bit int")))
}

fn long(v: usize, what: &str) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::Shape(format!("{what}: {v} does not fit a 64-bit int")))
}

/// The address of the [`crate::KvMeta`]s of `n` tokens at value `off` of an f32 buffer (4 values
/// per token, 8-byte aligned for their u64).
fn meta_ptr(meta: &DeviceBuffer<f32>, off: usize, n: usize, what: &str) -> Result<u64> {
    if !off.is_multiple_of(2) {
        return Err(Error::Shape(format!("{what}: metadata at an odd offset {off}")));
    }
    meta.at(off, n * crate::KV_META_BYTES / 4, what)
}

fn grid(n: usize) -> Result<u32> {
    u32::try_from(n).ok().filter(|&g| g < (1 << 31)).ok_or_else(|| Error::Shape(format!("a grid of {n} blocks")))
}

fn grid_yz(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).ok().filter(|&g| g <= 65535).ok_or_else(|| Error::Shape(format!("{what}: {n} exceeds 65535")))
}

impl Runtime {
    fn new(drv: Arc<dyn Driver>, emulated: bool) -> Result<Runtime> {
        let pool = Pool::new(drv.clone());
        let precision = GemmPrecision::from_env()?;
        Ok(Runtime {
            drv,
            pool,
            ledger: Ledger::default(),
            emulated,
            gemm: Mutex::new(GemmScratch::default()),
            precision,
        })
    }

    /// How prefill gemms multiply quantized weights (`TANDEM_CUDA_GEMM`, read when the runtime opened).
    pub fn gemm_precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Sets how prefill gemms multiply quantized weights.
    pub fn set_gemm_precision(&mut self, p: GemmPrecision) {
        self.precision = p;
    }

    /// Opens CUDA device `ordinal` and loads `images` (the root's `tandem::kernels::images()`):
    /// per kernel file the cubin of the device's architecture, else the newest PTX it can JIT.
    pub fn open(images: &[Image], ordinal: usize) -> Result<Runtime> {
        #[cfg(feature = "cuda")]
        {
            Runtime::new(Arc::new(crate::cuda::Cuda::open(images, ordinal)?), false)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (images, ordinal);
            Err(Error::BuiltWithoutCuda)
        }
    }

    /// The host emulator: the same kernels compiled for the CPU (the `emulate` feature), for
    /// tests on machines without a GPU.
    pub fn emulated() -> Result<Runtime> {
        #[cfg(feature = "emulate")]
        {
            Runtime::new(Arc::new(crate::emu::Emulator::new()?), true)
        }
        #[cfg(not(feature = "emulate"))]
        {
            Err(Error::Emulator("tandem-cuda was built without the `emulate` feature".into()))
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        self.drv.info()
    }

    /// Whether this is the host emulator.
    pub fn is_emulated(&self) -> bool {
        self.emulated
    }

    /// Which image of each kernel file was loaded, e.g. `["add: cubin sm_90", ...]`.
    pub fn loaded_images(&self) -> &[String] {
        self.drv.loaded_images()
    }

    /// Whether the kernel `name` (an ABI entry point) was found.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.drv.has_kernel(name)
    }

    /// Whether matrices of type `ty` can be multiplied here (a matvec kernel exists).
    pub fn supports(&self, ty: GgmlType) -> bool {
        MATVEC_TYPES.contains(&ty) && self.has_kernel(&matvec_name(ty))
    }

    /// Whether prefill gemms go through cuBLAS (else the matvec kernels, 8 tokens at a time).
    pub fn has_cublas(&self) -> bool {
        self.drv.has_blas()
    }

    /// Free and total device memory in bytes, now.
    pub fn memory(&self) -> Result<(u64, u64)> {
        self.drv.memory()
    }

    /// Launches, copies and waits so far.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Bytes the memory pool keeps for reuse.
    pub fn cached_bytes(&self) -> usize {
        self.pool.cached_bytes()
    }

    fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &mut [*mut c_void]) -> Result<()> {
        self.ledger.launch(1);
        // SAFETY: every typed launch below passes locals of the C types of the kernel's ABI
        // signature, with device pointers it checked against the buffers' lengths for the grid.
        unsafe { self.drv.launch(name, grid, block, args) }
    }

    fn launch_1d(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK_1D as usize).clamp(1, MAX_GRID_STRIDE_BLOCKS);
        self.launch(name, [blocks as u32, 1, 1], [BLOCK_1D, 1, 1], args)
    }

    // ---- memory ---------------------------------------------------------------------------------

    /// A buffer of `n` values, not zeroed; `what` names it in an out-of-memory error.
    pub fn alloc<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::new(&self.pool, n, what)
    }

    /// A buffer of `n` zeros (queued).
    pub fn zeros<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(n, what)?;
        if n > 0 {
            self.drv.memset_zero(b.at(0, n, what)?, n * std::mem::size_of::<T>())?;
            self.ledger.launch(1);
        }
        Ok(b)
    }

    /// Queues zeroing values `off..off + n` of `b`.
    pub fn fill_zero<T: Elem>(&self, b: &DeviceBuffer<T>, off: usize, n: usize) -> Result<()> {
        let p = b.at(off, n, "zero")?;
        if n > 0 {
            self.drv.memset_zero(p, n * std::mem::size_of::<T>())?;
            self.ledger.launch(1);
        }
        Ok(())
    }

    /// A new buffer holding `data` (one copy).
    pub fn upload<T: Elem>(&self, data: &[T], what: &str) -> Result<DeviceBuffer<T>> {
        let b = self.alloc::<T>(data.len(), what)?;
        self.write(&b, 0, data)?;
        Ok(b)
    }

    /// Queues a copy of `data` to `dst[offset..]` (one copy; `data` may be reused at once).
    pub fn write<T: Elem>(&self, dst: &DeviceBuffer<T>, offset: usize, data: &[T]) -> Result<()> {
        // SAFETY: `T` is a plain value type (f32, u8, u16, i32, f16): its bytes are initialized.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.write_bytes(dst, offset, bytes)
    }

    /// Queues a copy of raw bytes to `dst[offset..]`; `bytes` must be a whole number of values.
    pub fn write_bytes<T: Elem>(&self, dst: &DeviceBuffer<T>, offset: usize, bytes: &[u8]) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::Shape(format!("{} bytes are not a whole number of {size}-byte values", bytes.len())));
        }
        let p = dst.at(offset, bytes.len() / size, "write")?;
        if bytes.is_empty() {
            return Ok(());
        }
        let waits = self.drv.h2d(p, bytes)?;
        self.ledger.h2d(bytes.len());
        self.ledger.sync(waits);
        Ok(())
    }

    /// Copies `src[offset..offset + out.len()]` to `out` after all queued work (one copy, one
    /// wait).
    pub fn read<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, out: &mut [T]) -> Result<()> {
        let r = self.read_begin(src, offset, out.len())?;
        self.read_end(r, out)
    }

    /// Queues a copy of `n` values of `src[offset..]` to the host (one copy); the work queued
    /// after it does not delay it. [`Runtime::read_end`] waits for it (one wait).
    pub fn read_begin<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, n: usize) -> Result<Reading> {
        let p = src.at(offset, n, "read")?;
        let bytes = n * std::mem::size_of::<T>();
        let ticket = self.drv.d2h_begin(p, bytes)?;
        self.ledger.d2h(bytes);
        Ok(Reading { ticket, bytes })
    }

    /// Waits for a read begun with [`Runtime::read_begin`] and copies its values to `out`.
    pub fn read_end<T: Elem>(&self, r: Reading, out: &mut [T]) -> Result<()> {
        // SAFETY: as in `write`; every byte pattern is a valid value of these types.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out)) };
        if bytes.len() != r.bytes {
            return Err(Error::Shape(format!("a read of {} bytes ended into {}", r.bytes, bytes.len())));
        }
        self.ledger.sync(1);
        self.drv.d2h_end(r.ticket, bytes)
    }

    /// Queues a device-to-device copy of `n` values.
    pub fn copy<T: Elem>(
        &self,
        dst: &DeviceBuffer<T>,
        dst_off: usize,
        src: &DeviceBuffer<T>,
        src_off: usize,
        n: usize,
    ) -> Result<()> {
        let (d, s) = (dst.at(dst_off, n, "copy destination")?, src.at(src_off, n, "copy source")?);
        if n == 0 {
            return Ok(());
        }
        self.ledger.launch(1);
        self.drv.d2d(d, s, n * std::mem::size_of::<T>())
    }

    /// Waits for all queued work; a kernel that failed while running is reported here.
    pub fn synchronize(&self) -> Result<()> {
        self.ledger.sync(1);
        self.drv.synchronize()
    }

    // ---- element-wise kernels (kernels/ABI.md) -------------------------------------------------------

    /// RMS norm of `n_rows` rows of `dim` values at `x[off + r * row_stride ..]`, times `w`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm(
        &self,
        x: &DeviceBuffer<f32>,
        off: usize,
        n_rows: usize,
        row_stride: usize,
        dim: usize,
        w: Option<&DeviceBuffer<f32>>,
        eps: f32,
    ) -> Result<()> {
        if n_rows == 0 {
            return Ok(());
        }
        if dim == 0 || dim > row_stride {
            return Err(Error::Shape(format!("rmsnorm: {dim} values in rows of {row_stride}")));
        }
        let xp = x.at(off, (n_rows - 1) * row_stride + dim, "rmsnorm x")?;
        let wp = match w {
            Some(w) => w.at(0, dim, "rmsnorm weight")?,
            None => 0,
        };
        let (d, rs, yp) = (int(dim, "rmsnorm dim")?, long(row_stride, "rmsnorm")?, xp);
        self.launch("tandem_rmsnorm_f32", [grid(n_rows)?, 1, 1], [BLOCK_1D, 1, 1], &mut args![xp, wp, yp, d, rs, eps])
    }

    /// Rotary embedding of `n_rows` rows of `n_heads` heads at `x[off + t * row_stride + h *
    /// head_stride ..]`; the first `n_dims` values of each head rotate with `cs[cs_off + t * n_dims
    /// ..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &DeviceBuffer<f32>,
        off: usize,
        cs: &DeviceBuffer<f32>,
        cs_off: usize,
        n_rows: usize,
        n_heads: usize,
        head_stride: usize,
        row_stride: usize,
        n_dims: usize,
        neox: bool,
    ) -> Result<()> {
        if n_dims == 0 || !n_dims.is_multiple_of(2) || n_dims / 2 > 1024 || n_dims > head_stride {
            return Err(Error::Shape(format!("rope: {n_dims} rotated dims in heads of {head_stride}")));
        }
        if n_rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let xp = x.at(off, (n_rows - 1) * row_stride + (n_heads - 1) * head_stride + n_dims, "rope x")?;
        let cp = cs.at(cs_off, n_rows * n_dims, "rope cos/sin")?;
        let (nh, hs, rs, nd) = (
            grid_yz(n_heads, "rope heads")? as i32,
            int(head_stride, "rope")?,
            int(row_stride, "rope")?,
            n_dims as i32,
        );
        let neox = neox as i32;
        self.launch(
            "tandem_rope_f32",
            [grid(n_rows)?, nh as u32, 1],
            [(n_dims / 2) as u32, 1, 1],
            &mut args![xp, cp, nh, hs, rs, nd, neox],
        )
    }

    /// `gate[..n] = silu(gate) * up`.
    pub fn swiglu(&self, gate: &DeviceBuffer<f32>, up: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        let (g, u, n64) = (gate.at(0, n, "swiglu gate")?, up.at(0, n, "swiglu up")?, n as i64);
        self.launch_1d("tandem_swiglu_f32", n, &mut args![g, u, n64])
    }

    /// `x[..n] += y`.
    pub fn add(&self, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        let (xp, yp, n64) = (x.at(0, n, "add x")?, y.at(0, n, "add y")?, n as i64);
        self.launch_1d("tandem_add_f32", n, &mut args![xp, yp, n64])
    }

    /// `x[..n] += s * y`.
    pub fn scale_add(&self, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        let (xp, yp, n64) = (x.at(0, n, "scale_add x")?, y.at(0, n, "scale_add y")?, n as i64);
        self.launch_1d("tandem_scale_add_f32", n, &mut args![xp, yp, s, n64])
    }

    /// `x[..n] *= s`.
    pub fn scale(&self, x: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        let (xp, n64) = (x.at(0, n, "scale x")?, n as i64);
        self.launch_1d("tandem_scale_f32", n, &mut args![xp, s, n64])
    }

    /// `y[i] *= scales[i / row]` for `i < n`.
    pub fn scale_rows(&self, y: &DeviceBuffer<f32>, scales: &DeviceBuffer<f32>, row: usize, n: usize) -> Result<()> {
        if row == 0 {
            return Err(Error::Shape("scale_rows: rows of 0".into()));
        }
        let (yp, sp) = (y.at(0, n, "scale_rows y")?, scales.at(0, n.div_ceil(row), "scale_rows scales")?);
        let (r64, n64) = (row as i64, n as i64);
        self.launch_1d("tandem_scale_rows_f32", n, &mut args![yp, sp, r64, n64])
    }

    /// The strided copy `c` from `src[src_off ..]` to `dst[dst_off ..]`.
    pub fn copy_rows(
        &self,
        dst: &DeviceBuffer<f32>,
        dst_off: usize,
        src: &DeviceBuffer<f32>,
        src_off: usize,
        c: CopyRows,
    ) -> Result<()> {
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let rep = c.src_rep.max(1);
        let sp = src.at(src_off, ((c.rows - 1) / rep) * c.src_stride + c.width, "copy_rows source")?;
        let dp = dst.at(dst_off, (c.rows - 1) * c.dst_stride + c.width, "copy_rows destination")?;
        let (rows, width, ss, sr, ds) = (
            int(c.rows, "copy_rows")?,
            int(c.width, "copy_rows")?,
            long(c.src_stride, "copy_rows")?,
            int(rep, "copy_rows")?,
            long(c.dst_stride, "copy_rows")?,
        );
        self.launch_1d("tandem_copy_rows_f32", c.rows * c.width, &mut args![dp, sp, rows, width, ss, sr, ds])
    }

    // ---- MoE ----------------------------------------------------------------------------------------

    /// Expert selection for `n_tokens` rows of router logits: `ids` and `weights` are
    /// `[n_tokens][n_used]`.
    pub fn router(
        &self,
        logits: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
        n_tokens: usize,
        p: &RouterParams,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
    ) -> Result<()> {
        if p.n_used == 0
            || p.n_used > p.n_expert
            || p.n_expert > ROUTER_MAX_EXPERT
            || (p.n_group > 1
                && (!p.n_expert.is_multiple_of(p.n_group) || p.n_group_used == 0 || p.n_group_used > p.n_group))
        {
            return Err(Error::Shape(format!(
                "router: {} of {} experts in {} groups",
                p.n_used, p.n_expert, p.n_group
            )));
        }
        if n_tokens == 0 {
            return Ok(());
        }
        let lp = logits.at(0, n_tokens * p.n_expert, "router logits")?;
        let bp = match bias {
            Some(b) => b.at(0, p.n_expert, "router bias")?,
            None => 0,
        };
        let ip = ids.at(0, n_tokens * p.n_used, "router ids")?;
        let wp = weights.at(0, n_tokens * p.n_used, "router weights")?;
        let (ne, nu, gating) = (p.n_expert as i32, p.n_used as i32, p.gating as i32);
        let (ng, ngu, norm, scale) =
            (int(p.n_group, "router")?, int(p.n_group_used, "router")?, p.norm as i32, p.scale);
        self.launch(
            "tandem_router_f32",
            [grid(n_tokens)?, 1, 1],
            [32, 1, 1],
            &mut args![lp, bp, ne, nu, gating, ng, ngu, norm, scale, ip, wp],
        )
    }

    /// The packet `[n_tokens][n_embd + 2 n_used]`: each row of `h`, its expert ids (as f32), its
    /// weights.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_pack(
        &self,
        h: &DeviceBuffer<f32>,
        ids: &DeviceBuffer<i32>,
        weights: &DeviceBuffer<f32>,
        packet: &DeviceBuffer<f32>,
        n_tokens: usize,
        n_embd: usize,
        n_used: usize,
    ) -> Result<()> {
        if n_tokens == 0 {
            return Ok(());
        }
        let hp = h.at(0, n_tokens * n_embd, "moe_pack h")?;
        let ip = ids.at(0, n_tokens * n_used, "moe_pack ids")?;
        let wp = weights.at(0, n_tokens * n_used, "moe_pack weights")?;
        let pp = packet.at(0, n_tokens * (n_embd + 2 * n_used), "moe_pack packet")?;
        let (ne, nu) = (int(n_embd, "moe_pack")?, int(n_used, "moe_pack")?);
        self.launch(
            "tandem_moe_pack_f32",
            [grid(n_tokens)?, 1, 1],
            [BLOCK_1D, 1, 1],
            &mut args![hp, ip, wp, pp, ne, nu],
        )
    }

    /// `out[t] = sum over slots of weight * y[t][slot]` (weights from the packet), in slot order.
    pub fn moe_sum(
        &self,
        y: &DeviceBuffer<f32>,
        packet: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
        n_tokens: usize,
        n_embd: usize,
        n_used: usize,
    ) -> Result<()> {
        if n_tokens == 0 {
            return Ok(());
        }
        let row = n_embd + 2 * n_used;
        let yp = y.at(0, n_tokens * n_used * n_embd, "moe_sum y")?;
        let pp = packet.at(0, n_tokens * row, "moe_sum packet")?;
        let op = out.at(0, n_tokens * n_embd, "moe_sum out")?;
        let (ne, nu, pr) = (int(n_embd, "moe_sum")?, int(n_used, "moe_sum")?, int(row, "moe_sum")?);
        self.launch("tandem_moe_sum_f32", [grid(n_tokens)?, 1, 1], [BLOCK_1D, 1, 1], &mut args![yp, pp, op, ne, nu, pr])
    }

    // ---- products -----------------------------------------------------------------------------------

    /// Batched matvec with the kernel of `ty` (see [`Batched`]): the matrices at byte `w_off` of
    /// `w`, the input at value `x_off` of `x`, the output at `y_off` of `y`; `rows x cols` each.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_off: usize,
        x: &DeviceBuffer<f32>,
        x_off: usize,
        y: &DeviceBuffer<f32>,
        y_off: usize,
        rows: usize,
        cols: usize,
        b: &Batched,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        if b.n_tokens == 0 || b.n_tokens > MAX_MATVEC_TOKENS || b.n_groups == 0 || b.x_grp_div == 0 || b.n_mats == 0 {
            return Err(Error::Shape(format!(
                "matvec: {} tokens (1..={MAX_MATVEC_TOKENS}), {} groups, {} matrices",
                b.n_tokens, b.n_groups, b.n_mats
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let mat = weight_bytes(ty, rows, cols)?;
        if b.w_grp_bytes < mat && b.n_mats > 1 {
            return Err(Error::Shape(format!("matvec: matrices {} bytes apart, each {mat}", b.w_grp_bytes)));
        }
        let wp = w.at(w_off, (b.n_mats - 1) * b.w_grp_bytes + mat, "matvec weight")?;
        let (nt, ng) = (b.n_tokens - 1, b.n_groups - 1);
        let xp = x.at(x_off, nt * b.x_tok + (ng / b.x_grp_div) * b.x_grp + cols, "matvec x")?;
        let yp = y.at(y_off, nt * b.y_tok + ng * b.y_grp + rows, "matvec y")?;
        let (idp, ids_per, ids_row) = match &b.ids {
            Some((ids, off, per, row)) => {
                if *per == 0 {
                    return Err(Error::Shape("matvec: 0 ids per row".into()));
                }
                (
                    ids.at(*off, (ng / per) * row + per, "matvec ids")?,
                    int(*per, "matvec ids")?,
                    long(*row, "matvec ids")?,
                )
            }
            None => {
                if b.n_mats < b.n_groups {
                    return Err(Error::Shape(format!("matvec: {} groups of {} matrices", b.n_groups, b.n_mats)));
                }
                (0u64, 1i32, 0i64)
            }
        };
        let (r, c, n) = (int(rows, "matvec rows")?, int(cols, "matvec cols")?, b.n_tokens as i32);
        let (xt, xg, xd) = (long(b.x_tok, "matvec")?, long(b.x_grp, "matvec")?, int(b.x_grp_div, "matvec")?);
        let (yt, yg, wg, nm) = (
            long(b.y_tok, "matvec")?,
            long(b.y_grp, "matvec")?,
            long(b.w_grp_bytes, "matvec")?,
            int(b.n_mats, "matvec")?,
        );
        self.launch(
            &matvec_name(ty),
            [grid(rows.div_ceil(4))?, grid_yz(b.n_groups, "matvec groups")?, 1],
            [32, 4, 1],
            &mut args![wp, xp, yp, r, c, n, xt, xg, xd, yt, yg, wg, idp, ids_per, ids_row, nm],
        )
    }

    /// `y[t] = W x[t]` for `n_tokens` rows of `x` (`[n][cols]`, output `[n][rows]`): the matvec
    /// kernel 8 tokens at a time, or beyond 8 tokens (with cuBLAS) the weight dequantized in chunks
    /// of rows and a gemm, as [`Runtime::gemm_precision`] says. Both take `x` as it is (the
    /// caller rounds it as the CPU would, see [`Runtime::round_acts`]), except that the f16 gemm
    /// rounds it to f16.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_off: usize,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        let f16 = self.precision == GemmPrecision::F16;
        let gemm_ok = self.has_cublas()
            && (ty == GgmlType::F32
                || (self.has_kernel(&dequant_name(ty, !f16))
                    && (!f16
                        || (self.has_kernel("tandem_f32_to_f16_scaled") && self.has_kernel("tandem_scale_rows_f32")))));
        if n_tokens <= MAX_MATVEC_TOKENS || !gemm_ok {
            for t0 in (0..n_tokens).step_by(MAX_MATVEC_TOKENS) {
                let n = (n_tokens - t0).min(MAX_MATVEC_TOKENS);
                let b = Batched::plain(n, rows, cols);
                self.matvec(ty, w, w_off, x, t0 * cols, y, t0 * rows, rows, cols, &b)?;
            }
            return Ok(());
        }
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        let wp = w.at(w_off, weight_bytes(ty, rows, cols)?, "gemm weight")?;
        let xp = x.at(0, n_tokens * cols, "gemm x")?;
        let yp = y.at(0, n_tokens * rows, "gemm y")?;
        let (m, k, n) = (int(rows, "gemm rows")?, int(cols, "gemm cols")?, int(n_tokens, "gemm tokens")?);
        if ty == GgmlType::F32 {
            self.ledger.launch(1);
            return self.drv.gemm(&Gemm { a: wp, b: xp, c: yp, m, n, k, ldc: m, f16_inputs: false });
        }
        let mut scratch = self.gemm.lock().map_err(|_| Error::Shape("gemm scratch lock poisoned".into()))?;
        let GemmScratch { w32, w: ws, x: xs, scales } = &mut *scratch;
        let chunk_rows = (GEMM_CHUNK_ELEMS / cols.max(1)).clamp(1, rows.max(1));
        let row_bytes = weight_bytes(ty, 1, cols)?;
        if !f16 {
            let wf = self.scratch(w32, chunk_rows * cols, "a dequantized weight chunk (f32)")?;
            for r0 in (0..rows).step_by(chunk_rows) {
                let nr = (rows - r0).min(chunk_rows);
                self.dequant(ty, w, w_off + r0 * row_bytes, wf, nr * cols)?;
                let yp_r = y.at(r0, (n_tokens - 1) * rows + nr, "gemm y")?;
                self.ledger.launch(1);
                let a = wf.at(0, nr * cols, "gemm")?;
                self.drv.gemm(&Gemm { a, b: xp, c: yp_r, m: nr as i32, n, k, ldc: m, f16_inputs: false })?;
            }
            return Ok(());
        }
        let xh = self.scratch(xs, n_tokens * cols, "prefill activations (f16)")?;
        let sc = self.scratch(scales, n_tokens, "prefill activation scales")?;
        {
            let (xh_p, sc_p, c32) = (xh.at(0, n_tokens * cols, "gemm")?, sc.at(0, n_tokens, "gemm")?, k);
            self.launch(
                "tandem_f32_to_f16_scaled",
                [grid(n_tokens)?, 1, 1],
                [BLOCK_1D, 1, 1],
                &mut args![xp, xh_p, sc_p, c32],
            )?;
        }
        let xh_p = xh.at(0, n_tokens * cols, "gemm")?;
        let wh = self.scratch(ws, chunk_rows * cols, "a dequantized weight chunk (f16)")?;
        for r0 in (0..rows).step_by(chunk_rows) {
            let nr = (rows - r0).min(chunk_rows);
            self.dequant(ty, w, w_off + r0 * row_bytes, wh, nr * cols)?;
            let yp_r = y.at(r0, (n_tokens - 1) * rows + nr, "gemm y")?;
            self.ledger.launch(1);
            self.drv.gemm(&Gemm {
                a: wh.at(0, nr * cols, "gemm")?,
                b: xh_p,
                c: yp_r,
                m: nr as i32,
                n,
                k,
                ldc: m,
                f16_inputs: true,
            })?;
        }
        self.scale_rows(y, sc, rows, n_tokens * rows)
    }

    /// The scratch buffer in `slot`, grown to at least `n` values.
    fn scratch<'a, T: Elem>(
        &self,
        slot: &'a mut Option<DeviceBuffer<T>>,
        n: usize,
        what: &str,
    ) -> Result<&'a DeviceBuffer<T>> {
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            *slot = None;
            *slot = Some(self.alloc::<T>(n.max(1), what)?);
        }
        slot.as_ref().ok_or_else(|| Error::Shape(format!("{what}: no scratch buffer")))
    }

    /// `out[..n] = W` for the `n` values of a weight of type `ty` at byte `w_off`, as f32 or as f16
    /// bits (rounded to nearest), by the type of `out`.
    pub fn dequant<T: Elem + DequantOut>(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_off: usize,
        out: &DeviceBuffer<T>,
        n: usize,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        let wp = w.at(w_off, weight_bytes(ty, 1, n)?, "dequant weight")?;
        let (op, n64) = (out.at(0, n, "dequant out")?, n as i64);
        self.launch_1d(&dequant_name(ty, T::F32), n, &mut args![wp, op, n64])
    }

    /// The first `cols` values of `n_rows` rows of `x` (`x_stride` apart) rounded as ggml's CPU
    /// backend rounds activations for weights of type `weight_ty` (its vec_dot_type: Q8_0 or
    /// Q8_K blocks, f16, bf16), into the same places of `y` (rows `y_stride` apart). `false` (and
    /// nothing queued) for types whose products take the values as they are (f32).
    #[allow(clippy::too_many_arguments)]
    pub fn round_acts(
        &self,
        weight_ty: GgmlType,
        x: &DeviceBuffer<f32>,
        x_off: usize,
        y: &DeviceBuffer<f32>,
        y_off: usize,
        n_rows: usize,
        cols: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<bool> {
        let (name, block) = match tandem_quant::vec_dot_type(weight_ty) {
            GgmlType::Q8_0 => ("tandem_round_q8_0", 32),
            GgmlType::Q8_K => ("tandem_round_q8_K", 256),
            GgmlType::F16 => ("tandem_round_f16", 1),
            GgmlType::BF16 => ("tandem_round_bf16", 1),
            _ => return Ok(false),
        };
        if !cols.is_multiple_of(block) || cols > x_stride || cols > y_stride {
            return Err(Error::Shape(format!(
                "{name}: rows of {cols} values (blocks of {block}, strides {x_stride}/{y_stride})"
            )));
        }
        if n_rows == 0 || cols == 0 {
            return Ok(true);
        }
        let xp = x.at(x_off, (n_rows - 1) * x_stride + cols, "round x")?;
        let yp = y.at(y_off, (n_rows - 1) * y_stride + cols, "round y")?;
        let (c, xs, ys) = (int(cols, "round")?, long(x_stride, "round")?, long(y_stride, "round")?);
        self.launch(name, [grid(n_rows)?, 1, 1], [BLOCK_1D, 1, 1], &mut args![xp, yp, c, xs, ys])?;
        Ok(true)
    }

    /// `out[..n] = f16(x)` (as bits).
    pub fn f32_to_f16(&self, x: &DeviceBuffer<f32>, out: &DeviceBuffer<u16>, n: usize) -> Result<()> {
        let (xp, op, n64) = (x.at(0, n, "f32_to_f16 x")?, out.at(0, n, "f32_to_f16 out")?, n as i64);
        self.launch_1d("tandem_f32_to_f16", n, &mut args![xp, op, n64])
    }

    // ---- KV cache and attention ---------------------------------------------------------------------

    /// Writes each token's row (`width` values at `src[src_off + t * src_stride ..]`) into the
    /// cache at its `meta` entry (a [`crate::KvMeta`] per token): layer `layer`, rows of
    /// `row_bytes`, at byte `byte_off` of the row.
    ///
    /// The metadata's addresses are not checked here: the caller made them from cache buffers of
    /// this runtime with room for each token's position.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        kind: CacheKind,
        src: &DeviceBuffer<f32>,
        src_off: usize,
        src_stride: usize,
        meta: &DeviceBuffer<f32>,
        meta_off: usize,
        n_tokens: usize,
        layer: usize,
        row_bytes: usize,
        byte_off: usize,
        width: usize,
    ) -> Result<()> {
        if n_tokens == 0 {
            return Ok(());
        }
        let bytes = kind.bytes(width).ok_or_else(|| Error::Shape(format!("kv_store: {width} {kind:?} values")))?;
        if byte_off + bytes > row_bytes || width > src_stride {
            return Err(Error::Shape(format!("kv_store: {bytes} bytes at {byte_off} of rows of {row_bytes}")));
        }
        let sp = src.at(src_off, (n_tokens - 1) * src_stride + width, "kv_store source")?;
        let mp = meta_ptr(meta, meta_off, n_tokens, "kv_store meta")?;
        let (ss, l, rb, bo, wd) = (
            long(src_stride, "kv")?,
            int(layer, "kv")?,
            long(row_bytes, "kv")?,
            long(byte_off, "kv")?,
            int(width, "kv")?,
        );
        let name = format!("tandem_kv_store_{}", kind.name());
        self.launch(&name, [grid(n_tokens)?, 1, 1], [BLOCK_1D, 1, 1], &mut args![sp, ss, mp, l, rb, bo, wd])
    }

    /// Attention of `s.n_tokens` query rows (`q`, `[n][n_head][dk]`) over each one's cache rows
    /// `0..=pos` (its `meta` entry) in layer `layer`; `v_off`: byte offset of V in a row, `None`
    /// when V is the first `dv` values of each K head (MLA). `part` is scratch of `n_tokens *
    /// n_head * n_split * (dv + 2)`; `out` is `[n][n_head][dv]`; `max_pos` is the largest position.
    /// MLA shapes (one KV head, V in K, heads a multiple of [`MLA_HEADS`]) take the kernel that
    /// shares each row among a group of heads.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        kind: CacheKind,
        q: &DeviceBuffer<f32>,
        meta: &DeviceBuffer<f32>,
        meta_off: usize,
        max_pos: usize,
        layer: usize,
        row_bytes: usize,
        v_off: Option<usize>,
        s: &AttnShape,
        part: &DeviceBuffer<f32>,
        out: &DeviceBuffer<f32>,
    ) -> Result<()> {
        if s.n_head_kv == 0
            || s.n_head == 0
            || !s.n_head.is_multiple_of(s.n_head_kv)
            || s.n_split == 0
            || s.dk == 0
            || s.dv == 0
            || (v_off.is_none() && s.dv > s.dk)
            || s.dk > ATTN_MAX_HEAD_DIM
            || s.dv > ATTN_MAX_HEAD_DIM
            || kind.bytes(s.dk).is_none()
            || kind.bytes(s.dv).is_none()
        {
            return Err(Error::Shape(format!(
                "attention: {} heads over {} KV heads, dk {} dv {}, {} splits, {kind:?} cache",
                s.n_head, s.n_head_kv, s.dk, s.dv, s.n_split
            )));
        }
        if s.n_tokens == 0 {
            return Ok(());
        }
        let k_bytes = kind.bytes(s.n_head_kv * s.dk).unwrap_or(usize::MAX);
        let v_bytes = kind.bytes(s.n_head_kv * s.dv).unwrap_or(usize::MAX);
        let fits = match v_off {
            Some(v) => k_bytes <= v && v + v_bytes <= row_bytes,
            None => k_bytes <= row_bytes,
        };
        if !fits {
            return Err(Error::Shape(format!("attention: K/V heads do not fit rows of {row_bytes} bytes")));
        }
        let rows = max_pos + 1;
        let chunk = rows.div_ceil(s.n_split);
        let qp = q.at(0, s.n_tokens * s.n_head * s.dk, "attention q")?;
        let mp = meta_ptr(meta, meta_off, s.n_tokens, "attention meta")?;
        let pp = part.at(0, s.n_tokens * s.n_head * s.n_split * (s.dv + 2), "attention parts")?;
        let op = out.at(0, s.n_tokens * s.n_head * s.dv, "attention out")?;
        let (l, rb) = (int(layer, "attention")?, long(row_bytes, "attention")?);
        let (nh, dk, dv, ch) =
            (s.n_head as i32, int(s.dk, "attention")?, int(s.dv, "attention")?, int(chunk, "attention")?);
        let (nt, ns, nhg) = (grid_yz(s.n_tokens, "attention tokens")?, s.n_split as u32, s.n_head as u32);
        let scale = s.scale;
        let mla = v_off.is_none()
            && s.n_head_kv == 1
            && s.n_head.is_multiple_of(MLA_HEADS)
            && s.dk <= MLA_MAX_DK
            && s.dv <= MLA_MAX_DV
            && self.has_kernel(&format!("tandem_attn_mla_{}", kind.name()));
        if mla {
            let groups = grid(s.n_head / MLA_HEADS)?;
            self.launch(
                &format!("tandem_attn_mla_{}", kind.name()),
                [groups, grid_yz(s.n_split, "attention splits")?, nt],
                [MLA_THREADS, 1, 1],
                &mut args![qp, mp, pp, l, rb, nh, dk, dv, scale, ch],
            )?;
        } else {
            let (nhk, vo) = (int(s.n_head_kv, "attention")?, v_off.map_or(-1i64, |v| v as i64));
            self.launch(
                &format!("tandem_attn_{}", kind.name()),
                [grid(s.n_split)?, grid_yz(s.n_head, "attention heads")?, nt],
                [ATTN_THREADS, 1, 1],
                &mut args![qp, mp, pp, l, rb, vo, nh, nhk, dk, dv, scale, ch],
            )?;
        }
        let ns_i = ns as i32;
        self.launch("tandem_attn_combine", [nhg, nt, 1], [ATTN_THREADS, 1, 1], &mut args![pp, op, nh, dv, ns_i])
    }
}
