//! The CUDA runtime (the `cuda` feature): driver, device, kernel modules, buffers, launches.
//!
//! Everything runs on one stream per device. Buffers are cudarc `CudaSlice`s (freed on drop) with
//! cudarc's multi-stream event tracking turned off, and kernels are launched through the driver
//! API with raw device pointers, so a launch is one `cuLaunchKernel` and nothing else. Host copies
//! of activations go through pinned staging buffers; weight uploads copy straight from the memory
//! map. Every shape is checked here before a launch (STYLE.md 4).

use crate::{
    dequant_name, entry_points, matvec_name, weight_bytes, AttnShape, DeviceInfo, Elem, Error, GgmlType, Image,
    ImageKind, Result, RouterParams, ATTN_MAX_HEAD_DIM, MATVEC_TYPES, MAX_MATVEC_TOKENS, ROUTER_MAX_EXPERT,
};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::result::{self as drv, DriverError};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use half::f16;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

/// Pinned staging buffers grow up to this size; larger copies go straight from pageable memory.
const STAGING_MAX_BYTES: usize = 64 << 20;
/// Elements of a weight dequantized to f16 at once for a prefill gemm (64 MiB of f16).
const GEMM_CHUNK_ELEMS: usize = 32 << 20;
/// Threads per block of the 1-D kernels (kernels/ABI.md).
const BLOCK_1D: u32 = 256;
/// Most blocks of a grid-stride kernel.
const MAX_GRID_STRIDE_BLOCKS: usize = 1 << 16;

/// Loads the driver and checks that it initializes.
pub fn init() -> Result<()> {
    guarded(|| {
        load_driver()?;
        Ok(())
    })
}

/// Every CUDA device with its name, compute capability and memory.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    guarded(|| {
        let count = load_driver()?;
        (0..count)
            .map(|i| {
                let ctx = CudaContext::new(i).map_err(|e| driver_err(&format!("open CUDA{i}"), e))?;
                device_info(&ctx)
            })
            .collect()
    })
}

/// Runs `f`, turning a panic inside cudarc (a driver without a symbol the bindings expect) into
/// an error instead of a crash, without the panic message on stderr.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    r.unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Driver { what: "load".into(), reason: msg.lines().next().unwrap_or_default().to_string() })
    })
}

/// Loads libcuda, initializes it, and returns the number of devices (at least one).
fn load_driver() -> Result<usize> {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDriver);
    }
    match drv::init() {
        Ok(()) => {}
        Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => return Err(Error::NoDevice),
        Err(e) => return Err(driver_err("initialize", e)),
    }
    let count = drv::device::get_count().map_err(|e| driver_err("count devices", e))?;
    if count <= 0 {
        return Err(Error::NoDevice);
    }
    Ok(count as usize)
}

fn driver_err(what: &str, e: DriverError) -> Error {
    Error::Driver { what: what.into(), reason: reason(&e) }
}

/// `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
fn reason(e: &DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

fn device_info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo> {
    let ordinal = ctx.ordinal();
    let what = format!("describe CUDA{ordinal}");
    let name = ctx.name().map_err(|e| driver_err(&what, e))?;
    let (major, minor) = ctx.compute_capability().map_err(|e| driver_err(&what, e))?;
    let (free, total) = ctx.mem_get_info().map_err(|e| driver_err(&what, e))?;
    Ok(DeviceInfo {
        ordinal,
        name,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        total_bytes: total as u64,
        free_bytes: free as u64,
    })
}

/// Memory on the device: `len` values of `T`, freed on drop.
pub struct DeviceBuffer<T: Elem> {
    slice: CudaSlice<T>,
}

impl<T: Elem> DeviceBuffer<T> {
    /// Number of `T` values.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    fn check(&self, need: usize, what: &str) -> Result<()> {
        if self.len() < need {
            return Err(Error::Shape(format!("{what}: {need} values needed, the buffer has {}", self.len())));
        }
        Ok(())
    }
}

/// Page-locked host memory for activation copies.
struct Staging {
    buf: Option<(*mut u8, usize)>,
    /// A copy from `buf` may still be in flight on the stream.
    pending: bool,
}

// SAFETY: the pointer is page-locked host memory owned by this struct and only used under the
// runtime's mutex.
unsafe impl Send for Staging {}

