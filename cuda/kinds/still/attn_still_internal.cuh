/* Internal to the still attention kind on the GPU: the state and workspace
 * layouts, the arguments every kernel takes, device helpers shared by the
 * kernel files, and the launch functions cuda/kinds/still/attn_still.cu calls in order:
 *
 *   1. (gate) pre = x · Wgᵀ                      cuBLASLt, stc_gemm_bf16
 *   2. score    routing scores of the call's tokens          attn_still_score.cu
 *   3. leave    per leaving chunk × head: selection, Sel append,
 *               the fold's ΔS, Δz into prefix slot k          attn_still_leave.cu
 *   4. scan     prefix sums of the slots (+ the state's S, z)  attn_still_leave.cu
 *   5. attn     softmax part over Sel ∪ Local (tensor cores)   attn_still_attn.cu
 *   6. linear   φq, φqᵀ[S | z], gate, the final division       attn_still_linear.cu
 *   7. finish   ring, ring scores, S / z commit, n_seen += T   attn_still_leave.cu
 * A decode step (T = 1) runs 2, 5 and 6 as attn_still_decode.cu's kernels.
 *
 * Every kernel reads the position p0 from the device counter and derives
 * its work from stillk::make_geom(p0, T, C) (attn_still_layout.cuh). */
#ifndef STILL_CUDA_ATTN_STILL_INTERNAL_CUH
#define STILL_CUDA_ATTN_STILL_INTERNAL_CUH

#include "kinds/still/attn_still_layout.cuh"
#include "common/cuda_common.cuh"

/* Buffers of a call, grown on demand, possibly shared by several states. */
enum { WS_SC = 0, WS_SLOTS, WS_LBUF, WS_PRE, WS_WG, WS_PART,
       WS_WIMG,   /* long calls: the feature maps' W split into bf16 tiles as the kernels hold them (launch_wimage) */
       /* stage-1 training only (stc_still_distill): outputs, dL/dpre, dS per query chunk, selected flags */
       WS_TY, WS_TDPRE, WS_TDS, WS_TFLAG, WS_COUNT };

struct stc_still_ws {
    int refs;
    void *buf[WS_COUNT];
    size_t bytes[WS_COUNT];
};

struct stc_still {
    stc_ctx *ctx;
    stc_still_config cfg;
    stc_still_info info;
    int H, Hk, G, D, C, P, Hs, d, lam, cap, sel_rows;   /* sel_rows = max(cap, 1) */
    /* device state */
    float *ring_k, *ring_v;   /* [2C][Hk][D]: position pos in row pos % 2C */
    double *ring_sc;          /* [H][2C] routing scores of the positions in the ring */
    __half *sel_k, *sel_v;    /* [Hs][sel_rows][D], IEEE half (as the CPU's default --sel-cache f16); NULL with sel_q8 */
    int8_t *sel_k8, *sel_v8;  /* sel_q8 (--sel-cache q8): [Hs][sel_rows][D] signed bytes, */
    float *sel_ks, *sel_vs;   /* ... and [Hs][sel_rows] a scale per key and per value (src/kinds/still/attn_still.c's quantize_q8) */
    int sel_q8;
    int32_t *sel_pos;         /* [Hs][sel_rows] */
    double *sel_sc;           /* global selection: [Hs][sel_rows] routing score of each slot, */
    int32_t *sel_order;       /* [Hs][sel_rows] the slots best first, */
    __half *ev_k, *ev_v;      /* [Hs][C][D] the entries a leave evicts (as stored), */
    int8_t *ev_k8, *ev_v8;    /* ... (sel_q8: [Hs][C][D] bytes as stored, */
    float *ev_ks, *ev_vs;     /* ... and [Hs][C] their scales), */
    int *ev_n, *g_picked;     /* [Hs] how many; [Hs][C] the leaving chunk's kept tokens (scratch of a call) */
    float *lin;               /* S [H][P][D], then z [H][P] */
    int *n_seen_dev;
    int *done_dev;            /* finish_kernel's block counter (args.done) */
    int n_seen;               /* host mirror; -1 unknown (after STC_STILL_P0_DEVICE calls) */
    size_t state_bytes;
    const stc_bf16 *wg_user;
    stc_still_ws *ws;
    int no_decode_kernels;    /* 1: T = 1 calls take the chunk-parallel kernels too */
    int decode_split;         /* keys per attention block of a decode step (STILL_CUDA_DECODE_SPLIT: 32, 64 or 128) */
    int attn_wg;              /* the attention on wgmma (head dim 64, sm_90a code loaded; STILL_CUDA_ATTN_WGMMA=0: mma.sync) */
    int npmap_wg;             /* the feature maps' z = x̃ Wᵀ on wgmma in sm_90a code (head dim 64; STILL_CUDA_NPMAP_WGMMA=0: mma.sync) */
    int decode_no_leave;      /* 1: the caller says no chunk leaves in the coming T = 1 calls (skip leave, scan) */
    const float *decode_pre;  /* T = 1: the gate's x·Wgᵀ, computed by the caller (NULL: the forward's GEMM) */
    int bwd_ready;            /* stc_still_distill has raised its kernels' shared-memory limits */
    int grad_tf32;            /* the gate's weight gradient in TF32 (STILL_CUDA_GRAD_TF32=0: fp32) */
};

