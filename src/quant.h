/* Tensor element types (numbered as ggml/GGUF), dequantization, and the
 * matrix kernels that work directly on quantized blocks. */
#ifndef STILL_QUANT_H
#define STILL_QUANT_H

#include "still.h"
#include <stddef.h>
#include <stdint.h>

typedef enum {
    TT_F32 = 0, TT_F16 = 1, TT_Q4_0 = 2, TT_Q4_1 = 3, TT_Q5_0 = 6, TT_Q5_1 = 7,
    TT_Q8_0 = 8, TT_Q8_1 = 9, TT_Q2_K = 10, TT_Q3_K = 11, TT_Q4_K = 12,
    TT_Q5_K = 13, TT_Q6_K = 14, TT_Q8_K = 15, TT_BF16 = 30,
} tensor_type;

/* Known to this engine (has size info)? Supported for compute (dequant/matmul)? */
int tensor_type_known(uint32_t t);
int tensor_type_supported(uint32_t t);
const char *tensor_type_name(uint32_t t);
int64_t tensor_type_block_elems(uint32_t t);   /* elements per block (1 for float types) */
size_t tensor_type_block_bytes(uint32_t t);    /* bytes per block */
/* Bytes of a row of n elements; returns 0 if n is not a multiple of the block size. */
size_t tensor_row_bytes(uint32_t t, int64_t n);

/* Dequantize n elements (n a multiple of the block size).  Results match
 * gguf-py's gguf.quants.dequantize bit for bit.  Q8_1 uses the current ggml
 * layout (half d, half s, int8 qs[32]: 36 bytes).  Errors: STILL_E_UNSUPPORTED
 * (type), STILL_E_ARG (n). */
int dequantize_row(uint32_t t, const void *src, float *dst, int64_t n, still_err *err);
/* x (n floats, n a multiple of 32) as Q8_0 blocks into dst (n / 32 blocks of 34 bytes: half d, int8 qs[32]),
 * ggml's reference rounding (d = max|x| / 127, q = roundf(x / d)): gguf-py's quantize bit for bit.
 * STILL_E_ARG for n. */
int quantize_row_q8_0(const float *x, void *dst, int64_t n);

/* A weight matrix as stored: n_out rows of n_in elements, row-major, each row
 * tensor_row_bytes(type, n_in) bytes. */
typedef struct {
    uint32_t type;
    int64_t n_in, n_out;
    const void *data;
    size_t row_bytes;
} weight_matrix;

/* Y[t][o] = sum_i W[o][i] * X[t][i] for t < n_tok: X is n_tok x n_in, Y is
 * n_tok x n_out, both float32 row-major (leading dims n_in / n_out).
 * Parallel over output rows with OpenMP (call from outside a parallel region).
 * Uses a matrix-vector path for n_tok == 1 and a blocked matrix-matrix path
 * otherwise; never expands the whole matrix to float. */
void matmul(const weight_matrix *W, const float *X, float *Y, int64_t n_tok);
/* (matmul requires tensor_type_supported(W->type), n_in a multiple of the
 *  block size and row_bytes >= tensor_row_bytes(type, n_in); otherwise it
 *  fills Y with NaN.  It uses up to omp_get_max_threads() threads, allocates
 *  its scratch once per call, and is safe to call from several threads at
 *  once.  The weight data needs no particular alignment.) */

/* dX[t][i] += sum_o dY[t][o] * W[o][i] (the gradient with respect to X of
 * matmul's output; W stays in its type, dequantized a row block at a time).
 * STILL_E_UNSUPPORTED for matrices matmul would refuse, STILL_E_NOMEM. */
int matmul_t_acc(const weight_matrix *W, const float *dY, float *dX, int64_t n_tok);

/* Decode with integer dot products (src/matvec_q8.c): an activation vector
 * quantized once to 8-bit blocks of 32 (llama.cpp's Q8_1: q = round(x / d),
 * d = max|x| / 127; s = d * sum(q) per block), then y = W x for Q4_0, Q4_1, Q5_0, Q5_1,
 * Q8_0, Q4_K, Q5_K and Q6_K weights (K-quants: n_in a multiple of 256) from
 * integer sums of products, one float scale per 32-block (or sub-block).
 * Paths: MATVEC_Q8_AUTO picks the best the running CPU has. */
typedef struct {
    int64_t n, n_max;   /* elements quantized, capacity (multiples of 32) */
    int8_t *q;          /* [n_max] */
    float *d, *s;       /* [n_max / 32] scale and scale * sum(q) per block */
} act_q8;
enum { MATVEC_Q8_AUTO = 0, MATVEC_Q8_PORTABLE = 1, MATVEC_Q8_AVX2 = 2, MATVEC_Q8_VNNI = 3, MATVEC_Q8_AVXVNNI = 4,
       MATVEC_Q8_LAST = MATVEC_Q8_AVXVNNI };
int act_q8_init(act_q8 *a, int64_t n_max);           /* STILL_E_ARG, STILL_E_NOMEM */
void act_q8_free(act_q8 *a);
int act_q8_quantize(act_q8 *a, const float *x, int64_t n);
int matvec_q8_supported(uint32_t type);
int matvec_q8_best_path(void);
int matvec_q8_path_available(int path);
const char *matvec_q8_path_name(int path);
/* y[o] = sum_i W[o][i] x[i] for one quantized activation; parallel over rows
 * (call from outside a parallel region). STILL_E_ARG for a type or size it
 * does not take, STILL_E_UNSUPPORTED for a path this CPU lacks. */
int matvec_q8(const weight_matrix *W, const act_q8 *x, float *y, int path);
/* The same for n (1..8) matrices of one input (q, k, v; gate, up) in one
 * parallel region: y[i] = W[i] x, each row as matvec_q8 computes it. */
int matvec_q8_many(const weight_matrix *const *W, float *const *y, int n, const act_q8 *x, int path);

/* Float helpers */
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);

#endif
