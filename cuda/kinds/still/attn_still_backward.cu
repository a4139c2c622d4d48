/* still on the GPU, stage-1 training: stc_still_distill, the counterpart of
 * src/kinds/still/attn_still.c's still_distill (its fast backward, head_bwd_fast).
 *
 * The forward is stc_still_forward over the whole sequence (p0 = 0) from a
 * fresh state; it leaves in the workspace what the backward needs: the
 * outputs y, the softmax denominators l (lbuf), the gate pre-activations
 * (pre) and the linear state's prefix sums after every leaving chunk
 * (slots). Selection is a fixed routing decision: the tokens the forward put
 * into Sel (sel_pos) are flagged, every other token that left Local was
 * folded. Every parameter acts through the linear branch of the rows of
 * chunks c >= 2:
 *   y = (o + g ⊙ a) / den,  a = S_{c-2}ᵀ φq,  b = φq·z_{c-2},  g = σ(pre + bg),
 *   den = l + b + 1e-6 (with gate_den per channel: den_d = l + g_d b + 1e-6)
 * With dy = 2 scale (y - target) / n (o and l constants):
 *   dnum = dy / den, dden = -dy ⊙ y / den, da = dnum ⊙ g,
 *   db = Σ_d dden_d = -(dy·y) / den (gate_den: Σ_d dden_d g_d),
 *   dg = dnum ⊙ a (gate_den: + dden b), dpre = dg ⊙ g (1 - g)
 *   dφq = S da + z db (into the q-map), dS_c += φq daᵀ, dz_c += φq db
 * then R(c) = Σ_{c' >= c} dS_c' (suffix sums over query chunks), and a token
 * j of leaving chunk cj that was folded gets dφk_j = R(cj + 2) v_j + Rz(cj + 2)
 * (into the k-map). The gate's dWg = Σ_t dpre_t x_tᵀ is a GEMM of fp32 operands
 * through TF32 tensor-core products (fp32 with STILL_CUDA_GRAD_TF32=0).
 *
 * Kernels, in order:
 *   mse       Σ (y - target)² / n into the layer's double
 *   flags     selected[hs][pos] from sel_pos
 *   bwd_q     block (query chunk c >= 2, row tile, head): φq, a, the row
 *             gradients, dφq, the block's dS_c and dz_c (atomics), the
 *             q-map's backward with dW_q, du_q, dbg (atomics)
 *   suffix    R(c) in place of dS_c
 *   bwd_k     block (leaving chunk, row tile, head): dφk of the folded
 *             tokens, the k-map's backward with dW_k, du_k (atomics)
 *   GEMM      dWg += dpreᵀ x (stc_gemm_tf32_at_b; stc_gemm_f32_at_b with STILL_CUDA_GRAD_TF32=0)
 * Float atomics make the sums' order vary from run to run (ulps). */
#include "kinds/still/attn_still_mma.cuh"

#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

namespace stillk {
namespace {

constexpr int kBT = 512;          /* threads of the backward kernels */
constexpr int kBW = kBT / 32;

/* ---- block products on the tensor cores ------------------------------------------------
 * The backward's products of 64-row tiles (a = Φ S, dΦ = DA Sᵀ, dS += Φᵀ DA,
 * dW += DZ0ᵀ X̃ in bwd_q; dΦk = V Rᵀ and dW in bwd_k) as mma.sync m16n8k16
 * in bf16x3 (attn_still_mma.cuh: hi/lo splits, three products, fp32
 * accumulation; relative errors of about 1e-5, well inside what the
 * gradients need), with the fragments built from the fp32 arrays in shared
 * memory as they are (rows padded by one float; no ldmatrix). */

/* The A fragment (m16 × k16) at (m0, k0) of A(m, k) = base[m·sm + k·sk],
 * split into NP bf16 pieces (hi, lo; or hi, mid, lo). */
template <int NP>
__device__ __forceinline__ void frag_a_f32(const float *base, int sm, int sk, int m0, int k0, int lane,
                                           uint32_t (&f)[NP][4]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int m = m0 + g + 8 * (i & 1), k = k0 + 2 * t + 8 * (i >> 1);
        const float x0 = base[m * sm + k * sk], x1 = base[m * sm + (k + 1) * sk];
        if constexpr (NP == 3) tc::split3_pair(x0, x1, f[0][i], f[1][i], f[2][i]);
        else tc::split_pair(x0, x1, f[0][i], f[1][i]);
    }
}

/* The B fragment (k16 × n8) at (k0, n0) of B(k, n) = base[k·sk + n·sn], split into NP pieces. */
template <int NP>
__device__ __forceinline__ void frag_b_f32(const float *base, int sk, int sn, int k0, int n0, int lane,
                                           uint32_t (&f)[NP][2]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int k = k0 + 2 * t + 8 * i, n = n0 + g;
        const float x0 = base[k * sk + n * sn], x1 = base[(k + 1) * sk + n * sn];
        if constexpr (NP == 3) tc::split3_pair(x0, x1, f[0][i], f[1][i], f[2][i]);
        else tc::split_pair(x0, x1, f[0][i], f[1][i]);
    }
}

/* C = A B for an M × N result (M a multiple of 16, N of 8) over k < 16 k_steps:
 * the block's 16 warps take m-tile w % (M/16) and a run of n8 tiles each;
 * then out(m, n, c[m][n], c[m][n + 1]) for every pair this lane holds.
 * NP = 2: bf16x3 (three products); NP = 3: three-way splits and the six
 * products down to 2^-18 (about fp32's accuracy), where the result is
 * amplified later (the NP-Map's z). */
