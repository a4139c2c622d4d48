/* The liger kind (Liger): half sliding-window softmax, half gated linear
 * attention with a per-channel decay, no new parameters:
 *
 *   o_swa = softmax over keys t-W < j <= t (RoPE'd q, k; W = config window)
 *   φ(x)  = softmax over the D channels of x, applied to q_nope, k_nope
 *           (before RoPE)
 *   α_t   = σ(k_nope_t)^{1/16} per channel
 *   S_t   = diag(α_t) S_{t-1} + φ(k_nope_t) v_tᵀ,   o_lin = φ(q_nope_t)ᵀ S_t
 *   y_t   = 0.5 o_swa + 0.5 o_lin
 *
 * α, φk and v come from the KV head only, so S is kept per KV head (D × D,
 * rows are key channels, columns value channels) and read by its G query heads.
 *
 * o_swa is computed by an embedded swa state (the tiled online softmax of
 * attn_softmax.c over a fixed ring). The linear part is a per-token
 * recurrence: O(D²) per token and KV head, linear in the sequence length.
 * The columns of S are independent (S[:, d] only sees v[d]), so the work is
 * split over KV head × blocks of value columns, each block of S staying in L1
 * while it runs through the tokens. φ and α are computed first for a block of
 * tokens, in parallel over tokens.
 *
 * State (bounded): the swa ring (window rounded up to its blocks, plus two
 * blocks) and S [Hk][D][D]. */
#include "attn.h"
#include "attn_common.h"
#include "attn_softmax.h"
#include "common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum {
    COL_BLOCK = 16,     /* value columns of S per work item */
    TOK_BLOCK = 256,    /* tokens whose φ, α are computed at once */
};

typedef struct {
    attn_state *swa;    /* sliding-window softmax part */
    float *S;           /* [Hk][D][D] */
} liger_state;

static size_t no_params(const attn_config *c) {
    (void)c;
    return 0;
}

static void no_init(const attn_config *c, float *params, uint64_t seed) { (void)c, (void)params, (void)seed; }

static size_t lin_floats(const attn_config *c) {
    return (size_t)c->n_head_kv * (size_t)c->head_dim * (size_t)c->head_dim;
}

static void liger_free(attn_state *s) {
    if (!s) return;
    liger_state *st = s->impl;
    if (st) {
        if (st->swa) attn_kind_get(ATTN_SWA)->state_free(st->swa);
        free(st->S), free(st);
    }
    free(s);
}

static int liger_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    if (c->window <= 0) return still_fail(err, STILL_E_ARG, "liger needs a positive window, got %d", c->window);
    if (c->head_dim > ATT_MAX_HEAD_DIM || c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 ||
        c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    attn_state *s = calloc(1, sizeof *s);
    liger_state *st = calloc(1, sizeof *st);
    if (!s || !st) {
        free(s), free(st);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    s->cfg = *c;
    s->impl = st;
    attn_config sc = *c;
    sc.kind = ATTN_SWA;
    int rc = attn_kind_get(ATTN_SWA)->state_create(&sc, &st->swa, err);
    if (rc) {
        liger_free(s);
        return rc;
    }
    st->S = calloc(lin_floats(c), sizeof(float));
    if (!st->S) {
        liger_free(s);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating the liger state");
    }
    *out = s;
    return STILL_OK;
}

static int liger_truncate(attn_state *s, int n, still_err *err) {
    if (n == s->n_seen) return STILL_OK;
    if (n != 0)
        return still_fail(err, STILL_E_ARG,
                          "cannot truncate a %d-token liger state to %d tokens (only to 0 or %d: history is folded)",
                          s->n_seen, n, s->n_seen);
    liger_state *st = s->impl;
    int rc = attn_kind_get(ATTN_SWA)->state_truncate(st->swa, 0, err);
    if (rc) return rc;
    memset(st->S, 0, lin_floats(&s->cfg) * sizeof(float));
    s->n_seen = 0;
    return STILL_OK;
}

static size_t liger_bytes(const attn_state *s) {
    const liger_state *st = s->impl;
    return attn_kind_get(ATTN_SWA)->state_bytes(st->swa) + lin_floats(&s->cfg) * sizeof(float);
}

/* φ(q_nope), φ(k_nope), α for tokens t0 .. t0+n-1 of the call:
 * phq [n][H][D], phk and alpha [n][Hk][D]. */
static void features(const attn_config *c, const attn_io *io, int t0, int n, float *phq, float *phk, float *alpha,
                     int n_threads) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim;
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int t = 0; t < n; t++) {
        float *pq = phq + (size_t)t * qd, *pk = phk + (size_t)t * kvd, *al = alpha + (size_t)t * kvd;
        memcpy(pq, io->q_nope + (size_t)(t0 + t) * qd, sizeof(float) * qd);
        memcpy(pk, io->k_nope + (size_t)(t0 + t) * kvd, sizeof(float) * kvd);
        for (int h = 0; h < H; h++) attn_softmax_inplace(pq + (size_t)h * D, D);
        for (size_t i = 0; i < kvd; i++) {
            /* σ(k)^{1/16} = exp(log σ(k) / 16), log σ(k) = min(k, 0) - log(1 + e^{-|k|}) */
            const float k = pk[i];
            al[i] = expf(((k < 0 ? k : 0) - log1pf(expf(-fabsf(k)))) * 0.0625f);
        }
        for (int h = 0; h < Hk; h++) attn_softmax_inplace(pk + (size_t)h * D, D);
    }
}

