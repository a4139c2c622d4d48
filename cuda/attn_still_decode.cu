/* still on the GPU, decode steps (T = 1): steps 2, 5 and 6 of
 * attn_still_internal.cuh's sequence specialised for one query row. The
 * chunk-parallel kernels launch one block per (64-row tile, head) and spend
 * most of a step loading tiles for a single row (measured with Nsight
 * Compute at SmolLM2's shape: score 26 µs, attention 15 µs, linear 25 µs per
 * layer); these spread the one row's work over more blocks and do only what
 * one row needs. Leave, scan and finish are shared with the general path.
 *
 *   score_decode   block per query head: the logits of the token t = p0
 *                  against its window R(t) (one key per thread, fp32, the
 *                  same fmaf order over the head dim as score_kernel, so the
 *                  qk scores are the same bits); saliency f(p) in double.
 *   attn_decode    block per (query head, split of 128 keys) over the key
 *                  list Sel ∪ Local(t) of make_keys: logits, the split's
 *                  max m, Σ e^{s-m} and o = Σ e^{s-m} v into a partial.
 *                  Operands rounded as the tensor-core kernel rounds them
 *                  (q, keys, values and the weights to IEEE half, fp32
 *                  sums), so a decode step and a prefill agree to float
 *                  rounding of the sums' order.
 *   linear_decode  block per query head: merges the partials, then as
 *                  linear_kernel: φq, φqᵀS_c, φq·z_c, the gate and the
 *                  division (or o / (l + ε) without a linear term).
 *
 * Grid sizes depend on the configuration only (graph-capturable). */
#include "attn_still_fmap.cuh"
#include "mma_ptx.cuh"

namespace stillk {
namespace {

constexpr int kDecThreads = 128;   /* >= kMaxChunk: one window key per thread */
constexpr int kSplitKeys = 128;    /* keys per attention block */
constexpr int kLinThreads = 256;

__device__ __forceinline__ float round_half(float x) { return __half2float(__float2half_rn(x)); }

/* Block-wide max / sum over kDecThreads threads (red: 32 floats of shared). */
__device__ __forceinline__ float block_max(float v, float *red) {
    v = warp_max(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = -INFINITY;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) r = fmaxf(r, red[w]);
    return r;
}
__device__ __forceinline__ float block_sum(float v, float *red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) r += red[w];
    return r;
}

template <int D>
__global__ void __launch_bounds__(kDecThreads) score_decode_kernel(const args a) {
    __shared__ float red[32];
    __shared__ float self_s;
    const int p0 = *a.n_seen, t = p0, h = blockIdx.x, hk = h / a.G, j = threadIdx.x;
    const int key = t - j;
    const bool ok = j < a.C && key >= 0;   /* R(t) = t-C+1 .. t */
    float val = -INFINITY;
    if (ok) {
        const float4 *q4 = reinterpret_cast<const float4 *>(a.q + (size_t)h * D);
        const float4 *k4 = reinterpret_cast<const float4 *>(kv_row(a, p0, key, hk, 0));
        float4 kr[D / 4];   /* the whole row's loads issued before the sums */
#pragma unroll
        for (int i = 0; i < D / 4; i++) kr[i] = k4[i];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < D / 4; i++) {
            const float4 qv = q4[i];
            acc = fmaf(qv.x, kr[i].x, acc), acc = fmaf(qv.y, kr[i].y, acc);
            acc = fmaf(qv.z, kr[i].z, acc), acc = fmaf(qv.w, kr[i].w, acc);
        }
        val = acc * a.scale;
        if (a.routing == R_QK) *score_ptr(a, p0, h, key) += (double)val;
    }
    if (a.routing != R_SALIENCY) return;
    if (j == 0) self_s = val;
    const float m = block_max(val, red);   /* the barriers also publish self_s */
    const float l = block_sum(ok ? expf(val - m) : 0.0f, red);
    if (j == 0) *score_ptr(a, p0, h, t) = saliency_of_p((double)(expf(self_s - m) / l));
}

/* npmap_load for a block of NT threads: W's float4 loads all issued before
 * the stores (a loop of dependent L2 round trips took ~10 µs per layer). W
 * and u 16-byte aligned. */
template <int D, int NT>
__device__ __forceinline__ void npmap_load_batched(const float *__restrict__ W, const float *__restrict__ u, float *Ws,
                                                   float *us) {
    constexpr int N4 = D * D / 4, PER = (N4 + NT - 1) / NT;
    const float4 *W4 = reinterpret_cast<const float4 *>(W);
    float4 r[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e4 = (int)threadIdx.x + i * NT;
        if (e4 < N4) r[i] = __ldg(W4 + e4);
    }
#pragma unroll
    for (int i = 0; i < PER; i++) {
        const int e4 = (int)threadIdx.x + i * NT;
        if (e4 >= N4) break;
        float *dst = Ws + (4 * e4 / D) * (D + 1) + 4 * e4 % D;
        dst[0] = r[i].x, dst[1] = r[i].y, dst[2] = r[i].z, dst[3] = r[i].w;
    }
    for (int e = threadIdx.x; e < D; e += NT) us[e] = u[e];
}

