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

/// A `rows x cols` matrix of random weights quantized to `ty` row by row.
pub fn quantized_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let rb = row_size(ty, cols).expect("row size");
    let src = random_f32(rows * cols, seed);
    let mut out = vec![0u8; rows * rb];
    for (s, d) in src.chunks_exact(cols).zip(out.chunks_exact_mut(rb)) {
        quantize_row(ty, s, d).expect("quantize");
    }
    out
}
