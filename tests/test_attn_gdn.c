/* Unit test of the gdn kind (src/kinds/gdn/attn_gdn.c) against its float64 reference written from the spec
 * (tests/ref/attn_gdn_ref.c): one call (the chunked form), token by token (the recurrent form) and sequences split
 * into calls of many lengths (both forms, chunk boundaries anywhere) give the reference's outputs; state size,
 * truncation, configuration and input errors. */
#include "kinds/attn.h"
#include "kinds/gdn/attn_gdn_rules.h"
#include "attn_gdn_ref.h"
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
} gdn_case;

/* Random inputs and parameters: the initialisation plus random projections, so that β, α and the gate change
 * from token to token. strong: larger projections (β near 0 or 1, fast decays). */
static gdn_case make_case(int H, int Hk, int D, int d, int T, uint64_t seed, float scale, int conv, int norm) {
    gdn_case g = {.c = {.kind = ATTN_GDN, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d, .n_ctx = T,
                        .conv = conv, .norm = norm},
                  .T = T};
    const attn_kind *k = attn_kind_get(ATTN_GDN);
    const size_t np = k->param_count(&g.c);
    g.q = malloc(sizeof(float) * (size_t)T * H * D), g.k = malloc(sizeof(float) * (size_t)T * Hk * D);
    g.v = malloc(sizeof(float) * (size_t)T * Hk * D), g.x = malloc(sizeof(float) * (size_t)T * d);
    g.params = malloc(sizeof(float) * np);
    uint64_t s = seed;
    for (size_t i = 0; i < (size_t)T * H * D; i++) g.q[i] = frand(&s);
    for (size_t i = 0; i < (size_t)T * Hk * D; i++) g.k[i] = frand(&s), g.v[i] = frand(&s);
    for (size_t i = 0; i < (size_t)T * d; i++) g.x[i] = frand(&s);
    k->param_init(&g.c, g.params, 0);
    const float f = scale / sqrtf((float)d);
    for (size_t i = 0; i < (size_t)Hk * d; i++) {
        g.params[gdn_par_wbeta(Hk, d) + i] = 2.0f * f * frand(&s);
        g.params[gdn_par_walpha(Hk, d) + i] = f * frand(&s);
    }
    for (int x = 0; x < D; x++) g.params[gdn_par_wnorm(Hk, d) + x] += 0.3f * frand(&s);
    for (size_t i = 0; i < (size_t)H * D * d; i++) g.params[gdn_par_wg(Hk, d, D) + i] = f * frand(&s);
    for (size_t i = 0; conv > 0 && i < (size_t)conv * (H + 2 * Hk) * D; i++)   /* the identity, then every tap moved */
        g.params[gdn_par_conv(H, Hk, d, D) + i] += 0.4f * frand(&s);
    return g;
}

static void free_case(gdn_case *g) { free(g->q), free(g->k), free(g->v), free(g->x), free(g->params); }

