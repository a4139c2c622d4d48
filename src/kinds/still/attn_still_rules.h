/* The rules of the still kind (and of lolcats, which the GPU runs as a mode
 * of still's kernels) that every implementation must agree on, written once:
 * the CPU kind (src/kinds/still/attn_still.c, src/kinds/lolcats/attn_lolcats.c), the CUDA kernels
 * (cuda/attn_still*.cu, cuda/train/train_lm_still.cu), the GPU trainers
 * (src/train/train_cuda.c, src/train/train_lm_cuda.c, src/model/model_cuda.c) and the plan
 * (src/model/model.c) include this header. It compiles as C11 and as CUDA C++
 * (the functions are host-and-device there).
 *
 * What is here (spec: ../shared/spec/attention.md, "still"):
 * - the self-saliency score as a function of a token's own weight p in its
 *   window, the random routing hash, the position routing's offsets;
 * - what a plan must be (the checks every backend makes before its own limits);
 * - λ (tokens a leaving chunk may keep) and the Sel capacity;
 * - the output's denominator, NP-Map's reflection factor and rescale;
 * - the parameters' layout, as offsets in floats. */
#ifndef STILL_ATTN_STILL_RULES_H
#define STILL_ATTN_STILL_RULES_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __CUDACC__
#define STILL_RULE __host__ __device__ __forceinline__
#define STILL_HOST_RULE static inline __host__
#else
#define STILL_RULE static inline
#define STILL_HOST_RULE static inline
#endif

#define STILL_SAL_EPS 1e-8       /* ε of the self-saliency score */
#define STILL_DEN_EPS 1e-6f      /* ε of the denominator γ·l + b (+ the gate's share) of still and lolcats */
#define STILL_FMAP_CLAMP 1e-12f  /* the feature maps' floor: φ = max(softmax(±z), this) (NP-Map, Hedgehog) */
#define STILL_NORM_FLOOR 1e-12f  /* NP-Map's rescale ‖x‖ / max(‖z‖, this) */

/* The ids both backends pass between them: src/kinds/attn.h's attn_routing and attn_feature_map take their
 * values from these, and the CUDA kernels compare against them. */
enum { STILL_ROUTE_SALIENCY = 0, STILL_ROUTE_RANDOM, STILL_ROUTE_KEYNORM, STILL_ROUTE_QK, STILL_ROUTE_POSITION,
       STILL_ROUTE_NONE };
enum { STILL_FMAP_NPMAP = 0, STILL_FMAP_HEDGEHOG };

/* ---- routing -------------------------------------------------------------------------------- */

/* The self-saliency score from the token's own weight p in its window R(j) (spec, "Self-saliency score"):
 * since a_diag_l = (1 − p) a_nodiag_l for l ≠ j, Σ_l a_diag_l log((a_diag_l + ε) / (a_nodiag_l + ε)) is
 * f(p) = p log((p + ε) / ε) + (1 − p) log(1 − p) up to the ε inside the other terms' logs (the tests check
 * that this form selects what the explicit formula selects). NaN maps to p = 0. */
STILL_RULE double still_saliency_of_p(double p) {
    if (!(p > 0)) p = 0;
    if (p > 1) p = 1;
    double r = p * log((p + STILL_SAL_EPS) / STILL_SAL_EPS);
    if (p < 1) r += (1 - p) * log1p(-p);
    return r;
}

/* splitmix64's step. */
STILL_RULE uint64_t still_splitmix_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Random routing: a uniform number in [0, 1) from (seed, selection head, position). */
STILL_RULE double still_route_random(uint64_t seed, int hs, int pos) {
    uint64_t s = seed ^ 0x5851f42d4c957f2dULL;
    s += ((uint64_t)(uint32_t)pos << 24) ^ (uint64_t)(uint32_t)hs;
    still_splitmix_next(&s);
    return (double)(still_splitmix_next(&s) >> 11) * 0x1.0p-53;
}

/* The window R(t) in which token t's self-saliency is scored: its own chunk-length past, keys
 * still_window_lo(t, C) .. t. */
STILL_RULE int still_window_lo(int t, int C) { return t - C + 1 > 0 ? t - C + 1 : 0; }

/* A query head's part of a token's routing value: its score (qk routing: divided by C). A selection head's
 * value sums its query heads' parts in head order (per KV head: the G heads of the KV head); random routing
 * takes still_route_random instead. */
STILL_RULE double still_route_term(int routing, double score, int C) {
    return routing == STILL_ROUTE_QK ? score / C : score;
}

/* The value a token is ranked by: its routing value, NaN last. */
STILL_RULE double still_rank_value(double v) { return v != v ? -INFINITY : v; }

/* The order of selection: (a, i) ranks before (b, j) when a > b, or a == b and position i < j. */
STILL_RULE int still_ranks_before(double a, int i, double b, int j) { return a > b || (a == b && i < j); }

