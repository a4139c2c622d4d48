/* Linearized-model files: the attention plan and its trained parameters as
 * GGUF metadata + tensors.
 *
 * An adapter GGUF holds only what linearization adds to a base model:
 *   still.attn.layer_kinds   array of strings, one attention kind per layer
 *   still.attn.window, .chunk, .feature_dim, .budget, .lambda   (int32)
 *   still.attn.layer_budgets (int32 array, one per layer; optional, only when
 *                            layers' budgets differ; .budget is then the most
 *                            common one and a derived λ is derived per layer)
 *   still.attn.per_kv_head, .linear, .gate                       (bool)
 *   still.attn.layer_linear (int32 array, one per layer, 1 = linear branch on;
 *     optional, only when the hybrid layers differ: --no-linear-layers)
 *   still.attn.gate_den      (bool; optional, written only when on: the gate also scales the
 *                            linear term of the denominator, --gate-den)
 *   still.attn.sel_cache     (string; optional, written only when not f16: the selected store the
 *                            plan's memory is sized for, f32 or q8; contexts use it by default)
 *   still.attn.routing, .feature_map, .selection                 (string; .selection optional: chunk)
 *   still.attn.seed                                              (uint64)
 *   still.base.block_count, .embedding_length, .head_count, .head_count_kv (uint32, checked on load)
 *   blk.N.attn_hybrid.params  F32 or F16 [n]: layer N's parameters, in the layout
 *                              its kind documents (src/attn_<kind>.c); F16
 *                              (IEEE half, rounded to nearest even) halves the
 *                              file, e.g. for an adapter kept in a repository
 * A stage-2 adapter (still finetune) adds the model's LoRA as llama.cpp
 * stores LoRA adapters (lora.h): general.architecture is then the base's
 * ("llama"), general.type = adapter, adapter.type = lora, adapter.lora.alpha,
 * blk.N.<tensor>.weight.lora_a / .lora_b; a softmax plan's adapter has no
 * other tensors, so llama.cpp loads it as a LoRA (--lora).
 * A merged file is the base GGUF with the same keys and tensors added, so it
 * loads alone; LoRA is folded into its target matrices, which are then
 * stored as F16 (requantizing to the base's 4-bit type would round away the
 * low-rank update, whose entries are far below a 4-bit step). */
#include "common.h"
#include "attn.h"
#include "gguf.h"
#include "model.h"
#include "quant.h"

