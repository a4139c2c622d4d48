/* Unit test of the lolcats kind's backward (src/kinds/lolcats/attn_lolcats.c, stage-1
 * training): the analytic gradient with respect to hq_W, hk_W and w against
 * central finite differences of a float64 token-by-token forward written here
 * from the spec (../shared/spec/attention.md, "lolcats"), which is first
 * checked against the C forward. Loss = Σ wts ⊙ y with random wts, so
 * dL/dy = wts is what backward is given. */
#include "kinds/attn.h"
#include "check.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int H, Hk, D, F, C, L;
    double wscale;   /* scale of the Hedgehog matrices (large: clamped entries) */
} tcase;

static uint64_t rng_state;
static double urand(void) {   /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(rng_state >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static int n_clamped;   /* entries the reference clamped in its last forward */

/* φ(x) = [softmax(xW) ⊕ softmax(-xW)], each entry >= 1e-12; W [D][F]. */
static void ref_hedgehog(const float *x, const double *W, int D, int F, double *out) {
    double *z = out, *nz = out + F, mz = -INFINITY, mn = -INFINITY, sz = 0, sn = 0;
    for (int f = 0; f < F; f++) {
        z[f] = 0;
        for (int d = 0; d < D; d++) z[f] += (double)x[d] * W[(size_t)d * F + f];
        nz[f] = -z[f];
        mz = fmax(mz, z[f]), mn = fmax(mn, nz[f]);
    }
    for (int f = 0; f < F; f++) z[f] = exp(z[f] - mz), sz += z[f], nz[f] = exp(nz[f] - mn), sn += nz[f];
    for (int f = 0; f < F; f++) z[f] /= sz, nz[f] /= sn;
    for (int f = 0; f < 2 * F; f++)
        if (out[f] < 1e-12) out[f] = 1e-12, n_clamped++;
}

/* The spec's formula token by token: Local(t) = chunk c(t) up to t plus chunk
 * c(t) - 1, Hist(t) = chunks <= c(t) - 2. y [L][H*D]; only head hsel's
 * columns if hsel >= 0 (a parameter of head h moves only head h's output). */
static void ref_forward(const tcase *tc, const double *params, const float *q, const float *k, const float *v,
                        double *y, int hsel) {
    const int H = tc->H, Hk = tc->Hk, D = tc->D, F = tc->F, C = tc->C, L = tc->L, G = H / Hk;
    const double *hq = params, *hk = params + (size_t)H * D * F, *wl = params + 2 * (size_t)H * D * F;
    double phq[64], *phk = malloc(sizeof(double) * (size_t)L * 2 * F);   /* φk(k_j) of head h */
    n_clamped = 0;
    for (int h = hsel < 0 ? 0 : hsel; h < (hsel < 0 ? H : hsel + 1); h++) {
        const double gamma = 1.0 / (1.0 + exp(-wl[h]));
        const int kh = h / G;
        for (int j = 0; j < L; j++)
            ref_hedgehog(k + ((size_t)j * Hk + kh) * D, hk + (size_t)h * D * F, D, F, phk + (size_t)j * 2 * F);
        for (int t = 0; t < L; t++) {
            const float *qt = q + ((size_t)t * H + h) * D;
            const int c = t / C, lo = c > 0 ? (c - 1) * C : 0;
            double m = -INFINITY, num[16] = {0}, den = 0, ls = 0;
            for (int j = lo; j <= t; j++) {
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)qt[d] * k[((size_t)j * Hk + kh) * D + d];
                m = fmax(m, s / sqrt((double)D));
            }
            for (int j = lo; j <= t; j++) {
                double s = 0;
                for (int d = 0; d < D; d++) s += (double)qt[d] * k[((size_t)j * Hk + kh) * D + d];
                const double e = exp(s / sqrt((double)D) - m);
                ls += gamma * e;
                for (int d = 0; d < D; d++) num[d] += gamma * e * v[((size_t)j * Hk + kh) * D + d];
            }
            ref_hedgehog(qt, hq + (size_t)h * D * F, D, F, phq);
            for (int j = 0; j < L && j / C <= c - 2; j++) {
                double a = 0;
                for (int f = 0; f < 2 * F; f++) a += phq[f] * phk[(size_t)j * 2 * F + f];
                den += a;
                for (int d = 0; d < D; d++) num[d] += a * v[((size_t)j * Hk + kh) * D + d];
            }
            for (int d = 0; d < D; d++) y[((size_t)t * H + h) * D + d] = num[d] / (ls + den + 1e-6);
        }
    }
    free(phk);
}

/* Σ wts ⊙ y over all heads (hsel < 0) or over head hsel's columns. */
static double ref_loss(const tcase *tc, const double *params, const float *q, const float *k, const float *v,
                       const float *wts, double *y, int hsel) {
    ref_forward(tc, params, q, k, v, y, hsel);
    double s = 0;
    for (size_t i = 0; i < (size_t)tc->L * tc->H * tc->D; i++)
        if (hsel < 0 || (int)(i / tc->D) % tc->H == hsel) s += (double)wts[i] * y[i];
    return s;
}

static void run_case(const tcase *tc, uint64_t seed) {
    const attn_kind *kind = attn_kind_get(ATTN_LOLCATS);
    const int H = tc->H, Hk = tc->Hk, D = tc->D, F = tc->F, L = tc->L;
    attn_config cfg = {.kind = ATTN_LOLCATS, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = H * D,
                       .n_ctx = L, .chunk = tc->C, .feature_dim = F};
    const size_t np = kind->param_count(&cfg), nq = (size_t)L * H * D, nk = (size_t)L * Hk * D;
    const size_t nW = (size_t)H * D * F;
    rng_state = seed;
    float *q = malloc(nq * sizeof *q), *k = malloc(nk * sizeof *k), *v = malloc(nk * sizeof *v);
    float *wts = malloc(nq * sizeof *wts), *out = malloc(nq * sizeof *out), *pf = malloc(np * sizeof *pf);
    float *dp = malloc(np * sizeof *dp), *base = malloc(np * sizeof *base);
    double *pd = malloc(np * sizeof *pd), *y = malloc(nq * sizeof *y), *fd = malloc(np * sizeof *fd);
    for (size_t i = 0; i < nq; i++) q[i] = (float)(1.5 * urand()), wts[i] = (float)urand();
    for (size_t i = 0; i < nk; i++) k[i] = (float)(1.5 * urand()), v[i] = (float)urand();
    kind->param_init(&cfg, pf, seed);
    for (size_t i = 0; i < 2 * nW; i++) pf[i] = (float)(pf[i] * tc->wscale);
    for (int h = 0; h < H; h++) pf[2 * nW + h] = (float)(-1.0 + 1.5 * urand());
    for (size_t i = 0; i < np; i++) pd[i] = pf[i], base[i] = (float)(0.25 * urand()), dp[i] = base[i];
    char name[96];
    snprintf(name, sizeof name, "H=%d Hk=%d D=%d F=%d C=%d L=%d Wx%g", H, Hk, D, F, tc->C, L, tc->wscale);

    /* the float64 reference forward against the C forward */
    attn_state *st = NULL;
    still_err err = {0};
    attn_io io = {.q = q, .k = k, .v = v, .p0 = 0, .T = L};
    CHECK(!kind->state_create(&cfg, &st, &err), "%s: create: %s", name, err.msg);
    if (st) CHECK(!kind->forward(st, pf, &io, out, &err), "%s: forward: %s", name, err.msg);
    kind->state_free(st);
    ref_loss(tc, pd, q, k, v, wts, y, -1);
    double fwd_err = 0;
    for (size_t i = 0; i < nq; i++) fwd_err = fmax(fwd_err, fabs(out[i] - y[i]) / fmax(1.0, fabs(y[i])));
    CHECK(fwd_err <= 1e-5, "%s: C forward vs float64 reference: max error %.3g", name, fwd_err);
    const int clamped = n_clamped;

    /* analytic gradient, accumulated onto base */
    CHECK(!kind->backward(&cfg, pf, &io, wts, dp, &err), "%s: backward: %s", name, err.msg);

    /* central differences in float64, of the loss of the parameter's head */
    for (size_t i = 0; i < np; i++) {
        const double p = pd[i], eps = 1e-6 * fmax(1.0, fabs(p));
        const int h = i < 2 * nW ? (int)(i % nW / ((size_t)D * F)) : (int)(i - 2 * nW);
        pd[i] = p + eps;
        const double lp = ref_loss(tc, pd, q, k, v, wts, y, h);
        pd[i] = p - eps;
        const double lm = ref_loss(tc, pd, q, k, v, wts, y, h);
        pd[i] = p;
        fd[i] = (lp - lm) / (2 * eps);
    }
    /* per group: hq_W, hk_W, w */
    const size_t g0[3] = {0, nW, 2 * nW}, g1[3] = {nW, 2 * nW, np};
    const char *gname[3] = {"hq_W", "hk_W", "w"};
    for (int g = 0; g < 3; g++) {
        double gmax = 0, worst = 0, wa = 0, wf = 0;
        for (size_t i = g0[g]; i < g1[g]; i++) gmax = fmax(gmax, fabs(fd[i]));
        int ok = 1;
        for (size_t i = g0[g]; i < g1[g]; i++) {
            const double a = (double)dp[i] - (double)base[i];
            const double e = fabs(a - fd[i]), tol = 1e-7 + 2e-5 * gmax + 2e-4 * fabs(fd[i]);
            if (e / tol > worst) worst = e / tol, wa = a, wf = fd[i];
            if (!(e <= tol)) ok = 0;
        }
        CHECK(ok, "%s: d%s: worst analytic %.8g vs finite difference %.8g (error / tolerance %.3g)", name, gname[g],
              wa, wf, worst);
        if (getenv("LOLCATS_GRAD_VERBOSE"))
            printf("%-40s d%-5s max|g| %.4g  worst err/tol %.3g  clamped %d\n", name, gname[g], gmax, worst, clamped);
    }
    if (tc->wscale > 10) CHECK(clamped > 0, "%s: the large-W case clamps some feature entries", name);
    if (L > 2 * tc->C) {   /* the history is used: the k side has a non-zero gradient */
        double s = 0;
        for (size_t i = nW; i < 2 * nW; i++) s += fabs(fd[i]);
        CHECK(s > 1e-6, "%s: hk_W gradient non-zero with history", name);
    }
    free(q), free(k), free(v), free(wts), free(out), free(pf), free(dp), free(base), free(pd), free(y), free(fd);
}

/* Accumulation, thread-count independence, argument errors. */
static void run_interface(void) {
    const attn_kind *kind = attn_kind_get(ATTN_LOLCATS);
    const int H = 4, Hk = 2, D = 8, F = 5, C = 3, L = 14;
    attn_config cfg = {.kind = ATTN_LOLCATS, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = H * D,
                       .n_ctx = L, .chunk = C, .feature_dim = F};
    const size_t np = kind->param_count(&cfg), nq = (size_t)L * H * D, nk = (size_t)L * Hk * D;
    rng_state = 77;
    float *q = malloc(nq * sizeof *q), *k = malloc(nk * sizeof *k), *v = malloc(nk * sizeof *v);
    float *wts = malloc(nq * sizeof *wts), *pf = malloc(np * sizeof *pf);
    float *d1 = calloc(np, sizeof *d1), *d2 = calloc(np, sizeof *d2), *d3 = calloc(np, sizeof *d3);
    for (size_t i = 0; i < nq; i++) q[i] = (float)urand(), wts[i] = (float)urand();
    for (size_t i = 0; i < nk; i++) k[i] = (float)urand(), v[i] = (float)urand();
    kind->param_init(&cfg, pf, 5);
    still_err err = {0};
    attn_io io = {.q = q, .k = k, .v = v, .p0 = 0, .T = L};
    CHECK(kind->backward == attn_kind_find("lolcats", NULL)->backward && kind->backward, "backward registered");
    CHECK(!kind->backward(&cfg, pf, &io, wts, d1, &err), "backward: %s", err.msg);
    CHECK(!kind->backward(&cfg, pf, &io, wts, d2, &err), "backward: %s", err.msg);
    CHECK(!kind->backward(&cfg, pf, &io, wts, d2, &err), "backward: %s", err.msg);
    int acc = 1, nz = 0;
    for (size_t i = 0; i < np; i++) acc &= d2[i] == 2 * d1[i], nz += d1[i] != 0;
    CHECK(acc && nz > (int)np / 2, "backward accumulates into dparams (%d of %zu non-zero)", nz, np);
    const int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    CHECK(!kind->backward(&cfg, pf, &io, wts, d3, &err), "backward (1 thread): %s", err.msg);
    omp_set_num_threads(nt);
    CHECK(!memcmp(d1, d3, np * sizeof *d1), "backward independent of the thread count");

    memset(d3, 0, np * sizeof *d3);
    attn_io empty = io;
    empty.T = 0;
    CHECK(!kind->backward(&cfg, pf, &empty, wts, d3, &err), "T = 0: %s", err.msg);
    int zero = 1;
    for (size_t i = 0; i < np; i++) zero &= d3[i] == 0;
    CHECK(zero, "T = 0 leaves dparams alone");
    attn_io late = io;
    late.p0 = 3;
    err.msg[0] = 0;
    CHECK(kind->backward(&cfg, pf, &late, wts, d3, &err) == STILL_E_ARG && err.msg[0], "p0 != 0 refused");
    attn_config bad = cfg;
    bad.chunk = 0;
    CHECK(kind->backward(&bad, pf, &io, wts, d3, &err) == STILL_E_ARG, "chunk 0 refused");
    bad = cfg, bad.n_head_kv = 3;
    CHECK(kind->backward(&bad, pf, &io, wts, d3, &err) == STILL_E_UNSUPPORTED, "H not a multiple of Hk refused");
    free(q), free(k), free(v), free(wts), free(pf), free(d1), free(d2), free(d3);
}

int main(void) {
    static const tcase cases[] = {
        {2, 1, 4, 3, 2, 1, 1}, {2, 1, 4, 3, 2, 4, 1}, {2, 1, 4, 3, 2, 5, 1},   {2, 2, 6, 4, 2, 11, 1},
        {4, 2, 8, 6, 3, 14, 1}, {4, 1, 5, 3, 3, 7, 1}, {4, 2, 8, 5, 4, 17, 1}, {2, 1, 7, 6, 4, 9, 1},
        {4, 4, 4, 4, 2, 8, 1}, {2, 2, 8, 3, 3, 12, 1}, {4, 2, 6, 6, 4, 16, 1}, {2, 1, 8, 6, 3, 10, 25},
        {4, 2, 8, 4, 2, 11, 40}, {4, 2, 4, 5, 3, 13, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], 1000 + i);
    run_interface();
    return CHECK_SUMMARY();
}
