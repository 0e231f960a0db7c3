//! The executor: tensors that belong to a device, ops that run where their weights are, and the
//! copies between devices, counted (DESIGN.md "Data flow", STYLE.md 16).
//!
//! An [`Exec`] holds the devices (the CPU first) and the placement: which device holds each
//! weight. Model code calls ops on it with [`Tensor`]s; each op runs on the device that holds its
//! weight (an elementwise op where its input is), and an input that sits elsewhere is copied there
//! first — the only copies there are. Every device keeps a [`Ledger`] of its launches, copies and
//! host syncs. The routed experts of a MoE layer are the one compound op ([`Exec::moe`]): with
//! the router and the experts on different devices it crosses once each way, with the shared
//! expert queued on the router's device before the experts start.

use crate::common::{Ffn, Ubatch};
use crate::device::{AttnCall, Device, KvStore, MlaCall};
use crate::host::HostDevice;
use crate::kv_cache::KvCache;
use crate::moe::Moe;
use crate::weights::{Vector, Weight};
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;
use tandem_cpu::{CpuBackend, RopeStyle, Threads};
pub use tandem_cuda::{Counts, Ledger};

/// A device of an [`Exec`]: an index into its devices; [`CPU`] is the host.
pub type DevId = usize;

/// The CPU, which every executor has and which can read every weight (they are in host memory).
pub const CPU: DevId = 0;

/// Bytes per token of what a step hands a device besides the hidden state and the rope rows: the
/// token's position, sequence and cache addressing ([`crate::device::Device::begin_step`]).
pub const STEP_META_BYTES: usize = 16;

/// Activations, `len` f32 values owned by one device.
pub struct Tensor {
    dev: DevId,
    len: usize,
    pub(crate) mem: Mem,
}

pub(crate) enum Mem {
    Host(Vec<f32>),
    Cuda(tandem_cuda::DeviceBuffer<f32>),
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({} values on device {})", self.len, self.dev)
    }
}

impl Tensor {
    /// Host memory of device `dev` (the CPU, or a host-memory stand-in).
    pub(crate) fn host(dev: DevId, v: Vec<f32>) -> Tensor {
        Tensor { dev, len: v.len(), mem: Mem::Host(v) }
    }

    pub(crate) fn cuda(dev: DevId, len: usize, b: tandem_cuda::DeviceBuffer<f32>) -> Tensor {
        Tensor { dev, len, mem: Mem::Cuda(b) }
    }

    pub fn dev(&self) -> DevId {
        self.dev
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The values, for a device whose tensors are in host memory.
    pub(crate) fn as_host(&self) -> Result<&[f32]> {
        match &self.mem {
            Mem::Host(v) => Ok(v),
            Mem::Cuda(_) => Err(Error::Model(format!("a tensor on device {} read as host memory", self.dev))),
        }
    }

    pub(crate) fn as_host_mut(&mut self) -> Result<&mut [f32]> {
        match &mut self.mem {
            Mem::Host(v) => Ok(v),
            Mem::Cuda(_) => Err(Error::Model(format!("a tensor on device {} written as host memory", self.dev))),
        }
    }

    pub(crate) fn into_host(self) -> Result<Vec<f32>> {
        match self.mem {
            Mem::Host(v) => Ok(v),
            Mem::Cuda(_) => Err(Error::Model(format!("a tensor on device {} taken as host memory", self.dev))),
        }
    }

    /// The device memory, for a CUDA device.
    pub(crate) fn buf(&self) -> Result<&tandem_cuda::DeviceBuffer<f32>> {
        match &self.mem {
            Mem::Cuda(b) => Ok(b),
            Mem::Host(_) => Err(Error::Model(format!("a host tensor of device {} used as device memory", self.dev))),
        }
    }
}

/// A copy to the host in flight: its values, or a device's handle for them.
pub(crate) enum Pending {
    Ready(Vec<f32>),
    Reading(tandem_cuda::Reading, usize),
}

/// A tensor on its way between devices ([`Exec::move_begin`]).
pub(crate) struct Moving {
    from: DevId,
    to: DevId,
    pending: Pending,
}

/// A tensor an op reads: the caller's own, or a copy made on the op's device.
pub(crate) enum Arg<'a> {
    Same(&'a Tensor),
    Copied(Tensor),
}

impl std::ops::Deref for Arg<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Arg::Same(t) => t,
            Arg::Copied(t) => t,
        }
    }
}

