/* Softmax (and swa) attention for training, fused: the forward keeps each row's log-sum-exp, the backward
 * recomputes the probabilities tile by tile from it, so no T × T matrix is ever stored. Head dim 64, bf16
 * mma.sync m16n8k16 with fp32 accumulators; q, k, v, o and their gradients fp32 where the trainer keeps them
 * ([B·T][H·D] and [B·T][Hk·D], row-major). Per (sequence, head), with s = 1/√D:
 *   P = softmax(s Q Kᵀ) (causal; swa: also key > query − window), O = P V, lse = log Σ exp(s Q Kᵀ)
 *   δ = rowsum(dO ⊙ O), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − δ), dQ = s dS K, dK = s dSᵀ Q.
 * Three kernels, no atomics (the same inputs give the same bits, as a replayed graph must):
 *   fwd:  a block per 64 query rows of one head, key tiles in order, online softmax;
 *   dkv:  a block per 64 keys of one KV head, over its G query heads and their query tiles;
 *   dq:   a block per 64 query rows of one head, over the key tiles.
 * Fragment layouts (PTX ISA, m16n8k16; g = lane / 4, c = lane % 4): A a0 = (r g, k 2c..2c+1), a1 = (g + 8, 2c),
 * a2 = (g, 2c + 8), a3 = (g + 8, 2c + 8); B b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g); C c0,c1 = (g, 2c..),
 * c2,c3 = (g + 8, 2c..). Tiles sit in shared memory as bf16 rows of 72 (64 + 8: the 32 lanes' 32-bit loads fall
 * in 32 banks); a B operand whose k runs down a row-major tile's rows is read from a transposed copy. */
#include "mma_ptx.cuh"
#include "cuda_common.cuh"

#include <math.h>

using namespace stc_ptx;

namespace {

constexpr int kD = 64, kTile = 64, kLds = 72, kThr = 128;
constexpr float kLog2e = 1.4426950408889634f;

typedef __nv_bfloat16 bf;

/* Rows row0 .. row0 + 63 of src (row stride ld floats, 64 columns), rows >= n as zeros, into dst [64][kLds] as
 * bf16, and (dstT non-NULL) transposed into dstT [64 columns][kLds]. */
__device__ __forceinline__ void tile_load(bf *dst, bf *dstT, const float *src, int64_t ld, int row0, int n) {
    for (int i = threadIdx.x; i < kTile * kD / 4; i += kThr) {
        const int r = i >> 4, c = (i & 15) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row0 + r < n) v = *reinterpret_cast<const float4 *>(src + (int64_t)(row0 + r) * ld + c);
        if (dst) {
            uint2 p = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
            *reinterpret_cast<uint2 *>(dst + r * kLds + c) = p;
        }
        if (dstT) {
            dstT[(c + 0) * kLds + r] = __float2bfloat16_rn(v.x);
            dstT[(c + 1) * kLds + r] = __float2bfloat16_rn(v.y);
            dstT[(c + 2) * kLds + r] = __float2bfloat16_rn(v.z);
            dstT[(c + 3) * kLds + r] = __float2bfloat16_rn(v.w);
        }
    }
}

__device__ __forceinline__ uint32_t ld32(const bf *p) { return *reinterpret_cast<const uint32_t *>(p); }

/* The A fragments of rows r0 .. r0 + 15 of a [64][kLds] tile over its 64 columns (4 k-steps). */
__device__ __forceinline__ void a_frags(uint32_t (&f)[4][4], const bf *s, int r0, int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 4; ks++) {
        const bf *p = s + (r0 + g) * kLds + ks * 16 + 2 * c;
        f[ks][0] = ld32(p), f[ks][1] = ld32(p + 8 * kLds), f[ks][2] = ld32(p + 8), f[ks][3] = ld32(p + 8 * kLds + 8);
    }
}

/* acc[nt] += A (16 × 64, fragments) · B, B[k][n] = s[n][k] (n over the tile's 64 rows, 8 n-tiles). */
__device__ __forceinline__ void mma_rows(float (&acc)[8][4], const uint32_t (&a)[4][4], const bf *s, int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int ks = 0; ks < 4; ks++)
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const bf *p = s + (nt * 8 + g) * kLds + ks * 16 + 2 * c;
            mma_bf16(acc[nt], a[ks], ld32(p), ld32(p + 8));
        }
}