/* The linear branch's numerator and denominator term of head h for the
 * token t = p0, written to lin[h·(D + 1) ..]: φqᵀS_c (D floats) then φq·z_c.
 * Run by the extra row of attn_decode's grid, so that it overlaps the
 * attention splits. Ws: dynamic shared memory of D·(D + 1) floats. */
template <int D>
__device__ __forceinline__ void linear_numerator(const args &a, float *lin, float *Ws) {
    constexpr int P = 2 * D, NP = kDecThreads / D;   /* NP parts of the feature dimension */
    __shared__ float us[D], xt[D], phi[P], zs[P];
    __shared__ float acc_s[NP][D];
    __shared__ float bz_s;
    const int p0 = *a.n_seen, t = p0, h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int C = a.C, c = t / C;
    if (!(a.linear && c >= 2)) return;   /* uniform; linear_decode does not read it then */
    const call_geom g = make_geom(p0, 1, C);
    const int idx = lin_index(g, c);
    const float *src = idx == 0 ? a.lin : a.slots + (size_t)(idx - 1) * a.slot_floats;
    const float *S = src + (size_t)h * P * D;
    const float *z = src + (size_t)a.H * P * D + (size_t)h * P;
    if (a.lolcats) fmap_load<D>(a, 0, h, Ws, us);
    else npmap_load_batched<D, kDecThreads>(a.params + par_q_w(a, h), a.params + par_q_u(a, h), Ws, us);
    for (int p = tid; p < P; p += kDecThreads) zs[p] = z[p];
    __syncthreads();
    if (warp == 0) npmap_warp<D>(a.q + (size_t)h * D, us, Ws, npmap_uu<D>(us, lane), xt, phi, lane, a.lolcats);
    __syncthreads();
    {   /* φqᵀ S: part k sums the features k·P/NP .. (k+1)·P/NP - 1 */
        const int k = tid / D, d = tid % D;
        const float *Sk = S + (size_t)k * (P / NP) * D + d;
        float acc = 0.0f;
        float sv[P / NP];   /* the column's loads issued before the sums */
#pragma unroll
        for (int p = 0; p < P / NP; p++) sv[p] = Sk[(size_t)p * D];
#pragma unroll
        for (int p = 0; p < P / NP; p++) acc = fmaf(phi[k * (P / NP) + p], sv[p], acc);
        acc_s[k][d] = acc;
    }
    if (warp == 0) {
        float bz = 0.0f;
        for (int p = lane; p < P; p += 32) bz = fmaf(phi[p], zs[p], bz);
        bz = warp_sum(bz);
        if (lane == 0) bz_s = bz;
    }
    __syncthreads();
    float *out = lin + (size_t)h * (D + 1);
    for (int d = tid; d < D; d += kDecThreads) {
        float lv = 0.0f;
#pragma unroll
        for (int k = 0; k < NP; k++) lv += acc_s[k][d];
        out[d] = lv;
    }
    if (tid == 0) out[D] = bz_s;
}

