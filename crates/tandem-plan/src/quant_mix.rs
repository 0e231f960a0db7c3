//! The tensor types llama.cpp's quantizer picks for the Q4_K_S and Q4_K_M mixes, so that the
//! Kimi-K2.5-shaped replica has the sizes a real `llama-quantize` run would give.
//!
//! A port of `llama_tensor_get_type` / `llama_tensor_get_type_impl` / `tensor_type_fallback` of
//! src/llama-quant.cpp (llama.cpp 0c1e5709, the build the fixtures were made with), restricted to
//! these two ftypes, without an imatrix, `--pure`, `--tensor-type` or `--output-tensor-type`, and
//! without the Falcon and 70B special cases (neither applies to deepseek2). The test in
//! tests/quant_mix.rs checks it against llama.cpp's own Q4_K_M quantization of the MLA fixture.

use tandem_gguf::naming::layer_of;
use tandem_gguf::GgmlType;

/// A llama.cpp ftype (`general.file_type`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ftype {
    Q4_K_S,
    Q4_K_M,
}

impl Ftype {
    /// `LLAMA_FTYPE_MOSTLY_Q4_K_S` = 14, `LLAMA_FTYPE_MOSTLY_Q4_K_M` = 15.
    pub fn file_type(self) -> u32 {
        match self {
            Ftype::Q4_K_S => 14,
            Ftype::Q4_K_M => 15,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Ftype::Q4_K_S => "Q4_K_S",
            Ftype::Q4_K_M => "Q4_K_M",
        }
    }
}

/// llama-quant.cpp's `tensor_category`, decided by substrings in the same order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnV,
    AttnK,
    AttnOutput,
    FfnDown,
    Output,
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" {
        return Category::TokenEmbd;
    }
    // attn_qkv, attn_kv_b and attn_v are all "attn_v-like" (`category_is_attn_v`).
    if name.contains("attn_qkv.weight") || name.contains("attn_kv_b.weight") || name.contains("attn_v.weight") {
        return Category::AttnV;
    }
    if name.contains("attn_k.weight") {
        return Category::AttnK;
    }
    if name.contains("attn_q.weight") {
        return Category::Other; // ATTENTION_Q: no change for Q4_K_S/M
    }
    if name.contains("attn_output.weight") {
        return Category::AttnOutput;
    }
    if name.contains("ffn_up") || name.contains("ffn_gate") {
        return Category::Other; // FFN_UP / FFN_GATE: no change for Q4_K_S/M
    }
    if name.contains("ffn_down") {
        return Category::FfnDown;
    }
    Category::Other
}

/// `use_more_bits`: the first and last eighth of the layers and every third one between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// Picks types tensor by tensor, keeping llama.cpp's running count of attn_v-like tensors.
#[derive(Clone, Debug)]
pub struct QuantMix {
    ftype: Ftype,
    n_layer: i64,
    n_expert: u32,
    tied_embeddings: bool,
    n_attention_wv: i64,
    i_attention_wv: i64,
}

impl QuantMix {
    /// `names` are all tensor names of the model (llama.cpp counts the attn_v-like ones and
    /// looks for `output.weight` before choosing any type).
    pub fn new<'a>(ftype: Ftype, n_layer: u32, n_expert: u32, names: impl IntoIterator<Item = &'a str>) -> QuantMix {
        let mut n_attention_wv = 0;
        let mut tied_embeddings = true;
        for n in names {
            n_attention_wv += i64::from(category(n) == Category::AttnV);
            tied_embeddings &= category(n) != Category::Output;
        }
        QuantMix { ftype, n_layer: i64::from(n_layer), n_expert, tied_embeddings, n_attention_wv, i_attention_wv: 0 }
    }

    /// The type llama.cpp gives tensor `name` of shape `dims` stored as `source` in the input
    /// file. Call it once per tensor, in file order.
    pub fn tensor_type(&mut self, name: &str, dims: &[u64], source: GgmlType) -> GgmlType {
        if !allows_quantization(name, dims) {
            return source;
        }
        let q4km = self.ftype == Ftype::Q4_K_M;
        let mut t = GgmlType::Q4_K;
        match category(name) {
            Category::Output => t = if !dims[0].is_multiple_of(256) { GgmlType::Q8_0 } else { GgmlType::Q6_K },
            Category::TokenEmbd if self.tied_embeddings => {
                t = if !dims[0].is_multiple_of(256) { GgmlType::Q8_0 } else { GgmlType::Q6_K }
            }
            Category::TokenEmbd => {}
            Category::AttnV => {
                if q4km && use_more_bits(self.i_attention_wv, self.n_attention_wv) {
                    t = GgmlType::Q6_K;
                } else if !q4km && self.i_attention_wv < 4 {
                    t = GgmlType::Q5_K;
                }
                if self.n_expert == 8 {
                    t = GgmlType::Q8_0;
                }
                self.i_attention_wv += 1;
            }
            Category::AttnK if self.n_expert == 8 => t = GgmlType::Q8_0,
            Category::AttnK => {}
            Category::FfnDown => {
                // With experts llama.cpp reads the layer from the name; without, it counts
                // ffn_down tensors, which is the same for one ffn_down per layer.
                let i = i64::from(layer_of(name).unwrap_or(0));
                if q4km && use_more_bits(i, self.n_layer) {
                    t = GgmlType::Q6_K;
                } else if !q4km && i < self.n_layer / 8 {
                    t = GgmlType::Q5_K;
                }
            }
            Category::AttnOutput if self.n_expert == 8 => t = GgmlType::Q5_K,
            Category::AttnOutput | Category::Other => {}
        }
        fallback(t, dims[0])
    }
}

