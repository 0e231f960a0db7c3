// Strided copies of f32 rows on the device (the executor's Copy2d: gathering rows, assembling
// per-head keys from the latent, splitting a micro-batch's rows among sequences).
//
// Launch (kernels/ABI.md): 1-D, block 256, any grid (a grid-stride loop).
#include "common.cuh"

// dst, src: f32; rows, width: for r < rows, width values from src[(r / src_rep) * src_stride ..]
// to dst[r * dst_stride ..] (the offsets are in the pointers); src_rep >= 1 repeats a source row.
extern "C" __global__ void tandem_copy_rows_f32(float* dst, const float* src, int rows, int width,
                                                long long src_stride, int src_rep, long long dst_stride) {
    const long long n = (long long)rows * width;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width;
        const long long c = i % width;
        dst[r * dst_stride + c] = src[(r / src_rep) * src_stride + c];
    }
}
