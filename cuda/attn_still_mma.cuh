/* The feature map and the linear branch's products on the tensor cores, for
 * the chunk-parallel still kernels (attn_still_linear.cu: φq and φqᵀS;
 * attn_still_leave.cu: φk and ΔS = Φᵀ V). A block of 256 threads (8 warps)
 * takes a tile of 64 rows.
 *
 * Precision. The products of φ with S or V are "bf16x3": each fp32 operand
 * x is split into hi = bf16(x) and lo = bf16(x - hi) (16 bits of mantissa
 * together) and a·b is taken as hi·hi + hi·lo + lo·hi on mma.m16n8k16 with
 * fp32 accumulation: relative errors of about 1e-5, harmless in a weighted
 * sum with weights in [0, 1]. z = W x̃ needs more: the NP-Map rescales z to
 * ‖x‖ and takes its softmax, so an error of 1e-5 relative becomes 1e-5 ‖x‖
 * in the logits (1e-3 for ‖x‖ = 100); the trained model's logits moved
 * measurably with it (tests/cuda/test_model_cuda.c). So x̃ and W are split
 * in three (hi, mid, lo: 24 bits) and z is the six products down to 2^-18
 * (hi·hi, hi·mid, mid·hi, hi·lo, lo·hi, mid·mid): about fp32's accuracy.
 * The fp32 CUDA-core version (attn_still_fmap.cuh's npmap_warp) stays in
 * the decode step and in the leave kernel's head-dim-128 path (the
 * training backward has tile products of its own, attn_still_backward.cu);
 * here it was bound by shared-memory loads (two per multiply-add of
 * z = W x̃).
 *
 * NP-Map of a row x (attn_still_fmap.cuh; spec "NP-Map"): x̃ = x - f u with
 * f = 2 (x·u)/(u·u), z = W x̃ (a 64×D by D×D product for the tile, here),
 * z ← z ‖x‖ / max(‖z‖, 1e-12), φ = softmax(z) ⊕ softmax(-z), each entry at
 * least 1e-12. Lolcats' Hedgehog map: z = x W, no reflection, no rescaling.
 *
 * Shared tiles of bf16 use attn_layout.cuh's swizzle (16-byte chunk c of row
 * r at chunk c ^ (r & 7)), so ldmatrix reads them without bank conflicts;
 * a lane owns E = D/32 consecutive elements of a row in the row phases. */
#ifndef STILL_CUDA_ATTN_STILL_MMA_CUH
#define STILL_CUDA_ATTN_STILL_MMA_CUH

#include "attn_layout.cuh"
#include "attn_still_fmap.cuh"
#include "mma_ptx.cuh"

