/* still layers' attention for training, fused: the dense form of cuda/train/train_lm_still.cu (its header comment has
 * the routing's meaning: route[j] = the first query chunk from which key j has left the softmax part) computed
 * tile by tile, so that no T × T matrix is ever stored. Per (sequence, query head h), s = 1/√D, query i in chunk
 * c(i) = i / C, key j:
 *   soft(i, j) = j <= i and c(i) < route[j]          lin(i, j) = c(i) >= route[j]
 *   E = exp(s q_i·k_j − m_i) on soft (m_i the row's maximum there, at key am_i), L = φq_i·φk_j on lin
 *   l = Σ E, b = Σ L, A = E V (soft numerator), a = L V (linear numerator)
 *   y = (A + g ⊙ a) / (l + b + 1e-6)          [gate_den: den = l + g ⊙ b + 1e-6, per channel]
 * and the backward, with dN = dy / den:
 *   dl = −Σ dN ⊙ y, db = dl (gate_den: −Σ dN ⊙ y ⊙ g), dA = dN ⊙ g, ρ = dN·A + dl l (= Σ_j dS before m's share)
 *   dS = E ⊙ (dN·v_j + dl) − [j = am_i] ρ,  dQ = s dS K,  dK = s dSᵀ Q,  dV = Eᵀ dN + Lᵀ dA
 *   dL = (dA·v_j + db) on lin,  dφq = dL Φk,  dφk = dLᵀ Φq,  dpre = (dN ⊙ a (+ gate_den: −dN ⊙ y b)) g (1 − g).
 * Kernels (a block of 4 warps per 64 rows; no atomics, so a replayed graph gives the same bits):
 *   far_list  per (sequence, KV head): the keys still soft after leaving Local (Sel for some query chunk), in order
 *   soft_fwd  per (query tile, head, sequence): A, m, l, am (online maximum with its lowest index), over the far
 *             keys gathered from the list (64 a tile) and then the key tiles of the rows' Local chunks, so that the
 *             masked-out history is never visited
 *   lin_fwd   per (query tile, head, sequence): a, b, over the key tiles that can be linear (c(i) >= c(j) + 2)
 *   combine   y from A, a, l, b and the gate
 *   rows      per (row, head): dN, dA, dl, db, ρ, dpre
 *   soft_dkv  per (key tile, KV head, sequence) over the G query heads and the queries that have it in Local: dK,
 *             dV (stored); then per tile of the far list over the queries that have it in Sel (added)
 *   soft_dq   per (query tile, head, sequence): dQ (stored), far keys then Local tiles, from K − its mean
 *             (attn_train_tiles.cuh: key_mean_kernel)
 *   lin_dkv   per (key tile, KV head, sequence): dV += Lᵀ dA (over the G heads), dφk per head (stored)
 *   lin_dq    per (query tile, head, sequence): dφq (stored)
 * The score products take IEEE half inputs, the rest bf16, fp32 accumulators (cuda/kinds/attn_train_tiles.cuh).
 * Layouts: q, y, a, the gate, dy, dN, dA, dpre [B·T][H·D]; k, v, dk, dv [B·T][Hk·D]; φq, φk, dφq, dφk
 * [H][B·T][2D]; the row values [B][H][T]; route [B][Hs][T] (Hs = Hk per KV head, else H). */
#include "kinds/attn_rules.h"
#include "kinds/attn_train_tiles.cuh"
#include "kinds/still/attn_still_rules.h"   /* still_den */
#include "common/cuda_common.cuh"

#include <limits.h>
#include <math.h>

using namespace stc_tiles;