/// f16 scratch for prefill gemms: the dequantized weight chunk and the activations.
#[derive(Default)]
struct GemmScratch {
    w: Option<DeviceBuffer<f16>>,
    x: Option<DeviceBuffer<f16>>,
}

/// One CUDA device with tandem's kernels loaded.
pub struct Runtime {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<sys::CUmodule>,
    funcs: HashMap<String, sys::CUfunction>,
    /// Which image each loaded file came from, e.g. `matvec: cubin sm_90`.
    loaded: Vec<String>,
    blas: Option<cudarc::cublas::CudaBlas>,
    staging_in: Mutex<Staging>,
    staging_out: Mutex<Staging>,
    gemm: Mutex<GemmScratch>,
}

// SAFETY: the module and function handles are driver objects of this runtime's context, valid
// until drop; the driver API is thread-safe and every call binds the context first.
unsafe impl Send for Runtime {}
// SAFETY: as above; mutable state (staging, scratch) sits behind mutexes.
unsafe impl Sync for Runtime {}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Runtime({})", self.info.describe())
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = self.ctx.bind_to_thread();
        for st in [&self.staging_in, &self.staging_out] {
            if let Ok(mut s) = st.lock() {
                if let Some((p, _)) = s.buf.take() {
                    // SAFETY: allocated by malloc_host in `staging` and not used after this.
                    let _ = unsafe { drv::free_host(p as *mut c_void) };
                }
            }
        }
        for &m in &self.modules {
            // SAFETY: loaded by load_data in `load_images`; the functions of it die with `self`.
            let _ = unsafe { drv::module::unload(m) };
        }
    }
}

/// Argument pointers for `cuLaunchKernel`: each value must be a local of the exact C type.
macro_rules! args {
    ($($a:expr),* $(,)?) => { [$(&$a as *const _ as *mut c_void),*] };
}

impl Runtime {
    /// Opens CUDA device `ordinal` and loads `images` (the root's `tandem::kernels::images()`):
    /// per kernel file the cubin of the device's architecture, else the newest PTX it can JIT.
    pub fn open(images: &[Image], ordinal: usize) -> Result<Runtime> {
        guarded(|| Runtime::open_unguarded(images, ordinal))
    }

