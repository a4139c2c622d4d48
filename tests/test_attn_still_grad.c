/* Unit test of the still kind's backwards (src/kinds/still/attn_still.c): on tiny random
 * configurations, the float64 reference backward (attn_still_backward_ref,
 * tests/ref/attn_still_ref.c: test code, not in the library) of every
 * parameter element of loss = Σ w ⊙ y (so dout = w) is compared with central
 * finite differences of a float64 forward written here from the spec
 * formulas (../shared/spec/attention.md, section still), token by token, with
 * the same selection. That forward is first checked against the engine's
 * float32 forward (to 1e-5), so both differentiate the same function. The
 * fast float32 backward (backward, the one training uses) is then compared
 * with the reference on every case and on the default model's shapes. */
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "attn_still_ref.h"
#include "check.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define EPS_DEN 1e-6
#define EPS_SAL 1e-8
#define CLAMP 1e-12
#define NORM_FLOOR 1e-12

/* ---- random numbers ------------------------------------------------------------ */

static double urand(uint64_t *s) { return 2.0 * attn_rng_uniform(s) - 1.0; }   /* [-1, 1) */

/* ---- the float64 forward from the spec ------------------------------------------ */

typedef struct {
    const attn_config *c;
    int L, H, Hk, D, G, Hs, Fd, P, dm, C;
    const float *q, *k, *v, *x, *w;   /* inputs, dout */
    unsigned char *pick;              /* [Hs][L]: selected into Sel */
    long n_clamped;                   /* feature-map entries at the clamp (last evaluation) */
} ref;

/* λ and Sel capacity (spec: "Routing with a fixed budget"). */
static void ref_lambda(const attn_config *c, int *lam, int *cap) {
    const int C = c->chunk;
    int l;
    if (c->routing == ROUTE_NONE) l = 0;
    else if (c->lambda >= 0) l = c->lambda;
    else if (c->budget > 0) l = (c->budget - 2 * C) / ((c->n_ctx + C - 1) / C);
    else l = C / 16;
    *lam = l > C ? C : l;
    *cap = c->budget > 0 ? c->budget - 2 * C : -1;   /* -1: uncapped */
}

