/* still's CUDA backend, first layer: a device context, weight upload with
 * on-device dequantization to bf16, cuBLASLt GEMMs, the elementwise kernels
 * of the Llama forward pass (src/model/model.c) and a flash-attention-style causal
 * softmax attention with grouped-query heads.
 *
 * Plain C (C11 and C++), no CUDA headers needed to include it. Built only
 * when CMake's STILL_CUDA option is on; the library exports the compile
 * definition STILL_HAVE_CUDA=1 so C code can #ifdef on it.
 *
 * Conventions
 * - Every function that can fail returns 0 (STILL_OK) or a negative code and,
 *   with a non-NULL still_err, writes a one-line message into it: the STILL_E_*
 *   codes of still.h (STILL_E_ARG bad argument, STILL_E_NOMEM device memory,
 *   STILL_E_UNSUPPORTED no device / unsupported type or shape) or STC_E_DEVICE
 *   (any other failing CUDA or cuBLASLt call; the message names the call, the
 *   file:line and CUDA's error string).
 * - Pointers named *_dev and the tensors of the kernels are device pointers
 *   (from stc_malloc); host pointers say so.
 * - Kernels are enqueued on the context's stream and return at once: a bad
 *   launch is reported by the call itself, a fault during execution by a
 *   later call (stc_ctx_sync, the memcpys). stc_memcpy_* and
 *   stc_dequant_to_bf16 return when their work is done.
 * - Row-major everywhere: a [T][H][D] tensor holds element (t, h, d) at
 *   (t * H + h) * D + d.
 * - stc_bf16 is the raw 16 bits of a bfloat16 (the layout of CUDA's
 *   __nv_bfloat16): the top half of the float32 with the same sign and
 *   exponent. Conversions to bf16 round to nearest, ties to even. */
#ifndef STILL_CUDA_H
#define STILL_CUDA_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA or cuBLASLt call failed (still.h has no device error code; this one
 * is kept well away from still.h's). */
enum { STC_E_DEVICE = -16 };

typedef uint16_t stc_bf16;
typedef uint16_t stc_f16;   /* IEEE half (binary16) */
typedef struct stc_ctx stc_ctx;

/* A piece of device memory holding part of a sequence's state (the kinds' *_regions, for state snapshots: what a
 * later call reads, scratch left out, in a fixed order; a restore copies the same regions back into a state of the
 * same configuration and then sets its host position, *_set_n_seen). */
typedef struct {
    void *dev;
    size_t bytes;
} stc_region;

/* ---- devices and the context -------------------------------------------- */

/* Number of CUDA devices (0 when there is none or no usable driver). */
int stc_device_count(void);
/* One line per device into buf ("0: NVIDIA H200, compute 9.0, 132 SMs,
 * 139.8 GiB, L2 60.0 MiB, ..."), or the reason there is none ("no CUDA device
 * found"). Returns 0, or STILL_E_UNSUPPORTED when there is no device. */
int stc_device_info(char *buf, size_t cap);

/* A context on device `device`: a stream, a cuBLASLt handle and its
 * workspace, caches of GEMM plans and attention scratch. Fails with "no CUDA
 * device found", a too old driver, or a device this build has no code for
 * (the build targets sm_90). One context is used by one thread at a time. */
int stc_ctx_create(int device, stc_ctx **out, still_err *err);
void stc_ctx_free(stc_ctx *ctx);
/* Wait for everything enqueued so far; reports faults of earlier kernels. */
int stc_ctx_sync(stc_ctx *ctx, still_err *err);
/* Make ctx's stream wait for the work enqueued so far on other's (a context
 * on the same device); asynchronous. While other's stream is being recorded
 * as a graph, ctx's stream joins the recording: it must be joined back (other
 * waits for ctx) before the graph ends. Buffers of one context may be used
 * by another's kernels. */
int stc_ctx_wait(stc_ctx *ctx, stc_ctx *other, still_err *err);
/* The context's device index. */
int stc_ctx_device(const stc_ctx *ctx);
/* The context's cudaStream_t (as void *, to keep this header free of CUDA's). */
void *stc_ctx_stream(const stc_ctx *ctx);
/* Multiprocessors of the context's device. */
int stc_ctx_sm_count(const stc_ctx *ctx);

/* CUDA graphs: record everything enqueued on the context's stream between
 * begin and end (nothing runs while recording), then replay it with one
 * launch. Enqueued work must not synchronise with the host or allocate
 * (stc_still_reserve first); positions must come from device memory
 * (stc_rope_at, STC_STILL_P0_DEVICE). end with ok = 0 abandons the recording
 * (after a failed call) and returns no graph. */
typedef struct stc_graph stc_graph;
int stc_graph_begin(stc_ctx *ctx, still_err *err);
int stc_graph_end(stc_ctx *ctx, int ok, stc_graph **out, still_err *err);
int stc_graph_launch(stc_ctx *ctx, const stc_graph *g, still_err *err);
void stc_graph_free(stc_graph *g);

/* Device memory. `what` names the buffer in the out-of-memory message
 * ("CUDA out of memory allocating 512.0 MiB for KV cache (...)"). The
 * allocation is aligned to at least 256 bytes. stc_free(ctx, NULL) is a
 * no-op; stc_free waits for the context's stream first. */
int stc_malloc(stc_ctx *ctx, size_t bytes, const char *what, void **out_dev, still_err *err);
void stc_free(stc_ctx *ctx, void *dev);
/* Synchronous copies (they return when the data has arrived). */
int stc_memcpy_h2d(stc_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes, still_err *err);
/* Device to device, in stream order (no host wait); the regions must not overlap. */
int stc_memcpy_d2d(stc_ctx *ctx, void *dst_dev, const void *src_dev, size_t bytes, still_err *err);
int stc_memcpy_d2h(stc_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes, still_err *err);
/* Fill bytes with `value` (asynchronous, on the stream). */
int stc_memset(stc_ctx *ctx, void *dst_dev, int value, size_t bytes, still_err *err);

/* ---- weights ---------------------------------------------------------------- */

/* ggml type ids (src/format/quant.h's tensor_type) this backend dequantizes: F32,
 * F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. */
int stc_type_supported(uint32_t ggml_type);

/* A GGUF matrix of `rows` rows of `cols` elements (each row
 * tensor_row_bytes(type, cols) bytes of raw blocks, rows back to back) to
 * bf16 [rows][cols]: the raw blocks are uploaded once and dequantized on the
 * device. Every value equals src/format/quant.c's dequantize_row() result rounded to
 * bf16 (nearest, ties to even). cols must be a multiple of the type's block
 * size (32, or 256 for the K types). Synchronous. */
int stc_dequant_to_bf16(stc_ctx *ctx, uint32_t ggml_type, const void *src_host, int64_t rows, int64_t cols,
                        stc_bf16 *dst_dev, still_err *err);
/* The same from raw blocks already on the device (asynchronous). */
int stc_dequant_dev_to_bf16(stc_ctx *ctx, uint32_t ggml_type, const void *src_dev, int64_t rows, int64_t cols,
                            stc_bf16 *dst_dev, still_err *err);

/* ---- GEMM (cuBLASLt) --------------------------------------------------------- */

