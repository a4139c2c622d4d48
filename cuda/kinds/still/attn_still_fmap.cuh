/* NP-Map, the still feature map (and, with hedgehog, lolcats' Hedgehog map), one vector per warp (used by the fold in
 * attn_still_leave.cu with the k-map and by attn_still_linear.cu with the
 * q-map). The float operations follow src/kinds/still/attn_still.c's feature_rows:
 *   x̃ = x - f u,  f = 2 (x·u) / (u·u)   (0 when u·u = 0)
 *   z = W x̃
 *   z ← z · ‖x‖ / max(‖z‖, 1e-12)
 *   φ = [softmax(z) ⊕ softmax(-z)], each entry at least 1e-12
 * (sums are warp reductions, so they round differently from the CPU's, by
 * float ulps). */
#ifndef STILL_CUDA_ATTN_STILL_FMAP_CUH
#define STILL_CUDA_ATTN_STILL_FMAP_CUH

#include "kinds/still/attn_still_internal.cuh"

namespace stillk {

/* Loads head h's NP-Map of one side into shared memory: W as [D][D + 1]
 * (the padding keeps the lanes of z = W x̃, which read different rows, on
 * different banks) and u. The caller synchronises. */
template <int D>
__device__ __forceinline__ void npmap_load(const float *__restrict__ W, const float *__restrict__ u, float *Ws,
                                           float *us) {
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) Ws[(e / D) * (D + 1) + e % D] = W[e];
    for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = u[e];
}

/* Head h's feature map of one side (0: q, 1: k) into shared memory, for
 * npmap_warp: NP-Map as npmap_load; lolcats' Hedgehog map z = x W (W [D][F],
 * F = D) as Ws = Wᵀ with u = 0 (no reflection), so that z = Ws x too. */
template <int D>
__device__ __forceinline__ void fmap_load(const args &a, int side, int h, float *Ws, float *us) {
    if (!a.lolcats) {
        npmap_load<D>(a.params + (side ? par_k_w(a, h) : par_q_w(a, h)),
                      a.params + (side ? par_k_u(a, h) : par_q_u(a, h)), Ws, us);
        return;
    }
    const float *W = a.params + (side ? par_k_w(a, h) : par_q_w(a, h));
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) Ws[(e % D) * (D + 1) + e / D] = W[e];   /* W[d][f] -> Ws[f][d] */
    for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = 0.0f;
}

/* u·u, computed by every warp for itself. */
template <int D>
__device__ __forceinline__ float npmap_uu(const float *us, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 32; j++) s += us[lane + 32 * j] * us[lane + 32 * j];
    return warp_sum(s);
}

/* The NP-Map's first steps for one vector, one warp (element lane + 32 j
 * of a vector in [j]): x and u into xv, uv; x·u and ‖x‖² into xu, xx;
 * x̃ = x - f u into xt (shared, D floats); z0 = W x̃ and ‖z0‖² into z0, zz
 * (sums on every lane), for npmap_warp. */
template <int D>
__device__ __forceinline__ void npmap_project(const float *__restrict__ x, const float *us, const float *Ws, float uu,
                                              float *xt, int lane, float (&xv)[D / 32], float (&uv)[D / 32],
                                              float &xu_out, float &xx_out, float (&z0)[D / 32], float &zz_out) {
    constexpr int J = D / 32;
    float xu = 0.0f, xx = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        xv[j] = x[lane + 32 * j];
        uv[j] = us[lane + 32 * j];
        xu += xv[j] * uv[j];
        xx += xv[j] * xv[j];
    }
    xu = warp_sum(xu);
    xx = warp_sum(xx);
    xu_out = xu;
    const float f = still_npmap_reflect(xu, uu);
#pragma unroll
    for (int j = 0; j < J; j++) xt[lane + 32 * j] = xv[j] - f * uv[j];
    __syncwarp();
    float zz = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const float *w = Ws + (lane + 32 * j) * (D + 1);
        float acc = 0.0f;
#pragma unroll 16
        for (int m = 0; m < D; m++) acc = fmaf(w[m], xt[m], acc);
        z0[j] = acc;
        zz += acc * acc;
    }
    __syncwarp();   /* xt may be rewritten by the warp's next vector */
    xx_out = xx;
    zz_out = warp_sum(zz);
}

/* One warp: phi (shared, 2D floats) = φ(x) for x (global, D floats).
 * xt: this warp's shared scratch of D floats. */
template <int D>
__device__ __forceinline__ void npmap_warp(const float *__restrict__ x, const float *us, const float *Ws, float uu,
                                           float *xt, float *phi, int lane, bool hedgehog = false) {
    constexpr int J = D / 32;
    float xv[J], uv[J], xu, xx, z[J], zz;
    npmap_project<D>(x, us, Ws, uu, xt, lane, xv, uv, xu, xx, z, zz);
    const float nx = sqrtf(xx), nz = sqrtf(zz);
    const float sc = hedgehog ? 1.0f : still_npmap_rescale(nx, nz);   /* Hedgehog: z as it is */
    float mx = -INFINITY, mn = INFINITY;
#pragma unroll
    for (int j = 0; j < J; j++) {
        z[j] *= sc;
        mx = fmaxf(mx, z[j]);
        mn = fminf(mn, z[j]);
    }
    mx = warp_max(mx);
    mn = warp_min(mn);
    float e1[J], e2[J], s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int j = 0; j < J; j++) {
        e1[j] = expf(z[j] - mx);    /* softmax(z) */
        e2[j] = expf(-z[j] + mn);   /* softmax(-z): max(-z) = -min(z) */
        s1 += e1[j];
        s2 += e2[j];
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    const float i1 = 1.0f / s1, i2 = 1.0f / s2;
#pragma unroll
    for (int j = 0; j < J; j++) {
        phi[lane + 32 * j] = fmaxf(e1[j] * i1, kFmapClamp);
        phi[D + lane + 32 * j] = fmaxf(e2[j] * i2, kFmapClamp);
    }
}

}   // namespace stillk

#endif