namespace stillk {

/* What every kernel gets (by value). */
struct args {
    /* shape and options */
    int H, Hk, G, D, C, P, Hs, d, lam, cap, sel_rows;
    fast_div fd_c, fd_rt;     /* x / C and x / row_tiles(C) (make_fast_div) */
    int per_kv, routing, linear, gate;
    int gate_den;         /* the gate scales the linear term of the denominator too, per channel (needs gate) */
    int lolcats;          /* Hedgehog maps, γ on the softmax sums, the lolcats parameter layout */
    uint64_t seed;
    float scale;          /* 1 / sqrt(D) */
    float scale_log2;     /* log2(e) / sqrt(D) */
    size_t slot_floats;   /* H·P·(D+1): one copy of S and z */
    /* the call */
    int T;
    int *n_seen;          /* device position: read at the start of every kernel, advanced by finish */
    int *done;            /* blocks of finish_kernel that have finished (0 between calls) */
    int decode_split;     /* keys per attention block of a decode step: 32, 64 or 128 */
    int npmap_wg;         /* linear and leave: the feature map's z product on wgmma (where the code is sm_90a) */
    int attn_wg;          /* the attention kernel on the warpgroup's wgmma */
    const float *q, *k, *v, *params, *pre;
    size_t ldq, ldkv, ldpre;   /* floats from one token's row of q (k and v; pre) to the next: H·D (Hk·D; H·D),
                                * or the row of a fused q | k | v | pre matrix (stc_still_forward_qkv) */
    const unsigned char *wimg;     /* non-NULL: the feature maps' image (launch_wimage), wimg_bytes per (side, head) */
    const __half *k_f16, *v_f16;   /* non-NULL: the call's k and v in half, rows packed [T][Hk][D]
                                    * (stc_still_forward_qkv): Local tiles and Sel entries copied from them */
    float *out;
    bf16 *out_bf16;       /* non-NULL: finished outputs go here in bf16 instead of to out (out keeps o and the like) */
    int out_first;        /* call rows before this one need no output: blocks with only such rows return */
    /* state */
    float *ring_k, *ring_v, *lin;
    double *ring_sc;
    __half *sel_k, *sel_v;
    int sel_q8;           /* Sel in 8 bits (--sel-cache q8): sel_k8 / sel_v8 and a scale per row; sel_k, sel_v NULL */
    int8_t *sel_k8, *sel_v8;
    float *sel_ks, *sel_vs;
    int32_t *sel_pos;
    int sel_global;       /* global selection (attn_still_global.cu): its state and scratch */
    int sel_span;         /* ... ranking by the best score within sel_span positions */
    double *sel_sc;
    int32_t *sel_order;
    __half *ev_k, *ev_v;
    int8_t *ev_k8, *ev_v8;
    float *ev_ks, *ev_vs;
    int *ev_n, *g_picked;
    /* workspace */
    double *sc;           /* [H][T] routing scores of positions p0 .. p0+T-1 */
    float *slots;         /* [max_leaves(T)][slot_floats] */
    float *lbuf;          /* [T][H] softmax denominators of rows finished by the linear kernel */
};

/* Parameter offsets (floats) by src/kinds/still/attn_still_rules.h, the CPU's layout (still's NP-Maps and gate; lolcats'
 * Hedgehog maps with F = D here and its window factors). */
__host__ __device__ inline size_t par_q_u(const args &a, int h) { return still_par_u(a.H, a.D, 0, h); }
__host__ __device__ inline size_t par_k_u(const args &a, int h) { return still_par_u(a.H, a.D, 1, h); }
__host__ __device__ inline size_t par_q_w(const args &a, int h) {
    return a.lolcats ? lolcats_par_w(a.H, a.D, a.D, 0, h) : still_par_w(a.H, a.D, a.D, 0, 0, h);
}
__host__ __device__ inline size_t par_k_w(const args &a, int h) {
    return a.lolcats ? lolcats_par_w(a.H, a.D, a.D, 1, h) : still_par_w(a.H, a.D, a.D, 0, 1, h);
}
__host__ __device__ inline size_t par_lol_w(const args &a, int h) { return lolcats_par_factor(a.H, a.D, a.D, h); }
__host__ __device__ inline size_t par_wg(const args &a) { return still_par_wg(a.H, a.D, a.D, 0); }
__host__ __device__ inline size_t par_bg(const args &a) { return still_par_bg(a.H, a.D, a.D, 0, a.d); }

/* Routings whose per-token scores the score kernels compute. */
__host__ __device__ inline bool uses_token_scores(int routing) {
    return routing == R_SALIENCY || routing == R_QK || routing == R_KEYNORM;
}

#ifdef __CUDACC__
/* Key (which = 0) or value (1) row of KV head hk at position pos: the ring
 * for positions before the call, the call's input from p0 on. */
__device__ __forceinline__ const float *kv_row(const args &a, int p0, int pos, int hk, int which) {
    if (pos < p0) return (which ? a.ring_v : a.ring_k) + ((size_t)(pos % (2 * a.C)) * a.Hk + hk) * a.D;
    return (which ? a.v : a.k) + (size_t)(pos - p0) * a.ldkv + (size_t)hk * a.D;
}
/* Query row of head h for the call's token t (0-based in the call). */
__device__ __forceinline__ const float *q_row(const args &a, int t, int h) {
    return a.q + (size_t)t * a.ldq + (size_t)h * a.D;
}
/* Routing score of query head h for position pos (ring before the call). */
__device__ __forceinline__ double *score_ptr(const args &a, int p0, int h, int pos) {
    if (pos < p0) return a.ring_sc + (size_t)h * 2 * a.C + pos % (2 * a.C);
    return a.sc + (size_t)h * a.T + (pos - p0);
}

/* Selection head hs's routing value of position pos (src/kinds/still/attn_still.c's leave_score_1): random, the hash;
 * else the scores of its query heads summed in head order, qk's divided by C. NaN is the caller's. */
__device__ __forceinline__ double route_value(const args &a, int p0, int hs, int pos) {
    if (a.routing == R_RANDOM) return route_random(a.seed, hs, pos);
    const int h0 = a.per_kv ? hs * a.G : hs, nh = a.per_kv ? a.G : 1;
    double v = 0.0;
    for (int hh = h0; hh < h0 + nh; hh++) {
        v += still_route_term(a.routing, *score_ptr(a, p0, hh, pos), a.C);
    }
    return v;
}

/* σ(x) for every kernel of the kind, prefill, decode and training alike: the gate g = σ(pre + b_g) and
 * lolcats' window factor γ = σ(w_h). The fast exponential and division (about 2^-21 relative): the accurate
 * expf and IEEE division took a sixth of the prefill linear kernel's issue slots in its epilogue. */
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

/* lolcats' window factor γ = σ(w_h); 1 for still. */
__device__ __forceinline__ float softmax_factor(const args &a, int h) {
    return a.lolcats ? sigmoid(a.params[par_lol_w(a, h)]) : 1.0f;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sel in 8 bits (--sel-cache q8), by attn_still_rules.h's still_q8_* as the CPU's quantize_q8. One warp quantizes one row of D
 * floats (D a multiple of 32, at most 128), lane holding elements lane, lane + 32, ...; returns s to every
 * lane. */
template <int D>
__device__ __forceinline__ float q8_row_warp(const float *x, int8_t *out, int lane) {
    static_assert(D % 32 == 0 && D <= 128, "a warp's row");
    constexpr int E = D / 32;
    float v[E], amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; e++) v[e] = x[lane + 32 * e], amax = fmaxf(amax, fabsf(v[e]));
    amax = warp_max(amax);
    const float inv = still_q8_inv(amax);   /* attn_still_rules.h */
#pragma unroll
    for (int e = 0; e < E; e++) out[lane + 32 * e] = (int8_t)still_q8_level(v[e], inv);
    return still_q8_scale(amax);
}
/* The same for the head dims the GPU takes (64, 128), chosen at run time. */
__device__ __forceinline__ float q8_row_warp_d(const float *x, int8_t *out, int D, int lane) {
    return D == 64 ? q8_row_warp<64>(x, out, lane) : q8_row_warp<128>(x, out, lane);
}

/* Sel entry e of selection head hs into its slot: the key and value rows of position pos, as stored (half,
 * or 8 bits and a scale). One warp a row (with sel_q8; the half path's lanes copy elements). */
__device__ __forceinline__ void sel_store_warp(const args &a, int p0, int hs, int hk, int slot, int pos, int lane) {
    const size_t row = (size_t)hs * a.sel_rows + slot;
    const float *k = kv_row(a, p0, pos, hk, 0), *v = kv_row(a, p0, pos, hk, 1);
    if (a.sel_q8) {
        const float sk = q8_row_warp_d(k, a.sel_k8 + row * a.D, a.D, lane);
        const float sv = q8_row_warp_d(v, a.sel_v8 + row * a.D, a.D, lane);
        if (lane == 0) a.sel_ks[row] = sk, a.sel_vs[row] = sv;
    } else {
        for (int x = lane; x < a.D; x += 32)
            a.sel_k[row * a.D + x] = __float2half_rn(k[x]), a.sel_v[row * a.D + x] = __float2half_rn(v[x]);
    }
}

/* Step 7, the end of a call, by the blocks of the call's last kernel
 * (finish_kernel, a decode step's merge), which have read the position p0; thread i of stride copies elements i, i + stride, ...: the
 * call's last positions into the ring (keys, values, routing scores), and
 * S, z <- the last prefix slot when chunks left. */
__device__ __forceinline__ void finish_copy(const args &a, int p0, int i, int stride) {
    const call_geom g = make_geom(p0, a.T, a.C);
    const int C2 = 2 * a.C, row = a.Hk * a.D;   /* row: a multiple of 4 */
    const int end = p0 + a.T, first = smax(p0, g.end_lo);
    /* keys and values of positions first .. end-1 (the ring keeps end_lo .. end-1;
     * end_lo .. p0-1 are there already) */
    const int n4 = (end - first) * (row / 4);
    for (int e = i; e < n4; e += stride) {
        const int pos = first + e / (row / 4), off = (e % (row / 4)) * 4;
        const size_t src = (size_t)(pos - p0) * a.ldkv + off, dst = (size_t)(pos % C2) * row + off;
        *reinterpret_cast<float4 *>(a.ring_k + dst) = *reinterpret_cast<const float4 *>(a.k + src);
        *reinterpret_cast<float4 *>(a.ring_v + dst) = *reinterpret_cast<const float4 *>(a.v + src);
    }
    if (uses_token_scores(a.routing)) {
        const int n = end - first;
        for (int e = i; e < a.H * n; e += stride) {
            const int h = e / n, pos = first + e % n;
            a.ring_sc[(size_t)h * C2 + pos % C2] = __ldcg(a.sc + (size_t)h * a.T + (pos - p0));   /* maybe this grid's */
        }
    }
    if (a.linear && g.n_leaves > 0) {
        const float4 *src = reinterpret_cast<const float4 *>(a.slots + (size_t)(g.n_leaves - 1) * a.slot_floats);
        float4 *dst = reinterpret_cast<float4 *>(a.lin);
        for (size_t e = i; e < a.slot_floats / 4; e += stride) dst[e] = src[e];
    }
}

/* Then every block of that kernel: the block that arrives last (a.done
 * counts them; every block has read the position by then) advances
 * n_seen to p0 + T and clears the counter. */
__device__ __forceinline__ void finish_arrive(const args &a, int p0) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(a.done, 1) == (int)(gridDim.x * gridDim.y * gridDim.z) - 1) {
            *a.done = 0;
            *a.n_seen = p0 + a.T;
        }
    }
}
#endif