/* C[M][N] = A[M][K] · W[N][K]ᵀ + beta · C[M][N]: activations A times weights W
 * stored as the CPU matmul() takes them (one weight row per output), bf16
 * inputs, fp32 accumulation (CUBLAS_COMPUTE_32F). beta = 1 adds into C (the
 * residual). The cuBLASLt descriptors and the chosen algorithm are cached per
 * shape and pointer alignment. */
int stc_gemm_bf16(stc_ctx *ctx, int M, int N, int K, const stc_bf16 *A, const stc_bf16 *W, float *C, float beta,
                  still_err *err);
/* The same with a bf16 C (beta · C is read in bf16, the sum rounded once). */
int stc_gemm_bf16_out_bf16(stc_ctx *ctx, int M, int N, int K, const stc_bf16 *A, const stc_bf16 *W, stc_bf16 *C,
                           float beta, still_err *err);

/* fp32 C[M][N] = Σ_k A[k][M] · B[k][N] + beta · C (A [K][M], B [K][N] row-major; CUBLAS_COMPUTE_32F, no
 * tensor cores): weight gradients, dW = dYᵀ X over K tokens (beta = 1 accumulates). */
int stc_gemm_f32_at_b(stc_ctx *ctx, int M, int N, int K, const float *A, const float *B, float *C, float beta,
                      still_err *err);
/* The same through TF32 tensor-core products (CUBLAS_COMPUTE_32F_FAST_TF32: the operands rounded to
 * 10-bit mantissas, fp32 sums): the still gate's weight gradient in training. */
int stc_gemm_tf32_at_b(stc_ctx *ctx, int M, int N, int K, const float *A, const float *B, float *C, float beta,
                       still_err *err);

/* Row-major C[M][N] = alpha · op(A) · op(B) + beta · C with op(A) [M][K] and op(B) [K][N]: A stored
 * [M][lda], or with ta [K][lda] (op(A) = Aᵀ); B stored [K][ldb], or with tb [N][ldb]; C [M][ldc]. Both
 * inputs bf16 (in_bf16) or both fp32; fp32 C and sums (tf32: fp32 operands through TF32 tensor cores).
 * Plans cached like the others (no tuning). Training's products (src/train/train_lm_cuda.c). */
int stc_gemm_rm(stc_ctx *ctx, int ta, int tb, int M, int N, int K, float alpha, const void *A, int64_t lda,
                const void *B, int64_t ldb, float beta, float *C, int64_t ldc, int in_bf16, int tf32, still_err *err);
/* The same for batch products at once: the i-th multiplies A + i·sa and B + i·sb into C + i·sc (strides in
 * elements). Attention over many (sequence, head) blocks in one launch. */
int stc_gemm_rm_batched(stc_ctx *ctx, int ta, int tb, int M, int N, int K, float alpha, const void *A, int64_t lda,
                        int64_t sa, const void *B, int64_t ldb, int64_t sb, float beta, float *C, int64_t ldc,
                        int64_t sc, int batch, int in_bf16, int tf32, still_err *err);

/* ---- stage-2 training steps (cuda/train/train_lm.cu; src/train/train_lm.c's loops, fp32) ---- */

/* Rows t < T of x [T][n]: out = x r w with r[t] = 1/sqrt(mean(x²) + eps) kept. */
int stc_rmsnorm_r(stc_ctx *ctx, const float *x, const float *w, int T, int n, float eps, float *out, float *r,
                  still_err *err);
/* dx += r (w ⊙ dy) − x r³/n Σ w ⊙ dy ⊙ x, row by row (the RMSNorm's backward). */
int stc_rmsnorm_bwd(stc_ctx *ctx, float *dx, const float *x, const float *r, const float *w, const float *dy, int T,
                    int n, still_err *err);
/* RoPE in place on x [rows][n_heads][D], row r at position r mod T (sequences of T rows one after another;
 * adjacent pairs); inverse rotates back. */
int stc_rope_rows(stc_ctx *ctx, float *x, int rows, int T, int n_heads, int D, float theta, int inverse,
                  still_err *err);
/* act = silu(gate) ⊙ up; and its backward dgate, dup from dact. */
int stc_swiglu_f32(stc_ctx *ctx, const float *gate, const float *up, float *act, int64_t n, still_err *err);
int stc_swiglu_bwd(stc_ctx *ctx, const float *dact, const float *gate, const float *up, float *dgate, float *dup,
                   int64_t n, still_err *err);
/* LoRA dropout with src/train/train_lm.c's masks over sequences of per_seq elements one after another (element i of
 * sequence s dropped when its hash draw is below p; the seed is seq_seed_dev[s] · 0x2545f4914f6cdd1d + salt, the
 * sequences' seeds read on the device so that a recorded graph replays with each step's own): out = mask ⊙ x /
 * (1 − p); the backward dx += mask ⊙ dxd / (1 − p). */
int stc_dropout(stc_ctx *ctx, const float *x, float *out, int64_t n, int64_t per_seq, float p,
                const uint64_t *seq_seed_dev, uint64_t salt, still_err *err);
int stc_dropout_bwd_acc(stc_ctx *ctx, float *dx, const float *dxd, int64_t n, int64_t per_seq, float p,
                        const uint64_t *seq_seed_dev, uint64_t salt, still_err *err);
/* y += a x. */
int stc_axpy(stc_ctx *ctx, float *y, const float *x, float a, int64_t n, still_err *err);
/* Cross-entropy of rows logit rows [rows][V] against targets_dev (weights w_dev, NULL: 1): loss_dev[i] =
 * w_i (logsumexp − ℓ_i[y_i]) (double); with grad the rows become s w_i (softmax − onehot), s = *scale_dev. */
int stc_ce_rows(stc_ctx *ctx, float *logits, int rows, int V, const int32_t *targets_dev, const float *w_dev,
                const float *scale_dev, int grad, double *loss_dev, still_err *err);
/* Row r of S [rows][ld] (T keys), the query at t = r mod T (blocks of T rows one after another): softmax over
 * keys t-window < j <= t (window 0: j <= t) in place, 0 elsewhere up to T. */
int stc_softmax_causal(stc_ctx *ctx, float *S, int rows, int T, int64_t ld, int window, still_err *err);
/* out[t] = Σ_i a[t][i] b[t][i] for i < n. */
int stc_rowdot(stc_ctx *ctx, const float *a, int64_t lda, const float *b, int64_t ldb, int T, int n, float *out,
               still_err *err);
/* The attention backward's dS = scale · P ⊙ (dP − δ_r), in place of dP [rows][ld] (T keys). */
int stc_attn_ds(stc_ctx *ctx, float *dP, const float *P, const float *delta, int rows, int T, int64_t ld, float scale,
                still_err *err);
/* Heads between the row-major layout x [B·T][ldx] (head h at columns h·D ..) and the head-major y [B][H][T][D]:
 * split y = x's heads; merge x = y's (overwriting). */
int stc_heads_split(stc_ctx *ctx, const float *x, int64_t ldx, int B, int T, int H, int D, float *y, still_err *err);
int stc_heads_merge(stc_ctx *ctx, const float *y, int B, int T, int H, int D, float *x, int64_t ldx, still_err *err);

