// Element-wise residual adds and scaling (tandem-cpu's `add_assign`, and x += s*y, x *= s).
//
// Launch (kernels/ABI.md): grid ceil(n / 256), block 256 (grid-stride loops, so any grid works).
#include "common.cuh"

#define GRID_STRIDE_LOOP(i, n)                                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);               \
         i += (long long)gridDim.x * blockDim.x)

// x: n f32, x += y; y: n f32 (may alias x); n: values.
extern "C" __global__ void tandem_add_f32(float* x, const float* y, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] += y[i];
    }
}

// x: n f32, x += s * y; y: n f32; s: scale of y; n: values.
extern "C" __global__ void tandem_scale_add_f32(float* x, const float* y, float s, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] += s * y[i];
    }
}

// x: n f32, x *= s; s: scale; n: values.
extern "C" __global__ void tandem_scale_f32(float* x, float s, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        x[i] *= s;
    }
}

// y: f32 rows of `row` values, y[i] *= scales[i / row] (the per-token scales of a prefill gemm's
// f16 inputs, undone); n: values.
extern "C" __global__ void tandem_scale_rows_f32(float* y, const float* scales, long long row, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        y[i] *= scales[i / row];
    }
}
