/* still on the GPU, step 5: the softmax part over A(t) = Sel ∪ Local(t) on
 * the tensor cores, FlashAttention-2 style (the fragment handling is that of
 * cuda/kinds/softmax/attn_softmax.cu, with attn_layout.cuh's verified index helpers).
 *
 * Precision: IEEE half operands (Q, the keys, the values and P), fp32
 * accumulation. Sel is stored in half, rounded as the CPU's default
 * --sel-cache f16 store (src/kinds/still/attn_still.c), or in 8 bits with a scale per
 * row (--sel-cache q8), widened to scale × byte in half on the way into
 * shared memory; bf16 (8-bit mantissa) was too
 * coarse: the trained model amplifies the rounding of the selected tokens
 * (tests/cuda/test_model_cuda.c). |x| > 65504 would round to inf, as on the
 * CPU's f16 store; attention inputs of the models here stay far below.
 *
 * Block: (query chunk c, row tile rt, query head h), 128 threads = 4 warps
 * of 16 rows; row r is the position lo + r of chunk c (block_rows). Keys
 * (make_keys): Sel entries 0 .. ns-1 of selection head hs (half rows of the
 * state, cp.async), then the Local positions (c-1)C .. hi (fp32 keys and
 * values from the ring or the call's input, converted to half on the way
 * into shared memory). Tiles of 64 keys, double-buffered; a row sees the
 * columns 0 .. tile_limit of a tile (every Sel entry, Local keys up to its
 * own position); tiles beyond a warp's last position are skipped (not on the
 * wgmma path below, where every product takes the whole warpgroup), tiles
 * fully visible to the warp's rows run without the mask.
 *
 * Epilogue, per row (m = max over A(t), l = Σ e^{s-m}, o = Σ e^{s-m} v):
 * without a linear term (linear off, or chunk c < 2) out = o / (l + 1e-6);
 * otherwise out = o (unnormalised) and lbuf = l, which the linear kernel
 * turns into (o + g ⊙ φqᵀS) / (l + φq·z + 1e-6) (with gate_den the
 * denominator per channel, l + g ⊙ φq·z + 1e-6). */
#include "kinds/attn_layout.cuh"
#include "kinds/still/attn_still_internal.cuh"
#include "common/mma_ptx.cuh"

