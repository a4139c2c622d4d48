/* The whole model's forward and backward for next-token training (see
 * train_lm.h). */
#include "train/train_lm.h"

#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "common/common.h"
#include "model/model.h"
#include "cpu/kernels.h"
#include "cpu/vecmath.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Logits rows per block: about 64 MiB of logits, 32 .. 1024 rows (each block
 * reads the whole output matrix once in the backward). */
static int ce_rows(int n_vocab) {
    int r = (int)((64u << 20) / (sizeof(float) * (size_t)(n_vocab > 0 ? n_vocab : 1)));
    return r < 32 ? 32 : r > 1024 ? 1024 : r;
}

/* One layer's activations, recomputed in the backward. */
typedef struct {
    float *h1, *r1;            /* normed input [T][d], 1/rms [T] */
    float *q, *k, *v;          /* after RoPE */
    float *qn, *kn;            /* before RoPE (kinds that ask), else NULL */
    float *att;                /* the kind's output [T][qd] */
    float *xm, *h2, *r2;       /* after attention [T][d], normed [T][d], 1/rms */
    float *g, *u, *act;        /* gate and up products, silu(g) ⊙ u [T][ff] */
    float *xd[LORA_N_TARGETS]; /* each LoRA target's (dropped-out) input; aliases when no dropout */
    float *U[LORA_N_TARGETS];  /* x̃ Aᵀ [T][rank] */
} layer_acts;

struct lm_train {
    const still_model *m;
    const lora_set *lora;
    int max_T, needs_nope;
    float dropout;
    float *X;                  /* layer inputs [n_layer + 1][max_T][d] */
    layer_acts a;
    float *drop_buf;           /* dropped-out inputs, [max_T][n_in] for each target the LoRA has */
    size_t drop_off[LORA_N_TARGETS];
    int ce_rows;
    /* gradients */
    float *dx, *dxm, *dh, *dq, *dk, *dv, *dqn, *dkn, *datt, *dact, *dg, *du, *dtmp, *dU;
    float *logits, *hn, *rn, *dhn;
    int *rows;
    double *ce_loss;           /* per row of a block */
    float *inv_freq;
};

static size_t maxz(size_t a, size_t b) { return a > b ? a : b; }

void lm_train_free(lm_train *t) {
    if (!t) return;
    free(t->X), free(t->a.h1), free(t->drop_buf), free(t->dx), free(t->logits), free(t->rows), free(t->ce_loss);
    free(t->inv_freq);
    free(t);
}

