/* Unit test of the dsa kind (src/kinds/dsa/attn_dsa.c) against its float64 reference written from the spec and the
 * rules (tests/ref/attn_dsa_ref.c): one call, token by token and sequences split into calls of many lengths give
 * the reference's outputs, and each other's bit for bit; below topk every position is attended (softmax with a
 * gate); state size, truncation, configuration and input errors; the backward (the gate's parameters, and q, k,
 * v, x) against central differences of the reference. */
#include "kinds/attn.h"
#include "kinds/dsa/attn_dsa.h"
#include "kinds/dsa/attn_dsa_rules.h"
#include "attn_dsa_ref.h"
#include "check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((*s >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

typedef struct {
    attn_config c;
    int T;
    float *q, *k, *v, *x, *params;
} dsa_case;

/* Random inputs; the initialisation plus random head weights and a random gate, so that every part moves. */
static dsa_case make_case(int H, int Hk, int D, int d, int HI, int dI, int topk, int T, uint64_t seed) {
    dsa_case g = {.c = {.kind = ATTN_DSA, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d, .n_ctx = T,
                        .index_heads = HI, .index_dim = dI, .topk = topk},
                  .T = T};
    const attn_kind *k = attn_kind_get(ATTN_DSA);
    const size_t np = k->param_count(&g.c);
    g.q = malloc(sizeof(float) * (size_t)T * H * D), g.k = malloc(sizeof(float) * (size_t)T * Hk * D);
    g.v = malloc(sizeof(float) * (size_t)T * Hk * D), g.x = malloc(sizeof(float) * (size_t)T * d);
    g.params = malloc(sizeof(float) * np);
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)T * H * D; i++) g.q[i] = 2.0f * frand(&s);
    for (size_t i = 0; i < (size_t)T * Hk * D; i++) g.k[i] = 2.0f * frand(&s), g.v[i] = frand(&s);
    for (size_t i = 0; i < (size_t)T * d; i++) g.x[i] = frand(&s);
    k->param_init(&g.c, g.params, seed);
    const float f = 1.0f / sqrtf((float)d);
    for (size_t i = 0; i < (size_t)HI * d; i++) g.params[dsa_par_ww(HI, dI, d) + i] = f * frand(&s);
    for (size_t i = 0; i < (size_t)H * D * d; i++) g.params[dsa_par_wg(HI, dI, d) + i] = 2.0f * f * frand(&s);
    for (size_t i = 0; i < (size_t)H * D; i++) g.params[dsa_par_bg(HI, dI, d, H, D) + i] = frand(&s);
    return g;
}

static void free_case(dsa_case *g) { free(g->q), free(g->k), free(g->v), free(g->x), free(g->params); }

static attn_io io_at(const dsa_case *g, int t, int n) {
    const int H = g->c.n_head, Hk = g->c.n_head_kv, D = g->c.head_dim, d = g->c.d_model;
    return (attn_io){.q = g->q + (size_t)t * H * D, .k = g->k + (size_t)t * Hk * D, .v = g->v + (size_t)t * Hk * D,
                     .x = g->x + (size_t)t * d, .p0 = t, .T = n};
}

/* The kind's outputs for the sequence split into calls of the lengths in splits (cycled); NULL on error. */
static float *run_split(const dsa_case *g, const int *splits, int n_splits, still_err *err) {
    const attn_kind *k = attn_kind_get(ATTN_DSA);
    const size_t HD = (size_t)g->c.n_head * g->c.head_dim;
    float *y = malloc(sizeof(float) * (size_t)g->T * HD);
    attn_state *s = NULL;
    if (!y || k->state_create(&g->c, &s, err)) {
        free(y);
        return NULL;
    }
    for (int t = 0, i = 0; t < g->T; i++) {
        int n = splits[i % n_splits];
        if (n > g->T - t) n = g->T - t;
        const attn_io io = io_at(g, t, n);
        if (k->forward(s, g->params, &io, y + (size_t)t * HD, err)) {
            k->state_free(s);
            free(y);
            return NULL;
        }
        t += n;
    }
    k->state_free(s);
    return y;
}

