/* Causal softmax attention (the teacher and the baseline), tiled with an
 * online softmax so memory is O(L·D): no L×L matrix is ever formed.
 *
 * KV cache layout, per layer and KV head:
 *   K: blocks of ATT_BLOCK positions stored transposed, [block][D][ATT_BLOCK],
 *      so a query row times a key block is D vector multiply-adds over keys;
 *   V: [position][D].
 * The same kernel serves prefill (many query rows per KV head) and decode
 * (G query heads of one token). */
#ifndef STILL_ATTN_SOFTMAX_H
#define STILL_ATTN_SOFTMAX_H

#include <stddef.h>

#define ATT_BLOCK 64
#define ATT_MAX_HEAD_DIM 256   /* checked when a model is loaded */

typedef struct {
    int n_head, n_head_kv, head_dim;
    int n_blocks;          /* key blocks allocated per KV head (n_ctx rounded up / ATT_BLOCK) */
} attn_shape;

/* Floats of K (or V) cache per layer. */
size_t attn_cache_floats(const attn_shape *s);
/* Scratch floats one thread needs for attn_softmax_forward with up to rows_max query rows. */
size_t attn_scratch_floats(const attn_shape *s, int rows_max);
/* Query rows processed together per work item (bounds rows_max above). */
int attn_rows_per_item(const attn_shape *s);

/* Store the keys and values of T tokens at positions p0.. into one layer's cache.
 * k, v: [T][n_head_kv * head_dim]. */
void attn_cache_store(const attn_shape *s, float *kc, float *vc, int p0, int T, const float *k, const float *v);

/* out[t] = softmax attention of q[t] (position p0 + t) over cached keys 0..p0+t.
 * q, out: [T][n_head * head_dim]. scratch: n_threads * attn_scratch_floats
 * floats. Parallel (OpenMP) over KV heads × blocks of queries. */
void attn_softmax_forward(const attn_shape *s, const float *kc, const float *vc, const float *q, int p0, int T,
                          float *out, float *scratch, int n_threads);

#endif
