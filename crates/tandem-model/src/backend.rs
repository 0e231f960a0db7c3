//! The operations a forward pass needs, as a trait: the CPU implementation is here; the CUDA issue
//! adds a GPU one. The pure-CPU fallback is this backend with every weight on the CPU.

use crate::weights::Weight;
use crate::{Error, Result};
use rayon::prelude::*;
use tandem_cpu::{quantize_activations, RopeStyle, Threads, WeightRef};
use tandem_gguf::GgmlType;
use tandem_quant::{dequantize_row, row_size, vec_dot, vec_dot_type};

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

/// The operations of the forward pass. Activations are row-major `[n_tokens][n]` f32.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// `y[t] = W[first_row .. first_row + n_rows] x[t]`; `y` is `[n_tokens][n_rows]`.
    fn matmul_rows(&self, w: &Weight, first_row: usize, n_rows: usize, x: &[f32], y: &mut [f32]) -> Result<()>;
    /// RMS norm of each `dim`-long row, times `weight`.
    fn rmsnorm(&self, x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32);
    /// Rotary embedding of the first `cache.len()` values of one head.
    fn rope(&self, x: &mut [f32], cache: &[f32], style: RopeStyle);
    /// Attention of one token; `out` is `[n_head][dv]`.
    fn attention(&self, a: &AttnInput, out: &mut [f32]) -> Result<()>;
    /// `gate = silu(gate) * up`.
    fn swiglu(&self, gate: &mut [f32], up: &[f32]);
    /// `x += y`.
    fn add(&self, x: &mut [f32], y: &[f32]);

    /// `y[t] = W x[t]` over all rows of `w`.
    fn matmul(&self, w: &Weight, x: &[f32], y: &mut [f32]) -> Result<()> {
        self.matmul_rows(w, 0, w.rows(), x, y)
    }
}

/// Everything on the CPU, in place from the memory map.
pub struct CpuBackend {
    threads: Threads,
}

impl CpuBackend {
    pub fn new(threads: Threads) -> CpuBackend {
        CpuBackend { threads }
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

    fn rmsnorm(&self, x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
        for row in x.chunks_exact_mut(dim) {
            tandem_cpu::rmsnorm(row, weight, eps);
        }
    }

    fn rope(&self, x: &mut [f32], cache: &[f32], style: RopeStyle) {
        tandem_cpu::rope(x, cache, style);
    }

    fn attention(&self, a: &AttnInput, out: &mut [f32]) -> Result<()> {
        attention_cpu(self.threads.for_tokens(1), a, out)
    }

    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        tandem_cpu::silu_mul(gate, up);
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        tandem_cpu::add_assign(x, y);
    }
}

/// ggml's non-flash attention: `softmax(scale * K q) V`, with q converted to the K cache's dot
/// type and the probabilities to the V cache's (f16 for an f16 cache), as `ggml_mul_mat` does.
fn attention_cpu(pool: &rayon::ThreadPool, a: &AttnInput, out: &mut [f32]) -> Result<()> {
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
