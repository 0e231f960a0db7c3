// RMS norm of each row: y = x / sqrt(mean(x^2) + eps) * w, as tandem-cpu's `rmsnorm` (the sum of
// squares in f64, as ggml's ggml_float).
//
// Launch (kernels/ABI.md): grid n_rows, block 256.
#include "common.cuh"

#define RMSNORM_THREADS 256

// x: n_rows rows of `dim` f32 values, `row_stride` apart; w: [dim] f32 or null (no weight);
// y: rows as x's, may alias x; dim: values per row; row_stride: values from a row to the next;
// eps: added to the mean square.
extern "C" __global__ void __launch_bounds__(RMSNORM_THREADS)
    tandem_rmsnorm_f32(const float* x, const float* w, float* y, int dim, long long row_stride, float eps) {
    __shared__ double partial[RMSNORM_THREADS / TANDEM_WARP];
    __shared__ float row_scale;
    if (blockDim.x > RMSNORM_THREADS || blockDim.x % TANDEM_WARP != 0) {
        return; // `partial` is sized for at most 256 threads in whole warps
    }
    const float* xr = x + (long long)blockIdx.x * row_stride;
    float* yr = y + (long long)blockIdx.x * row_stride;
    const int lane = threadIdx.x % TANDEM_WARP;
    const int warp = threadIdx.x / TANDEM_WARP;
    const int n_warps = blockDim.x / TANDEM_WARP;

    double sum = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = xr[i];
        sum += (double)(v * v);
    }
    sum = warp_sum_f64(sum);
    if (lane == 0) {
        partial[warp] = sum;
    }
    // Every read of x happens before this barrier, every write of y after it (y may alias x).
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int i = 0; i < n_warps; ++i) {
            total += partial[i];
        }
        const float mean = (float)(total / (double)dim);
        row_scale = 1.0f / sqrtf(mean + eps);
    }
    __syncthreads();
    const float scale = row_scale;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] * scale;
        if (w != nullptr) {
            v *= w[i];
        }
        yr[i] = v;
    }
}
