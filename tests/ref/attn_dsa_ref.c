/* The dsa kind's float64 reference (attn_dsa_ref.h). */
#include "attn_dsa_ref.h"
#include "kinds/dsa/attn_dsa_rules.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double score;
    int pos;
} scored;

/* The larger score first; ties: the later position. */
static int by_rank(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->pos < y->pos) - (x->pos > y->pos);
}

static int by_pos(const void *a, const void *b) { return (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b); }

void attn_dsa_forward_ref(const attn_config *c, const double *P, const attn_io *io, double *y, int *sel_out,
                          const int *sel_in) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, d = c->d_model, T = io->T;
    const int HI = c->index_heads, dI = c->index_dim, K = c->topk, HD = H * D, kvd = Hk * D;
    const double *WqI = P + dsa_par_wq(), *WkI = P + dsa_par_wk(HI, dI, d), *Ww = P + dsa_par_ww(HI, dI, d);
    const double *bw = P + dsa_par_bw(HI, dI, d), *Wg = P + dsa_par_wg(HI, dI, d), *bg = P + dsa_par_bg(HI, dI, d, H, D);
    double *kI = malloc(sizeof(double) * (size_t)T * dI), *qI = malloc(sizeof(double) * (size_t)HI * dI);
    double *w = malloc(sizeof(double) * HI), *pr = malloc(sizeof(double) * (size_t)T);
    scored *cand = malloc(sizeof(scored) * (size_t)T);
    int *sel = malloc(sizeof(int) * (size_t)T);
    for (int s = 0; s < T; s++)   /* k^I_s = W_kI x_s */
        for (int i = 0; i < dI; i++) {
            double a = 0;
            for (int e = 0; e < d; e++) a += WkI[(size_t)i * d + e] * io->x[(size_t)s * d + e];
            kI[(size_t)s * dI + i] = a;
        }
    for (int t = 0; t < T; t++) {
        const float *x = io->x + (size_t)t * d;
        int ns = 0;
        if (sel_in) {
            while (ns < K && sel_in[(size_t)t * K + ns] >= 0) sel[ns] = sel_in[(size_t)t * K + ns], ns++;
        } else if (t + 1 <= K) {
            for (int s = 0; s <= t; s++) sel[ns++] = s;
        } else {
            for (int r = 0; r < HI * dI; r++) {
                double a = 0;
                for (int e = 0; e < d; e++) a += WqI[(size_t)r * d + e] * x[e];
                qI[r] = a;
            }
            for (int j = 0; j < HI; j++) {
                double a = bw[j];
                for (int e = 0; e < d; e++) a += Ww[(size_t)j * d + e] * x[e];
                w[j] = a;
            }
            const int old = t + 1 - DSA_LOCAL;
            for (int s = 0; s < old; s++) {   /* I_{t,s} = Σ_j w_j ReLU(q^I_j · k^I_s) */
                double I = 0;
                for (int j = 0; j < HI; j++) {
                    double dot = 0;
                    for (int i = 0; i < dI; i++) dot += qI[(size_t)j * dI + i] * kI[(size_t)s * dI + i];
                    I += w[j] * (dot > 0 ? dot : 0);
                }
                cand[s] = (scored){I, s};
            }
            qsort(cand, (size_t)old, sizeof(scored), by_rank);
            for (int i = 0; i < K - DSA_LOCAL; i++) sel[ns++] = cand[i].pos;
            for (int s = old; s <= t; s++) sel[ns++] = s;
            qsort(sel, (size_t)ns, sizeof(int), by_pos);
        }
        if (sel_out)
            for (int i = 0; i < K; i++) sel_out[(size_t)t * K + i] = i < ns ? sel[i] : -1;
        for (int h = 0; h < H; h++) {
            const int hk = h / G;
            const float *q = io->q + (size_t)t * HD + (size_t)h * D;
            double mx = -INFINITY, l = 0;
            for (int i = 0; i < ns; i++) {
                double z = 0;
                for (int e = 0; e < D; e++) z += (double)q[e] * io->k[(size_t)sel[i] * kvd + (size_t)hk * D + e];
                pr[i] = z / sqrt((double)D);
                mx = pr[i] > mx ? pr[i] : mx;
            }
            for (int i = 0; i < ns; i++) pr[i] = exp(pr[i] - mx), l += pr[i];
            for (int e = 0; e < D; e++) {
                double o = 0;
                for (int i = 0; i < ns; i++) o += pr[i] * io->v[(size_t)sel[i] * kvd + (size_t)hk * D + e];
                const int r = h * D + e;
                double g = bg[r];
                for (int u = 0; u < d; u++) g += Wg[(size_t)r * d + u] * x[u];
                y[(size_t)t * HD + r] = o / l / (1.0 + exp(-g));
            }
        }
    }
    free(kI), free(qI), free(w), free(pr), free(cand), free(sel);
}