/* sel_span R: offset i of a leaving chunk ranks by the best value of offsets still_span_lo .. still_span_hi (of
 * the n offsets in the ring: the chunk and the next, n = 2C). */
STILL_RULE int still_span_lo(int i, int R) { return i - R > 0 ? i - R : 0; }
STILL_RULE int still_span_hi(int i, int R, int n) { return i + R < n - 1 ? i + R : n - 1; }

/* Position routing: the offset in a chunk of C of pick i of n (evenly spaced). */
STILL_RULE int still_position_offset(int i, int n, int C) { return (int)(((long long)(2 * i + 1) * C) / (2 * n)); }

/* ---- what a plan must be ---------------------------------------------------------------------- */

/* The fields of a layer's plan that the rules below read (the CPU's attn_config, the GPU's stc_still_config). */
typedef struct {
    int head_dim, n_head, n_head_kv, d_model, n_ctx;
    int chunk, budget, routing, sel_span, sel_global;
    int linear, feature_map, feature_dim, gate, gate_den;
} still_plan_fields;

enum { STILL_PLAN_OK = 0, STILL_PLAN_BAD_ARG, STILL_PLAN_UNSUPPORTED };

/* Whether a still plan is valid on any backend: STILL_PLAN_OK, or the kind of problem with its one-line
 * explanation in msg (n bytes). Each backend adds its own limits after these (head dims, chunk lengths). */
STILL_HOST_RULE int still_plan_check(const still_plan_fields *c, char *msg, size_t n) {
    if (c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 || c->n_head % c->n_head_kv) {
        snprintf(msg, n, "still: attention shape unsupported (head dim %d, %d heads, %d KV heads)", c->head_dim,
                 c->n_head, c->n_head_kv);
        return STILL_PLAN_UNSUPPORTED;
    }
    if (c->chunk <= 0) snprintf(msg, n, "still: chunk must be positive, got %d", c->chunk);
    else if (c->chunk > (1 << 20)) snprintf(msg, n, "still: chunk %d too large", c->chunk);
    else if (c->n_ctx <= 0) snprintf(msg, n, "still: n_ctx must be positive, got %d", c->n_ctx);
    else if (c->budget < 0 || (c->budget > 0 && c->budget < 2 * c->chunk))
        snprintf(msg, n, "still: budget must be 0 (uncapped) or >= 2*chunk = %d, got %d", 2 * c->chunk, c->budget);
    else if (c->routing < STILL_ROUTE_SALIENCY || c->routing > STILL_ROUTE_NONE)
        snprintf(msg, n, "still: unknown routing %d", c->routing);
    else if (c->sel_span < 0 || c->sel_span > c->chunk)
        snprintf(msg, n, "still: sel_span must be in 0..chunk = %d, got %d", c->chunk, c->sel_span);
    else if (c->sel_global && c->budget <= 0)
        snprintf(msg, n, "still: global selection needs a budget (it keeps the best m - 2C tokens)");
    else if (c->sel_global && (c->routing == STILL_ROUTE_POSITION || c->routing == STILL_ROUTE_NONE))
        snprintf(msg, n, "still: global selection ranks tokens by score; routing %s has none",
                 c->routing == STILL_ROUTE_POSITION ? "position" : "none");
    else if (c->feature_map != STILL_FMAP_NPMAP && c->feature_map != STILL_FMAP_HEDGEHOG)
        snprintf(msg, n, "still: unknown feature map %d", c->feature_map);
    else if (c->feature_map == STILL_FMAP_HEDGEHOG && (c->feature_dim <= 0 || c->feature_dim > 4096))
        snprintf(msg, n, "still: the hedgehog feature map needs a feature dim in 1..4096, got %d", c->feature_dim);
    else if (c->gate && c->d_model <= 0) snprintf(msg, n, "still: the gate needs d_model > 0, got %d", c->d_model);
    else if (c->gate_den && (!c->linear || !c->gate))
        snprintf(msg, n, "still: --gate-den needs the linear branch and its gate");
    else return STILL_PLAN_OK;
    return STILL_PLAN_BAD_ARG;
}

/* ---- the budget ------------------------------------------------------------------------------ */

/* λ: tokens a leaving chunk keeps in Sel. routing_none: no selection (0); lambda >= 0: as given; else from the
 * budget m over a context of n_ctx tokens, (m − 2C) / ceil(n_ctx / C), or C / 16 uncapped (the reference code);
 * at most C. */
STILL_RULE int still_lambda(int routing_none, int lambda, int budget, int C, int n_ctx) {
    int l;
    if (routing_none) l = 0;
    else if (lambda >= 0) l = lambda;
    else if (budget > 0) l = (budget - 2 * C) / (int)(((long long)n_ctx + C - 1) / C);
    else l = C / 16;
    if (l < 0) l = 0;
    return l > C ? C : l;
}

