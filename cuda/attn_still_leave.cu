/* still on the GPU, steps 3, 4 and 7: the chunks that leave Local during a
 * call (src/attn_still.c's leave_chunk, chunk-parallel), the prefix sums of
 * their folds, and the end of the call.
 *
 * leave: block (leaving chunk k of the call, query head h), 256 threads.
 *   1. Selection for selection head hs (h, or h / G with per_kv_head): the
 *      chunk's C scores (saliency / keynorm / qk: the scores of the query
 *      heads of hs summed in head order, qk divided by C; random: the hash
 *      of (seed, hs, position); NaN -> -inf); token i is picked when fewer
 *      than n tokens rank before it (higher score, or equal score and lower
 *      position), n = sel_count(c+1) - sel_count(c); position routing picks
 *      the evenly spaced offsets. The block of the first query head of hs
 *      appends the picks in position order at Sel slots sel_count(c) .. (half
 *      keys and values, and their positions). Every block computes the same
 *      picks, so the fold needs no other block.
 *   2. Fold (linear on): Φ = φk(k_j) for the chunk's tokens with head h's
 *      k-map (zero rows for the picked ones), then ΔS = Φᵀ V [P][D] and
 *      Δz = Σ rows of Φ, written to prefix slot k of the workspace.
 * scan: slot k ← S, z at the start of the call + slots 0 .. k (element-wise,
 *   in slot order, which is chunk order: the same fp32 additions as one
 *   fold at a time).
 * finish (kFinishBlocks blocks): the call's last positions into the ring
 *   (keys, values, routing scores), S, z ← the last slot, then the last
 *   block to end advances n_seen by T (finish_copy, finish_arrive). */
#include "attn_still_fmap.cuh"
#include "mma_ptx.cuh"

