/* Small math functions written so the compiler can vectorize loops that call
 * them (no libm calls inside hot loops). */
#ifndef STILL_VECMATH_H
#define STILL_VECMATH_H

#include <stdint.h>

/* e^x for float x, relative error below 2e-7 over the normal range; returns 0
 * for x < -87.3 (including -inf), saturates at e^88.7, and returns a NaN for a
 * NaN (which the clamp turns into a finite value first, so that the exponent
 * bits below never come from converting a NaN to an integer). Range reduction
 * x = n ln2 + r with |r| <= ln2/2, then a degree-6 polynomial for e^r - 1 - r
 * (Taylor coefficients nudged to a minimax fit) and 2^n built from the
 * exponent bits. */
static inline float vec_expf(float x) {
    const float lo = -87.33654f, hi = 88.72283f;
    const float x_in = x;
    int underflow = x < lo;
    x = x > lo ? x : lo;   /* a NaN fails the comparison: lo */
    x = x < hi ? x : hi;
    /* n = round(x / ln2): adding and subtracting 1.5·2^23 rounds to an
     * integer (|x / ln2| < 2^22 after clamping); floorf would not vectorize
     * without -fno-trapping-math. */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;        /* ln2 split into an exact high part */
    r = r - n * -2.12194440e-4f;           /* and the low remainder */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    float y = e * scale.f;
    return x_in != x_in ? x_in : underflow ? 0.0f : y;
}

static inline float vec_silu(float x) { return x / (1.0f + vec_expf(-x)); }

#endif
