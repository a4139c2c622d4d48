/* still on the GPU, global selection (src/kinds/still/attn_still.c's leave_global): Sel
 * keeps the best cap tokens of everything that has left Local and evicts its
 * worst into the linear state. It replaces step 3 (leave) of a call; the
 * rest of the call (scan, attention, linear, finish) is unchanged.
 *
 * A chunk's selection depends on the Sel the chunk before it left, so the
 * leaving chunks of a call are not independent as they are with λ per
 * chunk: still_forward cuts a call at chunk boundaries into segments that
 * each start at most one chunk's leave, at their first token (decode steps
 * are such segments already). Every kernel here reads the position from the
 * device counter and returns unless the call's first position starts a
 * chunk c >= 2, so a decode step can be replayed in a CUDA graph.
 *
 * The Sel count after k chunks have left is min(k·C, cap), sel_count with
 * λ = C: free slots fill first, so the attention kernels' prefix rule holds.
 *
 * select: block (selection head hs), kGlobalThreads threads. Besides Sel's
 *   half keys and values and their positions the state keeps each slot's
 *   routing score and the order of the slots, best first (sel_order). The
 *   chunk's C scores are ranked among themselves; each entry's rank in the
 *   union of Sel and the chunk is its rank in its own list plus the entries
 *   of the other list that rank before it (a binary search: both lists are
 *   sorted). Entries ranked >= cap leave Sel: evicted ones are copied (as
 *   stored: half, or with --sel-cache q8 bytes and their scales) to ev_*, then the chunk's kept tokens go best first into
 *   the free slots, then into the evicted ones' slots; the merged order is
 *   written back. Ranking: higher score first, ties to the lower position.
 * fold: block (query head h), 256 threads. Φ = φk(k) with head h's k-map for
 *   the rows: the evicted entries (as stored), then the chunk's tokens that
 *   were not kept (the ring's fp32); ΔS = Φᵀ V and Δz = Σ Φ into prefix
 *   slot 0 (fp32 CUDA cores; at most 2C rows a chunk). */
#include "kinds/still/attn_still_fmap.cuh"

