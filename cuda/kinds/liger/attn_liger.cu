/* The liger kind's linear branch on the GPU (src/kinds/liger/attn_liger.c is the
 * reference; ../shared/spec/attention.md the contract):
 *
 *   φ(x) = softmax over the D channels of x (q and k before RoPE)
 *   α_t  = σ(k_t)^{1/16} per channel
 *   S_t  = diag(α_t) S_{t-1} + φ(k_t) v_tᵀ,   o_lin = φ(q_t)ᵀ S_t
 *   out  = 0.5 out + 0.5 o_lin            (out holds o_swa on entry)
 *
 * S is kept per KV head ([Hk][D][D], rows key channels i, columns value
 * channels d) and read by the KV head's G query heads. Column d of S sees
 * only v[d], so one thread owns one column and keeps it in registers; a
 * block of D threads is one KV head.
 *
 * A call of T tokens runs in segments of at most `seg` tokens (what the
 * caller's workspace holds), each in four kernels:
 *   1. features: φ(q), φ(k) and α of every token (one warp per row);
 *   2. local: for every chunk of C = 64 tokens, the state the chunk alone
 *      would build from zero, L_c = Σ_s (Π_{r>s} diag α_r) φk_s v_sᵀ, and its
 *      decay A_c = Π_s α_s (per row): one block per (chunk, KV head);
 *   3. scan: S at every chunk's start, S_{c+1} = diag(A_c) S_c + L_c, one
 *      thread per element of S walking the chunks (in place over L_c), the
 *      last value back into the state;
 *   4. output: every chunk re-runs the recurrence from its start state,
 *      token by token, and mixes o_lin into out.
 * Steps 2 and 3 are skipped when the segment is one chunk (a decode step,
 * a short call): step 4 then runs from the state and writes it back. The
 * same recurrence as the CPU's, token by token in fp32; only the chunk
 * boundaries' products (A_c · S_c + L_c) are grouped differently. */
#include "common/cuda_common.cuh"
#include "kinds/liger/attn_liger_rules.h"

#include <algorithm>
#include <math.h>
#include <stdlib.h>

