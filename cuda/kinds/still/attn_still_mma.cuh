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
 * in the row phases a row has 8 lanes, each owning E = D/8 consecutive
 * elements (whole 16-byte chunks of the tiles). */
#ifndef STILL_CUDA_ATTN_STILL_MMA_CUH
#define STILL_CUDA_ATTN_STILL_MMA_CUH

#include "kinds/attn_rules.h"
#include "kinds/attn_layout.cuh"
#include "kinds/still/attn_still_fmap.cuh"
#include "common/mma_ptx.cuh"

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

/* c += a·b in bf16x3 for one m16n8 tile: (ah, al) the A fragment's hi and lo, (bh0, bh1), (bl0, bl1) B's. */
__device__ __forceinline__ void mma3(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4], uint32_t bh0,
                                     uint32_t bh1, uint32_t bl0, uint32_t bl1) {
    mma_bf16(c, al, bh0, bh1);
    mma_bf16(c, ah, bl0, bl1);
    mma_bf16(c, ah, bh0, bh1);
}

/* The same for the two n8 tiles of a 16-column B fragment pair (registers 0, 1 and 2, 3 of an ldmatrix.x4). */
__device__ __forceinline__ void mma3_x2(float (&c0)[4], float (&c1)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                        const uint32_t (&bh)[4], const uint32_t (&bl)[4]) {
    mma3(c0, ah, al, bh[0], bh[1], bl[0], bl[1]);
    mma3(c1, ah, al, bh[2], bh[3], bl[2], bl[3]);
}

/* c += a·b from three-way splits (hi, mid, lo of A and of B; B's n8 tile in
 * registers 2 half, 2 half + 1): the six products down to 2^-18, the small
 * terms first. */
__device__ __forceinline__ void mma6(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&am)[4],
                                     const uint32_t (&al)[4], const uint32_t (&bh)[4], const uint32_t (&bm)[4],
                                     const uint32_t (&bl)[4], int half) {
    const uint32_t h0 = bh[2 * half], h1 = bh[2 * half + 1], m0 = bm[2 * half], m1 = bm[2 * half + 1];
    mma_bf16(c, al, h0, h1);
    mma_bf16(c, ah, bl[2 * half], bl[2 * half + 1]);
    mma_bf16(c, am, m0, m1);
    mma_bf16(c, am, h0, h1);
    mma_bf16(c, ah, m0, m1);
    mma_bf16(c, ah, h0, h1);
}

/* acc += A Bᵀ for one warp, six products of three-way splits: A's rows
 * m0 .. m0+15 and B's rows n0 .. n0 + 8 NT - 1 (B stored [n][k]), k over
 * KS·16, from swizzled bf16 tiles of CH chunks a row (hi at a0 / b0, mid
 * and lo a_step / b_step bytes further on). */
template <int NT, int KS>
__device__ __forceinline__ void warp_mma6_abt(uint32_t a0, uint32_t a_step, uint32_t b0, uint32_t b_step, int m0, int n0,
                                              int CH, float (&acc)[NT][4]) {
    static_assert(NT % 2 == 0, "n8 tiles in pairs");
    const int lane = threadIdx.x & 31;
    const int a_row = stc_attn::ldm_rowmajor_row(lane), a_chunk = stc_attn::ldm_rowmajor_chunk(lane);
    const int b_row = stc_attn::ldm_nk_row(lane), b_chunk = stc_attn::ldm_nk_chunk(lane);
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t ah[4], am[4], al[4];
        const int ao = stc_attn::swz_off_add(a_row, a_chunk, m0, 2 * ks, CH);
        ldsm_x4(ah, a0 + ao);
        ldsm_x4(am, a0 + a_step + ao);
        ldsm_x4(al, a0 + 2 * a_step + ao);
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t bh[4], bm[4], bl[4];
            const int bo = stc_attn::swz_off_add(b_row, b_chunk, n0 + 16 * np, 2 * ks, CH);
            ldsm_x4(bh, b0 + bo);
            ldsm_x4(bm, b0 + b_step + bo);
            ldsm_x4(bl, b0 + 2 * b_step + bo);
            mma6(acc[2 * np], ah, am, al, bh, bm, bl, 0);
            mma6(acc[2 * np + 1], ah, am, al, bh, bm, bl, 1);
        }
    }
}

