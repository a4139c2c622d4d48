/* The attention plan: made from the command line's settings, read from and
 * written to GGUF, validated (plan.h; the file format in src/model/adapter.c). */
#include "kinds/plan.h"
#include "kinds/dsa/attn_dsa_rules.h"
#include "kinds/gdn/attn_gdn_rules.h"

#include "kinds/still/attn_still_rules.h"
#include "common/common.h"
#include "format/gguf.h"
#include "format/quant.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void plan_free(attn_plan *p) {
    if (p->params)
        for (int l = 0; l < p->n_layer; l++) free(p->params[l]);
    free(p->params);
    free(p->cfg);
    memset(p, 0, sizeof *p);
}

still_attn_params still_attn_default_params(void) {
    still_attn_params p = {
        .kind = "softmax", .window = 64, .chunk = 64, .feature_dim = 64, .budget = 896, .lambda = -1,
        .routing = "saliency", .linear = 1, .feature_map = "npmap", .gate = 1, .seed = 0, .selection = "chunk",
    };
    return p;
}

int plan_derived_lambda(int budget, int chunk, int n_ctx_train) {
    return chunk > 0 && n_ctx_train > 0 ? still_lambda(0, -1, budget, chunk, n_ctx_train) : 0;
}

static int sel_cache_id(const char *store) {
    return !strcmp(store, "q8") ? STILL_SEL_Q8 : !strcmp(store, "f32") ? STILL_SEL_F32 : STILL_SEL_F16;
}

/* ---- per-layer specs: "L", "A-B" items ------------------------------------------ */

/* A layer item of a per-layer spec: "A" or "A-B" at s (b = -1 when the
 * range's end is missing); *end after it (s when there is no number). */
static void layer_range(const char *s, char **end, long *a, long *b) {
    *a = *b = strtol(s, end, 10);
    if (*end != s && **end == '-') {
        const char *t = *end + 1;
        *b = strtol(t, end, 10);
        if (*end == t) *b = -1;
    }
}

/* --layer-budgets: "L=M" or "A-B=M" items separated by commas; out[l] = M
 * for the layers named, untouched elsewhere. */
static int parse_layer_budgets(const char *spec, int n_layer, int *out, still_err *err) {
    const char *s = spec;
    while (*s) {
        char *end;
        long a, b;
        layer_range(s, &end, &a, &b);
        long v = -1;
        if (end != s && *end == '=') {
            const char *t = end + 1;
            v = strtol(t, &end, 10);
            if (end == t) v = -1;
        } else {
            end = (char *)s;
        }
        if (end == s || a < 0 || b < a || b >= n_layer || v < 0 || v > (1 << 22) || (*end && *end != ',') ||
            (*end == ',' && !end[1]))
            return still_fail(err, STILL_E_ARG,
                              "--layer-budgets: expected L=M or A-B=M items (layers 0..%d, budgets 0..%d) separated "
                              "by commas, got '%s'", n_layer - 1, 1 << 22, spec);
        for (long l = a; l <= b; l++) out[l] = (int)v;
        s = *end ? end + 1 : end;
    }
    return STILL_OK;
}

/* --no-linear-layers: "L" or "A-B" items separated by commas; out[l] = 1 for
 * the layers named. */
static int parse_layer_set(const char *spec, int n_layer, char *out, still_err *err) {
    const char *s = spec;
    while (*s) {
        char *end;
        long a, b;
        layer_range(s, &end, &a, &b);
        if (end == s || a < 0 || b < a || b >= n_layer || (*end && *end != ',') || (*end == ',' && !end[1]))
            return still_fail(err, STILL_E_ARG,
                              "--no-linear-layers: expected layers L or ranges A-B (0..%d) separated by commas, got '%s'",
                              n_layer - 1, spec);
        for (long l = a; l <= b; l++) out[l] = 1;
        s = *end ? end + 1 : end;
    }
    return STILL_OK;
}

/* ---- --plan: any mix of kinds per layer --------------------------------------------- */

/* The settings a group of --plan may give its layers, and the kinds that take each. */
typedef struct {
    const char *key;
    size_t off;   /* offsetof(attn_config, ...) */
    int lo, hi;
    unsigned kinds;   /* bit per attn_kind_id */
} plan_key;
#define KB(k) (1u << (k))
static const plan_key PLAN_KEYS[] = {
    {"window", offsetof(attn_config, window), 1, 1 << 22, KB(ATTN_SWA) | KB(ATTN_LIGER)},
    {"chunk", offsetof(attn_config, chunk), 1, 1 << 16, KB(ATTN_LOLCATS) | KB(ATTN_STILL)},
    {"feature_dim", offsetof(attn_config, feature_dim), 1, 4096, KB(ATTN_LOLCATS) | KB(ATTN_STILL)},
    {"budget", offsetof(attn_config, budget), 0, 1 << 22, KB(ATTN_STILL)},
    {"lambda", offsetof(attn_config, lambda), -1, 1 << 16, KB(ATTN_STILL)},
    {"linear", offsetof(attn_config, linear), 0, 1, KB(ATTN_STILL)},
    {"conv", offsetof(attn_config, conv), 0, GDN_CONV_MAX, KB(ATTN_GDN)},
    {"norm", offsetof(attn_config, norm), 0, 1, KB(ATTN_GDN)},
    {"iheads", offsetof(attn_config, index_heads), 1, DSA_MAX_HEADS, KB(ATTN_DSA)},
    {"idim", offsetof(attn_config, index_dim), 1, DSA_MAX_DIM, KB(ATTN_DSA)},
    {"topk", offsetof(attn_config, topk), DSA_LOCAL + 1, 1 << 22, KB(ATTN_DSA)},
    {"ifrom", offsetof(attn_config, index_from), 0, DSA_MAX_HEADS - 1, KB(ATTN_DSA)},
};
#undef KB

