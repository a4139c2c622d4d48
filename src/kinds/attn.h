/* Attention kinds: the interface every kind implements (see
 * ../shared/spec/attention.md for the math of each).
 *
 * A model layer hands its kind the per-head q, k, v (after RoPE; q_nope /
 * k_nope before RoPE for kinds that ask for them) and the normed layer input
 * x of T consecutive tokens, and gets back per-head outputs [T][H*D]. The
 * kind keeps whatever it needs between calls in its state (a KV cache, a
 * ring of recent keys, a linear-attention summary, selected tokens), so the
 * same forward serves a whole-prompt prefill (T large), a chunked prefill and
 * a decode step (T = 1): one algorithm, any split of the sequence. */
#ifndef STILL_ATTN_H
#define STILL_ATTN_H

#include "still.h"
#include "kinds/still/attn_still_rules.h"

#include <stddef.h>
#include <stdint.h>

typedef enum {
    ATTN_SOFTMAX = 0, ATTN_SWA, ATTN_LOLCATS, ATTN_LIGER, ATTN_STILL, ATTN_GDN, ATTN_DSA, ATTN_KIND_COUNT
} attn_kind_id;

/* still's routing of leaving chunks (spec: "Routing with a fixed budget"). */
typedef enum {
    ROUTE_SALIENCY = STILL_ROUTE_SALIENCY, ROUTE_RANDOM = STILL_ROUTE_RANDOM, ROUTE_KEYNORM = STILL_ROUTE_KEYNORM,
    ROUTE_QK = STILL_ROUTE_QK, ROUTE_POSITION = STILL_ROUTE_POSITION, ROUTE_NONE = STILL_ROUTE_NONE,
} attn_routing;

typedef enum { FMAP_NPMAP = STILL_FMAP_NPMAP, FMAP_HEDGEHOG = STILL_FMAP_HEDGEHOG } attn_feature_map;

/* Storage of still's selected keys and values (a run-time choice, not part
 * of the plan): float32, IEEE half (rounded to nearest even), or 8 bits with
 * one float scale per token and vector. */
typedef enum { SEL_F32 = 0, SEL_F16, SEL_Q8 } attn_sel_type;

/* Hyper-parameters of one layer's attention. */
typedef struct {
    attn_kind_id kind;
    int n_head, n_head_kv, head_dim, d_model;
    int n_ctx;      /* longest sequence the state must hold */
    int window;     /* swa: keys t-window < j <= t; liger: its sliding window (64) */
    /* lolcats and still */
    int chunk;      /* C: chunk size of the terrace (Local = current chunk + previous one) */
    int feature_dim;/* F of the Hedgehog feature map (lolcats; still with feature_map hedgehog) */
    /* still */
    int budget;     /* m: softmax KV slots per head in total (0: uncapped reference mode) */
    int lambda;     /* tokens selected per leaving chunk (< 0: derived from budget, n_ctx, chunk) */
    int per_kv_head;            /* select per KV head (scores of its G query heads summed) */
    int sel_global;             /* budget mode: Sel keeps the best-scoring tokens of the whole history and
                                 * evicts its worst into the linear state (0: λ per leaving chunk, kept forever) */
    int sel_span;               /* a leaving token's routing value: the best score within sel_span positions
                                 * of it, among the positions still in the ring (its chunk and the next) */
    attn_routing routing;
    int linear;                 /* linear branch on */
    attn_feature_map feature_map;
    int gate;                   /* gate on the linear numerator */
    int gate_den;               /* the gate also scales the linear state's term of the denominator, per
                                 * channel: y_d = (Σ e v_d + g_d (φqᵀS)_d) / (Σ e + g_d φq·z + 1e-6)
                                 * (docs/gate-den.md; needs linear and gate) */
    uint64_t seed;              /* random routing */
    attn_sel_type sel_type;     /* still: storage of Sel's keys and values */
    int conv;                   /* gdn: width of the short causal convolution on q, k, v (0: none) */
    int norm;                   /* gdn: 1 = the per-head RMSNorm of the outputs (the spec's), 0 = none (a plan's
                                 * default: a converted layer then starts at the teacher's output scale) */
    /* dsa (src/kinds/dsa/attn_dsa_rules.h) */
    int index_heads;            /* H_I: the lightning indexer's heads */
    int index_dim;              /* d_I: their size (and the one indexer key's per token) */
    int topk;                   /* keys each query attends to (the last DSA_LOCAL of them always) */
    int index_from;             /* a new plan's indexer: -1 random (the spec's), else it starts as the layer's own
                                 * W_q rows of KV head index_from's query heads and W_k rows of that head (plan
                                 * "ifrom"; used when the plan is made, not stored: attn_dsa_init_from_projections) */
} attn_config;

/* Per-layer inputs for T tokens at positions p0 .. p0+T-1. Rows are tokens:
 * q [T][H*D], k and v [T][Hk*D]; q_nope/k_nope likewise (may be NULL unless
 * the kind needs them); x [T][d_model] (may be NULL unless needed).
 * gate_pre: NULL, or for one token (T = 1; ignored otherwise) the gate's
 * pre-activations W_g x [H*D] (without its bias; kinds with x_gate) computed by
 * the caller (the decode step's 8-bit products, model.c); the kind computes
 * them from x otherwise. */
typedef struct {
    const float *q, *k, *v, *q_nope, *k_nope, *x;
    int p0, T;
    const float *gate_pre;
} attn_io;

/* A layer's attention state: the common part every kind shares, and the
 * kind's own data behind impl. */
