/* still on the GPU, step 6: the linear branch and the final division, for
 * the rows of chunks c >= 2 (linear on):
 *   y = (o + g ⊙ (φq(q)ᵀ S_c)) / (l + φq(q)·z_c + 1e-6)
 * with o, l the unnormalised softmax part the attention kernel left in out
 * and lbuf, S_c, z_c the linear state of the chunk (lin_index: the state at
 * the start of the call, or a prefix slot of the call's folds) and
 * g = σ(Wg x + bg) from the gate GEMM's pre-activations (1 without the gate).
 * With gate_den the gate scales the denominator's linear term too, so the
 * denominator is per channel: y_d = (o_d + g_d a_d) / (l + g_d φq(q)·z_c + 1e-6).
 *
 * Block: (query chunk c, row tile rt, query head h) as the attention
 * kernel's, 256 threads, on the tensor cores in bf16x3 (attn_still_mma.cuh):
 * φq of the block's 64 rows (x̃ per row, z = x̃ Wᵀ as one 64×D×D product,
 * then φ per row, with φ·z_c), then Φ S_c (64×2D by 2D×D) with S_c streamed
 * through shared memory 128 feature rows at a time; then the gate and the
 * division on the accumulators. */
#include "kinds/still/attn_still_mma.cuh"

#include <type_traits>