namespace stillk {
namespace {

using namespace stc_ptx;
using stc_attn::acc_col;
using stc_attn::acc_row;
using stc_attn::ldm_nk_chunk;
using stc_attn::ldm_nk_row;
using stc_attn::ldm_rowmajor_chunk;
using stc_attn::ldm_rowmajor_row;
using stc_attn::p_frag_e;
using stc_attn::p_frag_ntile;
using stc_attn::swz_off_add;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
static_assert(kWarps * 16 == kRows, "one m16 tile per warp");
static_assert(kKeys == stc_attn::kBlockN, "the softmax kernel's tile size");

/* STAGE (head dim 64 on mma.sync): a Local tile's fp32 keys and values come by cp.async
 * into a staging area (two [64][D] fp32 tiles) one tile ahead, like Sel's
 * half rows, and are converted to half in shared memory when their turn
 * comes; without it (head dim 128, and the wgmma path, whose prefill tiles
 * come from the half copies), the conversion loads wait on global memory in
 * the tile's own iteration (the kernel's largest stall). Same roundings. */
template <int D, bool STAGE, bool WG = false>
constexpr int attn_smem() {   /* Q, K and V double-buffered (WG: and room to start them at 1,024 bytes) */
    return (kRows + 4 * kKeys) * D * 2 + (STAGE ? 2 * kKeys * D * 4 : 0) + (WG ? 1024 : 0);
}

/* The lane's ldmatrix offsets within a K or V tile, less what the unrolled loops add as constants: K's for
 * k-step ks (rows ldm_nk_row, chunk 2 ks ^ the lane's swizzle; key group np adds np·16 rows = a constant,
 * since 16 rows keep the XOR pattern), V's for dim pair dp (key step kk adds kk·16 rows). Computed once per
 * lane; a tile then costs one add per k-step or dim pair instead of an address computation per ldmatrix. */
template <int D>
struct lane_offsets {
    uint32_t k[D / 16], v[D / 16];
};
template <int D>
__device__ __forceinline__ lane_offsets<D> make_lane_offsets(int lane) {
    constexpr int CH = D / 8;
    lane_offsets<D> lo;
#pragma unroll
    for (int i = 0; i < D / 16; i++) {
        lo.k[i] = (uint32_t)swz_off_add(ldm_nk_row(lane), ldm_nk_chunk(lane), 0, 2 * i, CH);
        lo.v[i] = (uint32_t)swz_off_add(ldm_rowmajor_row(lane), ldm_rowmajor_chunk(lane), 0, 2 * i, CH);
    }
    return lo;
}

/* The online-softmax update of one warp's tile scores s (64 keys): the mask
 * (column > lim[row half] -> -inf) if MASK, then m, l and the rescale of O;
 * s becomes P. With MASK, only the first ng 16-key groups are visible to any
 * of the warp's rows (their exponentials are skipped: 2^-inf = 0). */
template <int D, bool MASK>
__device__ __forceinline__ void softmax_update(float (&s)[kKeys / 8][4], const int lane, const float sl2,
                                               float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                               const int (&lim)[2], const int ng) {
    constexpr int NT = kKeys / 8, DT = D / 8;
    if constexpr (MASK) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (nt * 8 + acc_col(lane, e) > lim[e >> 1]) s[nt][e] = -INFINITY;
    }
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float mx = m[hh];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * hh], s[nt][2 * hh + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        /* a row with no visible key yet keeps m = -inf: offset 0, so 2^-inf = 0, not NaN */
        const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
        const float corr = ex2(m[hh] * sl2 - msc);
        m[hh] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                const float p = !MASK || nt < 2 * ng ? ex2(fmaf(s[nt][e], sl2, -msc)) : 0.0f;   /* (2^-inf) */
                s[nt][e] = p;
                sum += p;
            }
        l[hh] = l[hh] * corr + sum;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) o[dt][2 * hh] *= corr, o[dt][2 * hh + 1] *= corr;
    }
}

/* P's 16-key group kk (n-tiles 2kk, 2kk+1 of s) as the A operand of P·V (IEEE half pairs). */
__device__ __forceinline__ void pack_p(const float (&s)[kKeys / 8][4], int kk, uint32_t (&pa)[4]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float *c = s[2 * kk + p_frag_ntile(i)];
        pa[i] = pack_f16(c[p_frag_e(i)], c[p_frag_e(i) + 1]);
    }
}

/* One warp, one 64-key tile (K at shared address kt, V at vt), mma.sync:
 * S = Q Kᵀ, softmax_update, then O += P V. With MASK only the first ng
 * 16-key groups are computed (a partial Sel tile, the diagonal Local tile:
 * the others' scores are masked and their P is 0 either way). */
template <int D, bool MASK>
__device__ __forceinline__ void tile_step(const uint32_t kt, const uint32_t vt, const int lane, const float sl2,
                                          const uint32_t (&qf)[D / 16][4], float (&o)[D / 8][4], float (&m)[2],
                                          float (&l)[2], const int (&lim)[2], const lane_offsets<D> &lo,
                                          const int ng) {
    constexpr int CH = D / 8, KS = D / 16, NT = kKeys / 8, DT = D / 8;
    constexpr uint32_t ROW16 = 16 * CH * 16;   /* bytes of 16 tile rows */

    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        const uint32_t kb = kt + lo.k[ks];
#pragma unroll
        for (int np = 0; np < NT / 2; np++) {
            if (MASK && np >= ng) continue;   /* (uniform over the warp) */
            uint32_t b[4];
            ldsm_x4(b, kb + np * ROW16);
            mma_f16(s[2 * np], qf[ks], b[0], b[1]);
            mma_f16(s[2 * np + 1], qf[ks], b[2], b[3]);
        }
    }

    softmax_update<D, MASK>(s, lane, sl2, o, m, l, lim, ng);

