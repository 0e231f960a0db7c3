//! Shared by the benches: seeded random data, quantized weight matrices, the thread pool size.

#![allow(dead_code)] // each bench uses a part

use tandem_quant::{quantize_row, row_size, GgmlType};

/// Threads for the benches: `TANDEM_BENCH_THREADS`, else every core.
pub fn threads() -> usize {
    std::env::var("TANDEM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `n` floats uniform in [-1, 1), from a seeded SplitMix64.
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// A `rows x cols` matrix of random weights quantized to `ty` row by row; for the IQ1/IQ2/IQ3
/// types, which tandem does not quantize, random blocks (every bit pattern is one) with a modest
/// fp16 scale.
pub fn quantized_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let rb = row_size(ty, cols).expect("row size");
    if tandem_quant::GRID_TYPES.contains(&ty) {
        let mut out: Vec<u8> = random_f32(rows * rb, seed).iter().map(|v| (v.to_bits() >> 8) as u8).collect();
        let d = tandem_quant::f32_to_fp16(0.002).to_bits();
        for block in out.chunks_exact_mut(ty.type_size()) {
            if ty == GgmlType::IQ1_M {
                for k in 0..4 {
                    block[49 + 2 * k] = (block[49 + 2 * k] & 0x0F) | ((((d >> (4 * k)) & 0xF) as u8) << 4);
                }
            } else {
                block[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
        return out;
    }
    let src = random_f32(rows * cols, seed);
    let mut out = vec![0u8; rows * rb];
    for (s, d) in src.chunks_exact(cols).zip(out.chunks_exact_mut(rb)) {
        quantize_row(ty, s, d).expect("quantize");
    }
    out
}
