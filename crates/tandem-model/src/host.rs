//! The host device: tensors in host memory, ops by [`tandem_cpu::CpuBackend`], weights read in
//! place from the memory map (or their packed copies). It is the CPU of every executor; a second
//! one, with its own id and its copies and waits counted, stands in for a GPU in the tests
//! ([`crate::Exec::with_stand_in`]).

use crate::common::{Ffn, Ubatch};
use crate::device::{AttnCall, Device, KvStore, MlaCall};
use crate::exec::{Copy2d, DevId, Heads, Ledger, MlaShape, Pending, Rows, Tensor, CPU, STEP_META_BYTES};
use crate::kv_cache::{KvLayout, StoreLayers};
use crate::moe::Moe;
use crate::weights::{Vector, Weight};
use crate::{Error, Result};
use std::any::Any;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// Values per part of a sum the CPU splits over its threads (a row of a small model's hidden state;
/// a decode step's sums stay whole, a prefill's are split).
const ADD_PART: usize = 4096;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tandem_cpu::{Attn, CpuBackend, KvType, RebuiltRows, RopeStyle, WeightRef};
use tandem_gguf::GgmlType;
use tandem_quant::{quantize_row, row_size};

pub(crate) struct HostDevice {
    id: DevId,
    name: String,
    cpu: Arc<CpuBackend>,
    ledger: Ledger,
    /// A stand-in for a GPU: its copies and the host's waits for it are counted.
    stand_in: bool,
    /// The names a stand-in holds (the CPU reads everything).
    holds: HashSet<String>,
    /// Ask the kernel for the chosen experts' bytes before multiplying them.
    read_ahead: AtomicBool,
}

/// Adds the time since it was made to a ledger's busy time when dropped.
struct Busy<'a>(&'a Ledger, std::time::Instant);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy(self.1.elapsed());
    }
}

/// A CPU error about a weight, named.
fn named(name: &str) -> impl Fn(tandem_cpu::Error) -> Error + '_ {
    move |e| match e {
        tandem_cpu::Error::Shape(s) => Error::Model(format!("{name}: {s}")),
        other => other.into(),
    }
}

/// Each head's rows, one after another, of `n` tokens laid out `[n][n_heads][stride]`: for head
/// `h`, the first `width` values at `(t * n_heads + h) * stride` of every token `t`; for one token
/// they are where they are in `x`.
fn head_rows(x: &[f32], n: usize, n_heads: usize, stride: usize, width: usize) -> Vec<Cow<'_, [f32]>> {
    (0..n_heads)
        .map(|h| match n {
            1 => Cow::Borrowed(&x[h * stride..][..width]),
            _ => {
                let mut v = Vec::with_capacity(n * width);
                for t in 0..n {
                    v.extend_from_slice(&x[(t * n_heads + h) * stride..][..width]);
                }
                Cow::Owned(v)
            }
        })
        .collect()
}

impl HostDevice {
    /// Each head's first `width` values of the `n` rows of `x` (`n_heads` heads `stride` apart)
    /// times its own `out` rows of `w` (head `h` owns rows `h * out ..`): `[head][n * out]`.
    fn per_head(
        &self,
        w: &Weight,
        x: &[f32],
        n: usize,
        n_heads: usize,
        (stride, width): (usize, usize),
        out: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let m = self.matrix(w)?;
        let rows = head_rows(x, n, n_heads, stride, width);
        let xs: Vec<&[f32]> = rows.iter().map(|v| &v[..]).collect();
        let groups: Vec<(usize, usize)> = (0..n_heads).map(|h| (h * out, out)).collect();
        let mut ys = vec![vec![0f32; n * out]; n_heads];
        self.cpu.matmul_groups(&m, &groups, &xs, &mut ys).map_err(named(&w.name))?;
        Ok(ys)
    }

    pub fn cpu(cpu: Arc<CpuBackend>) -> HostDevice {
        HostDevice {
            id: CPU,
            name: "CPU".into(),
            cpu,
            ledger: Ledger::default(),
            stand_in: false,
            holds: HashSet::new(),
            read_ahead: AtomicBool::new(false),
        }
    }

    pub fn stand_in(id: DevId, cpu: Arc<CpuBackend>, holds: HashSet<String>) -> HostDevice {
        HostDevice {
            id,
            name: format!("HOST{id}"),
            cpu,
            ledger: Ledger::default(),
            stand_in: true,
            holds,
            read_ahead: AtomicBool::new(false),
        }
    }

