/* The dsa kind (spec "dsa"; attn_dsa_rules.h has the rules): exact softmax attention over the keys a lightning
 * indexer picks, and an output gate, on the CPU.
 *
 * State: the layer's own KV cache (keys after RoPE and values, [Hk][n_ctx][D], as softmax keeps them) and one
 * indexer key per position, stored transposed [d_I][n_ctx] so that a query's indexer head scores every earlier
 * position with d_I vector multiply-adds over positions.
 *
 * A call of T tokens first appends their keys, values and indexer keys, then handles its tokens in parallel, each
 * on its own: the indexer's scores of the positions before the local window, the top topk − DSA_LOCAL of them by a
 * partial selection, the selected positions in ascending order, then per query head the softmax over them (no
 * T × T matrix anywhere: a query's scores are one row of n_ctx floats). Every value a token's output depends on is
 * computed by the same loops whatever the call's T, so a prefill, a chunked prefill and decode steps give the same
 * outputs bit for bit.
 *
 * Training: the selection is a fixed routing decision (recomputed from the same inputs). backward (stage 1) gives
 * the gate's gradient; backward_inputs (stage 2) the gradients of q, k, v through the selected softmax and of x
 * through the gate; the indexer's input is detached from these losses (spec), it learns by its own loss. */
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "kinds/attn_rules.h"
#include "kinds/dsa/attn_dsa.h"
#include "kinds/dsa/attn_dsa_rules.h"
#include "common/common.h"

extern const attn_kind attn_kind_dsa;

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int cap;        /* positions the cache holds */
    float *k, *v;   /* [Hk][cap][D] */
    float *kit;     /* indexer keys [d_I][cap] */
    int n_threads;
    float *fscr;    /* per thread: scores [cap], dots [cap], q^I [H_I d_I], w [H_I], p [topk] */
    int *iscr;      /* per thread: candidates [cap], the selection [topk] */
} dsa_state;

/* ---- configuration and parameters ---------------------------------------------------------- */

static int dsa_shape_ok(const attn_config *c) {
    return c->n_head > 0 && c->n_head_kv > 0 && c->head_dim > 0 && c->d_model > 0 && c->n_head % c->n_head_kv == 0 &&
           c->index_heads > 0 && c->index_heads <= DSA_MAX_HEADS && c->index_dim > 0 && c->index_dim <= DSA_MAX_DIM;
}

static size_t dsa_param_count(const attn_config *c) {
    if (!dsa_shape_ok(c)) return 0;
    return dsa_par_count(c->index_heads, c->index_dim, c->d_model, c->n_head, c->head_dim);
}

static void dsa_param_init(const attn_config *c, float *p, uint64_t seed) {
    const int HI = c->index_heads, dI = c->index_dim, d = c->d_model, H = c->n_head, D = c->head_dim;
    memset(p, 0, sizeof(float) * dsa_param_count(c));
    uint64_t s = seed ^ 0xd5a1de8e7ULL;
    const double sd = 1.0 / sqrt((double)d);
    for (size_t i = 0; i < (size_t)(HI + 1) * dI * d; i++) p[i] = (float)(sd * attn_rng_normal(&s));   /* W_qI, W_kI */
    for (int j = 0; j < HI; j++) p[dsa_par_bw(HI, dI, d) + j] = dsa_init_bw(HI);
    for (size_t i = 0; i < (size_t)H * D; i++) p[dsa_par_bg(HI, dI, d, H, D) + i] = DSA_GATE_BIAS0;
}

void attn_dsa_init_from_projections(const attn_config *c, float *p, const float *wq, const float *wk) {
    const int HI = c->index_heads, dI = c->index_dim, d = c->d_model, D = c->head_dim;
    const int G = c->n_head / c->n_head_kv;
    memset(p + dsa_par_wq(), 0, sizeof(float) * (size_t)HI * dI * d);
    /* d_I = D: indexer head j's rows are query head g·G + j's, the first G heads' rows one block */
    memcpy(p + dsa_par_wq(), wq, sizeof(float) * (size_t)G * D * d);
    memcpy(p + dsa_par_wk(HI, dI, d), wk, sizeof(float) * (size_t)D * d);
    memset(p + dsa_par_ww(HI, dI, d), 0, sizeof(float) * (size_t)HI * d);
    for (int j = 0; j < HI; j++) p[dsa_par_bw(HI, dI, d) + j] = j < G ? 1.0f / (float)G : 0.0f;
}

static size_t fscr_floats(const attn_config *c, int cap) {
    return 2 * (size_t)cap + (size_t)c->index_heads * c->index_dim + (size_t)c->index_heads + (size_t)c->topk;
}
static size_t iscr_ints(const attn_config *c, int cap) { return (size_t)cap + (size_t)c->topk; }

static void dsa_free(attn_state *s) {
    if (!s) return;
    dsa_state *g = s->impl;
    if (g) free(g->k), free(g->v), free(g->kit), free(g->fscr), free(g->iscr), free(g);
    free(s);
}

