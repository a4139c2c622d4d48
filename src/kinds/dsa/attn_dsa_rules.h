/* The rules of the dsa kind (gated fine-grained sparse attention with a lightning indexer, spec "dsa") that every
 * implementation must agree on, written once: the parameter layout, the initialisation, the indexer's score and the
 * selection rule. Compiles as C11 and as CUDA C++ (host and device).
 *
 * Per token t (query), with x_t the layer's normalised input:
 *   indexer: H_I heads of d_I values, q^I_{t,j} = W_qI[j] x_t, one key per token k^I_s = W_kI x_s, head weights
 *            w_{t,j} = W_w[j] · x_t + b_w[j];  I_{t,s} = Σ_j w_{t,j} ReLU(q^I_{t,j} · k^I_s)
 *   selection: the last DSA_LOCAL positions (s > t − DSA_LOCAL, t itself included) always, and of the older
 *            positions the topk − DSA_LOCAL with the largest I_{t,s} (ties: the later position first); every
 *            position when t + 1 <= topk
 *   attention: per query head h, softmax over the selected keys of its KV head of (q_h · k_s) / sqrt(D) (q and k
 *            after RoPE, the layer's own KV cache), o_h = Σ p_s v_s
 *   output:  y_h = σ(W_g x_t + b_g) ⊙ o_h.
 * The local window is a deviation from the spec's plain top-K: without positions the indexer cannot prefer the
 * recent tokens that a small model's heads attend to most, and forcing them in leaves it the long-range choice.
 * No RoPE inside the indexer. */
#ifndef STILL_ATTN_DSA_RULES_H
#define STILL_ATTN_DSA_RULES_H

#include <math.h>
#include <stddef.h>

#ifdef __CUDACC__
#define DSA_RULE __host__ __device__ __forceinline__
#else
#define DSA_RULE static inline
#endif

#define DSA_LOCAL 64             /* the most recent positions, always selected */
#define DSA_GATE_BIAS0 4.0f      /* b_g at initialisation: the gate open (σ(4) = 0.982), the layer ≈ its teacher */
#define DSA_HEADS_DEFAULT 4      /* H_I */
#define DSA_DIM_DEFAULT 64       /* d_I */
#define DSA_TOPK_DIVISOR 16      /* topk's default: the trained context / 16 (512 for an 8K model) */
#define DSA_MAX_HEADS 64
#define DSA_MAX_DIM 512

/* ---- parameters (floats, in this order) ------------------------------------------------------
 * W_qI [H_I·d_I][d], W_kI [d_I][d], W_w [H_I][d], b_w [H_I], W_g [H·D][d], b_g [H·D]. */
DSA_RULE size_t dsa_par_wq(void) { return 0; }
DSA_RULE size_t dsa_par_wk(int HI, int dI, int d) { return (size_t)HI * dI * d; }
DSA_RULE size_t dsa_par_ww(int HI, int dI, int d) { return (size_t)HI * dI * d + (size_t)dI * d; }
DSA_RULE size_t dsa_par_bw(int HI, int dI, int d) { return dsa_par_ww(HI, dI, d) + (size_t)HI * d; }
DSA_RULE size_t dsa_par_wg(int HI, int dI, int d) { return dsa_par_bw(HI, dI, d) + (size_t)HI; }
DSA_RULE size_t dsa_par_bg(int HI, int dI, int d, int H, int D) { return dsa_par_wg(HI, dI, d) + (size_t)H * D * d; }
DSA_RULE size_t dsa_par_count(int HI, int dI, int d, int H, int D) {
    return dsa_par_bg(HI, dI, d, H, D) + (size_t)H * D;
}

/* topk's default for a model trained on n_ctx_train tokens (never below twice the local window). */
DSA_RULE int dsa_default_topk(int n_ctx_train) {
    const int k = n_ctx_train / DSA_TOPK_DIVISOR;
    return k > 2 * DSA_LOCAL ? k : 2 * DSA_LOCAL;
}

/* ---- initialisation ---------------------------------------------------------------------------
 * W_qI, W_kI ~ N(0, 1/d) (so q^I · k^I has a spread of about sqrt(d_I)); W_w = 0, b_w = 1/H_I (every indexer head
 * weighs the same until trained); W_g = 0, b_g = DSA_GATE_BIAS0. */
DSA_RULE float dsa_init_bw(int HI) { return 1.0f / (float)HI; }

/* ---- per token -------------------------------------------------------------------------------- */

/* One indexer head's term: w · ReLU(dot). */
DSA_RULE float dsa_index_term(float w, float dot) { return dot > 0.0f ? w * dot : 0.0f; }
/* Does score a at position sa rank before score b at position sb (the larger score; ties: the later position)? */
DSA_RULE int dsa_ranks_before(float a, int sa, float b, int sb) { return a > b || (a == b && sa > sb); }
/* The output gate from its pre-activation W_g x + b_g. */
DSA_RULE float dsa_gate(float pre) { return 1.0f / (1.0f + expf(-pre)); }

#endif
