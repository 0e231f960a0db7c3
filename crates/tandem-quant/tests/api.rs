//! The public API's contracts: unsupported types and bad lengths are errors (never panics),
//! round trips stay within each format's resolution, and the activation-type table is ggml's.

mod common;

use common::Rng;
use tandem_quant::{
    dequantize_row, quantize_row, row_size, vec_dot, vec_dot_type, Error, GgmlType, DEQUANTIZE_TYPES, QUANTIZE_TYPES,
    VEC_DOT_TYPES,
};

#[test]
fn unsupported_types_are_named_in_the_error() {
    for ty in GgmlType::ALL {
        let n = ty.block_size();
        let bytes = vec![0u8; ty.type_size()];
        let mut out = vec![0f32; n];
        let cases = [
            ("dequantize", DEQUANTIZE_TYPES.contains(&ty), dequantize_row(ty, &bytes, &mut out).err()),
            (
                "quantize",
                QUANTIZE_TYPES.contains(&ty),
                quantize_row(ty, &vec![0f32; n], &mut vec![0u8; ty.type_size()]).err(),
            ),
            ("vec_dot", VEC_DOT_TYPES.contains(&ty), {
                let act = vec![0u8; vec_dot_type(ty).row_bytes(n as u64).unwrap_or(0) as usize];
                vec_dot(ty, n, &bytes, &act).err()
            }),
        ];
        for (op, supported, err) in cases {
            if supported {
                assert_eq!(err, None, "{ty} {op}");
                continue;
            }
            let err = err.unwrap_or_else(|| panic!("{ty} {op} should be unsupported"));
            assert_eq!(err, Error::UnsupportedType { ty, op });
            let msg = err.to_string();
            assert_eq!(msg, format!("unsupported tensor type {} (id {}): {op} not implemented", ty.name(), ty.id()));
        }
    }
    let msg = dequantize_row(GgmlType::TQ1_0, &[0; 54], &mut [0.0; 256]).unwrap_err().to_string();
    assert_eq!(msg, "unsupported tensor type tq1_0 (id 34): dequantize not implemented");
    let msg = quantize_row(GgmlType::IQ2_XXS, &[0.0; 256], &mut [0; 66]).unwrap_err().to_string();
    assert_eq!(msg, "unsupported tensor type iq2_xxs (id 16): quantize not implemented");
}

