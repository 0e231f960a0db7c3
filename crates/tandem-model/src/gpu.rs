//! [`GpuBackend`]: the [`Backend`] with the weights the placement put on a GPU uploaded once and
//! multiplied there, and everything else on an inner [`CpuBackend`] — so `-ngl 999 -ot exps=CPU`
//! runs attention, shared experts, dense layers and the output head on the GPU and the routed
//! experts on the CPU, over the same forward pass as the pure-CPU fallback.
//!
//! This is the first, deliberately simple step (correct before fast):
//! * activations stay in host memory: every GPU op copies its inputs in and its outputs back
//!   through pinned staging buffers, and waits for them;
//! * attention over f16 caches runs on the GPU by uploading the rows it reads each call (other
//!   cache types, and heads wider than the kernel's 1024 values, run on the CPU); a
//!   device-resident KV cache is a later step;
//! * rmsnorm, rope, swiglu and add run on the CPU unless [`GpuOptions::elementwise`] asks for the
//!   GPU (tests do): with activations in host memory a round trip costs more than the op;
//! * CPU and GPU work do not overlap yet (DESIGN.md's shared-expert / routed-expert overlap needs
//!   device-resident activations and a second stream).

use crate::backend::{AttnInput, Backend, CpuBackend};
use crate::weights::Weight;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;
use tandem_cpu::RopeStyle;
use tandem_cuda::{AttnShape, DeviceBuffer, Elem, Runtime, ATTN_MAX_HEAD_DIM};
use tandem_gguf::{GgmlType, GgufModel};
use tandem_quant::row_size;

/// KV rows per attention split on the GPU (flash-decoding parts).
const ATTN_ROWS_PER_SPLIT: usize = 256;
/// Most attention splits.
const ATTN_MAX_SPLITS: usize = 32;

/// What runs on the GPU besides the matrices placed there.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuOptions {
    /// Index (into the runtimes) of the GPU that runs attention over f16 KV caches; `None`: the CPU.
    pub attention: Option<usize>,
    /// Also run rmsnorm, rope, swiglu and add on the first GPU. Slower while activations live in
    /// host memory; tests use it to run every kernel inside the real forward pass.
    pub elementwise: bool,
}

/// What was uploaded at construction, per GPU.
#[derive(Clone, Debug, Default)]
pub struct GpuLoad {
    /// `(device description, tensors, bytes)` per runtime.
    pub devices: Vec<(String, usize, u64)>,
    /// Tensors placed on a GPU whose type has no CUDA kernel: they run on the CPU (name, type).
    pub kept_on_cpu: Vec<(String, GgmlType)>,
    pub seconds: f64,
}

impl GpuLoad {
    /// One line: `CUDA0 (NVIDIA H200, ...): 312 tensors, 14.20 GiB uploaded in 3.1 s`.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .devices
            .iter()
            .map(|(d, n, b)| format!("{d}: {n} tensors, {:.2} GiB", *b as f64 / (1u64 << 30) as f64))
            .collect();
        if !self.kept_on_cpu.is_empty() {
            let mut types: Vec<&str> = self.kept_on_cpu.iter().map(|(_, t)| t.name()).collect();
            types.sort_unstable();
            types.dedup();
            parts.push(format!(
                "{} tensors of types without a CUDA kernel ({}) stay on the CPU",
                self.kept_on_cpu.len(),
                types.join(", ")
            ));
        }
        format!("{}; uploaded in {:.1} s", parts.join("; "), self.seconds)
    }
}

/// Reusable device buffers for the activations of one op.
#[derive(Default)]
struct Scratch {
    x: Option<DeviceBuffer<f32>>,
    y: Option<DeviceBuffer<f32>>,
    w: Option<DeviceBuffer<f32>>,
    k: Option<DeviceBuffer<half::f16>>,
    v: Option<DeviceBuffer<half::f16>>,
    n_kv: Option<DeviceBuffer<i32>>,
}

struct Gpu {
    rt: Runtime,
    weights: HashMap<String, DeviceBuffer<u8>>,
    scratch: Mutex<Scratch>,
}

