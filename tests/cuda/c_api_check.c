/* Compiled as C11 with -pedantic into test_cuda_kernels: cuda/still_cuda.h is
 * a plain C header, and its functions link from C code. */
#include "still_cuda.h"

#ifndef STILL_HAVE_CUDA
#error "the still_cuda target exports STILL_HAVE_CUDA"
#endif

int stc_c_api_check(void);

/* 1 when the entry points are there and the type table answers as expected. */
int stc_c_api_check(void) {
    int (*create)(int, stc_ctx **, still_err *) = stc_ctx_create;
    void (*destroy)(stc_ctx *) = stc_ctx_free;
    int (*gemm)(stc_ctx *, int, int, int, const stc_bf16 *, const stc_bf16 *, float *, float, still_err *) =
        stc_gemm_bf16;
    int (*attn)(stc_ctx *, const stc_bf16 *, const stc_bf16 *, const stc_bf16 *, int, int, int, int, int, float *,
                stc_bf16 *, still_err *) = stc_attn_softmax;
    int (*rope)(stc_ctx *, float *, float *, int, int, int, int, int, float, stc_bf16 *, stc_bf16 *, const float *,
                stc_bf16 *, still_err *) = stc_rope;
    int (*still_create)(stc_ctx *, const stc_still_config *, stc_still **, still_err *) = stc_still_create;
    int (*still_fwd)(stc_ctx *, stc_still *, const float *, const float *, const float *, const float *,
                     const stc_bf16 *, int, int, float *, still_err *) = stc_still_forward;
    stc_still_config sc = {9, 3, 64, 576, 8192, 64, 896, 6, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0};
    stc_still_info si;
    still_err err = {STILL_OK, ""};
    const int still_ok = stc_still_resolve(&sc, &si, NULL) == 0 && si.lambda == 6 && si.cap == 768 && si.n_sel_heads == 9;
    const int code = STC_E_DEVICE;
    return create != 0 && destroy != 0 && gemm != 0 && attn != 0 && rope != 0 && still_create != 0 && still_fwd != 0 &&
           still_ok && err.code == 0 && code < 0 &&
           stc_type_supported(2 /* Q4_0 */) && stc_type_supported(30 /* BF16 */) && !stc_type_supported(20);
}
