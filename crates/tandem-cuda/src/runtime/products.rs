//! The [`Runtime`]'s matrix products: the batched matvec kernels (up to [`MAX_MATVEC_TOKENS`]
//! tokens), prefill gemms through cuBLAS on weights dequantized in chunks ([`GemmPrecision`]),
//! dequantization, and activations rounded as ggml's CPU backend rounds them.

use super::{grid, grid_yz, int, long, Runtime};
use crate::driver::Gemm;
use crate::memory::{DeviceBuffer, Span};
use crate::{dequant_name, matvec_name, weight_bytes, Batched, Elem, Error, Result, MATVEC_TYPES, MAX_MATVEC_TOKENS};
use tandem_quant::GgmlType;

/// Elements of a weight dequantized at once for a prefill gemm (64 MiB of f32).
const GEMM_CHUNK_ELEMS: usize = 16 << 20;

/// How a prefill gemm (more than [`MAX_MATVEC_TOKENS`] tokens) multiplies a quantized weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPrecision {
    /// The weight dequantized to f32 and an f32 gemm (cuBLAS `CUBLAS_COMPUTE_32F`, no TF32): the
    /// products of the values given, so activations rounded as the CPU rounds them
    /// (`Runtime::round_acts`) give the CPU's results up to float order. The default.
    F32,
    /// The weight dequantized to f16 and the activations scaled per token into f16's range, an
    /// f16 gemm with f32 accumulation (tensor cores): faster, but each value rounded to 11 bits,
    /// so prefill logits move by the rounding the CPU does not do (`TANDEM_CUDA_GEMM=f16`).
    F16,
}

impl GemmPrecision {
    /// `TANDEM_CUDA_GEMM`: `f32` (or unset) or `f16`.
    pub fn from_env() -> Result<GemmPrecision> {
        match std::env::var("TANDEM_CUDA_GEMM") {
            Err(_) => Ok(GemmPrecision::F32),
            Ok(v) if v == "f32" => Ok(GemmPrecision::F32),
            Ok(v) if v == "f16" => Ok(GemmPrecision::F16),
            Ok(v) => Err(Error::GemmSetting(v)),
        }
    }
}

/// Scratch of the prefill gemm: the dequantized weight chunk (f32, or f16 bits), and for the f16
/// gemm the scaled activations and their per-token scales.
#[derive(Default)]
pub(super) struct GemmScratch {
    w32: Option<DeviceBuffer<f32>>,
    w: Option<DeviceBuffer<u16>>,
    x: Option<DeviceBuffer<u16>>,
    scales: Option<DeviceBuffer<f32>>,
}

/// The element types [`Runtime::dequant`] writes: f32, or f16 as its bits.
pub trait DequantOut {
    const F32: bool;
}
impl DequantOut for f32 {
    const F32: bool = true;
}
impl DequantOut for u16 {
    const F32: bool = false;
}