/* The same product on the block's two warpgroups' wgmma (sm_90a code; D = 64, KS = 4): warpgroup g =
 * warp / 4 takes B's rows n0 = 32 g .. 32 g + 31 (m64n32k16, bf16, fp32 accumulators), so each warp holds
 * the rows and columns warp_mma6_abt gives it (rows 16 (w & 3), columns n0 + 8 nt, in mma.sync's m16n8
 * fragment order), with the six products of each k-step in mma6's order. A [64][64] and B [64][64] are
 * K-major tiles with the 128-byte swizzle, 1024-byte aligned (hi at a0 / b0, mid and lo a_step / b_step
 * bytes further on, multiples of 1,024). One asm block issues, commits and waits for all 24, so the
 * compiler never sees the accumulators in flight. Every warp of the warpgroup must call it; the writers
 * of the tiles fence them for the async proxy before the barrier that precedes it. */
#define WG_D16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define WG_ACC16(c, a) \
    c(a[0][0]), c(a[0][1]), c(a[0][2]), c(a[0][3]), c(a[1][0]), c(a[1][1]), c(a[1][2]), c(a[1][3]), c(a[2][0]), \
        c(a[2][1]), c(a[2][2]), c(a[2][3]), c(a[3][0]), c(a[3][1]), c(a[3][2]), c(a[3][3])
__device__ __forceinline__ void wg_mma6_abt(uint32_t a0, uint32_t a_step, uint32_t b0, uint32_t b_step, int n0,
                                            float (&acc)[4][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uint32_t bb = b0 + (uint32_t)n0 * 128u;   /* B's row n0: 32 rows of 128 bytes, a multiple of 1,024 */
    const uint64_t ah = wg_desc(a0, 1024), am = wg_desc(a0 + a_step, 1024), al = wg_desc(a0 + 2 * a_step, 1024);
    const uint64_t bh = wg_desc(bb, 1024), bm = wg_desc(bb + b_step, 1024), bl = wg_desc(bb + 2 * b_step, 1024);
    asm volatile(
        "{\n"
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %18, %19, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %16, %21, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %17, %20, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %17, %19, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %16, %20, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %16, %19, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %24, %25, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %22, %27, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %23, %26, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %23, %25, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %22, %26, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %22, %25, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %30, %31, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %28, %33, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %29, %32, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %29, %31, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %28, %32, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %28, %31, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %36, %37, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %34, %39, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %35, %38, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %35, %37, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %34, %38, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " WG_D16 ", %34, %37, 1, 1, 1, 0, 0;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;\n"
        "}\n"
        : WG_ACC16("+f", acc)
        : "l"(ah), "l"(am), "l"(al), "l"(bh), "l"(bm), "l"(bl),                                 /* k-step 0 */
          "l"(ah + 2), "l"(am + 2), "l"(al + 2), "l"(bh + 2), "l"(bm + 2), "l"(bl + 2),     /* 1 */
          "l"(ah + 4), "l"(am + 4), "l"(al + 4), "l"(bh + 4), "l"(bm + 4), "l"(bl + 4),     /* 2 */
          "l"(ah + 6), "l"(am + 6), "l"(al + 6), "l"(bh + 6), "l"(bm + 6), "l"(bl + 6)
        : "memory");
#else
    (void)a0, (void)a_step, (void)b0, (void)b_step, (void)n0, (void)acc;
    __trap();   /* not reached: npmap_project_tc takes this path only in sm_90a code */
#endif
}
#undef WG_D16
#undef WG_ACC16

/* The row phases give each row 8 lanes (a lane group): lane L takes row
 * r0 + 4 warp + L/8 of a pass of 32 rows, and the E = D/8 consecutive
 * elements from (L % 8) E on, as whole 16-byte chunks of the bf16 tiles. */
constexpr int kGroup = 8;
constexpr int kPassRows = kWarps * 32 / kGroup;

__device__ __forceinline__ float grp_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    return v + __shfl_xor_sync(0xffffffffu, v, 1);
}
__device__ __forceinline__ float grp_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
}
__device__ __forceinline__ float grp_min(float v) {
    v = fminf(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = fminf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    return fminf(v, __shfl_xor_sync(0xffffffffu, v, 1));
}

/* E floats (E a multiple of 8) at columns c0 .. c0 + E - 1 (c0 a multiple of
 * 8) of row r, split in NP bf16 pieces (hi, lo or hi, mid, lo), into the NP
 * tiles at t, stride bytes apart, one 16-byte store per chunk and piece. */
template <int NP, int E>
__device__ __forceinline__ void store_split(unsigned char *t, int stride, int r, int c0, int CH, const float *v) {
#pragma unroll
    for (int j = 0; j < E / 8; j++) {
        uint32_t w[NP][4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const float x0 = v[8 * j + 2 * q], x1 = v[8 * j + 2 * q + 1];
            if constexpr (NP == 3) split3_pair(x0, x1, w[0][q], w[1][q], w[2][q]);
            else split_pair(x0, x1, w[0][q], w[1][q]);
        }
        const int off = stc_attn::swz_off(r, (c0 >> 3) + j, CH);
#pragma unroll
        for (int p = 0; p < NP; p++)
            *reinterpret_cast<uint4 *>(t + p * stride + off) = make_uint4(w[p][0], w[p][1], w[p][2], w[p][3]);
    }
}

/* Head h's map of one side (0: q, 1: k) into shared memory: W as the B
 * operand of z = x̃ Wᵀ, element (n, k) = W[n][k] (NP-Map; Hedgehog:
 * W[k][n]) in three tiles [D][D] at Wt (hi, mid, lo; h3_bytes(D, D) in
 * all); u (zero for Hedgehog) into us. A block of kThreads threads; each
 * issues the loads of two 8-float pieces (and of u) before it splits and
 * stores any of them, so their latencies overlap. The caller synchronises. */
template <int D>
__device__ __forceinline__ void fmap_load_3(const args &a, int side, int h, unsigned char *Wt, float *us) {
    constexpr int CH = D / 8, PIECES = D * D / 8, BATCH = 2;
    static_assert(PIECES % (BATCH * kThreads) == 0 && D <= kThreads, "whole batches");
    const float *W = a.params + (side ? par_k_w(a, h) : par_q_w(a, h));
    const float *u = a.params + (side ? par_k_u(a, h) : par_q_u(a, h));
    const int tid = threadIdx.x;
    const float uv = tid < D && !a.lolcats ? u[tid] : 0.0f;
    for (int e0 = tid; e0 < PIECES; e0 += BATCH * kThreads) {
        float v[BATCH][8];
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int e = e0 + b * kThreads, n = e / (D / 8), k = 8 * (e % (D / 8));
            if (!a.lolcats) {
                const float4 *src = reinterpret_cast<const float4 *>(W + (size_t)n * D + k);
                const float4 v0 = src[0], v1 = src[1];
                v[b][0] = v0.x, v[b][1] = v0.y, v[b][2] = v0.z, v[b][3] = v0.w;
                v[b][4] = v1.x, v[b][5] = v1.y, v[b][6] = v1.z, v[b][7] = v1.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) v[b][i] = W[(size_t)(k + i) * D + n];
            }
        }
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int e = e0 + b * kThreads;
            store_split<3, 8>(Wt, D * D * 2, e / (D / 8), 8 * (e % (D / 8)), CH, v[b]);
        }
    }
    if (tid < D) us[tid] = uv;
}

