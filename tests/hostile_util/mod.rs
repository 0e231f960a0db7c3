//! What the hostile-file tests share: the fixture models, a seeded sample of cases, and each case
//! run through `tandem run` as a user would, under an 8 GiB address-space limit. A mutant may load
//! and generate, or be refused in one error line; it may never panic, abort, hang or say more.
//!
//! `TANDEM_FUZZ_CASES` and `TANDEM_FUZZ_SEED` change how many cases run and which;
//! `TANDEM_FUZZ_ONLY=I,J` runs those cases alone (the numbers the failures print) and prints how
//! each ended.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tandem_model::demo::SplitMix64;

/// A uniform index below `n` from the seeded stream (modulo: the bias does not matter here).
pub fn below(rng: &mut SplitMix64, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// Every single-file fixture model (split shards are read together; the single files cover the
/// same keys and tensors).
pub fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut v = Vec::new();
    for dir in ["models", "inference"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.ends_with(".gguf") && !name.contains("-of-") {
                v.push(p);
            }
        }
    }
    v.sort();
    v
}

/// `take` cases of `all` chosen by the seeded stream (a partial Fisher-Yates shuffle), after
/// every one of `always`.
pub fn sample<T>(mut always: Vec<T>, mut all: Vec<T>, n: usize, seed: u64) -> Vec<T> {
    assert!(all.len() + always.len() >= n, "only {} cases", all.len() + always.len());
    let mut rng = SplitMix64(seed);
    let take = n.saturating_sub(always.len());
    for i in 0..take {
        let j = i + below(&mut rng, all.len() - i);
        all.swap(i, j);
    }
    all.truncate(take);
    always.extend(all);
    always
}

/// The environment's number of cases and seed, `n` and `seed` by default.
pub fn cases_and_seed(n: usize, seed: u64) -> (usize, u64) {
    let n = std::env::var("TANDEM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(n);
    let seed = std::env::var("TANDEM_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(seed);
    (n, seed)
}

pub enum Outcome {
    Ran,
    Refused(String),
    Bad(String),
}

/// Writes case `i` with `write` into `dir` and runs `tandem run` on it.
fn run_case(write: &dyn Fn(&Path), what: &str, dir: &Path, i: usize) -> Outcome {
    let path = dir.join(format!("mutant-{i}.gguf"));
    write(&path);
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
    let what = format!("case {i}: {what}");
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

/// Runs every case (`what` describes one, `write` writes its file) on a few threads, prints how
/// many ran and were refused with examples of the refusals, and fails on any bad ending.
pub fn run_all<C: Sync>(
    name: &str,
    cases: &[C],
    what: impl Fn(&C) -> String + Sync,
    write: impl Fn(&C, &Path) + Sync,
    seed: u64,
) {
    let mut cases: Vec<(usize, &C)> = cases.iter().enumerate().collect();
    if let Ok(only) = std::env::var("TANDEM_FUZZ_ONLY") {
        let keep: Vec<usize> = only.split(',').filter_map(|v| v.trim().parse().ok()).collect();
        cases.retain(|(i, _)| keep.contains(i));
    }
    let dir = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
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
                        let Some(&(no, c)) = cases.get(i) else { break };
                        out.push((no, run_case(&|p| write(c, p), &what(c), &dir, no)));
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
    assert!(bad.is_empty(), "{} of {} mutants failed badly:\n{}", bad.len(), results.len(), bad.join("\n"));
}
