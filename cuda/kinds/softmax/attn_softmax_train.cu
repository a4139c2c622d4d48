/* Softmax (and swa) attention for training, fused: the forward keeps each row's log-sum-exp, the backward
 * recomputes the probabilities tile by tile from it, so no T × T matrix is ever stored. Head dim 64, mma.sync
 * m16n8k16; q, k, v, o and their gradients fp32 where the trainer keeps them
 * ([B·T][H·D] and [B·T][Hk·D], row-major). Per (sequence, head), with s = 1/√D:
 *   P = softmax(s Q Kᵀ) (causal; swa: also key > query − window), O = P V, lse = log Σ exp(s Q Kᵀ)
 *   δ = rowsum(dO ⊙ O), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − δ), dQ = s dS K, dK = s dSᵀ Q.
 * Three kernels, no atomics (the same inputs give the same bits, as a replayed graph must):
 *   fwd:  a block per 64 query rows of one head, key tiles in order, online softmax;
 *   dkv:  a block per 64 keys of one KV head, over its G query heads and their query tiles;
 *   dq:   a block per 64 query rows of one head, over the key tiles.
 * Products through the tensor cores (cuda/kinds/attn_train_tiles.cuh): the score products Q Kᵀ take IEEE half inputs
 * (10 mantissa bits, as tf32: bf16's 7 put 0.21 of relative error into the LoRA gradients of a 64-token window
 * against the CPU's 0.17 with tf32), the others bf16 (dS and dO are small and need the exponent range), all with
 * fp32 accumulators. */
#include "kinds/attn_rules.h"
#include "kinds/attn_train_tiles.cuh"
#include "common/cuda_common.cuh"

#include <math.h>

using namespace stc_tiles;

