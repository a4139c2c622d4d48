/* The Llama forward pass's small kernels (src/model/model.c's forward_chunk):
 * embedding gather, RMSNorm, RoPE, SwiGLU, residual add, fp32 -> bf16, and
 * the greedy argmax. All memory-bound; each follows the CPU code's float
 * operations in the same order, so results differ from the CPU's only by the
 * libm-vs-CUDA differences of sincos / exp (a couple of ulps) and the order
 * of the RMSNorm sum (done in double, as on the CPU). */
#include "common/cuda_common.cuh"

#include <cuda_fp16.h>

#include <limits.h>
#include <math.h>

namespace {

/* ---- embedding ------------------------------------------------------------------ */

__global__ void embed_bf16_kernel(const bf16 *__restrict__ table, int64_t n_vocab, int d,
                                  const int32_t *__restrict__ tokens, float *__restrict__ out) {
    const int t = blockIdx.x;
    const int32_t tok = tokens[t];
    float *o = out + (size_t)t * d;
    const bool ok = tok >= 0 && tok < n_vocab;
    const bf16 *row = table + (size_t)(ok ? tok : 0) * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = ok ? __bfloat162float(row[c]) : __int_as_float(0x7fc00000);
}

/* ---- RMSNorm: a block per long row, a warp per short one ---------------------------- */

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every
 * thread gets the result. */
__device__ double block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < n_warps ? part[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* out may alias x: each thread rewrites only the elements it read. */
__global__ void rmsnorm_kernel(const float *x, const float *__restrict__ w, int n, float eps, float *out,
                               bf16 *__restrict__ out_bf16) {
    const size_t base = (size_t)blockIdx.x * n;
    double ss = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const double v = x[base + i];
        ss += v * v;
    }
    ss = block_sum(ss);
    const float scale = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float y = __fmul_rn(__fmul_rn(x[base + i], scale), w[i]);
        if (out) out[base + i] = y;
        if (out_bf16) out_bf16[base + i] = __float2bfloat16_rn(y);
    }
}

enum { RMSNORM_WARP_MAX = 32 * 64, RMSNORM_REG_MAX_ROWS = 2048 };
static_assert(RMSNORM_WARP_MAX <= 32 * 64, "the register kernel's largest VPL is 64");

/* The same for short rows (n <= RMSNORM_WARP_MAX), a warp per row: no block-wide reduction; x is read
 * twice (the second time from the caches). Used for many rows: 16K rows of 576 (37.7 MB in, 18.9 MB of
 * bf16 out) take 25 µs, about 2.2 TB/s, against 38 µs for the register version below. */
__global__ void rmsnorm_rows_kernel(const float *x, const float *__restrict__ w, int T, int n, float eps, float *out,
                                    bf16 *__restrict__ out_bf16) {
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < T; row += gridDim.x * warps) {
        const size_t base = (size_t)row * n;
        double ss = 0;
#pragma unroll 4
        for (int i = lane; i < n; i += 32) {
            const double v = x[base + i];
            ss += v * v;
        }
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = lane; i < n; i += 32) {
            const float y = __fmul_rn(__fmul_rn(x[base + i], scale), w[i]);
            if (out) out[base + i] = y;
            if (out_bf16) out_bf16[base + i] = __float2bfloat16_rn(y);
        }
    }
}

/* The same with a lane's VPL elements (i = lane + 32 j) and weights in
 * registers, so all of a row's loads are in flight at once: for few rows
 * (1,024 rows of 576, about one wave: 5.3 µs, against 9.2 µs for the loop
 * above, which waits on loads after stores). The sums run in the same order
 * (each lane over its j, then the shuffles), so both give the same bits.
 * out may alias x. */
template <int VPL>
__global__ void rmsnorm_rows_reg_kernel(const float *x, const float *__restrict__ w, int T, int n, float eps,
                                        float *out, bf16 *__restrict__ out_bf16) {
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < T; row += gridDim.x * warps) {
        const size_t base = (size_t)row * n;
        float v[VPL], wv[VPL];   /* the weights too: a load after a store would wait a round trip each */
#pragma unroll
        for (int j = 0; j < VPL; j++) {
            const bool in = lane + 32 * j < n;
            v[j] = in ? x[base + lane + 32 * j] : 0.0f;
            wv[j] = in ? w[lane + 32 * j] : 0.0f;
        }
        double ss = 0;
#pragma unroll
        for (int j = 0; j < VPL; j++)
            if (lane + 32 * j < n) ss += (double)v[j] * v[j];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
#pragma unroll
        for (int j = 0; j < VPL; j++) {
            const int i = lane + 32 * j;
            if (i < n) {
                const float y = __fmul_rn(__fmul_rn(v[j], scale), wv[j]);
                if (out) out[base + i] = y;
                if (out_bf16) out_bf16[base + i] = __float2bfloat16_rn(y);
            }
        }
    }
}