namespace {

constexpr int kD = 64, kF = 2 * kD, kLds = kD + 8, kLdf = kF + 8;
constexpr float kLog2e = (float)ATTN_LOG2E;

struct args {
    const float *q, *k, *v, *phq, *phk, *gate;
    const int *route;
    const int *far_idx, *far_n;   /* [B][Hk][T], [B][Hk]: the keys that stay soft after leaving Local, ascending */
    int B, T, H, Hk, C, per_kv, gate_den;
    float scale;
};

__device__ __forceinline__ const int *route_row(const args &a, int b, int h) {
    const int hs = a.per_kv ? h / (a.H / a.Hk) : h, Hs = a.per_kv ? a.Hk : a.H;
    return a.route + ((int64_t)b * Hs + hs) * a.T;
}

/* The key tile's routing into shared memory (keys past T: 0, which no query's chunk is below). */
__device__ __forceinline__ void route_load(int *ro, const int *rt, int j0, int T) {
    if (threadIdx.x < kRows) ro[threadIdx.x] = j0 + (int)threadIdx.x < T ? rt[j0 + threadIdx.x] : 0;
}

/* The last query chunk of query tile qt, and whether key tile kt can hold a linear key for it. */
__device__ __forceinline__ bool lin_reach(int qt, int kt, int T, int C) {
    const int last = min(qt * kRows + kRows - 1, T - 1) / C;
    return (kt * kRows) / C + 2 <= last;
}

/* The keys of (sequence b, KV head hk) that are still in the softmax part after their chunk left Local (in Sel
 * for some query chunk: route > c(j) + 2 in one of the KV head's routing rows), ascending, into far_idx, and their
 * count. A block per (sequence, KV head); a warp ballot and the warps' counts give each flagged key its place. */
__global__ void far_list_kernel(args a, int *far_idx, int *far_n) {
    __shared__ int wsum[kThr / 32];
    const int b = blockIdx.x, hk = blockIdx.y, T = a.T, C = a.C, G = a.H / a.Hk, lane = threadIdx.x & 31,
              w = threadIdx.x >> 5;
    const int Hs = a.per_kv ? a.Hk : a.H, hs0 = a.per_kv ? hk : hk * G, hs1 = a.per_kv ? hk + 1 : hk * G + G;
    const int lastc = (T - 1) / C;
    int *out = far_idx + ((int64_t)b * a.Hk + hk) * T, base = 0;
    for (int j0 = 0; j0 < T; j0 += kThr) {
        const int j = j0 + threadIdx.x;
        bool f = false;
        if (j < T && j / C + 2 <= lastc)
            for (int hs = hs0; hs < hs1; hs++) f |= a.route[((int64_t)b * Hs + hs) * T + j] > j / C + 2;
        const unsigned bal = __ballot_sync(0xffffffffu, f);
        if (lane == 0) wsum[w] = __popc(bal);
        __syncthreads();
        int off = base, tot = 0;
        for (int i = 0; i < kThr / 32; i++) off += i < w ? wsum[i] : 0, tot += wsum[i];
        if (f) out[off + __popc(bal & ((1u << lane) - 1u))] = j;
        base += tot;
        __syncthreads();
    }
    if (threadIdx.x == 0) far_n[b * a.Hk + hk] = base;
}

/* The far phase's key tiles of query tile qt: list tile lt holds far keys lt·64 .. (at most nf), worth a visit
 * while its first key can be far for the tile's last row (c(j) + 2 <= c(last row)). */
__device__ __forceinline__ bool far_tile_in(const int *fl, int nf, int lt, int clast, int C) {
    return lt * kRows < nf && fl[lt * kRows] / C + 2 <= clast;
}

/* A key tile's positions and routing into shared memory: jp = the key's position (−1: none), ro its routing. */
__device__ __forceinline__ void keys_load(int *jp, int *ro, const int *rt, const int *idx, int cnt, int j0, int T) {
    const int x = (int)threadIdx.x;
    if (x < kRows) {
        const int j = idx ? (x < cnt ? idx[x] : -1) : (j0 + x < T ? j0 + x : -1);
        jp[x] = j;
        ro[x] = j >= 0 ? rt[j] : 0;
    }
}

/* Is key j (routing o) in row i's softmax part, in this phase? far: c(j) + 2 <= c(i) < o (Sel); local: j <= i and
 * c(j) + 1 >= c(i) (Local, always soft). */
__device__ __forceinline__ bool soft_in(bool far, int i, int ci, int j, int o, int T, int C) {
    if (j < 0 || i >= T) return false;
    const int cj = j / C;
    return far ? cj + 2 <= ci && ci < o : j <= i && cj + 1 >= ci;
}

/* The soft part over the far keys (Sel, gathered from the list) and then the Local key tiles: every key of a row's
 * softmax part once, ascending (far keys precede Local ones). */
__global__ void __launch_bounds__(kThr) soft_fwd_kernel(args a, float *y, float *mrow, float *lrow, int *amrow) {
    __shared__ __align__(16) h16 Qs[kRows * kLds], Ks[kRows * kLds], Vt[kD * kLdT];
    __shared__ int ro[kRows], jp[kRows];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.H / a.Hk), T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD;
    const float *qb = a.q + (int64_t)b * T * qd + h * kD, *kb = a.k + (int64_t)b * T * kvd + hk * kD,
                *vb = a.v + (int64_t)b * T * kvd + hk * kD;
    const int *rt = route_row(a, b, h), *fl = a.far_idx + ((int64_t)b * a.Hk + hk) * T;
    const int nf = a.far_n[b * a.Hk + hk], clast = min(qt * kRows + kRows - 1, T - 1) / C;
    const int kt_lo = max(0, (qt * kRows / C - 1) * C) / kRows;
    tile_load<kD, F16, F16>(Qs, NULL, qb, qd, qt * kRows, T);
    __syncthreads();
    uint32_t qf[4][4];
    a_frags(qf, Qs, kLds, w * 16, lane);
    const int i0 = qt * kRows + w * 16 + g, i1 = i0 + 8, c0 = i0 / C, c1 = i1 / C;
    const float sl2 = a.scale * kLog2e;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, acc[8][4];
    int am[2] = {i0, i1};
    zero(acc);
    for (int phase = 0; phase < 2; phase++) {
        const bool far = phase == 0;
        for (int t = far ? 0 : kt_lo;; t++) {
            __syncthreads();
            if (far ? !far_tile_in(fl, nf, t, clast, C) : t > qt) break;   /* the same for the whole block */
            if (far) {
                const int cnt = min(kRows, nf - t * kRows);
                tile_gather<kD, F16, F16>(Ks, NULL, kb, kvd, fl + t * kRows, cnt);
                tile_gather<kD, BF16, BF16>(NULL, Vt, vb, kvd, fl + t * kRows, cnt);
                keys_load(jp, ro, rt, fl + t * kRows, cnt, 0, T);
            } else {
                tile_load<kD, F16, F16>(Ks, NULL, kb, kvd, t * kRows, T);
                tile_load<kD, BF16, BF16>(NULL, Vt, vb, kvd, t * kRows, T);
                keys_load(jp, ro, rt, NULL, 0, t * kRows, T);
            }
            __syncthreads();
            float s[8][4];
            zero(s);
            mma_rows<F16>(s, qf, Ks, kLds, lane);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int jj = nt * 8 + 2 * c + (e & 1);
                    if (!soft_in(far, e < 2 ? i0 : i1, e < 2 ? c0 : c1, jp[jj], ro[jj], T, C)) s[nt][e] = -INFINITY;
                }
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                /* the tile's maximum of the row and its lowest key (this lane's keys ascend with nt, e) */
                float mx = -INFINITY;
                int jx = INT_MAX;
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int e = 2 * hh; e < 2 * hh + 2; e++)
                        if (s[nt][e] > mx) mx = s[nt][e], jx = jp[nt * 8 + 2 * c + (e & 1)];
#pragma unroll
                for (int o = 1; o <= 2; o <<= 1) {
                    const float m2 = __shfl_xor_sync(0xffffffffu, mx, o);
                    const int j2 = __shfl_xor_sync(0xffffffffu, jx, o);
                    if (m2 > mx || (m2 == mx && j2 < jx)) mx = m2, jx = j2;
                }
                if (mx > m[hh]) am[hh] = jx;   /* equal: the earlier tile's key is lower */
                mx = fmaxf(mx, m[hh]);
                const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
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
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
        l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
    }
    store_rows(y + (int64_t)b * T * qd + h * kD, qd, qt * kRows + w * 16, T, acc, 1.0f, 1.0f, lane);
    if (c == 0) {
        const int64_t rb = ((int64_t)b * a.H + h) * T;
        if (i0 < T) mrow[rb + i0] = m[0] * a.scale, lrow[rb + i0] = l[0], amrow[rb + i0] = am[0];
        if (i1 < T) mrow[rb + i1] = m[1] * a.scale, lrow[rb + i1] = l[1], amrow[rb + i1] = am[1];
    }
}

