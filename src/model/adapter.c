/* Linearized-model files: the attention plan and its trained parameters as
 * GGUF metadata + tensors (read and written by src/kinds/plan.c; this file writes
 * and applies whole adapter and merged files).
 *
 * An adapter GGUF holds only what linearization adds to a base model:
 *   still.attn.layer_kinds   array of strings, one attention kind per layer
 *                            (kinds may mix: softmax, swa and one linear or
 *                            hybrid kind per file)
 *   still.attn.window, .chunk, .feature_dim, .budget, .lambda   (int32)
 *   still.attn.layer_budgets (int32 array, one per layer; optional, only when
 *                            layers' budgets differ; .budget is then the most
 *                            common one and a derived λ is derived per layer)
 *   still.attn.layer_window, .layer_chunk, .layer_feature_dim, .layer_lambda
 *                            (int32 arrays, one per layer; optional, each only
 *                            when layers differ in it; .layer_lambda only when
 *                            some layer's λ is not the one its budget derives)
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
#include "common/common.h"
#include "kinds/attn.h"
#include "format/gguf.h"
#include "model/model.h"
#include "format/quant.h"

#include <cblas.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    if (!rc) {
        const plan_shape ps = model_plan_shape(m);
        const attn_plan plan = model_plan(m);
        rc = plan_write(&ps, &plan, w, f16, err);
    }
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

/* Set m's plan from f's (see still_model_load_adapter_with). */
static int adapter_apply_with(still_model *m, const gguf_file *f, const still_attn_params *over, unsigned mask,
                              still_err *err) {
    const plan_shape ps = model_plan_shape(m);
    attn_plan plan;
    int rc = plan_read(&ps, f, over, mask, &plan, err);
    if (rc) return rc;
    model_set_plan(m, &plan);
    return STILL_OK;
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
    if (!plan_present(f)) {
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
    if (!rc) {
        const plan_shape ps = model_plan_shape(m);
        const attn_plan plan = model_plan(m);
        rc = plan_write(&ps, &plan, w, 0, err);
    }
    if (!rc) rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}