/* One group's head "KIND[/key=value...]" (len bytes at h) into g (a copy of base with the kind and settings). */
static int plan_group_head(const char *h, size_t len, const attn_config *base, attn_config *g, still_err *err) {
    char buf[128];
    if (len == 0 || len >= sizeof buf)
        return still_fail(err, STILL_E_ARG, "--plan: a group must start with KIND[/key=value...]: (got '%.*s')",
                          (int)len, h);
    memcpy(buf, h, len);
    buf[len] = 0;
    char *opt = strchr(buf, '/');
    if (opt) *opt++ = 0;
    *g = *base;
    if (!attn_kind_find(buf, &g->kind))
        return still_fail(err, STILL_E_ARG, "--plan: unknown attention kind '%s' (softmax, swa, lolcats, liger, still, gdn, dsa)",
                          buf);
    while (opt && *opt) {
        char *next = strchr(opt, '/');
        if (next) *next++ = 0;
        char *eq = strchr(opt, '=');
        const plan_key *k = NULL;
        for (size_t i = 0; eq && i < sizeof PLAN_KEYS / sizeof PLAN_KEYS[0]; i++)
            if ((size_t)(eq - opt) == strlen(PLAN_KEYS[i].key) && !strncmp(opt, PLAN_KEYS[i].key, (size_t)(eq - opt)))
                k = &PLAN_KEYS[i];
        if (!k)
            return still_fail(err, STILL_E_ARG, "--plan: '%s' in group '%s' is not key=value with a key of window, chunk, "
                              "feature_dim, budget, lambda, linear, conv, norm, iheads, idim, topk, ifrom", opt, buf);
        if (!(k->kinds & (1u << g->kind)))
            return still_fail(err, STILL_E_ARG, "--plan: the %s kind takes no %s (group '%.*s')", buf, k->key, (int)len, h);
        char *end;
        const long v = strtol(eq + 1, &end, 10);
        if (end == eq + 1 || *end || v < k->lo || v > k->hi)
            return still_fail(err, STILL_E_ARG, "--plan: %s=%s in group '%.*s': expected an integer in %d..%d", k->key,
                              eq + 1, (int)len, h, k->lo, k->hi);
        *(int *)((char *)g + k->off) = (int)v;
        opt = next;
    }
    return STILL_OK;
}

/* --plan SPEC: groups KIND[/key=value...]:ITEM[,ITEM...] separated by commas (an item holding ':' starts the next
 * group); ITEM is a layer L, a range A-B or * (every layer). Groups apply in order, a later one re-assigning the
 * layers it names; every layer must be named by some group. cfg[l] = the group's configuration (base with the
 * group's kind and settings). */
static int parse_plan(const char *spec, const attn_config *base, int n, attn_config *cfg, still_err *err) {
    int *group = malloc(sizeof(int) * (size_t)n);
    if (!group) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < n; l++) group[l] = -1;
    attn_config g = *base;
    int rc = STILL_OK, gi = -1;
    const char *t = spec;
    if (!*t) rc = still_fail(err, STILL_E_ARG, "--plan: empty plan");
    while (!rc && *t) {
        const char *end = strchr(t, ',');
        if (!end) end = t + strlen(t);
        const char *colon = memchr(t, ':', (size_t)(end - t));
        const char *item = t;
        if (colon) {
            if ((rc = plan_group_head(t, (size_t)(colon - t), base, &g, err))) break;
            gi++, item = colon + 1;
        } else if (gi < 0) {
            rc = still_fail(err, STILL_E_ARG, "--plan: '%.*s' comes before any KIND: (e.g. gdn:0-29,softmax:3,7)",
                            (int)(end - t), t);
            break;
        }
        long a, b;
        char *e;
        if (end - item == 1 && *item == '*') a = 0, b = n - 1, e = (char *)end;
        else layer_range(item, &e, &a, &b);
        if (e == item || e != end || a < 0 || b < a || b >= n) {
            rc = still_fail(err, STILL_E_ARG, "--plan: '%.*s' is not a layer, a range A-B or * of layers 0..%d",
                            (int)(end - item), item, n - 1);
            break;
        }
        for (long l = a; l <= b && !rc; l++) {
            if (group[l] == gi)
                rc = still_fail(err, STILL_E_ARG, "--plan: layer %ld named twice in group %d ('%.*s')", l, gi + 1,
                                (int)(end - item), item);
            group[l] = gi, cfg[l] = g;
        }
        if (!*end) break;
        t = end + 1;
        if (!*t) rc = still_fail(err, STILL_E_ARG, "--plan: ends with a comma");
    }
    for (int l = 0; !rc && l < n; l++)
        if (group[l] < 0) rc = still_fail(err, STILL_E_ARG, "--plan: layer %d has no kind (name every layer 0..%d)", l, n - 1);
    free(group);
    return rc;
}

/* ---- the common end of every plan: derived values, validation, parameters ---------- */

/* cfg (n_layer configurations, taken over) becomes out: still's λ derived where it is < 0 (from each layer's
 * own budget and the model's trained context, so a model behaves the same whatever context a run uses); the
 * gate's place in the denominator and global selection only where a still layer can have them; each layer
 * validated by building (and dropping) a small state; new parameters at the spec's initialisation. */
static int plan_finish(const plan_shape *s, attn_config *cfg, int sel_cache, attn_plan *out, still_err *err) {
    attn_plan p = {.n_layer = s->n_layer, .cfg = cfg, .sel_cache = sel_cache};
    int rc = (p.params = calloc((size_t)s->n_layer, sizeof *p.params)) ? STILL_OK
                                                                       : still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; !rc && l < s->n_layer; l++) {
        attn_config *a = &cfg[l];
        const int still = a->kind == ATTN_STILL;
        if (still && a->lambda < 0 && a->chunk > 0) a->lambda = plan_derived_lambda(a->budget, a->chunk, s->n_ctx_train);
        a->gate_den = a->gate_den && still && a->linear;
        a->sel_global = a->sel_global && still;
        if (a->kind == ATTN_DSA && a->index_from >= 0 &&
            (a->index_from >= a->n_head_kv || a->index_dim != a->head_dim || a->index_heads < a->n_head / a->n_head_kv)) {
            rc = still_fail(err, STILL_E_ARG, "--plan: layer %d: dsa's ifrom=%d needs a KV head below %d, idim equal to "
                            "the head dim (%d) and iheads at least the %d query heads a KV head serves", l, a->index_from,
                            a->n_head_kv, a->head_dim, a->n_head / a->n_head_kv);
            break;
        }
        const attn_kind *k = attn_kind_get(a->kind);
        attn_config probe = *a;
        attn_state *st = NULL;
        if ((rc = k->state_create(&probe, &st, err))) break;
        k->state_free(st);
        const size_t n = k->param_count(a);
        if (!n) continue;
        if (!(p.params[l] = malloc(n * sizeof(float)))) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory for layer %d's attention parameters", l);
            break;
        }
        k->param_init(a, p.params[l], a->seed * 1000003u + (uint64_t)l);
    }
    if (rc) {
        plan_free(&p);
        return rc;
    }
    *out = p;
    return STILL_OK;
}

