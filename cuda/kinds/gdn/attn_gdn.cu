/* The gdn kind (Gated DeltaNet) on the GPU: the forward, and the backward of stage-1 and stage-2 training
 * (src/kinds/gdn/attn_gdn.c is the CPU's, with the derivation; tests/ref/attn_gdn_ref.c the float64 reference;
 * attn_gdn_rules.h the rules both follow):
 *
 *   S_t = α_t S_{t−1} (I − β_t k̂_t k̂_tᵀ) + β_t v_t k̂_tᵀ,   o_t = S_t q̂_t,   y = σ(W_g x + b_g) ⊙ w_n ⊙ o / rms(o)
 *
 * The state is kept transposed as on the CPU, ST [Hk][D][D] (rows key channels, columns value channels), fp32.
 * Prefill (two tokens or more) is the chunked (WY / UT) form of the CPU's run_chunk, in four kernels of which
 * only the third walks the chunks in order, and it carries the state alone:
 *   1. prep (a warp per (token, head) row): q̂, k̂ in place; β and log α per (token, KV head) from the caller's
 *      pre-activations;
 *   2. chunk (a block per (chunk of 64, KV head), all chunks at once): the cumulative log α g (γ_i = e^{g_i}),
 *      the triangular inverse T = (I + A)⁻¹ with A_ij = β_i e^{g_i − g_j} k̂_i·k̂_j (j < i), then
 *      W = T diag(β γ) K̂ and U = T diag(β) V, and the weights e^{g_C − g_j} and γ_C of the state's update;
 *   3. scan (a block per (KV head, slice of SCAN_SW value columns), chunk after chunk; the next chunk's W, K̂, U
 *      arrive by cp.async while this one computes): keeps ST_c, the state before chunk c, then
 *      E = U − W ST_c and ST ← γ_C ST + K̂ᵀ diag(e^{g_C − g_j}) E. Column x of ST meets only column x of U and
 *      E, so the slices are independent;
 *   4. out (a block per (chunk, query head), all at once): P_ij = e^{g_i − g_j} q̂_i·k̂_j (j <= i), the raw output
 *      O = diag(γ) Q̂ ST_c + P E, then the RMSNorm (norm = 1; none with 0), w_n and the gate of each row.
 * With conv = W > 0 (the spec's optional short convolution), q, k and v first pass a causal depthwise convolution
 * (a thread per token and channel; the last W − 1 inputs kept in the state, as on the CPU).
 * A decode step (one token) is the recurrent form itself, one kernel per (KV head, slice of DEC_SW columns):
 * ST ← α ST, e = β (v − k̂ᵀ ST), ST ← ST + k̂ e, o = q̂ᵀ ST per query head; then the norm and gate (kernel 5).
 * The chunked form of one token is the same sum (T = 1, P = q̂·k̂). No position anywhere, so the step records
 * into the CUDA-graph decode. A call longer than the workspace's segment runs segment after segment. */
#include "common/cuda_common.cuh"
#include "common/mma_ptx.cuh"
#include "kinds/gdn/attn_gdn_rules.h"

#include <algorithm>
#include <math.h>
#include <stdlib.h>

using namespace stc_ptx;

namespace {

enum {
    GDN_C = GDN_CHUNK,   /* tokens per chunk (64) */
    SCAN_SW = 4,         /* value columns of ST per scan block (4: 48 blocks for the model's 3 KV heads) */
    DEC_SW = 16,         /* value columns of ST per decode block */
    WC_LD = GDN_C + 4,   /* a chunk's state-update weights: e^{g_C − g_j} (C of them), γ_C, padding */
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

/* Shared floats of the chunk kernel: K̂ rows [C][D + 1] (padded: no bank conflicts), V rows [C][D], A and T
 * [C][C + 1], g and β [C]. */
constexpr size_t chunk_smem_floats(int D) {
    return (size_t)GDN_C * (D + 1) + (size_t)GDN_C * D + 2 * (size_t)GDN_C * (GDN_C + 1) + 2 * GDN_C;
}

/* grid (chunks, Hk), GDN_THREADS threads. Writes g [T][Hk] (cumulative log α inside each chunk), W and U
 * [T][Hk][D], and wc [chunks][Hk][WC_LD]: e^{g_C − g_j} for j < C (0 past the chunk's end) and γ_C at C. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_chunk_kernel(const float *__restrict__ kn, const float *__restrict__ v, const float *__restrict__ beta,
                     const float *__restrict__ lal, int T, int Hk, float *__restrict__ gcum,
                     float *__restrict__ W, float *__restrict__ U, float *__restrict__ wc) {
    extern __shared__ float sm[];
    constexpr int LD = D + 1, C = GDN_C, LC = GDN_C + 1;
    float *sK = sm, *sV = sK + C * LD, *sA = sV + C * D, *sT = sA + C * LC, *sg = sT + C * LC, *sb = sg + C;
    const int c = blockIdx.x, hk = blockIdx.y, tid = threadIdx.x;
    const int t0 = c * C, n = min(C, T - t0);
    for (int e = tid; e < C * D; e += blockDim.x) {
        const int i = e / D, m = e % D;
        const size_t row = ((size_t)(t0 + i) * Hk + hk) * D + m;
        sK[i * LD + m] = i < n ? kn[row] : 0.0f;
        sV[e] = i < n ? v[row] : 0.0f;
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
    float *wcc = wc + ((size_t)c * Hk + hk) * WC_LD;
    if (tid < C) wcc[tid] = tid < n ? expf(sg[n - 1] - sg[tid]) : 0.0f;
    if (tid == C) wcc[C] = expf(sg[n - 1]);
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
    /* the columns of T scaled: T diag(β) in sA, T diag(β γ) in sT (T is lower triangular) */
    for (int e = tid; e < C * C; e += blockDim.x) {
        const int i = e / C, j = e % C;
        const float t = sT[i * LC + j] * sb[j];
        sA[i * LC + j] = t;
        sT[i * LC + j] = t * expf(sg[j]);
    }
    __syncthreads();
    for (int e = tid; e < n * D; e += blockDim.x) {
        const int i = e / D, m = e % D;
        float w = 0.0f, u = 0.0f;
        for (int l = 0; l <= i; l++) w += sT[i * LC + l] * sK[l * LD + m], u += sA[i * LC + l] * sV[l * D + m];
        const size_t row = ((size_t)(t0 + i) * Hk + hk) * D + m;
        W[row] = w, U[row] = u;
    }
}

/* ---- 3. scan ------------------------------------------------------------------------------------------ */

/* Shared floats of the scan kernel: two buffers of W and K̂ rows [C][D + 4] (16-byte rows for cp.async, the
 * padding against bank conflicts), U's slice [C][SW] and the chunk's weights [WC_LD]; the slice of ST [D][SW]
 * and the weighted E [C][SW]. */
__host__ __device__ constexpr int scan_ld(int D) { return D + 4; }
__host__ __device__ constexpr size_t scan_buf_floats(int D) {
    return 2 * (size_t)GDN_C * scan_ld(D) + (size_t)GDN_C * SCAN_SW + WC_LD;
}
constexpr size_t scan_smem_floats(int D) {
    return 2 * scan_buf_floats(D) + (size_t)D * SCAN_SW + (size_t)GDN_C * SCAN_SW;
}

__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* Chunk c's W and K̂ rows, U's slice and weights into buf by cp.async (rows past T zero-filled). */
template <int D>
__device__ __forceinline__ void scan_load(float *buf, const float *__restrict__ W, const float *__restrict__ kn,
                                          const float *__restrict__ U, const float *__restrict__ wc, int c, int T,
                                          int Hk, int hk, int x0) {
    constexpr int LDS = scan_ld(D), C = GDN_C, SW = SCAN_SW, Q = D / 4;
    float *bW = buf, *bK = bW + C * LDS, *bU = bK + C * LDS, *bw = bU + C * SW;
    const int t0 = c * C;
    for (int e = threadIdx.x; e < 2 * C * Q; e += blockDim.x) {
        const int which = e / (C * Q), i = (e / Q) % C, p = e % Q;
        const bool ok = t0 + i < T;
        const size_t row = ((size_t)(ok ? t0 + i : 0) * Hk + hk) * D + 4 * p;
        cp_async_16(smem_addr((which ? bK : bW) + i * LDS + 4 * p), (which ? kn : W) + row, ok);
    }
    for (int e = threadIdx.x; e < C * (SW / 4); e += blockDim.x) {
        const int i = e / (SW / 4), p = e % (SW / 4);
        const bool ok = t0 + i < T;
        cp_async_16(smem_addr(bU + i * SW + 4 * p), U + ((size_t)(ok ? t0 + i : 0) * Hk + hk) * D + x0 + 4 * p, ok);
    }
    for (int e = threadIdx.x; e < WC_LD / 4; e += blockDim.x)
        cp_async_16(smem_addr(bw + 4 * e), wc + ((size_t)c * Hk + hk) * WC_LD + 4 * e, true);
}

/* grid (D / SCAN_SW, Hk), GDN_THREADS threads: value columns x0 .. x0 + SW − 1 of KV head hk, chunk after
 * chunk. Writes STc [chunks][Hk][D][D] (the state before each chunk), E [T][Hk][D]; ST updated in place. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_scan_kernel(const float *__restrict__ kn, const float *__restrict__ W, const float *__restrict__ U,
                    const float *__restrict__ wc, int T, int Hk, float *__restrict__ ST, float *__restrict__ STc,
                    float *__restrict__ E) {
    extern __shared__ __align__(16) float smq[];
    constexpr int LDS = scan_ld(D), C = GDN_C, SW = SCAN_SW, BUF = (int)scan_buf_floats(D);
    constexpr int ROWS = C * SW / GDN_THREADS, MROWS = D * SW / GDN_THREADS;   /* per thread */
    static_assert(GDN_THREADS % SW == 0 && ROWS >= 1 && MROWS >= 1, "scan tiling");
    float *sS = smq + 2 * BUF, *sE = sS + D * SW;
    const int x0 = blockIdx.x * SW, hk = blockIdx.y, tid = threadIdx.x, x = tid % SW, r0 = tid / SW;
    constexpr int RSTEP = GDN_THREADS / SW;
    float *st = ST + (size_t)hk * D * D;
    for (int e = tid; e < D * SW; e += blockDim.x) sS[e] = st[(size_t)(e / SW) * D + x0 + e % SW];
    const int n_chunks = (T + C - 1) / C;
    scan_load<D>(smq, W, kn, U, wc, 0, T, Hk, hk, x0);
    cp_async_commit();
    for (int c = 0; c < n_chunks; c++) {
        const float *buf = smq + (c & 1) * BUF;
        if (c + 1 < n_chunks) {
            scan_load<D>(smq + ((c + 1) & 1) * BUF, W, kn, U, wc, c + 1, T, Hk, hk, x0);
            cp_async_commit();
            cp_async_wait_one();
        } else {
            cp_async_wait_all();
        }
        __syncthreads();   /* chunk c's rows and the previous chunk's state are visible to every thread */
        const float *bW = buf, *bK = bW + C * LDS, *bU = bK + C * LDS, *bw = bU + C * SW;
        float *stc = STc + ((size_t)c * Hk + hk) * D * D;
        for (int e = tid; e < D * SW; e += blockDim.x) stc[(size_t)(e / SW) * D + x0 + e % SW] = sS[e];
        /* E = U − W ST for the slice; sE keeps e^{g_C − g_i} E_i */
        const int t0 = c * C;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const int i = r0 + r * RSTEP;
            float s = 0.0f;
#pragma unroll 16
            for (int m = 0; m < D; m++) s += bW[i * LDS + m] * sS[m * SW + x];
            const float e = bU[i * SW + x] - s;
            if (t0 + i < T) E[((size_t)(t0 + i) * Hk + hk) * D + x0 + x] = e;
            sE[i * SW + x] = bw[i] * e;
        }
        __syncthreads();
        /* ST ← γ_C ST + K̂ᵀ (weighted E) */
        const float gc = bw[C];
#pragma unroll
        for (int r = 0; r < MROWS; r++) {
            const int m = r0 + r * RSTEP;
            float s = 0.0f;
#pragma unroll 16
            for (int j = 0; j < C; j++) s += bK[j * LDS + m] * sE[j * SW + x];
            sS[m * SW + x] = gc * sS[m * SW + x] + s;
        }
        __syncthreads();   /* every reader of this buffer is done before the next loads land in it */
    }
    for (int e = tid; e < D * SW; e += blockDim.x) st[(size_t)(e / SW) * D + x0 + e % SW] = sS[e];
}

