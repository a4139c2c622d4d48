/* Rules that every attention kind shares on the CPU and the GPU, written
 * once: the logit scale of the softmax and its base-2 form for kernels that
 * exponentiate with exp2. Compiles as C11 and as CUDA C++ (host and device). */
#ifndef STILL_ATTN_RULES_H
#define STILL_ATTN_RULES_H

#include <math.h>

#ifdef __CUDACC__
#define ATTN_RULE __host__ __device__ __forceinline__
#else
#define ATTN_RULE static inline
#endif

#define ATTN_LOG2E 1.4426950408889634   /* log2 e: e^x = 2^(x log2 e) */

/* The softmax's logit scale 1/√D for head dimension D. */
ATTN_RULE float attn_logit_scale(int D) { return 1.0f / sqrtf((float)D); }

/* log2 e / √D, rounded once: the scale of kernels that take exp2 of the logits. */
ATTN_RULE float attn_logit_scale_log2(int D) { return (float)(ATTN_LOG2E / sqrt((double)D)); }

/* The keys a query at position t sees: causal, and under a sliding window W > 0 (swa, liger's window) the
 * last W of them, keys t − W < j <= t; W <= 0: no window. */
ATTN_RULE int attn_key_visible(int t, int j, int W) { return j <= t && (W <= 0 || j > t - W); }
/* The first key the query at t sees (0 without a window). */
ATTN_RULE int attn_window_first(int t, int W) { return W > 0 && t - W + 1 > 0 ? t - W + 1 : 0; }

#endif
