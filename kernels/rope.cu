// Rotary position embedding in place, as tandem-cpu's `rope` with a cache from
// `RopeParams::cache` (n_dims values per position: cos, sin of pair 0, cos, sin of pair 1, ...).
//
// Launch (kernels/ABI.md): grid (n_rows, n_heads), block n_dims / 2: one thread per rotated pair.
#include "common.cuh"

// x: row t at x + t*row_stride, its head h at + h*head_stride (f32, rotated in place);
// cs: [n_rows][n_dims] interleaved cos/sin of row t's position; n_heads: heads per row;
// head_stride, row_stride: in floats; n_dims: rotated values at the start of each head (even);
// neox: 0 rotates pairs (2i, 2i+1) (ggml "norm"), 1 rotates pairs (i, i + n_dims/2) (NeoX).
extern "C" __global__ void tandem_rope_f32(float* x, const float* cs, int n_heads, int head_stride, int row_stride,
                                           int n_dims, int neox) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int i = threadIdx.x;
    if (h >= n_heads || i >= n_dims / 2) {
        return;
    }
    float* xh = x + (size_t)t * row_stride + (size_t)h * head_stride;
    const float c = cs[(size_t)t * n_dims + 2 * i];
    const float s = cs[(size_t)t * n_dims + 2 * i + 1];
    const int a = neox ? i : 2 * i;
    const int b = neox ? i + n_dims / 2 : 2 * i + 1;
    const float x0 = xh[a];
    const float x1 = xh[b];
    xh[a] = x0 * c - x1 * s;
    xh[b] = x0 * s + x1 * c;
}