#pragma unroll
    for (int kk = 0; kk < NT / 2; kk++) {
        if (MASK && kk >= ng) continue;   /* P is 0 there */
        uint32_t pa[4];
        pack_p(s, kk, pa);
#pragma unroll
        for (int dp = 0; dp < DT / 2; dp++) {
            uint32_t b[4];
            ldsm_x4_trans(b, vt + lo.v[dp] + kk * ROW16);
            mma_f16(o[2 * dp], pa, b[0], b[1]);
            mma_f16(o[2 * dp + 1], pa, b[2], b[3]);
        }
    }
}

/* ---- the Hopper path (head dim 64): wgmma of the block's warpgroup -----------------------------------------
 * The block's 4 warps are one warpgroup; S = Q Kᵀ and O += P V are each one asm block of four
 * wgmma.m64n64k16 (f16 in, fp32 accumulators, the same fragment layouts as mma.sync's m16n8 tiles, warp w
 * holding rows 16w ..), issued, committed and waited for together, so the compiler never sees the
 * accumulators in flight. Q and K come from shared memory K-major, V N-major (its rows are keys): the tiles'
 * swizzle (chunk c of row r at c ^ (r & 7), rows of 128 bytes, tiles 1024-byte aligned) is the 128-byte
 * swizzle the descriptors name. P comes from registers. Every wgmma needs all 4 warps, so with WG no warp
 * skips a tile; the masks and the online softmax stay per warp. Compiled for sm_90a only
 * (__CUDA_ARCH_FEAT_SM90_ALL); attn_wg_available() tells the host whether the loaded code has it. The
 * descriptors (wg_desc) and the proxy fence are in mma_ptx.cuh. */

/* wgmma's 32 fp32 accumulators of an m64n64 tile: the register list in the instruction and the asm operands
 * (an [8][4] array in mma.sync's m16n8 fragment order, operands 0 .. 31) */
#define WG_D32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WG_ACC4(c, a, i) c(a[i][0]), c(a[i][1]), c(a[i][2]), c(a[i][3])
#define WG_ACC32(c, a)                                                                                       \
    WG_ACC4(c, a, 0), WG_ACC4(c, a, 1), WG_ACC4(c, a, 2), WG_ACC4(c, a, 3), WG_ACC4(c, a, 4), WG_ACC4(c, a, 5), \
        WG_ACC4(c, a, 6), WG_ACC4(c, a, 7)

