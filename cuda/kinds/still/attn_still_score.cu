/* still on the GPU, step 2: the routing scores of the call's tokens
 * (src/kinds/still/attn_still.c computes them inside block_head).
 *
 * saliency: token t's own weight p in its window R(t) = max(0, t-C+1) .. t,
 *   p = e^{s_tt} / Σ_{l ∈ R(t)} e^{s_tl}, s = q·k / sqrt(D) in fp32 from the
 *   fp32 inputs (not the bf16 copies: selection must follow the CPU's), and
 *   the score f(p) = p log((p+ε)/ε) + (1-p) log(1-p) in double.
 * qk: each query i adds its logits s_il over R(i) to key l's score (double
 *   atomics; a key's score collects the C queries i = l .. l+C-1, which all
 *   come before the key's chunk leaves; the selection divides by C).
 * keynorm: ‖k_t‖ in double.
 * Scores of positions p0 .. p0+T-1 go to the workspace (sc), those of
 * earlier positions (qk's additions) to the ring's scores, in place.
 *
 * saliency / qk kernel: block (score tile b, query head h), 256 threads.
 * The tile's 64 query positions (64-aligned, absolute) against 64-key
 * sub-tiles of their windows: logits on the tensor cores from the fp32
 * inputs split three ways into bf16 (six products, as z in
 * attn_still_mma.cuh: about fp32's accuracy, which selection needs: it must
 * pick what the CPU picks). Warp w takes rows 16 (w & 3) and the keys
 * 32 (w >> 2) .. + 31 of each sub-tile, keeps an online max / sum for its
 * two rows a lane (the four lanes of a row reduce by shuffles), and the two
 * key halves' (max, sum) are combined per row at the end. */
#include "kinds/still/attn_still_mma.cuh"

#include <math.h>

#include <algorithm>

