// Weights for the cuBLAS prefill matmul (n_tokens > 8): to f32 (`_f32`, the values of
// crates/tandem-quant/src/dequant.rs, for the default f32 gemm) or to f16 (`_f16`, those values
// rounded to nearest, with the activations, for the f16 gemm of TANDEM_CUDA_GEMM=f16).
//
// Launch (kernels/ABI.md): 1-D, block 256, any grid; every kernel is a grid-stride loop.
#include "common.cuh"

__device__ __forceinline__ long long grid_start() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_step() {
    return (long long)gridDim.x * blockDim.x;
}

__device__ __forceinline__ void put(__half* o, float v) {
    *o = __float2half_rn(v);
}
__device__ __forceinline__ void put(float* o, float v) {
    *o = v;
}

// One thread per 32-value chunk.
template <typename T, typename O>
__device__ void dequant_quant(const uint8_t* __restrict__ w, O* __restrict__ out, long long n_elements) {
    const int chunks_per_block = T::ELEMS / CHUNK;
    const long long n_chunks = n_elements / CHUNK;
    float v[CHUNK];
    for (long long c = grid_start(); c < n_chunks; c += grid_step()) {
        T::chunk(w + (size_t)(c / chunks_per_block) * T::BYTES, (int)(c % chunks_per_block), v);
        O* o = out + (size_t)c * CHUNK;
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) {
            put(o + i, v[i]);
        }
    }
}

// Every entry point: (w: n_elements values in the type's layout (a whole number of blocks),
// out: n_elements f16 or f32, n_elements).
#define DEQUANT_QUANT(name, T)                                                                        \
    extern "C" __global__ void tandem_dequant_##name##_f16(const unsigned char* w, __half* out,      \
                                                           long long n_elements) {                   \
        dequant_quant<T>(w, out, n_elements);                                                         \
    }                                                                                                 \
    extern "C" __global__ void tandem_dequant_##name##_f32(const unsigned char* w, float* out,       \
                                                           long long n_elements) {                   \
        dequant_quant<T>(w, out, n_elements);                                                         \
    }

DEQUANT_QUANT(q4_0, TypeQ4_0)
DEQUANT_QUANT(q5_0, TypeQ5_0)
DEQUANT_QUANT(q8_0, TypeQ8_0)
DEQUANT_QUANT(q4_K, TypeQ4_K)
DEQUANT_QUANT(q5_K, TypeQ5_K)
DEQUANT_QUANT(q6_K, TypeQ6_K)
DEQUANT_QUANT(iq4_xs, TypeIQ4_XS)

// (w: n_elements of SRC, out: n_elements of OUT, n_elements): one conversion per element (a copy
// where the types are the same, so every type has an entry point).
#define DEQUANT_ELEMENTS(NAME, SRC, OUT, CONVERT)                                                     \
    extern "C" __global__ void tandem_dequant_##NAME(const unsigned char* w, OUT* out,               \
                                                     long long n_elements) {                         \
        const SRC* src = reinterpret_cast<const SRC*>(w);                                             \
        for (long long i = grid_start(); i < n_elements; i += grid_step()) {                          \
            out[i] = CONVERT(src[i]);                                                                 \
        }                                                                                             \
    }

__device__ __forceinline__ __half same_half(__half x) { return x; }
__device__ __forceinline__ float same_float(float x) { return x; }
__device__ __forceinline__ float bf16_float(uint16_t x) { return __uint_as_float((uint32_t)x << 16); }
__device__ __forceinline__ __half bf16_half(uint16_t x) { return __float2half_rn(bf16_float(x)); }

DEQUANT_ELEMENTS(f32_f16, float, __half, __float2half_rn)
DEQUANT_ELEMENTS(f16_f16, __half, __half, same_half)
DEQUANT_ELEMENTS(bf16_f16, uint16_t, __half, bf16_half)
DEQUANT_ELEMENTS(f32_f32, float, float, same_float)
DEQUANT_ELEMENTS(f16_f32, __half, float, __half2float)
DEQUANT_ELEMENTS(bf16_f32, uint16_t, float, bf16_float)

// Activations: (x: n f32, out: n f16, n)
extern "C" __global__ void tandem_f32_to_f16(const float* x, __half* out, long long n) {
    for (long long i = grid_start(); i < n; i += grid_step()) {
        out[i] = __float2half_rn(x[i]);
    }
}

// Activations for a prefill gemm, one row per block (256 threads): out = f16(x * s) with s a
// power of two (exact) that brings the row's largest |x| to at most 2^14, so no value overflows
// f16's 65504; scales[row] = 1 / s, for tandem_scale_rows_f32 on the products. (x: [n_rows][cols]
// f32, out: [n_rows][cols] f16, scales: [n_rows] f32, cols.)
extern "C" __global__ void __launch_bounds__(256)
    tandem_f32_to_f16_scaled(const float* x, __half* out, float* scales, int cols) {
    __shared__ float partial[256 / TANDEM_WARP];
    __shared__ float row_scale;
    const long long r = blockIdx.x;
    const float* xr = x + r * cols;
    __half* o = out + r * cols;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        amax = fmaxf(amax, fabsf(xr[i]));
    }
    amax = warp_max(amax);
    if (threadIdx.x % TANDEM_WARP == 0) {
        partial[threadIdx.x / TANDEM_WARP] = amax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int i = 0; i < (int)(blockDim.x / TANDEM_WARP); ++i) {
            m = fmaxf(m, partial[i]);
        }
        float s = 1.0f;
        while (m * s > 16384.0f && s > 1e-30f) {
            s *= 0.5f;
        }
        row_scale = s;
        scales[r] = 1.0f / s;
    }
    __syncthreads();
    const float s = row_scale;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        o[i] = __float2half_rn(xr[i] * s);
    }
}