/* max |y − ref| / max |ref| */
static double rel_err(const float *y, const double *ref, size_t n) {
    double e = 0, m = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)y[i] - ref[i]);
        e = d > e || d != d ? d : e;
        m = fabs(ref[i]) > m ? fabs(ref[i]) : m;
    }
    return m > 0 ? e / m : e;
}

static double *params_d(const dsa_case *g) {
    const size_t np = attn_kind_get(ATTN_DSA)->param_count(&g->c);
    double *pd = malloc(sizeof(double) * np);
    for (size_t i = 0; i < np; i++) pd[i] = g->params[i];
    return pd;
}

static void check_case(const char *name, int H, int Hk, int D, int d, int HI, int dI, int topk, int T, uint64_t seed) {
    dsa_case g = make_case(H, Hk, D, d, HI, dI, topk, T, seed);
    const size_t n = (size_t)T * H * D;
    double *ref = malloc(sizeof(double) * n), *pd = params_d(&g);
    int *sel = malloc(sizeof(int) * (size_t)T * topk);
    const attn_io io = io_at(&g, 0, T);
    attn_dsa_forward_ref(&g.c, pd, &io, ref, sel, NULL);
    int sparse = 0;   /* queries that attended to fewer positions than they had */
    for (int t = 0; t < T; t++) sparse += t + 1 > topk;
    still_err err = {0};
    const int whole[] = {T}, steps[] = {1}, mixed[] = {5, 64, 1, 70, 9, 3, 130, 8, 63, 2};
    const struct { const char *what; const int *s; int n; } runs[] = {
        {"one call", whole, 1}, {"token by token", steps, 1}, {"calls of 5, 64, 1, 70, 9, ...", mixed, 10}};
    float *first = NULL;
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        float *y = run_split(&g, runs[r].s, runs[r].n, &err);
        const double e = y ? rel_err(y, ref, n) : INFINITY;
        printf("%s, %s: %.2e (%d sparse queries)\n", name, runs[r].what, e, sparse);
        CHECK(y && e < 2e-5, "%s, %s: against the float64 reference, max error %.2e of the largest output (< 2e-5)%s%s",
              name, runs[r].what, e, y ? "" : ": ", y ? "" : err.msg);
        if (!first) first = y;
        else {
            CHECK(y && !memcmp(first, y, sizeof(float) * n), "%s, %s: bit for bit the one call's outputs", name,
                  runs[r].what);
            free(y);
        }
    }
    free(first), free(ref), free(pd), free(sel);
    free_case(&g);
}

/* The selection matters: with the indexer's keys of the positions it should pick and those it should drop swapped,
 * the outputs change (a test of the test: a kind that attended to every position would pass the above only when
 * T <= topk). */
static void check_selection_matters(void) {
    dsa_case g = make_case(4, 2, 16, 12, 2, 8, 80, 200, 21);
    const size_t n = (size_t)200 * 4 * 16;
    double *ref = malloc(sizeof(double) * n), *dense = malloc(sizeof(double) * n), *pd = params_d(&g);
    const attn_io io = io_at(&g, 0, 200);
    attn_dsa_forward_ref(&g.c, pd, &io, ref, NULL, NULL);
    attn_config all = g.c;
    all.topk = 200;   /* every position */
    attn_dsa_forward_ref(&all, pd, &io, dense, NULL, NULL);
    still_err err = {0};
    const int whole[] = {200};
    float *y = run_split(&g, whole, 1, &err);
    const double e_sparse = y ? rel_err(y, ref, n) : INFINITY, e_dense = y ? rel_err(y, dense, n) : 0;
    CHECK(e_sparse < 2e-5 && e_dense > 1e-3,
          "top-80 of 200: the kind matches the sparse reference (%.2e) and not the dense one (%.2e)", e_sparse, e_dense);
    free(y), free(ref), free(dense), free(pd);
    free_case(&g);
}

/* Σ dout ⊙ y of the reference, with its parameters pd and the selection sel held fixed. */
static double ref_loss(const dsa_case *g, const double *pd, const float *dout, const int *sel, double *y) {
    const attn_io io = io_at(g, 0, g->T);
    attn_dsa_forward_ref(&g->c, pd, &io, y, NULL, sel);
    double l = 0;
    for (size_t e = 0; e < (size_t)g->T * g->c.n_head * g->c.head_dim; e++) l += (double)dout[e] * y[e];
    return l;
}