    /// Counts an op and, until the guard drops, the time spent in it.
    fn op(&self) -> Busy<'_> {
        self.ledger.launch(1);
        Busy(&self.ledger, std::time::Instant::now())
    }

    fn out(&self, v: Vec<f32>) -> Tensor {
        Tensor::host(self.id, v)
    }

    /// A weight's matrix, checked to be one this device holds.
    fn matrix<'w>(&self, w: &'w Weight) -> Result<WeightRef<'w>> {
        if self.stand_in && !self.holds.contains(&w.name) {
            return Err(Error::Model(format!("{}: not held by {}", w.name, self.name)));
        }
        w.matrix()
    }

    fn mine<'t>(&self, t: &'t Tensor) -> Result<&'t [f32]> {
        if t.dev() != self.id {
            return Err(Error::Model(format!("a tensor of device {} given to {}", t.dev(), self.name)));
        }
        t.as_host()
    }

    fn mine_mut<'t>(&self, t: &'t mut Tensor) -> Result<&'t mut [f32]> {
        if t.dev() != self.id {
            return Err(Error::Model(format!("a tensor of device {} given to {}", t.dev(), self.name)));
        }
        t.as_host_mut()
    }

    fn kv<'k>(&self, kv: &'k dyn KvStore) -> Result<&'k HostKv> {
        kv.as_any()
            .downcast_ref::<HostKv>()
            .ok_or_else(|| Error::Model(format!("{}: a cache of another device", self.name)))
    }

    fn ffn_jobs<'w>(&self, specs: &[(&'w Ffn, usize, Vec<usize>)]) -> Result<Vec<tandem_cpu::FfnJob<'w>>> {
        specs
            .iter()
            .map(|(f, expert, tokens)| {
                let (nf, no) = (f.n_ff(), f.n_out());
                Ok(tandem_cpu::FfnJob {
                    gate: self.matrix(&f.gate)?.rows(expert * nf, nf)?,
                    up: self.matrix(&f.up)?.rows(expert * nf, nf)?,
                    down: self.matrix(&f.down)?.rows(expert * no, no)?,
                    tokens: tokens.clone(),
                })
            })
            .collect()
    }
}

impl Device for HostDevice {
    fn name(&self) -> &str {
        &self.name
    }

    fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    fn upload(&self, data: &[f32]) -> Result<Tensor> {
        if self.stand_in {
            self.ledger.h2d(std::mem::size_of_val(data));
        }
        Ok(self.out(data.to_vec()))
    }

    fn download_begin(&self, t: &Tensor) -> Result<Pending> {
        let v = self.mine(t)?.to_vec();
        if self.stand_in {
            self.ledger.d2h(std::mem::size_of_val(&v[..]));
        }
        Ok(Pending::Ready(v))
    }

    fn download_end(&self, p: Pending) -> Result<Vec<f32>> {
        match p {
            Pending::Ready(v) => {
                if self.stand_in {
                    self.ledger.sync(1);
                }
                Ok(v)
            }
            Pending::Reading(..) => Err(Error::Model(format!("{}: a device read ended on the host", self.name))),
        }
    }

    fn zeros(&self, n: usize) -> Result<Tensor> {
        Ok(self.out(vec![0f32; n]))
    }

    fn duplicate(&self, t: &Tensor) -> Result<Tensor> {
        Ok(self.out(self.mine(t)?.to_vec()))
    }

    fn begin_step(&self, ub: &Ubatch, kv: Option<&mut dyn KvStore>, x: Option<&[f32]>) -> Result<Option<Tensor>> {
        if !self.stand_in {
            return Ok(x.map(|x| self.out(x.to_vec())));
        }
        // What a GPU gets in one copy: the hidden state, the rope rows, each token's addressing.
        let n = ub.len();
        let bytes = 4 * (x.map_or(0, <[f32]>::len) + ub.rope.len()) + n * STEP_META_BYTES;
        if x.is_some() || kv.is_some() {
            self.ledger.h2d(bytes);
        }
        Ok(x.map(|x| self.out(x.to_vec())))
    }

    fn matmul(&self, w: &Weight, x: &Tensor) -> Result<Tensor> {
        let _busy = self.op();
        let m = self.matrix(w)?;
        let x = self.mine(x)?;
        let mut y = vec![0f32; x.len() / m.cols.max(1) * m.rows];
        self.cpu.matmul(&m, x, &mut y).map_err(named(&w.name))?;
        Ok(self.out(y))
    }

