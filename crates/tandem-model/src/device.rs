//! What a device of the executor offers: memory for tensors and the KV cache, copies to and from
//! the host, and the ops of a forward pass on tensors it owns ([`crate::exec`] moves the inputs
//! there first). Implemented by the host (the CPU, and the stand-in device of the tests) and by
//! CUDA.

use crate::common::{AttnShape, Ffn, Ubatch};
use crate::exec::{Copy2d, Heads, Ledger, MlaShape, Pending, Rows, Tensor};
use crate::kv_cache::KvLayout;
use crate::moe::Moe;
use crate::weights::{Vector, Weight};
use crate::Result;
use std::any::Any;
use tandem_cpu::RopeStyle;
use tandem_gguf::GgmlType;

/// The rows a device keeps of the KV cache, for the layers it holds (one per sequence and layer,
/// one row per position, in the cache type). The cache's own bookkeeping (lengths) is in
/// [`crate::KvCache`]; a store only holds rows.
pub(crate) trait KvStore: Send + Sync {
    /// Forgets positions `n..` of `seq` (all of it with `n = 0`).
    fn truncate(&mut self, seq: usize, n: usize);
    /// Makes `dst` start with the first `n` positions of `src` (on the device, no crossing).
    fn copy_prefix(&mut self, src: usize, dst: usize, n: usize) -> Result<()>;
    /// Bytes of rows held.
    fn used_bytes(&self) -> usize;
    /// Appends `n` rows of zeros to `seq` (which has `len` positions) in every layer.
    fn append_zeros(&mut self, seq: usize, len: usize, n: usize) -> Result<()>;
    /// The first `n` rows of `seq` in layer `il` (one this store holds), as the bytes of the
    /// cache type: its `n` K rows, then its `n` V rows (none under MLA).
    fn read_rows(&self, seq: usize, il: usize, n: usize) -> Result<Vec<u8>>;
    /// Makes `seq`'s rows in layer `il` the `n` rows in `data` (as [`KvStore::read_rows`] gives
    /// them), after the caller emptied `seq`; the layers are written in order, each once.
    fn write_rows(&mut self, seq: usize, il: usize, n: usize, data: &[u8]) -> Result<()>;
    /// The most bytes the decompressed MLA attention may keep of rebuilt keys and values
    /// between runs (a store whose device keeps none ignores it).
    fn set_rebuilt_budget(&mut self, _bytes: usize) {}
    /// Rows of `seq` in layer `il` whose rebuilt keys and values are kept.
    fn rebuilt_rows(&self, _seq: usize, _il: usize) -> usize {
        0
    }
    /// Bytes of rebuilt keys and values kept.
    fn rebuilt_bytes(&self) -> usize {
        0
    }
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// A device of an [`crate::Exec`]. Every tensor argument is on this device.
pub(crate) trait Device: Send + Sync {
    fn name(&self) -> &str;
    fn ledger(&self) -> &Ledger;

    /// A tensor of this device with `data` copied from the host (one copy).
    fn upload(&self, data: &[f32]) -> Result<Tensor>;
    /// Starts copying `t` to the host (one copy, queued now: work queued later does not delay it).
    fn download_begin(&self, t: &Tensor) -> Result<Pending>;
    /// Waits for a copy of [`Device::download_begin`] (the host waits once) and returns the values.
    fn download_end(&self, p: Pending) -> Result<Vec<f32>>;
    /// A tensor of `n` zeros.
    fn zeros(&self, n: usize) -> Result<Tensor>;
    /// A copy of `t` on this device.
    fn duplicate(&self, t: &Tensor) -> Result<Tensor>;
    /// The start of a micro-batch: what this device needs of it (rope rows, the addressing of its
    /// cache rows), and the hidden state `x` when the first layer runs here, in one copy; returns
    /// `x` on this device.
    fn begin_step(&self, ub: &Ubatch, kv: Option<&mut dyn KvStore>, x: Option<&[f32]>) -> Result<Option<Tensor>>;

    /// `y[t] = W x[t]` for every row of `x` (`[n][w.cols()]`); `y` is `[n][w.rows()]`.
    fn matmul(&self, w: &Weight, x: &Tensor) -> Result<Tensor>;
    /// `ys[i] = ws[i] x`.
    fn matmul_same_input(&self, ws: &[&Weight], x: &Tensor) -> Result<Vec<Tensor>>;
    /// RMS norm of values `off..off + dim` of each row, times `w`.
    fn rmsnorm(&self, x: &mut Tensor, w: &Vector, rows: Rows, eps: f32) -> Result<()>;
    /// Rotary embedding of the heads of each row at the micro-batch's positions.
    fn rope(&self, x: &mut Tensor, ub: &Ubatch, h: Heads, style: RopeStyle) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Tensor, y: &Tensor) -> Result<()>;
    /// A strided copy from `src` into `dst`.
    fn copy_rows(&self, dst: &mut Tensor, src: &Tensor, c: Copy2d) -> Result<()>;

