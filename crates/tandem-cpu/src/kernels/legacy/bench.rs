//! Throughput of the kernels of this file's types, per level (not a test: no timing is asserted).
//! `cargo test -p tandem-cpu --release --lib legacy::bench -- --ignored --nocapture`

use crate::kernels::{kernel, Isa, MAX_NY};
use std::time::Instant;
use tandem_quant::{quantize_row, row_size, GgmlType};

use crate::test_data as data;

/// Weight bytes per second (GB/s) of `rows` rows of `n` run against `ny` activation rows (median
/// over chunks of the matrix).
fn rate(ty: GgmlType, isa: Isa, n: usize, rows: usize, ny: usize) -> f64 {
    let k = kernel(ty, isa).unwrap();
    rate_of(ty, n, rows, ny, |w, ys, out| k.run(n, w, ys, out))
}

fn rate_of(ty: GgmlType, n: usize, rows: usize, ny: usize, run: impl Fn(&[u8], &[u8], &mut [f32])) -> f64 {
    let rb = row_size(ty, n).unwrap();
    // 16 distinct quantized rows, tiled over the matrix.
    let mut tile = vec![0u8; rb * 16];
    let x = data(7, n * 16);
    for (r, row) in tile.chunks_exact_mut(rb).enumerate() {
        quantize_row(ty, &x[r * n..][..n], row).unwrap();
    }
    let w: Vec<u8> = tile.iter().copied().cycle().take(rb * rows).collect();
    let acts = crate::quantize_activations(ty, &data(9, n * MAX_NY), n).unwrap();
    let ys = &acts.data[..ny * acts.row_bytes];
    let mut out = [0f32; MAX_NY];
    // The machine is shared: time chunks of about 1 MiB of weights on their own and take the
    // median chunk rate, so chunks that lost the core to another process do not count.
    let chunk_rows = ((1 << 20) / rb).clamp(1, rows);
    let mut rates = Vec::new();
    for _ in 0..(64 << 20) / w.len().max(1) + 1 {
        for chunk in w.chunks(chunk_rows * rb) {
            let t = Instant::now();
            for row in chunk.chunks_exact(rb) {
                run(row, ys, &mut out[..ny]);
            }
            rates.push(chunk.len() as f64 / t.elapsed().as_secs_f64() / 1e9);
            std::hint::black_box(&out);
        }
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

#[test]
#[ignore]
fn throughput() {
    use GgmlType as T;
    let types = [T::Q8_0, T::Q4_0, T::Q5_0, T::IQ4_XS, T::F16, T::BF16, T::F32, T::IQ4_NL, T::Q4_1, T::Q5_1];
    let only = std::env::var("TANDEM_BENCH_TYPES").ok();
    let n: usize = std::env::var("TANDEM_BENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(7168);
    println!("n = {n}; GB/s of weight bytes; 'x8' = ny=8 rate / ny=1 rate (weight-byte speedup of one ny=8 call over eight ny=1 calls)");
    for ty in types {
        if only.as_deref().is_some_and(|o| !o.split(',').any(|t| t.eq_ignore_ascii_case(&ty.to_string()))) {
            continue;
        }
        for isa in Isa::ALL.into_iter().filter(|l| l.supported()) {
            if kernel(ty, isa).unwrap().isa != isa {
                continue;
            }
            let rb = row_size(ty, n).unwrap();
            let l2_rows = (512 << 10) / rb;
            let dram_rows = (128 << 20) / rb;
            let l2_1 = rate(ty, isa, n, l2_rows, 1);
            let l2_8 = rate(ty, isa, n, l2_rows, 8);
            let ram_1 = rate(ty, isa, n, dram_rows, 1);
            let ram_8 = rate(ty, isa, n, dram_rows, 8);
            println!(
                "{ty:>7} {isa:<11} L2: ny=1 {l2_1:6.1} GB/s, ny=8 {l2_8:6.1} GB/s (x8 {:4.1}) | 128 MiB: ny=1 {ram_1:5.1} GB/s, ny=8 {ram_8:5.1} GB/s (x8 {:4.1})",
                8.0 * l2_8 / l2_1,
                8.0 * ram_8 / ram_1
            );
        }
    }
}
