/* The gdn kind (Gated DeltaNet, spec "gdn"; its rules in attn_gdn_rules.h):
 * a gated delta-rule linear attention whose state S (D × D) per KV head is
 * an associative memory from normalised keys to values,
 *
 *   S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q̂_t,
 *
 * read by the KV head's G query heads, then a per-head RMSNorm (norm = 1; none with
 * norm = 0, a plan's default) and an output gate from the layer input. q and k are taken before RoPE (q_nope, k_nope).
 *
 * One algorithm, two schedules (the same outputs to float32 rounding for any
 * split of a sequence into calls, tests/test_attn_gdn.c):
 * - recurrent (a decode step, calls of a few tokens): token by token, with
 *   S kept transposed (ST[k][v]): ST ← α ST; r = STᵀ k̂; e = β (v − r);
 *   ST += k̂ eᵀ; o = STᵀ q̂.
 * - chunked (prefill, GDN_CHUNK tokens at a time, the WY / UT form): with
 *   g_i the cumulative log α inside the chunk, γ_i = e^{g_i},
 *   A_ij = β_i e^{g_i − g_j} k̂_i·k̂_j (j < i), U = (I + A)⁻¹ diag(β) V and
 *   W = (I + A)⁻¹ diag(β γ) K̂ (forward substitution), the deltas
 *   E = U − W S⁰ᵀ, outputs O = diag(γ) Q̂ S⁰ᵀ + (Q̂ K̂ᵀ ⊙ e^{g_i − g_j}, j <= i) E
 *   and the state S_Cᵀ = γ_C S⁰ᵀ + K̂ᵀ diag(e^{g_C − g_j}) E. The derivation:
 *   with e_i = β_i (v_i − α_i S_{i−1} k̂_i), S_i = α_i S_{i−1} + e_i k̂_iᵀ, so
 *   S_i = γ_i S⁰ + Σ_{j<=i} e^{g_i − g_j} e_j k̂_jᵀ, and substituting it into
 *   e_i gives (I + A) E = diag(β) V − diag(β γ) K̂ S⁰ᵀ.
 *
 * With conv = W > 0 (the spec's optional short convolution), q, k and v first pass a causal depthwise
 * convolution (below); the core then runs on its outputs.
 *
 * State: ST [Hk][D][D] floats, bounded (and the convolution's last W − 1 inputs). The backward (the parameters'
 * gradient for stage 1, the inputs' too for stage 2) is below, through the recurrent form; the GPU has the
 * forward (with the convolution) and stage 1's parameter gradient (without it) (cuda/kinds/gdn/attn_gdn.cu). */
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "kinds/gdn/attn_gdn_rules.h"
#include "common/common.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum { GDN_MAX_HEAD_DIM = 256, GDN_RECURRENT_MAX_T = 8 };   /* calls up to this many tokens run token by token */

typedef struct {
    float *ST;   /* [Hk][D][D]: S transposed, ST[k][v] */
    float *hist; /* conv = W > 0: the last W − 1 tokens' q | k | v before the convolution [W − 1][(H + 2 Hk) D] */
} gdn_state;

/* ---- configuration and parameters -------------------------------------------------------- */

static size_t gdn_param_count(const attn_config *c) {
    if (c->n_head <= 0 || c->n_head_kv <= 0 || c->head_dim <= 0 || c->d_model <= 0) return 0;
    return gdn_par_count_conv(c->n_head, c->n_head_kv, c->d_model, c->head_dim, c->conv);
}

static size_t conv_channels(const attn_config *c) { return (size_t)(c->n_head + 2 * c->n_head_kv) * c->head_dim; }

static void gdn_param_init(const attn_config *c, float *p, uint64_t seed) {
    (void)seed;   /* deterministic without randomness: the zero projections start every head at its own decay */
    const int H = c->n_head, Hk = c->n_head_kv, d = c->d_model, D = c->head_dim;
    memset(p, 0, sizeof(float) * gdn_par_count_conv(H, Hk, d, D, c->conv));
    for (int hk = 0; hk < Hk; hk++) {
        p[gdn_par_balpha(Hk, d) + hk] = gdn_softplus_inv(gdn_init_dt(hk, Hk));
        p[gdn_par_alog(Hk, d) + hk] = logf(gdn_init_a(hk, Hk));
    }
    for (int x = 0; x < D; x++) p[gdn_par_wnorm(Hk, d) + x] = 1.0f;
    for (size_t i = 0; i < (size_t)H * D; i++) p[gdn_par_bg(H, Hk, d, D) + i] = GDN_GATE_BIAS0;
    for (size_t ch = 0; c->conv > 0 && ch < conv_channels(c); ch++)   /* the identity: the current token alone */
        p[gdn_par_conv(H, Hk, d, D) + ch * (size_t)c->conv + (size_t)(c->conv - 1)] = 1.0f;
}

static size_t st_floats(const attn_config *c) { return (size_t)c->n_head_kv * c->head_dim * c->head_dim; }

static void gdn_free(attn_state *s) {
    if (!s) return;
    gdn_state *g = s->impl;
    if (g) free(g->ST), free(g->hist), free(g);
    free(s);
}

