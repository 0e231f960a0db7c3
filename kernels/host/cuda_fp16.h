// Host emulation of the parts of <cuda_fp16.h> the kernels use: the __half type (the bits of an
// IEEE binary16) and its conversions, rounding to nearest even as the GPU's do.
#pragma once

#include <stdint.h>
#include <string.h>

struct __half {
    uint16_t bits;
};

inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.bits & 0x8000) << 16;
    const uint32_t exp = (h.bits >> 10) & 0x1f;
    uint32_t mant = h.bits & 0x3ff;
    uint32_t x;
    if (exp == 0) {
        if (mant == 0) {
            x = sign;
        } else {
            // A subnormal: normalize it.
            int e = -1;
            do {
                ++e;
                mant <<= 1;
            } while (!(mant & 0x400));
            x = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else {
        x = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

inline __half __float2half_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    uint32_t mant = x & 0x7fffff;
    const int32_t exp = (int32_t)((x >> 23) & 0xff);
    __half h;
    if (exp == 0xff) {
        h.bits = (uint16_t)(sign | 0x7c00 | (mant ? 0x200 | (mant >> 13) : 0));
        return h;
    }
    const int32_t e = exp - 127 + 15;
    if (e >= 0x1f) {
        h.bits = (uint16_t)(sign | 0x7c00);
        return h;
    }
    if (e <= 0) {
        if (e < -10) {
            h.bits = (uint16_t)sign;
            return h;
        }
        mant |= 0x800000;
        const uint32_t shift = (uint32_t)(14 - e);
        uint32_t m = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1);
        const uint32_t halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (m & 1))) {
            ++m;
        }
        h.bits = (uint16_t)(sign | m);
        return h;
    }
    uint32_t r = sign | ((uint32_t)e << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fff;
    // A carry out of the mantissa moves into the exponent, as rounding up should.
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) {
        ++r;
    }
    h.bits = (uint16_t)r;
    return h;
}

inline __half __float2half(float f) {
    return __float2half_rn(f);
}
