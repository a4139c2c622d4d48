/* The gdn kind (Gated DeltaNet) on the GPU, forward only (src/kinds/gdn/attn_gdn.c is the CPU's, with the
 * derivation; tests/ref/attn_gdn_ref.c the float64 reference; attn_gdn_rules.h the rules both follow):
 *
 *   S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q̂_t,   y = σ(W_g x + b_g) ⊙ w_n ⊙ o / rms(o)
 *
 * The state is kept transposed as on the CPU, ST [Hk][D][D] (rows key channels, columns value channels), fp32.
 * One algorithm for every call length, the chunked (WY / UT) form of the CPU's run_chunk, in four kernels:
 *   1. prep (a warp per (token, head) row): q̂, k̂ in place; β and log α per (token, KV head) from the caller's
 *      pre-activations;
 *   2. chunk (a block per (chunk of 64, KV head), all chunks at once): the cumulative log α g, the triangular
 *      inverse T = (I + A)⁻¹ with A_ij = β_i e^{g_i − g_j} k̂_i·k̂_j (j < i), and per query head
 *      P_ij = e^{g_i − g_j} q̂_i·k̂_j (j <= i): nothing here depends on the state;
 *   3. scan (a block per (KV head, slice of GDN_SW value columns), chunk after chunk): column x of ST meets
 *      only column x of V, E and the outputs, so the slices are independent. Per chunk, with γ_i = e^{g_i}:
 *      E = T diag(β) (V − diag(γ) K̂ ST), O = diag(γ) Q̂ ST + P E, ST ← γ_C ST + K̂ᵀ diag(e^{g_C − g_j}) E;
 *   4. out (a warp per (token, head) row): the RMSNorm, w_n and the gate.
 * A decode step is a chunk of one token (T = 1, P = q̂·k̂): the same kernels, no position anywhere, so the step
 * records into the CUDA-graph decode. A call longer than the workspace's segment runs segment after segment. */
#include "common/cuda_common.cuh"
#include "kinds/gdn/attn_gdn_rules.h"

#include <algorithm>
#include <math.h>
#include <stdlib.h>

namespace {

enum {
    GDN_C = GDN_CHUNK,   /* tokens per chunk (64) */
    GDN_SW = 16,         /* value columns of ST per scan block */
    GDN_THREADS = 256,
    GDN_MAX_G = 16,      /* query heads per KV head */
};

/* ---- 1. prep ------------------------------------------------------------------------------------------ */

/* Rows 0 .. T·H−1 are q rows, then T·Hk k rows; each is L2-normalised in place. A k row's lane 0 also forms
 * β and log α of its (token, KV head) from pre [T][ld] (columns H·D + hk: w_β·x; H·D + Hk + hk: w_α·x). */
template <int D>
__global__ void gdn_prep_kernel(float *__restrict__ q, float *__restrict__ k, const float *__restrict__ pre, int ld,
                                const float *__restrict__ params, int T, int H, int Hk, int d,
                                float *__restrict__ beta, float *__restrict__ lal) {
    constexpr int PER = D / 32;
    const int lane = threadIdx.x & 31;
    const int64_t nq = (int64_t)T * H, rows = nq + (int64_t)T * Hk;
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * (blockDim.x / 32)) {
        const bool is_q = row < nq;
        float *x = is_q ? q + row * D : k + (row - nq) * D;
        float v[PER], nn = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) v[j] = x[lane + 32 * j], nn += v[j] * v[j];
        for (int o = 16; o > 0; o >>= 1) nn += __shfl_xor_sync(0xffffffffu, nn, o);
        const float f = gdn_l2_factor(nn);
#pragma unroll
        for (int j = 0; j < PER; j++) x[lane + 32 * j] = v[j] * f;
        if (!is_q && lane == 0) {
            const int64_t r = row - nq, t = r / Hk;
            const int hk = (int)(r % Hk);
            const float *p = pre + t * ld + (int64_t)H * D;
            beta[r] = gdn_beta(p[hk] + params[gdn_par_bbeta(Hk, d) + hk]);
            lal[r] = gdn_log_alpha(p[Hk + hk] + params[gdn_par_balpha(Hk, d) + hk], params[gdn_par_alog(Hk, d) + hk]);
        }
    }
}

