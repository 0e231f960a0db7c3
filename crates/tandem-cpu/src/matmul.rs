//! Quantized matrix multiplication: `y[t] = W x[t]` with `W` in any ggml weight type, used in place
//! from the memory map. As ggml's `mul_mat`, each activation row is first quantized to the weight
//! type's `vec_dot_type` (Q8_0, Q8_1, Q8_K, F16, BF16 or F32), then dotted with each weight row.

use crate::jobs::{matmul_jobs, MatJob};
use crate::{Error, Result};
use tandem_quant::{quantize_row, row_size, vec_dot_type, GgmlType};

/// A weight matrix of `rows` rows of `cols` elements of type `ty` (ggml: ne0 = cols, ne1 = rows).
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    /// `data` is in the packed layout of [`crate::packed`] (groups of 16 rows), not ggml rows.
    pub packed: bool,
}

impl<'a> WeightRef<'a> {
    /// Checks that the bytes hold exactly `rows x cols` elements.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<WeightRef<'a>> {
        let rb = row_size(ty, cols)?;
        if rb.checked_mul(rows) != Some(data.len()) {
            return Err(Error::Shape(format!(
                "{ty} weight of {rows} x {cols} needs {} bytes, got {}",
                rb.saturating_mul(rows),
                data.len()
            )));
        }
        Ok(WeightRef { ty, rows, cols, data, packed: false })
    }

    /// Rows `start..start + n` as a matrix of their own (e.g. one expert of a 3-D tensor); whole
    /// groups of 16 rows of a packed weight.
    pub fn rows(&self, start: usize, n: usize) -> Result<WeightRef<'a>> {
        if start + n > self.rows {
            return Err(Error::Shape(format!("rows {start}..{} of a {}-row weight", start + n, self.rows)));
        }
        let unit = if self.packed { crate::packed::PACK_ROWS } else { 1 };
        if !start.is_multiple_of(unit) || !n.is_multiple_of(unit) {
            return Err(Error::Shape(format!(
                "rows {start}..{} of a weight packed in groups of {unit} rows",
                start + n
            )));
        }
        let ub = self.data.len() / (self.rows / unit).max(1);
        let data = &self.data[start / unit * ub..(start + n) / unit * ub];
        Ok(WeightRef { ty: self.ty, rows: n, cols: self.cols, data, packed: self.packed })
    }
}

/// Activation rows quantized to the `vec_dot_type` of a weight type.
pub struct QuantizedActs {
    pub ty: GgmlType,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: Vec<u8>,
}

impl QuantizedActs {
    pub fn row(&self, t: usize) -> &[u8] {
        &self.data[t * self.row_bytes..(t + 1) * self.row_bytes]
    }

    pub fn n_rows(&self) -> usize {
        self.data.len() / self.row_bytes.max(1)
    }
}

/// Quantizes the rows of `x` (each `cols` long) as ggml does before multiplying them with weights
/// of type `weight_ty`.
pub fn quantize_activations(weight_ty: GgmlType, x: &[f32], cols: usize) -> Result<QuantizedActs> {
    let ty = vec_dot_type(weight_ty);
    let row_bytes = row_size(ty, cols)?;
    if cols == 0 || !x.len().is_multiple_of(cols) {
        return Err(Error::Shape(format!("{} activations are not rows of {cols}", x.len())));
    }
    let n = x.len() / cols;
    let mut data = vec![0u8; n * row_bytes];
    for (src, dst) in x.chunks_exact(cols).zip(data.chunks_exact_mut(row_bytes)) {
        match ty {
            GgmlType::Q8_0 | GgmlType::Q8_1 => quantize_q8_act(ty, src, dst),
            #[cfg(target_arch = "x86_64")]
            GgmlType::Q8_K if crate::Isa::detected() >= crate::Isa::Avx512 => {
                for (x, y) in src.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
                    // SAFETY: AVX-512 is present; the chunks are one block each.
                    unsafe { q8k_avx512::block(x, y) };
                }
            }
            #[cfg(target_arch = "x86_64")]
            GgmlType::Q8_K if crate::Isa::detected() >= crate::Isa::Avx2 => {
                for (x, y) in src.chunks_exact(256).zip(dst.chunks_exact_mut(292)) {
                    // SAFETY: AVX2 is present; the chunks are one block each.
                    unsafe { q8k_avx2::block(x, y) };
                }
            }
            _ => quantize_row(ty, src, dst)?,
        }
    }
    Ok(QuantizedActs { ty, cols, row_bytes, data })
}

