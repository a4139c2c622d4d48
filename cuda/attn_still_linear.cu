/* still on the GPU, step 6: the linear branch and the final division, for
 * the rows of chunks c >= 2 (linear on):
 *   y = (o + g ⊙ (φq(q)ᵀ S_c)) / (l + φq(q)·z_c + 1e-6)
 * with o, l the unnormalised softmax part the attention kernel left in out
 * and lbuf, S_c, z_c the linear state of the chunk (lin_index: the state at
 * the start of the call, or a prefix slot of the call's folds) and
 * g = σ(Wg x + bg) from the gate GEMM's pre-activations (1 without the gate).
 *
 * Block: (query chunk c, row tile rt, query head h) as the attention
 * kernel's, 256 threads. φq of the block's rows (NP-Map, q-map of head h,
 * one row per warp at a time) into shared memory; then [rows][P] × [P][D]
 * as a register-blocked fp32 GEMM (thread: 4 rows × D/16 dims) with S
 * streamed through shared memory D feature rows at a time, and φq·z per
 * row; then the gate and the division. */
#include "attn_still_fmap.cuh"

namespace stillk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/* Shared memory (floats): region A (q-map W [D][D+1], later S tiles [D][D]),
 * Φ [kRows][P+1], u [D], x̃ scratch [warps][D], z [P], φ·z [kRows]. */
__host__ __device__ inline size_t linear_floats(int D) {
    const size_t P = 2 * (size_t)D;
    return (size_t)D * (D + 1) + kRows * (P + 1) + D + (size_t)kWarps * D + P + kRows;
}

template <int D>
__global__ void __launch_bounds__(kThreads) linear_kernel(const args a) {
    constexpr int P = 2 * D, DJ = D / 16;
    extern __shared__ __align__(16) float sm[];
    float *regA = sm;
    float *Phi = regA + D * (D + 1);
    float *us = Phi + kRows * (P + 1);
    float *xt = us + D;
    float *zs = xt + kWarps * D;
    float *bz = zs + P;

    const int p0 = *a.n_seen;
    const call_geom g = make_geom(p0, a.T, a.C);
    const int n_rt = row_tiles(a.C);
    const int c = g.c_first + (int)blockIdx.x / n_rt, rt = (int)blockIdx.x % n_rt, h = blockIdx.y;
    if (c > g.c_last || c < 2) return;   /* chunks 0 and 1: the attention kernel wrote the output */
    int lo, hi;
    block_rows(g, a.C, c, rt, &lo, &hi);
    if (lo > hi) return;
    const int n_rows = hi - lo + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    const int idx = lin_index(g, c);
    const float *src = idx == 0 ? a.lin : a.slots + (size_t)(idx - 1) * a.slot_floats;
    const float *S = src + (size_t)h * P * D;
    const float *z = src + (size_t)a.H * P * D + (size_t)h * P;

    fmap_load<D>(a, 0, h, regA, us);
    for (int p = tid; p < P; p += kThreads) zs[p] = z[p];
    __syncthreads();
    const float uu = npmap_uu<D>(us, lane);
    for (int r = warp; r < kRows; r += kWarps) {
        float *ph = Phi + r * (P + 1);
        if (r >= n_rows) {   /* uniform over the warp */
            for (int p = lane; p < P; p += 32) ph[p] = 0.0f;
            continue;
        }
        npmap_warp<D>(a.q + ((size_t)(lo + r - p0) * a.H + h) * D, us, regA, uu, xt + warp * D, ph, lane, a.lolcats);
    }
    __syncthreads();   /* Φ complete; W no longer read */
    if (tid < kRows) {
        float s = 0.0f;
        for (int p = 0; p < P; p++) s = fmaf(Phi[tid * (P + 1) + p], zs[p], s);
        bz[tid] = s;
    }

    const int rg = tid >> 4, dg = tid & 15;   /* rows rg*4 .. +3, dims dg + 16 j */
    float acc[4][DJ];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < DJ; j++) acc[i][j] = 0.0f;
    for (int pt = 0; pt < P; pt += D) {
        __syncthreads();   /* the previous S tile (or W) is no longer read */
        for (int e = tid; e < D * D; e += kThreads) regA[e] = S[(size_t)pt * D + e];
        __syncthreads();
        for (int pp = 0; pp < D; pp++) {
            float av[4], bv[DJ];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = Phi[(rg * 4 + i) * (P + 1) + pt + pp];
#pragma unroll
            for (int j = 0; j < DJ; j++) bv[j] = regA[pp * D + dg + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < DJ; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
    }
    /* bz was written before the first barrier of the loop */

    const float *pre = a.gate ? a.pre : nullptr;
    const float *bg = a.gate ? a.params + par_bg(a) + (size_t)h * D : nullptr;
    const float gam = softmax_factor(a, h);   /* lolcats' γ on the softmax sums */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rg * 4 + i;
        if (r >= n_rows) continue;
        const int t = lo + r - p0;
        const float inv = 1.0f / (gam * a.lbuf[(size_t)t * a.H + h] + bz[r] + kDenEps);
        float *y = a.out + ((size_t)t * a.H + h) * D;
#pragma unroll
        for (int j = 0; j < DJ; j++) {
            const int d = dg + 16 * j;
            float lin = acc[i][j];
            if (pre) lin *= 1.0f / (1.0f + expf(-(pre[(size_t)t * a.H * D + (size_t)h * D + d] + bg[d])));
            y[d] = (gam * y[d] + lin) * inv;
        }
    }
}

}   // namespace

size_t smem_linear(int D) { return linear_floats(D) * sizeof(float); }

int prepare_linear(int D, still_err *err) {
    const int bytes = (int)smem_linear(D);
    if (D == 64) STC_CUDA(err, cudaFuncSetAttribute(linear_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else STC_CUDA(err, cudaFuncSetAttribute(linear_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return STILL_OK;
}

int launch_linear(stc_ctx *ctx, const args &a, still_err *err) {
    const dim3 grid((unsigned)(max_query_chunks(a.T, a.C) * row_tiles(a.C)), (unsigned)a.H);
    if (a.D == 64) linear_kernel<64><<<grid, kThreads, smem_linear(64), ctx->stream>>>(a);
    else linear_kernel<128><<<grid, kThreads, smem_linear(128), ctx->stream>>>(a);
    STC_LAUNCHED(err, "linear_kernel");
    return STILL_OK;
}

}   // namespace stillk