namespace {

constexpr int kD = 64, kTile = kRows, kLds = kD + 8;
constexpr float kLog2e = (float)ATTN_LOG2E;

/* Is key j visible from query i? */
__device__ __forceinline__ bool visible(int i, int j, int T, int window) {
    return i < T && attn_key_visible(i, j, window);
}

__global__ void __launch_bounds__(kThr) flash_fwd_kernel(const float *q, const float *k, const float *v, float *o,
                                                         float *lse, int T, int H, int Hk, int window, float scale) {
    __shared__ __align__(16) h16 Qs[kTile * kLds], Ks[kTile * kLds], Vt[kTile * kLds];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *qb = q + (int64_t)b * T * qd + h * kD, *kb = k + (int64_t)b * T * kvd + hk * kD,
                *vb = v + (int64_t)b * T * kvd + hk * kD;
    tile_load<kD, F16, F16>(Qs, NULL, qb, qd, qt * kTile, T);
    __syncthreads();
    uint32_t qf[4][4];
    a_frags(qf, Qs, kLds, w * 16, lane);
    const int i0 = qt * kTile + w * 16 + g, i1 = i0 + 8;
    const float sl2 = scale * kLog2e;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[8][4];
    zero(acc);
    const int kt0 = window > 0 ? max(0, qt * kTile - window + 1) / kTile : 0;
    for (int kt = kt0; kt <= qt; kt++) {
        __syncthreads();
        tile_load<kD, F16, F16>(Ks, NULL, kb, kvd, kt * kTile, T);
        tile_load<kD, BF16, BF16>(NULL, Vt, vb, kvd, kt * kTile, T);
        __syncthreads();
        float s[8][4];
        zero(s);
        mma_rows<F16>(s, qf, Ks, kLds, lane);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (!visible(e < 2 ? i0 : i1, kt * kTile + nt * 8 + 2 * c + (e & 1), T, window)) s[nt][e] = -INFINITY;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float mx = m[hh];
#pragma unroll
            for (int nt = 0; nt < 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float msc = mx == -INFINITY ? 0.0f : mx * sl2;   /* no visible key yet: 2^(-inf) = 0, not NaN */
            const float corr = ex2(m[hh] * sl2 - msc);
            m[hh] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                    const float p = ex2(fmaf(s[nt][e], sl2, -msc));
                    s[nt][e] = p;
                    sum += p;
                }
            l[hh] = l[hh] * corr + sum;
#pragma unroll
            for (int dt = 0; dt < 8; dt++) acc[dt][2 * hh] *= corr, acc[dt][2 * hh + 1] *= corr;
        }
        uint32_t pf[4][4];
        acc_as_a<BF16>(pf, s);
        mma_rows<BF16>(acc, pf, Vt, kLdT, lane);
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
    float *ob = o + (int64_t)b * T * qd + h * kD;
    store_rows(ob, qd, qt * kTile + w * 16, T, acc, 1.0f / l[0], 1.0f / l[1], lane);
    if (c == 0) {
        float *lb = lse + ((int64_t)b * H + h) * T;
        if (i0 < T) lb[i0] = m[0] * scale + logf(l[0]);
        if (i1 < T) lb[i1] = m[1] * scale + logf(l[1]);
    }
}

__global__ void __launch_bounds__(kThr) flash_dkv_kernel(const float *q, const float *k, const float *v,
                                                         const float *dO, const float *lse, const float *delta,
                                                         float *dk, float *dv, int T, int H, int Hk, int window,
                                                         float scale) {
    __shared__ __align__(16) h16 Qs[kTile * kLds], Qt[kTile * kLds], Ds[kTile * kLds], Dt[kTile * kLds];
    __shared__ float lse_s[kTile], del_s[kTile];
    const int kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, G = H / Hk;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *kb = k + (int64_t)b * T * kvd + hk * kD, *vb = v + (int64_t)b * T * kvd + hk * kD;
    /* this warp's 16 keys as A fragments (K for Sᵀ = K Qᵀ, V for dPᵀ = V dOᵀ) */
    tile_load<kD, F16, F16>(Qs, NULL, kb, kvd, kt * kTile, T);
    tile_load<kD, BF16, BF16>(Ds, NULL, vb, kvd, kt * kTile, T);
    __syncthreads();
    uint32_t kf[4][4], vf[4][4];
    a_frags(kf, Qs, kLds, w * 16, lane);
    a_frags(vf, Ds, kLds, w * 16, lane);
    const int j0 = kt * kTile + w * 16 + g, j1 = j0 + 8;
    const float sl2 = scale * kLog2e;
    const int nqt = (T + kTile - 1) / kTile;
    const int qt1 = window > 0 ? min(nqt - 1, (kt * kTile + kTile - 1 + window - 1) / kTile) : nqt - 1;
    float dka[8][4], dva[8][4];
    zero(dka), zero(dva);
    for (int hq = hk * G; hq < hk * G + G; hq++) {
        const float *qb = q + (int64_t)b * T * qd + hq * kD, *db = dO + (int64_t)b * T * qd + hq * kD;
        const float *lb = lse + ((int64_t)b * H + hq) * T, *eb = delta + (int64_t)b * T * H + hq;   /* row i at i·H */
        for (int qt = kt; qt <= qt1; qt++) {
            __syncthreads();
            tile_load<kD, F16, BF16>(Qs, Qt, qb, qd, qt * kTile, T);
            tile_load<kD, BF16, BF16>(Ds, Dt, db, qd, qt * kTile, T);
            if (threadIdx.x < kTile) {
                const int i = qt * kTile + threadIdx.x;
                lse_s[threadIdx.x] = i < T ? lb[i] : 0.0f, del_s[threadIdx.x] = i < T ? eb[(int64_t)i * H] : 0.0f;
            }
            __syncthreads();
            float p[8][4], dp[8][4];
            zero(p), zero(dp);
            mma_rows<F16>(p, kf, Qs, kLds, lane);     /* Sᵀ: row key, column query */
            mma_rows<BF16>(dp, vf, Ds, kLds, lane);   /* dPᵀ */
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nt * 8 + 2 * c + (e & 1), i = qt * kTile + qi, j = e < 2 ? j0 : j1;
                    const float pe = visible(i, j, T, window) && j < T
                                         ? ex2(fmaf(p[nt][e], sl2, -lse_s[qi] * kLog2e)) : 0.0f;
                    p[nt][e] = pe;
                    dp[nt][e] = pe * (dp[nt][e] - del_s[qi]);
                }
            uint32_t af[4][4];
            acc_as_a<BF16>(af, p);
            mma_rows<BF16>(dva, af, Dt, kLdT, lane);   /* dV += Pᵀ dO */
            acc_as_a<BF16>(af, dp);
            mma_rows<BF16>(dka, af, Qt, kLdT, lane);   /* dK += dSᵀ Q */
        }
    }
    store_rows(dk + (int64_t)b * T * kvd + hk * kD, kvd, kt * kTile + w * 16, T, dka, scale, scale, lane);
    store_rows(dv + (int64_t)b * T * kvd + hk * kD, kvd, kt * kTile + w * 16, T, dva, 1.0f, 1.0f, lane);
}