/* The backward: the gate's parameters (stage 1) and q, k, v, x (stage 2) against central differences of the
 * reference with the selection held fixed (every 11th parameter of the gate, every 7th input): moving x moves the
 * indexer's scores, and a flipped selection is a jump the gradient does not (and should not) see. The indexer's
 * parameters get no gradient (its input is detached from these losses; it learns by its own). */
static void check_grad(const char *name, int H, int Hk, int D, int d, int topk, int T, uint64_t seed) {
    dsa_case g = make_case(H, Hk, D, d, 2, 8, topk, T, seed);
    const attn_kind *k = attn_kind_get(ATTN_DSA);
    const size_t np = k->param_count(&g.c), n = (size_t)T * H * D, nk = (size_t)T * Hk * D, nx = (size_t)T * d;
    float *dout = malloc(sizeof(float) * n), *dp = calloc(np, sizeof(float)), *dp2 = calloc(np, sizeof(float));
    float *dq = calloc(n, sizeof(float)), *dk = calloc(nk, sizeof(float)), *dv = calloc(nk, sizeof(float));
    float *dx = calloc(nx, sizeof(float));
    double *pd = params_d(&g), *y = malloc(sizeof(double) * n);
    uint64_t s = seed * 7 + 1;
    for (size_t i = 0; i < n; i++) dout[i] = frand(&s);
    const attn_io io = io_at(&g, 0, T);
    int *sel = malloc(sizeof(int) * (size_t)T * topk);   /* the selection, fixed for the differences */
    attn_dsa_forward_ref(&g.c, pd, &io, y, sel, NULL);
    still_err err = {0};
    int rc = k->backward(&g.c, g.params, &io, dout, dp, &err);
    CHECK(!rc, "%s: backward runs%s%s", name, rc ? ": " : "", rc ? err.msg : "");
    const attn_grads gr = {.dq = dq, .dk = dk, .dv = dv, .dx = dx, .dparams = dp2};
    const int rc2 = k->backward_inputs(&g.c, g.params, &io, dout, &gr, &err);
    CHECK(!rc2, "%s: backward_inputs runs%s%s", name, rc2 ? ": " : "", rc2 ? err.msg : "");
    CHECK(!rc && !rc2 && !memcmp(dp, dp2, sizeof(float) * np), "%s: both backwards give the same parameter gradient",
          name);
    const size_t g0 = dsa_par_wg(2, 8, d);
    int indexer_zero = 1;
    for (size_t i = 0; i < g0; i++) indexer_zero &= dp[i] == 0.0f;
    CHECK(indexer_zero, "%s: the indexer's parameters get no gradient from the output's loss", name);
    double num = 0, den = 0, worst = 0;
    for (size_t i = g0; i < np && !rc; i += 11) {
        const double h = 1e-5, p0 = pd[i];
        pd[i] = p0 + h;
        const double lp = ref_loss(&g, pd, dout, sel, y);
        pd[i] = p0 - h;
        const double lm = ref_loss(&g, pd, dout, sel, y);
        pd[i] = p0;
        const double fd = (lp - lm) / (2 * h), e = fabs(fd - dp[i]);
        num += e * e, den += fd * fd;
        worst = e / (fabs(fd) + 1e-3) > worst ? e / (fabs(fd) + 1e-3) : worst;
    }
    double rel = den > 0 ? sqrt(num / den) : INFINITY;
    printf("%s, gate: %.2e over all, worst %.2e\n", name, rel, worst);
    CHECK(rel < 1e-4 && worst < 1e-3, "%s: the gate's gradient against central differences: %.2e (< 1e-4), worst %.2e "
          "(< 1e-3)", name, rel, worst);
    struct { const char *what; float *x; const float *grad; size_t n; } in[] = {
        {"q", g.q, dq, n}, {"k", g.k, dk, nk}, {"v", g.v, dv, nk}, {"x", g.x, dx, nx}};
    for (size_t w = 0; w < 4 && !rc2; w++) {
        num = den = worst = 0;
        for (size_t i = 0; i < in[w].n; i += 7) {
            const float x0 = in[w].x[i];
            in[w].x[i] = x0 + 2e-3f;
            const double hp = (double)in[w].x[i] - x0, lp = ref_loss(&g, pd, dout, sel, y);
            in[w].x[i] = x0 - 2e-3f;
            const double hm = x0 - (double)in[w].x[i], lm = ref_loss(&g, pd, dout, sel, y);
            in[w].x[i] = x0;
            const double fd = (lp - lm) / (hp + hm), e = fabs(fd - in[w].grad[i]);
            num += e * e, den += fd * fd;
            worst = e / (fabs(fd) + 1e-2) > worst ? e / (fabs(fd) + 1e-2) : worst;
        }
        rel = den > 0 ? sqrt(num / den) : INFINITY;
        printf("%s, d%s: %.2e over all, worst %.2e\n", name, in[w].what, rel, worst);
        CHECK(rel < 5e-4 && worst < 5e-3, "%s: d%s against central differences of the float64 reference: %.2e over "
              "all (< 5e-4), worst %.2e (< 5e-3)", name, in[w].what, rel, worst);
    }
    free(dout), free(dp), free(dp2), free(dq), free(dk), free(dv), free(dx), free(pd), free(y), free(sel);
    free_case(&g);
}

