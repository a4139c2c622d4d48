/* The whole model's forward and backward on the CPU for next-token training
 * (stage 2, `still finetune`; src/train/finetune.c drives it).
 *
 * One sequence of T tokens: position t predicts token t+1 with weight w_t
 * (t < T-1), loss = Σ_t w_t · (logsumexp(logits_t) − logits_t[tok_{t+1}]).
 * The forward is the inference forward (model.c) written for a whole
 * sequence: the same quantized products, the kind's own forward on a fresh
 * state, LoRA after each targeted product. Memory stays bounded by
 * checkpointing: only every layer's input (the residual stream, T·d floats a
 * layer) is kept; the backward recomputes one layer's activations at a time.
 * The logits are computed in row blocks, so no T × n_vocab matrix exists.
 *
 * Backward, per layer from the top (x the layer input, r = 1/rms):
 *   x' = xm + down(silu(g) ⊙ u),  g = gate(h2), u = up(h2), h2 = norm(xm)
 *   xm = x + o(attn(q, k, v, h1)), q|k|v = rope(proj(h1)), h1 = norm(x)
 * through the frozen products as dX += dY W (matmul_t_acc, the weights stay
 * in their GGUF type), RMSNorm dx = r (w ⊙ dy) − x r³/n Σ(w ⊙ dy ⊙ x),
 * RoPE's inverse rotation, the kind's backward_inputs, and each LoRA target
 * y += s B A x̃ (x̃ = dropout(x)): dB += s dYᵀ (A x̃), dA += s (dY B)ᵀ x̃,
 * dx̃ = s (dY B) A. The frozen weights never receive a gradient. */
#ifndef STILL_TRAIN_LM_H
#define STILL_TRAIN_LM_H

#include "model/lora.h"
#include "still.h"

#include <stdint.h>

typedef struct lm_train lm_train;

/* What a backward accumulates into (any part may be NULL). */
typedef struct {
    lora_set *lora;   /* same shape as the model's LoRA: dA in A, dB in B */
    float **attn;     /* per layer: gradient of the kind's parameters (NULL: frozen) */
} lm_grads;

/* Scratch for sequences of up to max_T tokens of model m with LoRA set lora
 * (may be NULL) and LoRA dropout probability dropout in [0, 1). */
int lm_train_create(const still_model *m, const lora_set *lora, int max_T, float dropout, lm_train **out,
                    still_err *err);
void lm_train_free(lm_train *t);

/* One sequence: *loss_sum = Σ_t w_t CE_t, *w_sum = Σ_t w_t (w NULL: every
 * w_t = 1). With g, also the gradients of scale · loss_sum, accumulated into
 * g; dropout (training only, when the trainer was created with it) draws its
 * masks from drop_seed. */
int lm_train_seq(lm_train *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                 const lm_grads *g, double *loss_sum, double *w_sum, still_err *err);

#endif
