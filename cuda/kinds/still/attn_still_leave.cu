/* still on the GPU, steps 3, 4 and 7: the chunks that leave Local during a
 * call (src/kinds/still/attn_still.c's leave_chunk, chunk-parallel), the prefix sums of
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
 *      keys and values, or 8 bits and a scale per row with --sel-cache q8,
 *      and their positions). Every block computes the same
 *      picks, so the fold needs no other block.
 *   2. Fold (linear on): Φ = φk(k_j) for the chunk's tokens with head h's
 *      k-map (zero rows for the picked ones), then ΔS = Φᵀ V [P][D] and
 *      Δz = Σ rows of Φ, written to prefix slot k of the workspace; on the
 *      tensor cores in bf16x3 (attn_still_mma.cuh), 64 tokens at a time.
 * scan: slot k ← S, z at the start of the call + slots 0 .. k (element-wise,
 *   in slot order, which is chunk order: the same fp32 additions as one
 *   fold at a time).
 * finish (kFinishBlocks blocks): the call's last positions into the ring
 *   (keys, values, routing scores), S, z ← the last slot, then the last
 *   block to end advances n_seen by T (finish_copy, finish_arrive). */
#include "kinds/still/attn_still_mma.cuh"

namespace stillk {
namespace {

using namespace tc;

/* The k-map's NP-Map on the tensor cores (attn_still_mma.cuh) for head dim
 * 64; for 128 its three W tiles would not fit next to the others, so φk is
 * npmap_warp's (fp32 CUDA cores, one key per warp at a time). */
__host__ __device__ constexpr bool leave_tc_map(int D) { return D == 64; }

/* Shared memory of leave_kernel (bytes): vals [C] double, picked [C] and
 * slot [C] int; the k-map W (three bf16 tiles [D][D], or fp32 [D][D + 1]);
 * a tile of values (hi/lo [64][D]), first the fp32 keys as they arrive;
 * x̃ / z (or the warps' x̃ scratch [8][D] floats); Φ (hi/lo [64][2D]),
 * first the fp32 values as they arrive; then floats u [D], ‖x‖ [64] and
 * [8][2D]: the warps' column sums of Φ (the fp32 path's φ rows before). */
__host__ __device__ constexpr int leave_w_bytes(int D) { return leave_tc_map(D) ? h3_bytes(D, D) : D * (D + 1) * 4; }
__host__ __device__ constexpr int leave_xz_bytes(int D) { return leave_tc_map(D) ? xz_bytes(D) : kWarps * D * 4; }
__host__ __device__ constexpr int leave_tiles_bytes(int D) {
    return leave_w_bytes(D) + hl_bytes(kTile, D) + leave_xz_bytes(D) + hl_bytes(kTile, 2 * D) + (D + kTile + kWarps * 2 * D) * 4;
}
__host__ __device__ inline size_t leave_head_bytes(int C) { return (size_t)((C * 16 + 127) / 128 * 128); }
/* Head dim 64: the tiles from Wt on start at a multiple of 1,024 bytes (z's product on wgmma reads W and x̃
 * with the 128-byte swizzle), up to 1,024 bytes further into the allocation. */
__host__ __device__ constexpr int leave_align(int D) { return leave_tc_map(D) ? 1024 : 0; }

template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) leave_kernel(const args a) {   /* (64: two blocks an SM) */
    constexpr int P = 2 * D, CH = D / 8, CHP = P / 8;
    const int C = a.C;
    extern __shared__ __align__(128) unsigned char smraw[];
    double *vals = (double *)smraw;
    int *picked = (int *)(vals + C);
    int *slot = picked + C;
    unsigned char *Wt = smraw + leave_head_bytes(C);
    if constexpr (leave_align(D) > 0) Wt += (0u - smem_addr(Wt)) & (uint32_t)(leave_align(D) - 1);
    static_assert(!leave_tc_map(D) || (leave_w_bytes(D) % 1024 == 0 && hl_bytes(kTile, D) % 1024 == 0),
                  "x̃'s tiles 1024-byte aligned too");
    unsigned char *Vh = Wt + leave_w_bytes(D), *Vl = Vh + hl_bytes(kTile, D) / 2;
    unsigned char *XZ = Vh + hl_bytes(kTile, D);
    unsigned char *Ph = XZ + leave_xz_bytes(D), *Pl = Ph + hl_bytes(kTile, P) / 2;
    float *us = reinterpret_cast<float *>(Ph + hl_bytes(kTile, P));
    float *nx = us + D, *dzw = nx + kTile;

    const int p0 = *a.n_seen;
    const call_geom g = make_geom_fd(p0, a.T, C, a.fd_c);
    const int k = blockIdx.x;
    if (k >= g.n_leaves) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int h = blockIdx.y, hk = h / a.G, hs = a.per_kv ? hk : h;
    const bool rep = !a.per_kv || h % a.G == 0;   /* this block appends hs's picks */
    const int cl = g.leave_first + k, pos0 = cl * C;
    const int base = sel_count(cl, a.lam, a.cap), n = sel_count(cl + 1, a.lam, a.cap) - base;

    /* the first 64 tokens' keys and values on their way (cp.async, fp32: keys
     * where the value tiles go, values where Φ goes) while the selection runs */
    auto stage = [&](int i0) {
        if (pos0 + i0 >= p0) {   /* the call's rows (a prefill's every leaving chunk): a stride apart */
            const int n_rows = C - i0;
            const size_t at = (size_t)(pos0 + i0 - p0) * a.ldkv + (size_t)hk * D;
            copy_rows_f32<D>(smem_addr(Vh), a.k + at, a.ldkv, n_rows);
            copy_rows_f32<D>(smem_addr(Ph), a.v + at, a.ldkv, n_rows);
            cp_async_commit();
            return;
        }
        for (int e = tid; e < kTile * D / 4; e += kThreads) {
            const int r = e / (D / 4), c4 = e % (D / 4);
            const bool ok = i0 + r < C;
            const int pos = ok ? pos0 + i0 + r : pos0;
            cp_async_16(smem_addr(Vh) + e * 16, kv_row(a, p0, pos, hk, 0) + 4 * c4, ok);
            cp_async_16(smem_addr(Ph) + e * 16, kv_row(a, p0, pos, hk, 1) + 4 * c4, ok);
        }
        cp_async_commit();
    };
    /* the k-map's image (prefill), on its way with the first keys and values while the selection runs */
    const bool img = leave_tc_map(D) && a.wimg != nullptr && a.linear;
    if constexpr (leave_tc_map(D))
        if (img) fmap_copy_3<D>(a.wimg + ((size_t)a.H + h) * wimage_bytes(D), Wt, us);
    if (a.linear) stage(0);   /* (commits the image's copies too) */
    /* token tid's selection value (C <= kThreads): its loads go out right after the copies above, before
     * anything waits (they take the longest) */
    static_assert(kMaxChunk <= kThreads, "a token a thread");
    const bool by_value = n > 0 && a.routing != R_POSITION;
    const double my_val = by_value && tid < C ? route_value(a, p0, hs, pos0 + tid) : 0.0;

    /* 1. selection */
    for (int i = tid; i < C; i += kThreads) picked[i] = 0;
    if (by_value && tid < C) vals[tid] = still_rank_value(my_val);
    __syncthreads();
    if (n > 0) {
        if (a.routing == R_POSITION) {
            for (int i = tid; i < n; i += kThreads) picked[position_offset(i, n, C)] = 1;
        } else {
            /* token i's rank: the tokens that rank before it, counted by a group of GS lanes
             * (GS·C <= kThreads), each over every GS-th token, then summed by shuffles */
            constexpr int kMaxGroup = 32;
            int gs = 1;
            while (gs < kMaxGroup && 2 * gs * C <= kThreads) gs *= 2;
            for (int i0 = 0; i0 < C; i0 += kThreads / gs) {   /* one pass when C <= kThreads */
                const int i = i0 + tid / gs, part = tid % gs;
                int rank = 0;
                if (i < C) {
                    const double vi = vals[i];
                    for (int j = part; j < C; j += gs) rank += ranks_before(vals[j], j, vi, i) ? 1 : 0;
                }
                for (int o = gs / 2; o > 0; o /= 2) rank += __shfl_xor_sync(0xffffffffu, rank, o);
                if (i < C && part == 0) picked[i] = rank < n;
            }
        }
        __syncthreads();
        if (rep) {   /* uniform over the block */
            /* Sel slot of token i: base + the picked tokens before it (ballots over the flags) */
            for (int i0 = 0; i0 < C; i0 += kThreads) {
                const int i = i0 + tid, w0 = i0 / 32;
                int before = 0;
                for (int w = w0; w < w0 + warp; w++) before += __popc(__ballot_sync(0xffffffffu, w * 32 + lane < C && picked[w * 32 + lane]));
                const unsigned mine = __ballot_sync(0xffffffffu, i < C && picked[i]);
                before += __popc(mine & ((1u << lane) - 1u));
                for (int j = 0; j < i0; j++) before += picked[j];   /* earlier passes (C > kThreads only) */
                if (i < C) {
                    slot[i] = base + before;
                    if (picked[i]) a.sel_pos[(size_t)hs * a.sel_rows + base + before] = pos0 + i;
                }
            }
            __syncthreads();
            /* --sel-cache q8: a warp quantizes a picked token's key and value rows (from fp32, as the CPU) */
            if (a.sel_q8) {
                for (int i = warp; i < C; i += kThreads / 32)
                    if (picked[i]) sel_store_warp(a, p0, hs, hk, slot[i], pos0 + i, lane);
            }
            /* the picked keys and values in half, two pieces a thread with their loads issued first */
            for (int e0 = tid; !a.sel_q8 && e0 < C * CH; e0 += 2 * kThreads) {
                uint4 kq[2], vq[2];
                bool ok[2];
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    const int e = e0 + b * kThreads, i = e / CH, c8 = (e % CH) * 8;
                    ok[b] = e < C * CH && picked[i];
                    if (ok[b] && a.k_f16 && pos0 + i >= p0) {   /* the call's half copies: the same values */
                        const size_t off = ((size_t)(pos0 + i - p0) * a.Hk + hk) * D + c8;
                        kq[b] = *reinterpret_cast<const uint4 *>(a.k_f16 + off);
                        vq[b] = *reinterpret_cast<const uint4 *>(a.v_f16 + off);
                    } else if (ok[b]) {
                        kq[b] = stc_ptx::load8_f32_as_f16(kv_row(a, p0, pos0 + i, hk, 0) + c8);
                        vq[b] = stc_ptx::load8_f32_as_f16(kv_row(a, p0, pos0 + i, hk, 1) + c8);
                    }
                }
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    if (!ok[b]) continue;
                    const int e = e0 + b * kThreads, i = e / CH, c8 = (e % CH) * 8;
                    const size_t dst = ((size_t)hs * a.sel_rows + slot[i]) * D + c8;
                    *reinterpret_cast<uint4 *>(a.sel_k + dst) = kq[b];
                    *reinterpret_cast<uint4 *>(a.sel_v + dst) = vq[b];
                }
            }
        }
    }
    if (!a.linear) return;
    static_assert(kTile * D * 4 <= hl_bytes(kTile, D) && kTile * D * 4 <= hl_bytes(kTile, 2 * D), "staging");

    /* 2. fold, 64 tokens at a time: Φ (k-map of head h; zero rows for the
     * picked tokens and past the chunk), the values, then ΔS += Φᵀ V (warp w:
     * feature rows pb + 16 w, dims db .. db + 63) and the lane's column sums of Φ */
    if constexpr (leave_tc_map(D)) {
        if (img) cp_async_wait_all();   /* the image (and the first keys and values) have landed */
        else fmap_load_3<D>(a, 1, h, Wt, us);
    } else {
        fmap_load<D>(a, 1, h, reinterpret_cast<float *>(Wt), us);
    }
    __syncthreads();
    const float uu = npmap_uu<D>(us, lane);
    /* the lane's column sums of Φ: tensor-core path, columns c0 + i and D + c0 + i
     * (npmap_finish's lanes); fp32 path, columns 2 lane + 64 j + e (store_phi_warp's) */
    constexpr int NZ = leave_tc_map(D) ? 2 * (D / kGroup) : 2 * D / 32;
    float dzl[NZ];
