/* Tiled causal softmax attention; see attn_softmax.h for the cache layout.
 *
 * For a work item (one KV head, a block of query tokens and the G query heads
 * that share the KV head) and each key block b of ATT_BLOCK keys:
 *   S = Q Kbᵀ / sqrt(D)                   (rows × ATT_BLOCK, causal mask)
 *   m' = max(m, rowmax S);  P = exp(S - m')
 *   l = l·e^(m-m') + rowsum P;  O = O·e^(m-m') + P Vb
 * and finally out = O / l. */
#include "attn_softmax.h"

#include "vecmath.h"

#include <math.h>
#include <omp.h>
#include <string.h>

enum { ROWS_MAX = 48 };   /* query rows per work item: S and O stay in L1/L2 */

size_t attn_cache_floats(const attn_shape *s) {
    return (size_t)s->n_head_kv * (size_t)s->n_blocks * ATT_BLOCK * (size_t)s->head_dim;
}

int attn_rows_per_item(const attn_shape *s) {
    int G = s->n_head / s->n_head_kv;
    return G > ROWS_MAX ? G : ROWS_MAX / G * G;
}

size_t attn_scratch_floats(const attn_shape *s, int rows_max) {
    return (size_t)rows_max * ((size_t)s->head_dim + 2);
}

void attn_cache_store(const attn_shape *s, float *kc, float *vc, int p0, int T, const float *k, const float *v) {
    const int D = s->head_dim, Hk = s->n_head_kv, kvd = Hk * D;
    for (int t = 0; t < T; t++) {
        int pos = p0 + t, blk = pos / ATT_BLOCK, j = pos % ATT_BLOCK;
        for (int hk = 0; hk < Hk; hk++) {
            const float *kt = k + (size_t)t * kvd + (size_t)hk * D;
            float *kb = kc + ((size_t)hk * s->n_blocks + blk) * (size_t)D * ATT_BLOCK;
            for (int d = 0; d < D; d++) kb[(size_t)d * ATT_BLOCK + j] = kt[d];
            memcpy(vc + ((size_t)hk * s->n_blocks * ATT_BLOCK + pos) * D, v + (size_t)t * kvd + (size_t)hk * D,
                   sizeof(float) * (size_t)D);
        }
    }
}

/* One work item: query tokens t0..t1-1, KV head hk. Always inlined so that a
 * constant head dimension D unrolls the inner loops and keeps the output row
 * in registers. */
