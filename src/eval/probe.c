/* still probe (see still.h, "diagnosis"): one prompt through the model twice,
 * with its plan and with softmax everywhere, the layer observer collecting
 * each layer's attention to given keys from given queries. */
#include "kinds/dsa/attn_dsa.h"
#include "kinds/still/attn_still.h"
#include "common/common.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const still_model *m;
    still_probe_result *r;
    const int *keys, *queries;
    int teacher;
    int rc;
    still_err err;
} probe_ctx;

/* Softmax attention mass on the keys, mean over the queries, per head. */
static void softmax_mass(const model_config *c, const float *q, const float *k, int T, const int *keys, int nk,
                         const int *qs, int nq, double *out) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk;
    double *lg = malloc(sizeof(double) * (size_t)T);
    if (!lg) return;
    for (int h = 0; h < H; h++) {
        double acc = 0;
        for (int i = 0; i < nq; i++) {
            const int t = qs[i];
            const float *qt = q + ((size_t)t * H + h) * D;
            double mx = -INFINITY, s = 0, on = 0;
            for (int j = 0; j <= t; j++) {
                const float *kj = k + ((size_t)j * Hk + h / G) * D;
                double d = 0;
                for (int x = 0; x < D; x++) d += (double)qt[x] * kj[x];
                lg[j] = d / sqrt((double)D);
                mx = lg[j] > mx ? lg[j] : mx;
            }
            for (int j = 0; j <= t; j++) s += exp(lg[j] - mx);
            for (int i2 = 0; i2 < nk; i2++)
                if (keys[i2] <= t) on += exp(lg[keys[i2]] - mx);
            acc += on / s;
        }
        out[h] = acc / nq;
    }
    free(lg);
}

static void observe(void *data, int layer, int p0, int T, const float *x, const float *q, const float *k,
                    const float *v, const float *outp) {
    probe_ctx *pc = data;
    (void)outp;
    if (pc->rc || p0 != 0) return;
    still_probe_result *r = pc->r;
    const model_config *c = &pc->m->cfg;
    const size_t at = (size_t)layer * r->n_head;
    if (pc->teacher) {
        softmax_mass(c, q, k, T, pc->keys, r->n_keys, pc->queries, r->n_queries, r->teacher + at);
        return;
    }
    const attn_config *ac = &pc->m->attn_cfg[layer];
    if (ac->kind == ATTN_DSA) {   /* its selection's softmax mass on the keys; the indexer against the teacher */
        attn_config cfg = *ac;
        cfg.n_ctx = T;
        attn_io io = {.q = q, .k = k, .v = v, .x = x, .p0 = 0, .T = T};
        pc->rc = attn_dsa_explain(&cfg, pc->m->attn_params[layer], &io, pc->queries, r->n_queries + r->n_ordinary,
                                  r->n_queries, pc->keys, r->n_keys, r->soft + at, r->recall + layer,
                                  r->kept + layer, &pc->err);
        return;
    }
    if (ac->kind != ATTN_STILL) {   /* another kind: its softmax mass where it is softmax, else nothing */
        if (ac->kind == ATTN_SOFTMAX)
            softmax_mass(c, q, k, T, pc->keys, r->n_keys, pc->queries, r->n_queries, r->soft + at);
        return;
    }
    attn_config cfg = *ac;
    cfg.n_ctx = T;
    attn_io io = {.q = q, .k = k, .v = v, .x = x, .p0 = 0, .T = T};
    still_explain e;
    pc->rc = attn_still_explain(&cfg, pc->m->attn_params[layer], &io, pc->queries, r->n_queries + r->n_ordinary,
                                pc->keys, r->n_keys, &e, &pc->err);
    if (pc->rc) return;
    const int nq = r->n_queries, nall = nq + r->n_ordinary;
    for (int h = 0; h < r->n_head; h++) {
        double s[8] = {0};
        for (int i = 0; i < nall; i++) {
            const size_t w = (size_t)h * nall + i;
            if (i >= nq) {   /* the ordinary queries */
                s[6] += e.w_fold[w], s[7] += e.w_exact[w];
                continue;
            }
            s[0] += e.w_soft[w], s[1] += e.w_lin[w], s[2] += e.w_local[w], s[3] += e.w_sel[w], s[4] += e.w_fold[w];
            s[5] += e.w_exact[w];
        }
        r->soft[at + h] = s[0] / nq, r->lin[at + h] = s[1] / nq;
        r->local[at + h] = s[2] / nq, r->sel[at + h] = s[3] / nq;
        r->fold[at + h] = s[4] / nq, r->exact[at + h] = s[5] / nq;
        if (r->n_ordinary) r->ord_fold[at + h] = s[6] / r->n_ordinary, r->ord_exact[at + h] = s[7] / r->n_ordinary;
    }
    for (int hs = 0; hs < e.Hs && hs < r->n_sel_head; hs++)
        for (int i = 0; i < r->n_keys; i++) {
            const size_t o = ((size_t)layer * r->n_sel_head + hs) * r->n_keys + i;
            r->route[o] = e.route[(size_t)hs * r->n_keys + i];
            r->rank[o] = e.rank[(size_t)hs * r->n_keys + i];
        }
    still_explain_free(&e);
}

