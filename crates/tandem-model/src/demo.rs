//! The built-in demo model: a small deepseek2 (Kimi K2 / DeepSeek V3 layout: MLA attention, a
//! dense first layer, routed and shared experts) with deterministic synthetic weights, built as a
//! GGUF in memory. It lets `tandem serve` run on a fresh machine with no download. Its output is
//! not meaningful text: the weights are random.
//!
//! The tokenizer is byte-level BPE without merges (each UTF-8 byte is a token), with DeepSeek
//! V3's special tokens and a chat template in its style.

use crate::Result;
use tandem_gguf::{GgmlType, GgufFile, GgufModel, GgufWriter};
use tandem_quant::{quantize_row, row_size};

pub const DEMO_NAME: &str = "tandem demo (synthetic deepseek2, random weights)";
const ARCH: &str = "deepseek2";
const SEED: u64 = 0x7a6e_6465_6d6f_0001;

const N_EMBD: usize = 256;
const N_LAYER: usize = 3;
const N_DENSE: usize = 1;
const N_FF: usize = 256;
const N_HEAD: usize = 4;
const Q_LORA: usize = 128;
const KV_LORA: usize = 128;
const NOPE: usize = 64;
const ROPE: usize = 64;
const V_HEAD: usize = 64;
const N_EXPERT: usize = 8;
const N_EXPERT_USED: usize = 2;
const N_FF_EXP: usize = 64;
const CONTEXT: u32 = 8192;

const BOS: &str = "<｜begin▁of▁sentence｜>";
const EOS: &str = "<｜end▁of▁sentence｜>";
const PAD: &str = "<｜▁pad▁｜>";
const USER: &str = "<｜User｜>";
const ASSISTANT: &str = "<｜Assistant｜>";

const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}\
{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}\
{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>\
{% else %}{{ m['content'] }}{% endif %}{% endfor %}\
{% if add_generation_prompt %}<｜Assistant｜>{% endif %}";

/// splitmix64: a tiny, well-mixed generator with no dependency; the same seed gives the same
/// stream everywhere (the demo model's weights, `tandem bench`'s random tokens, tests' cases).
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-a, a).
    pub fn uniform(&mut self, a: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * a
    }
}

/// GPT-2's reversible byte -> printable character mapping, in GPT-2 vocabulary order.
fn byte_tokens() -> Vec<String> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + n);
            n += 1;
        }
    }
    chars.iter().map(|&c| char::from_u32(c).map(String::from).unwrap_or_default()).collect()
}

struct Builder {
    w: GgufWriter,
    rng: SplitMix64,
}

impl Builder {
    /// A `[rows][cols]` matrix (ggml dims `[cols, rows, extra...]`), fan-in scaled.
    fn matrix(&mut self, name: &str, dims: &[usize], ty: GgmlType, std: f32) -> Result<()> {
        let cols = dims[0];
        let n: usize = dims.iter().product();
        let a = std * 3f32.sqrt(); // uniform(-a, a) has this standard deviation
        let values: Vec<f32> = (0..n).map(|_| self.rng.uniform(a)).collect();
        self.tensor(name, dims, ty, &values, cols)
    }

    fn tensor(&mut self, name: &str, dims: &[usize], ty: GgmlType, values: &[f32], cols: usize) -> Result<()> {
        let rb = row_size(ty, cols).map_err(crate::Error::from)?;
        let mut data = vec![0u8; rb * (values.len() / cols)];
        for (src, dst) in values.chunks_exact(cols).zip(data.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst).map_err(crate::Error::from)?;
        }
        let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        self.w.add_tensor(name, ty, &dims, data)?;
        Ok(())
    }

    /// A norm weight near 1.
    fn norm(&mut self, name: &str, n: usize) -> Result<()> {
        let v: Vec<f32> = (0..n).map(|_| 1.0 + self.rng.uniform(0.1)).collect();
        self.tensor(name, &[n], GgmlType::F32, &v, n)
    }
}

