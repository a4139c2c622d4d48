/* The softmax kind (full causal attention: the teacher and the baseline) and
 * the swa kind (the same restricted to a sliding window of W keys), tiled
 * with an online softmax so memory is O(L·D): no L×L matrix is formed.
 *
 * For a work item (one KV head, a block of query tokens and the G query heads
 * that share the KV head) and each key block b of ATT_BLOCK keys:
 *   S = Q Kbᵀ / sqrt(D)                   (rows × ATT_BLOCK, causal/window mask)
 *   m' = max(m, rowmax S);  P = exp(S - m')
 *   l = l·e^(m-m') + rowsum P;  O = O·e^(m-m') + P Vb
 * and finally out = O / l.
 *
 * State (per layer, per KV head): keys in blocks of ATT_BLOCK positions
 * stored transposed, [block][D][ATT_BLOCK], so a query row times a key block
 * is D vector multiply-adds over keys; values [position][D]. softmax keeps
 * every position (the cache grows with the context); swa keeps a ring of
 * blocks just large enough for the window, so its state is fixed.
 *
 * Training (stage 2): attn_softmax_grad (declared in attn_softmax.h, also
 * used by liger for its window) gives the gradients of q, k and v; see
 * "Backward" below. */
#include "kinds/attn_rules.h"
#include "kinds/softmax/attn_softmax.h"

#include "kinds/attn.h"
#include "common/common.h"
#include "cpu/vecmath.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS_MAX = 48 };   /* query rows per work item: O stays in L1/L2 */

typedef struct {
    int n_blocks;         /* blocks in the ring (softmax: enough for n_ctx, never wraps) */
    int window;           /* 0: unlimited (softmax) */
    float *k, *v;         /* [Hk][n_blocks][D][ATT_BLOCK], [Hk][n_blocks * ATT_BLOCK][D] */
    float *scratch;       /* per-thread O, m, l */
    int scratch_threads;
} kv_ring;

static int rows_per_item(const attn_config *c) {
    int G = c->n_head / c->n_head_kv;
    return G > ROWS_MAX ? G : ROWS_MAX / G * G;
}

static size_t scratch_floats(const attn_config *c) { return (size_t)rows_per_item(c) * ((size_t)c->head_dim + 2); }

static size_t ring_floats(const attn_config *c, const kv_ring *r) {
    return (size_t)c->n_head_kv * (size_t)r->n_blocks * ATT_BLOCK * (size_t)c->head_dim;
}

/* The keys and values a later call reads: softmax's ring never wraps, so the blocks up to n_seen per KV head; a
 * sliding window's whole ring. */
static int ring_regions(attn_state *s, attn_region *out, int max) {
    const attn_config *c = &s->cfg;
    kv_ring *r = s->impl;
    const int Hk = c->n_head_kv, D = c->head_dim;
    if (max < 2 * Hk) return -1;
    int blocks = (s->n_seen + ATT_BLOCK - 1) / ATT_BLOCK;
    if (r->window > 0 || blocks > r->n_blocks) blocks = r->n_blocks;
    const size_t per_hk = (size_t)r->n_blocks * D * ATT_BLOCK, used = (size_t)blocks * D * ATT_BLOCK;
    for (int hk = 0; hk < Hk; hk++) {
        out[2 * hk] = (attn_region){r->k + (size_t)hk * per_hk, used * sizeof(float)};
        out[2 * hk + 1] = (attn_region){r->v + (size_t)hk * per_hk, used * sizeof(float)};
    }
    return 2 * Hk;
}

/* Store keys and values of tokens at positions p0 .. p0+T-1. */
static void ring_store(const attn_config *c, kv_ring *r, int p0, int T, const float *k, const float *v) {
    const int D = c->head_dim, Hk = c->n_head_kv, kvd = Hk * D;
    for (int t = 0; t < T; t++) {
        int pos = p0 + t, blk = (pos / ATT_BLOCK) % r->n_blocks, j = pos % ATT_BLOCK;
        for (int hk = 0; hk < Hk; hk++) {
            const float *kt = k + (size_t)t * kvd + (size_t)hk * D;
            float *kb = r->k + ((size_t)hk * r->n_blocks + blk) * (size_t)D * ATT_BLOCK;
            for (int d = 0; d < D; d++) kb[(size_t)d * ATT_BLOCK + j] = kt[d];
            memcpy(r->v + (((size_t)hk * r->n_blocks + blk) * ATT_BLOCK + j) * D, v + (size_t)t * kvd + (size_t)hk * D,
                   sizeof(float) * (size_t)D);
        }
    }
}