/* Launches (each checks its launch). prepare_* raise the kernels' shared
 * memory limits for a head dim (at every state creation; cheap). */
int prepare_score(int D, still_err *err);
int prepare_leave(int D, size_t limit, still_err *err);
int prepare_attn(int D, still_err *err);
/* Whether the attention kernel's wgmma path is in the code loaded on the device (sm_90a machine code). */
int attn_wg_available(stc_ctx *ctx, int *avail, still_err *err);
int prepare_linear(int D, still_err *err);
int launch_score(stc_ctx *ctx, const args &a, still_err *err);
int launch_leave(stc_ctx *ctx, const args &a, still_err *err);
/* global selection (attn_still_global.cu): the leave of a call's first position, if it starts a chunk >= 2 */
constexpr int kGlobalMaxCap = 8192;
size_t smem_global(int D, int C, int cap);
int prepare_global(int D, int C, int cap, still_err *err);
int launch_global_leave(stc_ctx *ctx, const args &a, still_err *err);
/* stream: NULL for the context's stream (still_forward runs the scan on the side stream beside the
 * attention kernel, which does not read the linear state) */
int launch_scan(stc_ctx *ctx, const args &a, still_err *err, cudaStream_t stream = nullptr);
int launch_attn(stc_ctx *ctx, const args &a, still_err *err);
int launch_linear(stc_ctx *ctx, const args &a, still_err *err);
/* The image of every head's q- and k-map for the tensor-core kernels (fmap_load_3's shared-memory bytes, then u):
 * wimg_bytes(D) a (side, head), side-major; the linear and leave kernels copy theirs by cp.async. */
size_t wimg_bytes(int D);
int launch_wimage(stc_ctx *ctx, const args &a, unsigned char *img, still_err *err);
int launch_finish(stc_ctx *ctx, const args &a, still_err *err);
/* Decode steps (T = 1, attn_still_decode.cu): step 2, and steps 5 + 6 through
 * per-split partials in part ([H][decode_splits][D + 2] floats). */
int prepare_decode(int D, still_err *err);
int decode_splits(int cap, int C, int split_keys);   /* key blocks of a decode step: Sel (cap) + Local (<= 2C) */
int launch_score_decode(stc_ctx *ctx, const args &a, still_err *err);
int launch_attn_linear_decode(stc_ctx *ctx, const args &a, float *part, still_err *err);
/* Whether launch_attn_linear_decode computes the token's routing scores too
 * (then launch_score_decode is not called); it always does step 7 (finish). */
bool decode_fuses_score(const args &a);
/* Dynamic shared memory of the kernels (bytes) for a shape. */
size_t smem_leave(int D, int C);
size_t smem_linear(int D);
size_t smem_score(int D, int C);
size_t smem_attn(int D);

}   // namespace stillk

#endif