    fn open_unguarded(images: &[Image], ordinal: usize) -> Result<Runtime> {
        let count = load_driver()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        if images.is_empty() {
            return Err(Error::NoKernels);
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(&format!("open CUDA{ordinal}"), e))?;
        // One stream: cudarc's cross-stream event tracking would only add work.
        // SAFETY: no buffer of this context exists yet, and all work goes to one stream.
        unsafe { ctx.disable_event_tracking() };
        let info = device_info(&ctx)?;
        let stream = ctx.new_stream().map_err(|e| driver_err(&format!("create a stream on CUDA{ordinal}"), e))?;
        let mut rt = Runtime {
            info,
            ctx,
            stream,
            modules: Vec::new(),
            funcs: HashMap::new(),
            loaded: Vec::new(),
            blas: None,
            staging_in: Mutex::new(Staging { buf: None, pending: false }),
            staging_out: Mutex::new(Staging { buf: None, pending: false }),
            gemm: Mutex::new(GemmScratch::default()),
        };
        rt.load_images(images)?;
        // SAFETY: only tries to dlopen libcublas by its usual names.
        if unsafe { blas_sys::is_culib_present() } {
            // Without cuBLAS, prefill runs the matvec kernels 8 tokens at a time.
            rt.blas = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                cudarc::cublas::CudaBlas::new(rt.stream.clone()).ok()
            }))
            .ok()
            .flatten();
        }
        Ok(rt)
    }

    fn load_images(&mut self, images: &[Image]) -> Result<()> {
        let sm = self.info.sm();
        let device = format!("CUDA{} ({})", self.info.ordinal, self.info.name);
        let mut files: Vec<&str> = images.iter().map(|i| i.file).collect();
        files.sort_unstable();
        files.dedup();
        self.ctx.bind_to_thread().map_err(|e| driver_err("bind the context", e))?;
        for file in files {
            let cubin = images.iter().find(|i| i.file == file && i.kind == ImageKind::Cubin { sm });
            // The newest PTX this device can JIT (PTX for compute_XY runs on sm >= XY).
            let ptx = images
                .iter()
                .filter(|i| i.file == file && matches!(i.kind, ImageKind::Ptx { sm: p } if p <= sm))
                .max_by_key(|i| match i.kind {
                    ImageKind::Ptx { sm } | ImageKind::Cubin { sm } => sm,
                });
            let mut reasons = Vec::new();
            let mut module = None;
            for img in [cubin, ptx].into_iter().flatten() {
                match load_module(img) {
                    Ok(m) => {
                        module = Some((m, img.kind));
                        break;
                    }
                    Err(e) => reasons.push(format!("{file} {}: {}", kind_name(img.kind), reason(&e))),
                }
            }
            let Some((m, kind)) = module else {
                let have: Vec<String> = images.iter().filter(|i| i.file == file).map(|i| kind_name(i.kind)).collect();
                let why = if reasons.is_empty() {
                    format!("kernels/{file}.cu was built for {} only", have.join(", "))
                } else {
                    reasons.join("; ")
                };
                return Err(Error::KernelLoad { device, sm, reason: why });
            };
            self.modules.push(m);
            self.loaded.push(format!("{file}: {}", kind_name(kind)));
            for (f, name) in entry_points() {
                if f != file {
                    continue;
                }
                let c = CString::new(name.clone()).map_err(|_| Error::Shape(format!("kernel name {name}")))?;
                // SAFETY: `m` is a module just loaded in this context; a missing name is an error.
                if let Ok(func) = unsafe { drv::module::get_function(m, c) } {
                    self.funcs.insert(name, func);
                }
            }
        }
        Ok(())
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Which image of each kernel file was loaded, e.g. `["add: cubin sm_90", ...]`.
    pub fn loaded_images(&self) -> &[String] {
        &self.loaded
    }

    /// Whether the kernel `name` (an ABI entry point) was found.
    pub fn has_kernel(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// Whether matrices of type `ty` can be multiplied here (a matvec kernel exists).
    pub fn supports(&self, ty: GgmlType) -> bool {
        MATVEC_TYPES.contains(&ty) && self.has_kernel(&matvec_name(ty))
    }

    /// Whether prefill gemms go through cuBLAS (else the matvec kernels, 8 tokens at a time).
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// Free and total device memory in bytes, now.
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().map_err(|e| self.err("query memory", e))?;
        Ok((free as u64, total as u64))
    }

    fn device(&self) -> String {
        format!("CUDA{}", self.info.ordinal)
    }

    fn err(&self, what: &str, e: DriverError) -> Error {
        driver_err(&format!("{what} on {}", self.device()), e)
    }

    fn func(&self, name: &str) -> Result<sys::CUfunction> {
        self.funcs.get(name).copied().ok_or_else(|| Error::MissingKernel {
            name: name.to_string(),
            file: entry_points().into_iter().find(|(_, n)| n == name).map_or("?", |(f, _)| f),
        })
    }

    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.func(name)?;
        self.ctx.bind_to_thread().map_err(|e| self.err("bind the context", e))?;
        // SAFETY: `f` is a kernel of this context; `args` point at locals of the C types of its
        // ABI signature (kernels/ABI.md), checked against the buffers by the caller.
        unsafe { drv::launch_kernel(f, grid, block, 0, self.stream.cu_stream(), args) }.map_err(|e| Error::Launch {
            kernel: name.to_string(),
            device: self.device(),
            reason: reason(&e),
        })
    }

    /// A zeroed buffer of `n` values; `what` names it in an out-of-memory error.
    pub fn alloc<T: Elem>(&self, n: usize, what: &str) -> Result<DeviceBuffer<T>> {
        let bytes = n.saturating_mul(std::mem::size_of::<T>());
        self.alloc_inner::<T>(n.max(1), what, bytes)
    }

    fn alloc_inner<T: Elem>(&self, n: usize, what: &str, bytes: usize) -> Result<DeviceBuffer<T>> {
        let oom = || Error::OutOfMemory { device: self.device(), what: what.to_string(), bytes };
        let r = match self.stream.alloc_zeros::<T>(n) {
            Ok(s) => s,
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => return Err(oom()),
            Err(e) => return Err(self.err(&format!("allocate {bytes} bytes for {what}"), e)),
        };
        Ok(DeviceBuffer { slice: r })
    }

    /// A new buffer holding `data`.
    pub fn upload<T: Elem>(&self, data: &[T], what: &str) -> Result<DeviceBuffer<T>> {
        let mut b = self.alloc::<T>(data.len(), what)?;
        self.write(&mut b, 0, data)?;
        Ok(b)
    }

    /// Copies `data` to `dst[offset..]` (through pinned staging up to 64 MiB).
    pub fn write<T: Elem>(&self, dst: &mut DeviceBuffer<T>, offset: usize, data: &[T]) -> Result<()> {
        // SAFETY: `T` is a plain value type (f32, u8, i32, f16): its bytes are initialized.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        self.write_bytes(dst, offset, bytes)
    }

    /// Copies raw bytes (e.g. an f16 KV cache as stored) to `dst[offset..]`; `bytes` must be a
    /// whole number of values.
    pub fn write_bytes<T: Elem>(&self, dst: &mut DeviceBuffer<T>, offset: usize, bytes: &[u8]) -> Result<()> {
        let size = std::mem::size_of::<T>();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::Shape(format!("{} bytes are not a whole number of {size}-byte values", bytes.len())));
        }
        let n = bytes.len() / size;
        dst.check(offset + n, "write")?;
        if n == 0 {
            return Ok(());
        }
        let p = self.ptr(dst, offset);
        self.ctx.bind_to_thread().map_err(|e| self.err("bind the context", e))?;
        let mut st = self.staging_in.lock().map_err(|_| Error::Shape("staging lock poisoned".into()))?;
        if bytes.len() > STAGING_MAX_BYTES {
            if st.pending {
                self.synchronize()?;
                st.pending = false;
            }
            // SAFETY: `p` points at `bytes.len()` bytes of `dst` (checked above).
            return unsafe { drv::memcpy_htod_sync(p, bytes) }.map_err(|e| self.err("copy to the device", e));
        }
        if st.pending {
            self.synchronize()?;
            st.pending = false;
        }
        let buf = self.staging(&mut st, bytes.len())?;
        // SAFETY: `buf` has room for `bytes` and no copy from it is in flight (synchronized).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len());
            let src = std::slice::from_raw_parts(buf, bytes.len());
            drv::memcpy_htod_async(p, src, self.stream.cu_stream()).map_err(|e| self.err("copy to the device", e))?;
        }
        st.pending = true;
        Ok(())
    }

    /// Copies `src[offset..offset + out.len()]` to `out`, after all work queued before it.
    pub fn read<T: Elem>(&self, src: &DeviceBuffer<T>, offset: usize, out: &mut [T]) -> Result<()> {
        src.check(offset + out.len(), "read")?;
        if out.is_empty() {
            return self.synchronize();
        }
        let p = self.ptr(src, offset);
        let bytes = std::mem::size_of_val(out);
        self.ctx.bind_to_thread().map_err(|e| self.err("bind the context", e))?;
        if bytes > STAGING_MAX_BYTES {
            self.synchronize()?;
            // SAFETY: `p` points at `bytes` bytes of `src` (checked above).
            return unsafe { drv::memcpy_dtoh_sync(out, p) }.map_err(|e| self.err("copy from the device", e));
        }
        let mut st = self.staging_out.lock().map_err(|_| Error::Shape("staging lock poisoned".into()))?;
        let buf = self.staging(&mut st, bytes)?;
        // SAFETY: `buf` holds at least `bytes` bytes; the stream is synchronized before the
        // host reads them.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(buf, bytes);
            drv::memcpy_dtoh_async(dst, p, self.stream.cu_stream()).map_err(|e| self.err("copy from the device", e))?;
        }
        self.synchronize()?;
        // SAFETY: the copy has completed; `out` has `bytes` bytes of plain values.
        unsafe { std::ptr::copy_nonoverlapping(buf, out.as_mut_ptr() as *mut u8, bytes) };
        Ok(())
    }

    /// The pinned buffer of `st`, grown to at least `bytes`.
    fn staging(&self, st: &mut Staging, bytes: usize) -> Result<*mut u8> {
        if let Some((p, len)) = st.buf {
            if len >= bytes {
                return Ok(p);
            }
            self.synchronize()?;
            // SAFETY: allocated by malloc_host below; nothing is in flight after the sync.
            let _ = unsafe { drv::free_host(p as *mut c_void) };
            st.buf = None;
        }
        let len = bytes.next_power_of_two().max(1 << 16);
        // SAFETY: a plain page-locked allocation, freed in `Drop` or when it grows.
        let p = unsafe { drv::malloc_host(len, 0) }.map_err(|e| self.err("allocate pinned host memory", e))?;
        st.buf = Some((p as *mut u8, len));
        Ok(p as *mut u8)
    }

    /// Waits for all queued work; a kernel that failed while running is reported here.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.err("run kernels", e))
    }

    fn ptr<T: Elem>(&self, b: &DeviceBuffer<T>, offset: usize) -> u64 {
        let (p, _sync) = b.slice.device_ptr(&self.stream);
        p + (offset * std::mem::size_of::<T>()) as u64
    }

    // ---- kernels (kernels/ABI.md) -------------------------------------------------------------

    /// `x[r] = rmsnorm(x[r]) * w` for `n_rows` rows of `dim`.
    pub fn rmsnorm(
        &self,
        x: &mut DeviceBuffer<f32>,
        n_rows: usize,
        w: Option<&DeviceBuffer<f32>>,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        x.check(n_rows * dim, "rmsnorm x")?;
        if let Some(w) = w {
            w.check(dim, "rmsnorm weight")?;
        }
        if n_rows == 0 {
            return Ok(());
        }
        let xp = self.ptr(x, 0);
        let wp = w.map_or(0, |w| self.ptr(w, 0));
        let (dim, yp) = (int(dim, "rmsnorm dim")?, xp);
        self.launch("tandem_rmsnorm_f32", (grid(n_rows)?, 1, 1), (BLOCK_1D, 1, 1), &mut args![xp, wp, yp, dim, eps])
    }

    /// Rotary embedding of `n_rows` rows of `n_heads` heads (`head_stride` apart, rows
    /// `row_stride` apart); the first `n_dims` values of each head rotate with `cs[t * n_dims..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut DeviceBuffer<f32>,
        cs: &DeviceBuffer<f32>,
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
        x.check((n_rows - 1) * row_stride + (n_heads - 1) * head_stride + n_dims, "rope x")?;
        cs.check(n_rows * n_dims, "rope cos/sin")?;
        if n_heads > 65535 {
            return Err(Error::Shape(format!("rope: {n_heads} heads")));
        }
        let (xp, cp) = (self.ptr(x, 0), self.ptr(cs, 0));
        let (nh, hs, rs, nd) = (n_heads as i32, int(head_stride, "rope")?, int(row_stride, "rope")?, n_dims as i32);
        let neox = neox as i32;
        self.launch(
            "tandem_rope_f32",
            (grid(n_rows)?, n_heads as u32, 1),
            ((n_dims / 2) as u32, 1, 1),
            &mut args![xp, cp, nh, hs, rs, nd, neox],
        )
    }

    /// `gate[..n] = silu(gate) * up`.
    pub fn swiglu(&self, gate: &mut DeviceBuffer<f32>, up: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        gate.check(n, "swiglu gate")?;
        up.check(n, "swiglu up")?;
        let (g, u, n64) = (self.ptr(gate, 0), self.ptr(up, 0), n as i64);
        self.launch_1d("tandem_swiglu_f32", n, &mut args![g, u, n64])
    }

    /// `x[..n] += y`.
    pub fn add(&self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        x.check(n, "add x")?;
        y.check(n, "add y")?;
        let (xp, yp, n64) = (self.ptr(x, 0), self.ptr(y, 0), n as i64);
        self.launch_1d("tandem_add_f32", n, &mut args![xp, yp, n64])
    }

    /// `x[..n] += s * y`.
    pub fn scale_add(&self, x: &mut DeviceBuffer<f32>, y: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        x.check(n, "scale_add x")?;
        y.check(n, "scale_add y")?;
        let (xp, yp, n64) = (self.ptr(x, 0), self.ptr(y, 0), n as i64);
        self.launch_1d("tandem_scale_add_f32", n, &mut args![xp, yp, s, n64])
    }

    /// `x[..n] *= s`.
    pub fn scale(&self, x: &mut DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        x.check(n, "scale x")?;
        let (xp, n64) = (self.ptr(x, 0), n as i64);
        self.launch_1d("tandem_scale_f32", n, &mut args![xp, s, n64])
    }

    fn launch_1d(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch(name, (grid(n.div_ceil(BLOCK_1D as usize))?, 1, 1), (BLOCK_1D, 1, 1), args)
    }

    /// Expert selection for `n_tokens` rows of router logits: `ids` and `weights` are
    /// `[n_tokens][n_used]`.
    pub fn router(
        &self,
        logits: &DeviceBuffer<f32>,
        bias: Option<&DeviceBuffer<f32>>,
        n_tokens: usize,
        p: &RouterParams,
        ids: &mut DeviceBuffer<i32>,
        weights: &mut DeviceBuffer<f32>,
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
        logits.check(n_tokens * p.n_expert, "router logits")?;
        if let Some(b) = bias {
            b.check(p.n_expert, "router bias")?;
        }
        ids.check(n_tokens * p.n_used, "router ids")?;
        weights.check(n_tokens * p.n_used, "router weights")?;
        if n_tokens == 0 {
            return Ok(());
        }
        let (lp, bp, ip, wp) =
            (self.ptr(logits, 0), bias.map_or(0, |b| self.ptr(b, 0)), self.ptr(ids, 0), self.ptr(weights, 0));
        let (ne, nu, gating) = (int(p.n_expert, "router")?, int(p.n_used, "router")?, p.gating as i32);
        let (ng, ngu, norm, scale) =
            (int(p.n_group, "router")?, int(p.n_group_used, "router")?, p.norm as i32, p.scale);
        self.launch(
            "tandem_router_f32",
            (grid(n_tokens)?, 1, 1),
            (32, 1, 1),
            &mut args![lp, bp, ne, nu, gating, ng, ngu, norm, scale, ip, wp],
        )
    }

    /// `y[t] = W x[t]` for `n_tokens <= 8` with the matvec kernel of `ty`; the weight's rows
    /// start at byte `w_offset` of `w`.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        self.matvec_at(ty, w, w_offset, x, 0, y, 0, rows, cols, n_tokens)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_at(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        x: &DeviceBuffer<f32>,
        x_offset: usize,
        y: &mut DeviceBuffer<f32>,
        y_offset: usize,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        if n_tokens > MAX_MATVEC_TOKENS {
            return Err(Error::Shape(format!("matvec: {n_tokens} tokens (at most {MAX_MATVEC_TOKENS})")));
        }
        w.check(w_offset + weight_bytes(ty, rows, cols)?, "matvec weight")?;
        x.check(x_offset + n_tokens * cols, "matvec x")?;
        y.check(y_offset + n_tokens * rows, "matvec y")?;
        if n_tokens == 0 || rows == 0 {
            return Ok(());
        }
        let (wp, xp, yp) = (self.ptr(w, w_offset), self.ptr(x, x_offset), self.ptr(y, y_offset));
        let (r, c, n) = (int(rows, "matvec rows")?, int(cols, "matvec cols")?, n_tokens as i32);
        self.launch(&matvec_name(ty), (grid(rows.div_ceil(4))?, 1, 1), (32, 4, 1), &mut args![wp, xp, yp, r, c, n])
    }

    /// `out[..n] = f16(W)` for the `n` values of a weight of type `ty` starting at byte `w_offset`.
    pub fn dequant_f16(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        out: &mut DeviceBuffer<f16>,
        n: usize,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        w.check(w_offset + weight_bytes(ty, 1, n)?, "dequant weight")?;
        out.check(n, "dequant out")?;
        let (wp, op, n64) = (self.ptr(w, w_offset), self.ptr(out, 0), n as i64);
        self.launch_grid_stride(&dequant_name(ty), n, &mut args![wp, op, n64])
    }

    /// `out[..n] = f16(x)`.
    pub fn f32_to_f16(&self, x: &DeviceBuffer<f32>, out: &mut DeviceBuffer<f16>, n: usize) -> Result<()> {
        x.check(n, "f32_to_f16 x")?;
        out.check(n, "f32_to_f16 out")?;
        let (xp, op, n64) = (self.ptr(x, 0), self.ptr(out, 0), n as i64);
        self.launch_grid_stride("tandem_f32_to_f16", n, &mut args![xp, op, n64])
    }

    fn launch_grid_stride(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(BLOCK_1D as usize).clamp(1, MAX_GRID_STRIDE_BLOCKS);
        self.launch(name, (blocks as u32, 1, 1), (BLOCK_1D, 1, 1), args)
    }

    /// `y[t] = W x[t]` for any number of tokens: the matvec kernel up to 8 tokens, beyond that
    /// the weight dequantized to f16 in chunks of rows and cuBLAS `gemmEx` (f32 weights: f32
    /// gemm), or the matvec kernel 8 tokens at a time when cuBLAS is missing.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        ty: GgmlType,
        w: &DeviceBuffer<u8>,
        w_offset: usize,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        let gemm_ok = self.blas.is_some()
            && (ty == GgmlType::F32 || (self.has_kernel(&dequant_name(ty)) && self.has_kernel("tandem_f32_to_f16")));
        if n_tokens <= MAX_MATVEC_TOKENS || !gemm_ok {
            for t0 in (0..n_tokens).step_by(MAX_MATVEC_TOKENS) {
                let n = (n_tokens - t0).min(MAX_MATVEC_TOKENS);
                self.matvec_at(ty, w, w_offset, x, t0 * cols, y, t0 * rows, rows, cols, n)?;
            }
            return Ok(());
        }
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        w.check(w_offset + weight_bytes(ty, rows, cols)?, "gemm weight")?;
        x.check(n_tokens * cols, "gemm x")?;
        y.check(n_tokens * rows, "gemm y")?;
        let (m, k, n) = (int(rows, "gemm rows")?, int(cols, "gemm cols")?, int(n_tokens, "gemm tokens")?);
        if ty == GgmlType::F32 {
            return self.gemm(self.ptr(w, w_offset), self.ptr(x, 0), self.ptr(y, 0), (m, n, k), m, false);
        }
        let mut scratch = self.gemm.lock().map_err(|_| Error::Shape("gemm scratch lock poisoned".into()))?;
        let GemmScratch { w: ws, x: xs } = &mut *scratch;
        let chunk_rows = (GEMM_CHUNK_ELEMS / cols.max(1)).clamp(1, rows.max(1));
        let xh = ensure(self, xs, n_tokens * cols, "prefill activations (f16)")?;
        self.f32_to_f16(x, xh, n_tokens * cols)?;
        let xp = self.ptr(xh, 0);
        let wh = ensure(self, ws, chunk_rows * cols, "a dequantized weight chunk (f16)")?;
        let row_bytes = weight_bytes(ty, 1, cols)?;
        for r0 in (0..rows).step_by(chunk_rows) {
            let nr = (rows - r0).min(chunk_rows);
            self.dequant_f16(ty, w, w_offset + r0 * row_bytes, wh, nr * cols)?;
            let (wp, yp) = (self.ptr(wh, 0), self.ptr(y, r0));
            self.gemm(wp, xp, yp, (nr as i32, n, k), m, true)?;
        }
        Ok(())
    }

    /// Column-major `C[m x n] = A^T B` with A `k x m` (the row-major weight), B `k x n` (the
    /// row-major activations) and `ldc`: y row-major `[n][ldc]`.
    fn gemm(&self, a: u64, b: u64, c: u64, (m, n, k): (i32, i32, i32), ldc: i32, f16_inputs: bool) -> Result<()> {
        use blas_sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
        let Some(blas) = &self.blas else { return Err(Error::Cublas("not loaded".into())) };
        let in_ty = if f16_inputs { cudaDataType::CUDA_R_16F } else { cudaDataType::CUDA_R_32F };
        let (alpha, beta) = (1f32, 0f32);
        self.ctx.bind_to_thread().map_err(|e| self.err("bind the context", e))?;
        // SAFETY: a, b, c point at buffers checked by `matmul` to hold k*m, k*n and ldc*n values
        // of the stated types; alpha/beta are host f32 (cuBLAS's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                in_ty,
                k,
                b as *const c_void,
                in_ty,
                k,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| Error::Cublas(format!("gemmEx {m}x{n}x{k} on {}: {e:?}", self.device())))
    }

    /// Attention of `s.n_tokens` query rows over f16 K/V rows: `n_kv[t]` rows for token `t`,
    /// `max_n_kv` the largest; `part` is scratch of `n_tokens * n_head * n_split * (dv + 2)`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        q: &DeviceBuffer<f32>,
        k: &DeviceBuffer<f16>,
        v: Option<&DeviceBuffer<f16>>,
        n_kv: &DeviceBuffer<i32>,
        max_n_kv: usize,
        s: &AttnShape,
        part: &mut DeviceBuffer<f32>,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        if s.n_head_kv == 0
            || !s.n_head.is_multiple_of(s.n_head_kv)
            || s.n_split == 0
            || (v.is_none() && s.dv > s.dk)
            || s.dk > ATTN_MAX_HEAD_DIM
            || s.dv > ATTN_MAX_HEAD_DIM
        {
            return Err(Error::Shape(format!(
                "attention: {} heads over {} KV heads, dk {} dv {}, {} splits",
                s.n_head, s.n_head_kv, s.dk, s.dv, s.n_split
            )));
        }
        if s.n_tokens == 0 || max_n_kv == 0 {
            return Err(Error::Shape("attention over no rows".into()));
        }
        if s.n_tokens > 65535 || s.n_head > 65535 {
            return Err(Error::Shape(format!("attention: {} tokens x {} heads", s.n_tokens, s.n_head)));
        }
        q.check(s.n_tokens * s.n_head * s.dk, "attention q")?;
        k.check((max_n_kv - 1) * s.k_stride + s.n_head_kv * s.dk, "attention K")?;
        let v_stride = match v {
            Some(v) => {
                v.check((max_n_kv - 1) * s.v_stride + s.n_head_kv * s.dv, "attention V")?;
                s.v_stride
            }
            None => s.k_stride,
        };
        n_kv.check(s.n_tokens, "attention n_kv")?;
        part.check(s.n_tokens * s.n_head * s.n_split * (s.dv + 2), "attention parts")?;
        out.check(s.n_tokens * s.n_head * s.dv, "attention out")?;
        let (qp, kp, vp) = (self.ptr(q, 0), self.ptr(k, 0), v.map_or(0, |v| self.ptr(v, 0)));
        let (pp, np, op) = (self.ptr(part, 0), self.ptr(n_kv, 0), self.ptr(out, 0));
        let (nh, nhk, dk, dv) = (s.n_head as i32, int(s.n_head_kv, "attn")?, int(s.dk, "attn")?, int(s.dv, "attn")?);
        let (ks, vs, scale, ns) = (s.k_stride as i64, v_stride as i64, s.scale, int(s.n_split, "attn")?);
        self.launch(
            "tandem_attn_f16",
            (s.n_split as u32, s.n_head as u32, s.n_tokens as u32),
            (128, 1, 1),
            &mut args![qp, kp, vp, pp, np, nh, nhk, dk, dv, ks, vs, scale, ns],
        )?;
        self.launch(
            "tandem_attn_combine",
            (s.n_head as u32, s.n_tokens as u32, 1),
            (128, 1, 1),
            &mut args![pp, op, nh, dv, ns],
        )
    }
}