static double dotfd(const float *a, const float *b, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* random routing: as the engine's route_random (a hash of seed, head, position). */
static double route_random(uint64_t seed, int hs, int pos) {
    uint64_t s = seed ^ 0x5851f42d4c957f2dULL;
    s += ((uint64_t)(uint32_t)pos << 24) ^ (uint64_t)(uint32_t)hs;
    attn_rng_next(&s);
    return attn_rng_uniform(&s);
}

/* Routing scores [L][Hs] (per query head, summed over the G heads of a KV
 * head with per_kv_head). Saliency by the explicit formula. */
static void ref_scores(const ref *r, double *sc) {
    const attn_config *c = r->c;
    const int L = r->L, D = r->D, C = r->C, H = r->H, G = r->G;
    const double scale = 1.0 / sqrt((double)D);
    memset(sc, 0, sizeof(double) * (size_t)L * r->Hs);
    for (int h = 0; h < H; h++) {
        const int hk = h / G, hs = c->per_kv_head ? hk : h;
        for (int j = 0; j < L; j++) {
            const float *kj = r->k + ((size_t)j * r->Hk + hk) * D;
            double s = 0;
            if (c->routing == ROUTE_SALIENCY) {
                const float *qj = r->q + ((size_t)j * H + h) * D;
                const int lo = j - C + 1 > 0 ? j - C + 1 : 0, n = j - lo + 1;
                double lg[64], ad[64], an[64], mx = -INFINITY, mxn = -INFINITY, sd = 0, sn = 0;
                for (int l = lo; l <= j; l++) {
                    lg[l - lo] = dotfd(qj, r->k + ((size_t)l * r->Hk + hk) * D, D) * scale;
                    mx = fmax(mx, lg[l - lo]);
                    if (l < j) mxn = fmax(mxn, lg[l - lo]);
                }
                for (int i = 0; i < n; i++) {
                    sd += ad[i] = exp(lg[i] - mx);
                    an[i] = i < n - 1 ? exp(lg[i] - mxn) : 0.0;
                    sn += an[i];
                }
                for (int i = 0; i < n; i++) {
                    ad[i] /= sd;
                    an[i] = sn > 0 ? an[i] / sn : 0.0;
                    s += ad[i] * log((ad[i] + EPS_SAL) / (an[i] + EPS_SAL));
                }
            } else if (c->routing == ROUTE_KEYNORM) {
                s = sqrt(dotfd(kj, kj, D));
            } else if (c->routing == ROUTE_QK) {   /* mean q·k received inside the window */
                for (int i = j; i < j + C && i < L; i++) s += dotfd(r->q + ((size_t)i * H + h) * D, kj, D) * scale;
                s /= C;
            }
            sc[(size_t)j * r->Hs + hs] += s;
        }
    }
}

/* Delayed selection: chunks c with (c + 2) C <= L - 1 leave Local, in order. */
static void ref_select(ref *r) {
    const attn_config *c = r->c;
    const int L = r->L, C = r->C, Hs = r->Hs;
    int lam, cap;
    ref_lambda(c, &lam, &cap);
    double *sc = malloc(sizeof(double) * (size_t)L * Hs);
    ref_scores(r, sc);
    memset(r->pick, 0, (size_t)Hs * L);
    const int n_left = (L - 1) / C - 1;
    for (int hs = 0; hs < Hs; hs++) {
        int used = 0;
        for (int cl = 0; cl < n_left; cl++) {
            int n = lam;
            if (cap >= 0 && n > cap - used) n = cap - used;
            if (n <= 0) continue;
            unsigned char *pk = r->pick + (size_t)hs * L + (size_t)cl * C;
            if (c->routing == ROUTE_POSITION) {
                for (int i = 0; i < n; i++) pk[(2 * i + 1) * C / (2 * n)] = 1;
            } else {
                for (int kk = 0; kk < n; kk++) {   /* higher score first, ties to the lower position */
                    int best = -1;
                    double bs = 0;
                    for (int i = 0; i < C; i++) {
                        if (pk[i]) continue;
                        const int pos = cl * C + i;
                        const double v = c->routing == ROUTE_RANDOM ? route_random(c->seed, hs, pos)
                                                                    : sc[(size_t)pos * Hs + hs];
                        if (best < 0 || v > bs) best = i, bs = v;
                    }
                    pk[best] = 1;
                }
            }
            used += n;
        }
    }
    free(sc);
}

/* φ of one vector with head h's map (side 0: q, 1: k), in double. */
static void ref_fmap(ref *r, const double *pd, int h, int side, const float *x, double *phi) {
    const int D = r->D, H = r->H, Fd = r->Fd;
    double z[256];
    if (r->c->feature_map == FMAP_HEDGEHOG) {
        const double *W = pd + ((size_t)side * H + h) * D * Fd;   /* [D][F], z = x W */
        for (int f = 0; f < Fd; f++) {
            z[f] = 0;
            for (int d = 0; d < D; d++) z[f] += x[d] * W[(size_t)d * Fd + f];
        }
    } else {
        const double *u = pd + ((size_t)side * H + h) * D;
        const double *W = pd + 2 * (size_t)H * D + ((size_t)side * H + h) * D * D;   /* [D][D], z = W x̃ */
        double nu = 0, xu = 0, nx = 0, xt[256], nz = 0;
        for (int i = 0; i < D; i++) nu += u[i] * u[i], nx += (double)x[i] * x[i];
        nu = sqrt(nu), nx = sqrt(nx);
        for (int i = 0; i < D; i++) xu += x[i] * (u[i] / nu);
        for (int i = 0; i < D; i++) xt[i] = x[i] - 2.0 * xu * (u[i] / nu);
        for (int i = 0; i < D; i++) {
            z[i] = 0;
            for (int j = 0; j < D; j++) z[i] += W[(size_t)i * D + j] * xt[j];
            nz += z[i] * z[i];
        }
        nz = sqrt(nz);
        for (int i = 0; i < D; i++) z[i] *= nx / (nz > NORM_FLOOR ? nz : NORM_FLOOR);
    }
    for (int half = 0; half < 2; half++) {
        const double sg = half ? -1 : 1;
        double mx = -INFINITY, s = 0;
        for (int f = 0; f < Fd; f++) mx = fmax(mx, sg * z[f]);
        for (int f = 0; f < Fd; f++) s += phi[half * Fd + f] = exp(sg * z[f] - mx);
        for (int f = 0; f < Fd; f++) {
            double v = phi[half * Fd + f] / s;
            if (v < CLAMP) v = CLAMP, r->n_clamped++;
            phi[half * Fd + f] = v;
        }
    }
}

/* Σ_t w_t·y_t over head h; y (if given) gets head h's outputs. */
static double ref_head(ref *r, const double *pd, int h, double *y) {
    const attn_config *c = r->c;
    const int L = r->L, D = r->D, C = r->C, H = r->H, P = r->P, Hk = r->Hk, dm = r->dm;
    const int hk = h / r->G, hs = c->per_kv_head ? hk : h;
    const unsigned char *pk = r->pick + (size_t)hs * L;
    const double scale = 1.0 / sqrt((double)D);
    double *phq = malloc(sizeof(double) * (size_t)L * P), *phk = malloc(sizeof(double) * (size_t)L * P);
    double *S = malloc(sizeof(double) * (size_t)P * D), zz[512], num[256], g[256];
    if (c->linear)
        for (int t = 0; t < L; t++) {
            ref_fmap(r, pd, h, 0, r->q + ((size_t)t * H + h) * D, phq + (size_t)t * P);
            ref_fmap(r, pd, h, 1, r->k + ((size_t)t * Hk + hk) * D, phk + (size_t)t * P);
        }
    double loss = 0;
    for (int t = 0; t < L; t++) {
        const int ct = t / C;
        const float *qt = r->q + ((size_t)t * H + h) * D;
        /* A(t) = Local(t) ∪ Sel(t) */
        double m = -INFINITY;
        for (int j = 0; j <= t; j++) {
            const int cj = j / C, inA = cj >= ct - 1 || (cj <= ct - 2 && pk[j]);
            if (inA) m = fmax(m, dotfd(qt, r->k + ((size_t)j * Hk + hk) * D, D) * scale);
        }
        double den = EPS_DEN, bz = 0;   /* bz: φq·z (gate_den: scaled per channel by the gate) */
        for (int x = 0; x < D; x++) num[x] = 0;
        for (int j = 0; j <= t; j++) {
            const int cj = j / C, inA = cj >= ct - 1 || (cj <= ct - 2 && pk[j]);
            if (!inA) continue;
            const float *vj = r->v + ((size_t)j * Hk + hk) * D;
            const double e = exp(dotfd(qt, r->k + ((size_t)j * Hk + hk) * D, D) * scale - m);
            den += e;
            for (int x = 0; x < D; x++) num[x] += e * vj[x];
        }
        if (c->linear) {
            /* S_t, z_t: the non-selected tokens of chunks <= c(t) - 2 (the
             * same for every token of a chunk: summed at its first token) */
            if (t % C == 0) {
                memset(S, 0, sizeof(double) * (size_t)P * D);
                memset(zz, 0, sizeof(double) * (size_t)P);
            }
            for (int j = 0; t % C == 0 && j < (ct - 1) * C; j++) {
                if (pk[j]) continue;
                const float *vj = r->v + ((size_t)j * Hk + hk) * D;
                for (int p = 0; p < P; p++) {
                    zz[p] += phk[(size_t)j * P + p];
                    for (int x = 0; x < D; x++) S[(size_t)p * D + x] += phk[(size_t)j * P + p] * vj[x];
                }
            }
            for (int x = 0; x < D; x++) {
                g[x] = 1;
                if (c->gate) {
                    const size_t fp = r->c->feature_map == FMAP_HEDGEHOG ? 2 * (size_t)H * D * r->Fd
                                                                         : 2 * (size_t)H * D * (1 + D);
                    const size_t row = (size_t)h * D + x;
                    const double *Wg = pd + fp, *bg = Wg + (size_t)H * D * dm;
                    double a = bg[row];
                    for (int i = 0; i < dm; i++) a += Wg[row * dm + i] * r->x[(size_t)t * dm + i];
                    g[x] = 1.0 / (1.0 + exp(-a));
                }
                double lin = 0;
                for (int p = 0; p < P; p++) lin += phq[(size_t)t * P + p] * S[(size_t)p * D + x];
                num[x] += g[x] * lin;
            }
            for (int p = 0; p < P; p++) bz += phq[(size_t)t * P + p] * zz[p];
        }
        for (int x = 0; x < D; x++) {
            const double yv = num[x] / (den + (c->gate_den ? g[x] : 1.0) * bz);
            if (y) y[((size_t)t * H + h) * D + x] = yv;
            loss += r->w[((size_t)t * H + h) * D + x] * yv;
        }
    }
    free(phq), free(phk), free(S);
    return loss;
}

/* The query head a parameter element belongs to. */
static int param_head(const ref *r, size_t i) {
    const size_t H = (size_t)r->H, D = (size_t)r->D, Fd = (size_t)r->Fd, dm = (size_t)r->dm;
    size_t fp;
    if (r->c->feature_map == FMAP_HEDGEHOG) {
        fp = 2 * H * D * Fd;
        if (i < fp) return (int)((i / (D * Fd)) % H);
    } else {
        fp = 2 * H * D * (1 + D);
        if (i < 2 * H * D) return (int)((i / D) % H);
        if (i < fp) return (int)(((i - 2 * H * D) / (D * D)) % H);
    }
    i -= fp;
    if (i < H * D * dm) return (int)(i / dm / D);
    return (int)((i - H * D * dm) / D);
}

/* ---- one configuration ----------------------------------------------------------- */

typedef struct {
    const char *name;
    attn_config cfg;
    int L;
    double qscale;   /* q magnitude (large: feature-map entries reach the clamp) */
    double wscale;   /* feature-map matrices scaled (hedgehog: reach the clamp) */
    int want_clamp;
    int want_full;   /* budget mode: some selection head's Sel is full */
} tcase;

/* The fast backward's gradient (accumulated onto a non-zero start, as the
 * trainer does) against the reference gradient ref: the largest error
 * relative to max|ref|, or 1e30 on failure. */
static double compare_fast(const attn_kind *k, const attn_config *c, const float *params, const attn_io *io,
                           const float *w, const float *ref, size_t np) {
    float *g = malloc(sizeof(float) * (np ? np : 1));
    still_err err = {0};
    for (size_t i = 0; i < np; i++) g[i] = ref[i];   /* accumulates onto the start */
    int rc = k->backward(c, params, io, w, g, &err);
    double gmax = 0, e = 0;
    for (size_t i = 0; i < np; i++) gmax = fmax(gmax, fabs(ref[i]));
    for (size_t i = 0; i < np; i++) e = fmax(e, fabs(((double)g[i] - ref[i]) - ref[i]));
    free(g);
    if (rc) {
        printf("  fast backward: %s\n", err.msg);
        return 1e30;
    }
    return gmax > 0 ? e / gmax : e;
}

static void run_case(const tcase *tc, uint64_t seed) {
    const attn_kind *k = attn_kind_get(ATTN_STILL);
    attn_config c = tc->cfg;
    c.kind = ATTN_STILL;
    if (c.n_ctx <= 0) c.n_ctx = tc->L;
    const int L = tc->L, H = c.n_head, Hk = c.n_head_kv, D = c.head_dim, dm = c.d_model;
    const int qd = H * D, kvd = Hk * D;
    const size_t np = k->param_count(&c);
    uint64_t s = seed;
    float *q = malloc(sizeof(float) * (size_t)L * qd), *kk = malloc(sizeof(float) * (size_t)L * kvd),
          *v = malloc(sizeof(float) * (size_t)L * kvd), *x = malloc(sizeof(float) * (size_t)L * (dm > 0 ? dm : 1)),
          *w = malloc(sizeof(float) * (size_t)L * qd), *yc = malloc(sizeof(float) * (size_t)L * qd),
          *params = malloc(sizeof(float) * (np ? np : 1)), *grad = calloc(np ? np : 1, sizeof(float)),
          *grad2 = calloc(np ? np : 1, sizeof(float));
    double *pd = malloc(sizeof(double) * (np ? np : 1)), *yr = malloc(sizeof(double) * (size_t)L * qd);
    for (int i = 0; i < L * qd; i++) q[i] = (float)(tc->qscale * urand(&s)), w[i] = (float)urand(&s);
    for (int i = 0; i < L * kvd; i++) kk[i] = (float)(1.5 * urand(&s)), v[i] = (float)urand(&s);
    for (int i = 0; i < L * dm; i++) x[i] = (float)urand(&s);
    k->param_init(&c, params, seed ^ 77);
    const size_t fp = c.feature_map == FMAP_HEDGEHOG ? 2 * (size_t)H * D * c.feature_dim : 2 * (size_t)H * D * (1 + D);
    for (size_t i = 0; i < fp; i++) {
        const int is_u = c.feature_map == FMAP_NPMAP && i < 2 * (size_t)H * D;
        params[i] = is_u ? params[i] : (float)(tc->wscale * params[i]);
    }
    for (size_t i = fp; i < np; i++) params[i] = (float)(0.5 * urand(&s)) + (i >= fp + (size_t)qd * dm ? 1.0f : 0.0f);
    for (size_t i = 0; i < np; i++) pd[i] = params[i];

    /* the engine's forward */
    attn_state *st = NULL;
    still_err err = {0};
    attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = L};
    int rc = k->state_create(&c, &st, &err);
    if (!rc) rc = k->forward(st, params, &io, yc, &err);
    k->state_free(st);
    CHECK(!rc, "%s: forward: %s", tc->name, err.msg);

    /* the float64 forward with the same selection */
    ref r = {.c = &c, .L = L, .H = H, .Hk = Hk, .D = D, .G = H / Hk, .Hs = c.per_kv_head ? Hk : H,
             .Fd = c.feature_map == FMAP_HEDGEHOG ? c.feature_dim : D, .dm = c.gate ? dm : 0, .C = c.chunk,
             .q = q, .k = kk, .v = v, .x = x, .w = w};
    r.P = 2 * r.Fd;
    r.pick = malloc((size_t)r.Hs * L);
    ref_select(&r);
    r.n_clamped = 0;
    double loss = 0;
    for (int h = 0; h < H; h++) loss += ref_head(&r, pd, h, yr);
    const long n_clamped = r.n_clamped;
    double ferr = 0;
    for (int i = 0; i < L * qd; i++) ferr = fmax(ferr, fabs(yr[i] - yc[i]) / fmax(1.0, fabs(yr[i])));
    CHECK(ferr < 1e-5, "%s: float64 forward vs engine forward: max error %.3g", tc->name, ferr);

    int n_sel = 0, full = 0, lam, cap;
    ref_lambda(&c, &lam, &cap);
    for (int hs = 0; hs < r.Hs; hs++) {
        int nh = 0;
        for (int j = 0; j < L; j++) nh += r.pick[(size_t)hs * L + j];
        n_sel += nh;
        full |= cap >= 0 && nh == cap;
    }
    if (tc->want_full) CHECK(full, "%s: some Sel should be full (cap %d)", tc->name, cap);
    if (tc->want_clamp) CHECK(n_clamped > 0, "%s: no feature-map entry reached the clamp", tc->name);

    /* the analytic gradient: dout = w; called twice to check it accumulates */
    rc = attn_still_backward_ref(&c, params, &io, w, grad, &err);
    CHECK(!rc, "%s: backward_ref: %s", tc->name, err.msg);
    memcpy(grad2, grad, sizeof(float) * np);
    rc = attn_still_backward_ref(&c, params, &io, w, grad2, &err);
    int acc = !rc;
    for (size_t i = 0; i < np && acc; i++) acc = grad2[i] == 2.0f * grad[i];
    CHECK(acc, "%s: backward_ref accumulates into dparams", tc->name);

    /* the fast float32 backward against the reference */
    const double ferr_fast = compare_fast(k, &c, params, &io, w, grad, np);
    CHECK(ferr_fast < 1e-4, "%s: fast backward vs reference: max error %.3g (relative to max|g|)", tc->name, ferr_fast);

    /* central finite differences of the float64 forward, per parameter element */
    double worst = 0, gmax = 0;
    size_t n_bad = 0, n_nonzero = 0, worst_i = 0;
    for (size_t i = 0; i < np; i++) gmax = fmax(gmax, fabs(grad[i]));
    const double atol = 1e-7 + 1e-6 * gmax;
    for (size_t i = 0; i < np; i++) {
        const int h = param_head(&r, i);
        const double p0 = pd[i], hstep = 1e-6 * fmax(1.0, fabs(p0));
        pd[i] = p0 + hstep;
        const double lp = ref_head(&r, pd, h, NULL);
        pd[i] = p0 - hstep;
        const double lm = ref_head(&r, pd, h, NULL);
        pd[i] = p0;
        const double fd = (lp - lm) / (2 * hstep), a = grad[i];
        const double e = fabs(a - fd), tol = 1e-4 * fmax(fabs(a), fabs(fd)) + atol;
        if (e > tol) {
            if (n_bad < 5) printf("  %s: param %zu (head %d): analytic %.9g, finite difference %.9g\n", tc->name, i, h, a, fd);
            n_bad++;
        }
        if (e / tol > worst) worst = e / tol, worst_i = i;
        n_nonzero += a != 0;
    }
    CHECK(n_bad == 0, "%s: %zu of %zu gradient elements differ from finite differences", tc->name, n_bad, np);
    if (c.linear) CHECK(n_nonzero > np / 2, "%s: only %zu of %zu gradient elements nonzero", tc->name, n_nonzero, np);
    else CHECK(n_nonzero == 0, "%s: linear off, yet %zu gradient elements nonzero", tc->name, n_nonzero);
    printf("%-22s L=%2d H=%d Hk=%d D=%d C=%d lambda=%d cap=%d selected=%d%s clamped=%ld params=%zu "
           "fwd err %.2g, worst |err|/tol %.3f (param %zu), max|g| %.3g, loss %.4g, fast vs ref %.2g\n",
           tc->name, L, H, Hk, D, c.chunk, lam, cap, n_sel, full ? " (full)" : "", n_clamped, np, ferr, worst, worst_i,
           gmax, loss, ferr_fast);

    free(q), free(kk), free(v), free(x), free(w), free(yc), free(params), free(grad), free(grad2), free(pd), free(yr);
    free(r.pick);
}

