//! The real GPU (the `cuda` feature): the CUDA driver API through cudarc, loaded at run time, so
//! the binary starts on machines without libcuda and says why there is no GPU.
//!
//! One stream per device; kernels launch by name from the embedded images (kernels/ABI.md: the
//! cubin of the device's architecture, else the newest PTX it can JIT). Host-to-device copies go
//! through a ring of pinned memory on the stream (a region is reused once the copy from it is done,
//! by its event), device-to-host copies through a pinned buffer and an event the host waits on:
//! never a device-wide sync, never the legacy stream.

use crate::driver::{Driver, Gemm};
use crate::{entry_points, DeviceInfo, Error, Image, ImageKind, Result};
use cudarc::cublas::sys as blas_sys;
use cudarc::driver::result::{self as drv, DriverError};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex};

/// Pinned memory for host-to-device copies; larger copies go through it in pieces.
const RING_BYTES: usize = 64 << 20;

/// Loads the driver and checks that it initializes.
pub(crate) fn init() -> Result<()> {
    guarded(|| {
        load_driver()?;
        Ok(())
    })
}

/// Every CUDA device with its name, compute capability and memory.
pub(crate) fn devices() -> Result<Vec<DeviceInfo>> {
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

/// The driver's version as `major.minor` (e.g. 12.8), for messages about images it cannot load.
pub(crate) fn driver_version() -> Option<String> {
    let mut v = 0i32;
    // SAFETY: writes one int; only called after the library loaded.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result().ok()?;
    Some(format!("{}.{}", v / 1000, (v % 1000) / 10))
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

/// Pinned host memory used as a ring for host-to-device copies: a region is handed out again once
/// the event recorded after the copy from it has completed.
struct Ring {
    base: *mut u8,
    head: usize,
    /// Regions with a copy in flight, oldest first: (start, end, event).
    pending: VecDeque<(usize, usize, sys::CUevent)>,
    idle_events: Vec<sys::CUevent>,
}

/// A pinned buffer for device-to-host copies and the event the host waits on; `busy` while a
/// copy into it has begun and not ended.
struct Readback {
    buf: *mut u8,
    len: usize,
    event: sys::CUevent,
    busy: bool,
}

pub(crate) struct Cuda {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    modules: Vec<sys::CUmodule>,
    funcs: HashMap<String, sys::CUfunction>,
    loaded: Vec<String>,
    blas: Option<cudarc::cublas::CudaBlas>,
    ring: Mutex<Ring>,
    readback: Mutex<Vec<Readback>>,
}

// SAFETY: the module, function, event and pinned-memory handles belong to this context and live
// until drop; the driver API is thread-safe, every call binds the context first, and the mutable
// state (ring, readback) sits behind mutexes.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

impl Cuda {
    /// Opens CUDA device `ordinal` and loads `images`.
    pub fn open(images: &[Image], ordinal: usize) -> Result<Cuda> {
        guarded(|| Cuda::open_unguarded(images, ordinal))
    }

    fn open_unguarded(images: &[Image], ordinal: usize) -> Result<Cuda> {
        let count = load_driver()?;
        if ordinal >= count {
            return Err(Error::NoSuchDevice { ordinal, count });
        }
        if images.is_empty() {
            return Err(Error::NoKernels);
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(&format!("open CUDA{ordinal}"), e))?;
        // One stream and raw device pointers: cudarc's cross-stream event tracking would only add work.
        // SAFETY: no buffer of this context exists yet, and all work goes to one stream.
        unsafe { ctx.disable_event_tracking() };
        let info = device_info(&ctx)?;
        let stream = ctx.new_stream().map_err(|e| driver_err(&format!("create a stream on CUDA{ordinal}"), e))?;
        let err = |what: &'static str| move |e| driver_err(&format!("{what} on CUDA{ordinal}"), e);
        ctx.bind_to_thread().map_err(err("bind the context"))?;
        // SAFETY: a plain page-locked allocation of this context, freed in Drop.
        let ring_base =
            unsafe { drv::malloc_host(RING_BYTES, 0) }.map_err(err("allocate pinned host memory"))? as *mut u8;
        let mut c = Cuda {
            info,
            ctx,
            stream,
            modules: Vec::new(),
            funcs: HashMap::new(),
            loaded: Vec::new(),
            blas: None,
            ring: Mutex::new(Ring { base: ring_base, head: 0, pending: VecDeque::new(), idle_events: Vec::new() }),
            readback: Mutex::new(Vec::new()),
        };
        c.load_images(images)?;
        // SAFETY: only tries to dlopen libcublas by its usual names.
        if unsafe { blas_sys::is_culib_present() } {
            // Without cuBLAS, prefill runs the matvec kernels 8 tokens at a time.
            c.blas = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                cudarc::cublas::CudaBlas::new(c.stream.clone()).ok()
            }))
            .ok()
            .flatten();
        }
        Ok(c)
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
                let mut why = if reasons.is_empty() {
                    format!("kernels/{file}.cu was built for {} only", have.join(", "))
                } else {
                    reasons.join("; ")
                };
                if let Some(v) = driver_version() {
                    why.push_str(&format!(" (driver for CUDA {v})"));
                }
                return Err(Error::KernelLoad { device, sm, reason: why });
            };
            self.modules.push(m);
            self.loaded.push(format!("{file}: {}", kind_name(kind)));
            for (f, name) in entry_points::all_entry_points() {
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

    fn err(&self, what: &str, e: DriverError) -> Error {
        driver_err(&format!("{what} on CUDA{}", self.info.ordinal), e)
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| self.err("bind the context", e))
    }

    /// Waits for `ev` unless it has completed; returns whether it waited.
    fn wait_event(&self, ev: sys::CUevent) -> Result<bool> {
        // SAFETY: an event of this context.
        if unsafe { drv::event::query(ev) }.is_ok() {
            return Ok(false);
        }
        // SAFETY: as above.
        unsafe { drv::event::synchronize(ev) }.map_err(|e| self.err("wait for a copy", e))?;
        Ok(true)
    }
}