namespace stillk {
namespace {

constexpr int kGlobalThreads = 1024;
constexpr int kFoldThreads = 256, kFoldWarps = kFoldThreads / 32, kFoldRows = 32;

__device__ __forceinline__ bool ranks_before(double a, int pa, double b, int pb) {
    return a > b || (a == b && pa < pb);
}

/* The chunk that leaves at this call's first position, or -1. */
__device__ __forceinline__ int leaving_chunk(const args &a, int p0) {
    return p0 % a.C == 0 && p0 / a.C >= 2 ? p0 / a.C - 2 : -1;
}

__global__ void __launch_bounds__(kGlobalThreads) global_select_kernel(const args a) {
    const int p0 = *a.n_seen, cl = leaving_chunk(a, p0);
    if (cl < 0) return;
    const int C = a.C, cap = a.cap, hs = blockIdx.x, tid = threadIdx.x;
    const int hk = a.per_kv ? hs : hs / a.G, pos0 = cl * C;
    const int nb = smin(cl * C, cap);   /* Sel entries before this leave (sel_count with λ = C) */
    extern __shared__ __align__(16) unsigned char smraw[];
    double *osc = (double *)smraw;      /* [cap] Sel's scores, best first */
    double *vals = osc + cap;           /* [C] the chunk's scores by offset */
    double *nsc = vals + C;             /* [C] ... best first */
    int *opos = (int *)(nsc + C);       /* [cap] Sel's positions, best first */
    int *oslot = opos + cap;            /* [cap] Sel's slots, best first */
    int *noff = oslot + cap;            /* [C] the chunk's offsets, best first */
    int *nrank = noff + C;              /* [C] their ranks in the union */
    double *raw = (double *)(nrank + C + (C & 1));   /* [2C] the scores of the chunk and the next (sel_span) */
    const size_t row0 = (size_t)hs * a.sel_rows;

    /* the chunk's scores (as leave_kernel's; with sel_span, the next chunk's too) and Sel's list */
    const int n_raw = a.sel_span > 0 ? 2 * C : C;
    if (tid < n_raw) {
        raw[tid] = still_rank_value(route_value(a, p0, hs, pos0 + tid));
    }
    __syncthreads();
    if (tid < C) {   /* sel_span R: the best of offsets tid - R .. tid + R in the ring (src/kinds/still/attn_still.c: leave_score) */
        const int lo = still_span_lo(tid, a.sel_span), hi = still_span_hi(tid, a.sel_span, n_raw);
        double best = -INFINITY;
        for (int j = lo; j <= hi; j++) best = raw[j] > best ? raw[j] : best;
        vals[tid] = best;
    }
    for (int q = tid; q < nb; q += kGlobalThreads) {
        const int slot = a.sel_order[row0 + q];
        oslot[q] = slot, osc[q] = a.sel_sc[row0 + slot], opos[q] = a.sel_pos[row0 + slot];
    }
    __syncthreads();
    if (tid < C) {   /* rank within the chunk */
        int r = 0;
        for (int j = 0; j < C; j++) r += ranks_before(vals[j], pos0 + j, vals[tid], pos0 + tid);
        nsc[r] = vals[tid], noff[r] = tid;
    }
    __syncthreads();
    /* ranks in the union: the chunk's entries against Sel's list */
    int kept = 0;
    if (tid < C) {
        const double v = nsc[tid];
        const int pos = pos0 + noff[tid];
        int lo = 0, hi = nb;   /* Sel entries ranking before it: a prefix of Sel's list */
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (ranks_before(osc[mid], opos[mid], v, pos)) lo = mid + 1;
            else hi = mid;
        }
        nrank[tid] = tid + lo;
        kept = tid + lo < cap;
    }
    const int n_new = __syncthreads_count(kept);   /* the chunk's kept tokens: a prefix of its list */
    const int total = smin(cap, nb + C), kept_old = total - n_new, n_ev = nb - kept_old;
    const int fresh = smin(C, cap - nb);           /* free slots nb .. nb + fresh - 1 */
    /* evicted entries (Sel's list from kept_old on) copied out as stored, before their slots are reused */
    if (a.sel_q8) {   /* 16 bytes = 16 elements a piece, and the rows' scales */
        for (int e = tid; e < n_ev * (a.D / 16); e += kGlobalThreads) {
            const int r = e / (a.D / 16), c16 = 16 * (e % (a.D / 16));
            const size_t src = (row0 + oslot[kept_old + r]) * a.D + c16, dst = ((size_t)hs * C + r) * a.D + c16;
            *reinterpret_cast<uint4 *>(a.ev_k8 + dst) = *reinterpret_cast<const uint4 *>(a.sel_k8 + src);
            *reinterpret_cast<uint4 *>(a.ev_v8 + dst) = *reinterpret_cast<const uint4 *>(a.sel_v8 + src);
        }
        for (int r = tid; r < n_ev; r += kGlobalThreads) {
            const size_t src = row0 + oslot[kept_old + r], dst = (size_t)hs * C + r;
            a.ev_ks[dst] = a.sel_ks[src], a.ev_vs[dst] = a.sel_vs[src];
        }
    } else {
        for (int e = tid; e < n_ev * (a.D / 8); e += kGlobalThreads) {
            const int r = e / (a.D / 8), c8 = 8 * (e % (a.D / 8));
            const size_t src = (row0 + oslot[kept_old + r]) * a.D + c8, dst = ((size_t)hs * C + r) * a.D + c8;
            *reinterpret_cast<uint4 *>(a.ev_k + dst) = *reinterpret_cast<const uint4 *>(a.sel_k + src);
            *reinterpret_cast<uint4 *>(a.ev_v + dst) = *reinterpret_cast<const uint4 *>(a.sel_v + src);
        }
    }
    if (tid == 0) a.ev_n[hs] = n_ev;
    if (tid < C) a.g_picked[(size_t)hs * C + noff[tid]] = tid < n_new;
    /* the merged order: Sel's kept entries at their union ranks */
    for (int q = tid; q < kept_old; q += kGlobalThreads) {
        const double v = osc[q];
        const int pos = opos[q];
        int lo = 0, hi = C;   /* chunk tokens ranking before it */
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (ranks_before(nsc[mid], pos0 + noff[mid], v, pos)) lo = mid + 1;
            else hi = mid;
        }
        a.sel_order[row0 + q + lo] = oslot[q];
    }
    __syncthreads();   /* the evicted entries are copied */
    /* the chunk's kept tokens into their slots, a warp a token (as stored: half, or 8 bits and scales) */
    for (int r = tid / 32; r < n_new; r += kGlobalThreads / 32) {
        const int slot = r < fresh ? nb + r : oslot[kept_old + (r - fresh)];
        const int pos = pos0 + noff[r];
        sel_store_warp(a, p0, hs, hk, slot, pos, tid % 32);
        if (tid % 32 == 0) {
            a.sel_pos[row0 + slot] = pos, a.sel_sc[row0 + slot] = nsc[r];
            a.sel_order[row0 + nrank[r]] = slot;
        }
    }
}

