// Appends rows to the KV cache on the device: each token's f32 row converted to the cache format
// and written at its position (tandem-quant's quantize_row for f16, bf16 and q8_0). Reference:
// tandem-model's host cache (HostKv::push).
//
// Launch (kernels/ABI.md): grid n_tokens, block 256.
#include "common.cuh"

#define KV_THREADS 256

// src: [n_tokens] rows `src_stride` apart, `width` f32 values each; meta: [n_tokens] (KvMeta);
// layer: the layer among those this device holds; row_bytes: bytes of one cache row (K and V
// together); byte_off: where in the row these values go (0 for K, K's bytes for V); width: a
// multiple of 32 for q8_0.
template <typename F>
__device__ void kv_store(const float* src, long long src_stride, const KvMeta* meta, int layer, long long row_bytes,
                         long long byte_off, int width, F write) {
    const int t = blockIdx.x;
    const KvMeta m = meta[t];
    uint8_t* dst = const_cast<uint8_t*>(kv_row(m, layer, row_bytes, m.pos)) + byte_off;
    const float* s = src + (long long)t * src_stride;
    write(s, dst, width);
}

// The entry point `name`: each value of the row converted to `T` by `cvt`, the threads taking
// them in turn.
#define KV_STORE_FLOAT(name, T, cvt)                                                                                  \
    extern "C" __global__ void __launch_bounds__(KV_THREADS)                                                          \
        name(const float* src, long long src_stride, const KvMeta* meta, int layer, long long row_bytes,              \
             long long byte_off, int width) {                                                                         \
        kv_store(src, src_stride, meta, layer, row_bytes, byte_off, width, [](const float* s, uint8_t* d, int n) {  \
            T* h = reinterpret_cast<T*>(d);                                                                           \
            for (int i = threadIdx.x; i < n; i += blockDim.x) {                                                       \
                h[i] = cvt(s[i]);                                                                                     \
            }                                                                                                         \
        });                                                                                                           \
    }

KV_STORE_FLOAT(tandem_kv_store_f16, __half, __float2half_rn)
KV_STORE_FLOAT(tandem_kv_store_bf16, uint16_t, f32_to_bf16)

// One warp per block of 32 values: d = max|x| / 127, q = round(x / d), as ggml's
// quantize_row_q8_0_ref.
extern "C" __global__ void __launch_bounds__(KV_THREADS)
    tandem_kv_store_q8_0(const float* src, long long src_stride, const KvMeta* meta, int layer, long long row_bytes,
                         long long byte_off, int width) {
    kv_store(src, src_stride, meta, layer, row_bytes, byte_off, width, [](const float* s, uint8_t* d, int n) {
        block_q8_0* blocks = reinterpret_cast<block_q8_0*>(d);
        const int lane = threadIdx.x % TANDEM_WARP;
        const int warp = threadIdx.x / TANDEM_WARP;
        const int n_warps = blockDim.x / TANDEM_WARP;
        const int n_blocks = n / QK8_0;
        // Every lane of every warp runs the same number of rounds, so the shuffles meet.
        for (int b0 = 0; b0 < n_blocks; b0 += n_warps) {
            const int b = b0 + warp;
            const float v = b < n_blocks ? s[b * QK8_0 + lane] : 0.0f;
            const float amax = warp_max(fabsf(v));
            if (b < n_blocks) {
                const float dq = amax / 127.0f;
                const float id = dq != 0.0f ? 1.0f / dq : 0.0f;
                blocks[b].qs[lane] = (int8_t)roundf(v * id);
                if (lane == 0) {
                    blocks[b].d = __float2half_rn(dq);
                }
            }
        }
    });
}