    fn matmul_same_input(&self, ws: &[&Weight], x: &Tensor) -> Result<Vec<Tensor>> {
        let _busy = self.op();
        let names = || ws.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ");
        let mats = ws.iter().map(|w| self.matrix(w)).collect::<Result<Vec<_>>>()?;
        let x = self.mine(x)?;
        let n = x.len() / mats.first().map_or(1, |m| m.cols.max(1));
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows]).collect();
        let mut refs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        self.cpu.matmul_same_input(&mats, x, &mut refs).map_err(|e| named(&names())(e))?;
        Ok(ys.into_iter().map(|y| self.out(y)).collect())
    }

    fn rmsnorm(&self, x: &mut Tensor, w: &Vector, rows: Rows, eps: f32) -> Result<()> {
        let _busy = self.op();
        let x = self.mine_mut(x)?;
        if rows.stride == 0
            || !x.len().is_multiple_of(rows.stride)
            || rows.off + rows.dim > rows.stride
            || w.v.len() != rows.dim
        {
            return Err(Error::Model(format!("{}: RMS norm of {} values in rows of {}", w.name, x.len(), rows.stride)));
        }
        self.cpu.for_parts(x, rows.stride, |_, row| {
            tandem_cpu::rmsnorm(&mut row[rows.off..rows.off + rows.dim], Some(&w.v), eps)
        });
        Ok(())
    }

    fn rope(&self, x: &mut Tensor, ub: &Ubatch, h: Heads, style: RopeStyle) -> Result<()> {
        let _busy = self.op();
        let x = self.mine_mut(x)?;
        let (n, nr) = (ub.len(), ub.n_rot);
        if x.len() != n * h.row || h.off + (h.n_heads.max(1) - 1) * h.head + nr > h.row || ub.rope.len() != n * nr {
            return Err(Error::Model(format!("rope of {} values in {n} rows of {}", x.len(), h.row)));
        }
        self.cpu.for_parts(x, h.row, |t, row| {
            let cache = &ub.rope[t * nr..(t + 1) * nr];
            for i in 0..h.n_heads {
                let s = h.off + i * h.head;
                tandem_cpu::rope(&mut row[s..s + nr], cache, style);
            }
        });
        Ok(())
    }

    fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        let _busy = self.op();
        let y = self.mine(y)?;
        let x = self.mine_mut(x)?;
        if x.len() != y.len() {
            return Err(Error::Model(format!("add of {} values to {}", y.len(), x.len())));
        }
        self.cpu.for_parts(x, ADD_PART, |i, p| tandem_cpu::add_assign(p, &y[i * ADD_PART..]));
        Ok(())
    }

    fn copy_rows(&self, dst: &mut Tensor, src: &Tensor, c: Copy2d) -> Result<()> {
        let _busy = self.op();
        let src = self.mine(src)?;
        let dst = self.mine_mut(dst)?;
        if c.rows == 0 {
            return Ok(());
        }
        let rep = c.src_rep.max(1);
        let src_end = ((c.rows - 1) / rep) * c.src_stride + c.src_off + c.width;
        let dst_end = (c.rows - 1) * c.dst_stride + c.dst_off + c.width;
        if src_end > src.len() || dst_end > dst.len() {
            return Err(Error::Model(format!("copy of {} rows of {}: outside the tensors", c.rows, c.width)));
        }
        for r in 0..c.rows {
            let s = (r / rep) * c.src_stride + c.src_off;
            let d = r * c.dst_stride + c.dst_off;
            dst[d..d + c.width].copy_from_slice(&src[s..s + c.width]);
        }
        Ok(())
    }

    fn ffn(&self, f: &Ffn, x: &Tensor) -> Result<Tensor> {
        let _busy = self.op();
        let x = self.mine(x)?;
        let cols = f.gate.cols();
        let n = x.len() / cols.max(1);
        let jobs = self.ffn_jobs(&[(f, 0, (0..n).collect())])?;
        let mut outs = self.cpu.ffn(x, cols, &jobs).map_err(named(&f.gate.name))?;
        Ok(self.out(outs.swap_remove(0)))
    }

    fn route(&self, m: &Moe, x: &Tensor) -> Result<Tensor> {
        let _busy = self.op();
        let router = self.matrix(m.router())?;
        Ok(self.out(m.route_packet(&self.cpu, &router, self.mine(x)?)?))
    }

    fn set_read_ahead(&self, on: bool) {
        self.read_ahead.store(on, Ordering::Relaxed);
    }

    fn experts(&self, m: &Moe, packet: &Tensor) -> Result<Tensor> {
        let _busy = self.op();
        let p = self.mine(packet)?;
        let (routes, h) = m.unpack(p)?;
        let (out, _) = self.routed(m, None, &h, &routes)?;
        Ok(self.out(out))
    }

    fn moe(&self, m: &Moe, shared: Option<&Ffn>, x: &Tensor) -> Result<Option<Tensor>> {
        let _busy = self.op();
        let h = self.mine(x)?;
        let router = self.matrix(m.router())?;
        let routes = m.route_rows(&self.cpu, &router, h)?;
        let (mut out, sh) = self.routed(m, shared, h, &routes)?;
        if let Some(sh) = sh {
            tandem_cpu::add_assign(&mut out, &sh);
        }
        Ok(Some(self.out(out)))
    }

    fn mla_q(&self, k_b: &Weight, q: &Tensor, s: MlaShape) -> Result<Tensor> {
        let _busy = self.op();
        let q = self.mine(q)?;
        let (nh, kl, nr, nope) = (s.n_head, s.kv_lora, s.n_rot, s.nope);
        let (dk, dq) = (nope + nr, kl + nr);
        let n = s.query_tokens(k_b, q.len())?;
        // Each head's `q_nope` rows.
        let absorbed = self.per_head(k_b, q, n, nh, (dk, nope), kl)?;
        let mut qcur = vec![0f32; n * nh * dq];
        for (hd, absorbed) in absorbed.iter().enumerate() {
            for t in 0..n {
                let dst = &mut qcur[(t * nh + hd) * dq..(t * nh + hd + 1) * dq];
                dst[..kl].copy_from_slice(&absorbed[t * kl..(t + 1) * kl]);
                dst[kl..].copy_from_slice(&q[(t * nh + hd) * dk + nope..(t * nh + hd + 1) * dk]);
            }
        }
        Ok(self.out(qcur))
    }

    fn mla_out(&self, v_b: &Weight, lat: &Tensor, s: MlaShape) -> Result<Tensor> {
        let _busy = self.op();
        let lat = self.mine(lat)?;
        let (nh, kl, dv) = (s.n_head, s.kv_lora, s.dv);
        let n = s.latent_tokens(v_b, lat.len())?;
        // Each head's latent output.
        let ys = self.per_head(v_b, lat, n, nh, (kl, kl), dv)?;
        let mut o = vec![0f32; n * nh * dv];
        for (hd, y) in ys.iter().enumerate() {
            for i in 0..n {
                o[(i * nh + hd) * dv..(i * nh + hd + 1) * dv].copy_from_slice(&y[i * dv..(i + 1) * dv]);
            }
        }
        Ok(self.out(o))
    }

    fn mla_decompressed(&self, kv: &dyn KvStore, q: &Tensor, c: &MlaCall) -> Result<Option<Tensor>> {
        let MlaCall { il, seq, n_kv, k_b, v_b, s, scale } = *c;
        let store = self.kv(kv)?;
        let Some(kv_type) = KvType::of(store.k_type) else { return Ok(None) };
        let _busy = self.op();
        let q = self.mine(q)?;
        if self.stand_in && !self.holds.contains(&k_b.name) {
            return Err(Error::Model(format!("{}: not held by {}", k_b.name, self.name)));
        }
        // attn_k_b and attn_v_b as stored (never a packed copy): made f32 once from these bytes.
        let k_plain = WeightRef::new(k_b.ty, k_b.rows(), k_b.cols(), k_b.bytes())?;
        let v_plain = WeightRef::new(v_b.ty, v_b.rows(), v_b.cols(), v_b.bytes())?;
        let heads =
            tandem_cpu::MlaHeads { n_head: s.n_head, nope: s.nope, n_rot: s.n_rot, kv_lora: s.kv_lora, dv: s.dv };
        let input = tandem_cpu::MlaDecompressed {
            q,
            heads,
            kv: store.rows(seq, il).0,
            kv_type,
            n_kv,
            k_b: k_plain,
            k_b_key: &k_b.name,
            v_b: v_plain,
            scale,
        };
        let mut out = vec![0f32; n_kv.len() * s.n_head * s.dv];
        let done = store.with_rebuilt(seq, il, heads, |keep| self.cpu.mla_decompressed(&input, keep, &mut out));
        match done.map_err(named(&k_b.name))? {
            true => Ok(Some(self.out(out))),
            false => Ok(None),
        }
    }

    fn kv_new(&self, layout: KvLayout, layers: &[usize], k: GgmlType, v: GgmlType) -> Result<Box<dyn KvStore>> {
        Ok(Box::new(HostKv::new(layout, layers, k, v)?))
    }

    fn kv_store(&self, kv: &mut dyn KvStore, il: usize, ub: &Ubatch, k: &Tensor, v: Option<&Tensor>) -> Result<()> {
        let _busy = self.op();
        let store = kv
            .as_any_mut()
            .downcast_mut::<HostKv>()
            .ok_or_else(|| Error::Model(format!("{}: a cache of another device", self.name)))?;
        let k = self.mine(k)?;
        let v = v.map(|v| self.mine(v)).transpose()?;
        let n = ub.len();
        let (kr, vr) = (store.layout.k_row, store.layout.v_row);
        if k.len() != n * kr || v.is_some_and(|v| v.len() != n * vr) {
            return Err(Error::Model(format!("cache rows of layer {il}: {} values for {n} rows of {kr}", k.len())));
        }
        for t in 0..n {
            let vt = v.map(|v| &v[t * vr..(t + 1) * vr]);
            store.push(ub.seq[t], il, &k[t * kr..(t + 1) * kr], vt)?;
        }
        Ok(())
    }

    fn attention(&self, kv: &dyn KvStore, q: &Tensor, c: &AttnCall) -> Result<Tensor> {
        let AttnCall { il, ub, tokens, s, separate_v } = *c;
        let _busy = self.op();
        let store = self.kv(kv)?;
        let q = self.mine(q)?;
        let q_len = s.n_head * s.dk;
        if q.len() != tokens.len() * q_len {
            return Err(Error::Model(format!("attention of {} tokens: {} query values", tokens.len(), q.len())));
        }
        let (Some(k_type), Some(v_type)) = (KvType::of(store.k_type), KvType::of(store.v_type)) else {
            return Err(Error::Model(format!("no attention over a {}/{} cache", store.k_type, store.v_type)));
        };
        let items: Vec<Attn> = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let (kb, vb) = store.rows(ub.seq[t], il);
                Attn {
                    q: &q[i * q_len..(i + 1) * q_len],
                    n_head: s.n_head,
                    n_head_kv: s.n_head_kv,
                    dk: s.dk,
                    dv: s.dv,
                    k: kb,
                    k_type,
                    k_row: s.n_head_kv * s.dk,
                    v: separate_v.then_some(vb),
                    v_type: if separate_v { v_type } else { k_type },
                    v_row: if separate_v { s.n_head_kv * s.dv } else { s.n_head_kv * s.dk },
                    n_kv: ub.pos[t] as usize + 1,
                    scale: s.scale,
                }
            })
            .collect();
        let mut out = vec![0f32; tokens.len() * s.n_head * s.dv];
        if !items.is_empty() {
            self.cpu.attention(&items, &mut out)?;
        }
        Ok(self.out(out))
    }
}