/* Partial of split s of head h: [m, l, o[D]] at part + (h·n_split + s)·(D + 2). */
template <int D>
__global__ void __launch_bounds__(kDecThreads) attn_decode_kernel(const args a, float *part, int n_split) {
    constexpr int DP = D / 2, G2 = kDecThreads / DP;   /* pass 2: G2 groups of D / 2 threads (dimension pairs) */
    __shared__ float red[32];
    __shared__ float ps[kSplitKeys];      /* half-rounded weights */
    __shared__ float qs[D];
    __shared__ float os[G2][D];
    extern __shared__ __align__(16) float dyn_smem[];
    if ((int)blockIdx.y == n_split) {   /* the grid's extra row: the linear branch (linear on) */
        linear_numerator<D>(a, part + (size_t)a.H * n_split * (D + 2), dyn_smem);
        return;
    }
    const int p0 = *a.n_seen, t = p0, h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
    const int hk = h / a.G, hs = a.per_kv ? hk : h, C = a.C;
    const int c = t / C;
    const key_list kl = make_keys(c, t, C, a.lam, a.cap);
    const int n_local = t - kl.lo_pos + 1, n_keys = kl.ns + n_local;
    const int e0 = s * kSplitKeys;
    float *out = part + ((size_t)h * n_split + s) * (D + 2);
    if (e0 >= n_keys) {   /* uniform: an empty split */
        if (tid == 0) out[0] = -INFINITY, out[1] = 0.0f;
        return;
    }
    for (int d = tid; d < D; d += kDecThreads) qs[d] = round_half(a.q[(size_t)h * D + d]);
    __syncthreads();

    /* pass 1: one key per thread */
    const int e = e0 + tid;
    const bool ok = tid < kSplitKeys && e < n_keys;
    float sv = -INFINITY;
    if (ok) {   /* 16-byte loads, all issued before the sums (the row is 128 or 256 bytes) */
        float acc = 0.0f;
        if (e < kl.ns) {
            const uint4 *k = reinterpret_cast<const uint4 *>(a.sel_k + ((size_t)hs * a.sel_rows + e) * D);
            uint4 kr[D / 8];
#pragma unroll
            for (int i = 0; i < D / 8; i++) kr[i] = k[i];
#pragma unroll
            for (int i = 0; i < D / 8; i++) {
                const __half2 *h2 = reinterpret_cast<const __half2 *>(&kr[i]);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = __half22float2(h2[j]);
                    acc = fmaf(qs[8 * i + 2 * j], f.x, acc);
                    acc = fmaf(qs[8 * i + 2 * j + 1], f.y, acc);
                }
            }
        } else {
            const float4 *k = reinterpret_cast<const float4 *>(kv_row(a, p0, kl.lo_pos + (e - kl.ns), hk, 0));
            float4 kr[D / 4];
#pragma unroll
            for (int i = 0; i < D / 4; i++) kr[i] = k[i];
#pragma unroll
            for (int i = 0; i < D / 4; i++) {
                acc = fmaf(qs[4 * i], round_half(kr[i].x), acc);
                acc = fmaf(qs[4 * i + 1], round_half(kr[i].y), acc);
                acc = fmaf(qs[4 * i + 2], round_half(kr[i].z), acc);
                acc = fmaf(qs[4 * i + 3], round_half(kr[i].w), acc);
            }
        }
        sv = acc;
    }
    const float m = block_max(sv, red);
    const float msc = m * a.scale_log2;
    const float p = ok ? stc_ptx::ex2(fmaf(sv, a.scale_log2, -msc)) : 0.0f;
    if (tid < kSplitKeys) ps[tid] = round_half(p);
    const float l = block_sum(p, red);   /* its barriers publish ps */

    /* pass 2: o[d] = Σ p_j v_j[d]: thread (g, dp) takes the dimension pair dp of keys g, g + G2, ...
     * (Sel rows, then Local rows), eight rows' loads issued before their sums */
    const int g = tid / DP, dp = tid % DP;
    const int n_here = min(kSplitKeys, n_keys - e0);
    const int n_sel = max(0, min(n_here, kl.ns - e0));   /* the split's first n_sel keys are Sel rows */
    float2 o = make_float2(0.0f, 0.0f);
    {
        const __half2 *sv2 = reinterpret_cast<const __half2 *>(a.sel_v + ((size_t)hs * a.sel_rows + e0) * D) + dp;
        for (int i0 = g; i0 < n_sel; i0 += 8 * G2) {
            float2 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * G2;
                v[u] = i < n_sel ? __half22float2(sv2[(size_t)i * DP]) : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * G2;
                const float w = i < n_sel ? ps[i] : 0.0f;
                o.x = fmaf(w, v[u].x, o.x), o.y = fmaf(w, v[u].y, o.y);
            }
        }
        const int first_local = n_sel + ((g - n_sel) % G2 + G2) % G2;   /* the group's first key at or after n_sel */
        for (int i0 = first_local; i0 < n_here; i0 += 8 * G2) {
            float2 v[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * G2;
                v[u] = i < n_here ? *reinterpret_cast<const float2 *>(kv_row(a, p0, kl.lo_pos + (e0 + i - kl.ns), hk, 1) + 2 * dp)
                                  : make_float2(0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * G2;
                const float w = i < n_here ? ps[i] : 0.0f;
                o.x = fmaf(w, round_half(v[u].x), o.x), o.y = fmaf(w, round_half(v[u].y), o.y);
            }
        }
    }
    os[g][2 * dp] = o.x, os[g][2 * dp + 1] = o.y;
    __syncthreads();
    if (tid < D) {
        float r = 0.0f;
#pragma unroll
        for (int q = 0; q < G2; q++) r += os[q][tid];
        out[2 + tid] = r;
    }
    if (tid == 0) out[0] = m, out[1] = l;
}