template <int M, int N, int NP = 2, class Out>
__device__ __forceinline__ void block_gemm_tc(const float *A, int a_m, int a_k, const float *B, int b_k, int b_n,
                                              int k_steps, Out out) {
    constexpr int MT = M / 16, WPM = kBW / MT, NT8 = (N / 8) / WPM;   /* warps per m-tile, n8 tiles per warp */
    static_assert(kBW % MT == 0 && (N / 8) % WPM == 0 && NT8 >= 1, "the block's warps must tile the result");
    static_assert(NP == 2 || NP == 3, "two- or three-way splits");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = 16 * (warp % MT), n0 = (warp / MT) * NT8 * 8;
    float acc[NT8][4];
#pragma unroll
    for (int nt = 0; nt < NT8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
    for (int ks = 0; ks < k_steps; ks++) {
        uint32_t fa[NP][4];
        frag_a_f32<NP>(A, a_m, a_k, m0, 16 * ks, lane, fa);
#pragma unroll
        for (int nt = 0; nt < NT8; nt++) {
            uint32_t fb[NP][2];
            frag_b_f32<NP>(B, b_k, b_n, 16 * ks, n0 + 8 * nt, lane, fb);
            if constexpr (NP == 3) {   /* the small terms first */
                stc_ptx::mma_bf16(acc[nt], fa[2], fb[0][0], fb[0][1]);
                stc_ptx::mma_bf16(acc[nt], fa[0], fb[2][0], fb[2][1]);
                stc_ptx::mma_bf16(acc[nt], fa[1], fb[1][0], fb[1][1]);
                stc_ptx::mma_bf16(acc[nt], fa[1], fb[0][0], fb[0][1]);
                stc_ptx::mma_bf16(acc[nt], fa[0], fb[1][0], fb[1][1]);
                stc_ptx::mma_bf16(acc[nt], fa[0], fb[0][0], fb[0][1]);
            } else {
                tc::mma3(acc[nt], fa[0], fa[1], fb[0][0], fb[0][1], fb[1][0], fb[1][1]);
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT8; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            out(m0 + stc_attn::acc_row(lane, 2 * hh), n0 + 8 * nt + stc_attn::acc_col(lane, 0), acc[nt][2 * hh],
                acc[nt][2 * hh + 1]);
}

/* ---- the NP-Map of a 64-row tile, forward and backward ------------------------------------
 * As src/kinds/still/attn_still.c's feature map and fmap_d (attn_still_fmap.cuh has the
 * forward one row per warp): per row x̃ = x - f u (f = 2 x·u / u·u), then
 * z0 = x̃ Wᵀ for the tile on the tensor cores (six products: z is rescaled
 * to ‖x‖ before its softmax, so it needs about fp32's accuracy), then per
 * row the rescaling and the softmaxes; backward per row to dz0 (in z0's
 * place), dx̃ = dz0 W for the tile (bf16x3: a gradient), per row du. */

/* Forward to z0: for rows r < kRows with valid(r), x (X + r·D) reflected into
 * Xt [kRows][D+1] (zero rows otherwise), ‖x‖ into nx_s (-1: no row) and x·u
 * into xu_s; then z0 = x̃ Wᵀ into Z0 [kRows][D+1]. Ws: W as [D][D+1].
 * Ends with a barrier. */
template <int D, class Valid>
__device__ void npmap_tile_z0(const float *X, Valid valid, const float *us, const float *Ws, float uu, float *Xt,
                              float *Z0, float *nx_s, float *xu_s) {
    constexpr int J = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < kRows; r += kBW) {
        if (!valid(r)) {   /* uniform over the warp */
#pragma unroll
            for (int j = 0; j < J; j++) Xt[r * (D + 1) + lane + 32 * j] = 0.0f;
            if (lane == 0) nx_s[r] = -1.0f, xu_s[r] = 0.0f;
            continue;
        }
        float xv[J], uv[J], xu = 0.0f, xx = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            xv[j] = X[r * D + lane + 32 * j];
            uv[j] = us[lane + 32 * j];
            xu += xv[j] * uv[j];
            xx += xv[j] * xv[j];
        }
        xu = warp_sum(xu);
        xx = warp_sum(xx);
        const float f = still_npmap_reflect(xu, uu);
#pragma unroll
        for (int j = 0; j < J; j++) Xt[r * (D + 1) + lane + 32 * j] = xv[j] - f * uv[j];
        if (lane == 0) nx_s[r] = sqrtf(xx), xu_s[r] = xu;
    }
    __syncthreads();
    /* z0[r][n] = Σ_d x̃[r][d] W[n][d] */
    block_gemm_tc<kRows, D, 3>(Xt, D + 1, 1, Ws, 1, D + 1, D / 16, [&](int r, int n, float c0, float c1) {
        Z0[r * (D + 1) + n] = c0;
        Z0[r * (D + 1) + n + 1] = c1;
    });
    __syncthreads();
}

/* The rescaling and softmaxes of row r from z0 (one warp): the lane's
 * unclamped entries a1 (softmax(z)) and a2 (softmax(-z)), and z0, sc, nz. */
template <int D>
__device__ __forceinline__ void npmap_row_softmax(const float *z0_row, float n_x, int lane, float (&z0)[D / 32],
                                                  float (&a1)[D / 32], float (&a2)[D / 32], float &sc, float &nz,
                                                  bool hed) {
    constexpr int J = D / 32;
    float zz = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) z0[j] = z0_row[lane + 32 * j], zz += z0[j] * z0[j];
    nz = sqrtf(warp_sum(zz));
    sc = hed ? 1.0f : still_npmap_rescale(n_x, nz);   /* Hedgehog: z = z0 */
    float z[J], mx = -INFINITY, mn = INFINITY;
#pragma unroll
    for (int j = 0; j < J; j++) {
        z[j] = z0[j] * sc;
        mx = fmaxf(mx, z[j]);
        mn = fminf(mn, z[j]);
    }
    mx = warp_max(mx);
    mn = warp_min(mn);
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        a1[j] = expf(z[j] - mx);
        a2[j] = expf(-z[j] + mn);
        s1 += a1[j];
        s2 += a2[j];
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    const float i1 = 1.0f / s1, i2 = 1.0f / s2;   /* as npmap_warp */
#pragma unroll
    for (int j = 0; j < J; j++) a1[j] *= i1, a2[j] *= i2;
}

/* Backward of the tile from dphi (dPhi [kRows][P+1], complete: the caller
 * synchronised) and z0 (Z0, as npmap_tile_z0 left it): dz0 into Z0 in
 * place, dx̃ = dz0 W into DXt [kRows][D+1], then ∂/∂u added into du_s
 * (atomics). X, nx_s, xu_s as for npmap_tile_z0. Ends with a barrier. */
template <int D>
__device__ void npmap_tile_bwd(const float *X, const float *us, const float *Ws, float uu, const float *dPhi, float *Z0,
                               float *DXt, const float *nx_s, const float *xu_s, float *du_s, bool hed) {
    constexpr int J = D / 32, P = 2 * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int r = warp; r < kRows; r += kBW) {
        float *zr = Z0 + r * (D + 1);
        if (nx_s[r] < 0.0f) {   /* no row: nothing flows back */
#pragma unroll
            for (int j = 0; j < J; j++) zr[lane + 32 * j] = 0.0f;
            continue;
        }
        float z0[J], a1[J], a2[J], sc, nz;
        npmap_row_softmax<D>(zr, nx_s[r], lane, z0, a1, a2, sc, nz, hed);
        const float *dphi = dPhi + r * (P + 1);
        float g1[J], g2[J], dot1 = 0.0f, dot2 = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            g1[j] = a1[j] < kFmapClamp ? 0.0f : dphi[lane + 32 * j];   /* a clamped entry passes nothing */
            g2[j] = a2[j] < kFmapClamp ? 0.0f : dphi[D + lane + 32 * j];
            dot1 += a1[j] * g1[j];
            dot2 += a2[j] * g2[j];
        }
        dot1 = warp_sum(dot1);
        dot2 = warp_sum(dot2);
        float dz[J], pr = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            dz[j] = a1[j] * (g1[j] - dot1) - a2[j] * (g2[j] - dot2);
            pr += z0[j] * dz[j];
        }
        pr = warp_sum(pr);
        pr = !hed && nz > kNormFloor ? pr / (nz * nz) : 0.0f;   /* Hedgehog: no rescaling, dz0 = dz */