#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Write the plan's metadata and tensors into w. */
static int write_plan(const still_model *m, gguf_writer *w, int f16, still_err *err) {
    const model_config *c = &m->cfg;
    const attn_config *hy = NULL;   /* the configuration of the non-softmax layers */
    for (int l = 0; l < c->n_layer; l++)
        if (m->attn_cfg[l].kind != ATTN_SOFTMAX) hy = &m->attn_cfg[l];
    if (!hy) hy = &m->attn_cfg[0];
    /* per-layer budgets: still.attn.budget is the one most hybrid layers have
     * (hy is one of them), the rest goes in still.attn.layer_budgets */
    if (c->n_layer <= 0) return still_fail(err, STILL_E_STATE, "model has no layers");
    int best_n = 0, mixed = 0;
    for (int l = 0; l < c->n_layer; l++) {
        if (m->attn_cfg[l].kind == ATTN_SOFTMAX) continue;
        int n = 0;
        for (int j = 0; j < c->n_layer; j++)
            n += m->attn_cfg[j].kind != ATTN_SOFTMAX && m->attn_cfg[j].budget == m->attn_cfg[l].budget;
        if (n > best_n) best_n = n, hy = &m->attn_cfg[l];
    }
    for (int l = 0; l < c->n_layer; l++)
        mixed |= m->attn_cfg[l].kind != ATTN_SOFTMAX && m->attn_cfg[l].budget != hy->budget;
    gguf_value kinds = {.type = GGUF_TYPE_ARRAY};
    kinds.v.arr.elem_type = GGUF_TYPE_STRING;
    kinds.v.arr.n = (uint64_t)c->n_layer;
    kinds.v.arr.items = calloc((size_t)c->n_layer, sizeof(gguf_value));
    if (!kinds.v.arr.items) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < c->n_layer; l++) {
        const char *name = attn_kind_get(m->attn_cfg[l].kind)->name;
        kinds.v.arr.items[l] = (gguf_value){.type = GGUF_TYPE_STRING, .v.str = {strlen(name), name}};
    }
    int rc = gguf_writer_set(w, "still.attn.layer_kinds", &kinds, err);
    free(kinds.v.arr.items);
    struct { const char *key; int v; } ints[] = {
        {"still.attn.window", hy->window}, {"still.attn.chunk", hy->chunk}, {"still.attn.feature_dim", hy->feature_dim},
        {"still.attn.budget", hy->budget}, {"still.attn.lambda", hy->lambda},
    };
    for (size_t i = 0; !rc && i < sizeof ints / sizeof ints[0]; i++) {
        gguf_value v = {.type = GGUF_TYPE_INT32, .v.i64 = ints[i].v};
        rc = gguf_writer_set(w, ints[i].key, &v, err);
    }
    if (!rc && mixed) {   /* (only when they differ: files without it have one budget) */
        gguf_value b = {.type = GGUF_TYPE_ARRAY};
        b.v.arr.elem_type = GGUF_TYPE_INT32;
        b.v.arr.n = (uint64_t)c->n_layer;
        b.v.arr.items = calloc((size_t)c->n_layer, sizeof(gguf_value));
        if (!b.v.arr.items) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int l = 0; l < c->n_layer; l++)
            b.v.arr.items[l] = (gguf_value){.type = GGUF_TYPE_INT32,
                                            .v.i64 = m->attn_cfg[l].kind == ATTN_SOFTMAX ? 0 : m->attn_cfg[l].budget};
        rc = gguf_writer_set(w, "still.attn.layer_budgets", &b, err);
        free(b.v.arr.items);
    }
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.per_kv_head", hy->per_kv_head != 0, err);
    /* the linear branch: on if any hybrid layer has it; the per-layer switch
     * (--no-linear-layers) in still.attn.layer_linear, only when they differ */
    int lin_any = 0, lin_mixed = 0;
    for (int l = 0; l < c->n_layer; l++) lin_any |= m->attn_cfg[l].kind != ATTN_SOFTMAX && m->attn_cfg[l].linear;
    for (int l = 0; l < c->n_layer; l++)
        lin_mixed |= m->attn_cfg[l].kind != ATTN_SOFTMAX && !m->attn_cfg[l].linear != !lin_any;
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.linear", lin_any != 0, err);
    if (!rc && lin_mixed) {
        gguf_value b = {.type = GGUF_TYPE_ARRAY};
        b.v.arr.elem_type = GGUF_TYPE_INT32;
        b.v.arr.n = (uint64_t)c->n_layer;
        b.v.arr.items = calloc((size_t)c->n_layer, sizeof(gguf_value));
        if (!b.v.arr.items) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int l = 0; l < c->n_layer; l++)
            b.v.arr.items[l] = (gguf_value){.type = GGUF_TYPE_INT32,
                                            .v.i64 = m->attn_cfg[l].kind != ATTN_SOFTMAX && m->attn_cfg[l].linear};
        rc = gguf_writer_set(w, "still.attn.layer_linear", &b, err);
        free(b.v.arr.items);
    }
    if (!rc) rc = gguf_writer_set_bool(w, "still.attn.gate", hy->gate != 0, err);
    int gate_den = 0;   /* (only when set: files without it read as 0) */
    for (int l = 0; l < c->n_layer; l++) gate_den |= m->attn_cfg[l].kind != ATTN_SOFTMAX && m->attn_cfg[l].gate_den;
    if (!rc && gate_den) rc = gguf_writer_set_bool(w, "still.attn.gate_den", 1, err);
    if (!rc && m->plan_sel_cache && m->plan_sel_cache != STILL_SEL_F16)   /* (files without it read as f16) */
        rc = gguf_writer_set_str(w, "still.attn.sel_cache", m->plan_sel_cache == STILL_SEL_Q8 ? "q8" : "f32", err);
    const char *routing = attn_routing_name(hy->routing), *fmap = attn_feature_map_name(hy->feature_map);
    if (!rc && (!routing || !fmap)) rc = still_fail(err, STILL_E_STATE, "the plan's routing or feature map is not valid");
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.routing", routing, err);
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.selection", attn_selection_name(hy->sel_global), err);
    if (!rc && hy->sel_span) {   /* (only when set: files without it read as 0) */
        gguf_value v = {.type = GGUF_TYPE_INT32, .v.i64 = hy->sel_span};
        rc = gguf_writer_set(w, "still.attn.sel_span", &v, err);
    }
    if (!rc) rc = gguf_writer_set_str(w, "still.attn.feature_map", fmap, err);
    if (!rc) {
        gguf_value v = {.type = GGUF_TYPE_UINT64, .v.u64 = hy->seed};
        rc = gguf_writer_set(w, "still.attn.seed", &v, err);
    }
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.block_count", (uint32_t)c->n_layer, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.embedding_length", (uint32_t)c->d_model, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.head_count", (uint32_t)c->n_head, err);
    if (!rc) rc = gguf_writer_set_u32(w, "still.base.head_count_kv", (uint32_t)c->n_head_kv, err);
    for (int l = 0; !rc && l < c->n_layer; l++) {
        size_t n = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
        if (!n) continue;
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
        int64_t ne[1] = {(int64_t)n};
        if (!f16) {
            rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, m->attn_params[l], n * sizeof(float), err);
            continue;
        }
        uint16_t *h = malloc(n * sizeof(uint16_t));
        if (!h) return still_fail(err, STILL_E_NOMEM, "out of memory");
        for (size_t i = 0; i < n && !rc; i++) {
            const float x = m->attn_params[l][i];
            if (!(fabsf(x) <= 65504.0f))
                rc = still_fail(err, STILL_E_ARG, "layer %d parameter %zu (%g) does not fit in f16; write f32", l, i, x);
            h[i] = f32_to_f16(x);
        }
        if (!rc) rc = gguf_writer_add_tensor(w, name, TT_F16, 1, ne, h, n * sizeof(uint16_t), err);
        free(h);
    }
    return rc;
}