static int gdn_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    if (c->head_dim <= 0 || c->head_dim > GDN_MAX_HEAD_DIM || c->n_head <= 0 || c->n_head_kv <= 0 ||
        c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "gdn: attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (c->d_model <= 0) return still_fail(err, STILL_E_ARG, "gdn: needs d_model > 0, got %d", c->d_model);
    if (c->conv < 0 || c->conv > GDN_CONV_MAX)
        return still_fail(err, STILL_E_ARG, "gdn: conv %d (0 for none, else 1..%d)", c->conv, GDN_CONV_MAX);
    attn_state *s = calloc(1, sizeof *s);
    gdn_state *g = calloc(1, sizeof *g);
    if (g) g->ST = calloc(st_floats(c), sizeof(float));
    if (g && c->conv > 1) g->hist = calloc((size_t)(c->conv - 1) * conv_channels(c), sizeof(float));
    if (!s || !g || !g->ST || (c->conv > 1 && !g->hist)) {
        if (g) free(g->ST), free(g->hist);
        free(s), free(g);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating the gdn state");
    }
    s->cfg = *c;
    s->impl = g;
    *out = s;
    return STILL_OK;
}

static int gdn_truncate(attn_state *s, int n, still_err *err) {
    if (n == s->n_seen) return STILL_OK;
    if (n != 0)
        return still_fail(err, STILL_E_ARG,
                          "cannot truncate a %d-token gdn state to %d tokens (only to 0 or %d: history is folded)",
                          s->n_seen, n, s->n_seen);
    gdn_state *g = s->impl;
    memset(g->ST, 0, st_floats(&s->cfg) * sizeof(float));
    if (g->hist) memset(g->hist, 0, (size_t)(s->cfg.conv - 1) * conv_channels(&s->cfg) * sizeof(float));
    s->n_seen = 0;
    return STILL_OK;
}

static size_t gdn_bytes(const attn_state *s) {
    const size_t hist = s->cfg.conv > 1 ? (size_t)(s->cfg.conv - 1) * conv_channels(&s->cfg) : 0;
    return (st_floats(&s->cfg) + hist) * sizeof(float);
}

static int gdn_regions(attn_state *s, attn_region *out, int max) {
    gdn_state *g = s->impl;
    if (max < 2) return -1;
    out[0] = (attn_region){g->ST, st_floats(&s->cfg) * sizeof(float)};
    if (!g->hist) return 1;
    out[1] = (attn_region){g->hist, (size_t)(s->cfg.conv - 1) * conv_channels(&s->cfg) * sizeof(float)};
    return 2;
}

/* ---- the short convolution (conv = W > 0) ---------------------------------------------------
 * Channel ch of q | k | v (H·D, Hk·D, Hk·D channels): out_t = Σ_j w[ch][j] in_{t−W+1+j}, the inputs before the
 * call from hist (its W − 1 rows, oldest first; NULL: zeros, a sequence's start). */
/* Channel ch of token t (t < 0: from hist, or 0) of the call's q | k | v before the convolution. */
static float conv_src(const attn_config *c, const attn_io *io, const float *hist, int t, size_t ch) {
    const size_t HD = (size_t)c->n_head * c->head_dim, KD = (size_t)c->n_head_kv * c->head_dim;
    if (t < 0) {
        const int row = c->conv - 1 + t;
        return hist && row >= 0 ? hist[(size_t)row * (HD + 2 * KD) + ch] : 0.0f;
    }
    return ch < HD ? io->q_nope[(size_t)t * HD + ch]
                   : ch < HD + KD ? io->k_nope[(size_t)t * KD + (ch - HD)] : io->v[(size_t)t * KD + (ch - HD - KD)];
}

/* q, k, v of the call after the convolution into qc [T][H·D], kc, vc [T][Hk·D]. */
static void conv_forward(const attn_config *c, const float *params, const attn_io *io, const float *hist, float *qc,
                         float *kc, float *vc) {
    const int W = c->conv, T = io->T;
    const size_t HD = (size_t)c->n_head * c->head_dim, KD = (size_t)c->n_head_kv * c->head_dim, nch = HD + 2 * KD;
    const float *w = params + gdn_par_conv(c->n_head, c->n_head_kv, c->d_model, c->head_dim);
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++)
        for (size_t ch = 0; ch < nch; ch++) {
            float acc = 0;
            for (int j = 0; j < W; j++) acc += w[ch * W + j] * conv_src(c, io, hist, t - W + 1 + j, ch);
            float *dst = ch < HD ? qc + (size_t)t * HD + ch
                                 : ch < HD + KD ? kc + (size_t)t * KD + (ch - HD) : vc + (size_t)t * KD + (ch - HD - KD);
            *dst = acc;
        }
}

/* After a call: hist holds the last W − 1 inputs (older rows from hist itself when the call is shorter). */
static int conv_keep(const attn_config *c, const attn_io *io, float *hist, still_err *err) {
    const int W = c->conv;
    if (W <= 1 || !hist) return STILL_OK;
    const size_t nch = conv_channels(c);
    float *tmp = malloc(sizeof(float) * (size_t)(W - 1) * nch);
    if (!tmp) return still_fail(err, STILL_E_NOMEM, "gdn: out of memory for the convolution's history");
    for (int i = 0; i < W - 1; i++)
        for (size_t ch = 0; ch < nch; ch++) tmp[(size_t)i * nch + ch] = conv_src(c, io, hist, io->T - W + 1 + i, ch);
    memcpy(hist, tmp, sizeof(float) * (size_t)(W - 1) * nch);
    free(tmp);
    return STILL_OK;
}

/* The backward of conv_forward for a sequence from its start: dw (dparams' convolution part, may be NULL) and the
 * inputs' gradients (gi's dq_nope, dk_nope, dv, each may be NULL) from the outputs' dqc, dkc, dvc. */
