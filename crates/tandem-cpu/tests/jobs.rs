//! Batched products (`matmul_jobs`, `ffn_jobs`) against one `matmul` per product.

use tandem_cpu::testing::data;
use tandem_cpu::{ffn_jobs, matmul, matmul_jobs, packed, quantize_activations, silu_mul, FfnJob, MatJob, WeightRef};
use tandem_quant::{quantize_row, row_size, GgmlType};

fn weight(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let rb = row_size(ty, cols).unwrap();
    let mut w = vec![0u8; rows * rb];
    for (r, dst) in w.chunks_exact_mut(rb).enumerate() {
        quantize_row(ty, &data(seed * 1000 + r as u64, cols), dst).unwrap();
    }
    w
}

fn close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let max = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * max + 1e-7, "{what} [{i}]: {x} vs {y}");
    }
}

#[test]
fn ffn_jobs_equal_separate_matmuls() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let (cols, n_ff, n) = (512, 256, 13);
    let x = data(7, n * cols);
    // Three experts in one 3-D tensor (Q4_K gate/up, Q6_K down) and a Q8_0 "shared" FFN.
    let (ge, ue, de) = (
        weight(GgmlType::Q4_K, 3 * n_ff, cols, 1),
        weight(GgmlType::Q4_K, 3 * n_ff, cols, 2),
        weight(GgmlType::Q6_K, 3 * cols, n_ff, 3),
    );
    let (gs, us, ds) = (
        weight(GgmlType::Q8_0, n_ff, cols, 4),
        weight(GgmlType::Q8_0, n_ff, cols, 5),
        weight(GgmlType::Q8_0, cols, n_ff, 6),
    );
    let gate_all = WeightRef::new(GgmlType::Q4_K, 3 * n_ff, cols, &ge).unwrap();
    let up_all = WeightRef::new(GgmlType::Q4_K, 3 * n_ff, cols, &ue).unwrap();
    let down_all = WeightRef::new(GgmlType::Q6_K, 3 * cols, n_ff, &de).unwrap();
    let token_sets = [vec![0, 3, 4, 12], vec![], vec![1, 2, 5, 6, 7, 8, 9, 10, 11, 0]];
    let mut jobs: Vec<FfnJob> = token_sets
        .iter()
        .enumerate()
        .map(|(e, t)| FfnJob {
            gate: gate_all.rows(e * n_ff, n_ff).unwrap(),
            up: up_all.rows(e * n_ff, n_ff).unwrap(),
            down: down_all.rows(e * cols, cols).unwrap(),
            tokens: t.clone(),
        })
        .collect();
    jobs.push(FfnJob {
        gate: WeightRef::new(GgmlType::Q8_0, n_ff, cols, &gs).unwrap(),
        up: WeightRef::new(GgmlType::Q8_0, n_ff, cols, &us).unwrap(),
        down: WeightRef::new(GgmlType::Q8_0, cols, n_ff, &ds).unwrap(),
        tokens: (0..n).collect(),
    });
    let got = ffn_jobs(&pool, &x, cols, &jobs).unwrap();
    for (j, out) in jobs.iter().zip(&got) {
        let xs: Vec<f32> = j.tokens.iter().flat_map(|&t| x[t * cols..(t + 1) * cols].to_vec()).collect();
        let m = j.tokens.len();
        if m == 0 {
            assert!(out.is_empty());
            continue;
        }
        let (mut g, mut u, mut d) = (vec![0f32; m * n_ff], vec![0f32; m * n_ff], vec![0f32; m * cols]);
        matmul(&pool, &j.gate, &xs, &mut g).unwrap();
        matmul(&pool, &j.up, &xs, &mut u).unwrap();
        silu_mul(&mut g, &u);
        matmul(&pool, &j.down, &g, &mut d).unwrap();
        close(out, &d, "ffn job");
    }
}