int adapter_writer_typed(const still_model *m, int f16, gguf_writer **out, still_err *err) {
    gguf_writer *w;
    int rc = gguf_writer_create(&w, err);
    if (rc) return rc;
    if (m->lora) {
        gguf_str arch;
        rc = gguf_get_str(m->file, "general.architecture", &arch, err);
        char a[64];
        if (!rc && arch.len >= sizeof a) rc = still_fail(err, STILL_E_FORMAT, "architecture name too long");
        if (!rc) {
            memcpy(a, arch.ptr, arch.len), a[arch.len] = 0;
            rc = gguf_writer_set_str(w, "general.architecture", a, err);
        }
        if (!rc) rc = lora_write(m->lora, w, err);
    } else
        rc = gguf_writer_set_str(w, "general.architecture", "still-adapter", err);
    if (!rc) rc = write_plan(m, w, f16, err);
    if (rc) {
        gguf_writer_free(w);
        return rc;
    }
    *out = w;
    return STILL_OK;
}

int adapter_writer(const still_model *m, gguf_writer **out, still_err *err) {
    return adapter_writer_typed(m, 0, out, err);
}

int still_model_save_adapter(const still_model *m, const char *path, still_err *err) {
    return still_model_save_adapter_as(m, path, STILL_ADAPTER_F32, err);
}

int still_model_save_adapter_as(const still_model *m, const char *path, int type, still_err *err) {
    if (type != STILL_ADAPTER_F32 && type != STILL_ADAPTER_F16)
        return still_fail(err, STILL_E_ARG, "adapter parameter type %d (f32 or f16)", type);
    gguf_writer *w;
    int rc = adapter_writer_typed(m, type == STILL_ADAPTER_F16, &w, err);
    if (rc) return rc;
    rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}

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

/* Does this GGUF carry an attention plan? */
int adapter_present(const gguf_file *f) { return gguf_find(f, "still.attn.layer_kinds") != NULL; }

/* Set m's plan from f's still.* metadata and tensors, with the settings named
 * in mask taken from over (see still_model_load_adapter_with). */
