//! A CUDA device of the executor: weights, norm vectors, activations and the KV cache in device
//! memory ([`tandem_cuda::Runtime`], a GPU or the host emulator), every op a launch queued on one
//! stream. The host waits only where a tensor leaves the device (the packet of a MoE layer whose
//! experts run on the CPU, the logits), and a step reaches the device in one copy: each token's
//! cache addressing, its rope rows and (on the device of the first layer) the hidden state.

use crate::common::{Ffn, Ubatch};
use crate::device::{AttnCall, Device, KvStore};
use crate::exec::{Copy2d, DevId, Heads, Ledger, MlaShape, Pending, Rows, Tensor};
use crate::kv_cache::{KvLayout, StoreLayers};
use crate::moe::Moe;
use crate::weights::{Vector, Weight};
use crate::{Error, Result};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tandem_cpu::RopeStyle;
use tandem_cuda::{
    AttnShape as CuAttn, Batched, CacheKind, CopyRows, DeviceBuffer, GemmPrecision, KvMeta, Runtime, MAX_MATVEC_TOKENS,
};
use tandem_gguf::{GgmlType, GgufModel};
use tandem_quant::dequantize_row;

/// Cached rows per attention split (flash-decoding), and the most splits.
const ROWS_PER_SPLIT: usize = 512;
const MAX_SPLITS: usize = 64;
/// Rows a sequence's cache starts with on the device; it doubles as it fills.
const KV_MIN_ROWS: usize = 256;

fn cuda(e: tandem_cuda::Error) -> Error {
    Error::Model(e.to_string())
}

/// A matrix in device memory as the file has it.
struct DevWeight {
    buf: DeviceBuffer<u8>,
    ty: GgmlType,
}

/// What a step put on the device: `[n][4]` cache addressing (KvMeta as f32 bits), then `[n][n_rot]`
/// rope rows.
struct Step {
    blob: DeviceBuffer<f32>,
    n: usize,
    rope_off: usize,
}

/// What was uploaded at construction.
#[derive(Clone, Debug, Default)]
pub struct CudaLoad {
    pub tensors: usize,
    pub bytes: u64,
    /// Matrices placed here whose type has no CUDA kernel: they stay on the CPU (name, type).
    pub kept_on_cpu: Vec<(String, GgmlType)>,
}

pub(crate) struct CudaDevice {
    id: DevId,
    name: String,
    rt: Arc<Runtime>,
    weights: HashMap<String, DevWeight>,
    vectors: HashMap<String, DeviceBuffer<f32>>,
    step: Mutex<Option<Step>>,
}

impl CudaDevice {
    /// Uploads the tensors of `gguf` that `names` lists: matrices whose type has a kernel (the
    /// others are reported in [`CudaLoad::kept_on_cpu`]) and 1-D tensors (as f32). Out of device
    /// memory is an error, so that the caller can fall back to the CPU.
    pub fn new(id: DevId, rt: Arc<Runtime>, gguf: &GgufModel, names: &[String]) -> Result<(CudaDevice, CudaLoad)> {
        let mut load = CudaLoad::default();
        let mut weights = HashMap::new();
        let mut vectors = HashMap::new();
        for name in names {
            let Some(t) = gguf.tensor(name) else { continue };
            let info = t.info;
            let bytes = gguf.data(t);
            if info.dims.len() < 2 || info.dims[1..].iter().all(|&d| d == 1) {
                let n = info.dims.iter().product::<u64>() as usize;
                let mut v = vec![0f32; n];
                dequantize_row(info.ty, bytes, &mut v)?;
                vectors.insert(name.clone(), rt.upload(&v, &format!("tensor '{name}'")).map_err(cuda)?);
            } else if rt.supports(info.ty) {
                let buf = rt.upload(bytes, &format!("tensor '{name}'")).map_err(cuda)?;
                weights.insert(name.clone(), DevWeight { buf, ty: info.ty });
            } else {
                load.kept_on_cpu.push((name.clone(), info.ty));
                continue;
            }
            load.tensors += 1;
            load.bytes += bytes.len() as u64;
        }
        rt.synchronize().map_err(cuda)?;
        let name = format!("CUDA{}", rt.info().ordinal);
        Ok((CudaDevice { id, name, rt, weights, vectors, step: Mutex::new(None) }, load))
    }

    /// The names this device holds.
    pub fn held(&self) -> impl Iterator<Item = &String> {
        self.weights.keys().chain(self.vectors.keys())
    }

