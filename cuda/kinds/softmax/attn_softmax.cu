/* Causal softmax attention with grouped-query heads on the tensor cores,
 * FlashAttention-2 style: online softmax over 64-key tiles, the L×L score
 * matrix never formed.
 *
 * Work (cuda/kinds/attn_layout.cuh has the index arithmetic and its rationale):
 * grid.x = row tiles × KV heads, grid.y = key splits; 128 threads (4 warps)
 * per block. A block owns BLOCK_M = 64·MT rows of one KV head (rows are
 * (token, query head) pairs, token-major, so the G query heads of the KV head
 * share every K/V tile), each warp MT·16 of them.
 *
 * Per block:
 *   Q tile (BLOCK_M × D) -> shared memory (cp.async) -> registers (ldmatrix),
 *   held there for the whole key loop as mma A fragments;
 *   K and V tiles (64 × D each) double-buffered in shared memory: while the
 *   warps compute on tile j, cp.async brings tile j+1;
 *   per tile and warp, with m16n8k16 bf16 mma (fp32 accumulate):
 *     S = Q Kᵀ                 (K via ldmatrix: B fragments of [key][dim] rows)
 *     causal mask (only in tiles that cross the diagonal of the warp's rows:
 *     tile_step<MASK> is compiled twice), running row max m,
 *     P = 2^(S·scale·log2e − m·scale·log2e), row sums l (per thread, reduced
 *     across the 4 lanes of a row at the end), O rescaled by 2^(m_old − m_new);
 *     P converted to bf16 in registers, where the S accumulator layout is
 *     already the A fragment layout of the next mma;
 *     O += P V                 (V via ldmatrix.trans)
 *   then O / l to the output (fp32 or bf16) — or, with several splits, the
 *   unnormalised O, m and l to a workspace that attn_combine_kernel merges:
 *   out = Σ_s O_s 2^(m_s − m) / Σ_s l_s 2^(m_s − m), m = max_s m_s.
 *
 * Shared memory: Q BLOCK_M·D·2 bytes + K, V 2 × 2 × 64·D·2 bytes (48 KiB for
 * D = 64 and 128-row blocks), rows swizzled (attn_layout.cuh). Keys past a
 * block's last position are never read from the cache: their tile rows are
 * zero-filled (cp.async with source size 0), so whatever lies beyond row
 * p0 + T − 1 of the cache (even NaN) cannot leak in through 0 · NaN. */
#include "kinds/attn_rules.h"
#include "kinds/attn_layout.cuh"
#include "common/mma_ptx.cuh"
#include "common/cuda_common.cuh"

#include <math.h>

using namespace stc_attn;
using namespace stc_ptx;

namespace {

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_PART = 2 };

struct attn_args {
    const bf16 *q, *k, *v;
    void *out;              /* OUT_F32 / OUT_BF16: [T][H][D] */
    float *part_o;          /* OUT_PART: [split][Hk][rows][D] unnormalised */
    float2 *part_ml;        /*           [split][Hk][rows] (m, l) */
    int T, p0, H, Hk, G, rows;
    int n_row_tiles, tiles_per_split, block_m;
    int window;             /* 0: causal; W > 0: also key > pos - W (positions relative to the cache view) */
    float scale_log2;       /* log2(e) / sqrt(D) */
};

/* The PTX wrappers (cp.async, ldmatrix, mma.sync, ex2, bf16 packing): cuda/common/mma_ptx.cuh. */

/* ---- the kernel ---------------------------------------------------------------------- */

template <int D, int MT>
constexpr int smem_bytes() {
    return (kWarps * 16 * MT + 4 * kBlockN) * D * 2;
}

/* One warp, one 64-key tile (K at shared address kt, V at vt, keys from
 * kbase): S = Q Kᵀ, the causal mask if MASK, the online-softmax update of
 * m, l and O, then O += P V. */