/* ---- from the command line's settings ------------------------------------------------ */

int plan_from_params(const plan_shape *s, const still_attn_params *p, attn_plan *out, still_err *err) {
    attn_kind_id kind_id;
    const char *kind_name = p->kind ? p->kind : "softmax";
    if (p->plan && (strcmp(kind_name, "softmax") || (p->softmax_layers && *p->softmax_layers)))
        return still_fail(err, STILL_E_ARG, "--plan gives every layer its kind: drop --attn and --softmax-layers");
    if (!attn_kind_find(kind_name, &kind_id))
        return still_fail(err, STILL_E_ARG, "unknown attention kind '%s' (softmax, swa, lolcats, liger, still, gdn, dsa)",
                          p->kind);
    attn_config base = {
        .kind = kind_id, .n_head = s->n_head, .n_head_kv = s->n_head_kv, .head_dim = s->head_dim,
        .d_model = s->d_model, .n_ctx = s->n_ctx_train, .window = p->window, .chunk = p->chunk,
        .feature_dim = p->feature_dim, .budget = p->budget, .lambda = p->lambda, .per_kv_head = p->per_kv_head,
        .sel_span = p->sel_span, .linear = p->linear, .gate = p->gate, .gate_den = p->gate_den, .seed = p->seed,
        .index_heads = DSA_HEADS_DEFAULT, .index_dim = DSA_DIM_DEFAULT, .topk = dsa_default_topk(s->n_ctx_train),
        .index_from = -1,
    };
    const char *sel = p->selection ? p->selection : "chunk", *fm = p->feature_map ? p->feature_map : "npmap";
    const char *store = p->sel_cache ? p->sel_cache : "f16";
    const char *lb = p->layer_budgets ? p->layer_budgets : "", *nl = p->no_linear_layers ? p->no_linear_layers : "";
    if (*lb && kind_id != ATTN_STILL && !p->plan)
        return still_fail(err, STILL_E_ARG, "--layer-budgets is a still option (the plan's kind is %s)", kind_name);
    if (*nl && kind_id != ATTN_STILL && !p->plan)
        return still_fail(err, STILL_E_ARG, "--no-linear-layers is a still option (the plan's kind is %s)", kind_name);
    if (strcmp(store, "f16") && strcmp(store, "f32") && strcmp(store, "q8"))
        return still_fail(err, STILL_E_ARG, "unknown selected store '%s' (f16, f32, q8)", store);
    if (p->gate_den && ((kind_id != ATTN_STILL && !p->plan) || !p->gate))
        return still_fail(err, STILL_E_ARG, "--gate-den is an option of still's gate (the plan's kind is %s%s)",
                          kind_name, kind_id == ATTN_STILL ? ", without a gate" : "");
    if (attn_routing_parse(p->routing ? p->routing : "saliency", &base.routing))
        return still_fail(err, STILL_E_ARG, "unknown routing '%s' (saliency, random, keynorm, qk, position, none)",
                          p->routing);
    if (attn_selection_parse(sel, &base.sel_global))
        return still_fail(err, STILL_E_ARG, "unknown selection '%s' (chunk, global)", sel);
    if (attn_feature_map_parse(fm, &base.feature_map))
        return still_fail(err, STILL_E_ARG, "unknown feature map '%s' (npmap, hedgehog)", fm);
    const int n = s->n_layer;
    attn_config *cfg = calloc((size_t)n, sizeof *cfg);
    int *budget = calloc((size_t)n, sizeof *budget);
    char *keep = calloc((size_t)n, 1), *no_linear = calloc((size_t)n, 1);
    int rc = cfg && budget && keep && no_linear ? STILL_OK : still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < n && budget; l++) budget[l] = -1;
    if (!rc) rc = parse_layer_budgets(lb, n, budget, err);
    if (!rc) rc = parse_layer_set(nl, n, no_linear, err);
    for (const char *t = p->softmax_layers; !rc && t && *t;) {   /* layers kept as softmax */
        char *end;
        long l = strtol(t, &end, 10);
        if (end == t || l < 0 || l >= n || (*end && *end != ','))
            rc = still_fail(err, STILL_E_ARG, "--softmax-layers: expected layer numbers 0..%d separated by commas, got '%s'",
                            n - 1, p->softmax_layers);
        else keep[l] = 1, t = *end ? end + 1 : end;
    }
    for (int l = 0; !rc && l < n; l++) {
        cfg[l] = base;
        if (keep[l]) cfg[l].kind = ATTN_SOFTMAX;
    }
    if (!rc && p->plan) rc = parse_plan(p->plan, &base, n, cfg, err);
    int any_still = 0;
    for (int l = 0; !rc && l < n; l++) {   /* the still options: still layers only */
        if (cfg[l].kind != ATTN_STILL) continue;
        any_still = 1;
        if (budget[l] >= 0) cfg[l].budget = budget[l];
        if (no_linear[l]) cfg[l].linear = 0;
    }
    if (!rc && p->plan && !any_still && (*lb || *nl || p->gate_den))
        rc = still_fail(err, STILL_E_ARG, "%s is a still option (the plan has no still layer)",
                        *lb ? "--layer-budgets" : *nl ? "--no-linear-layers" : "--gate-den");
    free(budget), free(keep), free(no_linear);
    if (rc) {
        free(cfg);
        return rc;
    }
    return plan_finish(s, cfg, sel_cache_id(store), out, err);
}