namespace {

enum {
    LIGER_C = 64,      /* tokens per chunk of steps 2-4 */
    LIGER_SUB = 8,     /* tokens whose features a block stages in shared memory at once */
    LIGER_MAX_G = 8,   /* query heads per KV head */
};

/* ---- 1. features: one warp per row (token, head) ----------------------------------- */

/* Rows 0 .. T·H-1 are q rows, then T·Hk k rows. D = 32 · PER. */
template <int PER>
__global__ void liger_features_kernel(const float *__restrict__ q, const float *__restrict__ k, int T, int H, int Hk,
                                      float *__restrict__ phq, float *__restrict__ phk, float *__restrict__ alpha) {
    constexpr int D = 32 * PER;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    const int64_t nq = (int64_t)T * H;
    if (row >= nq + (int64_t)T * Hk) return;
    const bool is_q = row < nq;
    const size_t off = (size_t)(is_q ? row : row - nq) * D;
    const float *src = (is_q ? q : k) + off;
    float x[PER], mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        x[j] = src[lane + 32 * j];
        mx = fmaxf(mx, x[j]);
    }
    if (!is_q) {
        /* σ(k)^{1/16} = exp(log σ(k) / 16), log σ(k) = min(k, 0) - log(1 + e^{-|k|}) */
#pragma unroll
        for (int j = 0; j < PER; j++)
            alpha[off + lane + 32 * j] = liger_decay(x[j]);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        x[j] = expf(x[j] - mx);
        sum += x[j];
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
    float *dst = (is_q ? phq : phk) + off;
#pragma unroll
    for (int j = 0; j < PER; j++) dst[lane + 32 * j] = x[j] * inv;
}

/* ---- 2. local chunk states --------------------------------------------------------------- */

/* grid (chunks, Hk), D threads: thread d owns column d of L_c; as row i = d it
 * also forms A_c[i]. Lc [chunks][Hk][D][D], Ac [chunks][Hk][D]. */
template <int D>
__global__ void __launch_bounds__(D) liger_local_kernel(const float *__restrict__ phk, const float *__restrict__ alpha,
                                                        const float *__restrict__ v, int T, int Hk,
                                                        float *__restrict__ Lc, float *__restrict__ Ac) {
    __shared__ float sk[LIGER_SUB][D], sa[LIGER_SUB][D];
    const int c = blockIdx.x, hk = blockIdx.y, d = threadIdx.x;
    const int t0 = c * LIGER_C, n = min(LIGER_C, T - t0);
    const size_t kvd = (size_t)Hk * D;
    float L[D];
#pragma unroll
    for (int i = 0; i < D; i++) L[i] = 0.0f;
    float decay = 1.0f;
    for (int s0 = 0; s0 < n; s0 += LIGER_SUB) {
        const int ns = min(LIGER_SUB, n - s0);
        __syncthreads();
        for (int s = 0; s < ns; s++) {
            const size_t at = (size_t)(t0 + s0 + s) * kvd + (size_t)hk * D + d;
            sk[s][d] = phk[at];
            sa[s][d] = alpha[at];
            decay *= sa[s][d];
        }
        __syncthreads();
        for (int s = 0; s < ns; s++) {
            const float vd = v[(size_t)(t0 + s0 + s) * kvd + (size_t)hk * D + d];
#pragma unroll
            for (int i = 0; i < D; i++) L[i] = sa[s][i] * L[i] + sk[s][i] * vd;
        }
    }
    float *dst = Lc + ((size_t)c * Hk + hk) * D * D;
#pragma unroll
    for (int i = 0; i < D; i++) dst[(size_t)i * D + d] = L[i];
    Ac[((size_t)c * Hk + hk) * D + d] = decay;
}

/* ---- 3. scan over the chunks ---------------------------------------------------------- */

/* One thread per element (hk, i, d) of S: W[c] holds L_c on entry and S at
 * chunk c's start on return; S (the state) holds the start of chunk 0 on
 * entry and the end of the last chunk on return. */
__global__ void liger_scan_kernel(float *__restrict__ W, const float *__restrict__ Ac, float *__restrict__ S,
                                  int n_chunks, int Hk, int D) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t per = (int64_t)Hk * D * D;
    if (e >= per) return;
    const int64_t row = e / D;   /* hk · D + i */
    const int64_t rows = (int64_t)Hk * D;
    float cur = S[e];
    enum { AHEAD = 8 };
    for (int c0 = 0; c0 < n_chunks; c0 += AHEAD) {
        float l[AHEAD], a[AHEAD];
        const int nb = min((int)AHEAD, n_chunks - c0);
#pragma unroll
        for (int j = 0; j < AHEAD; j++)
            if (j < nb) l[j] = W[(size_t)(c0 + j) * per + e], a[j] = Ac[(size_t)(c0 + j) * rows + row];
#pragma unroll
        for (int j = 0; j < AHEAD; j++)
            if (j < nb) {
                W[(size_t)(c0 + j) * per + e] = cur;
                cur = a[j] * cur + l[j];
            }
    }
    S[e] = cur;
}

/* ---- 4. outputs ------------------------------------------------------------------------- */

/* grid (chunks, Hk), D threads. Start states at Sstart + c · start_stride
 * (start_stride 0: every chunk starts from Sstart, i.e. one chunk from the
 * state); write_back: the chunk's end state back into Sstart. */
template <int D>
__global__ void __launch_bounds__(D) liger_out_kernel(const float *__restrict__ phq, const float *__restrict__ phk,
                                                      const float *__restrict__ alpha, const float *__restrict__ v,
                                                      int T, int H, int Hk, float *Sstart, size_t start_stride,
                                                      int write_back, float *__restrict__ out) {
    __shared__ float sk[LIGER_SUB][D], sa[LIGER_SUB][D], sq[LIGER_SUB][LIGER_MAX_G][D];
    const int c = blockIdx.x, hk = blockIdx.y, d = threadIdx.x, G = H / Hk;
    const int t0 = c * LIGER_C, n = min(LIGER_C, T - t0);
    const size_t kvd = (size_t)Hk * D, qd = (size_t)H * D;
    float *st = Sstart + (size_t)c * start_stride + (size_t)hk * D * D;
    float S[D];
#pragma unroll
    for (int i = 0; i < D; i++) S[i] = st[(size_t)i * D + d];
    for (int s0 = 0; s0 < n; s0 += LIGER_SUB) {
        const int ns = min(LIGER_SUB, n - s0);
        __syncthreads();
        for (int s = 0; s < ns; s++) {
            const size_t t = (size_t)(t0 + s0 + s);
            sk[s][d] = phk[t * kvd + (size_t)hk * D + d];
            sa[s][d] = alpha[t * kvd + (size_t)hk * D + d];
            for (int g = 0; g < G; g++) sq[s][g][d] = phq[t * qd + (size_t)(hk * G + g) * D + d];
        }
        __syncthreads();
        for (int s = 0; s < ns; s++) {
            const size_t t = (size_t)(t0 + s0 + s);
            const float vd = v[t * kvd + (size_t)hk * D + d];
#pragma unroll
            for (int i = 0; i < D; i++) S[i] = sa[s][i] * S[i] + sk[s][i] * vd;
            for (int g = 0; g < G; g++) {
                float o0 = 0, o1 = 0, o2 = 0, o3 = 0;
#pragma unroll
                for (int i = 0; i < D; i += 4) {
                    o0 += sq[s][g][i] * S[i];
                    o1 += sq[s][g][i + 1] * S[i + 1];
                    o2 += sq[s][g][i + 2] * S[i + 2];
                    o3 += sq[s][g][i + 3] * S[i + 3];
                }
                float *dst = out + t * qd + (size_t)(hk * G + g) * D + d;
                *dst = LIGER_MIX * *dst + LIGER_MIX * ((o0 + o1) + (o2 + o3));
            }
        }
    }
    if (write_back) {
#pragma unroll
        for (int i = 0; i < D; i++) st[(size_t)i * D + d] = S[i];
    }
}