__global__ void __launch_bounds__(kThr) lin_fwd_kernel(args a, float *alin, float *brow) {
    __shared__ __align__(16) h16 Pq[kRows * kLdf], Pk[kRows * kLdf], Vt[kD * kLdT];
    __shared__ int ro[kRows];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.H / a.Hk), T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD, BT = (int64_t)a.B * T;
    const float *pq = a.phq + ((int64_t)h * BT + (int64_t)b * T) * kF, *pk = a.phk + ((int64_t)h * BT + (int64_t)b * T) * kF,
                *vb = a.v + (int64_t)b * T * kvd + hk * kD;
    const int *rt = route_row(a, b, h);
    tile_load<kF, BF16, BF16>(Pq, NULL, pq, kF, qt * kRows, T);
    const int i0 = qt * kRows + w * 16 + g, i1 = i0 + 8, c0 = i0 / C, c1 = i1 / C;
    float bs[2] = {0.0f, 0.0f}, acc[8][4];
    zero(acc);
    for (int kt = 0; kt <= qt && lin_reach(qt, kt, T, C); kt++) {
        __syncthreads();
        tile_load<kF, BF16, BF16>(Pk, NULL, pk, kF, kt * kRows, T);
        tile_load<kD, BF16, BF16>(NULL, Vt, vb, kvd, kt * kRows, T);
        route_load(ro, rt, kt * kRows, T);
        __syncthreads();
        float L[8][4];
        zero(L);
        mma_ss<BF16, 8, 8>(L, Pq, kLdf, w * 16, Pk, kLdf, lane);
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int jj = nt * 8 + 2 * c + (e & 1), i = e < 2 ? i0 : i1;
                if (!(i < T && kt * kRows + jj < T && (e < 2 ? c0 : c1) >= ro[jj])) L[nt][e] = 0.0f;
                bs[e >> 1] += L[nt][e];
            }
        uint32_t lf[4][4];
        acc_as_a<BF16>(lf, L);
        mma_rows<BF16>(acc, lf, Vt, kLdT, lane);
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        bs[hh] += __shfl_xor_sync(0xffffffffu, bs[hh], 1);
        bs[hh] += __shfl_xor_sync(0xffffffffu, bs[hh], 2);
    }
    store_rows(alin + (int64_t)b * T * qd + h * kD, qd, qt * kRows + w * 16, T, acc, 1.0f, 1.0f, lane);
    if (c == 0) {
        const int64_t rb = ((int64_t)b * a.H + h) * T;
        if (i0 < T) brow[rb + i0] = bs[0];
        if (i1 < T) brow[rb + i1] = bs[1];
    }
}

