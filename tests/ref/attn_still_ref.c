/* The still kind's float64 reference backward (tests only: tests/ref/attn_still_ref.h). It moved here from
 * src/kinds/still/attn_still.c unchanged in its math; the library keeps the fast float32 backward (still_backward), which
 * tests/test_attn_still_grad.c compares with this one, and the inputs' backward (still_backward_inputs).
 *
 * What it shares with the library: the configuration check (attn_still_routing), the forward's selection
 * (attn_still_record_selection: the float forward run once with a recorder) and the parameter layout
 * (src/kinds/still/attn_still_rules.h). Everything else (the feature maps, the gate, the scan) is its own, in double. */
#include "attn_still_ref.h"

#include "kinds/attn.h"
#include "kinds/still/attn_still.h"
#include "kinds/still/attn_still_rules.h"
#include "common/common.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* The forward's constants (src/kinds/still/attn_still.c; spec: ../shared/spec/attention.md, "still"): the float values the
 * forward uses, widened to double where the reference compares or adds them. */
#define DEN_EPS 1e-6f
#define FMAP_CLAMP 1e-12f
#define NORM_FLOOR 1e-12f

/* The parameter layout (src/kinds/still/attn_still_rules.h): head h's map of side 0 (q) or 1 (k), the NP-Map's u, the gate
 * after the maps. */
static int feat_half(const attn_config *c) { return c->feature_map == FMAP_HEDGEHOG ? c->feature_dim : c->head_dim; }
static size_t fmap_params(const attn_config *c) {
    return still_par_fmap_count(c->n_head, c->head_dim, c->feature_dim, c->feature_map == FMAP_HEDGEHOG);
}
static size_t par_w(const attn_config *c, int side, int h) {
    return still_par_w(c->n_head, c->head_dim, c->feature_dim, c->feature_map == FMAP_HEDGEHOG, side, h);
}
static size_t par_u(const attn_config *c, int side, int h) { return still_par_u(c->n_head, c->head_dim, side, h); }

/* Gradient of Σ dout ⊙ y over a whole sequence with respect to the
 * parameters, in double. Every parameter acts through the linear branch
 * (the feature maps on φq, φk; the gate on the linear numerator), so with
 * linear off the gradient is zero. Selection is a fixed routing decision:
 * the backward runs the float forward once with a recorder in leave_chunk,
 * so it uses exactly the tokens the forward selects.
 *
 * Per query head h (parallel over heads; each head owns its slices of
 * dparams), with selection head hs:
 *   sweep 1, chunks in order (the forward's scan, in double): at chunk c >= 2
 *     fold chunk c-2's non-selected tokens into S, z; per token t of chunk c
 *       num = Σ_A e^{s-m} v + g ⊙ a,  a = Sᵀφq,  den = Σ_A e^{s-m} + φq·z + 1e-6
 *       dnum = dy / den, dden = -(dy·y) / den
 *       da = dnum ⊙ g, db = dden, dg = dnum ⊙ a  (g = 1 without the gate)
 *       gate: dpre = dg g (1-g), dWg_row += dpre x_t, dbg_row += dpre
 *       dφq = S da + z db (through the q-map now), and dS_c += φq daᵀ,
 *       dz_c += φq db summed per chunk c;
 *   suffix sums over chunks: R(c) = Σ_{c' >= c} dS_c', and the same for z;
 *   sweep 2: each token j of a chunk cj that left Local (cj + 2 < n chunks)
 *     and was not selected has dφk_j = R(cj+2) v_j + Rz(cj+2) (through the
 *     k-map). Memory per head O((T/C)·P·D); work O(T (2C + |Sel|) D + T P D). */

/* The feature map of head h (side 0: q-map, 1: k-map) of one vector x, in
 * double; phi gets P = 2·Fd entries, clamped at 1e-12. When dphi is given,
 * also back-propagates dphi (the clamped entries pass nothing: a fixed
 * selection of the branch) into gu [D] (NP-Map only) and gW ([D][D] NP-Map,
 * [D][F] Hedgehog). w: 4·max(D, F) + 2 doubles. */