int lm_train_create(const still_model *m, const lora_set *lora, int max_T, float dropout, lm_train **out,
                    still_err *err) {
    *out = NULL;
    const model_config *c = &m->cfg;
    if (max_T < 2) return still_fail(err, STILL_E_ARG, "training sequences need at least 2 tokens, got %d", max_T);
    if (!(dropout >= 0 && dropout < 1)) return still_fail(err, STILL_E_ARG, "--lora-dropout must be in [0, 1), got %g", dropout);
    lm_train *t = calloc(1, sizeof *t);
    if (!t) return still_fail(err, STILL_E_NOMEM, "out of memory");
    t->m = m, t->lora = lora, t->max_T = max_T, t->dropout = lora ? dropout : 0;
    for (int l = 0; l < c->n_layer; l++) t->needs_nope |= attn_kind_get(m->attn_cfg[l].kind)->needs_nope;
    const size_t T = (size_t)max_T, d = c->d_model, qd = (size_t)c->n_head * c->head_dim,
                 kvd = (size_t)c->n_head_kv * c->head_dim, ff = c->d_ff, r = lora ? (size_t)lora->rank : 0;
    const size_t wide = maxz(maxz(d, ff), qd);
    int ok = 1;
    ok &= !!(t->X = malloc(sizeof(float) * ((size_t)c->n_layer + 1) * T * d));
    /* activations: one allocation */
    const size_t n_act = T * (3 * d + 2 + 2 * qd + 2 * kvd + (t->needs_nope ? qd + kvd : 0) + 3 * ff) +
                         (size_t)LORA_N_TARGETS * T * r;
    float *p = malloc(sizeof(float) * (n_act ? n_act : 1));
    ok &= !!p;
    if (p) {
        layer_acts *a = &t->a;
        a->h1 = p, p += T * d;
        a->r1 = p, p += T;
        a->q = p, p += T * qd;
        a->k = p, p += T * kvd;
        a->v = p, p += T * kvd;
        if (t->needs_nope) a->qn = p, p += T * qd, a->kn = p, p += T * kvd;
        a->att = p, p += T * qd;
        a->xm = p, p += T * d;
        a->h2 = p, p += T * d;
        a->r2 = p, p += T;
        a->g = p, p += T * ff;
        a->u = p, p += T * ff;
        a->act = p, p += T * ff;
        for (int k = 0; k < LORA_N_TARGETS; k++) a->U[k] = p, p += T * r;
    }
    if (t->dropout > 0) {
        size_t nd = 0;
        for (int k = 0; k < LORA_N_TARGETS; k++)
            if (lora->targets >> k & 1) t->drop_off[k] = nd, nd += T * (size_t)lora->n_in[k];
        ok &= !!(t->drop_buf = malloc(sizeof(float) * (nd ? nd : 1)));
    }
    /* gradients: one allocation */
    const size_t n_grad = T * (3 * d + 2 * qd + 2 * kvd + (t->needs_nope ? qd + kvd : 0) + 3 * ff + wide) + T * maxz(r, 1);
    float *g = malloc(sizeof(float) * n_grad);
    ok &= !!g;
    if (g) {
        t->dx = g, g += T * d;
        t->dxm = g, g += T * d;
        t->dh = g, g += T * d;
        t->dq = g, g += T * qd;
        t->datt = g, g += T * qd;
        t->dk = g, g += T * kvd;
        t->dv = g, g += T * kvd;
        if (t->needs_nope) t->dqn = g, g += T * qd, t->dkn = g, g += T * kvd;
        t->dact = g, g += T * ff;
        t->dg = g, g += T * ff;
        t->du = g, g += T * ff;
        t->dtmp = g, g += T * wide;
        t->dU = g;
    }
    const size_t V = (size_t)c->n_vocab, R = (size_t)(t->ce_rows = ce_rows(c->n_vocab));
    float *lb = malloc(sizeof(float) * (R * (V > d ? V : d) + 3 * R * d + R));
    ok &= !!lb;
    if (lb) t->logits = lb, t->hn = lb + R * (V > d ? V : d), t->dhn = t->hn + R * d, t->rn = t->dhn + R * d;
    ok &= !!(t->rows = malloc(sizeof(int) * T));
    ok &= !!(t->ce_loss = malloc(sizeof(double) * R));
    ok &= !!(t->inv_freq = malloc(sizeof(float) * (size_t)(c->head_dim / 2)));
    if (!ok) {
        lm_train_free(t);
        return still_fail(err, STILL_E_NOMEM, "out of memory for training sequences of %d tokens", max_T);
    }
    for (int i = 0; i < c->head_dim / 2; i++) t->inv_freq[i] = (float)pow((double)c->rope_theta, -2.0 * i / c->head_dim);
    *out = t;
    return STILL_OK;
}

/* ---- pieces ---------------------------------------------------------------------- */

/* out = x r w with r = 1/sqrt(mean(x²) + eps), as model.c's rmsnorm; r kept. */
static void rmsnorm_rows(float *out, float *r, const float *x, const float *w, int T, int n, float eps) {
#pragma omp parallel for schedule(static) if (T > 64)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        double ss = 0;
        for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
        const float s = (float)(1.0 / sqrt(ss / n + eps));
        r[t] = s;
        float *o = out + (size_t)t * n;
        for (int i = 0; i < n; i++) o[i] = xr[i] * s * w[i];
    }
}

/* dx += d(x r w)/dx · dy: r (w ⊙ dy) − x r³/n Σ_j w_j dy_j x_j. */
static void rmsnorm_bwd_rows(float *dx, const float *x, const float *r, const float *w, const float *dy, int T, int n) {
#pragma omp parallel for schedule(static) if (T > 64)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n, *g = dy + (size_t)t * n;
        float *o = dx + (size_t)t * n;
        double s = 0;
        for (int i = 0; i < n; i++) s += (double)w[i] * g[i] * xr[i];
        const float rs = r[t], c = (float)(s * (double)rs * rs * rs / n);
        for (int i = 0; i < n; i++) o[i] += rs * w[i] * g[i] - xr[i] * c;
    }
}

/* RoPE of every row (adjacent pairs, angle pos · inv_freq[i]); inverse = 1
 * rotates back (the backward of the rotation). As model.c's rope. */
