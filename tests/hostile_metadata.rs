//! Hostile hyperparameters: every fixture model rewritten with one metadata value changed (seeded,
//! 1,000 cases, the values that broke loaders before always among them), each run through
//! `tandem run` as a user would, under an 8 GiB address-space limit. A mutant may load and generate,
//! or be refused; it may never panic, abort, hang or print more than one error line. (Broken file
//! structure is crates/tandem-gguf/tests/malformed.rs's.)
//!
//! `TANDEM_FUZZ_CASES` and `TANDEM_FUZZ_SEED` change how many cases run and which.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tandem_gguf::{Array, GgufFile, GgufWriter, Value};
use tandem_model::demo::SplitMix64;

/// A uniform index below `n` from the seeded stream (modulo: the bias does not matter here).
fn below(rng: &mut SplitMix64, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut v = Vec::new();
    for dir in ["models", "inference"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            // Split shards are read together; the single-file fixtures cover the same keys.
            if name.ends_with(".gguf") && !name.contains("-of-") {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

/// Integer values that have broken loaders: zero, one, odd, the original's neighbours, and the
/// limits of 31, 32 and 64 bits.
fn int_values(v: i128) -> Vec<i128> {
    vec![
        0,
        1,
        2,
        3,
        7,
        v - 1,
        v + 1,
        v * 2,
        v / 2,
        v * 1000,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 40,
        -1,
        i64::MAX as i128,
        u64::MAX as i128,
    ]
}

fn float_values(v: f64) -> Vec<f64> {
    vec![0.0, -0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e-45, 1e38, v * 1e6, -v, 1.0]
}

/// `v` as a value of the same type as `like`, wrapped into its range.
fn int_like(like: &Value, v: i128) -> Value {
    match like {
        Value::U8(_) => Value::U8(v as u8),
        Value::I8(_) => Value::I8(v as i8),
        Value::U16(_) => Value::U16(v as u16),
        Value::I16(_) => Value::I16(v as i16),
        Value::U32(_) => Value::U32(v as u32),
        Value::I32(_) => Value::I32(v as i32),
        Value::U64(_) => Value::U64(v as u64),
        Value::I64(_) => Value::I64(v as i64),
        _ => unreachable!(),
    }
}

/// Every mutation of one metadata entry: `(description, new value)`.
fn mutations(key: &str, value: &Value) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    if let Some(v) = value.as_i128() {
        for m in int_values(v) {
            let nv = int_like(value, m);
            out.push((format!("{key} = {nv:?}"), nv));
        }
        // Another type than the key's: what a careless converter writes.
        out.push((format!("{key} as i32 -1"), Value::I32(-1)));
        out.push((format!("{key} as u64 2^40"), Value::U64(1 << 40)));
        out.push((format!("{key} as f32"), Value::F32(v as f32 + 0.5)));
        out.push((format!("{key} as string"), Value::String(v.to_string())));
        return out;
    }
    match value {
        Value::F32(f) => {
            for m in float_values(*f as f64) {
                out.push((format!("{key} = {m}f32"), Value::F32(m as f32)));
            }
            out.push((format!("{key} as u32"), Value::U32(7)));
        }
        Value::F64(f) => {
            for m in float_values(*f) {
                out.push((format!("{key} = {m}f64"), Value::F64(m)));
            }
        }
        Value::Bool(b) => {
            out.push((format!("{key} = {}", !b), Value::Bool(!b)));
            out.push((format!("{key} as u8 2"), Value::U8(2)));
        }
        Value::String(s) => {
            out.push((format!("{key} = \"\""), Value::String(String::new())));
            out.push((format!("{key} with control bytes"), Value::String(format!("{s}\n\x1b[31mX\r"))));
        }
        Value::Array(a) => {
            if a.is_empty() {
                return out;
            }
            if let Some(first) = a.get(0).and_then(|v| v.as_i128()) {
                // Per-layer integers (head counts) and token ids: one element changed, or the array
                // cut short.
                for m in [0, first + 1, (1 << 31) - 1, -1] {
                    let mut vals: Vec<Value> = (0..a.len()).filter_map(|i| a.get(i)).collect();
                    let i = vals.len() - 1;
                    vals[i] = int_like(&vals[i], m);
                    if let Some(arr) = array_of(&vals) {
                        out.push((format!("{key}[{i}] = {m}"), Value::Array(arr)));
                    }
                }
            }
            if a.len() > 1 {
                let vals: Vec<Value> = (0..a.len() / 2).filter_map(|i| a.get(i)).collect();
                if let Some(arr) = array_of(&vals) {
                    out.push((format!("{key} cut to {} of {}", vals.len(), a.len()), Value::Array(arr)));
                }
            }
            if let Some(Value::F32(_)) = a.get(0) {
                let mut vals: Vec<Value> = (0..a.len()).filter_map(|i| a.get(i)).collect();
                vals[0] = Value::F32(f32::NAN);
                if let Some(arr) = array_of(&vals) {
                    out.push((format!("{key}[0] = NaN"), Value::Array(arr)));
                }
            }
        }
        _ => {}
    }
    out
}

/// An array of the values' type, if the writer can hold it.
fn array_of(vals: &[Value]) -> Option<Array> {
    macro_rules! arr {
        ($var:ident) => {
            Some(Array::$var(
                vals.iter().map(|v| if let Value::$var(x) = v { x.clone() } else { unreachable!() }).collect(),
            ))
        };
    }
    match vals.first()? {
        Value::U8(_) => arr!(U8),
        Value::I8(_) => arr!(I8),
        Value::U16(_) => arr!(U16),
        Value::I16(_) => arr!(I16),
        Value::U32(_) => arr!(U32),
        Value::I32(_) => arr!(I32),
        Value::U64(_) => arr!(U64),
        Value::I64(_) => arr!(I64),
        Value::F32(_) => arr!(F32),
        Value::F64(_) => arr!(F64),
        Value::Bool(_) => arr!(Bool),
        Value::String(_) => arr!(String),
        _ => None,
    }
}

struct Case {
    fixture: PathBuf,
    key: String,
    what: String,
    value: Value,
}

/// The cases that broke `tandem run` before, always run.
const KNOWN: &[(&str, i128)] = &[
    ("rope.dimension_count", 7),
    ("rope.dimension_count", 1 << 31),
    ("rope.dimension_count", (1 << 32) - 1),
    ("block_count", (1 << 31) - 1),
    ("feed_forward_length", (1 << 32) - 1),
    ("embedding_length", (1 << 32) - 1),
    ("attention.head_count", (1 << 31) - 1),
    ("context_length", (1 << 32) - 1),
    ("expert_count", (1 << 32) - 1),
    ("expert_used_count", (1 << 32) - 1),
    ("attention.kv_lora_rank", (1 << 32) - 1),
];

fn cases(n: usize, seed: u64) -> Vec<Case> {
    let mut all = Vec::new();
    let mut known = Vec::new();
    for f in fixtures() {
        let file = GgufFile::open(&f).unwrap();
        for (key, value) in file.metadata().entries() {
            let muts = mutations(key, value);
            for (what, v) in muts {
                let is_known = KNOWN.iter().any(|&(k, kv)| {
                    key.split_once('.').is_some_and(|(_, rest)| rest == k)
                        && v.as_i128() == Some(kv)
                        && std::mem::discriminant(&v) == std::mem::discriminant(value)
                });
                let c = Case { fixture: f.clone(), key: key.clone(), what, value: v };
                if is_known {
                    known.push(c);
                } else {
                    all.push(c);
                }
            }
        }
    }
    // Values that wrap to the same one (-1 and 2^32 - 1 as u32) are one case.
    let mut seen = std::collections::HashSet::new();
    known.retain(|c| seen.insert((c.fixture.clone(), c.key.clone(), format!("{:?}", c.value))));
    all.retain(|c| seen.insert((c.fixture.clone(), c.key.clone(), format!("{:?}", c.value))));
    assert!(all.len() + known.len() >= n, "only {} mutations of the fixtures' metadata", all.len() + known.len());
    let mut rng = SplitMix64(seed);
    // A partial Fisher-Yates shuffle picks the sample.
    let take = n.saturating_sub(known.len());
    for i in 0..take {
        let j = i + below(&mut rng, all.len() - i);
        all.swap(i, j);
    }
    all.truncate(take);
    known.extend(all);
    known
}

fn write_mutant(c: &Case, path: &Path) {
    let f = GgufFile::open(&c.fixture).unwrap();
    let mut w = GgufWriter::new().version(f.version()).unwrap();
    for (k, v) in f.metadata().entries() {
        if *k == c.key {
            w.add(k, c.value.clone());
        } else {
            w.add(k, v.clone());
        }
    }
    for t in f.tensors() {
        w.add_tensor(&t.name, t.ty, &t.dims, f.tensor_data(&t.name).unwrap().to_vec()).unwrap();
    }
    w.write_file(path).unwrap();
}

enum Outcome {
    Ran,
    Refused(String),
    Bad(String),
}

fn run_case(c: &Case, dir: &Path, i: usize) -> Outcome {
    let path = dir.join(format!("mutant-{i}.gguf"));
    write_mutant(c, &path);
    // Under an 8 GiB address-space limit: a run-away allocation fails (an abort, reported) instead
    // of taking the machine's memory.
    let mut child = Command::new("sh")
        .args(["-c", "ulimit -v 8388608 && exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_tandem"), "run", "-m"])
        .arg(&path)
        .args(["-p", "Hello, world", "-n", "3", "--temp", "0", "-t", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // stderr is read on a thread so a chatty child cannot block on a full pipe.
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    let stderr = reader.join().unwrap();
    let _ = std::fs::remove_file(&path);
    let what = format!("case {i}: {} with {}", c.fixture.file_name().unwrap().to_string_lossy(), c.what);
    if std::env::var_os("TANDEM_FUZZ_ONLY").is_some() {
        println!(
            "{what}: {:?} in {:.1} s: {}",
            status.and_then(|s| s.code()),
            start.elapsed().as_secs_f64(),
            stderr.trim_end()
        );
    }
    let Some(status) = status else { return Outcome::Bad(format!("{what}: still running after 60 s")) };
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("tandem: error:")).collect();
    match status.code() {
        Some(0) if errors.is_empty() => Outcome::Ran,
        Some(1) if errors.len() == 1 && stderr.ends_with('\n') && stderr.lines().last() == Some(errors[0]) => {
            let line = errors[0];
            if line.chars().any(|ch| ch.is_control()) {
                Outcome::Bad(format!("{what}: the error line holds control characters: {line:?}"))
            } else {
                Outcome::Refused(line.to_string())
            }
        }
        code => {
            let tail: Vec<&str> = stderr.lines().rev().take(4).collect();
            Outcome::Bad(format!("{what}: exit {code:?} ({status}); stderr ends {tail:?}"))
        }
    }
}

#[test]
fn mutated_hyperparameters_are_refused_in_one_line_or_run() {
    let n: usize = std::env::var("TANDEM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let seed: u64 = std::env::var("TANDEM_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x7a6d);
    let mut cases: Vec<(usize, Case)> = cases(n, seed).into_iter().enumerate().collect();
    // TANDEM_FUZZ_ONLY=I,J runs those cases alone (the numbers the failures print).
    if let Ok(only) = std::env::var("TANDEM_FUZZ_ONLY") {
        let keep: Vec<usize> = only.split(',').filter_map(|v| v.trim().parse().ok()).collect();
        cases.retain(|(i, _)| keep.contains(i));
    }
    let dir = std::env::temp_dir().join(format!("tandem-hostile-metadata-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).min(4);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Outcome)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((no, c)) = cases.get(i) else { break };
                        out.push((*no, run_case(c, &dir, *no)));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let _ = std::fs::remove_dir_all(&dir);
    let (mut ran, mut refused, mut bad) = (0, 0, Vec::new());
    let mut samples = std::collections::BTreeMap::new();
    for (_, o) in &results {
        match o {
            Outcome::Ran => ran += 1,
            Outcome::Refused(line) => {
                refused += 1;
                // One refusal per distinct message shape (numbers and paths left out), to show.
                let shape: String =
                    line.rsplit(".gguf").next().unwrap_or(line).chars().filter(|c| !c.is_ascii_digit()).collect();
                samples.entry(shape).or_insert_with(|| line.clone());
            }
            Outcome::Bad(why) => bad.push(why.clone()),
        }
    }
    println!(
        "{} mutants of {} fixtures (seed {seed:#x}): {ran} ran, {refused} refused in one line, {} panicked, aborted, hung or said more",
        results.len(),
        fixtures().len(),
        bad.len()
    );
    println!("{} kinds of refusal, e.g.:", samples.len());
    for line in samples.values().take(12) {
        println!("  {line}");
    }
    if std::env::var_os("TANDEM_FUZZ_ONLY").is_none() {
        assert!(results.len() >= 500.min(n), "{} cases ran", results.len());
    }
    assert!(bad.is_empty(), "{} of {} mutants failed badly:\n{}", bad.len(), results.len(), bad.join("\n"));
}
