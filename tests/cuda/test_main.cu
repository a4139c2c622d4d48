/* GPU test program for the CUDA backend (cuda/still_cuda.h): every kernel
 * against a CPU reference written here (plain loops, double accumulation),
 * on fresh random inputs of several shapes, odd ones included. Output
 * buffers are filled with 0xFF bytes (NaN in fp32 and in bf16) before each
 * run, so an element a kernel fails to write shows up as NaN, and any NaN or
 * infinity in a result fails its check.
 *
 * Error measure: rel = ||gpu - ref||₂ / ||ref||₂ over the whole output. Limits:
 *   1e-4  fp32 results whose inputs the reference sees exactly (RMSNorm, RoPE,
 *         SwiGLU, GEMM with fp32 output: only fp32 rounding and libm-vs-CUDA
 *         ulps differ);
 *   1e-2  results with bf16 in the way: bf16 outputs (one rounding, 2^-9
 *         relative) and the attention (bf16 Q/K/V, P rounded to bf16 for the
 *         second mma);
 *   exact dequantization (the bf16 rounding of src/format/quant.c's values, bit for
 *         bit), the embedding gathers, residual add, fp32 -> bf16, argmax.
 * The still group (stc_still_forward) is checked per (token, head) row,
 * rel = ||y - ref|| / ||ref|| < 1e-2 for every row, against the double
 * reference of tests/cuda/still_ref.hpp (bf16 in the softmax part and in
 * Sel); the selected positions must equal the reference's exactly; every
 * split of a sequence (one call, random chunk-crossing calls, all single
 * steps, a prefill then single steps, the last with positions from the
 * device counter) must agree with the one-call run per row: to 1e-4 through
 * the chunk-parallel kernels (they should differ only through the gate GEMM,
 * whose cuBLASLt algorithm depends on T; all single steps run once more with
 * the decode kernels off to check it), to 2e-3 where single steps take the
 * decode kernels (attn_still_decode.cu: other summation orders, and half
 * roundings of the weights that land on the other side); the line reports
 * the share of bit-identical values.
 *
 *   test_cuda_kernels [--seed N] [--only NAME] [--device N]
 *   test_cuda_kernels --cpu-selftest      (no GPU needed)
 *
 * --only runs the groups whose name contains NAME (dequant, embed, gemm,
 * rmsnorm, rope, swiglu, gemv, add, convert, argmax, attn, errors, still-small,
 * still-long, liger, gdn, flash-train, still-train, still-lm-route; --only still runs the still groups).
 * --cpu-selftest checks the CPU side: the bf16 rounding, the attention
 * kernel's fragment / swizzle index arithmetic (cuda/kinds/attn_layout.cuh) against
 * the PTX ISA's definitions of ldmatrix and mma.m16n8k16, the work
 * decomposition (every visible key of every row exactly once), a CPU
 * emulation of the kernel's tiled online softmax with splits against the
 * double-precision reference, and for still a CPU emulation of the kernels'
 * chunk-parallel schedule (cuda/kinds/still/attn_still_layout.cuh's decomposition) over
 * every kind of split against the still reference, plus the call geometry
 * against a token-by-token simulation.
 *
 * One line per check; the last line is "N passed, N failed"; exit status 1
 * on any failure.
 *
 * The program's files (tests/cuda/, its folders as cuda/'s): test_main.cu (this: the command line, the
 * groups in order, the CPU self-test's own checks), harness.cuh / .cu (counting, random data, bf16 on the
 * host, device buffers, comparisons, call schedules), ref.cuh / .cu (CPU references of the kernels),
 * test_groups.cuh (each group's entry point and file), kernels/ (dequant, embed, gemm, gemv, elementwise),
 * kinds/softmax/ (attn, flash-train), kinds/selftest_attn_layout.cu, kinds/liger/, kinds/gdn/, kinds/still/ (its shared
 * parts, still-small and still-long, still-fused, still-train, the self-test's emulation), train/
 * (still-lm-route), common/ (errors); still_ref.hpp (the still reference and emulation), c_api_check.c. */

#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

extern "C" int stc_c_api_check(void);   /* c_api_check.c: the header compiled as C11 */

/* ---- CPU self-test ------------------------------------------------------------------------------ */

void selftest_bf16(void) {
    struct { float f; uint16_t h; } c[] = {
        {1.0f, 0x3f80}, {1.0f + 0x1p-8f, 0x3f80} /* tie -> even */, {1.0f + 3 * 0x1p-8f, 0x3f82} /* tie -> even (up) */,
        {-2.0f, 0xc000}, {3.4028235e38f, 0x7f80} /* rounds to inf */, {INFINITY, 0x7f80}, {0x1p-133f, 0x0001},
        {0x1.01p0f, 0x3f80}, {0x1.018p0f, 0x3f81},
    };
    bool ok = true;
    for (auto &x : c)
        if (f2bf(x.f) != x.h) {
            ok = false;
            printf("  f2bf(%a) = 0x%04x, expected 0x%04x\n", (double)x.f, f2bf(x.f), x.h);
        }
    ok = ok && isnan(bf2f(f2bf(NAN))) && bf2f(0x3f80) == 1.0f;
    report(ok, "selftest: fp32 -> bf16 rounds to nearest, ties to even");
    /* the dequant reference (quant.c) against per-type spot values */
    uint8_t blk[18] = {0};
    const uint16_t d = f32_to_f16(0.5f);
    memcpy(blk, &d, 2);
    blk[2] = 0x9f;   /* element 0: 15 - 8 = 7, element 16: 9 - 8 = 1 */
    float out[32];
    still_err e = {};
    ok = dequantize_row(TT_Q4_0, blk, out, 32, &e) == 0 && out[0] == 3.5f && out[16] == 0.5f && out[1] == -4.0f;
    report(ok, "selftest: the dequant reference (src/format/quant.c) decodes a Q4_0 block");
}