/// GPU-placed weights on their GPUs, the rest on the CPU. See the module documentation.
pub struct GpuBackend {
    cpu: CpuBackend,
    gpus: Vec<Gpu>,
    /// Tensor name -> index into `gpus`, for every uploaded tensor.
    on_gpu: HashMap<String, usize>,
    opts: GpuOptions,
    /// Set when an elementwise op failed on the GPU; they stay on the CPU from then on.
    elementwise_failed: AtomicBool,
    load: GpuLoad,
}

fn cuda(e: tandem_cuda::Error) -> Error {
    Error::Model(e.to_string())
}

/// The scratch buffer in `slot`, grown to at least `n` values.
fn ensure<'a, T: Elem>(
    rt: &Runtime,
    slot: &'a mut Option<DeviceBuffer<T>>,
    n: usize,
    what: &str,
) -> Result<&'a mut DeviceBuffer<T>> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None;
        let b = rt.alloc::<T>(n.next_power_of_two(), what).map_err(cuda)?;
        return Ok(slot.insert(b));
    }
    slot.as_mut().ok_or_else(|| Error::Model(format!("{what}: no scratch buffer")))
}

impl GpuBackend {
    /// Uploads every matrix of `gguf` that `placement` puts on a GPU (`placement[name]` is an
    /// index into `runtimes`) and whose type has a kernel; runs the rest on `cpu`. Out of GPU
    /// memory is an error, so that the caller can fall back to the CPU.
    pub fn new(
        cpu: CpuBackend,
        runtimes: Vec<Runtime>,
        gguf: &GgufModel,
        placement: &HashMap<String, usize>,
        opts: GpuOptions,
    ) -> Result<GpuBackend> {
        let start = Instant::now();
        if runtimes.is_empty() {
            return Err(Error::Model("no CUDA runtime given".into()));
        }
        let n_gpus = runtimes.len();
        let check = |i: usize, what: &str| {
            if i >= n_gpus {
                return Err(Error::Model(format!("{what} placed on GPU #{i}, but {n_gpus} are open")));
            }
            Ok(())
        };
        if let Some(a) = opts.attention {
            check(a, "attention")?;
            for k in ["tandem_attn_f16", "tandem_attn_combine"] {
                if !runtimes[a].has_kernel(k) {
                    return Err(cuda(tandem_cuda::Error::MissingKernel { name: k.into(), file: "attention" }));
                }
            }
        }
        let mut gpus: Vec<Gpu> =
            runtimes.into_iter().map(|rt| Gpu { rt, weights: HashMap::new(), scratch: Mutex::default() }).collect();
        let mut load = GpuLoad::default();
        let mut counts = vec![(0usize, 0u64); gpus.len()];
        let mut on_gpu = HashMap::new();
        let tied = gguf.tensor_index("output.weight").is_none();
        for t in gguf.tensors() {
            let info = t.info;
            let Some(&i) = placement.get(&info.name) else { continue };
            check(i, &info.name)?;
            // Vectors are read on the host; the embedding table only when it is also the head.
            if info.dims.len() < 2 || (info.name == "token_embd.weight" && !tied) {
                continue;
            }
            let g = &mut gpus[i];
            if !g.rt.supports(info.ty) {
                load.kept_on_cpu.push((info.name.clone(), info.ty));
                continue;
            }
            let bytes = gguf.data(t);
            let buf = g.rt.upload(bytes, &format!("tensor '{}'", info.name)).map_err(cuda)?;
            counts[i].0 += 1;
            counts[i].1 += bytes.len() as u64;
            g.weights.insert(info.name.clone(), buf);
            on_gpu.insert(info.name.clone(), i);
        }
        for (g, (n, b)) in gpus.iter().zip(counts) {
            g.rt.synchronize().map_err(cuda)?;
            load.devices.push((g.rt.info().describe(), n, b));
        }
        load.seconds = start.elapsed().as_secs_f64();
        Ok(GpuBackend { cpu, gpus, on_gpu, opts, elementwise_failed: AtomicBool::new(false), load })
    }

    /// What was uploaded where.
    pub fn load(&self) -> &GpuLoad {
        &self.load
    }

    /// Whether the tensor `name` is multiplied on a GPU.
    pub fn is_on_gpu(&self, name: &str) -> bool {
        self.on_gpu.contains_key(name)
    }

