//! The operations a forward pass needs, as a trait: the CPU implementation is here; the CUDA issue
//! adds a GPU one. The pure-CPU fallback is this backend with every weight on the CPU.

use crate::weights::Weight;
use crate::{Error, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tandem_cpu::packed::{pack, packable, packing_pays_for, Packed, PACK_ROWS};
use tandem_cpu::{quantize_activations, RopeStyle, Threads, WeightRef};
use tandem_gguf::GgmlType;
use tandem_quant::{dequantize_row, quantize_row, row_size, vec_dot, vec_dot_type};

/// One token's attention over its sequence's cached rows.
pub struct AttnInput<'a> {
    /// `[n_head][dk]`
    pub q: &'a [f32],
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    /// K rows (`n_head_kv * dk` values each) in `k_type`.
    pub k: &'a [u8],
    pub k_type: GgmlType,
    /// V rows (`n_head_kv * dv` each) in `v_type`, or `None` when V is the first `dv` values of each
    /// K head (MLA).
    pub v: Option<&'a [u8]>,
    pub v_type: GgmlType,
    /// Rows attended: positions `0..n_kv` (causal).
    pub n_kv: usize,
    pub scale: f32,
}

/// Tokens of one sequence for multi-head latent attention in the decompressed form: every
/// cached row's key and value rebuilt per head from the latent (`attn_k_b`, `attn_v_b`), then
/// ordinary attention ([`tandem_cpu::MlaPrefill`]).
pub struct MlaInput<'a> {
    /// `[n][n_head][nope + n_rot]`, after rope.
    pub q: &'a [f32],
    pub n_head: usize,
    pub nope: usize,
    pub n_rot: usize,
    pub kv_lora: usize,
    pub dv: usize,
    /// The sequence's cached rows, `kv_lora + n_rot` values each in `kv_type`.
    pub kv: &'a [u8],
    pub kv_type: GgmlType,
    /// Rows each token attends (its position + 1).
    pub n_kv: &'a [usize],
    /// `[nope, kv_lora, n_head]`: rows `h * kv_lora ..` are head `h`'s `W_kb`.
    pub k_b: &'a Weight,
    /// `[kv_lora, dv, n_head]`: rows `h * dv ..` are head `h`'s `W_vb`.
    pub v_b: &'a Weight,
    pub scale: f32,
}

/// A SwiGLU FFN on some of a batch's tokens: expert `expert` of 3-D expert tensors (rows
/// `expert * n_ff ..` of gate and up, `expert * n_out ..` of down), or a 2-D FFN with `expert` 0.
pub struct FfnSpec<'a> {
    pub gate: &'a Weight,
    pub up: &'a Weight,
    pub down: &'a Weight,
    pub expert: usize,
    pub n_ff: usize,
    pub n_out: usize,
    /// Rows of the input it runs on.
    pub tokens: Vec<usize>,
}

