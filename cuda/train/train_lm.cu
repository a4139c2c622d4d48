/* Stage 2 (still finetune) on the GPU: the elementwise and row-wise steps of
 * the whole model's forward and backward that src/train/train_lm_cuda.c strings
 * together with cuBLASLt products (stc_gemm_rm). Each mirrors a loop of the
 * CPU trainer (src/train/train_lm.c), in fp32:
 *   RMSNorm with its 1/rms kept, and its backward (accumulating);
 *   RoPE of whole rows at positions 0 .. T-1 of each sequence, and its inverse;
 *   SwiGLU and its backward; LoRA dropout with the CPU's hash-drawn masks;
 *   the cross-entropy of a block of logit rows (loss per row, the gradient
 *   in place); the causal (or windowed) softmax of an attention score
 *   matrix, and dS = P ⊙ (dP − δ) of its backward. */
#include "kinds/attn_rules.h"
#include "common/cuda_common.cuh"

namespace {

constexpr int kRowThreads = 256;

__device__ __forceinline__ float block_sum(float v, float *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}

__device__ __forceinline__ double block_sum_d(double v, double *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double t = 0.0;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}

__device__ __forceinline__ float block_max(float v, float *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = -INFINITY;
    for (int i = 0; i < nw; i++) t = fmaxf(t, sh[i]);
    return t;
}

/* Row t: out = x r w, r = 1/sqrt(mean(x²) + eps) (the sum of squares in double, as the CPU). */
__global__ void rmsnorm_r_kernel(const float *x, const float *w, int n, float eps, float *out, float *r) {
    __shared__ double sh[kRowThreads / 32];
    const float *xr = x + (size_t)blockIdx.x * n;
    double ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * xr[i];
    ss = block_sum_d(ss, sh);
    const float s = (float)(1.0 / sqrt(ss / n + eps));
    if (threadIdx.x == 0) r[blockIdx.x] = s;
    float *o = out + (size_t)blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * s * w[i];
}

/* dx += r (w ⊙ dy) − x r³/n Σ w dy x. */
__global__ void rmsnorm_bwd_kernel(float *dx, const float *x, const float *r, const float *w, const float *dy, int n) {
    __shared__ double sh[kRowThreads / 32];
    const size_t o = (size_t)blockIdx.x * n;
    double s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += (double)w[i] * dy[o + i] * x[o + i];
    s = block_sum_d(s, sh);
    const float rs = r[blockIdx.x], c = (float)(s * (double)rs * rs * rs / n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dx[o + i] += rs * w[i] * dy[o + i] - x[o + i] * c;
}

/* Row r (block) at position t = r mod T, pair i (thread): rotate by t · θ^(-2i/D) (back with inverse), every
 * head. */
__global__ void rope_rows_kernel(float *x, int T, int nh, int D, float theta, int inverse) {
    const int r = blockIdx.x, t = r % T;
    for (int i = threadIdx.x; i < D / 2; i += blockDim.x) {
        const float inv_freq = (float)pow((double)theta, -2.0 * i / D);
        const float angle = (float)t * inv_freq;
        const float cs = cosf(angle), sn = inverse ? -sinf(angle) : sinf(angle);
        for (int h = 0; h < nh; h++) {
            float *p = x + ((size_t)r * nh + h) * D + 2 * i;
            const float a = p[0], b = p[1];
            p[0] = a * cs - b * sn;
            p[1] = a * sn + b * cs;
        }
    }
}

__global__ void swiglu_f32_kernel(const float *g, const float *u, float *act, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float gi = g[i];
        act[i] = gi / (1.0f + expf(-gi)) * u[i];
    }
}

__global__ void swiglu_bwd_kernel(const float *dact, const float *g, const float *u, float *dg, float *du, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float gi = g[i], sg = 1.0f / (1.0f + expf(-gi));
        dg[i] = dact[i] * u[i] * sg * (1.0f + gi * (1.0f - sg));
        du[i] = dact[i] * gi * sg;
    }
}

