// Attention over the device's KV cache (f16, bf16 or q8_0 rows), split over the cached rows
// (flash-decoding): each block computes partial results of an online softmax over one split of
// the rows, and tandem_attn_combine merges the splits. Every token of a micro-batch in one launch
// (prefill and decode alike, several sequences): token t reads its sequence's rows through its
// KvMeta and attends rows 0..=pos (causal).
//
// * tandem_attn_<type>: one (split, head, token) per block; GQA and MHA (head h reads KV head
//   h / (n_head / n_head_kv)), V in its own part of the row or (MLA) the first dv values of K.
// * tandem_attn_mla_<type>: MLA in the absorbed form (one latent KV head shared by all query
//   heads, V the first dv values of K): a block takes MLA_HEADS heads of one split of one token,
//   so each cached row is read from memory once per group of heads instead of once per head;
//   the head groups of a split are neighbours in the grid, so they share the rows in L2.
//
// A token that attends at most ATTN_EXACT_ROWS rows takes ggml's non-flash order instead, as the
// CPU path does (tandem-cpu attention.rs, FLASH_MIN): all of its scores' max, their exp-sum (in
// double), then each probability scaled and rounded to V's format before the product; the first
// split does it all and the others contribute nothing. Longer ones run the online softmax.
//
// Reference: tandem-cpu's attention (softmax(scale * q.k) . v per head). The partial results:
// [n_tokens][n_head][n_split][dv + 2], the unnormalized sum_j e^(s_j - m) v_j, then m, then
// sum_j e^(s_j - m).
//
// Launch (kernels/ABI.md): attn grid (n_split, n_head, n_tokens), block 128; mla grid
// (n_head / MLA_HEADS, n_split, n_tokens), block 256; combine grid (n_head, n_tokens), block 128.
#include "common.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / TANDEM_WARP)
// Largest head sizes (the runtime checks dk and dv against them).
#define ATTN_MAX_DK 1024
#define ATTN_MAX_DV 1024
#define ATTN_DV_PER_THREAD (ATTN_MAX_DV / ATTN_THREADS)
// KV rows scored per step of the online softmax.
#define ATTN_TILE 64
// Rows up to which a token takes ggml's non-flash order (tandem-cpu's FLASH_MIN).
#define ATTN_EXACT_ROWS 512

// The rows of split s of token t: [lo, hi), `chunk` rows per split.
__device__ __forceinline__ void split_rows(const KvMeta& m, int s, int chunk, int* lo, int* hi) {
    *lo = s * chunk;
    *hi = min(*lo + chunk, (int)m.pos + 1);
}