namespace stillk {
namespace {

using namespace tc;

/* Shared memory (bytes): the query rows and a sub-tile's keys as three
 * bf16 tiles each ([64][D]); floats self logit [64], the key halves' max
 * and sum [2][64] each; qk's per-key sums (double) [64]; a NaN flag per
 * row [64] (int). */
__host__ __device__ constexpr int score_tile_bytes(int D) { return kScoreRows * D * 2; }
__host__ __device__ constexpr int score_bytes(int D) {
    return 6 * score_tile_bytes(D) + (kScoreRows + 4 * kScoreRows) * 4 + kScoreRows * 8 + kScoreRows * 4;
}

/* Rows r0 .. r0 + 63 (positions, absolute) of q (head h) or of the keys (KV
 * head hk) into three bf16 tiles at t; positions outside [lo, hi] zero. In
 * two steps, so a caller can have the loads in flight while it computes:
 * score_fetch issues every load of the thread's pieces into registers (the
 * loads of one call are not held up by the shared stores of the split),
 * score_put splits and stores them. */
template <int D>
__host__ __device__ constexpr int score_pieces() { return kScoreRows * D / 8 / kThreads; }   /* 8-float pieces a thread moves */
template <int D>
using score_regs = float4[score_pieces<D>()][2];

template <int D, bool KEYS>
__device__ __forceinline__ void score_fetch(const args &a, int p0, int h_or_hk, int r0, int lo, int hi,
                                            score_regs<D> &v) {
    static_assert(kScoreRows * D / 8 % kThreads == 0, "whole passes");
#pragma unroll
    for (int it = 0; it < score_pieces<D>(); it++) {
        const int e = threadIdx.x + it * kThreads;
        const int r = e / (D / 8), c = 8 * (e % (D / 8)), pos = r0 + r;
        if (pos >= lo && pos <= hi) {
            const float *src = KEYS ? kv_row(a, p0, pos, h_or_hk, 0) + c : q_row(a, pos - p0, h_or_hk) + c;
            v[it][0] = *reinterpret_cast<const float4 *>(src);
            v[it][1] = *reinterpret_cast<const float4 *>(src + 4);
        } else {
            v[it][0] = v[it][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
}
template <int D>
__device__ __forceinline__ void score_put(const score_regs<D> &v, unsigned char *t) {
    constexpr int CH = D / 8;
#pragma unroll
    for (int it = 0; it < score_pieces<D>(); it++) {
        const int e = threadIdx.x + it * kThreads;
        const int r = e / (D / 8), c = 8 * (e % (D / 8));
        const float x[8] = {v[it][0].x, v[it][0].y, v[it][0].z, v[it][0].w,
                            v[it][1].x, v[it][1].y, v[it][1].z, v[it][1].w};
        store_split<3, 8>(t, score_tile_bytes(D), r, c, CH, x);
    }
}
template <int D, bool KEYS>
__device__ __forceinline__ void score_load(const args &a, int p0, int h_or_hk, int r0, int lo, int hi, unsigned char *t) {
    score_regs<D> v;
    score_fetch<D, KEYS>(a, p0, h_or_hk, r0, lo, hi, v);
    score_put<D>(v, t);
}

/* Row hh of this lane's accumulators for the sub-tile at key kb (columns n0 ..): the logits in the
 * window (-inf elsewhere) into val, the row's own logit into self_s[r], a NaN flag into nan_row[r],
 * and (QK) the logits added to the lane's column sums cs; returns the lane's max. */
template <bool QK>
__device__ __forceinline__ float row_logits(const args &a, const float (&acc)[4][4], int hh, int kb, int n0, int t,
                                            bool row_ok, int r, float (&val)[4][2], float *self_s, int *nan_row,
                                            double (&cs)[4][2]) {
    const int lane = threadIdx.x & 31;
    float tmax = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; nt++)
#pragma unroll
        for (int e2 = 0; e2 < 2; e2++) {
            const int key = kb + n0 + 8 * nt + stc_attn::acc_col(lane, 0) + e2;
            const bool ok = row_ok && in_window(key, t, a.C);
            const float v = ok ? acc[nt][2 * hh + e2] * a.scale : -INFINITY;
            val[nt][e2] = v;
            tmax = fmaxf(tmax, v);
            if (ok && key == t) self_s[r] = v;
            if (ok && v != v) nan_row[r] = 1;   /* the max / sum skip it; the CPU's p is NaN */
            if (QK && ok) cs[nt][e2] += (double)v;
        }
    return tmax;
}

/* The online softmax of a row over one more sub-tile: the row's 4 lanes (lane ^ 1, lane ^ 2) share
 * their max and sum, then (m, l) move on. */
__device__ __forceinline__ void row_online(float tmax, const float (&val)[4][2], float &m, float &l) {
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float mn = fmaxf(m, tmax);
    float part = 0.0f;
    if (mn != -INFINITY)
#pragma unroll
        for (int nt = 0; nt < 4; nt++) part += expf(val[nt][0] - mn) + expf(val[nt][1] - mn);   /* e^-inf = 0 */
    part += __shfl_xor_sync(0xffffffffu, part, 1);
    part += __shfl_xor_sync(0xffffffffu, part, 2);
    if (mn != -INFINITY) {
        l = l * expf(m - mn) + part;
        m = mn;
    }
}

/* Row r's score from the two key halves' (m, l) [2][64] and its own logit, for query head h at t. */
__device__ __forceinline__ void row_saliency(const args &a, int p0, int h, int t, int r, const float *xm,
                                             const float *xl, const float *self_s, const int *nan_row) {
    const float m1 = xm[r], m2 = xm[kScoreRows + r], mx = fmaxf(m1, m2);
    const float lt = (m1 != -INFINITY ? xl[r] * expf(m1 - mx) : 0.0f) +
                     (m2 != -INFINITY ? xl[kScoreRows + r] * expf(m2 - mx) : 0.0f);
    const float p = nan_row[r] ? NAN : expf(self_s[r] - mx) / lt;   /* NaN: saliency_of_p gives 0 */
    *score_ptr(a, p0, h, t) = saliency_of_p((double)p);
}

/* The end of a head in both saliency kernels: each row's (m, l) over this warp's key half (warp rows
 * m0 .., key half kh) into xm, xl; then, after a barrier of the whole block, the tile's rows' scores. */
__device__ __forceinline__ void tile_saliency(const args &a, int p0, int h, int tq0, int r_lo, int r_hi, int m0, int kh,
                                              const float (&m)[2], const float (&l)[2], float *xm, float *xl,
                                              const float *self_s, const int *nan_row) {
    const int tid = threadIdx.x, lane = tid & 31;
    if ((lane & 3) == 0)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = m0 + stc_attn::acc_row(lane, 2 * hh);
            xm[kh * kScoreRows + r] = m[hh];
            xl[kh * kScoreRows + r] = l[hh];
        }
    __syncthreads();   /* self_s, xm, xl */
    if (tid < kScoreRows) {
        const int r = tid, t = tq0 + r;
        if (t >= r_lo && t <= r_hi) row_saliency(a, p0, h, t, r, xm, xl, self_s, nan_row);
    }
}

template <int D>
__global__ void __launch_bounds__(kThreads) score_kernel(const args a) {
    constexpr int CH = D / 8, KS = D / 16, TB = score_tile_bytes(D);
    static_assert(kScoreRows == kTile && kKeys == 64, "64-row tiles, 64-key sub-tiles");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *Q3 = smem, *K3 = smem + 3 * TB;
    float *self_s = reinterpret_cast<float *>(smem + 6 * TB);   /* [64] each row's own logit */
    float *xm = self_s + kScoreRows, *xl = xm + 2 * kScoreRows;  /* [2][64] per key half */
    double *colsum = reinterpret_cast<double *>(xl + 2 * kScoreRows);   /* [64] qk: per key of the sub-tile */
    int *nan_row = reinterpret_cast<int *>(colsum + kScoreRows);        /* [64] a visible logit is NaN */

    const int p0 = *a.n_seen;
    const int tid = threadIdx.x, h = blockIdx.y, hk = h / a.G;
    const int tq0 = score_tile_q0(p0, blockIdx.x);
    const int r_lo = smax(tq0, p0), r_hi = smin(tq0 + kScoreRows - 1, p0 + a.T - 1);
    if (r_lo > r_hi) return;
    const bool qk = a.routing == R_QK;
    const int warp = tid >> 5, lane = tid & 31;
    const int m0 = 16 * (warp & 3), kh = warp >> 2, n0 = 32 * kh;
    const uint32_t q0 = smem_addr(Q3), k0 = smem_addr(K3);

    score_load<D, false>(a, p0, h, tq0, r_lo, r_hi, Q3);
    if (tid < kScoreRows) nan_row[tid] = 0;   /* read after the barriers below */

    float m[2], l[2];   /* rows m0 + acc_row(lane, 0) and + 8, over this warp's key half */
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    const int J = score_sub_before(a.C);
    const int key_lo = still_window_lo(r_lo, a.C);   /* keys any row of the tile sees */
    for (int s = 0; s <= J; s++) {
        const int kb = tq0 + kScoreRows * (s - J);
        if (kb + kKeys - 1 < key_lo || kb > r_hi) continue;   /* uniform over the block */
        __syncthreads();   /* the previous sub-tile's keys and colsum are no longer read */
        score_load<D, true>(a, p0, hk, kb, key_lo, r_hi, K3);
        if (qk && tid < kKeys) colsum[tid] = 0.0;
        __syncthreads();   /* the keys (and, the first time, the query rows) are complete */

        float acc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
        warp_mma6_abt<4, KS>(q0, TB, k0, TB, m0, n0, CH, acc);

        double cs[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) cs[nt][0] = cs[nt][1] = 0.0;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = m0 + stc_attn::acc_row(lane, 2 * hh), t = tq0 + r;
            const bool row_ok = t >= r_lo && t <= r_hi;
            float val[4][2];
            if (qk) {   /* uniform over the block */
                row_logits<true>(a, acc, hh, kb, n0, t, row_ok, r, val, self_s, nan_row, cs);
                continue;
            }
            const float tmax = row_logits<false>(a, acc, hh, kb, n0, t, row_ok, r, val, self_s, nan_row, cs);
            row_online(tmax, val, m[hh], l[hh]);
        }
        if (qk) {
            /* a key's sum over the warp's 16 rows (the 8 lane quads), then over the 4 warps of its half */
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    double c = cs[nt][e2];
                    c += __shfl_xor_sync(0xffffffffu, c, 4);
                    c += __shfl_xor_sync(0xffffffffu, c, 8);
                    c += __shfl_xor_sync(0xffffffffu, c, 16);
                    if (lane < 4 && c != 0.0) atomicAdd(&colsum[n0 + 8 * nt + stc_attn::acc_col(lane, 0) + e2], c);
                }
            __syncthreads();
            if (tid < kKeys) {
                const int key = kb + tid;
                if (key >= key_lo && key <= r_hi && colsum[tid] != 0.0) atomicAdd(score_ptr(a, p0, h, key), colsum[tid]);
            }
        }
    }
    if (qk) return;
    /* the two key halves of each row: (m, l) combined */
    tile_saliency(a, p0, h, tq0, r_lo, r_hi, m0, kh, m, l, xm, xl, self_s, nan_row);
}

/* saliency, by KV head: block (score tile b, KV head hk), the G query heads
 * of hk one after another. The keys' sub-tiles (the same for the G heads)
 * are loaded and split once and stay in shared memory; only the query rows
 * change per head. Scores as score_kernel's, bit for bit: the same products
 * in the same order, the same reductions. Shared memory: the query tiles,
 * J + 1 key sub-tiles, then the floats and flags of score_kernel. */
__host__ __device__ constexpr int score_gqa_bytes(int D, int n_sub) {
    return (1 + n_sub) * 3 * score_tile_bytes(D) + (kScoreRows + 4 * kScoreRows) * 4 + kScoreRows * 4;
}

/* The by-KV-head kernels' shared memory (score_gqa_bytes): the query tiles Q3, then J + 1 key sub-tiles
 * at K3 (sub-tile s at K3 + 3 TB s), then each row's own logit, the key halves' (max, sum) and the NaN flags. */
struct gqa_smem {
    unsigned char *Q3, *K3;
    float *self_s, *xm, *xl;
    int *nan_row;
};
template <int D>
__device__ __forceinline__ gqa_smem carve_gqa_smem(unsigned char *smem, int J) {
    constexpr int TB = score_tile_bytes(D);
    gqa_smem s;
    s.Q3 = smem, s.K3 = smem + 3 * TB;
    s.self_s = reinterpret_cast<float *>(smem + (size_t)(2 + J) * 3 * TB);
    s.xm = s.self_s + kScoreRows, s.xl = s.xm + 2 * kScoreRows;
    s.nan_row = reinterpret_cast<int *>(s.xl + 2 * kScoreRows);
    return s;
}

/* The start of query head h = hk·G + gi in the by-KV-head kernels: its rows (fetched into qv) split into Q3,
 * the next head's rows on their way, the NaN flags cleared, between the barriers that order them. */
template <int D>
__device__ __forceinline__ void gqa_head_rows(const args &a, int p0, int h, int gi, int tq0, int r_lo, int r_hi,
                                              score_regs<D> &qv, const gqa_smem &sm) {
    __syncthreads();   /* the previous head's rows, self logits, (m, l) and flags are read */
    score_put<D>(qv, sm.Q3);
    if (gi + 1 < a.G) score_fetch<D, false>(a, p0, h + 1, tq0, r_lo, r_hi, qv);
    if (threadIdx.x < kScoreRows) sm.nan_row[threadIdx.x] = 0;
    __syncthreads();   /* the query rows (and, the first time, the keys) are complete */
}

template <int D>
__global__ void __launch_bounds__(kThreads, 3) score_gqa_kernel(const args a) {
    constexpr int CH = D / 8, KS = D / 16, TB = score_tile_bytes(D);
    extern __shared__ __align__(128) unsigned char smem[];
    const int J = score_sub_before(a.C);
    const gqa_smem sm = carve_gqa_smem<D>(smem, J);
    unsigned char *Q3 = sm.Q3, *K3 = sm.K3;
    float *self_s = sm.self_s, *xm = sm.xm, *xl = sm.xl;
    int *nan_row = sm.nan_row;

    const int p0 = *a.n_seen;
    const int tid = threadIdx.x, hk = blockIdx.y;
    const int tq0 = score_tile_q0(p0, blockIdx.x);
    const int r_lo = smax(tq0, p0), r_hi = smin(tq0 + kScoreRows - 1, p0 + a.T - 1);
    if (r_lo > r_hi) return;
    const int warp = tid >> 5, lane = tid & 31;
    const int m0 = 16 * (warp & 3), kh = warp >> 2, n0 = 32 * kh;
    const uint32_t q0 = smem_addr(Q3), k0 = smem_addr(K3);
    const int key_lo = still_window_lo(r_lo, a.C);   /* keys any row of the tile sees */

    /* The loads of the first head's query rows and of the key sub-tiles are all issued before any of
     * them is split (one sub-tile ahead); the next head's rows are fetched while this head's run. */
    score_regs<D> qv, kv[2];
    score_fetch<D, false>(a, p0, hk * a.G, tq0, r_lo, r_hi, qv);
    const auto sub_used = [&](int s) {
        const int kb = tq0 + kScoreRows * (s - J);
        return !(kb + kKeys - 1 < key_lo || kb > r_hi);
    };
    int s_cur = 0;
    while (s_cur <= J && !sub_used(s_cur)) s_cur++;
    if (s_cur <= J) score_fetch<D, true>(a, p0, hk, tq0 + kScoreRows * (s_cur - J), key_lo, r_hi, kv[0]);
    while (s_cur <= J) {
        int s_next = s_cur + 1;
        while (s_next <= J && !sub_used(s_next)) s_next++;
        if (s_next <= J) score_fetch<D, true>(a, p0, hk, tq0 + kScoreRows * (s_next - J), key_lo, r_hi, kv[1]);
        score_put<D>(kv[0], K3 + (size_t)s_cur * 3 * TB);
        if (s_next <= J)
#pragma unroll
            for (int it = 0; it < score_pieces<D>(); it++) kv[0][it][0] = kv[1][it][0], kv[0][it][1] = kv[1][it][1];
        s_cur = s_next;
    }
    for (int gi = 0; gi < a.G; gi++) {
        const int h = hk * a.G + gi;
        gqa_head_rows<D>(a, p0, h, gi, tq0, r_lo, r_hi, qv, sm);

        float m[2], l[2];
        m[0] = m[1] = -INFINITY;
        l[0] = l[1] = 0.0f;
        for (int s = 0; s <= J; s++) {
            const int kb = tq0 + kScoreRows * (s - J);
            if (kb + kKeys - 1 < key_lo || kb > r_hi) continue;   /* uniform over the block */
            float acc[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
            warp_mma6_abt<4, KS>(q0, TB, k0 + (uint32_t)(s * 3 * TB), TB, m0, n0, CH, acc);
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = m0 + stc_attn::acc_row(lane, 2 * hh), t = tq0 + r;
                float val[4][2];
                double unused[4][2];
                const float tmax = row_logits<false>(a, acc, hh, kb, n0, t, t >= r_lo && t <= r_hi, r, val, self_s,
                                                     nan_row, unused);
                row_online(tmax, val, m[hh], l[hh]);
            }
        }
        tile_saliency(a, p0, h, tq0, r_lo, r_hi, m0, kh, m, l, xm, xl, self_s, nan_row);
    }
}

/* saliency by KV head with each warp's keys cut to its rows' windows (chunk 64, the sub-tile size; the
 * default plan): rows m0 .. m0 + 15 (m0 = 16 rg) of the tile see the keys tq0 - 63 + 16 rg .. tq0 + 16 rg + 15,
 * which lie in the five 16-key pairs rg .. rg + 4 of the two sub-tiles (128 keys from tq0 - 64). Warp half 0
 * takes pairs rg .. rg + 2, half 1 pairs rg + 3 and rg + 4: 80 keys a row instead of score_gqa_kernel's 128,
 * so 5/8 of its products and of its per-logit work, and each half's (max, sum) in one pass. Loads, splits,
 * products and logits as score_gqa_kernel's (the same logits bit for bit); the sums run in another order. */
template <int NP>
__device__ __forceinline__ void win_half(const args &a, uint32_t q0, uint32_t k0, int tq0, int r_lo, int r_hi,
                                         int m0, int p_first, bool sub0, float *self_s, int *nan_row, float (&m)[2],
                                         float (&l)[2]) {
    constexpr int D = 64, CH = D / 8, KS = D / 16, TB = score_tile_bytes(D);
    const int lane = threadIdx.x & 31;
    const int a_row = stc_attn::ldm_rowmajor_row(lane), a_chunk = stc_attn::ldm_rowmajor_chunk(lane);
    const int b_row = stc_attn::ldm_nk_row(lane), b_chunk = stc_attn::ldm_nk_chunk(lane);
    float acc[2 * NP][4];
#pragma unroll
    for (int nt = 0; nt < 2 * NP; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        uint32_t ah[4], am[4], al[4];
        const int ao = stc_attn::swz_off_add(a_row, a_chunk, m0, 2 * ks, CH);
        ldsm_x4(ah, q0 + ao);
        ldsm_x4(am, q0 + TB + ao);
        ldsm_x4(al, q0 + 2 * TB + ao);
#pragma unroll
        for (int np = 0; np < NP; np++) {
            const int p = p_first + np, sub = p >> 2;
            if (sub == 0 && !sub0) continue;   /* (uniform) a sub-tile no row sees: not loaded */
            const uint32_t b0 = k0 + (uint32_t)(sub * 3 * TB);
            const int bo = stc_attn::swz_off_add(b_row, b_chunk, 16 * (p & 3), 2 * ks, CH);
            uint32_t bh[4], bm[4], bl[4];
            ldsm_x4(bh, b0 + bo);
            ldsm_x4(bm, b0 + TB + bo);
            ldsm_x4(bl, b0 + 2 * TB + bo);
            mma6(acc[2 * np], ah, am, al, bh, bm, bl, 0);
            mma6(acc[2 * np + 1], ah, am, al, bh, bm, bl, 1);
        }
    }
    const int kb = tq0 - kKeys + 16 * p_first;   /* the key of the half's first column */
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int r = m0 + stc_attn::acc_row(lane, 2 * hh), t = tq0 + r;
        const bool row_ok = t >= r_lo && t <= r_hi;
        float val[2 * NP][2], tmax = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 2 * NP; nt++)
#pragma unroll
            for (int e2 = 0; e2 < 2; e2++) {
                const int key = kb + 8 * nt + stc_attn::acc_col(lane, 0) + e2;
                const bool ok = row_ok && in_window(key, t, kKeys);
                const float v = ok ? acc[nt][2 * hh + e2] * a.scale : -INFINITY;
                val[nt][e2] = v;
                tmax = fmaxf(tmax, v);
                if (ok && key == t) self_s[r] = v;
                if (ok && v != v) nan_row[r] = 1;   /* the max / sum skip it; the CPU's p is NaN */
            }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        float part = 0.0f;
        if (tmax != -INFINITY)
#pragma unroll
            for (int nt = 0; nt < 2 * NP; nt++) part += expf(val[nt][0] - tmax) + expf(val[nt][1] - tmax);
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        m[hh] = tmax, l[hh] = part;
    }
}