static int dsa_check(const attn_config *c, still_err *err) {
    if (!dsa_shape_ok(c))
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "dsa: attention shape unsupported (head dim %d, %d heads, %d KV heads, indexer %d x %d)",
                          c->head_dim, c->n_head, c->n_head_kv, c->index_heads, c->index_dim);
    if (c->topk <= DSA_LOCAL)
        return still_fail(err, STILL_E_ARG, "dsa: topk %d must exceed the %d local positions it always keeps", c->topk,
                          DSA_LOCAL);
    if (c->n_ctx <= 0) return still_fail(err, STILL_E_ARG, "dsa: needs n_ctx > 0");
    return STILL_OK;
}

static int dsa_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    int rc = dsa_check(c, err);
    if (rc) return rc;
    const int cap = c->n_ctx, nt = omp_get_max_threads();
    const size_t kv = (size_t)c->n_head_kv * cap * c->head_dim;
    attn_state *s = calloc(1, sizeof *s);
    dsa_state *g = calloc(1, sizeof *g);
    if (g) {
        g->cap = cap, g->n_threads = nt;
        g->k = malloc(sizeof(float) * kv), g->v = malloc(sizeof(float) * kv);
        g->kit = malloc(sizeof(float) * (size_t)c->index_dim * cap);
        g->fscr = malloc(sizeof(float) * fscr_floats(c, cap) * nt);
        g->iscr = malloc(sizeof(int) * iscr_ints(c, cap) * nt);
    }
    if (!s || !g || !g->k || !g->v || !g->kit || !g->fscr || !g->iscr) {
        if (g) free(g->k), free(g->v), free(g->kit), free(g->fscr), free(g->iscr);
        free(s), free(g);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating the dsa state (%d positions)", cap);
    }
    s->cfg = *c;
    s->impl = g;
    *out = s;
    return STILL_OK;
}

static int dsa_truncate(attn_state *s, int n, still_err *err) {
    if (n < 0 || n > s->n_seen)
        return still_fail(err, STILL_E_ARG, "cannot truncate a %d-token dsa state to %d tokens", s->n_seen, n);
    s->n_seen = n;   /* a KV cache: the positions beyond n are simply overwritten later */
    return STILL_OK;
}

static size_t dsa_bytes(const attn_state *s) {
    const dsa_state *g = s->impl;
    const attn_config *c = &s->cfg;
    return sizeof(float) * ((size_t)2 * c->n_head_kv * g->cap * c->head_dim + (size_t)c->index_dim * g->cap);
}

/* The keys, values and indexer keys of the positions seen (per KV head: rows 0 .. n_seen − 1). */
static int dsa_regions(attn_state *s, attn_region *out, int max) {
    dsa_state *g = s->impl;
    const attn_config *c = &s->cfg;
    const int Hk = c->n_head_kv, D = c->head_dim;
    if (max < 2 * Hk + c->index_dim) return -1;
    const size_t used = (size_t)s->n_seen * D * sizeof(float);
    int n = 0;
    for (int hk = 0; hk < Hk; hk++) {
        out[n++] = (attn_region){g->k + (size_t)hk * g->cap * D, used};
        out[n++] = (attn_region){g->v + (size_t)hk * g->cap * D, used};
    }
    for (int i = 0; i < c->index_dim; i++)
        out[n++] = (attn_region){g->kit + (size_t)i * g->cap, (size_t)s->n_seen * sizeof(float)};
    return n;
}

/* ---- per token --------------------------------------------------------------------------------- */

static float dotf(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y [n] = W [n][d] x (+ b). */
static void matvec(const float *W, const float *b, const float *x, int n, int d, float *y) {
    for (int r = 0; r < n; r++) y[r] = dotf(W + (size_t)r * d, x, d) + (b ? b[r] : 0.0f);
}

/* a before b in the selection's order (the larger score; ties: the later position). */
static int before(const float *sc, int a, int b) { return dsa_ranks_before(sc[a], a, sc[b], b); }

/* Rearranges idx[0 .. n) so that its first m entries are the m best (by before), in no particular order: a
 * quickselect; everything in [0, lo) ranks before everything in [lo, n), everything in [hi, n) after [0, hi). */
static void select_top(const float *sc, int *idx, int n, int m) {
    int lo = 0, hi = n;
    while (lo < m && m < hi) {
        const int mid = lo + (hi - lo) / 2, piv = idx[mid];
        idx[mid] = idx[hi - 1], idx[hi - 1] = piv;
        int store = lo;
        for (int i = lo; i < hi - 1; i++)
            if (before(sc, idx[i], piv)) {
                const int t = idx[i];
                idx[i] = idx[store], idx[store] = t, store++;
            }
        idx[hi - 1] = idx[store], idx[store] = piv;   /* the pivot at store: [lo, store) before it, the rest after */
        if (store < m) lo = store + 1;
        else hi = store;
    }
}

static int cmp_int(const void *a, const void *b) { return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b); }