size_t ws_floats(int H, int Hk, int D, int seg) {
    const size_t nch = (size_t)(seg + LIGER_C - 1) / LIGER_C;
    return (size_t)seg * (H + 2 * Hk) * D + nch * Hk * ((size_t)D * D + D);
}

/* The longest segment (a multiple of C, or T itself when shorter) that fits ws_bytes. */
int segment_tokens(int H, int Hk, int D, int T, size_t ws_bytes) {
    if (ws_floats(H, Hk, D, T) * sizeof(float) <= ws_bytes) return T;
    int lo = 0, hi = T / LIGER_C;   /* in chunks */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ws_floats(H, Hk, D, mid * LIGER_C) * sizeof(float) <= ws_bytes) lo = mid;
        else hi = mid - 1;
    }
    return lo * LIGER_C;
}

template <int D>
int run_segment(stc_ctx *ctx, stc_liger *s, const float *q, const float *k, const float *v, int T, float *ws,
                float *out, still_err *err);

}  // namespace

struct stc_liger {
    stc_ctx *ctx;
    int H, Hk, D;
    float *S;          /* [Hk][D][D] */
    int n_seen;
};

namespace {

template <int D>
int run_segment(stc_ctx *ctx, stc_liger *s, const float *q, const float *k, const float *v, int T, float *ws,
                float *out, still_err *err) {
    const int H = s->H, Hk = s->Hk;
    float *phq = ws, *phk = phq + (size_t)T * H * D, *alpha = phk + (size_t)T * Hk * D;
    float *Lc = alpha + (size_t)T * Hk * D;
    const int n_chunks = (T + LIGER_C - 1) / LIGER_C;
    float *Ac = Lc + (size_t)n_chunks * Hk * D * D;
    cudaStream_t st = ctx->stream;
    const int64_t rows = (int64_t)T * (H + Hk);
    liger_features_kernel<D / 32><<<stc_blocks(rows, 8), 256, 0, st>>>(q, k, T, H, Hk, phq, phk, alpha);
    STC_LAUNCHED(err, "liger_features_kernel");
    if (n_chunks == 1) {
        liger_out_kernel<D><<<dim3(1, Hk), D, 0, st>>>(phq, phk, alpha, v, T, H, Hk, s->S, 0, 1, out);
        STC_LAUNCHED(err, "liger_out_kernel");
        return STILL_OK;
    }
    liger_local_kernel<D><<<dim3(n_chunks, Hk), D, 0, st>>>(phk, alpha, v, T, Hk, Lc, Ac);
    STC_LAUNCHED(err, "liger_local_kernel");
    const int64_t elems = (int64_t)Hk * D * D;
    liger_scan_kernel<<<stc_blocks(elems, 128), 128, 0, st>>>(Lc, Ac, s->S, n_chunks, Hk, D);
    STC_LAUNCHED(err, "liger_scan_kernel");
    liger_out_kernel<D><<<dim3(n_chunks, Hk), D, 0, st>>>(phq, phk, alpha, v, T, H, Hk, Lc, (size_t)Hk * D * D, 0,
                                                          out);
    STC_LAUNCHED(err, "liger_out_kernel");
    return STILL_OK;
}

int check_shape(int H, int Hk, int D, still_err *err) {
    if (H <= 0 || Hk <= 0 || H % Hk)
        return stc_fail(err, STILL_E_ARG, "liger: %d query heads over %d KV heads", H, Hk);
    if (D != 64 && D != 128) return stc_fail(err, STILL_E_UNSUPPORTED, "liger on the GPU: head dim %d (64 or 128)", D);
    if (H / Hk > LIGER_MAX_G)
        return stc_fail(err, STILL_E_UNSUPPORTED, "liger on the GPU: %d query heads per KV head (at most %d)", H / Hk,
                        (int)LIGER_MAX_G);
    return STILL_OK;
}

}  // namespace