static inline __attribute__((always_inline)) void
attend_item_d(const attn_shape *s, const float *kc, const float *vc, const float *q, int p0, int t0, int t1, int hk,
              float *out, float *scratch, const int D) {
    const int H = s->n_head, G = H / s->n_head_kv, qd = H * D;
    const int rows = (t1 - t0) * G;
    const float scale = 1.0f / sqrtf((float)D);
    float *O = scratch;                          /* rows × D */
    float *m = O + (size_t)rows * D, *l = m + rows;
    for (int r = 0; r < rows; r++) m[r] = -INFINITY, l[r] = 0;
    memset(O, 0, sizeof(float) * (size_t)rows * D);

    const float *kh = kc + (size_t)hk * s->n_blocks * (size_t)D * ATT_BLOCK;
    const float *vh = vc + (size_t)hk * s->n_blocks * ATT_BLOCK * (size_t)D;
    const int last_pos = p0 + t1 - 1;
    for (int b = 0; b * ATT_BLOCK <= last_pos; b++) {
        const float *kb = kh + (size_t)b * D * ATT_BLOCK;
        const float *vb = vh + (size_t)b * ATT_BLOCK * D;
        const int base = b * ATT_BLOCK;
        for (int r = 0; r < rows; r++) {
            const int t = t0 + r / G, h = hk * G + r % G, pos = p0 + t;
            if (base > pos) continue;                       /* whole block in the future */
            int n_valid = pos - base + 1;
            if (n_valid > ATT_BLOCK) n_valid = ATT_BLOCK;
            const float *qr = q + (size_t)t * qd + (size_t)h * D;
            float sr[ATT_BLOCK];
            float acc[ATT_BLOCK] = {0};
            for (int d = 0; d < D; d++) {
                const float qv = qr[d];
                const float *kd = kb + (size_t)d * ATT_BLOCK;
#pragma omp simd
                for (int j = 0; j < ATT_BLOCK; j++) acc[j] += qv * kd[j];
            }
            /* Scores; keys after the query's position are masked to -inf,
             * which vec_expf maps to exactly 0. */
            for (int j = 0; j < ATT_BLOCK; j++) sr[j] = j < n_valid ? acc[j] * scale : -INFINITY;
            /* Row max as a fixed tree (element-wise maxima vectorize without
             * a floating-point reduction). */
            float t16[16];
            for (int k = 0; k < 16; k++) {
                float a = sr[k] > sr[k + 16] ? sr[k] : sr[k + 16];
                float b = sr[k + 32] > sr[k + 48] ? sr[k + 32] : sr[k + 48];
                t16[k] = a > b ? a : b;
            }
            float mx = m[r];
            for (int k = 0; k < 16; k++) mx = t16[k] > mx ? t16[k] : mx;
            const float corr = vec_expf(m[r] - mx);   /* 0 on the first block (m = -inf) */
            float sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < ATT_BLOCK; j++) {
                float p = vec_expf(sr[j] - mx);
                sr[j] = p;
                sum += p;
            }
            m[r] = mx;
            l[r] = l[r] * corr + sum;
            float *orow = O + (size_t)r * D;
            float o[ATT_MAX_HEAD_DIM];
            for (int i = 0; i < D; i++) o[i] = orow[i] * corr;
            for (int j = 0; j < n_valid; j++) {
                const float p = sr[j];
                const float *vj = vb + (size_t)j * D;
#pragma omp simd
                for (int i = 0; i < D; i++) o[i] += p * vj[i];
            }
            memcpy(orow, o, sizeof(float) * (size_t)D);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int t = t0 + r / G, h = hk * G + r % G;
        const float inv = 1.0f / l[r];
        float *dst = out + (size_t)t * qd + (size_t)h * D;
        for (int i = 0; i < D; i++) dst[i] = O[(size_t)r * D + i] * inv;
    }
}

static void attend_item_64(const attn_shape *s, const float *kc, const float *vc, const float *q, int p0, int t0,
                           int t1, int hk, float *out, float *scratch) {
    attend_item_d(s, kc, vc, q, p0, t0, t1, hk, out, scratch, 64);
}

static void attend_item(const attn_shape *s, const float *kc, const float *vc, const float *q, int p0, int t0,
                        int t1, int hk, float *out, float *scratch) {
    if (s->head_dim == 64) attend_item_64(s, kc, vc, q, p0, t0, t1, hk, out, scratch);
    else attend_item_d(s, kc, vc, q, p0, t0, t1, hk, out, scratch, s->head_dim);
}

void attn_softmax_forward(const attn_shape *s, const float *kc, const float *vc, const float *q, int p0, int T,
                          float *out, float *scratch, int n_threads) {
    const int G = s->n_head / s->n_head_kv;
    const int tq = attn_rows_per_item(s) / G;            /* query tokens per item */
    const int n_tblk = (T + tq - 1) / tq;
    const int n_items = n_tblk * s->n_head_kv;
    const size_t per_thread = attn_scratch_floats(s, attn_rows_per_item(s));
    if (n_threads > n_items) n_threads = n_items;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
    for (int it = 0; it < n_items; it++) {
        /* Later query blocks see more keys: hand them out first. */
        const int tb = n_tblk - 1 - it / s->n_head_kv, hk = it % s->n_head_kv;
        const int t0 = tb * tq, t1 = t0 + tq < T ? t0 + tq : T;
        attend_item(s, kc, vc, q, p0, t0, t1, hk, out, scratch + (size_t)omp_get_thread_num() * per_thread);
    }
}
