/* still on the GPU, decode steps (T = 1): steps 2, 5, 6 and 7 of
 * attn_still_internal.cuh's sequence specialised for one query row. The
 * chunk-parallel kernels launch one block per (64-row tile, head) and spend
 * most of a step loading tiles for a single row (measured with Nsight
 * Compute at SmolLM2's shape: score 26 µs, attention 15 µs, linear 25 µs per
 * layer); these spread the one row's work over more blocks and do only what
 * one row needs. Leave and scan are shared with the general path (and
 * skipped by stc_still_set_decode_no_leave's promise).
 *
 *   score_decode   block per query head: the logits of the token t = p0
 *                  against its window R(t) (one key per thread, fp32, the
 *                  same fmaf order over the head dim as score_kernel, so the
 *                  qk scores are the same bits); saliency f(p) in double.
 *                  Saliency routing: a row of attn_decode's grid instead
 *                  of a kernel of its own (nothing this step reads it).
 *   attn_decode    block per (query head, split of 128 keys) over the key
 *                  list Sel ∪ Local(t) of make_keys: logits, the split's
 *                  max m, Σ e^{s-m} and o = Σ e^{s-m} v into a partial.
 *                  Operands rounded as the tensor-core kernel rounds them
 *                  (q, keys, values and the weights to IEEE half, fp32
 *                  sums), so a decode step and a prefill agree to float
 *                  rounding of the sums' order. Extra rows of the grid: the
 *                  linear branch's numerator φqᵀS_c, φq·z_c (linear on),
 *                  then the saliency.
 *   linear_decode  block per query head: merges the partials, then as
 *                  linear_kernel: the gate and the division (per channel
 *                  with gate_den; o / (l + ε) without a linear term); then
 *                  finish_kernel's work, spread over the blocks.
 *
 * A decode step thus launches two kernels (with no chunk leaving and the
 * saliency routing), both with Programmatic Dependent Launch
 * (stc_launch_pdl): before stc_pdl_wait they read only the parameters.
 * linear_decode takes the position from attn_decode (decode_p0), so that
 * its block 0 can advance n_seen without a race.
 * Grid sizes depend on the configuration only (graph-capturable). */
#include "kinds/still/attn_still_fmap.cuh"
#include "common/mma_ptx.cuh"