static void conv_backward(const attn_config *c, const float *params, const attn_io *io, const float *dqc,
                          const float *dkc, const float *dvc, float *dparams, const attn_grads *gi) {
    const int W = c->conv, T = io->T;
    const size_t HD = (size_t)c->n_head * c->head_dim, KD = (size_t)c->n_head_kv * c->head_dim, nch = HD + 2 * KD;
    const size_t at = gdn_par_conv(c->n_head, c->n_head_kv, c->d_model, c->head_dim);
    const float *w = params + at;
    float *dw = dparams ? dparams + at : NULL;
#pragma omp parallel for schedule(static)
    for (size_t ch = 0; ch < nch; ch++) {
        const float *g = ch < HD ? dqc + ch : ch < HD + KD ? dkc + (ch - HD) : dvc + (ch - HD - KD);
        const size_t ld = ch < HD ? HD : KD;
        float *din = ch < HD ? (gi ? gi->dq_nope : NULL) : ch < HD + KD ? (gi ? gi->dk_nope : NULL) : (gi ? gi->dv : NULL);
        const size_t off = ch < HD ? ch : ch < HD + KD ? ch - HD : ch - HD - KD;
        for (int j = 0; j < W && dw; j++) {
            double acc = 0;
            for (int t = 0; t < T; t++) acc += (double)g[(size_t)t * ld] * conv_src(c, io, NULL, t - W + 1 + j, ch);
            dw[ch * W + j] += (float)acc;
        }
        for (int t = 0; din && t < T; t++) {   /* input t feeds outputs t .. t + W − 1 through taps W − 1 .. 0 */
            float acc = 0;
            for (int j = 0; j < W; j++) {
                const int o = t + W - 1 - j;
                if (o < T) acc += g[(size_t)o * ld] * w[ch * W + j];
            }
            din[(size_t)t * ld + off] += acc;
        }
    }
}

/* ---- the forward ------------------------------------------------------------------------- */

/* Per token of the call: q̂ [T][H][D], k̂ [T][Hk][D], β and log α [T][Hk]. */
static void token_inputs(const attn_config *c, const float *p, const attn_io *io, float *qn, float *kn, float *beta,
                         float *lalpha) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, d = c->d_model, T = io->T;
    const float *wb = p + gdn_par_wbeta(Hk, d), *bb = p + gdn_par_bbeta(Hk, d);
    const float *wa = p + gdn_par_walpha(Hk, d), *ba = p + gdn_par_balpha(Hk, d), *al = p + gdn_par_alog(Hk, d);
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++) {
        const float *x = io->x + (size_t)t * d;
        for (int h = 0; h < H + Hk; h++) {
            const int kside = h >= H;
            const float *src = kside ? io->k_nope + ((size_t)t * Hk + (h - H)) * D : io->q_nope + ((size_t)t * H + h) * D;
            float *dst = kside ? kn + ((size_t)t * Hk + (h - H)) * D : qn + ((size_t)t * H + h) * D;
            float nn = 0;
            for (int i = 0; i < D; i++) nn += src[i] * src[i];
            const float f = gdn_l2_factor(nn);
            for (int i = 0; i < D; i++) dst[i] = src[i] * f;
        }
        for (int hk = 0; hk < Hk; hk++) {
            float sb = 0, sa = 0;
            for (int i = 0; i < d; i++) sb += wb[(size_t)hk * d + i] * x[i], sa += wa[(size_t)hk * d + i] * x[i];
            beta[(size_t)t * Hk + hk] = gdn_beta(sb + bb[hk]);
            lalpha[(size_t)t * Hk + hk] = gdn_log_alpha(sa + ba[hk], al[hk]);
        }
    }
}

/* KV head hk, tokens t0 .. t0+n-1 token by token; raw outputs o [T][H][D]. */
static void run_recurrent(const attn_config *c, float *ST, const float *qn, const float *kn, const float *v,
                          const float *beta, const float *lalpha, int hk, int t0, int n, float *o) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk;
    float r[GDN_MAX_HEAD_DIM];
    for (int t = t0; t < t0 + n; t++) {
        const float a = expf(lalpha[(size_t)t * Hk + hk]), b = beta[(size_t)t * Hk + hk];
        const float *k = kn + ((size_t)t * Hk + hk) * D, *vt = v + ((size_t)t * Hk + hk) * D;
        for (int i = 0; i < D * D; i++) ST[i] *= a;
        for (int j = 0; j < D; j++) r[j] = 0;
        for (int i = 0; i < D; i++) {
            const float ki = k[i], *row = ST + (size_t)i * D;
            for (int j = 0; j < D; j++) r[j] += ki * row[j];
        }
        for (int j = 0; j < D; j++) r[j] = b * (vt[j] - r[j]);   /* e */
        for (int i = 0; i < D; i++) {
            const float ki = k[i];
            float *row = ST + (size_t)i * D;
            for (int j = 0; j < D; j++) row[j] += ki * r[j];
        }
        for (int g = 0; g < G && o; g++) {   /* o NULL: the state only (the backward's recomputation) */
            const int h = hk * G + g;
            const float *q = qn + ((size_t)t * H + h) * D;
            float *ot = o + ((size_t)t * H + h) * D;
            for (int j = 0; j < D; j++) ot[j] = 0;
            for (int i = 0; i < D; i++) {
                const float qi = q[i], *row = ST + (size_t)i * D;
                for (int j = 0; j < D; j++) ot[j] += qi * row[j];
            }
        }
    }
}

/* Scratch floats of one chunk of KV head: g, γ [C]; A [C][C]; U, W, E, K̂, Q̂, V [C][D]; P [C][C]. */
static size_t chunk_floats(int D) {
    const size_t C = GDN_CHUNK;
    return 2 * C + 2 * C * C + 6 * C * (size_t)D;
}