/* ---- GGUF ------------------------------------------------------------------------------ */

int plan_present(const gguf_file *f) { return gguf_find(f, "still.attn.layer_kinds") != NULL; }

static int get_i32(const gguf_file *f, const char *key, int *out, still_err *err) {
    const gguf_value *v = gguf_find(f, key);
    if (!v) return still_fail(err, STILL_E_FORMAT, "adapter metadata '%s' is missing", key);
    if (v->type != GGUF_TYPE_INT32 && v->type != GGUF_TYPE_UINT32)
        return still_fail(err, STILL_E_FORMAT, "adapter metadata '%s' must be an integer", key);
    *out = v->type == GGUF_TYPE_INT32 ? (int)v->v.i64 : (int)v->v.u64;
    return STILL_OK;
}

static int get_string(const gguf_file *f, const char *key, char *buf, size_t cap, still_err *err) {
    gguf_str s;
    int rc = gguf_get_str(f, key, &s, err);
    if (rc) return rc;
    if (s.len >= cap) return still_fail(err, STILL_E_FORMAT, "adapter metadata '%s' is too long", key);
    memcpy(buf, s.ptr, s.len);
    buf[s.len] = 0;
    return STILL_OK;
}

/* The integer settings a layer may have of its own: the file's still.attn.<key> holds the value most hybrid
 * layers have, and still.attn.<layer key> (an int32 per layer; optional, written only when the hybrid layers
 * differ) every layer's. lo .. hi: the command line's ranges (src/cli/args.c), outside which a value is a
 * damaged file (a chunk of 0 divided by zero further on). */
typedef struct {
    const char *key, *layer_key, *what;
    size_t off;   /* offsetof(attn_config, ...) */
    int lo, hi;
} plan_int;
#define PLAN_INT(name, layer_key, what, lo, hi) \
    {"still.attn." #name, "still.attn." layer_key, what, offsetof(attn_config, name), lo, hi}
static const plan_int PLAN_INTS[] = {
    PLAN_INT(window, "layer_window", "window", 1, 1 << 22),
    PLAN_INT(chunk, "layer_chunk", "chunk", 1, 1 << 16),
    PLAN_INT(feature_dim, "layer_feature_dim", "feature dim", 1, 4096),
    PLAN_INT(budget, "layer_budgets", "budget", 0, 1 << 22),
    PLAN_INT(lambda, "layer_lambda", "lambda", -1, 1 << 16),
};
#undef PLAN_INT
#define N_PLAN_INTS (sizeof PLAN_INTS / sizeof PLAN_INTS[0])
static int *cfg_int(attn_config *a, const plan_int *k) { return (int *)((char *)a + k->off); }
static int cfg_int_get(const attn_config *a, const plan_int *k) { return *(const int *)((const char *)a + k->off); }

/* A per-layer int32 array of n_layer values in lo .. hi, or absent (*present = 0). */
static int get_layer_ints(const gguf_file *f, const char *key, const char *what, int n_layer, int lo, int hi,
                          int *out, int *present, still_err *err) {
    *present = 0;
    if (!gguf_find(f, key)) return STILL_OK;
    const gguf_value *b;
    uint64_t nb;
    int rc = gguf_get_arr(f, key, GGUF_TYPE_INT32, &b, &nb, err);
    if (rc) return rc;
    if (nb != (uint64_t)n_layer)
        return still_fail(err, STILL_E_FORMAT, "adapter lists %llu layer %ss for a %d-layer model",
                          (unsigned long long)nb, what, n_layer);
    for (int l = 0; l < n_layer; l++) {
        if (b[l].v.i64 < lo || b[l].v.i64 > hi)
            return still_fail(err, STILL_E_FORMAT, "adapter layer %d: %s %lld out of range (%d .. %d)", l, what,
                              (long long)b[l].v.i64, lo, hi);
        out[l] = (int)b[l].v.i64;
    }
    *present = 1;
    return STILL_OK;
}

/* The file's parameters into a plan made for them. */
static int read_params(const gguf_file *f, attn_plan *p, still_err *err) {
    for (int l = 0; l < p->n_layer; l++) {
        const size_t n = attn_kind_get(p->cfg[l].kind)->param_count(&p->cfg[l]);
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
        const gguf_tensor *t = gguf_find_tensor(f, name);
        if (!n) {
            if (t) return still_fail(err, STILL_E_FORMAT, "adapter has parameters for layer %d, whose kind has none", l);
            continue;
        }
        if (!t) return still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' is missing", name);
        if ((t->type != TT_F32 && t->type != TT_F16) || t->n_dims != 1 || (size_t)t->ne[0] != n)
            return still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' must be F32 or F16 of %zu elements", name, n);
        float *dst = p->params[l];
        if (t->type == TT_F32) memcpy(dst, t->data, n * sizeof(float));
        else
            for (size_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, (const unsigned char *)t->data + 2 * i, sizeof h);
                dst[i] = f16_to_f32(h);
            }
        for (size_t i = 0; i < n; i++)
            if (!isfinite(dst[i])) return still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' contains a non-finite value", name);
    }
    return STILL_OK;
}