/* One work item: query tokens t0..t1-1 (positions p0+t), KV head hk. Always
 * inlined so a constant head dimension D unrolls the inner loops and keeps
 * the output row in registers. */
static inline __attribute__((always_inline)) void
attend_item_d(const attn_config *c, const kv_ring *r, const float *q, int p0, int t0, int t1, int hk, float *out,
              float *scratch, const int D) {
    const int H = c->n_head, G = H / c->n_head_kv, qd = H * D, W = r->window;
    const int rows = (t1 - t0) * G;
    const float scale = attn_logit_scale(D);
    float *O = scratch;                          /* rows × D */
    float *m = O + (size_t)rows * D, *l = m + rows;
    for (int i = 0; i < rows; i++) m[i] = -INFINITY, l[i] = 0;
    memset(O, 0, sizeof(float) * (size_t)rows * D);

    const float *kh = r->k + (size_t)hk * r->n_blocks * (size_t)D * ATT_BLOCK;
    const float *vh = r->v + (size_t)hk * r->n_blocks * ATT_BLOCK * (size_t)D;
    const int first_pos = p0 + t0, last_pos = p0 + t1 - 1;
    const int lo_pos = attn_window_first(first_pos, W);
    for (int b = lo_pos / ATT_BLOCK; b * ATT_BLOCK <= last_pos; b++) {
        const int slot = b % r->n_blocks;
        const float *kb = kh + (size_t)slot * D * ATT_BLOCK;
        const float *vb = vh + (size_t)slot * ATT_BLOCK * D;
        const int base = b * ATT_BLOCK;
        for (int i = 0; i < rows; i++) {
            const int t = t0 + i / G, h = hk * G + i % G, pos = p0 + t;
            /* keys j of this block with lo <= base + j <= pos */
            int j_lo = attn_window_first(pos, W) - base, j_hi = pos - base + 1;
            if (j_lo < 0) j_lo = 0;
            if (j_hi > ATT_BLOCK) j_hi = ATT_BLOCK;
            if (j_lo >= j_hi) continue;
            const float *qr = q + (size_t)t * qd + (size_t)h * D;
            float acc[ATT_BLOCK] = {0}, sr[ATT_BLOCK];
            for (int d = 0; d < D; d++) {
                const float qv = qr[d];
                const float *kd = kb + (size_t)d * ATT_BLOCK;
#pragma omp simd
                for (int j = 0; j < ATT_BLOCK; j++) acc[j] += qv * kd[j];
            }
            /* Scores; keys outside [j_lo, j_hi) are masked to -inf, which
             * vec_expf maps to exactly 0. */
            for (int j = 0; j < ATT_BLOCK; j++) sr[j] = j >= j_lo && j < j_hi ? acc[j] * scale : -INFINITY;
            /* Row max as a fixed tree (element-wise maxima vectorize without
             * a floating-point reduction). */
            float t16[16];
            for (int k = 0; k < 16; k++) {
                float a = sr[k] > sr[k + 16] ? sr[k] : sr[k + 16];
                float bb = sr[k + 32] > sr[k + 48] ? sr[k + 32] : sr[k + 48];
                t16[k] = a > bb ? a : bb;
            }
            float mx = m[i];
            for (int k = 0; k < 16; k++) mx = t16[k] > mx ? t16[k] : mx;
            const float corr = vec_expf(m[i] - mx);   /* 0 on the first block (m = -inf) */
            float sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < ATT_BLOCK; j++) {
                float p = vec_expf(sr[j] - mx);
                sr[j] = p;
                sum += p;
            }
            m[i] = mx;
            l[i] = l[i] * corr + sum;
            float *orow = O + (size_t)i * D;
            float o[ATT_MAX_HEAD_DIM];
            for (int x = 0; x < D; x++) o[x] = orow[x] * corr;
            for (int j = j_lo; j < j_hi; j++) {
                const float p = sr[j];
                const float *vj = vb + (size_t)j * D;
#pragma omp simd
                for (int x = 0; x < D; x++) o[x] += p * vj[x];
            }
            memcpy(orow, o, sizeof(float) * (size_t)D);
        }
    }
    for (int i = 0; i < rows; i++) {
        const int t = t0 + i / G, h = hk * G + i % G;
        const float inv = 1.0f / l[i];
        float *dst = out + (size_t)t * qd + (size_t)h * D;
        for (int x = 0; x < D; x++) dst[x] = O[(size_t)i * D + x] * inv;
    }
}