template <int D, int MT, bool MASK>
__device__ __forceinline__ void tile_step(const uint32_t kt, const uint32_t vt, const int kbase, const int lane,
                                          const float sl2, const int window, const uint32_t (&qf)[MT][D / 16][4],
                                          float (&o)[MT][D / 8][4], float (&m)[MT][2], float (&l)[MT][2],
                                          const int (&pos)[MT][2]) {
    constexpr int CH = D / 8, KS = D / 16, NT = kBlockN / 8, DT = D / 8;
    /* the lane's own row / chunk of each ldmatrix.x4 (the loops add multiples of 16 rows, 2 chunks) */
    const int k_row = ldm_nk_row(lane), k_chunk = ldm_nk_chunk(lane);
    const int v_row = ldm_rowmajor_row(lane), v_chunk = ldm_rowmajor_chunk(lane);

    /* S = Q Kᵀ: 16 keys (two n-tiles) per ldmatrix.x4, each B fragment used by MT mma. */
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[mt][nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            uint32_t b[4];
            ldsm_x4(b, kt + swz_off_add(k_row, k_chunk, np * 16, 2 * ks, CH));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(s[mt][2 * np], qf[mt][ks], b[0], b[1]);
                mma_bf16(s[mt][2 * np + 1], qf[mt][ks], b[2], b[3]);
            }
        }

    /* Causal mask (only in tiles that cross the diagonal of this warp's rows). */
    if constexpr (MASK) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int key = kbase + nt * 8 + acc_col(lane, e), ps = pos[mt][e >> 1];
                    if (!attn_key_visible(ps, key, window)) s[mt][nt][e] = -INFINITY;
                }
    }

    /* Online softmax, per row (mt, h): the 4 lanes of a quad share a row. */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = m[mt][h];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            /* A row with no visible key yet (only in a split) keeps m = -inf: use 0
             * as the offset so that 2^(-inf - 0) = 0 instead of NaN. */
            const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
            const float corr = ex2(m[mt][h] * sl2 - msc);
            m[mt][h] = mx;
            float sum = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; e++) {
                    const float p = ex2(fmaf(s[mt][nt][e], sl2, -msc));
                    s[mt][nt][e] = p;
                    sum += p;
                }
            l[mt][h] = l[mt][h] * corr + sum;
#pragma unroll
            for (int dt = 0; dt < DT; dt++) o[mt][dt][2 * h] *= corr, o[mt][dt][2 * h + 1] *= corr;
        }

    /* O += P V: P (bf16) from the S registers, V B fragments via ldmatrix.trans,
     * 16 dims (two n-tiles) per ldmatrix.x4. */
#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float *c = s[mt][2 * kk + p_frag_ntile(i)];
                pa[mt][i] = pack_bf16(c[p_frag_e(i)], c[p_frag_e(i) + 1]);
            }
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            uint32_t b[4];
            ldsm_x4_trans(b, vt + swz_off_add(v_row, v_chunk, kk * 16, 2 * dp, CH));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(o[mt][2 * dp], pa[mt], b[0], b[1]);
                mma_bf16(o[mt][2 * dp + 1], pa[mt], b[2], b[3]);
            }
        }
    }
}

/* WIN: the swa window is compiled in only where it is used, so the causal
 * kernel is the same code as without it. */