/* ---- 4. out (prefill) --------------------------------------------------------------------------------- */

/* One step of a 4 × N register tile: acc[r][c] += a[r · lda] · b[c · ldb] (shared-memory operands). */
template <int N>
__device__ __forceinline__ void tile_step(float (&acc)[4][N], const float *a, int lda, const float *b, int ldb) {
    float x[4], y[N];
#pragma unroll
    for (int r = 0; r < 4; r++) x[r] = a[r * lda];
#pragma unroll
    for (int c = 0; c < N; c++) y[c] = b[c * ldb];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int c = 0; c < N; c++) acc[r][c] += x[r] * y[c];
}

/* Shared floats of the out kernel: Q̂ and K̂ rows [C][D + 1], P [C][C + 1], ST_c [D][D], E [C][D], g [C]. */
constexpr size_t out_smem_floats(int D) {
    return 2 * (size_t)GDN_C * (D + 1) + (size_t)GDN_C * (GDN_C + 1) + (size_t)D * D + (size_t)GDN_C * D + GDN_C;
}

/* grid (chunks, H), GDN_THREADS threads. Each thread computes 4 rows × D/16 columns of O (and 4 × 4 of P);
 * the rows' norm and gate follow, a warp a row. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_out_chunk_kernel(const float *__restrict__ qn, const float *__restrict__ kn, const float *__restrict__ gcum,
                         const float *__restrict__ STc, const float *__restrict__ E, const float *__restrict__ pre,
                         int ld, const float *__restrict__ params, int T, int H, int Hk, int d, int norm,
                         float *__restrict__ out_f32, bf16 *__restrict__ out_bf16, float *__restrict__ o_raw) {
    extern __shared__ float sm[];
    constexpr int LD = D + 1, C = GDN_C, LC = GDN_C + 1, RX = D / 16;
    static_assert(GDN_THREADS == (GDN_C / 4) * 16, "out tiling");
    float *sQ = sm, *sK = sQ + C * LD, *sP = sK + C * LD, *sS = sP + C * LC, *sE = sS + D * D, *sg = sE + C * D;
    const int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, G = H / Hk, hk = h / G;
    const int t0 = c * C, n = min(C, T - t0);
    for (int e = tid; e < C * D; e += blockDim.x) {
        const int i = e / D, m = e % D;
        const bool ok = i < n;
        sQ[i * LD + m] = ok ? qn[((size_t)(t0 + i) * H + h) * D + m] : 0.0f;
        sK[i * LD + m] = ok ? kn[((size_t)(t0 + i) * Hk + hk) * D + m] : 0.0f;
        sE[e] = ok ? E[((size_t)(t0 + i) * Hk + hk) * D + m] : 0.0f;
    }
    const float *stc = STc + ((size_t)c * Hk + hk) * D * D;
    for (int e = tid; e < D * D; e += blockDim.x) sS[e] = stc[e];
    if (tid < C) sg[tid] = tid < n ? gcum[(size_t)(t0 + tid) * Hk + hk] : 0.0f;
    __syncthreads();
    const int i0 = (tid / 16) * 4, xq = tid % 16;
    /* P, 4 × 4 a thread: rows i0 .. i0 + 3, columns xq + 16 cc */
    {
        float acc[4][4] = {};
#pragma unroll 8
        for (int m = 0; m < D; m++) tile_step<4>(acc, sQ + i0 * LD + m, LD, sK + xq * LD + m, 16 * LD);
#pragma unroll
        for (int r = 0; r < 4; r++)
#pragma unroll
            for (int cc = 0; cc < 4; cc++) {
                const int i = i0 + r, j = xq + 16 * cc;
                sP[i * LC + j] = j <= i && i < n ? expf(sg[i] - sg[j]) * acc[r][cc] : 0.0f;
            }
    }
    __syncthreads();
    /* O = diag(γ) Q̂ ST_c + P E, 4 rows × RX columns a thread */
    float acc[4][RX] = {}, pe[4][RX] = {};
#pragma unroll 4
    for (int m = 0; m < D; m++) tile_step<RX>(acc, sQ + i0 * LD + m, LD, sS + m * D + xq, 16);
    for (int j = 0; j <= i0 + 3; j++) tile_step<RX>(pe, sP + i0 * LC + j, LC, sE + j * D + xq, 16);
    __syncthreads();   /* every reader of sQ is done: it takes O */
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float gi = expf(sg[i0 + r]);
#pragma unroll
        for (int cc = 0; cc < RX; cc++) sQ[(i0 + r) * LD + xq + 16 * cc] = gi * acc[r][cc] + pe[r][cc];
    }
    __syncthreads();
    constexpr int PER = D / 32;
    const int lane = tid & 31;
    const float *wn = params + gdn_par_wnorm(Hk, d), *bg = params + gdn_par_bg(H, Hk, d, D);
    for (int i = tid / 32; i < n; i += GDN_THREADS / 32) {
        float vv[PER], ss = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) vv[j] = sQ[i * LD + lane + 32 * j], ss += vv[j] * vv[j];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float f = gdn_out_factor(norm, ss, D);
        const size_t t = (size_t)(t0 + i), row = t * H + h;
        if (o_raw)
#pragma unroll
            for (int j = 0; j < PER; j++) o_raw[row * D + lane + 32 * j] = vv[j];
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int xx = lane + 32 * j;
            const float y = gdn_gate(pre[t * ld + (size_t)h * D + xx] + bg[h * D + xx]) * (wn[xx] * (vv[j] * f));
            if (out_f32) out_f32[row * D + xx] = y;
            if (out_bf16) out_bf16[row * D + xx] = __float2bfloat16_rn(y);
        }
    }
}

/* ---- decode: one token, the recurrent form ------------------------------------------------------------ */