static int adapter_apply_with(still_model *m, const gguf_file *f, const still_attn_params *over, unsigned mask,
                              still_err *err) {
    if (mask & ~(unsigned)STILL_PLAN_OVERRIDABLE)
        return still_fail(err, STILL_E_ARG, "an adapter's feature map, gate and softmax layers are fixed by its "
                                            "parameters and cannot be overridden");
    if (mask && !over) return still_fail(err, STILL_E_ARG, "plan overrides given without their values");
    const model_config *c = &m->cfg;
    struct { const char *key; int want; } shape[] = {
        {"still.base.block_count", c->n_layer}, {"still.base.embedding_length", c->d_model},
        {"still.base.head_count", c->n_head}, {"still.base.head_count_kv", c->n_head_kv},
    };
    for (size_t i = 0; i < sizeof shape / sizeof shape[0]; i++) {
        uint32_t u;
        int rc = gguf_get_u32(f, shape[i].key, &u, err);
        if (rc) return rc;
        if ((int)u != shape[i].want)
            return still_fail(err, STILL_E_FORMAT, "adapter was made for a model with %s = %u, this one has %d",
                              shape[i].key + 11, u, shape[i].want);
    }
    const gguf_value *kinds;
    uint64_t n_kinds;
    int rc = gguf_get_arr(f, "still.attn.layer_kinds", GGUF_TYPE_STRING, &kinds, &n_kinds, err);
    if (rc) return rc;
    if (n_kinds != (uint64_t)c->n_layer)
        return still_fail(err, STILL_E_FORMAT, "adapter lists %llu layer kinds for a %d-layer model",
                          (unsigned long long)n_kinds, c->n_layer);
    still_attn_params p = still_attn_default_params();
    char kind[32] = "softmax", routing[32], fmap[32], selection[32] = "chunk", store[8] = "f16";
    size_t keep_cap = (size_t)c->n_layer * 8 + 1, keep_len = 0;
    char *keep = calloc(keep_cap, 1);
    if (!keep) return still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int l = 0; l < c->n_layer; l++) {
        gguf_str s = kinds[l].v.str;
        char name[32];
        if (s.len >= sizeof name) { rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: kind name too long", l); break; }
        memcpy(name, s.ptr, s.len);
        name[s.len] = 0;
        if (!attn_kind_find(name, NULL)) { rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: unknown attention kind '%s'", l, name); break; }
        if (!strcmp(name, "softmax")) {
            keep_len += (size_t)snprintf(keep + keep_len, keep_cap - keep_len, keep_len ? ",%d" : "%d", l);
        } else if (strcmp(kind, "softmax") && strcmp(kind, name)) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "adapter mixes kinds '%s' and '%s' (one hybrid kind per model)", kind, name);
            break;
        } else {
            snprintf(kind, sizeof kind, "%s", name);
        }
    }
    /* the command line's ranges (src/cli/args.c: --window, --chunk, --feature-dim, --budget, --lambda); a
     * value outside them is a damaged file (a chunk of 0 divided by zero further on) */
    const struct { const char *key; int *dst, lo, hi; } ints[] = {
        {"still.attn.window", &p.window, 1, 1 << 22},       {"still.attn.chunk", &p.chunk, 1, 1 << 16},
        {"still.attn.feature_dim", &p.feature_dim, 1, 4096}, {"still.attn.budget", &p.budget, 0, 1 << 22},
        {"still.attn.lambda", &p.lambda, -1, 1 << 16},
    };
    for (size_t i = 0; !rc && i < sizeof ints / sizeof ints[0]; i++) {
        rc = get_i32(f, ints[i].key, ints[i].dst, err);
        if (!rc && (*ints[i].dst < ints[i].lo || *ints[i].dst > ints[i].hi))
            rc = still_fail(err, STILL_E_FORMAT, "adapter: %s = %d is out of range (%d .. %d)", ints[i].key,
                            *ints[i].dst, ints[i].lo, ints[i].hi);
    }
    bool flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.per_kv_head", &flag, err))) p.per_kv_head = flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.linear", &flag, err))) p.linear = flag;
    if (!rc && !(rc = gguf_get_bool(f, "still.attn.gate", &flag, err))) p.gate = flag;
    if (!rc && gguf_find(f, "still.attn.gate_den") && !(rc = gguf_get_bool(f, "still.attn.gate_den", &flag, err)))
        p.gate_den = flag;
    if (!rc) rc = get_string(f, "still.attn.routing", routing, sizeof routing, err);
    if (!rc) rc = get_string(f, "still.attn.feature_map", fmap, sizeof fmap, err);
    /* optional (adapters before global selection have none: chunk) */
    if (!rc && gguf_find(f, "still.attn.selection"))
        rc = get_string(f, "still.attn.selection", selection, sizeof selection, err);
    if (!rc && gguf_find(f, "still.attn.sel_span")) rc = get_i32(f, "still.attn.sel_span", &p.sel_span, err);
    if (!rc && gguf_find(f, "still.attn.sel_cache")) rc = get_string(f, "still.attn.sel_cache", store, sizeof store, err);
    /* optional: per-layer budgets, as a --layer-budgets spec of the layers whose budget is not still.attn.budget */
    char *lb = NULL;
    if (!rc && gguf_find(f, "still.attn.layer_budgets")) {
        const gguf_value *b;
        uint64_t nb;
        rc = gguf_get_arr(f, "still.attn.layer_budgets", GGUF_TYPE_INT32, &b, &nb, err);
        if (!rc && nb != (uint64_t)c->n_layer)
            rc = still_fail(err, STILL_E_FORMAT, "adapter lists %llu layer budgets for a %d-layer model",
                            (unsigned long long)nb, c->n_layer);
        const size_t cap = (size_t)c->n_layer * 24 + 1;
        size_t len = 0;
        if (!rc && !(lb = calloc(cap, 1))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int l = 0; !rc && l < c->n_layer; l++) {
            if (b[l].v.i64 < 0 || b[l].v.i64 > (1 << 22)) {
                rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: budget %lld out of range", l, (long long)b[l].v.i64);
                break;
            }
            if (b[l].v.i64 != p.budget)
                len += (size_t)snprintf(lb + len, cap - len, len ? ",%d=%d" : "%d=%d", l, (int)b[l].v.i64);
        }
        /* a λ the base budget derived is derived per layer again */
        if (!rc && p.lambda == still_derived_lambda(p.budget, p.chunk, c->n_ctx_train)) p.lambda = -1;
    }
    /* optional: the per-layer linear switch, as a --no-linear-layers spec of the hybrid layers without it */
    char *nl = NULL;
    if (!rc && gguf_find(f, "still.attn.layer_linear")) {
        const gguf_value *b;
        uint64_t nb;
        rc = gguf_get_arr(f, "still.attn.layer_linear", GGUF_TYPE_INT32, &b, &nb, err);
        if (!rc && nb != (uint64_t)c->n_layer)
            rc = still_fail(err, STILL_E_FORMAT, "adapter lists %llu layer linear switches for a %d-layer model",
                            (unsigned long long)nb, c->n_layer);
        const size_t cap = (size_t)c->n_layer * 12 + 1;
        size_t len = 0;
        if (!rc && !(nl = calloc(cap, 1))) rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        for (int l = 0; !rc && l < c->n_layer; l++) {
            if (b[l].v.i64 != 0 && b[l].v.i64 != 1) {
                rc = still_fail(err, STILL_E_FORMAT, "adapter layer %d: linear switch %lld is not 0 or 1", l,
                                (long long)b[l].v.i64);
                break;
            }
            if (!b[l].v.i64)   /* (softmax layers are 0 too: a switch they do not read) */
                len += (size_t)snprintf(nl + len, cap - len, len ? ",%d" : "%d", l);
        }
    }
    if (!rc) {
        const gguf_value *v = gguf_find(f, "still.attn.seed");
        p.seed = v && v->type == GGUF_TYPE_UINT64 ? v->v.u64 : 0;
        p.kind = kind, p.routing = routing, p.feature_map = fmap, p.selection = selection, p.sel_cache = store;
        p.softmax_layers = keep_len && strcmp(kind, "softmax") ? keep : NULL;
        if (mask & STILL_PLAN_WINDOW) p.window = over->window;
        if (mask & STILL_PLAN_CHUNK) p.chunk = over->chunk;
        p.layer_budgets = lb && *lb ? lb : NULL;
        if (mask & STILL_PLAN_BUDGET) p.budget = over->budget, p.layer_budgets = NULL;   /* one budget everywhere */
        if (mask & STILL_PLAN_LAYER_BUDGETS) p.layer_budgets = over->layer_budgets;
        if (mask & STILL_PLAN_LAMBDA) p.lambda = over->lambda;
        /* the adapter records the λ its budget gave; a new budget alone
         * derives λ again, as --attn still --budget M would */
        else if (mask & (STILL_PLAN_BUDGET | STILL_PLAN_LAYER_BUDGETS)) p.lambda = -1;
        if (mask & STILL_PLAN_ROUTING) p.routing = over->routing;
        if (mask & STILL_PLAN_PER_KV_HEAD) p.per_kv_head = over->per_kv_head;
        p.no_linear_layers = nl && *nl ? nl : NULL;
        if (mask & STILL_PLAN_LINEAR) p.linear = over->linear;
        if (mask & STILL_PLAN_NO_LINEAR_LAYERS) p.no_linear_layers = over->no_linear_layers;
        if (mask & STILL_PLAN_SEED) p.seed = over->seed;
        if (mask & STILL_PLAN_SELECTION) p.selection = over->selection;
        if (mask & STILL_PLAN_SEL_SPAN) p.sel_span = over->sel_span;
        if (mask & STILL_PLAN_GATE_DEN) p.gate_den = over->gate_den;
        if (mask & STILL_PLAN_SEL_CACHE) p.sel_cache = over->sel_cache;
        rc = still_model_set_attention(m, &p, err);
    }
    free(keep), free(lb), free(nl);
    for (int l = 0; !rc && l < c->n_layer; l++) {
        size_t n = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
        const gguf_tensor *t = gguf_find_tensor(f, name);
        if (!n) {
            if (t) rc = still_fail(err, STILL_E_FORMAT, "adapter has parameters for layer %d, whose kind has none", l);
            continue;
        }
        if (!t) { rc = still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' is missing", name); break; }
        if ((t->type != TT_F32 && t->type != TT_F16) || t->n_dims != 1 || (size_t)t->ne[0] != n) {
            rc = still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' must be F32 or F16 of %zu elements", name, n);
            break;
        }
        if (t->type == TT_F32) memcpy(m->attn_params[l], t->data, n * sizeof(float));
        else
            for (size_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, (const unsigned char *)t->data + 2 * i, sizeof h);
                m->attn_params[l][i] = f16_to_f32(h);
            }
        for (size_t i = 0; i < n; i++)
            if (!isfinite(m->attn_params[l][i])) {
                rc = still_fail(err, STILL_E_FORMAT, "adapter tensor '%s' contains a non-finite value", name);
                break;
            }
    }
    return rc;
}

