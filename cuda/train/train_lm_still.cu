/* Stage 2 (still finetune) on the GPU for still layers: the row-wise steps
 * of a still layer written densely per query head, which src/train/train_lm_cuda.c
 * strings together with cuBLASLt products over one head's T × T matrices.
 *
 * The routing is recorded per selection head hs and key j as one number,
 * out[hs][j] = the first query chunk from which j is no longer in the
 * softmax part (INT_MAX: never). Before it, j is in Local or in Sel; from it
 * on, j is in the linear state (or dropped, linear off). So for query t in
 * chunk c(t):
 *   soft(t, j) = j <= t  and  c(t) < out[j]      lin(t, j) = c(t) >= out[j]
 * and the layer is (spec "still"; gate_den: the gate in the denominator too)
 *   E = exp(s Q Kᵀ − m) ⊙ soft,  L = (φq Φkᵀ) ⊙ lin,  l = rowsum E,  b = rowsum L
 *   y = (E V + g ⊙ L V) / (l + b + 1e-6)       [gate_den: / (l + g b + 1e-6)]
 * with m the row's maximum over soft: the same function of q, k, v and x as
 * src/kinds/still/attn_still.c's chunked forward, whose selection this reproduces:
 *   chunk selection: when chunk c' leaves Local (queries of chunk c' + 2 on),
 *     its best n = min(λ, C, slots left) tokens stay in Sel, the rest fold:
 *     out = c' + 2 for those;
 *   global selection: Sel holds the best cap tokens of all chunks that have
 *     left, so a token is in Sel at query chunk cq while fewer than cap
 *     tokens of chunks <= cq − 2 rank above it; out = the first cq where
 *     that fails (the evicted token folds then).
 * Ranking: higher score first, ties to the lower position; the score is the
 * self-saliency closed form f(p) of the token's own weight p in its window
 * (summed over the G query heads with one selection per KV head). */
#include "kinds/attn_rules.h"
#include "kinds/still/attn_still_fmap.cuh"

#include <limits.h>

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigm(float x) { return stillk::sigmoid(x); }   /* attn_still_internal.cuh */

__device__ __forceinline__ float bsum(float v, float *sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}

/* The block's maximum of v and the lowest index holding it. */
__device__ __forceinline__ void bargmax(float &v, int &j, float *shv, int *shj) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
        const int j2 = __shfl_xor_sync(0xffffffffu, j, o);
        if (v2 > v || (v2 == v && j2 < j)) v = v2, j = j2;
    }
    __syncthreads();
    if (lane == 0) shv[w] = v, shj[w] = j;
    __syncthreads();
    v = shv[0], j = shj[0];
    for (int i = 1; i < nw; i++)
        if (shv[i] > v || (shv[i] == v && shj[i] < j)) v = shv[i], j = shj[i];
}

/* Block (kSalTok consecutive tokens, selection head hs), kSalWarps warps, each warp kSalTok / kSalWarps tokens in
 * turn: score[hs][j] = Σ over the head's query heads of f(p), p = token j's softmax weight on itself over keys
 * max(0, j-C+1) .. j. The keys of the block's windows (its tokens' and the C − 1 before) are staged in shared memory
 * first (coalesced, rows of D + 1 floats so that the lanes' different rows fall in different banks); each lane then
 * takes keys lo + lane, lo + lane + 32, ... with its own running maximum and sum of exponentials, and the warp joins
 * them (Σ s_l e^(m_l − m)). */
constexpr int kSalWarps = 4, kSalTok = 16;

