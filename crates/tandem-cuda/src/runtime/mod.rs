//! [`Runtime`]: one device (a GPU, or the host emulator) with tandem's kernels: memory from a
//! caching pool, copies, and a typed launch per kernel that checks every shape before it queues
//! the kernel (STYLE.md 4), counting launches, copies and host waits in its [`Ledger`].
//! Everything is queued on one stream; only [`Runtime::read`] and [`Runtime::synchronize`] wait.
//!
//! The methods are grouped by concern, one file each:
//!
//! * this file: the [`Runtime`] itself (opening a device or the emulator, what it has loaded,
//!   its memory and [`Ledger`]) and the launch helpers every kernel wrapper goes through;
//! * `memory`: buffers from the pool, copies between host and device, waits;
//! * `elementwise`: norms, rope, SwiGLU, additions and strided copies;
//! * `moe`: expert routing and the gathering of the experts' outputs;
//! * `products`: the matvec kernels, prefill gemms through cuBLAS ([`GemmPrecision`]),
//!   dequantization and activation rounding;
//! * `attention`: the KV cache stores and attention kernels.

use crate::driver::Driver;
use crate::memory::Pool;
use crate::{matvec_name, DeviceInfo, Error, Image, Ledger, Result, MATVEC_TYPES};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};
use tandem_quant::GgmlType;

/// Threads per block of the 1-D kernels (kernels/ABI.md).
const BLOCK_1D: u32 = 256;
/// Most blocks of a grid-stride kernel.
const MAX_GRID_STRIDE_BLOCKS: usize = 1 << 16;

/// Argument pointers for a launch: each value must be a local of the exact C type.
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$(&$a as *const _ as *mut ::std::ffi::c_void),*] };
}

mod attention;
mod elementwise;
mod memory;
mod moe;
mod products;

pub use memory::Reading;
pub use moe::Packet;
pub use products::{DequantOut, GemmPrecision};

use products::GemmScratch;

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

    /// A kernel with one block of [`BLOCK_1D`] threads per row, `n_rows` rows.
    fn launch_rows(&self, name: &str, n_rows: usize, args: &mut [*mut c_void]) -> Result<()> {
        self.launch(name, [grid(n_rows)?, 1, 1], [BLOCK_1D, 1, 1], args)
    }

    fn launch_1d(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK_1D as usize).clamp(1, MAX_GRID_STRIDE_BLOCKS);
        self.launch(name, [blocks as u32, 1, 1], [BLOCK_1D, 1, 1], args)
    }
}