double attn_dsa_indexer_kl_ref(const attn_config *c, const double *P, const attn_io *io) {
    const int H = c->n_head, Hk = c->n_head_kv, D = c->head_dim, G = H / Hk, d = c->d_model, T = io->T;
    const int HI = c->index_heads, dI = c->index_dim, HD = H * D, kvd = Hk * D;
    const double *WqI = P + dsa_par_wq(), *WkI = P + dsa_par_wk(HI, dI, d), *Ww = P + dsa_par_ww(HI, dI, d);
    const double *bw = P + dsa_par_bw(HI, dI, d);
    if (T <= DSA_LOCAL) return 0;
    double *kI = malloc(sizeof(double) * (size_t)T * dI), *qI = malloc(sizeof(double) * (size_t)HI * dI);
    double *w = malloc(sizeof(double) * HI), *p = malloc(sizeof(double) * T), *r = malloc(sizeof(double) * T);
    double *z = malloc(sizeof(double) * T);
    for (int s = 0; s < T; s++)
        for (int i = 0; i < dI; i++) {
            double a = 0;
            for (int e = 0; e < d; e++) a += WkI[(size_t)i * d + e] * io->x[(size_t)s * d + e];
            kI[(size_t)s * dI + i] = a;
        }
    double total = 0;
    for (int t = DSA_LOCAL; t < T; t++) {
        const int old = t + 1 - DSA_LOCAL;
        const float *x = io->x + (size_t)t * d;
        for (int s = 0; s < old; s++) p[s] = 0;
        for (int h = 0; h < H; h++) {
            double mx = -INFINITY, l = 0;
            for (int s = 0; s <= t; s++) {
                double a = 0;
                for (int e = 0; e < D; e++)
                    a += (double)io->q[(size_t)t * HD + (size_t)h * D + e] * io->k[(size_t)s * kvd + (size_t)(h / G) * D + e];
                z[s] = a / sqrt((double)D);
                mx = z[s] > mx ? z[s] : mx;
            }
            for (int s = 0; s <= t; s++) l += exp(z[s] - mx);
            for (int s = 0; s < old; s++) p[s] += exp(z[s] - mx) / l;
        }
        double ps = 0;
        for (int s = 0; s < old; s++) ps += p[s];
        for (int r2 = 0; r2 < HI * dI; r2++) {
            double a = 0;
            for (int e = 0; e < d; e++) a += WqI[(size_t)r2 * d + e] * x[e];
            qI[r2] = a;
        }
        for (int j = 0; j < HI; j++) {
            double a = bw[j];
            for (int e = 0; e < d; e++) a += Ww[(size_t)j * d + e] * x[e];
            w[j] = a;
        }
        double mx = -INFINITY, l = 0;
        for (int s = 0; s < old; s++) {
            double I = 0;
            for (int j = 0; j < HI; j++) {
                double dot = 0;
                for (int i = 0; i < dI; i++) dot += qI[(size_t)j * dI + i] * kI[(size_t)s * dI + i];
                I += w[j] * (dot > 0 ? dot : 0);
            }
            r[s] = I;
            mx = I > mx ? I : mx;
        }
        for (int s = 0; s < old; s++) l += exp(r[s] - mx);
        for (int s = 0; s < old; s++) {
            const double ps_ = p[s] / ps, lr = r[s] - mx - log(l);
            if (ps_ > 0) total += ps_ * (log(ps_) - lr);
        }
    }
    free(kI), free(qI), free(w), free(p), free(r), free(z);
    return total / (T - DSA_LOCAL);
}