/* Element (row r = b·T + t, head h, channel x): y = (A + g a) / den, in place of A. */
__global__ void combine_kernel(float *y, const float *alin, const float *gate, const float *lrow, const float *brow,
                               int B, int T, int H, int gate_den) {
    const int64_t n = (int64_t)B * T * H * kD;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = e / (H * kD);
        const int h = (int)(e % (H * kD)) / kD, b = (int)(r / T), t = (int)(r % T);
        const int64_t rb = ((int64_t)b * H + h) * T + t;
        const float gx = gate ? gate[e] : 1.0f, av = alin ? alin[e] : 0.0f, bv = alin ? brow[rb] : 0.0f;
        const float den = still_den(lrow[rb], gx, bv, gate_den);
        y[e] = (y[e] + gx * av) / den;
    }
}

/* Warp per (row r, head h): dN, dA, dl, db, ρ, dpre. */
__global__ void rows_kernel(const float *dy, const float *y, const float *alin, const float *gate, const float *lrow,
                            const float *brow, int B, int T, int H, int gate_den, float *dN, float *dA, float *dlrow,
                            float *dbrow, float *rho, float *dpre) {
    const int64_t p = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (p >= (int64_t)B * T * H) return;
    const int64_t r = p / H;
    const int h = (int)(p % H), b = (int)(r / T), t = (int)(r % T);
    const int64_t rb = ((int64_t)b * H + h) * T + t, o = r * H * kD + h * kD;
    const float lt = lrow[rb], bt = alin ? brow[rb] : 0.0f;
    float sl = 0.0f, sb = 0.0f, sr = 0.0f;
    for (int x = lane; x < kD; x += 32) {
        const float gx = gate ? gate[o + x] : 1.0f, av = alin ? alin[o + x] : 0.0f, yv = y[o + x];
        const float den = still_den(lt, gx, bt, gate_den);
        const float dn = dy[o + x] / den, dd = -dn * yv;
        dN[o + x] = dn;
        if (alin) dA[o + x] = dn * gx;
        sl += dd;
        sb += gate_den ? dd * gx : dd;
        sr += dn * (yv * den - gx * av);   /* dN · A, the soft numerator A = y den − g a */
        if (gate && dpre) dpre[o + x] = (dn * av + (gate_den ? dd * bt : 0.0f)) * gx * (1.0f - gx);
    }
    for (int s = 16; s > 0; s >>= 1) {
        sl += __shfl_xor_sync(0xffffffffu, sl, s);
        sb += __shfl_xor_sync(0xffffffffu, sb, s);
        sr += __shfl_xor_sync(0xffffffffu, sr, s);
    }
    if (lane == 0) dlrow[rb] = sl, dbrow[rb] = sb, rho[rb] = sr + sl * lt;
}

struct brows {
    const float *dN, *dA, *mrow, *dlrow, *dbrow, *rho, *kbar;
    const int *amrow;
};

/* dK, dV of the soft part. FAR 0: a block per key tile, the queries that have it in Local (c(i) <= c(j) + 1),
 * stored; FAR 1 (after): a block per tile of the far list, the queries that have its keys in Sel, added at the keys'
 * positions (each listed once: no two blocks write one row). */