__global__ void __launch_bounds__(kThr) flash_dq_kernel(const float *q, const float *k, const float *v,
                                                        const float *dO, const float *lse, const float *delta,
                                                        const float *kbar, float *dq, int T, int H, int Hk, int window,
                                                        float scale) {
    __shared__ __align__(16) h16 Ks[kTile * kLds], Kt[kTile * kLds], Vs[kTile * kLds];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *qb = q + (int64_t)b * T * qd + h * kD, *db = dO + (int64_t)b * T * qd + h * kD;
    const float *kb = k + (int64_t)b * T * kvd + hk * kD, *vb = v + (int64_t)b * T * kvd + hk * kD;
    tile_load<kD, F16, F16>(Ks, NULL, qb, qd, qt * kTile, T);
    tile_load<kD, BF16, BF16>(Vs, NULL, db, qd, qt * kTile, T);
    __syncthreads();
    uint32_t qf[4][4], df[4][4];
    a_frags(qf, Ks, kLds, w * 16, lane);
    a_frags(df, Vs, kLds, w * 16, lane);
    const int i0 = qt * kTile + w * 16 + g, i1 = i0 + 8;
    const float *lb = lse + ((int64_t)b * H + h) * T, *eb = delta + (int64_t)b * T * H + h;   /* row i at i·H */
    const float l0 = i0 < T ? lb[i0] * kLog2e : 0.0f, l1 = i1 < T ? lb[i1] * kLog2e : 0.0f;
    const float d0 = i0 < T ? eb[(int64_t)i0 * H] : 0.0f, d1 = i1 < T ? eb[(int64_t)i1 * H] : 0.0f;
    const float sl2 = scale * kLog2e;
    float dqa[8][4];
    zero(dqa);
    const int kt0 = window > 0 ? max(0, qt * kTile - window + 1) / kTile : 0;
    for (int kt = kt0; kt <= qt; kt++) {
        __syncthreads();
        tile_load<kD, F16, BF16>(Ks, Kt, kb, kvd, kt * kTile, T, kbar + ((int64_t)b * Hk + hk) * kD);   /* Kt: K − kbar */
        tile_load<kD, BF16, BF16>(Vs, NULL, vb, kvd, kt * kTile, T);
        __syncthreads();
        float p[8][4], dp[8][4];
        zero(p), zero(dp);
        mma_rows<F16>(p, qf, Ks, kLds, lane);    /* S */
        mma_rows<BF16>(dp, df, Vs, kLds, lane);  /* dP = dO Vᵀ */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = e < 2 ? i0 : i1, j = kt * kTile + nt * 8 + 2 * c + (e & 1);
                const float pe = visible(i, j, T, window) ? ex2(fmaf(p[nt][e], sl2, -(e < 2 ? l0 : l1))) : 0.0f;
                dp[nt][e] = pe * (dp[nt][e] - (e < 2 ? d0 : d1));
            }
        uint32_t af[4][4];
        acc_as_a<BF16>(af, dp);
        mma_rows<BF16>(dqa, af, Kt, kLdT, lane);   /* dQ += dS K */
    }
    store_rows(dq + (int64_t)b * T * qd + h * kD, qd, qt * kTile + w * 16, T, dqa, scale, scale, lane);
}

int check_args(int B, int T, int H, int Hk, int D, still_err *err) {
    if (D != kD || B <= 0 || T <= 0 || Hk <= 0 || H % Hk != 0)
        return stc_fail(err, STILL_E_UNSUPPORTED, "fused training attention: head dim %d, %d/%d heads (takes head dim %d)",
                        D, H, Hk, kD);
    return STILL_OK;
}

}   // namespace

int stc_flash_train_fwd(stc_ctx *ctx, const float *q, const float *k, const float *v, int B, int T, int H, int Hk,
                        int D, int window, float *o, float *lse, still_err *err) {
    STC_ENTER(ctx, err);
    const int bad = check_args(B, T, H, Hk, D, err);
    if (bad) return bad;
    flash_fwd_kernel<<<dim3((unsigned)((T + kTile - 1) / kTile), (unsigned)H, (unsigned)B), kThr, 0, ctx->stream>>>(
        q, k, v, o, lse, T, H, Hk, window, attn_logit_scale(D));
    STC_LAUNCHED(err, "flash_fwd_kernel");
    return STILL_OK;
}

int stc_flash_train_bwd(stc_ctx *ctx, const float *q, const float *k, const float *v, const float *o,
                        const float *dO, const float *lse, int B, int T, int H, int Hk, int D, int window,
                        float *delta, float *kbar, float *dq, float *dk, float *dv, still_err *err) {
    STC_ENTER(ctx, err);
    const int bad = check_args(B, T, H, Hk, D, err);
    if (bad) return bad;
    const float scale = attn_logit_scale(D);
    /* δ = rowsum(dO ⊙ O): every (token, head) row of 64 is one row of [B·T·H][64] */
    const int rc = stc_rowdot(ctx, o, kD, dO, kD, B * T * H, kD, delta, err);
    if (rc) return rc;
    const unsigned nt = (unsigned)((T + kTile - 1) / kTile);
    flash_dkv_kernel<<<dim3(nt, (unsigned)Hk, (unsigned)B), kThr, 0, ctx->stream>>>(q, k, v, dO, lse, delta, dk, dv, T,
                                                                                   H, Hk, window, scale);
    STC_LAUNCHED(err, "flash_dkv_kernel");
    key_mean_kernel<<<dim3((unsigned)B, (unsigned)Hk), kD, 0, ctx->stream>>>(k, T, Hk, kbar);
    STC_LAUNCHED(err, "key_mean_kernel");
    flash_dq_kernel<<<dim3(nt, (unsigned)H, (unsigned)B), kThr, 0, ctx->stream>>>(q, k, v, dO, lse, delta, kbar, dq, T,
                                                                                 H, Hk, window, scale);
    STC_LAUNCHED(err, "flash_dq_kernel");
    return STILL_OK;
}