/// Activations to Q8_0 / Q8_1 as ggml's CPU backend quantizes them on x86 (`quantize_row_q8_0` /
/// `quantize_row_q8_1` in ggml-cpu/arch/x86/quants.c): `d = max/127`, multiply by `127/max`,
/// round half to even. The reference quantizer (`quantize_row_q8_0_ref`) divides and rounds half
/// away from zero; the difference decides which activations land one step apart, and matching
/// llama.cpp's logits needs the same steps.
fn quantize_q8_act(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    let bsz = ty.type_size();
    for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(bsz)) {
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max / 127.0;
        let id = if max != 0.0 { 127.0 / max } else { 0.0 };
        y[..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        let qs_at = if ty == GgmlType::Q8_1 { 4 } else { 2 };
        let mut sum = 0i32;
        for (j, v) in x.iter().enumerate() {
            // Round half to even without a libm call: adding and taking away 1.5 * 2^23 leaves
            // the nearest integer (ties to even) for |v * id| <= 127, as `round_ties_even` would.
            let q = ((v * id + 12_582_912.0) - 12_582_912.0) as i32;
            sum += q;
            y[qs_at + j] = q as i8 as u8;
        }
        if ty == GgmlType::Q8_1 {
            y[2..4].copy_from_slice(&half::f16::from_f32(d * sum as f32).to_bits().to_le_bytes());
        }
    }
}

/// ggml's `quantize_row_q8_K_ref` (what llama.cpp's x86 build runs for Q8_K activations), 16
/// values at a time, byte-identical with tandem-quant's port of it.
#[cfg(target_arch = "x86_64")]
mod q8k_avx512 {
    use std::arch::x86_64::*;

    /// One block: 256 values into 292 bytes (f32 d, 256 i8, 16 i16 sums of 16).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
    pub(super) unsafe fn block(x: &[f32], y: &mut [u8]) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            assert!(x.len() == 256 && y.len() == 292);
            let p = x.as_ptr();
            let mut amax = _mm512_setzero_ps();
            for i in 0..16 {
                amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(p.add(16 * i))));
            }
            let amax = _mm512_reduce_max_ps(amax);
            if amax == 0.0 {
                y.fill(0);
                return;
            }
            // The first value whose magnitude is the largest, as the reference's strict `>` keeps it.
            let target = _mm512_set1_ps(amax);
            let mut max = 0f32;
            for i in 0..16 {
                let m = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(_mm512_loadu_ps(p.add(16 * i))), target);
                if m != 0 {
                    max = x[16 * i + m.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let sv = _mm512_set1_ps(iscale);
            let top = _mm512_set1_epi32(127);
            for i in 0..16 {
                let v = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * i)), sv);
                let q = _mm512_min_epi32(
                    _mm512_cvtps_epi32(_mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v)),
                    top,
                );
                _mm_storeu_si128(y.as_mut_ptr().add(4 + 16 * i) as *mut __m128i, _mm512_cvtepi32_epi8(q));
                let sum = _mm512_reduce_add_epi32(q) as i16;
                y[260 + 2 * i..262 + 2 * i].copy_from_slice(&sum.to_le_bytes());
            }
            y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
    }
}

/// [`q8k_avx512`] with AVX2, 8 values at a time: the same bytes. (A decode step quantizes a dozen
/// activation rows a layer on the thread that leads it while the others wait; the scalar loop was
/// 2.5% of that thread's time in a Zen 3 decode.)
#[cfg(target_arch = "x86_64")]
mod q8k_avx2 {
    use std::arch::x86_64::*;