/// Rows of a tensor `stride` values apart; an op works on values `off .. off + dim` of each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub stride: usize,
    pub off: usize,
    pub dim: usize,
}

impl Rows {
    /// Whole rows of `dim`.
    pub fn dense(dim: usize) -> Rows {
        Rows { stride: dim, off: 0, dim }
    }
}

/// Heads inside the rows of a tensor: rows of `row` values, `n_heads` heads `head` values apart
/// starting at `off`; rope rotates the first `n_rot` values of each head (the step's rope rows).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub row: usize,
    pub n_heads: usize,
    pub head: usize,
    pub off: usize,
}

/// A strided copy: for `r` in `0..rows`, `width` values from `src[(r / src_rep) * src_stride +
/// src_off ..]` to `dst[r * dst_stride + dst_off ..]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Copy2d {
    pub rows: usize,
    pub width: usize,
    pub src_stride: usize,
    pub src_off: usize,
    pub src_rep: usize,
    pub dst_stride: usize,
    pub dst_off: usize,
}

impl Copy2d {
    /// One row of `width` values: row `src_row` of the source to row `dst_row` of the destination.
    pub(crate) fn row(width: usize, src_row: usize, dst_row: usize) -> Copy2d {
        Copy2d {
            rows: 1,
            width,
            src_stride: width,
            src_off: src_row * width,
            src_rep: 1,
            dst_stride: width,
            dst_off: dst_row * width,
        }
    }
}

/// Shapes of the absorbed MLA projections: `n_head` heads, query heads of `dk = nope + n_rot`,
/// a latent of `kv_lora`, value heads of `dv`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlaShape {
    pub n_head: usize,
    pub nope: usize,
    pub n_rot: usize,
    pub kv_lora: usize,
    pub dv: usize,
}

impl MlaShape {
    /// Tokens of a query of `len` values (`n_head` heads of `nope + n_rot`), for `k_b`.
    pub fn query_tokens(&self, k_b: &Weight, len: usize) -> Result<usize> {
        self.tokens(k_b, len, self.nope + self.n_rot, "query")
    }

    /// Tokens of a latent attention output of `len` values (`n_head` heads of `kv_lora`), for `v_b`.
    pub fn latent_tokens(&self, v_b: &Weight, len: usize) -> Result<usize> {
        self.tokens(v_b, len, self.kv_lora, "latent")
    }

    fn tokens(&self, w: &Weight, len: usize, head: usize, what: &str) -> Result<usize> {
        let n = len / (self.n_head * head).max(1);
        if len != n * self.n_head * head {
            return Err(Error::Model(format!("{}: {len} {what} values for heads of {head}", w.name)));
        }
        Ok(n)
    }
}

/// A cache store, its device and the layers it holds.
pub(crate) type KvStoreOn = (DevId, Vec<usize>, Box<dyn KvStore>);

/// Devices, the placement of the weights on them, and the ops of a forward pass.
pub struct Exec {
    devs: Vec<Box<dyn Device>>,
    cpu: Arc<CpuBackend>,
    /// Weight and vector names held by a device other than the CPU.
    place: HashMap<String, DevId>,
    /// The description printed at load.
    description: String,
    /// `--no-kv-offload`: the KV cache (and so attention) stays on the CPU.
    kv_on_cpu: bool,
    /// Weights are asked for ahead of use ([`Exec::set_read_ahead`]).
    read_ahead: bool,
}

impl std::fmt::Debug for Exec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Exec({})", self.description)
    }
}

impl Exec {
    /// Everything on the CPU.
    pub fn cpu(threads: Threads) -> Exec {
        let description = format!(
            "all tensors on CPU ({} threads; {} for batches)",
            threads.decode_threads(),
            threads.batch_threads()
        );
        let cpu = Arc::new(CpuBackend::new(threads));
        Exec {
            devs: vec![Box::new(HostDevice::cpu(cpu.clone()))],
            cpu,
            place: HashMap::new(),
            description,
            kv_on_cpu: false,
            read_ahead: false,
        }
    }