__global__ void saliency_kernel(const float *q, const float *k, int T, int H, int Hk, int D, int C, int per_kv,
                                float scale, double *score) {
    extern __shared__ float sal_smem[];   /* keys [kSalTok + C − 1][D + 1], then the warps' query rows [kSalWarps][D] */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, hs = blockIdx.y, G = H / Hk;
    const int j0 = blockIdx.x * kSalTok, base = still_window_lo(j0, C);
    const int last = j0 + kSalTok - 1 < T - 1 ? j0 + kSalTok - 1 : T - 1, nrows = last - base + 1, ld = D + 1;
    float *ks = sal_smem, *qs = sal_smem + (size_t)(kSalTok + C - 1) * ld + (size_t)w * D;
    const int h0 = per_kv ? hs * G : hs, nh = per_kv ? G : 1;
    const float *kb = k + (size_t)(h0 / G) * D;   /* the heads of one selection head share a KV head */
    for (int e = threadIdx.x; e < nrows * D; e += blockDim.x) {
        const int r = e / D, x = e % D;
        ks[r * ld + x] = kb[(size_t)(base + r) * Hk * D + x];
    }
    __syncthreads();
    for (int j = j0 + w; j <= last; j += kSalWarps) {
        const int lo = still_window_lo(j, C), self_lane = (j - lo) & 31;
        double acc = 0;
        for (int h = h0; h < h0 + nh; h++) {
            const float *qr = q + ((size_t)j * H + h) * D;
            __syncwarp();
            for (int x = lane; x < D; x += 32) qs[x] = qr[x];
            __syncwarp();
            float m = -INFINITY, sum = 0.0f, self = -INFINITY;
            for (int l = lo + lane; l <= j; l += 32) {
                const float *kr = ks + (size_t)(l - base) * ld;
                float s = 0.0f;
                for (int x = 0; x < D; x++) s = fmaf(qs[x], kr[x], s);
                s *= scale;
                if (l == j) self = s;
                if (s > m) sum = sum * expf(m - s) + 1.0f, m = s;
                else sum += expf(s - m);
            }
            float mx = m;
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float part = m == -INFINITY ? 0.0f : sum * expf(m - mx);
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            self = __shfl_sync(0xffffffffu, self, self_lane);
            acc += still_saliency_of_p((double)(expf(self - mx) / part));   /* src/kinds/still/attn_still_rules.h */
        }
        if (lane == 0) score[(size_t)hs * T + j] = acc != acc ? -INFINITY : acc;
    }
}

__device__ __forceinline__ bool better(double si, int i, double sj, int j) { return si > sj || (si == sj && i < j); }

/* Global selection. Warp (key j, selection head hs), kRouteWarps keys a block: out = the first query chunk
 * cq >= c(j) + 2 at which at least cap tokens of chunks <= cq - 2 rank above j; INT_MAX when there is none before
 * the sequence's end (chunks leave up to n_chunks - 3). The lanes take 32 keys i at a time; a chunk's end inside
 * them sees the count up to itself (the ballot's bits up to its lane). */
constexpr int kRouteWarps = 8;

__global__ void route_global_kernel(const double *score, int T, int C, int cap, int *out) {
    const int lane = threadIdx.x & 31, hs = blockIdx.y, j = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
    if (j >= T) return;
    const double *sc = score + (size_t)hs * T;
    const int nc = (T + C - 1) / C, last_leave = nc - 3;   /* the last chunk that leaves Local in the sequence */
    const int n_left = last_leave >= 0 ? (last_leave + 1) * C : 0;
    int *o = out + (size_t)hs * T + j;
    const int cj = j / C;
    if (cj > last_leave) {
        if (lane == 0) *o = INT_MAX;
        return;
    }
    if (cap == 0) {
        if (lane == 0) *o = cj + 2;
        return;
    }
    const double sj = sc[j];
    int count = 0, res = INT_MAX;
    for (int b = 0; b < n_left; b += 32) {
        const int i = b + lane;
        const bool in = i < n_left;
        const unsigned above = __ballot_sync(0xffffffffu, in && better(sc[in ? i : 0], i, sj, j));
        /* the end of chunk ci = i / C: the set of chunks <= ci is complete (queries of chunk ci + 2) */
        const bool hit = in && (i + 1) % C == 0 && i / C >= cj &&
                         count + __popc(above & (0xffffffffu >> (31 - lane))) >= cap;
        const unsigned hits = __ballot_sync(0xffffffffu, hit);
        if (hits) {
            res = (b + __ffs(hits) - 1) / C + 2;
            break;
        }
        count += __popc(above);
    }
    if (lane == 0) *o = res;
}

/* No selection (lolcats): every key folds when it leaves Local. */
__global__ void route_fold_kernel(int T, int C, int rows, int *out) {
    const int nc = (T + C - 1) / C;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < (int64_t)rows * T;
         e += (int64_t)gridDim.x * blockDim.x) {
        const int j = (int)(e % T);
        out[e] = j / C + 2 < nc ? j / C + 2 : INT_MAX;
    }
}