static void attend_item_64(const attn_config *c, const kv_ring *r, const float *q, int p0, int t0, int t1, int hk,
                           float *out, float *scratch) {
    attend_item_d(c, r, q, p0, t0, t1, hk, out, scratch, 64);
}

static void attend_item(const attn_config *c, const kv_ring *r, const float *q, int p0, int t0, int t1, int hk,
                        float *out, float *scratch) {
    if (c->head_dim == 64) attend_item_64(c, r, q, p0, t0, t1, hk, out, scratch);
    else attend_item_d(c, r, q, p0, t0, t1, hk, out, scratch, c->head_dim);
}

/* Attention of T queries at p0.. over the ring (their keys already stored). */
static void attend(const attn_config *c, kv_ring *r, const float *q, int p0, int T, float *out) {
    const int G = c->n_head / c->n_head_kv;
    const int tq = rows_per_item(c) / G;   /* query tokens per item */
    const int n_tblk = (T + tq - 1) / tq;
    const int n_items = n_tblk * c->n_head_kv;
    const size_t per_thread = scratch_floats(c);
    int n_threads = omp_get_max_threads() < r->scratch_threads ? omp_get_max_threads() : r->scratch_threads;
    if (n_threads > n_items) n_threads = n_items;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int it = 0; it < n_items; it++) {
        /* Later query blocks see more keys: hand them out first. */
        const int tb = n_tblk - 1 - it / c->n_head_kv, hk = it % c->n_head_kv;
        const int t0 = tb * tq, t1 = t0 + tq < T ? t0 + tq : T;
        attend_item(c, r, q, p0, t0, t1, hk, out, r->scratch + (size_t)omp_get_thread_num() * per_thread);
    }
}

/* ---- Backward (stage 2): gradients of q, k and v ---------------------------
 *
 * For query head h (KV head h / G), token t and its visible keys j (j <= t,
 * and t - W < j for a window W), with s_tj = q_t · k_j / sqrt(D),
 * P_tj = softmax_j(s_tj), y_t = Σ_j P_tj v_j and g_t = dL/dy_t:
 *   dP_tj = g_t · v_j,   Di_t = Σ_j P_tj dP_tj = g_t · y_t,
 *   ds_tj = P_tj (dP_tj - Di_t)                        (softmax Jacobian)
 *   dq_t = Σ_j ds_tj k_j / sqrt(D),   dk_j = Σ_t ds_tj q_t / sqrt(D),
 *   dv_j = Σ_t P_tj g_t,
 * the sums over t running over the G query heads of the KV head as well.
 *
 * Tiled as in FlashAttention-2: tiles of BWD_ROWS queries × ATT_BLOCK keys,
 * every product a BLAS sgemm, never a T × T matrix. Three passes:
 *   1. per query head × query tile: the forward again (online softmax over
 *      the key tiles), keeping per row only the log-sum-exp
 *      λ_t = m_t + log l_t and Di_t = g_t · y_t;
 *   2. per query head × query tile, over the key tiles it sees: the logits
 *      S = Q Kᵀ / sqrt(D), P = exp(S - λ) (already normalised: no second
 *      online pass), dP = G Vᵀ, dS = P ⊙ (dP - Di), dQ += dS K / sqrt(D);
 *   3. per KV head × key tile, over the query tiles of its G query heads
 *      that see it: the same S, P, dS, then dK += dSᵀ Q / sqrt(D) and
 *      dV += Pᵀ G.
 * Passes 2 and 3 both recompute the logits instead of sharing dK, dV between
 * threads: every work item owns the rows it writes, so the result is the
 * same for any thread count and schedule (the sgemm calls run
 * single-threaded inside the parallel loops). Memory: λ and Di [H][T] and
 * per-thread tiles. The incoming gradient is dscale · dout; dscale goes into
 * the sgemm factors (everything is linear in it). */

enum { BWD_ROWS = 64 };   /* query rows per tile */