    /// The CPU and a second host-memory device that stands in for a GPU: it holds the weights and
    /// vectors `on_device` names and runs their ops with the CPU's code in its own memory, and
    /// counts the copies to and from it and the host syncs as a GPU would. A test device for the
    /// executor's placement and crossings, not a user mode.
    pub fn with_stand_in(threads: Threads, names: impl IntoIterator<Item = String>) -> Exec {
        let mut ex = Exec::cpu(threads);
        let names: std::collections::HashSet<String> = names.into_iter().collect();
        ex.description = format!("{} tensors on HOST1 (a stand-in for a GPU), the rest on CPU", names.len());
        ex.place = names.iter().map(|n| (n.clone(), 1)).collect();
        ex.devs.push(Box::new(HostDevice::stand_in(1, ex.cpu.clone(), names)));
        ex
    }

    /// The CPU and a CUDA device per runtime (a GPU, or the host emulator in tests), holding the
    /// tensors of `gguf` that `placement` puts on them (`placement[name]` indexes `runtimes`):
    /// matrices whose type has a CUDA kernel and 1-D tensors; everything else stays on the CPU.
    /// Out of device memory while uploading is an error, so that the caller can fall back.
    pub fn with_cuda(
        threads: Threads,
        runtimes: Vec<tandem_cuda::Runtime>,
        gguf: &tandem_gguf::GgufModel,
        placement: &HashMap<String, usize>,
    ) -> Result<Exec> {
        let start = std::time::Instant::now();
        let cpu = Arc::new(CpuBackend::new(threads));
        let mut devs: Vec<Box<dyn Device>> = vec![Box::new(HostDevice::cpu(cpu.clone()))];
        let mut place = HashMap::new();
        let mut parts = Vec::new();
        let mut kept: Vec<(String, tandem_gguf::GgmlType)> = Vec::new();
        for (i, rt) in runtimes.into_iter().enumerate() {
            let rt = Arc::new(rt);
            let names: Vec<String> = placement.iter().filter(|(_, &r)| r == i).map(|(n, _)| n.clone()).collect();
            let desc = rt.info().describe();
            let (dev, load) = crate::cuda::CudaDevice::new(devs.len(), rt, gguf, &names)?;
            for n in dev.held() {
                place.insert(n.clone(), devs.len());
            }
            parts.push(format!("{desc}: {} tensors, {:.2} GiB", load.tensors, load.bytes as f64 / (1u64 << 30) as f64));
            kept.extend(load.kept_on_cpu);
            devs.push(Box::new(dev));
        }
        if !kept.is_empty() {
            let mut types: Vec<&str> = kept.iter().map(|(_, t)| t.name()).collect();
            types.sort_unstable();
            types.dedup();
            parts.push(format!(
                "{} tensors of types without a CUDA kernel ({}) stay on the CPU",
                kept.len(),
                types.join(", ")
            ));
        }
        let description = format!("{}; uploaded in {:.1} s", parts.join("; "), start.elapsed().as_secs_f64());
        Ok(Exec { devs, cpu, place, description, kv_on_cpu: false, read_ahead: false })
    }

    /// Keeps the KV cache on the CPU (llama.cpp's `--no-kv-offload`): attention runs there, and
    /// each layer's query and output cross to it and back.
    pub fn keep_kv_on_cpu(&mut self) {
        self.kv_on_cpu = true;
        self.description.push_str("; KV cache on the CPU (--no-kv-offload)");
    }

    /// Asks the kernel ahead for weights the CPU reads from a mapped file: each layer's chosen
    /// experts as soon as the router has picked them, and the next layer's other weights while
    /// this one runs, so that reads from storage overlap the work. For a model mapped from
    /// storage that does not fit in memory; elsewhere the advice costs a few system calls per
    /// layer and gains nothing.
    pub fn set_read_ahead(&mut self, on: bool) {
        self.read_ahead = on;
        for d in &self.devs {
            d.set_read_ahead(on);
        }
    }

    /// Whether [`Exec::set_read_ahead`] turned reading ahead on.
    pub fn reads_ahead(&self) -> bool {
        self.read_ahead
    }

    /// The device that keeps the cache rows of a layer whose attention weights are on `d`.
    pub(crate) fn kv_device(&self, d: DevId) -> DevId {
        if self.kv_on_cpu {
            CPU
        } else {
            d
        }
    }

    /// One line: where the tensors are.
    pub fn describe(&self) -> &str {
        &self.description
    }

    pub fn threads(&self) -> &Threads {
        self.cpu.threads()
    }

    /// Whether the weight or vector `name` is held by a device other than the CPU (the CPU never
    /// multiplies it, so repacking leaves it alone).
    pub fn holds_elsewhere(&self, name: &str) -> bool {
        self.place.contains_key(name)
    }