static void rope_rows(float *x, int T, int n_heads, int D, const float *inv_freq, int inverse) {
#pragma omp parallel for schedule(static) if (T > 64)
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D / 2; i++) {
            const float angle = (float)t * inv_freq[i];
            const float cs = cosf(angle), sn = inverse ? -sinf(angle) : sinf(angle);
            for (int h = 0; h < n_heads; h++) {
                float *p = x + ((size_t)t * n_heads + h) * D + 2 * i;
                const float a = p[0], b = p[1];
                p[0] = a * cs - b * sn;
                p[1] = a * sn + b * cs;
            }
        }
}

/* A uniform [0, 1) draw for (seed, target, element): dropout masks that the
 * backward reproduces without storing them. */
static inline float drop_u(uint64_t seed, uint64_t i) {
    uint64_t s = seed ^ (i * 0x9e3779b97f4a7c15ULL);
    return (float)(attn_rng_next(&s) >> 40) * 0x1.0p-24f;
}

/* The input a LoRA target sees: x itself, or dropout(x) scaled by 1/(1-p). */
static const float *lora_input(lm_train *t, int layer, lora_target tg, const float *x, size_t n, uint64_t seed,
                               int train) {
    if (!(t->dropout > 0) || !train) return x;
    float *o = t->drop_buf + t->drop_off[tg];
    const uint64_t s = seed * 0x2545f4914f6cdd1dULL + (uint64_t)(layer * LORA_N_TARGETS + tg) + 1;
    const float keep = 1.0f / (1.0f - t->dropout);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) o[i] = drop_u(s, i) < t->dropout ? 0.0f : x[i] * keep;
    return o;
}

/* y = W x (+ LoRA) for T rows (y NULL: only the LoRA input x̃ and U = x̃ Aᵀ,
 * which the backward needs and which are kept). */
static void project(lm_train *t, int l, lora_target tg, const weight_matrix *W, const float *x, float *y, int T,
                    uint64_t seed, int train) {
    if (y) matmul(W, x, y, T);
    if (!t->lora || !lora_A(t->lora, l, tg)) return;
    const float *xd = lora_input(t, l, tg, x, (size_t)T * W->n_in, seed, train);
    t->a.xd[tg] = (float *)xd;
    const lora_set *s = t->lora;
    const int r = s->rank, ni = s->n_in[tg], no = s->n_out[tg];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, r, ni, 1.0f, xd, ni, lora_A(s, l, tg), ni, 0.0f, t->a.U[tg], r);
    if (y) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, no, r, lora_scale(s), t->a.U[tg], r, lora_B(s, l, tg), r,
                1.0f, y, no);
}

/* Backward of project: dx += dy W (+ the LoRA part through the dropout mask);
 * dA, dB into g. */
static int project_bwd(lm_train *t, int l, lora_target tg, const weight_matrix *W, const float *dy, float *dx, int T,
                       uint64_t seed, const lm_grads *g, still_err *err) {
    int rc = matmul_t_acc(W, dy, dx, T);
    if (rc) return still_fail(err, rc, "cannot back-propagate through a %s matrix", tensor_type_name(W->type));
    if (!t->lora || !lora_A(t->lora, l, tg)) return STILL_OK;
    const lora_set *s = t->lora;
    const int r = s->rank, ni = s->n_in[tg], no = s->n_out[tg];
    const float sc = lora_scale(s);
    const float *xd = t->a.xd[tg], *U = t->a.U[tg];
    if (g && g->lora) {
        /* dB [no][r] += s dyᵀ U;  dU = s dy B [T][r];  dA [r][ni] += dUᵀ x̃ */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, no, r, T, sc, dy, no, U, r, 1.0f, lora_B(g->lora, l, tg), r);
    }
    float *dU = t->dU;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, r, no, sc, dy, no, lora_B(s, l, tg), r, 0.0f, dU, r);
    if (g && g->lora)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, ni, T, 1.0f, dU, r, xd, ni, 1.0f, lora_A(g->lora, l, tg), ni);
    if (!(t->dropout > 0)) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, ni, r, 1.0f, dU, r, lora_A(s, l, tg), ni, 1.0f, dx, ni);
        return STILL_OK;
    }
    /* dx̃ = dU A, then through the mask: dx += dx̃ · [kept] / (1-p) */
    float *dxd = t->dtmp;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, ni, r, 1.0f, dU, r, lora_A(s, l, tg), ni, 0.0f, dxd, ni);
    const uint64_t sd = seed * 0x2545f4914f6cdd1dULL + (uint64_t)(l * LORA_N_TARGETS + tg) + 1;
    const float keep = 1.0f / (1.0f - t->dropout);
    const size_t n = (size_t)T * ni;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++)
        if (!(drop_u(sd, i) < t->dropout)) dx[i] += dxd[i] * keep;
    return STILL_OK;
}