template <int D, int MT, int OUT, bool WIN>
__global__ void __launch_bounds__(kThreads, (D == 64 && MT == 1) ? 3 : 2) attn_fwd_kernel(const attn_args a) {
    constexpr int BLOCK_M = kWarps * 16 * MT;
    constexpr int CH = D / 8;               /* 16-byte chunks per tile row */
    constexpr int KS = D / 16;              /* k-steps of Q·Kᵀ over the head dim */
    constexpr int DT = D / 8;               /* 8-dim n-tiles of O */
    constexpr int RSTEP = kThreads / CH;    /* tile rows one pass of the block's threads copies (16 or 8) */
    constexpr uint32_t TILE = kBlockN * D * 2;
    static_assert(RSTEP % 8 == 0 && BLOCK_M % RSTEP == 0 && kBlockN % RSTEP == 0, "copy passes");

    extern __shared__ __align__(128) unsigned char smem[];
    const uint32_t sQ = smem_addr(smem);
    const uint32_t sK = sQ + BLOCK_M * D * 2;   /* K buffers 0, 1 */
    const uint32_t sV = sK + 2 * TILE;          /* V buffers 0, 1 */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int tile, hk;
    cta_coords(blockIdx.x, a.Hk, a.n_row_tiles, &tile, &hk);
    const int split = blockIdx.y;
    const int r0 = tile * BLOCK_M;
    int t_lo, t_hi;
    token_range(r0, BLOCK_M, a.rows, a.G, &t_lo, &t_hi);
    const int n_keys = a.p0 + t_hi + 1;
    const int n_tiles = key_tiles(a.p0, t_hi);
    int jb = split * a.tiles_per_split;
    const int je = imin(n_tiles, jb + a.tiles_per_split);
    if (jb >= je) return;   /* this split holds no keys for this row tile (the combine skips it) */
    const int window = WIN ? a.window : 0;
    /* a window and one split: start at the first tile any row of the block sees
     * (with splits, the caller's view of the cache already starts there) */
    if (WIN && gridDim.y == 1) jb = imax(jb, imax(0, a.p0 + t_lo - window + 1) / kBlockN);

    /* Copies: thread tid moves chunk tid % CH of rows tid / CH + RSTEP·i. */
    const int ld_row = tid / CH, ld_chunk = tid % CH;
    /* Q rows -> shared memory (rows past the end zero-filled). */
#pragma unroll
    for (int it = 0; it < BLOCK_M / RSTEP; it++) {
        const int r = r0 + ld_row + it * RSTEP;
        const bool ok = r < a.rows;
        const bf16 *src = a.q;
        if (ok) {
            const int t = r / a.G, g = r - t * a.G;
            src = a.q + ((size_t)t * a.H + (size_t)hk * a.G + g) * D + ld_chunk * 8;
        }
        cp_async_16(sQ + swz_off_add(ld_row, ld_chunk, it * RSTEP, 0, CH), src, ok);
    }
    /* K and V tile j -> buffer buf (keys past n_keys zero-filled). */
    const size_t kv_step = (size_t)RSTEP * a.Hk * D;
    auto load_kv = [&](int j, int buf) {
        const int key0 = j * kBlockN + ld_row;
        const size_t off = ((size_t)key0 * a.Hk + hk) * D + ld_chunk * 8;
#pragma unroll
        for (int it = 0; it < kBlockN / RSTEP; it++) {
            const bool ok = key0 + it * RSTEP < n_keys;
            const uint32_t so = buf * TILE + swz_off_add(ld_row, ld_chunk, it * RSTEP, 0, CH);
            cp_async_16(sK + so, ok ? a.k + off + it * kv_step : a.k, ok);
            cp_async_16(sV + so, ok ? a.v + off + it * kv_step : a.v, ok);
        }
    };
    load_kv(jb, 0);
    cp_async_commit();

    /* This warp's rows and the positions of the 2·MT rows this lane holds. */
    const int wr0 = r0 + warp * MT * 16;
    const bool warp_active = wr0 < a.rows;
    int wt_lo = 0, wt_hi = 0;
    if (warp_active) token_range(wr0, MT * 16, a.rows, a.G, &wt_lo, &wt_hi);
    int pos[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wr0 + mt * 16 + acc_row(lane, 2 * h);
            pos[mt][h] = a.p0 + imin(r, a.rows - 1) / a.G;   /* rows past the end: any valid position */
        }

    float o[MT][DT][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][dt][e] = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) m[mt][h] = -INFINITY, l[mt][h] = 0.0f;
    }
    uint32_t qf[MT][KS][4];

    for (int j = jb; j < je; j++) {
        const int buf = (j - jb) & 1;
        cp_async_wait_all();   /* tile j (and, the first time, Q) has landed ... */
        __syncthreads();       /* ... for every thread; and every warp is done with tile j-1's buffer */
        if (j == jb) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int ks = 0; ks < KS; ks++)
                    ldsm_x4(qf[mt][ks], sQ + swz_off_add(ldm_rowmajor_row(lane), ldm_rowmajor_chunk(lane),
                                                         warp * MT * 16 + mt * 16, 2 * ks, CH));
        }
        if (j + 1 < je) load_kv(j + 1, buf ^ 1);   /* prefetch into the buffer tile j-1 used */
        cp_async_commit();

        const int kbase = j * kBlockN;
        if (!warp_active || tile_skipped(kbase, a.p0, wt_hi)) continue;
        /* window: a tile wholly before every row's window holds nothing for this warp */
        if (WIN && kbase + kBlockN - 1 <= a.p0 + wt_lo - window) continue;
        const uint32_t kt = sK + buf * TILE, vt = sV + buf * TILE;
        if (tile_needs_mask(kbase, a.p0, wt_lo) || (WIN && kbase <= a.p0 + wt_hi - window))
            tile_step<D, MT, true>(kt, vt, kbase, lane, a.scale_log2, window, qf, o, m, l, pos);
        else
            tile_step<D, MT, false>(kt, vt, kbase, lane, a.scale_log2, window, qf, o, m, l, pos);
    }

    if (!warp_active) return;
    /* Epilogue: row sums across the quad, then O / l (or the partials). */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float lt = l[mt][h];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const int r = wr0 + mt * 16 + acc_row(lane, 2 * h);
            if (r >= a.rows) continue;
            const int t = r / a.G, g = r - t * a.G;
            const int col = acc_col(lane, 0);
            if constexpr (OUT == OUT_PART) {
                const size_t pr = ((size_t)split * a.Hk + hk) * a.rows + r;
                float *dst = a.part_o + pr * D + col;
#pragma unroll
                for (int dt = 0; dt < DT; dt++)
                    *reinterpret_cast<float2 *>(dst + dt * 8) = make_float2(o[mt][dt][2 * h], o[mt][dt][2 * h + 1]);
                if ((lane & 3) == 0) a.part_ml[pr] = make_float2(m[mt][h], lt);
            } else {
                const float inv = 1.0f / lt;
                const size_t off = ((size_t)t * a.H + (size_t)hk * a.G + g) * D + col;
#pragma unroll
                for (int dt = 0; dt < DT; dt++) {
                    const float x0 = o[mt][dt][2 * h] * inv, x1 = o[mt][dt][2 * h + 1] * inv;
                    if constexpr (OUT == OUT_F32)
                        *reinterpret_cast<float2 *>((float *)a.out + off + dt * 8) = make_float2(x0, x1);
                    else
                        *reinterpret_cast<__nv_bfloat162 *>((bf16 *)a.out + off + dt * 8) = __floats2bfloat162_rn(x0, x1);
                }
            }
        }
}

