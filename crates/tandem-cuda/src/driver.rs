//! What the runtime needs of a device: memory, copies, launches by name, a gemm, a wait. The real
//! GPU (`cuda.rs`, on the CUDA driver API through cudarc) and the host emulator (`emu.rs`, the
//! kernels compiled for the CPU) implement it; [`crate::Runtime`] puts the shape checks, the typed
//! launches and the ledger on top, the same for both.

use crate::{DeviceInfo, Result};
use std::ffi::c_void;

/// `C = A^T B` in column-major terms: `a` is the row-major weight `[m][k]`, `b` the row-major
/// activations `[n][k]`, `c` the row-major output `[n][ldc]` (columns `0..m` written); f32
/// accumulation, inputs f16 (`f16_inputs`) or f32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub ldc: i32,
    pub f16_inputs: bool,
}

pub(crate) trait Driver: Send + Sync {
    fn info(&self) -> &DeviceInfo;
    /// Which image each loaded kernel file came from, e.g. `matvec: cubin sm_90`.
    fn loaded_images(&self) -> &[String];
    fn has_kernel(&self, name: &str) -> bool;
    /// Whether [`Driver::gemm`] is there (cuBLAS).
    fn has_blas(&self) -> bool;
    /// Free and total device memory in bytes.
    fn memory(&self) -> Result<(u64, u64)>;
    /// `bytes` of device memory, not zeroed; [`crate::Error::OutOfMemory`] when there is none.
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Frees memory from [`Driver::alloc`].
    ///
    /// # Safety
    /// `ptr` came from `alloc` of this driver, and no queued work uses it any more.
    unsafe fn free(&self, ptr: u64);
    /// Queues zeroing `bytes` at `dst`.
    fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()>;
    /// Queues a copy of `src` to `dst` (through pinned memory: `src` may be reused at once);
    /// returns how many times it had to wait for earlier copies to free that memory.
    fn h2d(&self, dst: u64, src: &[u8]) -> Result<u64>;
    /// Queues a copy of `bytes` bytes from `src` into pinned memory; [`Driver::d2h_end`] with the
    /// ticket returned waits for it and hands the bytes over.
    fn d2h_begin(&self, src: u64, bytes: usize) -> Result<usize>;
    /// Waits for the copy of `ticket` and copies its bytes to `dst` (as many as it began with).
    fn d2h_end(&self, ticket: usize, dst: &mut [u8]) -> Result<()>;
    /// Queues a device-to-device copy.
    fn d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Queues kernel `name`.
    ///
    /// # Safety
    /// `args` point at values of exactly the C types of the kernel's signature (kernels/ABI.md),
    /// and every pointer among them addresses device memory the kernel may read or write as the
    /// ABI says, for the grid and block given.
    unsafe fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &mut [*mut c_void]) -> Result<()>;
    /// Queues a gemm (see [`Gemm`]).
    fn gemm(&self, g: &Gemm) -> Result<()>;
    /// Waits for all queued work.
    fn synchronize(&self) -> Result<()>;
}