/* grid (D / DEC_SW, Hk), GDN_THREADS threads: thread (x = tid % DEC_SW, mg = tid / DEC_SW) holds rows
 * mg + 16 r of the slice's columns. Every block normalises k̂ and its G q̂ rows for itself (q and k are left as
 * they are: a block writing them back would race with the others' reads); o [H][D] the raw outputs. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_decode_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                      const float *__restrict__ pre, const float *__restrict__ params, int H, int Hk, int d,
                      float *__restrict__ ST, float *__restrict__ o) {
    constexpr int SW = DEC_SW, MG = GDN_THREADS / DEC_SW, R = D / MG, PER = D / 32;
    static_assert(MG * R == D, "decode tiling");
    __shared__ float sk[D], sq[GDN_MAX_G][D], red[MG][SW], ored[GDN_MAX_G][MG][SW];
    __shared__ float sab[2];
    const int x0 = blockIdx.x * SW, hk = blockIdx.y, tid = threadIdx.x, G = H / Hk, lane = tid & 31;
    const int x = tid % SW, mg = tid / SW;
    for (int rr = tid / 32; rr < 1 + G; rr += GDN_THREADS / 32) {   /* row 0: k; rows 1 ..: the q heads */
        const float *src = rr == 0 ? k + (size_t)hk * D : q + (size_t)(hk * G + rr - 1) * D;
        float vv[PER], nn = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) vv[j] = src[lane + 32 * j], nn += vv[j] * vv[j];
        for (int s = 16; s > 0; s >>= 1) nn += __shfl_xor_sync(0xffffffffu, nn, s);
        const float f = gdn_l2_factor(nn);
        float *dst = rr == 0 ? sk : sq[rr - 1];
#pragma unroll
        for (int j = 0; j < PER; j++) dst[lane + 32 * j] = vv[j] * f;
    }
    if (tid == 0) {
        const float *p = pre + (size_t)H * D;
        sab[0] = gdn_beta(p[hk] + params[gdn_par_bbeta(Hk, d) + hk]);
        sab[1] = expf(gdn_log_alpha(p[Hk + hk] + params[gdn_par_balpha(Hk, d) + hk],
                                    params[gdn_par_alog(Hk, d) + hk]));
    }
    float *st = ST + (size_t)hk * D * D;
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = st[(size_t)(mg + MG * r) * D + x0 + x];
    __syncthreads();
    const float beta = sab[0], alpha = sab[1];
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) s[r] *= alpha, part += sk[mg + MG * r] * s[r];
    red[mg][x] = part;
    __syncthreads();
    float ks = 0.0f;
#pragma unroll
    for (int g = 0; g < MG; g++) ks += red[g][x];
    const float e = beta * (v[(size_t)hk * D + x0 + x] - ks);
#pragma unroll
    for (int r = 0; r < R; r++) {
        s[r] += sk[mg + MG * r] * e;
        st[(size_t)(mg + MG * r) * D + x0 + x] = s[r];
    }
    for (int g = 0; g < G; g++) {
        float po = 0.0f;
#pragma unroll
        for (int r = 0; r < R; r++) po += sq[g][mg + MG * r] * s[r];
        ored[g][mg][x] = po;
    }
    __syncthreads();
    for (int e2 = tid; e2 < G * SW; e2 += GDN_THREADS) {
        const int g = e2 / SW, xx = e2 % SW;
        float sum = 0.0f;
#pragma unroll
        for (int m = 0; m < MG; m++) sum += ored[g][m][xx];
        o[(size_t)(hk * G + g) * D + x0 + xx] = sum;
    }
}

/* ---- 5. out (decode) ---------------------------------------------------------------------------------- */

/* A warp per (token, query head) row: y = σ(pre_g + b_g) ⊙ w_n ⊙ o / rms(o) (without the norm: ⊙ o) into out_f32
 * and / or out_bf16. */
template <int D>
__global__ void gdn_out_kernel(const float *__restrict__ o, const float *__restrict__ pre, int ld,
                               const float *__restrict__ params, int T, int H, int Hk, int d, int norm,
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
        const float f = gdn_out_factor(norm, ss, D);
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int x = lane + 32 * j;
            const float y = gdn_gate(pre[t * ld + (int64_t)h * D + x] + bg[h * D + x]) * (wn[x] * (v[j] * f));
            if (out_f32) out_f32[row * D + x] = y;
            if (out_bf16) out_bf16[row * D + x] = __float2bfloat16_rn(y);
        }
    }
}

/* ---- the short convolution (conv = W > 0) ------------------------------------------------------------- */

/* Channel ch of q | k | v (HD, KD, KD channels): which of the three (0, 1, 2), its offset in a row and the row's
 * length. */
__device__ __forceinline__ int conv_channel(int ch, int HD, int KD, int *off, int *ld) {
    const int which = ch < HD ? 0 : ch < HD + KD ? 1 : 2;
    *off = which == 0 ? ch : which == 1 ? ch - HD : ch - HD - KD, *ld = which == 0 ? HD : KD;
    return which;
}

/* A thread per (token, channel of q | k | v): x'_t = Σ_j w[ch][j] x_{t−W+1+j}, earlier tokens of the call from the
 * inputs, those before it from hist [W − 1][channels] (the last W − 1 inputs of the calls before; zero at the
 * start), as src/kinds/gdn/attn_gdn.c's conv_forward. */
__global__ void gdn_conv_kernel(const float *__restrict__ q, const float *__restrict__ k, const float *__restrict__ v,
                                int T, int HD, int KD, int W, const float *__restrict__ w,
                                const float *__restrict__ hist, float *__restrict__ qc, float *__restrict__ kc,
                                float *__restrict__ vc) {
    const int nch = HD + 2 * KD;
    const int64_t n = (int64_t)T * nch;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(e / nch), ch = (int)(e % nch);
        int off, ld;
        const int which = conv_channel(ch, HD, KD, &off, &ld);
        const float *src = which == 0 ? q : which == 1 ? k : v;
        float acc = 0.0f;
        for (int j = 0; j < W; j++) {
            const int tau = t - W + 1 + j;
            const float xin = tau >= 0 ? src[(size_t)tau * ld + off] : hist[(size_t)(W - 1 + tau) * nch + ch];
            acc += w[(size_t)ch * W + j] * xin;
        }
        (which == 0 ? qc : which == 1 ? kc : vc)[(size_t)t * ld + off] = acc;
    }
}

/* After the call (a thread per channel): hist keeps the last W − 1 inputs, older rows from itself when T < W − 1. */
__global__ void gdn_conv_keep_kernel(const float *__restrict__ q, const float *__restrict__ k,
                                     const float *__restrict__ v, int T, int HD, int KD, int W, float *__restrict__ hist) {
    const int nch = HD + 2 * KD, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= nch) return;
    int off, ld;
    const int which = conv_channel(ch, HD, KD, &off, &ld);
    const float *src = which == 0 ? q : which == 1 ? k : v;
    for (int r = 0; r < W - 1; r++) {   /* row r: token T − (W − 1) + r of the call; rows move down in place */
        const int tau = T - (W - 1) + r;
        hist[(size_t)r * nch + ch] = tau >= 0 ? src[(size_t)tau * ld + off] : hist[(size_t)(r + T) * nch + ch];
    }
}

/* ---- the workspace ------------------------------------------------------------------------------------ */

/* Floats rounded up to 64 (256 bytes: every array 16-byte aligned for cp.async). */
constexpr size_t al64(size_t n) { return (n + 63) / 64 * 64; }

/* The workspace of a segment of seg tokens, in floats from its start. */
struct ws_layout {
    size_t beta, lal, gcum, W, U, E, wc, STc, odec, qc, kc, vc, total;
};
ws_layout layout(int H, int Hk, int D, int seg) {
    const size_t nch = (size_t)(seg + GDN_C - 1) / GDN_C, th = (size_t)seg * Hk;
    ws_layout l;
    l.beta = 0;
    l.lal = l.beta + al64(th);
    l.gcum = l.lal + al64(th);
    l.W = l.gcum + al64(th);
    l.U = l.W + al64(th * D);
    l.E = l.U + al64(th * D);
    l.wc = l.E + al64(th * D);
    l.STc = l.wc + al64(nch * Hk * WC_LD);
    l.odec = l.STc + al64(nch * Hk * D * D);
    l.qc = l.odec + al64((size_t)H * D);   /* the convolution's outputs (conv > 0) */
    l.kc = l.qc + al64((size_t)seg * H * D);
    l.vc = l.kc + al64(th * D);
    l.total = l.vc + al64(th * D);
    return l;
}
size_t ws_floats(int H, int Hk, int D, int seg) { return layout(H, Hk, D, seg).total; }

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
    int norm;    /* the outputs' RMSNorm (1) or none (0) */
    int conv;    /* the short convolution's width W (0: none) */
    float *ST;   /* [Hk][D][D] */
    float *hist; /* conv > 1: the last W − 1 inputs of q | k | v [W − 1][(H + 2 Hk) D] */
    void *tws;   /* stage-1 training's workspace (stc_gdn_distill), grown on first use */
    size_t tws_bytes;
    int n_seen;
};

