//! Fixture readers shared by the integration tests (formats in scripts/gen_quant_fixtures.py).

#![allow(dead_code)]

use std::path::PathBuf;

use tandem_quant::GgmlType;

/// Bytes of `tests/fixtures/<name>`.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run scripts/gen_quant_fixtures.py)", path.display()))
}

/// Little-endian u32 at byte `at`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// Little-endian f32s of `b`.
pub fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

/// `dequant_<type>.bin`: (raw blocks, expected f32 output).
pub fn dequant_fixture(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let b = fixture(&format!("dequant_{}.bin", ty.name()));
    let n_blocks = u32_at(&b, 0) as usize;
    let raw_len = n_blocks * ty.type_size();
    let raw = b[4..4 + raw_len].to_vec();
    let expected = f32s(&b[4 + raw_len..]);
    assert_eq!(expected.len(), n_blocks * ty.block_size(), "{ty}: fixture size");
    (raw, expected)
}

/// `quant_input.bin`: (rows, elements per row).
pub fn quant_input() -> (Vec<Vec<f32>>, usize) {
    let b = fixture("quant_input.bin");
    let (n_rows, n_per_row) = (u32_at(&b, 0) as usize, u32_at(&b, 4) as usize);
    let all = f32s(&b[8..]);
    assert_eq!(all.len(), n_rows * n_per_row);
    (all.chunks_exact(n_per_row).map(<[f32]>::to_vec).collect(), n_per_row)
}

/// `quant_<type>.bin`: (index into quant_input rows, quantized row bytes) per row.
pub fn quant_expected(ty: GgmlType, n_per_row: usize) -> Vec<(usize, Vec<u8>)> {
    let b = fixture(&format!("quant_{}.bin", ty.name()));
    let n = u32_at(&b, 0) as usize;
    let row_bytes = ty.row_bytes(n_per_row as u64).unwrap() as usize;
    let data = &b[4 + 4 * n..];
    assert_eq!(data.len(), n * row_bytes, "{ty}: fixture size");
    (0..n).map(|k| (u32_at(&b, 4 + 4 * k) as usize, data[k * row_bytes..(k + 1) * row_bytes].to_vec())).collect()
}

/// One dot product of `vecdot_<type>.bin`: the rows and ggml's scalar and SIMD results.
pub struct VecDotCase {
    pub weight_row: usize,
    pub act_row: usize,
    pub scalar: f32,
    pub simd: f32,
}

/// `vecdot_<type>.bin` with the rows its cases refer to.
pub struct VecDotFixture {
    pub cases: Vec<VecDotCase>,
    pub weight_rows: Vec<Vec<u8>>,
    pub act_rows: Vec<Vec<u8>>,
    /// Elements per row.
    pub n: usize,
}

/// Reads `vecdot_<ty>.bin`, its activation rows of `act_ty` and the weight rows of `ty`.
pub fn vec_dot_fixture(ty: GgmlType, act_ty: GgmlType) -> VecDotFixture {
    let b = fixture(&format!("vecdot_{}.bin", ty.name()));
    let count = u32_at(&b, 0) as usize;
    let results = f32s(&b[4 + 8 * count..]);
    assert_eq!(results.len(), 2 * count, "{ty}: fixture size");
    let cases = (0..count)
        .map(|k| VecDotCase {
            weight_row: u32_at(&b, 4 + 8 * k) as usize,
            act_row: u32_at(&b, 8 + 8 * k) as usize,
            scalar: results[k],
            simd: results[count + k],
        })
        .collect();
    let a = fixture(&format!("vecdot_act_{}.bin", act_ty.name()));
    let (n_rows, n) = (u32_at(&a, 0) as usize, u32_at(&a, 4) as usize);
    let act_rows: Vec<Vec<u8>> = a[8..].chunks_exact((a.len() - 8) / n_rows).map(<[u8]>::to_vec).collect();
    let weight_rows = if tandem_quant::GRID_TYPES.contains(&ty) {
        // Random blocks (llama.cpp quantizes these types only with an importance matrix): each
        // block of dequant_<type>.bin is one weight row.
        assert_eq!(n, ty.block_size(), "{ty}: rows of one block");
        dequant_fixture(ty).0.chunks_exact(ty.type_size()).map(<[u8]>::to_vec).collect()
    } else if ty == GgmlType::F32 {
        quant_input().0.iter().map(|r| r.iter().flat_map(|v| v.to_le_bytes()).collect()).collect()
    } else {
        quant_expected(ty, n).into_iter().map(|(_, bytes)| bytes).collect()
    };
    VecDotFixture { cases, weight_rows, act_rows, n }
}

/// `n` elements of `ty` from the blocks of its dequant fixture, in order and then again from the
/// start (for the types tandem-quant cannot quantize).
pub fn fixture_blocks(ty: GgmlType, n: usize) -> Vec<u8> {
    let raw = dequant_fixture(ty).0;
    raw.iter().copied().cycle().take(n / ty.block_size() * ty.type_size()).collect()
}

#[allow(unused_imports)] // not every test binary draws random inputs
pub use tandem_quant::testing::Rng;