template <bool FAR>
__global__ void __launch_bounds__(kThr) soft_dkv_kernel(args a, brows r, float *dk, float *dv) {
    __shared__ __align__(16) h16 Qs[kRows * kLds], Qt[kD * kLdT], Ds[kRows * kLds], Dt[kD * kLdT];
    __shared__ float m_s[kRows], dl_s[kRows], rho_s[kRows];
    __shared__ int am_s[kRows];
    const int kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, G = a.H / a.Hk, T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD;
    const float *kb = a.k + (int64_t)b * T * kvd + hk * kD, *vb = a.v + (int64_t)b * T * kvd + hk * kD;
    const int *fl = a.far_idx + ((int64_t)b * a.Hk + hk) * T + kt * kRows;
    const int nf = a.far_n[b * a.Hk + hk], cnt = FAR ? min(kRows, nf - kt * kRows) : 0;
    if (FAR && cnt <= 0) return;   /* the whole block */
    if (FAR) {
        tile_gather<kD, F16, F16>(Qs, NULL, kb, kvd, fl, cnt);
        tile_gather<kD, BF16, BF16>(Ds, NULL, vb, kvd, fl, cnt);
    } else {
        tile_load<kD, F16, F16>(Qs, NULL, kb, kvd, kt * kRows, T);
        tile_load<kD, BF16, BF16>(Ds, NULL, vb, kvd, kt * kRows, T);
    }
    __syncthreads();
    uint32_t kf[4][4], vf[4][4];
    a_frags(kf, Qs, kLds, w * 16, lane);
    a_frags(vf, Ds, kLds, w * 16, lane);
    const int r0 = w * 16 + g, r1 = r0 + 8;   /* this lane's two keys: tile rows, and their positions */
    const int j0 = FAR ? (r0 < cnt ? fl[r0] : -1) : (kt * kRows + r0 < T ? kt * kRows + r0 : -1);
    const int j1 = FAR ? (r1 < cnt ? fl[r1] : -1) : (kt * kRows + r1 < T ? kt * kRows + r1 : -1);
    const float sl2 = a.scale * kLog2e;
    const int nqt = (T + kRows - 1) / kRows;
    int qt0, qt1;
    if (FAR) {
        qt0 = (fl[0] / C + 2) * C / kRows, qt1 = nqt - 1;
    } else {
        qt0 = kt, qt1 = min(nqt - 1, ((min(kt * kRows + kRows - 1, T - 1) / C + 2) * C - 1) / kRows);
    }
    float dka[8][4], dva[8][4];
    zero(dka), zero(dva);
    for (int hq = hk * G; hq < hk * G + G; hq++) {
        const float *qb = a.q + (int64_t)b * T * qd + hq * kD, *db = r.dN + (int64_t)b * T * qd + hq * kD;
        const int *rt = route_row(a, b, hq);
        const int o0 = j0 >= 0 ? rt[j0] : 0, o1 = j1 >= 0 ? rt[j1] : 0;
        const int64_t rb = ((int64_t)b * a.H + hq) * T;
        for (int qt = qt0; qt <= qt1; qt++) {
            __syncthreads();
            tile_load<kD, F16, BF16>(Qs, Qt, qb, qd, qt * kRows, T);
            tile_load<kD, BF16, BF16>(Ds, Dt, db, qd, qt * kRows, T);
            if (threadIdx.x < kRows) {
                const int i = qt * kRows + threadIdx.x;
                const bool in = i < T;
                m_s[threadIdx.x] = in ? r.mrow[rb + i] : 0.0f, dl_s[threadIdx.x] = in ? r.dlrow[rb + i] : 0.0f;
                rho_s[threadIdx.x] = in ? r.rho[rb + i] : 0.0f, am_s[threadIdx.x] = in ? r.amrow[rb + i] : -1;
            }
            __syncthreads();
            float p[8][4], dp[8][4];
            zero(p), zero(dp);
            mma_rows<F16>(p, kf, Qs, kLds, lane);     /* Sᵀ: row key, column query */
            mma_rows<BF16>(dp, vf, Ds, kLds, lane);   /* dPᵀ = V dNᵀ */
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nt * 8 + 2 * c + (e & 1), i = qt * kRows + qi, j = e < 2 ? j0 : j1;
                    const bool ok = soft_in(FAR, i, i / C, j, e < 2 ? o0 : o1, T, C);
                    const float pe = ok ? ex2(fmaf(p[nt][e], sl2, -m_s[qi] * kLog2e)) : 0.0f;
                    p[nt][e] = pe;
                    dp[nt][e] = ok ? pe * (dp[nt][e] + dl_s[qi]) - (am_s[qi] == j ? rho_s[qi] : 0.0f) : 0.0f;
                }
            uint32_t af[4][4];
            acc_as_a<BF16>(af, p);
            mma_rows<BF16>(dva, af, Dt, kLdT, lane);   /* dV += Eᵀ dN */
            acc_as_a<BF16>(af, dp);
            mma_rows<BF16>(dka, af, Qt, kLdT, lane);   /* dK += dSᵀ Q */
        }
    }
    float *dkb = dk + (int64_t)b * T * kvd + hk * kD, *dvb = dv + (int64_t)b * T * kvd + hk * kD;
    if (!FAR) {
        store_rows(dkb, kvd, kt * kRows + w * 16, T, dka, a.scale, a.scale, lane);
        store_rows(dvb, kvd, kt * kRows + w * 16, T, dva, 1.0f, 1.0f, lane);
    }
#pragma unroll
    for (int hh = 0; hh < 2 && FAR; hh++) {
        const int j = hh ? j1 : j0;
        if (j < 0) continue;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            float2 *ok_ = reinterpret_cast<float2 *>(dkb + (int64_t)j * kvd + nt * 8 + 2 * c);
            float2 *ov = reinterpret_cast<float2 *>(dvb + (int64_t)j * kvd + nt * 8 + 2 * c);
            float2 x = *ok_, y = *ov;
            x.x += dka[nt][2 * hh] * a.scale, x.y += dka[nt][2 * hh + 1] * a.scale;
            y.x += dva[nt][2 * hh], y.y += dva[nt][2 * hh + 1];
            *ok_ = x, *ov = y;
        }
    }
}