#pragma unroll
        for (int j = 0; j < J; j++) zr[lane + 32 * j] = sc * (dz[j] - z0[j] * pr);   /* the lane's own elements */
    }
    if (!(uu > 0.0f)) {   /* uniform over the block: x̃ = x, u has no gradient */
        __syncthreads();
        return;
    }
    __syncthreads();
    /* dx̃[r][c] = Σ_i dz0[r][i] W[i][c] */
    block_gemm_tc<kRows, D>(Z0, D + 1, 1, Ws, D + 1, 1, D / 16, [&](int r, int c, float c0, float c1) {
        DXt[r * (D + 1) + c] = c0;
        DXt[r * (D + 1) + c + 1] = c1;
    });
    __syncthreads();
    /* x̃ = x - 2 (x·u / u·u) u */
    float du[J];
#pragma unroll
    for (int j = 0; j < J; j++) du[j] = 0.0f;
    for (int r = warp; r < kRows; r += kBW) {
        if (nx_s[r] < 0.0f) continue;
        const float xu = xu_s[r];
        float xv[J], uv[J], dxt[J], dud = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            xv[j] = X[r * D + lane + 32 * j];
            uv[j] = us[lane + 32 * j];
            dxt[j] = DXt[r * (D + 1) + lane + 32 * j];
            dud += dxt[j] * uv[j];
        }
        dud = warp_sum(dud);
#pragma unroll
        for (int j = 0; j < J; j++)
            du[j] += -2.0f * (xv[j] * dud / uu + xu * dxt[j] / uu - 2.0f * xu * dud * uv[j] / (uu * uu));
    }
#pragma unroll
    for (int j = 0; j < J; j++) atomicAdd(du_s + lane + 32 * j, du[j]);
    __syncthreads();
}

/* dW[i][j] += Σ_r DZ0[r][i] Xt[r][j] and du into the gradient (atomics);
 * DZ0, Xt: [kRows][D + 1] in shared memory, zero rows contribute nothing.
 * hed (lolcats' Hedgehog map, W stored [D][F] with z = x W): dW[j][i] instead, and no u. */
template <int D>
__device__ void npmap_grad_flush(const float *DZ0, const float *Xt, float *dW, float *du_s, float *du_g, bool hed) {
    static_assert(D == 64, "the training kernels take head dim 64");
    block_gemm_tc<D, D>(DZ0, 1, D + 1, Xt, D + 1, 1, kRows / 16, [&](int i, int j, float c0, float c1) {
        if (hed) {
            atomicAdd(dW + (size_t)j * D + i, c0);
            atomicAdd(dW + (size_t)(j + 1) * D + i, c1);
        } else {
            atomicAdd(dW + (size_t)i * D + j, c0);
            atomicAdd(dW + (size_t)i * D + j + 1, c1);
        }
    });
    if (!hed && threadIdx.x < D) atomicAdd(du_g + threadIdx.x, du_s[threadIdx.x]);
}


/* Rows of D floats from global memory (row r at src + r * ld, 16-byte
 * aligned) into shared memory (row r at dst + r * ldd), n_rows of kRows
 * (rows past n_rows are zero): every load issued before the first store. */
