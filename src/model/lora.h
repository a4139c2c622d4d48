/* LoRA: low-rank updates of a model's frozen projection matrices (stage 2,
 * `still finetune`). For a target matrix W (n_out rows of n_in) of layer l:
 *
 *   y = W x + s · B (A x),   A [rank][n_in], B [n_out][rank],   s = alpha / rank
 *
 * (llama.cpp's convention: s = alpha / rank when alpha is set, else 1; times
 * a user scale, as llama.cpp's --lora-scaled). Stored in GGUF the way
 * llama.cpp stores LoRA adapters: general.type = "adapter", adapter.type =
 * "lora", adapter.lora.alpha (float32), and per target the tensors
 * blk.N.<name>.weight.lora_a with ne = [n_in, rank] and
 * blk.N.<name>.weight.lora_b with ne = [rank, n_out], where <name> is the
 * base tensor's (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up,
 * ffn_down). A and B stay float32 in memory (the fine-tune's master weights). */
#ifndef STILL_LORA_H
#define STILL_LORA_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

typedef struct gguf_file gguf_file;
typedef struct gguf_writer gguf_writer;

typedef enum { LORA_Q = 0, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_N_TARGETS } lora_target;

typedef struct lora_set {
    int n_layer, rank;
    float alpha;          /* as stored (0: none, then the scale is 1) */
    float user_scale;     /* --lora-scaled; 1 by default */
    unsigned targets;     /* bit t set: some layer has target t (a layer's own: lora_A non-NULL) */
    int n_in[LORA_N_TARGETS], n_out[LORA_N_TARGETS];
    float **A, **B;       /* [n_layer * LORA_N_TARGETS]; NULL where the target is absent */
} lora_set;

/* The shapes a model gives each target: n_in / n_out per target. */
typedef struct {
    int n_layer, n_in[LORA_N_TARGETS], n_out[LORA_N_TARGETS];
} lora_shape;

/* Short option names ("q", "k", "v", "o", "gate", "up", "down") and GGUF base
 * tensor names ("attn_q", ...). */
const char *lora_target_option(lora_target t);
const char *lora_target_tensor(lora_target t);
/* "q,k,v,o" (any of the seven names, "all" for every one) -> bit mask. */
int lora_parse_targets(const char *s, unsigned *mask, still_err *err);

/* Zeroed A and B for the targets in mask (rank 1 .. min(n_in, n_out) of every
 * target). */
int lora_create(const lora_shape *sh, int rank, float alpha, unsigned targets, lora_set **out, still_err *err);
void lora_free(lora_set *s);
/* peft's initialisation: A kaiming-uniform with a = sqrt(5) (U(-b, b), b =
 * 1/sqrt(n_in)), B = 0, deterministic from seed. */
void lora_init(lora_set *s, uint64_t seed);
/* The effective scale s (alpha / rank, or 1 without alpha, times user_scale). */
float lora_scale(const lora_set *s);
static inline float *lora_A(const lora_set *s, int layer, lora_target t) { return s->A[layer * LORA_N_TARGETS + t]; }
static inline float *lora_B(const lora_set *s, int layer, lora_target t) { return s->B[layer * LORA_N_TARGETS + t]; }
/* Floats of one target's A and B together; of the whole set. */
size_t lora_target_floats(const lora_set *s, lora_target t);
size_t lora_floats(const lora_set *s);

/* Y [T][n_out] += s · (X [T][n_in] Aᵀ) Bᵀ for layer l's target t (no-op when
 * the set is NULL or lacks the target). tmp: T · rank floats, or NULL to
 * allocate (returns STILL_E_NOMEM on failure). */
int lora_apply(const lora_set *s, int layer, lora_target t, const float *X, float *Y, int T, float *tmp);

/* Does f hold LoRA tensors (general.type = adapter, adapter.type = lora)? */
int lora_present(const gguf_file *f);
/* Read the LoRA tensors of f (F32, F16 or BF16), checked against sh. */
int lora_read(const gguf_file *f, const lora_shape *sh, lora_set **out, still_err *err);
/* Add the LoRA keys (general.type, adapter.type, adapter.lora.alpha) and
 * tensors (float32) to w. */
int lora_write(const lora_set *s, gguf_writer *w, still_err *err);

#endif