static void fmap_d(const attn_config *c, const float *params, int h, int side, const float *x, double *phi,
                   const double *dphi, double *gu, double *gW, double *w) {
    const int D = c->head_dim, hed = c->feature_map == FMAP_HEDGEHOG, Fd = hed ? c->feature_dim : D;
    double *z = w, *z0 = w + Fd, *xt = z0 + (Fd > D ? Fd : D), *dz = xt + D;
    const float *u = NULL, *W;
    double beta = 0, alpha = 0, nz = 0, sc = 1;
    if (hed) {
        W = params + par_w(c, side, h);
        for (int f = 0; f < Fd; f++) z[f] = 0;
        for (int d = 0; d < D; d++)
            for (int f = 0; f < Fd; f++) z[f] += (double)x[d] * W[(size_t)d * Fd + f];
    } else {
        u = params + par_u(c, side, h);
        W = params + par_w(c, side, h);
        double nx = 0;
        for (int i = 0; i < D; i++) beta += (double)u[i] * u[i], alpha += (double)x[i] * u[i], nx += (double)x[i] * x[i];
        const double f = beta > 0 ? 2.0 * alpha / beta : 0.0;
        for (int i = 0; i < D; i++) xt[i] = x[i] - f * u[i];
        for (int i = 0; i < D; i++) {
            double a = 0;
            for (int j = 0; j < D; j++) a += (double)W[(size_t)i * D + j] * xt[j];
            z0[i] = a, nz += a * a;
        }
        nz = sqrt(nz);
        sc = sqrt(nx) / (nz > (double)NORM_FLOOR ? nz : (double)NORM_FLOOR);
        for (int i = 0; i < D; i++) z[i] = z0[i] * sc;
    }
    /* φ = [softmax(z) ⊕ softmax(-z)] */
    for (int half = 0; half < 2; half++) {
        const double sg = half ? -1.0 : 1.0;
        double mx = -INFINITY, sum = 0;
        for (int f = 0; f < Fd; f++) mx = sg * z[f] > mx ? sg * z[f] : mx;
        for (int f = 0; f < Fd; f++) sum += phi[half * Fd + f] = exp(sg * z[f] - mx);
        for (int f = 0; f < Fd; f++) phi[half * Fd + f] /= sum;
    }
    if (dphi) {
        /* dz through both softmaxes; a clamped entry is a constant */
        for (int f = 0; f < Fd; f++) dz[f] = 0;
        for (int half = 0; half < 2; half++) {
            const double sg = half ? -1.0 : 1.0, *a = phi + half * Fd, *ga = dphi + half * Fd;
            double dot = 0;
            for (int f = 0; f < Fd; f++)
                if (!(a[f] < (double)FMAP_CLAMP)) dot += a[f] * ga[f];
            for (int f = 0; f < Fd; f++) dz[f] += sg * a[f] * ((a[f] < (double)FMAP_CLAMP ? 0.0 : ga[f]) - dot);
        }
        if (hed) {
            for (int d = 0; d < D; d++)
                for (int f = 0; f < Fd; f++) gW[(size_t)d * Fd + f] += (double)x[d] * dz[f];
        } else {
            /* z = z0 ‖x‖ / max(‖z0‖, 1e-12): dz0 = sc (dz - ẑ (ẑ·dz)) above the floor */
            double *dz0 = z;   /* z is no longer needed */
            double pr = 0;
            if (nz > (double)NORM_FLOOR) {
                for (int i = 0; i < D; i++) pr += z0[i] * dz[i];
                pr /= nz * nz;
            }
            for (int i = 0; i < D; i++) dz0[i] = sc * (dz[i] - z0[i] * pr);
            /* z0 = W x̃ */
            double *dxt = dz;   /* dz is no longer needed once dz0 is formed */
            for (int j = 0; j < D; j++) dxt[j] = 0;
            for (int i = 0; i < D; i++)
                for (int j = 0; j < D; j++) {
                    gW[(size_t)i * D + j] += dz0[i] * xt[j];
                    dxt[j] += (double)W[(size_t)i * D + j] * dz0[i];
                }
            /* x̃ = x - 2 (x·u / u·u) u */
            if (beta > 0) {
                double du = 0;
                for (int i = 0; i < D; i++) du += dxt[i] * u[i];
                for (int i = 0; i < D; i++)
                    gu[i] += -2.0 * ((double)x[i] * du / beta + alpha * dxt[i] / beta -
                                     2.0 * alpha * du * u[i] / (beta * beta));
            }
        }
    }
    for (int f = 0; f < 2 * Fd; f++) phi[f] = phi[f] < (double)FMAP_CLAMP ? (double)FMAP_CLAMP : phi[f];
}