/* Tokens a leaving chunk puts into a selection head's Sel (chunk selection): λ, at most the free slots of a
 * capped store holding `used` of its cap. (A GPU's closed form: after k chunks, min(k λ, cap) entries.) */
STILL_RULE int still_picks(int lam, int capped, int cap, int used) {
    return capped && lam > cap - used ? cap - used : lam;
}

/* Sel's capacity: m − 2C with a budget; uncapped, what n_ctx tokens can select: λ per chunk that leaves Local
 * within them (chunks c with (c + 2) C <= n_ctx − 1). */
STILL_RULE long long still_capacity(int budget, int C, int n_ctx, int lam) {
    if (budget > 0) return (long long)budget - 2 * C;
    long long n_leave = (n_ctx - 1) / C - 1;
    return n_leave < 0 ? 0 : n_leave * lam;
}

/* ---- the output and the feature map ----------------------------------------------------------- */

/* The output's denominator (spec "still", "Combining"): the softmax part's sum gl (lolcats: l times its window
 * factor γ), the linear part's share b (φq·z) -- under --gate-den scaled per channel by the gate's value g --
 * and ε, summed in this order. A row without a linear part takes still_den_soft. */
STILL_RULE float still_den(float gl, float g, float b, int gate_den) { return gl + (gate_den ? g * b : b) + STILL_DEN_EPS; }
STILL_RULE float still_den_soft(float gl) { return gl + STILL_DEN_EPS; }

/* NP-Map (spec "NP-Map"): the Householder reflection x̃ = x − f u with f = 2 x·u / u·u (0 for u = 0), and the
 * rescale of z0 = W x̃ to the norm of x, ‖x‖ / max(‖z0‖, floor). */
STILL_RULE float still_npmap_reflect(float xu, float uu) { return uu > 0 ? 2.0f * xu / uu : 0.0f; }
STILL_RULE float still_npmap_rescale(float nx, float nz) {
    return nx / (nz > STILL_NORM_FLOOR ? nz : STILL_NORM_FLOOR);
}

/* Sel in 8 bits (--sel-cache q8), a row of keys or values at a time: the scale s = amax / 127 of the row's
 * largest magnitude and each element's level rint(x · 127 / amax) clamped to ±127 (amax = 0: zeros; NaN: −127). */
STILL_RULE float still_q8_scale(float amax) { return amax / 127.0f; }
STILL_RULE float still_q8_inv(float amax) { return amax > 0.0f ? 127.0f / amax : 0.0f; }
STILL_RULE float still_q8_level(float x, float inv) { return fminf(fmaxf(rintf(x * inv), -127.0f), 127.0f); }

/* ---- parameters (floats, in this order) ------------------------------------------------------
 * still: the feature maps of q (side 0) and k (side 1) per query head h: the NP-Map's Householder vectors
 * u [2][H][D], then W [2][H][D][D] (z0 = W x̃); or, with the Hedgehog map, W [2][H][D][F] (z = x W); then,
 * with the gate, W_g [H·D][d] and b_g [H·D].
 * lolcats: its Hedgehog maps W [2][H][D][F], then the window factors w [H] (γ = σ(w_h)). */

STILL_RULE size_t still_par_u(int H, int D, int side, int h) { return ((size_t)side * H + h) * D; }
STILL_RULE size_t still_par_w(int H, int D, int F, int hedgehog, int side, int h) {
    return hedgehog ? ((size_t)side * H + h) * D * F : 2 * (size_t)H * D + ((size_t)side * H + h) * D * D;
}
STILL_RULE size_t still_par_fmap_count(int H, int D, int F, int hedgehog) {
    return hedgehog ? 2 * (size_t)H * D * (size_t)(F > 0 ? F : 0) : 2 * (size_t)H * D + 2 * (size_t)H * D * D;
}
STILL_RULE size_t still_par_wg(int H, int D, int F, int hedgehog) { return still_par_fmap_count(H, D, F, hedgehog); }
STILL_RULE size_t still_par_bg(int H, int D, int F, int hedgehog, int d_model) {
    return still_par_fmap_count(H, D, F, hedgehog) + (size_t)H * D * (size_t)d_model;
}

/* Every parameter of a still layer: the maps, then with the gate W_g and b_g. */
STILL_RULE size_t still_par_count(int H, int D, int F, int hedgehog, int gate, int d_model) {
    return still_par_fmap_count(H, D, F, hedgehog) + (gate ? (size_t)H * D * (size_t)d_model + (size_t)H * D : 0);
}

STILL_RULE size_t lolcats_par_w(int H, int D, int F, int side, int h) { return ((size_t)side * H + h) * D * F; }
STILL_RULE size_t lolcats_par_factor(int H, int D, int F, int h) { return 2 * (size_t)H * D * F + h; }
STILL_RULE size_t lolcats_par_count(int H, int D, int F) { return 2 * (size_t)H * D * F + H; }

#endif
