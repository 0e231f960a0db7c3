// The routed experts' packet and sum (tandem-model's Moe::route_packet and Moe::combine): the
// router's choice packed with the hidden state for the device that runs the experts, and the
// experts' outputs weighted and summed in selection order.
//
// Launch (kernels/ABI.md): grid n_tokens, block 256, for both.
#include "common.cuh"

// h: [n_tokens][n_embd]; ids, w: [n_tokens][n_used] (tandem_router_f32); packet: [n_tokens]
// rows of n_embd + 2 n_used: the row of h, the ids as f32 (exact below 2^24), the weights.
extern "C" __global__ void tandem_moe_pack_f32(const float* h, const int* ids, const float* w, float* packet,
                                               int n_embd, int n_used) {
    const int t = blockIdx.x;
    const long long row = (long long)n_embd + 2 * n_used;
    float* p = packet + t * row;
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) {
        p[i] = h[(long long)t * n_embd + i];
    }
    for (int i = threadIdx.x; i < n_used; i += blockDim.x) {
        p[n_embd + i] = (float)ids[t * n_used + i];
        p[n_embd + n_used + i] = w[t * n_used + i];
    }
}

// y: [n_tokens][n_used][n_embd] expert outputs in selection order; packet: rows of packet_row
// with the weights at n_embd + n_used; out: [n_tokens][n_embd] = sum over slots of w * y, added
// in slot order.
extern "C" __global__ void tandem_moe_sum_f32(const float* y, const float* packet, float* out, int n_embd,
                                              int n_used, int packet_row) {
    const int t = blockIdx.x;
    const float* w = packet + (long long)t * packet_row + n_embd + n_used;
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) {
        float acc = 0.0f;
        for (int k = 0; k < n_used; ++k) {
            const float v = y[((long long)t * n_used + k) * n_embd + i] * w[k];
            acc = k == 0 ? v : acc + v;
        }
        out[(long long)t * n_embd + i] = acc;
    }
}