/* Many rows with n a multiple of 64 (at most 64 PMAX): a warp a row, lane L
 * holding the pairs L + 32 j (floats 2L + 64 j and the next) in registers,
 * loaded as float2 before any arithmetic, written as float2 / bf16x2 (the
 * loop kernel above moves a float a lane, reads x twice and stores 2-byte
 * bf16s). The sum of squares in double as the others (its order differs:
 * the scale can differ from theirs in the last bit, rarely). */
template <int PMAX>
__global__ void __launch_bounds__(256) rmsnorm_pairs_kernel(const float *x, const float *__restrict__ w, int T, int n,
                                                            float eps, float *out, bf16 *__restrict__ out_bf16) {
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31, np = n / 64;
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < T; row += gridDim.x * warps) {
        const float2 *xr = reinterpret_cast<const float2 *>(x + (size_t)row * n);
        float2 v[PMAX];
#pragma unroll
        for (int j = 0; j < PMAX; j++) v[j] = j < np ? xr[lane + 32 * j] : make_float2(0.0f, 0.0f);
        double ss = 0;
#pragma unroll
        for (int j = 0; j < PMAX; j++)
            if (j < np) ss += (double)v[j].x * v[j].x + (double)v[j].y * v[j].y;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float scale = (float)(1.0 / sqrt(ss / n + eps));
        const float2 *wr = reinterpret_cast<const float2 *>(w);
#pragma unroll
        for (int j = 0; j < PMAX; j++) {
            if (j >= np) break;
            const int i = lane + 32 * j;
            const float2 wv = wr[i];
            const float2 y = make_float2(__fmul_rn(__fmul_rn(v[j].x, scale), wv.x), __fmul_rn(__fmul_rn(v[j].y, scale), wv.y));
            if (out) reinterpret_cast<float2 *>(out + (size_t)row * n)[i] = y;
            if (out_bf16) reinterpret_cast<__nv_bfloat162 *>(out_bf16 + (size_t)row * n)[i] = __floats2bfloat162_rn(y.x, y.y);
        }
    }
}

/* ---- RoPE: one thread per (token, pair), looping over the heads ---------------------- */

enum { ROPE_MAX_PAIRS = 128 };   /* head dim <= 256 */

struct rope_freqs {
    float inv[ROPE_MAX_PAIRS];
};

/* A pair of floats into a copy of type CT (bf16: the softmax kinds' caches; IEEE half: still's Local keys). */
__device__ __forceinline__ void store_pair_as(bf16 *dst, float2 r) {
    *reinterpret_cast<__nv_bfloat162 *>(dst) = __floats2bfloat162_rn(r.x, r.y);
}
__device__ __forceinline__ void store_pair_as(__half *dst, float2 r) {
    *reinterpret_cast<__half2 *>(dst) = __floats2half2_rn(r.x, r.y);
}

/* The pairs at off + h·D of n heads (rows of the input at v; of the copy at vb, off_b + h·D), in batches
 * whose loads are all issued before the batch's stores: one head at a time, each load waited behind the
 * previous head's store (the compiler cannot tell that they never overlap), and the pass ran well below
 * the memory's bandwidth. rotate false: v's copy alone (v not written). */
template <class CT>
__device__ __forceinline__ void rotate_heads(float *v, CT *vb, int n, size_t off, size_t off_b, int D, float cs, float sn,
                                             bool rotate) {
    constexpr int NB = 8;
    for (int h0 = 0; h0 < n; h0 += NB) {
        float2 p[NB];
#pragma unroll
        for (int j = 0; j < NB; j++)
            if (h0 + j < n) p[j] = *reinterpret_cast<const float2 *>(v + off + (size_t)(h0 + j) * D);
#pragma unroll
        for (int j = 0; j < NB; j++) {
            if (h0 + j >= n) break;
            const float2 r = rotate ? make_float2(p[j].x * cs - p[j].y * sn, p[j].x * sn + p[j].y * cs) : p[j];
            if (rotate) *reinterpret_cast<float2 *>(v + off + (size_t)(h0 + j) * D) = r;
            if (vb) store_pair_as(vb + off_b + (size_t)(h0 + j) * D, r);
        }
    }
}