#pragma unroll
    for (int i = 0; i < NZ; i++) dzl[i] = 0.0f;
    float *dS = a.slots + (size_t)k * a.slot_floats;
    const int a_row = stc_attn::ldm_nk_row(lane), a_chunk = stc_attn::ldm_nk_chunk(lane);
    const int b_row = stc_attn::ldm_rowmajor_row(lane), b_chunk = stc_attn::ldm_rowmajor_chunk(lane);
    const uint32_t ph = smem_addr(Ph), pl = smem_addr(Pl), vh = smem_addr(Vh), vl = smem_addr(Vl);
    for (int i0 = 0; i0 < C; i0 += kTile) {
        if (i0 > 0) {
            __syncthreads();   /* the previous tile's Φ and values are no longer read */
            stage(i0);
        }
        cp_async_wait_all();
        __syncthreads();   /* this tile's keys and values have landed */
        const float *Kf = reinterpret_cast<const float *>(Vh), *Vf = reinterpret_cast<const float *>(Ph);
        auto key = [&](int r) -> const float * {
            const int i = i0 + r;
            return i < C && !picked[i] ? Kf + r * D : nullptr;
        };
        constexpr int NV = kTile * D / 8 / kThreads;   /* 8-float pieces of the values a thread converts */
        float vv[NV][8];   /* the values, into registers: Φ and their tiles take their places */
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const float4 *src = reinterpret_cast<const float4 *>(Vf + 8 * (tid + j * kThreads));
            const float4 v0 = src[0], v1 = src[1];
            vv[j][0] = v0.x, vv[j][1] = v0.y, vv[j][2] = v0.z, vv[j][3] = v0.w;
            vv[j][4] = v1.x, vv[j][5] = v1.y, vv[j][6] = v1.z, vv[j][7] = v1.w;
        }
        if constexpr (leave_tc_map(D)) {
            npmap_reflect<D>(key, us, uu, XZ, nx);
            __syncthreads();   /* the staged keys and values are read */
        } else {
            __syncthreads();   /* the staged values are read: Φ may go there */
            for (int r = warp; r < kTile; r += kWarps) {
                const float *x = key(r);
                float *row = dzw + warp * P;
                if (x) {
                    npmap_warp<D>(x, us, reinterpret_cast<const float *>(Wt), uu,
                                  reinterpret_cast<float *>(XZ) + warp * D, row, lane, a.lolcats);
                } else {
                    for (int c = lane; c < P; c += 32) row[c] = 0.0f;
                }
                __syncwarp();
                store_phi_warp<D>(Ph, r, row);
#pragma unroll
                for (int j = 0; j < NZ / 2; j++) dzl[2 * j] += row[2 * lane + 64 * j], dzl[2 * j + 1] += row[2 * lane + 64 * j + 1];
                __syncwarp();   /* row is rewritten by the warp's next key */
            }
            __syncthreads();   /* the staged keys are read */
        }
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int e = tid + j * kThreads;
            store_split<2, 8>(Vh, hl_bytes(kTile, D) / 2, e / (D / 8), 8 * (e % (D / 8)), CH, vv[j]);
        }
        if constexpr (leave_tc_map(D)) {
            npmap_project_tc<D>(XZ, Wt, a.npmap_wg);
            npmap_finish<D>(reinterpret_cast<const float *>(XZ), nx, a.lolcats,
                            [&](int r, int c0, const float *p1, const float *p2) {
                                store_phi<D>(Ph, r, c0, p1, p2);
#pragma unroll
                                for (int i = 0; i < D / kGroup; i++) dzl[i] += p1[i], dzl[D / kGroup + i] += p2[i];
                            });
        }
        __syncthreads();   /* Φ complete */
        const int n_ks = cdiv(smin(kTile, C - i0), 16);
        for (int pb = 0; pb < P; pb += 128)
            for (int db = 0; db < D; db += 64) {
                float acc[8][4];
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
                for (int ks = 0; ks < n_ks; ks++) {
                    uint32_t ah[4], al[4];
                    const int ao = stc_attn::swz_off_add(a_row, a_chunk, 16 * ks, pb / 8 + 2 * warp, CHP);
                    ldsm_x4_trans(ah, ph + ao);
                    ldsm_x4_trans(al, pl + ao);
#pragma unroll
                    for (int dp = 0; dp < 4; dp++) {
                        uint32_t bh[4], bl[4];
                        const int bo = stc_attn::swz_off_add(b_row, b_chunk, 16 * ks, db / 8 + 2 * dp, CH);
                        ldsm_x4_trans(bh, vh + bo);
                        ldsm_x4_trans(bl, vl + bo);
                        mma3_x2(acc[2 * dp], acc[2 * dp + 1], ah, al, bh, bl);
                    }
                }
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        const int p = pb + 16 * warp + stc_attn::acc_row(lane, 2 * hh);
                        const int d = db + 8 * nt + stc_attn::acc_col(lane, 0);
                        float2 *dst = reinterpret_cast<float2 *>(dS + ((size_t)h * P + p) * D + d);
                        float2 v = make_float2(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
                        if (i0 > 0) {   /* this thread wrote these two last tile */
                            const float2 o = *dst;
                            v.x += o.x, v.y += o.y;
                        }
                        *dst = v;
                    }
            }
    }
    /* Δz: the warps' column sums (the lane groups' first, by shuffles), added in warp order */
    if constexpr (leave_tc_map(D)) {
#pragma unroll
        for (int i = 0; i < NZ; i++) {
            dzl[i] += __shfl_xor_sync(0xffffffffu, dzl[i], 8);
            dzl[i] += __shfl_xor_sync(0xffffffffu, dzl[i], 16);
        }
        if (lane < kGroup) {
            const int c0 = lane * (D / kGroup);
#pragma unroll
            for (int i = 0; i < D / kGroup; i++)
                dzw[warp * P + c0 + i] = dzl[i], dzw[warp * P + D + c0 + i] = dzl[D / kGroup + i];
        }
    } else {
        __syncwarp();
#pragma unroll
        for (int j = 0; j < NZ / 2; j++)
            dzw[warp * P + 2 * lane + 64 * j] = dzl[2 * j], dzw[warp * P + 2 * lane + 64 * j + 1] = dzl[2 * j + 1];
    }
    __syncthreads();
    for (int p = tid; p < P; p += kThreads) {
        float s = 0.0f;
        for (int w = 0; w < kWarps; w++) s += dzw[w * P + p];
        dS[(size_t)a.H * P * D + (size_t)h * P + p] = s;
    }
}