/* Gradients of a kind's inputs (stage 2: the whole model trains), shaped as
 * attn_io's arrays: dq [T][H*D], dk and dv [T][Hk*D] (after RoPE), dq_nope
 * [T][H*D] and dk_nope [T][Hk*D] (kinds with needs_nope), dx [T][d_model]
 * (kinds with needs_x), and dparams (param_count floats). Every non-NULL
 * buffer is accumulated into (+=); a NULL one is not wanted (dparams NULL:
 * the kind's own parameters are frozen). */
typedef struct {
    float *dq, *dk, *dv, *dq_nope, *dk_nope, *dx, *dparams;
} attn_grads;

/* A piece of memory holding part of a sequence's state (state_regions). */
typedef struct {
    void *p;
    size_t bytes;
} attn_region;

typedef struct attn_state {
    attn_config cfg;
    int n_seen;     /* tokens processed so far */
    void *impl;
} attn_state;

typedef struct {
    const char *name;
    int needs_nope;    /* wants q/k before RoPE */
    int needs_x;       /* wants the layer input */
    /* Number of trainable floats for this configuration (0: none). */
    size_t (*param_count)(const attn_config *c);
    /* Fill params with the spec's initialisation, deterministically from seed. */
    void (*param_init)(const attn_config *c, float *params, uint64_t seed);
    int (*state_create)(const attn_config *c, attn_state **out, still_err *err);
    void (*state_free)(attn_state *s);
    /* Keep only the first n tokens (n <= n_seen). Kinds whose state folds
     * tokens irreversibly accept only n == 0 and n == n_seen. */
    int (*state_truncate)(attn_state *s, int n, still_err *err);
    /* Bytes the state holds for the sequence (as allocated). */
    size_t (*state_bytes)(const attn_state *s);
    /* The memory that holds the sequence's state after s->n_seen tokens: everything a later forward reads, scratch
     * left out, as up to max regions in a fixed order (their sizes may depend on n_seen, nothing else). A snapshot
     * copies them out; a restore sets n_seen on a state of the same configuration, then copies them back in.
     * Returns the count, or -1 when max is too small. */
    int (*state_regions)(attn_state *s, attn_region *out, int max);
    /* Process io->T tokens continuing the sequence held by the state
     * (io->p0 must equal the number of tokens seen so far); out [T][H*D].
     * Parallel inside (OpenMP); call from outside a parallel region. */
    int (*forward)(attn_state *s, const float *params, const attn_io *io, float *out, still_err *err);
    /* Training (stage 1, attention transfer): for a whole sequence io (p0 = 0)
     * and the gradient dout [T][H*D] of the loss with respect to forward's
     * output, accumulate the gradient with respect to the kind's parameters
     * into dparams (param_count floats). Selection is a fixed routing decision.
     * NULL for kinds without parameters and until implemented. */
    int (*backward)(const attn_config *c, const float *params, const attn_io *io, const float *dout, float *dparams,
                    still_err *err);
    /* Stage 2: for a whole sequence io (p0 = 0, T <= n_ctx) and the gradient
     * dout [T][H*D] of the loss with respect to forward's output, accumulate
     * the gradients with respect to the inputs (and, when g->dparams is not
     * NULL, the parameters) into g (attn_grads). Selection is a fixed routing
     * decision, as in backward. Every kind has one. */
    int (*backward_inputs)(const attn_config *c, const float *params, const attn_io *io, const float *dout,
                           const attn_grads *g, still_err *err);
    /* Optional: the kind's gate on the layer input, W_g [H·D][d_model] and its bias b_g [H·D], within params
     * (1), or none (0; NULL: the kind has none). A decode step may compute W_g x with the model's q, k, v
     * products and pass it as attn_io.gate_pre (model.c: 8-bit products on the CPU). */
    int (*x_gate)(const attn_config *c, const float *params, const float **Wg, const float **bg);
    /* Optional fused stage-1 step (see attn_distill); NULL: forward + backward. */
    int (*distill)(const attn_config *c, const float *params, const attn_io *io, const float *target, float scale,
                   float *dparams, double *mse, still_err *err);
} attn_kind;

const attn_kind *attn_kind_get(attn_kind_id id);
/* The plan's names, as the GGUF metadata and the flags spell them (one table each, src/kinds/attn.c): name (NULL when
 * out of range) and parse (0, or -1 for an unknown name, *out untouched). Selection: "chunk" (0) or "global" (1). */
const char *attn_routing_name(attn_routing r);
int attn_routing_parse(const char *s, attn_routing *out);
const char *attn_feature_map_name(attn_feature_map f);
int attn_feature_map_parse(const char *s, attn_feature_map *out);
const char *attn_selection_name(int sel_global);
int attn_selection_parse(const char *s, int *sel_global);
/* Mean of (y - target)² over n floats; dout (may be NULL, may alias y) gets
 * scale times its gradient, scale · 2 (y - target) / n. */
double attn_mse_grad(const float *y, const float *target, size_t n, float scale, float *dout);

/* Stage 1 for one layer and one whole sequence io (p0 = 0): the kind's output
 * y on a fresh state, *mse = mean((y - target)²) over tokens, heads and
 * channels, and, when dparams is not NULL, dparams += scale · ∂mse/∂params. */
int attn_distill(const attn_kind *k, const attn_config *c, const float *params, const attn_io *io,
                 const float *target, float scale, float *dparams, double *mse, still_err *err);
/* attn_distill's default step, whatever the kind's own distill: forward on a fresh state, the output's MSE, and
 * with dparams its gradient through k->backward (a kind's distill that adds a loss of its own calls it first). */
int attn_distill_output(const attn_kind *k, const attn_config *c, const float *params, const attn_io *io,
                        const float *target, float scale, float *dparams, double *mse, still_err *err);
/* Look a kind up by name ("softmax", "swa", ...); NULL if unknown. */
const attn_kind *attn_kind_find(const char *name, attn_kind_id *id);

#endif
