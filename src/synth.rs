//! `tandem synth`: writes a model with a real model's shapes and random weights (valid blocks of
//! the published quantization mix), for measuring speed where the real file is not at hand — on a
//! GPU machine that cannot download 550 GB, say (scripts/gpu-check.sh). Its logits mean nothing;
//! its bytes, tensors and arithmetic are a real model's. Written one tensor at a time.

use anyhow::{bail, Context as _};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;
use tandem_gguf::{GgmlType, GgufWriter, Value};

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The shape: kimi-k2.5 (Kimi K2 / K2.5: hidden 7168, 64 heads, MLA with kv_lora 512 and rope
    /// 64, 384 experts of 2048 with 8 used and one shared, vocabulary 163840).
    #[arg(value_name = "SHAPE")]
    pub shape: String,
    /// Layers to write: the first dense, the others MoE (the real model has 61).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// The routed experts' type (the published Q4_K_S mix: q4_K; everything else but norms, router
    /// and bias Q8_0).
    #[arg(long, default_value = "q4_K")]
    pub experts_type: String,
    /// Output file.
    #[arg(short = 'o', long = "out", value_name = "FILE")]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Kimi K2 / K2.5's hyperparameters (its config.json).
struct Kimi {
    n_embd: u64,
    n_head: u64,
    q_lora: u64,
    kv_lora: u64,
    nope: u64,
    rope: u64,
    v_head: u64,
    n_ff_dense: u64,
    n_expert: u64,
    n_used: u64,
    n_ff_exp: u64,
    n_vocab: u64,
}

const KIMI: Kimi = Kimi {
    n_embd: 7168,
    n_head: 64,
    q_lora: 1536,
    kv_lora: 512,
    nope: 128,
    rope: 64,
    v_head: 128,
    n_ff_dense: 18432,
    n_expert: 384,
    n_used: 8,
    n_ff_exp: 2048,
    n_vocab: 163_840,
};

/// How a tensor's bytes are made.
#[derive(Clone, Copy)]
enum Fill {
    /// Random blocks with scales that keep every value small.
    Blocks,
    /// f32 values in [-scale, scale).
    Uniform(f32),
    /// f32 ones (norm weights).
    Ones,
}

pub fn run(a: &SynthArgs) -> anyhow::Result<()> {
    if a.shape != "kimi-k2.5" {
        bail!("unknown shape '{}' (known: kimi-k2.5)", a.shape);
    }
    if a.layers < 2 {
        bail!("--layers {}: at least 2 (one dense, one MoE)", a.layers);
    }
    let experts_ty = GgmlType::from_name(&a.experts_type)
        .filter(|t| [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q4_0].contains(t))
        .with_context(|| format!("--experts-type {}: use q4_K, q5_K, q6_K, q8_0 or q4_0", a.experts_type))?;
    let k = KIMI;
    let mut w = GgufWriter::new();
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", "deepseek2".into()),
        ("general.name", Value::String(format!("synthetic {} x{} layers", a.shape, a.layers))),
        ("deepseek2.block_count", Value::U32(a.layers as u32)),
        ("deepseek2.context_length", Value::U32(131_072)),
        ("deepseek2.embedding_length", Value::U32(k.n_embd as u32)),
        ("deepseek2.feed_forward_length", Value::U32(k.n_ff_dense as u32)),
        ("deepseek2.attention.head_count", Value::U32(k.n_head as u32)),
        ("deepseek2.attention.head_count_kv", Value::U32(1)),
        ("deepseek2.rope.freq_base", Value::F32(50_000.0)),
        ("deepseek2.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("deepseek2.expert_used_count", Value::U32(k.n_used as u32)),
        ("deepseek2.leading_dense_block_count", Value::U32(1)),
        ("deepseek2.attention.q_lora_rank", Value::U32(k.q_lora as u32)),
        ("deepseek2.attention.kv_lora_rank", Value::U32(k.kv_lora as u32)),
        ("deepseek2.attention.key_length", Value::U32((k.kv_lora + k.rope) as u32)),
        ("deepseek2.attention.value_length", Value::U32(k.kv_lora as u32)),
        ("deepseek2.attention.key_length_mla", Value::U32((k.nope + k.rope) as u32)),
        ("deepseek2.attention.value_length_mla", Value::U32(k.v_head as u32)),
        ("deepseek2.rope.dimension_count", Value::U32(k.rope as u32)),
        ("deepseek2.expert_feed_forward_length", Value::U32(k.n_ff_exp as u32)),
        ("deepseek2.expert_count", Value::U32(k.n_expert as u32)),
        ("deepseek2.expert_shared_count", Value::U32(1)),
        ("deepseek2.expert_weights_scale", Value::F32(2.827)),
        ("deepseek2.expert_weights_norm", Value::Bool(true)),
        ("deepseek2.expert_gating_func", Value::U32(2)),
        ("deepseek2.expert_group_count", Value::U32(1)),
        ("deepseek2.expert_group_used_count", Value::U32(1)),
        ("deepseek2.rope.scaling.type", "yarn".into()),
        ("deepseek2.rope.scaling.factor", Value::F32(32.0)),
        ("deepseek2.rope.scaling.original_context_length", Value::U32(4096)),
        ("deepseek2.rope.scaling.yarn_log_multiplier", Value::F32(0.1)),
    ];
    for (key, v) in md {
        w.add(key, v);
    }
    let q8 = GgmlType::Q8_0;
    let mut fills: Vec<(GgmlType, Fill)> = Vec::new();
    let mut total = 0u64;
    let mut add = |w: &mut GgufWriter, name: &str, ty: GgmlType, dims: &[u64], fill: Fill| -> anyhow::Result<()> {
        total += w.add_tensor_later(name, ty, dims)?;
        fills.push((ty, fill));
        Ok(())
    };
    let (e, qk) = (k.n_embd, k.nope + k.rope);
    add(&mut w, "token_embd.weight", q8, &[e, k.n_vocab], Fill::Blocks)?;
    for il in 0..a.layers {
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        add(&mut w, &p("attn_norm"), GgmlType::F32, &[e], Fill::Ones)?;
        add(&mut w, &p("attn_q_a"), q8, &[e, k.q_lora], Fill::Blocks)?;
        add(&mut w, &p("attn_q_a_norm"), GgmlType::F32, &[k.q_lora], Fill::Ones)?;
        add(&mut w, &p("attn_q_b"), q8, &[k.q_lora, k.n_head * qk], Fill::Blocks)?;
        add(&mut w, &p("attn_kv_a_mqa"), q8, &[e, k.kv_lora + k.rope], Fill::Blocks)?;
        add(&mut w, &p("attn_kv_a_norm"), GgmlType::F32, &[k.kv_lora], Fill::Ones)?;
        add(&mut w, &p("attn_k_b"), q8, &[k.nope, k.kv_lora, k.n_head], Fill::Blocks)?;
        add(&mut w, &p("attn_v_b"), q8, &[k.kv_lora, k.v_head, k.n_head], Fill::Blocks)?;
        add(&mut w, &p("attn_output"), q8, &[k.n_head * k.v_head, e], Fill::Blocks)?;
        add(&mut w, &p("ffn_norm"), GgmlType::F32, &[e], Fill::Ones)?;
        if il == 0 {
            add(&mut w, &p("ffn_gate"), q8, &[e, k.n_ff_dense], Fill::Blocks)?;
            add(&mut w, &p("ffn_up"), q8, &[e, k.n_ff_dense], Fill::Blocks)?;
            add(&mut w, &p("ffn_down"), q8, &[k.n_ff_dense, e], Fill::Blocks)?;
            continue;
        }
        add(&mut w, &p("ffn_gate_inp"), GgmlType::F32, &[e, k.n_expert], Fill::Uniform(0.02))?;
        add(&mut w, &format!("blk.{il}.exp_probs_b.bias"), GgmlType::F32, &[k.n_expert], Fill::Uniform(0.02))?;
        add(&mut w, &p("ffn_gate_exps"), experts_ty, &[e, k.n_ff_exp, k.n_expert], Fill::Blocks)?;
        add(&mut w, &p("ffn_up_exps"), experts_ty, &[e, k.n_ff_exp, k.n_expert], Fill::Blocks)?;
        add(&mut w, &p("ffn_down_exps"), experts_ty, &[k.n_ff_exp, e, k.n_expert], Fill::Blocks)?;
        add(&mut w, &p("ffn_gate_shexp"), q8, &[e, k.n_ff_exp], Fill::Blocks)?;
        add(&mut w, &p("ffn_up_shexp"), q8, &[e, k.n_ff_exp], Fill::Blocks)?;
        add(&mut w, &p("ffn_down_shexp"), q8, &[k.n_ff_exp, e], Fill::Blocks)?;
    }
    add(&mut w, "output_norm.weight", GgmlType::F32, &[e], Fill::Ones)?;
    add(&mut w, "output.weight", q8, &[e, k.n_vocab], Fill::Blocks)?;
    let start = Instant::now();
    tracing::info!(
        "synth: {} layers of {}, {:.2} GiB, to {}",
        a.layers,
        a.shape,
        total as f64 / (1u64 << 30) as f64,
        a.out.display()
    );
    let seed = a.seed;
    w.write_file_with(&a.out, &mut |i, bytes| {
        let (ty, fill) = fills[i];
        fill_tensor(ty, fill, seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u64), bytes);
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    tracing::info!("synth: written in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Fills `bytes` (one tensor of `ty`) in parallel, by pieces of whole blocks.
fn fill_tensor(ty: GgmlType, fill: Fill, seed: u64, bytes: &mut [u8]) {
    let block = ty.type_size();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(64);
    let per = (bytes.len() / block).div_ceil(threads).max(1) * block;
    std::thread::scope(|s| {
        for (p, piece) in bytes.chunks_mut(per).enumerate() {
            s.spawn(move || {
                let mut rng = Rng(seed ^ ((p as u64 + 1) << 32) | 1);
                match fill {
                    Fill::Ones => piece.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&1f32.to_le_bytes())),
                    Fill::Uniform(scale) => piece.chunks_exact_mut(4).for_each(|c| {
                        let u = (rng.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                        c.copy_from_slice(&(u * scale).to_le_bytes());
                    }),
                    Fill::Blocks => {
                        for c in piece.chunks_mut(8) {
                            let r = rng.next().to_le_bytes();
                            c.copy_from_slice(&r[..c.len()]);
                        }
                        for b in piece.chunks_exact_mut(block) {
                            set_scales(ty, b, &mut rng);
                        }
                    }
                }
            });
        }
    });
}

/// The f16 scales of a block of random bits set to small normal values, so that every weight is
/// finite and of the size of a trained model's (|w| below about 0.03).
fn set_scales(ty: GgmlType, b: &mut [u8], rng: &mut Rng) {
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let jitter = 1.0 + (rng.next() >> 54) as f32 / 1024.0;
    match ty {
        // d, then the quants.
        GgmlType::Q8_0 => b[..2].copy_from_slice(&f16(2e-4 * jitter)),
        GgmlType::Q4_0 => b[..2].copy_from_slice(&f16(3e-3 * jitter)),
        // d, dmin, then 6-bit scales and mins up to 63, 4/5-bit quants.
        GgmlType::Q4_K | GgmlType::Q5_K => {
            b[..2].copy_from_slice(&f16(2e-5 * jitter));
            b[2..4].copy_from_slice(&f16(2e-5));
        }
        // Quants, 8-bit scales, then d last.
        GgmlType::Q6_K => {
            let n = b.len();
            b[n - 2..].copy_from_slice(&f16(5e-6 * jitter));
        }
        _ => {}
    }
}