int plan_read(const plan_shape *s, const gguf_file *f, const still_attn_params *over, unsigned mask, attn_plan *out,
              still_err *err) {
    if (mask & ~(unsigned)STILL_PLAN_OVERRIDABLE)
        return still_fail(err, STILL_E_ARG, "an adapter's feature map, gate, softmax layers and plan are fixed by its "
                                            "parameters and cannot be overridden");
    if (mask && !over) return still_fail(err, STILL_E_ARG, "plan overrides given without their values");
    const struct { const char *key; int want; } shape[] = {
        {"still.base.block_count", s->n_layer}, {"still.base.embedding_length", s->d_model},
        {"still.base.head_count", s->n_head}, {"still.base.head_count_kv", s->n_head_kv},
    };
    for (size_t i = 0; i < sizeof shape / sizeof shape[0]; i++) {
        uint32_t u;
        int rc = gguf_get_u32(f, shape[i].key, &u, err);
        if (rc) return rc;
        if ((int)u != shape[i].want)
            return still_fail(err, STILL_E_FORMAT, "adapter was made for a model with %s = %u, this one has %d",
                              shape[i].key + 11, u, shape[i].want);
    }
    const int n = s->n_layer;
    const gguf_value *kinds;
    uint64_t n_kinds;
    int rc = gguf_get_arr(f, "still.attn.layer_kinds", GGUF_TYPE_STRING, &kinds, &n_kinds, err);
    if (rc) return rc;
    if (n_kinds != (uint64_t)n)
        return still_fail(err, STILL_E_FORMAT, "adapter lists %llu layer kinds for a %d-layer model",
                          (unsigned long long)n_kinds, n);
    const still_attn_params dflt = still_attn_default_params();
    attn_config base = {
        .n_head = s->n_head, .n_head_kv = s->n_head_kv, .head_dim = s->head_dim, .d_model = s->d_model,
        .n_ctx = s->n_ctx_train, .window = dflt.window, .chunk = dflt.chunk, .feature_dim = dflt.feature_dim,
        .budget = dflt.budget, .lambda = dflt.lambda, .index_heads = DSA_HEADS_DEFAULT, .index_dim = DSA_DIM_DEFAULT,
        .topk = dsa_default_topk(s->n_ctx_train), .index_from = -1,
    };
    for (size_t i = 0; !rc && i < N_PLAN_INTS; i++) {
        const plan_int *k = &PLAN_INTS[i];
        int *v = cfg_int(&base, k);
        rc = get_i32(f, k->key, v, err);
        if (!rc && (*v < k->lo || *v > k->hi))
            rc = still_fail(err, STILL_E_FORMAT, "adapter: %s = %d is out of range (%d .. %d)", k->key, *v, k->lo, k->hi);
    }
    bool flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.per_kv_head", &flag, err))) base.per_kv_head = flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.linear", &flag, err))) base.linear = flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.gate", &flag, err))) base.gate = flag;
    if (!rc && gguf_find(f, "still.attn.gate_den") && !(rc = gguf_get_bool(f, "still.attn.gate_den", &flag, err)))
        base.gate_den = flag;
    char routing[32], fmap[32], selection[32] = "chunk", store[8] = "f16";
    if (!rc) rc = get_string(f, "still.attn.routing", routing, sizeof routing, err);
    if (!rc) rc = get_string(f, "still.attn.feature_map", fmap, sizeof fmap, err);
    /* optional (adapters before global selection have none: chunk) */
    if (!rc && gguf_find(f, "still.attn.selection"))
        rc = get_string(f, "still.attn.selection", selection, sizeof selection, err);
    if (!rc && gguf_find(f, "still.attn.sel_span")) rc = get_i32(f, "still.attn.sel_span", &base.sel_span, err);
    if (!rc && gguf_find(f, "still.attn.sel_cache")) rc = get_string(f, "still.attn.sel_cache", store, sizeof store, err);
    if (!rc) {
        const gguf_value *v = gguf_find(f, "still.attn.seed");
        base.seed = v && v->type == GGUF_TYPE_UINT64 ? v->v.u64 : 0;
    }
    /* the overrides of the settings every layer shares */
    const char *routing_s = (mask & STILL_PLAN_ROUTING) && over->routing ? over->routing : routing;
    const char *selection_s = (mask & STILL_PLAN_SELECTION) && over->selection ? over->selection : selection;
    const char *store_s = (mask & STILL_PLAN_SEL_CACHE) && over->sel_cache ? over->sel_cache : store;
    if (!rc && (mask & STILL_PLAN_ROUTING) && !over->routing) routing_s = "saliency";
    if (!rc && (mask & STILL_PLAN_SELECTION) && !over->selection) selection_s = "chunk";
    if (!rc && (mask & STILL_PLAN_SEL_CACHE) && !over->sel_cache) store_s = "f16";
    if (!rc && attn_routing_parse(routing_s, &base.routing))
        rc = still_fail(err, (mask & STILL_PLAN_ROUTING) ? STILL_E_ARG : STILL_E_FORMAT,
                        "unknown routing '%s' (saliency, random, keynorm, qk, position, none)", routing_s);
    if (!rc && attn_selection_parse(selection_s, &base.sel_global))
        rc = still_fail(err, (mask & STILL_PLAN_SELECTION) ? STILL_E_ARG : STILL_E_FORMAT,
                        "unknown selection '%s' (chunk, global)", selection_s);
    if (!rc && attn_feature_map_parse(fmap, &base.feature_map))
        rc = still_fail(err, STILL_E_FORMAT, "unknown feature map '%s' (npmap, hedgehog)", fmap);
    if (!rc && strcmp(store_s, "f16") && strcmp(store_s, "f32") && strcmp(store_s, "q8"))
        rc = still_fail(err, (mask & STILL_PLAN_SEL_CACHE) ? STILL_E_ARG : STILL_E_FORMAT,
                        "unknown selected store '%s' (f16, f32, q8)", store_s);
    if (rc) return rc;
    if (mask & STILL_PLAN_WINDOW) base.window = over->window;
    if (mask & STILL_PLAN_CHUNK) base.chunk = over->chunk;
    if (mask & STILL_PLAN_BUDGET) base.budget = over->budget;
    if (mask & STILL_PLAN_LAMBDA) base.lambda = over->lambda;
    if (mask & STILL_PLAN_PER_KV_HEAD) base.per_kv_head = over->per_kv_head;
    if (mask & STILL_PLAN_LINEAR) base.linear = over->linear;
    if (mask & STILL_PLAN_SEED) base.seed = over->seed;
    if (mask & STILL_PLAN_SEL_SPAN) base.sel_span = over->sel_span;
    if (mask & STILL_PLAN_GATE_DEN) base.gate_den = over->gate_den;

    attn_config *cfg = calloc((size_t)n, sizeof *cfg);
    int *vals = calloc((size_t)n * N_PLAN_INTS, sizeof *vals), *lin = calloc((size_t)n, sizeof *lin);
    int present[N_PLAN_INTS] = {0}, lin_present = 0, any_still = 0;
    char *no_linear = calloc((size_t)n, 1);
    if (!cfg || !vals || !lin || !no_linear) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; !rc && l < n; l++) {
        gguf_str nm = kinds[l].v.str;
        char name[32];
        if (nm.len >= sizeof name) {
            rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: kind name too long", l);
            break;
        }
        memcpy(name, nm.ptr, nm.len);
        name[nm.len] = 0;
        cfg[l] = base;
        if (!attn_kind_find(name, &cfg[l].kind))
            rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: unknown attention kind '%s'", l, name);
        any_still |= cfg[l].kind == ATTN_STILL;
    }
    /* per-layer values (the hybrid layers'; softmax layers keep the shared ones) */
    for (size_t i = 0; !rc && i < N_PLAN_INTS; i++) {
        const plan_int *k = &PLAN_INTS[i];
        rc = get_layer_ints(f, k->layer_key, k->what, n, k->lo, k->hi, vals + i * (size_t)n, &present[i], err);
    }
    if (!rc) rc = get_layer_ints(f, "still.attn.layer_linear", "linear switche", n, INT32_MIN, INT32_MAX, lin,
                                 &lin_present, err);
    /* gdn's short convolution per layer (optional: files without it have none) */
    int conv_present = 0;
    int *conv = calloc((size_t)n, sizeof *conv);
    if (!rc && !conv) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    if (!rc) rc = get_layer_ints(f, "still.attn.layer_conv", "convolution width", n, 0, GDN_CONV_MAX, conv, &conv_present,
                                 err);
    for (int l = 0; !rc && conv_present && l < n; l++) {
        if (conv[l] && cfg[l].kind != ATTN_GDN)
            rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: a convolution of width %d on a %s layer (gdn only)", l,
                            conv[l], attn_kind_get(cfg[l].kind)->name);
        cfg[l].conv = conv[l];
    }
    free(conv);
    /* gdn's output norm per layer (files without the key, written before it existed, have it on every gdn layer) */
    int norm_present = 0;
    int *norm = calloc((size_t)n, sizeof *norm);
    if (!rc && !norm) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    if (!rc) rc = get_layer_ints(f, "still.attn.layer_norm", "output norm switche", n, 0, 1, norm, &norm_present, err);
    for (int l = 0; !rc && l < n; l++) {
        if (norm_present && norm[l] && cfg[l].kind != ATTN_GDN)
            rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: an output norm on a %s layer (gdn only)", l,
                            attn_kind_get(cfg[l].kind)->name);
        cfg[l].norm = cfg[l].kind == ATTN_GDN && (norm_present ? norm[l] : 1);
    }
    free(norm);
    /* dsa's indexer and top-K per layer (written whenever a layer is dsa; others keep the defaults) */
    const struct { const char *key, *what; size_t off; int lo, hi; } dsa_keys[] = {
        {"still.attn.layer_index_heads", "indexer head count", offsetof(attn_config, index_heads), 1, DSA_MAX_HEADS},
        {"still.attn.layer_index_dim", "indexer dimension", offsetof(attn_config, index_dim), 1, DSA_MAX_DIM},
        {"still.attn.layer_topk", "top-K", offsetof(attn_config, topk), DSA_LOCAL + 1, 1 << 22},
    };
    int *dv = calloc((size_t)n, sizeof *dv);
    if (!rc && !dv) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    for (size_t i = 0; !rc && i < sizeof dsa_keys / sizeof dsa_keys[0]; i++) {
        int dpresent = 0;
        for (int l = 0; l < n; l++) dv[l] = 0;
        /* softmax and other layers hold 0 in the file: read the range per layer below */
        if (!rc) rc = get_layer_ints(f, dsa_keys[i].key, dsa_keys[i].what, n, 0, dsa_keys[i].hi, dv, &dpresent, err);
        for (int l = 0; !rc && dpresent && l < n; l++) {
            if (cfg[l].kind != ATTN_DSA) {
                if (dv[l])
                    rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: %s %d on a %s layer (dsa only)", l,
                                    dsa_keys[i].what, dv[l], attn_kind_get(cfg[l].kind)->name);
                continue;
            }
            if (dv[l] < dsa_keys[i].lo)
                rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: %s %d is out of range (%d .. %d)", l,
                                dsa_keys[i].what, dv[l], dsa_keys[i].lo, dsa_keys[i].hi);
            else *(int *)((char *)&cfg[l] + dsa_keys[i].off) = dv[l];
        }
    }
    free(dv);
    for (int l = 0; !rc && lin_present && l < n; l++)
        if (lin[l] != 0 && lin[l] != 1)
            rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: linear switch %d is not 0 or 1", l, lin[l]);
    /* budgets given per layer: a λ the shared budget derived is derived per layer again */
    const int budget_i = 3, lambda_i = 4;
    if (!rc && present[budget_i] && !present[lambda_i] &&
        base.lambda == plan_derived_lambda(cfg_int_get(&base, &PLAN_INTS[budget_i]), base.chunk, s->n_ctx_train))
        for (int l = 0; l < n; l++) cfg[l].lambda = -1;
    for (int l = 0; !rc && l < n; l++) {
        if (cfg[l].kind == ATTN_SOFTMAX) continue;
        for (size_t i = 0; i < N_PLAN_INTS; i++)
            if (present[i]) *cfg_int(&cfg[l], &PLAN_INTS[i]) = vals[i * (size_t)n + l];
        if (lin_present) cfg[l].linear = lin[l];
    }
    /* the overrides of per-layer settings */
    if (!rc && (mask & STILL_PLAN_BUDGET))   /* one budget everywhere */
        for (int l = 0; l < n; l++) cfg[l].budget = over->budget;
    if (!rc && (mask & STILL_PLAN_LAYER_BUDGETS)) {   /* in place of the file's per-layer budgets */
        int *b = vals;   /* (reused) */
        for (int l = 0; l < n; l++) b[l] = -1;
        rc = parse_layer_budgets(over->layer_budgets ? over->layer_budgets : "", n, b, err);
        for (int l = 0; !rc && l < n; l++)
            if (cfg[l].kind != ATTN_SOFTMAX) cfg[l].budget = b[l] >= 0 ? b[l] : base.budget;
    }
    if (!rc && (mask & STILL_PLAN_LAYER_BUDGETS) && over->layer_budgets && *over->layer_budgets && !any_still)
        rc = still_fail(err, STILL_E_ARG, "--layer-budgets is a still option (the plan has no still layer)");
    if (!rc && (mask & (STILL_PLAN_LAMBDA | STILL_PLAN_BUDGET | STILL_PLAN_LAYER_BUDGETS)))
        /* the adapter records the λ its budget gave; a new budget alone derives λ again, as --attn still
         * --budget M would */
        for (int l = 0; l < n; l++) cfg[l].lambda = (mask & STILL_PLAN_LAMBDA) ? over->lambda : -1;
    if (!rc && (mask & STILL_PLAN_LINEAR))   /* (layers the file turns off stay off) */
        for (int l = 0; l < n; l++) cfg[l].linear = lin_present && !lin[l] && cfg[l].kind != ATTN_SOFTMAX ? 0 : over->linear;
    if (!rc && (mask & STILL_PLAN_NO_LINEAR_LAYERS)) {
        const char *nl = over->no_linear_layers ? over->no_linear_layers : "";
        if (*nl && !any_still)
            rc = still_fail(err, STILL_E_ARG, "--no-linear-layers is a still option (the plan has no still layer)");
        if (!rc) rc = parse_layer_set(nl, n, no_linear, err);
        for (int l = 0; !rc && l < n; l++) cfg[l].linear = no_linear[l] ? 0 : (mask & STILL_PLAN_LINEAR) ? over->linear : base.linear;
    }
    if (!rc && base.gate_den && (!any_still || !base.gate))
        rc = still_fail(err, (mask & STILL_PLAN_GATE_DEN) ? STILL_E_ARG : STILL_E_FORMAT,
                        "--gate-den is an option of still's gate (the plan %s)",
                        any_still ? "has no gate" : "has no still layer");
    free(vals), free(lin), free(no_linear);
    if (rc) {
        free(cfg);
        return rc;
    }
    attn_plan p;
    if ((rc = plan_finish(s, cfg, sel_cache_id(store_s), &p, err))) return rc;
    if ((rc = read_params(f, &p, err))) {
        plan_free(&p);
        return rc;
    }
    *out = p;
    return STILL_OK;
}

