//! `tandem bench` end to end on the tiny fixtures: the table, the JSON contract that
//! scripts/compare_llama_cpp.py reads, the sweep's rows, the SVG plot, and one-line errors for bad flags.
//! No assertion depends on how fast this machine is.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem_gguf::{GgufModel, LoadOptions};

const TABLE_HEADER: &str = "|    PP |     TG |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// Runs `tandem bench -m MODEL ARGS` with a small bandwidth buffer and no progress bar.
fn bench(model: &str, args: &[&str]) -> Output {
    let m = fixture(model);
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "-m", m.to_str().unwrap(), "--bandwidth-mib", "8", "--no-progress"])
        .args(args)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> (String, String) {
    let (so, se) =
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    assert!(out.status.success(), "tandem bench failed\nstdout:\n{so}\nstderr:\n{se}");
    (so, se)
}

fn json(model: &str, args: &[&str]) -> (Value, String) {
    let (so, se) = ok(&bench(model, &[args, &["--json"]].concat()));
    let v: Value = serde_json::from_str(&so).unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}):\n{so}"));
    (v, se)
}

/// Table rows (not the header or the separator).
fn table_rows(text: &str) -> Vec<&str> {
    text.lines().filter(|l| l.starts_with('|') && !l.contains("PP |") && !l.starts_with("|--")).collect()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// Checks every row: tokens / rate = time, rates positive, roofline = active x S_TG / bandwidth.
fn check_rows(v: &Value) {
    let active = v["active_bytes_per_token"].as_u64().unwrap() as f64;
    assert!(active > 0.0);
    for r in v["rows"].as_array().unwrap() {
        let t = r["threads"].as_u64().unwrap();
        // --parallel: the rates count the tokens of every sequence
        let np = r["n_parallel"].as_u64().unwrap() as f64;
        for (n, time, rate) in [("pp", "t_pp_s", "s_pp_tps"), ("tg", "t_tg_s", "s_tg_tps")] {
            let n = r[n].as_u64().unwrap() as f64 * np;
            if n == 0.0 {
                assert!(r[time].is_null() && r[rate].is_null(), "skipped part has numbers: {r}");
                continue;
            }
            let (time, rate) = (f(&r[time]), f(&r[rate]));
            assert!(time > 0.0 && rate > 0.0, "{r}");
            assert!((time * rate - n).abs() < 1e-6 * n, "t = tokens / rate does not hold: {r}");
        }
        let bw = f(&v["read_bandwidth_gbs"][t.to_string()]);
        assert!(bw > 0.0);
        if r["tg"].as_u64().unwrap() == 0 || np > 1.0 {
            assert!(r["roofline_pct"].is_null(), "{r}");
        } else {
            let want = active * f(&r["s_tg_tps"]) / (bw * 1e9) * 100.0;
            assert!((f(&r["roofline_pct"]) - want).abs() <= 1e-9 * want.max(1.0), "{r}");
        }
    }
}

#[test]
fn table_for_two_thread_counts() {
    let (so, _) = ok(&bench("deepseek2-mla-tiny.gguf", &["-t", "1,2", "-p", "8", "-n", "4", "-r", "2", "-ub", "4"]));
    assert_eq!(so.matches(TABLE_HEADER).count(), 2, "{so}");
    assert!(so.contains("n_threads = 1,") && so.contains("n_threads = 2,"), "{so}");
    assert!(so.contains("active weights per decoded token:") && so.contains("GB/s"), "{so}");
    assert!(so.contains("CPU kernels: ") && so.contains(", weight prefetch "), "{so}");
    for t in [1, 2] {
        let line = so.lines().find(|l| l.starts_with(&format!("memory read bandwidth, -t {t}:"))).expect(&so);
        assert!(line.contains("before the runs") && line.contains("after"), "{line}");
    }
    let rows = table_rows(&so);
    assert_eq!(rows.len(), 2, "{so}");
    for r in rows {
        let cells: Vec<&str> = r.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(&cells[..3], ["8", "4", "0"], "{r}");
        assert!(cells[3..].iter().all(|c| c.parse::<f64>().unwrap() > 0.0), "{r}");
    }
}

#[test]
fn json_rows_per_thread_count_and_depth() {
    let model = "llama-tiny.gguf";
    let (v, se) = json(model, &["-t", "1,2", "-p", "8", "-n", "4", "-d", "0,6", "-r", "3", "-ub", "4"]);
    assert!(se.contains(TABLE_HEADER), "the table goes to stderr with --json:\n{se}");
    assert!(v["model"].as_str().unwrap().ends_with(model));
    assert_eq!(v["threads"], serde_json::json!([1, 2]));
    let rows = v["rows"].as_array().unwrap();
    let got: Vec<(u64, u64)> =
        rows.iter().map(|r| (r["threads"].as_u64().unwrap(), r["n_kv"].as_u64().unwrap())).collect();
    assert_eq!(got, [(1, 0), (1, 6), (2, 0), (2, 6)]);
    assert!(rows.iter().all(|r| r["pp"] == 8 && r["tg"] == 4));
    check_rows(&v);
}

#[test]
fn sweep_rows_step_by_ubatch_until_the_context_is_full() {
    // As llama-sweep-bench: each row decodes at N_KV, drops those tokens, then prefills -ub there,
    // so the last row is the one whose micro-batch fills the context (16 + 4 = 20). Decoding
    // after the prefill would need 16 + 4 + 2 positions.
    let (v, se) = json("deepseek2-mla-tiny.gguf", &["--sweep", "-c", "20", "-ub", "4", "-n", "2", "-t", "1"]);
    let n_kv: Vec<u64> = v["rows"].as_array().unwrap().iter().map(|r| r["n_kv"].as_u64().unwrap()).collect();
    assert_eq!(n_kv, [0, 4, 8, 12, 16]);
    assert!(v["rows"].as_array().unwrap().iter().all(|r| r["pp"] == 4 && r["tg"] == 2));
    assert_eq!(table_rows(&se).len(), 5, "{se}");
    check_rows(&v);
}

#[test]
fn parallel_rows_batch_the_sequences() {
    let args = ["-t", "1", "-npl", "1,3", "-p", "6", "-n", "3", "-r", "2", "-ub", "8"];
    let (v, se) = json("deepseek2-mla-tiny.gguf", &args);
    assert!(se.contains("|    B |") && se.contains("S_TG/seq"), "llama-batched-bench's table:\n{se}");
    let rows = v["rows"].as_array().unwrap();
    let np: Vec<u64> = rows.iter().map(|r| r["n_parallel"].as_u64().unwrap()).collect();
    assert_eq!(np, [1, 3]);
    assert!(rows.iter().all(|r| r["pp"] == 6 && r["tg"] == 3 && r["n_kv"] == 0), "{v}");
    check_rows(&v);
    let lines = table_rows(&se);
    assert_eq!(lines.len(), 2, "{se}");
    // S_TG/seq is the aggregate over the sequences; S is all tokens over all time
    let cells: Vec<f64> = lines[1].trim_matches('|').split('|').map(|c| c.trim().parse().unwrap()).collect();
    assert_eq!(cells[2], 3.0);
    let r = &rows[1];
    assert!((cells[7] - f(&r["s_tg_tps"]) / 3.0).abs() < 0.01, "{}", lines[1]);
    let s = 3.0 * 9.0 / (f(&r["t_pp_s"]) + f(&r["t_tg_s"]));
    assert!((cells[9] - s).abs() < 0.01, "{} vs {s}", lines[1]);
}

#[test]
fn zero_prompt_or_zero_gen_skips_that_part() {
    let (v, _) = json("llama-tiny.gguf", &["-t", "1", "-p", "0", "-n", "3", "-r", "1"]);
    let r = &v["rows"][0];
    assert!(r["t_pp_s"].is_null() && r["s_pp_tps"].is_null() && f(&r["s_tg_tps"]) > 0.0, "{r}");
    check_rows(&v);
    let (v, _) = json("llama-tiny.gguf", &["-t", "1", "-p", "5", "-n", "0", "-r", "1"]);
    let r = &v["rows"][0];
    assert!(r["t_tg_s"].is_null() && r["roofline_pct"].is_null() && f(&r["s_pp_tps"]) > 0.0, "{r}");
    check_rows(&v);
}

#[test]
fn plot_writes_an_svg_with_one_series_per_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("bench.svg");
    let args = ["-t", "1,2", "-p", "4", "-n", "2", "-d", "0,4", "-r", "1", "--plot", svg.to_str().unwrap()];
    ok(&bench("llama-tiny.gguf", &args));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.trim_start().starts_with("<svg") && text.trim_end().ends_with("</svg>"), "{text}");
    for name in ["S_PP -t 1", "S_PP -t 2", "S_TG -t 1", "S_TG -t 2"] {
        assert!(text.contains(name), "series {name} missing from the SVG");
    }
    assert!(text.contains("<polyline"), "no line drawn");
}