    fn out(&self, len: usize, what: &str) -> Result<Tensor> {
        Ok(Tensor::cuda(self.id, len, self.rt.alloc::<f32>(len.max(1), what).map_err(cuda)?))
    }

    fn weight(&self, w: &Weight) -> Result<&DevWeight> {
        self.weights.get(&w.name).ok_or_else(|| Error::Model(format!("{}: not held by {}", w.name, self.name)))
    }

    fn vector(&self, v: &Vector) -> Result<&DeviceBuffer<f32>> {
        self.vectors.get(&v.name).ok_or_else(|| Error::Model(format!("{}: not held by {}", v.name, self.name)))
    }

    fn mine<'t>(&self, t: &'t Tensor) -> Result<&'t DeviceBuffer<f32>> {
        if t.dev() != self.id {
            return Err(Error::Model(format!("a tensor of device {} given to {}", t.dev(), self.name)));
        }
        t.buf()
    }

    fn named<'a>(&'a self, what: &'a str) -> impl Fn(tandem_cuda::Error) -> Error + 'a {
        move |e| Error::Model(format!("{what} on {}: {e}", self.name))
    }

    /// `y = W x` for the rows of `x` (`[n][cols]`), the input rounded as the CPU rounds it for
    /// `W`'s type (see [`CudaDevice::rounded`]) unless the product is an f16 gemm
    /// (`TANDEM_CUDA_GEMM=f16`, which rounds to f16 itself).
    fn matmul_into(&self, w: &Weight, x: &DeviceBuffer<f32>, n: usize, y: &DeviceBuffer<f32>) -> Result<()> {
        let dw = self.weight(w)?;
        let f32_gemm = self.rt.gemm_precision() == GemmPrecision::F32;
        let xr = self.rounded(dw.ty, x, n, w.cols(), w.cols(), n <= MAX_MATVEC_TOKENS || f32_gemm)?;
        let x = xr.as_ref().unwrap_or(x);
        self.rt.matmul(dw.ty, dw.buf.span(0), x, y, w.rows(), w.cols(), n).map_err(self.named(&w.name))
    }

    /// The first `cols` values of `n_rows` rows of `x` (`stride` apart) as ggml's CPU backend
    /// rounds activations for weights of type `ty` (Q8_0 or Q8_K blocks, f16, bf16), in a new
    /// buffer of the same layout; `None` where the values are used as they are (f32 weights, or
    /// not `round`). So the products see the values llama.cpp's CPU path sees, and the GPU's
    /// logits stay as close to llama.cpp's as the CPU's (the kernels' and cuBLAS's f32 sums differ
    /// from the CPU's integer ones by float order only).
    fn rounded(
        &self,
        ty: GgmlType,
        x: &DeviceBuffer<f32>,
        n_rows: usize,
        cols: usize,
        stride: usize,
        round: bool,
    ) -> Result<Option<DeviceBuffer<f32>>> {
        if !round
            || !matches!(
                tandem_quant::vec_dot_type(ty),
                GgmlType::Q8_0 | GgmlType::Q8_K | GgmlType::F16 | GgmlType::BF16
            )
        {
            return Ok(None);
        }
        let y = self.rt.alloc::<f32>(n_rows * stride, "rounded activations").map_err(cuda)?;
        self.rt.round_acts(ty, x.span(0), y.span(0), n_rows, cols, stride, stride).map_err(cuda)?;
        Ok(Some(y))
    }

    /// A batched matvec over token chunks of at most 8: `b` describes one chunk's tokens; `x_off`
    /// and `y_off` advance by `b.x_tok` and `b.y_tok` per token.
    #[allow(clippy::too_many_arguments)]
    fn matvec_tokens(
        &self,
        w: &DevWeight,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n: usize,
        b: &Batched,
        what: &str,
    ) -> Result<()> {
        for t0 in (0..n).step_by(MAX_MATVEC_TOKENS) {
            let nt = (n - t0).min(MAX_MATVEC_TOKENS);
            let bt = Batched { n_tokens: nt, ..b.clone() };
            self.rt
                .matvec(w.ty, w.buf.span(0), x.span(t0 * b.x_tok), y.span(t0 * b.y_tok), rows, cols, &bt)
                .map_err(self.named(what))?;
        }
        Ok(())
    }

    fn kv<'k>(&self, kv: &'k dyn KvStore) -> Result<&'k CudaKv> {
        kv.as_any()
            .downcast_ref::<CudaKv>()
            .ok_or_else(|| Error::Model(format!("{}: a cache of another device", self.name)))
    }

    /// The step's addressing of the tokens `tokens` of the micro-batch: the step's own when they
    /// are all of it in order, else a copy made here for them.
    fn meta(&self, ub: &Ubatch, tokens: &[usize]) -> Result<(Option<DeviceBuffer<f32>>, usize)> {
        let step = self.step.lock().map_err(|_| Error::Model("CUDA step lock poisoned".into()))?;
        let s = step.as_ref().ok_or_else(|| Error::Model(format!("{}: no step begun", self.name)))?;
        if s.n != ub.len() {
            return Err(Error::Model(format!("{}: a step of {} tokens, {} given", self.name, s.n, ub.len())));
        }
        if tokens.iter().enumerate().all(|(i, &t)| i == t) {
            return Ok((None, 0));
        }
        let m = self.rt.alloc::<f32>(4 * tokens.len(), "cache addressing").map_err(cuda)?;
        for (i, &t) in tokens.iter().enumerate() {
            self.rt.copy(m.span(4 * i), s.blob.span(4 * t), 4).map_err(cuda)?;
        }
        Ok((Some(m), 0))
    }

    fn with_step<R>(&self, f: impl FnOnce(&Step) -> Result<R>) -> Result<R> {
        let step = self.step.lock().map_err(|_| Error::Model("CUDA step lock poisoned".into()))?;
        f(step.as_ref().ok_or_else(|| Error::Model(format!("{}: no step begun", self.name)))?)
    }
}

