//! A header-only, sparse replica of a Kimi-K2.5 GGUF for tests and for planning without the
//! 600 GB download: the real tensor list and shapes (mainline-MLA deepseek2 layout, as
//! convert_hf_to_gguf.py writes `KimiK25ForConditionalGeneration`), the Q4_K_S or Q4_K_M types
//! llama.cpp's quantizer would assign ([`crate::quant_mix`]), split into shards the way
//! `gguf-split` lays them out. Each shard's tensor data is never written: the file is extended
//! with `set_len`, so on a filesystem with sparse files the replica costs a few MB of disk.
//!
//! Simplifications, none of which changes a tensor's size: the vocabulary is synthetic (163840
//! placeholder tokens, no merges) and the shards are cut into equal byte ranges rather than at
//! gguf-split's `--split-max-size`.

use crate::quant_mix::{Ftype, QuantMix};
use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use tandem_gguf::{split_path, Array, GgmlType, Value, KEY_SPLIT_COUNT, KEY_SPLIT_NO, KEY_SPLIT_TENSORS_COUNT};

/// Kimi K2.5's text model (config.json of moonshotai/Kimi-K2.5, `text_config`).
pub mod kimi {
    pub const N_LAYER: u64 = 61;
    pub const N_DENSE_LEAD: u64 = 1;
    pub const N_EXPERT: u64 = 384;
    pub const N_EXPERT_USED: u64 = 8;
    pub const N_EXPERT_SHARED: u64 = 1;
    pub const N_EMBD: u64 = 7168;
    pub const Q_LORA: u64 = 1536;
    pub const KV_LORA: u64 = 512;
    pub const ROPE: u64 = 64;
    pub const NOPE: u64 = 128;
    pub const V_HEAD: u64 = 128;
    pub const N_HEAD: u64 = 64;
    pub const N_FF_EXP: u64 = 2048;
    pub const N_FF: u64 = 18432;
    pub const N_VOCAB: u64 = 163840;
    pub const N_CTX_TRAIN: u64 = 262144;
    pub const N_SHARDS: u32 = 13;
}

/// One tensor of the replica: name, type, ggml shape.
pub type TensorSpec = (String, GgmlType, Vec<u64>);

/// Kimi K2.5's tensors in the BF16 GGUF's order, with their source types (F32 for 1-D tensors
/// and the router, BF16 for the rest).
fn kimi_source_tensors() -> Vec<TensorSpec> {
    use kimi::*;
    let mut out: Vec<TensorSpec> = Vec::new();
    let mut add = |name: String, dims: &[u64]| {
        let f32 = dims.len() == 1 || name.contains("ffn_gate_inp");
        out.push((name, if f32 { GgmlType::F32 } else { GgmlType::BF16 }, dims.to_vec()));
    };
    add("token_embd.weight".into(), &[N_EMBD, N_VOCAB]);
    for i in 0..N_LAYER {
        let b = |s: &str| format!("blk.{i}.{s}");
        add(b("attn_norm.weight"), &[N_EMBD]);
        add(b("attn_q_a_norm.weight"), &[Q_LORA]);
        add(b("attn_kv_a_norm.weight"), &[KV_LORA]);
        add(b("attn_q_a.weight"), &[N_EMBD, Q_LORA]);
        add(b("attn_q_b.weight"), &[Q_LORA, N_HEAD * (NOPE + ROPE)]);
        add(b("attn_kv_a_mqa.weight"), &[N_EMBD, KV_LORA + ROPE]);
        add(b("attn_k_b.weight"), &[NOPE, KV_LORA, N_HEAD]);
        add(b("attn_v_b.weight"), &[KV_LORA, V_HEAD, N_HEAD]);
        add(b("attn_output.weight"), &[N_HEAD * V_HEAD, N_EMBD]);
        add(b("ffn_norm.weight"), &[N_EMBD]);
        if i < N_DENSE_LEAD {
            add(b("ffn_gate.weight"), &[N_EMBD, N_FF]);
            add(b("ffn_down.weight"), &[N_FF, N_EMBD]);
            add(b("ffn_up.weight"), &[N_EMBD, N_FF]);
        } else {
            add(b("ffn_gate_inp.weight"), &[N_EMBD, N_EXPERT]);
            add(b("exp_probs_b.bias"), &[N_EXPERT]);
            add(b("ffn_gate_exps.weight"), &[N_EMBD, N_FF_EXP, N_EXPERT]);
            add(b("ffn_down_exps.weight"), &[N_FF_EXP, N_EMBD, N_EXPERT]);
            add(b("ffn_up_exps.weight"), &[N_EMBD, N_FF_EXP, N_EXPERT]);
            let shared = N_FF_EXP * N_EXPERT_SHARED;
            add(b("ffn_gate_shexp.weight"), &[N_EMBD, shared]);
            add(b("ffn_down_shexp.weight"), &[shared, N_EMBD]);
            add(b("ffn_up_shexp.weight"), &[N_EMBD, shared]);
        }
    }
    add("output_norm.weight".into(), &[N_EMBD]);
    add("output.weight".into(), &[N_EMBD, N_VOCAB]);
    out
}