    fn matmul_gpu(&self, g: &Gpu, w: &Weight, first_row: usize, n_rows: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
        let cols = w.cols();
        let shape_err = || {
            Error::Model(format!(
                "{}: {} inputs and {} outputs do not fit rows {first_row}..{} of {} x {cols}",
                w.name,
                x.len(),
                y.len(),
                first_row + n_rows,
                w.rows()
            ))
        };
        if cols == 0 || !x.len().is_multiple_of(cols) || first_row + n_rows > w.rows() {
            return Err(shape_err());
        }
        let n = x.len() / cols;
        if y.len() != n * n_rows {
            return Err(shape_err());
        }
        let buf = g.weights.get(&w.name).ok_or_else(|| Error::Model(format!("{}: not uploaded", w.name)))?;
        let offset = first_row * row_size(w.ty, cols)?;
        let named = |e: tandem_cuda::Error| Error::Model(format!("{}: {e}", w.name));
        let mut s = g.scratch.lock().map_err(|_| Error::Model("GPU scratch lock poisoned".into()))?;
        let Scratch { x: xs, y: ys, .. } = &mut *s;
        let xb = ensure(&g.rt, xs, x.len(), "matmul input")?;
        g.rt.write(xb, 0, x).map_err(named)?;
        let yb = ensure(&g.rt, ys, y.len(), "matmul output")?;
        g.rt.matmul(w.ty, buf, offset, xb, yb, n_rows, cols, n).map_err(named)?;
        g.rt.read(yb, 0, y).map_err(named)
    }

    fn attention_gpu(&self, g: &Gpu, a: &AttnInput, out: &mut [f32]) -> Result<()> {
        let k_row = row_size(a.k_type, a.n_head_kv * a.dk)?;
        let v_row = match a.v {
            Some(_) => row_size(a.v_type, a.n_head_kv * a.dv)?,
            None => 0,
        };
        if a.n_kv == 0
            || a.k.len() < a.n_kv * k_row
            || a.v.is_some_and(|v| v.len() < a.n_kv * v_row)
            || out.len() != a.n_head * a.dv
            || a.q.len() != a.n_head * a.dk
        {
            return Err(Error::Model(format!("attention over {} cached rows: cache or output too short", a.n_kv)));
        }
        let n_split = a.n_kv.div_ceil(ATTN_ROWS_PER_SPLIT).clamp(1, ATTN_MAX_SPLITS);
        let shape = AttnShape {
            n_tokens: 1,
            n_head: a.n_head,
            n_head_kv: a.n_head_kv,
            dk: a.dk,
            dv: a.dv,
            k_stride: a.n_head_kv * a.dk,
            v_stride: a.n_head_kv * a.dv,
            scale: a.scale,
            n_split,
        };
        let rt = &g.rt;
        let mut s = g.scratch.lock().map_err(|_| Error::Model("GPU scratch lock poisoned".into()))?;
        let Scratch { x: qs, y: os, w: ps, k: ks, v: vs, n_kv: ns } = &mut *s;
        let qb = ensure(rt, qs, a.q.len(), "attention q")?;
        rt.write(qb, 0, a.q).map_err(cuda)?;
        let kb = ensure(rt, ks, a.n_kv * k_row / 2, "attention K rows")?;
        rt.write_bytes(kb, 0, &a.k[..a.n_kv * k_row]).map_err(cuda)?;
        let vb = match a.v {
            Some(v) => {
                let vb = ensure(rt, vs, a.n_kv * v_row / 2, "attention V rows")?;
                rt.write_bytes(vb, 0, &v[..a.n_kv * v_row]).map_err(cuda)?;
                Some(&*vb)
            }
            None => None,
        };
        let nb = ensure(rt, ns, 1, "attention n_kv")?;
        rt.write(nb, 0, &[a.n_kv as i32]).map_err(cuda)?;
        let pb = ensure(rt, ps, a.n_head * n_split * (a.dv + 2), "attention parts")?;
        let ob = ensure(rt, os, out.len(), "attention output")?;
        rt.attention(qb, kb, vb, nb, a.n_kv, &shape, pb, ob).map_err(cuda)?;
        rt.read(ob, 0, out).map_err(cuda)
    }

    /// Runs `f` on the first GPU when elementwise ops go there; `false` means "do it on the CPU".
    fn elementwise(&self, f: impl FnOnce(&Gpu, &mut Scratch) -> Result<()>) -> bool {
        if !self.opts.elementwise || self.elementwise_failed.load(Ordering::Relaxed) {
            return false;
        }
        let g = &self.gpus[0];
        let ok = match g.scratch.lock() {
            Ok(mut s) => f(g, &mut s).is_ok(),
            Err(_) => false,
        };
        if !ok {
            self.elementwise_failed.store(true, Ordering::Relaxed);
        }
        ok
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> &'static str {
        "CUDA"
    }