#[test]
fn active_bytes_count_the_used_share_of_the_experts() {
    for name in ["deepseek2-mla-tiny.gguf", "llama-tiny.gguf"] {
        let g = GgufModel::open(fixture(name), LoadOptions::default()).unwrap();
        let md = g.metadata();
        let arch = md.get_str("general.architecture").unwrap().to_string();
        let n_expert = md.opt_u32(&format!("{arch}.expert_count")).unwrap().unwrap_or(1) as u64;
        let n_used = md.opt_u32(&format!("{arch}.expert_used_count")).unwrap().unwrap_or(1) as u64;
        let tied = g.tensor("output.weight").is_none();
        let (mut dense, mut experts, mut total) = (0, 0, 0);
        for t in g.tensors() {
            let i = t.info;
            total += i.size;
            if i.name == "token_embd.weight" && !tied {
                dense += i.size / i.dims[1];
            } else if i.name.contains("_exps") {
                experts += i.size;
            } else if !i.name.contains(".nextn.") {
                dense += i.size;
            }
        }
        let active = tandem::bench::active_bytes_per_token(&g).unwrap();
        assert_eq!(active, dense + experts / n_expert * n_used, "{name}");
        assert!(active < total, "{name}: {active} of {total} bytes");
        if name.starts_with("deepseek2") {
            assert!(experts > 0 && n_used < n_expert, "{name} has no routed experts to scale");
        }
    }
}