/* The image of head h's map of one side as fmap_load_3 leaves it in shared memory: the three tiles
 * (h3_bytes(D, D)), then u (D floats). */
__host__ __device__ constexpr int wimage_bytes(int D) { return h3_bytes(D, D) + D * 4; }

/* N contiguous 16-byte pieces from global src to shared dst by cp.async (the caller commits): thread t takes
 * pieces t, t + kThreads, ..., so the trip count is a constant and each copy's addresses are the first one's
 * plus constants (a generic strided loop recomputed them, 64-bit, for every piece). */
template <int N>
__device__ __forceinline__ void copy_pieces(uint32_t dst, const void *src) {
    const int t = threadIdx.x;
    const unsigned char *s = static_cast<const unsigned char *>(src) + t * 16;
    const uint32_t d = dst + t * 16;
#pragma unroll
    for (int i = 0; i < N / kThreads; i++) cp_async_16(d + i * kThreads * 16, s + i * kThreads * 16, true);
    if constexpr (N % kThreads != 0)
        if (t < N % kThreads) cp_async_16(d + (N / kThreads) * kThreads * 16, s + (N / kThreads) * kThreads * 16, true);
}

/* Rows 0 .. kTile - 1 of D floats (row r at src + r · ld floats, present for r < n_rows; the rest
 * zero-filled) to shared dst as [kTile][D] floats, by cp.async (the caller commits). Rows not present are
 * copied with source size 0 from the first row's address (nothing read). */