/* The indexer's stage-1 loss: its value against the float64 reference, its gradient (every indexer parameter group)
 * against central differences of the reference, and descent: plain gradient steps lower it and raise the share of
 * the teacher's attention mass on the older positions that the top-(topk − local) selection keeps. */
static void check_indexer(void) {
    const int H = 4, Hk = 2, D = 16, d = 12, HI = 2, dI = 8, T = 160, topk = 80;
    dsa_case g = make_case(H, Hk, D, d, HI, dI, topk, T, 41);
    const attn_kind *k = attn_kind_get(ATTN_DSA);
    const size_t np = k->param_count(&g.c);
    const attn_io io = io_at(&g, 0, T);
    float *dp = calloc(np, sizeof(float));
    double *pd = params_d(&g), kl = 0;
    still_err err = {0};
    int rc = attn_dsa_indexer_loss(&g.c, g.params, &io, 1.0f, dp, &kl, &err);
    const double kl_ref = attn_dsa_indexer_kl_ref(&g.c, pd, &io);
    CHECK(!rc && fabs(kl - kl_ref) < 1e-5 * (1 + kl_ref), "indexer loss %.8f against the reference's %.8f%s%s", kl, kl_ref,
          rc ? ": " : "", rc ? err.msg : "");
    double num = 0, den = 0, worst = 0;
    int n_checked = 0;
    for (size_t i = 0; i < dsa_par_wg(HI, dI, d) && !rc; i += 3) {
        const double h = 1e-5, p0 = pd[i];
        pd[i] = p0 + h;
        const double lp = attn_dsa_indexer_kl_ref(&g.c, pd, &io);
        pd[i] = p0 - h;
        const double lm = attn_dsa_indexer_kl_ref(&g.c, pd, &io);
        pd[i] = p0;
        const double fd = (lp - lm) / (2 * h), e = fabs(fd - dp[i]);
        num += e * e, den += fd * fd, n_checked++;
        worst = e / (fabs(fd) + 1e-3) > worst ? e / (fabs(fd) + 1e-3) : worst;
    }
    const double rel = den > 0 ? sqrt(num / den) : INFINITY;
    printf("indexer loss gradient: %d parameters, %.2e over all, worst %.2e\n", n_checked, rel, worst);
    CHECK(rel < 1e-3 && worst < 1e-2, "indexer loss: %d parameters' gradients against central differences of the "
          "float64 reference: %.2e (< 1e-3), worst %.2e (< 1e-2)", n_checked, rel, worst);
    /* descent, and the teacher's mass the selection keeps (over the older positions, mean over queries) */
    double kept0 = 0, kept1 = 0, kl1 = kl;
    for (int step = 0; step <= 60 && !rc; step++) {
        if (step == 0 || step == 60) {
            int *sel = malloc(sizeof(int) * (size_t)T * topk);
            double *y = malloc(sizeof(double) * (size_t)T * H * D), kept = 0;
            for (size_t i = 0; i < np; i++) pd[i] = g.params[i];
            attn_dsa_forward_ref(&g.c, pd, &io, y, sel, NULL);
            int nq = 0;
            for (int t = topk; t < T; t++) {   /* queries where the selection is sparse */
                const int old = t + 1 - DSA_LOCAL;
                double tot = 0, in = 0;
                for (int h = 0; h < H; h++) {
                    double mx = -INFINITY, l = 0, z[160];
                    for (int s = 0; s <= t; s++) {
                        double a = 0;
                        for (int e = 0; e < D; e++) a += (double)g.q[(size_t)t * H * D + h * D + e] * g.k[(size_t)s * Hk * D + (h / (H / Hk)) * D + e];
                        z[s] = a / 4.0, mx = z[s] > mx ? z[s] : mx;
                    }
                    for (int s = 0; s <= t; s++) l += exp(z[s] - mx);
                    for (int s = 0; s < old; s++) tot += exp(z[s] - mx) / l;
                    for (int i = 0; i < topk && sel[(size_t)t * topk + i] >= 0; i++)
                        if (sel[(size_t)t * topk + i] < old) in += exp(z[sel[(size_t)t * topk + i]] - mx) / l;
                }
                kept += in / tot, nq++;
            }
            kept /= nq;
            if (step == 0) kept0 = kept;
            else kept1 = kept;
            free(sel), free(y);
        }
        if (step == 60) break;
        memset(dp, 0, sizeof(float) * np);
        rc = attn_dsa_indexer_loss(&g.c, g.params, &io, 1.0f, dp, &kl1, &err);
        for (size_t i = 0; i < dsa_par_wg(HI, dI, d); i++) g.params[i] -= 0.5f * dp[i];
    }
    printf("indexer descent: KL %.4f -> %.4f, teacher mass kept on the older positions %.3f -> %.3f\n", kl, kl1, kept0,
           kept1);
    CHECK(!rc && kl1 < 0.8 * kl && kept1 > kept0 + 0.005, "60 gradient steps on the indexer's loss: KL %.4f -> %.4f, the "
          "teacher's mass the selection keeps %.3f -> %.3f", kl, kl1, kept0, kept1);
    free(dp), free(pd);
    free_case(&g);
}