namespace {

template <int D>
int set_smem(still_err *err) {
    STC_CUDA(err, cudaFuncSetAttribute(gdn_chunk_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(chunk_smem_floats(D) * sizeof(float))));
    STC_CUDA(err, cudaFuncSetAttribute(gdn_scan_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(scan_smem_floats(D) * sizeof(float))));
    STC_CUDA(err, cudaFuncSetAttribute(gdn_out_chunk_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)(out_smem_floats(D) * sizeof(float))));
    return STILL_OK;
}

/* o_raw (optional, [T][H][D]): the raw outputs too, before the norm and gate (stage-1 training's backward). */
template <int D>
int run_segment(stc_ctx *ctx, stc_gdn *s, const float *params, float *q, float *k, const float *v, const float *pre,
                int ld, int T, float *ws, float *out_f32, bf16 *out_bf16, float *o_raw, still_err *err) {
    const int H = s->H, Hk = s->Hk, d = s->d;
    const ws_layout l = layout(H, Hk, D, T);
    cudaStream_t st = ctx->stream;
    if (s->conv > 0) {   /* the short convolution first; the core then reads its outputs */
        const int HD = H * D, KD = Hk * D;
        float *qc = ws + l.qc, *kc = ws + l.kc, *vc = ws + l.vc;
        gdn_conv_kernel<<<stc_blocks((int64_t)T * (HD + 2 * KD), 256), 256, 0, st>>>(
            q, k, v, T, HD, KD, s->conv, params + gdn_par_conv(H, Hk, d, D), s->hist, qc, kc, vc);
        STC_LAUNCHED(err, "gdn_conv_kernel");
        if (s->conv > 1) {
            gdn_conv_keep_kernel<<<(HD + 2 * KD + 255) / 256, 256, 0, st>>>(q, k, v, T, HD, KD, s->conv, s->hist);
            STC_LAUNCHED(err, "gdn_conv_keep_kernel");
        }
        q = qc, k = kc, v = vc;
    }
    if (T == 1) {   /* decode: the recurrent form */
        gdn_decode_kernel<D><<<dim3(D / DEC_SW, Hk), GDN_THREADS, 0, st>>>(q, k, v, pre, params, H, Hk, d, s->ST,
                                                                           ws + l.odec);
        STC_LAUNCHED(err, "gdn_decode_kernel");
        gdn_out_kernel<D><<<stc_blocks(H, 8), 256, 0, st>>>(ws + l.odec, pre, ld, params, 1, H, Hk, d, s->norm,
                                                            out_f32, out_bf16);
        STC_LAUNCHED(err, "gdn_out_kernel");
        return o_raw ? stc_memcpy_d2d(ctx, o_raw, ws + l.odec, sizeof(float) * (size_t)H * D, err) : STILL_OK;
    }
    const int n_chunks = (T + GDN_C - 1) / GDN_C;
    float *beta = ws + l.beta, *lal = ws + l.lal, *gcum = ws + l.gcum, *W = ws + l.W, *U = ws + l.U, *E = ws + l.E;
    float *wc = ws + l.wc, *STc = ws + l.STc;
    const int64_t rows = (int64_t)T * (H + Hk);
    gdn_prep_kernel<D><<<stc_blocks(rows, 8), 256, 0, st>>>(q, k, pre, ld, params, T, H, Hk, d, beta, lal);
    STC_LAUNCHED(err, "gdn_prep_kernel");
    gdn_chunk_kernel<D><<<dim3(n_chunks, Hk), GDN_THREADS, chunk_smem_floats(D) * sizeof(float), st>>>(
        k, v, beta, lal, T, Hk, gcum, W, U, wc);
    STC_LAUNCHED(err, "gdn_chunk_kernel");
    gdn_scan_kernel<D><<<dim3(D / SCAN_SW, Hk), GDN_THREADS, scan_smem_floats(D) * sizeof(float), st>>>(
        k, W, U, wc, T, Hk, s->ST, STc, E);
    STC_LAUNCHED(err, "gdn_scan_kernel");
    gdn_out_chunk_kernel<D><<<dim3(n_chunks, H), GDN_THREADS, out_smem_floats(D) * sizeof(float), st>>>(
        q, k, gcum, STc, E, pre, ld, params, T, H, Hk, d, s->norm, out_f32, out_bf16, o_raw);
    STC_LAUNCHED(err, "gdn_out_chunk_kernel");
    return STILL_OK;
}

size_t st_bytes(const stc_gdn *s) { return (size_t)s->Hk * s->D * s->D * sizeof(float); }
size_t hist_bytes(const stc_gdn *s) {
    return (size_t)(s->conv - 1) * (size_t)(s->H + 2 * s->Hk) * s->D * sizeof(float);
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

int stc_gdn_create(stc_ctx *ctx, int n_head, int n_head_kv, int head_dim, int d_model, int norm, int conv,
                   stc_gdn **out, still_err *err) {
    if (!out) return stc_fail(err, STILL_E_ARG, "stc_gdn_create: NULL output");
    *out = NULL;
    STC_ENTER(ctx, err);
    if (conv < 0 || conv > GDN_CONV_MAX)
        return stc_fail(err, STILL_E_ARG, "gdn: conv %d (0 for none, else 1..%d)", conv, GDN_CONV_MAX);
    int rc = check_shape(n_head, n_head_kv, head_dim, d_model, err);
    if (!rc) rc = head_dim == 64 ? set_smem<64>(err) : set_smem<128>(err);
    if (rc) return rc;
    stc_gdn *s = (stc_gdn *)calloc(1, sizeof *s);
    if (!s) return stc_fail(err, STILL_E_NOMEM, "out of host memory");
    s->ctx = ctx, s->H = n_head, s->Hk = n_head_kv, s->D = head_dim, s->d = d_model, s->norm = norm != 0;
    s->conv = conv;
    rc = stc_malloc(ctx, st_bytes(s), "the gdn state", (void **)&s->ST, err);
    if (!rc && conv > 1) rc = stc_malloc(ctx, hist_bytes(s), "the gdn convolution's history", (void **)&s->hist, err);
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
    stc_free(s->ctx, s->hist);
    stc_free(s->ctx, s->tws);
    free(s);
}

int stc_gdn_reset(stc_ctx *ctx, stc_gdn *s, still_err *err) {
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_gdn_reset: NULL state");
    int rc = stc_memset(ctx, s->ST, 0, st_bytes(s), err);
    if (!rc && s->hist) rc = stc_memset(ctx, s->hist, 0, hist_bytes(s), err);
    if (!rc) s->n_seen = 0;
    return rc;
}

size_t stc_gdn_state_bytes(const stc_gdn *s) { return s ? st_bytes(s) + (s->hist ? hist_bytes(s) : 0) : 0; }

int stc_gdn_n_seen(const stc_gdn *s) { return s ? s->n_seen : 0; }

int stc_gdn_regions(stc_gdn *s, stc_region *out, int max) {
    if (!s) return 0;
    const int n = s->hist ? 2 : 1;
    if (max < n) return -1;
    out[0] = stc_region{s->ST, st_bytes(s)};
    if (s->hist) out[1] = stc_region{s->hist, hist_bytes(s)};
    return n;
}

void stc_gdn_set_n_seen(stc_gdn *s, int n) {
    if (s) s->n_seen = n;
}

int stc_gdn_state(stc_ctx *ctx, const stc_gdn *s, float *ST_host, still_err *err) {
    if (!s || !ST_host) return stc_fail(err, STILL_E_ARG, "stc_gdn_state: NULL argument");
    return stc_memcpy_d2h(ctx, ST_host, s->ST, st_bytes(s), err);
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
                                                 pre + (size_t)t0 * ld_pre, ld_pre, n, (float *)ws_dev, of, obs, NULL, err)
                               : run_segment<128>(ctx, s, params, q_nope + t0 * qd, k_nope + t0 * kvd, v + t0 * kvd,
                                                  pre + (size_t)t0 * ld_pre, ld_pre, n, (float *)ws_dev, of, obs, NULL, err);
        if (rc) return rc;
    }
    s->n_seen += T;
    return STILL_OK;
}

/* ---- stage-1 training: the parameters' gradient ------------------------------------------------------------
 *
 * The CPU's gdn_backward_core (src/kinds/gdn/attn_gdn.c) for the parameters alone (q, k, v are the teacher's,
 * fixed): the output side per (token, head) row (the gate, w_n, the norm; do), then the recurrence in reverse per
 * (KV head, slice of BW_SW value columns), chunk after chunk from the last: the chunk's states S_{t−1} recomputed
 * token by token from the forward's ST_c into a scratch, then per token, in ST layout [key m][value x],
 *   dST += Σ_h q̂_h do_hᵀ,  r = S_{t−1}ᵀ k̂,  dSk = dSTᵀ k̂,
 *   dα = ⟨dST, S_{t−1}⟩ − β dSk·r,  dβ = dSk·(v − α r),  dST ← α (dST − β k̂ dSkᵀ),
 * with dα and dβ summed over the slices by a last kernel, which also forms the gates' pre-activation gradients;
 * the weights' gradients are fp32 products with the layer input.
 * With the short convolution (conv = W > 0) its weights train too, which needs the core's inputs' gradients: the
 * reverse recurrence also forms, per token, with e = β (v − α r) and S_t = α S_{t−1} + k̂ eᵀ,
 *   dq̂_h = S_t do_h,  dk̂ = dST e − α β S_{t−1} dSk,  dv = β dSk
 * (the first two summed over the value columns: 8 lanes, then the slices by atomics), then the L2 norms' backward
 * (the convolved rows recomputed) and w_c's gradient, Σ_t dx'_t[ch] x_{t−W+1+j}[ch]. */