/* s = Q Kᵀ (Q at sq, K at sk: [64][64] half tiles). */
__device__ __forceinline__ void wg_qk(uint32_t sq, uint32_t sk, float (&s)[kKeys / 8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uint64_t q0 = wg_desc(sq, 1024), k0 = wg_desc(sk, 1024);   /* a k-step: 16 halves = 32 bytes on */
    asm volatile(
        "{\n"
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", %32, %36, 0, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", %33, %37, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", %34, %38, 1, 1, 1, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", %35, %39, 1, 1, 1, 0, 0;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;\n"
        "}\n"
        : WG_ACC32("=f", s)
        : "l"(q0), "l"(q0 + 2), "l"(q0 + 4), "l"(q0 + 6), "l"(k0), "l"(k0 + 2), "l"(k0 + 4), "l"(k0 + 6)
        : "memory");
#else
    (void)sq, (void)sk;
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    __trap();   /* not reached: the host launches this path only where attn_wg_available() */
#endif
}

/* o += P V (P in registers as pack_p's groups, V at sv: [64 keys][64] half, rows of 128 bytes). */
__device__ __forceinline__ void wg_pv(const uint32_t (&pa)[4][4], uint32_t sv, float (&o)[8][4]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const uint64_t v0 = wg_desc(sv, 1024);   /* a k-step: 16 keys = 2048 bytes on */
    asm volatile(
        "{\n"
        "wgmma.fence.sync.aligned;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", {%32,%33,%34,%35}, %48, 1, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", {%36,%37,%38,%39}, %49, 1, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", {%40,%41,%42,%43}, %50, 1, 1, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        WG_D32 ", {%44,%45,%46,%47}, %51, 1, 1, 1, 1;\n"
        "wgmma.commit_group.sync.aligned;\n"
        "wgmma.wait_group.sync.aligned 0;\n"
        "}\n"
        : WG_ACC32("+f", o)
        : "r"(pa[0][0]), "r"(pa[0][1]), "r"(pa[0][2]), "r"(pa[0][3]), "r"(pa[1][0]), "r"(pa[1][1]), "r"(pa[1][2]),
          "r"(pa[1][3]), "r"(pa[2][0]), "r"(pa[2][1]), "r"(pa[2][2]), "r"(pa[2][3]), "r"(pa[3][0]), "r"(pa[3][1]),
          "r"(pa[3][2]), "r"(pa[3][3]), "l"(v0), "l"(v0 + 128), "l"(v0 + 256), "l"(v0 + 384)
        : "memory");
#else
    (void)pa, (void)sv, (void)o;
    __trap();   /* not reached (as wg_qk) */
#endif
}


/* Eight 8-bit Sel elements (8-byte aligned) times their row's scale, as eight halves (--sel-cache q8). */
__device__ __forceinline__ uint4 load8_q8_as_f16(const int8_t *p, float s) {
    const uint2 r = *reinterpret_cast<const uint2 *>(p);
    const int8_t *b = reinterpret_cast<const int8_t *>(&r);
    return make_uint4(pack_f16(s * (float)b[0], s * (float)b[1]), pack_f16(s * (float)b[2], s * (float)b[3]),
                      pack_f16(s * (float)b[4], s * (float)b[5]), pack_f16(s * (float)b[6], s * (float)b[7]));
}

/* (WG, never with STAGE: 117 registers and 41 KB of shared memory a block, room for four blocks an SM) */
template <int D, bool STAGE, bool WG = false>
__global__ void __launch_bounds__(kThreads, WG ? 4 : D == 64 ? 3 : 2) attn_kernel(const args a) {
    constexpr int CH = D / 8, KS = D / 16, DT = D / 8;
    constexpr int RSTEP = kThreads / CH;   /* tile rows one pass of the block copies (16 or 8) */
    constexpr uint32_t TILE = kKeys * D * 2;
    static_assert(RSTEP % 8 == 0 && kRows % RSTEP == 0 && kKeys % RSTEP == 0, "copy passes");
    static_assert(!WG || (D == 64 && kThreads == 128 && kKeys == 64 && kRows == 64), "one warpgroup, 64 x 64 tiles");
    static_assert(!(WG && STAGE), "the wgmma path has no staging tiles (dev/cuda/README.md: the staged one)");

    extern __shared__ __align__(128) unsigned char smem[];
    /* (WG: the tiles at a multiple of 1,024 bytes, where the 128-byte swizzle's pattern starts) */
    const uint32_t sQ = WG ? (smem_addr(smem) + 1023u) & ~1023u : smem_addr(smem);
    const uint32_t sK = sQ + kRows * D * 2;
    const uint32_t sV = sK + 2 * TILE;
    const uint32_t sKf = sV + 2 * TILE, sVf = sKf + kKeys * D * 4;   /* STAGE: fp32 Local keys, values */

    const int p0 = *a.n_seen;
    const call_geom g = make_geom_fd(p0, a.T, a.C, a.fd_c);
    const int bq = fdiv((int)blockIdx.x, a.fd_rt);
    const int c = g.c_first + bq, rt = (int)blockIdx.x - bq * row_tiles(a.C), h = blockIdx.y;
    if (c > g.c_last) return;
    int lo, hi;
    block_rows(g, a.C, c, rt, &lo, &hi);
    if (lo > hi || hi < p0 + a.out_first) return;
    const int n_rows = hi - lo + 1;
    const int hk = h / a.G, hs = a.per_kv ? hk : h;
    const key_list kl = make_keys(c, hi, a.C, a.lam, a.cap);
    const __half *selk = a.sel_k + (size_t)hs * a.sel_rows * D, *selv = a.sel_v + (size_t)hs * a.sel_rows * D;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int ld_row = tid / CH, ld_chunk = tid % CH;
    const uint32_t ld_off = (uint32_t)swz_off_add(ld_row, ld_chunk, 0, 0, CH);
    const __half *selk_t = selk + (size_t)ld_row * D + ld_chunk * 8, *selv_t = selv + (size_t)ld_row * D + ld_chunk * 8;

    /* Q rows (fp32 -> half; rows past n_rows zero): every load issued before the first store */
    {
        uint4 qv[kRows / RSTEP];
#pragma unroll
        for (int it = 0; it < kRows / RSTEP; it++) {
            const int r = ld_row + it * RSTEP;
            qv[it] = r < n_rows ? load8_f32_as_f16(q_row(a, lo + r - p0, h) + ld_chunk * 8) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int it = 0; it < kRows / RSTEP; it++) st_shared_16(sQ + swz_off_add(ld_row, ld_chunk, it * RSTEP, 0, CH), qv[it]);
    }
    /* Local tile j from the call's half copies of k and v (all its positions in the call; uniform over the
     * block): the values the conversion of the fp32 rows would give, without the staging pass. */
    const auto local_direct = [&](int j) { return a.k_f16 != nullptr && tile_pos0(kl, j) >= p0; };
    /* K and V tile j -> buffer buf; rows without a key zero-filled. */
    auto load_kv = [&](int j, int buf) {
        /* the thread's rows ld_row + it·RSTEP: the shared offsets are the first one's plus constants (RSTEP a
         * multiple of 8 rows keeps the swizzle), the sources its first row's pointer plus a stride */
        const uint32_t sk = sK + buf * TILE + ld_off, sv = sV + buf * TILE + ld_off;
        /* Rows without a key are copied with source size 0 (zero-filled, nothing read), from the address the
         * row would have: at most one tile past the last entry or position, which the store's and the half
         * copies' allocations keep inside them (sel_k / sel_v and model_cuda.c's kvh have a tile of rows of
         * padding). No select of a fallback address: these copies are issued for every tile. */
        if (j < kl.n_sel_tiles && a.sel_q8) {   /* 8-bit rows: scale × byte rounded to half, stored in line */
            const int left = kl.ns - j * kKeys - ld_row;
            const size_t row = (size_t)hs * a.sel_rows + (size_t)j * kKeys + ld_row;
#pragma unroll 2   /* bounds the loads in flight (registers) */
            for (int it = 0; it < kKeys / RSTEP; it++) {
                uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
                if (it * RSTEP < left) {
                    const size_t r = row + (size_t)it * RSTEP;
                    kv = load8_q8_as_f16(a.sel_k8 + r * D + ld_chunk * 8, a.sel_ks[r]);
                    vv = load8_q8_as_f16(a.sel_v8 + r * D + ld_chunk * 8, a.sel_vs[r]);
                }
                st_shared_16(sk + it * RSTEP * CH * 16, kv);
                st_shared_16(sv + it * RSTEP * CH * 16, vv);
            }
        } else if (j < kl.n_sel_tiles) {
            const int left = kl.ns - j * kKeys - ld_row;   /* the thread's rows it with it·RSTEP < left hold entries */
            const __half *gk = selk_t + (size_t)j * kKeys * D, *gv = selv_t + (size_t)j * kKeys * D;
#pragma unroll
            for (int it = 0; it < kKeys / RSTEP; it++) {
                const bool ok = it * RSTEP < left;
                cp_async_16(sk + it * RSTEP * CH * 16, gk + it * RSTEP * D, ok);
                cp_async_16(sv + it * RSTEP * CH * 16, gv + it * RSTEP * D, ok);
            }
        } else if (local_direct(j)) {   /* the call's half copies: straight into buf, like Sel's rows */
            const int pos = tile_pos0(kl, j) + ld_row;   /* >= p0: the tile is the call's */
            const size_t step = (size_t)RSTEP * a.Hk * D;
            const __half *gk = a.k_f16 + ((size_t)(pos - p0) * a.Hk + hk) * D + ld_chunk * 8;
            const __half *gv = a.v_f16 + (gk - a.k_f16);
#pragma unroll
            for (int it = 0; it < kKeys / RSTEP; it++) {
                const bool ok = pos + it * RSTEP <= hi;
                cp_async_16(sk + it * RSTEP * CH * 16, gk + it * step, ok);
                cp_async_16(sv + it * RSTEP * CH * 16, gv + it * step, ok);
            }
        } else if constexpr (STAGE) {
            (void)buf;   /* into the staging tiles; stage_local converts them into buf */
            const int pos0 = tile_pos0(kl, j);
#pragma unroll
            for (int it = 0; it < kKeys / RSTEP; it++) {
                const int r = ld_row + it * RSTEP, pos = pos0 + r;
                const bool ok = pos <= hi;
                const float *ks = ok ? kv_row(a, p0, pos, hk, 0) + ld_chunk * 8 : a.k;
                const float *vs = ok ? kv_row(a, p0, pos, hk, 1) + ld_chunk * 8 : a.v;
                const uint32_t so = (uint32_t)(r * D + ld_chunk * 8) * 4;
                cp_async_16(sKf + so, ks, ok);
                cp_async_16(sKf + so + 16, ks + 4, ok);
                cp_async_16(sVf + so, vs, ok);
                cp_async_16(sVf + so + 16, vs + 4, ok);
            }
        } else {
            const int pos0 = tile_pos0(kl, j);
#pragma unroll 2   /* bounds the loads in flight (registers) */
            for (int it = 0; it < kKeys / RSTEP; it++) {
                const int r = ld_row + it * RSTEP, pos = pos0 + r;
                uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
                if (pos <= hi) {
                    kv = load8_f32_as_f16(kv_row(a, p0, pos, hk, 0) + ld_chunk * 8);
                    vv = load8_f32_as_f16(kv_row(a, p0, pos, hk, 1) + ld_chunk * 8);
                }
                const uint32_t so = buf * TILE + swz_off_add(ld_row, ld_chunk, it * RSTEP, 0, CH);
                st_shared_16(sK + so, kv);
                st_shared_16(sV + so, vv);
            }
        }
    };
    /* STAGE: the staged Local tile -> half tiles in buffer buf (rows without a key arrived as zeros) */
    auto stage_local = [&](int buf) {
#pragma unroll
        for (int it = 0; it < kKeys / RSTEP; it++) {
            const int r = ld_row + it * RSTEP;
            const uint32_t so = (uint32_t)(r * D + ld_chunk * 8) * 4;
            const uint32_t dst = buf * TILE + swz_off_add(ld_row, ld_chunk, it * RSTEP, 0, CH);
            st_shared_16(sK + dst, ld_shared_8f_as_f16(sKf + so));
            st_shared_16(sV + dst, ld_shared_8f_as_f16(sVf + so));
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    /* This warp's rows and the positions of the 2 rows this lane holds (rows
     * past the end take the last row's position: computed, never written). */
    const int wr0 = warp * 16;
    const bool warp_active = wr0 < n_rows;
    const int w_lo = lo + wr0, w_hi = lo + min(wr0 + 15, n_rows - 1);
    int pos[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) pos[hh] = lo + min(wr0 + acc_row(lane, 2 * hh), n_rows - 1);

    float o[DT][4], m[2], l[2];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[dt][e] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    uint32_t qf[KS][4];
    const lane_offsets<D> lofs = make_lane_offsets<D>(lane);

    for (int j = 0; j < kl.n_tiles; j++) {
        const int buf = j & 1;
        cp_async_wait_all();   /* tile j (Sel: cp.async) has landed ... */
        if constexpr (WG) fence_proxy_async();   /* (Q's stores, the copies: for the tensor cores' reads) */
        __syncthreads();       /* ... for every thread, Q and Local tiles too; tile j-1's buffer is free */
        if constexpr (STAGE)
            if (j >= kl.n_sel_tiles && !local_direct(j)) {   /* uniform over the block */
                stage_local(buf);
                __syncthreads();   /* the half tile is complete; the staging tiles are free */
            }
        if constexpr (WG) {   /* the warpgroup's tile: no warp skips it (see wg_qk) */
            if (j + 1 < kl.n_tiles) load_kv(j + 1, buf ^ 1);
            cp_async_commit();
            bool mask;
            int lim[2];
            if (j < kl.n_sel_tiles) {
                lim[0] = lim[1] = tile_limit(kl, j, 0);
                mask = lim[0] < kKeys - 1;
            } else {
                const int tp = tile_pos0(kl, j);
                lim[0] = tile_limit(kl, j, pos[0]);
                lim[1] = tile_limit(kl, j, pos[1]);
                mask = tp + kKeys - 1 > w_lo;
            }
            float s[kKeys / 8][4];
            wg_qk(sQ, sK + buf * TILE, s);
            if (mask) softmax_update<D, true>(s, lane, a.scale_log2, o, m, l, lim, kKeys / 16);
            else softmax_update<D, false>(s, lane, a.scale_log2, o, m, l, lim, kKeys / 16);
            uint32_t pa[kKeys / 16][4];
#pragma unroll
            for (int kk = 0; kk < kKeys / 16; kk++) pack_p(s, kk, pa[kk]);
            wg_pv(pa, sV + buf * TILE, o);
            continue;
        }
        if (j == 0) {
#pragma unroll
            for (int ks = 0; ks < KS; ks++)
                ldsm_x4(qf[ks], sQ + swz_off_add(ldm_rowmajor_row(lane), ldm_rowmajor_chunk(lane), wr0, 2 * ks, CH));
        }
        if (j + 1 < kl.n_tiles) load_kv(j + 1, buf ^ 1);
        cp_async_commit();

        if (!warp_active) continue;
        bool mask;
        int lim[2], wlim;   /* wlim: the largest limit of the warp's rows */
        if (j < kl.n_sel_tiles) {
            lim[0] = lim[1] = wlim = tile_limit(kl, j, 0);
            mask = lim[0] < kKeys - 1;
        } else {
            const int tp = tile_pos0(kl, j);
            if (tp > w_hi) continue;   /* nothing visible to this warp */
            lim[0] = tile_limit(kl, j, pos[0]);
            lim[1] = tile_limit(kl, j, pos[1]);
            wlim = tile_limit(kl, j, w_hi);
            mask = tp + kKeys - 1 > w_lo;
        }
        const uint32_t kt = sK + buf * TILE, vt = sV + buf * TILE;
        const int ng = min(wlim, kKeys - 1) / 16 + 1;   /* masked: the 16-key groups some row of the warp sees */
        if (mask) tile_step<D, true>(kt, vt, lane, a.scale_log2, qf, o, m, l, lim, lofs, ng);
        else tile_step<D, false>(kt, vt, lane, a.scale_log2, qf, o, m, l, lim, lofs, kKeys / 16);
    }

    if (!warp_active) return;
    const bool final_out = !(a.linear && c >= 2);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        float lt = l[hh];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        const int r = wr0 + acc_row(lane, 2 * hh);
        if (r >= n_rows) continue;
        const int t = lo + r - p0;
        float *dst = a.out + ((size_t)t * a.H + h) * D + acc_col(lane, 0);
        bf16 *dst_b = final_out && a.out_bf16 ? a.out_bf16 + ((size_t)t * a.H + h) * D + acc_col(lane, 0) : nullptr;
        const float gam = softmax_factor(a, h);   /* lolcats' γ (1 for still) */
        const float inv = final_out ? gam / still_den_soft(gam * lt) : 1.0f;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            const float y0 = o[dt][2 * hh] * inv, y1 = o[dt][2 * hh + 1] * inv;
            if (dst_b) *reinterpret_cast<__nv_bfloat162 *>(dst_b + dt * 8) = __floats2bfloat162_rn(y0, y1);
            else *reinterpret_cast<float2 *>(dst + dt * 8) = make_float2(y0, y1);
        }
        if (!final_out && (lane & 3) == 0) a.lbuf[(size_t)t * a.H + h] = lt;
    }
}

}   // namespace