/* Chunk selection. Block hs, thread i of each leaving chunk in turn (C <= blockDim): its rank in the chunk;
 * the best n = min(lam, C, cap - used) (uncapped: min(lam, C)) stay in Sel. */
__global__ void route_chunk_kernel(const double *score, int T, int C, int lam, int capped, int cap, int *out) {
    const int hs = blockIdx.x, i = threadIdx.x;
    const double *sc = score + (size_t)hs * T;
    int *o = out + (size_t)hs * T;
    for (int j = i; j < T; j += blockDim.x) o[j] = INT_MAX;
    __syncthreads();
    const int nc = (T + C - 1) / C;
    int used = 0;
    for (int c = 0; c + 2 < nc; c++) {
        int n = lam < C ? lam : C;
        if (capped && n > cap - used) n = cap - used;
        if (n < 0) n = 0;
        if (i < C) {
            const int j = c * C + i;
            const double sj = sc[j];
            int rank = 0;
            for (int x = 0; x < C; x++) rank += better(sc[c * C + x], c * C + x, sj, j);
            o[j] = rank < n ? INT_MAX : c + 2;
        }
        used += n;
    }
}

/* Row t of S [T][ld] (logits) becomes E = γ exp(S − m) ⊙ soft (γ: lolcats' window factor, 1 for still);
 * l[t] = Σ E, am[t] = the arg-max (lowest index). */
__global__ void mask_soft_kernel(float *S, int64_t ld, int64_t sS, int T, int C, const int *out, int64_t sOut,
                                 const float *wfac, float *l, int *am) {
    const float gamma = wfac ? sigm(*wfac) : 1.0f;   /* read on the device: a recorded graph sees the current w */
    __shared__ float shf[kThreads / 32];
    __shared__ int shi[kThreads / 32];
    const int t = blockIdx.x, ct = t / C, b = blockIdx.y;   /* row t of sequence b */
    out += b * sOut, l += (size_t)b * T, am += (size_t)b * T;
    float *row = S + b * sS + (size_t)t * ld;
    float mx = -INFINITY;
    int jm = t;   /* the diagonal is always in the softmax part: a row of non-finite logits keeps an index in range */
    for (int j = threadIdx.x; j <= t; j += blockDim.x)
        if (ct < out[j] && (row[j] > mx || (row[j] == mx && j < jm))) mx = row[j], jm = j;
    bargmax(mx, jm, shf, shi);
    float s = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const float e = j <= t && ct < out[j] ? gamma * expf(row[j] - mx) : 0.0f;
        row[j] = e;
        s += e;
    }
    s = bsum(s, shf);
    if (threadIdx.x == 0) l[t] = s, am[t] = jm;
}

/* Row t of L [T][ld] masked to lin (keys folded by chunk c(t)); b[t] = Σ. */
__global__ void mask_lin_kernel(float *L, int64_t ld, int64_t sL, int T, int C, const int *out, int64_t sOut, float *b) {
    __shared__ float shf[kThreads / 32];
    const int t = blockIdx.x, ct = t / C, sq = blockIdx.y;   /* row t of sequence sq */
    out += sq * sOut, b += (size_t)sq * T;
    float *row = L + sq * sL + (size_t)t * ld;
    float s = 0.0f;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const float v = ct >= out[j] ? row[j] : 0.0f;
        row[j] = v;
        s += v;
    }
    s = bsum(s, shf);
    if (threadIdx.x == 0) b[t] = s;
}


/* Element (t, x): y = (num + g a) / (l + b + ε) (gate_den: l + g b + ε), in place of num. */
__global__ void out_kernel(float *y, int64_t ldy, const float *a, const float *l, const float *b, const float *g,
                           int64_t ldg, int gate_den, int T, int D) {
    const int64_t n = (int64_t)T * D;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int t = (int)(e / D), x = (int)(e % D);
        const float gx = g ? g[(size_t)t * ldg + x] : 1.0f, av = a ? a[e] : 0.0f, bv = a ? b[t] : 0.0f;
        const float den = still_den(l[t], gx, bv, gate_den);
        float *o = y + (size_t)t * ldy + x;
        *o = (*o + gx * av) / den;
    }
}

