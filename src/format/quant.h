/* Tensor element types (numbered as ggml/GGUF): block sizes, names, rows
 * dequantized to float and quantized to Q8_0, half and bfloat16 conversions.
 * The CPU kernels that work directly on quantized blocks: cpu/kernels.h. */
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

/* Float helpers */
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float bf16_to_f32(uint16_t h);

#endif