/* Doubles of head_bwd's work area. */
static size_t bwd_doubles(const attn_config *c, int T) {
    const size_t D = (size_t)c->head_dim, Fd = (size_t)feat_half(c), P = 2 * Fd, C = (size_t)c->chunk;
    const size_t nc = ((size_t)T + C - 1) / C, dm = c->gate ? (size_t)c->d_model : 0, mx = Fd > D ? Fd : D;
    return nc * P * (D + 1)               /* dS_c, dz_c per chunk (then their suffix sums) */
           + P * (D + 1)                  /* S, z */
           + 2 * (D + D * mx)             /* gu, gW of the q-map and the k-map */
           + D * dm + D                   /* gWg, gbg rows of the head */
           + 2 * C + (size_t)T            /* logits over A(t) */
           + 2 * P + 5 * D + 4 * mx + 2;  /* φ, dφ, Ns, g, a, da, dy; fmap_d's work */
}

/* Query head h's gate for one layer input xt, in double: g[x] = σ(Wg_row · xt + bg_row), rows h·D .. h·D+D-1. */
static void gate_row_d(const attn_config *c, const float *params, int h, const float *xt, double *g) {
    const size_t D = (size_t)c->head_dim, dm = (size_t)c->d_model;
    const float *Wg = params + fmap_params(c), *bg = Wg + (size_t)c->n_head * D * dm;
    for (size_t x = 0; x < D; x++) {
        const size_t row = (size_t)h * D + x;
        double pre = bg[row];
        for (size_t i = 0; i < dm; i++) pre += (double)Wg[row * dm + i] * xt[i];
        g[x] = 1.0 / (1.0 + exp(-pre));
    }
}

