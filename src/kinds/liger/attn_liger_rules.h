/* liger's rules that the CPU (attn_liger.c) and the GPU (cuda/kinds/liger/attn_liger.cu) must agree on
 * (spec: "Liger"): a key's decay α = σ(k)^(1/16), computed as exp(log σ(k) / 16), and the output's mix
 * o = ½ o_swa + ½ o_lin. Compiled as C11 and as CUDA. */
#ifndef STILL_ATTN_LIGER_RULES_H
#define STILL_ATTN_LIGER_RULES_H

#include <math.h>

#ifdef __CUDACC__
#define LIGER_RULE __host__ __device__ __forceinline__
#else
#define LIGER_RULE static inline
#endif

#define LIGER_MIX 0.5f           /* each branch's share of the output */
#define LIGER_DECAY_POW 0.0625f  /* α = σ(k)^LIGER_DECAY_POW */

/* α of a key entry k: exp(log σ(k) · 1/16), log σ(k) = min(k, 0) − log1p(exp(−|k|)) (no overflow). */
LIGER_RULE float liger_decay(float k) { return expf((fminf(k, 0.0f) - log1pf(expf(-fabsf(k)))) * LIGER_DECAY_POW); }

#endif
