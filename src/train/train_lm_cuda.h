/* The whole model's forward and backward for next-token training on the GPU
 * (stage 2, `still finetune --device cuda`): src/train/train_lm.c's algorithm, step
 * for step, on the CUDA backend.
 *
 * - The frozen weights are dequantized once to bf16 on the device; their
 *   products (the forward Y = X Wᵀ and the backward dX = dY W) run through
 *   cuBLASLt with bf16 inputs and fp32 sums. Everything else is fp32: the
 *   residual stream, the activations, the LoRA products, the attention's
 *   score matrices, the cross-entropy.
 * - A batch of B sequences of T tokens runs as one pass of B·T rows: every
 *   row-wise step and product covers the whole batch (8 sequences of 1,024
 *   tokens: one launch where there were eight).
 * - Checkpointing as on the CPU: every layer's input is kept, one layer's
 *   activations are recomputed at a time in the backward; the logits exist a
 *   block of rows at a time.
 * - softmax and swa layers: the attention's forward and backward by
 *   products over whole T × T score matrices (P = softmax(s Q Kᵀ), O = P V;
 *   dV = Pᵀ dO, dP = dO Vᵀ, dS = s P ⊙ (dP − rowsum(dO ⊙ O)), dQ = dS K,
 *   dK = dSᵀ Q), head-major, every (sequence, KV head) block of the batch in
 *   one strided-batched product (as many as fit in 2 × 512 MiB of scores;
 *   at least one block of G T² floats: 2 × 768 MiB at 8K for SmolLM2).
 * - still and lolcats layers: a sequence and a query head at a time
 *   (cuda/train/train_lm_still.cu), the rest of the layer batched.
 * - The LoRA's master weights stay on the host (the trainer's AdamW): each
 *   batch uploads them, and a training batch adds its LoRA gradients into
 *   the host's. Dropout masks are the CPU trainer's (the same hash).
 * - A batch's device work (between the uploads and the downloads) is
 *   recorded as a CUDA graph at the second batch of its shape and kind
 *   (loss weights or not, training or validation) and replayed after that:
 *   the dropout seeds and the loss scale are read from device memory. */
#ifndef STILL_TRAIN_LM_CUDA_H
#define STILL_TRAIN_LM_CUDA_H

#include "train/train_lm.h"

typedef struct lm_train_cuda lm_train_cuda;

/* As lm_train_create, on CUDA device 0, for batches of up to max_B
 * sequences of up to max_T tokens (a one-line error without a CUDA build or
 * device, or for a plan with kinds the GPU trainer does not run). exact: the
 * frozen weights and their products in fp32 instead of bf16 (for the tests:
 * then the GPU computes what the CPU does, to fp32 rounding). */
int lm_train_cuda_create(const still_model *m, const lora_set *lora, int max_T, int max_B, float dropout, int exact,
                         lm_train_cuda **out, still_err *err);
void lm_train_cuda_free(lm_train_cuda *t);

/* As lm_train_seq (the same arguments and results; g->attn must be NULL). */
int lm_train_cuda_seq(lm_train_cuda *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                      const lm_grads *g, double *loss_sum, double *w_sum, still_err *err);
/* B sequences of T tokens at once, the same as B calls of lm_train_cuda_seq with the same scale (loss and weight
 * sums over all of them, gradients added once): tok[b], w[b] (w NULL, or any w[b] NULL: every row of that
 * sequence weighs 1), drop_seeds[b]. */
int lm_train_cuda_batch(lm_train_cuda *t, const int32_t *const *tok, const float *const *w, int B, int T, float scale,
                        const uint64_t *drop_seeds, const lm_grads *g, double *loss_sum, double *w_sum, still_err *err);

#endif
