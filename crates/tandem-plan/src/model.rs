//! What the planner needs to know about a model, read from GGUF headers only: every tensor's
//! name, type, shape and size, and the hyperparameters that size the KV cache and the compute
//! buffers. Key names follow llama.cpp's `LLM_KV_*` (`{arch}.attention.head_count`, ...).

use crate::{Error, Result};
use serde::Serialize;
use tandem_gguf::naming::layer_of;
use tandem_gguf::{GgmlType, GgufModel, Metadata, TensorCategory};

/// One tensor of the inventory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorEntry {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub bytes: u64,
    pub category: TensorCategory,
    /// `i` of `blk.{i}.`; `None` for embeddings, output and other global tensors.
    pub layer: Option<u32>,
}

impl TensorEntry {
    pub fn new(name: &str, ty: GgmlType, dims: &[u64], bytes: u64) -> TensorEntry {
        TensorEntry {
            name: name.to_string(),
            ty,
            dims: dims.to_vec(),
            bytes,
            category: TensorCategory::of(name),
            layer: layer_of(name),
        }
    }
}

/// How attention keeps its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// DeepSeek's multi-head latent attention in the mainline layout (`attn_k_b`/`attn_v_b`,
    /// `key_length_mla`/`value_length_mla` keys): one latent of `kv_lora_rank + rope_dim` per token.
    Mla { kv_lora_rank: u32, rope_dim: u32 },
    /// Per-head K and V (llama, and deepseek2 files in the legacy `attn_kv_b` layout).
    Standard,
}

/// Hyperparameters from the metadata.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hparams {
    pub arch: String,
    /// `{arch}.block_count`: every layer with attention (llama.cpp's `n_layer_all`).
    pub n_layer: u32,
    pub n_embd: u32,
    /// Most query heads of any layer.
    pub n_head: u32,
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub attention: Attention,
    /// Elements of K (and of V) cached per token, per layer.
    pub k_per_token: Vec<u32>,
    pub v_per_token: Vec<u32>,
    /// Query/key head size and value head size as the attention math sees them (after MLA
    /// decompression: 192 and 128 for DeepSeek V3 / Kimi K2).
    pub head_dim_k: u32,
    pub head_dim_v: u32,
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// Width of one routed (and shared) expert's FFN.
    pub n_ff_exp: u32,
    pub n_expert_shared: u32,
    /// Widest dense FFN of any layer.
    pub n_ff: u32,
}

/// A model as the planner sees it.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The file the user named (for messages).
    pub path: String,
    pub name: Option<String>,
    pub hparams: Hparams,
    /// In file order, shard by shard.
    pub tensors: Vec<TensorEntry>,
}

impl ModelInfo {
    /// Reads the inventory and hyperparameters of an opened model (headers only).
    pub fn from_gguf(model: &GgufModel, path: &str) -> Result<ModelInfo> {
        let tensors: Vec<TensorEntry> =
            model.tensors().map(|t| TensorEntry::new(&t.info.name, t.info.ty, &t.info.dims, t.info.size)).collect();
        let md = model.metadata();
        let hparams = read_hparams(md, &tensors).map_err(|e| match e {
            Error::Model { msg, .. } => Error::Model { path: path.to_string(), msg },
            e => e,
        })?;
        let name = md.opt_str("general.name")?.map(str::to_string);
        Ok(ModelInfo { path: path.to_string(), name, hparams, tensors })
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }
}

fn model_err(md: &Metadata, msg: String) -> Error {
    Error::Model { path: md.path().to_string(), msg }
}

/// A per-layer value stored either once or as an array of `n_layer` values (llama.cpp's
/// `get_key_or_arr`).
fn per_layer(md: &Metadata, key: &str, n_layer: u32, default: Option<u32>) -> Result<Vec<u32>> {
    if !md.contains(key) {
        return match default {
            Some(d) => Ok(vec![d; n_layer as usize]),
            None => Err(model_err(md, format!("metadata key '{key}' not found"))),
        };
    }
    let v = md.get_u32_list(key)?;
    match v.len() {
        1 => Ok(vec![v[0]; n_layer as usize]),
        n if n == n_layer as usize => Ok(v),
        n => Err(model_err(md, format!("'{key}' has {n} values for {n_layer} layers"))),
    }
}