template <int D>
__device__ __forceinline__ void copy_rows_f32(uint32_t dst, const float *src, size_t ld, int n_rows) {
    constexpr int PR = D / 4, RP = kThreads / PR;   /* pieces a row, rows a pass */
    static_assert(kThreads % PR == 0 && kTile % RP == 0, "whole rows a pass");
    const int t = threadIdx.x, r0 = t / PR, c4 = t % PR;
    const float *s = src + (size_t)r0 * ld + 4 * c4;
    const size_t step = (size_t)RP * ld;
    const uint32_t d = dst + (uint32_t)(r0 * D + 4 * c4) * 4;
#pragma unroll
    for (int i = 0; i < kTile / RP; i++) {
        const bool ok = r0 + i * RP < n_rows;
        cp_async_16(d + i * RP * D * 4, ok ? s + i * step : src, ok);
    }
}

/* fmap_load_3 from that image (by cp.async; the caller commits and waits, then synchronises). */
template <int D>
__device__ __forceinline__ void fmap_copy_3(const unsigned char *img, unsigned char *Wt, float *us) {
    copy_pieces<h3_bytes(D, D) / 16>(smem_addr(Wt), img);
    copy_pieces<D / 4>(smem_addr(us), img + h3_bytes(D, D));
}

/* Phase 1 of a tile: for rows r = 0 .. 63, x = row(r) (D floats, 16-byte
 * aligned, global or shared; NULL: no row, Φ will be zero), x̃ into three
 * tiles [64][D] at Xt (hi, mid, lo) and ‖x‖ into nx[r] (-1 for no row).
 * uu = u·u. */
template <int D, class RowFn>
__device__ __forceinline__ void npmap_reflect(RowFn row, const float *us, float uu, unsigned char *Xt, float *nx) {
    constexpr int E = D / kGroup, CH = D / 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = (lane & 7) * E;
    float uv[E];
#pragma unroll
    for (int i = 0; i < E; i++) uv[i] = us[c0 + i];
    for (int r0 = 0; r0 < kTile; r0 += kPassRows) {
        const int r = r0 + warp * 4 + (lane >> 3);
        const float *x = row(r);
        float xv[E];
#pragma unroll
        for (int i = 0; i < E; i += 4) {
            const float4 t = x ? *reinterpret_cast<const float4 *>(x + c0 + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            xv[i] = t.x, xv[i + 1] = t.y, xv[i + 2] = t.z, xv[i + 3] = t.w;
        }
        float xu = 0.0f, xx = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) xu = fmaf(xv[i], uv[i], xu), xx = fmaf(xv[i], xv[i], xx);
        xu = grp_sum(xu);
        xx = grp_sum(xx);
        const float f = still_npmap_reflect(xu, uu);
#pragma unroll
        for (int i = 0; i < E; i++) xv[i] -= f * uv[i];
        store_split<3, E>(Xt, kTile * D * 2, r, c0, CH, xv);
        if ((lane & 7) == 0) nx[r] = x ? sqrtf(xx) : -1.0f;
    }
}

/* Phase 2: z = x̃ Wᵀ for the tile (six products of the three-way splits),
 * written as fp32 [64][D + 4] over the x̃ tiles at XZ. Warp w: rows
 * 16 (w & 3), columns (w >> 2) D/2 onwards. Synchronises before and after.
 * wg (head dim 64, sm_90a code; uniform over the block): the products on
 * wgmma (wg_mma6_abt), the tiles 1024-byte aligned. */