/* src/kinds/attn_common.h's attn_rng_next and src/train/train_lm.c's drop_u: the same masks as the CPU. */
__device__ __forceinline__ float drop_u(uint64_t seed, uint64_t i) {
    uint64_t z = (seed ^ (i * 0x9e3779b97f4a7c15ULL)) + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (float)(z >> 40) * 0x1.0p-24f;
}

/* Element i's draw: its sequence's seed (device memory, so that a recorded graph replays with each step's own)
 * mixed with the target's salt, as src/train/train_lm.c, at its index within the sequence. */
__device__ __forceinline__ bool dropped(const uint64_t *seq_seed, uint64_t salt, int64_t i, int64_t per_seq, float p) {
    const int64_t s = i / per_seq;
    return drop_u(seq_seed[s] * 0x2545f4914f6cdd1dULL + salt, (uint64_t)(i - s * per_seq)) < p;
}

__global__ void dropout_kernel(const float *x, float *out, int64_t n, int64_t per_seq, float p, const uint64_t *seq_seed,
                               uint64_t salt) {
    const float keep = 1.0f / (1.0f - p);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = dropped(seq_seed, salt, i, per_seq, p) ? 0.0f : x[i] * keep;
}

__global__ void dropout_bwd_kernel(float *dx, const float *dxd, int64_t n, int64_t per_seq, float p,
                                   const uint64_t *seq_seed, uint64_t salt) {
    const float keep = 1.0f / (1.0f - p);
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        if (!dropped(seq_seed, salt, i, per_seq, p)) dx[i] += dxd[i] * keep;
}

__global__ void axpy_kernel(float *y, const float *x, float a, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] += a * x[i];
}

/* Row i of the block: loss_i = w (logsumexp − ℓ[y]) (sum of exponentials in double, as the CPU); with grad,
 * ℓ ← scale w (softmax(ℓ) − onehot(y)). */
__global__ void ce_rows_kernel(float *logits, int V, const int32_t *targets, const float *w, const float *scale_dev,
                               int grad, double *loss) {
    __shared__ float shf[kRowThreads / 32];
    __shared__ double shd[kRowThreads / 32];
    float *lg = logits + (size_t)blockIdx.x * V;
    const int y = targets[blockIdx.x];
    const float wi = w ? (w[blockIdx.x] > 0.0f ? w[blockIdx.x] : 0.0f) : 1.0f;   /* as the CPU: w <= 0 (or NaN) learns nothing */
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, lg[j]);
    mx = block_max(mx, shf);
    double s = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += exp((double)lg[j] - mx);
    s = block_sum_d(s, shd);
    const double lse = mx + log(s);
    const float ly = lg[y];
    __syncthreads();   /* every thread has read lg[y] before it is overwritten */
    if (threadIdx.x == 0) loss[blockIdx.x] = wi * (lse - ly);
    if (!grad) return;
    const float f = *scale_dev * wi;
    for (int j = threadIdx.x; j < V; j += blockDim.x) lg[j] = f * (float)exp((double)lg[j] - lse) - (j == y ? f : 0.0f);
}

/* Row r of S [rows][ld], the query at t = r mod T: softmax over the keys lo .. t (lo = t - window + 1 with a
 * window, else 0), zero elsewhere. */
__global__ void softmax_causal_kernel(float *S, int T, int64_t ld, int window) {
    __shared__ float sh[kRowThreads / 32];
    const int t = blockIdx.x % T, lo = attn_window_first(t, window);
    float *row = S + (size_t)blockIdx.x * ld;
    float mx = -INFINITY;
    for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) mx = fmaxf(mx, row[j]);
    mx = block_max(mx, sh);
    float s = 0.0f;
    for (int j = lo + threadIdx.x; j <= t; j += blockDim.x) s += expf(row[j] - mx);
    s = block_sum(s, sh);
    const float inv = 1.0f / s;
    for (int j = threadIdx.x; j < T; j += blockDim.x) row[j] = j >= lo && j <= t ? expf(row[j] - mx) * inv : 0.0f;
}