namespace stillk {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

/* Shared memory of leave_kernel (bytes): vals [C] double, picked [C] and
 * slot [C] int, then floats: region A (k-map W [D][D+1], later V [C][D]),
 * Φ [C][P+1], u [D], x̃ scratch [warps][D]. */
__host__ __device__ inline size_t leave_region_a(int D, int C) {
    return (size_t)(D * (D + 1) > C * D ? D * (D + 1) : C * D);
}

template <int D>
__global__ void __launch_bounds__(kThreads) leave_kernel(const args a) {
    constexpr int P = 2 * D;
    const int C = a.C;
    extern __shared__ __align__(16) unsigned char smraw[];
    double *vals = (double *)smraw;
    int *picked = (int *)(vals + C);
    int *slot = picked + C;
    float *regA = (float *)(slot + C);
    float *Phi = regA + leave_region_a(D, C);
    float *us = Phi + (size_t)C * (P + 1);
    float *xt = us + D;

    const int p0 = *a.n_seen;
    const call_geom g = make_geom(p0, a.T, C);
    const int k = blockIdx.x;
    if (k >= g.n_leaves) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int h = blockIdx.y, hk = h / a.G, hs = a.per_kv ? hk : h;
    const bool rep = !a.per_kv || h % a.G == 0;   /* this block appends hs's picks */
    const int cl = g.leave_first + k, pos0 = cl * C;
    const int base = sel_count(cl, a.lam, a.cap), n = sel_count(cl + 1, a.lam, a.cap) - base;

    /* 1. selection */
    for (int i = tid; i < C; i += kThreads) picked[i] = 0;
    __syncthreads();
    if (n > 0) {
        if (a.routing == R_POSITION) {
            for (int i = tid; i < n; i += kThreads) picked[position_offset(i, n, C)] = 1;
        } else {
            for (int i = tid; i < C; i += kThreads) {
                const int pos = pos0 + i;
                double v = 0.0;
                if (a.routing == R_RANDOM) {
                    v = route_random(a.seed, hs, pos);
                } else {
                    const int h0 = a.per_kv ? hs * a.G : hs, nh = a.per_kv ? a.G : 1;
                    for (int hh = h0; hh < h0 + nh; hh++) {
                        const double x = *score_ptr(a, p0, hh, pos);
                        v += a.routing == R_QK ? x / C : x;
                    }
                }
                vals[i] = v != v ? -INFINITY : v;
            }
            __syncthreads();
            for (int i = tid; i < C; i += kThreads) {
                int rank = 0;
                for (int j = 0; j < C; j++) rank += ranks_before(vals[j], j, vals[i], i) ? 1 : 0;
                picked[i] = rank < n;
            }
        }
        __syncthreads();
        if (rep) {   /* uniform over the block */
            for (int i = tid; i < C; i += kThreads) {
                int before = 0;
                for (int j = 0; j < i; j++) before += picked[j];
                slot[i] = base + before;
                if (picked[i]) a.sel_pos[(size_t)hs * a.sel_rows + base + before] = pos0 + i;
            }
            __syncthreads();
            constexpr int CH = D / 8;
            for (int e = tid; e < C * CH; e += kThreads) {
                const int i = e / CH, c8 = (e % CH) * 8;
                if (!picked[i]) continue;
                const size_t dst = ((size_t)hs * a.sel_rows + slot[i]) * D + c8;
                *reinterpret_cast<uint4 *>(a.sel_k + dst) = stc_ptx::load8_f32_as_f16(kv_row(a, p0, pos0 + i, hk, 0) + c8);
                *reinterpret_cast<uint4 *>(a.sel_v + dst) = stc_ptx::load8_f32_as_f16(kv_row(a, p0, pos0 + i, hk, 1) + c8);
            }
        }
    }
    if (!a.linear) return;

    /* 2. fold: Φ of the chunk's tokens (k-map of head h), zero rows for the picked */
    fmap_load<D>(a, 1, h, regA, us);
    __syncthreads();
    const float uu = npmap_uu<D>(us, lane);
    for (int i = warp; i < C; i += kWarps) {
        float *ph = Phi + (size_t)i * (P + 1);
        if (picked[i]) {   /* uniform over the warp */
            for (int p = lane; p < P; p += 32) ph[p] = 0.0f;
            continue;
        }
        npmap_warp<D>(kv_row(a, p0, pos0 + i, hk, 0), us, regA, uu, xt + warp * D, ph, lane, a.lolcats);
    }
    __syncthreads();   /* Φ complete; W no longer read */
    for (int e = tid; e < C * D; e += kThreads) regA[e] = kv_row(a, p0, pos0 + e / D, hk, 1)[e % D];
    __syncthreads();

    /* ΔS = Φᵀ V: thread (pg, dg) owns feature rows pb + pg + 16 ii and dims db + dg + 16 jj */
    float *dS = a.slots + (size_t)k * a.slot_floats;
    const int pg = tid >> 4, dg = tid & 15;
    for (int pb = 0; pb < P; pb += 128)
        for (int db = 0; db < D; db += 64) {
            float acc[8][4];
#pragma unroll
            for (int ii = 0; ii < 8; ii++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++) acc[ii][jj] = 0.0f;
            for (int i = 0; i < C; i++) {
                const float *ph = Phi + (size_t)i * (P + 1) + pb + pg;
                const float *vr = regA + (size_t)i * D + db + dg;
                float av[8], bv[4];
#pragma unroll
                for (int ii = 0; ii < 8; ii++) av[ii] = ph[16 * ii];
#pragma unroll
                for (int jj = 0; jj < 4; jj++) bv[jj] = vr[16 * jj];
#pragma unroll
                for (int ii = 0; ii < 8; ii++)
#pragma unroll
                    for (int jj = 0; jj < 4; jj++) acc[ii][jj] = fmaf(av[ii], bv[jj], acc[ii][jj]);
            }
#pragma unroll
            for (int ii = 0; ii < 8; ii++)
#pragma unroll
                for (int jj = 0; jj < 4; jj++)
                    dS[((size_t)h * P + pb + pg + 16 * ii) * D + db + dg + 16 * jj] = acc[ii][jj];
        }
    for (int p = tid; p < P; p += kThreads) {
        float s = 0.0f;
        for (int i = 0; i < C; i++) s += Phi[(size_t)i * (P + 1) + p];
        dS[(size_t)a.H * P * D + (size_t)h * P + p] = s;
    }
}

__global__ void scan_kernel(const args a) {
    const int p0 = *a.n_seen;
    const call_geom g = make_geom(p0, a.T, a.C);
    if (g.n_leaves == 0) return;
    constexpr int B = 8;   /* a batch of slots' loads issued before their sums (the same additions in order) */
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < a.slot_floats;
         e += (size_t)gridDim.x * blockDim.x) {
        float acc = a.lin[e];
        int k = 0;
        for (; k + B <= g.n_leaves; k += B) {
            float v[B];
#pragma unroll
            for (int u = 0; u < B; u++) v[u] = a.slots[(size_t)(k + u) * a.slot_floats + e];
#pragma unroll
            for (int u = 0; u < B; u++) {
                acc += v[u];
                a.slots[(size_t)(k + u) * a.slot_floats + e] = acc;
            }
        }
        for (; k < g.n_leaves; k++) {
            float *s = a.slots + (size_t)k * a.slot_floats + e;
            acc += *s;
            *s = acc;
        }
    }
}

