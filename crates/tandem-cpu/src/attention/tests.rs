//! Unit tests of the attention: bits independent of batching, threads and row blocks, the SIMD
//! kernels against the scalar code, long caches by chunks against the textbook softmax, bad
//! shapes, and the AVX2 softmax against the AVX-512 one.

use super::flash::flash_rows;
use super::*;
use crate::kernels::Isa;
use crate::uniform;

/// Rows of random values in a cache format.
fn cache_rows(ty: KvType, x: &[f32]) -> Vec<u8> {
    match ty {
        KvType::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        KvType::F16 => x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
        KvType::BF16 => x.iter().flat_map(|v| tandem_quant::f32_to_bf16(*v).to_le_bytes()).collect(),
        KvType::Q8_0 | KvType::Q4_0 => {
            let mut out = vec![0u8; ty.bytes(x.len())];
            tandem_quant::quantize_row(ty.ggml(), x, &mut out).unwrap();
            out
        }
    }
}

/// One token of MLA's absorbed attention over an f16 latent cache of `n` rows (`dk` 576, V the
/// first 512 values of each row), as the bench model's layers have it.
fn mla_f16<'a>(q: &'a [f32], k: &'a [u8], nh: usize, n: usize, scale: f32) -> Attn<'a> {
    Attn::case(q, (nh, 1, 576, 512), k, None, KvType::F16, n, scale)
}

/// Scores and weighted values have the same bits however the rows are cut into calls (at any
/// row for scores, at whole blocks of 16 for values): a split of the rows between threads or
/// into blocks may rely on it.
#[cfg(target_arch = "x86_64")]
#[test]
fn rows_cut_into_calls_give_the_same_bits() {
    let levels: Vec<bool> = match Level::detected() {
        Level::Avx512 => vec![false, true],
        Level::Avx2 => vec![true],
        Level::Scalar => {
            println!("SKIPPED attention row blocks: this machine has no AVX2");
            return;
        }
    };
    let mut rnd = uniform(5);
    let (nh, dk, dv, n) = (16usize, 576usize, 512usize, 300usize);
    let k = cache_rows(KvType::F16, &(0..n * dk).map(|_| rnd()).collect::<Vec<_>>());
    let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
    let p: Vec<f32> = (0..nh * n).map(|_| rnd().abs() / n as f32).collect();
    let a = mla_f16(&q, &k, nh, n, 0.1);
    let (v, v_row, _) = a.v_rows();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for avx2 in levels {
        let (mut whole, mut cut) = (vec![0f32; nh * n], vec![0f32; nh * n]);
        // SAFETY: the level was detected; every row read is within the n rows of the cache.
        unsafe {
            x86::scores(&a, 0, &q, nh, 0..n, &mut whole, n, avx2);
            for (r0, r1) in [(0, 37), (37, 200), (200, n)] {
                x86::scores(&a, 0, &q, nh, r0..r1, &mut cut[r0..], n, avx2);
            }
        }
        assert_eq!(bits(&whole), bits(&cut), "scores, avx2 {avx2}");
        let (mut whole, mut cut) = (vec![0f32; nh * dv], vec![0f32; nh * dv]);
        // SAFETY: as above; the outputs hold nh rows of dv.
        unsafe {
            x86::weighted_values(v, KvType::F16, v_row, 0, dv, &p, nh, n, 0..n, &mut whole, avx2);
            for (r0, r1) in [(0, 80), (80, 96), (96, n)] {
                x86::weighted_values(v, KvType::F16, v_row, 0, dv, &p[r0..], nh, n, r0..r1, &mut cut, avx2);
            }
        }
        assert_eq!(bits(&whole), bits(&cut), "values, avx2 {avx2}");
    }
}

/// A prefill's tokens (each seeing one more row of the same cache, as a causal batch does),
/// and tokens of another sequence, give in a batch exactly the bits they give one at a time,
/// for every cache format.
#[test]
fn a_batch_of_tokens_equals_each_token_alone_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
    let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let mut rnd = uniform(11);
    // (n_head, n_head_kv, dk, dv, separate V)
    for &(nh, nkv, dk, dv, sep) in
        &[(16usize, 1usize, 576usize, 512usize, false), (12, 4, 64, 64, true), (6, 2, 48, 32, true)]
    {
        for ty in [KvType::F16, KvType::BF16, KvType::F32, KvType::Q8_0, KvType::Q4_0] {
            if !dk.is_multiple_of(ty.block()) {
                continue;
            }
            let rows = 800;
            let mut values = |n: usize| -> Vec<u8> { cache_rows(ty, &(0..n).map(|_| rnd()).collect::<Vec<f32>>()) };
            let (k, v, k2) = (values(rows * nkv * dk), values(rows * nkv * dv), values(rows * nkv * dk));
            let n_tok = 37;
            let qs: Vec<Vec<f32>> = (0..n_tok).map(|_| (0..nh * dk).map(|_| rnd()).collect()).collect();
            let items: Vec<Attn> = (0..n_tok)
                .map(|t| {
                    // The last tokens read another cache (another sequence), at depths from 100
                    // to 767 rows.
                    let (k, n_kv) = if t < 30 { (&k, 100 + 23 * t) } else { (&k2, 1 + 17 * (t - 30)) };
                    Attn::case(&qs[t], (nh, nkv, dk, dv), k, sep.then_some(&v[..]), ty, n_kv, 0.125)
                })
                .collect();
            let mut batch = vec![vec![f32::NAN; nh * dv]; n_tok];
            let mut outs: Vec<&mut [f32]> = batch.iter_mut().map(|o| &mut o[..]).collect();
            attention_many(&pool, &items, &mut outs).unwrap();
            for (t, a) in items.iter().enumerate() {
                let mut alone = vec![f32::NAN; nh * dv];
                attention(&one, a, &mut alone).unwrap();
                assert!(
                    batch[t].iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{ty:?} {nh}/{nkv}/{dk}/{dv} token {t}: batch differs from alone"
                );
                // Alone on two and three threads (its heads split over them where the work pays
                // for it).
                for (threads, p) in [(2, &pool), (3, &three)] {
                    let mut split = vec![f32::NAN; nh * dv];
                    attention(p, a, &mut split).unwrap();
                    assert!(
                        split.iter().zip(&alone).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{ty:?} {nh}/{nkv}/{dk}/{dv} token {t}: {threads} threads differ from one"
                    );
                }
            }
        }
    }
}