/// One parallel step of several products (row-major and, where this machine packs, packed; rows
/// that are not a multiple of any block; 1 and 5 tokens; a job with no tokens) writes every output,
/// with the same bits on 2 and 3 threads as each product alone on 1: however the threads divide
/// the rows among them.
#[test]
fn a_step_writes_every_output_the_same_on_any_number_of_threads() {
    let cols = 2048;
    let mut mats: Vec<(GgmlType, usize, Vec<u8>)> = vec![
        (GgmlType::Q4_K, 1000, weight(GgmlType::Q4_K, 1000, cols, 1)),
        (GgmlType::Q8_0, 77, weight(GgmlType::Q8_0, 77, cols, 2)),
        (GgmlType::Q6_K, 3, weight(GgmlType::Q6_K, 3, cols, 3)),
        (GgmlType::F32, 40, data(4, 40 * cols).iter().flat_map(|v| v.to_le_bytes()).collect()),
    ];
    let packs: Vec<packed::Packed> =
        [(GgmlType::Q4_K, 640usize, 5u64), (GgmlType::Q6_K, 48, 6), (GgmlType::Q8_0, 208, 7)]
            .iter()
            .filter(|&&(ty, rows, _)| packed::packing_pays_for(ty) && packed::packable(ty, rows, cols))
            .map(|&(ty, rows, seed)| packed::pack(ty, rows, cols, &weight(ty, rows, cols, seed)).unwrap())
            .collect();
    mats.push((GgmlType::Q4_K, 16, weight(GgmlType::Q4_K, 16, cols, 8)));
    let mut ws: Vec<WeightRef> =
        mats.iter().map(|(ty, rows, d)| WeightRef::new(*ty, *rows, cols, d).unwrap()).collect();
    ws.extend(packs.iter().map(|p| p.weight_ref()));
    for n in [1usize, 5] {
        let x = data(20 + n as u64, n * cols);
        let acts: Vec<_> = ws.iter().map(|w| quantize_activations(w.ty, &x, cols).unwrap()).collect();
        let none = quantize_activations(GgmlType::Q8_0, &[], cols).unwrap();
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let alone: Vec<Vec<f32>> = ws
            .iter()
            .zip(&acts)
            .map(|(w, a)| {
                let mut y = vec![0f32; n * w.rows];
                matmul_jobs(&one, vec![MatJob { w: *w, acts: a, out: &mut y }]).unwrap();
                y
            })
            .collect();
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
            let mut empty: Vec<f32> = Vec::new();
            let mut jobs: Vec<MatJob> =
                ws.iter().zip(&acts).zip(outs.iter_mut()).map(|((w, a), out)| MatJob { w: *w, acts: a, out }).collect();
            jobs.insert(2, MatJob { w: ws[1], acts: &none, out: &mut empty });
            matmul_jobs(&pool, jobs).unwrap();
            for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
                let what = format!("{} threads, {n} tokens, job {i} ({} x {} {})", threads, ws[i].rows, cols, ws[i].ty);
                assert!(got.iter().all(|v| !v.is_nan()), "{what}: an output was not written");
                assert!(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: other bits than alone");
            }
        }
    }
}

#[test]
fn bad_shapes_and_tokens_are_errors() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let w = weight(GgmlType::Q8_0, 32, 64, 1);
    let d = weight(GgmlType::Q8_0, 64, 32, 2);
    let job = |tokens| FfnJob {
        gate: WeightRef::new(GgmlType::Q8_0, 32, 64, &w).unwrap(),
        up: WeightRef::new(GgmlType::Q8_0, 32, 64, &w).unwrap(),
        down: WeightRef::new(GgmlType::Q8_0, 64, 32, &d).unwrap(),
        tokens,
    };
    let x = data(1, 2 * 64);
    assert!(ffn_jobs(&pool, &x, 64, &[job(vec![2])]).is_err());
    assert!(ffn_jobs(&pool, &x[..100], 64, &[job(vec![0])]).is_err());
    assert!(ffn_jobs(&pool, &x, 32, &[job(vec![0])]).is_err());
    assert_eq!(ffn_jobs(&pool, &x, 64, &[job(vec![1, 0])]).unwrap()[0].len(), 2 * 64);
}

/// Activations quantized to Q8_K (whichever code path runs) are byte-identical with ggml's
/// reference quantizer as tandem-quant ports it, ties and equal-magnitude extremes included.
#[test]
fn q8_k_activations_equal_the_reference_quantizer() {
    let mut x = data(3, 256 * 40);
    // A block whose largest magnitude appears first negative then positive, one all zero, one
    // with values that land on .5 after scaling (127 / 127 * k / 2), one tiny.
    x[..256].iter_mut().enumerate().for_each(|(i, v)| {
        *v = if i == 5 {
            -2.0
        } else if i == 9 {
            2.0
        } else {
            *v
        }
    });
    x[256..512].fill(0.0);
    x[512..768]
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = if i == 0 { 127.0 } else { (i % 50) as f32 * 0.5 - 12.0 });
    x[768..1024].iter_mut().for_each(|v| *v *= 1e-30);
    let acts = tandem_cpu::quantize_activations(GgmlType::Q4_K, &x, 512).unwrap();
    let mut want = vec![0u8; acts.data.len()];
    quantize_row(GgmlType::Q8_K, &x, &mut want).unwrap();
    assert_eq!(acts.data, want);
}