impl HostDevice {
    /// The routed experts' weighted sum for the rows of `h` (`[n][n_embd]`), each expert run once
    /// on all the rows routed to it, in one [`CpuBackend::ffn`] with the shared expert when there
    /// is one; returns the sum and the shared expert's output.
    fn routed(
        &self,
        m: &Moe,
        shared: Option<&Ffn>,
        h: &[f32],
        routes: &[crate::moe::Route],
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let plan = m.plan(routes);
        let mut specs: Vec<(&Ffn, usize, Vec<usize>)> =
            plan.used.iter().map(|&(e, ref tokens)| (m.experts(), e, tokens.clone())).collect();
        if let Some(s) = shared {
            specs.push((s, 0, (0..routes.len()).collect()));
        }
        let jobs = self.ffn_jobs(&specs)?;
        if self.read_ahead.load(Ordering::Relaxed) {
            // All the chosen experts' reads start now and run together; the first expert's
            // product then waits only for its own pages.
            for j in &jobs {
                for w in [&j.gate, &j.up, &j.down] {
                    tandem_gguf::read_ahead::will_need(w.data);
                }
            }
        }
        let cols = m.n_embd();
        let mut outs = self.cpu.ffn(h, cols, &jobs).map_err(named(&m.experts().gate.name))?;
        let sh = if shared.is_some() { outs.pop() } else { None };
        let mut out = vec![0f32; routes.len() * cols];
        self.cpu.for_parts(&mut out, cols, |t, o| m.combine_row(&plan, routes, &outs, t, o));
        Ok((out, sh))
    }
}