/// The operations of the forward pass. Activations are row-major `[n_tokens][n]` f32.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether the tensor named `name` lives on a device of this backend other than the CPU (the
    /// CPU never multiplies it, so `--repack` leaves it alone).
    fn holds(&self, name: &str) -> bool {
        let _ = name;
        false
    }
    /// `y[t] = W[first_row .. first_row + n_rows] x[t]`; `y` is `[n_tokens][n_rows]`.
    fn matmul_rows(&self, w: &Weight, first_row: usize, n_rows: usize, x: &[f32], y: &mut [f32]) -> Result<()>;
    /// RMS norm of each `dim`-long row, times `weight`.
    fn rmsnorm(&self, x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32);
    /// Rotary embedding of the first `cache.len()` values of one head.
    fn rope(&self, x: &mut [f32], cache: &[f32], style: RopeStyle);
    /// Attention of one token; `out` is `[n_head][dv]`.
    fn attention(&self, a: &AttnInput, out: &mut [f32]) -> Result<()>;
    /// Attention of several tokens; `out` is `[n][n_head][dv]`.
    fn attention_batch(&self, items: &[AttnInput], out: &mut [f32]) -> Result<()> {
        let per = out.len() / items.len().max(1);
        for (a, o) in items.iter().zip(out.chunks_exact_mut(per.max(1))) {
            self.attention(a, o)?;
        }
        Ok(())
    }
    /// MLA attention in the decompressed form; `out` is `[n][n_head][dv]`. `Ok(false)` (and
    /// `out` untouched) where this backend does not have it for these inputs.
    fn mla_decompressed(&self, a: &MlaInput, out: &mut [f32]) -> Result<bool> {
        let _ = (a, out);
        Ok(false)
    }
    /// `gate = silu(gate) * up`.
    fn swiglu(&self, gate: &mut [f32], up: &[f32]);
    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]);

    /// `down(silu(gate x_t) * up x_t)` for each spec and each of its tokens (`x` is `[n][cols]`):
    /// per spec `[tokens.len()][n_out]`. Backends run them together where that pays.
    fn ffn_batch(&self, x: &[f32], cols: usize, specs: &[FfnSpec]) -> Result<Vec<Vec<f32>>> {
        specs
            .iter()
            .map(|s| {
                let xs: Vec<f32> = s.tokens.iter().flat_map(|&t| x[t * cols..(t + 1) * cols].iter().copied()).collect();
                let m = s.tokens.len();
                let (mut gate, mut up) = (vec![0f32; m * s.n_ff], vec![0f32; m * s.n_ff]);
                self.matmul_rows(s.gate, s.expert * s.n_ff, s.n_ff, &xs, &mut gate)?;
                self.matmul_rows(s.up, s.expert * s.n_ff, s.n_ff, &xs, &mut up)?;
                self.swiglu(&mut gate, &up);
                let mut out = vec![0f32; m * s.n_out];
                self.matmul_rows(s.down, s.expert * s.n_out, s.n_out, &gate, &mut out)?;
                Ok(out)
            })
            .collect()
    }

    /// `ys[i] = ws[i] x` for several weights that take the same input (`x` is `[n][cols]`, `ys[i]`
    /// is `[n][ws[i].rows()]`). Backends run them together where that pays.
    fn matmul_same_input(&self, ws: &[&Weight], x: &[f32], ys: &mut [&mut [f32]]) -> Result<()> {
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            self.matmul(w, x, y)?;
        }
        Ok(())
    }

    /// `ys[g] = W[rows of group g] xs[g]` for groups `(first_row, n_rows)` of one weight (e.g. the
    /// per-head matrices of MLA).
    fn matmul_groups(&self, w: &Weight, groups: &[(usize, usize)], xs: &[&[f32]], ys: &mut [Vec<f32>]) -> Result<()> {
        for ((&(first, n), x), y) in groups.iter().zip(xs).zip(ys.iter_mut()) {
            self.matmul_rows(w, first, n, x, y)?;
        }
        Ok(())
    }

    /// Runs `f` (the forward pass of a micro-batch of `n_tokens`) where this backend's parallel
    /// ops are cheapest to start: the CPU backend runs it on a thread of its pool, so each op's
    /// fork and join is between spinning workers instead of a wake-up from outside.
    fn in_pool(&self, n_tokens: usize, f: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        let _ = n_tokens;
        f()
    }

    /// `y[t] = W x[t]` over all rows of `w`.
    fn matmul(&self, w: &Weight, x: &[f32], y: &mut [f32]) -> Result<()> {
        self.matmul_rows(w, 0, w.rows(), x, y)
    }
}

/// Everything on the CPU, in place from the memory map.
pub struct CpuBackend {
    threads: Threads,
    /// Per `attn_k_b` (by name): the matrix that rebuilds the decompressed MLA's keys, made on
    /// first use ([`KeysWeight`]).
    keys: Mutex<HashMap<String, Arc<KeysWeight>>>,
}

impl CpuBackend {
    pub fn new(threads: Threads) -> CpuBackend {
        CpuBackend { threads, keys: Mutex::new(HashMap::new()) }
    }