__global__ void __launch_bounds__(kThreads, 3) score_win_kernel(const args a) {
    constexpr int D = 64, TB = score_tile_bytes(D);
    extern __shared__ __align__(128) unsigned char smem[];
    const gqa_smem sm = carve_gqa_smem<D>(smem, 1);   /* chunk 64: the previous sub-tile and the tile's own */
    unsigned char *Q3 = sm.Q3, *K3 = sm.K3;
    float *self_s = sm.self_s, *xm = sm.xm, *xl = sm.xl;
    int *nan_row = sm.nan_row;

    const int p0 = *a.n_seen;
    const int tid = threadIdx.x, hk = blockIdx.y;
    const int tq0 = score_tile_q0(p0, blockIdx.x);
    const int r_lo = smax(tq0, p0), r_hi = smin(tq0 + kScoreRows - 1, p0 + a.T - 1);
    if (r_lo > r_hi) return;
    const int warp = tid >> 5;
    const int rg = warp & 3, kh = warp >> 2, m0 = 16 * rg;
    const uint32_t q0 = smem_addr(Q3), k0 = smem_addr(K3);
    const int key_lo = smax(0, r_lo - kKeys + 1);   /* keys any row of the tile sees */
    const bool sub0 = tq0 - 1 >= key_lo;            /* the previous sub-tile holds some of them */

    /* the first head's query rows and both sub-tiles' keys in flight before any is split */
    score_regs<D> qv, kv[2];
    score_fetch<D, false>(a, p0, hk * a.G, tq0, r_lo, r_hi, qv);
    if (sub0) score_fetch<D, true>(a, p0, hk, tq0 - kKeys, key_lo, r_hi, kv[0]);
    score_fetch<D, true>(a, p0, hk, tq0, key_lo, r_hi, kv[1]);
    if (sub0) score_put<D>(kv[0], K3);
    score_put<D>(kv[1], K3 + 3 * TB);
    for (int gi = 0; gi < a.G; gi++) {
        const int h = hk * a.G + gi;
        gqa_head_rows<D>(a, p0, h, gi, tq0, r_lo, r_hi, qv, sm);
        float m[2], l[2];
        if (kh == 0) win_half<3>(a, q0, k0, tq0, r_lo, r_hi, m0, rg, sub0, self_s, nan_row, m, l);
        else win_half<2>(a, q0, k0, tq0, r_lo, r_hi, m0, rg + 3, sub0, self_s, nan_row, m, l);
        tile_saliency(a, p0, h, tq0, r_lo, r_hi, m0, kh, m, l, xm, xl, self_s, nan_row);
    }
}