/* p0_dev non-NULL: the first position is *p0_dev + p0 (graph-capturable decode).
 * Copies (CT, rows packed, each optional): q_c and k_c of the rotated q and k, v_c of v (not rotated; its
 * rows ldv floats apart). */
template <class CT>
__global__ void rope_kernel(float *q, float *k, int64_t ldq, int64_t ldk, int T, int H, int Hk, int D, int p0,
                            const int *p0_dev, const rope_freqs f, CT *q_c, CT *k_c, const float *v, int64_t ldv,
                            CT *v_c) {
    const int half = D / 2;
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)T * half) return;
    const int t = (int)(idx / half), i = (int)(idx % half);
    const int first = p0_dev ? *p0_dev + p0 : p0;
    /* as model.c: the angle rounded to float, then cos / sin of it */
    const float angle = (float)(first + t) * f.inv[i];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    if (q) rotate_heads(q, q_c, H, (size_t)t * ldq + 2 * i, (size_t)t * H * D + 2 * i, D, cs, sn, true);
    if (k) rotate_heads(k, k_c, Hk, (size_t)t * ldk + 2 * i, (size_t)t * Hk * D + 2 * i, D, cs, sn, true);
    /* v is not rotated: only its copy, in the same pass */
    if (v_c) rotate_heads(const_cast<float *>(v), v_c, Hk, (size_t)t * ldv + 2 * i, (size_t)t * Hk * D + 2 * i, D, cs, sn,
                          false);
}

/* ---- SwiGLU, add, conversion ------------------------------------------------------- */

/* A block per row (grid-stride over rows): no division per element. */
__global__ void swiglu_kernel(const float *__restrict__ gate, const float *__restrict__ up, int rows, int cols,
                              int64_t ld, bf16 *__restrict__ out_bf16, float *__restrict__ out_f32) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *g = gate + (int64_t)r * ld, *u = up + (int64_t)r * ld;
        const int64_t o = (int64_t)r * cols;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            const float gv = g[c], uv = u[c];
            const float y = gv / (1.0f + expf(-gv)) * uv;
            if (out_bf16) out_bf16[o + c] = __float2bfloat16_rn(y);
            if (out_f32) out_f32[o + c] = y;
        }
    }
}

/* The same four columns a thread (cols, ld multiples of 4, 16-byte aligned
 * rows): 16-byte loads, 8-byte bf16 stores; the same arithmetic per element. */
__global__ void swiglu4_kernel(const float *__restrict__ gate, const float *__restrict__ up, int rows, int cols,
                               int64_t ld, bf16 *__restrict__ out_bf16, float *__restrict__ out_f32) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float4 *g = reinterpret_cast<const float4 *>(gate + (int64_t)r * ld);
        const float4 *u = reinterpret_cast<const float4 *>(up + (int64_t)r * ld);
        const int64_t o = (int64_t)r * cols;
        for (int c = threadIdx.x; c < cols / 4; c += blockDim.x) {
            const float4 gv = g[c], uv = u[c];
            float4 y;
            y.x = gv.x / (1.0f + expf(-gv.x)) * uv.x;
            y.y = gv.y / (1.0f + expf(-gv.y)) * uv.y;
            y.z = gv.z / (1.0f + expf(-gv.z)) * uv.z;
            y.w = gv.w / (1.0f + expf(-gv.w)) * uv.w;
            if (out_bf16) {
                __nv_bfloat162 lo = __floats2bfloat162_rn(y.x, y.y), hi = __floats2bfloat162_rn(y.z, y.w);
                uint2 pk;
                memcpy(&pk.x, &lo, 4);
                memcpy(&pk.y, &hi, 4);
                *reinterpret_cast<uint2 *>(out_bf16 + o + 4 * c) = pk;
            }
            if (out_f32) *reinterpret_cast<float4 *>(out_f32 + o + 4 * c) = y;
        }
    }
}

