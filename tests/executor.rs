//! The executor with two devices, on a machine without a GPU: the CPU and a host-memory device
//! standing in for CUDA0 (its own memory, its copies and the host's waits for it counted), in the
//! placement the planner makes for `-ngl 999 -ot exps=CPU` and for `-ngl 999`. Its logits must be
//! the CPU's alone, bit for bit (both run the CPU's arithmetic; only where the tensors live
//! differs), and a decode step must cross between the two exactly where DESIGN.md says: the
//! hidden state in, once down and once up per MoE layer, the logits out, no cache row moved.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Batch, CacheType, Context, ContextParams, Counts, Exec, MlaMode, Model};
use tandem_plan::{Device, GpuBudget, GpuLayers, ModelInfo, PlanRequest, Rule};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every deepseek2 and llama fixture (inference and model fixtures, the first shard of the split one).
fn fixtures() -> Vec<PathBuf> {
    let mut v = Vec::new();
    for dir in ["tests/fixtures/inference", "tests/fixtures/models"] {
        for e in std::fs::read_dir(repo().join(dir)).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if p.extension().is_some_and(|e| e == "gguf") && (!name.contains("-of-") || name.contains("00001-of-")) {
                v.push(p);
            }
        }
    }
    v.sort();
    assert!(v.len() >= 14, "expected the fixtures, found {v:?}");
    v
}

fn open(path: &Path) -> (Arc<GgufModel>, Arc<Model>) {
    let gguf = Arc::new(GgufModel::open(path, LoadOptions::default()).unwrap());
    (gguf.clone(), Arc::new(Model::load(gguf).unwrap()))
}

/// The tensors the planner puts on CUDA0 for `-ngl 999` and the `-ot` rules given (a 1 TiB GPU).
fn on_gpu(gguf: &GgufModel, path: &Path, ot: &[&str]) -> Vec<String> {
    let info = ModelInfo::from_gguf(gguf, &path.display().to_string()).unwrap();
    let req = PlanRequest {
        gpus: vec![GpuBudget { device: Device::Cuda(0), bytes: 1 << 40 }],
        rules: Rule::parse_overrides(ot).unwrap(),
        n_gpu_layers: Some(GpuLayers::All),
        ..PlanRequest::default()
    };
    let plan = tandem_plan::plan(&info, &req).unwrap();
    plan.tensors.into_iter().filter(|t| t.device == Device::Cuda(0)).map(|t| t.name).collect()
}

fn params(mla: MlaMode, ubatch: usize) -> ContextParams {
    ContextParams {
        n_ctx: 256,
        n_ubatch: ubatch,
        cache_type_k: CacheType::F16,
        cache_type_v: CacheType::F16,
        mla,
    }
}

fn threads() -> tandem_cpu::Threads {
    tandem_cpu::Threads::new(2, 2).unwrap()
}

/// Two sequences' prompts in one batch, interleaved, then one decode step for each: all logits.
fn two_sequences(ctx: &mut Context, n_vocab: usize) -> Vec<f32> {
    let a: Vec<u32> = (0..23).map(|i| (7 + 31 * i) % n_vocab as u32).collect();
    let b: Vec<u32> = (0..17).map(|i| (3 + 11 * i) % n_vocab as u32).collect();
    let mut batch = Batch::default();
    let (mut ia, mut ib) = (0, 0);
    while ia < a.len() || ib < b.len() {
        for (seq, toks, i) in [(0usize, &a, &mut ia), (5, &b, &mut ib)] {
            for _ in 0..2 {
                if *i < toks.len() {
                    batch.tokens.push(toks[*i]);
                    batch.pos.push(*i as u32);
                    batch.seq.push(seq);
                    batch.logits.push(true);
                    *i += 1;
                }
            }
        }
    }
    let mut out = ctx.decode(&batch).unwrap();
    let step = Batch { tokens: vec![1, 2], pos: vec![a.len() as u32, b.len() as u32], seq: vec![0, 5], logits: vec![true, true] };
    out.extend(ctx.decode(&step).unwrap());
    out
}