template <int D>
__device__ __forceinline__ void load_rows(float *dst, int ldd, const float *__restrict__ src, size_t ld, int n_rows) {
    constexpr int V = kRows * D / 4 / kBT;   /* float4 per thread */
    static_assert(V * 4 * kBT == kRows * D, "rows must split evenly over the block");
    float4 buf[V];
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int e = (threadIdx.x + i * kBT) * 4, r = e / D, c = e % D;
        buf[i] = r < n_rows ? *reinterpret_cast<const float4 *>(src + (size_t)r * ld + c) : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int e = (threadIdx.x + i * kBT) * 4, r = e / D, c = e % D;
        float *d = dst + r * ldd + c;
        d[0] = buf[i].x, d[1] = buf[i].y, d[2] = buf[i].z, d[3] = buf[i].w;
    }
}

/* n contiguous floats (n a multiple of 4, src 16-byte aligned) into shared
 * memory at dst + (e / w) * ldd + e % w for element e (w: the source's row
 * width; ldd >= w), loads first. */
template <int N>
__device__ __forceinline__ void load_block(float *dst, int w, int ldd, const float *__restrict__ src) {
    constexpr int V = (N / 4 + kBT - 1) / kBT;
    float4 buf[V];
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int e = (threadIdx.x + i * kBT) * 4;
        if (e < N) buf[i] = *reinterpret_cast<const float4 *>(src + e);
    }
#pragma unroll
    for (int i = 0; i < V; i++) {
        const int e = (threadIdx.x + i * kBT) * 4;
        if (e >= N) continue;
        const float v[4] = {buf[i].x, buf[i].y, buf[i].z, buf[i].w};
#pragma unroll
        for (int k = 0; k < 4; k++) dst[((e + k) / w) * ldd + (e + k) % w] = v[k];
    }
}

/* Head h's map of one side (0: q, 1: k) into shared memory for the backward kernels: the NP-Map's W as [D][D + 1]
 * and u; lolcats' Hedgehog W [D][F] transposed (Ws[f][d], so that z0 = Ws x as for the NP-Map) and u = 0. */
template <int D>
__device__ __forceinline__ void bwd_map_load(const args &a, int side, int h, float *Ws, float *us) {
    const float *W = a.params + (side ? par_k_w(a, h) : par_q_w(a, h));
    if (a.lolcats) {
        for (int e = threadIdx.x; e < D * D; e += blockDim.x) Ws[(e % D) * (D + 1) + e / D] = W[e];
        for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = 0.0f;
        return;
    }
    load_block<D * D>(Ws, D, D + 1, W);
    const float *u = a.params + (side ? par_k_u(a, h) : par_q_u(a, h));
    for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = u[e];
}

/* ---- shared memory of bwd_q / bwd_k (floats) ---------------------------------------------- */

template <int D>
struct bwd_layout {
    static constexpr int P = 2 * D;
    static constexpr size_t W = 0;                                  /* [D][D+1] the map */
    static constexpr size_t U = W + (size_t)D * (D + 1);            /* [D] */
    static constexpr size_t S = U + D;                              /* [P][D+1] S | z (bwd_q), R | Rz (bwd_k) */
    static constexpr size_t PHI = S + (size_t)P * (D + 1);          /* [kRows][P+1] φq (bwd_q), k rows [kRows][D] (bwd_k) */
    static constexpr size_t DA = PHI + (size_t)kRows * (P + 1);     /* [kRows][D+1] da (bwd_q), v rows (bwd_k) */
    static constexpr size_t DPHI = DA + (size_t)kRows * (D + 1);    /* [kRows][P+1] */
    static constexpr size_t XT = DPHI + (size_t)kRows * (P + 1);    /* [kRows][D+1] x̃ rows */
    static constexpr size_t DZ0 = XT + (size_t)kRows * (D + 1);     /* [kRows][D+1] */
    static constexpr size_t QX = DZ0 + (size_t)kRows * (D + 1);     /* [kRows][D] q rows (bwd_q) */
    static constexpr size_t LZ = QX + (size_t)kRows * D;            /* [kRows] φq·z */
    static constexpr size_t DD = LZ + kRows;                        /* [kRows] db */
    static constexpr size_t DBG = DD + kRows;                       /* [D] */
    static constexpr size_t DU = DBG + D;                           /* [D] */
    static constexpr size_t FLAG = DU + D;                          /* [kRows] row valid (bwd_k) */
    static constexpr size_t NX = FLAG + kRows;                      /* [kRows] ‖x‖ of the map's input rows (-1: none) */
    static constexpr size_t XU = NX + kRows;                        /* [kRows] x·u */
    static constexpr size_t TOTAL = XU + kRows;
};

/* ---- kernels ------------------------------------------------------------------------------ */

__global__ void mse_kernel(const float *__restrict__ y, const float *__restrict__ t, int64_t n, double *out) {
    double s = 0.0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float d = y[i] - t[i];
        s += (double)d * d;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __shared__ double part[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.0;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) atomicAdd(out, s / (double)n);
    }
}

__global__ void flags_kernel(const int32_t *__restrict__ sel_pos, int sel_rows, int cnt, int T,
                             unsigned char *__restrict__ flag) {
    const int hs = blockIdx.x;
    for (int e = threadIdx.x; e < cnt; e += blockDim.x) {
        const int pos = sel_pos[(size_t)hs * sel_rows + e];
        if (pos >= 0 && pos < T) flag[(size_t)hs * T + pos] = 1;
    }
}