    /// `attn_k_b` (`[n_head][kv_lora][nope]`) as the matrix whose product with a cached latent is
    /// that row's keys: made once per weight and kept.
    fn keys_weight(&self, k_b: &Weight, nh: usize, kl: usize, nope: usize) -> Result<Arc<KeysWeight>> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = keys.get(&k_b.name) {
            return Ok(w.clone());
        }
        let head_bytes = row_size(k_b.ty, kl * nope)?;
        if k_b.bytes().len() != nh * head_bytes {
            return Err(Error::Model(format!(
                "{}: {} bytes for {nh} heads of {head_bytes}",
                k_b.name,
                k_b.bytes().len()
            )));
        }
        // Float weights stay exact (as f32); quantized ones are requantized to Q8_0 along the
        // latent, as the values' `attn_v_b` rows already run.
        let float = matches!(k_b.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let ty = if float { GgmlType::F32 } else { GgmlType::Q8_0 };
        let row_q = row_size(ty, kl)?;
        let mut data = vec![0u8; nh * nope * row_q];
        self.threads.for_tokens(2).install(|| {
            data.par_chunks_mut(nope * row_q).zip(k_b.bytes().par_chunks(head_bytes)).try_for_each(
                |(o, b)| -> Result<()> {
                    let mut w = vec![0f32; kl * nope];
                    dequantize_row(k_b.ty, b, &mut w)?;
                    let mut col = vec![0f32; kl];
                    for (i, o) in o.chunks_exact_mut(row_q).enumerate() {
                        for (j, c) in col.iter_mut().enumerate() {
                            *c = w[j * nope + i];
                        }
                        quantize_row(ty, &col, o)?;
                    }
                    Ok(())
                },
            )
        })?;
        let rows = nh * nope;
        let w = if packing_pays_for(ty) && packable(ty, rows, kl) && nope.is_multiple_of(PACK_ROWS) {
            KeysWeight::Packed(pack(ty, rows, kl, &data)?)
        } else {
            KeysWeight::Rows { ty, rows, cols: kl, data }
        };
        let w = Arc::new(w);
        keys.insert(k_b.name.clone(), w.clone());
        Ok(w)
    }

    pub fn threads(&self) -> &Threads {
        &self.threads
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "CPU"
    }

    fn matmul_rows(&self, w: &Weight, first_row: usize, n_rows: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
        let m: WeightRef = w.matrix()?.rows(first_row, n_rows)?;
        let n_tokens = x.len() / m.cols.max(1);
        tandem_cpu::matmul(self.threads.for_tokens(n_tokens), &m, x, y).map_err(|e| match e {
            tandem_cpu::Error::Shape(s) => Error::Model(format!("{}: {s}", w.name)),
            other => other.into(),
        })
    }

    fn ffn_batch(&self, x: &[f32], cols: usize, specs: &[FfnSpec]) -> Result<Vec<Vec<f32>>> {
        let n = x.len() / cols.max(1);
        let mut jobs = Vec::with_capacity(specs.len());
        for s in specs {
            jobs.push(tandem_cpu::FfnJob {
                gate: s.gate.matrix()?.rows(s.expert * s.n_ff, s.n_ff)?,
                up: s.up.matrix()?.rows(s.expert * s.n_ff, s.n_ff)?,
                down: s.down.matrix()?.rows(s.expert * s.n_out, s.n_out)?,
                tokens: s.tokens.clone(),
            });
        }
        tandem_cpu::ffn_jobs(self.threads.for_tokens(n), x, cols, &jobs).map_err(|e| match e {
            tandem_cpu::Error::Shape(m) => {
                Error::Model(format!("{}: {m}", specs.first().map_or("", |s| s.gate.name.as_str())))
            }
            other => other.into(),
        })
    }