namespace {

enum { BW_SW = 8 };   /* value columns per block of the reverse recurrence */
enum { CONV_TS = 256 };   /* tokens per block of w_c's gradient */

/* The distill workspace, in floats from its start. */
struct tws_layout {
    size_t qn, kn, qr, kr, pre, y, o, dO, dg, dpre, dab, scr, dq, dk, dv, dqp, dkp, wnp, cwp, fws, total;
};
enum { OUT_BLOCKS_MAX = 1024 };   /* blocks of gdn_bwd_out_kernel at most */
tws_layout tlayout(int H, int Hk, int D, int T) {
    const size_t th = (size_t)T * H * D, tk = (size_t)T * Hk * D, ld = (size_t)H * D + 2 * Hk, nsl = D / BW_SW;
    tws_layout l;
    l.qn = 0;
    l.kn = l.qn + al64(th);
    l.qr = l.kn + al64(tk);   /* the raw q and k before RoPE, kept for the inputs' gradients (no convolution) */
    l.kr = l.qr + al64(th);
    l.pre = l.kr + al64(tk);
    l.y = l.pre + al64((size_t)T * ld);
    l.o = l.y + al64(th);
    l.dO = l.o + al64(th);
    l.dg = l.dO + al64(th);
    l.dpre = l.dg + al64(th);
    l.dab = l.dpre + al64((size_t)T * 2 * Hk);
    l.scr = l.dab + al64(nsl * (size_t)T * Hk * 2);
    l.dq = l.scr + al64(nsl * (size_t)Hk * GDN_C * D * BW_SW);   /* the core's (and norms') inputs' gradients */
    l.dk = l.dq + al64(th);
    l.dv = l.dk + al64(tk);
    l.dqp = l.dv + al64(tk);   /* the slices' shares of dq̂ and dk̂ [slices][...], w_n's per block, w_c's per slice */
    l.dkp = l.dqp + al64(nsl * th);
    l.wnp = l.dkp + al64(nsl * tk);
    l.cwp = l.wnp + al64((size_t)OUT_BLOCKS_MAX * D);
    l.fws = l.cwp + al64((size_t)((T + CONV_TS - 1) / CONV_TS) * (H + 2 * Hk) * D * GDN_CONV_MAX);
    l.total = l.fws + ws_floats(H, Hk, D, T);
    return l;
}

/* The output side, a warp per (token, head) row. Stage 1 (dyin NULL): adds Σ (y − target)² / n to *mse and the
 * output's gradient is f2 (y − target); stage 2: it is dyin. With want_d, dO [T][H][D] (the raw outputs' gradient)
 * and dg [T][H·D] (the gate's pre-activations'); with wnp, the block's share of w_n's gradient into wnp [block][D]. */
template <int D>
__global__ void gdn_bwd_out_kernel(const float *__restrict__ y, const float *__restrict__ target,
                                   const float *__restrict__ dyin, const float *__restrict__ o,
                                   const float *__restrict__ pre, int ld, const float *__restrict__ params, int T,
                                   int H, int Hk, int d, int norm, float f2, double inv_n, int want_d,
                                   float *__restrict__ dO, float *__restrict__ dg, float *__restrict__ wnp,
                                   double *__restrict__ mse) {
    constexpr int PER = D / 32;
    __shared__ float swn[GDN_THREADS / 32][D];
    __shared__ double smse[GDN_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const float *wn = params + gdn_par_wnorm(Hk, d), *bg = params + gdn_par_bg(H, Hk, d, D);
    float acc[PER] = {};
    double ms = 0;
    const int64_t rows = (int64_t)T * H;
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + warp; row < rows;
         row += (int64_t)gridDim.x * (blockDim.x / 32)) {
        const int64_t t = row / H;
        const int h = (int)(row % H);
        float ov[PER], dy[PER], ss = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int64_t i = row * D + lane + 32 * j;
            if (dyin) {
                dy[j] = dyin[i];
            } else {
                const float df = y[i] - target[i];
                ms += (double)df * df, dy[j] = f2 * df;
            }
            ov[j] = o[i], ss += ov[j] * ov[j];
        }
        if (!want_d) continue;
        for (int s = 16; s > 0; s >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, s);
        const float f = gdn_out_factor(norm, ss, D);
        float dn[PER], odn = 0;
#pragma unroll
        for (int j = 0; j < PER; j++) {
            const int x = lane + 32 * j;
            const float g = gdn_gate(pre[t * ld + (int64_t)h * D + x] + bg[h * D + x]), nrm = ov[j] * f;
            dn[j] = dy[j] * g * wn[x];
            acc[j] += dy[j] * g * nrm;
            dg[row * D + x] = dy[j] * wn[x] * nrm * g * (1.0f - g);
            odn += ov[j] * dn[j];
        }
        for (int s = 16; s > 0; s >>= 1) odn += __shfl_xor_sync(0xffffffffu, odn, s);
        const float f3 = norm ? f * f * f * odn / (float)D : 0.0f;
#pragma unroll
        for (int j = 0; j < PER; j++) dO[row * D + lane + 32 * j] = f * dn[j] - f3 * ov[j];
    }
    if (mse) {
        for (int s = 16; s > 0; s >>= 1) ms += __shfl_xor_sync(0xffffffffu, ms, s);
        if (lane == 0) smse[warp] = ms;
    }
    if (want_d && wnp)
#pragma unroll
        for (int j = 0; j < PER; j++) swn[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    if (mse && threadIdx.x == 0) {
        double tot = 0;
        for (int w = 0; w < (int)(blockDim.x / 32); w++) tot += smse[w];
        atomicAdd(mse, tot * inv_n);
    }
    if (want_d && wnp)   /* the block's share of w_n's gradient, its warps summed in order (no atomics: reproducible) */
        for (int x = threadIdx.x; x < D; x += blockDim.x) {
            float a = 0.0f;
            for (int w = 0; w < GDN_THREADS / 32; w++) a += swn[w][x];
            wnp[(size_t)blockIdx.x * D + x] = a;
        }
}

/* out[i] += Σ_b part[b][i] (b in order) for i < n: the blocks' shares of a gradient, summed reproducibly. */
__global__ void gdn_sum_parts_kernel(const float *__restrict__ part, int n_parts, int n, float *__restrict__ out,
                                     int add) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float a = 0.0f;
    for (int b = 0; b < n_parts; b++) a += part[(size_t)b * n + i];
    out[i] = add ? out[i] + a : a;
}

/* The sum over the 8 lanes of a row group (lanes mg·8 .. mg·8 + 7 hold one row m's value columns). */
__device__ __forceinline__ float sum8(float p) {
    p += __shfl_xor_sync(0xffffffffu, p, 4);
    p += __shfl_xor_sync(0xffffffffu, p, 2);
    return p + __shfl_xor_sync(0xffffffffu, p, 1);
}

/* The recurrence in reverse, grid (D / BW_SW, Hk), GDN_THREADS threads: thread (x = tid % BW_SW, mg = tid / BW_SW)
 * holds rows m = mg + MG r of the slice's dST and S. Writes dab [slices][T][Hk][2]: the slice's share of dα and dβ
 * per token. scr: per block C states of D × BW_SW floats. With dqh: writes the slice's share of dq̂ into
 * dqh [slices][T][H][D] and of dk̂ into dkh [slices][T][Hk][D] (summed over the slices by gdn_sum_parts_kernel, in
 * order: no atomics, so that a replayed graph gives the same bits), and dv [T][Hk][D]. */