/* δ_t = Σ_i a[t][i] b[t][i] (one warp a row). */
__global__ void rowdot_kernel(const float *a, int64_t lda, const float *b, int64_t ldb, int T, int n, float *out) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    float s = 0.0f;
    for (int i = lane; i < n; i += 32) s += a[(size_t)t * lda + i] * b[(size_t)t * ldb + i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[t] = s;
}

/* dS = scale · P ⊙ (dP − δ_r), in place of dP (row r a block). */
__global__ void attn_ds_kernel(float *dP, const float *P, const float *delta, int T, int64_t ld, float scale) {
    const int r = blockIdx.x;
    const float dt = delta[r];
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const size_t o = (size_t)r * ld + j;
        dP[o] = scale * P[o] * (dP[o] - dt);
    }
}

/* Element e of the head-major y [B][H][T][D] and its place in the row-major x [B·T][ldx]. */
__global__ void heads_copy_kernel(const float *src, float *dst, int T, int H, int D, int64_t ldx, int64_t n,
                                  int to_major) {
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int d = (int)(e % D);
        const int64_t bht = e / D;
        const int t = (int)(bht % T);
        const int64_t bh = bht / T;
        const int h = (int)(bh % H);
        const int64_t b = bh / H;
        const int64_t xi = (b * T + t) * ldx + (int64_t)h * D + d;
        if (to_major) dst[e] = src[xi];
        else dst[xi] = src[e];
    }
}

unsigned flat_blocks(int64_t n) { return stc_blocks(n, kRowThreads) > 4096 ? 4096 : stc_blocks(n, kRowThreads); }

}   // namespace

int stc_rmsnorm_r(stc_ctx *ctx, const float *x, const float *w, int T, int n, float eps, float *out, float *r,
                  still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    rmsnorm_r_kernel<<<T, kRowThreads, 0, ctx->stream>>>(x, w, n, eps, out, r);
    STC_LAUNCHED(err, "rmsnorm_r_kernel");
    return STILL_OK;
}

int stc_rmsnorm_bwd(stc_ctx *ctx, float *dx, const float *x, const float *r, const float *w, const float *dy, int T,
                    int n, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    rmsnorm_bwd_kernel<<<T, kRowThreads, 0, ctx->stream>>>(dx, x, r, w, dy, n);
    STC_LAUNCHED(err, "rmsnorm_bwd_kernel");
    return STILL_OK;
}

int stc_rope_rows(stc_ctx *ctx, float *x, int rows, int T, int n_heads, int D, float theta, int inverse,
                  still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0) return STILL_OK;
    if (T <= 0) return stc_fail(err, STILL_E_ARG, "stc_rope_rows: sequences of %d rows", T);
    rope_rows_kernel<<<rows, 64, 0, ctx->stream>>>(x, T, n_heads, D, theta, inverse);
    STC_LAUNCHED(err, "rope_rows_kernel");
    return STILL_OK;
}

int stc_swiglu_f32(stc_ctx *ctx, const float *gate, const float *up, float *act, int64_t n, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    swiglu_f32_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(gate, up, act, n);
    STC_LAUNCHED(err, "swiglu_f32_kernel");
    return STILL_OK;
}

int stc_swiglu_bwd(stc_ctx *ctx, const float *dact, const float *gate, const float *up, float *dgate, float *dup,
                   int64_t n, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    swiglu_bwd_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(dact, gate, up, dgate, dup, n);
    STC_LAUNCHED(err, "swiglu_bwd_kernel");
    return STILL_OK;
}

int stc_dropout(stc_ctx *ctx, const float *x, float *out, int64_t n, int64_t per_seq, float p,
                const uint64_t *seq_seed_dev, uint64_t salt, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    if (per_seq <= 0) return stc_fail(err, STILL_E_ARG, "stc_dropout: sequences of %lld elements", (long long)per_seq);
    dropout_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(x, out, n, per_seq, p, seq_seed_dev, salt);
    STC_LAUNCHED(err, "dropout_kernel");
    return STILL_OK;
}