/* The positions query position p attends to, ascending, into sel; returns their count. x: its layer input. */
static int dsa_select(const attn_config *c, const float *params, const float *kit, int cap, const float *x, int p,
                      float *fs, int *is, int *sel) {
    const int n = p + 1, K = c->topk;
    if (n <= K) {
        for (int s = 0; s < n; s++) sel[s] = s;
        return n;
    }
    const int HI = c->index_heads, dI = c->index_dim, d = c->d_model, old = n - DSA_LOCAL, m = K - DSA_LOCAL;
    float *sc = fs, *dots = fs + cap, *qI = dots + cap, *w = qI + (size_t)HI * dI;
    matvec(params + dsa_par_wq(), NULL, x, HI * dI, d, qI);
    matvec(params + dsa_par_ww(HI, dI, d), params + dsa_par_bw(HI, dI, d), x, HI, d, w);
    for (int s = 0; s < old; s++) sc[s] = 0.0f;
    for (int j = 0; j < HI; j++) {
        const float *q = qI + (size_t)j * dI, wj = w[j];
        for (int s = 0; s < old; s++) dots[s] = 0.0f;
        for (int i = 0; i < dI; i++) {   /* every position's dot product, over i in order */
            const float qi = q[i], *kr = kit + (size_t)i * cap;
#pragma omp simd
            for (int s = 0; s < old; s++) dots[s] += qi * kr[s];
        }
        for (int s = 0; s < old; s++) sc[s] += dsa_index_term(wj, dots[s]);
    }
    for (int s = 0; s < old; s++) is[s] = s;
    select_top(sc, is, old, m);
    memcpy(sel, is, sizeof(int) * (size_t)m);
    qsort(sel, (size_t)m, sizeof(int), cmp_int);
    for (int s = old; s < n; s++) sel[m + s - old] = s;
    return K;
}

/* Query head h's softmax over the selected keys of its KV head: the weights into pr [ns], the output into o [D]. */
static void dsa_head(const attn_config *c, const dsa_state *g, const float *q, int hk, const int *sel, int ns,
                     float *pr, float *o) {
    const int D = c->head_dim;
    const float scale = attn_logit_scale(D);
    const float *K = g->k + (size_t)hk * g->cap * D, *V = g->v + (size_t)hk * g->cap * D;
    float mx = -INFINITY;
    for (int i = 0; i < ns; i++) {
        pr[i] = dotf(q, K + (size_t)sel[i] * D, D) * scale;
        mx = pr[i] > mx ? pr[i] : mx;
    }
    float l = 0.0f;
    for (int i = 0; i < ns; i++) pr[i] = expf(pr[i] - mx), l += pr[i];
    const float inv = 1.0f / l;
    for (int x = 0; x < D; x++) o[x] = 0.0f;
    for (int i = 0; i < ns; i++) {
        pr[i] *= inv;
        const float pi = pr[i], *vr = V + (size_t)sel[i] * D;
#pragma omp simd
        for (int x = 0; x < D; x++) o[x] += pi * vr[x];
    }
}

/* ---- forward --------------------------------------------------------------------------------------- */

/* Appends the call's keys, values and indexer keys at positions p0 .. p0 + T − 1. */
static void dsa_append(const attn_config *c, dsa_state *g, const float *params, const attn_io *io) {
    const int D = c->head_dim, Hk = c->n_head_kv, kvd = Hk * D, dI = c->index_dim, d = c->d_model;
    const float *WkI = params + dsa_par_wk(c->index_heads, dI, d);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < io->T; t++) {
        const int p = io->p0 + t;
        for (int hk = 0; hk < Hk; hk++) {
            memcpy(g->k + ((size_t)hk * g->cap + p) * D, io->k + (size_t)t * kvd + (size_t)hk * D, sizeof(float) * D);
            memcpy(g->v + ((size_t)hk * g->cap + p) * D, io->v + (size_t)t * kvd + (size_t)hk * D, sizeof(float) * D);
        }
        for (int i = 0; i < dI; i++) g->kit[(size_t)i * g->cap + p] = dotf(WkI + (size_t)i * d, io->x + (size_t)t * d, d);
    }
}

static int dsa_io_check(const attn_state *s, const float *params, const attn_io *io, still_err *err) {
    if (!params) return still_fail(err, STILL_E_ARG, "dsa: no parameters (convert or load an adapter)");
    if (!io->x || !io->q || !io->k || !io->v) return still_fail(err, STILL_E_ARG, "dsa: needs q, k, v and the layer input");
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_ARG, "dsa: call at position %d, but the state holds %d tokens", io->p0, s->n_seen);
    const dsa_state *g = s->impl;
    if (io->p0 + io->T > g->cap)
        return still_fail(err, STILL_E_ARG, "dsa: %d tokens exceed the context of %d", io->p0 + io->T, g->cap);
    return STILL_OK;
}

/* Token t of the call: its selection, every head's softmax output (into o [H·D], the raw output before the gate)
 * and, with y, the gated output. pr_all: NULL, or [H][topk] for the heads' weights. Returns the selection's size. */