template <int D>
__global__ void __launch_bounds__(kLinThreads) linear_decode_kernel(const args a, const float *part, int n_split) {
    __shared__ float os[D];
    __shared__ float ml[2];
    const int p0 = *a.n_seen, t = p0, h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int C = a.C, c = t / C;
    const bool lin = a.linear && c >= 2;

    /* merge the splits: m = max, l and o rescaled by 2^{(m_s - m) log2 e / sqrt(D)} */
    if (warp == 0) {   /* lane s takes splits s, s + 32, ... */
        float m = -INFINITY;
        for (int s = lane; s < n_split; s += 32) m = fmaxf(m, part[((size_t)h * n_split + s) * (D + 2)]);
        m = warp_max(m);
        float l = 0.0f;
        for (int s = lane; s < n_split; s += 32) {
            const float *ps = part + ((size_t)h * n_split + s) * (D + 2);
            if (ps[0] != -INFINITY) l += ps[1] * stc_ptx::ex2(ps[0] * a.scale_log2 - m * a.scale_log2);
        }
        l = warp_sum(l);
        if (lane == 0) ml[0] = m, ml[1] = l;
    }
    __syncthreads();
    const float m = ml[0];
    for (int d = tid; d < D; d += kLinThreads) {
        float o = 0.0f;
        for (int s = 0; s < n_split; s++) {
            const float *ps = part + ((size_t)h * n_split + s) * (D + 2);
            if (ps[0] != -INFINITY) o += ps[2 + d] * stc_ptx::ex2(ps[0] * a.scale_log2 - m * a.scale_log2);
        }
        os[d] = o;
    }
    float *y = a.out + (size_t)h * D;
    const float gam = softmax_factor(a, h);   /* lolcats' γ on the softmax sums */
    if (!lin) {
        for (int d = tid; d < D; d += kLinThreads) y[d] = gam * os[d] / (gam * ml[1] + kDenEps);
        return;
    }
    /* the numerator φqᵀS and φq·z from attn_decode's extra row */
    const float *ln = part + (size_t)a.H * n_split * (D + 2) + (size_t)h * (D + 1);
    const float inv = 1.0f / (gam * ml[1] + ln[D] + kDenEps);
    const float *pre = a.gate ? a.pre + (size_t)h * D : nullptr;
    const float *bg = a.gate ? a.params + par_bg(a) + (size_t)h * D : nullptr;
    for (int d = tid; d < D; d += kLinThreads) {
        float lv = ln[d];
        if (pre) lv *= 1.0f / (1.0f + expf(-(pre[d] + bg[d])));
        y[d] = (gam * os[d] + lv) * inv;
    }
}

}   // namespace

int decode_splits(int cap, int C) { return cdiv(cap + 2 * C, kSplitKeys); }

static size_t smem_attn_decode(int D) { return (size_t)D * (D + 1) * sizeof(float); }   /* the q-map's W */

int prepare_decode(int D, still_err *err) {
    const int bytes = (int)smem_attn_decode(D);
    if (D == 64)
        STC_CUDA(err, cudaFuncSetAttribute(attn_decode_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else
        STC_CUDA(err, cudaFuncSetAttribute(attn_decode_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return STILL_OK;
}

int launch_score_decode(stc_ctx *ctx, const args &a, still_err *err) {
    if (a.routing == R_KEYNORM) return launch_score(ctx, a, err);   /* already one warp per (token, KV head) */
    if (a.routing != R_SALIENCY && a.routing != R_QK) return STILL_OK;
    if (a.D == 64) score_decode_kernel<64><<<a.H, kDecThreads, 0, ctx->stream>>>(a);
    else score_decode_kernel<128><<<a.H, kDecThreads, 0, ctx->stream>>>(a);
    STC_LAUNCHED(err, "score_decode_kernel");
    return STILL_OK;
}

int launch_attn_linear_decode(stc_ctx *ctx, const args &a, float *part, still_err *err) {
    const int n_split = decode_splits(a.cap, a.C);
    /* one more row of blocks for the linear branch's numerator (it overlaps the attention splits) */
    const dim3 grid((unsigned)a.H, (unsigned)(n_split + (a.linear ? 1 : 0)));
    const size_t smem = a.linear ? smem_attn_decode(a.D) : 0;
    if (a.D == 64) attn_decode_kernel<64><<<grid, kDecThreads, smem, ctx->stream>>>(a, part, n_split);
    else attn_decode_kernel<128><<<grid, kDecThreads, smem, ctx->stream>>>(a, part, n_split);
    STC_LAUNCHED(err, "attn_decode_kernel");
    if (a.D == 64) linear_decode_kernel<64><<<a.H, kLinThreads, 0, ctx->stream>>>(a, part, n_split);
    else linear_decode_kernel<128><<<a.H, kLinThreads, 0, ctx->stream>>>(a, part, n_split);
    STC_LAUNCHED(err, "linear_decode_kernel");
    return STILL_OK;
}

}   // namespace stillk