template <int D>
__device__ __forceinline__ void npmap_project_tc(unsigned char *XZ, const unsigned char *Wt, bool wg = false) {
    constexpr int CH = D / 8, KS = D / 16, NT = D / 16;   /* n8 tiles per warp: D/2 columns */
    constexpr int ZLD = D + 4;
    constexpr uint32_t XS = kTile * D * 2, WSD = D * D * 2;   /* bytes between the three tiles */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = 16 * (warp & 3), n0 = (warp >> 2) * (D / 2);
    const uint32_t x0 = smem_addr(XZ), w0 = smem_addr(Wt);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
    bool done = false;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (D == 64) {
        if (wg) {
            fence_proxy_async();   /* this thread's x̃ and W writes, for the tensor cores' reads */
            __syncthreads();       /* x̃ and W complete */
            wg_mma6_abt(x0, XS, w0, WSD, n0, acc);
            done = true;
        }
    }
#else
    (void)wg;
#endif
    if (!done) {
        __syncthreads();   /* x̃ and W complete */
        warp_mma6_abt<NT, KS>(x0, XS, w0, WSD, m0, n0, CH, acc);
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

/* Phase 3: φ of each row from z (fp32 [64][D + 4] at Z) and nx; every lane
 * calls sink(r, c0, p1, p2) with its E = D/8 entries of softmax(z)
 * (columns c0 ..) and softmax(-z) (columns D + c0 ..) of row r, zero for a
 * row without input (all lanes call it: it may use grp_sum). The exponentials
 * are ex2.approx with log2(e) folded into the scale (an error of about
 * |z| 2^-24 in the exponent, as fp32's own rounding of z). */
template <int D, class Sink>
__device__ __forceinline__ void npmap_finish(const float *Z, const float *nx, bool hedgehog, Sink sink) {
    constexpr int E = D / kGroup, ZLD = D + 4;
    constexpr float kLog2e = (float)ATTN_LOG2E;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = (lane & 7) * E;
    for (int r0 = 0; r0 < kTile; r0 += kPassRows) {
        const int r = r0 + warp * 4 + (lane >> 3);
        const float n_x = nx[r];
        float z[E], zz = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i += 4) {
            const float4 t = *reinterpret_cast<const float4 *>(Z + r * ZLD + c0 + i);
            z[i] = t.x, z[i + 1] = t.y, z[i + 2] = t.z, z[i + 3] = t.w;
        }
#pragma unroll
        for (int i = 0; i < E; i++) zz = fmaf(z[i], z[i], zz);
        const float nz = sqrtf(grp_sum(zz));
        const float sc = (hedgehog ? 1.0f : still_npmap_rescale(n_x, nz)) * kLog2e;
        float mx = -INFINITY, mn = INFINITY;
#pragma unroll
        for (int i = 0; i < E; i++) {
            z[i] *= sc;
            mx = fmaxf(mx, z[i]);
            mn = fminf(mn, z[i]);
        }
        mx = grp_max(mx);
        mn = grp_min(mn);
        float p1[E], p2[E], s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) {
            p1[i] = ex2(z[i] - mx);
            p2[i] = ex2(mn - z[i]);
            s1 += p1[i];
            s2 += p2[i];
        }
        /* every lane takes part in the group sums (the shuffles need all 32; a
         * lane's row may be valid while another's in the same warp is not) */
        s1 = grp_sum(s1);
        s2 = grp_sum(s2);
        const bool valid = !(n_x < 0.0f);   /* -1: no row; a NaN norm stays valid and propagates */
        /* no row: factors and floor 0, so every entry is max(p·0, 0) = 0 (fmaxf drops a NaN from p·0);
         * __frcp_rn is the correctly rounded 1 / s, as the division was */
        const float i1 = valid ? __frcp_rn(s1) : 0.0f, i2 = valid ? __frcp_rn(s2) : 0.0f;
        const float floor_v = valid ? kFmapClamp : 0.0f;
#pragma unroll
        for (int i = 0; i < E; i++) {
            p1[i] = fmaxf(p1[i] * i1, floor_v);
            p2[i] = fmaxf(p2[i] * i2, floor_v);
        }
        sink(r, c0, p1, p2);
    }
}

/* Stores a lane's φ entries (npmap_finish's p1, p2) of row r into the tiles Ph, Pl [rows][2D]. */
template <int D>
__device__ __forceinline__ void store_phi(unsigned char *Ph, int r, int c0, const float *p1, const float *p2) {
    constexpr int E = D / kGroup, CHP = 2 * D / 8;
    store_split<2, E>(Ph, kTile * 2 * D * 2, r, c0, CHP, p1);
    store_split<2, E>(Ph, kTile * 2 * D * 2, r, D + c0, CHP, p2);
}

/* The same for a lane of npmap_warp's layout (one row per warp, the lane's
 * entries lane + 32 j of each half): the fp32 path of attn_still_leave.cu. */
template <int D>
__device__ __forceinline__ void store_phi_warp(unsigned char *Ph, int r, const float *row) {
    constexpr int CHP = 2 * D / 8;
    unsigned char *Pl = Ph + kTile * 2 * D * 2;
    const int lane = threadIdx.x & 31;
    for (int c = 2 * lane; c < 2 * D; c += 64) store_pair(Ph, Pl, r, c, CHP, row[c], row[c + 1]);
}

}   // namespace tc
}   // namespace stillk

#endif
