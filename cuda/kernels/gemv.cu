/* Decode-step matrix-vector products (one token), fused with the small
 * steps around them so that a decode step launches fewer kernels:
 *
 *   stc_gemv         y = W · x̂ + beta · y, x̂ = RMSNorm(x) · w or x itself
 *                    (o_proj and down_proj with the residual, the LM head
 *                    with the final norm);
 *   stc_gemv_swiglu  h = silu(W_gate · x̂) · (W_up · x̂), the FFN's input
 *                    side after its norm;
 *   stc_gemv_qkv     q | k | v (| the gate's pre-activations) = W · x̂,
 *                    then RoPE on the q and k rows and, optionally, bf16
 *                    copies of q, k and v (the KV cache's new row).
 *
 * Weights bf16 (rows of n_in, n_in a multiple of 8), x and the outputs fp32,
 * fp32 accumulation. Each block stages x̂ in shared memory (the norm
 * recomputed per block: n_in floats, cheaper than a launch), each warp
 * computes two rows with 16-byte weight loads. The RMSNorm and RoPE follow
 * elementwise.cu's float operations (src/model/model.c's rmsnorm() and rope()).
 *
 * On sm_90 the kernels are launched with Programmatic Dependent Launch: a
 * kernel's blocks start while the previous kernel finishes, issue their
 * weight loads (weights never change), and only then wait for the previous
 * kernel's results (stc_pdl_wait). The still decode kernel before o_proj
 * (linear_decode) and every gemv kernel trigger their successor at once. */
#include "common/cuda_common.cuh"

#include <math.h>
#include <string.h>

namespace {

enum { GEMV_WARPS = 4, GEMV_MAX_IN = 12288 };

enum gemv_mode { MODE_PLAIN, MODE_SWIGLU, MODE_QKV };

struct gemv_rope {
    int rot_rows;          /* rows 0 .. rot_rows-1 are rotated (q then k heads) */
    int D;                 /* head dim */
    int p0;
    const int *p0_dev;     /* non-NULL: the position is *p0_dev + p0 */
    float inv[128];        /* inv_freq[i] = (float)pow(theta, -2i/D) */
    bf16 *q_bf16, *k_bf16, *v_bf16;
    int qd, kvd;
};

__device__ __forceinline__ double block_sum_d(double v, double *part) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    double s = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += part[w];
    return s;
}

/* x̂ into xs (shared): x, or RMSNorm(x) · w as src/model/model.c computes it. */
__device__ __forceinline__ void stage_input(const float *__restrict__ x, const float *__restrict__ w, float eps,
                                            int n, float *xs) {
    __shared__ double part[GEMV_WARPS];
    if (!w) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = x[i];
    } else {
        double ss = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const double v = x[i];
            ss += v * v;
        }
        ss = block_sum_d(ss, part);
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = threadIdx.x; i < n; i += blockDim.x) xs[i] = __fmul_rn(__fmul_rn(x[i], scale), w[i]);
    }
    __syncthreads();
}

enum { GEMV_U = 4 };   /* 16-byte loads per row and lane issued before their sums */

/* The first batch of a warp's weight loads for rows r0 and r1 (r1 < 0: r0
 * twice), issued before the block stages its input. */
struct row_pair {
    const uint4 *w0, *w1;
    uint4 u0[GEMV_U], u1[GEMV_U];
};

__device__ __forceinline__ void load_batch(row_pair &rp, int c0, int n8) {
#pragma unroll
    for (int u = 0; u < GEMV_U; u++) {
        const int c = c0 + 32 * u;
        if (c < n8) rp.u0[u] = __ldg(rp.w0 + c), rp.u1[u] = __ldg(rp.w1 + c);
    }
}

/* Dot products of the pair with xs, summed over the warp (every lane gets
 * them); the first batch is already in rp. */
