//! `tandem plan` end to end: seed command lines from llama.cpp / ik_llama.cpp deployments parse,
//! accepted-but-unneeded flags print one note each, unknown flags and bad rules fail with one
//! line, and the Kimi-K2.5-shaped replica plans as the placement issue asks.

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tandem::cli::normalize_args;
use tandem::plan::PlanArgs;
use tandem_plan::quant_mix::Ftype;

const FIXTURE: &str = "tests/fixtures/models/deepseek2-mla-tiny-Q4_K_M.gguf";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE)
}

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem")).args(args).output().expect("running tandem")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `args` as `tandem plan` parses them (after llama.cpp's multi-letter flags are rewritten).
#[derive(Parser)]
struct PlanCli {
    #[command(flatten)]
    plan: PlanArgs,
}

fn parse(line: &str) -> Result<PlanArgs, clap::Error> {
    let words = std::iter::once("plan").chain(line.split_whitespace()).map(Into::into);
    PlanCli::try_parse_from(normalize_args(words)).map(|c| c.plan)
}

/// Command lines as seed deployments run llama-server / ik_llama.cpp (binary name changed).
const SEED_LINES: &[&str] = &[
    "-m X --no-mmap -mla 3 -amb 512 -b 4096 -ub 4096 -ctk f16 -ctv f16 -c 131072 -ngl 999 -ot exps=CPU --threads 13 --threads-batch 26 -n 128",
    r"-m X -ngl 999 -ot \.ffn_.*_exps\.=CPU --threads 12 --cache-type-k q8_0 --cache-type-v q8_0",
    "-m X -c 65536 -np 4 -ngl 99 --n-cpu-moe 20 -fa on --jinja --host 0.0.0.0 --port 8080 -a kimi",
    "-m X -fa -fmoe -rtr -ser 7,1 -mla 2 -amb 1024 --merge-qkv --warmup-batch --cont-batching -ngl 999 -cmoe -t 32",
    "-m X -ngl 999 -ot blk\\.(1|2|3)\\.ffn_.*=CUDA0,exps=CPU -ot output=CUDA0 --mlock -ctk q8_0 -ub 2048 -b 2048",
    "-m X -ngl all -ncmoe 30 -nkvo -dev CUDA0 -sm layer -ts 1,1 -mg 0 --temp 0.6 --min-p 0.01 --seed 42",
    "-m X --gpu CUDA0=96GiB --gpu CUDA1=48GiB --fit -fitt 2048 --host-memory 768GiB -c 0",
];

#[test]
fn seed_command_lines_parse() {
    for line in SEED_LINES {
        let a = parse(line).unwrap_or_else(|e| panic!("{line}\n{e}"));
        assert_eq!(a.model.path(), PathBuf::from("X"));
    }
    let a = parse(SEED_LINES[0]).unwrap();
    assert_eq!(
        (a.engine.runtime.ctx_size, a.engine.runtime.ubatch_size, a.engine.runtime.batch_size),
        (131072, 4096, 4096)
    );
    assert_eq!((a.engine.runtime.threads, a.engine.runtime.threads_batch), (Some(13), Some(26)));
    assert_eq!(a.engine.placement.override_tensor, ["exps=CPU"]);
    assert_eq!(a.engine.placement.n_gpu_layers, Some(tandem_plan::GpuLayers::Count(999)));
    assert!(a.model.load.no_mmap);
    assert_eq!(a.engine.compat.mla_use, Some(3));
    assert_eq!(a.serving.n_predict, Some(128));
    let a = parse(SEED_LINES[1]).unwrap();
    assert_eq!(a.engine.placement.override_tensor, [r"\.ffn_.*_exps\.=CPU"]);
    assert_eq!(a.engine.runtime.cache_type_v, "q8_0");
    let a = parse(SEED_LINES[6]).unwrap();
    assert_eq!(a.engine.placement.fit.as_deref(), Some("on"));
    assert_eq!(a.engine.placement.gpu, ["CUDA0=96GiB", "CUDA1=48GiB"]);
    assert_eq!(parse("-m X --fit off").unwrap().engine.placement.fit.as_deref(), Some("off"));
}

