/* The CPU's matrix kernels over weights kept in their GGUF type (format/quant.h):
 * float activations (src/cpu/matmul.c) and 8-bit activations with integer dot
 * products (src/cpu/matvec_q8.c). */
#ifndef STILL_CPU_KERNELS_H
#define STILL_CPU_KERNELS_H

#include "format/quant.h"
#include "still.h"
#include <stddef.h>
#include <stdint.h>

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

/* Rows r0 .. r0+n-1 of W dequantized to float into out [n][n_in] (0, or dequantize_row's error). */
int weight_rows_to_f32(const weight_matrix *W, int64_t r0, int64_t n, float *out, still_err *err);

/* dX[t][i] += sum_o dY[t][o] * W[o][i] (the gradient with respect to X of
 * matmul's output; W stays in its type, dequantized a row block at a time).
 * STILL_E_UNSUPPORTED for matrices matmul would refuse, STILL_E_NOMEM. */
int matmul_t_acc(const weight_matrix *W, const float *dY, float *dX, int64_t n_tok);

/* Decode with integer dot products (src/cpu/matvec_q8.c): an activation vector
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
/* The same for n_x inputs at once (several sequences' decode steps): y[i] is [n_x][n_out of W[i]], row j = W[i] xs[j]
 * bit for bit as matvec_q8 gives it, each group of weight rows read once for all inputs. */
int matvec_q8_batch(const weight_matrix *const *W, float *const *y, int n, const act_q8 *xs, int n_x, int path);
/* Prefill with 8-bit activations (src/cpu/matmul_q8.c): Y [M][n_out] with row t = W xs[t], each as the portable
 * matvec_q8 computes it to float rounding, for Q4_0 / Q4_1 / Q8_0 weights on the AVX-512 VNNI path (matmul_q8_supported);
 * parallel over 32-row panels (call from outside a parallel region). STILL_E_ARG for a type, size or path it does
 * not take, STILL_E_NOMEM. */
int matmul_q8_supported(uint32_t type, int path);
int matmul_q8(const weight_matrix *W, const act_q8 *xs, int64_t M, float *Y, int path);

#endif