    fn holds(&self, name: &str) -> bool {
        self.on_gpu.contains_key(name)
    }

    fn matmul_rows(&self, w: &Weight, first_row: usize, n_rows: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
        match self.on_gpu.get(&w.name) {
            Some(&i) => self.matmul_gpu(&self.gpus[i], w, first_row, n_rows, x, y),
            None => self.cpu.matmul_rows(w, first_row, n_rows, x, y),
        }
    }

    fn rmsnorm(&self, x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
        let done = dim > 0
            && x.len().is_multiple_of(dim)
            && weight.is_none_or(|w| w.len() == dim)
            && self.elementwise(|g, s| {
                let xb = ensure(&g.rt, &mut s.x, x.len(), "rmsnorm x")?;
                g.rt.write(xb, 0, x).map_err(cuda)?;
                let wb = match weight {
                    Some(w) => {
                        let wb = ensure(&g.rt, &mut s.w, w.len(), "rmsnorm weight")?;
                        g.rt.write(wb, 0, w).map_err(cuda)?;
                        Some(&*wb)
                    }
                    None => None,
                };
                g.rt.rmsnorm(xb, x.len() / dim, wb, dim, eps).map_err(cuda)?;
                g.rt.read(xb, 0, x).map_err(cuda)
            });
        if !done {
            self.cpu.rmsnorm(x, dim, weight, eps);
        }
    }

    fn rope(&self, x: &mut [f32], cache: &[f32], style: RopeStyle) {
        let n = cache.len();
        let done = n > 0
            && n <= x.len()
            && self.elementwise(|g, s| {
                let xb = ensure(&g.rt, &mut s.x, x.len(), "rope x")?;
                g.rt.write(xb, 0, x).map_err(cuda)?;
                let cb = ensure(&g.rt, &mut s.w, n, "rope cos/sin")?;
                g.rt.write(cb, 0, cache).map_err(cuda)?;
                g.rt.rope(xb, cb, 1, 1, x.len(), x.len(), n, style == RopeStyle::Neox).map_err(cuda)?;
                g.rt.read(xb, 0, x).map_err(cuda)
            });
        if !done {
            self.cpu.rope(x, cache, style);
        }
    }

    fn attention(&self, a: &AttnInput, out: &mut [f32]) -> Result<()> {
        let f16_cache = a.k_type == GgmlType::F16 && (a.v.is_none() || a.v_type == GgmlType::F16);
        let fits = a.dk <= ATTN_MAX_HEAD_DIM && a.dv <= ATTN_MAX_HEAD_DIM;
        match self.opts.attention {
            Some(i) if f16_cache && fits => self.attention_gpu(&self.gpus[i], a, out),
            _ => self.cpu.attention(a, out),
        }
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        let done = gate.len() == up.len()
            && self.elementwise(|g, s| {
                let Scratch { x, y, .. } = s;
                let gb = ensure(&g.rt, x, gate.len(), "swiglu gate")?;
                g.rt.write(gb, 0, gate).map_err(cuda)?;
                let ub = ensure(&g.rt, y, up.len(), "swiglu up")?;
                g.rt.write(ub, 0, up).map_err(cuda)?;
                g.rt.swiglu(gb, ub, gate.len()).map_err(cuda)?;
                g.rt.read(gb, 0, gate).map_err(cuda)
            });
        if !done {
            self.cpu.swiglu(gate, up);
        }
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        let done = x.len() == y.len()
            && self.elementwise(|g, s| {
                let Scratch { x: xs, y: ys, .. } = s;
                let xb = ensure(&g.rt, xs, x.len(), "add x")?;
                g.rt.write(xb, 0, x).map_err(cuda)?;
                let yb = ensure(&g.rt, ys, y.len(), "add y")?;
                g.rt.write(yb, 0, y).map_err(cuda)?;
                g.rt.add(xb, yb, x.len()).map_err(cuda)?;
                g.rt.read(xb, 0, x).map_err(cuda)
            });
        if !done {
            self.cpu.add(x, y);
        }
    }
}
