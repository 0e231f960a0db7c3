//! What a tensor is for, from its GGUF name (llama.cpp's names: `blk.{i}.ffn_gate_exps.weight`).
//! Shared by `tandem inspect` and the placement planner.

use serde::Serialize;

/// The role of a tensor, used to total bytes and to place tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorCategory {
    Attention,
    RoutedExperts,
    SharedExperts,
    DenseFfn,
    EmbeddingsOutput,
    NormsRouter,
    Other,
}

impl TensorCategory {
    pub const ALL: [TensorCategory; 7] = [
        Self::Attention,
        Self::RoutedExperts,
        Self::SharedExperts,
        Self::DenseFfn,
        Self::EmbeddingsOutput,
        Self::NormsRouter,
        Self::Other,
    ];

    /// The snake_case name used in JSON output.
    pub fn key(self) -> &'static str {
        match self {
            Self::Attention => "attention",
            Self::RoutedExperts => "routed_experts",
            Self::SharedExperts => "shared_experts",
            Self::DenseFfn => "dense_ffn",
            Self::EmbeddingsOutput => "embeddings_output",
            Self::NormsRouter => "norms_router",
            Self::Other => "other",
        }
    }

    /// A label for tables.
    pub fn label(self) -> &'static str {
        match self {
            Self::Attention => "attention",
            Self::RoutedExperts => "routed experts",
            Self::SharedExperts => "shared experts",
            Self::DenseFfn => "dense FFN",
            Self::EmbeddingsOutput => "embeddings/output",
            Self::NormsRouter => "norms/router",
            Self::Other => "other",
        }
    }

    /// The category of the tensor named `name`.
    pub fn of(name: &str) -> TensorCategory {
        let base = strip_layer(name).unwrap_or(name);
        let base = base.split('.').next().unwrap_or(base);
        if base.starts_with("token_embd") || base == "output" || base.starts_with("token_types") {
            Self::EmbeddingsOutput
        } else if base.ends_with("_exps") {
            Self::RoutedExperts
        } else if base.contains("_shexp") {
            Self::SharedExperts
        } else if base.ends_with("_norm") || base == "ffn_gate_inp" || base == "exp_probs_b" {
            Self::NormsRouter
        } else if base.starts_with("attn_") {
            Self::Attention
        } else if base.starts_with("ffn_") {
            Self::DenseFfn
        } else {
            Self::Other
        }
    }
}

/// The layer number of a `blk.{i}.` tensor.
pub fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("blk.")?;
    rest[..rest.find('.')?].parse().ok()
}

fn strip_layer(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("blk.")?;
    Some(&rest[rest.find('.')? + 1..])
}

#[cfg(test)]
mod tests {
    use super::TensorCategory as C;
    use super::*;

    #[test]
    fn categories_of_deepseek2_names() {
        let cases = [
            ("token_embd.weight", C::EmbeddingsOutput),
            ("output.weight", C::EmbeddingsOutput),
            ("output_norm.weight", C::NormsRouter),
            ("blk.0.attn_norm.weight", C::NormsRouter),
            ("blk.0.attn_q_a_norm.weight", C::NormsRouter),
            ("blk.0.attn_kv_a_mqa.weight", C::Attention),
            ("blk.0.attn_k_b.weight", C::Attention),
            ("blk.0.attn_output.weight", C::Attention),
            ("blk.0.ffn_gate.weight", C::DenseFfn),
            ("blk.0.ffn_down.weight", C::DenseFfn),
            ("blk.3.ffn_gate_inp.weight", C::NormsRouter),
            ("blk.3.exp_probs_b.bias", C::NormsRouter),
            ("blk.3.ffn_up_exps.weight", C::RoutedExperts),
            ("blk.3.ffn_gate_up_exps.weight", C::RoutedExperts),
            ("blk.3.ffn_down_shexp.weight", C::SharedExperts),
            ("blk.61.nextn.eh_proj.weight", C::Other),
            ("rope_freqs.weight", C::Other),
        ];
        for (name, want) in cases {
            assert_eq!(C::of(name), want, "{name}");
        }
        assert_eq!(layer_of("blk.17.attn_norm.weight"), Some(17));
        assert_eq!(layer_of("output.weight"), None);
    }
}