/* keynorm: one warp per (token, KV head); the norm goes to the G query heads. */
__global__ void keynorm_kernel(const args a) {
    const int p0 = *a.n_seen;
    const int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= a.T * a.Hk) return;
    const int t = w / a.Hk, hk = w % a.Hk;
    const float *k = a.k + (size_t)t * a.ldkv + (size_t)hk * a.D;
    double n2 = 0.0;
    for (int x = lane; x < a.D; x += 32) n2 += (double)k[x] * k[x];
    for (int o = 16; o > 0; o >>= 1) n2 += __shfl_xor_sync(0xffffffffu, n2, o);
    if (lane < a.G) *score_ptr(a, p0, hk * a.G + lane, p0 + t) = sqrt(n2);
}

}   // namespace

/* The larger of the two saliency kernels' needs (the by-KV-head one keeps J + 1 key sub-tiles). */
size_t smem_score(int D, int C) {
    return D == 64 ? (size_t)std::max(score_bytes(64), score_gqa_bytes(64, score_sub_before(C) + 1))
                   : (size_t)score_bytes(128);
}

/* The by-KV-head saliency kernel: head dim 64, saliency routing (else score_kernel, a block per query head). */
static bool use_score_gqa(const args &a) { return a.D == 64 && a.routing == R_SALIENCY; }
static size_t smem_score_gqa(const args &a) { return (size_t)score_gqa_bytes(64, score_sub_before(a.C) + 1); }
/* ... with the keys cut to each warp's windows: chunk 64 (other chunks: score_gqa_kernel) */
static bool use_score_win(const args &a) { return use_score_gqa(a) && a.C == kKeys; }