namespace stillk {
namespace tc {

using namespace stc_ptx;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;   /* rows of a tile */

/* Bytes of a hi/lo pair of bf16 tiles [rows][cols]. */
__host__ __device__ constexpr int hl_bytes(int rows, int cols) { return 2 * rows * cols * 2; }
/* Bytes of three bf16 tiles [rows][cols] (hi, mid, lo). */
__host__ __device__ constexpr int h3_bytes(int rows, int cols) { return 3 * rows * cols * 2; }
/* Bytes of the x̃ tiles (three, [64][D]) and, in the same place afterwards, z (fp32 [64][D + 4]). */
__host__ __device__ constexpr int xz_bytes(int D) {
    return h3_bytes(kTile, D) > kTile * (D + 4) * 4 ? h3_bytes(kTile, D) : kTile * (D + 4) * 4;
}

/* a, b -> bf16x2 hi and the bf16x2 of the remainders lo. */
__device__ __forceinline__ void split_pair(float a, float b, uint32_t &hi, uint32_t &lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<const uint32_t *>(&h);
    lo = pack_bf16(a - hf.x, b - hf.y);
}

/* a, b -> bf16x2 of hi, mid and lo, a = hi + mid + lo to 24 bits. */
__device__ __forceinline__ void split3_pair(float a, float b, uint32_t &hi, uint32_t &mid, uint32_t &lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 hf = __bfloat1622float2(h);
    const float ra = a - hf.x, rb = b - hf.y;
    const __nv_bfloat162 m = __floats2bfloat162_rn(ra, rb);
    const float2 mf = __bfloat1622float2(m);
    hi = *reinterpret_cast<const uint32_t *>(&h);
    mid = *reinterpret_cast<const uint32_t *>(&m);
    lo = pack_bf16(ra - mf.x, rb - mf.y);
}

/* Byte offset of element (row, col) (col even) in a swizzled tile of CH chunks a row. */
__device__ __forceinline__ int hl_off(int row, int col, int CH) {
    return stc_attn::swz_off(row, col >> 3, CH) + (col & 7) * 2;
}

/* Stores the pair (a, b) at (row, col) of the tiles hi and lo (col even). */
__device__ __forceinline__ void store_pair(unsigned char *hi, unsigned char *lo, int row, int col, int CH, float a,
                                           float b) {
    uint32_t h, l;
    split_pair(a, b, h, l);
    const int off = hl_off(row, col, CH);
    *reinterpret_cast<uint32_t *>(hi + off) = h;
    *reinterpret_cast<uint32_t *>(lo + off) = l;
}

/* The pair (a, b) at (row, col) of the three tiles at t, t + stride, t + 2 stride (col even). */
__device__ __forceinline__ void store_triple(unsigned char *t, int stride, int row, int col, int CH, float a, float b) {
    uint32_t h, m, l;
    split3_pair(a, b, h, m, l);
    const int off = hl_off(row, col, CH);
    *reinterpret_cast<uint32_t *>(t + off) = h;
    *reinterpret_cast<uint32_t *>(t + stride + off) = m;
    *reinterpret_cast<uint32_t *>(t + 2 * stride + off) = l;
}

/* c += a·b in bf16x3 for one m16n8 tile: (ah, al) the A fragment's hi and lo, (bh0, bh1), (bl0, bl1) B's. */
__device__ __forceinline__ void mma3(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                     uint32_t bh1, uint32_t bl0, uint32_t bl1) {
    mma_bf16(c, al, bh0, bh1);
    mma_bf16(c, ah, bl0, bl1);
    mma_bf16(c, ah, bh0, bh1);
}

/* Head h's map of one side (0: q, 1: k) into shared memory: W as the B
 * operand of z = x̃ Wᵀ, element (n, k) = W[n][k] (NP-Map; Hedgehog:
 * W[k][n]) in three tiles [D][D] at Wt (hi, mid, lo; h3_bytes(D, D) in
 * all); u (zero for Hedgehog) into us. The caller synchronises. */
template <int D>
__device__ __forceinline__ void fmap_load_3(const args &a, int side, int h, unsigned char *Wt, float *us) {
    constexpr int CH = D / 8;
    const float *W = a.params + (side ? par_k_w(a, h) : par_q_w(a, h));
    for (int e = threadIdx.x; e < D * D / 2; e += blockDim.x) {
        const int n = e / (D / 2), k = 2 * (e % (D / 2));
        float x0, x1;
        if (!a.lolcats) {
            const float2 w = *reinterpret_cast<const float2 *>(W + (size_t)n * D + k);
            x0 = w.x, x1 = w.y;
        } else {
            x0 = W[(size_t)k * D + n], x1 = W[(size_t)(k + 1) * D + n];
        }
        store_triple(Wt, D * D * 2, n, k, CH, x0, x1);
    }
    const float *u = a.params + (side ? par_k_u(a, h) : par_q_u(a, h));
    for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = a.lolcats ? 0.0f : u[e];
}

/* E consecutive floats from global memory (16- or 8-byte aligned). */
template <int E>
__device__ __forceinline__ void load_e(const float *p, float (&v)[E]) {
    if constexpr (E == 4) {
        const float4 t = *reinterpret_cast<const float4 *>(p);
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
        static_assert(E == 2, "head dim 64 or 128");
        const float2 t = *reinterpret_cast<const float2 *>(p);
        v[0] = t.x, v[1] = t.y;
    }
}

/* Phase 1 of a tile: for rows r = 0 .. 63, x = row(r) (global, D floats;
 * NULL: no row, Φ will be zero), x̃ into three tiles [64][D] at Xt (hi,
 * mid, lo) and ‖x‖ into nx[r] (-1 for no row). uu = u·u. */
template <int D, class RowFn>
__device__ __forceinline__ void npmap_reflect(RowFn row, const float *us, float uu, unsigned char *Xt, float *nx) {
    constexpr int E = D / 32, CH = D / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = lane * E;
    float uv[E];
#pragma unroll
    for (int i = 0; i < E; i++) uv[i] = us[c0 + i];
    for (int r = warp; r < kTile; r += kWarps) {
        const float *x = row(r);
        float xv[E];
        if (x) {
            load_e<E>(x + c0, xv);
        } else {
#pragma unroll
            for (int i = 0; i < E; i++) xv[i] = 0.0f;
        }
        float xu = 0.0f, xx = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) xu = fmaf(xv[i], uv[i], xu), xx = fmaf(xv[i], xv[i], xx);
        xu = warp_sum(xu);
        xx = warp_sum(xx);
        const float f = uu > 0.0f ? 2.0f * xu / uu : 0.0f;
#pragma unroll
        for (int i = 0; i < E; i += 2)
            store_triple(Xt, kTile * D * 2, r, c0 + i, CH, xv[i] - f * uv[i], xv[i + 1] - f * uv[i + 1]);
        if (lane == 0) nx[r] = x ? sqrtf(xx) : -1.0f;
    }
}

/* Phase 2: z = x̃ Wᵀ for the tile (six products of the three-way splits),
 * written as fp32 [64][D + 4] over the x̃ tiles at XZ. Warp w: rows
 * 16 (w & 3), columns (w >> 2) D/2 onwards. Synchronises before and after. */
template <int D>
__device__ __forceinline__ void npmap_project_tc(unsigned char *XZ, const unsigned char *Wt) {
    constexpr int CH = D / 8, KS = D / 16, NT = D / 16;   /* n8 tiles per warp: D/2 columns */
    constexpr int ZLD = D + 4;
    constexpr uint32_t XS = kTile * D * 2, WSD = D * D * 2;   /* bytes between the three tiles */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = 16 * (warp & 3), n0 = (warp >> 2) * (D / 2);
    const uint32_t x0 = smem_addr(XZ), w0 = smem_addr(Wt);
    const int a_row = stc_attn::ldm_rowmajor_row(lane), a_chunk = stc_attn::ldm_rowmajor_chunk(lane);
    const int b_row = stc_attn::ldm_nk_row(lane), b_chunk = stc_attn::ldm_nk_chunk(lane);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
    __syncthreads();   /* x̃ and W complete */
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t ah[4], am[4], al[4];
        const int ao = stc_attn::swz_off_add(a_row, a_chunk, m0, 2 * ks, CH);
        ldsm_x4(ah, x0 + ao);
        ldsm_x4(am, x0 + XS + ao);
        ldsm_x4(al, x0 + 2 * XS + ao);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t bh[4], bm[4], bl[4];
            const int bo = stc_attn::swz_off_add(b_row, b_chunk, n0 + 16 * np, 2 * ks, CH);
            ldsm_x4(bh, w0 + bo);
            ldsm_x4(bm, w0 + WSD + bo);
            ldsm_x4(bl, w0 + 2 * WSD + bo);
#pragma unroll
            for (int half = 0; half < 2; half++) {
                float(&c)[4] = acc[2 * np + half];
                const uint32_t h0 = bh[2 * half], h1 = bh[2 * half + 1], m0_ = bm[2 * half], m1 = bm[2 * half + 1];
                mma_bf16(c, al, h0, h1);   /* the small terms first */
                mma_bf16(c, ah, bl[2 * half], bl[2 * half + 1]);
                mma_bf16(c, am, m0_, m1);
                mma_bf16(c, am, h0, h1);
                mma_bf16(c, ah, m0_, m1);
                mma_bf16(c, ah, h0, h1);
            }
        }
    }
    __syncthreads();   /* every warp is done with x̃ */
    float *Z = reinterpret_cast<float *>(XZ);
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = m0 + stc_attn::acc_row(lane, 2 * hh), c = n0 + 8 * nt + stc_attn::acc_col(lane, 0);
            *reinterpret_cast<float2 *>(Z + r * ZLD + c) = make_float2(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
        }
    __syncthreads();
}

