/* Constants of the tiled softmax attention (softmax and swa kinds), and its
 * backward shared with the kinds that contain a sliding-window softmax. */
#ifndef STILL_ATTN_SOFTMAX_H
#define STILL_ATTN_SOFTMAX_H

#include "kinds/attn.h"

#define ATT_BLOCK 64             /* keys per tile; also the cache's block */
#define ATT_MAX_HEAD_DIM 256     /* checked when a model is loaded */

/* Backward of causal softmax attention over the keys t-window < j <= t
 * (window <= 0: every j <= t) for a whole sequence io (p0 = 0, io->T <= n_ctx;
 * q, k, v after RoPE, GQA as in c): with y the attention output and
 * dscale · dout the gradient of the loss with respect to y, accumulates (+=)
 * the gradients of q, k and v into dq [T][H*D], dk and dv [T][Hk*D] (each
 * may be NULL: not wanted). Tiled (no T×T matrix), parallel inside (OpenMP;
 * call from outside a parallel region), the same result for any thread count. */
int attn_softmax_grad(const attn_config *c, int window, const attn_io *io, const float *dout, float dscale, float *dq,
                      float *dk, float *dv, still_err *err);

#endif