/* Run the recurrence of KV head hk, value columns d0 .. d0+nd-1, through n
 * tokens; out gets 0.5 out + 0.5 o_lin for the G query heads. */
static void recur(const attn_config *c, float *S, const attn_io *io, int t0, int n, const float *phq,
                  const float *phk, const float *alpha, int hk, int d0, int nd, float *out) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk;
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
    float *Sk = S + (size_t)hk * D * D;
    for (int t = 0; t < n; t++) {
        const float *pk = phk + (size_t)t * kvd + (size_t)hk * D, *al = alpha + (size_t)t * kvd + (size_t)hk * D;
        const float *vr = io->v + (size_t)(t0 + t) * kvd + (size_t)hk * D + d0;
        for (int i = 0; i < D; i++) {
            float *row = Sk + (size_t)i * D + d0;
            const float a = al[i], p = pk[i];
#pragma omp simd
            for (int d = 0; d < nd; d++) row[d] = a * row[d] + p * vr[d];
        }
        for (int g = 0; g < G; g++) {
            const int h = hk * G + g;
            const float *pq = phq + (size_t)t * qd + (size_t)h * D;
            float o[COL_BLOCK] = {0};
            for (int i = 0; i < D; i++) {
                const float p = pq[i];
                const float *row = Sk + (size_t)i * D + d0;
#pragma omp simd
                for (int d = 0; d < nd; d++) o[d] += p * row[d];
            }
            float *dst = out + (size_t)(t0 + t) * qd + (size_t)h * D + d0;
            for (int d = 0; d < nd; d++) dst[d] = 0.5f * dst[d] + 0.5f * o[d];
        }
    }
}

static int liger_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    (void)params;
    liger_state *st = s->impl;
    const attn_config *c = &s->cfg;
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "attention state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "negative token count %d", io->T);
    if (io->T == 0) return STILL_OK;
    if (!io->q_nope || !io->k_nope) return still_fail(err, STILL_E_ARG, "liger needs q and k before RoPE");
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim;
    const int tb = io->T < TOK_BLOCK ? io->T : TOK_BLOCK;
    const int n_threads = omp_get_max_threads();
    float *phq = malloc(sizeof(float) * (size_t)tb * (H + 2 * Hk) * D);
    if (!phq) return still_fail(err, STILL_E_NOMEM, "out of memory in liger forward");
    /* o_swa into out (checks the context limit too) */
    int rc = attn_kind_get(ATTN_SWA)->forward(st->swa, NULL, io, out, err);
    if (rc) {
        free(phq);
        return rc;
    }
    float *phk = phq + (size_t)tb * H * D, *alpha = phk + (size_t)tb * Hk * D;
    const int n_cb = (D + COL_BLOCK - 1) / COL_BLOCK, items = Hk * n_cb;
    for (int t0 = 0; t0 < io->T; t0 += tb) {
        const int n = io->T - t0 < tb ? io->T - t0 : tb;
        features(c, io, t0, n, phq, phk, alpha, n_threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads < items ? n_threads : items)
        for (int it = 0; it < items; it++) {
            const int hk = it / n_cb, d0 = it % n_cb * COL_BLOCK;
            recur(c, st->S, io, t0, n, phq, phk, alpha, hk, d0, D - d0 < COL_BLOCK ? D - d0 : COL_BLOCK, out);
        }
    }
    free(phq);
    s->n_seen += io->T;
    return STILL_OK;
}

const attn_kind attn_kind_liger = {
    .name = "liger", .needs_nope = 1, .param_count = no_params, .param_init = no_init, .state_create = liger_create,
    .state_free = liger_free, .state_truncate = liger_truncate, .state_bytes = liger_bytes, .forward = liger_forward,
};