/* ---- 2. chunk ----------------------------------------------------------------------------------------- */

/* Shared floats of the chunk kernel: K̂ and Q̂ rows [C][D + 1] (padded: no bank conflicts), A and T [C][C + 1],
 * g and β [C]. */
constexpr size_t chunk_smem_floats(int D) { return 2 * (size_t)GDN_C * (D + 1) + 2 * (size_t)GDN_C * (GDN_C + 1) + 2 * GDN_C; }

/* grid (chunks, Hk), GDN_THREADS threads. Writes g [T][Hk] (cumulative log α inside each chunk),
 * Tinv [chunks][Hk][C][C] and P [chunks][H][C][C] (rows and columns past the chunk's end: 0). */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_chunk_kernel(const float *__restrict__ qn, const float *__restrict__ kn, const float *__restrict__ beta,
                     const float *__restrict__ lal, int T, int H, int Hk, float *__restrict__ gcum,
                     float *__restrict__ Tinv, float *__restrict__ P) {
    extern __shared__ float sm[];
    constexpr int LD = D + 1, C = GDN_C, LC = GDN_C + 1;
    float *sK = sm, *sQ = sK + C * LD, *sA = sQ + C * LD, *sT = sA + C * LC, *sg = sT + C * LC, *sb = sg + C;
    const int c = blockIdx.x, hk = blockIdx.y, tid = threadIdx.x, G = H / Hk;
    const int t0 = c * C, n = min(C, T - t0);
    for (int e = tid; e < C * D; e += blockDim.x) {
        const int i = e / D, m = e % D;
        sK[i * LD + m] = i < n ? kn[((size_t)(t0 + i) * Hk + hk) * D + m] : 0.0f;
    }
    if (tid < 32) {   /* g: a warp's inclusive scan over two halves of 32 */
        float a = tid < n ? lal[(size_t)(t0 + tid) * Hk + hk] : 0.0f;
        float b = tid + 32 < n ? lal[(size_t)(t0 + tid + 32) * Hk + hk] : 0.0f;
        for (int o = 1; o < 32; o <<= 1) {
            const float ya = __shfl_up_sync(0xffffffffu, a, o), yb = __shfl_up_sync(0xffffffffu, b, o);
            if (tid >= o) a += ya, b += yb;
        }
        b += __shfl_sync(0xffffffffu, a, 31);
        sg[tid] = a, sg[tid + 32] = b;
        sb[tid] = tid < n ? beta[(size_t)(t0 + tid) * Hk + hk] : 0.0f;
        sb[tid + 32] = tid + 32 < n ? beta[(size_t)(t0 + tid + 32) * Hk + hk] : 0.0f;
    }
    __syncthreads();
    if (tid < C && tid < n) gcum[(size_t)(t0 + tid) * Hk + hk] = sg[tid];
    for (int e = tid; e < C * C; e += blockDim.x) {
        const int i = e / C, j = e % C;
        float a = 0.0f;
        if (j < i && i < n) {
            float s = 0.0f;
#pragma unroll 16
            for (int m = 0; m < D; m++) s += sK[i * LD + m] * sK[j * LD + m];
            a = sb[i] * expf(sg[i] - sg[j]) * s;
        }
        sA[i * LC + j] = a;
    }
    __syncthreads();
    /* T = (I + A)⁻¹ column by column (forward substitution), four lanes of a warp per column */
    {
        const int j = tid / 4, sub = tid % 4;
        for (int i = 0; i < C; i++) {
            float part = 0.0f;
            for (int m = j + sub; m < i; m += 4) part += sA[i * LC + m] * sT[m * LC + j];
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            if (sub == 0) sT[i * LC + j] = i < j ? 0.0f : (i == j ? 1.0f : -part);
            __syncwarp();
        }
    }
    __syncthreads();
    float *Tout = Tinv + ((size_t)c * Hk + hk) * C * C;
    for (int e = tid; e < C * C; e += blockDim.x) Tout[e] = sT[(e / C) * LC + e % C];
    for (int gq = 0; gq < G; gq++) {
        const int h = hk * G + gq;
        __syncthreads();
        for (int e = tid; e < C * D; e += blockDim.x) {
            const int i = e / D, m = e % D;
            sQ[i * LD + m] = i < n ? qn[((size_t)(t0 + i) * H + h) * D + m] : 0.0f;
        }
        __syncthreads();
        float *Pout = P + ((size_t)c * H + h) * C * C;
        for (int e = tid; e < C * C; e += blockDim.x) {
            const int i = e / C, j = e % C;
            float p = 0.0f;
            if (j <= i && i < n) {
                float s = 0.0f;
#pragma unroll 16
                for (int m = 0; m < D; m++) s += sQ[i * LD + m] * sK[j * LD + m];
                p = expf(sg[i] - sg[j]) * s;
            }
            Pout[e] = p;
        }
    }
}

