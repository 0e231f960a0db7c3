// Decode attention over an f16 KV cache, split over the sequence (flash-decoding): each block
// computes one (split, head, token)'s unnormalized partial result with an online softmax, and
// tandem_attn_combine merges the splits. Covers GQA (n_head_kv divides n_head) and MLA with the
// absorbed projections (one latent KV head; V is the first dv values of the K row).
// Reference: tandem-model's CPU attention (softmax(scale * q.k) . v per head).
//
// Launch (kernels/ABI.md): attn grid (n_split, n_head, n_tokens), block 128;
// combine grid (n_head, n_tokens), block 128.
#include "common.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / TANDEM_WARP)
// Largest head sizes (the runtime checks dk and dv against them); MLA uses dk 576, dv 512.
#define ATTN_MAX_DK 1024
#define ATTN_MAX_DV 1024
#define ATTN_DV_PER_THREAD (ATTN_MAX_DV / ATTN_THREADS)
// KV rows scored per step of the online softmax.
#define ATTN_TILE 64

// q: [n_tokens][n_head][dk] f32; k: KV row j at k + j*k_stride (f16), head kvh at + kvh*dk;
// v: KV row j at v + j*v_stride (f16), head kvh at + kvh*dv, or null: V is the first dv values of
// each K head (MLA); part: [n_tokens][n_head][n_split][dv + 2] f32 — the unnormalized
// sum_j e^(x_j - m) v_j, then m, then sum_j e^(x_j - m); n_kv: [n_tokens], token t attends
// rows 0..n_kv[t]; n_head, n_head_kv: query and KV heads (head h reads KV head
// h / (n_head / n_head_kv)); dk <= 1024, dv <= 1024: K and V head sizes; k_stride, v_stride: in
// f16 values; scale: applied to q.k; n_split: splits of the sequence (gridDim.x).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    tandem_attn_f16(const float* q, const __half* k, const __half* v, float* part, const int* n_kv, int n_head,
                    int n_head_kv, int dk, int dv, long long k_stride, long long v_stride, float scale, int n_split) {
    __shared__ float qs[ATTN_MAX_DK];
    __shared__ float sc[ATTN_TILE];
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int t = blockIdx.z;
    const int tid = threadIdx.x;
    const int lane = tid % TANDEM_WARP;
    const int warp = tid / TANDEM_WARP;
    if (blockDim.x != ATTN_THREADS || dk > ATTN_MAX_DK || dv > ATTN_MAX_DV) {
        return;
    }
    const int kvh = h / (n_head / n_head_kv);
    const __half* kbase = k + (size_t)kvh * dk;
    const __half* vbase;
    long long vstride;
    if (v != nullptr) {
        vbase = v + (size_t)kvh * dv;
        vstride = v_stride;
    } else {
        vbase = kbase;
        vstride = k_stride;
    }

    // This split's rows: chunk = ceil(max n_kv / n_split), the same for every token.
    int max_kv = 0;
    for (int i = 0; i < (int)gridDim.z; ++i) {
        max_kv = max(max_kv, n_kv[i]);
    }
    const int chunk = (max_kv + n_split - 1) / n_split;
    const int lo = s * chunk;
    const int hi = min(lo + chunk, n_kv[t]);

    const float* qrow = q + ((size_t)t * n_head + h) * dk;
    for (int d = tid; d < dk; d += ATTN_THREADS) {
        qs[d] = qrow[d] * scale;
    }
    __syncthreads();

    float acc[ATTN_DV_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    float m = -INFINITY; // running max of the scores
    float lsum = 0.0f;   // running sum of e^(score - m)

    for (int base = lo; base < hi; base += ATTN_TILE) {
        const int n = min(ATTN_TILE, hi - base);
        // Scores: one warp per row, the lanes split dk.
        for (int r = warp; r < n; r += ATTN_WARPS) {
            const __half* kr = kbase + (size_t)(base + r) * k_stride;
            float dot = 0.0f;
            for (int d = lane; d < dk; d += TANDEM_WARP) {
                dot += qs[d] * __half2float(kr[d]);
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                sc[r] = dot;
            }
        }
        __syncthreads();
        float tile_max = -INFINITY;
        for (int r = 0; r < n; ++r) {
            tile_max = fmaxf(tile_max, sc[r]);
        }
        const float m_new = fmaxf(m, tile_max);
        // Rescales what was accumulated under the old max (nothing yet on the first tile).
        const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
        __syncthreads(); // every thread has read the scores before they become weights
        if (tid < n) {
            sc[tid] = expf(sc[tid] - m_new);
        }
        __syncthreads();
        lsum *= corr;
#pragma unroll
        for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
            acc[i] *= corr;
        }
        for (int r = 0; r < n; ++r) {
            const float p = sc[r];
            lsum += p;
            const __half* vr = vbase + (size_t)(base + r) * vstride;
#pragma unroll
            for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
                const int d = tid + i * ATTN_THREADS;
                if (d < dv) {
                    acc[i] += p * __half2float(vr[d]);
                }
            }
        }
        m = m_new;
        __syncthreads(); // the weights are read before the next tile's scores overwrite them
    }

    float* out = part + (((size_t)t * n_head + h) * n_split + s) * (size_t)(dv + 2);
#pragma unroll
    for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
        const int d = tid + i * ATTN_THREADS;
        if (d < dv) {
            out[d] = acc[i];
        }
    }
    if (tid == 0) {
        out[dv] = m;
        out[dv + 1] = lsum;
    }
}

// part: [n_tokens][n_head][n_split][dv + 2] from tandem_attn_f16; out: [n_tokens][n_head][dv] f32,
// the softmax-weighted sum of V (zero for a token that attends no row); n_head; dv; n_split.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    tandem_attn_combine(const float* part, float* out, int n_head, int dv, int n_split) {
    const int h = blockIdx.x;
    const int t = blockIdx.y;
    const size_t row = (size_t)dv + 2;
    const float* p = part + ((size_t)t * n_head + h) * n_split * row;
    float* o = out + ((size_t)t * n_head + h) * dv;
    float m = -INFINITY;
    for (int s = 0; s < n_split; ++s) {
        m = fmaxf(m, p[s * row + dv]);
    }
    if (m == -INFINITY) {
        for (int d = threadIdx.x; d < dv; d += blockDim.x) {
            o[d] = 0.0f;
        }
        return;
    }
    float l = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        l += expf(p[s * row + dv] - m) * p[s * row + dv + 1];
    }
    const float inv = 1.0f / l;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            acc += expf(p[s * row + dv] - m) * p[s * row + d];
        }
        o[d] = acc * inv;
    }
}