/* Row t (one warp): from dy and y, dN = dy / den, dA = dN ⊙ g, dl, db, and the gate's dpre. */
__global__ void bwd_rows_kernel(const float *dy, int64_t lddy, const float *y, int64_t ldy, const float *a,
                                const float *l, const float *b, const float *g, int64_t ldg, int gate_den, int T, int D,
                                float *dN, float *dA, float *dl, float *db, float *dpre) {
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= T) return;
    const float lt = l[t], bt = a ? b[t] : 0.0f;
    float sl = 0.0f, sb = 0.0f;
    for (int x = lane; x < D; x += 32) {
        const float gx = g ? g[(size_t)t * ldg + x] : 1.0f, av = a ? a[(size_t)t * D + x] : 0.0f;
        const float den = still_den(lt, gx, bt, gate_den);
        const float dn = dy[(size_t)t * lddy + x] / den, dd = -dn * y[(size_t)t * ldy + x];
        dN[(size_t)t * D + x] = dn;
        if (a) dA[(size_t)t * D + x] = dn * gx;
        sl += dd;
        sb += gate_den ? dd * gx : dd;
        if (g && dpre) dpre[(size_t)t * ldg + x] = (dn * av + (gate_den ? dd * bt : 0.0f)) * gx * (1.0f - gx);
    }
    for (int o = 16; o > 0; o >>= 1) sl += __shfl_xor_sync(0xffffffffu, sl, o), sb += __shfl_xor_sync(0xffffffffu, sb, o);
    if (lane == 0) dl[t] = sl, db[t] = sb;
}

/* Row t: dS = E ⊙ (dE + dl), then the maximum's share: dS[am] −= Σ dS (in place of dE). With dw: dl[t] becomes
 * the row's share of ∂L/∂w, (1 − γ) Σ dS, summed in order afterwards (no atomics: a replay gives the same bits). */
__global__ void ds_kernel(float *dE, const float *E, int64_t ld, int64_t sS, int T, float *dl, const int *am,
                          int want_dw, const float *wfac) {
    __shared__ float shf[kThreads / 32];
    const int t = blockIdx.x, b = blockIdx.y;   /* row t of sequence b */
    dl += (size_t)b * T, am += (size_t)b * T;
    float *row = dE + b * sS + (size_t)t * ld;
    const float *e = E + b * sS + (size_t)t * ld, d = dl[t];
    float s = 0.0f;
    for (int j = threadIdx.x; j <= t; j += blockDim.x) {
        const float v = e[j] * (row[j] + d);
        row[j] = v;
        s += v;
    }
    for (int j = t + 1 + threadIdx.x; j < T; j += blockDim.x) row[j] = 0.0f;
    s = bsum(s, shf);   /* every thread has read dl[t] before bsum's barriers */
    if (threadIdx.x == 0) {
        row[am[t]] -= s;
        if (want_dw) dl[t] = (1.0f - sigm(*wfac)) * s;
    }
}

/* out[j] += Σ_r A[r][j]: a block of 32 × 32 threads per 32 columns, the rows split over threadIdx.y, the 32 partial
 * sums added in a fixed order (deterministic: no atomics). */
__global__ void colsum_kernel(const float *A, int64_t ld, int n, int m, float *out) {
    __shared__ float part[32][33];
    const int j = blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (j < m)
        for (int r = threadIdx.y; r < n; r += 32) s += A[(size_t)r * ld + j];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < m) {
        float t = 0.0f;
        for (int i = 0; i < 32; i++) t += part[i][threadIdx.x];
        out[j] += t;
    }
}

/* Row t: dL = lin ⊙ (dL + db). */
__global__ void dlin_kernel(float *dL, int64_t ld, int64_t sL, int T, int C, const int *out, int64_t sOut,
                            const float *db) {
    const int t = blockIdx.x, ct = t / C, b = blockIdx.y;   /* row t of sequence b */
    out += b * sOut, db += (size_t)b * T;
    float *row = dL + b * sL + (size_t)t * ld;
    const float d = db[t];
    for (int j = threadIdx.x; j < T; j += blockDim.x) row[j] = ct >= out[j] ? row[j] + d : 0.0f;
}

/* G [T][n] = σ(G + bias). */
__global__ void sigmoid_bias_kernel(float *G, const float *bias, int T, int n) {
    const int64_t N = (int64_t)T * n;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < N; e += (int64_t)gridDim.x * blockDim.x)
        G[e] = sigm(G[e] + bias[e % n]);
}