/* Fused softmax (window > 0: swa) attention for training, head dim 64 (cuda/kinds/softmax/attn_softmax_train.cu): q, o
 * [B·T][H·64], k, v [B·T][Hk·64] row-major fp32, bf16 products with fp32 accumulators. The forward writes o and
 * lse [B][H][T] (each row's log Σ exp of its scaled scores); the backward takes them and dO (like o) and writes
 * dq, dk, dv (overwritten), with delta [B·T][H] and kbar [B][Hk][64] as scratch. No atomics: the same inputs give
 * the same bits. */
int stc_flash_train_fwd(stc_ctx *ctx, const float *q, const float *k, const float *v, int B, int T, int H, int Hk,
                        int D, int window, float *o, float *lse, still_err *err);
int stc_flash_train_bwd(stc_ctx *ctx, const float *q, const float *k, const float *v, const float *o,
                        const float *dO, const float *lse, int B, int T, int H, int Hk, int D, int window,
                        float *delta, float *kbar, float *dq, float *dk, float *dv, still_err *err);

/* still layers' attention for training, fused (cuda/kinds/still/attn_still_train.cu; the dense form's fused counterpart for
 * bf16 mode, head dim 64): route [B][Hs][T] as stc_still_lm_route writes it (Hs = Hk with per_kv, else H); linear
 * 0: no linear part (nor gate); gate_den: the gate in the denominator too. */
typedef struct {
    int B, T, H, Hk, D, C, per_kv, linear, gate_den;
    const int *route;
} stc_still_train_geom;
/* Per (sequence, head, query) values [B][H][T]: the forward's maximum of the scaled scores over the softmax part
 * (m), its lowest key (am), the soft and linear denominators (l, b); the backward's dl, db and ρ, and kbar
 * [B][Hk][64] (scratch). */
typedef struct {
    float *m, *l, *b, *dl, *db, *rho, *kbar;
    int *am;
    int *far_idx, *far_n;   /* [B][Hk][T], [B][Hk]: the forward's list of the keys that stay soft past Local */
} stc_still_train_rows;
/* q, y, alin (the linear numerator, kept for the backward), gate (σ already applied; NULL: none) [B·T][H·64]; k, v
 * [B·T][Hk·64]; phq, phk [H][B·T][128] (each query head's feature maps of q and of k). */
int stc_still_train_fwd(stc_ctx *ctx, const stc_still_train_geom *g, const float *q, const float *k, const float *v,
                        const float *phq, const float *phk, const float *gate, float *y, float *alin,
                        stc_still_train_rows *rows, still_err *err);
/* From dy (like y): dq, dk, dv, dphq, dphk (like their inputs) and, with a gate, dpre [B·T][H·64] (the gate's
 * pre-activation gradient), all overwritten; dN, dA [B·T][H·64] scratch. No atomics: the same bits every time. */
int stc_still_train_bwd(stc_ctx *ctx, const stc_still_train_geom *g, const float *q, const float *k, const float *v,
                        const float *phq, const float *phk, const float *gate, const float *y, const float *alin,
                        stc_still_train_rows *rows, const float *dy, float *dN, float *dA, float *dq, float *dk,
                        float *dv, float *dphq, float *dphk, float *dpre, still_err *err);

/* ---- stage 2 for still layers (cuda/train/train_lm_still.cu): the layer written densely per query head ---- */

/* The routing of a whole sequence: score [Hs][T] (double) = the self-saliency of every token (q [T][H][D],
 * k [T][Hk][D] after RoPE; per_kv: summed over each KV head's G query heads, Hs = Hk, else Hs = H), then
 * out [Hs][T] = the first query chunk from which the key is out of the softmax part (INT_MAX: never), for
 * global selection (capacity cap) or chunk selection (lam per leaving chunk; capped: at most cap in all). */
int stc_still_lm_route(stc_ctx *ctx, const float *q, const float *k, int T, int H, int Hk, int D, int C, int per_kv,
                       int global, int lam, int capped, int cap, double *score, int *out, still_err *err);
/* lolcats (no selection): out [rows][T] = c(j) + 2 for every key that leaves Local, INT_MAX for the others. */
int stc_still_lm_route_fold(stc_ctx *ctx, int T, int C, int rows, int *out, still_err *err);
/* The row kernels below take nb sequences at once: sequence i's [T][ld] matrix at i·sS (or sL) elements, its routing
 * out at i·sOut, its row vectors (l, am, b, dl, db) at i·T. */
/* Logits S [T][ld] -> E = γ exp(S − m) on the softmax part (j <= t, c(t) < out[j]), 0 elsewhere (γ = σ(*wfac):
 * lolcats' window factor, read on the device; wfac NULL: 1, for still); l = rowsum, am = each row's arg-max. */
int stc_still_lm_mask_soft(stc_ctx *ctx, float *S, int64_t ld, int64_t sS, int nb, int T, int C, const int *out,
                           int64_t sOut, const float *wfac, float *l, int *am, still_err *err);
/* L [T][ld] kept where c(t) >= out[j] (the linear part), 0 elsewhere; b = rowsum. */
int stc_still_lm_mask_lin(stc_ctx *ctx, float *L, int64_t ld, int64_t sL, int nb, int T, int C, const int *out,
                          int64_t sOut, float *b, still_err *err);
/* y (holding E V) = (E V + g ⊙ a) / (l + b + 1e-6) (gate_den: l + g b + 1e-6); a NULL: no linear part, g NULL:
 * no gate. */
int stc_still_lm_out(stc_ctx *ctx, float *y, int64_t ldy, const float *a, const float *l, const float *b,
                     const float *g, int64_t ldg, int gate_den, int T, int D, still_err *err);
/* From dy and y: dN = dy / den, dA = dN ⊙ g (a given), dl = −Σ dN ⊙ y, db (gate_den: Σ dden ⊙ g), and the gate's
 * pre-activation gradient dpre (g and dpre given). */
int stc_still_lm_bwd_rows(stc_ctx *ctx, const float *dy, int64_t lddy, const float *y, int64_t ldy, const float *a,
                          const float *l, const float *b, const float *g, int64_t ldg, int gate_den, int T, int D,
                          float *dN, float *dA, float *dl, float *db, float *dpre, still_err *err);
/* dE (holding dN Vᵀ) -> dS = E ⊙ (dE + dl), and the row maximum's share −Σ dS at am. dw (NULL: none): lolcats'
 * ∂L/∂w += (1 − γ) Σ_rows Σ dS before the maximum's share, γ = σ(*wfac) (E = γ exp(S − m): that sum is γ ∂L/∂γ);
 * the rows' shares pass through dl (overwritten) and add in a fixed order. */
int stc_still_lm_ds(stc_ctx *ctx, float *dE, const float *E, int64_t ld, int64_t sS, int nb, int T, float *dl,
                    const int *am, float *dw, const float *wfac, still_err *err);
