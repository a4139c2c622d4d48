/* still on the GPU, step 2: the routing scores of the call's tokens
 * (src/attn_still.c computes them inside block_head).
 *
 * saliency: token t's own weight p in its window R(t) = max(0, t-C+1) .. t,
 *   p = e^{s_tt} / Σ_{l ∈ R(t)} e^{s_tl}, s = q·k / sqrt(D) in fp32 from the
 *   fp32 inputs (not the bf16 copies: selection must follow the CPU's), and
 *   the score f(p) = p log((p+ε)/ε) + (1-p) log(1-p) in double.
 * qk: each query i adds its logits s_il over R(i) to key l's score (double
 *   atomics; a key's score collects the C queries i = l .. l+C-1, which all
 *   come before the key's chunk leaves; the selection divides by C).
 * keynorm: ‖k_t‖ in double.
 * Scores of positions p0 .. p0+T-1 go to the workspace (sc), those of
 * earlier positions (qk's additions) to the ring's scores, in place.
 *
 * saliency / qk kernel: block (score tile b, query head h), 256 threads.
 * The tile's 64 query positions (64-aligned, absolute) against 64-key
 * sub-tiles of their windows: logits as a register-blocked fp32 GEMM from
 * shared memory (Qᵀ and Kᵀ, [D][68]: each thread 4 rows × 4 keys, float4
 * reads), then per row an online max / sum over the sub-tiles. The 16
 * threads of a row are the 16 lanes of one half-warp. */
#include "attn_still_internal.cuh"

#include <math.h>