/* dS [nC][H][P][D+1] (z in column D): R(c) = Σ_{c' >= c} dS_c' for c >= 2. */
__global__ void suffix_kernel(float *dS, int n_chunks, size_t per_chunk) {
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= per_chunk) return;
    float acc = 0.0f;
    for (int c = n_chunks - 1; c >= 2; c--) {
        acc += dS[(size_t)c * per_chunk + e];
        dS[(size_t)c * per_chunk + e] = acc;
    }
}

template <int D>
__global__ void __launch_bounds__(kBT) bwd_q_kernel(const args a, const float *__restrict__ target, float coef,
                                                    float *__restrict__ grad, float *__restrict__ dS,
                                                    float *__restrict__ dpre) {
    using L = bwd_layout<D>;
    constexpr int P = L::P, DJ = D / 32;
    extern __shared__ __align__(16) float sm[];
    float *Ws = sm + L::W, *us = sm + L::U, *Ss = sm + L::S, *Phi = sm + L::PHI, *DA = sm + L::DA;
    float *dPhi = sm + L::DPHI, *Xt = sm + L::XT, *DZ0 = sm + L::DZ0, *Qx = sm + L::QX, *lz = sm + L::LZ;
    float *dd = sm + L::DD, *dbg_s = sm + L::DBG, *du_s = sm + L::DU, *nx_s = sm + L::NX, *xu_s = sm + L::XU;

    const call_geom g = make_geom(0, a.T, a.C);
    const int n_rt = row_tiles(a.C);
    const int c = 2 + (int)blockIdx.x / n_rt, rt = (int)blockIdx.x % n_rt, h = blockIdx.y;
    if (c > g.c_last) return;
    int lo, hi;
    block_rows(g, a.C, c, rt, &lo, &hi);
    if (lo > hi) return;
    const int n_rows = hi - lo + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int HD = a.H * D;

    /* the state the chunk's rows saw (prefix slot c - 2), the q-map, the rows' q */
    const float *src = a.slots + (size_t)(c - 2) * a.slot_floats;
    load_block<P * D>(Ss, D, D + 1, src + (size_t)h * P * D);
    load_block<P>(Ss + D, 1, D + 1, src + (size_t)a.H * P * D + (size_t)h * P);
    bwd_map_load<D>(a, 0, h, Ws, us);
    load_rows<D>(Qx, D, q_row(a, lo, h), a.ldq, n_rows);
    for (int e = tid; e < D; e += kBT) dbg_s[e] = 0.0f, du_s[e] = 0.0f;
    const bool hed = a.lolcats != 0;
    const float gam = softmax_factor(a, h);   /* lolcats' γ on the softmax sums (1 for still) */
    __syncthreads();
    const float uu = npmap_uu<D>(us, lane);
    npmap_tile_z0<D>(Qx, [&](int r) { return r < n_rows; }, us, Ws, uu, Xt, DZ0, nx_s, xu_s);
    for (int r = warp; r < kRows; r += kBW) {   /* φq, rows past the chunk zero; z0 stays in DZ0 for the backward */
        float *ph = Phi + r * (P + 1);
        if (nx_s[r] < 0.0f) {
            for (int p = lane; p < P; p += 32) ph[p] = 0.0f;
            continue;
        }
        float z0[DJ], a1[DJ], a2[DJ], sc, nz;
        npmap_row_softmax<D>(DZ0 + r * (D + 1), nx_s[r], lane, z0, a1, a2, sc, nz, hed);
#pragma unroll
        for (int j = 0; j < DJ; j++)
            ph[lane + 32 * j] = fmaxf(a1[j], kFmapClamp), ph[D + lane + 32 * j] = fmaxf(a2[j], kFmapClamp);
    }
    __syncthreads();
    if (tid < kRows) {
        float s = 0.0f;
        for (int p = 0; p < P; p++) s = fmaf(Phi[tid * (P + 1) + p], Ss[p * (D + 1) + D], s);
        lz[tid] = s;
    }
    /* a = Φ S (tensor cores), into dPhi's place as [kRows][D + 1] until dΦ is formed */
    float *As = dPhi;
    block_gemm_tc<kRows, D>(Phi, P + 1, 1, Ss, D + 1, 1, P / 16, [&](int r, int d, float c0, float c1) {
        As[r * (D + 1) + d] = c0;
        As[r * (D + 1) + d + 1] = c1;
    });
    const int rg = warp;   /* the row gradients: thread rows rg*4 .. +3, dims lane + 32 j */
    /* the rows' outputs, targets and gate pre-activations, all loads first */
    const float *bg = a.gate ? a.params + par_bg(a) + (size_t)h * D : nullptr;
    float yv[4][DJ], tv[4][DJ], pv[4][DJ], bgv[DJ], lb[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int r = rg * 4 + i, t = lo + (r < n_rows ? r : 0);
        lb[i] = a.lbuf[(size_t)t * a.H + h];
#pragma unroll
        for (int j = 0; j < DJ; j++) {
            const size_t o = ((size_t)t * a.H + h) * D + lane + 32 * j;
            yv[i][j] = a.out[o];
            tv[i][j] = target[o];
            pv[i][j] = bg ? a.pre[(size_t)t * a.ldpre + (size_t)h * D + lane + 32 * j] : 0.0f;
        }
    }
#pragma unroll
    for (int j = 0; j < DJ; j++) bgv[j] = bg ? bg[lane + 32 * j] : 0.0f;
    __syncthreads();   /* lz, a */

    float dbg_acc[DJ], dw_acc = 0.0f;   /* dw_acc: lolcats' dw_h of the warp's rows (the same on every lane) */
#pragma unroll
    for (int j = 0; j < DJ; j++) dbg_acc[j] = 0.0f;
    /* the row gradients, compiled twice: a denominator per row, or per channel with gate_den */
    auto row_grads = [&](auto per_channel) {
        constexpr bool GD = decltype(per_channel)::value;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = rg * 4 + i;
            const bool ok = r < n_rows;   /* uniform over the warp */
            const int t = lo + (ok ? r : 0);
            float dy[DJ], gt[DJ];
#pragma unroll
            for (int j = 0; j < DJ; j++) {
                dy[j] = ok ? coef * (yv[i][j] - tv[i][j]) : 0.0f;
                gt[j] = bg ? sigmoid(pv[i][j] + bgv[j]) : 1.0f;
            }
            if constexpr (GD) {   /* (the gate is on) den_d = l + g_d b + 1e-6, db = Σ_d dden_d g_d */
                float db = 0.0f;
#pragma unroll
                for (int j = 0; j < DJ; j++) {
                    const int d = lane + 32 * j;
                    const float den = still_den(lb[i], gt[j], lz[r], 1);
                    const float dnum = dy[j] / den, dden = -dy[j] * yv[i][j] / den;
                    db += dden * gt[j];
                    DA[r * (D + 1) + d] = ok ? dnum * gt[j] : 0.0f;   /* rows past the chunk: zero */
                    const float dp = (dnum * As[r * (D + 1) + d] + dden * lz[r]) * gt[j] * (1.0f - gt[j]);
                    if (ok) dpre[(size_t)t * HD + (size_t)h * D + d] = dp;
                    dbg_acc[j] += dp;
                }
                db = warp_sum(db);
                if (lane == 0) dd[r] = ok ? db : 0.0f;
            } else {   /* den = γ l + b + 1e-6, db = Σ_d dden_d = -(dy·y) / den */
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < DJ; j++) s += dy[j] * yv[i][j];
                s = warp_sum(s);
                const float den = still_den(gam * lb[i], 1.0f, lz[r], 0);
                const float dden = ok ? -s / den : 0.0f;
                if (hed) {
                    /* lolcats' w_h: y = (γ o + a) / (γ l + b + ε), so ∂y/∂γ = (o − y l) / den and with
                     * γ o = den y − a, dw = γ (1 − γ) Σ dy ∂y/∂γ = (1 − γ) ((b + ε)(dy·y) − dy·a) / den */
                    float sa = 0.0f;
#pragma unroll
                    for (int j = 0; j < DJ; j++) sa += dy[j] * As[r * (D + 1) + lane + 32 * j];
                    sa = warp_sum(sa);
                    if (ok) dw_acc += (1.0f - gam) * ((lz[r] + kDenEps) * s - sa) / den;
                }
#pragma unroll
                for (int j = 0; j < DJ; j++) {
                    const int d = lane + 32 * j;
                    const float dnum = dy[j] / den;
                    DA[r * (D + 1) + d] = ok ? dnum * gt[j] : 0.0f;   /* rows past the chunk: zero (the dS product reads them) */
                    if (bg) {
                        const float dp = dnum * As[r * (D + 1) + d] * gt[j] * (1.0f - gt[j]);
                        if (ok) dpre[(size_t)t * HD + (size_t)h * D + d] = dp;
                        dbg_acc[j] += dp;
                    }
                }
                if (lane == 0) dd[r] = dden;
            }
        }
    };
    if (a.gate_den) row_grads(std::true_type());
    else row_grads(std::false_type());
    if (bg)