static void head_bwd(const attn_config *cfg, const float *params, const attn_io *io, const float *dout, float *dparams,
                     int h, const int *sel_pos, int n_selpos, const unsigned char *rec, double *wk) {
    const int H = cfg->n_head, Hk = cfg->n_head_kv, D = cfg->head_dim, C = cfg->chunk, T = io->T, G = H / Hk;
    const int hk = h / G, hs = cfg->per_kv_head ? hk : h, Fd = feat_half(cfg), P = 2 * Fd, qd = H * D, kvd = Hk * D;
    const int gate = cfg->gate, dm = gate ? cfg->d_model : 0, nc = (T + C - 1) / C, mx = Fd > D ? Fd : D;
    const double scale = 1.0 / sqrt((double)D);
    const unsigned char *picked = rec + (size_t)hs * T;
    double *dSc = wk, *dzc = dSc + (size_t)nc * P * D, *S = dzc + (size_t)nc * P, *z = S + (size_t)P * D;
    double *gqu = z + P, *gku = gqu + D, *gqW = gku + D, *gkW = gqW + (size_t)D * mx;
    double *gWg = gkW + (size_t)D * mx, *gbg = gWg + (size_t)D * dm, *lg = gbg + D;
    double *phi = lg + 2 * C + T, *dphi = phi + P, *Ns = dphi + P, *g = Ns + D, *a = g + D, *da = a + D, *dy = da + D;
    double *fw = dy + D;
    memset(wk, 0, sizeof(double) * (size_t)(fw - wk));

    /* Sweep 1 */
    for (int t = 0; t < T; t++) {
        const int c = t / C;
        if (t == c * C && c >= 2)   /* chunk c-2 leaves Local: fold its non-selected tokens */
            for (int j = (c - 2) * C; j < (c - 1) * C; j++) {
                if (picked[j]) continue;
                const float *kr = io->k + (size_t)j * kvd + (size_t)hk * D, *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
                fmap_d(cfg, params, h, 1, kr, phi, NULL, NULL, NULL, fw);
                for (int p = 0; p < P; p++) {
                    z[p] += phi[p];
                    for (int x = 0; x < D; x++) S[(size_t)p * D + x] += phi[p] * vr[x];
                }
            }
        if (c < 2) continue;   /* no linear term yet: nothing depends on the parameters */
        const float *qv = io->q + (size_t)t * qd + (size_t)h * D, *dr = dout + (size_t)t * qd + (size_t)h * D;
        /* softmax part over A(t) = Local(t) ∪ Sel(t): Sel(t) is the selected
         * tokens of chunks <= c-2, a prefix of sel_pos */
        const int lo = (c - 1) * C;
        int ns = 0;
        while (ns < n_selpos && sel_pos[ns] < (c - 1) * C) ns++;
        int n = 0;
        double m = -INFINITY;
        for (int i = 0; i < ns + t - lo + 1; i++) {
            const int j = i < ns ? sel_pos[i] : lo + (i - ns);
            const float *kr = io->k + (size_t)j * kvd + (size_t)hk * D;
            double s = 0;
            for (int x = 0; x < D; x++) s += (double)qv[x] * kr[x];
            lg[n++] = s *= scale;
            m = s > m ? s : m;
        }
        double Ds = 0;
        for (int x = 0; x < D; x++) Ns[x] = 0;
        for (int i = 0; i < n; i++) {
            const int j = i < ns ? sel_pos[i] : lo + (i - ns);
            const float *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
            const double e = exp(lg[i] - m);
            Ds += e;
            for (int x = 0; x < D; x++) Ns[x] += e * vr[x];
        }
        fmap_d(cfg, params, h, 0, qv, phi, NULL, NULL, NULL, fw);
        double b = 0;
        for (int x = 0; x < D; x++) a[x] = 0;
        for (int p = 0; p < P; p++) {
            b += phi[p] * z[p];
            for (int x = 0; x < D; x++) a[x] += phi[p] * S[(size_t)p * D + x];
        }
        if (gate)
            gate_row_d(cfg, params, h, io->x + (size_t)t * dm, g);
        else
            for (int x = 0; x < D; x++) g[x] = 1.0;
        /* gate_den: per channel den_x = Ds + g_x b + 1e-6, so db = Σ_x dden_x g_x and dg_x gains dden_x b */
        const int gd = gate && cfg->gate_den;
        double db = 0;
        for (int x = 0; x < D; x++) {
            dy[x] = dr[x];
            const double den = Ds + (gd ? g[x] : 1.0) * b + (double)DEN_EPS;
            db -= (gd ? g[x] : 1.0) * dy[x] * (Ns[x] + g[x] * a[x]) / (den * den);
        }
        for (int x = 0; x < D; x++) {
            const double den = Ds + (gd ? g[x] : 1.0) * b + (double)DEN_EPS;
            const double dn = dy[x] / den;
            da[x] = dn * g[x];
            if (gate) {
                const double dden = -dy[x] * (Ns[x] + g[x] * a[x]) / (den * den);
                const double dpre = (dn * a[x] + (gd ? dden * b : 0.0)) * g[x] * (1.0 - g[x]);
                const float *xt = io->x + (size_t)t * dm;
                for (int i = 0; i < dm; i++) gWg[(size_t)x * dm + i] += dpre * xt[i];
                gbg[x] += dpre;
            }
        }
        double *dS = dSc + (size_t)c * P * D, *dz = dzc + (size_t)c * P;
        for (int p = 0; p < P; p++) {
            double s = z[p] * db;
            for (int x = 0; x < D; x++) {
                s += S[(size_t)p * D + x] * da[x];
                dS[(size_t)p * D + x] += phi[p] * da[x];
            }
            dz[p] += phi[p] * db;
            dphi[p] = s;
        }
        fmap_d(cfg, params, h, 0, qv, phi, dphi, gqu, gqW, fw);
    }

    /* Suffix sums over chunks, then sweep 2: the keys folded into S. */
    for (int c = nc - 2; c >= 0; c--) {
        for (size_t i = 0; i < (size_t)P * D; i++) dSc[(size_t)c * P * D + i] += dSc[(size_t)(c + 1) * P * D + i];
        for (int p = 0; p < P; p++) dzc[(size_t)c * P + p] += dzc[(size_t)(c + 1) * P + p];
    }
    for (int j = 0; j < (nc - 2) * C; j++) {   /* chunks cj with cj + 2 < nc */
        if (picked[j]) continue;
        const int c2 = j / C + 2;
        const double *R = dSc + (size_t)c2 * P * D, *Rz = dzc + (size_t)c2 * P;
        const float *kr = io->k + (size_t)j * kvd + (size_t)hk * D, *vr = io->v + (size_t)j * kvd + (size_t)hk * D;
        for (int p = 0; p < P; p++) {
            double s = Rz[p];
            for (int x = 0; x < D; x++) s += R[(size_t)p * D + x] * vr[x];
            dphi[p] = s;
        }
        fmap_d(cfg, params, h, 1, kr, phi, dphi, gku, gkW, fw);
    }

    /* Accumulate into this head's slices of dparams. */
    const size_t Hz = (size_t)H;
    if (cfg->feature_map == FMAP_HEDGEHOG) {
        const size_t WF = (size_t)D * Fd;
        float *dq = dparams + par_w(cfg, 0, h), *dk = dparams + par_w(cfg, 1, h);
        for (size_t i = 0; i < WF; i++) dq[i] += (float)gqW[i], dk[i] += (float)gkW[i];
    } else {
        float *dqu = dparams + par_u(cfg, 0, h), *dku = dparams + par_u(cfg, 1, h);
        for (int i = 0; i < D; i++) dqu[i] += (float)gqu[i], dku[i] += (float)gku[i];
        const size_t DD = (size_t)D * D;
        float *dqW = dparams + par_w(cfg, 0, h), *dkW = dparams + par_w(cfg, 1, h);
        for (size_t i = 0; i < DD; i++) dqW[i] += (float)gqW[i], dkW[i] += (float)gkW[i];
    }
    if (gate) {
        float *dWg = dparams + fmap_params(cfg) + (size_t)h * D * dm, *dbg = dparams + fmap_params(cfg) + Hz * D * dm;
        for (size_t i = 0; i < (size_t)D * dm; i++) dWg[i] += (float)gWg[i];
        for (int x = 0; x < D; x++) dbg[(size_t)h * D + x] += (float)gbg[x];
    }
}