/* ---- one layer ------------------------------------------------------------------- */

/* Layer l's forward from x (its input) to xo (may be NULL: activations only). */
static int layer_forward(lm_train *t, int l, const float *x, float *xo, int T, uint64_t seed, int train,
                         still_err *err) {
    const still_model *m = t->m;
    const model_config *c = &m->cfg;
    const layer_weights *L = &m->layers[l];
    const int d = c->d_model, H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, qd = H * D, kvd = Hk * D;
    const size_t ff = (size_t)c->d_ff;
    layer_acts *a = &t->a;
    rmsnorm_rows(a->h1, a->r1, x, L->attn_norm, T, d, c->norm_eps);
    project(t, l, LORA_Q, &L->wq, a->h1, a->q, T, seed, train);
    project(t, l, LORA_K, &L->wk, a->h1, a->k, T, seed, train);
    project(t, l, LORA_V, &L->wv, a->h1, a->v, T, seed, train);
    const attn_config *ac = &m->attn_cfg[l];
    const attn_kind *kind = attn_kind_get(ac->kind);
    if (kind->needs_nope) {
        memcpy(a->qn, a->q, sizeof(float) * (size_t)T * qd);
        memcpy(a->kn, a->k, sizeof(float) * (size_t)T * kvd);
    }
    rope_rows(a->q, T, H, D, t->inv_freq, 0);
    rope_rows(a->k, T, Hk, D, t->inv_freq, 0);
    attn_config cfg = *ac;
    cfg.n_ctx = T;
    attn_state *st = NULL;
    int rc = kind->state_create(&cfg, &st, err);
    attn_io io = {.q = a->q, .k = a->k, .v = a->v, .q_nope = kind->needs_nope ? a->qn : NULL,
                  .k_nope = kind->needs_nope ? a->kn : NULL, .x = a->h1, .p0 = 0, .T = T};
    if (!rc) rc = kind->forward(st, m->attn_params[l], &io, a->att, err);
    if (st) kind->state_free(st);
    if (rc) return rc;
    project(t, l, LORA_O, &L->wo, a->att, a->xm, T, seed, train);
    const size_t nd = (size_t)T * d;
    for (size_t i = 0; i < nd; i++) a->xm[i] += x[i];
    rmsnorm_rows(a->h2, a->r2, a->xm, L->ffn_norm, T, d, c->norm_eps);
    project(t, l, LORA_GATE, &L->w_gate, a->h2, a->g, T, seed, train);
    project(t, l, LORA_UP, &L->w_up, a->h2, a->u, T, seed, train);
    const size_t nf = (size_t)T * ff;
    float *restrict act = a->act;
    const float *restrict gg = a->g, *restrict uu = a->u;
#pragma omp simd
    for (size_t i = 0; i < nf; i++) act[i] = vec_silu(gg[i]) * uu[i];
    project(t, l, LORA_DOWN, &L->w_down, a->act, xo, T, seed, train);
    if (!xo) return STILL_OK;
    for (size_t i = 0; i < nd; i++) xo[i] += a->xm[i];
    return STILL_OK;
}

/* Backward of layer l (activations in t->a): t->dx holds ∂/∂(layer output)
 * on entry and ∂/∂(layer input x) on return. */
