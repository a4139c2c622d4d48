/* CPU references of the kernels (ref.cu): plain loops, double accumulation where the kernel's own roundings
 * are not the point. The still reference is still_ref.hpp. */
#ifndef STILL_TESTS_CUDA_REF_CUH
#define STILL_TESTS_CUDA_REF_CUH

#include "harness.cuh"

/* Random raw blocks of `type` for rows × cols elements (finite scales, some fp16 subnormals). */
std::vector<uint8_t> rand_blocks(uint32_t type, int64_t rows, int64_t cols);
/* src/format/quant.c's dequantize_row over the rows. */
std::vector<float> ref_dequant(uint32_t type, const std::vector<uint8_t> &raw, int64_t rows, int64_t cols);
/* C[m][n] = Σ_k A[m][k] W[n][k] + beta C0[m][n], in double. */
std::vector<double> ref_gemm(int M, int N, int K, const std::vector<uint16_t> &A, const std::vector<uint16_t> &W,
                             const std::vector<double> &C0, double beta);
/* src/model/model.c's rmsnorm(). */
std::vector<float> ref_rmsnorm(const std::vector<float> &x, const std::vector<float> &w, int T, int n, float eps);
/* src/model/model.c's rope(), the rotation in double. */
void ref_rope(std::vector<double> &v, const std::vector<float> &in, int T, int nh, int D, int p0, float theta);
/* Causal GQA attention in double from the bf16 inputs; window W > 0: swa. */
std::vector<double> ref_attention(const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                                  const std::vector<uint16_t> &v, int T, int p0, int H, int Hk, int D, int W = 0);

#endif