/* dQ of the soft part: the far keys (gathered) and then the Local key tiles, as the forward. */
__global__ void __launch_bounds__(kThr) soft_dq_kernel(args a, brows r, float *dq) {
    __shared__ __align__(16) h16 Ks[kRows * kLds], Kt[kD * kLdT], Vs[kRows * kLds];
    __shared__ int ro[kRows], jp[kRows];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.H / a.Hk), T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD;
    const float *qb = a.q + (int64_t)b * T * qd + h * kD, *db = r.dN + (int64_t)b * T * qd + h * kD;
    const float *kb = a.k + (int64_t)b * T * kvd + hk * kD, *vb = a.v + (int64_t)b * T * kvd + hk * kD;
    const float *kbar = r.kbar + ((int64_t)b * a.Hk + hk) * kD;
    const int *rt = route_row(a, b, h), *fl = a.far_idx + ((int64_t)b * a.Hk + hk) * T;
    const int nf = a.far_n[b * a.Hk + hk], clast = min(qt * kRows + kRows - 1, T - 1) / C;
    const int kt_lo = max(0, (qt * kRows / C - 1) * C) / kRows;
    tile_load<kD, F16, F16>(Ks, NULL, qb, qd, qt * kRows, T);
    tile_load<kD, BF16, BF16>(Vs, NULL, db, qd, qt * kRows, T);
    __syncthreads();
    uint32_t qf[4][4], df[4][4];
    a_frags(qf, Ks, kLds, w * 16, lane);
    a_frags(df, Vs, kLds, w * 16, lane);
    const int i0 = qt * kRows + w * 16 + g, i1 = i0 + 8, c0 = i0 / C, c1 = i1 / C;
    const int64_t rb = ((int64_t)b * a.H + h) * T;
    float mi[2], dl[2], rh[2];
    int am[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int i = hh ? i1 : i0;
        const bool in = i < T;
        mi[hh] = in ? r.mrow[rb + i] * kLog2e : 0.0f, dl[hh] = in ? r.dlrow[rb + i] : 0.0f;
        rh[hh] = in ? r.rho[rb + i] : 0.0f, am[hh] = in ? r.amrow[rb + i] : -1;
    }
    const float sl2 = a.scale * kLog2e;
    float dqa[8][4];
    zero(dqa);
    for (int phase = 0; phase < 2; phase++) {
        const bool far = phase == 0;
        for (int t = far ? 0 : kt_lo;; t++) {
            __syncthreads();
            if (far ? !far_tile_in(fl, nf, t, clast, C) : t > qt) break;   /* the same for the whole block */
            if (far) {
                const int cnt = min(kRows, nf - t * kRows);
                tile_gather<kD, F16, BF16>(Ks, Kt, kb, kvd, fl + t * kRows, cnt, kbar);   /* Kt: K − kbar */
                tile_gather<kD, BF16, BF16>(Vs, NULL, vb, kvd, fl + t * kRows, cnt);
                keys_load(jp, ro, rt, fl + t * kRows, cnt, 0, T);
            } else {
                tile_load<kD, F16, BF16>(Ks, Kt, kb, kvd, t * kRows, T, kbar);
                tile_load<kD, BF16, BF16>(Vs, NULL, vb, kvd, t * kRows, T);
                keys_load(jp, ro, rt, NULL, 0, t * kRows, T);
            }
            __syncthreads();
            float p[8][4], dp[8][4];
            zero(p), zero(dp);
            mma_rows<F16>(p, qf, Ks, kLds, lane);    /* S */
            mma_rows<BF16>(dp, df, Vs, kLds, lane);  /* dP = dN Vᵀ */
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hh = e >> 1, jj = nt * 8 + 2 * c + (e & 1), j = jp[jj];
                    const bool ok = soft_in(far, hh ? i1 : i0, hh ? c1 : c0, j, ro[jj], T, C);
                    const float pe = ok ? ex2(fmaf(p[nt][e], sl2, -mi[hh])) : 0.0f;
                    dp[nt][e] = ok ? pe * (dp[nt][e] + dl[hh]) - (am[hh] == j ? rh[hh] : 0.0f) : 0.0f;
                }
            uint32_t af[4][4];
            acc_as_a<BF16>(af, dp);
            mma_rows<BF16>(dqa, af, Kt, kLdT, lane);   /* dQ += dS (K − kbar) */
        }
    }
    store_rows(dq + (int64_t)b * T * qd + h * kD, qd, qt * kRows + w * 16, T, dqa, a.scale, a.scale, lane);
}

/* lin_dkv's shared memory: Φk [64][136], Φq [64][136], Φqᵀ [128][72], dA [64][72], dAᵀ [64][72], db [64]. */
constexpr size_t kLinDkvSmem = sizeof(h16) * (2 * kRows * kLdf + kF * kLdT + 2 * kRows * kLds) + sizeof(float) * kRows;

