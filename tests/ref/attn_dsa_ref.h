/* The dsa kind's forward computed the slow, obvious way (tests/ref/, library still_test_ref): float64, token by
 * token, from ../shared/spec/attention.md ("dsa") and the rules of src/kinds/dsa/attn_dsa_rules.h. Not part of
 * still_core. */
#ifndef STILL_TEST_ATTN_DSA_REF_H
#define STILL_TEST_ATTN_DSA_REF_H

#include "kinds/attn.h"

/* y [T][H*D] for the whole sequence io (p0 = 0): for every query t the indexer score of every earlier position,
 * the selection (the local window, then the best of the older positions by a full sort), the softmax over the
 * selected keys per head and the gate. Parameters in double (finite differences move them finely). sel_out: NULL,
 * or [T][topk] the selected positions of each query ascending (−1 past its count); sel_in: NULL, or such a table
 * used instead of the indexer's (the selection held fixed, as training treats it). */
void attn_dsa_forward_ref(const attn_config *c, const double *params, const attn_io *io, double *y, int *sel_out,
                          const int *sel_in);

/* The indexer's stage-1 loss (src/kinds/dsa/attn_dsa.c's dsa_indexer_loss) in float64: for every query with older
 * positions (t >= DSA_LOCAL), the teacher's head-summed softmax restricted to them and renormalised, p, the indexer's
 * softmax over them, r, and KL(p || r); their mean. */
double attn_dsa_indexer_kl_ref(const attn_config *c, const double *params, const attn_io *io);

#endif