int stc_dropout_bwd_acc(stc_ctx *ctx, float *dx, const float *dxd, int64_t n, int64_t per_seq, float p,
                        const uint64_t *seq_seed_dev, uint64_t salt, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    if (per_seq <= 0) return stc_fail(err, STILL_E_ARG, "stc_dropout: sequences of %lld elements", (long long)per_seq);
    dropout_bwd_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(dx, dxd, n, per_seq, p, seq_seed_dev, salt);
    STC_LAUNCHED(err, "dropout_bwd_kernel");
    return STILL_OK;
}

int stc_axpy(stc_ctx *ctx, float *y, const float *x, float a, int64_t n, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    axpy_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(y, x, a, n);
    STC_LAUNCHED(err, "axpy_kernel");
    return STILL_OK;
}

int stc_ce_rows(stc_ctx *ctx, float *logits, int rows, int V, const int32_t *targets_dev, const float *w_dev,
                const float *scale_dev, int grad, double *loss_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0) return STILL_OK;
    ce_rows_kernel<<<rows, kRowThreads, 0, ctx->stream>>>(logits, V, targets_dev, w_dev, scale_dev, grad, loss_dev);
    STC_LAUNCHED(err, "ce_rows_kernel");
    return STILL_OK;
}

int stc_softmax_causal(stc_ctx *ctx, float *S, int rows, int T, int64_t ld, int window, still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0) return STILL_OK;
    if (T <= 0 || ld < T) return stc_fail(err, STILL_E_ARG, "stc_softmax_causal: %d keys, rows of %lld", T, (long long)ld);
    softmax_causal_kernel<<<rows, kRowThreads, 0, ctx->stream>>>(S, T, ld, window);
    STC_LAUNCHED(err, "softmax_causal_kernel");
    return STILL_OK;
}

int stc_rowdot(stc_ctx *ctx, const float *a, int64_t lda, const float *b, int64_t ldb, int T, int n, float *out,
               still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    rowdot_kernel<<<(T + 7) / 8, 256, 0, ctx->stream>>>(a, lda, b, ldb, T, n, out);
    STC_LAUNCHED(err, "rowdot_kernel");
    return STILL_OK;
}

int stc_attn_ds(stc_ctx *ctx, float *dP, const float *P, const float *delta, int rows, int T, int64_t ld, float scale,
                still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0) return STILL_OK;
    attn_ds_kernel<<<rows, kRowThreads, 0, ctx->stream>>>(dP, P, delta, T, ld, scale);
    STC_LAUNCHED(err, "attn_ds_kernel");
    return STILL_OK;
}

static int heads_copy(stc_ctx *ctx, const float *src, float *dst, int B, int T, int H, int D, int64_t ldx, int to_major,
                      still_err *err) {
    STC_ENTER(ctx, err);
    const int64_t n = (int64_t)B * T * H * D;
    if (n <= 0) return STILL_OK;
    if (ldx < (int64_t)H * D) return stc_fail(err, STILL_E_ARG, "stc_heads: rows of %lld for %d heads", (long long)ldx, H);
    heads_copy_kernel<<<flat_blocks(n), kRowThreads, 0, ctx->stream>>>(src, dst, T, H, D, ldx, n, to_major);
    STC_LAUNCHED(err, "heads_copy_kernel");
    return STILL_OK;
}

int stc_heads_split(stc_ctx *ctx, const float *x, int64_t ldx, int B, int T, int H, int D, float *y, still_err *err) {
    return heads_copy(ctx, x, y, B, T, H, D, ldx, 1, err);
}

int stc_heads_merge(stc_ctx *ctx, const float *y, int B, int T, int H, int D, float *x, int64_t ldx, still_err *err) {
    return heads_copy(ctx, y, x, B, T, H, D, ldx, 0, err);
}
