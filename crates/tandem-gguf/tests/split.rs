//! Split models: discovery from any shard, one tensor index, and a clear error naming the file
//! for every inconsistency.

use std::path::Path;
use tandem_gguf::{GgmlType, GgufModel, GgufWriter, LoadOptions};

/// Writes `count` shards of a model with `per_shard` tensors each, as gguf-split lays them out
/// (all metadata in the first shard, split keys in every shard).
fn write_split(dir: &Path, prefix: &str, count: u16, per_shard: usize, total_override: Option<i32>) {
    let total = total_override.unwrap_or((count as usize * per_shard) as i32);
    for no in 0..count {
        let mut w = GgufWriter::new();
        if no == 0 {
            w.add("general.architecture", "llama").add("llama.block_count", 2u32);
        }
        w.add("split.no", no).add("split.count", count).add("split.tensors.count", total);
        for t in 0..per_shard {
            let data: Vec<u8> = (0..4).flat_map(|i| ((no as usize * 100 + t * 10 + i) as f32).to_le_bytes()).collect();
            w.add_tensor(&format!("blk.{no}.t{t}.weight"), GgmlType::F32, &[4], data).unwrap();
        }
        let path = dir.join(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1));
        w.write_file(path).unwrap();
    }
}

fn open(p: impl AsRef<Path>) -> Result<GgufModel, String> {
    GgufModel::open(p, LoadOptions::default()).map_err(|e| e.to_string())
}

#[test]
fn opens_all_shards_from_any_shard() {
    let dir = tempfile::tempdir().unwrap();
    write_split(dir.path(), "m", 3, 2, None);
    for no in 1..=3 {
        let m = open(dir.path().join(format!("m-{no:05}-of-00003.gguf"))).unwrap();
        assert_eq!(m.shards().len(), 3);
        assert_eq!(m.tensor_count(), 6);
        assert_eq!(m.metadata().get_u32("llama.block_count").unwrap(), 2);
        let t = m.tensor("blk.2.t1.weight").unwrap();
        assert_eq!(t.shard, 2);
        let d = m.tensor_data("blk.2.t1.weight").unwrap();
        assert_eq!(f32::from_le_bytes(d[4..8].try_into().unwrap()), 211.0);
        let names: Vec<_> = m.tensors().map(|t| t.info.name.clone()).collect();
        assert_eq!(names[0], "blk.0.t0.weight");
        assert_eq!(names[5], "blk.2.t1.weight");
    }
}

/// The error of opening the first of `count` shards (as [`write_split`] writes them) once
/// `change` has been made to their folder.
fn first_shard_error(count: u16, per_shard: usize, total: Option<i32>, change: impl FnOnce(&Path)) -> String {
    let dir = tempfile::tempdir().unwrap();
    write_split(dir.path(), "m", count, per_shard, total);
    change(dir.path());
    open(dir.path().join(format!("m-00001-of-{count:05}.gguf"))).unwrap_err()
}

#[test]
fn missing_shard_is_named() {
    let e = first_shard_error(3, 1, None, |d| std::fs::remove_file(d.join("m-00002-of-00003.gguf")).unwrap());
    assert!(e.starts_with("missing shard ") && e.contains("m-00002-of-00003.gguf"), "{e}");
}

#[test]
fn extra_shard_is_named() {
    let e = first_shard_error(3, 1, None, |d| std::fs::write(d.join("m-00004-of-00004.gguf"), b"junk").unwrap());
    assert!(e.starts_with("extra shard ") && e.contains("m-00004-of-00004.gguf"), "{e}");
}

#[test]
fn shard_with_wrong_split_no_is_named() {
    // Swap the two files: each now has the other's split.no.
    let e = first_shard_error(2, 1, None, |d| {
        let (a, b, tmp) = (d.join("m-00001-of-00002.gguf"), d.join("m-00002-of-00002.gguf"), d.join("swap"));
        std::fs::rename(&a, &tmp).unwrap();
        std::fs::rename(&b, &a).unwrap();
        std::fs::rename(&tmp, &b).unwrap();
    });
    assert!(e.contains("m-00001-of-00002.gguf: split.no = 1, split.count = 2; expected 0 and 2"), "{e}");
}

#[test]
fn wrong_total_tensor_count() {
    let e = first_shard_error(2, 2, Some(5), |_| {});
    assert!(e.contains("split.tensors.count = 5 but the 2 shards hold 4 tensors"), "{e}");
}

#[test]
fn tensor_in_two_shards() {
    let dir = tempfile::tempdir().unwrap();
    for no in 0..2u16 {
        let mut w = GgufWriter::new();
        w.add("split.no", no).add("split.count", 2u16);
        w.add_tensor("same.weight", GgmlType::F32, &[1], vec![0; 4]).unwrap();
        w.write_file(dir.path().join(format!("d-{:05}-of-00002.gguf", no + 1))).unwrap();
    }
    let e = open(dir.path().join("d-00001-of-00002.gguf")).unwrap_err();
    assert!(e.contains("tensor 'same.weight' is in both") && e.contains("d-00002-of-00002.gguf"), "{e}");
}

#[test]
fn split_count_without_split_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.add("split.no", 0u16).add("split.count", 3u16);
    let p = dir.path().join("renamed.gguf");
    w.write_file(&p).unwrap();
    let e = open(&p).unwrap_err();
    assert!(
        e.contains("renamed.gguf: split.count = 3 but the file name does not follow NAME-00001-of-00003.gguf"),
        "{e}"
    );
}

#[test]
fn split_names_parse_like_llama_cpp() {
    use tandem_gguf::{parse_split_name, split_path};
    assert_eq!(
        parse_split_name(Path::new("/x/Kimi-K2-Q4-00002-of-00013.gguf")),
        Some(("Kimi-K2-Q4".to_string(), 2, 13))
    );
    assert_eq!(parse_split_name(Path::new("model.gguf")), None);
    assert_eq!(parse_split_name(Path::new("m-0001-of-00013.gguf")), None);
    assert_eq!(split_path(Path::new("d"), "m", 3, 13), Path::new("d/m-00003-of-00013.gguf"));
}