// q: [n_tokens][n_head][dk] f32; meta: [n_tokens]; part: see above; layer: the cache layer;
// row_bytes: bytes of a cache row; v_off: byte offset of V in a row, or -1: V is the first dv
// values of each K head (MLA); n_head, n_head_kv; dk, dv <= 1024 (whole blocks for q8_0); scale:
// applied to q.k; chunk: rows per split (gridDim.x splits).
template <typename C>
__device__ void attn(const float* q, const KvMeta* meta, float* part, int layer, long long row_bytes, long long v_off,
                     int n_head, int n_head_kv, int dk, int dv, float scale, int chunk) {
    __shared__ float qs[ATTN_MAX_DK];
    __shared__ float sc[ATTN_TILE];
    const int s = blockIdx.x;
    const int h = blockIdx.y;
    const int t = blockIdx.z;
    const int n_split = gridDim.x;
    const int tid = threadIdx.x;
    const int lane = tid % TANDEM_WARP;
    const int warp = tid / TANDEM_WARP;
    if (blockDim.x != ATTN_THREADS || dk > ATTN_MAX_DK || dv > ATTN_MAX_DV) {
        return;
    }
    const KvMeta m_t = meta[t];
    const int n_kv = (int)m_t.pos + 1;
    const bool exact = n_kv <= ATTN_EXACT_ROWS;
    float* out = part + (((size_t)t * n_head + h) * n_split + s) * (size_t)(dv + 2);
    if (exact && s != 0) {
        for (int d = tid; d < dv; d += ATTN_THREADS) {
            out[d] = 0.0f;
        }
        if (tid == 0) {
            out[dv] = -INFINITY;
            out[dv + 1] = 0.0f;
        }
        return;
    }
    const int kvh = h / (n_head / n_head_kv);
    const long long k_head = C::bytes((long long)kvh * dk);
    const long long v_head = v_off < 0 ? k_head : v_off + C::bytes((long long)kvh * dv);
    int lo = 0, hi = n_kv;
    if (!exact) {
        split_rows(m_t, s, chunk, &lo, &hi);
    }

    const float* qrow = q + ((size_t)t * n_head + h) * dk;
    for (int d = tid; d < dk; d += ATTN_THREADS) {
        qs[d] = qrow[d];
    }
    __syncthreads();

    // The scores of rows base .. base + n into sc: one warp per row, the lanes split dk.
    auto scores = [&](int base, int n) {
        for (int r = warp; r < n; r += ATTN_WARPS) {
            const uint8_t* kr = kv_row(m_t, layer, row_bytes, base + r) + k_head;
            float dot = 0.0f;
            for (int d = lane; d < dk; d += TANDEM_WARP) {
                dot += qs[d] * C::load(kr, d);
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                sc[r] = dot * scale;
            }
        }
        __syncthreads();
    };

    float acc[ATTN_DV_PER_THREAD];
#pragma unroll
    for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    // Adds sc[r] * V row base + r for every row of the tile.
    auto weigh = [&](int base, int n) {
        for (int r = 0; r < n; ++r) {
            const float p = sc[r];
            const uint8_t* vr = kv_row(m_t, layer, row_bytes, base + r) + v_head;
#pragma unroll
            for (int i = 0; i < ATTN_DV_PER_THREAD; ++i) {
                const int d = tid + i * ATTN_THREADS;
                if (d < dv) {
                    acc[i] += p * C::load(vr, d);
                }
            }
        }
    };

    float m = -INFINITY; // running max of the scores
    float lsum = 0.0f;   // running sum of e^(score - m)
    if (exact) {
        for (int base = lo; base < hi; base += ATTN_TILE) {
            const int n = min(ATTN_TILE, hi - base);
            scores(base, n);
            for (int r = 0; r < n; ++r) {
                m = fmaxf(m, sc[r]);
            }
            __syncthreads();
        }
        double sum = 0.0;
        for (int base = lo; base < hi; base += ATTN_TILE) {
            const int n = min(ATTN_TILE, hi - base);
            scores(base, n);
            for (int r = 0; r < n; ++r) {
                sum += (double)expf(sc[r] - m);
            }
            __syncthreads();
        }
        const float inv = (float)(1.0 / sum);
        for (int base = lo; base < hi; base += ATTN_TILE) {
            const int n = min(ATTN_TILE, hi - base);
            scores(base, n);
            const float e = tid < n ? C::round_p(expf(sc[tid] - m) * inv) : 0.0f;
            __syncthreads();
            if (tid < n) {
                sc[tid] = e;
            }
            __syncthreads();
            weigh(base, n);
            __syncthreads();
        }
        // Already normalized: the combine takes it as one part of weight 1.
        m = 0.0f;
        lsum = 1.0f;
    } else {
        for (int base = lo; base < hi; base += ATTN_TILE) {
            const int n = min(ATTN_TILE, hi - base);
            scores(base, n);
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
                lsum += sc[r];
            }
            weigh(base, n);
            m = m_new;
            __syncthreads(); // the weights are read before the next tile's scores overwrite them
        }
    }

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

#define ATTN_ENTRY(name, C)                                                                                      \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                                   \
        tandem_attn_##name(const float* q, const KvMeta* meta, float* part, int layer, long long row_bytes,      \
                           long long v_off, int n_head, int n_head_kv, int dk, int dv, float scale, int chunk) { \
        attn<C>(q, meta, part, layer, row_bytes, v_off, n_head, n_head_kv, dk, dv, scale, chunk);                \
    }

ATTN_ENTRY(f16, CacheF16)
ATTN_ENTRY(bf16, CacheBF16)
ATTN_ENTRY(q8_0, CacheQ8_0)

// ---- MLA: heads in groups over shared rows -----------------------------------------------------

#define MLA_THREADS 256
// Query heads per block (the runtime checks that they divide n_head).
#define MLA_HEADS 4
// Cached rows per tile.
#define MLA_TILE 16
// Largest latent row (kv_lora + n_rot; Kimi K2 and DeepSeek V3: 576) and value (kv_lora: 512).
#define MLA_MAX_DK 576
#define MLA_MAX_DV 512
// Threads per (head, row) score.
#define MLA_SCORE_LANES (MLA_THREADS / (MLA_HEADS * MLA_TILE))
#define MLA_DV_PER_THREAD (MLA_HEADS * MLA_MAX_DV / MLA_THREADS)