#[test]
fn bad_lengths_are_errors_not_panics() {
    for ty in QUANTIZE_TYPES {
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let n = 2 * bs.max(32);
        let bytes = row_size(ty, n).unwrap();
        // Source one byte short and one byte long.
        for len in [bytes - 1, bytes + 1, 0] {
            let err = dequantize_row(ty, &vec![0u8; len], &mut vec![0f32; n]).unwrap_err();
            assert!(
                matches!(err, Error::BufferLength { got, expected, .. } if got == len && expected == bytes),
                "{ty}: {err}"
            );
            let err = quantize_row(ty, &vec![0f32; n], &mut vec![0u8; len]).unwrap_err();
            assert!(matches!(err, Error::BufferLength { .. }), "{ty}: {err}");
        }
        if bs > 1 {
            // Element counts that are not whole blocks.
            let err = dequantize_row(ty, &vec![0u8; ts], &mut vec![0f32; bs - 1]).unwrap_err();
            assert_eq!(err, Error::PartialBlock { ty, n: bs - 1, block: bs });
            assert!(err.to_string().contains("not a whole number"), "{err}");
            let err = quantize_row(ty, &vec![0f32; bs + 1], &mut vec![0u8; 2 * ts]).unwrap_err();
            assert_eq!(err, Error::PartialBlock { ty, n: bs + 1, block: bs });
        }
        // Empty rows are fine.
        dequantize_row(ty, &[], &mut []).unwrap();
        quantize_row(ty, &[], &mut []).unwrap();
    }
    for ty in tandem_quant::GRID_TYPES {
        let n = 512;
        let bytes = row_size(ty, n).unwrap();
        for len in [bytes - 1, bytes + 1, 0] {
            let err = dequantize_row(ty, &vec![0u8; len], &mut vec![0f32; n]).unwrap_err();
            assert!(matches!(err, Error::BufferLength { .. }), "{ty}: {err}");
        }
        let err = dequantize_row(ty, &vec![0u8; ty.type_size()], &mut vec![0f32; 255]).unwrap_err();
        assert_eq!(err, Error::PartialBlock { ty, n: 255, block: 256 });
        dequantize_row(ty, &[], &mut []).unwrap();
    }
    for ty in VEC_DOT_TYPES {
        let act_ty = vec_dot_type(ty);
        let n = 512;
        let w = vec![0u8; row_size(ty, n).unwrap()];
        let a = vec![0u8; row_size(act_ty, n).unwrap()];
        assert_eq!(vec_dot(ty, n, &w, &a).unwrap(), 0.0, "{ty}");
        assert!(vec_dot(ty, n, &w[1..], &a).is_err(), "{ty}");
        assert!(vec_dot(ty, n, &w, &a[1..]).is_err(), "{ty}");
        assert!(vec_dot(ty, n / 2, &w, &a).is_err(), "{ty}");
        assert!(vec_dot(ty, usize::MAX, &w, &a).is_err(), "{ty}");
        if ty.block_size() == 1 {
            assert_eq!(row_size(ty, usize::MAX), Err(Error::RowTooLarge { ty, n: usize::MAX }));
        }
        if ty.block_size() > 1 {
            assert!(matches!(vec_dot(ty, n - 1, &w, &a), Err(Error::PartialBlock { .. })), "{ty}");
        }
    }
    let msg = dequantize_row(GgmlType::Q4_K, &[0u8; 143], &mut [0f32; 256]).unwrap_err().to_string();
    assert_eq!(msg, "q4_K: source is 143 bytes, but 256 elements take 144 bytes");
}

#[test]
fn vec_dot_types_follow_ggml() {
    use GgmlType::*;
    let table = [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (IQ4_NL, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2_K, Q8_K),
        (Q3_K, Q8_K),
        (Q4_K, Q8_K),
        (Q5_K, Q8_K),
        (Q6_K, Q8_K),
        (IQ4_XS, Q8_K),
        (IQ2_XXS, Q8_K),
        (IQ2_XS, Q8_K),
        (IQ2_S, Q8_K),
        (IQ3_XXS, Q8_K),
        (IQ3_S, Q8_K),
        (IQ1_S, Q8_K),
        (IQ1_M, Q8_K),
    ];
    for (w, a) in table {
        assert_eq!(vec_dot_type(w), a, "{w}");
    }
    assert_eq!(table.len(), VEC_DOT_TYPES.len());
}

/// Worst |x - dequant(quant(x))| relative to the block's absolute maximum, per type.
#[test]
fn round_trip_error_is_within_the_format_resolution() {
    // (type, bound on |error| / block absmax): half a step of each format, plus the clamped
    // extreme of the symmetric types (Q4_0: d = max/-8, so -max lands one full step off).
    let bounds = [
        (GgmlType::F32, 0.0),
        (GgmlType::F16, 5e-4),
        (GgmlType::BF16, 4e-3),
        (GgmlType::Q8_0, 5e-3),
        (GgmlType::Q8_1, 5e-3),
        (GgmlType::Q8_K, 5e-3),
        (GgmlType::Q6_K, 0.025),
        (GgmlType::Q5_0, 0.07),
        (GgmlType::Q5_1, 0.035),
        (GgmlType::Q5_K, 0.045),
        (GgmlType::Q4_0, 0.13),
        (GgmlType::Q4_1, 0.07),
        (GgmlType::Q4_K, 0.09),
        (GgmlType::IQ4_NL, 0.12),
        (GgmlType::IQ4_XS, 0.12),
        (GgmlType::Q3_K, 0.25),
        (GgmlType::Q2_K, 0.45),
    ];
    assert_eq!(bounds.len(), QUANTIZE_TYPES.len());
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let n = 4096;
    let x: Vec<f32> = (0..n).map(|i| rng.normal(if i % 512 < 256 { 1.0 } else { 0.01 })).collect();
    for (ty, bound) in bounds {
        let mut q = vec![0u8; row_size(ty, n).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; n];
        dequantize_row(ty, &q, &mut y).unwrap();
        let bs = ty.block_size().max(32);
        let mut worst = 0f32;
        for (xb, yb) in x.chunks(bs).zip(y.chunks(bs)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in xb.iter().zip(yb) {
                worst = worst.max((a - b).abs() / amax);
            }
        }
        assert!(worst <= bound, "{ty}: worst relative round-trip error {worst} > {bound}");
    }
}

