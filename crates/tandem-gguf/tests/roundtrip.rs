//! The writer and the reader agree on every value type, nested arrays, alignment, v2 and v3,
//! mmap and owned loading; typed getters name the key, the expected type and the file.

use tandem_gguf::{Array, GgmlType, GgufFile, GgufModel, GgufWriter, LoadOptions, Value};

fn all_values_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama")
        .add("v.u8", 200u8)
        .add("v.i8", -5i8)
        .add("v.u16", 60000u16)
        .add("v.i16", -30000i16)
        .add("v.u32", 4_000_000_000u32)
        .add("v.i32", -2_000_000_000i32)
        .add("v.f32", 1.5f32)
        .add("v.bool", true)
        .add("v.string", "héllo ✓")
        .add("v.u64", u64::MAX)
        .add("v.i64", i64::MIN)
        .add("v.f64", -0.25f64)
        .add("a.u8", vec![1u8, 2, 3])
        .add("a.i8", vec![-1i8])
        .add("a.u16", vec![1u16])
        .add("a.i16", vec![-1i16])
        .add("a.u32", vec![7u32, 8])
        .add("a.i32", vec![-7i32])
        .add("a.f32", vec![0.5f32, -0.5])
        .add("a.bool", vec![true, false])
        .add("a.string", vec!["a", "", "ç"])
        .add("a.u64", vec![u64::MAX])
        .add("a.i64", vec![i64::MIN])
        .add("a.f64", vec![1e300f64])
        .add("a.empty", Vec::<f32>::new())
        .add(
            "a.nested",
            Array::Array(vec![Array::U32(vec![1, 2]), Array::Array(vec![Array::String(vec!["x".into()])])]),
        );
    w
}

#[test]
fn every_value_type_round_trips() {
    for version in [2, 3] {
        let bytes = all_values_writer().version(version).unwrap().to_bytes().unwrap();
        let f = GgufFile::from_bytes(bytes, "rt.gguf").unwrap();
        assert_eq!(f.version(), version);
        let md = f.metadata();
        assert_eq!(md.len(), 27);
        assert_eq!(md.get_u32("v.u32").unwrap(), 4_000_000_000);
        assert_eq!(md.get_i32("v.i32").unwrap(), -2_000_000_000);
        assert_eq!(md.get_u64("v.u64").unwrap(), u64::MAX);
        assert_eq!(md.get("v.i64"), Some(&Value::I64(i64::MIN)));
        assert_eq!(md.get_f32("v.f32").unwrap(), 1.5);
        assert_eq!(md.get_f32("v.f64").unwrap(), -0.25);
        assert!(md.get_bool("v.bool").unwrap());
        assert_eq!(md.get_str("v.string").unwrap(), "héllo ✓");
        assert_eq!(md.get_str_array("a.string").unwrap(), ["a", "", "ç"]);
        assert_eq!(md.get_f32_array("a.f32").unwrap(), [0.5, -0.5]);
        assert_eq!(md.get_u32_list("a.u32").unwrap(), [7, 8]);
        assert_eq!(md.get_u32_list("v.u8").unwrap(), [200]);
        assert_eq!(md.get_array("a.empty").unwrap(), &Array::F32(vec![]));
        assert_eq!(md.get_array("a.nested").unwrap().len(), 2);
        // Everything read equals everything written, in order.
        let again = {
            let mut w2 = GgufWriter::new().version(version).unwrap();
            for (k, v) in md.entries() {
                w2.add(k, v.clone());
            }
            w2.to_bytes().unwrap()
        };
        assert_eq!(again, all_values_writer().version(version).unwrap().to_bytes().unwrap());
    }
}

#[test]
fn getter_errors_name_key_type_and_file() {
    let f = GgufFile::from_bytes(all_values_writer().to_bytes().unwrap(), "m.gguf").unwrap();
    let md = f.metadata();
    let e = md.get_u32("v.string").unwrap_err().to_string();
    assert_eq!(e, "m.gguf: metadata key 'v.string': expected u32, found string");
    let e = md.get_u32("v.i32").unwrap_err().to_string();
    assert_eq!(e, "m.gguf: metadata key 'v.i32': expected u32, found i32 -2000000000");
    let e = md.get_f32_array("a.u32").unwrap_err().to_string();
    assert_eq!(e, "m.gguf: metadata key 'a.u32': expected array of f32, found array of u32");
    let e = md.get_bool("missing.key").unwrap_err().to_string();
    assert_eq!(e, "m.gguf: metadata key 'missing.key' not found");
    assert_eq!(md.opt_u32("missing.key").unwrap(), None);
}