__device__ __forceinline__ void dot2(row_pair &rp, int n8, const float *xs, float &a0, float &a1) {
    const int lane = threadIdx.x & 31;
    float s0 = 0, s1 = 0;
    for (int c0 = lane; c0 < n8; c0 += 32 * GEMV_U) {
        if (c0 != lane) load_batch(rp, c0, n8);
#pragma unroll
        for (int u = 0; u < GEMV_U; u++) {
            const int c = c0 + 32 * u;
            if (c >= n8) break;
            const float4 xa = *reinterpret_cast<const float4 *>(xs + 8 * c);
            const float4 xb = *reinterpret_cast<const float4 *>(xs + 8 * c + 4);
            const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
            const __nv_bfloat162 *p0 = reinterpret_cast<const __nv_bfloat162 *>(&rp.u0[u]);
            const __nv_bfloat162 *p1 = reinterpret_cast<const __nv_bfloat162 *>(&rp.u1[u]);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f0 = __bfloat1622float2(p0[j]), f1 = __bfloat1622float2(p1[j]);
                s0 = fmaf(f0.x, xv[2 * j], s0), s0 = fmaf(f0.y, xv[2 * j + 1], s0);
                s1 = fmaf(f1.x, xv[2 * j], s1), s1 = fmaf(f1.y, xv[2 * j + 1], s1);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        s0 += __shfl_xor_sync(0xffffffffu, s0, o);
        s1 += __shfl_xor_sync(0xffffffffu, s1, o);
    }
    a0 = s0, a1 = s1;
}

/* One warp per pair of outputs:
 *   PLAIN   rows 2p, 2p+1 -> y (+ beta y)
 *   SWIGLU  rows p (gate) and ff + p (up) -> y[p] = silu(gate) · up   (n_out = ff)
 *   QKV     rows 2p, 2p+1 -> y, rotated as pair p of its head when 2p < rot_rows */
template <int MODE>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(const float *__restrict__ x, const float *__restrict__ norm_w, float eps, int n_in,
                const bf16 *__restrict__ W, int n_out, float *y, float beta, const gemv_rope rope) {
    extern __shared__ float4 smem_f4[];
    float *xs = reinterpret_cast<float *>(smem_f4);
    const int p = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int n_pairs = MODE == MODE_SWIGLU ? n_out : (n_out + 1) / 2;
    const bool active = p < n_pairs;
    const int r0 = MODE == MODE_SWIGLU ? p : 2 * p;
    const int r1 = MODE == MODE_SWIGLU ? n_out + p : (2 * p + 1 < n_out ? 2 * p + 1 : -1);
    const int n8 = n_in / 8;
    row_pair rp;
    stc_pdl_trigger();   /* the next matrix-vector kernel may start loading its weights */
    if (active) {   /* the weights do not depend on earlier kernels: their loads go out first */
        rp.w0 = reinterpret_cast<const uint4 *>(W + (size_t)r0 * n_in);
        rp.w1 = reinterpret_cast<const uint4 *>(W + (size_t)(r1 >= 0 ? r1 : r0) * n_in);
        load_batch(rp, threadIdx.x & 31, n8);
    }
    stc_pdl_wait();      /* x and y come from earlier kernels */
    stage_input(x, norm_w, eps, n_in, xs);
    if (!active) return;
    float a0, a1;
    dot2(rp, n8, xs, a0, a1);
    if ((threadIdx.x & 31) != 0) return;
    if (MODE == MODE_SWIGLU) {
        /* silu(g) · u as elementwise.cu's swiglu_kernel */
        y[p] = a0 / (1.0f + expf(-a0)) * a1;
        return;
    }
    if (MODE == MODE_QKV && r0 < rope.rot_rows) {
        const int i = (r0 % rope.D) / 2;
        const int pos = rope.p0 + (rope.p0_dev ? *rope.p0_dev : 0);
        float sn, cs;
        sincosf((float)pos * rope.inv[i], &sn, &cs);
        const float b0 = a0 * cs - a1 * sn, b1 = a0 * sn + a1 * cs;
        a0 = b0, a1 = b1;
    }
    if (beta != 0.0f) {
        a0 += beta * y[r0];
        if (r1 >= 0) a1 += beta * y[r1];
    }
    y[r0] = a0;
    if (r1 >= 0) y[r1] = a1;
    if (MODE == MODE_QKV) {
        const int qd = rope.qd, kvd = rope.kvd;
        for (int e = 0; e < 2; e++) {
            const int r = e ? r1 : r0;
            const float val = e ? a1 : a0;
            if (r < 0) continue;
            bf16 *dst = r < qd ? rope.q_bf16 : r < qd + kvd ? rope.k_bf16 : r < qd + 2 * kvd ? rope.v_bf16 : NULL;
            const int off = r < qd ? r : r < qd + kvd ? r - qd : r - qd - kvd;
            if (dst) dst[off] = __float2bfloat16_rn(val);
        }
    }
}

int check_args(const float *x, int n_in, const stc_bf16 *W, int n_out, const float *y, still_err *err) {
    if (!x || !W || !y) return stc_fail(err, STILL_E_ARG, "gemv: NULL tensor");
    if (n_in <= 0 || n_out <= 0 || n_in % 8 || n_in > GEMV_MAX_IN)
        return stc_fail(err, STILL_E_ARG, "gemv: %d inputs (a positive multiple of 8, at most %d), %d outputs", n_in,
                        (int)GEMV_MAX_IN, n_out);
    if (((uintptr_t)W | (uintptr_t)x) & 15) return stc_fail(err, STILL_E_ARG, "gemv: W and x must be 16-byte aligned");
    return STILL_OK;
}

template <int MODE>
int launch(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W, int n_out,
           float *y, float beta, const gemv_rope &rope, still_err *err) {
    const int n_pairs = MODE == MODE_SWIGLU ? n_out : (n_out + 1) / 2;
    const unsigned blocks = (unsigned)((n_pairs + GEMV_WARPS - 1) / GEMV_WARPS);
    const size_t smem = (size_t)n_in * sizeof(float);
    /* the default 48 KB covers the static shared memory too (stage_input's sums): raise it with a margin */
    if (smem > 47 * 1024)
        STC_CUDA(err, cudaFuncSetAttribute(gemv_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    /* launched with programmatic serialization: the kernel starts while the previous one finishes, loads its
     * weights, then waits for it (stc_pdl_wait) */
    STC_CUDA(err, stc_launch_pdl(ctx, gemv_kernel<MODE>, dim3(blocks), dim3(GEMV_WARPS * 32), smem, x, norm_w, eps,
                                 n_in, (const bf16 *)W, n_out, y, beta, rope));
    return STILL_OK;
}

}  // namespace

int stc_gemv(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W, int n_out,
             float *y, float beta, still_err *err) {
    STC_ENTER(ctx, err);
    int rc = check_args(x, n_in, W, n_out, y, err);
    if (rc) return rc;
    gemv_rope none;
    memset(&none, 0, sizeof none);
    return launch<MODE_PLAIN>(ctx, x, norm_w, eps, n_in, W, n_out, y, beta, none, err);
}

int stc_gemv_swiglu(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W_gate_up,
                    int ff, float *h, still_err *err) {
    STC_ENTER(ctx, err);
    int rc = check_args(x, n_in, W_gate_up, ff, h, err);
    if (rc) return rc;
    gemv_rope none;
    memset(&none, 0, sizeof none);
    return launch<MODE_SWIGLU>(ctx, x, norm_w, eps, n_in, W_gate_up, ff, h, 0.0f, none, err);
}

int stc_gemv_qkv(stc_ctx *ctx, const float *x, const float *norm_w, float eps, int n_in, const stc_bf16 *W, int n_out,
                 float *y, const stc_gemv_rope *r, still_err *err) {
    STC_ENTER(ctx, err);
    int rc = check_args(x, n_in, W, n_out, y, err);
    if (rc) return rc;
    if (!r) return stc_fail(err, STILL_E_ARG, "gemv_qkv: NULL rope");
    const int qd = r->n_head * r->head_dim, kvd = r->n_head_kv * r->head_dim;
    if (r->head_dim <= 0 || r->head_dim % 2 || r->head_dim > 256 || r->n_head <= 0 || r->n_head_kv < 0 ||
        qd + 2 * kvd > n_out)
        return stc_fail(err, STILL_E_ARG, "gemv_qkv: %d + 2 · %d q, k, v rows of head dim %d do not fit %d outputs", qd,
                        kvd, r->head_dim, n_out);
    gemv_rope g;
    memset(&g, 0, sizeof g);
    g.rot_rows = r->rotate ? qd + kvd : 0;
    g.D = r->head_dim, g.p0 = r->p0, g.p0_dev = r->p0_dev;
    for (int i = 0; i < r->head_dim / 2; i++) g.inv[i] = (float)pow((double)r->theta, -2.0 * i / r->head_dim);
    g.q_bf16 = (bf16 *)r->q_bf16, g.k_bf16 = (bf16 *)r->k_bf16, g.v_bf16 = (bf16 *)r->v_bf16;
    g.qd = qd, g.kvd = kvd;
    return launch<MODE_QKV>(ctx, x, norm_w, eps, n_in, W, n_out, y, 0.0f, g, err);
}
