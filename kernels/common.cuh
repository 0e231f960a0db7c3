// Shared by every kernel: ggml's block layouts (ggml/src/ggml-common.h, mirrored by
// crates/tandem-quant/src/blocks.rs), the dequantization of one 32-value chunk of a block per type
// (ported from crates/tandem-quant/src/dequant.rs), and warp reductions.
//
// Every quantized type is handled as a sequence of 32-value chunks: a block of 32 values is one
// chunk, a 256-value k-quant super-block is 8 chunks. matvec.cu and dequant.cu both go through
// `Type::chunk`, so one port of each format serves both.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#define TANDEM_WARP 32
#define TANDEM_FULL_MASK 0xffffffffu

#define QK_K 256
#define QK4_0 32
#define QK5_0 32
#define QK8_0 32
#define K_SCALE_SIZE 12
// Values per chunk: every block size of the supported types is a multiple of it.
#define CHUNK 32

// Blocks hold only 2-byte-aligned fields (__half, uint16_t) and bytes, so every block size is even
// and a block at any even offset of a cudaMalloc'd buffer is correctly aligned.
struct block_q4_0 {
    __half d;
    uint8_t qs[QK4_0 / 2]; // low nibbles: values 0..16, high nibbles: values 16..32
};
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 size");

struct block_q5_0 {
    __half d;
    uint8_t qh[4]; // fifth bit of value j in bit j (little-endian u32)
    uint8_t qs[QK5_0 / 2];
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 size");

struct block_q8_0 {
    __half d;
    int8_t qs[QK8_0];
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 size");

struct block_q4_K {
    __half d;
    __half dmin;
    uint8_t scales[K_SCALE_SIZE]; // 6-bit scales and mins of the 8 groups of 32
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q4_K) == 144, "block_q4_K size");

struct block_q5_K {
    __half d;
    __half dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_q5_K) == 176, "block_q5_K size");

struct block_q6_K {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    __half d;
};
static_assert(sizeof(block_q6_K) == 210, "block_q6_K size");

struct block_iq4_xs {
    __half d;
    uint16_t scales_h;
    uint8_t scales_l[QK_K / 64];
    uint8_t qs[QK_K / 2];
};
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs size");

// ggml-common.h kvalues_iq4nl.
__device__ __constant__ int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                     1,    13,   25,  38,  53,  69,  89,  113};

// tandem-quant get_scale_min_k4 (ggml-quants.c).
__device__ __forceinline__ void get_scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One type per struct: BYTES per block, ELEMS values per block, and chunk(b, j, y) writing values
// 32*j .. 32*j+32 of block `b` (j < ELEMS / 32) to y[0..32].

struct TypeQ4_0 {
    static constexpr int BYTES = sizeof(block_q4_0);
    static constexpr int ELEMS = QK4_0;
    __device__ static void chunk(const uint8_t* p, int, float* y) {
        const block_q4_0* b = reinterpret_cast<const block_q4_0*>(p);
        const float d = __half2float(b->d);
        for (int j = 0; j < QK4_0 / 2; ++j) {
            const int q = b->qs[j];
            y[j] = (float)((q & 0x0F) - 8) * d;
            y[j + QK4_0 / 2] = (float)((q >> 4) - 8) * d;
        }
    }
};

struct TypeQ5_0 {
    static constexpr int BYTES = sizeof(block_q5_0);
    static constexpr int ELEMS = QK5_0;
    __device__ static void chunk(const uint8_t* p, int, float* y) {
        const block_q5_0* b = reinterpret_cast<const block_q5_0*>(p);
        const float d = __half2float(b->d);
        const uint32_t qh = (uint32_t)b->qh[0] | ((uint32_t)b->qh[1] << 8) | ((uint32_t)b->qh[2] << 16) |
                            ((uint32_t)b->qh[3] << 24);
        for (int j = 0; j < QK5_0 / 2; ++j) {
            const uint32_t q = b->qs[j];
            const uint32_t xh_0 = ((qh >> j) << 4) & 0x10;
            const uint32_t xh_1 = (qh >> (j + 12)) & 0x10;
            y[j] = (float)((int)((q & 0x0F) | xh_0) - 16) * d;
            y[j + QK5_0 / 2] = (float)((int)((q >> 4) | xh_1) - 16) * d;
        }
    }
};

struct TypeQ8_0 {
    static constexpr int BYTES = sizeof(block_q8_0);
    static constexpr int ELEMS = QK8_0;
    __device__ static void chunk(const uint8_t* p, int, float* y) {
        const block_q8_0* b = reinterpret_cast<const block_q8_0*>(p);
        const float d = __half2float(b->d);
        for (int j = 0; j < QK8_0; ++j) {
            y[j] = (float)b->qs[j] * d;
        }
    }
};

// Group j of 8: values 64*(j/2) + 32*(j%2) .. +32 come from the low (j even) or high (j odd)
// nibbles of qs[32*(j/2) .. +32], with scale and min j.
struct TypeQ4_K {
    static constexpr int BYTES = sizeof(block_q4_K);
    static constexpr int ELEMS = QK_K;
    __device__ static void chunk(const uint8_t* p, int j, float* y) {
        const block_q4_K* b = reinterpret_cast<const block_q4_K*>(p);
        int sc, m;
        get_scale_min_k4(j, b->scales, &sc, &m);
        const float d = __half2float(b->d) * (float)sc;
        const float mn = __half2float(b->dmin) * (float)m;
        const uint8_t* q = b->qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) {
            y[l] = d * (float)((q[l] >> shift) & 0xF) - mn;
        }
    }
};