/// `tensor_allows_quantization` for the tensors a deepseek2 / llama model has: 2D and 3D
/// `*weight` tensors except norms and the router.
fn allows_quantization(name: &str, dims: &[u64]) -> bool {
    // ggml_n_dims: trailing dimensions of 1 do not count.
    let n_dims = dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    n_dims >= 2 && name.ends_with("weight") && !name.contains("_norm.weight") && !name.contains("ffn_gate_inp.weight")
}

/// `tensor_type_fallback`: a k-quant needs rows of whole 256-blocks; otherwise the 32-block type
/// of about the same size, else F16.
fn fallback(t: GgmlType, ncols: u64) -> GgmlType {
    if ncols.is_multiple_of(t.block_size() as u64) {
        return t;
    }
    let f = match t {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if ncols.is_multiple_of(f.block_size() as u64) {
        f
    } else {
        GgmlType::F16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_of_kimi() {
        // 61 layers: 0-6, 53-60 and every third from 9 to 51.
        let picked: Vec<i64> = (0..61).filter(|&i| use_more_bits(i, 61)).collect();
        let mut want: Vec<i64> = (0..7).chain((9..53).step_by(3)).chain(53..61).collect();
        want.dedup();
        assert_eq!(picked, want);
    }

    #[test]
    fn kimi_shapes_get_llama_cpp_types() {
        let names = ["output.weight", "blk.1.ffn_down_exps.weight"];
        let mut m = QuantMix::new(Ftype::Q4_K_M, 61, 384, names);
        assert_eq!(m.tensor_type("token_embd.weight", &[7168, 163840], GgmlType::BF16), GgmlType::Q4_K);
        assert_eq!(m.tensor_type("output.weight", &[7168, 163840], GgmlType::BF16), GgmlType::Q6_K);
        assert_eq!(m.tensor_type("blk.0.attn_norm.weight", &[7168], GgmlType::F32), GgmlType::F32);
        assert_eq!(m.tensor_type("blk.1.ffn_gate_inp.weight", &[7168, 384], GgmlType::F32), GgmlType::F32);
        // ne[0] = 128 is no whole Q4_K block: Q5_0.
        assert_eq!(m.tensor_type("blk.1.attn_k_b.weight", &[128, 512, 64], GgmlType::BF16), GgmlType::Q5_0);
        assert_eq!(m.tensor_type("blk.1.attn_v_b.weight", &[512, 128, 64], GgmlType::BF16), GgmlType::Q4_K);
        assert_eq!(m.tensor_type("blk.1.attn_output.weight", &[8192, 7168], GgmlType::BF16), GgmlType::Q4_K);
        assert_eq!(m.tensor_type("blk.1.ffn_down_exps.weight", &[2048, 7168, 384], GgmlType::BF16), GgmlType::Q6_K);
        assert_eq!(m.tensor_type("blk.8.ffn_down_exps.weight", &[2048, 7168, 384], GgmlType::BF16), GgmlType::Q4_K);
        let mut s = QuantMix::new(Ftype::Q4_K_S, 61, 384, names);
        assert_eq!(s.tensor_type("blk.6.ffn_down_shexp.weight", &[2048, 7168], GgmlType::BF16), GgmlType::Q5_K);
        assert_eq!(s.tensor_type("blk.7.ffn_down_exps.weight", &[2048, 7168, 384], GgmlType::BF16), GgmlType::Q4_K);
    }
}
