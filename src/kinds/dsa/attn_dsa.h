/* The dsa kind's entry points beyond the attn_kind table (src/kinds/dsa/attn_dsa.c). */
#ifndef STILL_ATTN_DSA_H
#define STILL_ATTN_DSA_H

#include "kinds/attn.h"

/* The indexer's stage-1 loss for the whole sequence io (p0 = 0; q and k the teacher's, after RoPE; x the layer
 * input): the mean over queries with older positions of KL(teacher || indexer) over the positions before the local
 * window (src/kinds/dsa/attn_dsa.c), into *kl; with dparams, scale times its gradient (the indexer's parameters
 * only) added into it. */
int attn_dsa_indexer_loss(const attn_config *c, const float *params, const attn_io *io, float scale, float *dparams,
                          double *kl, still_err *err);

#endif
