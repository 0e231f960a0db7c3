//! The Q4_K_M type mix against llama.cpp's own: the MLA fixture was quantized by
//! `llama_model_quantize` (tests/fixtures/README.md); every tensor must get the same type.

use std::path::PathBuf;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_plan::quant_mix::{Ftype, QuantMix};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

#[test]
fn q4_k_m_mix_matches_llama_cpp_quantizer() {
    let src = GgufModel::open(fixture("deepseek2-mla-tiny.gguf"), LoadOptions::default()).unwrap();
    let q = GgufModel::open(fixture("deepseek2-mla-tiny-Q4_K_M.gguf"), LoadOptions::default()).unwrap();
    let md = src.metadata();
    let n_layer = md.get_u32("deepseek2.block_count").unwrap();
    let n_expert = md.get_u32("deepseek2.expert_count").unwrap();
    let mut mix = QuantMix::new(Ftype::Q4_K_M, n_layer, n_expert, src.tensors().map(|t| t.info.name.as_str()));
    let mut checked = 0;
    for t in src.tensors() {
        let want = q.tensor(&t.info.name).unwrap_or_else(|| panic!("{} missing in the Q4_K_M fixture", t.info.name));
        let got = mix.tensor_type(&t.info.name, &t.info.dims, t.info.ty);
        assert_eq!(got, want.info.ty, "{} {:?}", t.info.name, t.info.dims);
        checked += 1;
    }
    assert_eq!(checked, q.tensor_count());
}