static attn_config base(int H, int Hk, int D, int d, int C, int budget, int lambda, attn_routing rt) {
    return (attn_config){.kind = ATTN_STILL, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d, .chunk = C,
                         .feature_dim = 5, .budget = budget, .lambda = lambda, .routing = rt, .linear = 1,
                         .feature_map = FMAP_NPMAP, .gate = 1, .seed = 11};
}

int main(void) {
    const attn_kind *k = attn_kind_get(ATTN_STILL);
    CHECK(k && k->backward, "still has a backward");
    if (!k || !k->backward) return CHECK_SUMMARY();

    tcase cases[32];
    int n = 0;
    cases[n++] = (tcase){"saliency", base(4, 2, 8, 6, 4, 11, 2, ROUTE_SALIENCY), 17, 1.5, 1, 0, 1};
    cases[n++] = (tcase){"saliency C=2", base(2, 1, 6, 7, 2, 6, 1, ROUTE_SALIENCY), 11, 1.5, 1, 0, 1};
    cases[n++] = (tcase){"keynorm", base(2, 1, 5, 7, 3, 9, 2, ROUTE_KEYNORM), 14, 1.5, 1, 0, 1};
    cases[n] = (tcase){"linear off", base(2, 1, 4, 6, 2, 6, 1, ROUTE_SALIENCY), 11, 1.5, 1, 0, 1};
    cases[n++].cfg.linear = 0;
    cases[n] = (tcase){"gate off", base(4, 2, 6, 6, 3, 10, 2, ROUTE_SALIENCY), 14, 1.5, 1, 0, 1};
    cases[n++].cfg.gate = 0;
    cases[n] = (tcase){"hedgehog", base(2, 2, 6, 8, 4, 12, 2, ROUTE_SALIENCY), 21, 1.5, 1, 0, 1};
    cases[n++].cfg.feature_map = FMAP_HEDGEHOG;
    cases[n] = (tcase){"per_kv_head", base(4, 2, 7, 6, 3, 9, 2, ROUTE_SALIENCY), 14, 1.5, 1, 0, 1};
    cases[n++].cfg.per_kv_head = 1;
    cases[n] = (tcase){"per_kv_head keynorm", base(4, 1, 4, 6, 4, 10, 1, ROUTE_KEYNORM), 17, 1.5, 1, 0, 1};
    cases[n++].cfg.per_kv_head = 1;
    cases[n++] = (tcase){"reference (budget 0)", base(2, 1, 8, 6, 4, 0, 2, ROUTE_SALIENCY), 17, 1.5, 1, 0, 0};
    cases[n] = (tcase){"reference per_kv_head", base(4, 2, 5, 6, 3, 0, 1, ROUTE_SALIENCY), 14, 1.5, 1, 0, 0};
    cases[n++].cfg.per_kv_head = 1;
    cases[n] = (tcase){"derived lambda, qk", base(2, 1, 4, 6, 3, 16, -1, ROUTE_QK), 14, 1.5, 1, 0, 0};
    cases[n++].cfg.n_ctx = 14;
    cases[n++] = (tcase){"random", base(2, 1, 6, 6, 4, 11, 2, ROUTE_RANDOM), 21, 1.5, 1, 0, 1};
    cases[n] = (tcase){"position, hedgehog", base(4, 2, 4, 6, 3, 10, 2, ROUTE_POSITION), 14, 1.5, 1, 0, 1};
    cases[n++].cfg.feature_map = FMAP_HEDGEHOG;
    cases[n++] = (tcase){"none", base(2, 1, 6, 6, 4, 11, 2, ROUTE_NONE), 17, 1.5, 1, 0, 0};
    cases[n++] = (tcase){"npmap clamp", base(2, 1, 8, 6, 4, 11, 2, ROUTE_KEYNORM), 17, 30.0, 1, 1, 1};
    cases[n] = (tcase){"hedgehog clamp", base(2, 1, 6, 6, 4, 11, 2, ROUTE_SALIENCY), 17, 1.5, 30, 1, 1};
    cases[n++].cfg.feature_map = FMAP_HEDGEHOG;
    cases[n] = (tcase){"gate in the denominator", base(4, 2, 6, 6, 3, 10, 2, ROUTE_SALIENCY), 14, 1.5, 1, 0, 1};
    cases[n++].cfg.gate_den = 1;
    cases[n] = (tcase){"gate in the denominator, per_kv_head, hedgehog", base(4, 2, 5, 6, 3, 9, 2, ROUTE_KEYNORM), 14, 1.5, 1, 0, 1};
    cases[n].cfg.per_kv_head = 1, cases[n].cfg.feature_map = FMAP_HEDGEHOG;
    cases[n++].cfg.gate_den = 1;
    cases[n] = (tcase){"no gate, hedgehog, L<3C", base(2, 2, 4, 6, 4, 10, 1, ROUTE_SALIENCY), 9, 1.5, 1, 0, 0};
    cases[n].cfg.feature_map = FMAP_HEDGEHOG;
    cases[n++].cfg.gate = 0;
    /* One thread for the many small calls (cheap under a loaded machine);
     * the thread count does not change the gradient, checked below. */
    const int n_thr = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int i = 0; i < n; i++) run_case(&cases[i], 1000 + 17 * (uint64_t)i);
    omp_set_num_threads(n_thr);

    /* the fast backward on the default model's shapes (H 9, Hk 3, D 64, d 576,
     * C 64), long enough for Sel to fill and a partial last chunk */
    for (int variant = 0; variant < 4; variant++) {
        attn_config c = base(9, 3, 64, 576, 64, 256, 6, ROUTE_SALIENCY);
        const int L = variant == 2 ? 200 : 611, qd = 9 * 64, kvd = 3 * 64;
        c.n_ctx = L;
        if (variant == 1) c.feature_map = FMAP_HEDGEHOG, c.feature_dim = 64, c.per_kv_head = 1, c.budget = 0;
        if (variant == 2) c.gate = 0, c.chunk = 16;
        if (variant == 3) c.gate_den = 1;
        const size_t np = k->param_count(&c);
        float *p = malloc(sizeof(float) * np), *gr = calloc(np, sizeof(float));
        float *q = malloc(sizeof(float) * L * qd), *kk = malloc(sizeof(float) * L * kvd),
              *v = malloc(sizeof(float) * L * kvd), *x = malloc(sizeof(float) * L * 576),
              *w = malloc(sizeof(float) * L * qd);
        uint64_t s = 5 + variant;
        k->param_init(&c, p, 3 + variant);
        for (int i = 0; i < L * qd; i++) q[i] = (float)(3 * urand(&s)), w[i] = (float)(1e-3 * urand(&s));
        for (int i = 0; i < L * kvd; i++) kk[i] = (float)(3 * urand(&s)), v[i] = (float)urand(&s);
        for (int i = 0; i < L * 576; i++) x[i] = (float)urand(&s);
        if (c.gate)
            for (size_t i = np - 9 * 64 - (size_t)9 * 64 * 576; i < np - 9 * 64; i++) p[i] = (float)(0.05 * urand(&s));
        attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = L};
        still_err err = {0};
        int rc = attn_still_backward_ref(&c, p, &io, w, gr, &err);
        CHECK(!rc, "model shapes %d: backward_ref: %s", variant, err.msg);
        const double e = compare_fast(k, &c, p, &io, w, gr, np);
        CHECK(e < 1e-4, "model shapes %d: fast backward vs reference: max error %.3g (relative to max|g|)", variant, e);
        printf("model shapes %d (L=%d, %s%s%s%s): fast vs reference %.2g\n", variant, L,
               c.feature_map == FMAP_HEDGEHOG ? "hedgehog" : "npmap", c.per_kv_head ? ", per_kv_head" : "",
               c.gate ? "" : ", no gate", c.gate_den ? ", gate in the denominator" : "", e);
        free(p), free(gr), free(q), free(kk), free(v), free(x), free(w);
    }

    /* the fused distillation step (attn_distill: forward, MSE against a
     * target, gradient) equals forward + attn_mse_grad + backward */
    {
        attn_config c = base(4, 2, 8, 6, 4, 12, 2, ROUTE_SALIENCY);
        const int L = 3 * 4 + 7, qd = 4 * 8, kvd = 2 * 8;
        c.n_ctx = L;
        const size_t np = k->param_count(&c);
        float *p = malloc(sizeof(float) * np), *g1 = calloc(np, sizeof(float)), *g2 = calloc(np, sizeof(float));
        float *q = malloc(sizeof(float) * L * qd), *kk = malloc(sizeof(float) * L * kvd), *v = malloc(sizeof(float) * L * kvd),
              *x = malloc(sizeof(float) * L * 6), *tg = malloc(sizeof(float) * L * qd), *y = malloc(sizeof(float) * L * qd);
        uint64_t s = 123;
        k->param_init(&c, p, 9);
        for (int i = 0; i < L * qd; i++) q[i] = (float)(1.5 * urand(&s)), tg[i] = (float)(0.3 * urand(&s));
        for (int i = 0; i < L * kvd; i++) kk[i] = (float)(1.5 * urand(&s)), v[i] = (float)urand(&s);
        for (int i = 0; i < L * 6; i++) x[i] = (float)urand(&s);
        attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = L};
        still_err err = {0};
        double mse1 = -1, mse0 = -1;
        int rc = attn_distill(k, &c, p, &io, tg, 7.0f, g1, &mse1, &err);
        attn_state *st = NULL;
        rc |= k->state_create(&c, &st, &err);
        if (st) rc |= k->forward(st, p, &io, y, &err), k->state_free(st);
        double mse2 = attn_mse_grad(y, tg, (size_t)L * qd, 7.0f, y);
        rc |= k->backward(&c, p, &io, y, g2, &err);
        rc |= attn_distill(k, &c, p, &io, tg, 7.0f, NULL, &mse0, &err);
        CHECK(!rc && mse1 == mse2 && mse0 == mse1 && mse1 > 0 && !memcmp(g1, g2, sizeof(float) * np),
              "fused distill = forward + MSE + backward (mse %.6g vs %.6g)", mse1, mse2);
        free(p), free(g1), free(g2), free(q), free(kk), free(v), free(x), free(tg), free(y);
    }

    /* threads: each head owns its slices of dparams, so 1 and 4 threads give the same bits */
    {
        attn_config c = base(4, 2, 8, 6, 4, 12, 2, ROUTE_SALIENCY);
        const int L = 3 * 4 + 5, qd = 4 * 8, kvd = 2 * 8;
        c.n_ctx = L;
        const size_t np = k->param_count(&c);
        float *p = malloc(sizeof(float) * np), *g1 = calloc(np, sizeof(float)), *g4 = calloc(np, sizeof(float));
        float *q = malloc(sizeof(float) * L * qd), *kk = malloc(sizeof(float) * L * kvd),
              *v = malloc(sizeof(float) * L * kvd), *x = malloc(sizeof(float) * L * 6), *w = malloc(sizeof(float) * L * qd);
        uint64_t s = 99;
        k->param_init(&c, p, 3);
        for (size_t i = 2 * 4 * 8 * 9; i < np; i++) p[i] += (float)(0.5 * urand(&s));
        for (int i = 0; i < L * qd; i++) q[i] = (float)(1.5 * urand(&s)), w[i] = (float)urand(&s);
        for (int i = 0; i < L * kvd; i++) kk[i] = (float)(1.5 * urand(&s)), v[i] = (float)urand(&s);
        for (int i = 0; i < L * 6; i++) x[i] = (float)urand(&s);
        attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = L};
        still_err err = {0};
        for (int fast = 0; fast < 2; fast++) {
            int (*bwd)(const attn_config *, const float *, const attn_io *, const float *, float *, still_err *) =
                fast ? k->backward : attn_still_backward_ref;
            memset(g1, 0, sizeof(float) * np), memset(g4, 0, sizeof(float) * np);
            omp_set_num_threads(1);
            int rc = bwd(&c, p, &io, w, g1, &err);
            omp_set_num_threads(4);
            rc |= bwd(&c, p, &io, w, g4, &err);
            omp_set_num_threads(n_thr);
            CHECK(!rc && !memcmp(g1, g4, sizeof(float) * np), "%s: 1 and 4 threads give the same gradient",
                  fast ? "backward" : "backward_ref");
        }
        free(p), free(g1), free(g4), free(q), free(kk), free(v), free(x), free(w);
    }

    /* arguments */
    {
        attn_config c = base(2, 1, 4, 6, 2, 6, 1, ROUTE_SALIENCY);
        c.n_ctx = 8;
        const size_t np = k->param_count(&c);
        float *p = calloc(np, sizeof(float)), *g = calloc(np, sizeof(float)), buf[8 * 8] = {0};
        k->param_init(&c, p, 1);
        still_err err = {0};
        attn_io io = {.q = buf, .k = buf, .v = buf, .x = buf, .p0 = 1, .T = 2};
        CHECK(k->backward(&c, p, &io, buf, g, &err) == STILL_E_ARG && !strchr(err.msg, '\n'), "p0 != 0 refused");
        io.p0 = 0, io.T = 9;
        CHECK(k->backward(&c, p, &io, buf, g, &err) != STILL_OK, "T > n_ctx refused");
        io.T = 2, io.x = NULL;
        CHECK(k->backward(&c, p, &io, buf, g, &err) == STILL_E_ARG, "gate without x refused");
        io.T = 0;
        CHECK(k->backward(&c, p, &io, buf, g, &err) == STILL_OK, "T = 0 is a no-op");
        free(p), free(g);
    }
    return CHECK_SUMMARY();
}
