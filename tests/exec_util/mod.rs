//! What tests/executor.rs (the stand-in and the emulated CUDA device) and tests/gpu.rs (a real
//! GPU) check of the executor: shared fixtures and placements, and the checks, each taking a
//! maker of the executor under test.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tandem_gguf::{GgufModel, LoadOptions};
use tandem_model::{Batch, CacheType, Context, ContextParams, Counts, Exec, MlaMode, Model};
use tandem_plan::{Device, GpuBudget, GpuLayers, ModelInfo, PlanRequest, Rule};

/// Makes the executor under test for a model and the tensor names its second device holds.
pub type Maker = dyn Fn(&GgufModel, &[String]) -> Exec;

/// The repository (for fixtures): `TANDEM_REPO` when the test binary runs away from its build tree
/// (scripts/gpu-check.sh on a GPU machine), else the one it was built in.
pub fn repo() -> PathBuf {
    std::env::var_os("TANDEM_REPO").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// The `tandem` binary: `TANDEM_BIN` (scripts/gpu-check.sh), else the one cargo built with the test.
pub fn tandem_bin() -> PathBuf {
    std::env::var_os("TANDEM_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tandem")), PathBuf::from)
}

/// `tandem logits` on an MoE fixture with `-ngl 999 -ot exps=CPU` and `-ngl 999`, with `env` set:
/// the device is used (its upload line, no fallback) and the logits meet the CPU's (the same
/// command without GPU flags) within [`within_tolerance`].
pub fn binary_uses_the_device(env: &[(&str, &str)]) {
    let dir = tempfile::tempdir().unwrap();
    let m = repo().join("tests/fixtures/models/deepseek2-mla-tiny-Q4_K_M.gguf");
    let m = m.to_str().unwrap();
    let tokens = "1,17,42,99,100,200,300,301,302,7,8,9";
    let run = |flags: &[&str], out: &str| {
        let mut args = vec!["logits", "-m", m, "--tokens", tokens, "--out", out, "-c", "64", "--token-by-token"];
        args.extend(flags);
        let o = std::process::Command::new(tandem_bin()).args(&args).envs(env.iter().copied()).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(o.status.success(), "{flags:?}: {err}");
        let bytes = std::fs::read(out).unwrap();
        (bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect::<Vec<f32>>(), err)
    };
    let cpu_out = dir.path().join("cpu.f32");
    let (want, _) = run(&[], cpu_out.to_str().unwrap());
    for flags in [&["-ngl", "999", "-ot", "exps=CPU"][..], &["-ngl", "999"]] {
        let out = dir.path().join("gpu.f32");
        let (got, err) = run(flags, out.to_str().unwrap());
        assert!(!err.contains("CUDA unavailable"), "{flags:?} fell back: {err}");
        assert!(err.lines().any(|l| l.starts_with("tandem: CUDA: CUDA0")), "{flags:?}: no upload line: {err}");
        match within_tolerance(&got, &want, 512) {
            Ok(d) => println!("tandem logits {flags:?}: {d}"),
            Err(d) => panic!("tandem logits {flags:?}: {d}"),
        }
    }
}