__global__ void scan_kernel(const args a) {
    const int p0 = *a.n_seen;
    const call_geom g = make_geom_fd(p0, a.T, a.C, a.fd_c);
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
    stc_pdl_trigger();   /* a following matrix-vector kernel may load its weights meanwhile (cuda/kernels/gemv.cu) */
    const int p0 = *a.n_seen;
    finish_copy(a, p0, blockIdx.x * kFinishThreads + threadIdx.x, kFinishBlocks * kFinishThreads);
    finish_arrive(a, p0);
}

}   // namespace

size_t smem_leave(int D, int C) {
    return leave_head_bytes(C) + (size_t)(D == 64 ? leave_align(64) + leave_tiles_bytes(64) : leave_tiles_bytes(128));
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

int launch_scan(stc_ctx *ctx, const args &a, still_err *err, cudaStream_t stream) {
    scan_kernel<<<stc_blocks((int64_t)a.slot_floats, 256), 256, 0, stream ? stream : ctx->stream>>>(a);
    STC_LAUNCHED(err, "scan_kernel");
    return STILL_OK;
}

int launch_finish(stc_ctx *ctx, const args &a, still_err *err) {
    finish_kernel<<<kFinishBlocks, kFinishThreads, 0, ctx->stream>>>(a);
    STC_LAUNCHED(err, "finish_kernel");
    return STILL_OK;
}

}   // namespace stillk
