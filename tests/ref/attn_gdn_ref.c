/* float64 reference of the gdn kind's forward (attn_gdn_ref.h). */
#include "attn_gdn_ref.h"
#include "kinds/gdn/attn_gdn_rules.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double dot(const double *w, const float *x, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)w[i] * x[i];
    return s;
}

/* x / ‖x‖ (the spec's L2 normalisation; the engine's floor on ‖x‖ matters only for a zero vector) */
static void l2n(const double *x, int n, double *out) {
    double s = 0;
    for (int i = 0; i < n; i++) s += (double)x[i] * x[i];
    const double r = sqrt(s) > GDN_L2_EPS ? sqrt(s) : GDN_L2_EPS;
    for (int i = 0; i < n; i++) out[i] = x[i] / r;
}

void attn_gdn_forward_ref(const attn_config *c, const double *p, const attn_io *io, double *y) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, d = c->d_model, G = H / Hk, T = io->T;
    double *S = calloc((size_t)Hk * D * D, sizeof(double)), *M = malloc(sizeof(double) * (size_t)D * D);
    double *S2 = malloc(sizeof(double) * (size_t)D * D), *k = malloc(sizeof(double) * D), *q = malloc(sizeof(double) * D);
    double *o = malloc(sizeof(double) * D);
    /* q, k, v as the recurrence reads them: through the short convolution (conv = W > 0: channel ch of token t is
     * Σ_j w_c[ch][j] · in[t − W + 1 + j][ch], zero before the sequence), else as given */
    const size_t HD = (size_t)H * D, KD = (size_t)Hk * D, nch = HD + 2 * KD;
    double *in = malloc(sizeof(double) * (size_t)T * nch);
    for (int t = 0; t < T; t++)
        for (size_t ch = 0; ch < nch; ch++) {
            double acc = 0;
            const int W = c->conv > 0 ? c->conv : 1;
            for (int j = 0; j < W; j++) {
                const int u = t - W + 1 + j;
                if (u < 0) continue;
                const double xin = ch < HD ? io->q_nope[(size_t)u * HD + ch]
                                   : ch < HD + KD ? io->k_nope[(size_t)u * KD + ch - HD]
                                                  : io->v[(size_t)u * KD + ch - HD - KD];
                acc += (c->conv > 0 ? p[gdn_par_conv(H, Hk, d, D) + ch * (size_t)W + (size_t)j] : 1.0) * xin;
            }
            in[(size_t)t * nch + ch] = acc;
        }
    for (int t = 0; t < T; t++) {
        const float *x = io->x + (size_t)t * d;
        for (int hk = 0; hk < Hk; hk++) {
            double *Sh = S + (size_t)hk * D * D;
            const double beta = 1.0 / (1.0 + exp(-(dot(p + gdn_par_wbeta(Hk, d) + (size_t)hk * d, x, d) +
                                                   p[gdn_par_bbeta(Hk, d) + hk])));
            const double pre = dot(p + gdn_par_walpha(Hk, d) + (size_t)hk * d, x, d) + p[gdn_par_balpha(Hk, d) + hk];
            const double sp = pre > 30 ? pre : log1p(exp(pre));
            const double alpha = exp(-exp(p[gdn_par_alog(Hk, d) + hk]) * sp);
            l2n(in + (size_t)t * nch + HD + (size_t)hk * D, D, k);
            const double *v = in + (size_t)t * nch + HD + KD + (size_t)hk * D;
            /* M = I − β k kᵀ; S2 = α S M + β v kᵀ */
            for (int i = 0; i < D; i++)
                for (int j = 0; j < D; j++) M[(size_t)i * D + j] = (i == j) - beta * k[i] * k[j];
            for (int a = 0; a < D; a++)
                for (int b = 0; b < D; b++) {
                    double s = 0;
                    for (int m = 0; m < D; m++) s += Sh[(size_t)a * D + m] * M[(size_t)m * D + b];
                    S2[(size_t)a * D + b] = alpha * s + beta * v[a] * k[b];
                }
            memcpy(Sh, S2, sizeof(double) * (size_t)D * D);
            for (int g = 0; g < G; g++) {
                const int h = hk * G + g;
                l2n(in + (size_t)t * nch + (size_t)h * D, D, q);
                double ss = 0;
                for (int a = 0; a < D; a++) {
                    double s = 0;
                    for (int b = 0; b < D; b++) s += Sh[(size_t)a * D + b] * q[b];
                    o[a] = s, ss += s * s;
                }
                const double f = c->norm ? 1.0 / sqrt(ss / D + GDN_NORM_EPS) : 1.0;
                for (int a = 0; a < D; a++) {
                    const size_t row = (size_t)h * D + a;
                    const double gpre = dot(p + gdn_par_wg(Hk, d, D) + row * d, x, d) + p[gdn_par_bg(H, Hk, d, D) + row];
                    y[(size_t)t * H * D + row] = 1.0 / (1.0 + exp(-gpre)) * p[gdn_par_wnorm(Hk, d) + a] * o[a] * f;
                }
            }
        }
    }
    free(S), free(M), free(S2), free(k), free(q), free(o), free(in);
}
