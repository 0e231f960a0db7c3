//! The [`Runtime`]'s element-wise kernels (kernels/ABI.md): RMS norm, rope, SwiGLU, additions and
//! scalings, strided row copies.

use super::{grid, grid_yz, int, long, Runtime};
use crate::memory::{DeviceBuffer, Span};
use crate::{CopyRows, Error, Result};

impl Runtime {
    /// RMS norm of `n_rows` rows of `dim` values at `x[r * row_stride ..]`, times `w`.
    pub fn rmsnorm(
        &self,
        x: Span<f32>,
        n_rows: usize,
        row_stride: usize,
        dim: usize,
        w: Option<&DeviceBuffer<f32>>,
        eps: f32,
    ) -> Result<()> {
        if n_rows == 0 {
            return Ok(());
        }
        if dim == 0 || dim > row_stride {
            return Err(Error::Shape(format!("rmsnorm: {dim} values in rows of {row_stride}")));
        }
        let xp = x.ptr((n_rows - 1) * row_stride + dim, "rmsnorm x")?;
        let wp = match w {
            Some(w) => w.at(0, dim, "rmsnorm weight")?,
            None => 0,
        };
        let (d, rs, yp) = (int(dim, "rmsnorm dim")?, long(row_stride, "rmsnorm")?, xp);
        self.launch_rows("tandem_rmsnorm_f32", n_rows, &mut args![xp, wp, yp, d, rs, eps])
    }

    /// Rotary embedding of `n_rows` rows of `n_heads` heads at `x[t * row_stride + h *
    /// head_stride ..]`; the first `n_dims` values of each head rotate with `cs[t * n_dims ..]`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: Span<f32>,
        cs: Span<f32>,
        n_rows: usize,
        n_heads: usize,
        head_stride: usize,
        row_stride: usize,
        n_dims: usize,
        neox: bool,
    ) -> Result<()> {
        if n_dims == 0 || !n_dims.is_multiple_of(2) || n_dims / 2 > 1024 || n_dims > head_stride {
            return Err(Error::Shape(format!("rope: {n_dims} rotated dims in heads of {head_stride}")));
        }
        if n_rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let xp = x.ptr((n_rows - 1) * row_stride + (n_heads - 1) * head_stride + n_dims, "rope x")?;
        let cp = cs.ptr(n_rows * n_dims, "rope cos/sin")?;
        let (nh, hs, rs, nd) = (
            grid_yz(n_heads, "rope heads")? as i32,
            int(head_stride, "rope")?,
            int(row_stride, "rope")?,
            n_dims as i32,
        );
        let neox = neox as i32;
        self.launch(
            "tandem_rope_f32",
            [grid(n_rows)?, nh as u32, 1],
            [(n_dims / 2) as u32, 1, 1],
            &mut args![xp, cp, nh, hs, rs, nd, neox],
        )
    }

    /// `gate[..n] = silu(gate) * up`.
    pub fn swiglu(&self, gate: &DeviceBuffer<f32>, up: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        let (g, u, n64) = (gate.at(0, n, "swiglu gate")?, up.at(0, n, "swiglu up")?, n as i64);
        self.launch_1d("tandem_swiglu_f32", n, &mut args![g, u, n64])
    }

    /// `x[..n] += y`.
    pub fn add(&self, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>, n: usize) -> Result<()> {
        let (xp, yp, n64) = (x.at(0, n, "add x")?, y.at(0, n, "add y")?, n as i64);
        self.launch_1d("tandem_add_f32", n, &mut args![xp, yp, n64])
    }

    /// `x[..n] += s * y`.
    pub fn scale_add(&self, x: &DeviceBuffer<f32>, y: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        let (xp, yp, n64) = (x.at(0, n, "scale_add x")?, y.at(0, n, "scale_add y")?, n as i64);
        self.launch_1d("tandem_scale_add_f32", n, &mut args![xp, yp, s, n64])
    }

    /// `x[..n] *= s`.
    pub fn scale(&self, x: &DeviceBuffer<f32>, s: f32, n: usize) -> Result<()> {
        let (xp, n64) = (x.at(0, n, "scale x")?, n as i64);
        self.launch_1d("tandem_scale_f32", n, &mut args![xp, s, n64])
    }

    /// `y[i] *= scales[i / row]` for `i < n`.
    pub fn scale_rows(&self, y: &DeviceBuffer<f32>, scales: &DeviceBuffer<f32>, row: usize, n: usize) -> Result<()> {
        if row == 0 {
            return Err(Error::Shape("scale_rows: rows of 0".into()));
        }
        let (yp, sp) = (y.at(0, n, "scale_rows y")?, scales.at(0, n.div_ceil(row), "scale_rows scales")?);
        let (r64, n64) = (row as i64, n as i64);
        self.launch_1d("tandem_scale_rows_f32", n, &mut args![yp, sp, r64, n64])
    }

    /// The strided copy `c` from `src` to `dst`.
    pub fn copy_rows(&self, dst: Span<f32>, src: Span<f32>, c: CopyRows) -> Result<()> {
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let rep = c.src_rep.max(1);
        let sp = src.ptr(((c.rows - 1) / rep) * c.src_stride + c.width, "copy_rows source")?;
        let dp = dst.ptr((c.rows - 1) * c.dst_stride + c.width, "copy_rows destination")?;
        let (rows, width, ss, sr, ds) = (
            int(c.rows, "copy_rows")?,
            int(c.width, "copy_rows")?,
            long(c.src_stride, "copy_rows")?,
            int(rep, "copy_rows")?,
            long(c.dst_stride, "copy_rows")?,
        );
        self.launch_1d("tandem_copy_rows_f32", c.rows * c.width, &mut args![dp, sp, rows, width, ss, sr, ds])
    }
}
