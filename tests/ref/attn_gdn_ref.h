/* The gdn kind's forward computed the slow, obvious way (tests/ref/, library still_test_ref): float64, token by
 * token, straight from ../shared/spec/attention.md ("gdn"). Not part of still_core. */
#ifndef STILL_TEST_ATTN_GDN_REF_H
#define STILL_TEST_ATTN_GDN_REF_H

#include "kinds/attn.h"

/* y [T][H*D] for the whole sequence io (p0 = 0) of a fresh state: per KV head the matrix S (D × D, S[v][k]) is
 * updated as written in the spec, S ← α S (I − β k̂ k̂ᵀ) + β v k̂ᵀ (the product with the explicit matrix
 * I − β k̂ k̂ᵀ), o = S q̂, then the output's RMSNorm and gate. The parameters (in double, so that finite
 * differences can move them finely) in attn_gdn_rules.h's layout; with c->conv > 0, q, k and v first pass the
 * short convolution. */
void attn_gdn_forward_ref(const attn_config *c, const double *params, const attn_io *io, double *y);

#endif