namespace stillk {
namespace {

using namespace tc;

/* Shared memory (bytes): W (three tiles [D][D]), later the S rows (hi/lo
 * [128][D]); x̃ / z; Φ (hi/lo [64][2D]), first the fp32 S rows as they
 * arrive; the fp32 q rows as they arrive ([64][D], head dim 64 only: 128
 * would not fit, its q rows are read where they are); then floats u [D],
 * ‖x‖ [64], φ·z [64], z_c [2D]. */
__host__ __device__ constexpr bool lin_stage_q(int D) { return D == 64; }
__host__ __device__ constexpr int lin_ws_bytes(int D) {
    return h3_bytes(D, D) > hl_bytes(128, D) ? h3_bytes(D, D) : hl_bytes(128, D);
}
/* Head dim 64: the tiles start at a multiple of 1,024 bytes (z's product on wgmma reads W and x̃ with the
 * 128-byte swizzle), up to 1,024 bytes into the allocation. */
__host__ __device__ constexpr int lin_align(int D) { return D == 64 ? 1024 : 0; }
__host__ __device__ constexpr int linear_bytes(int D) {
    return lin_align(D) + lin_ws_bytes(D) + xz_bytes(D) + hl_bytes(kTile, 2 * D) + (lin_stage_q(D) ? kTile * D * 4 : 0) +
           (D + kTile + kTile + 2 * D) * 4;
}

/* Rows r0 .. r0 + 127 of S (fp32 [P][D] at S, in global memory) into the tiles Sh, Sl [128][D]. */
template <int D>
__device__ __forceinline__ void load_s_rows(const float *S, int r0, unsigned char *Sh, unsigned char *Sl) {
    constexpr int CH = D / 8;
    for (int e = threadIdx.x; e < 128 * D / 8; e += kThreads) {
        const int r = e / (D / 8), col = 8 * (e % (D / 8));
        const float4 *src = reinterpret_cast<const float4 *>(S + (size_t)(r0 + r) * D + col);
        const float4 v0 = src[0], v1 = src[1];
        const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        store_split<2, 8>(Sh, Sl - Sh, r, col, CH, v);
    }
}

template <int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) linear_kernel(const args a) {
    constexpr int P = 2 * D, CH = D / 8, CHP = P / 8, NT = D / 16, ST = 128;
    static_assert(kRows == kTile, "one tile of rows per block");
    static_assert(ST * D * 4 <= hl_bytes(kTile, P), "the first S rows are staged where Φ goes");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char *WS = smem + (lin_align(D) ? (0u - smem_addr(smem)) & (uint32_t)(lin_align(D) - 1) : 0u);
    static_assert(lin_ws_bytes(D) % 1024 == 0, "x̃'s tiles 1024-byte aligned too");
    unsigned char *XZ = WS + lin_ws_bytes(D);
    unsigned char *Ph = XZ + xz_bytes(D), *Pl = Ph + hl_bytes(kTile, P) / 2;
    float *Qs = reinterpret_cast<float *>(Ph + hl_bytes(kTile, P));
    float *us = Qs + (lin_stage_q(D) ? kTile * D : 0);
    float *nx = us + D, *bz = nx + kTile, *zs = bz + kTile;

    const int p0 = *a.n_seen;
    const call_geom g = make_geom_fd(p0, a.T, a.C, a.fd_c);
    const int bq = fdiv((int)blockIdx.x, a.fd_rt);
    const int c = g.c_first + bq, rt = (int)blockIdx.x - bq * row_tiles(a.C), h = blockIdx.y;
    if (c > g.c_last || c < 2) return;   /* chunks 0 and 1: the attention kernel wrote the output */
    int lo, hi;
    block_rows(g, a.C, c, rt, &lo, &hi);
    if (lo > hi || hi < p0 + a.out_first) return;
    const int n_rows = hi - lo + 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    const int idx = lin_index(g, c);
    const float *src = idx == 0 ? a.lin : a.slots + (size_t)(idx - 1) * a.slot_floats;
    const float *S = src + (size_t)h * P * D;
    const float *z = src + (size_t)a.H * P * D + (size_t)h * P;

    /* the q rows and S's first 128 rows on their way (cp.async), meanwhile W, u and z_c */
    if constexpr (lin_stage_q(D)) copy_rows_f32<D>(smem_addr(Qs), q_row(a, lo - p0, h), a.ldq, n_rows);
    copy_pieces<ST * D / 4>(smem_addr(Ph), S);
    if (a.wimg) fmap_copy_3<D>(a.wimg + (size_t)h * wimage_bytes(D), WS, us);   /* W's image: split already */
    cp_async_commit();
    static_assert(P <= kThreads, "one z_c entry a thread");
    const float zv = tid < P ? z[tid] : 0.0f;   /* issued before W's loads: the latencies overlap */
    if (!a.wimg) fmap_load_3<D>(a, 0, h, WS, us);
    if (tid < P) zs[tid] = zv;
    cp_async_wait_all();
    __syncthreads();

    /* φq of the rows */
    const float uu = npmap_uu<D>(us, lane);
    npmap_reflect<D>(
        [&](int r) -> const float * {
            if (r >= n_rows) return nullptr;
            return lin_stage_q(D) ? Qs + r * D : q_row(a, lo + r - p0, h);
        },
        us, uu, XZ, nx);
    npmap_project_tc<D>(XZ, WS, a.npmap_wg);   /* ends with a barrier: W is free */
    {
        const float *Sf = reinterpret_cast<const float *>(Ph);
        for (int e = tid; e < ST * D / 8; e += kThreads) {
            const float4 *src = reinterpret_cast<const float4 *>(Sf + e * 8);
            const float4 v0 = src[0], v1 = src[1];
            const float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
            store_split<2, 8>(WS, hl_bytes(ST, D) / 2, e / (D / 8), 8 * (e % (D / 8)), CH, v);
        }
    }

    /* the epilogue's inputs for this lane's accumulators, loaded early */
    const int m0 = 16 * (warp & 3), n0 = (warp >> 2) * (D / 2);
    const float *pre = a.gate ? a.pre : nullptr;
    const float *bg = a.gate ? a.params + par_bg(a) + (size_t)h * D : nullptr;
    float lb[2];
    float2 yin[2][NT], pin[2][NT], bgv[NT];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)   /* the gate's bias for the lane's columns */
        bgv[nt] = bg ? *reinterpret_cast<const float2 *>(bg + n0 + 8 * nt + stc_attn::acc_col(lane, 0))
                     : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int r = m0 + stc_attn::acc_row(lane, 2 * hh);
        const int t = lo + smin(r, n_rows - 1) - p0;   /* rows past the end: a valid row's values, not used */
        lb[hh] = a.lbuf[(size_t)t * a.H + h];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int d = n0 + 8 * nt + stc_attn::acc_col(lane, 0);
            yin[hh][nt] = *reinterpret_cast<const float2 *>(a.out + ((size_t)t * a.H + h) * D + d);
            pin[hh][nt] = pre ? *reinterpret_cast<const float2 *>(pre + (size_t)t * a.ldpre + (size_t)h * D + d)
                              : make_float2(0.0f, 0.0f);
        }
    }
    __syncthreads();   /* the staged S rows are read: Φ may overwrite them */
    npmap_finish<D>(reinterpret_cast<const float *>(XZ), nx, a.lolcats,
                    [&](int r, int c0, const float *p1, const float *p2) {
                        store_phi<D>(Ph, r, c0, p1, p2);
                        float s = 0.0f;
#pragma unroll
                        for (int i = 0; i < D / kGroup; i++) s = fmaf(p1[i], zs[c0 + i], fmaf(p2[i], zs[D + c0 + i], s));
                        s = grp_sum(s);
                        if ((lane & 7) == 0) bz[r] = s;
                    });

    /* Φ S_c: warp w takes rows 16 (w & 3), columns (w >> 2) D/2 on */
    const int a_row = stc_attn::ldm_rowmajor_row(lane), a_chunk = stc_attn::ldm_rowmajor_chunk(lane);
    const uint32_t ph = smem_addr(Ph), pl = smem_addr(Pl), sh = smem_addr(WS), sl = sh + hl_bytes(ST, D) / 2;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[nt][e] = 0.0f;
    for (int pc = 0; pc < P; pc += ST) {
        if (pc > 0) {
            __syncthreads();   /* the previous S rows are no longer read */
            load_s_rows<D>(S, pc, WS, WS + hl_bytes(ST, D) / 2);
        }
        __syncthreads();   /* Φ (and these S rows) complete */
#pragma unroll
        for (int ks = 0; ks < ST / 16; ks++) {
            uint32_t ah[4], al[4];
            const int ao = stc_attn::swz_off_add(a_row, a_chunk, m0, pc / 8 + 2 * ks, CHP);
            ldsm_x4(ah, ph + ao);
            ldsm_x4(al, pl + ao);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                uint32_t bh[4], bl[4];
                const int bo = stc_attn::swz_off_add(a_row, a_chunk, 16 * ks, n0 / 8 + 2 * dp, CH);
                ldsm_x4_trans(bh, sh + bo);
                ldsm_x4_trans(bl, sl + bo);
                mma3_x2(acc[2 * dp], acc[2 * dp + 1], ah, al, bh, bl);
            }
        }
    }

    const float gam = softmax_factor(a, h);   /* lolcats' γ on the softmax sums */
    /* the gate and the division, compiled twice: a denominator per row, or per channel with gate_den
     * (l + g_d φq·z + 1e-6; the gate then scales the numerator's and the denominator's linear terms) */
    auto epilogue = [&](auto per_channel) {
        constexpr bool GD = decltype(per_channel)::value;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = m0 + stc_attn::acc_row(lane, 2 * hh);
            if (r >= n_rows) continue;
            const int t = lo + r - p0;
            const float inv = GD ? 0.0f : 1.0f / still_den(gam * lb[hh], 1.0f, bz[r], 0);   /* the row's (GD: per channel, below) */
            float *y = a.out + ((size_t)t * a.H + h) * D;
            bf16 *yb = a.out_bf16 ? a.out_bf16 + ((size_t)t * a.H + h) * D : nullptr;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const int d = n0 + 8 * nt + stc_attn::acc_col(lane, 0);
                float l0 = acc[nt][2 * hh], l1 = acc[nt][2 * hh + 1], g0 = 1.0f, g1 = 1.0f;
                if (pre) {
                    g0 = sigmoid(pin[hh][nt].x + bgv[nt].x);   /* attn_still_internal.cuh */
                    g1 = sigmoid(pin[hh][nt].y + bgv[nt].y);
                    l0 *= g0, l1 *= g1;
                }
                float y0, y1;
                if constexpr (GD) {
                    y0 = (gam * yin[hh][nt].x + l0) / still_den(gam * lb[hh], g0, bz[r], 1);
                    y1 = (gam * yin[hh][nt].y + l1) / still_den(gam * lb[hh], g1, bz[r], 1);
                } else {
                    y0 = (gam * yin[hh][nt].x + l0) * inv, y1 = (gam * yin[hh][nt].y + l1) * inv;
                }
                if (yb) *reinterpret_cast<__nv_bfloat162 *>(yb + d) = __floats2bfloat162_rn(y0, y1);
                else *reinterpret_cast<float2 *>(y + d) = make_float2(y0, y1);
            }
        }
    };
    if (a.gate_den) epilogue(std::true_type());
    else epilogue(std::false_type());
}