/// Repacking, the default (`--repack` says the same): one line says what was repacked (or why
/// nothing was), the JSON says whether it was on, and the rows hold; `--no-repack` (llama.cpp's
/// `-nr`) turns it off, the last of the two flags wins, and ik_llama.cpp's `-rtr` against
/// `--no-repack` is a one-line error.
#[test]
fn repack_says_what_it_packed() {
    let short = ["-t", "2", "-p", "8", "-n", "4", "-r", "1"];
    for extra in [&[][..], &["--repack"], &["--no-repack", "--repack"], &["-rtr"]] {
        let (v, se) = json("deepseek2-mla-tiny-Q4_K_M.gguf", &[&short[..], extra].concat());
        check_rows(&v);
        let line: Vec<&str> = se.lines().filter(|l| l.contains("repack: ")).collect();
        assert_eq!(line.len(), 1, "{extra:?}: {se}");
        if tandem_cpu::packed::packing_pays() {
            assert!(line[0].contains("tensors repacked (") && line[0].contains("Q4_K"), "{extra:?}: {se}");
            assert_eq!(v["repack"], Value::Bool(true), "{extra:?}: {v}");
        } else {
            println!("SKIPPED the packed kernels: this machine runs none ({})", line[0]);
            assert!(line[0].contains("runs no packed kernel"), "{se}");
            assert_eq!(v["repack"], Value::Bool(false), "{v}");
        }
    }
    // Read into memory, the repacked matrices' read bytes are given back once packed; not when the
    // memory is locked (where this machine lets a process lock memory at all).
    for (extra, given) in [(&["--no-mmap"][..], true), (&["--no-mmap", "--mlock"], false)] {
        let out = bench("deepseek2-mla-tiny-Q4_K_M.gguf", &[&short[..], extra, &["--json"]].concat());
        let se = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() && se.contains("mlock failed") {
            println!("SKIPPED {extra:?}: this machine does not let the process lock memory ({se})");
            continue;
        }
        let (so, se) = ok(&out);
        check_rows(&serde_json::from_str(&so).unwrap());
        if tandem_cpu::packed::packing_pays() {
            let line = se.lines().find(|l| l.contains("repack: ")).unwrap_or_else(|| panic!("{se}"));
            assert_eq!(line.contains(" of them given back ("), given, "{extra:?}: {se}");
        }
    }
    for extra in [&["--no-repack"][..], &["-nr"], &["--repack", "--no-repack"]] {
        let (v, se) = json("deepseek2-mla-tiny-Q4_K_M.gguf", &[&short[..], extra].concat());
        check_rows(&v);
        assert_eq!(v["repack"], Value::Bool(false), "{extra:?}: {v}");
        assert!(!se.contains("repack"), "{extra:?}: {se}");
    }
    let out = bench("deepseek2-mla-tiny-Q4_K_M.gguf", &[&short[..], &["-rtr", "--no-repack"]].concat());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && se.contains("--no-repack") && se.contains("--run-time-repack"), "{se}");
}

