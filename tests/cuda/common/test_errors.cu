/* Group errors: refusals across the API (cuda/common/: errors and memory). */
#include "harness.cuh"
#include "test_groups.cuh"

/* Bad arguments come back as errors with messages, not crashes. */
void test_errors(void) {
    still_err e = {};
    int rc = stc_attn_softmax(g_ctx, NULL, NULL, NULL, 1, 0, 9, 3, 96, NULL, NULL, &e);
    report(rc == STILL_E_UNSUPPORTED && strstr(e.msg, "head dim"), "attention with head dim 96 refused: %s", e.msg);
    rc = stc_attn_softmax(g_ctx, NULL, NULL, NULL, 1, 0, 9, 4, 64, NULL, NULL, &e);
    report(rc == STILL_E_ARG, "attention with 9 heads over 4 KV heads refused: %s", e.msg);
    rc = stc_dequant_to_bf16(g_ctx, TT_Q4_0, "", 1, 31, (stc_bf16 *)16, &e);
    report(rc == STILL_E_ARG, "dequant of 31 Q4_0 columns refused: %s", e.msg);
    rc = stc_dequant_to_bf16(g_ctx, 20 /* IQ4_NL */, "", 1, 32, (stc_bf16 *)16, &e);
    report(rc == STILL_E_UNSUPPORTED, "dequant of an unsupported type refused: %s", e.msg);
    void *p = NULL;
    rc = stc_malloc(g_ctx, (size_t)1 << 50, "a 1 PiB test buffer", &p, &e);
    report(rc == STILL_E_NOMEM && strstr(e.msg, "CUDA out of memory allocating") && strstr(e.msg, "1 PiB test"),
           "out of memory reported: %s", e.msg);
    rc = stc_gemm_bf16(g_ctx, 0, 1, 1, NULL, NULL, NULL, 0, &e);
    report(rc == STILL_E_ARG, "gemm of an empty shape refused: %s", e.msg);
    rc = stc_ctx_sync(g_ctx, &e);
    report(rc == 0, "context still usable after the refusals");
}