/* The probe's diagnosis (attn_dsa_explain) against the same quantities computed here in float64 from the reference's
 * selection: the selection's softmax mass on given keys per head, the indexer's recall of the teacher's best
 * topk − 64 older positions and the teacher's older-position attention the selection keeps. */
static void check_explain(void) {
    const int H = 4, Hk = 2, D = 16, d = 12, HI = 2, dI = 8, T = 200, topk = 80, m = topk - DSA_LOCAL, G = H / Hk;
    dsa_case g = make_case(H, Hk, D, d, HI, dI, topk, T, 51);
    const attn_io io = io_at(&g, 0, T);
    double *pd = params_d(&g), *y = malloc(sizeof(double) * (size_t)T * H * D);
    int *sel = malloc(sizeof(int) * (size_t)T * topk);
    attn_dsa_forward_ref(&g.c, pd, &io, y, sel, NULL);
    const int qs[] = {199, 190, 150, 60, 120, 81}, nq = 6, n_mass = 3, keys[] = {10, 11, 12, 40, 185};
    const int nk = 5;
    double mass_ref[4] = {0}, rsum = 0, ksum = 0;
    int n_sel = 0;
    for (int i = 0; i < nq; i++) {
        const int t = qs[i], old = t + 1 - DSA_LOCAL;
        double p_old[200] = {0};
        for (int h = 0; h < H; h++) {
            double z[200], mx = -INFINITY, l = 0, ls = 0, on = 0;
            for (int s = 0; s <= t; s++) {
                double a = 0;
                for (int e = 0; e < D; e++)
                    a += (double)g.q[(size_t)t * H * D + h * D + e] * g.k[(size_t)s * Hk * D + (h / G) * D + e];
                z[s] = a / 4.0, mx = z[s] > mx ? z[s] : mx;   /* 1 / sqrt(16) */
            }
            for (int s = 0; s <= t; s++) l += exp(z[s] - mx);
            for (int s = 0; s < old; s++) p_old[s] += exp(z[s] - mx) / l;
            for (int j = 0; j < topk && sel[(size_t)t * topk + j] >= 0; j++) {   /* the student: its selection */
                const int s = sel[(size_t)t * topk + j];
                ls += exp(z[s] - mx);
                for (int u = 0; u < nk; u++) on += s == keys[u] ? exp(z[s] - mx) : 0;
            }
            if (i < n_mass) mass_ref[h] += on / ls / n_mass;
        }
        if (t + 1 <= topk) continue;
        /* the teacher's best m older positions: a plain selection sort (ties: the later position) */
        char top[200] = {0};
        double tot = 0, in = 0;
        for (int s = 0; s < old; s++) tot += p_old[s];
        for (int j = 0; j < m; j++) {
            int b = -1;
            for (int s = 0; s < old; s++)
                if (!top[s] && (b < 0 || p_old[s] > p_old[b] || (p_old[s] == p_old[b] && s > b))) b = s;
            top[b] = 1;
        }
        int hit = 0;
        for (int j = 0; j < topk; j++) {
            const int s = sel[(size_t)t * topk + j];
            if (s >= 0 && s < old) hit += top[s], in += p_old[s];
        }
        rsum += (double)hit / m, ksum += in / tot, n_sel++;
    }
    double mass[4], recall = 0, kept = 0, em = 0;
    still_err err = {0};
    const int rc = attn_dsa_explain(&g.c, g.params, &io, qs, nq, n_mass, keys, nk, mass, &recall, &kept, &err);
    for (int h = 0; h < H; h++) em = fmax(em, fabs(mass[h] - mass_ref[h]));
    const double er = fabs(recall - rsum / n_sel), ek = fabs(kept - ksum / n_sel);
    printf("explain: recall %.4f (reference %.4f), kept %.4f (%.4f), needle mass head 0 %.4f (%.4f)\n", recall,
           rsum / n_sel, kept, ksum / n_sel, mass[0], mass_ref[0]);
    CHECK(!rc && em < 1e-5 && er < 1e-9 && ek < 1e-5 && recall > 0 && recall < 1 && mass_ref[0] > 0,
          "probe diagnosis against float64 from the reference's selection: mass %.1e, recall %.1e, kept %.1e%s%s", em,
          er, ek, rc ? ": " : "", rc ? err.msg : "");
    const int bad_q[] = {T};
    CHECK(attn_dsa_explain(&g.c, g.params, &io, bad_q, 1, 1, keys, nk, mass, &recall, &kept, &err) != 0 &&
              strstr(err.msg, "out of range"), "a query past the sequence is refused: %s", err.msg);
    free(pd), free(y), free(sel);
    free_case(&g);
}