/* Merges the splits of one row (block (r, hk), one thread per dim). */
template <int OUT>
__global__ void attn_combine_kernel(const attn_args a, int D) {
    const int r = blockIdx.x, hk = blockIdx.y, d = threadIdx.x;
    const int ns = splits_used(r / a.block_m, a.block_m, a.rows, a.G, a.p0, a.tiles_per_split);
    float mx = -INFINITY;
    for (int s = 0; s < ns; s++) mx = fmaxf(mx, a.part_ml[((size_t)s * a.Hk + hk) * a.rows + r].x);
    float acc = 0.0f, lsum = 0.0f;
    for (int s = 0; s < ns; s++) {
        const size_t pr = ((size_t)s * a.Hk + hk) * a.rows + r;
        const float2 ml = a.part_ml[pr];
        const float w = exp2f((ml.x - mx) * a.scale_log2);   /* 0 for a split with no visible key */
        lsum += ml.y * w;
        acc += a.part_o[pr * D + d] * w;
    }
    const int t = r / a.G, g = r - t * a.G;
    const size_t off = ((size_t)t * a.H + (size_t)hk * a.G + g) * D + d;
    const float x = acc / lsum;
    if constexpr (OUT == OUT_F32) ((float *)a.out)[off] = x;
    else ((bf16 *)a.out)[off] = __float2bfloat16_rn(x);
}