size_t smem_attn(int D) { return D == 64 ? attn_smem<64, true>() : attn_smem<128, false>(); }

namespace {
__global__ void wg_probe_kernel(int *out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}
}   // namespace

int attn_wg_available(stc_ctx *ctx, int *avail, still_err *err) {
    *avail = 0;
    if (ctx->attn_wg_probe >= 0) {   /* probed for an earlier state of this context */
        *avail = ctx->attn_wg_probe;
        return STILL_OK;
    }
    int *d = NULL, h = 0;
    int rc = stc_malloc(ctx, sizeof(int), "wgmma probe", (void **)&d, err);
    if (rc) return rc;
    wg_probe_kernel<<<1, 1, 0, ctx->stream>>>(d);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpyAsync(&h, d, sizeof h, cudaMemcpyDeviceToHost, ctx->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(ctx->stream);
    stc_free(ctx, d);
    if (e != cudaSuccess) return stc_cuda_fail(err, e, "wgmma probe", __FILE__, __LINE__);
    *avail = ctx->attn_wg_probe = h == 1;
    return STILL_OK;
}

int prepare_attn(int D, still_err *err) {
    if (D == 64) {
        STC_CUDA(err, cudaFuncSetAttribute(attn_kernel<64, false, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           attn_smem<64, false, true>()));
        STC_CUDA(err, cudaFuncSetAttribute(attn_kernel<64, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           attn_smem<64, true>()));
    } else {
        STC_CUDA(err, cudaFuncSetAttribute(attn_kernel<128, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           attn_smem<128, false>()));
    }
    return STILL_OK;
}

int launch_attn(stc_ctx *ctx, const args &a, still_err *err) {
    const dim3 grid((unsigned)(max_query_chunks(a.T, a.C) * row_tiles(a.C)), (unsigned)a.H);
    /* head dim 64: the wgmma path without the staging tiles (41 KB a block, four blocks an SM; a prefill's Local
     * tiles come from the call's half copies anyway), else mma.sync with the Local tiles staged; head dim 128:
     * mma.sync, Local tiles loaded in line. (The other variants, measured slower, are listed in dev/cuda/README.md.) */
    if (a.D == 64 && a.attn_wg)
        attn_kernel<64, false, true><<<grid, kThreads, attn_smem<64, false, true>(), ctx->stream>>>(a);
    else if (a.D == 64) attn_kernel<64, true><<<grid, kThreads, attn_smem<64, true>(), ctx->stream>>>(a);
    else attn_kernel<128, false><<<grid, kThreads, attn_smem<128, false>(), ctx->stream>>>(a);
    STC_LAUNCHED(err, "still attn_kernel");
    return STILL_OK;
}

}   // namespace stillk