namespace stillk {
namespace {

constexpr int kThreads = 256;
constexpr int kLd = kScoreRows + 4;   /* row stride of Qᵀ, Kᵀ (floats): 16-byte rows, fewer bank conflicts */

template <int D>
__global__ void __launch_bounds__(kThreads) score_kernel(const args a) {
    extern __shared__ __align__(16) float sm[];
    float *Qt = sm;                  /* [D][kLd] */
    float *Kt = Qt + D * kLd;        /* [D][kLd] */
    float *self_s = Kt + D * kLd;    /* [64] each row's own logit */
    double *colsum = (double *)(self_s + kScoreRows);   /* [64] qk: per key of the sub-tile */

    const int p0 = *a.n_seen;
    const int tid = threadIdx.x, h = blockIdx.y, hk = h / a.G;
    const int tq0 = score_tile_q0(p0, blockIdx.x);
    const int r_lo = smax(tq0, p0), r_hi = smin(tq0 + kScoreRows - 1, p0 + a.T - 1);
    if (r_lo > r_hi) return;
    const bool qk = a.routing == R_QK;

    for (int e = tid; e < kScoreRows * D; e += kThreads) {
        const int r = e / D, d = e % D, pos = tq0 + r;
        const bool ok = pos >= r_lo && pos <= r_hi;
        Qt[d * kLd + r] = ok ? a.q[((size_t)(pos - p0) * a.H + h) * D + d] : 0.0f;
    }

    const int rg = tid >> 4, kg = tid & 15;   /* rows rg*4 .. +3, keys kg*4 .. +3 of the sub-tile */
    float m[4], l[4];
#pragma unroll
    for (int i = 0; i < 4; i++) m[i] = -INFINITY, l[i] = 0.0f;
    const int J = score_sub_before(a.C);
    const int key_lo = smax(0, r_lo - a.C + 1);   /* keys any row of the tile sees */
    for (int s = 0; s <= J; s++) {
        const int kb = tq0 + kScoreRows * (s - J);
        if (kb + kKeys - 1 < key_lo || kb > r_hi) continue;   /* uniform over the block */
        __syncthreads();   /* the previous sub-tile's Kt and colsum are no longer read */
        for (int e = tid; e < kKeys * D; e += kThreads) {
            const int j = e / D, d = e % D, pos = kb + j;
            const bool ok = pos >= key_lo && pos <= r_hi;
            Kt[d * kLd + j] = ok ? kv_row(a, p0, pos, hk, 0)[d] : 0.0f;
        }
        if (qk && tid < kKeys) colsum[tid] = 0.0;
        __syncthreads();

        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; d++) {
            const float4 qa = *reinterpret_cast<const float4 *>(Qt + d * kLd + rg * 4);
            const float4 kb4 = *reinterpret_cast<const float4 *>(Kt + d * kLd + kg * 4);
            const float qv[4] = {qa.x, qa.y, qa.z, qa.w}, kv[4] = {kb4.x, kb4.y, kb4.z, kb4.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(qv[i], kv[j], acc[i][j]);
        }

        double cs[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = tq0 + rg * 4 + i;
            const bool row_ok = t >= r_lo && t <= r_hi;
            float val[4], tmax = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int key = kb + kg * 4 + j;
                const bool ok = row_ok && in_window(key, t, a.C);
                val[j] = ok ? acc[i][j] * a.scale : -INFINITY;
                tmax = fmaxf(tmax, val[j]);
                if (ok && key == t) self_s[rg * 4 + i] = val[j];
                if (qk && ok) cs[j] += (double)val[j];
            }
            if (qk) continue;
            /* the row's 16 threads are the lanes of a half-warp */
            for (int o = 8; o > 0; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            const float mn = fmaxf(m[i], tmax);
            float part = 0.0f;
            if (mn != -INFINITY)
#pragma unroll
                for (int j = 0; j < 4; j++) part += expf(val[j] - mn);   /* e^-inf = 0 */
            for (int o = 8; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (mn != -INFINITY) {
                l[i] = l[i] * expf(m[i] - mn) + part;
                m[i] = mn;
            }
        }
        if (qk) {
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (cs[j] != 0.0) atomicAdd(&colsum[kg * 4 + j], cs[j]);
            __syncthreads();
            if (tid < kKeys) {
                const int key = kb + tid;
                if (key >= key_lo && key <= r_hi && colsum[tid] != 0.0) atomicAdd(score_ptr(a, p0, h, key), colsum[tid]);
            }
        }
    }
    if (qk) return;
    __syncthreads();   /* self_s */
    if (kg == 0)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int t = tq0 + rg * 4 + i;
            if (t < r_lo || t > r_hi) continue;
            const float p = expf(self_s[rg * 4 + i] - m[i]) / l[i];
            *score_ptr(a, p0, h, t) = saliency_of_p((double)p);
        }
}

/* keynorm: one warp per (token, KV head); the norm goes to the G query heads. */
__global__ void keynorm_kernel(const args a) {
    const int p0 = *a.n_seen;
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= a.T * a.Hk) return;
    const int t = w / a.Hk, hk = w % a.Hk;
    const float *k = a.k + ((size_t)t * a.Hk + hk) * a.D;
    double n2 = 0.0;
    for (int x = lane; x < a.D; x += 32) n2 += (double)k[x] * k[x];
    for (int o = 16; o > 0; o >>= 1) n2 += __shfl_xor_sync(0xffffffffu, n2, o);
    if (lane < a.G) *score_ptr(a, p0, hk * a.G + lane, p0 + t) = sqrt(n2);
}

}   // namespace

size_t smem_score(int D) { return (size_t)2 * D * kLd * sizeof(float) + kScoreRows * (sizeof(float) + sizeof(double)); }

int launch_score(stc_ctx *ctx, const args &a, still_err *err) {
    if (a.routing == R_KEYNORM) {
        const int warps = a.T * a.Hk;
        keynorm_kernel<<<stc_blocks((int64_t)warps * 32, 256), 256, 0, ctx->stream>>>(a);
        STC_LAUNCHED(err, "keynorm_kernel");
        return STILL_OK;
    }
    if (a.routing != R_SALIENCY && a.routing != R_QK) return STILL_OK;
    const dim3 grid((unsigned)max_score_tiles(a.T), (unsigned)a.H);
    if (a.D == 64) score_kernel<64><<<grid, kThreads, smem_score(64), ctx->stream>>>(a);
    else score_kernel<128><<<grid, kThreads, smem_score(128), ctx->stream>>>(a);
    STC_LAUNCHED(err, "score_kernel");
    return STILL_OK;
}

int prepare_score(int D, still_err *err) {
    const int bytes = (int)smem_score(D);
    if (D == 64) STC_CUDA(err, cudaFuncSetAttribute(score_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else STC_CUDA(err, cudaFuncSetAttribute(score_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return STILL_OK;
}

}   // namespace stillk
