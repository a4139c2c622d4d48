/* Unit test of the still attention kind's interface (src/kinds/still/attn_still.c):
 * configuration errors, truncation, state size, schedule independence.
 * Agreement with the numpy reference is tests/python/test_attn_still.py. */
#include "kinds/attn.h"
#include "check.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static attn_config base_cfg(void) {
    return (attn_config){
        .kind = ATTN_STILL, .n_head = 4, .n_head_kv = 2, .head_dim = 16, .d_model = 12, .n_ctx = 64, .chunk = 4,
        .feature_dim = 8, .budget = 13, .lambda = 2, .per_kv_head = 0, .routing = ROUTE_SALIENCY, .linear = 1,
        .feature_map = FMAP_NPMAP, .gate = 1, .seed = 3,
    };
}

static int create_fails(attn_config c, int code) {
    const attn_kind *k = attn_kind_get(ATTN_STILL);
    attn_state *s = (attn_state *)1;
    still_err err = {0};
    int rc = k->state_create(&c, &s, &err);
    int one_line = err.msg[0] && !strchr(err.msg, '\n');
    if (!rc) k->state_free(s);
    return rc == code && s == NULL && one_line;
}

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((*s >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

int main(void) {
    const attn_kind *k = attn_kind_find("still", NULL);
    CHECK(k && k == attn_kind_get(ATTN_STILL) && k->needs_x && !k->needs_nope, "still registered");
    if (!k) return CHECK_SUMMARY();

    /* bad configurations */
    attn_config c = base_cfg();
    c.chunk = 0;
    CHECK(create_fails(c, STILL_E_ARG), "chunk 0");
    c = base_cfg(), c.budget = 7;
    CHECK(create_fails(c, STILL_E_ARG), "budget below 2C");
    c = base_cfg(), c.budget = -1;
    CHECK(create_fails(c, STILL_E_ARG), "negative budget");
    c = base_cfg(), c.feature_map = FMAP_HEDGEHOG, c.feature_dim = 0;
    CHECK(create_fails(c, STILL_E_ARG), "hedgehog without F");
    c = base_cfg(), c.routing = (attn_routing)17;
    CHECK(create_fails(c, STILL_E_ARG), "unknown routing");
    c = base_cfg(), c.n_head_kv = 3;
    CHECK(create_fails(c, STILL_E_UNSUPPORTED), "H not a multiple of Hk");
    c = base_cfg(), c.d_model = 0;
    CHECK(create_fails(c, STILL_E_ARG), "gate without d_model");
    c = base_cfg(), c.sel_global = 1, c.budget = 0;
    CHECK(create_fails(c, STILL_E_ARG), "global selection without a budget");
    c = base_cfg(), c.sel_global = 1, c.routing = ROUTE_POSITION;
    CHECK(create_fails(c, STILL_E_ARG), "global selection by position");

    /* parameter count: npmap 2HD + 2HD^2, hedgehog 2HDF, gate HD*d + HD */
    c = base_cfg();
    CHECK(k->param_count(&c) == (size_t)(2 * 64 + 2 * 4 * 256 + 64 * 12 + 64), "npmap + gate params");
    c.feature_map = FMAP_HEDGEHOG, c.gate = 0;
    CHECK(k->param_count(&c) == (size_t)(2 * 4 * 16 * 8), "hedgehog params");

    /* state size: fixed in budget mode, grows in reference mode */
    attn_config big = base_cfg();
    big.n_head = 9, big.n_head_kv = 3, big.head_dim = 64, big.d_model = 576, big.chunk = 64, big.budget = 896,
    big.lambda = -1;
    size_t bytes[3];
    int ctxs[3] = {2048, 8192, 65536};
    for (int i = 0; i < 3; i++) {
        attn_state *s = NULL;
        big.n_ctx = ctxs[i];
        still_err err = {0};
        CHECK(!k->state_create(&big, &s, &err), "create: %s", err.msg);
        bytes[i] = s ? k->state_bytes(s) : 0;
        k->state_free(s);
    }
    CHECK(bytes[0] == bytes[1] && bytes[1] == bytes[2] && bytes[0] > 0, "budget-mode state %zu %zu %zu", bytes[0],
          bytes[1], bytes[2]);
    printf("state bytes per layer (SmolLM2 shape, m=896): %zu\n", bytes[0]);

    /* a sequence: whole, in steps, after truncate(0) — identical bits; a
     * model width below one vector (12) and one with full vectors and a
     * tail (40: the gate's decode path takes four rows at a time); then
     * global selection (its store of 5 evicts from the third leave on),
     * with Sel in f32, f16 and 8 bits */
    const int dms[5] = {12, 40, 12, 40, 12};
    for (int di = 0; di < 5; di++) {
    c = base_cfg();
    const int L = 31, qd = 64, kvd = 32, dm = dms[di];
    c.d_model = dm;
    c.sel_global = di >= 2, c.lambda = di >= 2 ? -1 : c.lambda;
    c.sel_type = di == 3 ? SEL_F16 : di == 4 ? SEL_Q8 : SEL_F32;
    size_t np = k->param_count(&c);
    float *params = malloc(np * sizeof(float)), *q = malloc(sizeof(float) * L * qd), *kk = malloc(sizeof(float) * L * kvd),
          *v = malloc(sizeof(float) * L * kvd), *x = malloc(sizeof(float) * L * dm), *y1 = calloc((size_t)L * qd, 4),
          *y2 = calloc((size_t)L * qd, 4);
    k->param_init(&c, params, 5);
    uint64_t rs = 1;
    for (size_t i = 0; i < np; i++) params[i] += 0.1f * frand(&rs);   /* a gate that is not uniform */
    for (int i = 0; i < L * qd; i++) q[i] = frand(&rs) * 2;
    for (int i = 0; i < L * kvd; i++) kk[i] = frand(&rs) * 2, v[i] = frand(&rs);
    for (int i = 0; i < L * dm; i++) x[i] = frand(&rs);
    attn_state *s = NULL;
    still_err err = {0};
    CHECK(!k->state_create(&c, &s, &err), "create: %s", err.msg);
    if (s) {
        attn_io io = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = L};
        CHECK(!k->forward(s, params, &io, y1, &err), "forward: %s", err.msg);
        CHECK(s->n_seen == L, "n_seen %d", s->n_seen);
        int finite = 1;
        for (int i = 0; i < L * qd; i++) finite &= isfinite(y1[i]) != 0;
        CHECK(finite, "finite outputs");
        /* wrong p0, partial truncation */
        attn_io bad = io;
        bad.p0 = 3, bad.T = 1;
        CHECK(k->forward(s, params, &bad, y2, &err) == STILL_E_STATE, "p0 mismatch");
        CHECK(k->state_truncate(s, 10, &err) == STILL_E_ARG && !strchr(err.msg, '\n'), "partial truncate refused");
        CHECK(!k->state_truncate(s, L, &err) && s->n_seen == L, "truncate to n_seen");
        /* context full */
        attn_io more = {.q = q, .k = kk, .v = v, .x = x, .p0 = L, .T = 64 - L + 1};
        CHECK(k->forward(s, params, &more, y2, &err) == STILL_E_STATE, "context full");
        CHECK(!k->state_truncate(s, 0, &err) && s->n_seen == 0, "truncate to 0");
        /* gate without x */
        attn_io nox = {.q = q, .k = kk, .v = v, .x = NULL, .p0 = 0, .T = 1};
        CHECK(k->forward(s, params, &nox, y2, &err) == STILL_E_ARG, "gate needs x");
        /* T = 0 is a no-op */
        attn_io none = {.q = q, .k = kk, .v = v, .x = x, .p0 = 0, .T = 0};
        CHECK(!k->forward(s, params, &none, y2, &err) && s->n_seen == 0, "T = 0");
        int ok = 1;
        for (int t = 0; t < L && ok; t++) {
            attn_io one = {.q = q + t * qd, .k = kk + t * kvd, .v = v + t * kvd, .x = x + t * dm, .p0 = t, .T = 1};
            ok = !k->forward(s, params, &one, y2 + t * qd, &err);
        }
        CHECK(ok, "steps: %s", err.msg);
        CHECK(!memcmp(y1, y2, sizeof(float) * (size_t)L * qd),
              "single steps give the bits of one call (d_model %d, global %d, Sel type %d)", dm, c.sel_global,
              (int)c.sel_type);
        /* parameters that are all halves (an f16 adapter's): the decode
         * steps read the gate from a half copy, with the bits of one call;
         * then the first parameters again on the same state (a new buffer:
         * the copy is rebuilt, here as "not exact"): the first steps' bits */
        float *ph = malloc(np * sizeof(float)), *y3 = calloc((size_t)L * qd, 4), *y4 = calloc((size_t)L * qd, 4),
              *y5 = calloc((size_t)L * qd, 4);
        for (size_t i = 0; i < np; i++) ph[i] = (float)(_Float16)params[i];
        CHECK(!k->state_truncate(s, 0, &err), "truncate");
        CHECK(!k->forward(s, ph, &io, y3, &err), "forward (halves): %s", err.msg);
        CHECK(!k->state_truncate(s, 0, &err), "truncate");
        ok = 1;
        for (int t = 0; t < L && ok; t++) {
            attn_io one = {.q = q + t * qd, .k = kk + t * kvd, .v = v + t * kvd, .x = x + t * dm, .p0 = t, .T = 1};
            ok = !k->forward(s, ph, &one, y4 + t * qd, &err);
        }
        CHECK(ok && !memcmp(y3, y4, sizeof(float) * (size_t)L * qd),
              "f16 parameters: single steps give the bits of one call (d_model %d, global %d)", dm, c.sel_global);
        CHECK(memcmp(y1, y3, sizeof(float) * (size_t)L * qd), "rounded parameters give other outputs");
        CHECK(!k->state_truncate(s, 0, &err), "truncate");
        ok = 1;
        for (int t = 0; t < L && ok; t++) {
            attn_io one = {.q = q + t * qd, .k = kk + t * kvd, .v = v + t * kvd, .x = x + t * dm, .p0 = t, .T = 1};
            ok = !k->forward(s, params, &one, y5 + t * qd, &err);
        }
        CHECK(ok && !memcmp(y2, y5, sizeof(float) * (size_t)L * qd), "other parameters on the same state: their own bits");
        free(ph), free(y3), free(y4), free(y5);
        k->state_free(s);
    }
    free(params), free(q), free(kk), free(v), free(x), free(y1), free(y2);
    }
    return CHECK_SUMMARY();
}
