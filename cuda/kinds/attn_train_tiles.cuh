/* Tiles and tensor-core steps shared by the fused training attentions (cuda/kinds/softmax/attn_softmax_train.cu,
 * cuda/kinds/still/attn_still_train.cu): 64-row tiles of fp32 rows copied into shared memory as 16-bit values (bf16 or IEEE
 * half, the product's choice), and mma.sync m16n8k16 with fp32 accumulators over them. A block has 4 warps; warp w
 * owns rows 16 w .. 16 w + 15 of the block's 64.
 *
 * Fragment layouts (PTX ISA, m16n8k16; g = lane / 4, c = lane % 4): A a0 = (row g, k 2c..2c+1), a1 = (g + 8, 2c),
 * a2 = (g, 2c + 8), a3 = (g + 8, 2c + 8); B b0 = (k 2c..2c+1, n g), b1 = (k 2c + 8.., n g); C c0,c1 = (g, 2c..),
 * c2,c3 = (g + 8, 2c..). A tile of NC columns sits as rows of NC + 8 values (the 32 lanes' 32-bit loads fall in 32
 * banks); a B operand whose k runs down a row-major tile's rows is read from a transposed copy (NC rows of 72). */
#ifndef STILL_CUDA_ATTN_TRAIN_TILES_CUH
#define STILL_CUDA_ATTN_TRAIN_TILES_CUH

#include "common/mma_ptx.cuh"

#include <stdint.h>

namespace stc_tiles {

using namespace stc_ptx;

constexpr int kRows = 64, kThr = 128, kLdT = kRows + 8;   /* tile rows, threads a block, a transposed tile's row */
typedef uint16_t h16;                                      /* a bf16 or half value, as stored */

enum Prec { BF16 = 0, F16 = 1 };

template <Prec P> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    return P == F16 ? pack_f16(lo, hi) : pack_bf16(lo, hi);
}
template <Prec P> __device__ __forceinline__ h16 one(float x) { return (h16)(pack2<P>(x, 0.0f) & 0xffffu); }

/* Tile row r (0 .. 63) comes from src row rows(r) (row stride ld floats, NC columns, 16-byte aligned rows; rows(r)
 * < 0: zeros) into dst [64][NC + 8] as PA values and (dstT non-NULL) transposed into dstT [NC][kLdT] as PT values;
 * subT (NC floats, optional) subtracted from the rows read in the transposed copy only. */
template <int NC, Prec PA, Prec PT, typename RowOf>
__device__ __forceinline__ void tile_copy(h16 *dst, h16 *dstT, const float *src, int64_t ld, RowOf rows,
                                          const float *subT) {
    constexpr int lds = NC + 8, q4 = NC / 4;
    /* 32 consecutive i: 8 rows × 4 float4 (16 columns), so that the transposed 16-bit stores of a warp fall in
     * runs of 8 consecutive rows (2-way bank conflicts, where one float4 per row across a warp made them 16-way) */
    for (int i = threadIdx.x; i < kRows * q4; i += kThr) {
        const int blk = i >> 5, lane = i & 31, r = (blk & 7) * 8 + (lane & 7), c = (blk >> 3) * 16 + (lane >> 3) * 4;
        const int64_t sr = rows(r);
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (sr >= 0) v = *reinterpret_cast<const float4 *>(src + sr * ld + c);
        if (dst) *reinterpret_cast<uint2 *>(dst + r * lds + c) = make_uint2(pack2<PA>(v.x, v.y), pack2<PA>(v.z, v.w));
        if (dstT && subT && sr >= 0) {
            const float4 m = *reinterpret_cast<const float4 *>(subT + c);
            v.x -= m.x, v.y -= m.y, v.z -= m.z, v.w -= m.w;
        }
        if (dstT) {
            dstT[(c + 0) * kLdT + r] = one<PT>(v.x);
            dstT[(c + 1) * kLdT + r] = one<PT>(v.y);
            dstT[(c + 2) * kLdT + r] = one<PT>(v.z);
            dstT[(c + 3) * kLdT + r] = one<PT>(v.w);
        }
    }
}

/* Rows row0 .. row0 + 63, rows >= n as zeros. */
template <int NC, Prec PA, Prec PT>
__device__ __forceinline__ void tile_load(h16 *dst, h16 *dstT, const float *src, int64_t ld, int row0, int n,
                                          const float *subT = nullptr) {
    tile_copy<NC, PA, PT>(dst, dstT, src, ld, [=](int r) -> int64_t { return row0 + r < n ? row0 + r : -1; }, subT);
}

/* Rows idx[0 .. cnt − 1] (a gathered tile), the rest zeros. */
template <int NC, Prec PA, Prec PT>
__device__ __forceinline__ void tile_gather(h16 *dst, h16 *dstT, const float *src, int64_t ld, const int *idx, int cnt,
                                            const float *subT = nullptr) {
    tile_copy<NC, PA, PT>(dst, dstT, src, ld, [=](int r) -> int64_t { return r < cnt ? idx[r] : -1; }, subT);
}

__device__ __forceinline__ uint32_t ld32(const h16 *p) { return *reinterpret_cast<const uint32_t *>(p); }