    /// One block: 256 values into 292 bytes (f32 d, 256 i8, 16 i16 sums of 16).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(x: &[f32], y: &mut [u8]) {
        // SAFETY: the caller upholds this function's `# Safety` contract.
        unsafe {
            assert!(x.len() == 256 && y.len() == 292);
            let p = x.as_ptr();
            let abs = |v: __m256| _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
            // max_ps returns its second operand where either is NaN: a NaN never becomes the
            // largest magnitude, as with the reference's `>`.
            let mut amax = _mm256_setzero_ps();
            for i in 0..32 {
                amax = _mm256_max_ps(abs(_mm256_loadu_ps(p.add(8 * i))), amax);
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), amax);
            let amax = lanes.iter().fold(0f32, |m, &v| if v > m { v } else { m });
            if amax == 0.0 {
                y.fill(0);
                return;
            }
            // The first value whose magnitude is the largest, as the reference's strict `>` keeps it.
            let target = _mm256_set1_ps(amax);
            let mut max = 0f32;
            for i in 0..32 {
                let m = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs(_mm256_loadu_ps(p.add(8 * i))), target));
                if m != 0 {
                    max = x[8 * i + m.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let sv = _mm256_set1_ps(iscale);
            let top = _mm256_set1_epi32(127);
            // vpacks* work within 128-bit halves: this puts the 32 bytes of four vectors back in order.
            let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            for g in 0..8 {
                let q: [__m256i; 4] = std::array::from_fn(|k| {
                    let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(32 * g + 8 * k)), sv);
                    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                    // A NaN converts to i32::MIN, which vpacks would saturate to -128; the
                    // reference's rounding makes it 0 (AVX-512's truncating vpmovdb does too).
                    let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
                    _mm256_and_si256(_mm256_min_epi32(_mm256_cvtps_epi32(r), top), ordered)
                });
                let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                let bytes = _mm256_permutevar8x32_epi32(bytes, order);
                _mm256_storeu_si256(y.as_mut_ptr().add(4 + 32 * g) as *mut __m256i, bytes);
                for h in 0..2 {
                    let s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
                    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
                    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
                    let at = 260 + 2 * (2 * g + h);
                    y[at..at + 2].copy_from_slice(&(_mm_cvtsi128_si32(s) as i16).to_le_bytes());
                }
            }
            y[..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Blocks that try the quantizer: the largest magnitude first negative then positive, all
    /// zero, values landing on .5 after scaling, tiny values, a NaN beside normal values, and
    /// a value that scales to exactly -127 (the clamp at 127 is then never needed, but a rounding
    /// of 127.5 would show).
    fn blocks() -> Vec<f32> {
        let mut x: Vec<f32> = (0..256 * 8).map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.0173).collect();
        x[5] = -9.0;
        x[9] = 9.0;
        x[256..512].fill(0.0);
        for (i, v) in x[512..768].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { (i % 50) as f32 * 0.5 - 12.0 };
        }
        x[768..1024].iter_mut().for_each(|v| *v *= 1e-30);
        x[1024 + 17] = f32::NAN;
        x[1280 + 255] = -1000.0;
        x
    }

    type Block = unsafe fn(&[f32], &mut [u8]);

    #[test]
    fn every_level_quantizes_q8_k_as_the_reference() {
        let x = blocks();
        let mut want = vec![0u8; 292 * x.len() / 256];
        tandem_quant::quantize_row(GgmlType::Q8_K, &x, &mut want).unwrap();
        let isa = crate::Isa::detected();
        let levels: [(&str, bool, Block); 2] = [
            ("avx512", isa >= crate::Isa::Avx512, q8k_avx512::block),
            ("avx2", isa >= crate::Isa::Avx2, q8k_avx2::block),
        ];
        for (name, present, block) in levels {
            if !present {
                println!("q8_k quantizer {name}: not checked, this machine lacks it");
                continue;
            }
            let mut got = vec![0xAAu8; want.len()];
            for (x, y) in x.chunks_exact(256).zip(got.chunks_exact_mut(292)) {
                // SAFETY: the level is present; one block each.
                unsafe { block(x, y) };
            }
            for (b, (g, w)) in got.chunks_exact(292).zip(want.chunks_exact(292)).enumerate() {
                assert_eq!(g, w, "{name}: block {b}");
            }
            println!("q8_k quantizer {name}: {} blocks byte-identical", got.len() / 292);
        }
    }
}

/// `y[t][r] = dot(W[r], x[t])` for `n = x.len() / w.cols` tokens; `y` is `[n][w.rows]`.
pub fn matmul(pool: &rayon::ThreadPool, w: &WeightRef, x: &[f32], y: &mut [f32]) -> Result<()> {
    let acts = quantize_activations(w.ty, x, w.cols)?;
    matmul_quantized(pool, w, &acts, y)
}

/// [`matmul`] with activations already quantized (reused across weights of the same type).
pub fn matmul_quantized(pool: &rayon::ThreadPool, w: &WeightRef, acts: &QuantizedActs, y: &mut [f32]) -> Result<()> {
    let n = acts.n_rows();
    if y.len() != n * w.rows {
        return Err(Error::Shape(format!("matmul of {} rows for {n} tokens into {} outputs", w.rows, y.len())));
    }
    matmul_jobs(pool, vec![MatJob { w: *w, acts, out: y }])?;
    Ok(())
}
