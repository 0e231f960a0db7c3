// Decode matvec: y[t][r] = dot(W[r], x[t]) for n_tokens <= 8 activation rows, one warp per weight
// row, f32 accumulation. Reference: crates/tandem-quant/src/dequant.rs (the values) and
// tandem-cpu's matvec (the sums).
//
// Launch (kernels/ABI.md): grid ceil(rows / 4), block (32, 4); threadIdx.y picks the row.
#include "common.cuh"

#define MAX_TOKENS 8
#define ROWS_PER_BLOCK 4

// Quantized rows: the lanes of the warp take the row's 32-value chunks in turn.
template <typename T>
__device__ void matvec_quant(const uint8_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                             int rows, int cols, int n_tokens) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const int lane = threadIdx.x;
    const int chunks_per_block = T::ELEMS / CHUNK;
    const int n_chunks = cols / CHUNK;
    const uint8_t* wr = w + (size_t)row * (size_t)(cols / T::ELEMS) * T::BYTES;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        acc[t] = 0.0f;
    }
    float v[CHUNK];
    for (int c = lane; c < n_chunks; c += TANDEM_WARP) {
        T::chunk(wr + (size_t)(c / chunks_per_block) * T::BYTES, c % chunks_per_block, v);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t < n_tokens) {
                const float* xt = x + (size_t)t * cols + (size_t)c * CHUNK;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < CHUNK; ++i) {
                    s += v[i] * xt[i];
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < n_tokens) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) {
                y[(size_t)t * rows + row] = s;
            }
        }
    }
}

__device__ __forceinline__ float load_f32(const uint8_t* w, size_t i) {
    return reinterpret_cast<const float*>(w)[i];
}
__device__ __forceinline__ float load_f16(const uint8_t* w, size_t i) {
    return __half2float(reinterpret_cast<const __half*>(w)[i]);
}
__device__ __forceinline__ float load_bf16(const uint8_t* w, size_t i) {
    return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t*>(w)[i] << 16);
}

// Float rows: any `cols`; the lanes take the values in turn (coalesced).
template <float (*LOAD)(const uint8_t*, size_t)>
__device__ void matvec_float(const uint8_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                             int rows, int cols, int n_tokens) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const int lane = threadIdx.x;
    const size_t base = (size_t)row * cols;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        acc[t] = 0.0f;
    }
    for (int i = lane; i < cols; i += TANDEM_WARP) {
        const float wi = LOAD(w, base + i);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t < n_tokens) {
                acc[t] += wi * x[(size_t)t * cols + i];
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < n_tokens) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) {
                y[(size_t)t * rows + row] = s;
            }
        }
    }
}

// Every entry point: (w: rows x cols weights in the type's layout, x: [n_tokens][cols] f32,
// y: [n_tokens][rows] f32, rows, cols (a multiple of the block size for quantized types),
// n_tokens in 1..=8).
#define MATVEC_QUANT(name, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(TANDEM_WARP * ROWS_PER_BLOCK)                                 \
        tandem_matvec_##name(const unsigned char* w, const float* x, float* y, int rows, int cols, int n_tokens) { \
        matvec_quant<T>(w, x, y, rows, cols, n_tokens);                                                        \
    }

#define MATVEC_FLOAT(name, LOAD)                                                                               \
    extern "C" __global__ void __launch_bounds__(TANDEM_WARP * ROWS_PER_BLOCK)                                 \
        tandem_matvec_##name(const unsigned char* w, const float* x, float* y, int rows, int cols, int n_tokens) { \
        matvec_float<LOAD>(w, x, y, rows, cols, n_tokens);                                                     \
    }

MATVEC_FLOAT(f32, load_f32)
MATVEC_FLOAT(f16, load_f16)
MATVEC_FLOAT(bf16, load_bf16)
MATVEC_QUANT(q4_0, TypeQ4_0)
MATVEC_QUANT(q5_0, TypeQ5_0)
MATVEC_QUANT(q8_0, TypeQ8_0)
MATVEC_QUANT(q4_K, TypeQ4_K)
MATVEC_QUANT(q5_K, TypeQ5_K)
MATVEC_QUANT(q6_K, TypeQ6_K)
MATVEC_QUANT(iq4_xs, TypeIQ4_XS)