/* KV head hk, tokens t0 .. t0+n-1 (n <= GDN_CHUNK) as one chunk of the WY form (the header); raw outputs o. */
static void run_chunk(const attn_config *c, float *ST, const float *qn, const float *kn, const float *v,
                      const float *beta, const float *lalpha, int hk, int t0, int n, float *o, float *ws) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, C = GDN_CHUNK;
    float *g = ws, *gam = g + C, *A = gam + C, *P = A + (size_t)C * C, *U = P + (size_t)C * C, *W = U + (size_t)C * D;
    float *K = W + (size_t)C * D, *Q = K + (size_t)C * D, *V = Q + (size_t)C * D;
    float acc = 0;
    for (int i = 0; i < n; i++) {
        acc += lalpha[(size_t)(t0 + i) * Hk + hk];
        g[i] = acc, gam[i] = expf(acc);
        memcpy(K + (size_t)i * D, kn + ((size_t)(t0 + i) * Hk + hk) * D, sizeof(float) * (size_t)D);
        memcpy(V + (size_t)i * D, v + ((size_t)(t0 + i) * Hk + hk) * D, sizeof(float) * (size_t)D);
    }
    /* A = K Kᵀ, then its strictly lower part scaled by β_i e^{g_i − g_j} */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, D, 1.0f, K, D, K, D, 0.0f, A, C);
    for (int i = 0; i < n; i++) {
        const float b = beta[(size_t)(t0 + i) * Hk + hk];
        for (int j = 0; j < i; j++) A[(size_t)i * C + j] *= b * expf(g[i] - g[j]);
    }
    /* U = (I + A)⁻¹ diag(β) V, W = (I + A)⁻¹ diag(β γ) K: forward substitution, row by row */
    for (int i = 0; i < n; i++) {
        const float b = beta[(size_t)(t0 + i) * Hk + hk];
        float *u = U + (size_t)i * D, *w = W + (size_t)i * D;
        for (int x = 0; x < D; x++) u[x] = b * V[(size_t)i * D + x], w[x] = b * gam[i] * K[(size_t)i * D + x];
        for (int j = 0; j < i; j++) {
            const float a = A[(size_t)i * C + j];
            const float *uj = U + (size_t)j * D, *wj = W + (size_t)j * D;
            for (int x = 0; x < D; x++) u[x] -= a * uj[x], w[x] -= a * wj[x];
        }
    }
    /* E = U − W S⁰ᵀ (into U) */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, D, -1.0f, W, D, ST, D, 1.0f, U, D);
    /* each query head: O = diag(γ) Q S⁰ᵀ + (Q Kᵀ ⊙ e^{g_i − g_j}, j <= i) E */
    for (int gi = 0; gi < G; gi++) {
        const int h = hk * G + gi;
        for (int i = 0; i < n; i++)
            memcpy(Q + (size_t)i * D, qn + ((size_t)(t0 + i) * H + h) * D, sizeof(float) * (size_t)D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, D, 1.0f, Q, D, K, D, 0.0f, P, C);
        for (int i = 0; i < n; i++) {
            for (int j = 0; j <= i; j++) P[(size_t)i * C + j] *= expf(g[i] - g[j]);
            for (int j = i + 1; j < n; j++) P[(size_t)i * C + j] = 0;
            for (int x = 0; x < D; x++) Q[(size_t)i * D + x] *= gam[i];
        }
        float *O = W;   /* W is no longer needed: the head's outputs, then copied out */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, D, 1.0f, Q, D, ST, D, 0.0f, O, D);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, n, 1.0f, P, C, U, D, 1.0f, O, D);
        for (int i = 0; i < n; i++)
            memcpy(o + ((size_t)(t0 + i) * H + h) * D, O + (size_t)i * D, sizeof(float) * (size_t)D);
    }
    /* S_Cᵀ = γ_C S⁰ᵀ + K̂ᵀ diag(e^{g_C − g_j}) E */
    const float gl = g[n - 1];
    for (int i = 0; i < n; i++) {
        const float f = expf(gl - g[i]);
        for (int x = 0; x < D; x++) K[(size_t)i * D + x] *= f;
    }
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, D, D, n, 1.0f, K, D, U, D, gam[n - 1], ST, D);
}