impl Device for CudaDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn ledger(&self) -> &Ledger {
        self.rt.ledger()
    }

    fn upload(&self, data: &[f32]) -> Result<Tensor> {
        Ok(Tensor::cuda(self.id, data.len(), self.rt.upload(data, "activations").map_err(cuda)?))
    }

    fn download_begin(&self, t: &Tensor) -> Result<Pending> {
        let r = self.rt.read_begin(self.mine(t)?, 0, t.len()).map_err(cuda)?;
        Ok(Pending::Reading(r, t.len()))
    }

    fn download_end(&self, p: Pending) -> Result<Vec<f32>> {
        match p {
            Pending::Reading(r, n) => {
                let mut v = vec![0f32; n];
                self.rt.read_end(r, &mut v).map_err(cuda)?;
                Ok(v)
            }
            Pending::Ready(_) => Err(Error::Model(format!("{}: a host read ended on the device", self.name))),
        }
    }

    fn zeros(&self, n: usize) -> Result<Tensor> {
        Ok(Tensor::cuda(self.id, n, self.rt.zeros::<f32>(n.max(1), "activations").map_err(cuda)?))
    }

    fn duplicate(&self, t: &Tensor) -> Result<Tensor> {
        let out = self.out(t.len(), "activations")?;
        self.rt.copy(out.buf()?.span(0), self.mine(t)?.span(0), t.len()).map_err(cuda)?;
        Ok(out)
    }

    fn begin_step(&self, ub: &Ubatch, kv: Option<&mut dyn KvStore>, x: Option<&[f32]>) -> Result<Option<Tensor>> {
        let n = ub.len();
        let mut meta = vec![KvMeta::default(); n];
        if let Some(kv) = kv {
            let store = kv
                .as_any_mut()
                .downcast_mut::<CudaKv>()
                .ok_or_else(|| Error::Model(format!("{}: a cache of another device", self.name)))?;
            store.reserve(ub)?;
            for (t, m) in meta.iter_mut().enumerate() {
                *m = store.meta(ub.seq[t], ub.pos[t])?;
            }
        }
        // One copy: the addressing, the rope rows, the hidden state.
        let rope_off = 4 * n;
        let x_off = rope_off + ub.rope.len();
        let mut blob = Vec::with_capacity(x_off + x.map_or(0, <[f32]>::len));
        for m in &meta {
            blob.extend_from_slice(&m.to_f32s());
        }
        blob.extend_from_slice(&ub.rope);
        if let Some(x) = x {
            blob.extend_from_slice(x);
        }
        let dev = self.rt.upload(&blob, "the step's inputs").map_err(cuda)?;
        let out = match x {
            Some(x) => {
                let t = self.out(x.len(), "hidden state")?;
                self.rt.copy(t.buf()?.span(0), dev.span(x_off), x.len()).map_err(cuda)?;
                Some(t)
            }
            None => None,
        };
        *self.step.lock().map_err(|_| Error::Model("CUDA step lock poisoned".into()))? =
            Some(Step { blob: dev, n, rope_off });
        Ok(out)
    }

    fn matmul(&self, w: &Weight, x: &Tensor) -> Result<Tensor> {
        let n = x.len() / w.cols().max(1);
        if n * w.cols() != x.len() {
            return Err(Error::Model(format!("{}: {} inputs for rows of {}", w.name, x.len(), w.cols())));
        }
        let y = self.out(n * w.rows(), "activations")?;
        self.matmul_into(w, self.mine(x)?, n, y.buf()?)?;
        Ok(y)
    }

    fn matmul_same_input(&self, ws: &[&Weight], x: &Tensor) -> Result<Vec<Tensor>> {
        ws.iter().map(|w| self.matmul(w, x)).collect()
    }

    fn rmsnorm(&self, x: &mut Tensor, w: &Vector, rows: Rows, eps: f32) -> Result<()> {
        if rows.stride == 0
            || !x.len().is_multiple_of(rows.stride)
            || rows.off + rows.dim > rows.stride
            || w.v.len() != rows.dim
        {
            return Err(Error::Model(format!("{}: RMS norm of {} values in rows of {}", w.name, x.len(), rows.stride)));
        }
        let n = x.len() / rows.stride;
        let wb = self.vector(w)?;
        self.rt
            .rmsnorm(self.mine(x)?.span(rows.off), n, rows.stride, rows.dim, Some(wb), eps)
            .map_err(self.named(&w.name))
    }

    fn rope(&self, x: &mut Tensor, ub: &Ubatch, h: Heads, style: RopeStyle) -> Result<()> {
        let n = ub.len();
        if x.len() != n * h.row {
            return Err(Error::Model(format!("rope of {} values in {n} rows of {}", x.len(), h.row)));
        }
        self.with_step(|s| {
            self.rt
                .rope(
                    self.mine(x)?.span(h.off),
                    s.blob.span(s.rope_off),
                    n,
                    h.n_heads,
                    h.head,
                    h.row,
                    ub.n_rot,
                    style == RopeStyle::Neox,
                )
                .map_err(self.named("rope"))
        })
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        if x.len() != y.len() {
            return Err(Error::Model(format!("add of {} values to {}", y.len(), x.len())));
        }
        self.rt.add(self.mine(x)?, self.mine(y)?, x.len()).map_err(cuda)
    }

    fn copy_rows(&self, dst: &mut Tensor, src: &Tensor, c: Copy2d) -> Result<()> {
        let cr = CopyRows {
            rows: c.rows,
            width: c.width,
            src_stride: c.src_stride,
            src_rep: c.src_rep.max(1),
            dst_stride: c.dst_stride,
        };
        self.rt.copy_rows(self.mine(dst)?.span(c.dst_off), self.mine(src)?.span(c.src_off), cr).map_err(cuda)
    }

    fn ffn(&self, f: &Ffn, x: &Tensor) -> Result<Tensor> {
        let n = x.len() / f.gate.cols().max(1);
        let (nf, no) = (f.n_ff(), f.n_out());
        if f.gate.rows() != nf || f.down.rows() != no {
            return Err(Error::Model(format!("{}: stacked experts are run by the router", f.gate.name)));
        }
        let g = self.out(n * nf, "FFN gate")?;
        let u = self.out(n * nf, "FFN up")?;
        let xb = self.mine(x)?;
        self.matmul_into(&f.gate, xb, n, g.buf()?)?;
        self.matmul_into(&f.up, xb, n, u.buf()?)?;
        self.rt.swiglu(g.buf()?, u.buf()?, n * nf).map_err(cuda)?;
        let y = self.out(n * no, "FFN out")?;
        self.matmul_into(&f.down, g.buf()?, n, y.buf()?)?;
        Ok(y)
    }

    fn route(&self, m: &Moe, x: &Tensor) -> Result<Tensor> {
        let r = m.routing();
        let ne = m.n_embd();
        let n = x.len() / ne.max(1);
        let logits = self.out(n * r.n_expert, "router logits")?;
        self.matmul_into(m.router(), self.mine(x)?, n, logits.buf()?)?;
        let ids = self.rt.alloc::<i32>(n * r.n_used, "expert ids").map_err(cuda)?;
        let weights = self.out(n * r.n_used, "expert weights")?;
        let bias = m.bias().map(|b| self.vector(b)).transpose()?;
        self.rt.router(logits.buf()?, bias, n, r, &ids, weights.buf()?).map_err(self.named(m.router_name()))?;
        let packet = self.out(n * m.packet_row(), "MoE packet")?;
        let shape = tandem_cuda::Packet { n_tokens: n, n_embd: ne, n_used: r.n_used };
        self.rt.moe_pack(self.mine(x)?, &ids, weights.buf()?, packet.buf()?, shape).map_err(cuda)?;
        Ok(packet)
    }

    fn experts(&self, m: &Moe, packet: &Tensor) -> Result<Tensor> {
        let e = m.experts();
        let r = m.routing();
        let (ne, nu, nf, row) = (m.n_embd(), r.n_used, e.n_ff(), m.packet_row());
        let n = packet.len() / row;
        let pb = self.mine(packet)?;
        let pairs = n * nu;
        let (gate, up, down) = (self.weight(&e.gate)?, self.weight(&e.up)?, self.weight(&e.down)?);
        let in_bytes = tandem_cuda::weight_bytes(gate.ty, nf, ne).map_err(cuda)?;
        let up_bytes = tandem_cuda::weight_bytes(up.ty, nf, ne).map_err(cuda)?;
        let down_bytes = tandem_cuda::weight_bytes(down.ty, ne, nf).map_err(cuda)?;
        let g = self.out(pairs * nf, "experts' gate")?;
        let u = self.out(pairs * nf, "experts' up")?;
        let y = self.out(pairs * ne, "experts' out")?;
        // Each token's row rounded for gate and up (the same activation type for both, as ggml's
        // k-quant and legacy experts have), in the packet's layout.
        let hr = self.rounded(gate.ty, pb, n, ne, row, true)?;
        let hr_up = match tandem_quant::vec_dot_type(up.ty) == tandem_quant::vec_dot_type(gate.ty) {
            true => None,
            false => self.rounded(up.ty, pb, n, ne, row, true)?,
        };
        // Each (token, slot) pair multiplies the expert its packet names; pairs in chunks the
        // grid's second dimension holds.
        for p0 in (0..pairs).step_by(65535 / nu * nu) {
            let np = (pairs - p0).min(65535 / nu * nu);
            let t0 = p0 / nu;
            let ids = Some((pb.span(t0 * row + ne), nu, row));
            let b = |w_grp, x_grp, x_div, y_grp| Batched {
                n_tokens: 1,
                n_groups: np,
                x_tok: 0,
                x_grp,
                x_grp_div: x_div,
                y_tok: 0,
                y_grp,
                w_grp_bytes: w_grp,
                n_mats: r.n_expert,
                ids,
            };
            let (gb, ub_) = (g.buf()?, u.buf()?);
            let xg = hr.as_ref().unwrap_or(pb);
            let xu = hr_up.as_ref().or(hr.as_ref()).unwrap_or(pb);
            self.rt
                .matvec(
                    gate.ty,
                    gate.buf.span(0),
                    xg.span(t0 * row),
                    gb.span(p0 * nf),
                    nf,
                    ne,
                    &b(in_bytes, row, nu, nf),
                )
                .map_err(self.named(&e.gate.name))?;
            self.rt
                .matvec(up.ty, up.buf.span(0), xu.span(t0 * row), ub_.span(p0 * nf), nf, ne, &b(up_bytes, row, nu, nf))
                .map_err(self.named(&e.up.name))?;
        }
        self.rt.swiglu(g.buf()?, u.buf()?, pairs * nf).map_err(cuda)?;
        let gr = self.rounded(down.ty, g.buf()?, pairs, nf, nf, true)?;
        let gx = gr.as_ref().unwrap_or(g.buf()?);
        for p0 in (0..pairs).step_by(65535 / nu * nu) {
            let np = (pairs - p0).min(65535 / nu * nu);
            let t0 = p0 / nu;
            let b = Batched {
                n_tokens: 1,
                n_groups: np,
                x_tok: 0,
                x_grp: nf,
                x_grp_div: 1,
                y_tok: 0,
                y_grp: ne,
                w_grp_bytes: down_bytes,
                n_mats: r.n_expert,
                ids: Some((pb.span(t0 * row + ne), nu, row)),
            };
            self.rt
                .matvec(down.ty, down.buf.span(0), gx.span(p0 * nf), y.buf()?.span(p0 * ne), ne, nf, &b)
                .map_err(self.named(&e.down.name))?;
        }
        let out = self.out(n * ne, "experts' sum")?;
        let shape = tandem_cuda::Packet { n_tokens: n, n_embd: ne, n_used: nu };
        self.rt.moe_sum(y.buf()?, pb, out.buf()?, shape).map_err(cuda)?;
        Ok(out)
    }

    fn mla_q(&self, k_b: &Weight, q: &Tensor, s: MlaShape) -> Result<Tensor> {
        let (nh, kl, nr, nope) = (s.n_head, s.kv_lora, s.n_rot, s.nope);
        let (dk, dq) = (nope + nr, kl + nr);
        let n = s.query_tokens(k_b, q.len())?;
        let w = self.weight(k_b)?;
        let qb = self.mine(q)?;
        let qr = self.rounded(w.ty, qb, n * nh, nope, dk, true)?;
        let out = self.out(n * nh * dq, "absorbed queries")?;
        let b = Batched::per_head(1, nh, dk, dq, tandem_cuda::weight_bytes(w.ty, kl, nope).map_err(cuda)?);
        self.matvec_tokens(w, qr.as_ref().unwrap_or(qb), out.buf()?, kl, nope, n, &b, &k_b.name)?;
        // Each head's q_pe after its absorbed part.
        let c = CopyRows { rows: n * nh, width: nr, src_stride: dk, src_rep: 1, dst_stride: dq };
        self.rt.copy_rows(out.buf()?.span(kl), qb.span(nope), c).map_err(cuda)?;
        Ok(out)
    }

    fn mla_out(&self, v_b: &Weight, lat: &Tensor, s: MlaShape) -> Result<Tensor> {
        let (nh, kl, dv) = (s.n_head, s.kv_lora, s.dv);
        let n = s.latent_tokens(v_b, lat.len())?;
        let w = self.weight(v_b)?;
        let out = self.out(n * nh * dv, "attention values")?;
        let b = Batched::per_head(1, nh, kl, dv, tandem_cuda::weight_bytes(w.ty, dv, kl).map_err(cuda)?);
        let lb = self.mine(lat)?;
        let lr = self.rounded(w.ty, lb, n * nh, kl, kl, true)?;
        self.matvec_tokens(w, lr.as_ref().unwrap_or(lb), out.buf()?, dv, kl, n, &b, &v_b.name)?;
        Ok(out)
    }

    fn kv_new(&self, layout: KvLayout, layers: &[usize], k: GgmlType, v: GgmlType) -> Result<Box<dyn KvStore>> {
        Ok(Box::new(CudaKv::new(self.rt.clone(), &self.name, layout, layers, k, v)?))
    }

    fn kv_store(&self, kv: &mut dyn KvStore, il: usize, ub: &Ubatch, k: &Tensor, v: Option<&Tensor>) -> Result<()> {
        let store = kv
            .as_any()
            .downcast_ref::<CudaKv>()
            .ok_or_else(|| Error::Model(format!("{}: a cache of another device", self.name)))?;
        let n = ub.len();
        let li = store.layers.at(il)?;
        let (kr, vr) = (store.layout.k_row, store.layout.v_row);
        if k.len() != n * kr || v.is_some_and(|v| v.len() != n * vr) || v.is_some() != (vr > 0) {
            return Err(Error::Model(format!("cache rows of layer {il}: {} values for {n} rows of {kr}", k.len())));
        }
        self.with_step(|s| {
            self.rt
                .kv_store(store.kind, self.mine(k)?.span(0), kr, s.blob.span(0), n, li, store.row_bytes, 0, kr)
                .map_err(self.named("the cache"))?;
            if let Some(v) = v {
                self.rt
                    .kv_store(
                        store.kind,
                        self.mine(v)?.span(0),
                        vr,
                        s.blob.span(0),
                        n,
                        li,
                        store.row_bytes,
                        store.k_bytes,
                        vr,
                    )
                    .map_err(self.named("the cache"))?;
            }
            Ok(())
        })
    }

    fn attention(&self, kv: &dyn KvStore, q: &Tensor, c: &AttnCall) -> Result<Tensor> {
        let AttnCall { il, ub, tokens, s, separate_v } = *c;
        let store = self.kv(kv)?;
        let li = store.layers.at(il)?;
        let n = tokens.len();
        if q.len() != n * s.n_head * s.dk {
            return Err(Error::Model(format!("attention of {n} tokens: {} query values", q.len())));
        }
        let out = self.out(n * s.n_head * s.dv, "attention out")?;
        if n == 0 {
            return Ok(out);
        }
        let max_pos = tokens.iter().map(|&t| ub.pos[t] as usize).max().unwrap_or(0);
        let n_split = (max_pos + 1).div_ceil(ROWS_PER_SPLIT).clamp(1, MAX_SPLITS);
        let shape = CuAttn {
            n_tokens: n,
            n_head: s.n_head,
            n_head_kv: s.n_head_kv,
            dk: s.dk,
            dv: s.dv,
            scale: s.scale,
            n_split,
        };
        let part = self.rt.alloc::<f32>(n * s.n_head * n_split * (s.dv + 2), "attention parts").map_err(cuda)?;
        let v_off = separate_v.then_some(store.k_bytes);
        let (own, off) = self.meta(ub, tokens)?;
        // q as the CPU hands it to the cache's dot product: rounded to f16 / bf16, or Q8_0 blocks.
        let q_ty = match store.kind {
            CacheKind::F16 => GgmlType::F16,
            CacheKind::BF16 => GgmlType::BF16,
            CacheKind::Q8_0 => GgmlType::Q8_0,
        };
        let qr = self.rounded(q_ty, self.mine(q)?, n * s.n_head, s.dk, s.dk, true)?;
        let qb = qr.as_ref().unwrap_or(self.mine(q)?);
        let run = |meta: &DeviceBuffer<f32>| {
            self.rt
                .attention(
                    store.kind,
                    qb,
                    meta.span(off),
                    max_pos,
                    li,
                    store.row_bytes,
                    v_off,
                    &shape,
                    &part,
                    out.buf()?,
                )
                .map_err(self.named("attention"))
        };
        match own {
            Some(m) => run(&m)?,
            None => self.with_step(|st| run(&st.blob))?,
        }
        Ok(out)
    }
}