impl Drop for Cuda {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let _ = self.ctx.bind_to_thread();
        if let Ok(mut r) = self.ring.lock() {
            let mut events: Vec<sys::CUevent> = r.pending.drain(..).map(|(_, _, e)| e).collect();
            events.append(&mut r.idle_events);
            // SAFETY: allocated in `open`; nothing is in flight after the sync.
            unsafe {
                for e in events {
                    let _ = drv::event::destroy(e);
                }
                let _ = drv::free_host(r.base as *mut c_void);
            }
        }
        if let Ok(mut slots) = self.readback.lock() {
            for r in slots.drain(..) {
                // SAFETY: as above.
                unsafe {
                    let _ = drv::event::destroy(r.event);
                    let _ = drv::free_host(r.buf as *mut c_void);
                }
            }
        }
        for &m in &self.modules {
            // SAFETY: loaded by load_data in `load_images`; the functions of it die with `self`.
            let _ = unsafe { drv::module::unload(m) };
        }
    }
}

impl Driver for Cuda {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn loaded_images(&self) -> &[String] {
        &self.loaded
    }

    fn has_kernel(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    fn has_blas(&self) -> bool {
        self.blas.is_some()
    }

    fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info().map_err(|e| self.err("query memory", e))?;
        Ok((free as u64, total as u64))
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        // SAFETY: a plain device allocation, freed by `free`.
        match unsafe { drv::malloc_sync(bytes) } {
            Ok(p) => Ok(p),
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(Error::OutOfMemory { device: format!("CUDA{}", self.info.ordinal), what: "a buffer".into(), bytes })
            }
            Err(e) => Err(self.err(&format!("allocate {bytes} bytes"), e)),
        }
    }

    unsafe fn free(&self, ptr: u64) {
        let _ = self.bind();
        // SAFETY: the caller's promise: an allocation of ours that nothing queued uses.
        let _ = unsafe { drv::free_sync(ptr) };
    }

    fn memset_zero(&self, dst: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the runtime checked that `dst` has `bytes` bytes; queued on our stream.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }.map_err(|e| self.err("zero memory", e))
    }

    fn h2d(&self, dst: u64, src: &[u8]) -> Result<u64> {
        self.bind()?;
        let mut waits = 0;
        let mut r = self.ring.lock().map_err(|_| Error::Shape("the staging ring's lock is poisoned".into()))?;
        for (i, piece) in src.chunks(RING_BYTES / 2).enumerate() {
            let n = piece.len();
            if r.head + n > RING_BYTES {
                r.head = 0;
            }
            let (start, end) = (r.head, r.head + n);
            // The regions still in flight that this one overlaps: wait for them, oldest first.
            while r.pending.iter().any(|&(s, e, _)| s < end && start < e) {
                let Some((_, _, ev)) = r.pending.pop_front() else { break };
                waits += self.wait_event(ev)? as u64;
                r.idle_events.push(ev);
            }
            let ev = match r.idle_events.pop() {
                Some(e) => e,
                None => drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| self.err("create an event", e))?,
            };
            // SAFETY: [start, end) of the ring is free (no copy from it in flight); `dst + i *
            // RING_BYTES / 2` has `n` bytes (the runtime checked the whole copy); the copy and the
            // event are queued on our stream.
            unsafe {
                let buf = r.base.add(start);
                std::ptr::copy_nonoverlapping(piece.as_ptr(), buf, n);
                let at = dst + (i * (RING_BYTES / 2)) as u64;
                drv::memcpy_htod_async(at, std::slice::from_raw_parts(buf, n), self.stream.cu_stream())
                    .map_err(|e| self.err("copy to the device", e))?;
                drv::event::record(ev, self.stream.cu_stream()).map_err(|e| self.err("record an event", e))?;
            }
            r.pending.push_back((start, end, ev));
            r.head = end;
        }
        Ok(waits)
    }

    fn d2h_begin(&self, src: u64, bytes: usize) -> Result<usize> {
        self.bind()?;
        let mut slots =
            self.readback.lock().map_err(|_| Error::Shape("the readback buffers' lock is poisoned".into()))?;
        let i = match slots.iter().position(|r| !r.busy) {
            Some(i) => i,
            None => {
                let ev = drv::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| self.err("create an event", e))?;
                slots.push(Readback { buf: std::ptr::null_mut(), len: 0, event: ev, busy: false });
                slots.len() - 1
            }
        };
        let r = &mut slots[i];
        if r.len < bytes {
            let len = bytes.next_power_of_two().max(1 << 16);
            // SAFETY: the old buffer has no copy in flight (the slot is not busy); the new one is
            // a plain page-locked allocation.
            unsafe {
                if !r.buf.is_null() {
                    let _ = drv::free_host(r.buf as *mut c_void);
                }
                r.buf = drv::malloc_host(len, 0).map_err(|e| self.err("allocate pinned host memory", e))? as *mut u8;
            }
            r.len = len;
        }
        // SAFETY: `r.buf` holds at least `bytes` bytes and is read only after the event recorded
        // after the copy has completed (d2h_end).
        unsafe {
            let buf = std::slice::from_raw_parts_mut(r.buf, bytes);
            drv::memcpy_dtoh_async(buf, src, self.stream.cu_stream())
                .map_err(|e| self.err("copy from the device", e))?;
            drv::event::record(r.event, self.stream.cu_stream()).map_err(|e| self.err("record an event", e))?;
        }
        r.busy = true;
        Ok(i)
    }

    fn d2h_end(&self, ticket: usize, dst: &mut [u8]) -> Result<()> {
        let mut slots =
            self.readback.lock().map_err(|_| Error::Shape("the readback buffers' lock is poisoned".into()))?;
        let r = slots
            .get_mut(ticket)
            .filter(|r| r.busy)
            .ok_or_else(|| Error::Shape(format!("no read {ticket} in flight")))?;
        r.busy = false;
        let n = dst.len().min(r.len);
        // SAFETY: an event of this context; after it the copy into `r.buf` is complete.
        unsafe {
            drv::event::synchronize(r.event).map_err(|e| self.err("run kernels", e))?;
            std::ptr::copy_nonoverlapping(r.buf, dst.as_mut_ptr(), n);
        }
        Ok(())
    }

    fn d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the runtime checked both ranges; queued on our stream.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| self.err("copy on the device", e))
    }

    unsafe fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &mut [*mut c_void]) -> Result<()> {
        let f = self.funcs.get(name).copied().ok_or_else(|| Error::MissingKernel {
            name: name.to_string(),
            file: entry_points::all_entry_points().into_iter().find(|(_, n)| n == name).map_or("?", |(f, _)| f),
        })?;
        self.bind()?;
        let g = (grid[0], grid[1], grid[2]);
        let b = (block[0], block[1], block[2]);
        // SAFETY: `f` is a kernel of this context; the caller's promise about `args`.
        unsafe { drv::launch_kernel(f, g, b, 0, self.stream.cu_stream(), args) }.map_err(|e| Error::Launch {
            kernel: name.to_string(),
            device: format!("CUDA{}", self.info.ordinal),
            reason: reason(&e),
        })
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        use blas_sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
        let Some(blas) = &self.blas else { return Err(Error::Cublas("not loaded".into())) };
        let in_ty = if g.f16_inputs { cudaDataType::CUDA_R_16F } else { cudaDataType::CUDA_R_32F };
        let (alpha, beta) = (1f32, 0f32);
        self.bind()?;
        // SAFETY: a, b, c point at buffers the runtime checked to hold k*m, k*n and ldc*n values
        // of the stated types; alpha/beta are host f32 (cuBLAS's default pointer mode).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                g.m,
                g.n,
                g.k,
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                in_ty,
                g.k,
                g.b as *const c_void,
                in_ty,
                g.k,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                cudaDataType::CUDA_R_32F,
                g.ldc,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| Error::Cublas(format!("gemmEx {}x{}x{} on CUDA{}: {e:?}", g.m, g.n, g.k, self.info.ordinal)))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| self.err("run kernels", e))
    }
}