// As Q4_K, plus the fifth bit of value l of group j in bit j of qh[l].
struct TypeQ5_K {
    static constexpr int BYTES = sizeof(block_q5_K);
    static constexpr int ELEMS = QK_K;
    __device__ static void chunk(const uint8_t* p, int j, float* y) {
        const block_q5_K* b = reinterpret_cast<const block_q5_K*>(p);
        int sc, m;
        get_scale_min_k4(j, b->scales, &sc, &m);
        const float d = __half2float(b->d) * (float)sc;
        const float mn = __half2float(b->dmin) * (float)m;
        const uint8_t* ql = b->qs + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        const uint8_t u = (uint8_t)(1u << j);
        for (int l = 0; l < 32; ++l) {
            const int h = (b->qh[l] & u) ? 16 : 0;
            y[l] = d * (float)(((ql[l] >> shift) & 0xF) + h) - mn;
        }
    }
};

// Chunk j = 4*n + k (n: half of 128 values, k: quarter): low 4 bits from the low (k < 2) or high
// nibbles of ql[64n + 32(k%2) + l], high 2 bits from bits 2k of qh[32n + l], scale
// scales[8n + 2k + l/16].
struct TypeQ6_K {
    static constexpr int BYTES = sizeof(block_q6_K);
    static constexpr int ELEMS = QK_K;
    __device__ static void chunk(const uint8_t* p, int j, float* y) {
        const block_q6_K* b = reinterpret_cast<const block_q6_K*>(p);
        const float d = __half2float(b->d);
        const int n = j / 4;
        const int k = j % 4;
        const uint8_t* ql = b->ql + 64 * n + 32 * (k % 2);
        const uint8_t* qh = b->qh + 32 * n;
        const int lshift = 4 * (k / 2);
        const int hshift = 2 * k;
        const int8_t* sc = b->scales + 8 * n + 2 * k;
        for (int l = 0; l < 32; ++l) {
            const int q = (((ql[l] >> lshift) & 0xF) | (((qh[l] >> hshift) & 3) << 4)) - 32;
            y[l] = d * (float)sc[l / 16] * (float)q;
        }
    }
};

struct TypeIQ4_XS {
    static constexpr int BYTES = sizeof(block_iq4_xs);
    static constexpr int ELEMS = QK_K;
    __device__ static void chunk(const uint8_t* p, int ib, float* y) {
        const block_iq4_xs* b = reinterpret_cast<const block_iq4_xs*>(p);
        const float d = __half2float(b->d);
        const int ls = ((b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) | (((b->scales_h >> (2 * ib)) & 3) << 4);
        const float dl = d * (float)(ls - 32);
        const uint8_t* qs = b->qs + 16 * ib;
        for (int j = 0; j < 16; ++j) {
            y[j] = dl * (float)kvalues_iq4nl[qs[j] & 0xF];
            y[j + 16] = dl * (float)kvalues_iq4nl[qs[j] >> 4];
        }
    }
};

// A token's place in the KV cache (16 bytes; tandem-model's step metadata): its sequence's rows
// start at `base`, the rows of layer `l` (of those the device holds) at base + l * cap * row_bytes,
// row j of it at + j * row_bytes; the token sits at position `pos` (it attends rows 0..=pos).
struct KvMeta {
    unsigned long long base;
    unsigned int cap;
    unsigned int pos;
};
static_assert(sizeof(KvMeta) == 16, "KvMeta size");

__device__ __forceinline__ const uint8_t* kv_row(const KvMeta& m, int layer, long long row_bytes, long long j) {
    return reinterpret_cast<const uint8_t*>(m.base) + ((long long)layer * m.cap + j) * row_bytes;
}

// The KV cache formats: `load(row, i)` is value i of a run of values starting at `row` (a head's
// start: whole blocks for q8_0), `bytes(n)` the bytes of n values, `round_p(p)` a probability as
// ggml converts it for the product with V rows of this format (f16, bf16; q8_0 keeps it).
struct CacheF16 {
    __device__ static float load(const uint8_t* row, int i) {
        return __half2float(reinterpret_cast<const __half*>(row)[i]);
    }
    __device__ static float round_p(float p) {
        return __half2float(__float2half_rn(p));
    }
    __device__ static long long bytes(long long n) {
        return 2 * n;
    }
};

struct CacheBF16 {
    __device__ static float load(const uint8_t* row, int i) {
        return __uint_as_float((uint32_t)reinterpret_cast<const uint16_t*>(row)[i] << 16);
    }
    __device__ static float round_p(float p);
    __device__ static long long bytes(long long n) {
        return 2 * n;
    }
};

struct CacheQ8_0 {
    __device__ static float load(const uint8_t* row, int i) {
        const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + i / QK8_0;
        return __half2float(b->d) * (float)b->qs[i % QK8_0];
    }
    __device__ static float round_p(float p) {
        return p;
    }
    __device__ static long long bytes(long long n) {
        return n / QK8_0 * (long long)sizeof(block_q8_0);
    }
};

// ggml's f32 -> bf16: round to nearest even, NaN kept quiet (tandem-quant f32_to_bf16).
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    const uint32_t i = __float_as_uint(f);
    if ((i & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((i >> 16) | 64);
    }
    return (uint16_t)((i + (0x7fffu + ((i >> 16) & 1u))) >> 16);
}

__device__ __forceinline__ float CacheBF16::round_p(float p) {
    return __uint_as_float((uint32_t)f32_to_bf16(p) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(TANDEM_FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
        v += __shfl_xor_sync(TANDEM_FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(TANDEM_FULL_MASK, v, o));
    }
    return v;
}