/// Hybrid and all-on-the-stand-in placements against the CPU alone, on every fixture, with the
/// MLA forms (absorbed, decompressed where it pays, always decompressed), several sequences per
/// micro-batch and micro-batches that cut through a sequence: the same bits.
#[test]
fn stand_in_logits_equal_the_cpu_path_on_every_fixture() {
    let mut checked = Vec::new();
    for path in fixtures() {
        let (gguf, model) = open(&path);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let mla_files = gguf.tensor_index("blk.0.attn_k_b.weight").is_some();
        let modes: &[MlaMode] = if mla_files { &[MlaMode::Absorbed, MlaMode::Auto, MlaMode::Decompressed] } else { &[MlaMode::Absorbed] };
        let cpu = |mla| two_sequences(&mut Context::new(model.clone(), Exec::cpu(threads()), params(mla, 9)).unwrap(), model.n_vocab());
        for &mla in modes {
            let want = cpu(mla);
            for ot in [&["exps=CPU"][..], &[]] {
                let names = on_gpu(&gguf, &path, ot);
                assert!(!names.is_empty(), "{name}: nothing planned on CUDA0");
                // The decompressed form runs where the cache and both attn_k_b and attn_v_b are;
                // a type without a CUDA kernel keeps some of them on the CPU, and then the layer
                // attends absorbed, as the CPU does under the absorbed form.
                let on = |t: &str| names.iter().any(|n| n == &format!("blk.0.{t}.weight"));
                let split = mla_files && (on("attn_kv_a_mqa") != on("attn_k_b") || on("attn_kv_a_mqa") != on("attn_v_b"));
                let want = if split && mla != MlaMode::Absorbed { cpu(MlaMode::Absorbed) } else { want.clone() };
                let exec = Exec::with_stand_in(threads(), names);
                let mut ctx = Context::new(model.clone(), exec, params(mla, 9)).unwrap();
                let got = two_sequences(&mut ctx, model.n_vocab());
                assert_eq!(got.len(), want.len());
                let same = got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
                let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
                assert!(same, "{name} {mla:?} -ot {ot:?}: stand-in logits differ from the CPU's (worst {worst:e})");
                let moved: u64 = ctx.exec().ledgers().iter().map(|(_, c)| c.copies()).sum();
                assert!(moved > 0, "{name} {ot:?}: nothing crossed to the stand-in");
            }
        }
        checked.push(name);
    }
    println!("stand-in = CPU bit for bit: {}", checked.join(", "));
}

/// `(n_embd, n_rot, n_used, n_vocab, MoE layers)` of a deepseek2 fixture.
fn dims(gguf: &GgufModel) -> (u64, u64, u64, u64, u64) {
    let md = gguf.metadata();
    let u = |k: &str| md.get_u32(&format!("deepseek2.{k}")).unwrap() as u64;
    let n_vocab = gguf.tensor("token_embd.weight").unwrap().info.dims[1];
    (u("embedding_length"), u("rope.dimension_count"), u("expert_used_count"), n_vocab, u("block_count") - u("leading_dense_block_count"))
}

/// The stand-in's counts for one call of `ctx.decode(batch)`.
fn step(ctx: &mut Context, batch: &Batch) -> Counts {
    let before = ctx.exec().ledgers()[1].1;
    ctx.decode(batch).unwrap();
    ctx.exec().ledgers()[1].1 - before
}

/// Under `-ngl 999 -ot exps=CPU` a decode step crosses once in (hidden state, rope rows, cache
/// addressing), once down (the normalized hidden state with the expert ids and weights) and once
/// up (the experts' sum) per MoE layer, once out (the logits); the host waits once per MoE layer
/// and once for the logits. The bytes are exactly those activations: no cache row moves, at
/// depth 0 or 40, for one sequence or two in the step.
#[test]
fn a_decode_step_crosses_twice_per_moe_layer() {
    for file in ["inference/deepseek2-mla-q4_k_m.gguf", "inference/deepseek2-mla-f16.gguf", "inference/deepseek2-legacy-f32.gguf"] {
        let path = repo().join("tests/fixtures").join(file);
        let (gguf, model) = open(&path);
        let (n_embd, n_rot, n_used, n_vocab, n_moe) = dims(&gguf);
        let names = on_gpu(&gguf, &path, &["exps=CPU"]);
        assert!(names.iter().all(|n| !n.contains("_exps")) && names.iter().any(|n| n.contains("ffn_gate_inp")));
        let mut ctx = Context::new(model.clone(), Exec::with_stand_in(threads(), names), params(MlaMode::Absorbed, 512)).unwrap();
        let prompt: Vec<u32> = (0..40).map(|i| (5 + 13 * i) % n_vocab as u32).collect();
        ctx.decode(&Batch::sequence(&prompt, 0, 0, false)).unwrap();
        ctx.decode(&Batch::sequence(&prompt[..3], 0, 1, false)).unwrap();
        for (n, batch) in [
            (1u64, Batch::sequence(&[9], 0, 2, true)),
            (1, Batch::sequence(&[9], 40, 0, true)),
            (2, Batch { tokens: vec![4, 5], pos: vec![41, 3], seq: vec![0, 1], logits: vec![true, true] }),
        ] {
            let c = step(&mut ctx, &batch);
            let want = Counts {
                launches: c.launches,
                h2d: 1 + n_moe,
                h2d_bytes: n * (4 * (n_embd + n_rot) + 16) + n_moe * n * 4 * n_embd,
                d2h: n_moe + 1,
                d2h_bytes: n_moe * n * 4 * (n_embd + 2 * n_used) + n * 4 * n_vocab,
                syncs: n_moe + 1,
            };
            assert_eq!(c, want, "{file}: a decode step of {n} token(s)");
            assert!(c.copies() <= 2 * n_moe + 2 && c.syncs <= n_moe + 1);
            println!("{file}: {n} token(s): {c:?}");
        }
    }
}
