//! Quantized matmul per weight type through `tandem_cpu::matmul`: a 2048 x 2048 weight against
//! 1 token (the decode matvec) and 64 tokens (a prefill micro-batch), row-major and, for the types
//! `--repack` packs, packed (`TYPE-packed`; where the machine runs the packed kernels). Throughput
//! is the row-major weight bytes. The IQ1/IQ2/IQ3 types are random blocks (tandem cannot quantize
//! them).
//!
//! `cargo bench --bench kernels` (`-- --quick` for a short run); threads: TANDEM_BENCH_THREADS.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use tandem_cpu::{matmul, packed, Threads, WeightRef};
use tandem_quant::GgmlType;

const N: usize = 2048;
const TOKENS: [usize; 2] = [1, 64];
const TYPES: [GgmlType; 12] = [
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_0,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ1_S,
    GgmlType::F16,
    GgmlType::BF16,
];

fn bench_matmul(c: &mut Criterion) {
    let n_threads = common::threads();
    let threads = Threads::new(n_threads, n_threads).expect("thread pool");
    let mut g = c.benchmark_group(format!("matmul_{N}x{N}_t{n_threads}"));
    for ty in TYPES {
        let data = common::quantized_matrix(ty, N, N, 1);
        let w = WeightRef::new(ty, N, N, &data).expect("weight");
        for n in TOKENS {
            let x = common::random_f32(n * N, 2);
            let mut y = vec![0f32; n * N];
            let pool = threads.for_tokens(n);
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_with_input(BenchmarkId::new(ty.to_string(), format!("{n}tok")), &n, |b, _| {
                b.iter(|| matmul(pool, &w, black_box(&x), &mut y).expect("matmul"))
            });
        }
        if !(packed::packing_pays() && packed::packable(ty, N, N)) {
            continue;
        }
        let p = packed::pack(ty, N, N, &data).expect("pack");
        let w = p.weight_ref();
        for n in TOKENS {
            let x = common::random_f32(n * N, 2);
            let mut y = vec![0f32; n * N];
            let pool = threads.for_tokens(n);
            g.throughput(Throughput::Bytes(data.len() as u64));
            g.bench_with_input(BenchmarkId::new(format!("{ty}-packed"), format!("{n}tok")), &n, |b, _| {
                b.iter(|| matmul(pool, &w, black_box(&x), &mut y).expect("matmul"))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench_matmul);
criterion_main!(benches);