static int dsa_token(const attn_config *c, const dsa_state *g, const float *params, const attn_io *io, int t,
                     float *fs, int *is, int *sel, float *o, float *pr_all, float *y) {
    const int H = c->n_head, D = c->head_dim, G = H / c->n_head_kv, d = c->d_model, HD = H * D;
    const float *x = io->x + (size_t)t * d;
    const int ns = dsa_select(c, params, g->kit, g->cap, x, io->p0 + t, fs, is, sel);
    float *pr = fs + fscr_floats(c, g->cap) - c->topk;
    for (int h = 0; h < H; h++)
        dsa_head(c, g, io->q + (size_t)t * HD + (size_t)h * D, h / G, sel, ns, pr_all ? pr_all + (size_t)h * c->topk : pr,
                 o + (size_t)h * D);
    if (y) {
        const int HI = c->index_heads, dI = c->index_dim;
        const float *Wg = params + dsa_par_wg(HI, dI, d), *bg = params + dsa_par_bg(HI, dI, d, H, D);
        for (int r = 0; r < HD; r++) y[r] = dsa_gate(dotf(Wg + (size_t)r * d, x, d) + bg[r]) * o[r];
    }
    return ns;
}

static int dsa_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    if (io->T <= 0) return io->T < 0 ? still_fail(err, STILL_E_ARG, "dsa: negative token count %d", io->T) : STILL_OK;
    int rc = dsa_io_check(s, params, io, err);
    if (rc) return rc;
    const attn_config *c = &s->cfg;
    dsa_state *g = s->impl;
    dsa_append(c, g, params, io);
    const int HD = c->n_head * c->head_dim;
#pragma omp parallel num_threads(g->n_threads)
    {
        const int th = omp_get_thread_num();
        float *fs = g->fscr + fscr_floats(c, g->cap) * th, *o = malloc(sizeof(float) * HD);
        int *is = g->iscr + iscr_ints(c, g->cap) * th, *sel = is + g->cap;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < io->T; t++) {
            if (o) dsa_token(c, g, params, io, t, fs, is, sel, o, NULL, out + (size_t)t * HD);
        }
        if (!o) {
#pragma omp atomic write
            rc = STILL_E_NOMEM;
        }
        free(o);
    }
    if (rc) return still_fail(err, STILL_E_NOMEM, "dsa: out of memory");
    s->n_seen += io->T;
    return STILL_OK;
}

/* ---- backward -------------------------------------------------------------------------------------- */

/* The whole sequence io (p0 = 0) once more on a fresh state, then per token the gate's and, with gi, the inputs'
 * gradients: y = g ⊙ o with g = σ(W_g x + b_g): dpre = dy ⊙ o ⊙ g (1 − g), do = dy ⊙ g; per head over the
 * selected keys dv_s += p_s do, dz_s = p_s (do · v_s − do · o), dq += scale Σ dz_s k_s, dk_s += scale dz_s q;
 * dx += dpreᵀ W_g; dW_g += dpre xᵀ, db_g += dpre. */
