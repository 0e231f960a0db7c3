//! The writer reproduces, byte for byte, GGUF files written by gguf-py and by llama.cpp itself
//! (tests/fixtures/models, which scripts/gen_model_fixtures.py checked load in llama.cpp): so the
//! files it writes load in llama.cpp too.

use std::path::PathBuf;
use tandem_gguf::{GgufFile, GgufWriter};

fn fixtures() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    v.sort();
    v
}

#[test]
fn rewriting_a_fixture_gives_the_same_bytes() {
    let files = fixtures();
    assert!(files.len() >= 5, "expected the model fixtures, found {files:?}");
    for path in files {
        let original = std::fs::read(&path).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let mut w = GgufWriter::new().version(f.version()).unwrap();
        for (k, v) in f.metadata().entries() {
            w.add(k, v.clone());
        }
        for t in f.tensors() {
            w.add_tensor(&t.name, t.ty, &t.dims, f.tensor_data(&t.name).unwrap().to_vec()).unwrap();
        }
        let again = w.to_bytes().unwrap();
        let first_diff = original.iter().zip(&again).position(|(a, b)| a != b);
        assert!(
            again == original,
            "{}: rewritten file differs (lengths {} vs {}, first differing byte {first_diff:?})",
            path.display(),
            again.len(),
            original.len()
        );
    }
}