/// `--repack` at lower instruction-set levels (`TANDEM_CPU_ISA`): with AVX2 the fixture's Q6_K, Q5_K,
/// Q4_K and Q5_0 matrices have packed kernels and its Q8_0 ones none, so those stay; with none,
/// nothing.
#[test]
fn repack_follows_the_instruction_set() {
    let run = |isa: &str| {
        let m = fixture("deepseek2-mla-tiny-Q4_K_M.gguf");
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench", "-m", m.to_str().unwrap(), "--bandwidth-mib", "8", "--no-progress"])
            .args(["-t", "2", "-p", "8", "-n", "2", "-r", "1", "--repack", "--json"])
            .env("TANDEM_CPU_ISA", isa)
            .output()
            .unwrap();
        let (so, se) = ok(&out);
        let v: Value = serde_json::from_str(&so).unwrap();
        check_rows(&v);
        let line = se.lines().find(|l| l.contains("repack: ")).unwrap_or_else(|| panic!("{se}")).to_string();
        (v["repack"].clone(), line)
    };
    if tandem_cpu::Isa::Avx2.supported() {
        let (on, line) = run("avx2");
        assert_eq!(on, Value::Bool(true), "{line}");
        assert!(
            line.contains("tensors repacked (Q6_K, Q4_K, Q5_0, Q5_K, Q8_0;"),
            "every type has an AVX2 kernel: {line}"
        );
    } else {
        println!("SKIPPED --repack at avx2: this machine has no AVX2");
    }
    let (on, line) = run("scalar");
    assert_eq!(on, Value::Bool(false), "{line}");
    assert!(line.contains("runs no packed kernel"), "{line}");
}