int adapter_apply(still_model *m, const gguf_file *f, still_err *err) {
    return adapter_apply_with(m, f, NULL, 0, err);
}

int still_model_load_adapter(still_model *m, const char *path, still_err *err) {
    return still_model_load_adapter_with(m, path, NULL, 0, err);
}

int still_model_load_adapter_with(still_model *m, const char *path, const still_attn_params *over, unsigned mask,
                                  still_err *err) {
    gguf_file *f;
    int rc = gguf_open(path, &f, err);
    if (rc) return rc;
    if (!adapter_present(f)) {
        rc = lora_present(f) ? still_fail(err, STILL_E_FORMAT, "'%s' is a LoRA adapter without an attention plan: load it with --lora", path)
                             : still_fail(err, STILL_E_FORMAT, "'%s' is not a still adapter (no still.attn.layer_kinds)", path);
    } else {
        lora_set *lo = NULL;
        if (lora_present(f)) {
            const lora_shape sh = model_lora_shape(m);
            rc = lora_read(f, &sh, &lo, err);
        }
        if (!rc) rc = adapter_apply_with(m, f, over, mask, err);
        if (!rc) model_set_lora(m, lo);
        else lora_free(lo);
    }
    gguf_close(f);
    return rc;
}

/* If tensor `name` is a LoRA target of m, its merged rows W + s B A as F16
 * in *out (malloc'ed; *nbytes); else *out = NULL. */