size_t stc_liger_workspace_bytes(int n_head, int n_head_kv, int head_dim, int T_max) {
    if (n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || T_max <= 0) return 0;
    const int seg = std::min(T_max, (int)STC_LIGER_SEGMENT);
    return ws_floats(n_head, n_head_kv, head_dim, seg) * sizeof(float);
}

int stc_liger_create(stc_ctx *ctx, int n_head, int n_head_kv, int head_dim, stc_liger **out, still_err *err) {
    if (!out) return stc_fail(err, STILL_E_ARG, "stc_liger_create: NULL output");
    *out = NULL;
    STC_ENTER(ctx, err);
    int rc = check_shape(n_head, n_head_kv, head_dim, err);
    if (rc) return rc;
    stc_liger *s = (stc_liger *)calloc(1, sizeof *s);
    if (!s) return stc_fail(err, STILL_E_NOMEM, "out of host memory");
    s->ctx = ctx, s->H = n_head, s->Hk = n_head_kv, s->D = head_dim;
    rc = stc_malloc(ctx, stc_liger_state_bytes(s), "the liger state", (void **)&s->S, err);
    if (!rc) rc = stc_liger_reset(ctx, s, err);
    if (rc) {
        stc_liger_free(s);
        return rc;
    }
    *out = s;
    return STILL_OK;
}

void stc_liger_free(stc_liger *s) {
    if (!s) return;
    stc_free(s->ctx, s->S);
    free(s);
}

int stc_liger_reset(stc_ctx *ctx, stc_liger *s, still_err *err) {
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_liger_reset: NULL state");
    int rc = stc_memset(ctx, s->S, 0, stc_liger_state_bytes(s), err);
    if (!rc) s->n_seen = 0;
    return rc;
}

size_t stc_liger_state_bytes(const stc_liger *s) { return s ? (size_t)s->Hk * s->D * s->D * sizeof(float) : 0; }

int stc_liger_n_seen(const stc_liger *s) { return s ? s->n_seen : 0; }

int stc_liger_regions(stc_liger *s, stc_region *out, int max) {
    if (!s) return 0;
    if (max < 1) return -1;
    out[0] = stc_region{s->S, stc_liger_state_bytes(s)};
    return 1;
}

void stc_liger_set_n_seen(stc_liger *s, int n) {
    if (s) s->n_seen = n;
}

int stc_liger_state(stc_ctx *ctx, const stc_liger *s, float *S_host, still_err *err) {
    if (!s || !S_host) return stc_fail(err, STILL_E_ARG, "stc_liger_state: NULL argument");
    return stc_memcpy_d2h(ctx, S_host, s->S, stc_liger_state_bytes(s), err);
}

int stc_liger_forward(stc_ctx *ctx, stc_liger *s, const float *q_nope, const float *k_nope, const float *v, int T,
                      void *ws_dev, size_t ws_bytes, float *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_liger_forward: NULL state");
    if (T < 0) return stc_fail(err, STILL_E_ARG, "liger: negative token count %d", T);
    if (T == 0) return STILL_OK;
    if (!q_nope || !k_nope || !v || !out || !ws_dev)
        return stc_fail(err, STILL_E_ARG, "stc_liger_forward: NULL tensor");
    const int H = s->H, Hk = s->Hk, D = s->D;
    const int seg_max = segment_tokens(H, Hk, D, std::min(T, (int)STC_LIGER_SEGMENT), ws_bytes);
    if (seg_max <= 0)
        return stc_fail(err, STILL_E_ARG, "liger: a %zu-byte workspace cannot hold one %d-token chunk (%zu bytes needed)",
                        ws_bytes, (int)LIGER_C, ws_floats(H, Hk, D, std::min(T, (int)LIGER_C)) * sizeof(float));
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
    for (int t0 = 0; t0 < T; t0 += seg_max) {
        const int n = std::min(seg_max, T - t0);
        const float *q = q_nope + (size_t)t0 * qd, *k = k_nope + (size_t)t0 * kvd, *vv = v + (size_t)t0 * kvd;
        float *o = out + (size_t)t0 * qd;
        const int rc = D == 64 ? run_segment<64>(ctx, s, q, k, vv, n, (float *)ws_dev, o, err)
                               : run_segment<128>(ctx, s, q, k, vv, n, (float *)ws_dev, o, err);
        if (rc) return rc;
    }
    s->n_seen += T;
    return STILL_OK;
}