__global__ void __launch_bounds__(kThr) lin_dkv_kernel(args a, brows r, float *dv, float *dphk) {
    extern __shared__ __align__(16) h16 smem[];
    h16 *Pk = smem, *Pq = Pk + kRows * kLdf, *PqT = Pq + kRows * kLdf, *As = PqT + kF * kLdT, *At = As + kRows * kLds;
    float *db_s = reinterpret_cast<float *>(At + kD * kLdT);
    const int kt = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, G = a.H / a.Hk, T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD, BT = (int64_t)a.B * T;
    tile_load<kD, BF16, BF16>(As, NULL, a.v + (int64_t)b * T * kvd + hk * kD, kvd, kt * kRows, T);
    __syncthreads();
    uint32_t vf[4][4];
    a_frags(vf, As, kLds, w * 16, lane);
    const int j0 = kt * kRows + w * 16 + g, j1 = j0 + 8;
    const int nqt = (T + kRows - 1) / kRows;
    float dva[8][4];
    zero(dva);
    for (int hq = hk * G; hq < hk * G + G; hq++) {
        const float *pq = a.phq + ((int64_t)hq * BT + (int64_t)b * T) * kF;
        const float *pk = a.phk + ((int64_t)hq * BT + (int64_t)b * T) * kF;
        const float *ab = r.dA + (int64_t)b * T * qd + hq * kD;
        const int *rt = route_row(a, b, hq);
        const int o0 = j0 < T ? rt[j0] : INT_MAX, o1 = j1 < T ? rt[j1] : INT_MAX;
        const int64_t rb = ((int64_t)b * a.H + hq) * T;
        __syncthreads();
        tile_load<kF, BF16, BF16>(Pk, NULL, pk, kF, kt * kRows, T);
        float dpk[16][4];
        zero(dpk);
        for (int qt = kt; qt < nqt; qt++) {
            if (!lin_reach(qt, kt, T, C)) continue;   /* the same for the whole block */
            __syncthreads();
            tile_load<kF, BF16, BF16>(Pq, PqT, pq, kF, qt * kRows, T);
            tile_load<kD, BF16, BF16>(As, At, ab, qd, qt * kRows, T);
            if (threadIdx.x < kRows) {
                const int i = qt * kRows + threadIdx.x;
                db_s[threadIdx.x] = i < T ? r.dbrow[rb + i] : 0.0f;
            }
            __syncthreads();
            float Lt[8][4], dLt[8][4];
            zero(Lt), zero(dLt);
            mma_ss<BF16, 8, 8>(Lt, Pk, kLdf, w * 16, Pq, kLdf, lane);   /* Lᵀ = Φk Φqᵀ: row key, column query */
            mma_rows<BF16>(dLt, vf, As, kLds, lane);                     /* V dAᵀ */
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = nt * 8 + 2 * c + (e & 1), i = qt * kRows + qi;
                    const bool ok = i < T && i / C >= (e < 2 ? o0 : o1);
                    Lt[nt][e] = ok ? Lt[nt][e] : 0.0f;
                    dLt[nt][e] = ok ? dLt[nt][e] + db_s[qi] : 0.0f;
                }
            uint32_t af[4][4];
            acc_as_a<BF16>(af, Lt);
            mma_rows<BF16>(dva, af, At, kLdT, lane);    /* dV += Lᵀ dA */
            acc_as_a<BF16>(af, dLt);
            mma_rows<BF16>(dpk, af, PqT, kLdT, lane);   /* dφk += dLᵀ Φq */
        }
        store_rows(dphk + ((int64_t)hq * BT + (int64_t)b * T) * kF, kF, kt * kRows + w * 16, T, dpk, 1.0f, 1.0f, lane);
    }
    store_rows(dv + (int64_t)b * T * kvd + hk * kD, kvd, kt * kRows + w * 16, T, dva, 1.0f, 1.0f, lane, true);
}

__global__ void __launch_bounds__(kThr) lin_dq_kernel(args a, brows r, float *dphq) {
    __shared__ __align__(16) h16 Vs[kRows * kLds], PkT[kF * kLdT];
    __shared__ int ro[kRows];
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / (a.H / a.Hk), T = a.T, C = a.C;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int64_t qd = (int64_t)a.H * kD, kvd = (int64_t)a.Hk * kD, BT = (int64_t)a.B * T;
    const float *pk = a.phk + ((int64_t)h * BT + (int64_t)b * T) * kF, *vb = a.v + (int64_t)b * T * kvd + hk * kD;
    const int *rt = route_row(a, b, h);
    tile_load<kD, BF16, BF16>(Vs, NULL, r.dA + (int64_t)b * T * qd + h * kD, qd, qt * kRows, T);
    __syncthreads();
    uint32_t df[4][4];
    a_frags(df, Vs, kLds, w * 16, lane);
    const int i0 = qt * kRows + w * 16 + g, i1 = i0 + 8, c0 = i0 / C, c1 = i1 / C;
    const int64_t rb = ((int64_t)b * a.H + h) * T;
    const float db0 = i0 < T ? r.dbrow[rb + i0] : 0.0f, db1 = i1 < T ? r.dbrow[rb + i1] : 0.0f;
    float dpq[16][4];
    zero(dpq);
    for (int kt = 0; kt <= qt && lin_reach(qt, kt, T, C); kt++) {
        __syncthreads();
        tile_load<kD, BF16, BF16>(Vs, NULL, vb, kvd, kt * kRows, T);
        tile_load<kF, BF16, BF16>(NULL, PkT, pk, kF, kt * kRows, T);
        route_load(ro, rt, kt * kRows, T);
        __syncthreads();
        float dL[8][4];
        zero(dL);
        mma_rows<BF16>(dL, df, Vs, kLds, lane);   /* dA Vᵀ */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int hh = e >> 1, jj = nt * 8 + 2 * c + (e & 1);
                const bool ok = (hh ? i1 : i0) < T && kt * kRows + jj < T && (hh ? c1 : c0) >= ro[jj];
                dL[nt][e] = ok ? dL[nt][e] + (hh ? db1 : db0) : 0.0f;
            }
        uint32_t af[4][4];
        acc_as_a<BF16>(af, dL);
        mma_rows<BF16>(dpq, af, PkT, kLdT, lane);   /* dφq += dL Φk */
    }
    store_rows(dphq + ((int64_t)h * BT + (int64_t)b * T) * kF, kF, qt * kRows + w * 16, T, dpq, 1.0f, 1.0f, lane);
}

unsigned flat(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 1 ? 1 : b > 4096 ? 4096 : b);
}

int check(const stc_still_train_geom *g, still_err *err) {
    if (!g || g->D != kD || g->B <= 0 || g->T <= 0 || g->Hk <= 0 || g->H % g->Hk != 0 || g->C <= 0 || !g->route)
        return stc_fail(err, STILL_E_UNSUPPORTED, "fused still training attention: head dim %d, %d/%d heads, chunk %d "
                        "(takes head dim %d)", g ? g->D : 0, g ? g->H : 0, g ? g->Hk : 0, g ? g->C : 0, kD);
    return STILL_OK;
}

