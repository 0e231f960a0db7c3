//! Element-wise ops as ggml's CPU backend computes them (ggml/src/ggml-cpu/ops.cpp, vec.h):
//! the same float types and order of operations, so results agree with llama.cpp to rounding.

/// RMS norm of one row in place (`ggml_compute_forward_rms_norm_f32`), then times `weight`.
pub fn rmsnorm(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let n = x.len();
    // ggml sums the squares in double (ggml_float).
    let sum: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / n as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
    if let Some(w) = weight {
        for (v, w) in x.iter_mut().zip(w) {
            *v *= w;
        }
    }
}

/// Softmax in place (`ggml_compute_forward_soft_max_f32` after scale and mask were applied).
pub fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `gate = silu(gate) * up` (`ggml_swiglu_split`; silu(x) = x / (1 + e^-x)), with ggml's vector
/// exp where the machine has AVX-512 (and the same bits with AVX2), as llama.cpp's x86 build
/// computes it.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detected() >= crate::Isa::Avx512 {
        // SAFETY: AVX-512 is present.
        unsafe { crate::vmath::x86::swiglu(gate, up) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::Isa::detected() >= crate::Isa::Avx2 {
        // SAFETY: AVX2 and FMA are present.
        unsafe { crate::vmath::x86::swiglu_avx2(gate, up) };
        return;
    }
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// How rotary dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x[2i], x[2i+1]): llama, deepseek2 (`LLAMA_ROPE_TYPE_NORM`).
    Norm,
    /// Halves (x[i], x[i + n/2]): qwen3moe and most HF-native models (`LLAMA_ROPE_TYPE_NEOX`).
    Neox,
}

/// Rotary embedding parameters, as `ggml_rope_ext` takes them.
#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub n_dims: usize,
    pub style: RopeStyle,
    pub freq_base: f32,
    pub freq_scale: f32,
    /// YaRN ramp mix (1 with YaRN, 0 without).
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub n_ctx_orig: u32,
}

fn yarn_corr_dim(n_dims: usize, n_ctx_orig: u32, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
}

impl RopeParams {
    /// `ggml_rope_yarn_corr_dims`: the dimensions where YaRN ramps from extrapolation to
    /// interpolation.
    fn corr_dims(&self) -> [f32; 2] {
        let start = yarn_corr_dim(self.n_dims, self.n_ctx_orig, self.beta_fast, self.freq_base).floor();
        let end = yarn_corr_dim(self.n_dims, self.n_ctx_orig, self.beta_slow, self.freq_base).ceil();
        [start.max(0.0), end.min(self.n_dims as f32 - 1.0)]
    }

    /// cos/sin pairs for position `pos` (`ggml_rope_cache_init` with `rope_yarn`); `freq_factors`
    /// divide each pair's angle (llama 3's `rope_freqs`).
    pub fn cache(&self, pos: u32, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let theta_scale = self.freq_base.powf(-2.0 / self.n_dims as f32);
        let corr = self.corr_dims();
        let mut cache = vec![0f32; self.n_dims];
        let mut theta = pos as f32;
        for i0 in (0..self.n_dims).step_by(2) {
            let theta_extrap = theta / freq_factors.and_then(|f| f.get(i0 / 2)).copied().unwrap_or(1.0);
            let theta_interp = self.freq_scale * theta_extrap;
            let mut t = theta_interp;
            let mut mscale = self.attn_factor;
            if self.ext_factor != 0.0 {
                let y = ((i0 / 2) as f32 - corr[0]) / (corr[1] - corr[0]).max(0.001);
                let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
                t = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
                mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
            }
            cache[i0] = t.cos() * mscale;
            cache[i0 + 1] = t.sin() * mscale;
            theta *= theta_scale;
        }
        cache
    }
}

/// Rotates the first `cache.len()` dimensions of `x` (one head) with a cache from
/// [`RopeParams::cache`].
pub fn rope(x: &mut [f32], cache: &[f32], style: RopeStyle) {
    let n = cache.len();
    for i0 in (0..n).step_by(2) {
        let (c, s) = (cache[i0], cache[i0 + 1]);
        let (a, b) = match style {
            RopeStyle::Norm => (i0, i0 + 1),
            RopeStyle::Neox => (i0 / 2, i0 / 2 + n / 2),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_without_scaling_is_a_rotation_by_pos_times_freq() {
        let p = RopeParams {
            n_dims: 4,
            style: RopeStyle::Norm,
            freq_base: 10000.0,
            freq_scale: 1.0,
            ext_factor: 0.0,
            attn_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            n_ctx_orig: 4096,
        };
        let c = p.cache(3, None);
        assert!((c[0] - 3f32.cos()).abs() < 1e-6 && (c[1] - 3f32.sin()).abs() < 1e-6);
        let f = 10000f32.powf(-0.5) * 3.0;
        assert!((c[2] - f.cos()).abs() < 1e-6);
        let mut x = [1.0, 0.0, 1.0, 0.0];
        rope(&mut x, &c, RopeStyle::Norm);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
        let mut y = [1.0, 1.0, 0.0, 0.0];
        rope(&mut y, &c, RopeStyle::Neox);
        assert!((y[0] - 3f32.cos()).abs() < 1e-6 && (y[2] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn rmsnorm_and_softmax() {
        let mut x = [3.0f32, 4.0];
        rmsnorm(&mut x, Some(&[1.0, 2.0]), 0.0);
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
        let mut s = [0.0f32, 0.0, f32::NEG_INFINITY];
        softmax_in_place(&mut s);
        assert_eq!(s, [0.5, 0.5, 0.0]);
    }
}
