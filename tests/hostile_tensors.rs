//! Hostile tensors: every fixture model rewritten with one tensor changed, in a file whose
//! structure is sound (seeded, 600 cases): another ggml type (its bytes random), bytes that are
//! NaN, infinite or random in its own type, other dimensions, the tensor left out or an unknown
//! one added. Each runs through `tandem run` as [`hostile_util`] does: loaded and generating, or
//! refused in one line; never a panic, an abort or a hang. (Broken structure is
//! crates/tandem-gguf/tests/malformed.rs's; hyperparameters hostile_metadata.rs's.)

mod hostile_util;

use hostile_util::{cases_and_seed, fixtures, run_all, sample};
use std::path::{Path, PathBuf};
use tandem_gguf::{GgmlType, GgufFile, GgufWriter};
use tandem_model::demo::SplitMix64;

/// What is done to the tensor `name`.
#[derive(Clone, Debug)]
enum Change {
    /// Another type, seeded random bytes.
    Type(GgmlType),
    /// Every byte this one.
    Fill(u8),
    /// Seeded random bytes in its own type.
    Random,
    /// Other dimensions (seeded random bytes of their size, in its own type).
    Dims(Vec<u64>),
    /// Left out of the file.
    Drop,
    /// Another tensor of the same type and shape, under a name no model has.
    Extra,
}

struct Case {
    fixture: PathBuf,
    name: String,
    change: Change,
    seed: u64,
}

/// Types a converter could write instead (each where the row length divides into its blocks).
const TYPES: [GgmlType; 12] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ1_M,
];

fn changes(ty: GgmlType, dims: &[u64]) -> Vec<Change> {
    let mut out: Vec<Change> = TYPES
        .into_iter()
        .filter(|&t| t != ty && dims[0].is_multiple_of(t.block_size() as u64))
        .map(Change::Type)
        .collect();
    // 0xFF: NaN in every float and every fp16 scale; 0x7C: +inf halves and huge floats.
    out.extend([Change::Fill(0xFF), Change::Fill(0x7C), Change::Fill(0), Change::Random, Change::Drop, Change::Extra]);
    let bs = ty.block_size() as u64;
    let mut dims_of = vec![
        [&[dims[0] + bs], &dims[1..]].concat(),
        [dims, &[1]].concat(),
        [&dims[..dims.len() - 1], &[dims[dims.len() - 1] + 1]].concat(),
    ];
    if dims.len() > 1 {
        dims_of.push(dims[..dims.len() - 1].to_vec());
        let mut swapped = dims.to_vec();
        swapped.swap(0, 1);
        if swapped[0].is_multiple_of(bs) {
            dims_of.push(swapped);
        }
    }
    out.extend(dims_of.into_iter().filter(|d| d != dims).map(Change::Dims));
    out
}

fn cases(n: usize, seed: u64) -> Vec<Case> {
    let mut all = Vec::new();
    let mut rng = SplitMix64(seed ^ 0x5eed);
    for f in fixtures() {
        let file = GgufFile::open(&f).unwrap();
        for t in file.tensors() {
            for change in changes(t.ty, &t.dims) {
                all.push(Case { fixture: f.clone(), name: t.name.clone(), change, seed: rng.next_u64() });
            }
        }
    }
    sample(Vec::new(), all, n, seed)
}

fn random_bytes(n: u64, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64(seed);
    (0..n).map(|_| rng.next_u64() as u8).collect()
}

fn bytes_of(ty: GgmlType, dims: &[u64]) -> u64 {
    ty.row_bytes(dims[0]).unwrap() * dims[1..].iter().product::<u64>()
}

fn write_mutant(c: &Case, path: &Path) {
    let f = GgufFile::open(&c.fixture).unwrap();
    let mut w = GgufWriter::new().version(f.version()).unwrap();
    for (k, v) in f.metadata().entries() {
        w.add(k, v.clone());
    }
    for t in f.tensors() {
        let data = f.tensor_data(&t.name).unwrap().to_vec();
        if t.name != c.name {
            w.add_tensor(&t.name, t.ty, &t.dims, data).unwrap();
            continue;
        }
        let (ty, dims, data) = match &c.change {
            Change::Type(ty) => (*ty, t.dims.clone(), random_bytes(bytes_of(*ty, &t.dims), c.seed)),
            Change::Fill(b) => (t.ty, t.dims.clone(), vec![*b; data.len()]),
            Change::Random => (t.ty, t.dims.clone(), random_bytes(data.len() as u64, c.seed)),
            Change::Dims(d) => (t.ty, d.clone(), random_bytes(bytes_of(t.ty, d), c.seed)),
            Change::Drop => continue,
            Change::Extra => {
                w.add_tensor("blk.0.unknown_extra.weight", t.ty, &t.dims, data.clone()).unwrap();
                (t.ty, t.dims.clone(), data)
            }
        };
        w.add_tensor(&t.name, ty, &dims, data).unwrap();
    }
    w.write_file(path).unwrap();
}

#[test]
fn hostile_tensors_are_refused_in_one_line_or_run() {
    let (n, seed) = cases_and_seed(600, 0x7e45);
    let cases = cases(n, seed);
    let what =
        |c: &Case| format!("{} with {} {:?}", c.fixture.file_name().unwrap().to_string_lossy(), c.name, c.change);
    run_all("hostile-tensors", &cases, what, write_mutant, seed);
}

/// `tandem run`'s standard output and whether it succeeded, with the error lines when not.
fn run_greedy(model: &Path) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["run", "-m"])
        .arg(model)
        .args(["-p", "Hello, world", "-n", "8", "--temp", "0", "-t", "1"])
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn dimensions_of_one_are_read_as_llama_cpp_reads_them() {
    // llama.cpp's `check_tensor_dims` takes every dimension past the ones it asks for as 1: a
    // converter may write `[n, 1]` for a norm, `[n_embd, n_vocab, 1]` for a matrix. The same
    // model with a trailing 1 on every tensor must load and give the same tokens.
    let dir = std::env::temp_dir().join(format!("tandem-dims-of-one-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in fixtures().into_iter().filter(|f| f.parent().is_some_and(|p| p.ends_with("models"))) {
        let file = GgufFile::open(&f).unwrap();
        let mut w = GgufWriter::new().version(file.version()).unwrap();
        for (k, v) in file.metadata().entries() {
            w.add(k, v.clone());
        }
        let mut padded = 0;
        for t in file.tensors() {
            let mut dims = t.dims.clone();
            if dims.len() < 4 {
                dims.push(1);
                padded += 1;
            }
            w.add_tensor(&t.name, t.ty, &dims, file.tensor_data(&t.name).unwrap().to_vec()).unwrap();
        }
        assert!(padded > 0);
        let copy = dir.join(f.file_name().unwrap());
        w.write_file(&copy).unwrap();
        let (ok, want, err) = run_greedy(&f);
        assert!(ok, "{}: {err}", f.display());
        let (ok, got, err) = run_greedy(&copy);
        assert!(ok, "{} with trailing dimensions of 1: {err}", f.display());
        assert_eq!(got, want, "{} with trailing dimensions of 1", f.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