/// One sequence's rows on the device: `[layer][cap][row_bytes]`, the first `len` rows of each
/// layer written.
struct SeqRows {
    buf: DeviceBuffer<u8>,
    cap: usize,
    len: usize,
}

/// The cache rows of the layers a CUDA device holds: per sequence one buffer with every layer's
/// rows (K then V in each row), grown by doubling on the device.
pub(crate) struct CudaKv {
    rt: Arc<Runtime>,
    layout: KvLayout,
    kind: CacheKind,
    k_bytes: usize,
    row_bytes: usize,
    layers: StoreLayers,
    seqs: HashMap<usize, SeqRows>,
}

impl CudaKv {
    fn new(
        rt: Arc<Runtime>,
        device: &str,
        layout: KvLayout,
        layers: &[usize],
        k: GgmlType,
        v: GgmlType,
    ) -> Result<CudaKv> {
        let kind = CacheKind::of(k)
            .ok_or_else(|| Error::Model(format!("the KV cache on {device} holds f16, bf16 or q8_0, not {k} (-ctk)")))?;
        if layout.v_row > 0 && v != k {
            return Err(Error::Model(format!(
                "the KV cache on {device} holds K and V in one type ({k} and {v} asked: give -ctk and -ctv the same)"
            )));
        }
        let bad = || Error::Model(format!("KV cache rows of {} values are not whole {k} blocks", layout.k_row));
        let k_bytes = kind.bytes(layout.k_row).ok_or_else(bad)?;
        let v_bytes = if layout.v_row == 0 { 0 } else { kind.bytes(layout.v_row).ok_or_else(bad)? };
        let layers = StoreLayers::new(&layout, layers)?;
        Ok(CudaKv { rt, layout, kind, k_bytes, row_bytes: k_bytes + v_bytes, layers, seqs: HashMap::new() })
    }

