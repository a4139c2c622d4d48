/* The groups of test_cuda_kernels (test_main.cu runs them in this order; --only NAME picks by name) and the
 * parts of --cpu-selftest. */
#ifndef STILL_TESTS_CUDA_TEST_GROUPS_CUH
#define STILL_TESTS_CUDA_TEST_GROUPS_CUH

/* kernels/ (cuda/kernels/) */
void test_dequant(void);       /* dequant         kernels/test_dequant.cu */
void test_embed(void);         /* embed           kernels/test_dequant.cu */
void test_gemm(void);          /* gemm            kernels/test_gemm.cu */
void test_rmsnorm(void);       /* rmsnorm         kernels/test_elementwise.cu */
void test_rope(void);          /* rope            kernels/test_elementwise.cu */
void test_rope_ld(void);       /* rope            kernels/test_elementwise.cu */
void test_swiglu(void);        /* swiglu          kernels/test_elementwise.cu */
void test_gemv(void);          /* gemv            kernels/test_gemv.cu */
void test_add_convert(void);   /* add, convert    kernels/test_elementwise.cu */
void test_argmax(void);        /* argmax          kernels/test_elementwise.cu */
/* kinds/ (cuda/kinds/<kind>/) */
void test_attention(void);     /* attn            kinds/softmax/test_attn_softmax.cu */
void test_flash_train(void);   /* flash-train     kinds/softmax/test_flash_train.cu */
void test_still_small(void);   /* still-small     kinds/still/test_still.cu */
void test_still_long(void);    /* still-long      kinds/still/test_still.cu */
void test_still_fused(void);   /* still-fused     kinds/still/test_still_fused.cu */
void test_still_train(void);   /* still-train     kinds/still/test_still_train.cu */
void test_liger(void);         /* liger           kinds/liger/test_liger.cu */
void test_gdn(void);           /* gdn             kinds/gdn/test_gdn.cu */
/* train/ (cuda/train/) */
void test_still_lm_route(void);   /* still-lm-route  train/test_still_lm_route.cu */
/* common/ (cuda/common/) */
void test_errors(void);        /* errors          common/test_errors.cu */

/* --cpu-selftest, in this order */
void selftest_bf16(void);            /* test_main.cu */
void selftest_fragments(void);       /* kinds/selftest_attn_layout.cu */
void selftest_decomposition(void);   /* kinds/selftest_attn_layout.cu */
void selftest_emulation(void);       /* kinds/selftest_attn_layout.cu */
void selftest_refs(void);            /* test_main.cu */
void selftest_still(void);           /* kinds/still/selftest_still.cu */

#endif