    /// `down(silu(gate x) * up x)` for every row of `x`.
    fn ffn(&self, f: &Ffn, x: &Tensor) -> Result<Tensor>;
    /// The router of `m` on `x` (`[n][n_embd]`): the packet `[n][n_embd + 2 n_used]` of each row of
    /// `x`, its experts' ids (as f32) and their weights.
    fn route(&self, m: &Moe, x: &Tensor) -> Result<Tensor>;
    /// The routed experts of `m` on a packet of [`Device::route`]: `sum_k w_k expert_k(x)` per row.
    fn experts(&self, m: &Moe, packet: &Tensor) -> Result<Tensor>;
    /// Whether to ask the kernel ahead for the bytes of the experts the router picks (a model
    /// mapped from storage that does not fit in memory). Devices that hold their weights ignore it.
    fn set_read_ahead(&self, _on: bool) {}
    /// Router, routed experts and shared expert together, when this device has a fused form.
    fn moe(&self, m: &Moe, shared: Option<&Ffn>, x: &Tensor) -> Result<Option<Tensor>> {
        let _ = (m, shared, x);
        Ok(None)
    }

    /// `[n][n_head][kv_lora + n_rot]` from `q` (`[n][n_head][nope + n_rot]`): each head's `q_nope`
    /// times its `attn_k_b` (`[kv_lora]` rows of `nope` per head), then its `q_pe`.
    fn mla_q(&self, k_b: &Weight, q: &Tensor, s: MlaShape) -> Result<Tensor>;
    /// `[n][n_head * dv]` from the latent outputs `lat` (`[n][n_head][kv_lora]`): each head's times
    /// its `attn_v_b` (`[dv]` rows of `kv_lora` per head).
    fn mla_out(&self, v_b: &Weight, lat: &Tensor, s: MlaShape) -> Result<Tensor>;
    /// The decompressed MLA attention of the run of tokens `c` describes (queries `q`), or `None`
    /// where this device does not have it.
    fn mla_decompressed(&self, kv: &dyn KvStore, q: &Tensor, c: &MlaCall) -> Result<Option<Tensor>> {
        let _ = (kv, q, c);
        Ok(None)
    }

    /// A store for the cache rows of `layers`.
    fn kv_new(&self, layout: KvLayout, layers: &[usize], k: GgmlType, v: GgmlType) -> Result<Box<dyn KvStore>>;
    /// Appends each token's K row (`[n][k_row]`) and V row (`[n][v_row]`, none under MLA) to its
    /// sequence in layer `il`.
    fn kv_store(&self, kv: &mut dyn KvStore, il: usize, ub: &Ubatch, k: &Tensor, v: Option<&Tensor>) -> Result<()>;
    /// Attention of the tokens `c` names over their sequences' rows `0..=pos`: `q` is
    /// `[c.tokens.len()][n_head * dk]`; returns `[c.tokens.len()][n_head * dv]`.
    fn attention(&self, kv: &dyn KvStore, q: &Tensor, c: &AttnCall) -> Result<Tensor>;
}

/// One attention call: the tokens `tokens` of micro-batch `ub` in layer `il`, heads as `s`.
#[derive(Clone, Copy)]
pub(crate) struct AttnCall<'a> {
    pub il: usize,
    pub ub: &'a Ubatch<'a>,
    pub tokens: &'a [usize],
    pub s: AttnShape,
    /// V rows cached apart from K; `false`: V is the first `dv` values of each K row (MLA's
    /// absorbed form over the latent).
    pub separate_v: bool,
}

/// One decompressed MLA call: a run of tokens of sequence `seq` in layer `il`, token `i`
/// attending `n_kv[i]` rows, with the layer's `attn_k_b` and `attn_v_b`.
#[derive(Clone, Copy)]
pub(crate) struct MlaCall<'a> {
    pub il: usize,
    pub seq: usize,
    pub n_kv: &'a [usize],
    pub k_b: &'a Weight,
    pub v_b: &'a Weight,
    pub s: MlaShape,
    pub scale: f32,
}