#[test]
fn bad_flags_give_one_line_errors() {
    let cases: &[(&[&str], &str)] = &[
        (&["-t", "0"], "-t 0"),
        (&["-t", "1,-2"], "-t -2"),
        (&["-p", "-1"], "-p -1"),
        (&["-n", "-5"], "-n -5"),
        (&["-r", "0"], "-r 0"),
        (&["-ub", "0"], "-ub 0"),
        (&["-p", "0", "-n", "0"], "nothing to measure"),
        (&["-p", "8", "-c", "4"], "-c 4"),
        (&["--sweep", "-ub", "4"], "--sweep needs -c"),
        (&["--sweep", "-c", "8", "-ub", "16"], "-ub 16 is larger than -c 8"),
        (&["--sweep", "-c", "8", "-ub", "4", "-n", "12"], "-n 12 decode steps do not fit in -c 8: no sweep row"),
        (&["--sweep", "-c", "64", "-p", "8"], "-p does not apply"),
        (&["-ctk", "q9_9"], "-ctk q9_9"),
        (&["--mla-cache", "lots"], "--mla-cache: 'lots' is not a size"),
        (&["--mla-cache", "2PiB"], "--mla-cache: unknown unit 'PiB'"),
        (&["--parallel", "0"], "--parallel 0"),
        (&["-npl", "2", "-d", "4"], "-d does not apply to --parallel"),
        (&["-npl", "2", "--sweep", "-c", "64"], "--parallel does not apply to --sweep"),
    ];
    for (args, want) in cases {
        let out = bench("llama-tiny.gguf", args);
        let se = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert_eq!(se.lines().filter(|l| !l.trim().is_empty()).count(), 1, "{args:?}: not one line:\n{se}");
        assert!(se.starts_with("tandem: error:") && se.contains(want), "{args:?}: {se}");
    }
    let out =
        Command::new(env!("CARGO_BIN_EXE_tandem")).args(["bench", "-m", "/nonexistent/model.gguf"]).output().unwrap();
    assert!(!out.status.success());
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(se.lines().count() == 1 && se.contains("/nonexistent/model.gguf"), "{se}");
}