fn fan_in(n: usize) -> f32 {
    1.0 / (n as f32).sqrt()
}

/// The demo model as GGUF bytes.
pub fn demo_gguf_bytes() -> Result<Vec<u8>> {
    let mut tokens = vec![BOS.to_string(), EOS.to_string(), PAD.to_string()];
    tokens.extend(byte_tokens());
    tokens.push(USER.to_string());
    tokens.push(ASSISTANT.to_string());
    let n_vocab = tokens.len();
    let types: Vec<i32> = tokens.iter().map(|t| if t.starts_with("<｜") { 3 } else { 1 }).collect();

    let mut w = GgufWriter::new();
    let k = |key: &str| format!("{ARCH}.{key}");
    w.add("general.architecture", ARCH).add("general.type", "model").add("general.name", DEMO_NAME);
    w.add(&k("block_count"), N_LAYER as u32).add(&k("context_length"), CONTEXT);
    w.add(&k("embedding_length"), N_EMBD as u32).add(&k("feed_forward_length"), N_FF as u32);
    w.add(&k("attention.head_count"), N_HEAD as u32).add(&k("attention.head_count_kv"), 1u32);
    w.add(&k("rope.freq_base"), 10000f32).add(&k("attention.layer_norm_rms_epsilon"), 1e-6f32);
    w.add(&k("expert_used_count"), N_EXPERT_USED as u32).add(&k("expert_count"), N_EXPERT as u32);
    w.add(&k("expert_shared_count"), 1u32).add(&k("expert_feed_forward_length"), N_FF_EXP as u32);
    w.add(&k("expert_weights_scale"), 2.5f32).add(&k("expert_weights_norm"), true);
    w.add(&k("expert_gating_func"), 2u32).add(&k("leading_dense_block_count"), N_DENSE as u32);
    w.add(&k("vocab_size"), n_vocab as u32).add(&k("attention.q_lora_rank"), Q_LORA as u32);
    w.add(&k("attention.kv_lora_rank"), KV_LORA as u32);
    w.add(&k("attention.key_length"), (KV_LORA + ROPE) as u32).add(&k("attention.value_length"), KV_LORA as u32);
    w.add(&k("attention.key_length_mla"), (NOPE + ROPE) as u32);
    w.add(&k("attention.value_length_mla"), V_HEAD as u32);
    w.add(&k("rope.dimension_count"), ROPE as u32);
    w.add("tokenizer.ggml.model", "gpt2").add("tokenizer.ggml.pre", "deepseek-v3");
    w.add("tokenizer.ggml.tokens", tokens.clone()).add("tokenizer.ggml.token_type", types);
    w.add("tokenizer.ggml.merges", Vec::<String>::new());
    w.add("tokenizer.ggml.bos_token_id", 0u32).add("tokenizer.ggml.eos_token_id", 1u32);
    w.add("tokenizer.ggml.padding_token_id", 2u32).add("tokenizer.ggml.add_bos_token", true);
    w.add("tokenizer.chat_template", CHAT_TEMPLATE);

    let mut b = Builder { w, rng: SplitMix64(SEED) };
    let (f16, q8) = (GgmlType::F16, GgmlType::Q8_0);
    b.matrix("token_embd.weight", &[N_EMBD, n_vocab], f16, 0.5)?;
    for il in 0..N_LAYER {
        let p = |n: &str| format!("blk.{il}.{n}.weight");
        b.norm(&p("attn_norm"), N_EMBD)?;
        b.matrix(&p("attn_q_a"), &[N_EMBD, Q_LORA], f16, fan_in(N_EMBD))?;
        b.norm(&p("attn_q_a_norm"), Q_LORA)?;
        b.matrix(&p("attn_q_b"), &[Q_LORA, N_HEAD * (NOPE + ROPE)], f16, fan_in(Q_LORA))?;
        b.matrix(&p("attn_kv_a_mqa"), &[N_EMBD, KV_LORA + ROPE], f16, fan_in(N_EMBD))?;
        b.norm(&p("attn_kv_a_norm"), KV_LORA)?;
        b.matrix(&p("attn_k_b"), &[NOPE, KV_LORA, N_HEAD], f16, fan_in(NOPE))?;
        b.matrix(&p("attn_v_b"), &[KV_LORA, V_HEAD, N_HEAD], f16, fan_in(KV_LORA))?;
        b.matrix(&p("attn_output"), &[N_HEAD * V_HEAD, N_EMBD], f16, fan_in(N_HEAD * V_HEAD))?;
        b.norm(&p("ffn_norm"), N_EMBD)?;
        if il < N_DENSE {
            b.matrix(&p("ffn_gate"), &[N_EMBD, N_FF], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_up"), &[N_EMBD, N_FF], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_down"), &[N_FF, N_EMBD], q8, fan_in(N_FF))?;
        } else {
            b.matrix(&p("ffn_gate_inp"), &[N_EMBD, N_EXPERT], GgmlType::F32, fan_in(N_EMBD))?;
            let bias = vec![0f32; N_EXPERT];
            b.tensor(&format!("blk.{il}.exp_probs_b.bias"), &[N_EXPERT], GgmlType::F32, &bias, N_EXPERT)?;
            b.matrix(&p("ffn_gate_exps"), &[N_EMBD, N_FF_EXP, N_EXPERT], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_up_exps"), &[N_EMBD, N_FF_EXP, N_EXPERT], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_down_exps"), &[N_FF_EXP, N_EMBD, N_EXPERT], q8, fan_in(N_FF_EXP))?;
            b.matrix(&p("ffn_gate_shexp"), &[N_EMBD, N_FF_EXP], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_up_shexp"), &[N_EMBD, N_FF_EXP], q8, fan_in(N_EMBD))?;
            b.matrix(&p("ffn_down_shexp"), &[N_FF_EXP, N_EMBD], q8, fan_in(N_FF_EXP))?;
        }
    }
    b.norm("output_norm.weight", N_EMBD)?;
    b.matrix("output.weight", &[N_EMBD, n_vocab], f16, fan_in(N_EMBD))?;
    Ok(b.w.to_bytes()?)
}