    /// Each device's name and ledger counts now.
    pub fn ledgers(&self) -> Vec<(String, Counts)> {
        self.devs.iter().map(|d| (d.name().to_string(), d.ledger().counts())).collect()
    }

    /// Runs `f` (the forward pass of a micro-batch) on a thread of the CPU's pool, so that its
    /// threads stay awake for every CPU op of the step, across the other devices' phases too.
    pub(crate) fn run_step(&self, n_tokens: usize, f: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        self.cpu.run_step(n_tokens, f)
    }

    /// The device that holds `name` (the CPU when no other does).
    pub(crate) fn dev_of(&self, name: &str) -> DevId {
        if self.place.is_empty() {
            return CPU;
        }
        self.place.get(name).copied().unwrap_or(CPU)
    }

    /// The device that holds all of `names`, or the CPU (which reads any weight).
    fn dev_of_all(&self, names: &[&str]) -> DevId {
        let d = self.dev_of(names.first().copied().unwrap_or(""));
        if names.iter().all(|n| self.dev_of(n) == d) {
            d
        } else {
            CPU
        }
    }

    /// `t` on device `d`: itself, or a copy made there.
    pub(crate) fn on<'t>(&self, d: DevId, t: &'t Tensor) -> Result<Arg<'t>> {
        if t.dev == d {
            return Ok(Arg::Same(t));
        }
        Ok(Arg::Copied(self.copy(t, d)?))
    }

    fn copy(&self, t: &Tensor, d: DevId) -> Result<Tensor> {
        let m = self.move_begin(t, d)?;
        self.move_end(m)
    }

    /// Starts copying `t` to device `d`: a copy to the host is queued now, and work queued after
    /// this call does not delay it; [`Exec::move_end`] waits for it.
    pub(crate) fn move_begin(&self, t: &Tensor, d: DevId) -> Result<Moving> {
        let from = match t.dev {
            CPU => Pending::Ready(t.as_host()?.to_vec()),
            src => self.devs[src].download_begin(t)?,
        };
        Ok(Moving { from: t.dev, to: d, pending: from })
    }

    pub(crate) fn move_end(&self, m: Moving) -> Result<Tensor> {
        let host = match (m.from, m.pending) {
            (CPU, Pending::Ready(v)) => v,
            (from, p) => self.devs[from].download_end(p)?,
        };
        match m.to {
            CPU => Ok(Tensor::host(CPU, host)),
            d => self.devs[d].upload(&host),
        }
    }

    /// Moves `t` to device `d` (a copy, unless it is there).
    pub(crate) fn move_to(&self, t: &mut Tensor, d: DevId) -> Result<()> {
        if t.dev != d {
            *t = self.copy(t, d)?;
        }
        Ok(())
    }

    /// The values of `t` on the host (a copy and a wait unless it is on the CPU).
    pub(crate) fn to_host(&self, t: Tensor) -> Result<Vec<f32>> {
        match t.dev {
            CPU => t.into_host(),
            d => {
                let p = self.devs[d].download_begin(&t)?;
                self.devs[d].download_end(p)
            }
        }
    }

    /// Hands the micro-batch to every device (the rope rows and cache addressing it needs, one
    /// copy each), with the hidden state `x` to device `x_dev`; returns `x` there.
    pub(crate) fn begin_step(&self, ub: &Ubatch, cache: &mut KvCache, x: Vec<f32>, x_dev: DevId) -> Result<Tensor> {
        let mut out = None;
        for d in 1..self.devs.len() {
            let kv = cache.store_on_mut(d);
            let xd = (d == x_dev).then_some(&x[..]);
            let r = self.devs[d].begin_step(ub, kv, xd)?;
            if d == x_dev {
                out = r;
            }
        }
        match out {
            Some(t) => Ok(t),
            None if x_dev == CPU => Ok(Tensor::host(CPU, x)),
            None => self.devs[x_dev].upload(&x),
        }
    }

    pub(crate) fn matmul(&self, w: &Weight, x: &Tensor) -> Result<Tensor> {
        let d = self.dev_of(&w.name);
        self.devs[d].matmul(w, &*self.on(d, x)?)
    }

    /// Products of several weights with one input, on the device that holds them all (else the CPU).
    pub(crate) fn matmul_same_input(&self, ws: &[&Weight], x: &Tensor) -> Result<Vec<Tensor>> {
        let names: Vec<&str> = ws.iter().map(|w| w.name.as_str()).collect();
        let d = self.dev_of_all(&names);
        self.devs[d].matmul_same_input(ws, &*self.on(d, x)?)
    }

    /// A new tensor: each row of `x` RMS-normalized and scaled by `w`, where `w` is held.
    pub(crate) fn rmsnorm(&self, x: &Tensor, w: &Vector, eps: f32) -> Result<Tensor> {
        let d = self.dev_of(&w.name);
        let mut h = match self.on(d, x)? {
            Arg::Copied(t) => t,
            Arg::Same(t) => self.devs[d].duplicate(t)?,
        };
        self.devs[d].rmsnorm(&mut h, w, Rows::dense(w.v.len()), eps)?;
        Ok(h)
    }

    /// RMS norm in place of part of each row of `x` (where `x` is).
    pub(crate) fn rmsnorm_in_place(&self, x: &mut Tensor, w: &Vector, rows: Rows, eps: f32) -> Result<()> {
        self.devs[x.dev].rmsnorm(x, w, rows, eps)
    }

    /// Rotary embedding in place of the heads of `x` at the micro-batch's positions (where `x` is).
    pub(crate) fn rope(&self, x: &mut Tensor, ub: &Ubatch, h: Heads, style: RopeStyle) -> Result<()> {
        self.devs[x.dev].rope(x, ub, h, style)
    }

    /// `x += y` where `x` is.
    pub(crate) fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        let d = x.dev;
        self.devs[d].add(x, &*self.on(d, y)?)
    }

    /// A new zeroed tensor of `n` values on `d`.
    pub(crate) fn zeros(&self, d: DevId, n: usize) -> Result<Tensor> {
        self.devs[d].zeros(n)
    }

    /// A strided copy from `src` into `dst` (where `dst` is).
    pub(crate) fn copy_rows(&self, dst: &mut Tensor, src: &Tensor, c: Copy2d) -> Result<()> {
        let d = dst.dev;
        self.devs[d].copy_rows(dst, &*self.on(d, src)?, c)
    }

    /// Rows `rows` of `x` (rows of `cols`), as a new tensor where `x` is.
    pub(crate) fn gather_rows(&self, x: &Tensor, cols: usize, rows: &[usize]) -> Result<Tensor> {
        let mut out = self.zeros(x.dev, rows.len() * cols)?;
        for (i, &r) in rows.iter().enumerate() {
            self.copy_rows(&mut out, x, Copy2d::row(cols, r, i))?;
        }
        Ok(out)
    }

    /// The rows of `src` (rows of `cols`) into rows `rows` of `dst`.
    pub(crate) fn scatter_rows(&self, dst: &mut Tensor, src: &Tensor, cols: usize, rows: &[usize]) -> Result<()> {
        for (i, &r) in rows.iter().enumerate() {
            self.copy_rows(dst, src, Copy2d::row(cols, i, r))?;
        }
        Ok(())
    }

    /// A SwiGLU FFN on the device that holds its three matrices (else the CPU).
    pub(crate) fn ffn(&self, f: &Ffn, x: &Tensor) -> Result<Tensor> {
        let d = self.dev_of_all(&[&f.gate.name, &f.up.name, &f.down.name]);
        self.devs[d].ffn(f, &*self.on(d, x)?)
    }

    /// The routed experts of a MoE layer on the normalized hidden state `h`, plus the shared
    /// expert's output when there is one: `[n][n_embd]`, where `h` is.
    ///
    /// All on one device that has a fused form: that. Otherwise the router runs on its device and
    /// packs `h` with each token's expert ids and weights; the packet crosses to the experts'
    /// device (one copy); the shared expert is queued on its device before the experts start, so
    /// the two overlap where the devices are asynchronous; the experts' weighted sum crosses back
    /// (one copy) and the shared expert's output is added to it.
    pub(crate) fn moe(&self, m: &Moe, shared: Option<&Ffn>, h: &Tensor) -> Result<Tensor> {
        let (gate, up, down) = m.expert_names();
        let de = self.dev_of_all(&[gate, up, down]);
        let dr = self.dev_of(m.router_name());
        let ds = shared.map(|s| self.dev_of_all(&[&s.gate.name, &s.up.name, &s.down.name]));
        if dr == de && ds.is_none_or(|d| d == de) {
            if let Some(out) = self.devs[de].moe(m, shared, &*self.on(de, h)?)? {
                return Ok(out);
            }
        }
        let packet = self.devs[dr].route(m, &*self.on(dr, h)?)?;
        // The packet's copy is queued before the shared expert, so the experts' device gets it
        // while the shared expert runs.
        let moving = (de != dr).then(|| self.move_begin(&packet, de)).transpose()?;
        let sh = match (shared, ds) {
            (Some(s), Some(d)) => Some(self.devs[d].ffn(s, &*self.on(d, h)?)?),
            _ => None,
        };
        let routed = match moving {
            Some(mv) => {
                let pe = self.move_end(mv)?;
                self.devs[de].experts(m, &pe)?
            }
            None => self.devs[de].experts(m, &packet)?,
        };
        let mut out = match self.on(h.dev, &routed)? {
            Arg::Copied(t) => t,
            Arg::Same(_) => routed,
        };
        if let Some(sh) = sh {
            self.add(&mut out, &sh)?;
        }
        Ok(out)
    }

    /// Appends the micro-batch's K (and V) rows of layer `il` to the cache, on its device.
    pub(crate) fn kv_store(
        &self,
        cache: &mut KvCache,
        il: usize,
        ub: &Ubatch,
        k: &Tensor,
        v: Option<&Tensor>,
    ) -> Result<()> {
        let (d, store) = cache.store_mut(il)?;
        let dev = &self.devs[d];
        let k = self.on(d, k)?;
        match v {
            Some(v) => dev.kv_store(store, il, ub, &k, Some(&*self.on(d, v)?)),
            None => dev.kv_store(store, il, ub, &k, None),
        }
    }

    /// Attention of the micro-batch's tokens `c.tokens` (their rows cached) over layer `c.il` of
    /// the cache, on its device: `q` is `[tokens][n_head * dk]`; returns `[tokens][n_head * dv]`.
    pub(crate) fn attention(&self, cache: &KvCache, q: &Tensor, c: &AttnCall) -> Result<Tensor> {
        let (d, store) = cache.store(c.il)?;
        self.devs[d].attention(store, &*self.on(d, q)?, c)
    }

    /// `[n][n_head][kv_lora + n_rot]`: each head's `q_nope` times its `attn_k_b`, then its `q_pe`.
    pub(crate) fn mla_q(&self, k_b: &Weight, q: &Tensor, s: MlaShape) -> Result<Tensor> {
        let d = self.dev_of(&k_b.name);
        self.devs[d].mla_q(k_b, &*self.on(d, q)?, s)
    }

    /// `[n][n_head * dv]`: each head's latent output times its `attn_v_b`.
    pub(crate) fn mla_out(&self, v_b: &Weight, lat: &Tensor, s: MlaShape) -> Result<Tensor> {
        let d = self.dev_of(&v_b.name);
        self.devs[d].mla_out(v_b, &*self.on(d, lat)?, s)
    }

    /// The decompressed MLA attention of one sequence's run of tokens, where the cache is, or
    /// `None` where that device does not have it or does not hold `attn_k_b` and `attn_v_b`.
    pub(crate) fn mla_decompressed(&self, cache: &KvCache, q: &Tensor, c: &MlaCall) -> Result<Option<Tensor>> {
        let (d, store) = cache.store(c.il)?;
        // It reads the cache rows and both matrices where they are, or not at all.
        if self.dev_of(&c.k_b.name) != d || self.dev_of(&c.v_b.name) != d {
            return Ok(None);
        }
        self.devs[d].mla_decompressed(store, &*self.on(d, q)?, c)
    }

    /// The stores a cache of these layers needs: one per device that holds a layer's attention.
    pub(crate) fn kv_stores(
        &self,
        layer_dev: &[DevId],
        layout: crate::kv_cache::KvLayout,
        k: tandem_gguf::GgmlType,
        v: tandem_gguf::GgmlType,
    ) -> Result<Vec<KvStoreOn>> {
        let mut out = Vec::new();
        for d in 0..self.devs.len() {
            let layers: Vec<usize> = (0..layer_dev.len()).filter(|&il| layer_dev[il] == d).collect();
            if !layers.is_empty() {
                let store = self.devs[d].kv_new(layout, &layers, k, v)?;
                out.push((d, layers, store));
            }
        }
        Ok(out)
    }
}
