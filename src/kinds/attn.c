/* The registry of attention kinds. */
#include "kinds/attn.h"
#include "common/common.h"

#include <stdlib.h>
#include <string.h>

extern const attn_kind attn_kind_softmax, attn_kind_swa;
extern const attn_kind attn_kind_lolcats, attn_kind_liger;
extern const attn_kind attn_kind_still, attn_kind_gdn, attn_kind_dsa;

static const attn_kind *const KINDS[ATTN_KIND_COUNT] = {
    [ATTN_SOFTMAX] = &attn_kind_softmax,
    [ATTN_SWA] = &attn_kind_swa,
    [ATTN_LOLCATS] = &attn_kind_lolcats,
    [ATTN_LIGER] = &attn_kind_liger,
    [ATTN_STILL] = &attn_kind_still,
    [ATTN_GDN] = &attn_kind_gdn,
    [ATTN_DSA] = &attn_kind_dsa,
};

const attn_kind *attn_kind_get(attn_kind_id id) {
    return (unsigned)id < ATTN_KIND_COUNT ? KINDS[id] : NULL;
}

const attn_kind *attn_kind_find(const char *name, attn_kind_id *id) {
    for (int i = 0; i < ATTN_KIND_COUNT; i++)
        if (KINDS[i] && !strcmp(KINDS[i]->name, name)) {
            if (id) *id = (attn_kind_id)i;
            return KINDS[i];
        }
    return NULL;
}

/* The plan's names (GGUF metadata and command-line flags), one table each: index = the enum's value. */
static const char *const ROUTING_NAMES[] = {"saliency", "random", "keynorm", "qk", "position", "none"};
static const char *const FMAP_NAMES[] = {"npmap", "hedgehog"};
static const char *const SELECTION_NAMES[] = {"chunk", "global"};

static int name_index(const char *const *names, int n, const char *s) {
    for (int i = 0; s && i < n; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

const char *attn_routing_name(attn_routing r) {
    return (unsigned)r < sizeof ROUTING_NAMES / sizeof ROUTING_NAMES[0] ? ROUTING_NAMES[r] : NULL;
}
int attn_routing_parse(const char *s, attn_routing *out) {
    const int i = name_index(ROUTING_NAMES, (int)(sizeof ROUTING_NAMES / sizeof ROUTING_NAMES[0]), s);
    if (i >= 0) *out = (attn_routing)i;
    return i < 0 ? -1 : 0;
}
const char *attn_feature_map_name(attn_feature_map f) {
    return (unsigned)f < sizeof FMAP_NAMES / sizeof FMAP_NAMES[0] ? FMAP_NAMES[f] : NULL;
}
int attn_feature_map_parse(const char *s, attn_feature_map *out) {
    const int i = name_index(FMAP_NAMES, (int)(sizeof FMAP_NAMES / sizeof FMAP_NAMES[0]), s);
    if (i >= 0) *out = (attn_feature_map)i;
    return i < 0 ? -1 : 0;
}
const char *attn_selection_name(int sel_global) { return SELECTION_NAMES[sel_global != 0]; }
int attn_selection_parse(const char *s, int *sel_global) {
    const int i = name_index(SELECTION_NAMES, 2, s);
    if (i >= 0) *sel_global = i;
    return i < 0 ? -1 : 0;
}

/* dout = scale · 2 (y - target) / n, and the mean squared error. */
double attn_mse_grad(const float *y, const float *target, size_t n, float scale, float *dout) {
    double s = 0;
    const float f = n ? 2.0f * scale / (float)n : 0.0f;
    for (size_t i = 0; i < n; i++) {
        const float d = y[i] - target[i];
        s += (double)d * d;
        if (dout) dout[i] = f * d;
    }
    return n ? s / (double)n : 0.0;
}

int attn_distill(const attn_kind *k, const attn_config *c, const float *params, const attn_io *io,
                 const float *target, float scale, float *dparams, double *mse, still_err *err) {
    if (!io || !target || !mse) return still_fail(err, STILL_E_ARG, "attn_distill: io, target and mse are required");
    if (io->p0 != 0) return still_fail(err, STILL_E_ARG, "attn_distill needs a whole sequence (p0 = 0)");
    if (dparams && !k->backward)
        return still_fail(err, STILL_E_UNSUPPORTED, "attention kind '%s' has no trainable parameters", k->name);
    if (k->distill) return k->distill(c, params, io, target, scale, dparams, mse, err);
    return attn_distill_output(k, c, params, io, target, scale, dparams, mse, err);
}

int attn_distill_output(const attn_kind *k, const attn_config *c, const float *params, const attn_io *io,
                        const float *target, float scale, float *dparams, double *mse, still_err *err) {
    const size_t n = (size_t)io->T * (size_t)c->n_head * (size_t)c->head_dim;
    float *y = malloc(sizeof(float) * (n ? n : 1));
    if (!y) return still_fail(err, STILL_E_NOMEM, "out of memory");
    attn_config cc = *c;
    if (cc.n_ctx < io->T) cc.n_ctx = io->T;
    attn_state *st = NULL;
    int rc = k->state_create(&cc, &st, err);
    if (!rc) rc = k->forward(st, params, io, y, err);
    if (st) k->state_free(st);
    if (!rc) {
        *mse = attn_mse_grad(y, target, n, scale, dparams ? y : NULL);
        if (dparams) rc = k->backward(&cc, params, io, y, dparams, err);
    }
    free(y);
    return rc;
}