/* out[j] += Σ_r A[r][j] over rows r < n (ld floats apart), j < m; in a fixed order (the same bits every run). */
int stc_colsum_acc(stc_ctx *ctx, const float *A, int64_t ld, int n, int m, float *out, still_err *err);
/* dL (holding dA Vᵀ) -> (dL + db) on the linear part, 0 elsewhere. */
int stc_still_lm_dlin(stc_ctx *ctx, float *dL, int64_t ld, int64_t sL, int nb, int T, int C, const int *out,
                      int64_t sOut, const float *db, still_err *err);
/* G [T][n] = σ(G + bias). */
int stc_sigmoid_bias(stc_ctx *ctx, float *G, const float *bias, int T, int n, still_err *err);
/* NP-Map (u [D], W [D][D], device fp32; D = 64) of n rows X (ldx apart) into phi [n][2D]; and its backward into
 * the rows' gradients dX (ldd apart, accumulated) from dphi [n][2D]. u NULL: lolcats' Hedgehog map z = x W
 * (W [D][F], F = D) instead. */
int stc_npmap_rows(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W, float *phi,
                   still_err *err);
int stc_npmap_bwd(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W,
                  const float *dphi, float *dX, int64_t ldd, still_err *err);
/* The map's own gradient (--train-attn): the same backward (dX may be NULL) that also writes each row's dz0 (the
 * gradient of z0 = W x̃; Hedgehog: of z = x W) into dZ0 [n][D] and x̃ (x reflected by u; Hedgehog: x) into Xt
 * [n][D], and adds ∂/∂u into du [D] (NP-Map only; NULL: none) through the blocks' partial sums in du_part
 * [STC_NPMAP_BLOCKS][D] (scratch), added in a fixed order. Then dW = dZ0ᵀ Xt (NP-Map, W [D][D] as z0 = W x̃)
 * or Xtᵀ dZ0 (Hedgehog, W [D][F]): one product, the caller's. */
/* The maps' grid at most: each block stages its map (16 KiB at D = 64) once for all its rows, so about two
 * blocks an SM, each warp taking several rows, rather than a block per 8 rows. */
#define STC_NPMAP_BLOCKS 256
int stc_npmap_bwd_params(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W,
                         const float *dphi, float *dX, int64_t ldd, float *dZ0, float *Xt, float *du, float *du_part,
                         still_err *err);

/* ---- elementwise kernels (fp32 activations) ------------------------------------ */

/* out[t][:] = table[tokens[t]][:] for t < T (tokens_dev: T device int32).
 * bf16 table [n_vocab][d] -> fp32 rows. A token outside [0, n_vocab) gives a
 * row of NaN (the caller validates tokens; the engine does on the host). */
int stc_embed_bf16(stc_ctx *ctx, const stc_bf16 *table, int64_t n_vocab, int d, const int32_t *tokens_dev, int T,
                   float *out, still_err *err);
/* The same from the raw quantized table on the device (rows of
 * tensor_row_bytes(type, d) bytes): exactly dequantize_row()'s fp32 values. */
int stc_embed_quant(stc_ctx *ctx, uint32_t ggml_type, const void *table_dev, int64_t n_vocab, int d,
                    const int32_t *tokens_dev, int T, float *out, still_err *err);

/* RMSNorm of T rows of n: out = x · (1 / sqrt(mean(x²) + eps)) · w, as
 * src/model/model.c's rmsnorm() (sum of squares in double, scale rounded to float,
 * then (x · scale) · w in float). Writes out_f32 and/or out_bf16 (at least one
 * non-NULL); out_f32 may equal x. */
int stc_rmsnorm(stc_ctx *ctx, const float *x, const float *w, int T, int n, float eps, float *out_f32,
                stc_bf16 *out_bf16, still_err *err);

/* RoPE in place, exactly as src/model/model.c's rope(): for token t (position
 * p0 + t) and pair i < D/2, angle = (float)(p0 + t) · inv_freq[i] with
 * inv_freq[i] = (float)pow(theta, -2i/D), and each head's (x[2i], x[2i+1])
 * rotated by it. q [T][H][D], k [T][Hk][D] (either may be NULL). q_bf16 /
 * k_bf16, when non-NULL, receive bf16 copies of the rotated values (same
 * layouts; e.g. k_bf16 = the KV cache at position p0). v [T][Hk][D] and
 * v_bf16, both or neither: v's bf16 copy (not rotated) in the same pass.
 * D even, <= 256. */
int stc_rope(stc_ctx *ctx, float *q, float *k, int T, int H, int Hk, int D, int p0, float theta, stc_bf16 *q_bf16,
             stc_bf16 *k_bf16, const float *v, stc_bf16 *v_bf16, still_err *err);

/* The same with the first position read on the device from *p0_dev when
 * the kernel runs (e.g. stc_still_n_seen_dev: a decode step captured in a
 * CUDA graph and replayed at every position). */
int stc_rope_at(stc_ctx *ctx, float *q, float *k, int T, int H, int Hk, int D, const int *p0_dev, float theta,
                stc_bf16 *q_bf16, stc_bf16 *k_bf16, still_err *err);
/* stc_rope_at on q and k rows ld floats apart (both in one fused matrix,
 * stc_still_forward_qkv's layout; ld a multiple of 2); no bf16 copies.
 * Optionally (v and the copies non-NULL) IEEE half copies, rows packed
 * [T][Hk][D]: k_f16 of the rotated k, v_f16 of v (rows ld floats apart,
 * not rotated), for stc_still_forward_qkv's Local tiles (which wants each
 * buffer allocated 64 rows past its T rows; this call writes only T); each
 * copy is optional (k_f16 alone, or v with v_f16), v without v_f16 is refused. */
int stc_rope_at_ld(stc_ctx *ctx, float *q, float *k, int64_t ld, int T, int H, int Hk, int D, const int *p0_dev,
                   float theta, const float *v, stc_f16 *k_f16, stc_f16 *v_f16, still_err *err);

/* SwiGLU: out[r][c] = silu(gate[r·ld + c]) · up[r·ld + c] for r < rows,
 * c < cols, silu(x) = x / (1 + e^-x); out is [rows][cols] bf16 and/or fp32
 * (at least one). ld >= cols lets gate and up be the two halves of one fused
 * GEMM output [rows][2·cols] (gate = C, up = C + cols, ld = 2·cols). */
int stc_swiglu(stc_ctx *ctx, const float *gate, const float *up, int rows, int cols, int64_t ld, stc_bf16 *out_bf16,
               float *out_f32, still_err *err);
/* The same from bf16 gate and up (a fused gate | up GEMM with bf16 output:
 * half the bytes to write and to read back), bf16 out. */
int stc_swiglu_bf16(stc_ctx *ctx, const stc_bf16 *gate, const stc_bf16 *up, int rows, int cols, int64_t ld,
                    stc_bf16 *out_bf16, still_err *err);

/* x[i] += y[i] for i < n (the residual; a GEMM with beta = 1 does it too). */
int stc_add(stc_ctx *ctx, float *x, const float *y, int64_t n, still_err *err);
/* dst[i] = bf16(src[i]) for i < n. */
int stc_f32_to_bf16(stc_ctx *ctx, const float *src, stc_bf16 *dst, int64_t n, still_err *err);
/* Greedy argmax of each of `rows` rows of n floats into out_dev[row] (device
 * int32), as src/text/sample.c picks it: NaN never wins, ties go to the lowest
 * index (all -inf or NaN gives 0). */