static int dsa_backward_run(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                            float *dparams, const attn_grads *gi, still_err *err) {
    if (io->p0 != 0) return still_fail(err, STILL_E_ARG, "dsa backward: a whole sequence from position 0 (got %d)", io->p0);
    attn_config cc = *c;
    if (cc.n_ctx < io->T) cc.n_ctx = io->T;
    attn_state *s = NULL;
    int rc = dsa_create(&cc, &s, err);
    if (rc) return rc;
    if ((rc = dsa_io_check(s, params, io, err))) {
        dsa_free(s);
        return rc;
    }
    dsa_state *g = s->impl;
    dsa_append(&cc, g, params, io);
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, d = c->d_model, HD = H * D, kvd = Hk * D;
    const int HI = c->index_heads, dI = c->index_dim, T = io->T, K = c->topk, nt = g->n_threads;
    const float scale = attn_logit_scale(D);
    const float *Wg = params + dsa_par_wg(HI, dI, d), *bg = params + dsa_par_bg(HI, dI, d, H, D);
    /* per thread: dk, dv [T][kvd] (summed after), dW_g [HD][d] and db_g [HD] when wanted */
    const int want_k = gi && (gi->dk || gi->dv), want_p = dparams != NULL;
    const size_t per = (want_k ? 2 * (size_t)T * kvd : 0) + (want_p ? (size_t)HD * (d + 1) : 0);
    float *acc = calloc(per * nt + 1, sizeof(float));
    if (!acc) {
        dsa_free(s);
        return still_fail(err, STILL_E_NOMEM, "dsa backward: out of memory for %d tokens", T);
    }
    int bad = 0;
#pragma omp parallel num_threads(nt)
    {
        const int th = omp_get_thread_num();
        float *fs = g->fscr + fscr_floats(&cc, g->cap) * th, *mine = acc + per * th;
        int *is = g->iscr + iscr_ints(&cc, g->cap) * th, *sel = is + g->cap;
        float *dk = want_k ? mine : NULL, *dv = want_k ? mine + (size_t)T * kvd : NULL;
        float *dW = want_p ? mine + (want_k ? 2 * (size_t)T * kvd : 0) : NULL, *db = dW ? dW + (size_t)HD * d : NULL;
        float *o = malloc(sizeof(float) * (3 * (size_t)HD + (size_t)H * K + D));
        if (!o) {
#pragma omp atomic write
            bad = 1;
        }
#pragma omp for schedule(static)   /* a fixed share per thread: the sums below are reproducible */
        for (int t = 0; t < T; t++) {
            if (!o) continue;
            float *dpre = o + HD, *dov = dpre + HD, *pr = dov + HD, *tmp = pr + (size_t)H * K;
            const float *x = io->x + (size_t)t * d, *dy = dout + (size_t)t * HD;
            const int ns = dsa_token(&cc, g, params, io, t, fs, is, sel, o, pr, NULL);
            for (int r = 0; r < HD; r++) {
                const float gt = dsa_gate(dotf(Wg + (size_t)r * d, x, d) + bg[r]);
                dpre[r] = dy[r] * o[r] * gt * (1.0f - gt), dov[r] = dy[r] * gt;
            }
            if (dW)
                for (int r = 0; r < HD; r++) {
                    const float e = dpre[r];
                    float *wr = dW + (size_t)r * d;
#pragma omp simd
                    for (int i = 0; i < d; i++) wr[i] += e * x[i];
                    db[r] += e;
                }
            if (gi && gi->dx)   /* each token its own row: no race */
                for (int r = 0; r < HD; r++) {
                    const float e = dpre[r], *wr = Wg + (size_t)r * d;
                    float *dx = gi->dx + (size_t)t * d;
#pragma omp simd
                    for (int i = 0; i < d; i++) dx[i] += e * wr[i];
                }
            if (!gi || (!gi->dq && !dk)) continue;
            for (int h = 0; h < H; h++) {
                const int hk = h / G;
                const float *q = io->q + (size_t)t * HD + (size_t)h * D, *dh = dov + (size_t)h * D, *p = pr + (size_t)h * K;
                const float *Kc = g->k + (size_t)hk * g->cap * D, *Vc = g->v + (size_t)hk * g->cap * D;
                const float delta = dotf(dh, o + (size_t)h * D, D);
                for (int x2 = 0; x2 < D; x2++) tmp[x2] = 0.0f;
                for (int i = 0; i < ns; i++) {
                    const int sp = sel[i];
                    const float dz = p[i] * (dotf(dh, Vc + (size_t)sp * D, D) - delta) * scale;
                    const float *kr = Kc + (size_t)sp * D;
#pragma omp simd
                    for (int x2 = 0; x2 < D; x2++) tmp[x2] += dz * kr[x2];
                    if (dk) {
                        float *dkr = dk + (size_t)sp * kvd + (size_t)hk * D, *dvr = dv + (size_t)sp * kvd + (size_t)hk * D;
                        const float pi = p[i];
#pragma omp simd
                        for (int x2 = 0; x2 < D; x2++) dkr[x2] += dz * q[x2], dvr[x2] += pi * dh[x2];
                    }
                }
                if (gi->dq) {
                    float *dq = gi->dq + (size_t)t * HD + (size_t)h * D;
                    for (int x2 = 0; x2 < D; x2++) dq[x2] += tmp[x2];
                }
            }
        }
        free(o);
    }
    if (bad) rc = still_fail(err, STILL_E_NOMEM, "dsa backward: out of memory");
    for (int th = 0; th < nt && !rc; th++) {   /* the threads' sums, in thread order */
        const float *mine = acc + per * th;
        if (want_k) {
            for (size_t i = 0; gi->dk && i < (size_t)T * kvd; i++) gi->dk[i] += mine[i];
            for (size_t i = 0; gi->dv && i < (size_t)T * kvd; i++) gi->dv[i] += mine[(size_t)T * kvd + i];
        }
        if (want_p) {
            const float *dW = mine + (want_k ? 2 * (size_t)T * kvd : 0);
            float *pw = dparams + dsa_par_wg(HI, dI, d), *pb = dparams + dsa_par_bg(HI, dI, d, H, D);
            for (size_t i = 0; i < (size_t)HD * d; i++) pw[i] += dW[i];
            for (int r = 0; r < HD; r++) pb[r] += dW[(size_t)HD * d + r];
        }
    }
    free(acc);
    dsa_free(s);
    return rc;
}

static int dsa_backward(const attn_config *c, const float *params, const attn_io *io, const float *dout, float *dparams,
                        still_err *err) {
    if (!dparams) return still_fail(err, STILL_E_ARG, "dsa backward: no gradient buffer");
    return dsa_backward_run(c, params, io, dout, dparams, NULL, err);
}

static int dsa_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                               const attn_grads *g, still_err *err) {
    if (!g) return still_fail(err, STILL_E_ARG, "dsa backward: no gradient buffers");
    return dsa_backward_run(c, params, io, dout, g->dparams, g, err);
}