args make_args(const stc_still_train_geom *g, const float *q, const float *k, const float *v, const float *phq,
               const float *phk, const float *gate, const stc_still_train_rows *rows) {
    return args{q, k, v, phq, phk, g->linear ? gate : nullptr, g->route, rows->far_idx, rows->far_n, g->B, g->T, g->H,
                g->Hk, g->C, g->per_kv, g->linear && gate && g->gate_den, attn_logit_scale(kD)};
}

}   // namespace

int stc_still_train_fwd(stc_ctx *ctx, const stc_still_train_geom *g, const float *q, const float *k, const float *v,
                        const float *phq, const float *phk, const float *gate, float *y, float *alin,
                        stc_still_train_rows *rows, still_err *err) {
    STC_ENTER(ctx, err);
    int rc = check(g, err);
    if (rc) return rc;
    const args a = make_args(g, q, k, v, phq, phk, gate, rows);
    const dim3 grid((unsigned)((g->T + kRows - 1) / kRows), (unsigned)g->H, (unsigned)g->B);
    far_list_kernel<<<dim3((unsigned)g->B, (unsigned)g->Hk), kThr, 0, ctx->stream>>>(a, rows->far_idx, rows->far_n);
    STC_LAUNCHED(err, "still train far_list_kernel");
    soft_fwd_kernel<<<grid, kThr, 0, ctx->stream>>>(a, y, rows->m, rows->l, rows->am);
    STC_LAUNCHED(err, "still train soft_fwd_kernel");
    if (g->linear) {
        lin_fwd_kernel<<<grid, kThr, 0, ctx->stream>>>(a, alin, rows->b);
        STC_LAUNCHED(err, "still train lin_fwd_kernel");
    }
    combine_kernel<<<flat((int64_t)g->B * g->T * g->H * kD), 256, 0, ctx->stream>>>(
        y, g->linear ? alin : nullptr, a.gate, rows->l, rows->b, g->B, g->T, g->H, a.gate_den);
    STC_LAUNCHED(err, "still train combine_kernel");
    return STILL_OK;
}

int stc_still_train_bwd(stc_ctx *ctx, const stc_still_train_geom *g, const float *q, const float *k, const float *v,
                        const float *phq, const float *phk, const float *gate, const float *y, const float *alin,
                        stc_still_train_rows *rows, const float *dy, float *dN, float *dA, float *dq, float *dk,
                        float *dv, float *dphq, float *dphk, float *dpre, still_err *err) {
    STC_ENTER(ctx, err);
    int rc = check(g, err);
    if (rc) return rc;
    const args a = make_args(g, q, k, v, phq, phk, gate, rows);
    const int64_t pairs = (int64_t)g->B * g->T * g->H;
    rows_kernel<<<(unsigned)((pairs + 7) / 8), 256, 0, ctx->stream>>>(
        dy, y, g->linear ? alin : nullptr, a.gate, rows->l, rows->b, g->B, g->T, g->H, a.gate_den, dN, dA, rows->dl,
        rows->db, rows->rho, dpre);
    STC_LAUNCHED(err, "still train rows_kernel");
    const brows r{dN, dA, rows->m, rows->dl, rows->db, rows->rho, rows->kbar, rows->am};
    key_mean_kernel<<<dim3((unsigned)g->B, (unsigned)g->Hk), kD, 0, ctx->stream>>>(k, g->T, g->Hk, rows->kbar);
    STC_LAUNCHED(err, "key_mean_kernel");
    const unsigned nt = (unsigned)((g->T + kRows - 1) / kRows);
    soft_dkv_kernel<false><<<dim3(nt, (unsigned)g->Hk, (unsigned)g->B), kThr, 0, ctx->stream>>>(a, r, dk, dv);
    STC_LAUNCHED(err, "still train soft_dkv_kernel (Local)");
    soft_dkv_kernel<true><<<dim3(nt, (unsigned)g->Hk, (unsigned)g->B), kThr, 0, ctx->stream>>>(a, r, dk, dv);
    STC_LAUNCHED(err, "still train soft_dkv_kernel (far)");
    soft_dq_kernel<<<dim3(nt, (unsigned)g->H, (unsigned)g->B), kThr, 0, ctx->stream>>>(a, r, dq);
    STC_LAUNCHED(err, "still train soft_dq_kernel");
    if (!g->linear) return STILL_OK;
    STC_CUDA(err, cudaFuncSetAttribute(lin_dkv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kLinDkvSmem));
    lin_dkv_kernel<<<dim3(nt, (unsigned)g->Hk, (unsigned)g->B), kThr, kLinDkvSmem, ctx->stream>>>(a, r, dv, dphk);
    STC_LAUNCHED(err, "still train lin_dkv_kernel");
    lin_dq_kernel<<<dim3(nt, (unsigned)g->H, (unsigned)g->B), kThr, 0, ctx->stream>>>(a, r, dphq);
    STC_LAUNCHED(err, "still train lin_dq_kernel");
    return STILL_OK;
}