int launch_score(stc_ctx *ctx, const args &a, still_err *err) {
    if (a.routing == R_KEYNORM) {
        const int warps = a.T * a.Hk;
        keynorm_kernel<<<stc_blocks((int64_t)warps * 32, 256), 256, 0, ctx->stream>>>(a);
        STC_LAUNCHED(err, "keynorm_kernel");
        return STILL_OK;
    }
    if (a.routing != R_SALIENCY && a.routing != R_QK) return STILL_OK;
    if (use_score_win(a)) {
        const dim3 grid((unsigned)max_score_tiles(a.T), (unsigned)a.Hk);
        score_win_kernel<<<grid, kThreads, smem_score_gqa(a), ctx->stream>>>(a);
        STC_LAUNCHED(err, "score_win_kernel");
        return STILL_OK;
    }
    if (use_score_gqa(a)) {
        const dim3 grid((unsigned)max_score_tiles(a.T), (unsigned)a.Hk);
        score_gqa_kernel<64><<<grid, kThreads, smem_score_gqa(a), ctx->stream>>>(a);
        STC_LAUNCHED(err, "score_gqa_kernel");
        return STILL_OK;
    }
    const dim3 grid((unsigned)max_score_tiles(a.T), (unsigned)a.H);
    if (a.D == 64) score_kernel<64><<<grid, kThreads, score_bytes(64), ctx->stream>>>(a);
    else score_kernel<128><<<grid, kThreads, score_bytes(128), ctx->stream>>>(a);
    STC_LAUNCHED(err, "score_kernel");
    return STILL_OK;
}

int prepare_score(int D, still_err *err) {
    const int bytes = D == 64 ? score_bytes(64) : score_bytes(128);
    if (D == 64) STC_CUDA(err, cudaFuncSetAttribute(score_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else STC_CUDA(err, cudaFuncSetAttribute(score_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (D == 64)   /* room for up to three key sub-tiles (chunks up to 128) */
        STC_CUDA(err, cudaFuncSetAttribute(score_gqa_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           score_gqa_bytes(64, 3)));
    if (D == 64)
        STC_CUDA(err, cudaFuncSetAttribute(score_win_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           score_gqa_bytes(64, 2)));
    return STILL_OK;
}

}   // namespace stillk
