/* The rules of the gdn kind (Gated DeltaNet, spec "gdn") that every
 * implementation must agree on, written once: the parameter layout, the
 * initialisation's constants, the per-token gates β and α, the L2 norm of q and
 * k and the output's RMSNorm. Compiles as C11 and as CUDA C++ (host and device).
 *
 * Per KV head hk (the state is the KV head's; its G query heads read it):
 *   k̂ = k / ‖k‖, q̂ = q / ‖q‖ (q, k before RoPE: the delta rule has no positions)
 *   β_t = σ(w_β[hk] · x_t + b_β[hk]),   α_t = exp(−exp(a_log[hk]) · softplus(w_α[hk] · x_t + b_α[hk]))
 *   S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q̂_t
 * then per query head y = σ(W_g x + b_g) ⊙ (w_n ⊙ o / rms(o)), or with norm = 0 (plan key norm; a plan's
 * default) y = σ(W_g x + b_g) ⊙ w_n ⊙ o: the RMSNorm gives every head's output the same size, while a softmax
 * teacher's outputs vary by orders of magnitude (layer 0 of SmolLM2: 0.0004 mean square against the norm's ~0.8),
 * so a converted layer with the norm starts far from its teacher.
 * Optionally (conv = W > 0) q, k and v first pass a causal depthwise convolution of width W per channel,
 * x'_t = Σ_j w_c[j] x_{t−W+1+j} (earlier positions of the sequence, zero before its start), initialised to the
 * identity (w_c[W−1] = 1) so that a converted layer starts from the teacher's projections. The original applies
 * SiLU after it; here it stays linear, for the same reason. */
#ifndef STILL_ATTN_GDN_RULES_H
#define STILL_ATTN_GDN_RULES_H

#include <math.h>
#include <stddef.h>

#ifdef __CUDACC__
#define GDN_RULE __host__ __device__ __forceinline__
#else
#define GDN_RULE static inline
#endif

#define GDN_CHUNK 64           /* tokens per chunk of the chunked (WY) form */
#define GDN_L2_EPS 1e-6f       /* q / max(‖q‖, this) */
#define GDN_NORM_EPS 1e-6f     /* the output's RMSNorm: o / sqrt(mean(o²) + this) */
#define GDN_GATE_BIAS0 2.0f    /* b_g at initialisation: the output gate open (σ(2) = 0.88) */

/* ---- parameters (floats, in this order) ----------------------------------------------------
 * w_β [Hk][d], b_β [Hk], w_α [Hk][d], b_α [Hk], a_log [Hk], w_n [D] (the output norm's weight, shared by the
 * heads), W_g [H·D][d], b_g [H·D]. */
GDN_RULE size_t gdn_par_wbeta(int Hk, int d) { (void)Hk, (void)d; return 0; }
GDN_RULE size_t gdn_par_bbeta(int Hk, int d) { return (size_t)Hk * d; }
GDN_RULE size_t gdn_par_walpha(int Hk, int d) { return (size_t)Hk * d + Hk; }
GDN_RULE size_t gdn_par_balpha(int Hk, int d) { return 2 * (size_t)Hk * d + Hk; }
GDN_RULE size_t gdn_par_alog(int Hk, int d) { return 2 * (size_t)Hk * d + 2 * (size_t)Hk; }
GDN_RULE size_t gdn_par_wnorm(int Hk, int d) { return 2 * (size_t)Hk * d + 3 * (size_t)Hk; }
GDN_RULE size_t gdn_par_wg(int Hk, int d, int D) { return gdn_par_wnorm(Hk, d) + (size_t)D; }
GDN_RULE size_t gdn_par_bg(int H, int Hk, int d, int D) { return gdn_par_wg(Hk, d, D) + (size_t)H * D * d; }
GDN_RULE size_t gdn_par_count(int H, int Hk, int d, int D) { return gdn_par_bg(H, Hk, d, D) + (size_t)H * D; }
/* With a short convolution of width W (plan key conv; 0: none), its weights follow: w_c [(H + 2 Hk)·D][W], one
 * row per channel of q | k | v, tap W − 1 on the current token. */
GDN_RULE size_t gdn_par_conv(int H, int Hk, int d, int D) { return gdn_par_count(H, Hk, d, D); }
GDN_RULE size_t gdn_par_count_conv(int H, int Hk, int d, int D, int W) {
    return gdn_par_count(H, Hk, d, D) + (W > 0 ? (size_t)W * (H + 2 * Hk) * D : 0);
}
#define GDN_CONV_MAX 8         /* the widest short convolution */

/* ---- initialisation (so that stage 1 starts from a stable layer) ----------------------------
 * w_β = 0, b_β = 0: β = 1/2. w_α = 0; KV head hk of Hk gets A = exp(a_log) and a step dt (b_α =
 * softplus⁻¹(dt)) spread geometrically, A from 1 to 16 and dt from 0.1 to 0.001, so that the heads' decays
 * α = exp(−A dt) run from fast (e^−0.1) to slow (e^−0.016) memories; w_n = 1; W_g = 0, b_g = GDN_GATE_BIAS0. */
GDN_RULE float gdn_init_a(int hk, int Hk) { return Hk > 1 ? powf(16.0f, (float)hk / (float)(Hk - 1)) : 1.0f; }
GDN_RULE float gdn_init_dt(int hk, int Hk) {
    return Hk > 1 ? 0.1f * powf(0.01f, (float)hk / (float)(Hk - 1)) : 0.01f;
}
GDN_RULE float gdn_softplus_inv(float y) { return y > 20.0f ? y : logf(expm1f(y)); }

/* ---- per token ---------------------------------------------------------------------------- */

GDN_RULE float gdn_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
/* β from its pre-activation w_β · x + b_β. */
GDN_RULE float gdn_beta(float pre) { return 1.0f / (1.0f + expf(-pre)); }
/* log α (<= 0) from its pre-activation w_α · x + b_α and a_log. */
GDN_RULE float gdn_log_alpha(float pre, float a_log) { return -expf(a_log) * gdn_softplus(pre); }
/* The factor that L2-normalises a vector of squared norm nn. */
GDN_RULE float gdn_l2_factor(float nn) {
    const float n = sqrtf(nn);
    return 1.0f / (n > GDN_L2_EPS ? n : GDN_L2_EPS);
}
/* The output RMSNorm's factor for a head of D values with sum of squares ss. */
GDN_RULE float gdn_rms_factor(float ss, int D) { return 1.0f / sqrtf(ss / (float)D + GDN_NORM_EPS); }
/* The output's factor: the RMSNorm's with norm, else 1. */
GDN_RULE float gdn_out_factor(int norm, float ss, int D) { return norm ? gdn_rms_factor(ss, D) : 1.0f; }
/* The output gate from its pre-activation W_g x + b_g. */
GDN_RULE float gdn_gate(float pre) { return 1.0f / (1.0f + expf(-pre)); }

#endif