    fn matmul_same_input(&self, ws: &[&Weight], x: &[f32], ys: &mut [&mut [f32]]) -> Result<()> {
        let names = || ws.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", ");
        if ws.len() != ys.len() {
            return Err(Error::Model(format!("{}: {} outputs for {} weights", names(), ys.len(), ws.len())));
        }
        let mut mats = Vec::with_capacity(ws.len());
        for w in ws {
            mats.push(w.matrix()?);
        }
        // The input quantized once per activation type the weights take.
        let mut acts: Vec<tandem_cpu::QuantizedActs> = Vec::new();
        for m in &mats {
            if !acts.iter().any(|a| a.ty == vec_dot_type(m.ty)) {
                acts.push(quantize_activations(m.ty, x, m.cols)?);
            }
        }
        let n = x.len() / mats.first().map_or(1, |m| m.cols.max(1));
        let mut jobs = Vec::with_capacity(ws.len());
        for (m, y) in mats.iter().zip(ys.iter_mut()) {
            let a = acts.iter().find(|a| a.ty == vec_dot_type(m.ty)).expect("quantized above");
            jobs.push(tandem_cpu::MatJob { w: *m, acts: a, out: y });
        }
        tandem_cpu::matmul_jobs(self.threads.for_tokens(n), jobs).map_err(|e| match e {
            tandem_cpu::Error::Shape(s) => Error::Model(format!("{}: {s}", names())),
            other => other.into(),
        })
    }

    fn matmul_groups(&self, w: &Weight, groups: &[(usize, usize)], xs: &[&[f32]], ys: &mut [Vec<f32>]) -> Result<()> {
        let m = w.matrix()?;
        let mut acts = Vec::with_capacity(groups.len());
        for x in xs {
            acts.push(quantize_activations(w.ty, x, m.cols)?);
        }
        let n = acts.iter().map(|a| a.n_rows()).max().unwrap_or(0);
        if ys.len() != groups.len()
            || groups.iter().zip(&acts).zip(ys.iter()).any(|((g, a), y)| y.len() != g.1 * a.n_rows())
        {
            return Err(Error::Model(format!("{}: grouped matmul outputs do not match the groups", w.name)));
        }
        let mut jobs = Vec::with_capacity(groups.len());
        for ((&(first, rows), a), out) in groups.iter().zip(&acts).zip(ys.iter_mut()) {
            jobs.push(tandem_cpu::MatJob { w: m.rows(first, rows)?, acts: a, out });
        }
        tandem_cpu::matmul_jobs(self.threads.for_tokens(n), jobs)?;
        Ok(())
    }

    fn in_pool(&self, n_tokens: usize, f: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        self.threads.run_step(n_tokens, f)
    }

    fn rmsnorm(&self, x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
        for row in x.chunks_exact_mut(dim) {
            tandem_cpu::rmsnorm(row, weight, eps);
        }
    }

    fn rope(&self, x: &mut [f32], cache: &[f32], style: RopeStyle) {
        tandem_cpu::rope(x, cache, style);
    }

    fn attention(&self, a: &AttnInput, out: &mut [f32]) -> Result<()> {
        match fast_view(a) {
            Some(f) => Ok(tandem_cpu::attention(self.threads.for_tokens(1), &f, out)?),
            None => attention_cpu(self.threads.for_tokens(1), a, out),
        }
    }

    fn attention_batch(&self, items: &[AttnInput], out: &mut [f32]) -> Result<()> {
        let per = out.len() / items.len().max(1);
        let views: Option<Vec<tandem_cpu::Attn>> = items.iter().map(fast_view).collect();
        match views {
            Some(views) if per > 0 && out.len() == per * items.len() => {
                let mut outs: Vec<&mut [f32]> = out.chunks_exact_mut(per).collect();
                Ok(tandem_cpu::attention_many(self.threads.for_tokens(items.len()), &views, &mut outs)?)
            }
            _ => {
                for (a, o) in items.iter().zip(out.chunks_exact_mut(per.max(1))) {
                    self.attention(a, o)?;
                }
                Ok(())
            }
        }
    }

    fn mla_decompressed(&self, a: &MlaInput, out: &mut [f32]) -> Result<bool> {
        let Some(ty) = tandem_cpu::KvType::of(a.kv_type) else { return Ok(false) };
        let row = a.kv_lora + a.n_rot;
        if !row.is_multiple_of(a.kv_type.block_size()) {
            return Ok(false);
        }
        let (nh, kl) = (a.n_head, a.kv_lora);
        if a.k_b.rows() != nh * kl || a.k_b.cols() != a.nope || a.v_b.rows() != nh * a.dv || a.v_b.cols() != kl {
            return Err(Error::Model(format!("{} / {}: shapes do not fit the attention", a.k_b.name, a.v_b.name)));
        }
        let (n, dk, dv, nope) = (a.n_kv.len(), a.nope + a.n_rot, a.dv, a.nope);
        if a.q.len() != n * nh * dk || out.len() != n * nh * dv {
            return Err(Error::Model(format!("decompressed MLA attention of {n} tokens: query or output size wrong")));
        }
        if !kl.is_multiple_of(GgmlType::Q8_0.block_size()) {
            return Ok(false);
        }
        let keys = self.keys_weight(a.k_b, nh, kl, nope)?;
        let rows = a.n_kv.iter().copied().max().unwrap_or(0);
        let pool = self.threads.for_tokens(n);
        let kv = tandem_cpu::cache_rows_f32(pool, a.kv, ty, rows, row)?;
        let mut latent = Vec::with_capacity(rows * kl);
        for r in kv.chunks_exact(row) {
            latent.extend_from_slice(&r[..kl]);
        }
        // Each head's q_nope as the absorbed form hands it to attn_k_b (rounded to the weight's
        // dot type: Q8 blocks, f16), so the scores are llama.cpp's up to the order of the sums.
        let mut q = a.q.to_vec();
        let dot_ty = vec_dot_type(a.k_b.ty);
        pool.install(|| {
            q.par_chunks_mut(Q_ROUND_TOKENS * nh * dk).try_for_each(|qc| -> Result<()> {
                let mut q_nope = Vec::with_capacity(qc.len() / dk * nope);
                for h in qc.chunks_exact(dk) {
                    q_nope.extend_from_slice(&h[..nope]);
                }
                let acts = quantize_activations(a.k_b.ty, &q_nope, nope)?;
                for (i, h) in qc.chunks_exact_mut(dk).enumerate() {
                    dequantize_row(dot_ty, acts.row(i), &mut h[..nope])?;
                }
                Ok(())
            })
        })?;
        // Heads in groups whose rebuilt keys and values take at most MLA_VALUE_BYTES (one head per
        // thread at least): at Kimi's 64 heads and 128K rows all values would be 4 GiB per layer.
        let per_head = rows * (nope + dv) * std::mem::size_of::<f32>();
        let hg = (MLA_VALUE_BYTES / per_head.max(1)).max(pool.current_num_threads()).clamp(1, nh);
        for h0 in (0..nh).step_by(hg) {
            let h1 = (h0 + hg).min(nh);
            let g = h1 - h0;
            // Keys and values: attn_k_b (transposed) and attn_v_b times every cached latent, as
            // quantized matrix products.
            let mut k = vec![0f32; rows * g * nope];
            let kw = keys.weight_ref()?.rows(h0 * nope, g * nope)?;
            tandem_cpu::matmul(pool, &kw, &latent, &mut k)?;
            let mut v = vec![0f32; rows * g * dv];
            self.matmul_rows(a.v_b, h0 * dv, g * dv, &latent, &mut v)?;
            let qg: Vec<f32> = if g == nh {
                std::mem::take(&mut q)
            } else {
                q.chunks_exact(nh * dk).flat_map(|t| t[h0 * dk..h1 * dk].iter().copied()).collect()
            };
            let p = tandem_cpu::MlaPrefill {
                q: &qg,
                n_head: g,
                nope,
                n_rot: a.n_rot,
                kv_lora: kl,
                dv,
                kv: &kv,
                k: &k,
                v: &v,
                n_kv: a.n_kv,
                scale: a.scale,
            };
            if g == nh {
                tandem_cpu::mla_prefill(pool, &p, out)?;
            } else {
                let mut og = vec![0f32; n * g * dv];
                tandem_cpu::mla_prefill(pool, &p, &mut og)?;
                for (o, r) in out.chunks_exact_mut(nh * dv).zip(og.chunks_exact(g * dv)) {
                    o[h0 * dv..h1 * dv].copy_from_slice(r);
                }
            }
        }
        Ok(true)
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        tandem_cpu::silu_mul(gate, up);
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        tandem_cpu::add_assign(x, y);
    }
}