/* ---- stage 1: the indexer's own loss -------------------------------------------------------------
 *
 * The indexer learns to rank the positions the teacher attends to (spec: the dense warm-up, KL against the teacher's
 * head-summed, L1-normalised attention). Since the local window is always kept, its loss covers the older positions
 * only: for a query t with old = t + 1 − DSA_LOCAL > 0 older positions, the teacher's distribution over them is
 * p_s ∝ Σ_h softmax_{s' <= t}(q_h · k_{s'} / √D)_s (s < old), the indexer's r = softmax_{s < old}(I_{t,s}), and the
 * loss is the mean over such queries of KL(p || r). Its gradient: dI_s = (r_s − p_s) / N, then through
 * I = Σ_j w_j ReLU(a_j), a_j = q^I_j · k^I_s: dw_j = Σ_s dI_s ReLU(a_js), da_js = dI_s w_j [a_js > 0],
 * dq^I_j = Σ_s da_js k^I_s, dk^I_s = Σ_j da_js q^I_j, and into W_qI, W_w, b_w, W_kI with the layer inputs. */

/* The mean KL over the sequence io (p0 = 0) into *kl; with dparams, scale times its gradient added. */
static int dsa_indexer_loss(const attn_config *c, const float *params, const attn_io *io, float scale, float *dparams,
                            double *kl, still_err *err) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, d = c->d_model, HD = H * D, kvd = Hk * D;
    const int HI = c->index_heads, dI = c->index_dim, T = io->T, nt = omp_get_max_threads();
    *kl = 0;
    const int nq = T - DSA_LOCAL;   /* queries with older positions: t >= DSA_LOCAL */
    if (nq <= 0) return STILL_OK;
    const float zs = attn_logit_scale(D);
    const float *WqI = params + dsa_par_wq(), *WkI = params + dsa_par_wk(HI, dI, d), *Ww = params + dsa_par_ww(HI, dI, d);
    const float *bw = params + dsa_par_bw(HI, dI, d);
    /* per thread: dW_qI [HI dI][d], dW_w [HI][d], db_w [HI], dk^I [T][dI]; scratch: p, r/I, z [T], a [HI][T],
     * q^I [HI dI], w, dw [HI], dq^I [dI] */
    const size_t per = (size_t)HI * dI * d + (size_t)HI * d + HI + (size_t)T * dI;
    const size_t scr = 3 * (size_t)T + (size_t)HI * T + (size_t)HI * dI + 2 * (size_t)HI + (size_t)dI;
    float *kI = malloc(sizeof(float) * (size_t)T * dI), *acc = dparams ? calloc(per * nt, sizeof(float)) : NULL;
    float *work = malloc(sizeof(float) * scr * nt);
    double *kl_t = calloc((size_t)nt, sizeof(double));
    if (!kI || !work || !kl_t || (dparams && !acc)) {
        free(kI), free(acc), free(work), free(kl_t);
        return still_fail(err, STILL_E_NOMEM, "dsa: out of memory for the indexer's loss (%d tokens)", T);
    }
#pragma omp parallel for schedule(static)
    for (int s = 0; s < T; s++)
        for (int i = 0; i < dI; i++) kI[(size_t)s * dI + i] = dotf(WkI + (size_t)i * d, io->x + (size_t)s * d, d);