/* The accumulators of a 16 × 64 product as the A fragments of the next product over its 64 columns. */
__device__ __forceinline__ void acc_as_a(uint32_t (&f)[4][4], const float (&x)[8][4]) {
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        f[kk][0] = pack_bf16(x[2 * kk][0], x[2 * kk][1]);
        f[kk][1] = pack_bf16(x[2 * kk][2], x[2 * kk][3]);
        f[kk][2] = pack_bf16(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        f[kk][3] = pack_bf16(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

__device__ __forceinline__ void zero(float (&x)[8][4]) {
#pragma unroll
    for (int i = 0; i < 8; i++) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.0f;
}

/* Is key j visible from query i? */
__device__ __forceinline__ bool visible(int i, int j, int T, int window) {
    return j <= i && i < T && (window <= 0 || j > i - window);
}

/* Rows of a 16 × 64 accumulator (row r0 + g (+ 8), columns 2c.. of each n-tile) to dst (row stride ld), rows
 * below n, times f. */
__device__ __forceinline__ void store_rows(float *dst, int64_t ld, int r0, int n, const float (&x)[8][4], float f0,
                                           float f1, int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + g + 8 * h;
        if (r >= n) continue;
        const float f = h ? f1 : f0;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            *reinterpret_cast<float2 *>(dst + (int64_t)r * ld + nt * 8 + 2 * c) =
                make_float2(x[nt][2 * h] * f, x[nt][2 * h + 1] * f);
    }
}

__global__ void __launch_bounds__(kThr) flash_fwd_kernel(const float *q, const float *k, const float *v, float *o,
                                                         float *lse, int T, int H, int Hk, int window, float scale) {
    __shared__ __align__(16) bf Qs[kTile * kLds], Ks[kTile * kLds], Vt[kTile * kLds];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *qb = q + (int64_t)b * T * qd + h * kD, *kb = k + (int64_t)b * T * kvd + hk * kD,
                *vb = v + (int64_t)b * T * kvd + hk * kD;
    tile_load(Qs, NULL, qb, qd, qt * kTile, T);
    __syncthreads();
    uint32_t qf[4][4];
    a_frags(qf, Qs, w * 16, lane);
    const int i0 = qt * kTile + w * 16 + g, i1 = i0 + 8;
    const float sl2 = scale * kLog2e;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[8][4];
    zero(acc);
    const int kt0 = window > 0 ? max(0, qt * kTile - window + 1) / kTile : 0;
    for (int kt = kt0; kt <= qt; kt++) {
        __syncthreads();
        tile_load(Ks, NULL, kb, kvd, kt * kTile, T);
        tile_load(NULL, Vt, vb, kvd, kt * kTile, T);
        __syncthreads();
        float s[8][4];
        zero(s);
        mma_rows(s, qf, Ks, lane);
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
        acc_as_a(pf, s);
        mma_rows(acc, pf, Vt, lane);
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
    __shared__ __align__(16) bf Qs[kTile * kLds], Qt[kTile * kLds], Ds[kTile * kLds], Dt[kTile * kLds];
    __shared__ float lse_s[kTile], del_s[kTile];
    const int kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, G = H / Hk;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *kb = k + (int64_t)b * T * kvd + hk * kD, *vb = v + (int64_t)b * T * kvd + hk * kD;
    /* this warp's 16 keys as A fragments (K for Sᵀ = K Qᵀ, V for dPᵀ = V dOᵀ) */
    tile_load(Qs, NULL, kb, kvd, kt * kTile, T);
    tile_load(Ds, NULL, vb, kvd, kt * kTile, T);
    __syncthreads();
    uint32_t kf[4][4], vf[4][4];
    a_frags(kf, Qs, w * 16, lane);
    a_frags(vf, Ds, w * 16, lane);
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
            tile_load(Qs, Qt, qb, qd, qt * kTile, T);
            tile_load(Ds, Dt, db, qd, qt * kTile, T);
            if (threadIdx.x < kTile) {
                const int i = qt * kTile + threadIdx.x;
                lse_s[threadIdx.x] = i < T ? lb[i] : 0.0f, del_s[threadIdx.x] = i < T ? eb[(int64_t)i * H] : 0.0f;
            }
            __syncthreads();
            float p[8][4], dp[8][4];
            zero(p), zero(dp);
            mma_rows(p, kf, Qs, lane);    /* Sᵀ: row key, column query */
            mma_rows(dp, vf, Ds, lane);   /* dPᵀ */
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
            acc_as_a(af, p);
            mma_rows(dva, af, Dt, lane);   /* dV += Pᵀ dO */
            acc_as_a(af, dp);
            mma_rows(dka, af, Qt, lane);   /* dK += dSᵀ Q */
        }
    }
    store_rows(dk + (int64_t)b * T * kvd + hk * kD, kvd, kt * kTile + w * 16, T, dka, scale, scale, lane);
    store_rows(dv + (int64_t)b * T * kvd + hk * kD, kvd, kt * kTile + w * 16, T, dva, 1.0f, 1.0f, lane);
}

__global__ void __launch_bounds__(kThr) flash_dq_kernel(const float *q, const float *k, const float *v,
                                                        const float *dO, const float *lse, const float *delta,
                                                        float *dq, int T, int H, int Hk, int window, float scale) {
    __shared__ __align__(16) bf Ks[kTile * kLds], Kt[kTile * kLds], Vs[kTile * kLds];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hk);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)H * kD, kvd = (int64_t)Hk * kD;
    const float *qb = q + (int64_t)b * T * qd + h * kD, *db = dO + (int64_t)b * T * qd + h * kD;
    const float *kb = k + (int64_t)b * T * kvd + hk * kD, *vb = v + (int64_t)b * T * kvd + hk * kD;
    tile_load(Ks, NULL, qb, qd, qt * kTile, T);
    tile_load(Vs, NULL, db, qd, qt * kTile, T);
    __syncthreads();
    uint32_t qf[4][4], df[4][4];
    a_frags(qf, Ks, w * 16, lane);
    a_frags(df, Vs, w * 16, lane);
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
        tile_load(Ks, Kt, kb, kvd, kt * kTile, T);
        tile_load(Vs, NULL, vb, kvd, kt * kTile, T);
        __syncthreads();
        float p[8][4], dp[8][4];
        zero(p), zero(dp);
        mma_rows(p, qf, Ks, lane);   /* S */
        mma_rows(dp, df, Vs, lane);  /* dP = dO Vᵀ */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int i = e < 2 ? i0 : i1, j = kt * kTile + nt * 8 + 2 * c + (e & 1);
                const float pe = visible(i, j, T, window) ? ex2(fmaf(p[nt][e], sl2, -(e < 2 ? l0 : l1))) : 0.0f;
                dp[nt][e] = pe * (dp[nt][e] - (e < 2 ? d0 : d1));
            }
        uint32_t af[4][4];
        acc_as_a(af, dp);
        mma_rows(dqa, af, Kt, lane);   /* dQ += dS K */
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
        q, k, v, o, lse, T, H, Hk, window, 1.0f / sqrtf((float)D));
    STC_LAUNCHED(err, "flash_fwd_kernel");
    return STILL_OK;
}

