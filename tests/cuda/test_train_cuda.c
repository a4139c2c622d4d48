/* Stage-1 training on the GPU against the CPU trainer (run on a machine with
 * a CUDA device; not a CTest test):
 *
 *   test_train_cuda [MODEL.gguf DATA.txt]
 *
 * Part 1, always: one layer's loss and parameter gradient from
 * stc_still_distill against src/kinds/still/attn_still.c's still_distill (the CPU's
 * fast backward, itself checked against a float64 reference and finite
 * differences by tests/test_attn_still_grad.c; for lolcats, src/kinds/lolcats/attn_lolcats.c's
 * backward, checked by tests/test_attn_lolcats_grad.c) on fresh random inputs, for
 * several shapes (gate on and off, the gate on the denominator too
 * (gate_den), per-query-head and per-KV-head selection, sequences shorter
 * and longer than the Sel budget's chunks, a length that is not a multiple
 * of C; lolcats at three chunk sizes). The layer input x and the gate
 * matrix are rounded to bf16 on both sides, so that the GPU's bf16 gate GEMM
 * is exact and the comparison sees the backward itself; Sel is IEEE half on
 * both. The GPU adds into a gradient buffer pre-filled with random values:
 * result minus that start must match the CPU gradient for every parameter
 * group (relative error of the group's vector < 2e-3), and elements with no
 * gradient (the gate's, with the gate off) must come back unchanged.
 *
 * gdn's stc_gdn_distill against the CPU kind's stage-1 step likewise (gdn_grad_check), with and without the
 * short convolution (whose weights then train too).
 *
 * Part 2, with MODEL and DATA, for every layer still, then every layer
 * lolcats, then every layer gdn, then the 3 : 1 gdn plan with the
 * convolution: still_train on the CPU and on the GPU with
 * the same seed, data and settings (3 steps of 2 sequences of 512 tokens),
 * the GPU twice: launch by launch (STILL_CUDA_GRAPHS=0) and with its training
 * sequences replayed as a CUDA graph, which must agree to 1e-2 (float
 * atomics differ in order; measured 1.9e-7); and once more with one
 * sequence per teacher pass (STILL_CUDA_TRAIN_ROWS=512; by default a step's
 * two sequences go through the teacher side by side);
 * the per-layer validation MSEs and every layer's parameter update (trained
 * minus initial) must agree: ‖Δ_gpu - Δ_cpu‖ / ‖Δ_cpu‖ < 5e-2 over all
 * layers (bf16 tolerance: the GPU's q, k, v come from bf16 GEMMs). Then two
 * trained layers of 30 with four side streams asked for and passes that do
 * not divide the step (train_few_layers). Ends with
 * `N passed, N failed`. */
#include "kinds/attn.h"
#include "kinds/gdn/attn_gdn_rules.h"
#include "model/model.h"
#include "model/model_cuda.h"
#include "still.h"
#include "still_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int n_pass, n_fail;

static void check(int ok, const char *what, const char *detail) {
    printf("%s  %s%s%s\n", ok ? "PASS" : "FAIL", what, detail ? ": " : "", detail ? detail : "");
    fflush(stdout);
    ok ? n_pass++ : n_fail++;
}

static uint64_t rng_state = 0x1234567;
static double urand(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static float nrand(void) {
    const double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}
static float bf16_round(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    b += 0x7FFF + ((b >> 16) & 1);
    b &= 0xFFFF0000u;
    memcpy(&x, &b, 4);
    return x;
}

#define CK(call)                                                                          \
    do {                                                                                  \
        still_err e_ = {0};                                                               \
        int rc_ = (call);                                                                 \
        if (rc_) {                                                                        \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, e_.msg); \
            exit(2);                                                                      \
        }                                                                                 \
    } while (0)
#define CKE(call)                                                                           \
    do {                                                                                    \
        int rc_ = (call);                                                                   \
        if (rc_) {                                                                          \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, err.msg); \
            exit(2);                                                                        \
        }                                                                                   \
    } while (0)

static void *dev_upload(stc_ctx *ctx, const void *host, size_t bytes) {
    void *d = NULL;
    still_err err = {0};
    CKE(stc_malloc(ctx, bytes, "test buffer", &d, &err));
    CKE(stc_memcpy_h2d(ctx, d, host, bytes, &err));
    return d;
}