#pragma unroll
        for (int j = 0; j < DJ; j++) atomicAdd(dbg_s + lane + 32 * j, dbg_acc[j]);
    if (hed && lane == 0) atomicAdd(dbg_s, dw_acc);   /* lolcats has no gate: dbg_s[0] holds the block's dw_h */
    __syncthreads();   /* DA, dd */

    /* dΦ = DA Sᵀ + dd zᵀ (tensor cores; a is no longer read) */
    block_gemm_tc<kRows, P>(DA, D + 1, 1, Ss, 1, D + 1, D / 16, [&](int r, int p, float c0, float c1) {
        dPhi[r * (P + 1) + p] = c0 + Ss[p * (D + 1) + D] * dd[r];
        dPhi[r * (P + 1) + p + 1] = c1 + Ss[(p + 1) * (D + 1) + D] * dd[r];
    });
    /* dS_c += Φᵀ DA (tensor cores; rows past the chunk are zero in Φ and DA), dz_c += Φᵀ dd */
    {
        float *dst = dS + ((size_t)c * a.H + h) * P * (D + 1);
        block_gemm_tc<P, D>(Phi, 1, P + 1, DA, D + 1, 1, cdiv(n_rows, 16), [&](int p, int d, float c0, float c1) {
            atomicAdd(dst + (size_t)p * (D + 1) + d, c0);
            atomicAdd(dst + (size_t)p * (D + 1) + d + 1, c1);
        });
        if (tid < P) {
            float accz = 0.0f;
            for (int r = 0; r < n_rows; r++) accz = fmaf(Phi[r * (P + 1) + tid], dd[r], accz);
            atomicAdd(dst + (size_t)tid * (D + 1) + D, accz);
        }
    }
    __syncthreads();   /* dΦ complete; DA is free for dx̃ */

    /* the q-map's backward */
    npmap_tile_bwd<D>(Qx, us, Ws, uu, dPhi, DZ0, DA, nx_s, xu_s, du_s, hed);
    npmap_grad_flush<D>(DZ0, Xt, grad + par_q_w(a, h), du_s, hed ? nullptr : grad + par_q_u(a, h), hed);
    if (bg && tid < D) atomicAdd(grad + par_bg(a) + (size_t)h * D + tid, dbg_s[tid]);
    if (hed && tid == 0) atomicAdd(grad + par_lol_w(a, h), dbg_s[0]);
}