constexpr int kFmapWarps = 8;
constexpr unsigned kNpmapBlocks = STC_NPMAP_BLOCKS;   /* the maps' grid at most (still_cuda.h) */

/* The map into shared memory: NP-Map (u, W [D][D]) as npmap_load; Hedgehog (u NULL, W [D][F], F = D) as Ws = Wᵀ
 * and u = 0, so that the NP-Map's z0 = Ws x̃ is Hedgehog's z = x W (x̃ = x without a reflection). */
template <int D>
__device__ __forceinline__ void map_load(const float *W, const float *u, float *Ws, float *us) {
    if (u) {
        stillk::npmap_load<D>(W, u, Ws, us);
        return;
    }
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) Ws[(e % D) * (D + 1) + e / D] = W[e];
    for (int e = threadIdx.x; e < D; e += blockDim.x) us[e] = 0.0f;
}

/* φ of rows X (ldx apart) by one NP-Map (u, W [D][D]) or Hedgehog map (u NULL) into phi [n][2D]; one warp a row. */
template <int D>
__global__ void __launch_bounds__(kFmapWarps * 32) npmap_rows_kernel(const float *X, int64_t ldx, int n, const float *u,
                                                                       const float *W, float *phi) {
    __shared__ float Ws[D * (D + 1)], us[D], xt[kFmapWarps][D];
    map_load<D>(W, u, Ws, us);
    __syncthreads();
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float uu = stillk::npmap_uu<D>(us, lane);
    for (int r = blockIdx.x * kFmapWarps + w; r < n; r += gridDim.x * kFmapWarps)
        stillk::npmap_warp<D>(X + (size_t)r * ldx, us, Ws, uu, xt[w], phi + (size_t)r * 2 * D, lane, u == nullptr);
}

/* dX (ldd apart) += ∂/∂x of Σ dphi ⊙ φ(x), the forward recomputed (src/kinds/still/attn_still.c's fmap_bwd_rows):
 *   dz = ±a ⊙ (dφ − Σ a dφ) per half (nothing through clamped entries), z = z0 sc, sc = ‖x‖ / max(‖z0‖, 1e-12):
 *   dz0 = sc (dz − z0 (z0·dz) / ‖z0‖²) (sc dz below the floor), d‖x‖ = (z0·dz) / max(‖z0‖, 1e-12),
 *   dx̃ = Wᵀ dz0, dx = dx̃ − 2 (dx̃·u / u·u) u + d‖x‖ x / ‖x‖. */