/* ---- 3. scan ------------------------------------------------------------------------------------------ */

/* Shared floats of the scan kernel: K̂ rows [C][D + 1], the slice of ST [D][SW], R and E [C][SW], g, β and
 * e^{g_C − g_j} [C]. */
constexpr size_t scan_smem_floats(int D) {
    return (size_t)GDN_C * (D + 1) + (size_t)D * GDN_SW + 2 * (size_t)GDN_C * GDN_SW + 3 * GDN_C;
}

/* grid (D / GDN_SW, Hk), GDN_THREADS threads: value columns x0 .. x0 + SW − 1 of KV head hk, chunk after
 * chunk; raw outputs o [T][H][D] (before the norm and gate), ST updated in place. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_scan_kernel(const float *__restrict__ qn, const float *__restrict__ kn, const float *__restrict__ v,
                    const float *__restrict__ beta, const float *__restrict__ gcum, const float *__restrict__ Tinv,
                    const float *__restrict__ P, int T, int H, int Hk, float *__restrict__ ST,
                    float *__restrict__ o) {
    extern __shared__ float sm[];
    constexpr int LD = D + 1, C = GDN_C, SW = GDN_SW;
    float *sK = sm, *sS = sK + C * LD, *sR = sS + D * SW, *sE = sR + C * SW, *sg = sE + C * SW, *sb = sg + C,
          *sw = sb + C;
    const int x0 = blockIdx.x * SW, hk = blockIdx.y, tid = threadIdx.x, G = H / Hk;
    float *st = ST + (size_t)hk * D * D;
    for (int e = tid; e < D * SW; e += blockDim.x) sS[e] = st[(size_t)(e / SW) * D + x0 + e % SW];
    const int n_chunks = (T + C - 1) / C;
    for (int c = 0; c < n_chunks; c++) {
        const int t0 = c * C, n = min(C, T - t0);
        __syncthreads();   /* the previous chunk's readers of sK, sg, sE are done */
        for (int e = tid; e < C * D; e += blockDim.x) {
            const int i = e / D, m = e % D;
            sK[i * LD + m] = i < n ? kn[((size_t)(t0 + i) * Hk + hk) * D + m] : 0.0f;
        }
        if (tid < C) {
            sg[tid] = tid < n ? gcum[(size_t)(t0 + tid) * Hk + hk] : 0.0f;
            sb[tid] = tid < n ? beta[(size_t)(t0 + tid) * Hk + hk] : 0.0f;
        }
        __syncthreads();
        if (tid < C) sw[tid] = tid < n ? expf(sg[n - 1] - sg[tid]) : 0.0f;
        /* R = diag(β) (V − diag(γ) K̂ ST) for the slice */
        for (int e = tid; e < C * SW; e += blockDim.x) {
            const int i = e / SW, x = e % SW;
            float r = 0.0f;
            if (i < n) {
                float s = 0.0f;
#pragma unroll 16
                for (int m = 0; m < D; m++) s += sK[i * LD + m] * sS[m * SW + x];
                r = sb[i] * (v[((size_t)(t0 + i) * Hk + hk) * D + x0 + x] - expf(sg[i]) * s);
            }
            sR[e] = r;
        }
        __syncthreads();
        /* E = T R */
        const float *Tc = Tinv + ((size_t)c * Hk + hk) * C * C;
        for (int e = tid; e < C * SW; e += blockDim.x) {
            const int i = e / SW, x = e % SW;
            float s = 0.0f;
            for (int j = 0; j <= i && j < n; j++) s += Tc[i * C + j] * sR[j * SW + x];
            sE[e] = i < n ? s : 0.0f;
        }
        __syncthreads();
        /* O = diag(γ) Q̂ ST + P E, per query head */
        for (int e = tid; e < G * C * SW; e += blockDim.x) {
            const int gq = e / (C * SW), i = (e / SW) % C, x = e % SW;
            if (i >= n) continue;
            const int h = hk * G + gq;
            const float *qr = qn + ((size_t)(t0 + i) * H + h) * D;
            float s = 0.0f;
#pragma unroll 16
            for (int m = 0; m < D; m++) s += qr[m] * sS[m * SW + x];
            const float *Pr = P + ((size_t)c * H + h) * C * C + (size_t)i * C;
            float pe = 0.0f;
            for (int j = 0; j <= i; j++) pe += Pr[j] * sE[j * SW + x];
            o[((size_t)(t0 + i) * H + h) * D + x0 + x] = expf(sg[i]) * s + pe;
        }
        __syncthreads();
        /* ST ← γ_C ST + K̂ᵀ diag(e^{g_C − g_j}) E */
        const float gc = expf(sg[n - 1]);
        for (int e = tid; e < D * SW; e += blockDim.x) {
            const int m = e / SW, x = e % SW;
            float s = 0.0f;
            for (int j = 0; j < n; j++) s += sK[j * LD + m] * sw[j] * sE[j * SW + x];
            sS[e] = gc * sS[e] + s;
        }
    }
    __syncthreads();
    for (int e = tid; e < D * SW; e += blockDim.x) st[(size_t)(e / SW) * D + x0 + e % SW] = sS[e];
}