static_assert(MLA_SCORE_LANES == 4, "four threads per score: two shuffles combine them");

// q: [n_tokens][n_head][dk] f32; meta: [n_tokens]; part: [n_tokens][n_head][n_split][dv + 2];
// layer; row_bytes; n_head (a multiple of MLA_HEADS); dk <= 576, dv <= min(dk, 512); scale;
// chunk: rows per split (gridDim.y splits). V is the first dv values of each row.
template <typename C>
__device__ void attn_mla(const float* q, const KvMeta* meta, float* part, int layer, long long row_bytes, int n_head,
                         int dk, int dv, float scale, int chunk) {
    __shared__ float qs[MLA_HEADS][MLA_MAX_DK];
    // Rows as f32, one value more per row so that lanes reading one column of different rows
    // hit different banks.
    __shared__ float ks[MLA_TILE][MLA_MAX_DK + 1];
    __shared__ float ps[MLA_HEADS][MLA_TILE];
    __shared__ float corr_s[MLA_HEADS];
    const int hg = blockIdx.x;
    const int s = blockIdx.y;
    const int t = blockIdx.z;
    const int n_split = gridDim.y;
    const int tid = threadIdx.x;
    if (blockDim.x != MLA_THREADS || dk > MLA_MAX_DK || dv > MLA_MAX_DV || dv > dk) {
        return;
    }
    const KvMeta m_t = meta[t];
    const int n_kv = (int)m_t.pos + 1;
    const bool exact = n_kv <= ATTN_EXACT_ROWS;
    const int h0 = hg * MLA_HEADS;
    // Value lanes: head vh, values vd + MLA_THREADS / MLA_HEADS * i.
    const int per_head = MLA_THREADS / MLA_HEADS;
    const int vh = tid / per_head;
    const int vd = tid % per_head;
    float* out = part + (((size_t)t * n_head + h0 + vh) * n_split + s) * (size_t)(dv + 2);
    if (exact && s != 0) {
        for (int i = 0; i < MLA_DV_PER_THREAD; ++i) {
            const int d = vd + i * per_head;
            if (d < dv) {
                out[d] = 0.0f;
            }
        }
        if (vd == 0) {
            out[dv] = -INFINITY;
            out[dv + 1] = 0.0f;
        }
        return;
    }
    int lo = 0, hi = n_kv;
    if (!exact) {
        split_rows(m_t, s, chunk, &lo, &hi);
    }
    for (int i = tid; i < MLA_HEADS * dk; i += MLA_THREADS) {
        const int h = i / dk;
        const int d = i % dk;
        qs[h][d] = q[((size_t)t * n_head + h0 + h) * dk + d];
    }
    // Score lanes: (head, row) pairs, four threads each on a quarter of dk.
    const int pair = tid / MLA_SCORE_LANES;
    const int part_lane = tid % MLA_SCORE_LANES;
    const int sh = pair / MLA_TILE;
    const int sr = pair % MLA_TILE;
    __syncthreads();

    // Loads rows base .. base + n and scores them into ps (-inf beyond n).
    auto scores = [&](int base, int n) {
        for (int i = tid; i < MLA_TILE * dk; i += MLA_THREADS) {
            const int r = i / dk;
            const int d = i % dk;
            ks[r][d] = r < n ? C::load(kv_row(m_t, layer, row_bytes, base + r), d) : 0.0f;
        }
        __syncthreads();
        float dot = 0.0f;
        for (int d = part_lane; d < dk; d += MLA_SCORE_LANES) {
            dot += qs[sh][d] * ks[sr][d];
        }
        dot += __shfl_xor_sync(TANDEM_FULL_MASK, dot, 1);
        dot += __shfl_xor_sync(TANDEM_FULL_MASK, dot, 2);
        if (part_lane == 0) {
            ps[sh][sr] = sr < n ? dot * scale : -INFINITY;
        }
        __syncthreads();
    };

    float acc[MLA_DV_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MLA_DV_PER_THREAD; ++i) {
        acc[i] = 0.0f;
    }
    // Adds ps[vh][r] * V row r of the tile (the first dv values of the row).
    auto weigh = [&](int n) {
        for (int r = 0; r < n; ++r) {
            const float p = ps[vh][r];
#pragma unroll
            for (int i = 0; i < MLA_DV_PER_THREAD; ++i) {
                const int d = vd + i * per_head;
                if (d < dv) {
                    acc[i] += p * ks[r][d];
                }
            }
        }
    };

    // The running max and sum of each head, kept by thread `head` (tid < MLA_HEADS).
    float m = -INFINITY;
    float lsum = 0.0f;
    if (exact) {
        for (int base = lo; base < hi; base += MLA_TILE) {
            const int n = min(MLA_TILE, hi - base);
            scores(base, n);
            if (tid < MLA_HEADS) {
                for (int r = 0; r < n; ++r) {
                    m = fmaxf(m, ps[tid][r]);
                }
            }
            __syncthreads();
        }
        double sum = 0.0;
        for (int base = lo; base < hi; base += MLA_TILE) {
            const int n = min(MLA_TILE, hi - base);
            scores(base, n);
            if (tid < MLA_HEADS) {
                for (int r = 0; r < n; ++r) {
                    sum += (double)expf(ps[tid][r] - m);
                }
            }
            __syncthreads();
        }
        const float inv = (float)(1.0 / sum);
        for (int base = lo; base < hi; base += MLA_TILE) {
            const int n = min(MLA_TILE, hi - base);
            scores(base, n);
            if (tid < MLA_HEADS) {
                for (int r = 0; r < MLA_TILE; ++r) {
                    ps[tid][r] = r < n ? C::round_p(expf(ps[tid][r] - m) * inv) : 0.0f;
                }
            }
            __syncthreads();
            weigh(n);
            __syncthreads(); // the tile is read before the next one overwrites it
        }
        // Already normalized: the combine takes it as one part of weight 1.
        m = 0.0f;
        lsum = 1.0f;
    } else {
        for (int base = lo; base < hi; base += MLA_TILE) {
            const int n = min(MLA_TILE, hi - base);
            scores(base, n);
            // Each head's new max and the weights of this tile: one thread per head.
            if (tid < MLA_HEADS) {
                float tile_max = -INFINITY;
                for (int r = 0; r < n; ++r) {
                    tile_max = fmaxf(tile_max, ps[tid][r]);
                }
                const float m_new = fmaxf(m, tile_max);
                const float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
                float sum = 0.0f;
                for (int r = 0; r < MLA_TILE; ++r) {
                    const float p = r < n ? expf(ps[tid][r] - m_new) : 0.0f;
                    ps[tid][r] = p;
                    sum += p;
                }
                lsum = lsum * corr + sum;
                m = m_new;
                corr_s[tid] = corr;
            }
            __syncthreads();
            const float corr = corr_s[vh];
#pragma unroll
            for (int i = 0; i < MLA_DV_PER_THREAD; ++i) {
                acc[i] *= corr;
            }
            weigh(n);
            __syncthreads(); // the tile is read before the next one overwrites it
        }
    }

#pragma unroll
    for (int i = 0; i < MLA_DV_PER_THREAD; ++i) {
        const int d = vd + i * per_head;
        if (d < dv) {
            out[d] = acc[i];
        }
    }
    if (tid < MLA_HEADS) {
        float* o = part + (((size_t)t * n_head + h0 + tid) * n_split + s) * (size_t)(dv + 2);
        o[dv] = m;
        o[dv + 1] = lsum;
    }
}