/// `attn_k_b` transposed, `[n_head][nope][kv_lora]`: each row of `kv_lora` quantized to Q8_0
/// (packed where that pays on this machine), or f32 where `attn_k_b` is a float type. The
/// decompressed MLA attention rebuilds every cached row's keys with it in one product, as it
/// rebuilds the values with `attn_v_b`, instead of an f32 product of the dequantized `attn_k_b`.
/// About 1.1 bytes per value of a quantized `attn_k_b`: 4.5 MB per layer for Kimi K2's 64 heads.
enum KeysWeight {
    Rows { ty: GgmlType, rows: usize, cols: usize, data: Vec<u8> },
    Packed(Packed),
}

impl KeysWeight {
    fn weight_ref(&self) -> Result<WeightRef<'_>> {
        Ok(match self {
            KeysWeight::Rows { ty, rows, cols, data } => WeightRef::new(*ty, *rows, *cols, data)?,
            KeysWeight::Packed(p) => p.weight_ref(),
        })
    }
}

/// Most bytes of rebuilt keys and values the decompressed MLA attention holds at once (see
/// `CpuBackend::mla_decompressed`).
const MLA_VALUE_BYTES: usize = 1 << 30;

/// Tokens per task when the decompressed MLA attention rounds the queries.
const Q_ROUND_TOKENS: usize = 16;

