//! One routed expert's FFN as tandem's MoE runs it, `down(silu(gate x) * up x)`, hidden 2048 and
//! expert FFN 768 (a small DeepSeek-style expert), for 1 token and for a batch of 64, built from
//! `tandem_cpu::matmul` and `silu_mul`, with the weights as stored and repacked (`TYPE-packed`,
//! as `tandem` runs by default where the machine has the packed kernels). Throughput is the
//! expert's weight bytes.
//!
//! `cargo bench --bench expert_ffn` (`-- --quick` for a short run); threads: TANDEM_BENCH_THREADS.

mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use tandem_cpu::{matmul, packed, silu_mul, Threads, WeightRef};
use tandem_quant::GgmlType;

const HIDDEN: usize = 2048;
const FFN: usize = 768;
const TOKENS: [usize; 2] = [1, 64];
/// The routed-expert types of common Kimi K2 / DeepSeek V3 quantizations.
const TYPES: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::IQ4_XS, GgmlType::Q8_0];

fn bench_expert(c: &mut Criterion) {
    let n_threads = common::threads();
    let threads = Threads::new(n_threads, n_threads).expect("thread pool");
    let mut g = c.benchmark_group(format!("expert_ffn_{HIDDEN}x{FFN}_t{n_threads}"));
    for ty in TYPES {
        let gate_d = common::quantized_matrix(ty, FFN, HIDDEN, 11);
        let up_d = common::quantized_matrix(ty, FFN, HIDDEN, 12);
        let down_d = common::quantized_matrix(ty, HIDDEN, FFN, 13);
        let bytes = (gate_d.len() + up_d.len() + down_d.len()) as u64;
        let gate = WeightRef::new(ty, FFN, HIDDEN, &gate_d).expect("gate"); // [FFN][HIDDEN]
        let up = WeightRef::new(ty, FFN, HIDDEN, &up_d).expect("up"); // [FFN][HIDDEN]
        let down = WeightRef::new(ty, HIDDEN, FFN, &down_d).expect("down"); // [HIDDEN][FFN]
        expert(&mut g, &threads, &ty.to_string(), bytes, [gate, up, down]);
        let packable = packed::paying_types().contains(&ty)
            && packed::packable(ty, FFN, HIDDEN)
            && packed::packable(ty, HIDDEN, FFN);
        if !packable {
            continue;
        }
        let pg = packed::pack(ty, FFN, HIDDEN, &gate_d).expect("pack gate");
        let pu = packed::pack(ty, FFN, HIDDEN, &up_d).expect("pack up");
        let pd = packed::pack(ty, HIDDEN, FFN, &down_d).expect("pack down");
        expert(&mut g, &threads, &format!("{ty}-packed"), bytes, [pg.weight_ref(), pu.weight_ref(), pd.weight_ref()]);
    }
    g.finish();
}

/// The expert `[gate, up, down]` for 1 and 64 tokens, named `name`.
fn expert(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    threads: &Threads,
    name: &str,
    bytes: u64,
    [gate, up, down]: [WeightRef<'_>; 3],
) {
    for n in TOKENS {
        let x = common::random_f32(n * HIDDEN, 14);
        let (mut hg, mut hu, mut y) = (vec![0f32; n * FFN], vec![0f32; n * FFN], vec![0f32; n * HIDDEN]);
        let pool = threads.for_tokens(n);
        g.throughput(Throughput::Bytes(bytes));
        g.bench_with_input(BenchmarkId::new(name, format!("{n}tok")), &n, |b, _| {
            b.iter(|| {
                matmul(pool, &gate, black_box(&x), &mut hg).expect("gate");
                matmul(pool, &up, &x, &mut hu).expect("up");
                silu_mul(&mut hg, &hu);
                matmul(pool, &down, &hg, &mut y).expect("down");
                black_box(&y);
            })
        });
    }
}

criterion_group!(benches, bench_expert);
criterion_main!(benches);