#pragma omp parallel num_threads(nt)
    {
        const int th = omp_get_thread_num();
        float *p = work + scr * th, *r = p + T, *z = r + T, *a = z + T, *qI = a + (size_t)HI * T, *w = qI + (size_t)HI * dI;
        float *dw = w + HI, *dq = dw + HI;   /* dq: one indexer head's dq^I [dI] */
        float *gq = acc ? acc + per * th : NULL, *gw = gq ? gq + (size_t)HI * dI * d : NULL;
        float *gb = gw ? gw + (size_t)HI * d : NULL, *gk = gb ? gb + HI : NULL;
#pragma omp for schedule(static)
        for (int t = DSA_LOCAL; t < T; t++) {
            const int old = t + 1 - DSA_LOCAL;
            const float *x = io->x + (size_t)t * d;
            /* the teacher: every head's softmax over s <= t, summed over the heads on the older positions */
            for (int s = 0; s < old; s++) p[s] = 0.0f;
            for (int h = 0; h < H; h++) {
                const float *q = io->q + (size_t)t * HD + (size_t)h * D;
                float mx = -INFINITY, l = 0.0f;
                for (int s = 0; s <= t; s++) {
                    z[s] = dotf(q, io->k + (size_t)s * kvd + (size_t)(h / G) * D, D) * zs;
                    mx = z[s] > mx ? z[s] : mx;
                }
                for (int s = 0; s <= t; s++) z[s] = expf(z[s] - mx), l += z[s];
                for (int s = 0; s < old; s++) p[s] += z[s] / l;
            }
            float ps = 0.0f;
            for (int s = 0; s < old; s++) ps += p[s];
            if (!(ps > 0.0f)) continue;
            for (int s = 0; s < old; s++) p[s] /= ps;
            /* the indexer's scores and their softmax */
            matvec(WqI, NULL, x, HI * dI, d, qI);
            matvec(Ww, bw, x, HI, d, w);
            float mx = -INFINITY;
            for (int s = 0; s < old; s++) r[s] = 0.0f;
            for (int j = 0; j < HI; j++)
                for (int s = 0; s < old; s++) {
                    const float aj = dotf(qI + (size_t)j * dI, kI + (size_t)s * dI, dI);
                    a[(size_t)j * T + s] = aj;
                    r[s] += dsa_index_term(w[j], aj);
                }
            for (int s = 0; s < old; s++) mx = r[s] > mx ? r[s] : mx;
            float l = 0.0f;
            for (int s = 0; s < old; s++) r[s] = expf(r[s] - mx), l += r[s];
            double klq = 0;
            for (int s = 0; s < old; s++) {
                r[s] /= l;
                if (p[s] > 0.0f) klq += (double)p[s] * (log((double)p[s]) - log((double)r[s] > 1e-30 ? r[s] : 1e-30));
            }
            kl_t[th] += klq;
            if (!gq) continue;
            /* dI_s = scale (r_s − p_s) / nq, through the heads */
            for (int j = 0; j < HI; j++) {
                float dwj = 0.0f;
                for (int i = 0; i < dI; i++) dq[i] = 0.0f;
                for (int s = 0; s < old; s++) {
                    const float dIs = scale * (r[s] - p[s]) / (float)nq, aj = a[(size_t)j * T + s];
                    if (!(aj > 0.0f)) continue;
                    dwj += dIs * aj;
                    const float da = dIs * w[j], *kr = kI + (size_t)s * dI, *qr = qI + (size_t)j * dI;
                    float *gkr = gk + (size_t)s * dI;
                    for (int i = 0; i < dI; i++) dq[i] += da * kr[i], gkr[i] += da * qr[i];
                }
                dw[j] = dwj;
                for (int i = 0; i < dI; i++) {
                    float *gr = gq + ((size_t)j * dI + i) * d;
                    const float e = dq[i];
#pragma omp simd
                    for (int u = 0; u < d; u++) gr[u] += e * x[u];
                }
            }
            for (int j = 0; j < HI; j++) {
                float *gr = gw + (size_t)j * d;
#pragma omp simd
                for (int u = 0; u < d; u++) gr[u] += dw[j] * x[u];
                gb[j] += dw[j];
            }
        }
    }
    for (int th = 0; th < nt; th++) *kl += kl_t[th];
    *kl /= nq;
    if (acc) {   /* the threads' sums in thread order, then W_kI's gradient from every position's dk^I */
        for (int th = 1; th < nt; th++)
            for (size_t i = 0; i < per; i++) acc[i] += acc[per * th + i];
        float *gq = acc, *gw = gq + (size_t)HI * dI * d, *gb = gw + (size_t)HI * d, *gk = gb + HI;
        float *pq = dparams + dsa_par_wq(), *pw = dparams + dsa_par_ww(HI, dI, d), *pb = dparams + dsa_par_bw(HI, dI, d);
        float *pk = dparams + dsa_par_wk(HI, dI, d);
        for (size_t i = 0; i < (size_t)HI * dI * d; i++) pq[i] += gq[i];
        for (size_t i = 0; i < (size_t)HI * d; i++) pw[i] += gw[i];
        for (int j = 0; j < HI; j++) pb[j] += gb[j];
#pragma omp parallel for schedule(static)
        for (int i = 0; i < dI; i++) {
            float *row = pk + (size_t)i * d;
            for (int s = 0; s < T; s++) {
                const float e = gk[(size_t)s * dI + i], *x = io->x + (size_t)s * d;
#pragma omp simd
                for (int u = 0; u < d; u++) row[u] += e * x[u];
            }
        }
    }
    free(kI), free(acc), free(work), free(kl_t);
    return STILL_OK;
}

/* Stage 1: the output's MSE against the teacher (reported; its gradient trains the gate) and the indexer's KL (its
 * gradient trains the indexer), both times scale. */
static int dsa_distill(const attn_config *c, const float *params, const attn_io *io, const float *target, float scale,
                       float *dparams, double *mse, still_err *err) {
    int rc = attn_distill_output(&attn_kind_dsa, c, params, io, target, scale, dparams, mse, err);
    double kl;
    if (!rc && dparams) rc = dsa_indexer_loss(c, params, io, scale, dparams, &kl, err);
    return rc;
}

/* The indexer's loss alone (tests, diagnostics): attn_dsa.h. */
int attn_dsa_indexer_loss(const attn_config *c, const float *params, const attn_io *io, float scale, float *dparams,
                          double *kl, still_err *err) {
    if (!dsa_shape_ok(c) || !params || !io || !io->q || !io->k || !io->x || io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "dsa indexer loss: a whole sequence with q, k and x, and parameters");
    return dsa_indexer_loss(c, params, io, scale, dparams, kl, err);
}

/* ---- diagnosis (still probe) ---------------------------------------------------------------------- */

typedef struct {
    double p;
    int s;
} ranked_pos;

static int by_teacher(const void *a, const void *b) {   /* larger mass first; ties: the later position first */
    const ranked_pos *x = a, *y = b;
    if (x->p != y->p) return x->p > y->p ? -1 : 1;
    return (x->s < y->s) - (x->s > y->s);
}

/* attn_dsa.h. The kind's own selection and weights (dsa_token on a state filled with the whole sequence), the
 * teacher's head-summed softmax over each query's older positions in double. */