/// An f16, bf16, f32 or q8_0 cache whose heads are whole blocks takes the fast path of tandem-cpu.
fn fast_view<'a>(a: &AttnInput<'a>) -> Option<tandem_cpu::Attn<'a>> {
    let k_type = tandem_cpu::KvType::of(a.k_type)?;
    let v_type = if a.v.is_some() { tandem_cpu::KvType::of(a.v_type)? } else { k_type };
    let whole = |ty: GgmlType, n: usize| n.is_multiple_of(ty.block_size());
    let v_ty = if a.v.is_some() { a.v_type } else { a.k_type };
    (whole(a.k_type, a.dk) && whole(v_ty, a.dv)).then(|| tandem_cpu::Attn {
        q: a.q,
        n_head: a.n_head,
        n_head_kv: a.n_head_kv,
        dk: a.dk,
        dv: a.dv,
        k: a.k,
        k_type,
        k_row: a.n_head_kv * a.dk,
        v: a.v,
        v_type,
        v_row: a.n_head_kv * a.dv,
        n_kv: a.n_kv,
        scale: a.scale,
    })
}

/// ggml's non-flash attention: `softmax(scale * K q) V`, with q converted to the K cache's dot
/// type and the probabilities to the V cache's (f16 for an f16 cache), as `ggml_mul_mat` does.
pub(crate) fn attention_cpu(pool: &rayon::ThreadPool, a: &AttnInput, out: &mut [f32]) -> Result<()> {
    let group = a.n_head / a.n_head_kv.max(1);
    let k_row = row_size(a.k_type, a.n_head_kv * a.dk)?;
    let k_head = row_size(a.k_type, a.dk)?;
    let (v_bytes, v_row, v_head) = match a.v {
        Some(v) => (v, row_size(a.v_type, a.n_head_kv * a.dv)?, row_size(a.v_type, a.dv)?),
        None => (a.k, k_row, k_head),
    };
    if a.k.len() < a.n_kv * k_row || v_bytes.len() < a.n_kv * v_row || out.len() != a.n_head * a.dv {
        return Err(Error::Model(format!("attention over {} cached rows: cache or output too short", a.n_kv)));
    }
    let q_acts = quantize_activations(a.k_type, a.q, a.dk)?;
    let p_type = vec_dot_type(a.v_type);
    pool.install(|| {
        out.par_chunks_mut(a.dv).enumerate().try_for_each(|(h, o)| -> Result<()> {
            let kvh = h / group.max(1);
            let mut scores = vec![0f32; a.n_kv];
            for (j, s) in scores.iter_mut().enumerate() {
                let kr = &a.k[j * k_row + kvh * k_head..j * k_row + (kvh + 1) * k_head];
                *s = vec_dot(a.k_type, a.dk, kr, q_acts.row(h))? * a.scale;
            }
            tandem_cpu::softmax_in_place(&mut scores);
            round_to(p_type, &mut scores);
            o.fill(0.0);
            let mut v = vec![0f32; a.dv];
            let v_part = row_size(a.v_type, a.dv)?;
            for (j, p) in scores.iter().enumerate() {
                let start = j * v_row + kvh * v_head;
                dequantize_row(a.v_type, &v_bytes[start..start + v_part], &mut v)?;
                for (o, v) in o.iter_mut().zip(&v) {
                    *o += p * v;
                }
            }
            Ok(())
        })
    })
}

