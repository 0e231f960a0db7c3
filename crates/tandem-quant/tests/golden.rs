//! Golden tests against the fixtures of scripts/gen_quant_fixtures.py:
//! dequantization bit-exact with PyPI gguf / ggml's C decoders, quantization byte-exact with
//! llama.cpp's `llama_model_quantize` (and ggml's C `quantize_row_q8_{1,K}_ref`).

mod common;

use common::{dequant_fixture, quant_expected, quant_input};
use tandem_quant::{dequantize_row, quantize_row, GgmlType};

/// Dequantizes the fixture blocks (also from a deliberately misaligned copy) and compares f32
/// bits, so NaN equals NaN only with the same payload.
fn check_dequant(ty: GgmlType) {
    let (raw, expected) = dequant_fixture(ty);
    let mut shifted = vec![0u8; raw.len() + 1];
    shifted[1..].copy_from_slice(&raw);
    for (what, src) in [("aligned", &raw[..]), ("misaligned", &shifted[1..])] {
        let mut got = vec![0f32; expected.len()];
        dequantize_row(ty, src, &mut got).unwrap();
        let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i].to_bits() != expected[i].to_bits()).collect();
        if let Some(&i) = bad.first() {
            let bs = ty.block_size();
            panic!(
                "{ty} ({what}): {} of {} values differ; first at block {}, element {}: got {} ({:#010x}), want {} ({:#010x})",
                bad.len(),
                got.len(),
                i / bs,
                i % bs,
                got[i],
                got[i].to_bits(),
                expected[i],
                expected[i].to_bits()
            );
        }
    }
}

/// Quantizes the fixture rows and compares bytes with llama.cpp's output.
fn check_quant(ty: GgmlType) {
    let (rows, n_per_row) = quant_input();
    let expected = quant_expected(ty, n_per_row);
    assert!(!expected.is_empty());
    let mut mismatched_rows = Vec::new();
    let mut first = None;
    for (row, want) in &expected {
        let mut got = vec![0u8; want.len()];
        quantize_row(ty, &rows[*row], &mut got).unwrap();
        if let Some(off) = (0..got.len()).find(|&k| got[k] != want[k]) {
            mismatched_rows.push(*row);
            first.get_or_insert((*row, off, got[off], want[off]));
        }
    }
    if let Some((row, off, g, w)) = first {
        let ts = ty.type_size();
        panic!(
            "{ty}: {} of {} rows differ (input rows {mismatched_rows:?}); first in input row {row}, block {}, byte {} of the block: got {g:#04x}, want {w:#04x}",
            mismatched_rows.len(),
            expected.len(),
            off / ts,
            off % ts
        );
    }
}

macro_rules! golden_tests {
    ($kind:ident, $check:ident: $($name:ident => $ty:ident),* $(,)?) => {
        mod $kind {
            $(
                #[test]
                fn $name() {
                    super::$check(tandem_quant::GgmlType::$ty);
                }
            )*
        }
    };
}

golden_tests!(dequant, check_dequant:
    f32 => F32, f16 => F16, bf16 => BF16,
    q4_0 => Q4_0, q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, q8_0 => Q8_0, q8_1 => Q8_1,
    q2_k => Q2_K, q3_k => Q3_K, q4_k => Q4_K, q5_k => Q5_K, q6_k => Q6_K, q8_k => Q8_K,
    iq4_nl => IQ4_NL, iq4_xs => IQ4_XS,
    iq2_xxs => IQ2_XXS, iq2_xs => IQ2_XS, iq2_s => IQ2_S, iq3_xxs => IQ3_XXS, iq3_s => IQ3_S,
    iq1_s => IQ1_S, iq1_m => IQ1_M,
);

golden_tests!(quant_llama_cpp, check_quant:
    f16 => F16, bf16 => BF16,
    q4_0 => Q4_0, q4_1 => Q4_1, q5_0 => Q5_0, q5_1 => Q5_1, q8_0 => Q8_0,
    q2_k => Q2_K, q3_k => Q3_K, q4_k => Q4_K, q5_k => Q5_K, q6_k => Q6_K,
    iq4_nl => IQ4_NL, iq4_xs => IQ4_XS,
);

golden_tests!(quant_ggml_ref, check_quant: q8_1 => Q8_1, q8_k => Q8_K);

#[test]
fn every_supported_type_has_a_dequant_fixture() {
    for ty in tandem_quant::DEQUANTIZE_TYPES {
        let (raw, expected) = dequant_fixture(ty);
        assert!(!raw.is_empty() && !expected.is_empty(), "{ty}");
    }
}
