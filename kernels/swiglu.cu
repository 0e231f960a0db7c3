// gate = silu(gate) * up, as tandem-cpu's `silu_mul` (ggml_swiglu_split; silu(x) = x / (1 + e^-x)).
//
// Launch (kernels/ABI.md): grid ceil(n / 256), block 256 (a grid-stride loop, so any grid works).
#include "common.cuh"

// gate: n f32, overwritten with the result; up: n f32; n: values.
extern "C" __global__ void tandem_swiglu_f32(float* gate, const float* up, long long n) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