/// Kimi K2.5's tensors with the types of `ftype`.
pub fn kimi_k25_tensors(ftype: Ftype) -> Vec<TensorSpec> {
    let src = kimi_source_tensors();
    let mut mix = QuantMix::new(ftype, kimi::N_LAYER as u32, kimi::N_EXPERT as u32, src.iter().map(|t| t.0.as_str()));
    src.into_iter()
        .map(|(name, ty, dims)| (mix.tensor_type(&name, &dims, ty), name, dims))
        .map(|(t, n, d)| (n, t, d))
        .collect()
}

/// Kimi K2.5's metadata as convert_hf_to_gguf.py writes it, with a placeholder vocabulary.
pub fn kimi_k25_metadata(ftype: Ftype) -> Vec<(String, Value)> {
    use kimi::*;
    let a = |k: &str| format!("deepseek2.{k}");
    let u = |v: u64| Value::U32(v as u32);
    let tokens: Vec<String> = (0..N_VOCAB).map(|i| format!("<t{i}>")).collect();
    vec![
        ("general.architecture".into(), Value::String("deepseek2".into())),
        ("general.name".into(), Value::String(format!("Kimi-K2.5 {} (tandem header-only replica)", ftype.name()))),
        ("general.file_type".into(), u(u64::from(ftype.file_type()))),
        ("general.quantization_version".into(), u(2)),
        (a("block_count"), u(N_LAYER)),
        (a("context_length"), u(N_CTX_TRAIN)),
        (a("embedding_length"), u(N_EMBD)),
        (a("feed_forward_length"), u(N_FF)),
        (a("attention.head_count"), u(N_HEAD)),
        (a("attention.head_count_kv"), u(1)),
        (a("rope.freq_base"), Value::F32(50000.0)),
        (a("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
        (a("expert_used_count"), u(N_EXPERT_USED)),
        (a("leading_dense_block_count"), u(N_DENSE_LEAD)),
        (a("vocab_size"), u(N_VOCAB)),
        (a("attention.q_lora_rank"), u(Q_LORA)),
        (a("attention.kv_lora_rank"), u(KV_LORA)),
        (a("attention.key_length"), u(KV_LORA + ROPE)),
        (a("attention.value_length"), u(KV_LORA)),
        (a("attention.key_length_mla"), u(NOPE + ROPE)),
        (a("attention.value_length_mla"), u(V_HEAD)),
        (a("expert_feed_forward_length"), u(N_FF_EXP)),
        (a("expert_count"), u(N_EXPERT)),
        (a("expert_shared_count"), u(N_EXPERT_SHARED)),
        (a("expert_weights_scale"), Value::F32(2.827)),
        (a("expert_weights_norm"), Value::Bool(true)),
        (a("expert_gating_func"), u(2)),
        (a("rope.dimension_count"), u(ROPE)),
        (a("rope.scaling.type"), Value::String("yarn".into())),
        (a("rope.scaling.factor"), Value::F32(64.0)),
        (a("rope.scaling.original_context_length"), u(4096)),
        (a("rope.scaling.yarn_log_multiplier"), Value::F32(0.1)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("kimi-k2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(vec![1; N_VOCAB as usize]))),
    ]
}

/// Writes the Kimi K2.5 replica of `ftype` into `dir` as [`kimi::N_SHARDS`] shards named
/// `Kimi-K2.5-{ftype}-0000N-of-00013.gguf`; returns the path of the first shard.
pub fn write_kimi_k25(dir: &Path, ftype: Ftype) -> Result<PathBuf> {
    let prefix = format!("Kimi-K2.5-{}", ftype.name());
    write_split(dir, &prefix, &kimi_k25_metadata(ftype), &kimi_k25_tensors(ftype), kimi::N_SHARDS)
}

const ALIGNMENT: u64 = 32;

/// Writes a header-only split model: shard 1 holds all metadata, every shard the split keys
/// (`split.no`, `split.count` as u16, `split.tensors.count` as i32, as gguf-split writes them).
/// Tensors are cut into `n_shards` runs of about equal bytes, in order.
pub fn write_split(
    dir: &Path,
    prefix: &str,
    kv: &[(String, Value)],
    tensors: &[TensorSpec],
    n_shards: u32,
) -> Result<PathBuf> {
    let sizes: Vec<u64> = tensors
        .iter()
        .map(|(name, ty, dims)| {
            let (&row, rest) =
                dims.split_first().ok_or_else(|| Error::Replica(format!("tensor '{name}' has no dimensions")))?;
            let rows: u64 = rest.iter().product();
            ty.row_bytes(row)
                .map(|r| r * rows)
                .ok_or_else(|| Error::Replica(format!("tensor '{name}': {dims:?} is no whole {ty} row")))
        })
        .collect::<Result<_>>()?;
    let total: u128 = sizes.iter().map(|&s| u128::from(s)).sum::<u128>().max(1);
    let n = u64::from(n_shards.max(1));
    let mut shard_of = Vec::with_capacity(tensors.len());
    let mut before = 0u128;
    for s in &sizes {
        shard_of.push((before * u128::from(n) / total) as u64);
        before += u128::from(*s);
    }
    for shard in 0..n {
        let mut keys: Vec<(String, Value)> = if shard == 0 { kv.to_vec() } else { Vec::new() };
        keys.push((KEY_SPLIT_NO.into(), Value::U16(shard as u16)));
        keys.push((KEY_SPLIT_COUNT.into(), Value::U16(n as u16)));
        keys.push((KEY_SPLIT_TENSORS_COUNT.into(), Value::I32(tensors.len() as i32)));
        let mine: Vec<usize> = (0..tensors.len()).filter(|&i| shard_of[i] == shard).collect();
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(mine.len() as u64).to_le_bytes());
        header.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for (k, v) in &keys {
            put_str(&mut header, k);
            put_value(&mut header, v)?;
        }
        let mut offset = 0u64;
        for &i in &mine {
            let (name, ty, dims) = &tensors[i];
            put_str(&mut header, name);
            header.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&ty.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset += sizes[i].div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        let data_offset = (header.len() as u64).div_ceil(ALIGNMENT) * ALIGNMENT;
        let path = split_path(dir, prefix, shard as u32 + 1, n as u32);
        let mut f = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        f.write_all(&header).map_err(|e| Error::io(&path, e))?;
        // The data section is a hole: set_len extends the file without writing a byte.
        f.set_len(data_offset + offset).map_err(|e| Error::io(&path, e))?;
    }
    Ok(split_path(dir, prefix, 1, n as u32))
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Serializes the value kinds the replica uses (gguf.md `gguf_metadata_value_t`).
fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    out.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
    match v {
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(Array::String(items)) => {
            out.extend_from_slice(&(Array::String(Vec::new()).elem_type() as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|s| put_str(out, s));
        }
        Value::Array(Array::I32(items)) => {
            out.extend_from_slice(&(Array::I32(Vec::new()).elem_type() as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
        }
        other => return Err(Error::Replica(format!("{} values are not supported", other.type_description()))),
    }
    Ok(())
}