int attn_dsa_explain(const attn_config *c, const float *params, const attn_io *io, const int *qs, int nq, int n_mass,
                     const int *keys, int nk, double *mass, double *recall, double *kept, still_err *err) {
    if (!dsa_shape_ok(c) || !params || !io || !io->q || !io->k || !io->v || !io->x || io->p0 != 0 || io->T < 1 ||
        nq < 0 || n_mass < 0 || n_mass > nq || nk < 0 || !mass || !recall || !kept)
        return still_fail(err, STILL_E_ARG, "dsa explain: a whole sequence with q, k, v and x, parameters and outputs");
    for (int i = 0; i < nq; i++)
        if (qs[i] < 0 || qs[i] >= io->T) return still_fail(err, STILL_E_ARG, "dsa explain: query %d out of range", qs[i]);
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, T = io->T, K = c->topk;
    const int HD = H * D, kvd = Hk * D, m = K - DSA_LOCAL;
    attn_config cc = *c;
    cc.n_ctx = T;
    attn_state *st = NULL;
    int rc = dsa_create(&cc, &st, err);
    if (rc) return rc;
    dsa_state *g = st->impl;
    float *fs = malloc(sizeof(float) * fscr_floats(&cc, g->cap)), *o = malloc(sizeof(float) * HD);
    float *pr = malloc(sizeof(float) * (size_t)H * K);
    int *is = malloc(sizeof(int) * iscr_ints(&cc, g->cap));
    char *is_key = calloc((size_t)T, 1), *in_top = calloc((size_t)T, 1);
    double *p = malloc(sizeof(double) * (size_t)T), *z = malloc(sizeof(double) * (size_t)T);
    ranked_pos *rk = malloc(sizeof(ranked_pos) * (size_t)T);
    if (!fs || !o || !pr || !is || !is_key || !in_top || !p || !z || !rk) {
        rc = still_fail(err, STILL_E_NOMEM, "dsa explain: out of memory (%d tokens)", T);
        goto out;
    }
    dsa_append(&cc, g, params, io);
    for (int i = 0; i < nk; i++)
        if (keys[i] >= 0 && keys[i] < T) is_key[keys[i]] = 1;
    for (int h = 0; h < H; h++) mass[h] = 0;
    double rsum = 0, ksum = 0;
    int n_sel = 0;
    const double zs = 1.0 / sqrt((double)D);
    for (int i = 0; i < nq; i++) {
        const int t = qs[i], *sel = is + g->cap;
        const int ns = dsa_token(&cc, g, params, io, t, fs, is, is + g->cap, o, pr, NULL);
        for (int h = 0; i < n_mass && h < H; h++)
            for (int j = 0; j < ns; j++)
                if (is_key[sel[j]]) mass[h] += pr[(size_t)h * K + j];
        if (t + 1 <= K) continue;   /* every position attended: nothing to select */
        const int old = t + 1 - DSA_LOCAL;
        for (int s = 0; s < old; s++) p[s] = 0;
        for (int h = 0; h < H; h++) {
            const float *q = io->q + (size_t)t * HD + (size_t)h * D;
            double mx = -INFINITY, l = 0;
            for (int s = 0; s <= t; s++) {
                const float *kr = io->k + (size_t)s * kvd + (size_t)(h / G) * D;
                double a = 0;
                for (int x = 0; x < D; x++) a += (double)q[x] * kr[x];
                z[s] = a * zs, mx = z[s] > mx ? z[s] : mx;
            }
            for (int s = 0; s <= t; s++) z[s] = exp(z[s] - mx), l += z[s];
            for (int s = 0; s < old; s++) p[s] += z[s] / l;
        }
        double tot = 0;
        for (int s = 0; s < old; s++) tot += p[s], rk[s] = (ranked_pos){p[s], s};
        if (!(tot > 0)) continue;
        qsort(rk, (size_t)old, sizeof *rk, by_teacher);
        for (int j = 0; j < m; j++) in_top[rk[j].s] = 1;
        int hit = 0;
        double in = 0;
        for (int j = 0; j < m; j++) hit += in_top[sel[j]], in += p[sel[j]];   /* sel[0 .. m): the older picks */
        for (int j = 0; j < m; j++) in_top[rk[j].s] = 0;
        rsum += (double)hit / m, ksum += in / tot, n_sel++;
    }
    for (int h = 0; h < H; h++) mass[h] = n_mass ? mass[h] / n_mass : NAN;
    *recall = n_sel ? rsum / n_sel : NAN;
    *kept = n_sel ? ksum / n_sel : NAN;
out:
    free(fs), free(o), free(pr), free(is), free(is_key), free(in_top), free(p), free(z), free(rk);
    dsa_free(st);
    return rc;
}

const attn_kind attn_kind_dsa = {
    .name = "dsa", .needs_x = 1, .param_count = dsa_param_count, .param_init = dsa_param_init,
    .state_create = dsa_create, .state_free = dsa_free, .state_truncate = dsa_truncate, .state_bytes = dsa_bytes,
    .state_regions = dsa_regions,
    .forward = dsa_forward, .backward = dsa_backward, .backward_inputs = dsa_backward_inputs,
    .distill = dsa_distill,
};
