//! Hostile input: one test per class of malformed GGUF, each on a hand-built byte buffer, each
//! asserting on the error text. None may panic or allocate beyond the file.

use tandem_gguf::{Error, GgufFile};

/// Builds GGUF bytes field by field, so tests can write what no honest writer would.
#[derive(Default, Clone)]
struct Raw(Vec<u8>);

impl Raw {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw::default().bytes(b"GGUF").u32(version).u64(n_tensors).u64(n_kv)
    }
    fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(self, v: u32) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(self, v: u64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn i64(self, v: i64) -> Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(4).u32(v)
    }
    fn kv_str(self, key: &str, v: &str) -> Raw {
        self.str(key).u32(8).str(v)
    }
    /// A tensor info: name, dims, ggml type id, offset.
    fn tensor(self, name: &str, dims: &[i64], ty: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.i64(d);
        }
        r.u32(ty).u64(offset)
    }
    fn pad(mut self, align: usize) -> Raw {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        self
    }
    fn zeros(mut self, n: usize) -> Raw {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    fn parse(self) -> Result<GgufFile, Error> {
        GgufFile::from_bytes(self.0, "test.gguf")
    }
}

#[track_caller]
fn assert_rejects(raw: Raw, needle: &str) {
    match raw.parse() {
        Ok(_) => panic!("accepted a file that should fail with '{needle}'"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(needle), "error '{msg}' does not mention '{needle}'");
            assert!(msg.starts_with("test.gguf: "), "error '{msg}' does not name the file");
            assert!(!msg.contains('\n'), "error '{msg}' is not one line");
        }
    }
}

/// A small valid file: two keys, two f32 tensors (4 and 2x3 elements).
fn valid() -> Raw {
    Raw::new(3, 2, 2)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 1)
        .tensor("a.weight", &[4], 0, 0)
        .tensor("b.weight", &[3, 2], 0, 32)
        .pad(32)
        .zeros(32 + 24)
}

#[test]
fn valid_file_parses() {
    let f = valid().parse().unwrap();
    assert_eq!(f.tensors().len(), 2);
    assert_eq!(f.metadata().get_u32("llama.block_count").unwrap(), 1);
    assert_eq!(f.tensor_data("b.weight").unwrap().len(), 24);
}

#[test]
fn bad_magic() {
    let mut r = valid();
    r.0[..4].copy_from_slice(b"GGML");
    assert_rejects(r, "bad magic");
    assert_rejects(Raw::default(), "file truncated: magic");
}

#[test]
fn unsupported_version() {
    assert_rejects(Raw::new(1, 0, 0), "GGUF version 1 is not supported");
    assert_rejects(Raw::new(4, 0, 0), "unsupported GGUF version 4");
    assert_rejects(Raw::new(0x0300_0000, 0, 0), "looks big-endian");
}

#[test]
fn truncated_at_every_byte_offset() {
    let full = valid().0;
    // The data of the last tensor ends at 32-aligned header + 32 + 24 bytes: every shorter prefix
    // cuts the header or the tensor data and must be rejected.
    let data_end = full.len();
    for len in 0..data_end {
        let r = Raw(full[..len].to_vec());
        match r.parse() {
            Ok(_) => panic!("prefix of {len} bytes accepted"),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    ["truncated", "past the end", "cannot fit", "bytes left"].iter().any(|n| msg.contains(n)),
                    "prefix {len}: {msg}"
                );
            }
        }
    }
}

#[test]
fn huge_tensor_and_kv_counts() {
    assert_rejects(Raw::new(3, u64::MAX, 0), "tensor count 18446744073709551615 is larger than the limit");
    assert_rejects(Raw::new(3, 1000, 0).zeros(64), "tensor count 1000 cannot fit in the 72 bytes left");
    assert_rejects(Raw::new(3, 0, 1 << 40), "metadata key/value count 1099511627776 is larger than the limit");
    assert_rejects(Raw::new(3, 0, 5000).zeros(100), "metadata key/value count 5000 cannot fit");
}

#[test]
fn huge_string_and_array_lengths() {
    let r = Raw::new(3, 0, 1).u64(u64::MAX).bytes(b"key").zeros(16);
    assert_rejects(r, "key length 18446744073709551615 is larger than the limit");
    let r = Raw::new(3, 0, 1).str("k").u32(8).u64(1 << 29).bytes(b"abc");
    assert_rejects(r, "string length 536870912 is larger than the 3 bytes left");
    let r = Raw::new(3, 0, 1).str("k").u32(8).u64(1 << 40).zeros(8);
    assert_rejects(r, "string length 1099511627776 is larger than the limit");
    // An array of 2^40 u8, 2^38 u32 and 2^37 strings: each rejected before any allocation.
    for (ty, n) in [(0u32, 1u64 << 40), (4, 1 << 38), (8, 1 << 37)] {
        let r = Raw::new(3, 0, 1).str("k").u32(9).u32(ty).u64(n).zeros(16);
        assert_rejects(r, &format!("array length {n} cannot fit in the 16 bytes left"));
    }
}

#[test]
fn nesting_too_deep() {
    let mut r = Raw::new(3, 0, 1).str("deep").u32(9);
    for _ in 0..20 {
        r = r.u32(9).u64(1);
    }
    let r = r.u32(4).u64(0);
    assert_rejects(r, "arrays nested deeper than 8 levels in key 'deep'");
}