/// Rounds values to `ty` and back, as ggml converts an f32 operand to an f16/bf16 dot type.
fn round_to(ty: GgmlType, x: &mut [f32]) {
    match ty {
        GgmlType::F16 => x.iter_mut().for_each(|v| *v = half::f16::from_f32(*v).to_f32()),
        GgmlType::BF16 => x.iter_mut().for_each(|v| *v = tandem_quant::bf16_to_f32(tandem_quant::f32_to_bf16(*v))),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * scale
            })
            .collect()
    }

    fn cache_bytes(ty: GgmlType, x: &[f32]) -> Vec<u8> {
        match ty {
            GgmlType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => x.iter().flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()).collect(),
            GgmlType::BF16 => x.iter().flat_map(|v| tandem_quant::f32_to_bf16(*v).to_le_bytes()).collect(),
            _ => {
                let mut out = vec![0u8; row_size(ty, x.len()).unwrap()];
                tandem_quant::quantize_row(ty, x, &mut out).unwrap();
                out
            }
        }
    }

    /// Products of several weights on one input in one parallel step: the same bits as each
    /// product alone (weights of two activation types, a packed copy, one and several tokens), and
    /// mismatched outputs refused by name.
    #[test]
    fn products_on_one_input_equal_each_alone() {
        let (cols, ra, rb, rc) = (512usize, 48usize, 80usize, 16usize);
        let mut wr = tandem_gguf::GgufWriter::new();
        for (name, ty, rows, seed) in
            [("a", GgmlType::Q4_K, ra, 11u64), ("b", GgmlType::Q8_0, rb, 12), ("c", GgmlType::F32, rc, 13)]
        {
            wr.add_tensor(name, ty, &[cols as u64, rows as u64], cache_bytes(ty, &rand(seed, rows * cols, 1.0)))
                .unwrap();
        }
        let file = tandem_gguf::GgufFile::from_bytes(wr.to_bytes().unwrap(), "same-input.gguf").unwrap();
        let src = std::sync::Arc::new(tandem_gguf::GgufModel::from_file(file).unwrap());
        let b = CpuBackend::new(Threads::new(2, 2).unwrap());
        for repack in [false, true] {
            let l = crate::weights::WeightLoader::with_repack(src.clone(), repack);
            let (wa, wb, wc) =
                (l.get("a", &[cols, ra]).unwrap(), l.get("b", &[cols, rb]).unwrap(), l.get("c", &[cols, rc]).unwrap());
            for n in [1usize, 3] {
                let x = rand(20 + n as u64, n * cols, 2.0);
                let alone: Vec<Vec<f32>> = [&wa, &wb, &wc]
                    .iter()
                    .map(|w| {
                        let mut y = vec![0f32; n * w.rows()];
                        b.matmul(w, &x, &mut y).unwrap();
                        y
                    })
                    .collect();
                let (mut ya, mut yb, mut yc) = (vec![0f32; n * ra], vec![0f32; n * rb], vec![0f32; n * rc]);
                b.matmul_same_input(&[&wa, &wb, &wc], &x, &mut [&mut ya, &mut yb, &mut yc]).unwrap();
                assert!(ya == alone[0] && yb == alone[1] && yc == alone[2], "repack {repack}, {n} tokens");
            }
            let mut short = vec![0f32; ra - 1];
            let err = b.matmul_same_input(&[&wa], &rand(1, cols, 1.0), &mut [&mut short]).unwrap_err().to_string();
            assert!(err.contains("a:"), "{err}");
            let err = b.matmul_same_input(&[&wa, &wb], &rand(1, cols, 1.0), &mut [&mut short]).unwrap_err().to_string();
            assert!(err.contains("a, b: 1 outputs for 2 weights"), "{err}");
        }
    }

    /// The fast path (SIMD, one pass per row for all heads, by chunks past FLASH_MIN rows) against
    /// the reference that follows ggml's order, for MLA, GQA and MHA shapes, every cache format it
    /// reads, with and without a thread split.
    #[test]
    fn fast_attention_matches_the_reference() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        // (n_head, n_head_kv, dk, dv, separate V, n_kv)
        for &(nh, nkv, dk, dv, sep, n_kv) in &[
            (16usize, 1usize, 576usize, 512usize, false, 700usize),
            (8, 2, 64, 64, true, 300),
            (4, 4, 192, 128, true, 1),
            (16, 1, 576, 512, false, 33),
            (6, 3, 40, 24, true, 600),
            (1, 1, 64, 64, true, 1000),
            (32, 8, 128, 128, true, 777),
        ] {
            for ty in [GgmlType::F16, GgmlType::BF16, GgmlType::F32, GgmlType::Q8_0] {
                let q = rand(1, nh * dk, 1.0);
                if !dk.is_multiple_of(ty.block_size()) || !dv.is_multiple_of(ty.block_size()) {
                    continue;
                }
                let k = cache_bytes(ty, &rand(2, n_kv * nkv * dk, 1.0));
                let v = cache_bytes(ty, &rand(3, n_kv * nkv * dv, 1.0));
                let a = AttnInput {
                    q: &q,
                    n_head: nh,
                    n_head_kv: nkv,
                    dk,
                    dv,
                    k: &k,
                    k_type: ty,
                    v: sep.then_some(&v[..]),
                    v_type: ty,
                    n_kv,
                    scale: 1.0 / (dk as f32).sqrt(),
                };
                let mut want = vec![0f32; nh * dv];
                attention_cpu(&pool, &a, &mut want).unwrap();
                let mut alone = vec![0f32; nh * dv];
                tandem_cpu::attention(&one, &fast_view(&a).unwrap(), &mut alone).unwrap();
                let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Past FLASH_MIN rows the fast path runs by chunks and keeps its probabilities in
                // f32, where ggml rounds them to an f16 or bf16 V's type: p(1 + d), |d| <= u,
                // moves an output by at most u * max |v| (the values here are within [-1, 1]).
                let rounding = match ty {
                    GgmlType::F16 if n_kv > tandem_cpu::FLASH_MIN => 2f32.powi(-11),
                    GgmlType::BF16 if n_kv > tandem_cpu::FLASH_MIN => 2f32.powi(-8),
                    _ => 0.0,
                };
                for p in [&pool, &one] {
                    let mut got = vec![0f32; nh * dv];
                    tandem_cpu::attention(p, &fast_view(&a).unwrap(), &mut got).unwrap();
                    if nh >= 2 {
                        // Heads or rows split over the threads: every head computed exactly as on one thread.
                        assert!(got == alone, "{ty} {nh}/{nkv}/{dk}/{dv} n_kv {n_kv}: 2 threads differ from 1 in bits");
                    }
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= 2e-3 * max + 1e-6 + rounding,
                            "{ty} {nh}/{nkv}/{dk}/{dv} n_kv {n_kv} [{i}]: {g} vs {w}"
                        );
                    }
                }
                let mut outs = vec![0f32; 5 * nh * dv];
                let items: Vec<AttnInput> = (0..5).map(|_| AttnInput { ..a }).collect();
                CpuBackend::new(Threads::new(2, 2).unwrap()).attention_batch(&items, &mut outs).unwrap();
                for o in outs.chunks_exact(nh * dv) {
                    assert!(
                        o.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 2e-3 * max + 1e-6 + rounding),
                        "{ty} batch"
                    );
                }
            }
        }
    }

    /// A q8_0 cache whose heads are not whole blocks, and cache types without a fast path, go to
    /// the reference.
    #[test]
    fn other_caches_take_the_reference_path() {
        let q = vec![0f32; 2 * 48];
        let k = vec![0u8; 4096];
        let a = |ty: GgmlType, dk: usize| AttnInput {
            q: &q[..2 * dk],
            n_head: 2,
            n_head_kv: 1,
            dk,
            dv: dk,
            k: &k,
            k_type: ty,
            v: None,
            v_type: ty,
            n_kv: 3,
            scale: 1.0,
        };
        assert!(fast_view(&a(GgmlType::Q8_0, 32)).is_some());
        assert!(fast_view(&a(GgmlType::Q8_0, 48)).is_none());
        assert!(fast_view(&a(GgmlType::Q4_0, 32)).is_none());
        assert!(fast_view(&a(GgmlType::BF16, 48)).is_some());
    }

    #[test]
    fn short_caches_are_refused() {
        let q = vec![0f32; 64];
        let k = vec![0u8; 10];
        let a = AttnInput {
            q: &q,
            n_head: 1,
            n_head_kv: 1,
            dk: 64,
            dv: 64,
            k: &k,
            k_type: GgmlType::F16,
            v: None,
            v_type: GgmlType::F16,
            n_kv: 3,
            scale: 1.0,
        };
        let mut out = vec![0f32; 64];
        assert!(CpuBackend::new(Threads::new(1, 1).unwrap()).attention(&a, &mut out).is_err());
    }
}