/* ---- 4. out ------------------------------------------------------------------------------------------- */

/* A warp per (token, query head) row: y = σ(pre_g + b_g) ⊙ w_n ⊙ o / rms(o) into out_f32 and / or out_bf16. */
template <int D>
__global__ void gdn_out_kernel(const float *__restrict__ o, const float *__restrict__ pre, int ld,
                               const float *__restrict__ params, int T, int H, int Hk, int d,
                               float *__restrict__ out_f32, bf16 *__restrict__ out_bf16) {
    constexpr int PER = D / 32;
    const int lane = threadIdx.x & 31;
    const float *wn = params + gdn_par_wnorm(Hk, d), *bg = params + gdn_par_bg(H, Hk, d, D);
    const int64_t rows = (int64_t)T * H;
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * (blockDim.x / 32)) {
        const int64_t t = row / H;
        const int h = (int)(row % H);
        float v[PER], ss = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) v[j] = o[row * D + lane + 32 * j], ss += v[j] * v[j];
        for (int s = 16; s > 0; s >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, s);
        const float f = gdn_rms_factor(ss, D);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int x = lane + 32 * j;
            const float y = gdn_gate(pre[t * ld + (int64_t)h * D + x] + bg[h * D + x]) * (wn[x] * (v[j] * f));
            if (out_f32) out_f32[row * D + x] = y;
            if (out_bf16) out_bf16[row * D + x] = __float2bfloat16_rn(y);
        }
    }
}

/* Workspace floats of a segment of seg tokens: β, log α, g [seg][Hk]; raw outputs [seg][H][D]; T [chunks][Hk]
 * and P [chunks][H] of C × C. */
size_t ws_floats(int H, int Hk, int D, int seg) {
    const size_t nch = (size_t)(seg + GDN_C - 1) / GDN_C;
    return 3 * (size_t)seg * Hk + (size_t)seg * H * D + nch * (size_t)(Hk + H) * GDN_C * GDN_C;
}

/* The longest segment (a multiple of C, or T itself when shorter) that fits ws_bytes; 0 if none. */
int segment_tokens(int H, int Hk, int D, int T, size_t ws_bytes) {
    if (ws_floats(H, Hk, D, T) * sizeof(float) <= ws_bytes) return T;
    int lo = 0, hi = T / GDN_C;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ws_floats(H, Hk, D, mid * GDN_C) * sizeof(float) <= ws_bytes) lo = mid;
        else hi = mid - 1;
    }
    return lo * GDN_C;
}

}  // namespace