/* Index of a kernel configuration in stc_ctx::attn_smem_set. */
template <int D, int MT, int OUT, bool WIN>
constexpr int config_bit() {
    return ((D == 64 ? (MT == 2 ? 0 : 1) : 2) * 3 + OUT) * 2 + (WIN ? 1 : 0);
}

template <int D, int MT, int OUT, bool WIN>
int launch_fwd_w(stc_ctx *ctx, const attn_args &a, int n_splits, still_err *err) {
    constexpr int smem = smem_bytes<D, MT>();
    if ((size_t)smem > ctx->smem_optin)
        return stc_fail(err, STILL_E_UNSUPPORTED, "attention: %d bytes of shared memory needed, the device allows %zu",
                        smem, ctx->smem_optin);
    constexpr unsigned bit = 1u << config_bit<D, MT, OUT, WIN>();
    static_assert(config_bit<D, MT, OUT, WIN>() < 32, "attn_smem_set bits");
    if (!(ctx->attn_smem_set & bit)) {
        STC_CUDA(err, cudaFuncSetAttribute(attn_fwd_kernel<D, MT, OUT, WIN>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        ctx->attn_smem_set |= bit;
    }
    const dim3 grid((unsigned)(a.n_row_tiles * a.Hk), (unsigned)n_splits);
    attn_fwd_kernel<D, MT, OUT, WIN><<<grid, kThreads, smem, ctx->stream>>>(a);
    STC_LAUNCHED(err, "attn_fwd_kernel");
    return STILL_OK;
}

template <int D, int MT, int OUT>
int launch_fwd(stc_ctx *ctx, const attn_args &a, int n_splits, still_err *err) {
    return a.window > 0 ? launch_fwd_w<D, MT, OUT, true>(ctx, a, n_splits, err)
                        : launch_fwd_w<D, MT, OUT, false>(ctx, a, n_splits, err);
}

template <int D, int MT>
int run(stc_ctx *ctx, attn_args &a, const plan &p, bool bf16_out, still_err *err) {
    if (p.n_splits == 1)
        return bf16_out ? launch_fwd<D, MT, OUT_BF16>(ctx, a, 1, err) : launch_fwd<D, MT, OUT_F32>(ctx, a, 1, err);
    int rc = launch_fwd<D, MT, OUT_PART>(ctx, a, p.n_splits, err);
    if (rc) return rc;
    const dim3 grid((unsigned)a.rows, (unsigned)a.Hk);
    if (bf16_out) attn_combine_kernel<OUT_BF16><<<grid, D, 0, ctx->stream>>>(a, D);
    else attn_combine_kernel<OUT_F32><<<grid, D, 0, ctx->stream>>>(a, D);
    STC_LAUNCHED(err, "attn_combine_kernel");
    return STILL_OK;
}

/* Grows the split-K workspace to at least `bytes`. */
int reserve_ws(stc_ctx *ctx, size_t bytes, still_err *err) {
    if (ctx->attn_ws_bytes >= bytes) return STILL_OK;
    if (ctx->attn_ws) {
        stc_free(ctx, ctx->attn_ws);   /* waits for kernels that may still read it */
        ctx->attn_ws = NULL;
        ctx->attn_ws_bytes = 0;
    }
    void *p = NULL;
    int rc = stc_malloc(ctx, bytes, "the attention split-K workspace", &p, err);
    if (rc) return rc;
    ctx->attn_ws = (float *)p;
    ctx->attn_ws_bytes = bytes;
    return STILL_OK;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

}   // namespace

static int attn_softmax(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache, int T,
                        int p0, int H, int Hk, int D, int window, float *out_f32, stc_bf16 *out_bf16, int n_splits,
                        still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || p0 < 0 || H <= 0 || Hk <= 0 || H % Hk != 0 || n_splits < 0 || window < 0)
        return stc_fail(err, STILL_E_ARG, "stc_attn_softmax: T %d, p0 %d, %d heads over %d KV heads, %d splits, window %d",
                        T, p0, H, Hk, n_splits, window);
    if (D != 64 && D != 128)
        return stc_fail(err, STILL_E_UNSUPPORTED, "stc_attn_softmax: head dim %d (64 or 128 supported)", D);
    if ((int64_t)T * (H / Hk) > (1 << 30) || (int64_t)p0 + T > (1 << 30))
        return stc_fail(err, STILL_E_ARG, "stc_attn_softmax: T %d, p0 %d too large", T, p0);
    if (!q || !k_cache || !v_cache || (!out_f32) == (!out_bf16))
        return stc_fail(err, STILL_E_ARG, "stc_attn_softmax: NULL input, or not exactly one output");
    const void *out = out_f32 ? (const void *)out_f32 : (const void *)out_bf16;
    if (!aligned16(q) || !aligned16(k_cache) || !aligned16(v_cache) || !aligned16(out))
        return stc_fail(err, STILL_E_ARG, "stc_attn_softmax: pointers must be 16-byte aligned");

    /* a window: the keys before the first query's window are never needed, so
     * the kernel sees the cache from there (positions relative to that row) */
    if (window > 0 && p0 - window + 1 > 0) {
        const size_t skip = (size_t)(p0 - window + 1) * Hk * D;
        k_cache += skip, v_cache += skip;
        p0 = window - 1;
    }
    const plan p = make_plan(T, p0, H, Hk, D, ctx->sm_count, n_splits);
    attn_args a;
    a.q = (const bf16 *)q;
    a.k = (const bf16 *)k_cache;
    a.v = (const bf16 *)v_cache;
    a.out = out_f32 ? (void *)out_f32 : (void *)out_bf16;
    a.part_o = NULL;
    a.part_ml = NULL;
    a.T = T, a.p0 = p0, a.H = H, a.Hk = Hk, a.G = p.G, a.rows = p.rows;
    a.n_row_tiles = p.n_row_tiles, a.tiles_per_split = p.tiles_per_split, a.block_m = p.block_m;
    a.window = window;
    a.scale_log2 = attn_logit_scale_log2(D);
    if (p.n_splits > 1) {
        const size_t n_rows = (size_t)p.n_splits * Hk * p.rows;
        const size_t bytes = n_rows * D * sizeof(float) + n_rows * sizeof(float2);
        int rc = reserve_ws(ctx, bytes, err);
        if (rc) return rc;
        a.part_o = ctx->attn_ws;
        a.part_ml = (float2 *)(ctx->attn_ws + n_rows * D);
    }
    const bool b = out_bf16 != NULL;
    if (D == 64) return p.mt == 2 ? run<64, 2>(ctx, a, p, b, err) : run<64, 1>(ctx, a, p, b, err);
    return run<128, 1>(ctx, a, p, b, err);
}

int stc_attn_softmax_splits(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache,
                            int T, int p0, int H, int Hk, int D, float *out_f32, stc_bf16 *out_bf16, int n_splits,
                            still_err *err) {
    return attn_softmax(ctx, q, k_cache, v_cache, T, p0, H, Hk, D, 0, out_f32, out_bf16, n_splits, err);
}

int stc_attn_softmax(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache, int T, int p0,
                     int H, int Hk, int D, float *out_f32, stc_bf16 *out_bf16, still_err *err) {
    return attn_softmax(ctx, q, k_cache, v_cache, T, p0, H, Hk, D, 0, out_f32, out_bf16, 0, err);
}

int stc_attn_softmax_window(stc_ctx *ctx, const stc_bf16 *q, const stc_bf16 *k_cache, const stc_bf16 *v_cache, int T,
                            int p0, int H, int Hk, int D, int window, float *out_f32, stc_bf16 *out_bf16, int n_splits,
                            still_err *err) {
    if (window <= 0) return stc_fail(err, STILL_E_ARG, "stc_attn_softmax_window: window %d (at least 1)", window);
    return attn_softmax(ctx, q, k_cache, v_cache, T, p0, H, Hk, D, window, out_f32, out_bf16, n_splits, err);
}