template <int D>
__global__ void __launch_bounds__(GDN_THREADS)
    gdn_bwd_scan_kernel(const float *__restrict__ qn, const float *__restrict__ kn, const float *__restrict__ v,
                        const float *__restrict__ beta, const float *__restrict__ lal, const float *__restrict__ STc,
                        const float *__restrict__ dO, int T, int H, int Hk, float *__restrict__ scr,
                        float *__restrict__ dab, float *__restrict__ dqh, float *__restrict__ dkh,
                        float *__restrict__ dvo) {
    static_assert(BW_SW == 8, "sum8 reduces 8 lanes");
    constexpr int SW = BW_SW, MG = GDN_THREADS / BW_SW, R = D / MG, C = GDN_C;
    static_assert(MG * R == D, "reverse tiling");
    __shared__ float red[2][MG][SW], red2[MG][SW][2], wsum[GDN_THREADS / 32][2];
    const int sl = blockIdx.x, x0 = sl * SW, hk = blockIdx.y, tid = threadIdx.x, G = H / Hk;
    const int x = tid % SW, mg = tid / SW, lane = tid & 31, warp = tid / 32;
    float *sc = scr + ((size_t)sl * Hk + hk) * C * D * SW;
    float dS[R] = {}, S[R], kr[R];
    const int n_chunks = (T + C - 1) / C;
    for (int c = n_chunks - 1; c >= 0; c--) {
        const int t0 = c * C, n = min(C, T - t0);
#pragma unroll
        for (int r = 0; r < R; r++) S[r] = STc[(((size_t)c * Hk + hk) * D + mg + MG * r) * D + x0 + x];
        for (int i = 0; i < n; i++) {   /* the states before each token of the chunk */
            const size_t t = (size_t)(t0 + i);
            float p = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                sc[((size_t)i * D + mg + MG * r) * SW + x] = S[r];
                kr[r] = kn[(t * Hk + hk) * D + mg + MG * r];
                p += S[r] * kr[r];
            }
            red[i & 1][mg][x] = p;
            __syncthreads();
            float rx = 0.0f;
#pragma unroll 8
            for (int g = 0; g < MG; g++) rx += red[i & 1][g][x];
            const float al = expf(lal[t * Hk + hk]), e = beta[t * Hk + hk] * (v[(t * Hk + hk) * D + x0 + x] - al * rx);
#pragma unroll
            for (int r = 0; r < R; r++) S[r] = al * S[r] + kr[r] * e;
        }
        for (int i = n - 1; i >= 0; i--) {
            const size_t t = (size_t)(t0 + i);
            float Sp[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                Sp[r] = sc[((size_t)i * D + mg + MG * r) * SW + x];   /* this thread's own writes */
                kr[r] = kn[(t * Hk + hk) * D + mg + MG * r];
            }
            for (int g = 0; g < G; g++) {
                const size_t row = (t * H + (size_t)hk * G + g) * D;
                const float dov = dO[row + x0 + x];
#pragma unroll
                for (int r = 0; r < R; r++) dS[r] += qn[row + mg + MG * r] * dov;
            }
            float pr = 0.0f, pk = 0.0f, pa = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) pr += Sp[r] * kr[r], pk += dS[r] * kr[r], pa += dS[r] * Sp[r];
            red2[mg][x][0] = pr, red2[mg][x][1] = pk;
            __syncthreads();
            float rx = 0.0f, dsk = 0.0f;
#pragma unroll 8
            for (int g = 0; g < MG; g++) rx += red2[g][x][0], dsk += red2[g][x][1];
            const float al = expf(lal[t * Hk + hk]), be = beta[t * Hk + hk];
            if (dqh) {   /* the core's inputs' gradients (uniform across the block) */
                const float e = be * (v[(t * Hk + hk) * D + x0 + x] - al * rx);
                for (int g = 0; g < G; g++) {   /* dq̂_h[m] += Σ_x S_t[m][x] do_h[x] */
                    const size_t row = (t * H + (size_t)hk * G + g) * D;
                    const float dov = dO[row + x0 + x];
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        const float p = sum8((al * Sp[r] + kr[r] * e) * dov);
                        if (x == 0) dqh[(size_t)sl * T * H * D + row + mg + MG * r] = p;
                    }
                }
#pragma unroll
                for (int r = 0; r < R; r++) {   /* dk̂[m] += Σ_x dS_t[m][x] e[x] − α β S_{t−1}[m][x] dSk[x] */
                    const float p = sum8(dS[r] * e - al * be * Sp[r] * dsk);
                    if (x == 0) dkh[(size_t)sl * T * Hk * D + (t * Hk + hk) * D + mg + MG * r] = p;
                }
                if (mg == 0) dvo[(t * Hk + hk) * D + x0 + x] = be * dsk;
            }
            float da = pa, db = 0.0f;
            if (mg == 0) da -= be * dsk * rx, db = dsk * (v[(t * Hk + hk) * D + x0 + x] - al * rx);
            for (int s = 16; s > 0; s >>= 1)
                da += __shfl_xor_sync(0xffffffffu, da, s), db += __shfl_xor_sync(0xffffffffu, db, s);
            if (lane == 0) wsum[warp][0] = da, wsum[warp][1] = db;
#pragma unroll
            for (int r = 0; r < R; r++) dS[r] = al * (dS[r] - be * kr[r] * dsk);
            __syncthreads();
            if (tid == 0) {
                float a = 0.0f, b = 0.0f;
                for (int w = 0; w < GDN_THREADS / 32; w++) a += wsum[w][0], b += wsum[w][1];
                float *o = dab + (((size_t)sl * T + t) * Hk + hk) * 2;
                o[0] = a, o[1] = b;
            }
        }
    }
}

/* grid Hk: dα and dβ summed over the slices; the gates' pre-activation gradients into dpre [T][2 Hk] (β's, then
 * α's) and, with grad, the biases' and a_log's gradients. */
__global__ void gdn_bwd_gates_kernel(const float *__restrict__ dab, int n_slices, const float *__restrict__ pre,
                                     int ld, const float *__restrict__ params, int T, int H, int Hk, int d, int D,
                                     float *__restrict__ dpre, float *__restrict__ grad) {
    __shared__ float red[3][GDN_THREADS / 32];
    const int hk = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const float bb = params[gdn_par_bbeta(Hk, d) + hk], ba = params[gdn_par_balpha(Hk, d) + hk];
    const float alog = params[gdn_par_alog(Hk, d) + hk];
    float sb = 0.0f, sa = 0.0f, sl = 0.0f;
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
        float dal = 0.0f, dbe = 0.0f;
        for (int s = 0; s < n_slices; s++) {
            const float *p = dab + (((size_t)s * T + t) * Hk + hk) * 2;
            dal += p[0], dbe += p[1];
        }
        const float *pr = pre + (size_t)t * ld + (size_t)H * D;
        const float bpre = pr[hk] + bb, apre = pr[Hk + hk] + ba;
        const float be = gdn_beta(bpre), la = gdn_log_alpha(apre, alog), al = expf(la);
        const float dbp = dbe * be * (1.0f - be), dap = al * dal * (-expf(alog)) / (1.0f + expf(-apre));
        dpre[(size_t)t * 2 * Hk + hk] = dbp, dpre[(size_t)t * 2 * Hk + Hk + hk] = dap;
        sb += dbp, sa += dap, sl += al * dal * la;
    }
    for (int s = 16; s > 0; s >>= 1)
        sb += __shfl_xor_sync(0xffffffffu, sb, s), sa += __shfl_xor_sync(0xffffffffu, sa, s),
            sl += __shfl_xor_sync(0xffffffffu, sl, s);
    if (lane == 0) red[0][warp] = sb, red[1][warp] = sa, red[2][warp] = sl;
    __syncthreads();
    if (grad && threadIdx.x == 0) {
        float a = 0.0f, b = 0.0f, c = 0.0f;
        for (int w = 0; w < (int)(blockDim.x / 32); w++) a += red[0][w], b += red[1][w], c += red[2][w];
        grad[gdn_par_bbeta(Hk, d) + hk] += a, grad[gdn_par_balpha(Hk, d) + hk] += b, grad[gdn_par_alog(Hk, d) + hk] += c;
    }
}

/* The L2 norms' backward, a warp per row (T·H q rows, then T·Hk k rows): the row before its norm (the raw input;
 * with the convolution, W > 0, x' = Σ_j w[ch][j] x_{t−W+1+j}, zero before the sequence, recomputed from the raw
 * inputs); dx̂ → dx' in place, as src/kinds/gdn/attn_gdn.c's l2_backward. */
template <int D>
__global__ void gdn_bwd_l2_kernel(const float *__restrict__ q, const float *__restrict__ k, int T, int H, int Hk,
                                  int W, const float *__restrict__ w, float *__restrict__ dq, float *__restrict__ dk) {
    constexpr int PER = D / 32;
    const int lane = threadIdx.x & 31, HD = H * D, KD = Hk * D;
    const int64_t nq = (int64_t)T * H, rows = nq + (int64_t)T * Hk;
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows;
         row += (int64_t)gridDim.x * (blockDim.x / 32)) {
        const bool is_q = row < nq;
        const int64_t r = is_q ? row : row - nq, t = is_q ? r / H : r / Hk;
        const int ld = is_q ? HD : KD, head = (int)(is_q ? r % H : r % Hk), ch0 = is_q ? 0 : HD;
        const float *src = is_q ? q : k;
        float *g = (is_q ? dq : dk) + r * D;
        float xv[PER], gv[PER], nn = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int off = head * D + lane + 32 * i;
            float acc = W > 0 ? 0.0f : src[t * ld + off];
            for (int j = 0; j < W; j++) {
                const int64_t tau = t - W + 1 + j;
                if (tau >= 0) acc += w[(size_t)(ch0 + off) * W + j] * src[tau * ld + off];
            }
            xv[i] = acc, gv[i] = g[lane + 32 * i], nn += acc * acc;
        }
        for (int o = 16; o > 0; o >>= 1) nn += __shfl_xor_sync(0xffffffffu, nn, o);
        const float f = gdn_l2_factor(nn);
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) dot += xv[i] * f * gv[i];
        for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (sqrtf(nn) <= GDN_L2_EPS) dot = 0.0f;   /* the floor: x̂ = x / eps, linear in x */
#pragma unroll
        for (int i = 0; i < PER; i++) g[lane + 32 * i] = f * (gv[i] - xv[i] * f * dot);
    }
}