fn tensor_writer(alignment: Option<u32>) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama");
    if let Some(a) = alignment {
        w.add("general.alignment", a);
    }
    let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
    w.add_tensor("x.weight", GgmlType::F32, &[3, 2], f32s).unwrap();
    w.add_tensor("q.weight", GgmlType::Q8_0, &[64], vec![7u8; 68]).unwrap();
    w.add_tensor("n.weight", GgmlType::F16, &[5], vec![1u8; 10]).unwrap();
    w
}

#[test]
fn tensors_round_trip_through_files_mmap_and_owned() {
    let dir = tempfile::tempdir().unwrap();
    for alignment in [None, Some(64), Some(1)] {
        let path = dir.path().join(format!("t{alignment:?}.gguf"));
        tensor_writer(alignment).write_file(&path).unwrap();
        for mmap in [true, false] {
            let f = GgufFile::open_with(&path, LoadOptions { mmap, mlock: false }).unwrap();
            assert_eq!(f.is_mmapped(), mmap);
            assert_eq!(f.alignment(), alignment.unwrap_or(32) as u64);
            let x = f.tensor("x.weight").unwrap();
            assert_eq!((x.ty, x.dims.clone(), x.size), (GgmlType::F32, vec![3, 2], 24));
            let data = f.tensor_data("x.weight").unwrap();
            assert_eq!(f32::from_le_bytes(data[20..24].try_into().unwrap()), 5.0);
            assert_eq!(f.tensor_data("q.weight").unwrap(), &[7u8; 68][..]);
            assert_eq!(f.tensor_data("n.weight").unwrap(), &[1u8; 10][..]);
            assert!(f.tensor_data("nope").unwrap_err().to_string().contains("tensor 'nope' not found"));
            for t in f.tensors() {
                assert_eq!((f.data_offset() + t.offset) % f.alignment(), 0);
            }
        }
        let m = GgufModel::open(&path, LoadOptions::default()).unwrap();
        assert_eq!((m.shards().len(), m.tensor_count()), (1, 3));
    }
}

#[test]
fn mlock_is_applied_or_reports_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    tensor_writer(None).write_file(&path).unwrap();
    for mmap in [true, false] {
        match GgufFile::open_with(&path, LoadOptions { mmap, mlock: true }) {
            Ok(f) => assert_eq!(f.tensors().len(), 3),
            Err(e) => assert!(e.to_string().contains("mlock failed"), "{e}"),
        }
    }
}

#[test]
fn writer_refuses_invalid_files() {
    let mut w = GgufWriter::new();
    let e = w.add_tensor("t", GgmlType::Q4_K, &[100], vec![0; 10]).err().unwrap().to_string();
    assert!(e.contains("tensor 't'"), "{e}");
    let e = w.add_tensor("t", GgmlType::F32, &[0], vec![]).err().unwrap().to_string();
    assert!(e.contains("bad dimensions"), "{e}");
    w.add("k", 1u32).add("k", 2u32);
    assert!(w.to_bytes().unwrap_err().to_string().contains("duplicate key 'k'"));
    assert!(GgufWriter::new().version(1).is_err());
}

/// A file written tensor by tensor from a fill callback (`add_tensor_later`, `write_file_with`) is
/// byte for byte the file written from the same data in memory; `to_bytes` refuses tensors whose
/// data comes later.
#[test]
fn tensors_filled_while_writing_give_the_same_file() {
    let shapes: [(&str, GgmlType, Vec<u64>); 3] =
        [("a", GgmlType::F32, vec![5, 3]), ("b", GgmlType::Q8_0, vec![64, 2]), ("c", GgmlType::Q4_K, vec![256, 3, 2])];
    let data = |i: usize, len: usize| -> Vec<u8> { (0..len).map(|j| (i * 31 + j * 7) as u8).collect() };
    let mut whole = GgufWriter::new();
    let mut later = GgufWriter::new();
    for w in [&mut whole, &mut later] {
        w.add("general.architecture", "test");
    }
    for (i, (name, ty, dims)) in shapes.iter().enumerate() {
        let len = later.add_tensor_later(name, *ty, dims).unwrap() as usize;
        whole.add_tensor(name, *ty, dims, data(i, len)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("later.gguf");
    let mut asked = Vec::new();
    later
        .write_file_with(&path, &mut |i, bytes| {
            asked.push(i);
            bytes.copy_from_slice(&data(i, bytes.len()));
        })
        .unwrap();
    assert_eq!(asked, [0, 1, 2]);
    assert_eq!(std::fs::read(&path).unwrap(), whole.to_bytes().unwrap());
    assert!(later.to_bytes().unwrap_err().to_string().contains("write_file_with"));
    assert!(later.add_tensor_later("bad", GgmlType::Q4_K, &[100, 2]).is_err());
}