fn read_hparams(md: &Metadata, tensors: &[TensorEntry]) -> Result<Hparams> {
    let arch = md.get_str("general.architecture")?.to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let n_layer = md.get_u32(&key("block_count"))?;
    if n_layer == 0 || n_layer > 100_000 {
        return Err(model_err(md, format!("'{}' = {n_layer} is not a layer count", key("block_count"))));
    }
    let n_embd = md.get_u32(&key("embedding_length"))?;
    let heads = per_layer(md, &key("attention.head_count"), n_layer, None)?;
    let heads_kv =
        per_layer(md, &key("attention.head_count_kv"), n_layer, None).or_else(|_| Ok::<_, Error>(heads.clone()))?;
    let n_head = heads.iter().copied().max().unwrap_or(0);
    if n_head == 0 {
        return Err(model_err(md, format!("'{}' is 0", key("attention.head_count"))));
    }
    let default_head = n_embd / n_head;
    let key_length = md.opt_u32(&key("attention.key_length"))?.unwrap_or(default_head);
    let value_length = md.opt_u32(&key("attention.value_length"))?.unwrap_or(default_head);
    let k_mla = md.opt_u32(&key("attention.key_length_mla"))?.unwrap_or(0);
    let v_mla = md.opt_u32(&key("attention.value_length_mla"))?.unwrap_or(0);
    let rope_dim = md.opt_u32(&key("rope.dimension_count"))?.unwrap_or(key_length);

    // KV cache elements per token and layer, as llama.cpp's llama_kv_cache allocates them
    // (src/llama-kv-cache.cpp, llama.cpp 0c1e5709):
    // * MLA (`hparams.is_mla()`: both *_mla keys set): one K tensor of n_embd_k_gqa =
    //   key_length * head_count_kv = (kv_lora_rank + rope_dim) * 1 per token, the compressed
    //   latent plus the shared rope key; no V tensor at all (`has_v = !is_mla`): attention reads
    //   V as a view of the first kv_lora_rank elements of K, so -ctv does not matter.
    // * otherwise: K of head_count_kv * key_length and V of head_count_kv * value_length.
    let (attention, k_per_token, v_per_token, head_dim_k, head_dim_v) = if k_mla != 0 && v_mla != 0 {
        let kv_lora_rank = md.get_u32(&key("attention.kv_lora_rank"))?;
        let latent = kv_lora_rank + rope_dim;
        let k = vec![latent; n_layer as usize];
        (Attention::Mla { kv_lora_rank, rope_dim }, k, vec![0; n_layer as usize], k_mla, v_mla)
    } else {
        let k = heads_kv.iter().map(|h| h * key_length).collect();
        let v = heads_kv.iter().map(|h| h * value_length).collect();
        (Attention::Standard, k, v, key_length, value_length)
    };

    // The vocabulary from the embedding table (dims[1]), which every model has.
    let n_vocab = tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .map(|v| v as u32)
        .or(md.opt_u32(&key("vocab_size"))?)
        .unwrap_or(0);
    let n_ff = per_layer(md, &key("feed_forward_length"), n_layer, Some(0))?.into_iter().max().unwrap_or(0);
    Ok(Hparams {
        n_layer,
        n_embd,
        n_head,
        n_vocab,
        n_ctx_train: md.opt_u32(&key("context_length"))?.unwrap_or(0),
        attention,
        k_per_token,
        v_per_token,
        head_dim_k,
        head_dim_v,
        n_expert: md.opt_u32(&key("expert_count"))?.unwrap_or(0),
        n_expert_used: md.opt_u32(&key("expert_used_count"))?.unwrap_or(0),
        n_ff_exp: md.opt_u32(&key("expert_feed_forward_length"))?.unwrap_or(0),
        n_expert_shared: md.opt_u32(&key("expert_shared_count"))?.unwrap_or(0),
        n_ff,
        arch,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_gguf::{GgufFile, GgufWriter};

    fn md(pairs: &[(&str, u32)]) -> Metadata {
        let mut w = GgufWriter::new();
        w.add("general.architecture", "llama");
        for (k, v) in pairs {
            w.add(k, *v);
        }
        GgufFile::from_bytes(w.to_bytes().unwrap(), "t.gguf").unwrap().metadata().clone()
    }

    #[test]
    fn standard_attention_kv_follows_head_count_kv() {
        let m = md(&[
            ("llama.block_count", 2),
            ("llama.embedding_length", 256),
            ("llama.attention.head_count", 4),
            ("llama.attention.head_count_kv", 2),
        ]);
        let h = read_hparams(&m, &[]).unwrap();
        assert_eq!(h.attention, Attention::Standard);
        assert_eq!(h.k_per_token, [128, 128]); // 2 KV heads x 64
        assert_eq!(h.v_per_token, [128, 128]);
    }

    #[test]
    fn missing_and_bad_keys_are_named() {
        let e = read_hparams(&md(&[("llama.embedding_length", 8)]), &[]).unwrap_err().to_string();
        assert_eq!(e, "t.gguf: metadata key 'llama.block_count' not found");
        let e = read_hparams(&md(&[("llama.block_count", 0)]), &[]).unwrap_err().to_string();
        assert_eq!(e, "t.gguf: 'llama.block_count' = 0 is not a layer count");
        let e =
            read_hparams(&md(&[("llama.block_count", 2), ("llama.embedding_length", 8)]), &[]).unwrap_err().to_string();
        assert_eq!(e, "t.gguf: metadata key 'llama.attention.head_count' not found");
    }
}