/// `tandem bench --json -ngl 999 -ot exps=CPU` on an MoE fixture with `env` set: each decoded
/// token's row says what the device did (two copies each way per MoE layer plus the step's own:
/// see [`decode_step_crossings`]) and how long the CPU was busy.
pub fn bench_reports_the_device(env: &[(&str, &str)]) {
    let path = repo().join("tests/fixtures/models/deepseek2-mla-tiny-Q4_K_M.gguf");
    let (gguf, _) = open(&path);
    let n_moe = dims(&gguf).4 as f64;
    let args = ["bench", "-m", path.to_str().unwrap(), "-p", "8", "-n", "4", "-r", "2", "-t", "2"];
    let o = std::process::Command::new(tandem_bin())
        .args(args)
        .args(["--no-progress", "--bandwidth-mib", "0", "--json", "-ngl", "999", "-ot", "exps=CPU"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "tandem bench: {err}");
    assert!(!err.contains("CUDA unavailable"), "fell back: {err}");
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = &json["rows"][0];
    let gpu = &row["gpu"]["CUDA0"];
    println!("bench row: {row}");
    let per = |k: &str| gpu[k].as_f64().unwrap_or_else(|| panic!("no {k} in {gpu}"));
    // Per token: up, the step (hidden state, rope, addressing) and each MoE layer's expert sum;
    // down, each MoE layer's packet and the logits; a wait for each download.
    assert_eq!((per("h2d"), per("d2h"), per("syncs")), (1.0 + n_moe, n_moe + 1.0, n_moe + 1.0), "{gpu}");
    assert!(per("launches") > 10.0, "{gpu}");
    let busy = row["cpu_busy_s_per_token"].as_f64().unwrap();
    let per_token = row["t_tg_s"].as_f64().unwrap() / 4.0;
    assert!(busy > 0.0 && busy < per_token, "CPU busy {busy} s of {per_token} s per token");
}

/// Every deepseek2 and llama fixture (inference and model fixtures, the first shard of the split one).
pub fn fixtures() -> Vec<PathBuf> {
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

pub fn open(path: &Path) -> (Arc<GgufModel>, Arc<Model>) {
    let gguf = Arc::new(GgufModel::open(path, LoadOptions::default()).unwrap());
    (gguf.clone(), Arc::new(Model::load(gguf).unwrap()))
}

/// The tensors the planner puts on CUDA0 for `-ngl 999` and the `-ot` rules given (a 1 TiB GPU).
pub fn on_gpu(gguf: &GgufModel, path: &Path, ot: &[&str]) -> Vec<String> {
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

/// The rule tests/logits.rs holds differently rounded arithmetic to (`mla_forms_match_llama_cpp`):
/// the median position within 2e-2 of max|logit|, the argmax equal wherever the reference's top-2
/// margin exceeds 4e-2 and at >= 85% of all positions. (The GPU's products round activations as
/// the CPU does and meet the CPU to 1e-7 on the quantized files; float-order differences of 1e-7
/// flip an f16 cache value by one step now and then, and these random tiny models amplify that
/// through expert choices.) Returns a description, or the failure.
pub fn within_tolerance(got: &[f32], want: &[f32], n_vocab: usize) -> Result<String, String> {
    let tol = 2e-2f32;
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let mut errs = Vec::new();
    let (mut agree, mut clear, mut clear_agree) = (0, 0, 0);
    for (g, w) in got.chunks_exact(n_vocab).zip(want.chunks_exact(n_vocab)) {
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e =
            g.iter()
                .zip(w)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) })
                / scale;
        errs.push(e);
        let same = argmax(g) == argmax(w);
        agree += same as usize;
        let mut s = w.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        if (s[0] - s[1]) / scale > 2.0 * tol {
            clear += 1;
            clear_agree += same as usize;
        }
    }
    let worst = errs.iter().copied().fold(0f32, f32::max);
    errs.sort_by(f32::total_cmp);
    let median = errs[errs.len() / 2];
    let share = agree as f32 / errs.len() as f32;
    let desc =
        format!("worst {worst:.2e}, median {median:.2e}, argmax {:.1}% ({clear_agree}/{clear} clear)", share * 100.0);
    if median <= tol && clear_agree == clear && share >= 0.85 && worst.is_finite() {
        Ok(desc)
    } else {
        Err(desc)
    }
}

pub fn params(mla: MlaMode, ubatch: usize) -> ContextParams {
    ContextParams { n_ctx: 256, n_ubatch: ubatch, mla, ..ContextParams::default() }
}

pub fn threads() -> tandem_cpu::Threads {
    tandem_cpu::Threads::new(2, 2).unwrap()
}

/// Two sequences' prompts in one batch, interleaved, then one decode step for each: all logits.
pub fn two_sequences(ctx: &mut Context, n_vocab: usize) -> Vec<f32> {
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
    let step = Batch {
        tokens: vec![1, 2],
        pos: vec![a.len() as u32, b.len() as u32],
        seq: vec![0, 5],
        logits: vec![true, true],
    };
    out.extend(ctx.decode(&step).unwrap());
    out
}