static int layer_backward(lm_train *t, int l, const float *x, int T, uint64_t seed, const lm_grads *g, still_err *err) {
    const still_model *m = t->m;
    const model_config *c = &m->cfg;
    const layer_weights *L = &m->layers[l];
    const int d = c->d_model, H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, qd = H * D, kvd = Hk * D;
    const size_t ff = (size_t)c->d_ff, nd = (size_t)T * d, nf = (size_t)T * ff;
    layer_acts *a = &t->a;
    int rc;
    /* feed-forward: x' = xm + down(act) */
    memset(t->dact, 0, sizeof(float) * nf);
    if ((rc = project_bwd(t, l, LORA_DOWN, &L->w_down, t->dx, t->dact, T, seed, g, err))) return rc;
    /* act = silu(g) u: dg = dact u σ(g)(1 + g(1 - σ(g))), du = dact silu(g) */
#pragma omp parallel for schedule(static) if (nf > 65536)
    for (size_t i = 0; i < nf; i++) {
        const float gi = a->g[i], sg = 1.0f / (1.0f + vec_expf(-gi));
        t->dg[i] = t->dact[i] * a->u[i] * sg * (1.0f + gi * (1.0f - sg));
        t->du[i] = t->dact[i] * gi * sg;
    }
    memset(t->dh, 0, sizeof(float) * nd);
    if ((rc = project_bwd(t, l, LORA_GATE, &L->w_gate, t->dg, t->dh, T, seed, g, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_UP, &L->w_up, t->du, t->dh, T, seed, g, err))) return rc;
    memcpy(t->dxm, t->dx, sizeof(float) * nd);
    rmsnorm_bwd_rows(t->dxm, a->xm, a->r2, L->ffn_norm, t->dh, T, d);
    /* attention: xm = x + o(att) */
    memset(t->datt, 0, sizeof(float) * (size_t)T * qd);
    if ((rc = project_bwd(t, l, LORA_O, &L->wo, t->dxm, t->datt, T, seed, g, err))) return rc;
    const attn_config *ac = &m->attn_cfg[l];
    const attn_kind *kind = attn_kind_get(ac->kind);
    if (!kind->backward_inputs)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention kind '%s' has no backward through its inputs yet", kind->name);
    attn_config cfg = *ac;
    cfg.n_ctx = T;
    memset(t->dq, 0, sizeof(float) * (size_t)T * qd);
    memset(t->dk, 0, sizeof(float) * (size_t)T * kvd);
    memset(t->dv, 0, sizeof(float) * (size_t)T * kvd);
    memset(t->dh, 0, sizeof(float) * nd);
    if (kind->needs_nope) {
        memset(t->dqn, 0, sizeof(float) * (size_t)T * qd);
        memset(t->dkn, 0, sizeof(float) * (size_t)T * kvd);
    }
    attn_io io = {.q = a->q, .k = a->k, .v = a->v, .q_nope = kind->needs_nope ? a->qn : NULL,
                  .k_nope = kind->needs_nope ? a->kn : NULL, .x = a->h1, .p0 = 0, .T = T};
    attn_grads ag = {.dq = t->dq, .dk = t->dk, .dv = t->dv, .dq_nope = kind->needs_nope ? t->dqn : NULL,
                     .dk_nope = kind->needs_nope ? t->dkn : NULL, .dx = kind->needs_x ? t->dh : NULL,
                     .dparams = g && g->attn ? g->attn[l] : NULL};
    if ((rc = kind->backward_inputs(&cfg, m->attn_params[l], &io, t->datt, &ag, err))) return rc;
    rope_rows(t->dq, T, H, D, t->inv_freq, 1);
    rope_rows(t->dk, T, Hk, D, t->inv_freq, 1);
    if (kind->needs_nope) {
        for (size_t i = 0; i < (size_t)T * qd; i++) t->dq[i] += t->dqn[i];
        for (size_t i = 0; i < (size_t)T * kvd; i++) t->dk[i] += t->dkn[i];
    }
    if ((rc = project_bwd(t, l, LORA_Q, &L->wq, t->dq, t->dh, T, seed, g, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_K, &L->wk, t->dk, t->dh, T, seed, g, err))) return rc;
    if ((rc = project_bwd(t, l, LORA_V, &L->wv, t->dv, t->dh, T, seed, g, err))) return rc;
    memcpy(t->dx, t->dxm, sizeof(float) * nd);
    rmsnorm_bwd_rows(t->dx, x, a->r1, L->attn_norm, t->dh, T, d);
    return STILL_OK;
}

/* ---- the loss ---------------------------------------------------------------------- */

/* Cross-entropy of the rows with a positive weight, in blocks of ce_rows; with
 * grad, dX (zeroed here) gets ∂(scale · loss)/∂x of the final hidden states. */