impl Runtime {
    /// Batched matvec with the kernel of `ty` (see [`Batched`]): the matrices at `w` (bytes), the
    /// input at `x`, the output at `y`; `rows x cols` each.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(
        &self,
        ty: GgmlType,
        w: Span<u8>,
        x: Span<f32>,
        y: Span<f32>,
        rows: usize,
        cols: usize,
        b: &Batched,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        if b.n_tokens == 0 || b.n_tokens > MAX_MATVEC_TOKENS || b.n_groups == 0 || b.x_grp_div == 0 || b.n_mats == 0 {
            return Err(Error::Shape(format!(
                "matvec: {} tokens (1..={MAX_MATVEC_TOKENS}), {} groups, {} matrices",
                b.n_tokens, b.n_groups, b.n_mats
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let mat = weight_bytes(ty, rows, cols)?;
        if b.w_grp_bytes < mat && b.n_mats > 1 {
            return Err(Error::Shape(format!("matvec: matrices {} bytes apart, each {mat}", b.w_grp_bytes)));
        }
        let wp = w.ptr((b.n_mats - 1) * b.w_grp_bytes + mat, "matvec weight")?;
        let (nt, ng) = (b.n_tokens - 1, b.n_groups - 1);
        let xp = x.ptr(nt * b.x_tok + (ng / b.x_grp_div) * b.x_grp + cols, "matvec x")?;
        let yp = y.ptr(nt * b.y_tok + ng * b.y_grp + rows, "matvec y")?;
        let (idp, ids_per, ids_row) = match &b.ids {
            Some((ids, per, row)) => {
                if *per == 0 {
                    return Err(Error::Shape("matvec: 0 ids per row".into()));
                }
                (ids.ptr((ng / per) * row + per, "matvec ids")?, int(*per, "matvec ids")?, long(*row, "matvec ids")?)
            }
            None => {
                if b.n_mats < b.n_groups {
                    return Err(Error::Shape(format!("matvec: {} groups of {} matrices", b.n_groups, b.n_mats)));
                }
                (0u64, 1i32, 0i64)
            }
        };
        let (r, c, n) = (int(rows, "matvec rows")?, int(cols, "matvec cols")?, b.n_tokens as i32);
        let (xt, xg, xd) = (long(b.x_tok, "matvec")?, long(b.x_grp, "matvec")?, int(b.x_grp_div, "matvec")?);
        let (yt, yg, wg, nm) = (
            long(b.y_tok, "matvec")?,
            long(b.y_grp, "matvec")?,
            long(b.w_grp_bytes, "matvec")?,
            int(b.n_mats, "matvec")?,
        );
        self.launch(
            &matvec_name(ty),
            [grid(rows.div_ceil(4))?, grid_yz(b.n_groups, "matvec groups")?, 1],
            [32, 4, 1],
            &mut args![wp, xp, yp, r, c, n, xt, xg, xd, yt, yg, wg, idp, ids_per, ids_row, nm],
        )
    }

    /// `y[t] = W x[t]` for `n_tokens` rows of `x` (`[n][cols]`, output `[n][rows]`): the matvec
    /// kernel 8 tokens at a time, or beyond 8 tokens (with cuBLAS) the weight dequantized in chunks
    /// of rows and a gemm, as [`Runtime::gemm_precision`] says. Both take `x` as it is (the
    /// caller rounds it as the CPU would, see [`Runtime::round_acts`]), except that the f16 gemm
    /// rounds it to f16.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        ty: GgmlType,
        w: Span<u8>,
        x: &DeviceBuffer<f32>,
        y: &DeviceBuffer<f32>,
        rows: usize,
        cols: usize,
        n_tokens: usize,
    ) -> Result<()> {
        let f16 = self.precision == GemmPrecision::F16;
        let gemm_ok = self.has_cublas()
            && (ty == GgmlType::F32
                || (self.has_kernel(&dequant_name(ty, !f16))
                    && (!f16
                        || (self.has_kernel("tandem_f32_to_f16_scaled") && self.has_kernel("tandem_scale_rows_f32")))));
        if n_tokens <= MAX_MATVEC_TOKENS || !gemm_ok {
            for t0 in (0..n_tokens).step_by(MAX_MATVEC_TOKENS) {
                let n = (n_tokens - t0).min(MAX_MATVEC_TOKENS);
                let b = Batched::plain(n, rows, cols);
                self.matvec(ty, w, x.span(t0 * cols), y.span(t0 * rows), rows, cols, &b)?;
            }
            return Ok(());
        }
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        let wp = w.ptr(weight_bytes(ty, rows, cols)?, "gemm weight")?;
        let xp = x.at(0, n_tokens * cols, "gemm x")?;
        let yp = y.at(0, n_tokens * rows, "gemm y")?;
        let (m, k, n) = (int(rows, "gemm rows")?, int(cols, "gemm cols")?, int(n_tokens, "gemm tokens")?);
        if ty == GgmlType::F32 {
            self.ledger.launch(1);
            return self.drv.gemm(&Gemm { a: wp, b: xp, c: yp, m, n, k, ldc: m, f16_inputs: false });
        }
        let mut scratch = self.gemm.lock().map_err(|_| Error::Shape("gemm scratch lock poisoned".into()))?;
        let GemmScratch { w32, w: ws, x: xs, scales } = &mut *scratch;
        let dims = (rows, cols, n_tokens);
        if !f16 {
            let wf = self.scratch(w32, Self::chunk_rows(rows, cols) * cols, "a dequantized weight chunk (f32)")?;
            return self.gemm_chunks(ty, w, wf, xp, y, dims, false);
        }
        let xh = self.scratch(xs, n_tokens * cols, "prefill activations (f16)")?;
        let sc = self.scratch(scales, n_tokens, "prefill activation scales")?;
        let (xh_p, sc_p) = (xh.at(0, n_tokens * cols, "gemm")?, sc.at(0, n_tokens, "gemm")?);
        self.launch_rows("tandem_f32_to_f16_scaled", n_tokens, &mut args![xp, xh_p, sc_p, k])?;
        let wh = self.scratch(ws, Self::chunk_rows(rows, cols) * cols, "a dequantized weight chunk (f16)")?;
        self.gemm_chunks(ty, w, wh, xh_p, y, dims, true)?;
        self.scale_rows(y, sc, rows, n_tokens * rows)
    }

    /// Weight rows dequantized at a time for a gemm.
    fn chunk_rows(rows: usize, cols: usize) -> usize {
        (GEMM_CHUNK_ELEMS / cols.max(1)).clamp(1, rows.max(1))
    }

    /// `y = W b` (`dims`: W's rows and columns, b's tokens) by chunks of [`Self::chunk_rows`]
    /// weight rows, each dequantized into `wbuf` (f16 with `f16_inputs`, else f32) and multiplied
    /// against `b` by cuBLAS.
    #[allow(clippy::too_many_arguments)]
    fn gemm_chunks<T: Elem + DequantOut>(
        &self,
        ty: GgmlType,
        w: Span<u8>,
        wbuf: &DeviceBuffer<T>,
        b: u64,
        y: &DeviceBuffer<f32>,
        (rows, cols, n_tokens): (usize, usize, usize),
        f16_inputs: bool,
    ) -> Result<()> {
        let (m, k, n) = (int(rows, "gemm rows")?, int(cols, "gemm cols")?, int(n_tokens, "gemm tokens")?);
        let (chunk, row_bytes) = (Self::chunk_rows(rows, cols), weight_bytes(ty, 1, cols)?);
        for r0 in (0..rows).step_by(chunk) {
            let nr = (rows - r0).min(chunk);
            self.dequant(ty, w.skip(r0 * row_bytes), wbuf, nr * cols)?;
            let c = y.at(r0, (n_tokens - 1) * rows + nr, "gemm y")?;
            let a = wbuf.at(0, nr * cols, "gemm")?;
            self.ledger.launch(1);
            self.drv.gemm(&Gemm { a, b, c, m: nr as i32, n, k, ldc: m, f16_inputs })?;
        }
        Ok(())
    }

    /// The scratch buffer in `slot`, grown to at least `n` values.
    fn scratch<'a, T: Elem>(
        &self,
        slot: &'a mut Option<DeviceBuffer<T>>,
        n: usize,
        what: &str,
    ) -> Result<&'a DeviceBuffer<T>> {
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            *slot = None;
            *slot = Some(self.alloc::<T>(n.max(1), what)?);
        }
        slot.as_ref().ok_or_else(|| Error::Shape(format!("{what}: no scratch buffer")))
    }

    /// `out[..n] = W` for the `n` values of a weight of type `ty` at `w` (bytes), as f32 or as f16
    /// bits (rounded to nearest), by the type of `out`.
    pub fn dequant<T: Elem + DequantOut>(
        &self,
        ty: GgmlType,
        w: Span<u8>,
        out: &DeviceBuffer<T>,
        n: usize,
    ) -> Result<()> {
        if !MATVEC_TYPES.contains(&ty) {
            return Err(Error::UnsupportedType(ty));
        }
        let wp = w.ptr(weight_bytes(ty, 1, n)?, "dequant weight")?;
        let (op, n64) = (out.at(0, n, "dequant out")?, n as i64);
        self.launch_1d(&dequant_name(ty, T::F32), n, &mut args![wp, op, n64])
    }

    /// The first `cols` values of `n_rows` rows of `x` (`x_stride` apart) rounded as ggml's CPU
    /// backend rounds activations for weights of type `weight_ty` (its vec_dot_type: Q8_0 or
    /// Q8_K blocks, f16, bf16), into the same places of `y` (rows `y_stride` apart). `false` (and
    /// nothing queued) for types whose products take the values as they are (f32).
    #[allow(clippy::too_many_arguments)]
    pub fn round_acts(
        &self,
        weight_ty: GgmlType,
        x: Span<f32>,
        y: Span<f32>,
        n_rows: usize,
        cols: usize,
        x_stride: usize,
        y_stride: usize,
    ) -> Result<bool> {
        let (name, block) = match tandem_quant::vec_dot_type(weight_ty) {
            GgmlType::Q8_0 => ("tandem_round_q8_0", 32),
            GgmlType::Q8_K => ("tandem_round_q8_K", 256),
            GgmlType::F16 => ("tandem_round_f16", 1),
            GgmlType::BF16 => ("tandem_round_bf16", 1),
            _ => return Ok(false),
        };
        if !cols.is_multiple_of(block) || cols > x_stride || cols > y_stride {
            return Err(Error::Shape(format!(
                "{name}: rows of {cols} values (blocks of {block}, strides {x_stride}/{y_stride})"
            )));
        }
        if n_rows == 0 || cols == 0 {
            return Ok(true);
        }
        let xp = x.ptr((n_rows - 1) * x_stride + cols, "round x")?;
        let yp = y.ptr((n_rows - 1) * y_stride + cols, "round y")?;
        let (c, xs, ys) = (int(cols, "round")?, long(x_stride, "round")?, long(y_stride, "round")?);
        self.launch_rows(name, n_rows, &mut args![xp, yp, c, xs, ys])?;
        Ok(true)
    }

    /// `out[..n] = f16(x)` (as bits).
    pub fn f32_to_f16(&self, x: &DeviceBuffer<f32>, out: &DeviceBuffer<u16>, n: usize) -> Result<()> {
        let (xp, op, n64) = (x.at(0, n, "f32_to_f16 x")?, out.at(0, n, "f32_to_f16 out")?, n as i64);
        self.launch_1d("tandem_f32_to_f16", n, &mut args![xp, op, n64])
    }
}