#[test]
fn q8_k_quantization_properties() {
    let mut rng = Rng(7);
    let mut x: Vec<f32> = (0..512).map(|_| rng.normal(0.3)).collect();
    x[77] = -5.0; // ggml maps the largest magnitude to q = -127, whatever its sign
    x[300] = 2.0;
    let mut q = vec![0u8; 2 * 292];
    quantize_row(GgmlType::Q8_K, &x, &mut q).unwrap();
    for (b, xb) in q.chunks_exact(292).zip(x.chunks_exact(256)) {
        let d = f32::from_le_bytes(b[0..4].try_into().unwrap());
        let qs: Vec<i8> = b[4..260].iter().map(|&v| v as i8).collect();
        let (imax, max) =
            xb.iter().enumerate().fold((0, 0f32), |m, (i, &v)| if v.abs() > m.1.abs() { (i, v) } else { m });
        // iscale = -127 / max and d = 1 / iscale, so q = -127 at the largest magnitude.
        assert_eq!(d, 1.0 / (-127.0 / max));
        assert_eq!(qs[imax], -127, "largest magnitude");
        assert!(qs.iter().all(|&v| v >= -127), "never -128");
        for (g, s) in b[260..292].chunks_exact(2).enumerate() {
            let sum: i32 = qs[16 * g..16 * g + 16].iter().map(|&v| v as i32).sum();
            assert_eq!(i16::from_le_bytes([s[0], s[1]]) as i32, sum, "bsums[{g}]");
        }
    }
    // An all-zero block has d = 0, qs = 0 and (unlike ggml, which leaves them) zero bsums.
    let mut q = vec![0xAAu8; 292];
    quantize_row(GgmlType::Q8_K, &[0.0; 256], &mut q).unwrap();
    assert!(q.iter().all(|&b| b == 0));
}

#[test]
fn f32_rows_round_trip_bit_exactly() {
    let x = [1.5f32, -0.0, f32::INFINITY, f32::from_bits(0x7fc0_1234), f32::MIN_POSITIVE / 8.0];
    let mut q = vec![0u8; 20];
    quantize_row(GgmlType::F32, &x, &mut q).unwrap();
    let mut y = [0f32; 5];
    dequantize_row(GgmlType::F32, &q, &mut y).unwrap();
    assert_eq!(x.map(f32::to_bits), y.map(f32::to_bits));
}

#[test]
fn hostile_inputs_never_panic() {
    // NaN, infinities, huge and subnormal values through every quantizer, and random bytes
    // through every decoder and dot product (debug builds check integer overflow).
    let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38, -3e38, 1e-45, -0.0, 0.0, 1.0];
    let mut rng = Rng(42);
    let x: Vec<f32> =
        (0..1024).map(|i| if i % 3 == 0 { specials[i % specials.len()] } else { rng.normal(1e30) }).collect();
    for ty in QUANTIZE_TYPES {
        let mut q = vec![0u8; row_size(ty, x.len()).unwrap()];
        quantize_row(ty, &x, &mut q).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y).unwrap();
    }
    for ty in VEC_DOT_TYPES {
        let n = 1024;
        let random = |len: usize, rng: &mut Rng| (0..len).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>();
        let w = random(row_size(ty, n).unwrap(), &mut rng);
        let a = random(row_size(vec_dot_type(ty), n).unwrap(), &mut rng);
        vec_dot(ty, n, &w, &a).unwrap();
        let mut y = vec![0f32; n];
        dequantize_row(ty, &w, &mut y).unwrap();
    }
}