/* An int32 array of n values into w under key. */
static int set_layer_ints(gguf_writer *w, const char *key, const int *v, int n, still_err *err) {
    gguf_value b = {.type = GGUF_TYPE_ARRAY};
    b.v.arr.elem_type = GGUF_TYPE_INT32;
    b.v.arr.n = (uint64_t)n;
    b.v.arr.items = calloc((size_t)n, sizeof(gguf_value));
    if (!b.v.arr.items) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < n; l++) b.v.arr.items[l] = (gguf_value){.type = GGUF_TYPE_INT32, .v.i64 = v[l]};
    int rc = gguf_writer_set(w, key, &b, err);
    free(b.v.arr.items);
    return rc;
}

int plan_write(const plan_shape *s, const attn_plan *p, gguf_writer *w, int f16, still_err *err) {
    const int n = s->n_layer;
    if (n <= 0 || p->n_layer != n) return still_fail(err, STILL_E_STATE, "the plan has no layers or not the model's");
    const attn_config *cfg = p->cfg;
    /* hy: the hybrid layer whose settings the shared keys hold: the budget most hybrid layers have (per-layer
     * budgets), the first such layer */
    const attn_config *hy = NULL;
    int best_n = 0;
    for (int l = 0; l < n; l++) {
        if (cfg[l].kind == ATTN_SOFTMAX) continue;
        int c = 0;
        for (int j = 0; j < n; j++) c += cfg[j].kind != ATTN_SOFTMAX && cfg[j].budget == cfg[l].budget;
        if (c > best_n) best_n = c, hy = &cfg[l];
    }
    if (!hy) hy = &cfg[0];
    /* settings every hybrid layer must share (the file has one of each) */
    for (int l = 0; l < n; l++) {
        const attn_config *a = &cfg[l];
        if (a->kind == ATTN_SOFTMAX) continue;
        if (a->seed != hy->seed) return still_fail(err, STILL_E_UNSUPPORTED, "layers %d and %d differ in seed", (int)(hy - cfg), l);
        if (a->kind != hy->kind) continue;
        if (a->per_kv_head != hy->per_kv_head || a->gate != hy->gate || a->routing != hy->routing ||
            a->feature_map != hy->feature_map || a->sel_global != hy->sel_global || a->sel_span != hy->sel_span)
            return still_fail(err, STILL_E_UNSUPPORTED,
                              "layers %d and %d of one kind differ in a setting the file holds once (per KV head, "
                              "gate, routing, feature map, selection or span)", (int)(hy - cfg), l);
    }
    gguf_value kinds = {.type = GGUF_TYPE_ARRAY};
    kinds.v.arr.elem_type = GGUF_TYPE_STRING;
    kinds.v.arr.n = (uint64_t)n;
    kinds.v.arr.items = calloc((size_t)n, sizeof(gguf_value));
    if (!kinds.v.arr.items) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < n; l++) {
        const char *name = attn_kind_get(cfg[l].kind)->name;
        kinds.v.arr.items[l] = (gguf_value){.type = GGUF_TYPE_STRING, .v.str = {strlen(name), name}};
    }
    int rc = gguf_writer_set(w, "still.attn.layer_kinds", &kinds, err);
    free(kinds.v.arr.items);
    int *v = calloc((size_t)n, sizeof *v);
    if (!rc && !v) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
    for (size_t i = 0; !rc && i < N_PLAN_INTS; i++) {
        gguf_value one = {.type = GGUF_TYPE_INT32, .v.i64 = cfg_int_get(hy, &PLAN_INTS[i])};
        rc = gguf_writer_set(w, PLAN_INTS[i].key, &one, err);
    }
    for (size_t i = 0; !rc && i < N_PLAN_INTS; i++) {
        const plan_int *k = &PLAN_INTS[i];
        /* per layer only where the hybrid layers differ (files without it have one value); softmax layers 0.
         * λ where every layer has the one its own budget derives is left to the reader to derive again */
        int differ = 0, derived = 1;
        for (int l = 0; l < n; l++) {
            if (cfg[l].kind == ATTN_SOFTMAX) continue;
            differ |= cfg_int_get(&cfg[l], k) != cfg_int_get(hy, k);
            derived &= cfg[l].lambda == plan_derived_lambda(cfg[l].budget, cfg[l].chunk, s->n_ctx_train);
        }
        if (!strcmp(k->key, "still.attn.lambda") && derived) differ = 0;
        if (!differ) continue;
        for (int l = 0; l < n; l++) v[l] = cfg[l].kind == ATTN_SOFTMAX ? 0 : cfg_int_get(&cfg[l], k);
        rc = set_layer_ints(w, k->layer_key, v, n, err);
    }
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.per_kv_head", hy->per_kv_head != 0, err);
    /* the linear branch: on if any hybrid layer has it; the per-layer switch (--no-linear-layers) in
     * still.attn.layer_linear, only when they differ */
    int lin_any = 0, lin_mixed = 0;
    for (int l = 0; l < n; l++) lin_any |= cfg[l].kind != ATTN_SOFTMAX && cfg[l].linear;
    for (int l = 0; l < n; l++) lin_mixed |= cfg[l].kind != ATTN_SOFTMAX && !cfg[l].linear != !lin_any;
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.linear", lin_any != 0, err);
    int conv_any = 0;   /* gdn's short convolution: per layer, only when some layer has one */
    for (int l = 0; l < n; l++) conv_any |= cfg[l].conv != 0;
    if (!rc && conv_any) {
        for (int l = 0; l < n; l++) v[l] = cfg[l].kind == ATTN_GDN ? cfg[l].conv : 0;
        rc = set_layer_ints(w, "still.attn.layer_conv", v, n, err);
    }
    int gdn_any = 0;   /* gdn's output norm: per layer, whenever a layer is gdn (its absence means on) */
    for (int l = 0; l < n; l++) gdn_any |= cfg[l].kind == ATTN_GDN;
    if (!rc && gdn_any) {
        for (int l = 0; l < n; l++) v[l] = cfg[l].kind == ATTN_GDN && cfg[l].norm;
        rc = set_layer_ints(w, "still.attn.layer_norm", v, n, err);
    }
    int dsa_any = 0;   /* dsa's indexer and top-K: per layer, whenever a layer is dsa (0 on the others) */
    for (int l = 0; l < n; l++) dsa_any |= cfg[l].kind == ATTN_DSA;
    const struct { const char *key; size_t off; } dsa_keys[] = {
        {"still.attn.layer_index_heads", offsetof(attn_config, index_heads)},
        {"still.attn.layer_index_dim", offsetof(attn_config, index_dim)},
        {"still.attn.layer_topk", offsetof(attn_config, topk)},
    };
    for (size_t i = 0; !rc && dsa_any && i < sizeof dsa_keys / sizeof dsa_keys[0]; i++) {
        for (int l = 0; l < n; l++)
            v[l] = cfg[l].kind == ATTN_DSA ? *(const int *)((const char *)&cfg[l] + dsa_keys[i].off) : 0;
        rc = set_layer_ints(w, dsa_keys[i].key, v, n, err);
    }
    if (!rc && lin_mixed) {
        for (int l = 0; l < n; l++) v[l] = cfg[l].kind != ATTN_SOFTMAX && cfg[l].linear;
        rc = set_layer_ints(w, "still.attn.layer_linear", v, n, err);
    }
    free(v);
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.gate", hy->gate != 0, err);
    int gate_den = 0;   /* (only when set: files without it read as 0) */
    for (int l = 0; l < n; l++) gate_den |= cfg[l].kind != ATTN_SOFTMAX && cfg[l].gate_den;
    if (!rc && gate_den) rc = gguf_writer_set_bool(w, "still.attn.gate_den", 1, err);
    if (!rc && p->sel_cache && p->sel_cache != STILL_SEL_F16)   /* (files without it read as f16) */
        rc = gguf_writer_set_str(w, "still.attn.sel_cache", p->sel_cache == STILL_SEL_Q8 ? "q8" : "f32", err);
    const char *routing = attn_routing_name(hy->routing), *fmap = attn_feature_map_name(hy->feature_map);
    if (!rc && (!routing || !fmap)) rc = still_fail(err, STILL_E_STATE, "the plan's routing or feature map is not valid");
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.routing", routing, err);
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.selection", attn_selection_name(hy->sel_global), err);
    if (!rc && hy->sel_span) {   /* (only when set: files without it read as 0) */
        gguf_value one = {.type = GGUF_TYPE_INT32, .v.i64 = hy->sel_span};
        rc = gguf_writer_set(w, "still.attn.sel_span", &one, err);
    }
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.feature_map", fmap, err);
    if (!rc) {
        gguf_value one = {.type = GGUF_TYPE_UINT64, .v.u64 = hy->seed};
        rc = gguf_writer_set(w, "still.attn.seed", &one, err);
    }
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.block_count", (uint32_t)n, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.embedding_length", (uint32_t)s->d_model, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.head_count", (uint32_t)s->n_head, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.head_count_kv", (uint32_t)s->n_head_kv, err);
    for (int l = 0; !rc && l < n; l++) {
        const size_t np = attn_kind_get(cfg[l].kind)->param_count(&cfg[l]);
        if (!np) continue;
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
        const int64_t ne[1] = {(int64_t)np};
        if (!f16) {
            rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, p->params[l], np * sizeof(float), err);
            continue;
        }
        uint16_t *h = malloc(np * sizeof(uint16_t));
        if (!h) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (size_t i = 0; i < np && !rc; i++) {
            const float x = p->params[l][i];
            if (!(fabsf(x) <= 65504.0f))
                rc = still_fail(err, STILL_E_ARG, "layer %d parameter %zu (%g) does not fit in f16; write f32", l, i, x);
            h[i] = f32_to_f16(x);
        }
        if (!rc) rc = gguf_writer_add_tensor(w, name, TT_F16, 1, ne, h, np * sizeof(uint16_t), err);
        free(h);
    }
    return rc;
}