/// The AVX-512 kernels against the scalar code of this module, for every cache format (the
/// reference that follows ggml's order is in tandem-model's backend tests).
#[test]
fn simd_kernels_match_the_scalar_code() {
    let mut levels = Vec::new();
    for (level, isa) in [(Level::Avx512, Isa::Avx512), (Level::Avx2, Isa::Avx2)] {
        if isa.supported() {
            levels.push(level);
        } else {
            println!("SKIPPED {isa} attention kernels: this machine does not run them");
        }
    }
    let mut rnd = uniform(5);
    for &(nh, nkv, dk, dv, sep, n_kv) in &[
        (16usize, 1usize, 576usize, 512usize, false, 300usize),
        // Past FLASH_MIN rows: by chunks, the last one partial.
        (16, 1, 576, 512, false, 700),
        (8, 2, 64, 64, true, 77),
        (2, 1, 32, 32, true, 1),
        (4, 4, 128, 128, true, 1000),
    ] {
        for ty in [KvType::F16, KvType::BF16, KvType::F32, KvType::Q8_0, KvType::Q4_0] {
            let mut values = |n: usize| -> Vec<u8> { cache_rows(ty, &(0..n).map(|_| rnd()).collect::<Vec<f32>>()) };
            let (k, v) = (values(n_kv * nkv * dk), values(n_kv * nkv * dv));
            let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
            let a = Attn::case(&q, (nh, nkv, dk, dv), &k, sep.then_some(&v[..]), ty, n_kv, 0.125);
            assert!(a.check(&vec![0f32; nh * dv]));
            let qr = a.prepared_q().unwrap();
            let mut slow = vec![0f32; nh * dv];
            one_token(&a, &qr, &mut slow, Level::Scalar);
            let max = slow.iter().fold(0f32, |m, v| m.max(v.abs()));
            let mut outs = Vec::new();
            for &level in &levels {
                let mut fast = vec![0f32; nh * dv];
                one_token(&a, &qr, &mut fast, level);
                for (i, (f, s)) in fast.iter().zip(&slow).enumerate() {
                    assert!((f - s).abs() <= 1e-4 * max, "{level:?} {ty:?} {nh}/{nkv}/{dk}/{dv} [{i}]: {f} vs {s}");
                }
                outs.push(fast);
            }
            // The AVX2 kernels keep the AVX-512 kernels' lanes and orders: the same bits.
            if let [a512, a2] = &outs[..] {
                assert!(
                    a512.iter().zip(a2).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{ty:?} {nh}/{nkv}/{dk}/{dv}: AVX2 differs from AVX-512 in bits"
                );
            }
        }
    }
}

/// Past [`FLASH_MIN`] rows a token runs by chunks of [`CHUNK`] rows, and with many heads by
/// larger chunks, so that the partial sums stay within [`FLASH_PARTS`]. The bits do not depend
/// on the threads either way, and the result is the textbook softmax(q K) V.
#[test]
fn long_caches_run_by_chunks_the_same_on_any_threads() {
    let mut rnd = uniform(21);
    // (n_head, dk, dv, n_kv, rows per chunk): 16 heads of 512 values keep 32 KiB of partial
    // sums per chunk; 128 heads 256 KiB, so 2 MiB hold 8 chunks: 2100 rows in chunks of 263.
    for &(nh, dk, dv, n_kv, chunk) in &[(16usize, 64usize, 512usize, 1500usize, CHUNK), (128, 32, 512, 2100, 263)] {
        let k: Vec<f32> = (0..n_kv * dk).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..n_kv * dv).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
        let (kb, vb) = (cache_rows(KvType::F32, &k), cache_rows(KvType::F32, &v));
        let a = Attn::case(&q, (nh, 1, dk, dv), &kb, Some(&vb), KvType::F32, n_kv, 0.25);
        assert_eq!(flash_rows(&a), chunk, "{nh} heads of {dv} over {n_kv} rows");
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut out = vec![f32::NAN; nh * dv];
            attention(&pool, &a, &mut out).unwrap();
            out
        };
        let one = run(1);
        for threads in [2, 3] {
            assert!(
                run(threads).iter().zip(&one).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{nh} heads, {n_kv} rows: {threads} threads differ from one"
            );
        }
        for h in 0..nh {
            let s: Vec<f64> = (0..n_kv)
                .map(|j| 0.25 * (0..dk).map(|d| q[h * dk + d] as f64 * k[j * dk + d] as f64).sum::<f64>())
                .collect();
            let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - top).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..dv {
                let want = (0..n_kv).map(|j| e[j] * v[j * dv + d] as f64).sum::<f64>() / sum;
                let got = one[h * dv + d] as f64;
                assert!((got - want).abs() <= 1e-5, "{nh} heads, {n_kv} rows, head {h} [{d}]: {got} vs {want}");
            }
        }
    }
}

