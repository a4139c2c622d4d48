/* Group gemm: stc_gemm_bf16 / stc_gemm_bf16_out_bf16 (fp32 out 1e-4, bf16 out 1e-2) and the weight
 * gradients' stc_gemm_f32_at_b / stc_gemm_tf32_at_b, against double. */
#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

void test_gemm(void) {
    /* from 1,024 rows the candidates are timed on the first call (cuda/kernels/gemm.cu); {1100, 640, 576} comes
     * first with beta 1 below, so its timing runs must leave the residual in C alone; {1500, 1536, 576}
     * takes the choice {2048, 1536, 576} made for its rows bucket */
    const int shapes[][3] = {{1, 576, 576},  {7, 192, 576},  {64, 1536, 576}, {129, 576, 1536},
                             {300, 100, 72}, {3, 49152, 576}, {1000, 576, 576}, {33, 8, 16},
                             {2048, 1536, 576}, {1100, 640, 576}, {1500, 1536, 576}};
    for (auto &sh : shapes) {
        const int M = sh[0], N = sh[1], K = sh[2];
        const std::vector<uint16_t> A = rand_bf16((size_t)M * K, 1.0), W = rand_bf16((size_t)N * K, 0.05);
        dbuf dA(A.size() * 2), dW(W.size() * 2), dC((size_t)M * N * 4);
        if (!dA.ok() || !dW.ok() || !dC.ok() || !upload(dA, A) || !upload(dW, W)) continue;
        const bool beta_first = M == 1100;
        for (int out_bf16 = 0; out_bf16 < 2; out_bf16++)
            for (int b = 0; b < 2; b++) {
                const int beta = beta_first ? 1 - b : b;
                char name[128];
                snprintf(name, sizeof name, "gemm %d x %d x %d, %s out, beta %d", M, N, K, out_bf16 ? "bf16" : "fp32",
                         beta);
                std::vector<double> c0((size_t)M * N, 0.0);
                if (beta) {   /* C starts as random values (the residual) */
                    if (out_bf16) {
                        std::vector<uint16_t> c = rand_bf16(c0.size(), 1.0);
                        c0 = bf_to_double(c);
                        if (!upload(dC, c)) continue;
                    } else {
                        std::vector<float> c = rand_f32(c0.size(), 1.0);
                        c0 = to_double(c);
                        if (!upload(dC, c)) continue;
                    }
                } else if (!dC.poison()) {
                    continue;
                }
                const std::vector<double> ref = ref_gemm(M, N, K, A, W, c0, beta);
                int rc = out_bf16 ? stc_gemm_bf16_out_bf16(g_ctx, M, N, K, dA.as<stc_bf16>(), dW.as<stc_bf16>(),
                                                           dC.as<stc_bf16>(), (float)beta, &g_err)
                                  : stc_gemm_bf16(g_ctx, M, N, K, dA.as<stc_bf16>(), dW.as<stc_bf16>(), dC.as<float>(),
                                                  (float)beta, &g_err);
                if (!api_ok(rc, name)) continue;
                if (out_bf16) {
                    std::vector<uint16_t> got((size_t)M * N);
                    if (download(got, dC)) check_rel(name, bf_to_double(got), ref, 1e-2);
                } else {
                    std::vector<float> got((size_t)M * N);
                    if (download(got, dC)) check_rel(name, to_double(got), ref, 1e-4);
                }
            }
    }
    /* weight gradients: C[M][N] (+)= Σ_k A[k][M] B[k][N] from fp32, in fp32 and in TF32, against
     * double (the still gate's dWg: 576 x 576 over 896 tokens) */
    const int at_b_shapes[][3] = {{576, 576, 896}, {64, 40, 33}, {8, 576, 1}};
    for (auto &sh : at_b_shapes) {
        const int M = sh[0], N = sh[1], K = sh[2];
        const std::vector<float> A = rand_f32((size_t)K * M, 1.0), B = rand_f32((size_t)K * N, 1.0),
                                 C0 = rand_f32((size_t)M * N, 1.0);
        dbuf dA(A.size() * 4), dB(B.size() * 4), dC(C0.size() * 4);
        if (!dA.ok() || !dB.ok() || !dC.ok() || !upload(dA, A) || !upload(dB, B)) continue;
        for (int tf32 = 0; tf32 < 2; tf32++)
            for (int beta = 0; beta < 2; beta++) {
                std::vector<double> ref((size_t)M * N);
                for (int i = 0; i < M; i++)
                    for (int j = 0; j < N; j++) {
                        double acc = beta ? C0[(size_t)i * N + j] : 0.0;
                        for (int k = 0; k < K; k++) acc += (double)A[(size_t)k * M + i] * B[(size_t)k * N + j];
                        ref[(size_t)i * N + j] = acc;
                    }
                if (beta ? !upload(dC, C0) : !dC.poison()) continue;
                char name[128];
                snprintf(name, sizeof name, "gemm %s A^T B %d x %d over %d, beta %d", tf32 ? "tf32" : "fp32", M, N, K,
                         beta);
                const int rc = (tf32 ? stc_gemm_tf32_at_b : stc_gemm_f32_at_b)(
                    g_ctx, M, N, K, dA.as<float>(), dB.as<float>(), dC.as<float>(), (float)beta, &g_err);
                if (!api_ok(rc, name)) continue;
                std::vector<float> got((size_t)M * N);
                if (download(got, dC)) check_rel(name, to_double(got), ref, tf32 ? 2e-3 : 1e-5);
            }
    }
}