typedef struct {
    int G, D, T, W;
    int qd, kvd;
    float scale;                          /* 1 / sqrt(D) */
    const float *q, *k, *v, *g;           /* g: dout */
    const float *lse, *di;                /* [H][T] */
} sm_bwd;

static size_t sm_bwd_floats(int D) { return 2 * (size_t)BWD_ROWS * ATT_BLOCK + (size_t)BWD_ROWS * (D + 2); }

static inline int sm_visible(int t, int j, int W) { return attn_key_visible(t, j, W); }

/* First key a query tile starting at t0 sees. */
static inline int sm_first_key(const sm_bwd *b, int t0) { return b->W > 0 && t0 - b->W + 1 > 0 ? t0 - b->W + 1 : 0; }

/* S [nq][ATT_BLOCK] = Q Kᵀ / sqrt(D): query rows t0.. of head h, keys j0.. of its KV head. */
static void sm_logits(const sm_bwd *b, int h, int t0, int nq, int j0, int nk, float *S) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, b->D, b->scale,
                b->q + (size_t)t0 * b->qd + (size_t)h * b->D, b->qd,
                b->k + (size_t)j0 * b->kvd + (size_t)(h / b->G) * b->D, b->kvd, 0.0f, S, ATT_BLOCK);
}

/* Pass 1 for head h, query rows t0 .. t0+nq-1: λ and Di into lse, di (row t at [h][t]). */
static void sm_bwd_stats(const sm_bwd *b, int h, int t0, int nq, float *lse, float *di, float *ws) {
    const int D = b->D, hk = h / b->G, t1 = t0 + nq;
    float *S = ws, *O = S + (size_t)BWD_ROWS * ATT_BLOCK, *m = O + (size_t)BWD_ROWS * D, *l = m + BWD_ROWS;
    for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0;
    memset(O, 0, sizeof(float) * (size_t)nq * D);
    for (int j0 = sm_first_key(b, t0) / ATT_BLOCK * ATT_BLOCK; j0 < t1; j0 += ATT_BLOCK) {
        const int nk = t1 - j0 < ATT_BLOCK ? t1 - j0 : ATT_BLOCK;
        sm_logits(b, h, t0, nq, j0, nk, S);
        for (int i = 0; i < nq; i++) {
            float *row = S + (size_t)i * ATT_BLOCK;
            const int t = t0 + i;
            float mx = -INFINITY;
            for (int j = 0; j < nk; j++)
                if (sm_visible(t, j0 + j, b->W) && row[j] > mx) mx = row[j];
            if (mx == -INFINITY) {   /* no key of this tile is visible to row t */
                for (int j = 0; j < nk; j++) row[j] = 0;
                continue;
            }
            const float mn = m[i] > mx ? m[i] : mx, corr = vec_expf(m[i] - mn);   /* 0 while m = -inf */
            float sum = 0;
            for (int j = 0; j < nk; j++) {
                const float p = sm_visible(t, j0 + j, b->W) ? vec_expf(row[j] - mn) : 0.0f;
                row[j] = p;
                sum += p;
            }
            l[i] = l[i] * corr + sum;
            m[i] = mn;
            float *o = O + (size_t)i * D;
            for (int d = 0; d < D; d++) o[d] *= corr;
        }
        /* O += P V (rows without a visible key are zero) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, D, nk, 1.0f, S, ATT_BLOCK,
                    b->v + (size_t)j0 * b->kvd + (size_t)hk * D, b->kvd, 1.0f, O, D);
    }
    for (int i = 0; i < nq; i++) {
        const float *g = b->g + (size_t)(t0 + i) * b->qd + (size_t)h * D, *o = O + (size_t)i * D;
        float gy = 0;
        for (int d = 0; d < D; d++) gy += g[d] * o[d];
        lse[(size_t)h * b->T + t0 + i] = m[i] + logf(l[i]);
        di[(size_t)h * b->T + t0 + i] = gy / l[i];
    }
}

/* The tile's P (into S, from its logits) and dS (into dP) for head h,
 * query rows t0.., keys j0..: P = exp(S - λ), 0 where not visible;
 * dP = G Vᵀ; dS = P ⊙ (dP - Di). */
static void sm_bwd_tile(const sm_bwd *b, int h, int t0, int nq, int j0, int nk, float *S, float *dP) {
    const int D = b->D;
    sm_logits(b, h, t0, nq, j0, nk, S);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nq, nk, D, 1.0f, b->g + (size_t)t0 * b->qd + (size_t)h * D,
                b->qd, b->v + (size_t)j0 * b->kvd + (size_t)(h / b->G) * D, b->kvd, 0.0f, dP, ATT_BLOCK);
    const float *lse = b->lse + (size_t)h * b->T + t0, *di = b->di + (size_t)h * b->T + t0;
    for (int i = 0; i < nq; i++) {
        float *p = S + (size_t)i * ATT_BLOCK, *ds = dP + (size_t)i * ATT_BLOCK;
        const int t = t0 + i;
        const float lam = lse[i], dii = di[i];
        for (int j = 0; j < nk; j++) {
            const float pj = sm_visible(t, j0 + j, b->W) ? vec_expf(p[j] - lam) : 0.0f;
            p[j] = pj;
            ds[j] = pj * (ds[j] - dii);
        }
    }
}

/* Pass 2 for head h, query rows t0 .. t0+nq-1: dq += dscale · dS K / sqrt(D). */
static void sm_bwd_dq(const sm_bwd *b, int h, int t0, int nq, float dscale, float *dq, float *ws) {
    const int D = b->D, t1 = t0 + nq;
    float *S = ws, *dS = S + (size_t)BWD_ROWS * ATT_BLOCK;
    for (int j0 = sm_first_key(b, t0) / ATT_BLOCK * ATT_BLOCK; j0 < t1; j0 += ATT_BLOCK) {
        const int nk = t1 - j0 < ATT_BLOCK ? t1 - j0 : ATT_BLOCK;
        sm_bwd_tile(b, h, t0, nq, j0, nk, S, dS);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nq, D, nk, dscale * b->scale, dS, ATT_BLOCK,
                    b->k + (size_t)j0 * b->kvd + (size_t)(h / b->G) * D, b->kvd, 1.0f,
                    dq + (size_t)t0 * b->qd + (size_t)h * D, b->qd);
    }
}