/// Heads that are not whole q8_0 blocks, and caches too short for their rows, are refused.
#[test]
fn bad_shapes_are_refused() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let q = vec![0.5f32; 2 * 48];
    let k = vec![0u8; 10 * 48 * 4]; // ten f32 rows
    let a = |ty: KvType, n_kv: usize| Attn::case(&q, (2, 1, 48, 32), &k, None, ty, n_kv, 1.0);
    let mut out = vec![0f32; 64];
    assert!(attention(&pool, &a(KvType::F16, 10), &mut out).is_ok());
    let e = attention(&pool, &a(KvType::Q8_0, 10), &mut out).unwrap_err().to_string();
    assert!(e.contains("Q8_0") && e.contains("whole blocks"), "{e}");
    assert!(attention(&pool, &a(KvType::F32, 11), &mut out).is_err());
    assert!(attention(&pool, &a(KvType::F32, 10), &mut out).is_ok());
    let mut mixed = a(KvType::F16, 10);
    mixed.v_type = KvType::BF16;
    assert!(attention(&pool, &mixed, &mut out).is_err(), "MLA's V is K's rows: one format");
}

/// The AVX2 softmax (exp, sum, scale and rounding) gives the AVX-512 one's bits, across the
/// whole range a softmax sees (down to the flush to zero below e^-133 and through the
/// subnormal results between).
#[cfg(target_arch = "x86_64")]
#[test]
fn avx2_softmax_has_the_bits_of_the_avx512_one() {
    if !(Isa::Avx512.supported() && Isa::Avx2.supported()) {
        println!("SKIPPED AVX2 vs AVX-512 softmax: this machine lacks one of them");
        return;
    }
    let xs: Vec<f32> =
        (0..50_003).map(|i| -200.0 + i as f32 * 0.004).chain([0.0, -0.0, -1e-30, -87.5, -103.9]).collect();
    for ty in [KvType::F16, KvType::BF16, KvType::F32] {
        let (mut a, mut b) = (xs.clone(), xs.clone());
        // SAFETY: both levels checked above.
        let (sa, sb) =
            unsafe { (crate::vmath::x86::exp_sub(&mut a, 0.0), crate::vmath::x86::exp_sub_avx2(&mut b, 0.0)) };
        assert_eq!(sa.to_bits(), sb.to_bits(), "sums");
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "exp");
        // SAFETY: as above.
        unsafe {
            x86::scale_round(&mut a, 0.37, ty);
            x86::scale_round_avx2(&mut b, 0.37, ty);
        }
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{ty:?} rounding");
    }
}

/// Multiply-adds per second of one token's attention at the bench model's MLA shape (16 heads
/// over an f16 latent cache of 3072 rows: 576 values of score and 512 of value per row), one
/// thread: `cargo test -p tandem-cpu --release --lib decode_attention_speed -- --ignored
/// --nocapture` (`TANDEM_CPU_ISA=avx2` for the AVX2 kernels).
#[test]
#[ignore]
fn decode_attention_speed() {
    let mut rnd = uniform(9);
    let (nh, dk, dv, n) = (16usize, 576usize, 512usize, 3072usize);
    let k = cache_rows(KvType::F16, &(0..n * dk).map(|_| rnd()).collect::<Vec<_>>());
    let q: Vec<f32> = (0..nh * dk).map(|_| rnd()).collect();
    let a = mla_f16(&q, &k, nh, n, 0.04);
    let qr = a.prepared_q().unwrap();
    let level = Level::detected();
    let mut out = vec![0f32; nh * dv];
    let reps = 40;
    let t = std::time::Instant::now();
    for _ in 0..reps {
        one_token(&a, &qr, &mut out, level);
    }
    let s = t.elapsed().as_secs_f64();
    let mac = (nh * n * (dk + dv) * reps) as f64;
    println!(
        "{level:?} decode attention {nh} heads x {n} rows: {:.1} GFMA/s, {:.2} ms per token",
        mac / s / 1e9,
        s / reps as f64 * 1e3
    );
}