struct stc_gdn {
    stc_ctx *ctx;
    int H, Hk, D, d;
    float *ST;   /* [Hk][D][D] */
    int n_seen;
};

namespace {

template <int D>
int set_smem(still_err *err) {
    STC_CUDA(err, cudaFuncSetAttribute(gdn_chunk_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(chunk_smem_floats(D) * sizeof(float))));
    STC_CUDA(err, cudaFuncSetAttribute(gdn_scan_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(scan_smem_floats(D) * sizeof(float))));
    return STILL_OK;
}

template <int D>
int run_segment(stc_ctx *ctx, stc_gdn *s, const float *params, float *q, float *k, const float *v, const float *pre,
                int ld, int T, float *ws, float *out_f32, bf16 *out_bf16, still_err *err) {
    const int H = s->H, Hk = s->Hk, d = s->d;
    const int n_chunks = (T + GDN_C - 1) / GDN_C;
    float *beta = ws, *lal = beta + (size_t)T * Hk, *gcum = lal + (size_t)T * Hk, *o = gcum + (size_t)T * Hk;
    float *Tinv = o + (size_t)T * H * D, *P = Tinv + (size_t)n_chunks * Hk * GDN_C * GDN_C;
    cudaStream_t st = ctx->stream;
    const int64_t rows = (int64_t)T * (H + Hk);
    gdn_prep_kernel<D><<<stc_blocks(rows, 8), 256, 0, st>>>(q, k, pre, ld, params, T, H, Hk, d, beta, lal);
    STC_LAUNCHED(err, "gdn_prep_kernel");
    gdn_chunk_kernel<D><<<dim3(n_chunks, Hk), GDN_THREADS, chunk_smem_floats(D) * sizeof(float), st>>>(
        q, k, beta, lal, T, H, Hk, gcum, Tinv, P);
    STC_LAUNCHED(err, "gdn_chunk_kernel");
    gdn_scan_kernel<D><<<dim3(D / GDN_SW, Hk), GDN_THREADS, scan_smem_floats(D) * sizeof(float), st>>>(
        q, k, v, beta, gcum, Tinv, P, T, H, Hk, s->ST, o);
    STC_LAUNCHED(err, "gdn_scan_kernel");
    gdn_out_kernel<D><<<stc_blocks((int64_t)T * H, 8), 256, 0, st>>>(o, pre, ld, params, T, H, Hk, d, out_f32,
                                                                      out_bf16);
    STC_LAUNCHED(err, "gdn_out_kernel");
    return STILL_OK;
}

int check_shape(int H, int Hk, int D, int d, still_err *err) {
    if (H <= 0 || Hk <= 0 || H % Hk)
        return stc_fail(err, STILL_E_ARG, "gdn: %d query heads over %d KV heads", H, Hk);
    if (D != 64 && D != 128) return stc_fail(err, STILL_E_UNSUPPORTED, "gdn on the GPU: head dim %d (64 or 128)", D);
    if (H / Hk > GDN_MAX_G)
        return stc_fail(err, STILL_E_UNSUPPORTED, "gdn on the GPU: %d query heads per KV head (at most %d)", H / Hk,
                        (int)GDN_MAX_G);
    if (d <= 0) return stc_fail(err, STILL_E_ARG, "gdn: d_model %d", d);
    return STILL_OK;
}

}  // namespace

size_t stc_gdn_workspace_bytes(int n_head, int n_head_kv, int head_dim, int T_max) {
    if (n_head <= 0 || n_head_kv <= 0 || head_dim <= 0 || T_max <= 0) return 0;
    const int seg = std::min(T_max, (int)STC_GDN_SEGMENT);
    return ws_floats(n_head, n_head_kv, head_dim, seg) * sizeof(float);
}

