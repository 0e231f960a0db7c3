// Host emulation of the CUDA C++ that kernels/*.cu use, so that the same sources compile with a
// host C++ compiler and run on the CPU (tandem-cuda's `emulate` feature; the tests check every
// kernel there against the CPU reference on machines without a GPU).
//
// A block's threads are fibers on one OS thread, switched cooperatively (fiber.cc): a thread runs
// until it reaches __syncthreads(), a warp shuffle or __syncwarp(), or returns; a barrier lets
// its threads on once every thread of the block (or warp) that has not returned arrived there.
// `__shared__` variables are per OS thread (blocks run one after another on it), locals are per
// fiber (each has its own stack). Warps are 32 consecutive threads, as on the GPU.
//
// Only what the kernels use is here: adding a CUDA feature to a kernel means adding it here too,
// and the emulated-kernel tests fail to build until it is.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <cstddef>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __constant__
#define __shared__ static thread_local

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace tandem_emu {
extern thread_local uint3 g_block_idx;
extern thread_local dim3 g_block_dim;
extern thread_local dim3 g_grid_dim;
// The running thread's index in its block, lane in its warp, and its warp's exchange slots.
const uint3& thread_idx();
unsigned lane();
unsigned warp_size();
uint64_t* warp_slots();
void sync_block();
void sync_warp();

template <typename T>
inline uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffled values are at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}

template <typename T>
inline T from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}

// Every lane of the warp publishes `v`, then reads lane `src(lane)`'s (its own where that lane
// does not exist), as a shuffle does.
template <typename T, typename Src>
inline T exchange(T v, Src src) {
    uint64_t* s = warp_slots();
    const unsigned l = lane();
    s[l] = to_bits(v);
    sync_warp();
    const unsigned from = src(l);
    const T r = from < warp_size() ? from_bits<T>(s[from]) : v;
    sync_warp();
    return r;
}
} // namespace tandem_emu

#define threadIdx (::tandem_emu::thread_idx())
#define blockIdx (::tandem_emu::g_block_idx)
#define blockDim (::tandem_emu::g_block_dim)
#define gridDim (::tandem_emu::g_grid_dim)

inline void __syncthreads() {
    tandem_emu::sync_block();
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    tandem_emu::sync_warp();
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)mask;
    return tandem_emu::exchange(v, [=](unsigned l) {
        const unsigned seg = l & ~(unsigned)(width - 1);
        return seg | ((l ^ (unsigned)lane_mask) & (unsigned)(width - 1));
    });
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    (void)mask;
    return tandem_emu::exchange(v, [=](unsigned l) {
        return (l & ~(unsigned)(width - 1)) | ((unsigned)src_lane & (unsigned)(width - 1));
    });
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    (void)mask;
    return tandem_emu::exchange(v, [=](unsigned l) {
        return (l % (unsigned)width) + delta < (unsigned)width ? l + delta : l;
    });
}

inline unsigned __ballot_sync(unsigned mask, int pred) {
    (void)mask;
    uint64_t* s = tandem_emu::warp_slots();
    const unsigned l = tandem_emu::lane();
    s[l] = pred ? 1 : 0;
    tandem_emu::sync_warp();
    unsigned r = 0;
    for (unsigned i = 0; i < tandem_emu::warp_size(); ++i) {
        r |= (s[i] ? 1u : 0u) << i;
    }
    tandem_emu::sync_warp();
    return r;
}

// ---- numbers ------------------------------------------------------------------------------------

inline float __uint_as_float(unsigned u) { return tandem_emu::from_bits<float>(tandem_emu::to_bits(u)); }
inline unsigned __float_as_uint(float f) { return tandem_emu::from_bits<unsigned>(tandem_emu::to_bits(f)); }
inline float __int_as_float(int i) { return tandem_emu::from_bits<float>(tandem_emu::to_bits(i)); }
inline int __float_as_int(float f) { return tandem_emu::from_bits<int>(tandem_emu::to_bits(f)); }
// CUDA's integer min and max (the kernels use them without std::).
inline int min(int a, int b) {
    return a < b ? a : b;
}
inline int max(int a, int b) {
    return a > b ? a : b;
}
inline long long min(long long a, long long b) {
    return a < b ? a : b;
}
inline long long max(long long a, long long b) {
    return a > b ? a : b;
}
inline float rsqrtf(float x) {
    return 1.0f / sqrtf(x);
}
inline float __expf(float x) {
    return expf(x);
}
inline float __fdividef(float a, float b) {
    return a / b;
}
// A product rounded on its own (the emulator is built with -ffp-contract=off: nothing fuses).
inline float __fmul_rn(float a, float b) {
    return a * b;
}
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