template <int D>
__global__ void __launch_bounds__(kBT) bwd_k_kernel(const args a, const unsigned char *__restrict__ flag,
                                                    const float *__restrict__ R, float *__restrict__ grad) {
    using L = bwd_layout<D>;
    constexpr int P = L::P;
    extern __shared__ __align__(16) float sm[];
    float *Ws = sm + L::W, *us = sm + L::U, *Rs = sm + L::S, *Kx = sm + L::PHI, *Vs = sm + L::DA;
    float *dPhi = sm + L::DPHI, *Xt = sm + L::XT, *DZ0 = sm + L::DZ0, *du_s = sm + L::DU, *ok_s = sm + L::FLAG;
    float *nx_s = sm + L::NX, *xu_s = sm + L::XU;

    const int n_rt = row_tiles(a.C);
    const int cj = (int)blockIdx.x / n_rt, rt = (int)blockIdx.x % n_rt, h = blockIdx.y;
    if (cj >= n_left(a.T, a.C)) return;
    const int hk = h / a.G, hs = a.per_kv ? hk : h;
    const int lo = cj * a.C + rt * kRows, n_rows = smin(kRows, a.C - rt * kRows);
    const int tid = threadIdx.x, lane = tid & 31;

    load_block<P * (D + 1)>(Rs, P * (D + 1), P * (D + 1), R + ((size_t)(cj + 2) * a.H + h) * P * (D + 1));
    bwd_map_load<D>(a, 1, h, Ws, us);
    load_rows<D>(Vs, D + 1, a.v + (size_t)lo * a.ldkv + (size_t)hk * D, a.ldkv, n_rows);
    load_rows<D>(Kx, D, a.k + (size_t)lo * a.ldkv + (size_t)hk * D, a.ldkv, n_rows);
    for (int e = tid; e < D; e += kBT) du_s[e] = 0.0f;
    const bool hed = a.lolcats != 0;
    for (int r = tid; r < kRows; r += kBT) ok_s[r] = r < n_rows && !flag[(size_t)hs * a.T + lo + r] ? 1.0f : 0.0f;
    __syncthreads();

    /* dΦk = V Rᵀ + Rz (tensor cores) */
    block_gemm_tc<kRows, P>(Vs, D + 1, 1, Rs, 1, D + 1, D / 16, [&](int r, int p, float c0, float c1) {
        dPhi[r * (P + 1) + p] = c0 + Rs[p * (D + 1) + D];
        dPhi[r * (P + 1) + p + 1] = c1 + Rs[(p + 1) * (D + 1) + D];
    });
    __syncthreads();

    const float uu = npmap_uu<D>(us, lane);
    /* the k-map's backward for the folded tokens (selected ones and rows past the chunk: nothing was folded) */
    npmap_tile_z0<D>(Kx, [&](int r) { return ok_s[r] != 0.0f; }, us, Ws, uu, Xt, DZ0, nx_s, xu_s);
    npmap_tile_bwd<D>(Kx, us, Ws, uu, dPhi, DZ0, Vs, nx_s, xu_s, du_s, hed);
    npmap_grad_flush<D>(DZ0, Xt, grad + par_k_w(a, h), du_s, hed ? nullptr : grad + par_k_u(a, h), hed);
}

/* Grow workspace buffer i to at least bytes (waits for the device when it reallocates). */
int ws_grow(stc_ctx *ctx, stc_still_ws *w, int i, size_t bytes, const char *what, still_err *err) {
    if (w->bytes[i] >= bytes) return STILL_OK;
    stc_free(ctx, w->buf[i]);
    w->buf[i] = NULL;
    w->bytes[i] = 0;
    int rc = stc_malloc(ctx, bytes, what, &w->buf[i], err);
    if (rc) return rc;
    w->bytes[i] = bytes;
    return STILL_OK;
}

}   // namespace
}   // namespace stillk

using namespace stillk;