/// The rows of one sequence in each layer of a [`HostKv`].
struct SeqRows {
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

/// Cache rows in host memory: per sequence and layer, a growing run of rows.
pub(crate) struct HostKv {
    layout: KvLayout,
    k_type: GgmlType,
    v_type: GgmlType,
    k_row_bytes: usize,
    v_row_bytes: usize,
    layers: StoreLayers,
    seqs: HashMap<usize, SeqRows>,
    /// The decompressed MLA attention's rebuilt keys and values per (sequence, layer index),
    /// kept in step with the rows ([`tandem_cpu::RebuiltRows`]), and the most bytes they may
    /// take together.
    rebuilt: Mutex<HashMap<(usize, usize), RebuiltRows>>,
    rebuilt_budget: usize,
}

impl HostKv {
    fn new(layout: KvLayout, layers: &[usize], k_type: GgmlType, v_type: GgmlType) -> Result<HostKv> {
        let layers = StoreLayers::new(&layout, layers)?;
        Ok(HostKv {
            k_row_bytes: row_size(k_type, layout.k_row)?,
            v_row_bytes: if layout.v_row == 0 { 0 } else { row_size(v_type, layout.v_row)? },
            layout,
            k_type,
            v_type,
            layers,
            seqs: HashMap::new(),
            rebuilt: Mutex::new(HashMap::new()),
            rebuilt_budget: 0,
        })
    }