/* Pass 3 for KV head hk, keys j0 .. j0+nk-1: dk += dscale · dSᵀ Q / sqrt(D),
 * dv += dscale · Pᵀ G over the query tiles (of its G query heads) that see them. */
static void sm_bwd_dkv(const sm_bwd *b, int hk, int j0, int nk, float dscale, float *dk, float *dv, float *ws) {
    const int D = b->D;
    /* the last query that sees key j0 + nk - 1 (written so a huge W cannot overflow) */
    const int last = b->W > 0 && b->W - 1 < b->T - (j0 + nk) ? j0 + nk - 1 + b->W - 1 : b->T - 1;
    float *S = ws, *dS = S + (size_t)BWD_ROWS * ATT_BLOCK;
    for (int g = 0; g < b->G; g++) {
        const int h = hk * b->G + g;
        for (int t0 = j0 / BWD_ROWS * BWD_ROWS; t0 <= last; t0 += BWD_ROWS) {
            const int nq = b->T - t0 < BWD_ROWS ? b->T - t0 : BWD_ROWS;
            sm_bwd_tile(b, h, t0, nq, j0, nk, S, dS);
            if (dv)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, D, nq, dscale, S, ATT_BLOCK,
                            b->g + (size_t)t0 * b->qd + (size_t)h * D, b->qd, 1.0f,
                            dv + (size_t)j0 * b->kvd + (size_t)hk * D, b->kvd);
            if (dk)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nk, D, nq, dscale * b->scale, dS, ATT_BLOCK,
                            b->q + (size_t)t0 * b->qd + (size_t)h * D, b->qd, 1.0f,
                            dk + (size_t)j0 * b->kvd + (size_t)hk * D, b->kvd);
        }
    }
}

