/* Weights: GGUF blocks dequantized on the device, to bf16 matrices (the GEMM
 * operands) and to fp32 rows (the embedding gather of raw tables).
 *
 * One thread per output element: it finds its block, reads the block's
 * scale(s) and its own quant, and forms the value with the same float32
 * operations, in the same order, as src/format/quant.c (explicit __fmul_rn /
 * __fadd_rn, so no FMA contraction; quant.c's own products are exact, so
 * contraction would not change its results either). The fp16 scales convert
 * exactly. Hence the fp32 value equals dequantize_row()'s bit for bit, and
 * the bf16 one is that value rounded to nearest, ties to even. Dequantization
 * runs once per weight at load time, so simplicity beats speed here (the
 * redundant scale reads of a block's threads hit L1). */
#include "common/cuda_common.cuh"

extern "C" {
#include "format/quant.h"   /* tensor_type ids (TT_*); only the enum is used */
}

#include <cuda_fp16.h>

namespace {

struct type_shape {
    int elems, bytes;   /* per block */
};

/* Block shapes of the supported types (src/format/quant.c's table); {0, 0} otherwise. */
__host__ __device__ constexpr type_shape shape_of(uint32_t t) {
    return t == TT_F32    ? type_shape{1, 4}
           : t == TT_F16  ? type_shape{1, 2}
           : t == TT_BF16 ? type_shape{1, 2}
           : t == TT_Q4_0 ? type_shape{32, 18}
           : t == TT_Q4_1 ? type_shape{32, 20}
           : t == TT_Q5_0 ? type_shape{32, 22}
           : t == TT_Q5_1 ? type_shape{32, 24}
           : t == TT_Q8_0 ? type_shape{32, 34}
           : t == TT_Q8_1 ? type_shape{32, 36}
           : t == TT_Q2_K ? type_shape{256, 84}
           : t == TT_Q3_K ? type_shape{256, 110}
           : t == TT_Q4_K ? type_shape{256, 144}
           : t == TT_Q5_K ? type_shape{256, 176}
           : t == TT_Q6_K ? type_shape{256, 210}
                          : type_shape{0, 0};
}

__device__ __forceinline__ float rd_f16(const uint8_t *p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

__device__ __forceinline__ uint32_t rd_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* 6-bit scale and min of sub-block i (0..7) of a Q4_K / Q5_K block (the
 * 12 bytes at s), as quant.c's k_scale_min. */
__device__ __forceinline__ void k_scale_min(const uint8_t *s, int i, int *sc, int *mn) {
    if (i < 4) {
        *sc = s[i] & 0x3f;
        *mn = s[i + 4] & 0x3f;
    } else {
        const int j = i - 4;
        *sc = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        *mn = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

/* Element e of the block at b (for the float types, b is the element and e = 0). */
template <uint32_t TYPE>
__device__ __forceinline__ float dq_value(const uint8_t *b, int e) {
    if constexpr (TYPE == TT_F32) {
        return __uint_as_float(rd_u32(b));
    } else if constexpr (TYPE == TT_F16) {
        return rd_f16(b);
    } else if constexpr (TYPE == TT_BF16) {
        return __uint_as_float((uint32_t)(b[0] | (b[1] << 8)) << 16);
    } else if constexpr (TYPE == TT_Q4_0 || TYPE == TT_Q4_1) {
        /* Q4_0: half d, qs[16]; x = d*(q-8).  Q4_1: half d, half m, qs[16]; x = d*q + m.
         * Element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of qs[j-16]. */
        const int off = TYPE == TT_Q4_0 ? 2 : 4;
        const uint8_t qb = b[off + (e & 15)];
        const int q = e < 16 ? (qb & 0x0f) : (qb >> 4);
        const float d = rd_f16(b);
        if constexpr (TYPE == TT_Q4_0) return __fmul_rn(d, (float)(q - 8));
        else return __fadd_rn(__fmul_rn(d, (float)q), rd_f16(b + 2));
    } else if constexpr (TYPE == TT_Q5_0 || TYPE == TT_Q5_1) {
        /* Q5_0: half d, u32 qh, qs[16]; x = d*(q-16).  Q5_1: half d, half m, u32 qh, qs[16];
         * x = d*q + m.  Bit e of qh is element e's fifth bit. */
        const int qh_off = TYPE == TT_Q5_0 ? 2 : 4;
        const uint32_t qh = rd_u32(b + qh_off);
        const uint8_t qb = b[qh_off + 4 + (e & 15)];
        const int q = (e < 16 ? (qb & 0x0f) : (qb >> 4)) | (int)(((qh >> e) & 1u) << 4);
        const float d = rd_f16(b);
        if constexpr (TYPE == TT_Q5_0) return __fmul_rn(d, (float)(q - 16));
        else return __fadd_rn(__fmul_rn(d, (float)q), rd_f16(b + 2));
    } else if constexpr (TYPE == TT_Q8_0 || TYPE == TT_Q8_1) {
        /* Q8_0: half d, int8 qs[32].  Q8_1: half d, half s (unused), int8 qs[32]. */
        const int off = TYPE == TT_Q8_0 ? 2 : 4;
        return __fmul_rn(rd_f16(b), (float)(int8_t)b[off + e]);
    } else if constexpr (TYPE == TT_Q2_K) {
        /* scales[16], qs[64], half d, half dmin; e = 128h + 32s + l. */
        const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
        const int q = (b[16 + 32 * h + l] >> (2 * s)) & 3;
        const int scb = b[e >> 4];
        const float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
        const float dl = __fmul_rn(d, (float)(scb & 0x0f)), ml = __fmul_rn(dmin, (float)(scb >> 4));
        return __fsub_rn(__fmul_rn(dl, (float)q), ml);
    } else if constexpr (TYPE == TT_Q3_K) {
        /* hmask[32], qs[64], scales[12] (16 x 6 bits, offset 32), half d. */
        const uint8_t *scb = b + 96;
        const int i = e >> 4;
        const int lo = (scb[i & 7] >> (4 * (i >> 3))) & 0x0f;
        const int hi = (scb[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        const float dl = __fmul_rn(rd_f16(b + 108), (float)((lo | (hi << 4)) - 32));
        const int h = e >> 7, s = (e >> 5) & 3, l = e & 31;
        int q = (b[32 + 32 * h + l] >> (2 * s)) & 3;
        if (!((b[l] >> (e >> 5)) & 1)) q -= 4;
        return __fmul_rn(dl, (float)q);
    } else if constexpr (TYPE == TT_Q4_K || TYPE == TT_Q5_K) {
        /* half d, half dmin, scales[12], (Q5_K: qh[32],) qs[128]; sub-block i = e/32
         * uses qs[32*(i/2) ..], low nibbles for even i, high for odd. */
        const int i = e >> 5, l = e & 31;
        int sc, mn;
        k_scale_min(b + 4, i, &sc, &mn);
        const uint8_t *qs = b + (TYPE == TT_Q4_K ? 16 : 48);
        int v = (qs[32 * (i >> 1) + l] >> (4 * (i & 1))) & 0x0f;
        if constexpr (TYPE == TT_Q5_K) v |= ((b[16 + l] >> i) & 1) << 4;
        const float dl = __fmul_rn(rd_f16(b), (float)sc), ml = __fmul_rn(rd_f16(b + 2), (float)mn);
        return __fsub_rn(__fmul_rn(dl, (float)v), ml);
    } else if constexpr (TYPE == TT_Q6_K) {
        /* ql[128], qh[64], int8 scales[16], half d; e = 128h + 32t + l. */
        const int h = e >> 7, t = (e >> 5) & 3, l = e & 31;
        const int q = ((b[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 0x0f) |
                      (((b[128 + 32 * h + l] >> (2 * t)) & 3) << 4);
        const int sc = (int8_t)b[192 + 8 * h + 2 * t + (l >= 16)];
        return __fmul_rn(__fmul_rn(rd_f16(b + 208), (float)sc), (float)(q - 32));
    } else {
        static_assert(TYPE == TT_F32, "unsupported type");
        return 0.0f;
    }
}

/* dst[r][c] = bf16(value of element c of row r), rows of row_bytes raw bytes. */
template <uint32_t TYPE>
__global__ void dequant_bf16_kernel(const uint8_t *__restrict__ src, size_t row_bytes, int64_t rows, int64_t cols,
                                    bf16 *__restrict__ dst) {
    constexpr type_shape sh = shape_of(TYPE);
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i - r * cols;
        const uint8_t *blk = src + (size_t)r * row_bytes + (size_t)(c / sh.elems) * sh.bytes;
        if constexpr (TYPE == TT_BF16) {
            dst[i] = __ushort_as_bfloat16((unsigned short)(blk[0] | (blk[1] << 8)));   /* bits as they are */
        } else {
            dst[i] = __float2bfloat16_rn(dq_value<TYPE>(blk, (int)(c % sh.elems)));
        }
    }
}

/* out[t][c] = fp32 value of element c of table row tokens[t] (NaN row for a
 * token outside [0, n_vocab)). One block per token. */
template <uint32_t TYPE>
__global__ void embed_quant_kernel(const uint8_t *__restrict__ table, size_t row_bytes, int64_t n_vocab, int d,
                                   const int32_t *__restrict__ tokens, float *__restrict__ out) {
    constexpr type_shape sh = shape_of(TYPE);
    const int t = blockIdx.x;
    const int32_t tok = tokens[t];
    float *o = out + (size_t)t * d;
    if (tok < 0 || tok >= n_vocab) {
        for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = __int_as_float(0x7fc00000);
        return;
    }
    const uint8_t *row = table + (size_t)tok * row_bytes;
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        o[c] = dq_value<TYPE>(row + (size_t)(c / sh.elems) * sh.bytes, c % sh.elems);
}

/* Runs the statements in __VA_ARGS__ with TY a compile-time type id equal
 * to the run-time t (the caller has checked that t is supported). */
#define STC_TYPE_SWITCH(t, ...)                                                        \
    switch (t) {                                                                       \
    case TT_F32: { constexpr uint32_t TY = TT_F32; __VA_ARGS__; } break;               \
    case TT_F16: { constexpr uint32_t TY = TT_F16; __VA_ARGS__; } break;               \
    case TT_BF16: { constexpr uint32_t TY = TT_BF16; __VA_ARGS__; } break;             \
    case TT_Q4_0: { constexpr uint32_t TY = TT_Q4_0; __VA_ARGS__; } break;             \
    case TT_Q4_1: { constexpr uint32_t TY = TT_Q4_1; __VA_ARGS__; } break;             \
    case TT_Q5_0: { constexpr uint32_t TY = TT_Q5_0; __VA_ARGS__; } break;             \
    case TT_Q5_1: { constexpr uint32_t TY = TT_Q5_1; __VA_ARGS__; } break;             \
    case TT_Q8_0: { constexpr uint32_t TY = TT_Q8_0; __VA_ARGS__; } break;             \
    case TT_Q8_1: { constexpr uint32_t TY = TT_Q8_1; __VA_ARGS__; } break;             \
    case TT_Q2_K: { constexpr uint32_t TY = TT_Q2_K; __VA_ARGS__; } break;             \
    case TT_Q3_K: { constexpr uint32_t TY = TT_Q3_K; __VA_ARGS__; } break;             \
    case TT_Q4_K: { constexpr uint32_t TY = TT_Q4_K; __VA_ARGS__; } break;             \
    case TT_Q5_K: { constexpr uint32_t TY = TT_Q5_K; __VA_ARGS__; } break;             \
    case TT_Q6_K: { constexpr uint32_t TY = TT_Q6_K; __VA_ARGS__; } break;             \
    default: break;                                                                    \
    }

/* Checks a rows × cols matrix of type t; sets *row_bytes. */
int check_matrix(const char *fn, uint32_t t, int64_t rows, int64_t cols, size_t *row_bytes, still_err *err) {
    const type_shape sh = shape_of(t);
    if (sh.elems == 0)
        return stc_fail(err, STILL_E_UNSUPPORTED, "%s: tensor type %u is not supported on the GPU", fn, t);
    if (rows <= 0 || cols <= 0 || cols % sh.elems != 0)
        return stc_fail(err, STILL_E_ARG, "%s: %lld x %lld elements (columns must be a positive multiple of %d)", fn,
                        (long long)rows, (long long)cols, sh.elems);
    *row_bytes = (size_t)(cols / sh.elems) * (size_t)sh.bytes;
    return STILL_OK;
}

}   // namespace

int stc_type_supported(uint32_t ggml_type) { return shape_of(ggml_type).elems != 0; }

int stc_dequant_dev_to_bf16(stc_ctx *ctx, uint32_t ggml_type, const void *src_dev, int64_t rows, int64_t cols,
                            stc_bf16 *dst_dev, still_err *err) {
    STC_ENTER(ctx, err);
    size_t row_bytes = 0;
    int rc = check_matrix("stc_dequant_dev_to_bf16", ggml_type, rows, cols, &row_bytes, err);
    if (rc) return rc;
    if (!src_dev || !dst_dev) return stc_fail(err, STILL_E_ARG, "stc_dequant_dev_to_bf16: NULL pointer");
    const unsigned blocks = stc_blocks(rows * cols, 256);
    STC_TYPE_SWITCH(ggml_type, dequant_bf16_kernel<TY><<<blocks, 256, 0, ctx->stream>>>(
                                   (const uint8_t *)src_dev, row_bytes, rows, cols, (bf16 *)dst_dev));
    STC_LAUNCHED(err, "dequant_bf16_kernel");
    return STILL_OK;
}

int stc_dequant_to_bf16(stc_ctx *ctx, uint32_t ggml_type, const void *src_host, int64_t rows, int64_t cols,
                        stc_bf16 *dst_dev, still_err *err) {
    STC_ENTER(ctx, err);
    size_t row_bytes = 0;
    int rc = check_matrix("stc_dequant_to_bf16", ggml_type, rows, cols, &row_bytes, err);
    if (rc) return rc;
    if (!src_host || !dst_dev) return stc_fail(err, STILL_E_ARG, "stc_dequant_to_bf16: NULL pointer");
    const size_t bytes = (size_t)rows * row_bytes;
    void *staging = NULL;
    if ((rc = stc_malloc(ctx, bytes, "raw weight blocks (upload staging)", &staging, err))) return rc;
    if (!(rc = stc_memcpy_h2d(ctx, staging, src_host, bytes, err)) &&
        !(rc = stc_dequant_dev_to_bf16(ctx, ggml_type, staging, rows, cols, dst_dev, err)))
        rc = stc_ctx_sync(ctx, err);
    stc_free(ctx, staging);
    return rc;
}

int stc_embed_quant(stc_ctx *ctx, uint32_t ggml_type, const void *table_dev, int64_t n_vocab, int d,
                    const int32_t *tokens_dev, int T, float *out, still_err *err) {
    STC_ENTER(ctx, err);
    size_t row_bytes = 0;
    int rc = check_matrix("stc_embed_quant", ggml_type, n_vocab, d, &row_bytes, err);
    if (rc) return rc;
    if (T <= 0) return stc_fail(err, STILL_E_ARG, "stc_embed_quant: %d tokens", T);
    if (!table_dev || !tokens_dev || !out) return stc_fail(err, STILL_E_ARG, "stc_embed_quant: NULL pointer");
    STC_TYPE_SWITCH(ggml_type, embed_quant_kernel<TY><<<T, 256, 0, ctx->stream>>>(
                                   (const uint8_t *)table_dev, row_bytes, n_vocab, d, tokens_dev, out));
    STC_LAUNCHED(err, "embed_quant_kernel");
    return STILL_OK;
}