static int gdn_forward_core(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    gdn_state *gs = s->impl;
    const attn_config *c = &s->cfg;
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "gdn: state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "gdn: negative token count %d", io->T);
    if (io->T == 0) return STILL_OK;
    if (!io->q_nope || !io->k_nope || !io->v || !io->x || !params || !out)
        return still_fail(err, STILL_E_ARG, "gdn: q and k before RoPE, v, x, the parameters and out are required");
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, d = c->d_model, T = io->T;
    const size_t HD = (size_t)H * D;
    float *qn = malloc(sizeof(float) * (size_t)T * HD), *kn = malloc(sizeof(float) * (size_t)T * Hk * D);
    float *beta = malloc(sizeof(float) * (size_t)T * Hk), *lal = malloc(sizeof(float) * (size_t)T * Hk);
    float *o = malloc(sizeof(float) * (size_t)T * HD), *gate = malloc(sizeof(float) * (size_t)T * HD);
    const int chunked = T > GDN_RECURRENT_MAX_T;
    float *ws = chunked ? malloc(sizeof(float) * chunk_floats(D) * (size_t)Hk) : NULL;
    if (!qn || !kn || !beta || !lal || !o || !gate || (chunked && !ws)) {
        free(qn), free(kn), free(beta), free(lal), free(o), free(gate), free(ws);
        return still_fail(err, STILL_E_NOMEM, "gdn: out of memory for a %d-token call", T);
    }
    token_inputs(c, params, io, qn, kn, beta, lal);
#pragma omp parallel for schedule(dynamic, 1) num_threads(Hk < omp_get_max_threads() ? Hk : omp_get_max_threads())
    for (int hk = 0; hk < Hk; hk++) {
        float *ST = gs->ST + (size_t)hk * D * D;
        if (!chunked) run_recurrent(c, ST, qn, kn, io->v, beta, lal, hk, 0, T, o);
        else
            for (int t0 = 0; t0 < T; t0 += GDN_CHUNK)
                run_chunk(c, ST, qn, kn, io->v, beta, lal, hk, t0, T - t0 < GDN_CHUNK ? T - t0 : GDN_CHUNK, o,
                          ws + (size_t)hk * chunk_floats(D));
    }
    /* the output gate's pre-activations W_g x (+ b_g below), then RMSNorm and gate per head */
    const float *Wg = params + gdn_par_wg(Hk, d, D), *bg = params + gdn_par_bg(H, Hk, d, D);
    const float *wn = params + gdn_par_wnorm(Hk, d);
    if (T == 1 && io->gate_pre) memcpy(gate, io->gate_pre, sizeof(float) * HD);   /* the caller's product (model.c) */
    else cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, (int)HD, d, 1.0f, io->x, d, Wg, d, 0.0f, gate, (int)HD);
#pragma omp parallel for schedule(static) if (T > 16)
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const float *ot = o + (size_t)t * HD + (size_t)h * D, *gp = gate + (size_t)t * HD + (size_t)h * D;
            float ss = 0;
            for (int x = 0; x < D; x++) ss += ot[x] * ot[x];
            const float f = gdn_out_factor(c->norm, ss, D);
            float *y = out + (size_t)t * HD + (size_t)h * D;
            for (int x = 0; x < D; x++) y[x] = gdn_gate(gp[x] + bg[(size_t)h * D + x]) * (wn[x] * (ot[x] * f));
        }
    free(qn), free(kn), free(beta), free(lal), free(o), free(gate), free(ws);
    s->n_seen += T;
    return STILL_OK;
}

/* ---- the backward (stage 1: the parameters; stage 2: the inputs too) --------------------------
 *
 * Through the recurrent form, token by token in reverse, with S recomputed a segment of GDN_CKPT tokens at a
 * time from checkpoints of a first forward pass (memory: T / GDN_CKPT + GDN_CKPT states per KV head). With
 * n = o f (f the RMSNorm's factor) and y = g ⊙ w_n ⊙ n:
 *   dn = dy ⊙ g ⊙ w_n, do = f dn − f³ o (o·dn) / D, dg_pre = dy ⊙ w_n ⊙ n ⊙ g (1 − g), dw_n += dy ⊙ g ⊙ n;
 *   dS_t += Σ_h do_t^h q̂_t^hᵀ and dq̂_t^h = S_tᵀ do_t^h; with r = S_{t−1} k̂, M = I − β k̂ k̂ᵀ
 *   (S_t = α S_{t−1} M + β v k̂ᵀ) and dSk = dS_t k̂:
 *   dα = ⟨dS_t, S_{t−1}⟩ − β dSk·r,   dβ = dSk·(v − α r),   dv = β dSk,
 *   dk̂ = β dS_tᵀ (v − α r) − α β S_{t−1}ᵀ dSk,   dS_{t−1} = α dS_t M;
 * log α = −e^{a_log} softplus(a_pre): da_pre = α dα (−e^{a_log}) σ(a_pre), da_log = α dα log α;
 * β = σ(b_pre): db_pre = dβ β (1 − β); the projections' gradients are these times x_t, and x's gradient these
 * times the projections' rows (plus the gate's W_gᵀ dg_pre); q̂ = q / ‖q‖: dq = (dq̂ − q̂ (q̂·dq̂)) / ‖q‖ (k alike). */
enum { GDN_CKPT = 64 };

/* dq̂ → dq through the L2 normalisation of the raw vector x (D values), added into out. */
static void l2_backward(const float *x, const float *dxh, int D, float *out) {
    float nn = 0, dot = 0;
    for (int i = 0; i < D; i++) nn += x[i] * x[i];
    const float f = gdn_l2_factor(nn);
    if (sqrtf(nn) <= GDN_L2_EPS) {   /* the floor: x̂ = x / eps, linear in x */
        for (int i = 0; i < D; i++) out[i] += f * dxh[i];
        return;
    }
    for (int i = 0; i < D; i++) dot += x[i] * f * dxh[i];
    for (int i = 0; i < D; i++) out[i] += f * (dxh[i] - x[i] * f * dot);
}