namespace stillk {
namespace {

constexpr int kDecThreads = 128;   /* >= kMaxChunk: one window key per thread */

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

/* The scores of token t = p0 for query head h, by a block of kDecThreads
 * threads (one window key each). */
template <int D>
__device__ __forceinline__ void score_decode_row(const args &a, int h) {
    __shared__ float red[32];
    __shared__ float self_s;
    const int p0 = *a.n_seen, t = p0, hk = h / a.G, j = threadIdx.x;
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

template <int D>
__global__ void __launch_bounds__(kDecThreads) score_decode_kernel(const args a) {
    score_decode_row<D>(a, blockIdx.x);
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
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    /* the q-map's parameters do not change during decoding: loaded before the wait */
    if (a.lolcats) fmap_load<D>(a, 0, h, Ws, us);
    else npmap_load_batched<D, kDecThreads>(a.params + par_q_w(a, h), a.params + par_q_u(a, h), Ws, us);
    stc_pdl_wait();
    const int p0 = *a.n_seen, t = p0;
    const int C = a.C, c = t / C;
    if (!(a.linear && c >= 2)) return;   /* uniform; the merge does not read it then */
    const call_geom g = make_geom(p0, 1, C);
    const int idx = lin_index(g, c);
    const float *src = idx == 0 ? a.lin : a.slots + (size_t)(idx - 1) * a.slot_floats;
    const float *S = src + (size_t)h * P * D;
    const float *z = src + (size_t)a.H * P * D + (size_t)h * P;
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

/* Partial of split s of head h: [m, l, o[D]] at part + (h·n_split + s)·(D + 2).
 * SK keys per split; pass 1 gives each key KPT = kDecThreads / SK threads
 * (a part of the head dim each, summed with a shuffle). */
template <int D, int SK>
__device__ __forceinline__ void attn_split(const args &a, float *part, int n_split) {
    constexpr int DP = D / 2, G2 = kDecThreads / DP;   /* pass 2: G2 groups of D / 2 threads (dimension pairs) */
    constexpr int KPT = kDecThreads / SK, DK = D / KPT;   /* pass 1: threads per key, dims per thread */
    static_assert(KPT == 1 || KPT == 2 || KPT == 4, "a split has kDecThreads / 1, 2 or 4 keys");
    __shared__ float red[32];
    __shared__ float ps[SK];      /* half-rounded weights */
    __shared__ float qs[D];
    __shared__ float os[G2][D];
    const int p0 = *a.n_seen, t = p0, h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
    const int hk = h / a.G, hs = a.per_kv ? hk : h, C = a.C;
    const int c = t / C;
    const key_list kl = make_keys(c, t, C, a.lam, a.cap);
    const int n_local = t - kl.lo_pos + 1, n_keys = kl.ns + n_local;
    const int e0 = s * SK;
    float *out = part + ((size_t)h * n_split + s) * (D + 2);
    if (e0 >= n_keys) {   /* uniform: an empty split */
        if (tid == 0) out[0] = -INFINITY, out[1] = 0.0f;
        return;
    }
    for (int d = tid; d < D; d += kDecThreads) qs[d] = round_half(a.q[(size_t)h * D + d]);
    __syncthreads();

    /* pass 1: key kk = tid / KPT, dims part · DK .. + DK - 1 */
    const int kk = tid / KPT, part0 = (tid % KPT) * DK;
    const int e = e0 + kk;
    const bool ok = e < n_keys;
    float acc = 0.0f;
    if (ok) {   /* 16-byte loads, all issued before the sums */
        if (e < kl.ns && a.sel_q8) {   /* 8-bit keys: the sum over the bytes, then the row's scale (as the CPU) */
            const size_t row = (size_t)hs * a.sel_rows + e;
            static_assert(DK % 16 == 0, "16-byte loads");
            const uint4 *k = reinterpret_cast<const uint4 *>(a.sel_k8 + row * D + part0);
            uint4 kr[DK / 16];
#pragma unroll
            for (int i = 0; i < DK / 16; i++) kr[i] = k[i];
#pragma unroll
            for (int i = 0; i < DK / 16; i++) {
                const int8_t *b = reinterpret_cast<const int8_t *>(&kr[i]);
#pragma unroll
                for (int j = 0; j < 16; j++) acc = fmaf(qs[part0 + 16 * i + j], (float)b[j], acc);
            }
        } else if (e < kl.ns) {
            const uint4 *k = reinterpret_cast<const uint4 *>(a.sel_k + ((size_t)hs * a.sel_rows + e) * D + part0);
            uint4 kr[DK / 8];
#pragma unroll
            for (int i = 0; i < DK / 8; i++) kr[i] = k[i];
#pragma unroll
            for (int i = 0; i < DK / 8; i++) {
                const __half2 *h2 = reinterpret_cast<const __half2 *>(&kr[i]);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 f = __half22float2(h2[j]);
                    acc = fmaf(qs[part0 + 8 * i + 2 * j], f.x, acc);
                    acc = fmaf(qs[part0 + 8 * i + 2 * j + 1], f.y, acc);
                }
            }
        } else {
            const float4 *k = reinterpret_cast<const float4 *>(kv_row(a, p0, kl.lo_pos + (e - kl.ns), hk, 0) + part0);
            float4 kr[DK / 4];
#pragma unroll
            for (int i = 0; i < DK / 4; i++) kr[i] = k[i];
#pragma unroll
            for (int i = 0; i < DK / 4; i++) {
                acc = fmaf(qs[part0 + 4 * i], round_half(kr[i].x), acc);
                acc = fmaf(qs[part0 + 4 * i + 1], round_half(kr[i].y), acc);
                acc = fmaf(qs[part0 + 4 * i + 2], round_half(kr[i].z), acc);
                acc = fmaf(qs[part0 + 4 * i + 3], round_half(kr[i].w), acc);
            }
        }
    }
#pragma unroll
    for (int o = 1; o < KPT; o <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (a.sel_q8 && ok && e < kl.ns) acc *= a.sel_ks[(size_t)hs * a.sel_rows + e];
    const float sv = ok ? acc : -INFINITY;
    const float m = block_max(sv, red);
    const float msc = m * a.scale_log2;
    const float p = ok ? stc_ptx::ex2(fmaf(sv, a.scale_log2, -msc)) : 0.0f;
    if (tid % KPT == 0) ps[kk] = round_half(p);
    const float l = block_sum(tid % KPT == 0 ? p : 0.0f, red);   /* its barriers publish ps */

    /* pass 2: o[d] = Σ p_j v_j[d]: thread (g, dp) takes the dimension pair dp of keys g, g + G2, ...
     * (Sel rows, then Local rows), eight rows' loads issued before their sums */
    const int g = tid / DP, dp = tid % DP;
    const int n_here = min(SK, n_keys - e0);
    const int n_sel = max(0, min(n_here, kl.ns - e0));   /* the split's first n_sel keys are Sel rows */
    float2 o = make_float2(0.0f, 0.0f);
    if (a.sel_q8) {   /* 8-bit values: the weight takes the row's scale (as the CPU) */
        const size_t row0 = (size_t)hs * a.sel_rows + e0;
        const char2 *sv2 = reinterpret_cast<const char2 *>(a.sel_v8 + row0 * D) + dp;
        for (int i0 = g; i0 < n_sel; i0 += 8 * G2) {
            float2 v[8];
            float w[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                const int i = i0 + u * G2;
                const char2 b = i < n_sel ? sv2[(size_t)i * DP] : make_char2(0, 0);
                v[u] = make_float2((float)b.x, (float)b.y);
                w[u] = i < n_sel ? ps[i] * a.sel_vs[row0 + i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 8; u++) o.x = fmaf(w[u], v[u].x, o.x), o.y = fmaf(w[u], v[u].y, o.y);
        }
    } else {
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
    }
    {
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

/* Where attn_decode leaves the step's position for the merge kernels (an
 * int after the partials and the numerators): they do not read n_seen, which
 * they advance. */
__device__ __forceinline__ int *decode_p0(const args &a, float *part, int n_split) {
    return reinterpret_cast<int *>(part + (size_t)a.H * n_split * (a.D + 2) + (size_t)a.H * (a.D + 1));
}

/* The gate g_d = σ(pre_d + bg_d) of element d of head h. */
template <int D>
__device__ __forceinline__ float head_gate(const args &a, int h, int d) {
    return sigmoid(a.pre[(size_t)h * D + d] + a.params[par_bg(a) + (size_t)h * D + d]);
}

/* Element d of head h's output from the merged o and l: as linear_kernel,
 * the numerator (lin: from attn_decode's numerator row), the gate and the
 * division, or o / (l + ε) without a linear term; with gate_den the
 * denominator per channel, (o + g_d (φqᵀS)_d) / (l + g_d φq·z + ε). */
template <int D>
__device__ __forceinline__ float head_output(const args &a, const float *part, int n_split, int h, int d, float o,
                                             float l, bool lin) {
    const float gam = softmax_factor(a, h);   /* lolcats' γ on the softmax sums */
    if (!lin) return gam * o / still_den_soft(gam * l);
    const float *ln = part + (size_t)a.H * n_split * (D + 2) + (size_t)h * (D + 1);
    if (a.gate_den) {
        const float g = head_gate<D>(a, h, d);
        return (gam * o + g * ln[d]) / still_den(gam * l, g, ln[D], 1);
    }
    const float inv = 1.0f / still_den(gam * l, 1.0f, ln[D], 0);
    float lv = ln[d];
    if (a.gate) lv *= head_gate<D>(a, h, d);
    return (gam * o + lv) * inv;
}

/* Block h: head h's output row into out. Warp w merges the partials of splits w, w + NW, ... with an online
 * maximum, kMergeBatch splits' loads in flight at a time (lane: the dims lane + 32 j); then across the warps.
 * Then, spread over the blocks, the step's end (finish_copy; block 0 advances n_seen). An empty split's o is
 * unwritten (selected away, never scaled). */
constexpr int kMergeThreads = 256, kMergeBatch = 8;
template <int D>
__global__ void __launch_bounds__(kMergeThreads) linear_decode_kernel(const args a, float *part, int n_split) {
    constexpr int NW = kMergeThreads / 32, PL = D / 32, B = kMergeBatch;
    __shared__ float wm[NW], wl[NW];
    __shared__ float acc_s[NW][D];
    stc_pdl_trigger();   /* a following matrix-vector kernel may load its weights meanwhile */
    stc_pdl_wait();
    const int p0 = *decode_p0(a, part, n_split), h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const bool lin = a.linear && p0 / a.C >= 2;
    const float c = a.scale_log2;
    float m = -INFINITY, l = 0.0f, o[PL];
#pragma unroll
    for (int j = 0; j < PL; j++) o[j] = 0.0f;
    for (int s0 = warp; s0 < n_split; s0 += B * NW) {
        float ms[B], ls[B], v[B][PL];
#pragma unroll
        for (int u = 0; u < B; u++) {   /* every load of the batch issued before the sums */
            const int sp = s0 + u * NW;
            ms[u] = -INFINITY, ls[u] = 0.0f;
            if (sp < n_split) {
                const float *ps = part + ((size_t)h * n_split + sp) * (D + 2);
                ms[u] = ps[0], ls[u] = ps[1];
#pragma unroll
                for (int j = 0; j < PL; j++) v[u][j] = ps[2 + lane + 32 * j];
            }
        }
        float mb = m;
#pragma unroll
        for (int u = 0; u < B; u++) mb = fmaxf(mb, ms[u]);
        if (mb == -INFINITY) continue;   /* uniform over the warp: nothing yet */
        const float r = m == -INFINITY ? 0.0f : stc_ptx::ex2(fmaf(m, c, -mb * c));
        l *= r;
#pragma unroll
        for (int j = 0; j < PL; j++) o[j] *= r;
#pragma unroll
        for (int u = 0; u < B; u++) {
            if (ms[u] == -INFINITY) continue;
            const float w = stc_ptx::ex2(fmaf(ms[u], c, -mb * c));
            l = fmaf(ls[u], w, l);
#pragma unroll
            for (int j = 0; j < PL; j++) o[j] = fmaf(v[u][j], w, o[j]);
        }
        m = mb;
    }
    if (lane == 0) wm[warp] = m, wl[warp] = l;
#pragma unroll
    for (int j = 0; j < PL; j++) acc_s[warp][lane + 32 * j] = o[j];
    __syncthreads();
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; w++) M = fmaxf(M, wm[w]);
    float L = 0.0f, sc[NW];
#pragma unroll
    for (int w = 0; w < NW; w++) {
        sc[w] = wm[w] == -INFINITY ? 0.0f : stc_ptx::ex2(fmaf(wm[w], c, -M * c));
        L = fmaf(wl[w], sc[w], L);
    }
    for (int d = tid; d < D; d += kMergeThreads) {
        float od = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) od = fmaf(acc_s[w][d], sc[w], od);
        a.out[(size_t)h * D + d] = head_output<D>(a, part, n_split, h, d, od, L, lin);
    }
    finish_copy(a, p0, blockIdx.x * kMergeThreads + tid, gridDim.x * kMergeThreads);
    if (blockIdx.x == 0 && tid == 0) *a.n_seen = p0 + 1;
}

/* The step's attention: splits, then the numerator row (linear on), then
 * the saliency row (decode_fuses_score). Block (0, 0) leaves the position
 * for the merge (decode_p0). */
template <int D, int SK>
__global__ void __launch_bounds__(kDecThreads) attn_decode_kernel(const args a, float *part, int n_split) {
    extern __shared__ __align__(16) float dyn_smem[];
    stc_pdl_trigger();   /* the merge kernel may start; it waits for this one */
    const int extra = (int)blockIdx.y - n_split;
    if (extra == 0 && a.linear) {
        linear_numerator<D>(a, part + (size_t)a.H * n_split * (D + 2), dyn_smem);   /* waits itself */
        return;
    }
    stc_pdl_wait();   /* q, the scan's slots and the state come from earlier kernels */
    if (extra >= 0) {
        score_decode_row<D>(a, blockIdx.x);
        return;
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *decode_p0(a, part, n_split) = *a.n_seen;
    attn_split<D, SK>(a, part, n_split);
}

}   // namespace

int decode_splits(int cap, int C, int split_keys) { return cdiv(cap + 2 * C, split_keys); }

static size_t smem_attn_decode(int D) { return (size_t)D * (D + 1) * sizeof(float); }   /* the q-map's W */

/* The attention kernel for a head dim and keys per split (64 or 128, and 32, 64 or 128). */
static void (*attn_decode_for(int D, int sk))(const args, float *, int) {
    if (D == 64) return sk == 32 ? attn_decode_kernel<64, 32> : sk == 64 ? attn_decode_kernel<64, 64> : attn_decode_kernel<64, 128>;
    return sk == 32 ? attn_decode_kernel<128, 32> : sk == 64 ? attn_decode_kernel<128, 64> : attn_decode_kernel<128, 128>;
}

int prepare_decode(int D, still_err *err) {
    const int bytes = (int)smem_attn_decode(D);
    for (int sk = 32; sk <= 128; sk *= 2)
        STC_CUDA(err, cudaFuncSetAttribute(attn_decode_for(D, sk), cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
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

bool decode_fuses_score(const args &a) { return a.lam > 0 && a.routing == R_SALIENCY; }

int launch_attn_linear_decode(stc_ctx *ctx, const args &a, float *part, still_err *err) {
    const int sk = a.decode_split, n_split = decode_splits(a.cap, a.C, sk);
    /* more rows of blocks, overlapping the attention splits: the linear branch's numerator, the saliency */
    const int rows = n_split + (a.linear ? 1 : 0) + (decode_fuses_score(a) ? 1 : 0);
    const dim3 grid((unsigned)a.H, (unsigned)rows);
    const size_t smem = a.linear ? smem_attn_decode(a.D) : 0;
    /* both with Programmatic Dependent Launch (a no-op without ctx->pdl): the numerator row loads the q-map's
     * parameters while the kernel before finishes, linear_decode's launch overlaps attn_decode */
    STC_CUDA(err, stc_launch_pdl(ctx, attn_decode_for(a.D, sk), grid, dim3(kDecThreads), smem, a, part, n_split));
    STC_CUDA(err, a.D == 64 ? stc_launch_pdl(ctx, linear_decode_kernel<64>, dim3(a.H), dim3(kMergeThreads), 0, a, part, n_split)
                            : stc_launch_pdl(ctx, linear_decode_kernel<128>, dim3(a.H), dim3(kMergeThreads), 0, a, part, n_split));
    return STILL_OK;
}

}   // namespace stillk