#define MLA_ENTRY(name, C)                                                                                      \
    extern "C" __global__ void __launch_bounds__(MLA_THREADS)                                                   \
        tandem_attn_mla_##name(const float* q, const KvMeta* meta, float* part, int layer, long long row_bytes, \
                               int n_head, int dk, int dv, float scale, int chunk) {                            \
        attn_mla<C>(q, meta, part, layer, row_bytes, n_head, dk, dv, scale, chunk);                             \
    }

MLA_ENTRY(f16, CacheF16)
MLA_ENTRY(bf16, CacheBF16)
MLA_ENTRY(q8_0, CacheQ8_0)

// part: [n_tokens][n_head][n_split][dv + 2] from an attention kernel; out: [n_tokens][n_head][dv]
// f32, the softmax-weighted sum of V (zero for a token that attends no row); n_head; dv; n_split.
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
        const float ms = p[s * row + dv];
        if (ms != -INFINITY) {
            l += expf(ms - m) * p[s * row + dv + 1];
        }
    }
    const float inv = 1.0f / l;
    for (int d = threadIdx.x; d < dv; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; ++s) {
            const float ms = p[s * row + dv];
            if (ms != -INFINITY) {
                acc += expf(ms - m) * p[s * row + d];
            }
        }
        o[d] = acc * inv;
    }
}