/// The scratch buffer in `slot`, grown to at least `n` values.
fn ensure<'a>(
    rt: &Runtime,
    slot: &'a mut Option<DeviceBuffer<f16>>,
    n: usize,
    what: &str,
) -> Result<&'a mut DeviceBuffer<f16>> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None;
        let b = rt.alloc::<f16>(n, what)?;
        return Ok(slot.insert(b));
    }
    slot.as_mut().ok_or_else(|| Error::Shape(format!("{what}: no scratch buffer")))
}

fn kind_name(k: ImageKind) -> String {
    match k {
        ImageKind::Cubin { sm } => format!("cubin sm_{sm}"),
        ImageKind::Ptx { sm } => format!("PTX compute_{sm}"),
    }
}

/// Loads a cubin or PTX image (PTX must end with a NUL for the driver).
fn load_module(img: &Image) -> std::result::Result<sys::CUmodule, DriverError> {
    let mut bytes = img.bytes.to_vec();
    if matches!(img.kind, ImageKind::Ptx { .. }) && bytes.last() != Some(&0) {
        bytes.push(0);
    }
    // SAFETY: `bytes` is a complete cubin/PTX image that outlives the call (the driver copies it).
    unsafe { drv::module::load_data(bytes.as_ptr() as *const c_void) }
}

/// A kernel's `int` argument, or a shape error when it does not fit.
fn int(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Shape(format!("{what}: {v} does not fit a 32-bit int")))
}

fn grid(n: usize) -> Result<u32> {
    u32::try_from(n).ok().filter(|&g| g < (1 << 31)).ok_or_else(|| Error::Shape(format!("a grid of {n} blocks")))
}
