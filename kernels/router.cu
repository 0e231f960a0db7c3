// MoE routing of one token per warp, exactly `Moe::route` of crates/tandem-model/src/moe.rs
// (llama.cpp build_moe_ffn): softmax or sigmoid gating, the selection bias (selection only),
// group-limited routing (a group scores the sum of its best two), top-k with ties to the lower
// index, weights from the unbiased probabilities, optional normalization (sum clamped to the
// smallest normal f16) and scale.
//
// Launch (kernels/ABI.md): grid n_tokens, block 32.
#include "common.cuh"

// Experts (and groups) per token this kernel can route; the runtime checks n_expert against it.
#define ROUTER_MAX_EXPERT 1024
#define GATING_SOFTMAX 1
#define GATING_SIGMOID 2
// Smallest normal f16, the lower bound of the weight sum when normalizing (as llama.cpp).
#define NORM_MIN_SUM 6.103515625e-5f

// Index of the largest v[i] with !taken[i] (ties: the lower index), or -1 when every i < n is
// taken. Called by the whole warp; every lane gets the answer.
__device__ int warp_argmax(const float* v, const unsigned char* taken, int n) {
    const int lane = threadIdx.x;
    float best_v = -INFINITY;
    int best_i = -1;
    for (int i = lane; i < n; i += TANDEM_WARP) {
        // i grows, so a strict > keeps the lower index on ties.
        if (!taken[i] && (best_i < 0 || v[i] > best_v)) {
            best_v = v[i];
            best_i = i;
        }
    }
#pragma unroll
    for (int o = TANDEM_WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(TANDEM_FULL_MASK, best_v, o);
        const int oi = __shfl_xor_sync(TANDEM_FULL_MASK, best_i, o);
        if (oi >= 0 && (best_i < 0 || ov > best_v || (ov == best_v && oi < best_i))) {
            best_v = ov;
            best_i = oi;
        }
    }
    return best_i;
}

// logits: [n_tokens][n_expert] router logits; bias: [n_expert] selection bias (exp_probs_b) or
// null; n_expert <= 1024; n_used: experts chosen per token (<= n_expert); gating: 1 softmax,
// 2 sigmoid; n_group: expert groups (<= 1 means no group limit; else divides n_expert);
// n_group_used: groups kept; norm: nonzero divides the weights by their sum; scale: applied to
// the weights unless 0 or 1; ids, weights: [n_tokens][n_used] chosen experts, best first, and
// their weights.
extern "C" __global__ void __launch_bounds__(TANDEM_WARP)
    tandem_router_f32(const float* logits, const float* bias, int n_expert, int n_used, int gating, int n_group,
                      int n_group_used, int norm, float scale, int* ids, float* weights) {
    __shared__ float probs[ROUTER_MAX_EXPERT];
    __shared__ float sel[ROUTER_MAX_EXPERT];
    __shared__ float group_score[ROUTER_MAX_EXPERT];
    __shared__ unsigned char taken[ROUTER_MAX_EXPERT];
    const int t = blockIdx.x;
    const int lane = threadIdx.x;
    if (blockDim.x != TANDEM_WARP || n_expert > ROUTER_MAX_EXPERT || n_used > n_expert) {
        return;
    }
    const float* l = logits + (size_t)t * n_expert;

    // Gating probabilities; softmax sums in f64 like tandem-cpu's softmax_in_place.
    if (gating == GATING_SIGMOID) {
        for (int i = lane; i < n_expert; i += TANDEM_WARP) {
            probs[i] = 1.0f / (1.0f + expf(-l[i]));
        }
    } else {
        float mx = -INFINITY;
        for (int i = lane; i < n_expert; i += TANDEM_WARP) {
            mx = fmaxf(mx, l[i]);
        }
        mx = warp_max(mx);
        double sum = 0.0;
        for (int i = lane; i < n_expert; i += TANDEM_WARP) {
            const float e = expf(l[i] - mx);
            probs[i] = e;
            sum += (double)e;
        }
        sum = warp_sum_f64(sum);
        const float inv = (float)(1.0 / sum);
        for (int i = lane; i < n_expert; i += TANDEM_WARP) {
            probs[i] *= inv;
        }
    }
    for (int i = lane; i < n_expert; i += TANDEM_WARP) {
        sel[i] = bias != nullptr ? probs[i] + bias[i] : probs[i];
        taken[i] = 0;
    }
    __syncwarp();

    if (n_group > 1) {
        // A group's score is the sum of its two best experts (one when a group has one expert).
        const int per = n_expert / n_group;
        for (int g = lane; g < n_group; g += TANDEM_WARP) {
            const float* s = sel + g * per;
            int b0 = 0;
            for (int i = 1; i < per; ++i) {
                if (s[i] > s[b0]) {
                    b0 = i;
                }
            }
            float score = s[b0];
            if (per > 1) {
                int b1 = -1;
                for (int i = 0; i < per; ++i) {
                    if (i != b0 && (b1 < 0 || s[i] > s[b1])) {
                        b1 = i;
                    }
                }
                score += s[b1];
            }
            group_score[g] = score;
        }
        __syncwarp();
        // Keep the n_group_used best groups; mark them in `taken`, then clear it for the experts.
        for (int k = 0; k < n_group_used && k < n_group; ++k) {
            const int g = warp_argmax(group_score, taken, n_group);
            __syncwarp();
            if (lane == 0 && g >= 0) {
                taken[g] = 1;
            }
            __syncwarp();
        }
        for (int i = lane; i < n_expert; i += TANDEM_WARP) {
            if (!taken[i / per]) {
                sel[i] = -INFINITY;
            }
        }
        __syncwarp();
        for (int g = lane; g < n_group; g += TANDEM_WARP) {
            taken[g] = 0;
        }
        __syncwarp();
    }

    int* out_ids = ids + (size_t)t * n_used;
    float* out_w = weights + (size_t)t * n_used;
    for (int k = 0; k < n_used; ++k) {
        const int e = warp_argmax(sel, taken, n_expert);
        __syncwarp();
        if (lane == 0) {
            taken[e] = 1;
            out_ids[k] = e;
            out_w[k] = probs[e];
        }
        __syncwarp();
    }
    if (lane == 0) {
        if (norm) {
            float sum = 0.0f;
            for (int k = 0; k < n_used; ++k) {
                sum += out_w[k];
            }
            sum = fmaxf(sum, NORM_MIN_SUM);
            for (int k = 0; k < n_used; ++k) {
                out_w[k] /= sum;
            }
        }
        if (scale != 0.0f && scale != 1.0f) {
            for (int k = 0; k < n_used; ++k) {
                out_w[k] *= scale;
            }
        }
    }
}
