// Decode matvec: y[t][r] = dot(W[r], x[t]) for n_tokens <= 8 activation rows, one warp per weight
// row, f32 accumulation; batched over groups of rows (gridDim.y): the per-head matrices of MLA's
// attn_k_b / attn_v_b in one launch, or the routed experts of a MoE layer, each (token, slot)
// pair multiplying the matrix of the expert its packet names. Reference:
// crates/tandem-quant/src/dequant.rs (the values) and tandem-cpu's matvec (the sums).
//
// Launch (kernels/ABI.md): grid (ceil(rows / 4), n_groups), block (32, 4); threadIdx.y picks the
// row, blockIdx.y the group.
#include "common.cuh"

#define MAX_TOKENS 8
#define ROWS_PER_BLOCK 4

// Where group g's matrix, input and output are (see the entry points' comment).
struct Group {
    const uint8_t* w;
    const float* x;
    float* y;
    bool valid;
};

// Each token's sum over the warp's lanes into `row` of its output (lane 0 writes).
__device__ __forceinline__ void store_sums(const Group& gr, const float (&acc)[MAX_TOKENS], int n_tokens,
                                           long long y_tok, int row, int lane) {
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        if (t < n_tokens) {
            const float s = warp_sum(acc[t]);
            if (lane == 0) {
                gr.y[(long long)t * y_tok + row] = s;
            }
        }
    }
}

__device__ __forceinline__ Group group(const uint8_t* w, const float* x, float* y, long long x_grp, int x_grp_div,
                                       long long y_grp, long long w_grp_bytes, const float* ids, int ids_per,
                                       long long ids_row, int n_mats) {
    const int g = blockIdx.y;
    int sel = g;
    if (ids != nullptr) {
        const float f = ids[(long long)(g / ids_per) * ids_row + g % ids_per];
        sel = (f >= 0.0f && f < (float)n_mats) ? (int)f : -1;
    }
    Group r;
    r.valid = sel >= 0 && sel < n_mats;
    r.w = w + (long long)(r.valid ? sel : 0) * w_grp_bytes;
    r.x = x + (long long)(g / x_grp_div) * x_grp;
    r.y = y + (long long)g * y_grp;
    return r;
}

// Quantized rows: the lanes of the warp take the row's 32-value chunks in turn.
template <typename T>
__device__ void matvec_quant(const Group& gr, int rows, int cols, int n_tokens, long long x_tok, long long y_tok) {
    const int row = blockIdx.x * ROWS_PER_BLOCK + threadIdx.y;
    if (row >= rows) {
        return;
    }
    const int lane = threadIdx.x;
    const int chunks_per_block = T::ELEMS / CHUNK;
    const int n_chunks = cols / CHUNK;
    const uint8_t* wr = gr.w + (size_t)row * (size_t)(cols / T::ELEMS) * T::BYTES;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; ++t) {
        acc[t] = 0.0f;
    }
    float v[CHUNK];
    for (int c = lane; c < n_chunks && gr.valid; c += TANDEM_WARP) {
        T::chunk(wr + (size_t)(c / chunks_per_block) * T::BYTES, c % chunks_per_block, v);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t < n_tokens) {
                const float* xt = gr.x + (long long)t * x_tok + (size_t)c * CHUNK;
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < CHUNK; ++i) {
                    s += v[i] * xt[i];
                }
                acc[t] += s;
            }
        }
    }
    store_sums(gr, acc, n_tokens, y_tok, row, lane);
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
__device__ void matvec_float(const Group& gr, int rows, int cols, int n_tokens, long long x_tok, long long y_tok) {
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
    for (int i = lane; i < cols && gr.valid; i += TANDEM_WARP) {
        const float wi = LOAD(gr.w, base + i);
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; ++t) {
            if (t < n_tokens) {
                acc[t] += wi * gr.x[(long long)t * x_tok + i];
            }
        }
    }
    store_sums(gr, acc, n_tokens, y_tok, row, lane);
}

// Every entry point: w: the matrices, `rows` rows of `cols` elements each in the type's layout,
// matrix m at byte m * w_grp_bytes; x: f32, token t of group g at x + t * x_tok + (g / x_grp_div)
// * x_grp; y: f32, token t, row r of group g at y + t * y_tok + g * y_grp + r; rows; cols (a
// multiple of the block size for quantized types); n_tokens in 1..=8; ids: null (group g
// multiplies matrix g) or f32 expert ids, group g multiplying matrix ids[(g / ids_per) * ids_row +
// g % ids_per]; n_mats: matrices in w (a group whose id is not below it writes zeros).
#define MATVEC_ARGS                                                                                              \
    const unsigned char *w, const float *x, float *y, int rows, int cols, int n_tokens, long long x_tok,          \
        long long x_grp, int x_grp_div, long long y_tok, long long y_grp, long long w_grp_bytes, const float *ids, \
        int ids_per, long long ids_row, int n_mats
#define MATVEC_GROUP group(w, x, y, x_grp, x_grp_div, y_grp, w_grp_bytes, ids, ids_per, ids_row, n_mats)

#define MATVEC_QUANT(name, T)                                                                \
    extern "C" __global__ void __launch_bounds__(TANDEM_WARP * ROWS_PER_BLOCK)               \
        tandem_matvec_##name(MATVEC_ARGS) {                                                  \
        matvec_quant<T>(MATVEC_GROUP, rows, cols, n_tokens, x_tok, y_tok);                   \
    }

#define MATVEC_FLOAT(name, LOAD)                                                             \
    extern "C" __global__ void __launch_bounds__(TANDEM_WARP * ROWS_PER_BLOCK)               \
        tandem_matvec_##name(MATVEC_ARGS) {                                                  \
        matvec_float<LOAD>(MATVEC_GROUP, rows, cols, n_tokens, x_tok, y_tok);                \
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