constexpr int kFinishThreads = 512;

constexpr int kFinishBlocks = 32;

__global__ void __launch_bounds__(kFinishThreads) finish_kernel(const args a) {
    stc_pdl_trigger();   /* a following matrix-vector kernel may load its weights meanwhile (cuda/gemv.cu) */
    const int p0 = *a.n_seen;
    finish_copy(a, p0, blockIdx.x * kFinishThreads + threadIdx.x, kFinishBlocks * kFinishThreads);
    finish_arrive(a, p0);
}

}   // namespace

size_t smem_leave(int D, int C) {
    const size_t P = 2 * (size_t)D;
    return (size_t)C * (sizeof(double) + 2 * sizeof(int)) +
           (leave_region_a(D, C) + (size_t)C * (P + 1) + D + (size_t)kWarps * D) * sizeof(float);
}

int prepare_leave(int D, size_t limit, still_err *err) {
    /* the limit for the largest chunk the device allows: states with smaller
     * chunks of the same head dim launch with less (the caller has checked
     * that this state's chunk fits) */
    const size_t most = smem_leave(D, kMaxChunk);
    const int bytes = (int)(most < limit ? most : limit);
    if (D == 64) STC_CUDA(err, cudaFuncSetAttribute(leave_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else STC_CUDA(err, cudaFuncSetAttribute(leave_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return STILL_OK;
}

int launch_leave(stc_ctx *ctx, const args &a, still_err *err) {
    const dim3 grid((unsigned)max_leaves(a.T, a.C), (unsigned)a.H);
    const size_t bytes = smem_leave(a.D, a.C);
    if (a.D == 64) leave_kernel<64><<<grid, kThreads, bytes, ctx->stream>>>(a);
    else leave_kernel<128><<<grid, kThreads, bytes, ctx->stream>>>(a);
    STC_LAUNCHED(err, "leave_kernel");
    return STILL_OK;
}

int launch_scan(stc_ctx *ctx, const args &a, still_err *err) {
    scan_kernel<<<stc_blocks((int64_t)a.slot_floats, 256), 256, 0, ctx->stream>>>(a);
    STC_LAUNCHED(err, "scan_kernel");
    return STILL_OK;
}

int launch_finish(stc_ctx *ctx, const args &a, still_err *err) {
    finish_kernel<<<kFinishBlocks, kFinishThreads, 0, ctx->stream>>>(a);
    STC_LAUNCHED(err, "finish_kernel");
    return STILL_OK;
}

}   // namespace stillk