/// The demo model, parsed and validated like a file.
pub fn demo_model() -> Result<GgufModel> {
    let file = GgufFile::from_bytes(demo_gguf_bytes()?, "<built-in demo model>")?;
    Ok(GgufModel::from_file(file)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Batch, Context, ContextParams, Exec, Model};
    use std::sync::Arc;

    #[test]
    fn demo_model_loads_tokenizes_and_is_deterministic() {
        let start = std::time::Instant::now();
        let gguf = Arc::new(demo_model().unwrap());
        assert_eq!(demo_gguf_bytes().unwrap(), demo_gguf_bytes().unwrap());
        let model = Arc::new(Model::load(gguf.clone()).unwrap());
        assert!(start.elapsed().as_secs_f64() < 10.0, "built in {:?}", start.elapsed());
        let tok = tandem_tokenizer::Tokenizer::from_gguf(&gguf).unwrap();
        let ids = tok.encode("Hello, tandem!", true, true).unwrap();
        assert_eq!(ids[0], 0);
        assert_eq!(tok.decode(&ids[1..], false).unwrap(), "Hello, tandem!");
        let threads = tandem_cpu::Threads::new(1, 1).unwrap();
        let mut ctx = Context::new(model, Exec::cpu(threads), ContextParams::default()).unwrap();
        let logits = ctx.decode(&Batch::sequence(&ids, 0, 0, false)).unwrap();
        assert_eq!(logits.len(), tok.n_vocab());
        assert!(logits.iter().all(|l| l.is_finite()));
    }
}