/* From bf16 gate and up: eight columns a thread (16-byte loads and stores)
 * when VEC (cols, ld multiples of 8, 16-byte aligned rows), else one. The
 * arithmetic per element is swiglu_kernel's, in fp32. */
template <bool VEC>
__global__ void swiglu_bf16_kernel(const bf16 *__restrict__ gate, const bf16 *__restrict__ up, int rows, int cols,
                                   int64_t ld, bf16 *__restrict__ out) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16 *g = gate + (int64_t)r * ld, *u = up + (int64_t)r * ld;
        bf16 *o = out + (int64_t)r * cols;
        if constexpr (VEC) {
            for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
                const uint4 gw = reinterpret_cast<const uint4 *>(g)[c], uw = reinterpret_cast<const uint4 *>(u)[c];
                const __nv_bfloat162 *g2 = reinterpret_cast<const __nv_bfloat162 *>(&gw);
                const __nv_bfloat162 *u2 = reinterpret_cast<const __nv_bfloat162 *>(&uw);
                uint4 ow;
                __nv_bfloat162 *o2 = reinterpret_cast<__nv_bfloat162 *>(&ow);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float2 gv = __bfloat1622float2(g2[j]), uv = __bfloat1622float2(u2[j]);
                    o2[j] = __floats2bfloat162_rn(gv.x / (1.0f + expf(-gv.x)) * uv.x, gv.y / (1.0f + expf(-gv.y)) * uv.y);
                }
                reinterpret_cast<uint4 *>(o)[c] = ow;
            }
        } else {
            for (int c = threadIdx.x; c < cols; c += blockDim.x) {
                const float gv = __bfloat162float(g[c]), uv = __bfloat162float(u[c]);
                o[c] = __float2bfloat16_rn(gv / (1.0f + expf(-gv)) * uv);
            }
        }
    }
}

__global__ void add_kernel(float *__restrict__ x, const float *__restrict__ y, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

__global__ void f32_to_bf16_kernel(const float *__restrict__ src, bf16 *__restrict__ dst, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* ---- argmax: one block per row ----------------------------------------------------- */

/* (v, i) beats (bv, bi): larger value, or the same value at a lower index. */
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__global__ void argmax_kernel(const float *__restrict__ x, int n, int32_t *__restrict__ out) {
    const float *row = x + (size_t)blockIdx.x * n;
    float best = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = row[i];
        if (isnan(v)) v = -INFINITY;   /* NaN never wins (src/text/sample.c) */
        if (beats(v, i, best, bi)) best = v, bi = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (beats(ov, oi, best, bi)) best = ov, bi = oi;
    }
    __shared__ float wv[32];
    __shared__ int wi[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) wv[warp] = best, wi[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x >> 5;
        best = lane < n_warps ? wv[lane] : -INFINITY;
        bi = lane < n_warps ? wi[lane] : INT_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (beats(ov, oi, best, bi)) best = ov, bi = oi;
        }
        if (lane == 0) out[blockIdx.x] = bi;
    }
}

/* ---- training: Σ x², AdamW -------------------------------------------------------------- */

__global__ void sumsq_kernel(const float *__restrict__ x, int64_t n, double *out) {
    double s = 0.0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        s += (double)x[i] * x[i];
    s = block_sum(s);
    if (threadIdx.x == 0) atomicAdd(out, s);
}

__global__ void adamw_kernel(float *__restrict__ w, const float *__restrict__ g, float *__restrict__ m1,
                             float *__restrict__ m2, int64_t n, float lr, float b1, float omb1, float b2, float omb2,
                             float eps, float wd, float gscale, float c1, float c2) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float gi = g[i] * gscale;
    const float a = b1 * m1[i] + omb1 * gi, b = b2 * m2[i] + omb2 * gi * gi;
    m1[i] = a, m2[i] = b;
    w[i] -= lr * (a * c1 / (sqrtf(b * c2) + eps) + wd * w[i]);
}

}   // namespace

/* ---- API ------------------------------------------------------------------------------ */