/* The A fragments of rows r0 .. r0 + 15 of a tile (row stride lds) over its first 16 NK columns. */
template <int NK>
__device__ __forceinline__ void a_frags(uint32_t (&f)[NK][4], const h16 *s, int lds, int r0, int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int ks = 0; ks < NK; ks++) {
        const h16 *p = s + (r0 + g) * lds + ks * 16 + 2 * c;
        f[ks][0] = ld32(p), f[ks][1] = ld32(p + 8 * lds), f[ks][2] = ld32(p + 8), f[ks][3] = ld32(p + 8 * lds + 8);
    }
}

template <Prec P> __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if (P == F16) mma_f16(c, a, b0, b1);
    else mma_bf16(c, a, b0, b1);
}

/* acc[nt] += A (16 × 16 NK, fragments) · B, B[k][n] = s[n][k] (n over 8 NN rows of s, row stride lds). */
template <Prec P, int NK, int NN>
__device__ __forceinline__ void mma_rows(float (&acc)[NN][4], const uint32_t (&a)[NK][4], const h16 *s, int lds,
                                         int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int ks = 0; ks < NK; ks++)
#pragma unroll
        for (int nt = 0; nt < NN; nt++) {
            const h16 *p = s + (nt * 8 + g) * lds + ks * 16 + 2 * c;
            mma<P>(acc[nt], a[ks], ld32(p), ld32(p + 8));
        }
}

/* The same with A read from shared memory a k-step at a time (rows r0 .. r0 + 15 of As, row stride ldA). */
template <Prec P, int NK, int NN>
__device__ __forceinline__ void mma_ss(float (&acc)[NN][4], const h16 *As, int ldA, int r0, const h16 *s, int lds,
                                       int lane) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int ks = 0; ks < NK; ks++) {
        uint32_t a[4];
        const h16 *pa = As + (r0 + g) * ldA + ks * 16 + 2 * c;
        a[0] = ld32(pa), a[1] = ld32(pa + 8 * ldA), a[2] = ld32(pa + 8), a[3] = ld32(pa + 8 * ldA + 8);
#pragma unroll
        for (int nt = 0; nt < NN; nt++) {
            const h16 *p = s + (nt * 8 + g) * lds + ks * 16 + 2 * c;
            mma<P>(acc[nt], a, ld32(p), ld32(p + 8));
        }
    }
}

/* The accumulators of a 16 × 8 NN product as the A fragments of the next product over its 8 NN columns. */
template <Prec P, int NN>
__device__ __forceinline__ void acc_as_a(uint32_t (&f)[NN / 2][4], const float (&x)[NN][4]) {
#pragma unroll
    for (int kk = 0; kk < NN / 2; kk++) {
        f[kk][0] = pack2<P>(x[2 * kk][0], x[2 * kk][1]);
        f[kk][1] = pack2<P>(x[2 * kk][2], x[2 * kk][3]);
        f[kk][2] = pack2<P>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
        f[kk][3] = pack2<P>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
    }
}

template <int NN> __device__ __forceinline__ void zero(float (&x)[NN][4]) {
#pragma unroll
    for (int i = 0; i < NN; i++) x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0.0f;
}

/* Rows of a 16 × 8 NN accumulator (row r0 + g (+ 8), columns 2c.. of each n-tile) to dst (row stride ld), rows
 * below n, times f0 (row g) / f1 (row g + 8); add: dst += instead of dst =. */
template <int NN>
__device__ __forceinline__ void store_rows(float *dst, int64_t ld, int r0, int n, const float (&x)[NN][4], float f0,
                                           float f1, int lane, bool add = false) {
    const int g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r0 + g + 8 * h;
        if (r >= n) continue;
        const float f = h ? f1 : f0;
#pragma unroll
        for (int nt = 0; nt < NN; nt++) {
            float2 *o = reinterpret_cast<float2 *>(dst + (int64_t)r * ld + nt * 8 + 2 * c);
            float2 v = make_float2(x[nt][2 * h] * f, x[nt][2 * h + 1] * f);
            if (add) v.x += o->x, v.y += o->y;
            *o = v;
        }
    }
}

/* kbar [B][Hk][64] = the mean over the sequence of each KV head's keys (k [B·T][Hk·64]); a block per (sequence, KV
 * head), a thread per channel, summed in order. The attention backward's dQ = s Σ_j dS_ij k_j equals
 * s Σ_j dS_ij (k_j − kbar) because every row of dS sums to zero (the scores of a row may all move by one amount);
 * with the keys' common part taken out, the rounding left in a row's sum of dS no longer multiplies it. */
static __global__ void key_mean_kernel(const float *k, int T, int Hk, float *kbar) {
    const int b = blockIdx.x, hk = blockIdx.y, x = threadIdx.x;
    const float *kb = k + (int64_t)b * T * Hk * 64 + hk * 64 + x;
    float s = 0.0f;
    for (int t = 0; t < T; t++) s += kb[(int64_t)t * Hk * 64];
    kbar[((int64_t)b * Hk + hk) * 64 + x] = s / (float)T;
}

}   // namespace stc_tiles

#endif
