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
 * blocks just large enough for the window, so its state is fixed. */
#include "attn_softmax.h"

#include "attn.h"
#include "common.h"
#include "vecmath.h"

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
    const float scale = 1.0f / sqrtf((float)D);
    float *O = scratch;                          /* rows × D */
    float *m = O + (size_t)rows * D, *l = m + rows;
    for (int i = 0; i < rows; i++) m[i] = -INFINITY, l[i] = 0;
    memset(O, 0, sizeof(float) * (size_t)rows * D);

    const float *kh = r->k + (size_t)hk * r->n_blocks * (size_t)D * ATT_BLOCK;
    const float *vh = r->v + (size_t)hk * r->n_blocks * ATT_BLOCK * (size_t)D;
    const int first_pos = p0 + t0, last_pos = p0 + t1 - 1;
    const int lo_pos = W > 0 && first_pos - W + 1 > 0 ? first_pos - W + 1 : 0;
    for (int b = lo_pos / ATT_BLOCK; b * ATT_BLOCK <= last_pos; b++) {
        const int slot = b % r->n_blocks;
        const float *kb = kh + (size_t)slot * D * ATT_BLOCK;
        const float *vb = vh + (size_t)slot * ATT_BLOCK * D;
        const int base = b * ATT_BLOCK;
        for (int i = 0; i < rows; i++) {
            const int t = t0 + i / G, h = hk * G + i % G, pos = p0 + t;
            /* keys j of this block with lo <= base + j <= pos */
            int j_lo = W > 0 ? pos - W + 1 - base : 0, j_hi = pos - base + 1;
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

const attn_kind attn_kind_softmax = {
    .name = "softmax", .param_count = no_params, .param_init = no_init, .state_create = ring_create,
    .state_free = ring_free, .state_truncate = ring_truncate, .state_bytes = ring_bytes, .forward = ring_forward,
};

const attn_kind attn_kind_swa = {
    .name = "swa", .param_count = no_params, .param_init = no_init, .state_create = ring_create,
    .state_free = ring_free, .state_truncate = ring_truncate, .state_bytes = ring_bytes, .forward = ring_forward,
};