/* Block (head h, side): fmap_load_3 into the image in global memory (store_split writes through generic
 * pointers; the same bytes as in shared memory). */
template <int D>
__global__ void __launch_bounds__(kThreads) wimage_kernel(const args a, unsigned char *img) {
    const int side = blockIdx.y, h = blockIdx.x;
    unsigned char *dst = img + ((size_t)side * a.H + h) * wimage_bytes(D);
    fmap_load_3<D>(a, side, h, dst, reinterpret_cast<float *>(dst + h3_bytes(D, D)));
}

}   // namespace

size_t wimg_bytes(int D) { return (size_t)(D == 64 ? wimage_bytes(64) : wimage_bytes(128)); }

int launch_wimage(stc_ctx *ctx, const args &a, unsigned char *img, still_err *err) {
    /* the k-maps' images only where the leave kernel takes them (head dim 64: its tensor-core map) */
    const dim3 grid((unsigned)a.H, a.D == 64 ? 2 : 1);
    if (a.D == 64) wimage_kernel<64><<<grid, kThreads, 0, ctx->stream>>>(a, img);
    else wimage_kernel<128><<<grid, kThreads, 0, ctx->stream>>>(a, img);
    STC_LAUNCHED(err, "wimage_kernel");
    return STILL_OK;
}

size_t smem_linear(int D) { return (size_t)(D == 64 ? linear_bytes(64) : linear_bytes(128)); }

int prepare_linear(int D, still_err *err) {
    const int bytes = (int)smem_linear(D);
    if (D == 64) STC_CUDA(err, cudaFuncSetAttribute(linear_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    else STC_CUDA(err, cudaFuncSetAttribute(linear_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return STILL_OK;
}

int launch_linear(stc_ctx *ctx, const args &a, still_err *err) {
    const dim3 grid((unsigned)(max_query_chunks(a.T, a.C) * row_tiles(a.C)), (unsigned)a.H);
    if (a.D == 64) linear_kernel<64><<<grid, kThreads, smem_linear(64), ctx->stream>>>(a);
    else linear_kernel<128><<<grid, kThreads, smem_linear(128), ctx->stream>>>(a);
    STC_LAUNCHED(err, "linear_kernel");
    return STILL_OK;
}

}   // namespace stillk