int stc_flash_train_bwd(stc_ctx *ctx, const float *q, const float *k, const float *v, const float *o,
                        const float *dO, const float *lse, int B, int T, int H, int Hk, int D, int window,
                        float *delta, float *dq, float *dk, float *dv, still_err *err) {
    STC_ENTER(ctx, err);
    const int bad = check_args(B, T, H, Hk, D, err);
    if (bad) return bad;
    const float scale = 1.0f / sqrtf((float)D);
    /* δ = rowsum(dO ⊙ O): every (token, head) row of 64 is one row of [B·T·H][64] */
    const int rc = stc_rowdot(ctx, o, kD, dO, kD, B * T * H, kD, delta, err);
    if (rc) return rc;
    const unsigned nt = (unsigned)((T + kTile - 1) / kTile);
    flash_dkv_kernel<<<dim3(nt, (unsigned)Hk, (unsigned)B), kThr, 0, ctx->stream>>>(q, k, v, dO, lse, delta, dk, dv, T,
                                                                                   H, Hk, window, scale);
    STC_LAUNCHED(err, "flash_dkv_kernel");
    flash_dq_kernel<<<dim3(nt, (unsigned)H, (unsigned)B), kThr, 0, ctx->stream>>>(q, k, v, dO, lse, delta, dq, T, H,
                                                                                 Hk, window, scale);
    STC_LAUNCHED(err, "flash_dq_kernel");
    return STILL_OK;
}