template <int D>
__global__ void __launch_bounds__(kFoldThreads) global_fold_kernel(const args a) {
    const int p0 = *a.n_seen, cl = leaving_chunk(a, p0);
    if (cl < 0) return;
    constexpr int P = 2 * D, NA = P * D / kFoldThreads;
    const int C = a.C, h = blockIdx.x, hk = h / a.G, hs = a.per_kv ? hk : h, pos0 = cl * C;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    extern __shared__ __align__(16) unsigned char smraw[];
    float *Ws = (float *)smraw;                 /* [D][D + 1] */
    float *us = Ws + D * (D + 1);               /* [D] */
    float *xt = us + D;                         /* [warps][D] */
    float *xk = xt + kFoldWarps * D;            /* [rows][D] keys of a tile */
    float *xv = xk + kFoldRows * D;             /* [rows][D] values */
    float *ph = xv + kFoldRows * D;             /* [rows][P] features */
    int *rowi = (int *)(ph + kFoldRows * P);    /* [2C] the rows: -1 - e (evicted e) or the chunk offset */
    fmap_load<D>(a, 1, h, Ws, us);
    const int ne = a.ev_n[hs];
    if (tid == 0) {
        int n = 0;
        for (int e = 0; e < ne; e++) rowi[n++] = -1 - e;
        for (int i = 0; i < C; i++)
            if (!a.g_picked[(size_t)hs * C + i]) rowi[n++] = i;
        rowi[2 * C] = n;
    }
    __syncthreads();
    const int n_rows = rowi[2 * C];
    const float uu = npmap_uu<D>(us, lane);
    float acc[NA], zacc = 0.0f;
#pragma unroll
    for (int j = 0; j < NA; j++) acc[j] = 0.0f;
    for (int r0 = 0; r0 < n_rows; r0 += kFoldRows) {
        const int nr = smin(kFoldRows, n_rows - r0);
        for (int e = tid; e < nr * D; e += kFoldThreads) {
            const int r = e / D, x = e % D, ri = rowi[r0 + r];
            if (ri < 0) {
                const size_t row = (size_t)hs * C + (-1 - ri), at = row * D + x;
                if (a.sel_q8)   /* as src/kinds/still/attn_still.c's sel_get: scale × byte */
                    xk[r * D + x] = a.ev_ks[row] * (float)a.ev_k8[at], xv[r * D + x] = a.ev_vs[row] * (float)a.ev_v8[at];
                else
                    xk[r * D + x] = __half2float(a.ev_k[at]), xv[r * D + x] = __half2float(a.ev_v[at]);
            } else {
                xk[r * D + x] = kv_row(a, p0, pos0 + ri, hk, 0)[x], xv[r * D + x] = kv_row(a, p0, pos0 + ri, hk, 1)[x];
            }
        }
        __syncthreads();
        for (int r = warp; r < nr; r += kFoldWarps) npmap_warp<D>(xk + r * D, us, Ws, uu, xt + warp * D, ph + r * P, lane);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NA; j++) {
            const int e = tid + j * kFoldThreads, p = e / D, x = e % D;
            float s = acc[j];
            for (int r = 0; r < nr; r++) s = fmaf(ph[r * P + p], xv[r * D + x], s);
            acc[j] = s;
        }
        if (tid < P)
            for (int r = 0; r < nr; r++) zacc += ph[r * P + tid];
        __syncthreads();   /* the tile is read */
    }
    float *dS = a.slots;   /* prefix slot 0: the call's only leave */
#pragma unroll
    for (int j = 0; j < NA; j++) {
        const int e = tid + j * kFoldThreads;
        dS[(size_t)h * P * D + e] = acc[j];
    }
    if (tid < P) dS[(size_t)a.H * P * D + (size_t)h * P + tid] = zacc;
}

size_t smem_select(int C, int cap) { return (size_t)cap * 16 + (size_t)C * 24 + 16 + (size_t)C * 16 + 8; }
size_t smem_fold(int D, int C) {
    return ((size_t)D * (D + 1) + D + kFoldWarps * D + kFoldRows * (2 * D + 2 * D)) * 4 + (2 * (size_t)C + 1) * 4;
}

}   // namespace

size_t smem_global(int D, int C, int cap) {
    const size_t a = smem_select(C, cap), b = smem_fold(D, C);
    return a > b ? a : b;
}

int prepare_global(int D, int C, int cap, still_err *err) {
    /* the attribute is the kernel's, not the state's: raise it only, so that a
     * layer with a smaller cap (--layer-budgets) does not lower another's */
    cudaFuncAttributes at;
    STC_CUDA(err, cudaFuncGetAttributes(&at, global_select_kernel));
    if ((size_t)at.maxDynamicSharedSizeBytes < smem_select(C, cap))
        STC_CUDA(err, cudaFuncSetAttribute(global_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_select(C, cap)));
    if (D == 64)
        STC_CUDA(err, cudaFuncSetAttribute(global_fold_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_fold(64, C)));
    else
        STC_CUDA(err, cudaFuncSetAttribute(global_fold_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem_fold(128, C)));
    return STILL_OK;
}

int launch_global_leave(stc_ctx *ctx, const args &a, still_err *err) {
    global_select_kernel<<<a.Hs, kGlobalThreads, smem_select(a.C, a.cap), ctx->stream>>>(a);
    STC_LAUNCHED(err, "global_select_kernel");
    if (!a.linear) return STILL_OK;
    if (a.D == 64) global_fold_kernel<64><<<a.H, kFoldThreads, smem_fold(64, a.C), ctx->stream>>>(a);
    else global_fold_kernel<128><<<a.H, kFoldThreads, smem_fold(128, a.C), ctx->stream>>>(a);
    STC_LAUNCHED(err, "global_fold_kernel");
    return STILL_OK;
}

}   // namespace stillk