/// The hybrid and all-GPU placements against the CPU alone on every fixture, with the MLA forms
/// and two sequences per micro-batch of 8 (the products as matvecs): within the tolerance
/// [`within_tolerance`] explains.
pub fn cuda_logits_match_the_cpu(make: &Maker) {
    let mut failures = Vec::new();
    for path in fixtures() {
        let (gguf, model) = open(&path);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // Auto on one file: on CUDA it attends absorbed, but through the per-sequence runs (the
        // tokens' cache addressing regathered on the device).
        let modes: &[MlaMode] = match name.as_str() {
            "deepseek2-mla-q4_k_m.gguf" => &[MlaMode::Absorbed, MlaMode::Auto],
            _ => &[MlaMode::Absorbed],
        };
        for &mla in modes {
            // Micro-batches of 8: the products run as matvecs (beyond 8 tokens, as an f16 gemm).
            let want = two_sequences(
                &mut Context::new(model.clone(), Exec::cpu(threads()), params(mla, 8)).unwrap(),
                model.n_vocab(),
            );
            for ot in [&["exps=CPU"][..], &[]] {
                let exec = make(&gguf, &on_gpu(&gguf, &path, ot));
                let desc = exec.describe().to_string();
                let mut ctx = Context::new(model.clone(), exec, params(mla, 8)).unwrap();
                let got = two_sequences(&mut ctx, model.n_vocab());
                match within_tolerance(&got, &want, model.n_vocab()) {
                    Ok(d) => println!("{name} {mla:?} -ot {ot:?}: {d} ({desc})"),
                    Err(d) => {
                        println!("{name} {mla:?} -ot {ot:?}: FAIL {d} ({desc})");
                        failures.push(format!("{name} {mla:?} {ot:?}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "beyond tolerance: {failures:?}");
}

/// A whole prompt as one micro-batch (the prefill path: products of more than 8 tokens as f16
/// gemms on inputs scaled into f16's range, attention of every token in one launch), hybrid,
/// against llama.cpp's own logits for every inference fixture, by the rule tests/logits.rs holds
/// differently rounded arithmetic to: the median position within 1.5x of the distance between
/// llama.cpp and its own flash-attention run (at least 2e-2), the argmax equal at >= 85% of
/// positions. The device's cache holds f16 where the fixture's is f32.
pub fn cuda_prefill_matches_llama_cpp(make: &Maker) {
    let dir = repo().join("tests/fixtures/inference");
    let mut failures = Vec::new();
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let j: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        let Some(tokens) = j["tokens"].as_array() else { continue };
        let tokens: Vec<u32> = tokens.iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let model_path = dir.join(j["model"].as_str().unwrap());
        let reference: Vec<f32> = std::fs::read(dir.join(j["logits_file"].as_str().unwrap()))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let fa = j["other_numerics"]["flash_attn"]["median_rel_err"].as_f64().unwrap_or(0.0) as f32;
        let cache = |k: &str| match j[k].as_str().unwrap() {
            "f32" => CacheType::F16,
            other => CacheType::from_name(other).unwrap(),
        };
        let (gguf, model) = open(&model_path);
        let exec = make(&gguf, &on_gpu(&gguf, &model_path, &["exps=CPU"]));
        let params = ContextParams {
            n_ctx: 512,
            n_ubatch: 512,
            cache_type_k: cache("cache_type_k"),
            cache_type_v: cache("cache_type_v"),
            mla: MlaMode::Absorbed,
            ..ContextParams::default()
        };
        let Ok(mut ctx) = Context::new(model.clone(), exec, params) else {
            println!("{}: skipped, its cache types are not the device's", model_path.display());
            continue;
        };
        let got = ctx.decode(&Batch::sequence(&tokens, 0, 0, true)).unwrap();
        let nv = model.n_vocab();
        let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        let mut errs = Vec::new();
        let mut agree = 0;
        for (g, w) in got.chunks_exact(nv).zip(reference.chunks_exact(nv)) {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            errs.push(g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale);
            agree += (argmax(g) == argmax(w)) as usize;
        }
        errs.sort_by(f32::total_cmp);
        let median = errs[errs.len() / 2];
        let share = agree as f32 / errs.len() as f32;
        let ok = median <= 1.5 * fa.max(2e-2) && share >= 0.85 && errs.iter().all(|e| e.is_finite());
        println!(
            "{}: median {median:.2e} (llama.cpp's flash attention: {fa:.2e}), argmax {:.1}%{}",
            j["model"].as_str().unwrap(),
            share * 100.0,
            if ok { "" } else { " FAIL" }
        );
        if !ok {
            failures.push(j["model"].as_str().unwrap().to_string());
        }
        n += 1;
    }
    assert!(n >= 10, "expected the inference fixtures, found {n}");
    assert!(failures.is_empty(), "beyond tolerance: {failures:?}");
}

/// `(n_embd, n_rot, n_used, n_vocab, MoE layers)` of a deepseek2 fixture.
pub fn dims(gguf: &GgufModel) -> (u64, u64, u64, u64, u64) {
    let md = gguf.metadata();
    let u = |k: &str| md.get_u32(&format!("deepseek2.{k}")).unwrap() as u64;
    let n_vocab = gguf.tensor("token_embd.weight").unwrap().info.dims[1];
    (
        u("embedding_length"),
        u("rope.dimension_count"),
        u("expert_used_count"),
        n_vocab,
        u("block_count") - u("leading_dense_block_count"),
    )
}

/// The second device's counts for one call of `ctx.decode(batch)`.
pub fn step(ctx: &mut Context, batch: &Batch) -> Counts {
    let before = ctx.exec().ledgers()[1].1;
    ctx.decode(batch).unwrap();
    ctx.exec().ledgers()[1].1 - before
}

/// Under `-ngl 999 -ot exps=CPU` a decode step crosses once in (hidden state, rope rows, cache
/// addressing), once down (the normalized hidden state with the expert ids and weights) and once
/// up (the experts' sum) per MoE layer, once out (the logits); the host waits once per MoE layer
/// and once for the logits. The bytes are exactly those activations: no cache row moves, at
/// depth 0 or 40, for one sequence or two in the step.
pub fn decode_step_crossings(makers: &[(&str, &Maker)]) {
    for file in [
        "inference/deepseek2-mla-q4_k_m.gguf",
        "inference/deepseek2-mla-f16.gguf",
        "inference/deepseek2-legacy-f32.gguf",
    ] {
        let path = repo().join("tests/fixtures").join(file);
        let (gguf, model) = open(&path);
        let (n_embd, n_rot, n_used, n_vocab, n_moe) = dims(&gguf);
        let names = on_gpu(&gguf, &path, &["exps=CPU"]);
        assert!(names.iter().all(|n| !n.contains("_exps")) && names.iter().any(|n| n.contains("ffn_gate_inp")));
        for &(how, make) in makers {
            let exec = make(&gguf, &names);
            let mut ctx = Context::new(model.clone(), exec, params(MlaMode::Absorbed, 512)).unwrap();
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
                    busy_ns: c.busy_ns,
                };
                assert_eq!(c, want, "{file} {how}: a decode step of {n} token(s)");
                assert!(c.copies() <= 2 * n_moe + 2 && c.syncs <= n_moe + 1);
                println!("{file} {how}: {n} token(s): {c:?}");
            }
        }
    }
}

/// `tandem bench --zero-depth`'s cache rows: none (depth 0), then 24 zero rows in every layer,
/// then a prompt on top, on the CPU alone and hybrid (`exps=CPU`): the same logits within
/// [`within_tolerance`], and the sequence as long on both.
pub fn zero_rows_read_alike(make: &Maker) {
    for file in ["inference/deepseek2-mla-q4_k_m.gguf", "inference/deepseek2-legacy-f32.gguf"] {
        let path = repo().join("tests/fixtures").join(file);
        let (gguf, model) = open(&path);
        let names = on_gpu(&gguf, &path, &["exps=CPU"]);
        let run = |exec: Exec| {
            let mut ctx = Context::new(model.clone(), exec, params(MlaMode::Absorbed, 8)).unwrap();
            ctx.append_zero_rows(0, 0).unwrap();
            ctx.append_zero_rows(0, 24).unwrap();
            let out = ctx.decode(&Batch::sequence(&[5, 6, 7], 24, 0, true)).unwrap();
            (out, ctx.seq_len(0))
        };
        let (want, want_len) = run(Exec::cpu(threads()));
        let (got, got_len) = run(make(&gguf, &names));
        assert_eq!((got_len, want_len), (27, 27), "{file}");
        match within_tolerance(&got, &want, model.n_vocab()) {
            Ok(d) => println!("{file}: zero rows: {d}"),
            Err(d) => panic!("{file}: zero rows: {d}"),
        }
    }
}