int stc_argmax(stc_ctx *ctx, const float *x, int rows, int n, int32_t *out_dev, still_err *err);

/* Σ x[i]² for i < n into *out_dev (one double on the device, overwritten). */
int stc_sumsq(stc_ctx *ctx, const float *x, int64_t n, double *out_dev, still_err *err);
/* AdamW for n parameters, exactly src/train/train.c's float update per element:
 *   g = grad·gscale;  m1 = b1 m1 + (1 - b1) g;  m2 = b2 m2 + (1 - b2) g²
 *   w -= lr (m1 c1 / (sqrt(m2 c2) + eps) + wd w)     (c1, c2: the bias corrections' inverses) */
int stc_adamw(stc_ctx *ctx, float *w, const float *grad, float *m1, float *m2, int64_t n, float lr, double b1,
              double b2, double eps, float wd, float gscale, float c1, float c2, still_err *err);

/* ---- decode-step matrix-vector products (cuda/kernels/gemv.cu) ------------------------------ */

/* One token's products with their neighbours fused in (fewer launches per
 * decode step). W is bf16 [n_out][n_in] (one row per output, as
 * stc_gemm_bf16 takes it), n_in a multiple of 8 and at most 12288, x fp32;
 * fp32 accumulation. With norm_w non-NULL the input is RMSNorm(x) · norm_w
 * (as stc_rmsnorm computes it), else x. W and x 16-byte aligned. */

/* y = W · x̂ + beta · y (beta = 1: the residual). */
int stc_gemv(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W, int n_out,
             float *y, float beta, still_err *err);
/* h[j] = silu(W[j] · x̂) · (W[ff + j] · x̂) for j < ff: W is gate and up stacked [2 ff][n_in]. */
int stc_gemv_swiglu(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W_gate_up,
                    int ff, float *h, still_err *err);

/* What stc_gemv_qkv does after the product: the output rows are q [H·D],
 * k [Hk·D], v [Hk·D], then anything else (e.g. the gate's pre-activations). */
typedef struct {
    int n_head, n_head_kv, head_dim;
    int rotate;                 /* RoPE on the q and k rows, as stc_rope */
    float theta;
    int p0;                     /* the token's position: p0, plus *p0_dev when p0_dev is non-NULL */
    const int *p0_dev;
    stc_bf16 *q_bf16, *k_bf16, *v_bf16;   /* non-NULL: bf16 copies of q, k, v (after RoPE) */
} stc_gemv_rope;
int stc_gemv_qkv(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W, int n_out,
                 float *y, const stc_gemv_rope *rope, still_err *err);

/* ---- softmax attention ----------------------------------------------------------- */

/* Causal softmax attention with grouped-query heads for T queries at
 * positions p0 .. p0+T-1 over a KV cache holding keys 0 .. p0+T-1 (the
 * chunk's own keys and values already stored):
 *   out[t][h] = Σ_{j <= p0+t} softmax_j(q[t][h] · k[j][h / G] / sqrt(D)) v[j][h / G]
 * q [T][H][D], k_cache and v_cache [L][Hk][D] (L >= p0 + T; only rows
 * 0 .. p0+T-1 are read), all bf16; G = H / Hk; D = 64 or 128. Writes exactly
 * one of out_f32 / out_bf16 ([T][H][D]; the other NULL). fp32 accumulation.
 * Flash-attention style (cuda/kinds/softmax/attn_softmax.cu): tensor cores, online
 * softmax, the L×L matrix never formed; when the query tiles alone cannot
 * fill the GPU (decode: T = 1) the keys are split across thread blocks and
 * the parts combined (flash-decoding). All pointers 16-byte aligned. */
int stc_attn_softmax(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache, int T,
                     int p0, int H, int Hk, int D, float *out_f32, stc_bf16 *out_bf16, still_err *err);
/* The same with the number of key splits forced (0 = automatic, as above;
 * larger values are capped at the number of 64-key tiles). For tests and
 * tuning. */
int stc_attn_softmax_splits(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache,
                            int T, int p0, int H, int Hk, int D, float *out_f32, stc_bf16 *out_bf16, int n_splits,
                            still_err *err);

/* The swa kind (../shared/spec/attention.md): as stc_attn_softmax with the
 * keys restricted to pos - window < j <= pos for the query at position pos
 * (window >= 1). Keys before p0 - window + 1 are never read, so a cache may
 * hold only the recent rows as long as they sit at their positions.
 * n_splits as stc_attn_softmax_splits (0 = automatic). */
int stc_attn_softmax_window(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache, int T,
                            int p0, int H, int Hk, int D, int window, float *out_f32, stc_bf16 *out_bf16, int n_splits,
                            still_err *err);

/* ---- liger attention (sliding window + decayed linear attention) ----------------------------------
 *
 * The liger kind of ../shared/spec/attention.md: y = 0.5 o_swa + 0.5 o_lin.
 * o_swa is stc_attn_softmax_window's (window 64, RoPE'd q and k); this part
 * is o_lin, a linear attention with softmax features of q and k before RoPE
 * and a per-channel decay α = σ(k)^{1/16}, whose state S [Hk][D][D] (fp32)
 * is kept per KV head (cuda/kinds/liger/attn_liger.cu; src/kinds/liger/attn_liger.c is the
 * reference). Head dim 64 or 128, at most 8 query heads per KV head. */

typedef struct stc_liger stc_liger;

/* Tokens a call processes at once; a longer call runs in segments (the
 * workspace holds one). */
enum { STC_LIGER_SEGMENT = 8192 };

/* A fresh state (S = 0) for n_head query heads over n_head_kv KV heads. */
int stc_liger_create(stc_ctx *ctx, int n_head, int n_head_kv, int head_dim, stc_liger **out, still_err *err);
/* Frees the state (the context must still exist). NULL is a no-op. */
void stc_liger_free(stc_liger *s);
/* Back to S = 0 (asynchronous). */
int stc_liger_reset(stc_ctx *ctx, stc_liger *s, still_err *err);
/* Device bytes of S. */
size_t stc_liger_state_bytes(const stc_liger *s);
/* Tokens folded into S so far. */
int stc_liger_n_seen(const stc_liger *s);
/* The state's regions (stc_region): count, or -1 when max is too small. */
int stc_liger_regions(stc_liger *s, stc_region *out, int max);
/* After a restore: the tokens the restored state holds. */
void stc_liger_set_n_seen(stc_liger *s, int n);
/* S into S_host [Hk][D][D] (rows key channels, columns value channels). Synchronous. */
int stc_liger_state(stc_ctx *ctx, const stc_liger *s, float *S_host, still_err *err);
/* Workspace bytes for calls of up to T_max tokens (segments of at most
 * STC_LIGER_SEGMENT): about min(T_max, 8192) · (H + 2 Hk) · D · 4 bytes plus
 * Hk · D² · 4 bytes per 64 tokens. A smaller workspace works in shorter
 * segments, down to one 64-token chunk. */