int stc_embed_bf16(stc_ctx *ctx, const stc_bf16 *table, int64_t n_vocab, int d, const int32_t *tokens_dev, int T,
                   float *out, still_err *err) {
    STC_ENTER(ctx, err);
    if (n_vocab <= 0 || d <= 0 || T <= 0)
        return stc_fail(err, STILL_E_ARG, "stc_embed_bf16: vocab %lld, width %d, %d tokens", (long long)n_vocab, d, T);
    if (!table || !tokens_dev || !out) return stc_fail(err, STILL_E_ARG, "stc_embed_bf16: NULL pointer");
    embed_bf16_kernel<<<T, 256, 0, ctx->stream>>>((const bf16 *)table, n_vocab, d, tokens_dev, out);
    STC_LAUNCHED(err, "embed_bf16_kernel");
    return STILL_OK;
}

int stc_rmsnorm(stc_ctx *ctx, const float *x, const float *w, int T, int n, float eps, float *out_f32,
                stc_bf16 *out_bf16, still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || n <= 0) return stc_fail(err, STILL_E_ARG, "stc_rmsnorm: %d rows of %d", T, n);
    if (!x || !w || (!out_f32 && !out_bf16)) return stc_fail(err, STILL_E_ARG, "stc_rmsnorm: NULL pointer");
    if (n <= RMSNORM_WARP_MAX) {   /* 8 rows a block; few rows: the row in registers */
        const int blocks = (T + 7) / 8, grid = blocks < 65536 ? blocks : 65536;
        bf16 *ob = (bf16 *)out_bf16;
        /* rows of a multiple of 64 floats: by pairs whatever the row count, so a row's bits do not depend on
         * how many rows come with it */
        const bool pairs = n % 64 == 0 && n <= 64 * 16 &&
                           ((uintptr_t)x | (uintptr_t)w | (uintptr_t)out_f32) % 8 == 0 && (uintptr_t)ob % 4 == 0;
        if (pairs) {
            if (n <= 64 * 9) rmsnorm_pairs_kernel<9><<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
            else rmsnorm_pairs_kernel<16><<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
            STC_LAUNCHED(err, "rmsnorm_pairs_kernel");
            return STILL_OK;
        }
        if (T > RMSNORM_REG_MAX_ROWS) {
            rmsnorm_rows_kernel<<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
            STC_LAUNCHED(err, "rmsnorm_rows_kernel");
            return STILL_OK;
        }
        if (n <= 32 * 8) rmsnorm_rows_reg_kernel<8><<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
        else if (n <= 32 * 24) rmsnorm_rows_reg_kernel<24><<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
        else rmsnorm_rows_reg_kernel<64><<<grid, 256, 0, ctx->stream>>>(x, w, T, n, eps, out_f32, ob);
        STC_LAUNCHED(err, "rmsnorm_rows_reg_kernel");
        return STILL_OK;
    }
    rmsnorm_kernel<<<T, 256, 0, ctx->stream>>>(x, w, n, eps, out_f32, (bf16 *)out_bf16);
    STC_LAUNCHED(err, "rmsnorm_kernel");
    return STILL_OK;
}