int stc_still_distill(stc_ctx *ctx, stc_still *s, const float *params_dev, const float *q, const float *k,
                      const float *v, const stc_bf16 *x_bf16, const float *x_f32, int T, const float *target,
                      float scale, float *grad_dev, double *mse_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (!s || !target || !mse_dev) return stc_fail(err, STILL_E_ARG, "stc_still_distill: NULL state, target or mse");
    const stc_still_config *cfg = &s->cfg;
    if (T < 1 || T > cfg->n_ctx)
        return stc_fail(err, STILL_E_ARG, "still training: %d tokens per sequence (1 .. n_ctx = %d)", T, cfg->n_ctx);
    if (grad_dev && cfg->linear) {
        if (!cfg->lolcats && cfg->feature_map != 0)
            return stc_fail(err, STILL_E_UNSUPPORTED, "still training on the GPU: NP-Map feature maps only");
        if (s->D != 64)
            return stc_fail(err, STILL_E_UNSUPPORTED, "still training on the GPU: head dim %d (64 supported)", s->D);
        if (cfg->gate && !x_f32) return stc_fail(err, STILL_E_ARG, "still training: the gate needs the fp32 layer input");
    }
    if (cfg->sel_q8)
        return stc_fail(err, STILL_E_UNSUPPORTED, "still training: the selected store in 8 bits is for inference (f16 here)");
    if (cfg->sel_global && T > s->cap + s->C)
        return stc_fail(err, STILL_E_UNSUPPORTED,
                        "still training: global selection would evict tokens of a %d-token sequence (at most "
                        "budget - chunk = %d)", T, s->cap + s->C);
    const int H = s->H, D = s->D, P = s->P, C = s->C, HD = H * D;
    const int n_chunks = cdiv(T, C);
    stc_still_ws *w = s->ws;
    int rc = ws_grow(ctx, w, WS_TY, (size_t)T * HD * sizeof(float), "still training outputs", err);
    if (rc) return rc;
    float *y = (float *)w->buf[WS_TY];
    if ((rc = stc_still_reset(ctx, s, err))) return rc;
    if ((rc = stc_still_forward(ctx, s, params_dev, q, k, v, x_bf16, T, 0, y, err))) return rc;
    const int64_t n = (int64_t)T * HD;
    mse_kernel<<<(unsigned)std::min<int64_t>((n + 255) / 256, 1024), 256, 0, ctx->stream>>>(y, target, n, mse_dev);
    STC_LAUNCHED(err, "mse_kernel");
    if (!grad_dev || !cfg->linear || n_chunks < 3) return STILL_OK;   /* no row reaches the linear branch */

    const size_t per_chunk = (size_t)H * P * (D + 1);
    if ((rc = ws_grow(ctx, w, WS_TDPRE, cfg->gate ? (size_t)T * HD * sizeof(float) : 4, "still training gate gradients",
                      err)) ||
        (rc = ws_grow(ctx, w, WS_TDS, (size_t)n_chunks * per_chunk * sizeof(float), "still training state gradients",
                      err)) ||
        (rc = ws_grow(ctx, w, WS_TFLAG, (size_t)s->Hs * T, "still training selection flags", err)))
        return rc;
    float *dpre = (float *)w->buf[WS_TDPRE], *dS = (float *)w->buf[WS_TDS];
    unsigned char *flag = (unsigned char *)w->buf[WS_TFLAG];
    const size_t smem = bwd_layout<64>::TOTAL * sizeof(float);
    if (smem > ctx->smem_optin)
        return stc_fail(err, STILL_E_UNSUPPORTED, "still training: %zu bytes of shared memory needed, the device allows %zu",
                        smem, ctx->smem_optin);
    if (!s->bwd_ready) {   /* once per state, so that a later call can be recorded in a CUDA graph */
        STC_CUDA(err, cudaFuncSetAttribute(bwd_q_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        STC_CUDA(err, cudaFuncSetAttribute(bwd_k_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        s->bwd_ready = 1;
    }

    /* the forward's arguments (the workspace as it left it) */
    args a;
    memset(&a, 0, sizeof a);
    a.H = H, a.Hk = s->Hk, a.G = s->G, a.D = D, a.C = C, a.P = P, a.Hs = s->Hs, a.d = s->d;
    a.lam = s->lam, a.cap = s->cap, a.sel_rows = s->sel_rows;
    a.fd_c = make_fast_div(C), a.fd_rt = make_fast_div(row_tiles(C));
    a.per_kv = cfg->per_kv_head != 0, a.routing = cfg->routing, a.linear = 1, a.gate = cfg->gate != 0;
    a.lolcats = cfg->lolcats != 0;
    a.gate_den = a.gate && cfg->gate_den;
    a.slot_floats = (size_t)H * P * (D + 1);
    a.T = T;
    a.q = q, a.k = k, a.v = v, a.params = params_dev, a.out = y;
    a.ldq = (size_t)a.H * a.D, a.ldkv = (size_t)a.Hk * a.D, a.ldpre = (size_t)a.H * a.D;
    a.slots = (float *)w->buf[WS_SLOTS], a.lbuf = (float *)w->buf[WS_LBUF], a.pre = (const float *)w->buf[WS_PRE];

    STC_CUDA(err, cudaMemsetAsync(flag, 0, (size_t)s->Hs * T, ctx->stream));
    STC_CUDA(err, cudaMemsetAsync(dS, 0, (size_t)n_chunks * per_chunk * sizeof(float), ctx->stream));
    const int cnt = sel_count(n_left(T, C), s->lam, s->cap);
    if (cnt > 0) {
        flags_kernel<<<(unsigned)s->Hs, 128, 0, ctx->stream>>>(s->sel_pos, s->sel_rows, cnt, T, flag);
        STC_LAUNCHED(err, "flags_kernel");
    }
    const float coef = 2.0f * scale / (float)n;
    const int n_rt = row_tiles(C);
    bwd_q_kernel<64><<<dim3((unsigned)((n_chunks - 2) * n_rt), (unsigned)H), kBT, smem, ctx->stream>>>(
        a, target, coef, grad_dev, dS, dpre);
    STC_LAUNCHED(err, "bwd_q_kernel");
    suffix_kernel<<<(unsigned)((per_chunk + 255) / 256), 256, 0, ctx->stream>>>(dS, n_chunks, per_chunk);
    STC_LAUNCHED(err, "suffix_kernel");
    const int n_leave = n_left(T, C);
    if (n_leave > 0) {
        bwd_k_kernel<64><<<dim3((unsigned)(n_leave * n_rt), (unsigned)H), kBT, smem, ctx->stream>>>(a, flag, dS,
                                                                                                     grad_dev);
        STC_LAUNCHED(err, "bwd_k_kernel");
    }
    if (cfg->gate) {
        /* rows of chunks >= 2 (the others have no linear branch) */
        /* on the tensor cores in TF32 (s->grad_tf32, from STILL_CUDA_GRAD_TF32 at creation; fp32 when
         * cuBLASLt has no TF32 algorithm for the shape) */
        const int r0 = 2 * C;
        const float *A = dpre + (size_t)r0 * HD, *B = x_f32 + (size_t)r0 * s->d;
        float *dWg = grad_dev + par_wg(a);
        rc = s->grad_tf32 ? stc_gemm_tf32_at_b(ctx, HD, s->d, T - r0, A, B, dWg, 1.0f, err) : STILL_E_UNSUPPORTED;
        if (rc == STILL_E_UNSUPPORTED) rc = stc_gemm_f32_at_b(ctx, HD, s->d, T - r0, A, B, dWg, 1.0f, err);
        if (rc) return rc;
    }
    return STILL_OK;
}