template <int D>
__global__ void __launch_bounds__(kFmapWarps * 32) npmap_bwd_kernel(const float *X, int64_t ldx, int n, const float *u,
                                                                      const float *W, const float *dphi, float *dX,
                                                                      int64_t ldd, float *dZ0, float *Xt, float *du_out) {
    constexpr int J = D / 32;
    __shared__ float Ws[D * (D + 1)], us[D], xt[kFmapWarps][D];
    map_load<D>(W, u, Ws, us);
    __syncthreads();
    const bool hed = u == nullptr;   /* Hedgehog: z = z0, no norm terms */
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float uu = stillk::npmap_uu<D>(us, lane);
    float du_acc[J];   /* this lane's share of ∂/∂u over the warp's rows */
#pragma unroll
    for (int i = 0; i < J; i++) du_acc[i] = 0.0f;
    for (int r = blockIdx.x * kFmapWarps + w; r < n; r += gridDim.x * kFmapWarps) {
        float xv[J], uv[J], xu, xx, z0[J], zz;
        stillk::npmap_project<D>(X + (size_t)r * ldx, us, Ws, uu, xt[w], lane, xv, uv, xu, xx, z0, zz);
        const float nx = sqrtf(xx), nz = sqrtf(zz);
        const float sc = hed ? 1.0f : still_npmap_rescale(nx, nz);
        float mx = -INFINITY, mn = INFINITY, z[J];
#pragma unroll
        for (int i = 0; i < J; i++) z[i] = z0[i] * sc, mx = fmaxf(mx, z[i]), mn = fminf(mn, z[i]);
        mx = stillk::warp_max(mx);
        mn = stillk::warp_min(mn);
        float a1[J], a2[J], s1 = 0.0f, s2 = 0.0f;
#pragma unroll
        for (int i = 0; i < J; i++) a1[i] = expf(z[i] - mx), a2[i] = expf(-z[i] + mn), s1 += a1[i], s2 += a2[i];
        s1 = stillk::warp_sum(s1);
        s2 = stillk::warp_sum(s2);
        float g1[J], g2[J], d1 = 0.0f, d2 = 0.0f;
        const float *dp = dphi + (size_t)r * 2 * D;
#pragma unroll
        for (int i = 0; i < J; i++) {
            a1[i] /= s1, a2[i] /= s2;
            g1[i] = a1[i] < stillk::kFmapClamp ? 0.0f : dp[lane + 32 * i];
            g2[i] = a2[i] < stillk::kFmapClamp ? 0.0f : dp[D + lane + 32 * i];
            d1 += a1[i] * g1[i], d2 += a2[i] * g2[i];
        }
        d1 = stillk::warp_sum(d1);
        d2 = stillk::warp_sum(d2);
        float dz[J], zd = 0.0f;
#pragma unroll
        for (int i = 0; i < J; i++) dz[i] = a1[i] * (g1[i] - d1) - a2[i] * (g2[i] - d2), zd += z0[i] * dz[i];
        zd = stillk::warp_sum(zd);
        const float pr = !hed && nz > stillk::kNormFloor ? zd / (nz * nz) : 0.0f, dn = hed ? 0.0f : still_npmap_rescale(zd, nz);
        /* dz0 into the warp's scratch, then dx̃[m] = Σ_i W[i][m] dz0[i] */
#pragma unroll
        for (int i = 0; i < J; i++) {
            const float g0 = sc * (dz[i] - z0[i] * pr);
            xt[w][lane + 32 * i] = g0;
            if (dZ0) dZ0[(size_t)r * D + lane + 32 * i] = g0;
            if (Xt) Xt[(size_t)r * D + lane + 32 * i] = xv[i] - still_npmap_reflect(xu, uu) * uv[i];
        }
        __syncwarp();
        float dxt[J], du = 0.0f;
#pragma unroll
        for (int i = 0; i < J; i++) {
            const int m = lane + 32 * i;
            float acc = 0.0f;
            for (int e = 0; e < D; e++) acc = fmaf(Ws[e * (D + 1) + m], xt[w][e], acc);
            dxt[i] = acc;
            du += acc * uv[i];
        }
        __syncwarp();
        du = stillk::warp_sum(du);
        const float fu = uu > 0.0f ? 2.0f * du / uu : 0.0f, fx = nx > 0.0f ? dn / nx : 0.0f;
        if (dX) {
            float *o = dX + (size_t)r * ldd;
#pragma unroll
            for (int i = 0; i < J; i++) o[lane + 32 * i] += dxt[i] - fu * uv[i] + fx * xv[i];
        }
        /* x̃ = x − 2 (x·u / u·u) u: ∂/∂u = −2 ((g·u) x / u·u + (x·u) g / u·u − 2 (x·u)(g·u) u / (u·u)²), g = dx̃ */
        if (du_out && uu > 0.0f)
#pragma unroll
            for (int i = 0; i < J; i++)
                du_acc[i] += -2.0f * (xv[i] * du / uu + xu * dxt[i] / uu - 2.0f * xu * du * uv[i] / (uu * uu));
    }
    /* ∂/∂u: the block's warps' shares added in order into du_part[blockIdx.x] (summed over blocks afterwards) */
    if (du_out) {
        __syncthreads();
#pragma unroll
        for (int i = 0; i < J; i++) xt[w][lane + 32 * i] = uu > 0.0f ? du_acc[i] : 0.0f;
        __syncthreads();
        for (int e = threadIdx.x; e < D; e += blockDim.x) {
            float t = 0.0f;
            for (int i = 0; i < kFmapWarps; i++) t += xt[i][e];
            du_out[(size_t)blockIdx.x * D + e] = t;
        }
    }
}

unsigned flat(int64_t n) {
    const int64_t b = (n + kThreads - 1) / kThreads;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

}   // namespace