void still_probe_result_free(still_probe_result *r) {
    if (!r) return;
    free(r->recall), free(r->kept);
    free(r->teacher), free(r->soft), free(r->lin), free(r->local), free(r->sel), free(r->fold);
    free(r->exact), free(r->ord_fold), free(r->ord_exact);
    free(r->route), free(r->rank);
    memset(r, 0, sizeof *r);
}

int still_probe(still_model *m, const int32_t *tokens, int n, const int *keys, int n_keys, const int *queries,
                int n_queries, int n_ordinary, still_probe_result *r, still_err *err) {
    memset(r, 0, sizeof *r);
    const model_config *c = &m->cfg;
    if (n < 2 || n_keys < 1 || n_queries < 1) return still_fail(err, STILL_E_ARG, "still probe: a prompt, keys and queries are required");
    for (int i = 0; i < n_keys; i++)
        if (keys[i] < 0 || keys[i] >= n) return still_fail(err, STILL_E_ARG, "still probe: key position %d out of range", keys[i]);
    for (int i = 0; i < n_queries; i++)
        if (queries[i] < 0 || queries[i] >= n)
            return still_fail(err, STILL_E_ARG, "still probe: query position %d out of range", queries[i]);
    if (n_ordinary < 0 || n_ordinary > 4096) return still_fail(err, STILL_E_ARG, "still probe: ordinary queries: 0..4096");
    const int L = c->n_layer, H = c->n_head;
    int Hs = c->n_head;
    for (int l = 0; l < L; l++)
        if (m->attn_cfg[l].kind == ATTN_STILL && m->attn_cfg[l].per_kv_head) Hs = c->n_head_kv;
    /* the ordinary queries: evenly spaced from the third chunk (the first that reads a linear state) to a
     * chunk before the first query */
    const int C = m->attn_cfg[0].chunk > 0 ? m->attn_cfg[0].chunk : 64, lo = 2 * C, hi = queries[0] - C;
    if (n_ordinary > 0 && hi - lo < n_ordinary)
        return still_fail(err, STILL_E_ARG, "still probe: the prompt is too short for %d ordinary queries", n_ordinary);
    r->n_layer = L, r->n_head = H, r->n_sel_head = Hs, r->n_keys = n_keys, r->n_queries = n_queries;
    r->n_ordinary = n_ordinary;
    const size_t nl = (size_t)L * H, nr = (size_t)L * Hs * n_keys;
    double **fields[] = {&r->teacher, &r->soft, &r->lin, &r->local, &r->sel, &r->fold, &r->exact, &r->ord_fold,
                         &r->ord_exact};
    int ok = 1;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        *fields[i] = malloc(sizeof(double) * nl);
        ok &= !!*fields[i];
        for (size_t j = 0; *fields[i] && j < nl; j++) (*fields[i])[j] = NAN;
    }
    r->recall = malloc(sizeof(double) * (size_t)L), r->kept = malloc(sizeof(double) * (size_t)L);
    ok &= r->recall && r->kept;
    for (int l = 0; ok && l < L; l++) r->recall[l] = r->kept[l] = NAN;
    r->route = malloc(nr ? nr : 1), r->rank = calloc(nr ? nr : 1, sizeof(int));
    int *qall = malloc(sizeof(int) * (size_t)(n_queries + n_ordinary));
    if (!ok || !r->route || !r->rank || !qall) {
        free(qall);
        still_probe_result_free(r);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    memset(r->route, -1, nr);
    memcpy(qall, queries, sizeof(int) * (size_t)n_queries);
    for (int i = 0; i < n_ordinary; i++) qall[n_queries + i] = lo + (int)((long long)(hi - lo) * i / n_ordinary);
    probe_ctx pc = {.m = m, .r = r, .keys = keys, .queries = qall};
    int rc = STILL_OK;
    attn_config *plan = m->attn_cfg, *soft = calloc((size_t)L, sizeof *soft);
    if (!soft) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; soft && l < L; l++) soft[l] = plan[l], soft[l].kind = ATTN_SOFTMAX;
    for (int pass = 0; pass < 2 && !rc; pass++) {
        pc.teacher = pass == 1;
        if (pc.teacher) m->attn_cfg = soft;
        still_context *ctx = NULL;
        rc = still_context_create(m, (still_context_params){.n_ctx = n, .n_batch = n}, &ctx, err);
        if (!rc) {
            still_context_set_observer(ctx, observe, &pc);
            rc = still_decode(ctx, tokens, n, NULL, 0, err);
            if (!rc && pc.rc) rc = pc.rc, *err = pc.err;
        }
        still_context_free(ctx);
        m->attn_cfg = plan;
    }
    free(soft), free(qall);
    if (rc) still_probe_result_free(r);
    return rc;
}