int attn_still_backward_ref(const attn_config *cfg, const float *params, const attn_io *io, const float *dout,
                            float *dparams, still_err *err) {
    int lam = 0, capped = 0, cap = 0;
    int rc = attn_still_routing(cfg, &lam, &capped, &cap, err);
    if (rc) return rc;
    if (!io || !dout || !dparams)
        return still_fail(err, STILL_E_ARG, "still reference backward: io, dout and dparams are required");
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "still reference backward needs a whole sequence (p0 = 0), got p0 = %d",
                          io->p0);
    if (io->T < 0) return still_fail(err, STILL_E_ARG, "still reference backward: negative token count %d", io->T);
    if (io->T > cfg->n_ctx)
        return still_fail(err, STILL_E_ARG, "still reference backward: %d tokens exceed n_ctx %d", io->T, cfg->n_ctx);
    if (io->T == 0) return STILL_OK;
    if (!cfg->linear) return STILL_OK;   /* linear off: no parameter reaches the output */
    if (!io->q || !io->k || !io->v)
        return still_fail(err, STILL_E_ARG, "still reference backward: q, k and v are required");
    if (!params) return still_fail(err, STILL_E_ARG, "still reference backward: parameters required");
    if (cfg->gate && !io->x)
        return still_fail(err, STILL_E_ARG, "still reference backward: the gate needs the layer input x");

    const int T = io->T, H = cfg->n_head, Hs = cfg->per_kv_head ? cfg->n_head_kv : H;
    unsigned char *rec = calloc((size_t)Hs * T, 1);
    int *sel_pos = malloc(sizeof(int) * (size_t)Hs * T), *n_selpos = calloc((size_t)Hs, sizeof(int));
    float *y = malloc(sizeof(float) * (size_t)T * H * cfg->head_dim);
    double *wk = NULL;
    int max_sel = 0;
    if (!rec || !sel_pos || !n_selpos || !y) {
        rc = still_fail(err, STILL_E_NOMEM, "still reference backward: out of memory");
        goto done;
    }
    if ((rc = attn_still_record_selection(cfg, params, io, y, rec, sel_pos, n_selpos, &max_sel, 0, err))) goto done;

    const size_t per = bwd_doubles(cfg, T);
    const int n_thr = omp_get_max_threads() < H ? omp_get_max_threads() : H;
    wk = malloc(sizeof(double) * per * (size_t)n_thr);
    if (!wk) {
        rc = still_fail(err, STILL_E_NOMEM, "still reference backward: out of memory (%.1f MiB)",
                        (double)per * sizeof(double) * n_thr / 1048576.0);
        goto done;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_thr)
    for (int h = 0; h < H; h++) {
        const int hs = cfg->per_kv_head ? h / (H / cfg->n_head_kv) : h;
        head_bwd(cfg, params, io, dout, dparams, h, sel_pos + (size_t)hs * T, n_selpos[hs], rec,
                 wk + (size_t)omp_get_thread_num() * per);
    }
done:
    free(wk), free(rec), free(sel_pos), free(n_selpos), free(y);
    return rc;
}
