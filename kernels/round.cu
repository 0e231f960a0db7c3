// Activations rounded as ggml's CPU backend rounds them before a product (tandem-cpu's
// quantize_activations: the weight type's vec_dot_type), so that a GPU product sees the values
// the CPU's integer dot products see: Q8_0 (32 values: d = max|x| / 127 stored as f16, x * 127 /
// max rounded half to even), Q8_K (256 values: the first value of largest magnitude m, q =
// min(127, nearest(-127 / m * x)), d = m / -127), f16 or bf16. Out of place, row by row.
//
// Launch (kernels/ABI.md): grid n_rows, block 256.
#include "common.cuh"

#define ROUND_THREADS 256

// x: n_rows rows, `x_stride` apart, of which the first `cols` values are rounded into y (rows
// `y_stride` apart); cols a multiple of 32 (q8_0) or 256 (q8_K).

// One warp per block of 32: the warp's max, then each lane its value.
extern "C" __global__ void __launch_bounds__(ROUND_THREADS)
    tandem_round_q8_0(const float* x, float* y, int cols, long long x_stride, long long y_stride) {
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = y + (long long)blockIdx.x * y_stride;
    const int lane = threadIdx.x % TANDEM_WARP;
    const int warp = threadIdx.x / TANDEM_WARP;
    const int n_warps = blockDim.x / TANDEM_WARP;
    const int n_blocks = cols / 32;
    for (int b0 = 0; b0 < n_blocks; b0 += n_warps) {
        const int b = b0 + warp;
        const float v = b < n_blocks ? xr[b * 32 + lane] : 0.0f;
        const float max = warp_max(fabsf(v));
        if (b < n_blocks) {
            const float d = __half2float(__float2half_rn(max / 127.0f));
            const float id = max != 0.0f ? 127.0f / max : 0.0f;
            // Half to even, as the x86 quantizer's add-and-subtract of 1.5 * 2^23 does; the
            // product rounded on its own first (__fmul_rn is never fused into an FMA), as the
            // CPU rounds it, or values near a half would land on the other integer.
            const float q = (__fmul_rn(v, id) + 12582912.0f) - 12582912.0f;
            yr[b * 32 + lane] = d * q;
        }
    }
}

// One block of 256 per pass of the whole thread block: the first value of largest magnitude by a
// reduction over (|v|, -index), then each thread its value.
extern "C" __global__ void __launch_bounds__(ROUND_THREADS)
    tandem_round_q8_K(const float* x, float* y, int cols, long long x_stride, long long y_stride) {
    __shared__ float best_abs[ROUND_THREADS / TANDEM_WARP];
    __shared__ int best_idx[ROUND_THREADS / TANDEM_WARP];
    __shared__ float block_max;
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = y + (long long)blockIdx.x * y_stride;
    const int i = threadIdx.x;
    const int lane = i % TANDEM_WARP;
    const int warp = i / TANDEM_WARP;
    if (blockDim.x != ROUND_THREADS) {
        return;
    }
    for (int b = 0; b < cols / 256; ++b) {
        const float v = xr[b * 256 + i];
        float a = fabsf(v);
        int idx = i;
#pragma unroll
        for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
            const float oa = __shfl_xor_sync(TANDEM_FULL_MASK, a, o);
            const int oi = __shfl_xor_sync(TANDEM_FULL_MASK, idx, o);
            if (oa > a || (oa == a && oi < idx)) {
                a = oa;
                idx = oi;
            }
        }
        if (lane == 0) {
            best_abs[warp] = a;
            best_idx[warp] = idx;
        }
        __syncthreads();
        if (i == 0) {
            float ba = best_abs[0];
            int bi = best_idx[0];
            for (int w = 1; w < ROUND_THREADS / TANDEM_WARP; ++w) {
                if (best_abs[w] > ba || (best_abs[w] == ba && best_idx[w] < bi)) {
                    ba = best_abs[w];
                    bi = best_idx[w];
                }
            }
            block_max = xr[b * 256 + bi];
        }
        __syncthreads();
        const float max = block_max;
        if (max == 0.0f) {
            yr[b * 256 + i] = 0.0f;
        } else {
            const float iscale = -127.0f / max;
            // nearest_int: add 1.5 * 2^23 and read the mantissa (half to even), the product
            // rounded first as on the CPU (no FMA).
            const float t = __fmul_rn(iscale, v) + 12582912.0f;
            int q = (int)(__float_as_uint(t) & 0x007fffff) - 0x00400000;
            q = min(q, 127);
            yr[b * 256 + i] = (1.0f / iscale) * (float)q;
        }
        __syncthreads(); // block_max is read before the next block's reduction writes it
    }
}

extern "C" __global__ void __launch_bounds__(ROUND_THREADS)
    tandem_round_f16(const float* x, float* y, int cols, long long x_stride, long long y_stride) {
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = y + (long long)blockIdx.x * y_stride;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        yr[i] = __half2float(__float2half_rn(xr[i]));
    }
}

extern "C" __global__ void __launch_bounds__(ROUND_THREADS)
    tandem_round_bf16(const float* x, float* y, int cols, long long x_stride, long long y_stride) {
    const float* xr = x + (long long)blockIdx.x * x_stride;
    float* yr = y + (long long)blockIdx.x * y_stride;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        yr[i] = __uint_as_float((uint32_t)f32_to_bf16(xr[i]) << 16);
    }
}