static int merge_lora_tensor(const still_model *m, const char *name, const gguf_tensor *t, void **out, size_t *nbytes,
                             still_err *err) {
    *out = NULL;
    const lora_set *lo = m->lora;
    int layer, used = 0;
    char base[64];
    if (!lo || sscanf(name, "blk.%d.%63[^.].weight%n", &layer, base, &used) != 2 || used != (int)strlen(name) ||
        layer < 0 || layer >= lo->n_layer)
        return STILL_OK;
    int tg = -1;
    for (int k = 0; k < LORA_N_TARGETS; k++)
        if (!strcmp(base, lora_target_tensor((lora_target)k))) tg = k;
    if (tg < 0 || !lora_A(lo, layer, (lora_target)tg)) return STILL_OK;
    const int ni = lo->n_in[tg], no = lo->n_out[tg], r = lo->rank;
    if (t->n_dims != 2 || t->ne[0] != ni || t->ne[1] != no)
        return still_fail(err, STILL_E_FORMAT, "tensor '%s' does not have the LoRA's shape", name);
    float *W = malloc(sizeof(float) * (size_t)ni * no);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)ni * no);
    if (!W || !h) {
        free(W), free(h);
        return still_fail(err, STILL_E_NOMEM, "out of memory merging '%s'", name);
    }
    const size_t rb = tensor_row_bytes(t->type, ni);
    int rc = STILL_OK;
    for (int o = 0; o < no && !rc; o++) rc = dequantize_row(t->type, (const uint8_t *)t->data + (size_t)o * rb, W + (size_t)o * ni, ni, err);
    if (!rc) {
        /* W += s B A: B [no][r], A [r][ni] */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, no, ni, r, lora_scale(lo), lora_B(lo, layer, (lora_target)tg), r,
                    lora_A(lo, layer, (lora_target)tg), ni, 1.0f, W, ni);
        for (size_t i = 0; i < (size_t)ni * no && !rc; i++) {
            if (!(fabsf(W[i]) <= 65504.0f)) rc = still_fail(err, STILL_E_ARG, "merged '%s' has a value beyond f16's range", name);
            h[i] = f32_to_f16(W[i]);
        }
    }
    free(W);
    if (rc) {
        free(h);
        return rc;
    }
    *out = h, *nbytes = sizeof(uint16_t) * (size_t)ni * no;
    return STILL_OK;
}