static int cross_entropy(lm_train *t, const float *x, const int32_t *tok, const float *w, int T, float scale,
                         int grad, double *loss_sum, double *w_sum, still_err *err) {
    const still_model *m = t->m;
    const model_config *c = &m->cfg;
    const int d = c->d_model, V = c->n_vocab;
    int n = 0;
    for (int i = 0; i + 1 < T; i++)
        if (!w || w[i] > 0) t->rows[n++] = i;
    double ls = 0, ws = 0;
    if (grad) memset(t->dx, 0, sizeof(float) * (size_t)T * d);
    const int RB = t->ce_rows;
    for (int b0 = 0; b0 < n; b0 += RB) {
        const int nb = n - b0 < RB ? n - b0 : RB;
        for (int i = 0; i < nb; i++) memcpy(t->dhn + (size_t)i * d, x + (size_t)t->rows[b0 + i] * d, sizeof(float) * d);
        rmsnorm_rows(t->hn, t->rn, t->dhn, m->output_norm, nb, d, c->norm_eps);
        matmul(&m->output, t->hn, t->logits, nb);
        double *lsb = t->ce_loss;
#pragma omp parallel for schedule(static)
        for (int i = 0; i < nb; i++) {
            const int row = t->rows[b0 + i], y = tok[row + 1];
            const float wi = w ? w[row] : 1.0f;
            float *lg = t->logits + (size_t)i * V;
            float mx = lg[0];
            for (int j = 1; j < V; j++) mx = lg[j] > mx ? lg[j] : mx;
            double s = 0;
            for (int j = 0; j < V; j++) s += exp((double)lg[j] - mx);
            const double lse = mx + log(s);
            lsb[i] = wi * (lse - lg[y]);
            if (grad) {
                const float f = scale * wi;
                for (int j = 0; j < V; j++) lg[j] = f * (float)exp((double)lg[j] - lse);
                lg[y] -= f;
            }
        }
        for (int i = 0; i < nb; i++) ls += lsb[i], ws += w ? w[t->rows[b0 + i]] : 1.0;
        if (!grad) continue;
        memset(t->dhn, 0, sizeof(float) * (size_t)nb * d);
        int rc = matmul_t_acc(&m->output, t->logits, t->dhn, nb);
        if (rc) return still_fail(err, rc, "cannot back-propagate through the output matrix");
        /* the normed rows' gradient into the hidden states' rows */
        float *dxr = t->hn;   /* the normed rows are no longer needed: reuse as dx rows */
        memset(dxr, 0, sizeof(float) * (size_t)nb * d);
        for (int i = 0; i < nb; i++) memcpy(t->logits + (size_t)i * d, x + (size_t)t->rows[b0 + i] * d, sizeof(float) * d);
        rmsnorm_bwd_rows(dxr, t->logits, t->rn, m->output_norm, t->dhn, nb, d);
        for (int i = 0; i < nb; i++) {
            float *o = t->dx + (size_t)t->rows[b0 + i] * d;
            for (int j = 0; j < d; j++) o[j] += dxr[(size_t)i * d + j];
        }
    }
    *loss_sum = ls, *w_sum = ws;
    return STILL_OK;
}

/* ---- a sequence ---------------------------------------------------------------------- */

int lm_train_seq(lm_train *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                 const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    const still_model *m = t->m;
    const model_config *c = &m->cfg;
    const int d = c->d_model, NL = c->n_layer;
    *loss_sum = 0, *w_sum = 0;
    if (T < 2 || T > t->max_T) return still_fail(err, STILL_E_ARG, "training sequence of %d tokens (2 .. %d)", T, t->max_T);
    const size_t nd = (size_t)T * d;
    for (int i = 0; i < T; i++) {
        if (tok[i] < 0 || tok[i] >= c->n_vocab)
            return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", tok[i], c->n_vocab);
        const uint8_t *row = (const uint8_t *)m->tok_embd.data + (size_t)tok[i] * m->tok_embd.row_bytes;
        int rc = dequantize_row(m->tok_embd.type, row, t->X + (size_t)i * d, d, err);
        if (rc) return rc;
    }
    const int train = g != NULL;
    for (int l = 0; l < NL; l++) {
        int rc = layer_forward(t, l, t->X + (size_t)l * nd, t->X + (size_t)(l + 1) * nd, T, drop_seed, train, err);
        if (rc) return rc;
    }
    int rc = cross_entropy(t, t->X + (size_t)NL * nd, tok, w, T, scale, train, loss_sum, w_sum, err);
    if (rc || !g) return rc;
    for (int l = NL - 1; l >= 0; l--) {
        /* the top layer's activations are still in place from the forward */
        if (l < NL - 1 && (rc = layer_forward(t, l, t->X + (size_t)l * nd, NULL, T, drop_seed, train, err))) return rc;
        if ((rc = layer_backward(t, l, t->X + (size_t)l * nd, T, drop_seed, g, err))) return rc;
    }
    return STILL_OK;
}
