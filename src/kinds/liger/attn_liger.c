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
 * blocks) and S [Hk][D][D].
 *
 * Training (stage 2): backward_inputs gives the gradients of q, k, v (the
 * window, through attn_softmax_grad, and v through the linear part too) and
 * of q_nope, k_nope; see below. */
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "kinds/softmax/attn_softmax.h"
#include "kinds/liger/attn_liger_rules.h"
#include "common/common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum {
    COL_BLOCK = 16,     /* value columns of S per work item */
    TOK_BLOCK = 256,    /* tokens whose φ, α are computed at once */
    CKPT = 64,          /* backward: tokens between checkpoints of S */
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

static int liger_regions(attn_state *s, attn_region *out, int max) {
    liger_state *st = s->impl;
    if (max < 1) return -1;
    st->swa->n_seen = s->n_seen;   /* the window part has seen what the layer has */
    const int n = attn_kind_get(ATTN_SWA)->state_regions(st->swa, out, max - 1);
    if (n < 0) return -1;
    out[n] = (attn_region){st->S, lin_floats(&s->cfg) * sizeof(float)};
    return n + 1;
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
            al[i] = liger_decay(k);
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
            for (int d = 0; d < nd; d++) dst[d] = LIGER_MIX * dst[d] + LIGER_MIX * o[d];
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

/* ---- Backward of the inputs (stage 2) --------------------------------------
 *
 * y = 0.5 o_swa + 0.5 o_lin. The window's share is the softmax backward
 * (attn_softmax_grad with the gradient 0.5 dout) into dq, dk, dv.
 *
 * The linear part, per KV head (S_t [D][D], rows key channels i, columns
 * value channels d), with g_{t,h} = 0.5 dout_{t,h} and Λ_t = ∂L/∂S_t (the
 * adjoint of the state, through every later output):
 *   Λ_t      = Σ_h φq_{t,h} g_{t,h}ᵀ + diag(α_{t+1}) Λ_{t+1}      (Λ_T = 0)
 *   dφq_{t,h} = S_t g_{t,h}                 (h over the G query heads)
 *   dφk_t    = Λ_t v_t,   dv_t += Λ_tᵀ φk_t,
 *   dα_{t,i} = Σ_d Λ_t[i][d] S_{t-1}[i][d],
 * then through the maps: φ = softmax gives dx = φ ⊙ (dφ - φ · dφ) for
 * q_nope and k_nope, and α = σ(k)^{1/16} gives dk_nope += dα α (1 - σ(k)) / 16.
 *
 * Λ runs backwards while S runs forwards, so the states are recomputed: a
 * first pass runs the recurrence and keeps S at every CKPT-th token (the
 * state before each block of CKPT tokens); then the blocks go in reverse,
 * each recomputing its CKPT + 1 states from its checkpoint (never S_{t-1}
 * from S_t by dividing by α, which loses everything once α^n underflows) and
 * running Λ back through them. Memory: ceil(T / CKPT) Hk D² floats of
 * checkpoints, Λ, and one block's states per thread.
 *
 * As in the forward, the columns of S and Λ are independent (column d sees
 * v[d] and g[d] only), so a work item is a KV head × a block of COL_BLOCK
 * columns. Checkpoints, states and Λ are kept transposed (Sᵀ: rows value
 * channels), so an item's columns are contiguous rows and every inner loop
 * runs over the key channels i. dv is per column; dφq, dφk and dα are sums
 * over columns: each item writes its partial sums for the block's tokens and
 * they are added in column-block order afterwards, so the result does not
 * depend on the thread count. */

/* Σ a[i] b[i] over n entries, in 16 lanes (vectorizes without -ffast-math). */
static inline float dot16(const float *a, const float *b, int n) {
    float acc[16] = {0}, s = 0;
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (; i < n; i++) s += a[i] * b[i];
    for (int l = 0; l < 16; l++) s += acc[l];
    return s;
}

/* Checkpoint pass of item (hk, value columns d0 .. d0+nd-1) over the n
 * tokens of the block at t0: from S0ᵀ (this KV head's state before the
 * block, [D][D] transposed) to S1ᵀ (the state after it), rows d0... */
static void lin_advance(const attn_config *c, const attn_io *io, int t0, int n, const float *phk, const float *alpha,
                        int hk, int d0, int nd, const float *S0, float *S1) {
    const int D = c->head_dim;
    const size_t kvd = (size_t)c->n_head_kv * D;
    memcpy(S1 + (size_t)d0 * D, S0 + (size_t)d0 * D, sizeof(float) * (size_t)nd * D);
    for (int t = 0; t < n; t++) {
        const float *pk = phk + (size_t)t * kvd + (size_t)hk * D, *al = alpha + (size_t)t * kvd + (size_t)hk * D;
        const float *vr = io->v + (size_t)(t0 + t) * kvd + (size_t)hk * D + d0;
        for (int d = 0; d < nd; d++) {
            float *row = S1 + (size_t)(d0 + d) * D;
            const float vd = vr[d];
#pragma omp simd
            for (int i = 0; i < D; i++) row[i] = al[i] * row[i] + pk[i] * vd;
        }
    }
}

/* Backward of item (hk, value columns d0 .. d0+nd-1) through the block of n
 * tokens at t0, given its checkpoint S0ᵀ and the adjoint Lam (Λᵀ, [Hk][D][D];
 * carried in: diag(α_{t0+n}) Λ_{t0+n}, carried out: diag(α_t0) Λ_t0).
 * St: (n + 1) nd D floats of scratch (the block's states, rows d0..). The
 * partial sums of this column block go to pq [n][H][D], pk and pa
 * [n][Hk][D]; dv (when not NULL) is accumulated directly. */
static void lin_back(const attn_config *c, const attn_io *io, const float *dout, int t0, int n, const float *phq,
                     const float *phk, const float *alpha, int hk, int d0, int nd, const float *S0, float *Lam,
                     float *St, float *pq, float *pk, float *pa, float *dv) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk;
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D, blk = (size_t)nd * D;
    /* the block's states S_{t0-1} .. S_{t0+n-1} */
    memcpy(St, S0 + (size_t)d0 * D, sizeof(float) * blk);
    for (int t = 0; t < n; t++) {
        const float *pkr = phk + (size_t)t * kvd + (size_t)hk * D, *al = alpha + (size_t)t * kvd + (size_t)hk * D;
        const float *vr = io->v + (size_t)(t0 + t) * kvd + (size_t)hk * D + d0;
        const float *prev = St + (size_t)t * blk;
        float *cur = St + (size_t)(t + 1) * blk;
        for (int d = 0; d < nd; d++) {
            const float vd = vr[d], *pr = prev + (size_t)d * D;
            float *cr = cur + (size_t)d * D;
#pragma omp simd
            for (int i = 0; i < D; i++) cr[i] = al[i] * pr[i] + pkr[i] * vd;
        }
    }
    float *Lk = Lam + (size_t)hk * D * D + (size_t)d0 * D;
    for (int t = n - 1; t >= 0; t--) {
        const float *S_t = St + (size_t)(t + 1) * blk, *S_p = St + (size_t)t * blk;
        const float *pkr = phk + (size_t)t * kvd + (size_t)hk * D, *al = alpha + (size_t)t * kvd + (size_t)hk * D;
        const float *vr = io->v + (size_t)(t0 + t) * kvd + (size_t)hk * D + d0;
        /* Λ += Σ_h φq_h g_hᵀ;  dφq_h = S_t g_h */
        for (int x = 0; x < G; x++) {
            const int h = hk * G + x;
            const float *pqr = phq + (size_t)t * qd + (size_t)h * D;
            const float *gr = dout + (size_t)(t0 + t) * qd + (size_t)h * D + d0;
            float *o = pq + (size_t)t * qd + (size_t)h * D;
            memset(o, 0, sizeof(float) * (size_t)D);
            for (int d = 0; d < nd; d++) {
                const float gd = LIGER_MIX * gr[d], *sr = S_t + (size_t)d * D;
                float *lr = Lk + (size_t)d * D;
#pragma omp simd
                for (int i = 0; i < D; i++) {
                    lr[i] += pqr[i] * gd;
                    o[i] += sr[i] * gd;
                }
            }
        }
        /* dφk = Λ v,  dα = rowdot(Λ, S_{t-1}),  dv = Λᵀ φk;  then Λ <- diag(α_t) Λ */
        float *ok = pk + (size_t)t * kvd + (size_t)hk * D, *oa = pa + (size_t)t * kvd + (size_t)hk * D;
        memset(ok, 0, sizeof(float) * (size_t)D);
        memset(oa, 0, sizeof(float) * (size_t)D);
        float *dvr = dv ? dv + (size_t)(t0 + t) * kvd + (size_t)hk * D + d0 : NULL;
        for (int d = 0; d < nd; d++) {
            float *lr = Lk + (size_t)d * D;
            const float vd = vr[d], *sp = S_p + (size_t)d * D;
#pragma omp simd
            for (int i = 0; i < D; i++) {
                ok[i] += lr[i] * vd;
                oa[i] += lr[i] * sp[i];
            }
            if (dvr) dvr[d] += dot16(lr, pkr, D);
#pragma omp simd
            for (int i = 0; i < D; i++) lr[i] *= al[i];
        }
    }
}