/* Relative error of b against a over [lo, hi). */
static double rel_err(const float *a, const float *b, size_t lo, size_t hi) {
    double num = 0, den = 0;
    for (size_t i = lo; i < hi; i++) num += ((double)b[i] - a[i]) * ((double)b[i] - a[i]), den += (double)a[i] * a[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

typedef struct {
    const char *name;
    int T, C, budget, lambda, per_kv, gate;
    attn_routing routing;
    int gate_den;   /* the gate on the denominator's linear term too */
    int lolcats;    /* the lolcats kind (Hedgehog maps, F = D, the window factor w; no selection, no gate) */
} grad_case;

static void grad_check(stc_ctx *ctx, const grad_case *gc) {
    const int H = 9, Hk = 3, D = 64, d = 576;
    attn_config cfg = {
        .kind = ATTN_STILL, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d, .n_ctx = gc->T,
        .chunk = gc->C, .budget = gc->budget, .lambda = gc->lambda, .per_kv_head = gc->per_kv,
        .routing = gc->routing, .linear = 1, .feature_map = FMAP_NPMAP, .gate = gc->gate, .gate_den = gc->gate_den,
        .sel_type = SEL_F16,
    };
    if (gc->lolcats)
        cfg = (attn_config){.kind = ATTN_LOLCATS, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d,
                            .n_ctx = gc->T, .chunk = gc->C, .feature_dim = D, .feature_map = FMAP_HEDGEHOG,
                            .linear = 1, .routing = ROUTE_NONE};
    const attn_kind *k = attn_kind_get(cfg.kind);
    const size_t np = k->param_count(&cfg);
    const int T = gc->T;
    const size_t nq = (size_t)T * H * D, nk = (size_t)T * Hk * D, nx = (size_t)T * d;
    float *params = malloc(np * sizeof(float)), *q = malloc(nq * 4), *kk = malloc(nk * 4), *v = malloc(nk * 4);
    float *x = malloc(nx * 4), *target = malloc(nq * 4), *g_cpu = calloc(np, 4), *g0 = malloc(np * 4),
          *g_gpu = malloc(np * 4);
    uint16_t *xb = malloc(nx * 2);
    k->param_init(&cfg, params, 7);
    const size_t HD = (size_t)H * D, at_wg = gc->lolcats ? np : 2 * HD + 2 * HD * D;
    if (gc->lolcats)   /* window factors γ = σ(w) spread around 0.5 instead of all at the initial 0.1 */
        for (size_t h = 0; h < (size_t)H; h++) params[2 * HD * D + h] = 1.5f * nrand();
    if (gc->gate) {   /* a gate that is not at its initial 0 / +2, in bf16 */
        for (size_t i = 0; i < HD * d; i++) params[at_wg + i] = bf16_round(0.05f * nrand());
        for (size_t i = 0; i < HD; i++) params[at_wg + HD * d + i] = 0.5f * nrand();
    }
    /* q, k, v in IEEE half (exact on the GPU's tensor-core path) */
    for (size_t i = 0; i < nq; i++) q[i] = (float)(_Float16)(1.5f * nrand()), target[i] = 0.3f * nrand();
    for (size_t i = 0; i < nk; i++) kk[i] = (float)(_Float16)(1.5f * nrand()), v[i] = (float)(_Float16)nrand();
    for (size_t i = 0; i < nx; i++) {
        x[i] = bf16_round(nrand());
        uint32_t b;
        memcpy(&b, &x[i], 4);
        xb[i] = (uint16_t)(b >> 16);
    }
    for (size_t i = 0; i < np; i++) g0[i] = 0.0f;   /* the gradient buffer starts at zero (accumulation: below) */
    const float scale = 3.0f;

    /* CPU */
    still_err err = {0};
    attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = T};
    double mse_cpu = 0;
    CKE(attn_distill(k, &cfg, params, &io, target, scale, g_cpu, &mse_cpu, &err));

    /* GPU */
    stc_still_config sc;
    gpu_still_config(&cfg, T, &sc);
    stc_still *st = NULL;
    CKE(stc_still_create(ctx, &sc, &st, &err));
    float *d_params = dev_upload(ctx, params, np * 4), *d_q = dev_upload(ctx, q, nq * 4);
    float *d_k = dev_upload(ctx, kk, nk * 4), *d_v = dev_upload(ctx, v, nk * 4), *d_x = dev_upload(ctx, x, nx * 4);
    float *d_t = dev_upload(ctx, target, nq * 4), *d_g = dev_upload(ctx, g0, np * 4);
    stc_bf16 *d_xb = dev_upload(ctx, xb, nx * 2);
    const double zero = 0;
    double *d_mse = dev_upload(ctx, &zero, sizeof zero), mse_gpu = 0;
    CKE(stc_still_distill(ctx, st, d_params, d_q, d_k, d_v, d_xb, d_x, T, d_t, scale, d_g, d_mse, &err));
    CKE(stc_memcpy_d2h(ctx, g_gpu, d_g, np * 4, &err));
    CKE(stc_memcpy_d2h(ctx, &mse_gpu, d_mse, sizeof mse_gpu, &err));
    /* a second call adds the same gradient again */
    {
        float *g2 = malloc(np * 4);
        CKE(stc_still_distill(ctx, st, d_params, d_q, d_k, d_v, d_xb, d_x, T, d_t, scale, d_g, d_mse, &err));
        CKE(stc_memcpy_d2h(ctx, g2, d_g, np * 4, &err));
        for (size_t i = 0; i < np; i++) g2[i] *= 0.5f;
        char w2[160], d2[160];
        const double e = rel_err(g_gpu, g2, 0, np);
        snprintf(w2, sizeof w2, "distill %s: a second call accumulates", gc->name);
        snprintf(d2, sizeof d2, "half the sum vs one call: relative error %.2e", e);
        check(e < 1e-5, w2, d2);
        free(g2);
    }
    /* the reference's own sensitivity: the CPU gradient with Sel in float32 instead of half */
    float *g_f32 = calloc(np, 4);
    {
        attn_config c32 = cfg;
        c32.sel_type = SEL_F32;
        double mse32 = 0;
        CKE(attn_distill(k, &c32, params, &io, target, scale, g_f32, &mse32, &err));
    }
    /* forward outputs: GPU vs CPU */
    {
        float *y_cpu = malloc(nq * 4), *y_gpu = malloc(nq * 4), *d_y = NULL;
        attn_state *cs = NULL;
        CKE(k->state_create(&cfg, &cs, &err));
        CKE(k->forward(cs, params, &io, y_cpu, &err));
        k->state_free(cs);
        stc_still *s2 = NULL;
        CKE(stc_still_create(ctx, &sc, &s2, &err));
        CKE(stc_malloc(ctx, nq * 4, "y", (void **)&d_y, &err));
        CKE(stc_still_forward(ctx, s2, d_params, d_q, d_k, d_v, d_xb, T, 0, d_y, &err));
        CKE(stc_memcpy_d2h(ctx, y_gpu, d_y, nq * 4, &err));
        printf("       %s: forward y gpu vs cpu relative error %.2e\n", gc->name, rel_err(y_cpu, y_gpu, 0, nq));
        stc_free(ctx, d_y);
        stc_still_free(s2);
        free(y_cpu), free(y_gpu);
    }
    /* directional finite difference of the GPU loss along the GPU gradient */
    {
        /* along g without the gate matrix: the forward rounds Wg to bf16, so the loss is flat in its small steps */
        float *dir = malloc(np * 4);
        double gn = 0;
        for (size_t i = 0; i < np; i++) {
            dir[i] = i >= at_wg && i < at_wg + HD * d ? 0.0f : g_gpu[i];
            gn += (double)dir[i] * dir[i];
        }
        gn = sqrt(gn);
        float *pp = malloc(np * 4);
        double lp[2];
        const double eps = 1e-2 / (gn > 0 ? gn : 1);   /* a step that moves the loss by ~1e-2 * |g| */
        for (int sgn = 0; sgn < 2; sgn++) {
            for (size_t i = 0; i < np; i++) pp[i] = params[i] + (float)((sgn ? -eps : eps) * dir[i]);
            CKE(stc_memcpy_h2d(ctx, d_params, pp, np * 4, &err));
            CKE(stc_memset(ctx, d_mse, 0, sizeof(double), &err));
            CKE(stc_still_distill(ctx, st, d_params, d_q, d_k, d_v, d_xb, d_x, T, d_t, scale, NULL, d_mse, &err));
            CKE(stc_memcpy_d2h(ctx, &lp[sgn], d_mse, sizeof(double), &err));
        }
        CKE(stc_memcpy_h2d(ctx, d_params, params, np * 4, &err));
        const double fd = scale * (lp[0] - lp[1]) / (2 * eps), an = gn * gn;
        char w2[160], d2[200];
        snprintf(w2, sizeof w2, "distill %s: directional finite difference", gc->name);
        snprintf(d2, sizeof d2, "d loss along g (Wg left out): %.6e, |g|^2 %.6e, ratio %.5f", fd, an, fd / an);
        check(fabs(fd / an - 1) < 2e-3, w2, d2);
        free(pp), free(dir);
    }

    char what[160], detail[256];
    snprintf(what, sizeof what, "distill %s: loss", gc->name);
    snprintf(detail, sizeof detail, "MSE cpu %.6g gpu %.6g", mse_cpu, mse_gpu);
    check(fabs(mse_gpu - mse_cpu) <= 1e-3 * mse_cpu && isfinite(mse_gpu), what, detail);
    const struct { const char *n; size_t lo, hi; } still_groups[] = {
        {"q_u", 0, HD}, {"k_u", HD, 2 * HD}, {"q_W", 2 * HD, 2 * HD + HD * D}, {"k_W", 2 * HD + HD * D, at_wg},
        {"Wg", at_wg, at_wg + HD * d}, {"bg", at_wg + HD * d, at_wg + HD * d + HD},
    }, lol_groups[] = {
        {"hq_W", 0, HD * D}, {"hk_W", HD * D, 2 * HD * D}, {"w (window factor)", 2 * HD * D, 2 * HD * D + H},
    }, *groups = gc->lolcats ? lol_groups : still_groups;
    const int n_groups = gc->lolcats ? 3 : 6;
    for (int i = 0; i < n_groups; i++) {
        if (groups[i].lo >= np) break;
        double nan_or_moved = 0;
        for (size_t j = groups[i].lo; j < groups[i].hi; j++)
            if (!isfinite(g_gpu[j])) nan_or_moved++;
        const double e = rel_err(g_cpu, g_gpu, groups[i].lo, groups[i].hi);
        double n_cpu = 0;
        for (size_t j = groups[i].lo; j < groups[i].hi; j++) n_cpu += (double)g_cpu[j] * g_cpu[j];
        snprintf(what, sizeof what, "distill %s: gradient %s", gc->name, groups[i].n);
        snprintf(detail, sizeof detail, "relative error %.2e (|g_cpu| %.3e), %g non-finite; cpu f32 vs f16 Sel %.2e", e,
                 sqrt(n_cpu), nan_or_moved, rel_err(g_cpu, g_f32, groups[i].lo, groups[i].hi));
        check(e < 2e-3 && nan_or_moved == 0 && n_cpu > 0, what, detail);
    }
    stc_free(ctx, d_params), stc_free(ctx, d_q), stc_free(ctx, d_k), stc_free(ctx, d_v), stc_free(ctx, d_x);
    stc_free(ctx, d_t), stc_free(ctx, d_g), stc_free(ctx, d_xb), stc_free(ctx, d_mse);
    stc_still_free(st);
    free(params), free(q), free(kk), free(v), free(x), free(target), free(g_cpu), free(g0), free(g_gpu), free(xb), free(g_f32);
}

/* Two trained layers of 30 (the rest softmax), four side streams asked for,
 * three sequences a step in passes of two (STILL_CUDA_TRAIN_ROWS=1024 at 512
 * tokens): with a CUDA graph against launch by launch. A side stream without
 * a student used to make the graph's recording fail at the second step. */
static void train_few_layers(const char *model_path, const char *data_path) {
    still_err err = {0};
    still_model *m = NULL;
    CKE(still_model_load(model_path, &m, &err));
    const int L = m->cfg.n_layer;
    char keep[256] = "";
    for (int l = 0; l < L - 2; l++) snprintf(keep + strlen(keep), sizeof keep - strlen(keep), "%s%d", l ? "," : "", l);
    still_attn_params ap = still_attn_default_params();
    ap.kind = "still";
    ap.softmax_layers = keep;
    CKE(still_model_set_attention(m, &ap, &err));
    float *init[2], *nog[2];
    size_t n[2];
    for (int i = 0; i < 2; i++) {
        const int l = L - 2 + i;
        n[i] = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
        init[i] = malloc(n[i] * 4), nog[i] = malloc(n[i] * 4);
        memcpy(init[i], m->attn_params[l], n[i] * 4);
    }
    const char *files[] = {data_path};
    still_train_params p = still_train_default_params();
    p.data_files = files, p.n_data_files = 1, p.device = STILL_DEVICE_CUDA;
    p.tokens = 3 * 3 * 512, p.seq = 512, p.batch = 3, p.val_max = 2, p.ckpt_every = 0;
    char out[] = "/tmp/test_train_cuda_XXXXXX";
    int fd = mkstemp(out);
    if (fd >= 0) close(fd);
    p.out_path = out;
    setenv("STILL_CUDA_TRAIN_STREAMS", "4", 1);
    setenv("STILL_CUDA_TRAIN_ROWS", "1024", 1);
    setenv("STILL_CUDA_GRAPHS", "0", 1);
    still_train_result r_nog, r_g;
    const int rc_nog = still_train(m, &p, &r_nog, &err);
    char detail[320];
    snprintf(detail, sizeof detail, "%.300s", rc_nog ? err.msg : "ok");
    check(rc_nog == 0, "trainer, 2 of 30 layers trained, 4 streams asked for, passes of 2 + 1: launch by launch", detail);
    for (int i = 0; i < 2; i++) memcpy(nog[i], m->attn_params[L - 2 + i], n[i] * 4), memcpy(m->attn_params[L - 2 + i], init[i], n[i] * 4);
    unsetenv("STILL_CUDA_GRAPHS");
    const int rc_g = still_train(m, &p, &r_g, &err);
    snprintf(detail, sizeof detail, "%.300s", rc_g ? err.msg : "ok");
    check(rc_g == 0, "trainer, 2 of 30 layers trained, 4 streams asked for, passes of 2 + 1: CUDA graph", detail);
    unsetenv("STILL_CUDA_TRAIN_STREAMS");
    unsetenv("STILL_CUDA_TRAIN_ROWS");
    remove(out);
    if (!rc_nog && !rc_g) {
        double a = 0, b = 0;
        for (int i = 0; i < 2; i++)
            for (size_t j = 0; j < n[i]; j++) {
                const double dg = (double)m->attn_params[L - 2 + i][j] - nog[i][j], dn = (double)nog[i][j] - init[i][j];
                a += dg * dg, b += dn * dn;
            }
        const double vb = r_g.val_mse_before[L - 1], va = r_g.val_mse_after[L - 1];
        snprintf(detail, sizeof detail, "relative difference of the updates %.3e; layer %d validation MSE %.5f -> %.5f",
                 b > 0 ? sqrt(a / b) : INFINITY, L - 1, vb, va);
        check(b > 0 && sqrt(a / b) < 1e-2 && va < vb, "trainer, 2 of 30 layers: graph vs launch by launch", detail);
    }
    if (!rc_nog) still_train_result_free(&r_nog);
    if (!rc_g) still_train_result_free(&r_g);
    for (int i = 0; i < 2; i++) free(init[i]), free(nog[i]);
    still_model_free(m);
}

/* gdn (stc_gdn_distill) against the CPU kind's stage-1 step (attn_distill: forward, MSE and
 * src/kinds/gdn/attn_gdn.c's backward, itself checked against central differences by tests/test_attn_gdn.c):
 * random q, k, v, x and target, the initialisation plus random projections (β, α and the gate move from token to
 * token); the loss to 1e-5 and every parameter group's gradient to 2e-3 (relative); a second call adds the same
 * gradient again; with rope_theta, q and k handed over rotated give the same gradient. */
static void gdn_grad_check(stc_ctx *ctx, int T, int H, int Hk, int D, int d, int norm, int conv, float theta) {
    attn_config cfg = {.kind = ATTN_GDN, .n_head = H, .n_head_kv = Hk, .head_dim = D, .d_model = d, .n_ctx = T,
                       .norm = norm, .conv = conv};
    const attn_kind *k = attn_kind_get(ATTN_GDN);
    const size_t np = k->param_count(&cfg), nq = (size_t)T * H * D, nk = (size_t)T * Hk * D, nx = (size_t)T * d;
    float *params = malloc(np * 4), *q = malloc(nq * 4), *kk = malloc(nk * 4), *v = malloc(nk * 4), *x = malloc(nx * 4);
    float *target = malloc(nq * 4), *g_cpu = calloc(np, 4), *g_gpu = malloc(np * 4), *g0 = calloc(np, 4);
    k->param_init(&cfg, params, 0);
    const float f = 1.0f / sqrtf((float)d);
    for (size_t i = 0; i < (size_t)Hk * d; i++)
        params[gdn_par_wbeta(Hk, d) + i] = 2.0f * f * nrand(), params[gdn_par_walpha(Hk, d) + i] = f * nrand();
    for (size_t i = 0; i < (size_t)H * D * d; i++) params[gdn_par_wg(Hk, d, D) + i] = f * nrand();
    for (int i = 0; i < D; i++) params[gdn_par_wnorm(Hk, d) + i] += 0.3f * nrand();
    for (size_t i = gdn_par_conv(H, Hk, d, D); conv && i < np; i++) params[i] += 0.3f * nrand();   /* not the identity */
    for (size_t i = 0; i < nq; i++) q[i] = 1.5f * nrand(), target[i] = 0.3f * nrand();
    for (size_t i = 0; i < nk; i++) kk[i] = nrand(), v[i] = nrand();
    for (size_t i = 0; i < nx; i++) x[i] = nrand();
    const float scale = 3.0f;
    still_err err = {0};
    attn_io io = {.q = q, .k = kk, .v = v, .q_nope = q, .k_nope = kk, .x = x, .p0 = 0, .T = T};
    double mse_cpu = 0, mse_gpu = 0;
    CKE(attn_distill(k, &cfg, params, &io, target, scale, g_cpu, &mse_cpu, &err));
    stc_gdn *st = NULL;
    CKE(stc_gdn_create(ctx, H, Hk, D, d, norm, conv, &st, &err));
    float *d_params = dev_upload(ctx, params, np * 4), *d_q = dev_upload(ctx, q, nq * 4);
    float *d_k = dev_upload(ctx, kk, nk * 4), *d_v = dev_upload(ctx, v, nk * 4), *d_x = dev_upload(ctx, x, nx * 4);
    float *d_t = dev_upload(ctx, target, nq * 4), *d_g = dev_upload(ctx, g0, np * 4);
    const double zero = 0;
    double *d_mse = dev_upload(ctx, &zero, sizeof zero);
    if (theta > 0) {   /* hand q and k over rotated, as the trainer's teacher has them */
        CKE(stc_rope_rows(ctx, d_q, T, T, H, D, theta, 0, &err));
        CKE(stc_rope_rows(ctx, d_k, T, T, Hk, D, theta, 0, &err));
    }
    CKE(stc_gdn_distill(ctx, st, d_params, d_q, d_k, d_v, d_x, T, theta, d_t, scale, d_g, d_mse, &err));
    CKE(stc_memcpy_d2h(ctx, g_gpu, d_g, np * 4, &err));
    CKE(stc_memcpy_d2h(ctx, &mse_gpu, d_mse, sizeof mse_gpu, &err));
    char name[160], what[200], detail[400];
    char cs[32] = "";
    if (conv) snprintf(cs, sizeof cs, ", conv %d", conv);
    snprintf(name, sizeof name, "gdn distill T=%d H=%d/%d D=%d d=%d%s%s%s", T, H, Hk, D, d, norm ? "" : ", no norm", cs,
             theta > 0 ? ", q and k rotated" : "");
    snprintf(what, sizeof what, "%s: loss", name);
    snprintf(detail, sizeof detail, "cpu %.8f gpu %.8f", mse_cpu, mse_gpu);
    check(fabs(mse_gpu - mse_cpu) <= 1e-5 * mse_cpu, what, detail);
    const struct { const char *n; size_t lo, hi; } groups[] = {
        {"w_beta", gdn_par_wbeta(Hk, d), gdn_par_bbeta(Hk, d)}, {"b_beta", gdn_par_bbeta(Hk, d), gdn_par_walpha(Hk, d)},
        {"w_alpha", gdn_par_walpha(Hk, d), gdn_par_balpha(Hk, d)}, {"b_alpha", gdn_par_balpha(Hk, d), gdn_par_alog(Hk, d)},
        {"a_log", gdn_par_alog(Hk, d), gdn_par_wnorm(Hk, d)}, {"w_n", gdn_par_wnorm(Hk, d), gdn_par_wg(Hk, d, D)},
        {"W_g", gdn_par_wg(Hk, d, D), gdn_par_bg(H, Hk, d, D)}, {"b_g", gdn_par_bg(H, Hk, d, D), gdn_par_conv(H, Hk, d, D)},
        {"w_c", gdn_par_conv(H, Hk, d, D), np}};
    double worst = 0;
    int o = snprintf(detail, sizeof detail, "relative errors");
    for (size_t i = 0; i < sizeof groups / sizeof groups[0]; i++) {
        const double e = rel_err(g_cpu, g_gpu, groups[i].lo, groups[i].hi);
        worst = e > worst ? e : worst;
        o += snprintf(detail + o, sizeof detail - (size_t)o, " %s %.1e", groups[i].n, e);
    }
    snprintf(what, sizeof what, "%s: gradient (every group < 2e-3)", name);
    check(worst < 2e-3, what, detail);
    float *g2 = malloc(np * 4);
    CKE(stc_gdn_distill(ctx, st, d_params, d_q, d_k, d_v, d_x, T, theta, d_t, scale, d_g, d_mse, &err));
    CKE(stc_memcpy_d2h(ctx, g2, d_g, np * 4, &err));
    for (size_t i = 0; i < np; i++) g2[i] *= 0.5f;
    const double e2 = rel_err(g_gpu, g2, 0, np);
    snprintf(what, sizeof what, "%s: a second call accumulates", name);
    snprintf(detail, sizeof detail, "half the sum vs one call: relative error %.2e", e2);
    check(e2 < 1e-5, what, detail);
    stc_gdn_free(st);
    stc_free(ctx, d_params), stc_free(ctx, d_q), stc_free(ctx, d_k), stc_free(ctx, d_v), stc_free(ctx, d_x);
    stc_free(ctx, d_t), stc_free(ctx, d_g), stc_free(ctx, d_mse);
    free(params), free(q), free(kk), free(v), free(x), free(target), free(g_cpu), free(g_gpu), free(g0), free(g2);
}

/* ---- part 2: the whole trainer -------------------------------------------------------- */

static void train_compare(const char *model_path, const char *data_path, const char *kind) {
    still_err err = {0};
    still_model *m = NULL;
    CKE(still_model_load(model_path, &m, &err));
    const int L = m->cfg.n_layer;
    still_attn_params ap = still_attn_default_params();
    if (strchr(kind, ':')) ap.plan = kind;   /* a plan string */
    else ap.kind = kind;
    printf("       trainer comparison, %s%s\n", ap.plan ? "plan " : "every layer ", kind);
    CKE(still_model_set_attention(m, &ap, &err));
    float **init = calloc((size_t)L, sizeof(float *)), **cpu = calloc((size_t)L, sizeof(float *));
    size_t *n = calloc((size_t)L, sizeof(size_t));
    for (int l = 0; l < L; l++) {
        n[l] = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
        init[l] = malloc(n[l] * 4), cpu[l] = malloc(n[l] * 4);
        memcpy(init[l], m->attn_params[l], n[l] * 4);
    }
    const char *files[] = {data_path};
    still_train_params p = still_train_default_params();
    p.data_files = files, p.n_data_files = 1;
    p.tokens = 3 * 2 * 512, p.seq = 512, p.batch = 2, p.val_max = 2, p.ckpt_every = 0;
    char out[] = "/tmp/test_train_cuda_XXXXXX";
    int fd = mkstemp(out);
    if (fd >= 0) close(fd);
    p.out_path = out;
    still_train_result r_cpu, r_gpu;
    p.device = STILL_DEVICE_CPU;
    CKE(still_train(m, &p, &r_cpu, &err));
    for (int l = 0; l < L; l++) memcpy(cpu[l], m->attn_params[l], n[l] * 4), memcpy(m->attn_params[l], init[l], n[l] * 4);
    /* the GPU launch by launch, then with its training sequences replayed as a CUDA graph */
    float **nog = calloc((size_t)L, sizeof(float *));
    p.device = STILL_DEVICE_CUDA;
    setenv("STILL_CUDA_GRAPHS", "0", 1);
    still_train_result r_nog;
    CKE(still_train(m, &p, &r_nog, &err));
    unsetenv("STILL_CUDA_GRAPHS");
    for (int l = 0; l < L; l++) {
        nog[l] = malloc(n[l] * 4);
        memcpy(nog[l], m->attn_params[l], n[l] * 4), memcpy(m->attn_params[l], init[l], n[l] * 4);
    }
    setenv("STILL_CUDA_TRAIN_ROWS", "512", 1);
    still_train_result r_one_pass;
    CKE(still_train(m, &p, &r_one_pass, &err));
    unsetenv("STILL_CUDA_TRAIN_ROWS");
    still_train_result_free(&r_one_pass);
    float **one_pass = calloc((size_t)L, sizeof(float *));
    for (int l = 0; l < L; l++) {
        one_pass[l] = malloc(n[l] * 4);
        memcpy(one_pass[l], m->attn_params[l], n[l] * 4), memcpy(m->attn_params[l], init[l], n[l] * 4);
    }
    CKE(still_train(m, &p, &r_gpu, &err));
    remove(out);
    for (int run = 0; run < 2; run++) {
        double a = 0, b = 0;
        for (int l = 0; l < L; l++)
            for (size_t i = 0; i < n[l]; i++) {
                const double x = run ? one_pass[l][i] : m->attn_params[l][i];
                const double dg = x - nog[l][i], dn = (double)nog[l][i] - init[l][i];
                a += dg * dg, b += dn * dn;
            }
        char d0[160];
        snprintf(d0, sizeof d0, "relative difference of the updates %.3e", b > 0 ? sqrt(a / b) : INFINITY);
        check(b > 0 && sqrt(a / b) < 1e-2,
              run ? "trainer: one sequence a teacher pass (graph) vs two, launch by launch"
                  : "trainer: CUDA graph replay vs launch by launch",
              d0);
    }
    {
        for (int l = 0; l < L; l++) free(nog[l]), free(one_pass[l]);
        free(one_pass);
        free(nog);
        still_train_result_free(&r_nog);
    }

    double num = 0, den = 0, worst = 0;
    int worst_l = -1;
    for (int l = 0; l < L; l++) {
        double nl = 0, dl = 0;
        for (size_t i = 0; i < n[l]; i++) {
            const double dc = (double)cpu[l][i] - init[l][i], dg = (double)m->attn_params[l][i] - init[l][i];
            nl += (dg - dc) * (dg - dc), dl += dc * dc;
        }
        num += nl, den += dl;
        if (dl > 0 && sqrt(nl / dl) > worst) worst = sqrt(nl / dl), worst_l = l;
    }
    char detail[256];
    snprintf(detail, sizeof detail, "relative difference of the updates %.3e over all layers (worst layer %d: %.3e)",
             den > 0 ? sqrt(num / den) : INFINITY, worst_l, worst);
    check(den > 0 && sqrt(num / den) < 5e-2, "trainer: GPU parameters after 3 steps vs CPU", detail);
    double vb = 0, vc = 0, vg = 0, wv = 0;
    int n_trained = 0;   /* the plan's trained layers (a softmax layer of a mixed plan has no MSE: NaN) */
    for (int l = 0; l < L; l++) n_trained += n[l] > 0;
    for (int l = 0; l < L; l++) {
        if (!n[l]) continue;
        vb += r_cpu.val_mse_before[l] / n_trained, vc += r_cpu.val_mse_after[l] / n_trained;
        vg += r_gpu.val_mse_after[l] / n_trained;
        const double e = fabs(r_gpu.val_mse_after[l] - r_cpu.val_mse_after[l]) / r_cpu.val_mse_after[l];
        wv = e > wv ? e : wv;
    }
    snprintf(detail, sizeof detail, "mean validation MSE before %.5f, after: cpu %.5f gpu %.5f (worst layer %.2e)", vb,
             vc, vg, wv);
    check(fabs(vg - vc) < 2e-2 * vc && vg < vb, "trainer: GPU validation MSE vs CPU", detail);
    printf("       train throughput: cpu %.0f tok/s, gpu %.0f tok/s (tiny run, mostly start-up)\n", r_cpu.tokens_per_s,
           r_gpu.tokens_per_s);
    still_train_result_free(&r_cpu), still_train_result_free(&r_gpu);
    for (int l = 0; l < L; l++) free(init[l]), free(cpu[l]);
    free(init), free(cpu), free(n);
    still_model_free(m);
}

int main(int argc, char **argv) {
    still_err err = {0};
    stc_ctx *ctx = NULL;
    if (stc_ctx_create(0, &ctx, &err)) {
        fprintf(stderr, "test_train_cuda: %s\n", err.msg);
        return 2;
    }
    const grad_case cases[] = {
        {"T=300 C=64 gate, lambda 6", 300, 64, 896, 6, 0, 1, ROUTE_SALIENCY, 0, 0},
        {"T=1024 C=64 gate (budget 896, lambda 6)", 1024, 64, 896, -1, 0, 1, ROUTE_SALIENCY, 0, 0},
        {"T=517 C=64 no gate, per-KV-head", 517, 64, 0, 4, 1, 0, ROUTE_SALIENCY, 0, 0},
        {"T=700 C=128 gate, lambda 10", 700, 128, 0, 10, 0, 1, ROUTE_SALIENCY, 0, 0},
        {"T=1024 C=32 gate, budget 256 (Sel fills)", 1024, 32, 256, 8, 0, 1, ROUTE_SALIENCY, 0, 0},
        {"T=1024 C=64 gate, position routing", 1024, 64, 896, 6, 0, 1, ROUTE_POSITION, 0, 0},
        {"T=1024 C=64 gate, no selection", 1024, 64, 896, 0, 0, 1, ROUTE_NONE, 0, 0},
        {"T=300 C=64 gate_den, lambda 6", 300, 64, 896, 6, 0, 1, ROUTE_SALIENCY, 1, 0},
        {"T=1024 C=64 gate_den (budget 896, lambda 6)", 1024, 64, 896, -1, 0, 1, ROUTE_SALIENCY, 1, 0},
        {"T=517 C=64 gate_den, per-KV-head", 517, 64, 0, 4, 1, 1, ROUTE_SALIENCY, 1, 0},
        {"lolcats T=1024 C=64", 1024, 64, 0, 0, 0, 0, ROUTE_NONE, 0, 1},
        {"lolcats T=517 C=32", 517, 32, 0, 0, 0, 0, ROUTE_NONE, 0, 1},
        {"lolcats T=700 C=128", 700, 128, 0, 0, 0, 0, ROUTE_NONE, 0, 1},
    };
    const char *only = getenv("STILL_TEST_CASE");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        if (!only || atoi(only) == (int)i) grad_check(ctx, &cases[i]);
    if (!only) {
        gdn_grad_check(ctx, 300, 9, 3, 64, 96, 1, 0, 0.0f);       /* the model's heads; chunks and a tail */
        gdn_grad_check(ctx, 300, 9, 3, 64, 96, 0, 0, 0.0f);       /* without the output norm */
        gdn_grad_check(ctx, 200, 4, 2, 128, 64, 1, 0, 0.0f);      /* head dim 128 */
        gdn_grad_check(ctx, 130, 9, 3, 64, 96, 0, 0, 10000.0f);   /* q and k handed over rotated */
        gdn_grad_check(ctx, 300, 9, 3, 64, 96, 0, 4, 0.0f);       /* the short convolution (w_c trains too) */
        gdn_grad_check(ctx, 130, 9, 3, 64, 96, 1, 4, 10000.0f);   /* with the norm, q and k rotated */
        gdn_grad_check(ctx, 200, 4, 2, 128, 64, 1, 2, 0.0f);      /* head dim 128, width 2 */
        gdn_grad_check(ctx, 70, 9, 3, 64, 96, 0, 1, 0.0f);        /* width 1: no history */
    }
    stc_ctx_free(ctx);
    if (argc >= 3) train_compare(argv[1], argv[2], "still");
    if (argc >= 3) train_compare(argv[1], argv[2], "lolcats");
    if (argc >= 3) train_compare(argv[1], argv[2], "gdn");
    if (argc >= 3)   /* the 3 : 1 layout with the short convolution, its norm from layer 8 (docs/plans.md) */
        train_compare(argv[1], argv[2], "gdn/conv=4:0-29,gdn/conv=4/norm=1:8-29,softmax:3,7,11,15,19,23,27");
    if (argc >= 3) train_few_layers(argv[1], argv[2]);
    printf("%d passed, %d failed\n", n_pass, n_fail);
    return n_fail ? 1 : 0;
}