int still_model_save_merged(const still_model *m, const char *path, still_err *err) {
    const gguf_file *base = m->file;
    gguf_writer *w;
    int rc = gguf_writer_create(&w, err);
    if (rc) return rc;
    for (int64_t i = 0; !rc && i < gguf_kv_count(base); i++) {
        const gguf_kv *kv = gguf_kv_at(base, i);
        if (kv->key.len >= 6 && !memcmp(kv->key.ptr, "still.", 6)) continue;   /* replaced below */
        char key[512];
        if (kv->key.len >= sizeof key) { rc = still_fail(err, STILL_E_FORMAT, "metadata key too long"); break; }
        memcpy(key, kv->key.ptr, kv->key.len);
        key[kv->key.len] = 0;
        rc = gguf_writer_set(w, key, &kv->value, err);
    }
    for (int64_t i = 0; !rc && i < gguf_tensor_count(base); i++) {
        const gguf_tensor *t = gguf_tensor_at(base, i);
        char name[256];
        if (t->name.len >= sizeof name) { rc = still_fail(err, STILL_E_FORMAT, "tensor name too long"); break; }
        memcpy(name, t->name.ptr, t->name.len);
        name[t->name.len] = 0;
        if (strstr(name, ".attn_hybrid.")) continue;   /* replaced below */
        void *merged = NULL;
        size_t nb = 0;
        if ((rc = merge_lora_tensor(m, name, t, &merged, &nb, err))) break;
        if (merged) rc = gguf_writer_add_tensor(w, name, TT_F16, t->n_dims, t->ne, merged, nb, err);
        else rc = gguf_writer_add_tensor(w, name, t->type, t->n_dims, t->ne, t->data, t->nbytes, err);
        free(merged);
    }
    if (!rc) rc = write_plan(m, w, 0, err);
    if (!rc) rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}