    /// Room for every position of the micro-batch (buffers grown on the device where needed).
    fn reserve(&mut self, ub: &Ubatch) -> Result<()> {
        let mut need: HashMap<usize, usize> = HashMap::new();
        for (&s, &p) in ub.seq.iter().zip(ub.pos) {
            let e = need.entry(s).or_insert(0);
            *e = (*e).max(p as usize + 1);
        }
        for (s, rows) in need {
            self.grow(s, rows)?;
        }
        for (&s, &p) in ub.seq.iter().zip(ub.pos) {
            if let Some(r) = self.seqs.get_mut(&s) {
                r.len = r.len.max(p as usize + 1);
            }
        }
        Ok(())
    }

    /// Room for `rows` rows of `seq`, its written rows kept (copied on the device).
    fn grow(&mut self, s: usize, rows: usize) -> Result<()> {
        let cap = self.seqs.get(&s).map_or(0, |r| r.cap);
        if rows <= cap {
            return Ok(());
        }
        let new_cap = rows.max(2 * cap).max(KV_MIN_ROWS);
        let buf = self.rt.alloc::<u8>(self.layers.len() * new_cap * self.row_bytes, "the KV cache").map_err(cuda)?;
        let len = self.seqs.get(&s).map_or(0, |r| r.len);
        if let Some(old) = self.seqs.get(&s) {
            for l in 0..self.layers.len() {
                let n = len * self.row_bytes;
                self.rt
                    .copy(buf.span(l * new_cap * self.row_bytes), old.buf.span(l * old.cap * self.row_bytes), n)
                    .map_err(cuda)?;
            }
        }
        self.seqs.insert(s, SeqRows { buf, cap: new_cap, len });
        Ok(())
    }

