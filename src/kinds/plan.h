/* The attention plan: one attention configuration per layer (any mix of
 * kinds; each layer with its own hyper-parameters), the layers' trainable
 * parameters, and the selected store the plan is sized for.
 *
 * This module is the one place where a plan is made from the command line's
 * settings (still_attn_params), read from and written to GGUF metadata and
 * tensors (the still.attn.* keys, blk.N.attn_hybrid.params; the format is
 * described in src/model/adapter.c), and validated. The model holds the result;
 * the adapter files, the trainers and the GPU backend read it. It depends
 * on the attention kinds (attn.h) and the GGUF reader and writer only. */
#ifndef STILL_PLAN_H
#define STILL_PLAN_H

#include "kinds/attn.h"
#include "still.h"

#include <stdint.h>

typedef struct gguf_file gguf_file;
typedef struct gguf_writer gguf_writer;

/* What a plan needs of the model it is for. */
typedef struct {
    int n_layer, d_model, n_head, n_head_kv, head_dim, n_ctx_train;
} plan_shape;

typedef struct {
    int n_layer;
    attn_config *cfg;   /* [n_layer] */
    float **params;     /* [n_layer]; NULL where the layer's kind has none (owned) */
    int sel_cache;      /* STILL_SEL_F16, _F32 or _Q8: the store contexts use unless told otherwise */
} attn_plan;

void plan_free(attn_plan *p);

/* still's λ from a budget (tokens kept per leaving chunk when the budget is spread over the trained
 * context's chunks; C / 16 uncapped); 0 for an invalid chunk or context. */
int plan_derived_lambda(int budget, int chunk, int n_ctx_train);

/* The plan the command line's settings describe (every layer the same kind but p->softmax_layers, per-layer
 * budgets and linear switches from p->layer_budgets / p->no_linear_layers); new parameters at the spec's
 * initialisation. */
int plan_from_params(const plan_shape *s, const still_attn_params *p, attn_plan *out, still_err *err);

/* Does this GGUF carry a plan (still.attn.layer_kinds)? */
int plan_present(const gguf_file *f);
/* The plan a GGUF carries, its parameters included, with the settings named in mask (STILL_PLAN_* bits, only
 * those in STILL_PLAN_OVERRIDABLE) taken from over. */
int plan_read(const plan_shape *s, const gguf_file *f, const still_attn_params *over, unsigned mask, attn_plan *out,
              still_err *err);
/* Write p's metadata and parameter tensors into w (parameters as F16 when f16, else F32). */
int plan_write(const plan_shape *s, const attn_plan *p, gguf_writer *w, int f16, still_err *err);

#endif