/* The references against each other (GEMM, RoPE, RMSNorm), and still_cuda.h from C. */
void selftest_refs(void) {
    /* the references against each other: GEMM in double vs a float loop */
    const int M = 5, N = 7, K = 300;
    const std::vector<uint16_t> A = rand_bf16((size_t)M * K, 1.0), W = rand_bf16((size_t)N * K, 1.0);
    const std::vector<double> g = ref_gemm(M, N, K, A, W, std::vector<double>((size_t)M * N, 0.0), 0);
    std::vector<double> f((size_t)M * N);
    for (int m = 0; m < M; m++)
        for (int n2 = 0; n2 < N; n2++) {
            float s = 0;
            for (int kk = 0; kk < K; kk++) s += bf2f(A[(size_t)m * K + kk]) * bf2f(W[(size_t)n2 * K + kk]);
            f[(size_t)m * N + n2] = s;
        }
    check_rel("selftest: GEMM reference vs a float loop", f, g, 1e-5);
    /* RoPE reference: rotation preserves each pair's norm, and position 0 is the identity */
    std::vector<float> x = rand_f32(4 * 64, 1.0);
    std::vector<double> y, y0;
    ref_rope(y, x, 2, 2, 64, 1000, 10000.0f);
    ref_rope(y0, x, 1, 4, 64, 0, 10000.0f);   /* one token at position 0 */
    bool ok = true;
    for (size_t i = 0; i < x.size(); i += 2) {
        const double a = hypot((double)x[i], (double)x[i + 1]), b = hypot(y[i], y[i + 1]);
        ok = ok && fabs(a - b) <= 1e-12 * (a + 1) && y0[i] == x[i] && y0[i + 1] == x[i + 1];
    }
    report(ok, "selftest: RoPE reference keeps pair norms, identity at position 0");
    /* RMSNorm reference: unit weights give mean square 1 (eps aside) */
    std::vector<float> xr = rand_f32(3 * 100, 5.0), ones(100, 1.0f);
    const std::vector<float> rn = ref_rmsnorm(xr, ones, 3, 100, 1e-12f);
    ok = true;
    for (int t = 0; t < 3; t++) {
        double ms = 0;
        for (int i = 0; i < 100; i++) ms += (double)rn[t * 100 + i] * rn[t * 100 + i];
        ok = ok && fabs(ms / 100 - 1) < 1e-5;
    }
    report(ok, "selftest: RMSNorm reference gives unit mean square");
    report(stc_c_api_check() == 1, "selftest: still_cuda.h compiles as C11 and links from C");
}

/* ---- main ------------------------------------------------------------------------------------ */

int main(int argc, char **argv) {
    bool selftest = false;
    int device = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cpu-selftest")) selftest = true;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) g_rng.s = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) g_only = argv[++i];
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = atoi(argv[++i]);
        else {
            fprintf(stderr,
                    "usage: %s [--seed N] [--only NAME] [--device N]   GPU kernels against CPU references\n"
                    "       %s --cpu-selftest                          the CPU side only (no GPU)\n",
                    argv[0], argv[0]);
            return 2;
        }
    }
    if (selftest) {
        selftest_bf16();
        selftest_fragments();
        selftest_decomposition();
        selftest_emulation();
        selftest_refs();
        selftest_still();
    } else {
        char info[1024];
        stc_device_info(info, sizeof info);
        printf("%s\n", info);
        if (stc_ctx_create(device, &g_ctx, &g_err)) {
            report(false, "stc_ctx_create(%d): %s", device, g_err.msg);
        } else {
            if (selected("dequant")) test_dequant();
            if (selected("embed")) test_embed();
            if (selected("gemm")) test_gemm();
            if (selected("rmsnorm")) test_rmsnorm();
            if (selected("rope")) test_rope(), test_rope_ld();
            if (selected("swiglu")) test_swiglu();
            if (selected("gemv")) test_gemv();
            if (selected("add") || selected("convert")) test_add_convert();
            if (selected("argmax")) test_argmax();
            if (selected("attn")) test_attention();
            if (selected("errors")) test_errors();
            if (selected("still-small")) test_still_small();
            if (selected("still-lm-route")) test_still_lm_route();
            if (selected("flash-train")) test_flash_train();
            if (selected("still-train")) test_still_train();
            if (selected("still-long")) test_still_long();
            if (selected("still-fused")) test_still_fused();
            if (selected("liger")) test_liger();
            if (selected("gdn")) test_gdn();
            stc_ctx_free(g_ctx);
        }
    }
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail != 0;
}