int stc_gdn_create(stc_ctx *ctx, int n_head, int n_head_kv, int head_dim, int d_model, stc_gdn **out,
                   still_err *err) {
    if (!out) return stc_fail(err, STILL_E_ARG, "stc_gdn_create: NULL output");
    *out = NULL;
    STC_ENTER(ctx, err);
    int rc = check_shape(n_head, n_head_kv, head_dim, d_model, err);
    if (!rc) rc = head_dim == 64 ? set_smem<64>(err) : set_smem<128>(err);
    if (rc) return rc;
    stc_gdn *s = (stc_gdn *)calloc(1, sizeof *s);
    if (!s) return stc_fail(err, STILL_E_NOMEM, "out of host memory");
    s->ctx = ctx, s->H = n_head, s->Hk = n_head_kv, s->D = head_dim, s->d = d_model;
    rc = stc_malloc(ctx, stc_gdn_state_bytes(s), "the gdn state", (void **)&s->ST, err);
    if (!rc) rc = stc_gdn_reset(ctx, s, err);
    if (rc) {
        stc_gdn_free(s);
        return rc;
    }
    *out = s;
    return STILL_OK;
}

void stc_gdn_free(stc_gdn *s) {
    if (!s) return;
    stc_free(s->ctx, s->ST);
    free(s);
}

int stc_gdn_reset(stc_ctx *ctx, stc_gdn *s, still_err *err) {
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_gdn_reset: NULL state");
    int rc = stc_memset(ctx, s->ST, 0, stc_gdn_state_bytes(s), err);
    if (!rc) s->n_seen = 0;
    return rc;
}

size_t stc_gdn_state_bytes(const stc_gdn *s) { return s ? (size_t)s->Hk * s->D * s->D * sizeof(float) : 0; }

int stc_gdn_n_seen(const stc_gdn *s) { return s ? s->n_seen : 0; }

int stc_gdn_state(stc_ctx *ctx, const stc_gdn *s, float *ST_host, still_err *err) {
    if (!s || !ST_host) return stc_fail(err, STILL_E_ARG, "stc_gdn_state: NULL argument");
    return stc_memcpy_d2h(ctx, ST_host, s->ST, stc_gdn_state_bytes(s), err);
}

int stc_gdn_forward(stc_ctx *ctx, stc_gdn *s, const float *params, float *q_nope, float *k_nope, const float *v,
                    const float *pre, int ld_pre, int T, void *ws_dev, size_t ws_bytes, float *out_f32,
                    stc_bf16 *out_bf16, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_gdn_forward: NULL state");
    if (T < 0) return stc_fail(err, STILL_E_ARG, "gdn: negative token count %d", T);
    if (T == 0) return STILL_OK;
    if (!params || !q_nope || !k_nope || !v || !pre || !ws_dev || (!out_f32 && !out_bf16))
        return stc_fail(err, STILL_E_ARG, "stc_gdn_forward: NULL argument");
    if (ld_pre < s->H * s->D + 2 * s->Hk)
        return stc_fail(err, STILL_E_ARG, "gdn: pre-activation rows of %d floats (at least %d)", ld_pre,
                        s->H * s->D + 2 * s->Hk);
    const int H = s->H, Hk = s->Hk, D = s->D;
    const int seg = segment_tokens(H, Hk, D, T, ws_bytes);
    if (seg <= 0)
        return stc_fail(err, STILL_E_ARG, "gdn: a %zu-byte workspace holds no %d-token chunk (%zu bytes needed)",
                        ws_bytes, (int)GDN_C, ws_floats(H, Hk, D, std::min(T, (int)GDN_C)) * sizeof(float));
    const size_t qd = (size_t)H * D, kvd = (size_t)Hk * D;
    bf16 *ob = (bf16 *)out_bf16;
    for (int t0 = 0; t0 < T; t0 += seg) {
        const int n = std::min(seg, T - t0);
        float *of = out_f32 ? out_f32 + (size_t)t0 * qd : NULL;
        bf16 *obs = ob ? ob + (size_t)t0 * qd : NULL;
        const int rc = D == 64 ? run_segment<64>(ctx, s, params, q_nope + t0 * qd, k_nope + t0 * kvd, v + t0 * kvd,
                                                 pre + (size_t)t0 * ld_pre, ld_pre, n, (float *)ws_dev, of, obs, err)
                               : run_segment<128>(ctx, s, params, q_nope + t0 * qd, k_nope + t0 * kvd, v + t0 * kvd,
                                                  pre + (size_t)t0 * ld_pre, ld_pre, n, (float *)ws_dev, of, obs, err);
        if (rc) return rc;
    }
    s->n_seen += T;
    return STILL_OK;
}
