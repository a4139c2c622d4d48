/* The whole model's forward and backward for next-token training on the GPU
 * (stage 2, `still finetune --device cuda`): src/train_lm.c's algorithm, step
 * for step, on the CUDA backend.
 *
 * - The frozen weights are dequantized once to bf16 on the device; their
 *   products (the forward Y = X Wᵀ and the backward dX = dY W) run through
 *   cuBLASLt with bf16 inputs and fp32 sums. Everything else is fp32: the
 *   residual stream, the activations, the LoRA products, the attention's
 *   score matrices, the cross-entropy.
 * - Checkpointing as on the CPU: every layer's input is kept, one layer's
 *   activations are recomputed at a time in the backward; the logits exist a
 *   block of rows at a time.
 * - softmax and swa layers: the attention's forward and backward by
 *   products over the whole T × T score matrix of one head at a time
 *   (P = softmax(s Q Kᵀ), O = P V; dV = Pᵀ dO, dP = dO Vᵀ,
 *   dS = s P ⊙ (dP − rowsum(dO ⊙ O)), dQ = dS K, dK = dSᵀ Q), so a sequence
 *   of T tokens needs 2 T² floats of scratch (512 MiB at 8K). Other kinds
 *   are refused for now.
 * - The LoRA's master weights stay on the host (the trainer's AdamW): each
 *   sequence uploads them, and a training sequence adds its LoRA gradients
 *   into the host's. Dropout masks are the CPU trainer's (the same hash).
 * - A sequence's device work (between the uploads and the downloads) is
 *   recorded as a CUDA graph at the second sequence of its length and kind
 *   (loss weights or not, training or validation) and replayed after that:
 *   the dropout seed and the loss scale are read from device memory. */
#ifndef STILL_TRAIN_LM_CUDA_H
#define STILL_TRAIN_LM_CUDA_H

#include "train_lm.h"

typedef struct lm_train_cuda lm_train_cuda;

/* As lm_train_create, on CUDA device 0 (a one-line error without a CUDA
 * build or device, or for a plan with kinds other than softmax and swa).
 * exact: the frozen weights and their products in fp32 instead of bf16
 * (for the tests: then the GPU computes what the CPU does, to fp32 rounding). */
int lm_train_cuda_create(const still_model *m, const lora_set *lora, int max_T, float dropout, int exact,
                         lm_train_cuda **out, still_err *err);
void lm_train_cuda_free(lm_train_cuda *t);

/* As lm_train_seq (the same arguments and results; g->attn must be NULL). */
int lm_train_cuda_seq(lm_train_cuda *t, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                      const lm_grads *g, double *loss_sum, double *w_sum, still_err *err);

#endif
