/* Small helpers shared by the attention kinds (lolcats, liger, still):
 * a deterministic PRNG for parameter initialisation, kaiming-uniform init,
 * the sigmoid, an in-place softmax and the Hedgehog feature map.
 * Everything is static inline; the interface is stable. */
#ifndef STILL_ATTN_COMMON_H
#define STILL_ATTN_COMMON_H

#include "cpu/vecmath.h"
#include "kinds/still/attn_still_rules.h"   /* STILL_FMAP_CLAMP, still_splitmix_next */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* splitmix64: a tiny, good-enough generator for deterministic init. */
static inline uint64_t attn_rng_next(uint64_t *s) { return still_splitmix_next(s); }

/* Uniform in [0, 1) with 53 random bits. */
static inline double attn_rng_uniform(uint64_t *s) { return (double)(attn_rng_next(s) >> 11) * 0x1.0p-53; }

/* Standard normal (Box-Muller; one value per call, the second is dropped). */
static inline double attn_rng_normal(uint64_t *s) {
    double u1 = 1.0 - attn_rng_uniform(s);   /* (0, 1] so log() is finite */
    double u2 = attn_rng_uniform(s);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

/* torch.nn.init.kaiming_uniform_ defaults (a = 0, fan_in, leaky_relu gain
 * sqrt(2)): U(-b, b) with b = sqrt(6 / fan_in). */
static inline void attn_kaiming_uniform(float *w, size_t n, size_t fan_in, uint64_t *s) {
    const double b = sqrt(6.0 / (double)fan_in);
    for (size_t i = 0; i < n; i++) w[i] = (float)((2.0 * attn_rng_uniform(s) - 1.0) * b);
}

static inline float attn_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* x <- softmax(x) over n entries. */
static inline void attn_softmax_inplace(float *x, int n) {
    float mx = x[0];
    for (int i = 1; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    float sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = vec_expf(x[i] - mx);
        sum += x[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

/* Hedgehog feature map of one vector: zf = Σ_d x[d] W[d][f] (x W, W row-major
 * [D][F]), out[0..F) = softmax(z), out[F..2F) = softmax(-z), every entry
 * clamped at >= 1e-12. out has 2F floats. */
static inline void attn_hedgehog(const float *x, const float *W, int D, int F, float *out) {
    float *z = out, *nz = out + F;
    for (int f = 0; f < F; f++) z[f] = 0;
    for (int d = 0; d < D; d++) {
        const float xd = x[d];
        const float *wr = W + (size_t)d * F;
#pragma omp simd
        for (int f = 0; f < F; f++) z[f] += xd * wr[f];
    }
    for (int f = 0; f < F; f++) nz[f] = -z[f];
    attn_softmax_inplace(z, F);
    attn_softmax_inplace(nz, F);
    for (int f = 0; f < 2 * F; f++) out[f] = out[f] < STILL_FMAP_CLAMP ? STILL_FMAP_CLAMP : out[f];
}

#endif