static int gdn_backward_core(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                            float *dparams, const attn_grads *gi, still_err *err) {
    if (io->p0 != 0) return still_fail(err, STILL_E_ARG, "gdn backward: the sequence must start at 0, got %d", io->p0);
    if (io->T <= 0) return STILL_OK;
    if (!io->q_nope || !io->k_nope || !io->v || !io->x || !params || !dout)
        return still_fail(err, STILL_E_ARG, "gdn backward: q and k before RoPE, v, x, parameters and dout are required");
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, d = c->d_model, T = io->T, G = H / Hk;
    const size_t HD = (size_t)H * D, DD = (size_t)D * D;
    const int n_ck = (T + GDN_CKPT - 1) / GDN_CKPT, inputs = gi && (gi->dq_nope || gi->dk_nope || gi->dv || gi->dx);
    const size_t per_head = (size_t)(GDN_CKPT + 3) * DD;   /* a segment's states and the one after, dS, scratch */
    float *qn = malloc(sizeof(float) * (size_t)T * HD), *kn = malloc(sizeof(float) * (size_t)T * Hk * D);
    float *beta = malloc(sizeof(float) * (size_t)T * Hk), *lal = malloc(sizeof(float) * (size_t)T * Hk);
    float *o = malloc(sizeof(float) * (size_t)T * HD), *gpre = malloc(sizeof(float) * (size_t)T * HD);
    float *dO = malloc(sizeof(float) * (size_t)T * HD);
    float *ck = malloc(sizeof(float) * ((size_t)Hk * n_ck + Hk) * DD);   /* S before token c·GDN_CKPT; the last S */
    float *seg = malloc(sizeof(float) * (size_t)Hk * per_head);
    float *dpre = malloc(sizeof(float) * (size_t)T * Hk * 2);            /* db_pre, da_pre per token and KV head */
    if (!qn || !kn || !beta || !lal || !o || !gpre || !dO || !ck || !seg || !dpre) {
        free(qn), free(kn), free(beta), free(lal), free(o), free(gpre), free(dO), free(ck), free(seg), free(dpre);
        return still_fail(err, STILL_E_NOMEM, "gdn backward: out of memory for %d tokens", T);
    }
    token_inputs(c, params, io, qn, kn, beta, lal);
    /* 1. the forward, token by token, keeping checkpoints, the final state and the raw outputs */
#pragma omp parallel for schedule(dynamic, 1) num_threads(Hk < omp_get_max_threads() ? Hk : omp_get_max_threads())
    for (int hk = 0; hk < Hk; hk++) {
        float *ST = seg + (size_t)hk * per_head;
        memset(ST, 0, sizeof(float) * DD);
        for (int cI = 0; cI < n_ck; cI++) {
            memcpy(ck + ((size_t)hk * n_ck + cI) * DD, ST, sizeof(float) * DD);
            const int t0 = cI * GDN_CKPT, n = T - t0 < GDN_CKPT ? T - t0 : GDN_CKPT;
            run_recurrent(c, ST, qn, kn, io->v, beta, lal, hk, t0, n, o);
        }
        memcpy(ck + ((size_t)Hk * n_ck + hk) * DD, ST, sizeof(float) * DD);
    }
    /* 2. the output side: gate, norm weight, do */
    const float *Wg = params + gdn_par_wg(Hk, d, D), *bg = params + gdn_par_bg(H, Hk, d, D);
    const float *wn = params + gdn_par_wnorm(Hk, d);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, (int)HD, d, 1.0f, io->x, d, Wg, d, 0.0f, gpre, (int)HD);
    float *dwn = dparams ? dparams + gdn_par_wnorm(Hk, d) : NULL, *dbg = dparams ? dparams + gdn_par_bg(H, Hk, d, D) : NULL;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            const size_t off = (size_t)t * HD + (size_t)h * D;
            const float *ot = o + off, *dy = dout + off;
            float ss = 0, odn = 0;
            for (int x = 0; x < D; x++) ss += ot[x] * ot[x];
            const float f = gdn_out_factor(c->norm, ss, D);
            float *dg = gpre + off, *dot_ = dO + off;
            for (int x = 0; x < D; x++) {
                const float g = gdn_gate(dg[x] + bg[(size_t)h * D + x]), nrm = ot[x] * f;
                const float dn = dy[x] * g * wn[x];
                if (dwn) dwn[x] += dy[x] * g * nrm;
                dg[x] = dy[x] * wn[x] * nrm * g * (1.0f - g);   /* gpre now holds dg_pre */
                dot_[x] = dn, odn += ot[x] * dn;
            }
            const float f3 = c->norm ? f * f * f * odn / (float)D : 0.0f;   /* without the norm, do = dn */
            for (int x = 0; x < D; x++) dot_[x] = f * dot_[x] - f3 * ot[x];
            if (dbg)
                for (int x = 0; x < D; x++) dbg[(size_t)h * D + x] += dg[x];
        }
    if (dparams)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)HD, d, T, 1.0f, gpre, (int)HD, io->x, d, 1.0f,
                    dparams + gdn_par_wg(Hk, d, D), d);
    /* 3. the recurrence in reverse, per KV head */
    const float *wa = params + gdn_par_walpha(Hk, d), *ba = params + gdn_par_balpha(Hk, d), *al = params + gdn_par_alog(Hk, d);
    const float *wb = params + gdn_par_wbeta(Hk, d);