int main(void) {
    const attn_kind *k = attn_kind_find("dsa", NULL);
    CHECK(k && k == attn_kind_get(ATTN_DSA) && k->needs_x && !k->needs_nope, "dsa registered, wants x, q and k after RoPE");
    if (!k) return CHECK_SUMMARY();

    /* parameters: W_qI [4·64][576], W_kI [64][576], W_w [4][576], b_w [4], W_g [576][576], b_g [576] */
    attn_config c = {.kind = ATTN_DSA, .n_head = 9, .n_head_kv = 3, .head_dim = 64, .d_model = 576, .n_ctx = 100,
                     .index_heads = 4, .index_dim = 64, .topk = 512};
    CHECK(k->param_count(&c) == (size_t)(4 * 64 + 64 + 4) * 576 + 4 + (size_t)576 * 576 + 576,
          "parameter count of the default model's shape");
    float *p = malloc(sizeof(float) * k->param_count(&c));
    k->param_init(&c, p, 7);
    int init_ok = 1;
    for (int j = 0; j < 4; j++) init_ok &= p[dsa_par_bw(4, 64, 576) + j] == 0.25f;
    for (int r = 0; r < 576; r++) init_ok &= p[dsa_par_bg(4, 64, 576, 9, 64) + r] == DSA_GATE_BIAS0;
    double ss = 0;
    for (size_t i = 0; i < (size_t)5 * 64 * 576; i++) ss += (double)p[i] * p[i];
    const double sd = sqrt(ss / (5.0 * 64 * 576));
    init_ok &= fabs(sd - 1 / sqrt(576.0)) < 0.05 / sqrt(576.0);
    CHECK(init_ok, "initialisation: b_w = 1/H_I, b_g = %.1f, the indexer's projections N(0, 1/d) (sd %.4f)",
          DSA_GATE_BIAS0, sd);
    free(p);
    CHECK(dsa_default_topk(8192) == 512 && dsa_default_topk(100) == 2 * DSA_LOCAL, "topk's default: n_ctx / 16, >= 128");

    /* the forms against the reference */
    check_case("H 4 / Hk 2, D 16, d 12, indexer 2 x 8, top-80, T 300", 4, 2, 16, 12, 2, 8, 80, 300, 11);
    check_case("H 9 / Hk 3, D 64, d 40, indexer 4 x 16, top-100, T 260", 9, 3, 64, 40, 4, 16, 100, 260, 12);
    check_case("H 2 / Hk 1, D 8, d 6, indexer 1 x 4, top-65, T 200", 2, 1, 8, 6, 1, 4, 65, 200, 13);
    check_case("H 4 / Hk 2, D 16, d 12, top-128, T 100 (dense: below topk)", 4, 2, 16, 12, 2, 8, 128, 100, 14);
    check_selection_matters();

    /* state and truncation: back to 150 tokens, then the rest again gives the same outputs */
    {
        dsa_case g = make_case(4, 2, 16, 12, 2, 8, 80, 260, 15);
        still_err err = {0};
        const int whole[] = {260};
        float *y = run_split(&g, whole, 1, &err), *y2 = malloc(sizeof(float) * 260 * 64);
        attn_state *s = NULL;
        int ok = y && y2 && !k->state_create(&g.c, &s, &err);
        CHECK(ok && k->state_bytes(s) == sizeof(float) * (2 * 2 * 260 * 16 + 8 * 260), "state bytes: K, V and the indexer keys");
        attn_io io = io_at(&g, 0, 200);
        ok = ok && !k->forward(s, g.params, &io, y2, &err);
        ok = ok && !k->state_truncate(s, 150, &err);
        io = io_at(&g, 150, 110);
        ok = ok && !k->forward(s, g.params, &io, y2 + 150 * 64, &err);
        CHECK(ok && !memcmp(y, y2, sizeof(float) * 260 * 64), "truncated to 150 tokens and continued: the same outputs%s%s",
              ok ? "" : ": ", ok ? "" : err.msg);
        CHECK(k->state_truncate(s, 300, &err) != 0, "truncation beyond the tokens held is refused");
        io = io_at(&g, 100, 5);
        CHECK(k->forward(s, g.params, &io, y2, &err) != 0 && strstr(err.msg, "position"), "a call at the wrong position: %s",
              err.msg);
        attn_io nox = io_at(&g, 260, 1);
        nox.x = NULL;
        CHECK(k->forward(s, g.params, &nox, y2, &err) != 0, "a call without the layer input is refused: %s", err.msg);
        k->state_free(s);
        attn_config bad = g.c;
        bad.topk = DSA_LOCAL;
        CHECK(k->state_create(&bad, &s, &err) != 0 && strstr(err.msg, "topk"), "topk <= the local window: %s", err.msg);
        bad = g.c, bad.index_heads = 0;
        CHECK(k->state_create(&bad, &s, &err) != 0, "no indexer heads: %s", err.msg);
        free(y), free(y2);
        free_case(&g);
    }

    check_indexer();
    check_explain();

    /* the backward */
    check_grad("grad H 4 / Hk 2, D 16, d 12, top-80, T 150", 4, 2, 16, 12, 80, 150, 31);
    check_grad("grad H 3 / Hk 1, D 8, d 6, top-70 (dense), T 60", 3, 1, 8, 6, 70, 60, 32);
    return CHECK_SUMMARY();
}