#[test]
fn unknown_flags_are_errors() {
    for line in ["-m X --bogus", "-m X -ngl many", "-m X --fit maybe", "-m X -xyz 3"] {
        assert!(parse(line).is_err(), "{line} should not parse");
    }
    let o = tandem(&["plan", "-m", FIXTURE, "--no-such-flag"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("unexpected argument '--no-such-flag'"), "{}", stderr(&o));
}

#[test]
fn seed_lines_run_on_a_fixture_with_one_note_per_ignored_flag() {
    let model = fixture();
    for line in SEED_LINES {
        let mut args = vec!["plan".to_string()];
        args.extend(
            line.split_whitespace().map(|w| if w == "X" { model.display().to_string() } else { w.to_string() }),
        );
        if !line.contains("--gpu") {
            args.extend(["--gpu".into(), "CUDA0=24GiB".into()]);
        }
        let o = Command::new(env!("CARGO_BIN_EXE_tandem")).args(&args).output().unwrap();
        assert!(o.status.success(), "{line}\n{}", stderr(&o));
    }
    let o = tandem(&[
        "plan",
        "-m",
        FIXTURE,
        "--merge-qkv",
        "--jinja",
        "--cont-batching",
        "--warmup-batch",
        "-mla",
        "3",
        "-amb",
        "512",
    ]);
    let notes: Vec<String> = stderr(&o).lines().map(str::to_string).collect();
    assert_eq!(notes.len(), 6, "{notes:#?}");
    assert!(notes.iter().all(|n| n.starts_with("tandem: note: ") && n.contains("ignored; ")));
    assert!(notes.iter().any(|n| n.starts_with("tandem: note: -mla 3: ignored; tandem's MLA form is set with --mla")));
}

#[test]
fn bad_rules_fail_with_one_line_naming_them() {
    let o = tandem(&["plan", "-m", FIXTURE, "-ot", "exps(=CPU"]);
    assert_eq!(
        stderr(&o),
        "tandem: error: --override-tensor 'exps(=CPU': invalid regex 'exps(' at position 4: unclosed group\n"
    );
    let o = tandem(&["plan", "-m", FIXTURE, "-ot", "exps=CUDA1", "--gpu", "CUDA0=8GiB"]);
    assert_eq!(
        stderr(&o),
        "tandem: error: --override-tensor 'exps=CUDA1': unknown device 'CUDA1'; available: CUDA0, CPU\n"
    );
    let o = tandem(&["plan", "-m", FIXTURE, "--gpu", "CUDA0"]);
    assert_eq!(stderr(&o), "tandem: error: --gpu 'CUDA0': expected CUDA<n>=SIZE, e.g. CUDA0=96GiB\n");
    let o = tandem(&["plan", "-m", FIXTURE, "-ctk", "q4_K"]);
    assert!(stderr(&o).starts_with("tandem: error: --cache-type-k 'q4_K': not a KV cache type"), "{}", stderr(&o));
    assert!(!o.status.success());
}

#[test]
fn plan_json_for_the_kimi_replica_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let first = tandem_plan::replica::write_kimi_k25(dir.path(), Ftype::Q4_K_M).unwrap();
    let first = first.to_str().unwrap();
    let args = [
        "plan",
        "-m",
        first,
        "-ngl",
        "999",
        "-ot",
        "exps=CPU",
        "-c",
        "131072",
        "-ctk",
        "f16",
        "--gpu",
        "CUDA0=96GiB",
        "--json",
    ];
    let o = tandem(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 1096);
    let mut sum = 0;
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let want = if name.ends_with("_exps.weight") { "CPU" } else { "CUDA0" };
        assert_eq!(t["device"], want, "{name}");
        sum += t["bytes"].as_u64().unwrap();
    }
    let weights: u64 = v["devices"].as_array().unwrap().iter().map(|d| d["weights_bytes"].as_u64().unwrap()).sum();
    assert_eq!(weights, sum);
    assert_eq!(v["devices"][0]["kv_bytes"], 61u64 * 576 * 2 * 131072);
    assert_eq!(v["fits"], true);
    // Repacking (the default) copies CPU matrices only: here the routed experts.
    if tandem_cpu::packed::packing_pays() {
        let r = &v["repack"];
        let cpu_weights = v["devices"].as_array().unwrap().iter().find(|d| d["name"] == "CPU").unwrap()
            ["weights_bytes"]
            .as_u64()
            .unwrap();
        let (n, src, packed) =
            (r["tensors"].as_u64().unwrap(), r["source_bytes"].as_u64().unwrap(), r["packed_bytes"].as_u64().unwrap());
        assert!(n > 0 && n <= 180 && src <= cpu_weights && src > cpu_weights / 2, "{r} of {cpu_weights}");
        assert!(packed >= src && packed < src + src / 10, "{r}");
        // Only routed experts are on the CPU: with --no-mmap all their read bytes are given back.
        assert_eq!(r["no_mmap_given_back_bytes"].as_u64(), Some(src), "{r}");
    } else {
        println!("SKIPPED the repacking estimate: this machine runs no packed kernel");
        assert!(v["repack"].is_null(), "{}", v["repack"]);
    }
    let o = tandem(&[&args[..], &["--no-repack"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["repack"].is_null(), "{}", v["repack"]);
    // The text table of the same plan.
    let o = tandem(&args[..args.len() - 1]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("--n-gpu-layers 999: layers 0-60 on CUDA0, the output head on CUDA0"), "{text}");
    assert!(text.contains("fits: yes"));
    let packing = text.lines().filter(|l| l.starts_with("repacking (the default")).count();
    assert_eq!(packing, usize::from(tandem_cpu::packed::packing_pays()), "{text}");
}

/// The rebuilt MLA keys and values `--mla-cache` keeps are memory beyond the plan's table: `plan`
/// says how much, against what a full cache's rows take (f32 keys and values of every head of
/// every layer for every cell, from the file's own hyperparameters).
#[test]
fn plan_counts_the_kept_mla_rows() {
    let path = fixture();
    let p = path.to_str().unwrap();
    let f = tandem_gguf::GgufFile::open(&path).unwrap();
    let md = f.metadata();
    let int = |k: &str| md.get(&format!("deepseek2.{k}")).and_then(|v| v.as_i128()).unwrap() as u64;
    // -c 512: 512 cells; keys of key_length_mla, values of value_length_mla per head.
    let full = 512
        * int("block_count")
        * int("attention.head_count")
        * (int("attention.key_length_mla") + int("attention.value_length_mla"))
        * 4;
    let json = |args: &[&str]| -> serde_json::Value {
        let o = tandem(&[&["plan", "-m", p, "-c", "512", "--json"], args].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["mla_cache"].clone()
    };
    assert_eq!(json(&["--mla-cache", "1KiB"]), serde_json::json!({"budget_bytes": 1024, "full_cache_bytes": full}));
    assert_eq!(json(&["--mla", "absorbed"]), serde_json::Value::Null);
    // A GPU's cache keeps no rows; with -nkvo the cache is the CPU's again.
    assert_eq!(json(&["--gpu", "CUDA0=80GiB", "-ngl", "99"]), serde_json::Value::Null);
    assert_eq!(json(&["--gpu", "CUDA0=80GiB", "-ngl", "99", "-nkvo", "--mla-cache", "1KiB"])["full_cache_bytes"], full);
    let text = |args: &[&str]| -> String {
        let o = tandem(&[&["plan", "-m", p, "-c", "512"], args].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("MLA:")).collect::<Vec<_>>().join("\n")
    };
    let human = tandem_plan::human(full);
    assert!(text(&["--mla-cache", "1KiB"])
        .contains(&format!("up to 1.00 KiB (--mla-cache as given; a full cache's take {human})")));
    assert!(text(&["--mla-cache", "1TiB"]).contains(&format!("all, {human} for a full cache")));
    assert!(text(&["--mla-cache", "0"]).contains("not kept"));
    assert_eq!(text(&["--mla", "absorbed"]), "");
    let o = tandem(&["plan", "-m", p, "--mla-cache", "lots"]);
    assert!(!o.status.success() && stderr(&o).contains("--mla-cache"), "{}", stderr(&o));
}