/* ldq, ldk, ldv: floats between the tokens' rows of q, k and v; the copies of type CT (packed rows) */
template <class CT>
static int rope_launch(stc_ctx *ctx, float *q, float *k, int64_t ldq, int64_t ldk, int T, int H, int Hk, int D,
                       int p0, const int *p0_dev, float theta, CT *q_c, CT *k_c, const float *v, int64_t ldv, CT *v_c,
                       still_err *err) {
    STC_ENTER(ctx, err);
    if (T <= 0 || H < 0 || Hk < 0 || D <= 0 || D % 2 || D / 2 > ROPE_MAX_PAIRS || p0 < 0 || !(theta > 0))
        return stc_fail(err, STILL_E_ARG, "stc_rope: T %d, heads %d / %d, head dim %d (even, <= %d), p0 %d, theta %g",
                        T, H, Hk, D, 2 * ROPE_MAX_PAIRS, p0, (double)theta);
    if ((q_c && !q) || (k_c && !k) || (!v_c) != (!v))
        return stc_fail(err, STILL_E_ARG, "stc_rope: a copy without its input (or v without its copy)");
    if (((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 8 || ((uintptr_t)q_c | (uintptr_t)k_c | (uintptr_t)v_c) % 4 ||
        ldv % 2)
        return stc_fail(err, STILL_E_ARG,
                        "stc_rope: q / k / v must be 8-byte aligned (v's rows too), their copies 4-byte aligned");
    if (!q && !k && !v) return STILL_OK;
    rope_freqs f;
    for (int i = 0; i < D / 2; i++) f.inv[i] = (float)pow((double)theta, -2.0 * i / D);   /* as model.c */
    const int64_t n = (int64_t)T * (D / 2);
    rope_kernel<CT><<<stc_blocks(n, 128), 128, 0, ctx->stream>>>(q, k, ldq, ldk, T, H, Hk, D, p0, p0_dev, f, q_c, k_c,
                                                                  v, ldv, v_c);
    STC_LAUNCHED(err, "rope_kernel");
    return STILL_OK;
}

int stc_rope(stc_ctx *ctx, float *q, float *k, int T, int H, int Hk, int D, int p0, float theta, stc_bf16 *q_bf16,
             stc_bf16 *k_bf16, const float *v, stc_bf16 *v_bf16, still_err *err) {
    return rope_launch(ctx, q, k, (int64_t)H * D, (int64_t)Hk * D, T, H, Hk, D, p0, NULL, theta, (bf16 *)q_bf16,
                       (bf16 *)k_bf16, v, (int64_t)Hk * D, (bf16 *)v_bf16, err);
}

int stc_rope_at(stc_ctx *ctx, float *q, float *k, int T, int H, int Hk, int D, const int *p0_dev, float theta,
                stc_bf16 *q_bf16, stc_bf16 *k_bf16, still_err *err) {
    if (!p0_dev) return stc_fail(err, STILL_E_ARG, "stc_rope_at: NULL device position");
    return rope_launch(ctx, q, k, (int64_t)H * D, (int64_t)Hk * D, T, H, Hk, D, 0, p0_dev, theta, (bf16 *)q_bf16,
                       (bf16 *)k_bf16, (const float *)NULL, 0, (bf16 *)NULL, err);
}

int stc_rope_at_ld(stc_ctx *ctx, float *q, float *k, int64_t ld, int T, int H, int Hk, int D, const int *p0_dev,
                   float theta, const float *v, stc_f16 *k_f16, stc_f16 *v_f16, still_err *err) {
    if (!p0_dev) return stc_fail(err, STILL_E_ARG, "stc_rope_at_ld: NULL device position");
    const int64_t widest = (int64_t)(q && H > Hk ? H : k ? Hk : H) * D;   /* the rows of q and of k must not overlap */
    if (ld < widest || ld % 2)
        return stc_fail(err, STILL_E_ARG, "stc_rope_at_ld: row stride %lld (even, at least a row of %lld)", (long long)ld,
                        (long long)widest);
    if ((!v) != (!v_f16)) return stc_fail(err, STILL_E_ARG, "stc_rope_at_ld: v and its half copy go together");
    return rope_launch(ctx, q, k, ld, ld, T, H, Hk, D, 0, p0_dev, theta, (__half *)NULL, (__half *)k_f16, v, ld,
                       (__half *)v_f16, err);
}

int stc_swiglu(stc_ctx *ctx, const float *gate, const float *up, int rows, int cols, int64_t ld, stc_bf16 *out_bf16,
               float *out_f32, still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0 || cols <= 0 || ld < cols)
        return stc_fail(err, STILL_E_ARG, "stc_swiglu: %d x %d with row stride %lld", rows, cols, (long long)ld);
    if (!gate || !up || (!out_bf16 && !out_f32)) return stc_fail(err, STILL_E_ARG, "stc_swiglu: NULL pointer");
    const unsigned grid = (unsigned)(rows < 65536 ? rows : 65536);
    const bool vec = cols % 4 == 0 && ld % 4 == 0 &&
                     ((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out_f32) % 16 == 0 && (uintptr_t)out_bf16 % 8 == 0;
    if (vec) {
        swiglu4_kernel<<<grid, 128, 0, ctx->stream>>>(gate, up, rows, cols, ld, (bf16 *)out_bf16, out_f32);
        STC_LAUNCHED(err, "swiglu4_kernel");
    } else {
        swiglu_kernel<<<grid, 256, 0, ctx->stream>>>(gate, up, rows, cols, ld, (bf16 *)out_bf16, out_f32);
        STC_LAUNCHED(err, "swiglu_kernel");
    }
    return STILL_OK;
}

int stc_swiglu_bf16(stc_ctx *ctx, const stc_bf16 *gate, const stc_bf16 *up, int rows, int cols, int64_t ld,
                    stc_bf16 *out_bf16, still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0 || cols <= 0 || ld < cols)
        return stc_fail(err, STILL_E_ARG, "stc_swiglu_bf16: %d x %d with row stride %lld", rows, cols, (long long)ld);
    if (!gate || !up || !out_bf16) return stc_fail(err, STILL_E_ARG, "stc_swiglu_bf16: NULL pointer");
    const unsigned grid = (unsigned)(rows < 65536 ? rows : 65536);
    const bf16 *g = (const bf16 *)gate, *u = (const bf16 *)up;
    if (cols % 8 == 0 && ld % 8 == 0 && ((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out_bf16) % 16 == 0)
        swiglu_bf16_kernel<true><<<grid, 64, 0, ctx->stream>>>(g, u, rows, cols, ld, (bf16 *)out_bf16);
    else
        swiglu_bf16_kernel<false><<<grid, 256, 0, ctx->stream>>>(g, u, rows, cols, ld, (bf16 *)out_bf16);
    STC_LAUNCHED(err, "swiglu_bf16_kernel");
    return STILL_OK;
}

int stc_add(stc_ctx *ctx, float *x, const float *y, int64_t n, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return n == 0 ? STILL_OK : stc_fail(err, STILL_E_ARG, "stc_add: %lld elements", (long long)n);
    if (!x || !y) return stc_fail(err, STILL_E_ARG, "stc_add: NULL pointer");
    add_kernel<<<stc_blocks(n, 256), 256, 0, ctx->stream>>>(x, y, n);
    STC_LAUNCHED(err, "add_kernel");
    return STILL_OK;
}

int stc_f32_to_bf16(stc_ctx *ctx, const float *src, stc_bf16 *dst, int64_t n, still_err *err) {
    STC_ENTER(ctx, err);
    if (n <= 0) return n == 0 ? STILL_OK : stc_fail(err, STILL_E_ARG, "stc_f32_to_bf16: %lld elements", (long long)n);
    if (!src || !dst) return stc_fail(err, STILL_E_ARG, "stc_f32_to_bf16: NULL pointer");
    f32_to_bf16_kernel<<<stc_blocks(n, 256), 256, 0, ctx->stream>>>(src, (bf16 *)dst, n);
    STC_LAUNCHED(err, "f32_to_bf16_kernel");
    return STILL_OK;
}

int stc_argmax(stc_ctx *ctx, const float *x, int rows, int n, int32_t *out_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (rows <= 0 || n <= 0) return stc_fail(err, STILL_E_ARG, "stc_argmax: %d rows of %d", rows, n);
    if (!x || !out_dev) return stc_fail(err, STILL_E_ARG, "stc_argmax: NULL pointer");
    argmax_kernel<<<rows, 1024, 0, ctx->stream>>>(x, n, out_dev);
    STC_LAUNCHED(err, "argmax_kernel");
    return STILL_OK;
}

int stc_sumsq(stc_ctx *ctx, const float *x, int64_t n, double *out_dev, still_err *err) {
    STC_ENTER(ctx, err);
    if (n < 0 || !out_dev || (n > 0 && !x)) return stc_fail(err, STILL_E_ARG, "stc_sumsq: bad arguments");
    STC_CUDA(err, cudaMemsetAsync(out_dev, 0, sizeof(double), ctx->stream));
    if (n == 0) return STILL_OK;
    const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
    sumsq_kernel<<<(unsigned)blocks, 256, 0, ctx->stream>>>(x, n, out_dev);
    STC_LAUNCHED(err, "sumsq_kernel");
    return STILL_OK;
}

int stc_adamw(stc_ctx *ctx, float *w, const float *grad, float *m1, float *m2, int64_t n, float lr, double b1,
              double b2, double eps, float wd, float gscale, float c1, float c2, still_err *err) {
    STC_ENTER(ctx, err);
    if (n < 0 || (n > 0 && (!w || !grad || !m1 || !m2))) return stc_fail(err, STILL_E_ARG, "stc_adamw: bad arguments");
    if (n == 0) return STILL_OK;
    adamw_kernel<<<stc_blocks(n, 256), 256, 0, ctx->stream>>>(w, grad, m1, m2, n, lr, (float)b1, (float)(1 - b1),
                                                              (float)b2, (float)(1 - b2), (float)eps, wd, gscale, c1, c2);
    STC_LAUNCHED(err, "adamw_kernel");
    return STILL_OK;
}