    /// Where token at `pos` of `seq` reads and writes its rows.
    fn meta(&self, seq: usize, pos: u32) -> Result<KvMeta> {
        let r = self.seqs.get(&seq).ok_or_else(|| Error::Model(format!("sequence {seq} has no cache rows")))?;
        Ok(KvMeta { base: r.buf.device_ptr(), cap: r.cap as u32, pos })
    }
}

impl KvStore for CudaKv {
    fn truncate(&mut self, seq: usize, n: usize) {
        if n == 0 {
            self.seqs.remove(&seq);
        } else if let Some(r) = self.seqs.get_mut(&seq) {
            r.len = r.len.min(n);
        }
    }

    fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        self.seqs.remove(&dst);
        let Some(s) = self.seqs.get(&src) else { return Ok(()) };
        let n = n.min(s.len);
        let cap = n.max(KV_MIN_ROWS);
        let buf = self.rt.alloc::<u8>(self.layers.len() * cap * self.row_bytes, "the KV cache").map_err(cuda)?;
        for l in 0..self.layers.len() {
            self.rt
                .copy(buf.span(l * cap * self.row_bytes), s.buf.span(l * s.cap * self.row_bytes), n * self.row_bytes)
                .map_err(cuda)?;
        }
        self.seqs.insert(dst, SeqRows { buf, cap, len: n });
        Ok(())
    }

    fn used_bytes(&self) -> usize {
        self.seqs.values().map(|r| r.len * self.row_bytes * self.layers.len()).sum()
    }

    fn append_zeros(&mut self, seq: usize, len: usize, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.grow(seq, len + n)?;
        let rb = self.row_bytes;
        let r = self.seqs.get_mut(&seq).ok_or_else(|| Error::Model(format!("sequence {seq} has no cache rows")))?;
        for l in 0..self.layers.len() {
            self.rt.fill_zero(&r.buf, (l * r.cap + len) * rb, n * rb).map_err(cuda)?;
        }
        r.len = len + n;
        Ok(())
    }

    fn read_rows(&self, seq: usize, il: usize, n: usize) -> Result<Vec<u8>> {
        let l = self.layers.at(il)?;
        let r = self.seqs.get(&seq).filter(|r| r.len >= n);
        let r = r.ok_or_else(|| Error::Model(format!("sequence {seq} has fewer than {n} rows in layer {il}")))?;
        let mut rows = vec![0u8; n * self.row_bytes];
        self.rt.read(&r.buf, l * r.cap * self.row_bytes, &mut rows).map_err(cuda)?;
        // Each device row holds K then V: the K rows first, then the V rows.
        let (kb, vb) = (self.k_bytes, self.row_bytes - self.k_bytes);
        let mut out = Vec::with_capacity(rows.len());
        rows.chunks_exact(self.row_bytes).for_each(|row| out.extend_from_slice(&row[..kb]));
        rows.chunks_exact(self.row_bytes).for_each(|row| out.extend_from_slice(&row[kb..kb + vb]));
        Ok(out)
    }

    fn write_rows(&mut self, seq: usize, il: usize, n: usize, data: &[u8]) -> Result<()> {
        let l = self.layers.at(il)?;
        let (kb, rb) = (self.k_bytes, self.row_bytes);
        if data.len() != n * rb {
            return Err(Error::Model(format!(
                "{} bytes for {n} rows of layer {il}, which take {}",
                data.len(),
                n * rb
            )));
        }
        let (k, v) = data.split_at(n * kb);
        let mut rows = Vec::with_capacity(data.len());
        for i in 0..n {
            rows.extend_from_slice(&k[i * kb..(i + 1) * kb]);
            rows.extend_from_slice(&v[i * (rb - kb)..(i + 1) * (rb - kb)]);
        }
        self.grow(seq, n)?;
        let r = self.seqs.get_mut(&seq).ok_or_else(|| Error::Model(format!("sequence {seq} has no cache rows")))?;
        self.rt.write(&r.buf, l * r.cap * rb, &rows).map_err(cuda)?;
        r.len = n;
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