static int liger_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                                 const attn_grads *g, still_err *err) {
    (void)params;
    if (!io || !g) return still_fail(err, STILL_E_ARG, "liger backward: no inputs or gradient buffers");
    if (c->window <= 0) return still_fail(err, STILL_E_ARG, "liger needs a positive window, got %d", c->window);
    if (c->head_dim > ATT_MAX_HEAD_DIM || c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 ||
        c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "liger backward needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0 || io->T > c->n_ctx)
        return still_fail(err, STILL_E_ARG, "liger backward: %d tokens, the context holds %d", io->T, c->n_ctx);
    if (io->T == 0) return STILL_OK;
    if (!io->q || !io->k || !io->v || !dout)
        return still_fail(err, STILL_E_ARG, "liger backward: missing q, k, v or dout");
    if (!io->q_nope || !io->k_nope) return still_fail(err, STILL_E_ARG, "liger needs q and k before RoPE");

    /* the window's half */
    int rc = attn_softmax_grad(c, c->window, io, dout, LIGER_MIX, g->dq, g->dk, g->dv, err);
    if (rc || (!g->dq_nope && !g->dk_nope && !g->dv)) return rc;

    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, T = io->T;
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D, DD = (size_t)D * D;
    const int n_cb = (D + COL_BLOCK - 1) / COL_BLOCK, items = Hk * n_cb, nb = (T + CKPT - 1) / CKPT;
    const int n_threads = omp_get_max_threads(), n_it = n_threads < items ? n_threads : items;
    const size_t feat = (size_t)CKPT * (qd + 2 * kvd), part = (size_t)n_cb * CKPT * (qd + 2 * kvd);
    const size_t per_thread = (size_t)(CKPT + 1) * D * COL_BLOCK;
    float *ck = calloc((size_t)nb * Hk * DD, sizeof(float));   /* [nb][Hk][D][D]: Sᵀ before each block */
    float *lam = calloc((size_t)Hk * DD, sizeof(float));      /* Λᵀ [Hk][D][D] */
    float *buf = malloc(sizeof(float) * (feat + part + (size_t)n_threads * per_thread));
    if (!ck || !lam || !buf) {
        free(ck), free(lam), free(buf);
        return still_fail(err, STILL_E_NOMEM, "out of memory in liger backward (%.1f MiB)",
                          ((double)nb * Hk * DD + (double)feat + (double)part) * sizeof(float) / 1048576.0);
    }
    float *phq = buf, *phk = phq + (size_t)CKPT * qd, *alpha = phk + (size_t)CKPT * kvd;
    float *pq = alpha + (size_t)CKPT * kvd, *pk = pq + (size_t)n_cb * CKPT * qd, *pa = pk + (size_t)n_cb * CKPT * kvd;
    float *scratch = pa + (size_t)n_cb * CKPT * kvd;

    /* Pass 1: the checkpoints (ck[0] = 0). */
    for (int b = 0; b + 1 < nb; b++) {
        const int t0 = b * CKPT;
        features(c, io, t0, CKPT, phq, phk, alpha, n_threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_it)
        for (int it = 0; it < items; it++) {
            const int hk = it / n_cb, d0 = it % n_cb * COL_BLOCK;
            lin_advance(c, io, t0, CKPT, phk, alpha, hk, d0, D - d0 < COL_BLOCK ? D - d0 : COL_BLOCK,
                        ck + ((size_t)b * Hk + hk) * DD, ck + ((size_t)(b + 1) * Hk + hk) * DD);
        }
    }
    /* Pass 2: blocks in reverse. */
    for (int b = nb - 1; b >= 0; b--) {
        const int t0 = b * CKPT, n = T - t0 < CKPT ? T - t0 : CKPT;
        features(c, io, t0, n, phq, phk, alpha, n_threads);
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_it)
        for (int it = 0; it < items; it++) {
            const int hk = it / n_cb, cb = it % n_cb, d0 = cb * COL_BLOCK;
            lin_back(c, io, dout, t0, n, phq, phk, alpha, hk, d0, D - d0 < COL_BLOCK ? D - d0 : COL_BLOCK,
                     ck + ((size_t)b * Hk + hk) * DD, lam, scratch + (size_t)omp_get_thread_num() * per_thread,
                     pq + (size_t)cb * CKPT * qd, pk + (size_t)cb * CKPT * kvd, pa + (size_t)cb * CKPT * kvd, g->dv);
        }
        /* sum the column blocks' partials; through softmax and σ^{1/16} */
#pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int t = 0; t < n; t++) {
            float dphi[ATT_MAX_HEAD_DIM], dal[ATT_MAX_HEAD_DIM];
            if (g->dq_nope)
                for (int h = 0; h < H; h++) {
                    const float *ph = phq + (size_t)t * qd + (size_t)h * D;
                    for (int i = 0; i < D; i++) dphi[i] = 0;
                    for (int cb = 0; cb < n_cb; cb++) {
                        const float *src = pq + ((size_t)cb * CKPT + t) * qd + (size_t)h * D;
                        for (int i = 0; i < D; i++) dphi[i] += src[i];
                    }
                    float s = 0;
                    for (int i = 0; i < D; i++) s += ph[i] * dphi[i];
                    float *dst = g->dq_nope + (size_t)(t0 + t) * qd + (size_t)h * D;
                    for (int i = 0; i < D; i++) dst[i] += ph[i] * (dphi[i] - s);
                }
            if (g->dk_nope)
                for (int hk = 0; hk < Hk; hk++) {
                    const float *ph = phk + (size_t)t * kvd + (size_t)hk * D;
                    const float *al = alpha + (size_t)t * kvd + (size_t)hk * D;
                    const float *kn = io->k_nope + (size_t)(t0 + t) * kvd + (size_t)hk * D;
                    for (int i = 0; i < D; i++) dphi[i] = 0, dal[i] = 0;
                    for (int cb = 0; cb < n_cb; cb++) {
                        const float *sk = pk + ((size_t)cb * CKPT + t) * kvd + (size_t)hk * D;
                        const float *sa = pa + ((size_t)cb * CKPT + t) * kvd + (size_t)hk * D;
                        for (int i = 0; i < D; i++) dphi[i] += sk[i], dal[i] += sa[i];
                    }
                    float s = 0;
                    for (int i = 0; i < D; i++) s += ph[i] * dphi[i];
                    float *dst = g->dk_nope + (size_t)(t0 + t) * kvd + (size_t)hk * D;
                    for (int i = 0; i < D; i++) {
                        const float sig_neg = 1.0f / (1.0f + expf(kn[i]));   /* 1 - σ(k) */
                        dst[i] += ph[i] * (dphi[i] - s) + dal[i] * al[i] * sig_neg * LIGER_DECAY_POW;
                    }
                }
        }
    }
    free(ck), free(lam), free(buf);
    return STILL_OK;
}

const attn_kind attn_kind_liger = {
    .name = "liger", .needs_nope = 1, .param_count = no_params, .param_init = no_init, .state_create = liger_create,
    .state_free = liger_free, .state_truncate = liger_truncate, .state_bytes = liger_bytes,
    .state_regions = liger_regions, .forward = liger_forward,
    .backward_inputs = liger_backward_inputs,
};