int stc_still_lm_route(stc_ctx *ctx, const float *q, const float *k, int T, int H, int Hk, int D, int C, int per_kv,
                       int global, int lam, int capped, int cap, double *score, int *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    if (C > kThreads) return stc_fail(err, STILL_E_UNSUPPORTED, "still training on the GPU: chunk %d (at most %d)", C, kThreads);
    const int Hs = per_kv ? Hk : H;
    const size_t smem = sizeof(float) * ((size_t)(kSalTok + C - 1) * (D + 1) + (size_t)kSalWarps * D);
    if (smem > 48 * 1024)
        STC_CUDA(err, cudaFuncSetAttribute(saliency_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    saliency_kernel<<<dim3((unsigned)((T + kSalTok - 1) / kSalTok), (unsigned)Hs), 32 * kSalWarps, smem,
                      ctx->stream>>>(q, k, T, H, Hk, D, C, per_kv, attn_logit_scale(D), score);
    STC_LAUNCHED(err, "saliency_kernel");
    if (global) {
        route_global_kernel<<<dim3((unsigned)((T + kRouteWarps - 1) / kRouteWarps), (unsigned)Hs), 32 * kRouteWarps, 0,
                              ctx->stream>>>(score, T, C, cap, out);
        STC_LAUNCHED(err, "route_global_kernel");
    } else {
        route_chunk_kernel<<<(unsigned)Hs, kThreads, 0, ctx->stream>>>(score, T, C, lam, capped, cap, out);
        STC_LAUNCHED(err, "route_chunk_kernel");
    }
    return STILL_OK;
}

int stc_still_lm_mask_soft(stc_ctx *ctx, float *S, int64_t ld, int64_t sS, int nb, int T, int C, const int *out,
                           int64_t sOut, const float *wfac, float *l, int *am, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || nb <= 0) return STILL_OK;
    mask_soft_kernel<<<dim3((unsigned)T, (unsigned)nb), kThreads, 0, ctx->stream>>>(S, ld, sS, T, C, out, sOut, wfac, l,
                                                                                    am);
    STC_LAUNCHED(err, "mask_soft_kernel");
    return STILL_OK;
}

int stc_still_lm_route_fold(stc_ctx *ctx, int T, int C, int rows, int *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    route_fold_kernel<<<flat((int64_t)rows * T), kThreads, 0, ctx->stream>>>(T, C, rows, out);
    STC_LAUNCHED(err, "route_fold_kernel");
    return STILL_OK;
}

int stc_still_lm_mask_lin(stc_ctx *ctx, float *L, int64_t ld, int64_t sL, int nb, int T, int C, const int *out,
                          int64_t sOut, float *b, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || nb <= 0) return STILL_OK;
    mask_lin_kernel<<<dim3((unsigned)T, (unsigned)nb), kThreads, 0, ctx->stream>>>(L, ld, sL, T, C, out, sOut, b);
    STC_LAUNCHED(err, "mask_lin_kernel");
    return STILL_OK;
}

int stc_still_lm_out(stc_ctx *ctx, float *y, int64_t ldy, const float *a, const float *l, const float *b,
                     const float *g, int64_t ldg, int gate_den, int T, int D, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    out_kernel<<<flat((int64_t)T * D), kThreads, 0, ctx->stream>>>(y, ldy, a, l, b, g, ldg, gate_den, T, D);
    STC_LAUNCHED(err, "out_kernel");
    return STILL_OK;
}

int stc_still_lm_bwd_rows(stc_ctx *ctx, const float *dy, int64_t lddy, const float *y, int64_t ldy, const float *a,
                          const float *l, const float *b, const float *g, int64_t ldg, int gate_den, int T, int D,
                          float *dN, float *dA, float *dl, float *db, float *dpre, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    bwd_rows_kernel<<<(T + 7) / 8, 256, 0, ctx->stream>>>(dy, lddy, y, ldy, a, l, b, g, ldg, gate_den, T, D, dN, dA, dl,
                                                          db, dpre);
    STC_LAUNCHED(err, "bwd_rows_kernel");
    return STILL_OK;
}

int stc_still_lm_ds(stc_ctx *ctx, float *dE, const float *E, int64_t ld, int64_t sS, int nb, int T, float *dl,
                    const int *am, float *dw, const float *wfac, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || nb <= 0) return STILL_OK;
    if (dw && !wfac) return stc_fail(err, STILL_E_ARG, "stc_still_lm_ds: dw needs the window factor");
    ds_kernel<<<dim3((unsigned)T, (unsigned)nb), kThreads, 0, ctx->stream>>>(dE, E, ld, sS, T, dl, am, dw != nullptr,
                                                                             wfac);
    STC_LAUNCHED(err, "ds_kernel");
    return dw ? stc_colsum_acc(ctx, dl, 1, nb * T, 1, dw, err) : STILL_OK;
}

