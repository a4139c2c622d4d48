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

/* A new layer's indexer from the layer's own projections (plan "ifrom", c->index_from = g >= 0; the shape checked by
 * the plan): indexer head j < G = H / Hk takes W_q's rows of query head g·G + j, the shared indexer key W_k's rows of
 * KV head g, the head weights w_j = 1/G (W_w = 0; the other heads weigh 0), so that the indexer starts as the mean over
 * that KV head's query heads of ReLU(q · k) without RoPE. wq: those G·D rows of W_q [G·D][d], wk: those D rows of W_k
 * [D][d], dequantized; the gate keeps its initialisation. */
void attn_dsa_init_from_projections(const attn_config *c, float *params, const float *wq, const float *wk);

/* Diagnosis (still probe) for the whole sequence io (p0 = 0; q and k after RoPE, v, x the layer input) at the query
 * positions qs [nq]: mass [H], per query head the attention the layer's selection and softmax give the positions
 * keys [nk], mean over the first n_mass queries; *recall, the share of the teacher's best topk − DSA_LOCAL older
 * positions (by its attention summed over the heads) that the indexer selects, and *kept, the share of the teacher's
 * attention on the older positions that the selection keeps, each the mean over the queries that select (more than
 * topk positions; NaN when none does). */
int attn_dsa_explain(const attn_config *c, const float *params, const attn_io *io, const int *qs, int nq, int n_mass,
                     const int *keys, int nk, double *mass, double *recall, double *kept, still_err *err);

#endif