    /// Runs `f` with the kept rebuilt rows of `seq` in layer `il` and the most rows they may
    /// hold: all they hold, and as many more as fit in what the budget leaves (`heads` gives a
    /// row's bytes). `None` to `f` where the budget is 0 or `il` is not a layer of this store.
    fn with_rebuilt<R>(
        &self,
        seq: usize,
        il: usize,
        heads: tandem_cpu::MlaHeads,
        f: impl FnOnce(Option<(&mut RebuiltRows, usize)>) -> R,
    ) -> R {
        let Ok(li) = self.layers.at(il) else { return f(None) };
        if self.rebuilt_budget == 0 {
            return f(None);
        }
        let mut all = self.rebuilt.lock().unwrap_or_else(|e| e.into_inner());
        let used: usize = all.values().map(RebuiltRows::bytes).sum();
        let r = all.entry((seq, li)).or_default();
        let room = self.rebuilt_budget.saturating_sub(used) / RebuiltRows::row_bytes(heads).max(1);
        let most = r.rows().saturating_add(room);
        f(Some((r, most)))
    }

    /// Appends the K (and V) row of the next position of `seq` in layer `il`.
    fn push(&mut self, seq: usize, il: usize, k: &[f32], v: Option<&[f32]>) -> Result<()> {
        let li = self.layers.at(il)?;
        let n = self.layers.len();
        let s = self.seqs.entry(seq).or_insert_with(|| SeqRows { k: vec![Vec::new(); n], v: vec![Vec::new(); n] });
        let kbuf = &mut s.k[li];
        let at = kbuf.len();
        kbuf.resize(at + self.k_row_bytes, 0);
        quantize_row(self.k_type, k, &mut kbuf[at..])?;
        if let (Some(v), true) = (v, self.v_row_bytes > 0) {
            let vbuf = &mut s.v[li];
            let at = vbuf.len();
            vbuf.resize(at + self.v_row_bytes, 0);
            quantize_row(self.v_type, v, &mut vbuf[at..])?;
        }
        Ok(())
    }