#pragma omp parallel for schedule(dynamic, 1) num_threads(Hk < omp_get_max_threads() ? Hk : omp_get_max_threads())
    for (int hk = 0; hk < Hk; hk++) {
        float *states = seg + (size_t)hk * per_head, *dS = states + (size_t)(GDN_CKPT + 1) * DD;
        float *sc = dS + DD;   /* r, dSk, u, dk̂, dq̂ [D] each */
        float *r = sc, *dSk = sc + D, *u = sc + 2 * D, *dkh = sc + 3 * D, *dqh = sc + 4 * D;
        double dal = 0;
        const float A = expf(al[hk]);
        memset(dS, 0, sizeof(float) * DD);
        for (int cI = n_ck - 1; cI >= 0; cI--) {
            const int t0 = cI * GDN_CKPT, n = T - t0 < GDN_CKPT ? T - t0 : GDN_CKPT;
            /* states[i] = S before token t0 + i, states[n] = S after the segment */
            memcpy(states, ck + ((size_t)hk * n_ck + cI) * DD, sizeof(float) * DD);
            for (int i = 1; i < n; i++) {
                float *Si = states + (size_t)i * DD;
                memcpy(Si, states + (size_t)(i - 1) * DD, sizeof(float) * DD);
                run_recurrent(c, Si, qn, kn, io->v, beta, lal, hk, t0 + i - 1, 1, NULL);
            }
            const float *after = cI + 1 < n_ck ? ck + ((size_t)hk * n_ck + cI + 1) * DD : ck + ((size_t)Hk * n_ck + hk) * DD;
            memcpy(states + (size_t)n * DD, after, sizeof(float) * DD);
            for (int i = n - 1; i >= 0; i--) {
                const int t = t0 + i;
                const float *Sp = states + (size_t)i * DD, *St = states + (size_t)(i + 1) * DD;
                const float *k = kn + ((size_t)t * Hk + hk) * D, *v = io->v + ((size_t)t * Hk + hk) * D;
                const float *x = io->x + (size_t)t * d;
                const float b = beta[(size_t)t * Hk + hk], la = lal[(size_t)t * Hk + hk], a = expf(la);
                for (int gI = 0; gI < G; gI++) {   /* dS_t += do q̂ᵀ (dST[k][v] += q̂[k] do[v]); dq̂ = S_tᵀ do */
                    const int h = hk * G + gI;
                    const float *q = qn + ((size_t)t * H + h) * D, *dot_ = dO + (size_t)t * HD + (size_t)h * D;
                    for (int kk = 0; kk < D; kk++) {
                        float *dr = dS + (size_t)kk * D;
                        const float *sr = St + (size_t)kk * D;
                        float acc = 0;
                        for (int vv = 0; vv < D; vv++) dr[vv] += q[kk] * dot_[vv], acc += sr[vv] * dot_[vv];
                        dqh[kk] = acc;
                    }
                    if (gi && gi->dq_nope)
                        l2_backward(io->q_nope + ((size_t)t * H + h) * D, dqh, D, gi->dq_nope + ((size_t)t * H + h) * D);
                }
                float sdS = 0;
                for (int vv = 0; vv < D; vv++) r[vv] = 0, dSk[vv] = 0;
                for (int kk = 0; kk < D; kk++) {
                    const float *sr = Sp + (size_t)kk * D, *dr = dS + (size_t)kk * D;
                    for (int vv = 0; vv < D; vv++) r[vv] += k[kk] * sr[vv], dSk[vv] += k[kk] * dr[vv], sdS += dr[vv] * sr[vv];
                }
                float dkr = 0, dkv = 0;
                for (int vv = 0; vv < D; vv++) u[vv] = v[vv] - a * r[vv], dkr += dSk[vv] * r[vv], dkv += dSk[vv] * u[vv];
                const float dalpha = sdS - b * dkr, dbeta = dkv;
                if (inputs) {
                    /* dk̂ = β dSᵀ u − α β S_{t−1}ᵀ dSk (dSᵀ u)[k] = Σ_v dST[k][v] u[v]; dv = β dSk */
                    for (int kk = 0; kk < D; kk++) {
                        const float *dr = dS + (size_t)kk * D, *sr = Sp + (size_t)kk * D;
                        float s1 = 0, s2 = 0;
                        for (int vv = 0; vv < D; vv++) s1 += dr[vv] * u[vv], s2 += sr[vv] * dSk[vv];
                        dkh[kk] = b * s1 - a * b * s2;
                    }
                    if (gi->dk_nope)
                        l2_backward(io->k_nope + ((size_t)t * Hk + hk) * D, dkh, D, gi->dk_nope + ((size_t)t * Hk + hk) * D);
                    if (gi->dv) {
                        float *dvt = gi->dv + ((size_t)t * Hk + hk) * D;
                        for (int vv = 0; vv < D; vv++) dvt[vv] += b * dSk[vv];
                    }
                }
                /* dS_{t−1} = α dS_t M = α (dS − β k̂ (k̂ᵀ dS)) */
                for (int kk = 0; kk < D; kk++) {
                    float *dr = dS + (size_t)kk * D;
                    for (int vv = 0; vv < D; vv++) dr[vv] = a * (dr[vv] - b * k[kk] * dSk[vv]);
                }
                const float dla = a * dalpha;   /* ∂/∂ log α */
                float apre = ba[hk];
                for (int j = 0; j < d; j++) apre += wa[(size_t)hk * d + j] * x[j];
                dpre[((size_t)t * Hk + hk) * 2] = dbeta * b * (1.0f - b);
                dpre[((size_t)t * Hk + hk) * 2 + 1] = dla * -A * (1.0f / (1.0f + expf(-apre)));
                dal += (double)dla * la;
            }
        }
        if (dparams) {   /* the projections of β and α: Σ_t dpre x_t */
            float *dwb = dparams + gdn_par_wbeta(Hk, d) + (size_t)hk * d, *dwa = dparams + gdn_par_walpha(Hk, d) + (size_t)hk * d;
            double dbb = 0, dba = 0;
            for (int t = 0; t < T; t++) {
                const float db_ = dpre[((size_t)t * Hk + hk) * 2], da_ = dpre[((size_t)t * Hk + hk) * 2 + 1];
                const float *x = io->x + (size_t)t * d;
                for (int j = 0; j < d; j++) dwb[j] += db_ * x[j], dwa[j] += da_ * x[j];
                dbb += db_, dba += da_;
            }
            dparams[gdn_par_bbeta(Hk, d) + hk] += (float)dbb;
            dparams[gdn_par_balpha(Hk, d) + hk] += (float)dba;
            dparams[gdn_par_alog(Hk, d) + hk] += (float)dal;
        }
    }
    if (gi && gi->dx) {   /* x: through β's and α's projections and the gate's */
        for (int t = 0; t < T; t++) {
            float *dx = gi->dx + (size_t)t * d;
            for (int hk = 0; hk < Hk; hk++) {
                const float db_ = dpre[((size_t)t * Hk + hk) * 2], da_ = dpre[((size_t)t * Hk + hk) * 2 + 1];
                for (int j = 0; j < d; j++) dx[j] += db_ * wb[(size_t)hk * d + j] + da_ * wa[(size_t)hk * d + j];
            }
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, d, (int)HD, 1.0f, gpre, (int)HD, Wg, d, 1.0f, gi->dx, d);
    }
    free(qn), free(kn), free(beta), free(lal), free(o), free(gpre), free(dO), free(ck), free(seg), free(dpre);
    return STILL_OK;
}