size_t stc_liger_workspace_bytes(int n_head, int n_head_kv, int head_dim, int T_max);
/* T tokens continuing the sequence S holds: q_nope [T][H][D], k_nope and v
 * [T][Hk][D] fp32 (q and k before RoPE); out [T][H][D] holds o_swa on entry
 * and 0.5 o_swa + 0.5 o_lin on return. ws_dev: ws_bytes of device scratch
 * (stc_liger_workspace_bytes). Asynchronous. */
int stc_liger_forward(stc_ctx *ctx, stc_liger *s, const float *q_nope, const float *k_nope, const float *v, int T,
                      void *ws_dev, size_t ws_bytes, float *out, still_err *err);

/* ---- gdn attention (Gated DeltaNet) ----------------------------------------------------------------
 *
 * The gdn kind of ../shared/spec/attention.md: inference, stage 1 and stage 2 (cuda/kinds/gdn/attn_gdn.cu; src/kinds/gdn/attn_gdn.c
 * is the CPU's, src/kinds/gdn/attn_gdn_rules.h the rules and the parameter layout both follow). The state ST
 * [Hk][D][D] (fp32, rows key channels, columns value channels, as the CPU keeps it) per KV head, read by its G
 * query heads. Head dim 64 or 128, at most 16 query heads per KV head. */

typedef struct stc_gdn stc_gdn;

/* Tokens a call processes at once; a longer call runs in segments (the workspace holds one). */
enum { STC_GDN_SEGMENT = 4096 };

/* A fresh state (ST = 0) for n_head query heads over n_head_kv KV heads and a layer input of d_model; norm: the
 * outputs' per-head RMSNorm (1) or none (0; attn_config.norm); conv: the short convolution's width (0: none;
 * attn_config.conv; its weights follow the other parameters, gdn_par_conv). */
int stc_gdn_create(stc_ctx *ctx, int n_head, int n_head_kv, int head_dim, int d_model, int norm, int conv,
                   stc_gdn **out, still_err *err);
/* Frees the state (the context must still exist). NULL is a no-op. */
void stc_gdn_free(stc_gdn *s);
/* Back to ST = 0 (asynchronous). */
int stc_gdn_reset(stc_ctx *ctx, stc_gdn *s, still_err *err);
/* Device bytes of the state: ST and, with a convolution, its history. */
size_t stc_gdn_state_bytes(const stc_gdn *s);
/* Tokens folded into ST so far. */
int stc_gdn_n_seen(const stc_gdn *s);
/* The state's regions (stc_region; ST, then the convolution's history): count, or -1 when max is too small. */
int stc_gdn_regions(stc_gdn *s, stc_region *out, int max);
/* After a restore: the tokens the restored state holds. */
void stc_gdn_set_n_seen(stc_gdn *s, int n);
/* ST into ST_host [Hk][D][D]. Synchronous. */
int stc_gdn_state(stc_ctx *ctx, const stc_gdn *s, float *ST_host, still_err *err);
/* Workspace bytes for calls of up to T_max tokens (segments of at most STC_GDN_SEGMENT): about
 * min(T_max, 4096) · (3 Hk D + Hk D² / 64 + 4 Hk) · 4 bytes. A smaller one works in shorter segments, down to 64
 * tokens. */
size_t stc_gdn_workspace_bytes(int n_head, int n_head_kv, int head_dim, int T_max);
/* T tokens continuing the sequence ST holds. q_nope [T][H][D], k_nope and v [T][Hk][D] fp32, q and k before
 * RoPE (scratch: a call of two tokens or more L2-normalises them in place, a one-token call leaves them); pre [T][ld_pre] the products of the layer's normalised
 * input with the gate's, β's and α's rows, W_g x (H·D values) | w_β x (Hk) | w_α x (Hk), without their biases;
 * params the layer's parameters on the device (attn_gdn_rules.h's layout: the biases, a_log and w_n are read
 * from it). out_f32 and / or out_bf16 [T][H][D]: the gated, normalised outputs. ws_dev: ws_bytes of device
 * scratch (stc_gdn_workspace_bytes). Asynchronous. */
int stc_gdn_forward(stc_ctx *ctx, stc_gdn *s, const float *params, float *q_nope, float *k_nope, const float *v,
                    const float *pre, int ld_pre, int T, void *ws_dev, size_t ws_bytes, float *out_f32,
                    stc_bf16 *out_bf16, still_err *err);
/* Stage-1 training of one layer on one whole sequence of T >= 2 tokens (src/kinds/gdn/attn_gdn.c's backward for the
 * parameters): resets the state, runs the forward (q [T][H][D], k and v [T][Hk][D] fp32, left as they are; q and k
 * before RoPE, or with rope_theta > 0 rotated by it at positions 0 .. T − 1, which the call undoes on its copies;
 * x_f32 [T][d] the layer input), adds Σ (y − target)² / (T·H·D) to *mse_dev and, with grad_dev, the gradient of scale · that MSE
 * with respect to the parameters (attn_gdn_rules.h's layout, the convolution's weights included) into grad_dev.
 * target [T][H][D] the softmax teacher's per-head outputs. Its workspace grows on first use (see
 * stc_gdn_train_reserve). Asynchronous. */
int stc_gdn_distill(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k, const float *v,
                    const float *x_f32, int T, float rope_theta, const float *target, float scale, float *grad_dev,
                    double *mse_dev, still_err *err);
/* The training workspace for sequences of up to T_max tokens, allocated now: a caller that records training calls
 * into a CUDA graph reserves its longest sequence first (a later, longer call would replace the buffer the graph
 * uses). */
int stc_gdn_train_reserve(stc_ctx *ctx, stc_gdn *s, int T_max, still_err *err);
/* Stage 2 (end-to-end training), one whole sequence of T >= 2 tokens from a fresh state, inputs as stc_gdn_distill's
 * (q, k rotated by rope_theta > 0 at positions 0 .. T − 1, or before RoPE with 0; left as they are): the layer's
 * output into out [T][H][D]. */
int stc_gdn_train_forward(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k,
                          const float *v, const float *x_f32, int T, float rope_theta, float *out, still_err *err);
/* Its backward (the forward recomputed first): from dy [T][H][D], the output's gradient, the inputs' gradients
 * written into dq [T][H][D], dk and dv [T][Hk][D] (with respect to q and k BEFORE RoPE, the values gdn reads) and
 * added into dx [T][d] (the gates read the layer input), and with grad_dev the parameters' added into it.
 * Asynchronous. */
int stc_gdn_train_backward(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k,
                           const float *v, const float *x_f32, int T, float rope_theta, const float *dy, float *dq,
                           float *dk, float *dv, float *dx, float *grad_dev, still_err *err);