/* Phase 3: φ of each row from z (fp32 [64][D + 4] at Z) and nx; the warp of
 * row r calls sink(r, p1, p2, valid) with the lane's entries of softmax(z)
 * (columns lane E ..) and softmax(-z) (columns D + lane E ..), zero for a
 * row without input. */
template <int D, class Sink>
__device__ __forceinline__ void npmap_finish(const float *Z, const float *nx, bool hedgehog, Sink sink) {
    constexpr int E = D / 32, ZLD = D + 4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = lane * E;
    for (int r = warp; r < kTile; r += kWarps) {
        float p1[E], p2[E];
        const float n_x = nx[r];
        if (n_x < 0.0f) {   /* uniform over the warp */
#pragma unroll
            for (int i = 0; i < E; i++) p1[i] = p2[i] = 0.0f;
            sink(r, p1, p2, false);
            continue;
        }
        float z[E], zz = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) z[i] = Z[r * ZLD + c0 + i], zz = fmaf(z[i], z[i], zz);
        const float nz = sqrtf(warp_sum(zz));
        const float sc = hedgehog ? 1.0f : n_x / (nz > kNormFloor ? nz : kNormFloor);
        float mx = -INFINITY, mn = INFINITY;
#pragma unroll
        for (int i = 0; i < E; i++) {
            z[i] *= sc;
            mx = fmaxf(mx, z[i]);
            mn = fminf(mn, z[i]);
        }
        mx = warp_max(mx);
        mn = warp_min(mn);
        float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) {
            p1[i] = expf(z[i] - mx);
            p2[i] = expf(-z[i] + mn);
            s1 += p1[i];
            s2 += p2[i];
        }
        const float i1 = 1.0f / warp_sum(s1), i2 = 1.0f / warp_sum(s2);
#pragma unroll
        for (int i = 0; i < E; i++) p1[i] = fmaxf(p1[i] * i1, kFmapClamp), p2[i] = fmaxf(p2[i] * i2, kFmapClamp);
        sink(r, p1, p2, true);
    }
}

/* Stores a lane's φ entries of row r into the tiles Ph, Pl [rows][2D]. */
template <int D>
__device__ __forceinline__ void store_phi(unsigned char *Ph, unsigned char *Pl, int r, const float (&p1)[D / 32],
                                          const float (&p2)[D / 32]) {
    constexpr int E = D / 32, CHP = 2 * D / 8;
    const int c0 = (threadIdx.x & 31) * E;
#pragma unroll
    for (int i = 0; i < E; i += 2) {
        store_pair(Ph, Pl, r, c0 + i, CHP, p1[i], p1[i + 1]);
        store_pair(Ph, Pl, r, D + c0 + i, CHP, p2[i], p2[i + 1]);
    }
}

}   // namespace tc
}   // namespace stillk

#endif
