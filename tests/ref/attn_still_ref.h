/* Test-only references of the attention kinds (tests/ref/, library still_test_ref): slow, obviously correct
 * float64 implementations that the unit tests compare the library's fast paths with. Not part of still_core;
 * include/still.h and src/kinds/attn.h know nothing of them. */
#ifndef STILL_TEST_ATTN_STILL_REF_H
#define STILL_TEST_ATTN_STILL_REF_H

#include "kinds/attn.h"

/* The still kind's stage-1 backward computed the slow, obvious way (float64, token by token, one query head at a
 * time): for a whole sequence io (p0 = 0, T <= n_ctx) and the gradient dout [T][H*D] of the loss with respect to
 * the forward's output, dparams += the gradient with respect to the kind's parameters (param_count floats), the
 * same quantity as attn_kind_still.backward (the fast float32 one training uses). Selection is a fixed routing
 * decision: the library's float forward run once with its recorder (attn_still_record_selection), so both
 * backwards use exactly the tokens the forward selects. Parallel over query heads (OpenMP; each head owns its
 * slices of dparams, so the result does not depend on the thread count). */
int attn_still_backward_ref(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                            float *dparams, still_err *err);

#endif