/* ---- still attention (selected tokens + gated linear attention) ------------------------------------
 *
 * The still kind of ../shared/spec/attention.md on the GPU, forward only:
 * the same outputs as src/kinds/still/attn_still.c (the reference) up to bf16 rounding,
 * for any split of a sequence into calls (a whole prefill, a chunked
 * prefill crossing chunk boundaries anywhere, decode steps of T = 1). One
 * algorithm for every T, chunk-parallel (cuda/kinds/still/attn_still.cu has the kernels
 * and their order; cuda/kinds/still/attn_still_layout.cuh the index arithmetic).
 *
 * Precision. Sel keys and values are stored as IEEE half, rounded as the
 * CPU's default store (--sel-cache f16); the softmax part runs on the tensor
 * cores with half q, keys, values and weights and fp32 accumulation. Routing scores, feature maps, the
 * linear state S, z and its products are fp32 (scores in double where the
 * CPU uses double), so the GPU selects the same tokens as the CPU except at
 * near-ties of the scores (relative gaps ~1e-6). The gate's Wg · x is a bf16
 * GEMM (cuBLASLt, fp32 accumulation).
 *
 * Supported: head dim 64 or 128, chunk C <= 128, NP-Map feature map, every
 * routing (saliency, random, keynorm, qk, position, none), per query head or
 * per KV head selection, budget mode or uncapped, linear on / off, gate on /
 * off, the gate on the denominator's linear term too (gate_den). The
 * Hedgehog feature map is refused (STILL_E_UNSUPPORTED).
 *
 * The state lives on the device; the position (tokens seen) is a device int
 * the kernels read and advance themselves, so stc_still_forward enqueues
 * kernels whose launch parameters depend on T only and never waits for the
 * device (apart from growing its workspace the first time a larger T comes:
 * stc_still_reserve avoids that). */

typedef struct stc_still stc_still;

/* The fields of src/kinds/attn.h's attn_config that still uses, with the same
 * meanings and the same enum values (routing: attn_routing, 0 saliency,
 * 1 random, 2 keynorm, 3 qk, 4 position, 5 none; feature_map: 0 NP-Map,
 * 1 Hedgehog). */
typedef struct {
    int n_head, n_head_kv, head_dim, d_model;
    int n_ctx;        /* longest sequence the state must hold */
    int chunk;        /* C */
    int budget;       /* m: softmax slots per head (0: uncapped) */
    int lambda;       /* tokens kept per leaving chunk (< 0: (m - 2C) / ceil(n_ctx / C), or C / 16 uncapped) */
    int per_kv_head;  /* select per KV head (the G query heads' scores summed) */
    int routing;
    int linear;       /* linear branch on */
    int feature_map;
    int feature_dim;  /* Hedgehog only */
    int gate;         /* gate on the linear numerator */
    int gate_den;     /* the gate also scales the linear term of the denominator, per channel:
                       * y_d = (Σ e v_d + g_d (φqᵀS)_d) / (Σ e + g_d φq·z + 1e-6) (needs linear and gate;
                       * not lolcats) */
    uint64_t seed;    /* random routing */
    int lolcats;      /* the lolcats kind on the same kernels (src/kinds/lolcats/attn_lolcats.c): no Sel (routing
                       * none), Hedgehog feature maps φ(x) = [softmax(xW) ⊕ softmax(-xW)] with
                       * feature_dim = head_dim, the softmax sums scaled by γ = σ(w) per head, no
                       * gate; parameters hq_W [H][D][F], hk_W [H][D][F], w [H] */
    int sel_global;   /* global selection (budget mode): Sel keeps the best budget - 2C tokens of the whole
                       * history, its worst evicted into the linear state (at most kGlobalMaxCap of them;
                       * not for training) */
    int sel_span;     /* a leaving token ranks by the best score within sel_span positions (its chunk and the
                       * next); global selection only on the GPU */
    int sel_q8;       /* Sel's keys and values in 8 bits with a float scale per row (the CPU's --sel-cache q8,
                       * quantized the same way); 0: IEEE half (--sel-cache f16). Inference only: stage-1
                       * training (stc_still_distill) refuses it */
} stc_still_config;

/* What a configuration resolved to. */
typedef struct {
    int lambda;       /* tokens kept per leaving chunk (after the rules above, at most C) */
    int cap;          /* Sel capacity per selection head (budget - 2C, or enough for n_ctx) */
    int n_sel_heads;  /* Hs: n_head, or n_head_kv with per_kv_head */
    int feat;         /* P = 2 · head_dim, the feature-map width */
    size_t param_count;   /* floats of the parameters (the CPU layout) */
    int attn_wgmma;   /* the state's prefill attention runs on Hopper's wgmma (stc_still_get_info only: head
                       * dim 64, sm_90a code loaded, STILL_CUDA_ATTN_WGMMA not "0"); else on mma.sync */
} stc_still_info;

/* Parameters, floats in the CPU order (src/kinds/still/attn_still.c): q_u [H][D],
 * k_u [H][D], q_W [H][D][D], k_W [H][D][D], then with the gate Wg [H·D][d],
 * bg [H·D]. Checks the configuration as the CPU does, plus the limits above. */
int stc_still_resolve(const stc_still_config *cfg, stc_still_info *out, still_err *err);

/* A per-layer state: Local ring (fp32 keys and values of the last <= 2C
 * positions, and their routing scores), Sel (half keys and values, or bytes
 * and a scale per row with sel_q8, [Hs][cap] rows, and the positions they came from), S [H][P][D] and z [H][P] (fp32),
 * the device position counter. Fresh (n_seen = 0). */
int stc_still_create(stc_ctx *ctx, const stc_still_config *cfg, stc_still **out, still_err *err);
/* Frees the state (and its workspace unless another state still shares it).
 * The context must still exist. NULL is a no-op. */
void stc_still_free(stc_still *s);
/* Back to n_seen = 0 (asynchronous). */
int stc_still_reset(stc_ctx *ctx, stc_still *s, still_err *err);
/* Device bytes of the sequence state (not the workspace). */
size_t stc_still_state_bytes(const stc_still *s);
/* The sequence state's regions (stc_region: the ring and its scores, Sel, the linear state, the device position;
 * the whole capacity of each): count, or -1 when max is too small. After a restore, stc_still_set_position. */
int stc_still_regions(stc_still *s, stc_region *out, int max);
/* The resolved configuration of a state. */
void stc_still_get_info(const stc_still *s, stc_still_info *out);

/* The per-call workspace (routing scores of the call's tokens, the linear
 * state's prefix sums over the call's leaving chunks, the gate's
 * pre-activations, ...) grows on demand with T, which allocates and so waits
 * for the device; reserve it up front for calls of up to T_max tokens (e.g.
 * before capturing a CUDA graph). About T_max · (H·D·4 + H·12) +
 * (T_max / C + 1) · H·P·(D+1)·4 bytes. */
int stc_still_reserve(stc_ctx *ctx, stc_still *s, int T_max, still_err *err);
/* The caller knows the state's position (its tokens so far) after calls with STC_STILL_P0_DEVICE: global
 * selection cuts a call of several tokens at chunk boundaries by it. Not checked against the device. */
void stc_still_set_position(stc_still *s, int n_seen);
/* Let `s` use `owner`'s workspace instead of its own (the layers of a model
 * run one after another on one stream, so one workspace serves them all). */
int stc_still_share_workspace(stc_still *s, stc_still *owner, still_err *err);
/* Use a caller-owned bf16 copy of the gate matrix Wg [H·D][d] (e.g. made
 * once with stc_f32_to_bf16 from the parameters) instead of converting the
 * fp32 one on every call; NULL goes back to converting. The copy must stay
 * valid and match the parameters passed to stc_still_forward. */