int stc_colsum_acc(stc_ctx *ctx, const float *A, int64_t ld, int n, int m, float *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0 || m <= 0) return STILL_OK;
    colsum_kernel<<<(unsigned)((m + 31) / 32), dim3(32, 32), 0, ctx->stream>>>(A, ld, n, m, out);
    STC_LAUNCHED(err, "colsum_kernel");
    return STILL_OK;
}

int stc_still_lm_dlin(stc_ctx *ctx, float *dL, int64_t ld, int64_t sL, int nb, int T, int C, const int *out,
                      int64_t sOut, const float *db, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || nb <= 0) return STILL_OK;
    dlin_kernel<<<dim3((unsigned)T, (unsigned)nb), kThreads, 0, ctx->stream>>>(dL, ld, sL, T, C, out, sOut, db);
    STC_LAUNCHED(err, "dlin_kernel");
    return STILL_OK;
}

int stc_sigmoid_bias(stc_ctx *ctx, float *G, const float *bias, int T, int n, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0) return STILL_OK;
    sigmoid_bias_kernel<<<flat((int64_t)T * n), kThreads, 0, ctx->stream>>>(G, bias, T, n);
    STC_LAUNCHED(err, "sigmoid_bias_kernel");
    return STILL_OK;
}

int stc_npmap_rows(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W, float *phi,
                   still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    if (D != 64) return stc_fail(err, STILL_E_UNSUPPORTED, "NP-Map on the GPU: head dim %d (64 supported)", D);
    const unsigned nb = (unsigned)((n + kFmapWarps - 1) / kFmapWarps);
    npmap_rows_kernel<64><<<nb < kNpmapBlocks ? nb : kNpmapBlocks, kFmapWarps * 32, 0, ctx->stream>>>(X, ldx, n, u, W,
                                                                                                      phi);
    STC_LAUNCHED(err, "npmap_rows_kernel");
    return STILL_OK;
}

int stc_npmap_bwd(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W,
                  const float *dphi, float *dX, int64_t ldd, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    if (D != 64) return stc_fail(err, STILL_E_UNSUPPORTED, "NP-Map on the GPU: head dim %d (64 supported)", D);
    const unsigned nb = (unsigned)((n + kFmapWarps - 1) / kFmapWarps);
    npmap_bwd_kernel<64><<<nb < kNpmapBlocks ? nb : kNpmapBlocks, kFmapWarps * 32, 0, ctx->stream>>>(X, ldx, n, u, W,
                                                                                                      dphi, dX, ldd,
                                                                                      nullptr, nullptr, nullptr);
    STC_LAUNCHED(err, "npmap_bwd_kernel");
    return STILL_OK;
}

int stc_npmap_bwd_params(stc_ctx *ctx, const float *X, int64_t ldx, int n, int D, const float *u, const float *W,
                         const float *dphi, float *dX, int64_t ldd, float *dZ0, float *Xt, float *du, float *du_part,
                         still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return STILL_OK;
    if (D != 64) return stc_fail(err, STILL_E_UNSUPPORTED, "NP-Map on the GPU: head dim %d (64 supported)", D);
    if (u && du && !du_part) return stc_fail(err, STILL_E_ARG, "stc_npmap_bwd_params: du needs its scratch");
    const unsigned nb0 = (unsigned)((n + kFmapWarps - 1) / kFmapWarps), nb = nb0 < kNpmapBlocks ? nb0 : kNpmapBlocks;
    const int want_du = u && du;
    npmap_bwd_kernel<64><<<nb, kFmapWarps * 32, 0, ctx->stream>>>(X, ldx, n, u, W, dphi, dX, ldd, dZ0, Xt,
                                                                   want_du ? du_part : nullptr);
    STC_LAUNCHED(err, "npmap_bwd_kernel");
    return want_du ? stc_colsum_acc(ctx, du_part, D, (int)nb, D, du, err) : STILL_OK;
}