/* ---- with the short convolution: the core on the convolved q, k, v, then the convolution's own steps ---- */

static int gdn_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    const attn_config *c = &s->cfg;
    if (c->conv <= 0 || io->T <= 0 || !io->q_nope || !io->k_nope || !io->v || !params)
        return gdn_forward_core(s, params, io, out, err);   /* (the core reports what is missing) */
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "gdn: state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    gdn_state *g = s->impl;
    const size_t HD = (size_t)c->n_head * c->head_dim, KD = (size_t)c->n_head_kv * c->head_dim, T = (size_t)io->T;
    float *qc = malloc(sizeof(float) * T * (HD + 2 * KD));
    if (!qc) return still_fail(err, STILL_E_NOMEM, "gdn: out of memory for a %d-token call", io->T);
    float *kc = qc + T * HD, *vc = kc + T * KD;
    conv_forward(c, params, io, g->hist, qc, kc, vc);
    attn_io cio = *io;
    cio.q_nope = qc, cio.k_nope = kc, cio.v = vc;
    int rc = gdn_forward_core(s, params, &cio, out, err);
    if (!rc) rc = conv_keep(c, io, g->hist, err);
    free(qc);
    return rc;
}

static int gdn_backward_run(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                            float *dparams, const attn_grads *gi, still_err *err) {
    if (c->conv <= 0 || io->T <= 0 || !io->q_nope || !io->k_nope || !io->v || !params)
        return gdn_backward_core(c, params, io, dout, dparams, gi, err);
    const size_t HD = (size_t)c->n_head * c->head_dim, KD = (size_t)c->n_head_kv * c->head_dim, T = (size_t)io->T;
    float *qc = malloc(sizeof(float) * T * (HD + 2 * KD)), *dqc = calloc(T * (HD + 2 * KD), sizeof(float));
    if (!qc || !dqc) {
        free(qc), free(dqc);
        return still_fail(err, STILL_E_NOMEM, "gdn backward: out of memory for %d tokens", io->T);
    }
    float *kc = qc + T * HD, *vc = kc + T * KD, *dkc = dqc + T * HD, *dvc = dkc + T * KD;
    conv_forward(c, params, io, NULL, qc, kc, vc);
    attn_io cio = *io;
    cio.q_nope = qc, cio.k_nope = kc, cio.v = vc;
    const attn_grads cg = {.dq_nope = dqc, .dk_nope = dkc, .dv = dvc, .dx = gi ? gi->dx : NULL};
    const int rc = gdn_backward_core(c, params, &cio, dout, dparams, &cg, err);
    if (!rc) conv_backward(c, params, io, dqc, dkc, dvc, dparams, gi);
    free(qc), free(dqc);
    return rc;
}

static int gdn_backward(const attn_config *c, const float *params, const attn_io *io, const float *dout, float *dparams,
                        still_err *err) {
    if (!dparams) return still_fail(err, STILL_E_ARG, "gdn backward: no gradient buffer");
    return gdn_backward_run(c, params, io, dout, dparams, NULL, err);
}

/* Stage 2: dq_nope, dk_nope, dv, dx (and dparams when given); dq and dk (after RoPE) get nothing: gdn does not read
 * them. */
static int gdn_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                               const attn_grads *g, still_err *err) {
    if (!g) return still_fail(err, STILL_E_ARG, "gdn backward: no gradient buffers");
    return gdn_backward_run(c, params, io, dout, g->dparams, g, err);
}

/* The output gate's matrix and bias (attn_kind.x_gate). */
static int gdn_x_gate(const attn_config *c, const float *params, const float **Wg, const float **bg) {
    *Wg = *bg = NULL;
    if (!params || c->n_head <= 0 || c->n_head_kv <= 0 || c->d_model <= 0 || c->head_dim <= 0) return 0;
    *Wg = params + gdn_par_wg(c->n_head_kv, c->d_model, c->head_dim);
    *bg = params + gdn_par_bg(c->n_head, c->n_head_kv, c->d_model, c->head_dim);
    return 1;
}

const attn_kind attn_kind_gdn = {
    .name = "gdn", .needs_nope = 1, .needs_x = 1, .param_count = gdn_param_count, .param_init = gdn_param_init,
    .state_create = gdn_create, .state_free = gdn_free, .state_truncate = gdn_truncate, .state_bytes = gdn_bytes,
    .state_regions = gdn_regions,
    .forward = gdn_forward, .backward = gdn_backward, .backward_inputs = gdn_backward_inputs, .x_gate = gdn_x_gate,
};