void stc_still_set_gate_bf16(stc_still *s, const stc_bf16 *wg_dev);

/* Positions come from the device counter, unchecked (for a forward captured
 * in a CUDA graph and replayed; see stc_still_forward). */
enum { STC_STILL_P0_DEVICE = -1 };

/* T tokens at positions p0 .. p0 + T - 1 continuing the sequence the state
 * holds (p0 must equal the tokens seen so far, or be STC_STILL_P0_DEVICE):
 *   params_dev  the parameters, CPU layout (stc_still_resolve); may be NULL
 *               when linear is off. A decode step (T = 1) on sm_90 reads
 *               them while the kernels enqueued before it may still run
 *               (Programmatic Dependent Launch, back to the last kernel
 *               launched without it): write them before that kernel, or
 *               synchronise, not in a kernel just before a T = 1 call
 *   q           [T][H][D] fp32 after RoPE
 *   k, v        [T][Hk][D] fp32 (k after RoPE)
 *   x_bf16      [T][d] bf16, the layer input (after the attention RMSNorm)
 *               for the gate; may be NULL when the gate or linear is off
 *   out         [T][H][D] fp32 per-head outputs (before o_proj)
 * All device pointers (q, k, v, out and params 16-byte aligned). Asynchronous. With
 * p0 = STC_STILL_P0_DEVICE the host does not check the position (the
 * kernels clamp, but T tokens past n_ctx give undefined outputs) and stops
 * tracking it: later calls must pass STC_STILL_P0_DEVICE too, or learn the
 * position with stc_still_n_seen first. */
int stc_still_forward(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                      const float *v, const stc_bf16 *x_bf16, int T, int p0, float *out, still_err *err);
/* The same with the per-head outputs rounded to bf16 (to nearest, ties to
 * even) into out_bf16 [T][H][D] by the kernels that finish them, as
 * stc_still_forward followed by stc_f32_to_bf16 would give; out is then
 * only scratch (its contents are unspecified afterwards). Saves the fp32
 * outputs' write and a conversion pass in a prefill. out_bf16 4-byte
 * aligned. */
int stc_still_forward_bf16(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                           const float *v, const stc_bf16 *x_bf16, int T, int p0, float *out, stc_bf16 *out_bf16,
                           still_err *err);
/* The same from one fused matrix qkv [T][ld] fp32 whose rows hold q
 * (H·D, after RoPE), k (Hk·D, after RoPE), v (Hk·D) and, with the gate, its
 * pre-activations x·Wgᵀ (H·D), in that order: what one GEMM with the
 * concatenated weights [Wq; Wk; Wv; Wg] gives (a prefill's one product in
 * place of four). The gate GEMM is not run here, so no x is needed. ld a
 * multiple of 4 and at least the row's width, qkv 16-byte aligned;
 * out_bf16 NULL gives fp32 outputs in out as stc_still_forward.
 * k_f16, v_f16 (both or neither; 16-byte aligned): the call's k and v
 * rounded to IEEE half, rows packed [T][Hk][D] (stc_rope_at_ld's copies):
 * the attention kernel copies its Local tiles from them instead of
 * converting the fp32 rows (the same values: Sel and Local are half).
 * Each should stay allocated 64 rows (64·Hk·D halves) past its T rows: the
 * kernel's zero-filled copies of rows past the end take those addresses
 * (with a source size of 0: nothing is read there).
 * out_first (0 .. T-1; anything with T = 0): the first call row whose outputs are wanted; the
 * attention and linear blocks whose rows all come before it do not run, so
 * the outputs of earlier rows are unspecified (at most a block's rows, 64,
 * before out_first are written). The state is updated for all T tokens as
 * with 0. A model's last layer, whose output only its last rows' logits
 * read, passes T - 1. */
int stc_still_forward_qkv(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *qkv, int64_t ld, int T,
                          int out_first, int p0, float *out, stc_bf16 *out_bf16, const stc_f16 *k_f16,
                          const stc_f16 *v_f16, still_err *err);

/* Tokens seen (reads the device counter: synchronous). */
int stc_still_n_seen(stc_ctx *ctx, stc_still *s, int *out, still_err *err);
/* The device counter itself (an int the kernels advance). */
const int *stc_still_n_seen_dev(const stc_still *s);
/* Decode steps (T = 1) run kernels specialised for one query row (on by
 * default); off, they take the chunk-parallel kernels of a prefill (for
 * tests and benchmarks). */
void stc_still_set_decode_kernels(stc_still *s, int on);
/* How many chunks leave Local when T tokens are processed from position p0
 * (host arithmetic; 0 for a NULL state). */
int stc_still_leaves_at(const stc_still *s, int p0, int T);
/* A promise for the coming decode steps (T = 1): no chunk leaves in them
 * (stc_still_leaves_at(s, p0, 1) == 0 at each), so their leave and scan
 * kernels are not launched. A broken promise gives wrong outputs. For a
 * caller that records one CUDA graph for the steps where a chunk leaves and
 * one for the others. Off by default. */
void stc_still_set_decode_no_leave(stc_still *s, int on);
/* Calls of T = 1 read the gate's pre-activations x·Wgᵀ ([H·D] floats) from
 * pre_dev instead of computing them (NULL: compute). For an engine whose
 * decode step gets them from the same GEMM as q, k and v (Wg stacked under
 * Wq, Wk, Wv). The pointer must stay valid and be 8-byte aligned (a call
 * with a misaligned one fails with STILL_E_ARG). */
void stc_still_set_decode_gate_pre(stc_still *s, const float *pre_dev);
/* Stage-1 training (attention transfer) of one layer on one whole sequence,
 * the GPU counterpart of src/kinds/still/attn_still.c's still_distill: resets the state,
 * runs the forward over positions 0 .. T-1 (T <= n_ctx), adds
 * Σ (y - target)² / (T·H·D) to *mse_dev (one device double) and, with
 * grad_dev, adds the gradient of scale · that MSE with respect to the
 * parameters (CPU layout, param_count floats) into grad_dev. Selection is a
 * fixed routing decision (the tokens the forward selected); the gradient
 * flows through the linear branch: the q- and k-maps and the gate.
 * x_f32 is the same layer input as x_bf16 in fp32 (the gate's weight
 * gradient, an fp32 GEMM). target [T][H][D] fp32 (the softmax teacher's
 * per-head outputs). Supported: NP-Map, head dim 64, C <= 128 (not lolcats).
 * Asynchronous; the state's workspace grows on first use. */
int stc_still_distill(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                      const float *v, const stc_bf16 *x_bf16, const float *x_f32, int T, const float *target,
                      float scale, float *grad_dev, double *mse_dev, still_err *err);

/* Debugging and tests: the positions of the selected tokens per selection
 * head, in Sel order (chunk by chunk, positions ascending within a chunk):
 * pos_host [Hs][cap], count_host [Hs] (entries past the count are left
 * alone). Synchronous. */
int stc_still_selected(stc_ctx *ctx, stc_still *s, int32_t *pos_host, int *count_host, still_err *err);

#ifdef __cplusplus
}
#endif

#endif