/* w_c's gradient (conv > 0), grid (channel blocks, token slices of CONV_TS): a thread per channel of q | k | v sums
 * dx'_t[ch] x_{t−W+1+j}[ch] over its slice for every tap j into part [slice][channels][W] (summed in order after). */
__global__ void gdn_bwd_convw_kernel(const float *__restrict__ q, const float *__restrict__ k,
                                     const float *__restrict__ v, const float *__restrict__ dq,
                                     const float *__restrict__ dk, const float *__restrict__ dv, int T, int HD, int KD,
                                     int W, float *__restrict__ part) {
    const int nch = HD + 2 * KD, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= nch) return;
    int off, ld;
    const int which = conv_channel(ch, HD, KD, &off, &ld);
    const float *src = which == 0 ? q : which == 1 ? k : v, *g = which == 0 ? dq : which == 1 ? dk : dv;
    float acc[GDN_CONV_MAX] = {};
    const int t1 = min(T, (int)(blockIdx.y + 1) * CONV_TS);
    for (int t = blockIdx.y * CONV_TS; t < t1; t++) {
        const float gt = g[(size_t)t * ld + off];
#pragma unroll
        for (int j = 0; j < GDN_CONV_MAX; j++) {
            const int tau = t - W + 1 + j;
            if (j < W && tau >= 0) acc[j] += gt * src[(size_t)tau * ld + off];
        }
    }
    float *out = part + (size_t)blockIdx.y * nch * W + (size_t)ch * W;
#pragma unroll
    for (int j = 0; j < GDN_CONV_MAX; j++)
        if (j < W) out[j] = acc[j];
}

/* The convolution's inputs' gradients (stage 2), a thread per (token, channel): input t feeds outputs t .. t + W − 1
 * through taps W − 1 .. 0, din_t = Σ_j dx'_{t+W−1−j} w[ch][j]; written (not added) into dq, dk, dv. */
__global__ void gdn_bwd_conv_in_kernel(const float *__restrict__ gq, const float *__restrict__ gk,
                                       const float *__restrict__ gv, int T, int HD, int KD, int W,
                                       const float *__restrict__ w, float *__restrict__ dq, float *__restrict__ dk,
                                       float *__restrict__ dv) {
    const int nch = HD + 2 * KD;
    const int64_t n = (int64_t)T * nch;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(e / nch), ch = (int)(e % nch);
        int off, ld;
        const int which = conv_channel(ch, HD, KD, &off, &ld);
        const float *g = which == 0 ? gq : which == 1 ? gk : gv;
        float acc = 0.0f;
        for (int j = 0; j < W; j++) {
            const int o = t + W - 1 - j;
            if (o < T) acc += g[(size_t)o * ld + off] * w[(size_t)ch * W + j];
        }
        (which == 0 ? dq : which == 1 ? dk : dv)[(size_t)t * ld + off] = acc;
    }
}

/* grad_b[j] += Σ_t dg[t][j] for j < n: the gate's bias. */
__global__ void gdn_colsum_kernel(const float *__restrict__ dg, int T, int n, float *__restrict__ grad_b) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    float s = 0.0f;
    for (int t = 0; t < T; t++) s += dg[(size_t)t * n + j];
    grad_b[j] += s;
}

/* The workspace for sequences of up to T tokens (grown, never shrunk: a CUDA graph recorded over a call keeps using
 * the buffer, so a trainer reserves its longest sequence before recording). */
int reserve(stc_ctx *ctx, stc_gdn *s, int T, still_err *err) {
    const size_t need = tlayout(s->H, s->Hk, s->D, T).total * sizeof(float);
    if (need <= s->tws_bytes) return STILL_OK;
    stc_free(ctx, s->tws);
    s->tws = NULL, s->tws_bytes = 0;
    const int rc = stc_malloc(ctx, need, "gdn training workspace", &s->tws, err);
    if (!rc) s->tws_bytes = need;
    return rc;
}

/* A training forward from a fresh state over one sequence: q and k copied into the workspace (back before RoPE with
 * rope_theta > 0; with keep_raw and no convolution, also kept raw for the inputs' gradients), the gates'
 * pre-activations, the raw outputs (o) and y (the layer's output) into the workspace. */
template <int D>
int train_forward(stc_ctx *ctx, stc_gdn *s, const float *params, const float *q, const float *k, const float *v,
                  const float *x, int T, float rope_theta, int keep_raw, still_err *err) {
    const int H = s->H, Hk = s->Hk, d = s->d, HD = H * D, ld = HD + 2 * Hk;
    const tws_layout l = tlayout(H, Hk, D, T);
    int rc = reserve(ctx, s, T, err);
    if (rc) return rc;
    float *w = (float *)s->tws;
    float *qn = w + l.qn, *kn = w + l.kn, *pre = w + l.pre;
    rc = stc_memcpy_d2d(ctx, qn, q, sizeof(float) * (size_t)T * HD, err);
    if (!rc) rc = stc_memcpy_d2d(ctx, kn, k, sizeof(float) * (size_t)T * Hk * D, err);
    if (!rc && rope_theta > 0) rc = stc_rope_rows(ctx, qn, T, T, H, D, rope_theta, 1, err);   /* back before RoPE */
    if (!rc && rope_theta > 0) rc = stc_rope_rows(ctx, kn, T, T, Hk, D, rope_theta, 1, err);
    if (!rc && keep_raw && !s->conv) rc = stc_memcpy_d2d(ctx, w + l.qr, qn, sizeof(float) * (size_t)T * HD, err);
    if (!rc && keep_raw && !s->conv) rc = stc_memcpy_d2d(ctx, w + l.kr, kn, sizeof(float) * (size_t)T * Hk * D, err);
    if (!rc) rc = stc_gdn_reset(ctx, s, err);
    if (!rc)
        rc = stc_gemm_rm(ctx, 0, 1, T, HD, d, 1.0f, x, d, params + gdn_par_wg(Hk, d, D), d, 0.0f, pre, ld, 0, 0, err);
    if (!rc)
        rc = stc_gemm_rm(ctx, 0, 1, T, Hk, d, 1.0f, x, d, params + gdn_par_wbeta(Hk, d), d, 0.0f, pre + HD, ld, 0, 0,
                         err);
    if (!rc)
        rc = stc_gemm_rm(ctx, 0, 1, T, Hk, d, 1.0f, x, d, params + gdn_par_walpha(Hk, d), d, 0.0f, pre + HD + Hk, ld, 0,
                         0, err);
    if (!rc) rc = run_segment<D>(ctx, s, params, qn, kn, v, pre, ld, T, w + l.fws, w + l.y, NULL, w + l.o, err);
    if (!rc) s->n_seen = T;
    return rc;
}

/* The backward after train_forward. Stage 1 (dy NULL): the loss against target into *mse and, with grad, its
 * gradient scaled by scale; stage 2: the output's gradient dy, the inputs' gradients written into dq, dk, dv (before
 * RoPE) and added into dx, and with grad the parameters'. */
