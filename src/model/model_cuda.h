/* The model's forward pass on the CUDA backend (model_cuda.c), behind
 * still_context when it is created with device STILL_DEVICE_CUDA. */
#ifndef STILL_MODEL_CUDA_H
#define STILL_MODEL_CUDA_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

typedef struct gpu_context gpu_context;

/* Upload m's weights (dequantized to bf16) and allocate an n_ctx-token KV
 * cache and n_batch-token activations on CUDA device 0; still layers store
 * Sel as sel_cache says (STILL_SEL_F16 or STILL_SEL_Q8; the GPU has no f32
 * store). Fails with a one-line message when the build or the machine has
 * no CUDA device, the plan has a kind the GPU does not run, or device
 * memory runs out. */
int gpu_context_create(const still_model *m, int n_ctx, int n_batch, int sel_cache, gpu_context **out, still_err *err);
void gpu_context_free(gpu_context *g);
/* Forget the sequence: still states back to 0 tokens (a KV cache needs
 * nothing: its rows are overwritten). */
int gpu_context_reset(gpu_context *g, still_err *err);
/* Does the plan hold a kind whose state folds tokens irreversibly (still)?
 * Such a context can only be truncated to 0 tokens. */
/* Drop the tokens after the first n of n_past: softmax always; swa while its
 * cache still holds the window before n; still only to 0 (folded state). */
int gpu_context_truncate(gpu_context *g, int n_past, int n, still_err *err);
/* A piece of a sequence's state in a GPU context (state snapshots): device memory, or a host value (host 1). */
typedef struct {
    void *p;
    size_t bytes;
    int host;
} gpu_region;
/* Layer l's state after n_past tokens as up to max regions in a fixed order (their sizes depend on n_past and the
 * configuration alone): the KV cache's rows (softmax: the first n_past; swa, liger: the whole window cache and its
 * first position), then the kind's device state (still, liger, gdn). Returns the count, -1 when max is too small. */
int gpu_context_state_regions(gpu_context *g, int l, int n_past, gpu_region *out, int max);
/* Copy a region out to host memory, or host memory into it (synchronous). */
int gpu_region_read(gpu_context *g, const gpu_region *r, void *host, still_err *err);
int gpu_region_write(gpu_context *g, const gpu_region *r, const void *host, still_err *err);
/* After every region was written back: the kinds' host positions set to n_past. */
int gpu_context_state_restored(gpu_context *g, int n_past, still_err *err);
/* Bytes of the attention state (the bf16 KV cache) on the device. */
size_t gpu_context_state_bytes(const gpu_context *g);
/* T (<= n_batch) tokens at positions p0 .. p0+T-1 (the cache holds 0 .. p0-1);
 * logits: NULL, the last token's (all_logits 0) or every token's, on the host. */
int gpu_forward_chunk(gpu_context *g, const int32_t *tokens, int T, int p0, float *logits, int all_logits,
                      still_err *err);

/* Stage-1 training (src/train/train_cuda.c). The observer runs once per layer,
 * after the teacher's softmax attention and before o_proj, with device
 * pointers: the layer input after RMSNorm in fp32 [T][d] and bf16, q and k
 * after RoPE [T][H][D] / [T][Hk][D], v [T][Hk][D] (fp32) and the teacher's
 * per-head outputs [T][H][D] (fp32); it enqueues its own work on the
 * context's stream and returns a still error code. */
typedef int (*gpu_layer_observer)(void *data, int layer, int T, const float *x_f32, const void *x_bf16,
                                  const float *q, const float *k, const float *v, const float *att, still_err *err);
/* Enqueues T / seq whole sequences of seq tokens side by side (T <= n_batch
 * and n_ctx; each at positions 0 .. seq-1; the token ids in device memory,
 * tokens_dev [T], checked by the caller) through a context whose every layer
 * is softmax (the teacher), calling fn once per layer with all T rows; no
 * logits. The row-wise work (norms, GEMMs, SwiGLU) runs over all T rows at
 * once, RoPE and the causal attention per sequence. Returns without waiting
 * for the device: the caller syncs, and may record the work into a CUDA
 * graph (after one plain call, which allocates the observed layer inputs
 * and outputs). */
int gpu_observed_enqueue(gpu_context *g, const int32_t *tokens_dev, int T, int seq, gpu_layer_observer fn, void *data,
                         still_err *err);
/* The context's stc_ctx (as void *; NULL without a CUDA backend). */
void *gpu_context_device(gpu_context *g);

#ifdef STILL_HAVE_CUDA
#include "kinds/attn.h"
#include "still_cuda.h"
/* The still state configuration of a still or lolcats layer's plan. */
void gpu_still_config(const attn_config *a, int n_ctx, stc_still_config *out);
#endif

#endif