#[test]
fn zero_or_negative_dims() {
    let r = Raw::new(3, 1, 0).tensor("t", &[4, 0], 0, 0).pad(32).zeros(16);
    assert_rejects(r, "tensor 't' dimension 1 is 0 (must be positive)");
    let r = Raw::new(3, 1, 0).tensor("t", &[-4], 0, 0).pad(32).zeros(16);
    assert_rejects(r, "tensor 't' dimension 0 is -4 (must be positive)");
}

#[test]
fn too_many_or_no_dims() {
    let r = Raw::new(3, 1, 0).tensor("t", &[1, 1, 1, 1, 1], 0, 0).pad(32).zeros(4);
    assert_rejects(r, "tensor 't' has 5 dimensions (1 to 4 allowed)");
    let r = Raw::new(3, 1, 0).tensor("t", &[], 0, 0).pad(32).zeros(4);
    assert_rejects(r, "tensor 't' has 0 dimensions");
}

#[test]
fn dims_whose_product_overflows() {
    let big = 1i64 << 40;
    let r = Raw::new(3, 1, 0).tensor("t", &[big, big], 0, 0).pad(32);
    assert_rejects(r, "element count overflows");
    // Elements fit in u64, bytes do not: 2^62 f32 values.
    let r = Raw::new(3, 1, 0).tensor("t", &[1 << 31, 1 << 31], 0, 0).pad(32);
    assert_rejects(r, "byte size overflows");
}

#[test]
fn unknown_ggml_type() {
    let r = Raw::new(3, 1, 0).tensor("t", &[32], 4, 0).pad(32).zeros(64);
    assert_rejects(r, "tensor 't' has unknown ggml type id 4");
    let r = Raw::new(3, 1, 0).tensor("t", &[32], 1234, 0).pad(32).zeros(64);
    assert_rejects(r, "unknown ggml type id 1234");
}

#[test]
fn row_not_a_whole_number_of_blocks() {
    // q4_K (12) needs rows of 256.
    let r = Raw::new(3, 1, 0).tensor("t", &[100, 2], 12, 0).pad(32).zeros(512);
    assert_rejects(r, "tensor 't' row length 100 is not a multiple of the q4_K block size 256");
}

#[test]
fn tensor_data_past_the_end() {
    let r = Raw::new(3, 1, 0).tensor("t", &[16], 0, 0).pad(32).zeros(63);
    assert_rejects(r, "tensor 't' data (64 bytes at data offset 0) runs past the end of the file");
    let r = Raw::new(3, 1, 0).tensor("t", &[16], 0, u64::MAX - 31).pad(32).zeros(64);
    assert_rejects(r, "runs past the end of the file");
}

#[test]
fn misaligned_offset() {
    let r = Raw::new(3, 1, 0).tensor("t", &[4], 0, 8).pad(32).zeros(64);
    assert_rejects(r, "tensor 't' offset 8 is not a multiple of the alignment 32");
}

#[test]
fn overlapping_tensors() {
    let r = Raw::new(3, 2, 0).tensor("a", &[16], 0, 0).tensor("b", &[16], 0, 32).pad(32).zeros(128);
    assert_rejects(r, "tensors 'a' and 'b' overlap");
}

#[test]
fn duplicate_key() {
    let r = Raw::new(3, 0, 2).kv_u32("a.b", 1).kv_u32("a.b", 2);
    assert_rejects(r, "duplicate metadata key 'a.b'");
}

#[test]
fn duplicate_tensor_name() {
    let r = Raw::new(3, 2, 0).tensor("t", &[4], 0, 0).tensor("t", &[4], 0, 32).pad(32).zeros(64);
    assert_rejects(r, "duplicate tensor name 't'");
}

#[test]
fn alignment_zero_not_power_of_two_or_wrong_type() {
    for a in [0u32, 3, 48] {
        let r = Raw::new(3, 0, 1).kv_u32("general.alignment", a);
        assert_rejects(r, &format!("general.alignment = {a} is not a non-zero power of two"));
    }
    let r = Raw::new(3, 0, 1).kv_str("general.alignment", "32");
    assert_rejects(r, "general.alignment has type string, expected u32");
}

#[test]
fn empty_key_and_empty_tensor_name() {
    assert_rejects(Raw::new(3, 0, 1).kv_u32("", 1), "empty metadata key");
    let r = Raw::new(3, 1, 0).tensor("", &[4], 0, 0).pad(32).zeros(32);
    assert_rejects(r, "empty tensor name");
}

#[test]
fn unknown_value_type_and_bad_bool() {
    let r = Raw::new(3, 0, 1).str("k").u32(13).u32(0);
    assert_rejects(r, "unknown metadata value type 13 for key 'k'");
    let r = Raw::new(3, 0, 1).str("flag").u32(7).bytes(&[2]);
    assert_rejects(r, "bool value 2 of key 'flag' is neither 0 nor 1");
}

#[test]
fn io_errors_name_the_file() {
    let e = GgufFile::open("/nonexistent/model.gguf").unwrap_err().to_string();
    assert!(e.starts_with("/nonexistent/model.gguf: "), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let e = GgufFile::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("is a directory"), "{e}");
}

/// Every single-byte corruption of the valid file either parses or fails with an error: never a
/// panic. (Bytes inside tensor data are not interpreted, so most of those still parse.)
#[test]
fn every_single_byte_corruption_is_handled() {
    let full = valid().0;
    for i in 0..full.len() {
        for v in [0x00u8, 0xff, 0x80, 0x7f, 0x01] {
            let mut b = full.clone();
            b[i] = v;
            let _ = GgufFile::from_bytes(b, "x.gguf");
        }
    }
}