int attn_softmax_grad(const attn_config *c, int window, const attn_io *io, const float *dout, float dscale, float *dq,
                      float *dk, float *dv, still_err *err) {
    if (!c || !io) return still_fail(err, STILL_E_ARG, "softmax backward: no config or inputs");
    if (c->head_dim <= 0 || c->n_head <= 0 || c->n_head_kv <= 0 || c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (io->p0 != 0)
        return still_fail(err, STILL_E_ARG, "attention backward needs a whole sequence (p0 = 0), got p0 = %d", io->p0);
    if (io->T < 0 || io->T > c->n_ctx)
        return still_fail(err, STILL_E_ARG, "attention backward: %d tokens, the context holds %d", io->T, c->n_ctx);
    if (io->T == 0 || (!dq && !dk && !dv)) return STILL_OK;
    if (!io->q || !io->k || !io->v || !dout)
        return still_fail(err, STILL_E_ARG, "attention backward: missing q, k, v or dout");

    const int H = c->n_head, D = c->head_dim, T = io->T;
    sm_bwd b = {.G = H / c->n_head_kv, .D = D, .T = T, .W = window > 0 ? window : 0, .qd = H * D,
                .kvd = c->n_head_kv * D, .scale = attn_logit_scale(D), .q = io->q, .k = io->k, .v = io->v,
                .g = dout};
    const int n_threads = omp_get_max_threads();
    const size_t per_thread = sm_bwd_floats(D);
    float *stats = malloc(sizeof(float) * 2 * (size_t)H * T);
    float *ws = malloc(sizeof(float) * (size_t)n_threads * per_thread);
    if (!stats || !ws) {
        free(stats), free(ws);
        return still_fail(err, STILL_E_NOMEM, "out of memory in the softmax backward");
    }
    float *lse = stats, *di = stats + (size_t)H * T;
    b.lse = lse, b.di = di;
    const int n_qt = (T + BWD_ROWS - 1) / BWD_ROWS, n_kt = (T + ATT_BLOCK - 1) / ATT_BLOCK;
#pragma omp parallel num_threads(n_threads)
    {
        float *w = ws + (size_t)omp_get_thread_num() * per_thread;
        /* later query tiles see more keys: hand them out first */
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < H * n_qt; it++) {
            const int h = it % H, t0 = (n_qt - 1 - it / H) * BWD_ROWS;
            sm_bwd_stats(&b, h, t0, T - t0 < BWD_ROWS ? T - t0 : BWD_ROWS, lse, di, w);
        }
        if (dq) {
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < H * n_qt; it++) {
                const int h = it % H, t0 = (n_qt - 1 - it / H) * BWD_ROWS;
                sm_bwd_dq(&b, h, t0, T - t0 < BWD_ROWS ? T - t0 : BWD_ROWS, dscale, dq, w);
            }
        }
        if (dk || dv) {
            /* earlier key tiles are seen by more queries: first */
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < c->n_head_kv * n_kt; it++) {
                const int hk = it % c->n_head_kv, j0 = it / c->n_head_kv * ATT_BLOCK;
                sm_bwd_dkv(&b, hk, j0, T - j0 < ATT_BLOCK ? T - j0 : ATT_BLOCK, dscale, dk, dv, w);
            }
        }
    }
    free(stats), free(ws);
    return STILL_OK;
}

/* ---- the kinds' interface ------------------------------------------------ */

static size_t no_params(const attn_config *c) {
    (void)c;
    return 0;
}

static void no_init(const attn_config *c, float *params, uint64_t seed) { (void)c, (void)params, (void)seed; }

static int ring_create(const attn_config *c, attn_state **out, still_err *err) {
    *out = NULL;
    if (c->head_dim > ATT_MAX_HEAD_DIM || c->head_dim <= 0 || c->n_head_kv <= 0 || c->n_head % c->n_head_kv)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention shape unsupported (head dim %d, %d heads, %d KV heads)",
                          c->head_dim, c->n_head, c->n_head_kv);
    if (c->kind == ATTN_SWA && c->window <= 0)
        return still_fail(err, STILL_E_ARG, "swa needs a positive window, got %d", c->window);
    attn_state *s = calloc(1, sizeof *s);
    kv_ring *r = calloc(1, sizeof *r);
    if (!s || !r) {
        free(s), free(r);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    s->cfg = *c;
    s->impl = r;
    int full_blocks = (c->n_ctx + ATT_BLOCK - 1) / ATT_BLOCK;
    r->window = c->kind == ATTN_SWA ? c->window : 0;
    /* swa: the window plus one block of new tokens, plus one for alignment. */
    r->n_blocks = c->kind == ATTN_SWA ? (c->window + ATT_BLOCK - 1) / ATT_BLOCK + 2 : full_blocks;
    if (r->n_blocks > full_blocks) r->n_blocks = full_blocks;
    size_t n = ring_floats(c, r);
    r->k = malloc(n * sizeof(float));
    r->v = malloc(n * sizeof(float));
    r->scratch_threads = omp_get_max_threads();
    r->scratch = malloc((size_t)r->scratch_threads * scratch_floats(c) * sizeof(float));
    if (!r->k || !r->v || !r->scratch) {
        free(r->k), free(r->v), free(r->scratch), free(r), free(s);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating the %s cache (%.1f MiB)",
                          c->kind == ATTN_SWA ? "swa" : "KV", 2.0 * n * sizeof(float) / 1048576.0);
    }
    *out = s;
    return STILL_OK;
}

