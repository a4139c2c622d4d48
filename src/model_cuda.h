/* The model's forward pass on the CUDA backend (model_cuda.c), behind
 * still_context when it is created with device STILL_DEVICE_CUDA. */
#ifndef STILL_MODEL_CUDA_H
#define STILL_MODEL_CUDA_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

typedef struct gpu_context gpu_context;

/* Upload m's weights (dequantized to bf16) and allocate an n_ctx-token KV
 * cache and n_batch-token activations on CUDA device 0. Fails with a
 * one-line message when the build or the machine has no CUDA device, the
 * plan has a kind the GPU does not run, or device memory runs out. */
int gpu_context_create(const still_model *m, int n_ctx, int n_batch, gpu_context **out, still_err *err);
void gpu_context_free(gpu_context *g);
/* Forget the sequence: still states back to 0 tokens (a KV cache needs
 * nothing: its rows are overwritten). */
int gpu_context_reset(gpu_context *g, still_err *err);
/* Does the plan hold a kind whose state folds tokens irreversibly (still)?
 * Such a context can only be truncated to 0 tokens. */
/* Drop the tokens after the first n of n_past: softmax always; swa while its
 * cache still holds the window before n; still only to 0 (folded state). */
int gpu_context_truncate(gpu_context *g, int n_past, int n, still_err *err);
/* Bytes of the attention state (the bf16 KV cache) on the device. */
size_t gpu_context_state_bytes(const gpu_context *g);
/* T (<= n_batch) tokens at positions p0 .. p0+T-1 (the cache holds 0 .. p0-1);
 * logits: NULL, the last token's (all_logits 0) or every token's, on the host. */
int gpu_forward_chunk(gpu_context *g, const int32_t *tokens, int T, int p0, float *logits, int all_logits,
                      still_err *err);

#endif