    /// The K rows (and V rows, empty under MLA) of `seq` in layer `il`.
    pub fn rows(&self, seq: usize, il: usize) -> (&[u8], &[u8]) {
        match (self.seqs.get(&seq), self.layers.at(il)) {
            (Some(s), Ok(li)) => (&s.k[li], &s.v[li]),
            _ => (&[], &[]),
        }
    }
}

impl KvStore for HostKv {
    fn truncate(&mut self, seq: usize, n: usize) {
        let rebuilt = self.rebuilt.get_mut().unwrap_or_else(|e| e.into_inner());
        rebuilt.retain(|&(s, _), r| {
            if s == seq {
                r.truncate(n);
            }
            s != seq || n > 0
        });
        if n == 0 {
            self.seqs.remove(&seq);
            return;
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            for k in &mut s.k {
                k.truncate(n * self.k_row_bytes);
            }
            for v in &mut s.v {
                v.truncate(n * self.v_row_bytes);
            }
        }
    }

    fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        self.truncate(dst, 0);
        let Some(s) = self.seqs.get(&src) else { return Ok(()) };
        let copy = SeqRows {
            k: s.k.iter().map(|k| k[..(n * self.k_row_bytes).min(k.len())].to_vec()).collect(),
            v: s.v.iter().map(|v| v[..(n * self.v_row_bytes).min(v.len())].to_vec()).collect(),
        };
        self.seqs.insert(dst, copy);
        // The rebuilt keys and values of those positions too, layer by layer while the budget
        // lasts (a shared system prompt is then not rebuilt by every slot's first prompt).
        let rebuilt = self.rebuilt.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut used: usize = rebuilt.values().map(RebuiltRows::bytes).sum();
        let mut copies = Vec::new();
        for (&(_, li), r) in rebuilt.iter().filter(|(&(s, _), _)| s == src) {
            let c = r.prefix(n);
            if c.rows() > 0 && used + c.bytes() <= self.rebuilt_budget {
                used += c.bytes();
                copies.push(((dst, li), c));
            }
        }
        rebuilt.extend(copies);
        Ok(())
    }

    fn used_bytes(&self) -> usize {
        self.seqs.values().map(|s| s.k.iter().chain(&s.v).map(Vec::len).sum::<usize>()).sum()
    }

    fn append_zeros(&mut self, seq: usize, len: usize, n: usize) -> Result<()> {
        let nl = self.layers.len();
        let (kb, vb) = (self.k_row_bytes, self.v_row_bytes);
        let s = self.seqs.entry(seq).or_insert_with(|| SeqRows { k: vec![Vec::new(); nl], v: vec![Vec::new(); nl] });
        for k in &mut s.k {
            k.resize((len + n) * kb, 0);
        }
        for v in &mut s.v {
            v.resize((len + n) * vb, 0);
        }
        Ok(())
    }

    fn read_rows(&self, seq: usize, il: usize, n: usize) -> Result<Vec<u8>> {
        let li = self.layers.at(il)?;
        let (kb, vb) = (n * self.k_row_bytes, n * self.v_row_bytes);
        let s = self.seqs.get(&seq).filter(|s| s.k[li].len() >= kb && s.v[li].len() >= vb);
        let s = s.ok_or_else(|| Error::Model(format!("sequence {seq} has fewer than {n} rows in layer {il}")))?;
        Ok([&s.k[li][..kb], &s.v[li][..vb]].concat())
    }

    fn write_rows(&mut self, seq: usize, il: usize, n: usize, data: &[u8]) -> Result<()> {
        let li = self.layers.at(il)?;
        let (kb, vb) = (n * self.k_row_bytes, n * self.v_row_bytes);
        if data.len() != kb + vb {
            return Err(Error::Model(format!(
                "{} bytes for {n} rows of layer {il}, which take {}",
                data.len(),
                kb + vb
            )));
        }
        let nl = self.layers.len();
        let s = self.seqs.entry(seq).or_insert_with(|| SeqRows { k: vec![Vec::new(); nl], v: vec![Vec::new(); nl] });
        s.k[li] = data[..kb].to_vec();
        s.v[li] = data[kb..].to_vec();
        Ok(())
    }

    fn set_rebuilt_budget(&mut self, bytes: usize) {
        self.rebuilt_budget = bytes;
    }

    fn rebuilt_rows(&self, seq: usize, il: usize) -> usize {
        let Ok(li) = self.layers.at(il) else { return 0 };
        let all = self.rebuilt.lock().unwrap_or_else(|e| e.into_inner());
        all.get(&(seq, li)).map_or(0, RebuiltRows::rows)
    }

    fn rebuilt_bytes(&self) -> usize {
        self.rebuilt.lock().unwrap_or_else(|e| e.into_inner()).values().map(RebuiltRows::bytes).sum()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