static void ring_free(attn_state *s) {
    if (!s) return;
    kv_ring *r = s->impl;
    if (r) free(r->k), free(r->v), free(r->scratch), free(r);
    free(s);
}

static int ring_truncate(attn_state *s, int n, still_err *err) {
    const kv_ring *r = s->impl;
    /* A ring that never wrapped still holds every position. */
    int wrapped = s->n_seen > r->n_blocks * ATT_BLOCK;
    if (n < 0 || n > s->n_seen || (wrapped && n != 0 && n != s->n_seen))
        return still_fail(err, STILL_E_ARG, "cannot truncate a %d-token %s state to %d tokens", s->n_seen,
                          s->cfg.kind == ATTN_SWA ? "swa" : "softmax", n);
    s->n_seen = n;
    return STILL_OK;
}

static size_t ring_bytes(const attn_state *s) { return 2 * ring_floats(&s->cfg, s->impl) * sizeof(float); }

static int ring_forward(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err) {
    (void)params;
    kv_ring *r = s->impl;
    const attn_config *c = &s->cfg;
    if (io->p0 != s->n_seen)
        return still_fail(err, STILL_E_STATE, "attention state holds %d tokens, input starts at %d", s->n_seen, io->p0);
    if (io->p0 + io->T > c->n_ctx)
        return still_fail(err, STILL_E_STATE, "attention state full (%d + %d > %d tokens)", io->p0, io->T, c->n_ctx);
    const int kvd = c->n_head_kv * c->head_dim, qd = c->n_head * c->head_dim;
    /* A ring that can wrap takes the tokens one block at a time, so keys still
     * inside an earlier query's window are not overwritten before it attends. */
    const int step = r->window > 0 ? ATT_BLOCK : io->T;
    for (int t0 = 0; t0 < io->T; t0 += step) {
        int n = io->T - t0 < step ? io->T - t0 : step;
        ring_store(c, r, io->p0 + t0, n, io->k + (size_t)t0 * kvd, io->v + (size_t)t0 * kvd);
        attend(c, r, io->q + (size_t)t0 * qd, io->p0 + t0, n, out + (size_t)t0 * qd);
    }
    s->n_seen += io->T;
    return STILL_OK;
}

static int softmax_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                                   const attn_grads *g, still_err *err) {
    (void)params;
    if (!g) return still_fail(err, STILL_E_ARG, "softmax backward: no gradient buffers");
    return attn_softmax_grad(c, 0, io, dout, 1.0f, g->dq, g->dk, g->dv, err);
}

static int swa_backward_inputs(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                               const attn_grads *g, still_err *err) {
    (void)params;
    if (!g) return still_fail(err, STILL_E_ARG, "swa backward: no gradient buffers");
    if (c->window <= 0) return still_fail(err, STILL_E_ARG, "swa needs a positive window, got %d", c->window);
    return attn_softmax_grad(c, c->window, io, dout, 1.0f, g->dq, g->dk, g->dv, err);
}

const attn_kind attn_kind_softmax = {
    .name = "softmax", .param_count = no_params, .param_init = no_init, .state_create = ring_create,
    .state_free = ring_free, .state_truncate = ring_truncate, .state_bytes = ring_bytes, .state_regions = ring_regions,
    .forward = ring_forward,
    .backward_inputs = softmax_backward_inputs,
};

const attn_kind attn_kind_swa = {
    .name = "swa", .param_count = no_params, .param_init = no_init, .state_create = ring_create,
    .state_free = ring_free, .state_truncate = ring_truncate, .state_bytes = ring_bytes, .state_regions = ring_regions,
    .forward = ring_forward,
    .backward_inputs = swa_backward_inputs,
};