/* The kind's outputs for the sequence split into calls of the lengths in splits (cycled); NULL on error. */
static float *run_split(const gdn_case *g, const int *splits, int n_splits, still_err *err) {
    const attn_kind *k = attn_kind_get(ATTN_GDN);
    const int H = g->c.n_head, Hk = g->c.n_head_kv, D = g->c.head_dim, d = g->c.d_model;
    float *y = malloc(sizeof(float) * (size_t)g->T * H * D);
    attn_state *s = NULL;
    if (!y || k->state_create(&g->c, &s, err)) {
        free(y);
        return NULL;
    }
    for (int t = 0, i = 0; t < g->T; i++) {
        int n = splits[i % n_splits];
        if (n > g->T - t) n = g->T - t;
        const attn_io io = {.q = g->q + (size_t)t * H * D, .k = g->k + (size_t)t * Hk * D, .v = g->v + (size_t)t * Hk * D,
                            .q_nope = g->q + (size_t)t * H * D, .k_nope = g->k + (size_t)t * Hk * D,
                            .x = g->x + (size_t)t * d, .p0 = t, .T = n};
        if (k->forward(s, g->params, &io, y + (size_t)t * H * D, err)) {
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

static void check_case(const char *name, int H, int Hk, int D, int d, int T, uint64_t seed, float scale, int conv,
                       int norm) {
    gdn_case g = make_case(H, Hk, D, d, T, seed, scale, conv, norm);
    const size_t n = (size_t)T * H * D;
    double *ref = malloc(sizeof(double) * n);
    const attn_io io = {.q = g.q, .k = g.k, .v = g.v, .q_nope = g.q, .k_nope = g.k, .x = g.x, .p0 = 0, .T = T};
    const size_t np = attn_kind_get(ATTN_GDN)->param_count(&g.c);
    double *pd = malloc(sizeof(double) * np);
    for (size_t i = 0; i < np; i++) pd[i] = g.params[i];
    attn_gdn_forward_ref(&g.c, pd, &io, ref);
    free(pd);
    still_err err = {0};
    const int whole[] = {T}, steps[] = {1}, mixed[] = {5, 64, 1, 70, 9, 3, 130, 8, 63, 2};
    const struct { const char *what; const int *s; int n; } runs[] = {
        {"one call (chunked)", whole, 1}, {"token by token (recurrent)", steps, 1}, {"calls of 5, 64, 1, 70, 9, ...", mixed, 10}};
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        float *y = run_split(&g, runs[r].s, runs[r].n, &err);
        const double e = y ? rel_err(y, ref, n) : INFINITY;
        printf("%s, %s: %.2e\n", name, runs[r].what, e);
        CHECK(y && e < 1e-5, "%s, %s: against the float64 reference, max error %.2e of the largest output (< 1e-5)%s%s",
              name, runs[r].what, e, y ? "" : ": ", y ? "" : err.msg);
        free(y);
    }
    free(ref);
    free_case(&g);
}

/* Stage 1's backward: dparams of L = Σ dout ⊙ y against central finite differences of the float64 reference
 * (every scalar parameter and a sample of every matrix's entries). */
static void check_grad(const char *name, int H, int Hk, int D, int d, int T, uint64_t seed, float scale, int conv,
                       int norm) {
    gdn_case g = make_case(H, Hk, D, d, T, seed, scale, conv, norm);
    const attn_kind *k = attn_kind_get(ATTN_GDN);
    const size_t np = k->param_count(&g.c), n = (size_t)T * H * D;
    float *dout = malloc(sizeof(float) * n), *dp = calloc(np, sizeof(float));
    double *pd = malloc(sizeof(double) * np), *y = malloc(sizeof(double) * n);
    uint64_t s = seed * 7 + 1;
    for (size_t i = 0; i < n; i++) dout[i] = frand(&s);
    for (size_t i = 0; i < np; i++) pd[i] = g.params[i];
    const attn_io io = {.q = g.q, .k = g.k, .v = g.v, .q_nope = g.q, .k_nope = g.k, .x = g.x, .p0 = 0, .T = T};
    still_err err = {0};
    const int rc = k->backward(&g.c, g.params, &io, dout, dp, &err);
    CHECK(!rc, "%s: backward runs%s%s", name, rc ? ": " : "", rc ? err.msg : "");

    /* which parameters: the scalars of every KV head, then every 97th entry of the matrices */
    const size_t scal[] = {gdn_par_bbeta(Hk, d), gdn_par_balpha(Hk, d), gdn_par_alog(Hk, d)};
    double num = 0, den = 0, worst = 0;
    size_t n_checked = 0, worst_i = 0;
    for (size_t i = 0; i < np && !rc; i++) {
        int take = i % 97 == 0 || (i >= gdn_par_wnorm(Hk, d) && i < gdn_par_wg(Hk, d, D) && i % 5 == 0) ||
                   (i >= gdn_par_conv(H, Hk, d, D) && i % 3 == 0);   /* (the convolution's taps, when it has one) */
        for (int j = 0; j < 3; j++) take |= i >= scal[j] && i < scal[j] + (size_t)Hk;
        if (!take) continue;
        const double h = 1e-5 * (fabs(pd[i]) > 1 ? fabs(pd[i]) : 1), p0 = pd[i];
        double lp = 0, lm = 0;
        pd[i] = p0 + h;
        attn_gdn_forward_ref(&g.c, pd, &io, y);
        for (size_t e = 0; e < n; e++) lp += (double)dout[e] * y[e];
        pd[i] = p0 - h;
        attn_gdn_forward_ref(&g.c, pd, &io, y);
        for (size_t e = 0; e < n; e++) lm += (double)dout[e] * y[e];
        pd[i] = p0;
        const double fd = (lp - lm) / (2 * h), e = fabs(fd - dp[i]);
        num += e * e, den += fd * fd, n_checked++;
        const double rel = e / (fabs(fd) + 1e-3);
        if (rel > worst) worst = rel, worst_i = i;
    }
    const double rel = den > 0 ? sqrt(num / den) : INFINITY;
    printf("%s: %zu gradients, %.2e over all, worst %.2e\n", name, n_checked, rel, worst);
    CHECK(!rc && rel < 1e-4 && worst < 1e-3,
          "%s: %zu parameters' gradients against central differences of the float64 reference: %.2e over all "
          "(< 1e-4), worst %.2e at %zu (< 1e-3)", name, n_checked, rel, worst, worst_i);
    free(dout), free(dp), free(pd), free(y);
    free_case(&g);
}

/* Stage 2's backward: the gradients of q and k before RoPE, v and x against central differences of the float64
 * reference (every 7th entry of each input, steps of 2e-3 taken as the float inputs represent them: steps of 1e-2
 * were the checks' own limit, up to 2.5e-2 off where a query meets a key nearly at right angles). */
static void check_grad_inputs(const char *name, int H, int Hk, int D, int d, int T, uint64_t seed, float scale, int conv,
                       int norm) {
    gdn_case g = make_case(H, Hk, D, d, T, seed, scale, conv, norm);
    const attn_kind *k = attn_kind_get(ATTN_GDN);
    const size_t np = k->param_count(&g.c), n = (size_t)T * H * D;
    const size_t nq = (size_t)T * H * D, nk = (size_t)T * Hk * D, nx = (size_t)T * d;
    float *dout = malloc(sizeof(float) * n), *dq = calloc(nq, sizeof(float)), *dk = calloc(nk, sizeof(float));
    float *dv = calloc(nk, sizeof(float)), *dx = calloc(nx, sizeof(float)), *dqr = calloc(nq, sizeof(float));
    double *pd = malloc(sizeof(double) * np), *y = malloc(sizeof(double) * n);
    uint64_t s = seed * 5 + 3;
    for (size_t i = 0; i < n; i++) dout[i] = frand(&s);
    for (size_t i = 0; i < np; i++) pd[i] = g.params[i];
    const attn_io io = {.q = g.q, .k = g.k, .v = g.v, .q_nope = g.q, .k_nope = g.k, .x = g.x, .p0 = 0, .T = T};
    const attn_grads gr = {.dq = dqr, .dq_nope = dq, .dk_nope = dk, .dv = dv, .dx = dx};
    still_err err = {0};
    const int rc = k->backward_inputs(&g.c, g.params, &io, dout, &gr, &err);
    CHECK(!rc, "%s: backward_inputs runs%s%s", name, rc ? ": " : "", rc ? err.msg : "");
    int rope_zero = 1;
    for (size_t i = 0; i < nq; i++) rope_zero &= dqr[i] == 0.0f;
    CHECK(rope_zero, "%s: q after RoPE gets no gradient (gdn reads q before RoPE)", name);
    struct { const char *what; float *x; const float *grad; size_t n; } in[] = {
        {"q", g.q, dq, nq}, {"k", g.k, dk, nk}, {"v", g.v, dv, nk}, {"x", g.x, dx, nx}};
    for (size_t w = 0; w < 4 && !rc; w++) {
        double num = 0, den = 0, worst = 0;
        for (size_t i = 0; i < in[w].n; i += 7) {
            const float x0 = in[w].x[i];
            double lp = 0, lm = 0;
            in[w].x[i] = x0 + 2e-3f;
            const double hp = (double)in[w].x[i] - x0;
            attn_gdn_forward_ref(&g.c, pd, &io, y);
            for (size_t e = 0; e < n; e++) lp += (double)dout[e] * y[e];
            in[w].x[i] = x0 - 2e-3f;
            const double hm = x0 - (double)in[w].x[i];
            attn_gdn_forward_ref(&g.c, pd, &io, y);
            for (size_t e = 0; e < n; e++) lm += (double)dout[e] * y[e];
            in[w].x[i] = x0;
            const double fd = (lp - lm) / (hp + hm), e = fabs(fd - in[w].grad[i]);
            num += e * e, den += fd * fd;
            const double rel = e / (fabs(fd) + 1e-2);
            worst = rel > worst ? rel : worst;
        }
        const double rel = den > 0 ? sqrt(num / den) : INFINITY;
        printf("%s, d%s: %.2e over all, worst %.2e\n", name, in[w].what, rel, worst);
        CHECK(rel < 5e-4 && worst < 5e-3, "%s: d%s against central differences of the float64 reference: %.2e over all "
              "(< 5e-4), worst %.2e (< 5e-3)", name, in[w].what, rel, worst);
    }
    free(dout), free(dq), free(dk), free(dv), free(dx), free(dqr), free(pd), free(y);
    free_case(&g);
}

int main(void) {
    const attn_kind *k = attn_kind_find("gdn", NULL);
    CHECK(k && k == attn_kind_get(ATTN_GDN) && k->needs_x && k->needs_nope, "gdn registered, wants x and q, k before RoPE");
    if (!k) return CHECK_SUMMARY();

    /* parameters: w_β, b_β, w_α, b_α, a_log per KV head, w_n [D], W_g [HD][d], b_g [HD] */
    attn_config c = {.kind = ATTN_GDN, .n_head = 9, .n_head_kv = 3, .head_dim = 64, .d_model = 576, .n_ctx = 100};
    CHECK(k->param_count(&c) == (size_t)2 * 3 * 576 + 3 * 3 + 64 + (size_t)9 * 64 * 576 + 9 * 64,
          "parameter count of the default model's shape");
    float *p = malloc(sizeof(float) * k->param_count(&c));
    k->param_init(&c, p, 7);
    int init_ok = 1;
    double prev_decay = 0;
    for (int hk = 0; hk < 3; hk++) {
        const double a = exp(p[gdn_par_alog(3, 576) + hk]), b = p[gdn_par_balpha(3, 576) + hk];
        const double decay = a * log1p(exp(b));   /* −log α with x = 0 */
        init_ok &= decay > 0.005 && decay < 0.2 && (hk == 0 || decay < prev_decay);
        prev_decay = decay;
    }
    for (int i = 0; i < 64; i++) init_ok &= p[gdn_par_wnorm(3, 576) + i] == 1.0f;
    CHECK(init_ok, "initialisation: one decay per KV head, fast to slow (-log a between 0.005 and 0.2), norm weight 1");
    free(p);

    /* the forms against the reference */
    check_case("H 4 / Hk 2, D 16, d 12, T 200", 4, 2, 16, 12, 200, 11, 1.0f, 0, 1);
    check_case("H 4 / Hk 2, D 16, d 12, T 200, strong gates", 4, 2, 16, 12, 200, 12, 6.0f, 0, 1);
    check_case("H 9 / Hk 3, D 64, d 40, T 150", 9, 3, 64, 40, 150, 13, 1.0f, 0, 1);
    check_case("H 2 / Hk 2, D 8, d 5, T 7 (below one chunk)", 2, 2, 8, 5, 7, 14, 1.0f, 0, 1);

    /* stage 1's backward */
    check_grad("grad H 4 / Hk 2, D 16, d 12, T 150", 4, 2, 16, 12, 150, 31, 1.0f, 0, 1);
    check_grad("grad H 4 / Hk 2, D 8, d 6, T 70, strong gates", 4, 2, 8, 6, 70, 32, 6.0f, 0, 1);
    check_grad("grad H 3 / Hk 1, D 64, d 10, T 65", 3, 1, 64, 10, 65, 33, 1.0f, 0, 1);

    /* the short convolution (width 4: the original's; width 3 and a chunk boundary inside its reach) */
    check_case("conv 4, H 4 / Hk 2, D 16, d 12, T 200", 4, 2, 16, 12, 200, 15, 1.0f, 4, 1);
    check_case("conv 3, H 9 / Hk 3, D 64, d 40, T 150", 9, 3, 64, 40, 150, 16, 1.0f, 3, 1);
    check_grad("grad conv 4, H 4 / Hk 2, D 16, d 12, T 90", 4, 2, 16, 12, 90, 34, 1.0f, 4, 1);
    check_grad_inputs("inputs conv 4, H 4 / Hk 2, D 16, d 12, T 90", 4, 2, 16, 12, 90, 43, 1.0f, 4, 1);

    /* without the output norm (norm = 0, a plan's default) */
    check_case("no norm, H 9 / Hk 3, D 64, d 40, T 150", 9, 3, 64, 40, 150, 17, 1.0f, 0, 0);
    check_case("no norm, conv 4, H 4 / Hk 2, D 16, d 12, T 200, strong gates", 4, 2, 16, 12, 200, 18, 6.0f, 4, 0);
    check_grad("grad no norm, H 4 / Hk 2, D 16, d 12, T 150", 4, 2, 16, 12, 150, 35, 1.0f, 0, 0);
    check_grad_inputs("inputs no norm, H 4 / Hk 2, D 16, d 12, T 90", 4, 2, 16, 12, 90, 44, 1.0f, 0, 0);

    /* stage 2's backward through the inputs */
    check_grad_inputs("inputs H 4 / Hk 2, D 16, d 12, T 90", 4, 2, 16, 12, 90, 41, 1.0f, 0, 1);
    check_grad_inputs("inputs H 4 / Hk 2, D 8, d 6, T 70, strong gates", 4, 2, 8, 6, 70, 42, 6.0f, 0, 1);

    /* state, truncation, errors */
    gdn_case g = make_case(4, 2, 16, 12, 40, 21, 1.0f, 0, 1);
    still_err err = {0};
    attn_state *s = NULL;
    CHECK(!k->state_create(&g.c, &s, &err) && k->state_bytes(s) == (size_t)2 * 16 * 16 * sizeof(float),
          "state: one D x D matrix per KV head");
    float *y1 = malloc(sizeof(float) * 40 * 64), *y2 = malloc(sizeof(float) * 40 * 64);
    attn_io io = {.q = g.q, .k = g.k, .v = g.v, .q_nope = g.q, .k_nope = g.k, .x = g.x, .p0 = 0, .T = 40};
    int rc = k->forward(s, g.params, &io, y1, &err);
    CHECK(!rc && s->n_seen == 40, "forward of 40 tokens");
    CHECK(k->state_truncate(s, 20, &err) == STILL_E_ARG && err.msg[0] && !strchr(err.msg, '\n'),
          "truncating into the folded history is refused");
    CHECK(!k->state_truncate(s, 0, &err) && s->n_seen == 0 && !k->forward(s, g.params, &io, y2, &err) &&
              !memcmp(y1, y2, sizeof(float) * 40 * 64),
          "truncated to 0, the same input gives the same bits");
    io.p0 = 3;
    CHECK(k->forward(s, g.params, &io, y2, &err) == STILL_E_STATE, "a call that does not continue the state");
    io.p0 = 40, io.q_nope = NULL;
    CHECK(k->forward(s, g.params, &io, y2, &err) == STILL_E_ARG, "q before RoPE missing");
    io.q_nope = g.q, io.x = NULL;
    CHECK(k->forward(s, g.params, &io, y2, &err) == STILL_E_ARG, "x missing");
    k->state_free(s);
    attn_config bad = g.c;
    bad.n_head_kv = 3;
    s = (attn_state *)1;
    CHECK(k->state_create(&bad, &s, &err) == STILL_E_UNSUPPORTED && s == NULL, "H not a multiple of Hk");
    bad = g.c, bad.d_model = 0;
    CHECK(k->state_create(&bad, &s, &err) == STILL_E_ARG, "no d_model");
    free(y1), free(y2);
    free_case(&g);
    return CHECK_SUMMARY();
}