/// Placement flags work as for run/serve: with no usable GPU (none here, or a build without
/// CUDA) one line says so and the bench runs on the CPU; a bad device is a one-line error.
#[test]
fn gpu_placement_falls_back_to_the_cpu_with_one_line() {
    let (v, se) = json(
        "deepseek2-mla-tiny.gguf",
        &["-t", "1", "-p", "8", "-n", "4", "-r", "1", "-ngl", "999", "-ot", "exps=CPU"],
    );
    let fallback: Vec<&str> = se.lines().filter(|l| l.contains("CUDA unavailable")).collect();
    assert_eq!(fallback.len(), 1, "one fallback line expected:\n{se}");
    assert!(fallback[0].contains("running everything on the CPU"), "{se}");
    check_rows(&v);
    let out = bench("deepseek2-mla-tiny.gguf", &["-t", "1", "-p", "8", "-n", "4", "-r", "1", "-ot", "exps=GPU7"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().filter(|l| l.starts_with("tandem: error:")).count(), 1, "{err}");
    assert!(err.contains("GPU7"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// ik_llama.cpp's and llama-bench's flags run: `-rtr` is what tandem does by default, the others are one note each.
#[test]
fn ik_llama_cpp_flags_are_taken() {
    let args =
        ["-t", "2", "-p", "8", "-n", "2", "-r", "1", "-mla", "3", "-fmoe", "1", "-amb", "512", "-fa", "1", "-rtr"];
    let (v, se) = json("deepseek2-mla-tiny-Q4_K_M.gguf", &args);
    check_rows(&v);
    let notes: Vec<&str> = se.lines().filter(|l| l.starts_with("tandem: note: ")).collect();
    assert_eq!(notes.len(), 5, "{se}");
    for flag in ["-mla 3", "-fmoe", "-amb 512", "-fa 1", "-rtr: tandem repacks"] {
        assert!(notes.iter().any(|n| n.contains(flag)), "no note for {flag}:\n{se}");
    }
    assert_eq!(v["repack"], Value::Bool(tandem_cpu::packed::packing_pays()), "{v}");
}

/// A short `tandem bench` of the tiny fixture with the environment variable `var` set to `value`.
fn short_bench_with(var: &str, value: &str) -> std::process::Output {
    let m = fixture("deepseek2-mla-tiny.gguf");
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "-m", m.to_str().unwrap(), "--bandwidth-mib", "0", "--no-progress", "-p", "4", "-n", "2"])
        .env(var, value)
        .output()
        .unwrap()
}

/// `TANDEM_CPU_ISA` caps the kernels' level (shown in the header); a name it does not know is
/// reported in one line and the machine's best level is kept.
#[test]
fn the_kernel_level_follows_tandem_cpu_isa() {
    let run = |isa: &str| short_bench_with("TANDEM_CPU_ISA", isa);
    let (so, _) = ok(&run("scalar"));
    assert!(so.contains("CPU kernels: scalar,"), "{so}");
    let (so, se) = ok(&run("avx-vnni"));
    assert!(
        se.contains("TANDEM_CPU_ISA=\"avx-vnni\" is not one of scalar, avx2, avxvnni, avx512, avx512vnni, avx512vbmi, avx512bf16; ignored"),
        "{se}"
    );
    let best = tandem_cpu::Isa::best_within(None);
    assert!(so.contains(&format!("CPU kernels: {best},")), "{so}");
}

/// `TANDEM_PREFETCH` picks the weight prefetch hint (shown with the kernels' level); a name it
/// does not know is reported in one line and the processor's default is kept.
#[test]
fn the_prefetch_hint_follows_tandem_prefetch() {
    let run = |hint: &str| short_bench_with("TANDEM_PREFETCH", hint);
    for hint in ["nta", "t0", "t1", "off"] {
        let (so, _) = ok(&run(hint));
        assert!(so.contains(&format!(", weight prefetch {hint} (")), "{hint}: {so}");
    }
    let (so, se) = ok(&run("t7"));
    assert!(se.contains("TANDEM_PREFETCH=\"t7\" is not one of nta, t0, t1, off; ignored"), "{se}");
    // The defaults: t1 (Intel), nta (AMD), nta with t1 for the packed Q8_0 kernel (AMD Zen 4).
    let defaults = ["t1 (", "nta (", "nta, t1 for packed Q8_0 ("];
    assert!(defaults.iter().any(|d| so.contains(&format!(", weight prefetch {d}"))), "{so}");
}

/// `--read-ahead`: on, each layer's chosen experts and the next layer's weights are asked for
/// ahead (said once on stderr) and the logits are the same bytes as without; auto leaves it off
/// for a model that fits in memory; the rows count the page faults that waited for storage.
#[test]
fn read_ahead_changes_no_result_and_faults_are_counted() {
    let short = ["-t", "2", "-p", "8", "-n", "4", "-r", "1", "--no-repack"];
    let (v, se) = json("deepseek2-mla-tiny-Q4_K_M.gguf", &[&short[..], &["--read-ahead", "on"]].concat());
    check_rows(&v);
    assert_eq!(se.matches("read-ahead: --read-ahead on;").count(), 1, "{se}");
    for r in v["rows"].as_array().unwrap() {
        assert!(f(&r["major_faults_per_pp_token"]) >= 0.0 && f(&r["major_faults_per_tg_token"]) >= 0.0, "{r}");
    }
    let (_, se) = json("deepseek2-mla-tiny-Q4_K_M.gguf", &short);
    assert!(!se.contains("read-ahead"), "the fixture fits in memory: {se}");
    let out = bench("deepseek2-mla-tiny-Q4_K_M.gguf", &["--read-ahead", "sometimes"]);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && se.contains("--read-ahead") && se.lines().count() == 1, "{se}");

    let dir = std::env::temp_dir().join(format!("tandem-read-ahead-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let m = fixture("deepseek2-mla-tiny-Q4_K_M.gguf");
    let logits = |mode: &str| {
        let out_file = dir.join(format!("{mode}.f32"));
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["logits", "-m", m.to_str().unwrap(), "--tokens", "1,5,9,300,7,7,2", "-t", "2", "--read-ahead", mode])
            .arg("--out")
            .arg(&out_file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::read(&out_file).unwrap()
    };
    let (on, off) = (logits("on"), logits("off"));
    assert!(!on.is_empty());
    assert!(on == off, "--read-ahead on changed the logits");
    std::fs::remove_dir_all(&dir).unwrap();
}