template <int D>
int train_backward(stc_ctx *ctx, stc_gdn *s, const float *params, const float *v, const float *x, int T,
                   const float *target, float scale, double *mse, const float *dy, float *grad, float *dq_out,
                   float *dk_out, float *dv_out, float *dx, still_err *err) {
    const int H = s->H, Hk = s->Hk, d = s->d, HD = H * D, KD = Hk * D, ld = HD + 2 * Hk, nsl = D / BW_SW;
    const int cv = s->conv, inputs = dy != NULL;
    const tws_layout l = tlayout(H, Hk, D, T);
    const ws_layout f = layout(H, Hk, D, T);
    float *w = (float *)s->tws;
    float *qn = w + l.qn, *kn = w + l.kn, *pre = w + l.pre, *y = w + l.y, *o = w + l.o, *dO = w + l.dO, *dg = w + l.dg;
    float *dpre = w + l.dpre, *dab = w + l.dab, *scr = w + l.scr, *fws = w + l.fws;
    cudaStream_t st = ctx->stream;
    const double n = (double)T * HD;
    const int want_d = inputs || grad != NULL;
    const unsigned nb_out = std::min(stc_blocks((int64_t)T * H, GDN_THREADS / 32), (unsigned)OUT_BLOCKS_MAX);
    gdn_bwd_out_kernel<D><<<nb_out, GDN_THREADS, 0, st>>>(
        y, target, dy, o, pre, ld, params, T, H, Hk, d, s->norm, (float)(2.0 * scale / n), 1.0 / n, want_d, dO, dg,
        grad ? w + l.wnp : NULL, inputs ? NULL : mse);
    STC_LAUNCHED(err, "gdn_bwd_out_kernel");
    if (!want_d) return STILL_OK;
    if (grad) {   /* w_n's gradient: the blocks' shares in order */
        gdn_sum_parts_kernel<<<(D + 255) / 256, 256, 0, st>>>(w + l.wnp, (int)nb_out, D, grad + gdn_par_wnorm(Hk, d), 1);
        STC_LAUNCHED(err, "gdn_sum_parts_kernel");
    }
    /* the core's inputs' gradients: for the inputs themselves, or for the convolution's weights */
    const int need_in = inputs || cv;
    float *dq = need_in ? w + l.dq : NULL, *dk = need_in ? w + l.dk : NULL, *dv = need_in ? w + l.dv : NULL;
    int rc = STILL_OK;
    /* the core ran on the convolution's (normalised) outputs in fws, or on qn, kn normalised in place */
    gdn_bwd_scan_kernel<D><<<dim3(nsl, Hk), GDN_THREADS, 0, st>>>(
        cv ? fws + f.qc : qn, cv ? fws + f.kc : kn, cv ? fws + f.vc : v, fws + f.beta, fws + f.lal, fws + f.STc, dO, T,
        H, Hk, scr, dab, need_in ? w + l.dqp : NULL, need_in ? w + l.dkp : NULL, dv);
    STC_LAUNCHED(err, "gdn_bwd_scan_kernel");
    if (need_in) {   /* dq̂, dk̂: the slices' shares in order */
        gdn_sum_parts_kernel<<<stc_blocks((int64_t)T * HD, 256), 256, 0, st>>>(w + l.dqp, nsl, T * HD, dq, 0);
        STC_LAUNCHED(err, "gdn_sum_parts_kernel");
        gdn_sum_parts_kernel<<<stc_blocks((int64_t)T * KD, 256), 256, 0, st>>>(w + l.dkp, nsl, T * KD, dk, 0);
        STC_LAUNCHED(err, "gdn_sum_parts_kernel");
    }
    gdn_bwd_gates_kernel<<<Hk, GDN_THREADS, 0, st>>>(dab, nsl, pre, ld, params, T, H, Hk, d, D, dpre, grad);
    STC_LAUNCHED(err, "gdn_bwd_gates_kernel");
    const float *wc = cv ? params + gdn_par_conv(H, Hk, d, D) : NULL;
    if (need_in) {   /* through the norms of q and k: rows recomputed from the raw (un-rotated) inputs */
        gdn_bwd_l2_kernel<D><<<stc_blocks((int64_t)T * (H + Hk), 8), 256, 0, st>>>(
            cv ? qn : w + l.qr, cv ? kn : w + l.kr, T, H, Hk, cv, wc, dq, dk);
        STC_LAUNCHED(err, "gdn_bwd_l2_kernel");
    }
    if (inputs) {   /* the inputs' gradients: through the convolution, or the core's own */
        if (cv) {
            gdn_bwd_conv_in_kernel<<<stc_blocks((int64_t)T * (HD + 2 * KD), 256), 256, 0, st>>>(
                dq, dk, dv, T, HD, KD, cv, wc, dq_out, dk_out, dv_out);
            STC_LAUNCHED(err, "gdn_bwd_conv_in_kernel");
        } else {
            rc = stc_memcpy_d2d(ctx, dq_out, dq, sizeof(float) * (size_t)T * HD, err);
            if (!rc) rc = stc_memcpy_d2d(ctx, dk_out, dk, sizeof(float) * (size_t)T * KD, err);
            if (!rc) rc = stc_memcpy_d2d(ctx, dv_out, dv, sizeof(float) * (size_t)T * KD, err);
            if (rc) return rc;
        }
        /* the layer input: dx += dg W_g + dβ_pre w_β + dα_pre w_α */
        rc = stc_gemm_rm(ctx, 0, 0, T, d, HD, 1.0f, dg, HD, params + gdn_par_wg(Hk, d, D), d, 1.0f, dx, d, 0, 0, err);
        if (!rc)
            rc = stc_gemm_rm(ctx, 0, 0, T, d, Hk, 1.0f, dpre, 2 * Hk, params + gdn_par_wbeta(Hk, d), d, 1.0f, dx, d, 0,
                             0, err);
        if (!rc)
            rc = stc_gemm_rm(ctx, 0, 0, T, d, Hk, 1.0f, dpre + Hk, 2 * Hk, params + gdn_par_walpha(Hk, d), d, 1.0f, dx,
                             d, 0, 0, err);
        if (rc) return rc;
    }
    if (!grad) return STILL_OK;
    if (cv) {   /* w_c's gradient against the raw inputs, token slice by token slice, the slices summed in order */
        const int ny = (T + CONV_TS - 1) / CONV_TS, nw = (HD + 2 * KD) * cv;
        gdn_bwd_convw_kernel<<<dim3((HD + 2 * KD + 255) / 256, ny), 256, 0, st>>>(qn, kn, v, dq, dk, dv, T, HD, KD, cv,
                                                                                 w + l.cwp);
        STC_LAUNCHED(err, "gdn_bwd_convw_kernel");
        gdn_sum_parts_kernel<<<(nw + 255) / 256, 256, 0, st>>>(w + l.cwp, ny, nw, grad + gdn_par_conv(H, Hk, d, D), 1);
        STC_LAUNCHED(err, "gdn_sum_parts_kernel");
    }
    gdn_colsum_kernel<<<(HD + 255) / 256, 256, 0, st>>>(dg, T, HD, grad + gdn_par_bg(H, Hk, d, D));
    STC_LAUNCHED(err, "gdn_colsum_kernel");
    rc = stc_gemm_rm(ctx, 1, 0, HD, d, T, 1.0f, dg, HD, x, d, 1.0f, grad + gdn_par_wg(Hk, d, D), d, 0, 0, err);
    if (!rc)
        rc = stc_gemm_rm(ctx, 1, 0, Hk, d, T, 1.0f, dpre, 2 * Hk, x, d, 1.0f, grad + gdn_par_wbeta(Hk, d), d, 0, 0,
                         err);
    if (!rc)
        rc = stc_gemm_rm(ctx, 1, 0, Hk, d, T, 1.0f, dpre + Hk, 2 * Hk, x, d, 1.0f, grad + gdn_par_walpha(Hk, d), d, 0,
                         0, err);
    return rc;
}

}  // namespace

int stc_gdn_distill(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k, const float *v,
                    const float *x_f32, int T, float rope_theta, const float *target, float scale, float *grad_dev,
                    double *mse_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s || !params_dev || !q || !k || !v || !x_f32 || !target || !mse_dev)
        return stc_fail(err, STILL_E_ARG, "stc_gdn_distill: NULL argument");
    if (T < 2) return stc_fail(err, STILL_E_ARG, "gdn training on the GPU: sequences of at least 2 tokens (got %d)", T);
    int rc = s->D == 64 ? train_forward<64>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 0, err)
                        : train_forward<128>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 0, err);
    if (rc) return rc;
    return s->D == 64 ? train_backward<64>(ctx, s, params_dev, v, x_f32, T, target, scale, mse_dev, NULL, grad_dev, NULL,
                                           NULL, NULL, NULL, err)
                      : train_backward<128>(ctx, s, params_dev, v, x_f32, T, target, scale, mse_dev, NULL, grad_dev,
                                            NULL, NULL, NULL, NULL, err);
}

int stc_gdn_train_reserve(stc_ctx *ctx, stc_gdn *s, int T_max, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s) return stc_fail(err, STILL_E_ARG, "stc_gdn_train_reserve: NULL state");
    if (T_max < 2) return stc_fail(err, STILL_E_ARG, "gdn training on the GPU: sequences of at least 2 tokens (got %d)", T_max);
    return reserve(ctx, s, T_max, err);
}

int stc_gdn_train_forward(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k,
                          const float *v, const float *x_f32, int T, float rope_theta, float *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s || !params_dev || !q || !k || !v || !x_f32 || !out)
        return stc_fail(err, STILL_E_ARG, "stc_gdn_train_forward: NULL argument");
    if (T < 2) return stc_fail(err, STILL_E_ARG, "gdn training on the GPU: sequences of at least 2 tokens (got %d)", T);
    int rc = s->D == 64 ? train_forward<64>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 0, err)
                        : train_forward<128>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 0, err);
    if (rc) return rc;
    const tws_layout l = tlayout(s->H, s->Hk, s->D, T);
    return stc_memcpy_d2d(ctx, out, (float *)s->tws + l.y, sizeof(float) * (size_t)T * s->H * s->D, err);
}

int stc_gdn_train_backward(stc_ctx *ctx, stc_gdn *s, const float *params_dev, const float *q, const float *k,
                           const float *v, const float *x_f32, int T, float rope_theta, const float *dy, float *dq,
                           float *dk, float *dv, float *dx, float *grad_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s || !params_dev || !q || !k || !v || !x_f32 || !dy || !dq || !dk || !dv || !dx)
        return stc_fail(err, STILL_E_ARG, "stc_gdn_train_backward: NULL argument");
    if (T < 2) return stc_fail(err, STILL_E_ARG, "gdn training on the GPU: sequences of at least 2 tokens (got %d)", T);
    int rc = s->D == 64 ? train_forward<64>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 1, err)
                        : train_forward<128>(ctx, s, params_dev, q, k, v, x_f32, T, rope_theta, 1, err);
    if (rc) return rc;
    return s->D == 64 ? train_backward<64>(ctx, s, params_dev, v, x_f32, T, NULL, 0.0f, NULL, dy, grad_dev, dq, dk, dv,
                                           dx, err)
                      : train_backward<128>(ctx, s, params_dev, v, x_f32, T, NULL, 0.0f, NULL, dy, grad_dev, dq, dk,
                                            dv, dx, err);
}
