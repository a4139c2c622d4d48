/* GEMM through cuBLASLt: C[M][N] = A[M][K] · W[N][K]ᵀ + beta · C, bf16
 * inputs, fp32 accumulation, fp32 or bf16 output; and the weight-gradient
 * product C[M][N] += Σ_k A[k][M] B[k][N] of fp32 operands, in fp32 or
 * through TF32 tensor-core products (f32_at_b 1 or 2).
 *
 * cuBLASLt is column-major. The row-major C[M][N] is the column-major N×M
 * matrix Cᵀ = W · Aᵀ; the row-major W[N][K] is the column-major K×N matrix
 * Wᵀ, and the row-major A[M][K] is the column-major K×M matrix Aᵀ. So the
 * call is the "TN" product
 *   D (N×M, ld N) = op(Wcm)ᵀ (N×K) · Acm (K×M),   op A = T (ld K), op B = N (ld K)
 * — the layout cuBLASLt supports best. The descriptors, layouts and the
 * heuristic's chosen algorithm are cached per (M, N, K, output type, mode,
 * pointer alignments); a model has a handful of shapes per chunk size.
 *
 * Tuning: for bf16 products of at least kTuneRows rows (prefill, training's
 * teacher) the heuristic's first kTuneAlgos candidates (STILL_CUDA_GEMM_TUNE_ALGOS: 2 to 32) are timed
 * in kTuneRounds rounds (each candidate's fastest round counts), on
 * the first call's own operands (the output: the call's C when beta is 0,
 * else a scratch buffer, so the call's residual is not touched), and the
 * fastest is kept when it beats the heuristic's first choice by more than
 * 3% (tune_plan: the choice is remembered per power-of-two bucket of rows,
 * so a prompt of a new length does not time again). Not while the stream
 * is being captured into a graph (the heuristic's choice then), not with
 * STILL_CUDA_GEMM_TUNE=0. Another algorithm may sum in another order:
 * results stay within the products' rounding, not bit for bit those of the
 * untuned choice, and where two candidates time within a few percent two
 * processes may choose differently (STILL_CUDA_GEMM_TUNE=0 for runs that
 * must repeat bit for bit). The scratch output (beta != 0) is a cudaMalloc:
 * a caller capturing a graph on another stream of this thread in global
 * capture mode must turn tuning off (none here does). */
#include "common/cuda_common.cuh"

#include <string.h>

namespace {

constexpr int kTuneRows = 1024;   /* tune products of at least this many rows */
constexpr int kTuneAlgos = 8;     /* candidates asked of the heuristic (STILL_CUDA_GEMM_TUNE_ALGOS: up to */
constexpr int kMaxTuneAlgos = 32; /* this many) */
constexpr int kTuneReps = 3;      /* timed runs per candidate and round (after one untimed) */
constexpr int kTuneRounds = 3;    /* rounds over all candidates; a candidate's time is its fastest round's */

/* Largest power of two (<= 256) dividing the address: cuBLASLt assumes
 * 256-byte aligned pointers unless told otherwise. */
unsigned ptr_align(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    unsigned al = 256;
    while (al > 1 && (a % al) != 0) al >>= 1;
    return al;
}

void destroy_plan(const stc_lt_api *lt, stc_gemm_plan *p) {
    if (p->la) lt->MatrixLayoutDestroy(p->la);
    if (p->lb) lt->MatrixLayoutDestroy(p->lb);
    if (p->lc) lt->MatrixLayoutDestroy(p->lc);
    if (p->desc) lt->MatmulDescDestroy(p->desc);
    memset(p, 0, sizeof *p);
}

/* The first call's operands, for timing the candidates. */
struct tune_operands {
    const void *A, *W;
    void *C;
    float beta;
};

/* Milliseconds for kTuneReps runs of algorithm algo on the operands (C: out). */
int time_algo(stc_ctx *ctx, const stc_gemm_plan *p, const cublasLtMatmulAlgo_t *algo, const tune_operands *t, void *out,
              cudaEvent_t ev0, cudaEvent_t ev1, float *ms, still_err *err) {
    const float alpha = 1.0f;
    for (int r = 0; r <= kTuneReps; r++) {
        if (r == 1) STC_CUDA(err, cudaEventRecord(ev0, ctx->stream));
        STC_LT(err, ctx->lt_api.Matmul(ctx->lt, p->desc, &alpha, t->W, p->la, t->A, p->lb, &t->beta, out, p->lc, out,
                                       p->lc, algo, ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream));
    }
    STC_CUDA(err, cudaEventRecord(ev1, ctx->stream));
    STC_CUDA(err, cudaEventSynchronize(ev1));
    STC_CUDA(err, cudaEventElapsedTime(ms, ev0, ev1));
    return STILL_OK;
}

/* Rows bucket of a tuned choice: the power of two at or above M, so that
 * prompts of every length share the choices of a few sizes. */
int tune_bucket(int M) {
    int b = kTuneRows;
    while (b < M && b < (1 << 30)) b <<= 1;
    return b;
}

stc_gemm_tuned *find_tuned(stc_ctx *ctx, const stc_gemm_plan *p) {
    const int mb = tune_bucket(p->M);
    for (int i = 0; i < STC_GEMM_TUNED; i++) {
        stc_gemm_tuned *t = &ctx->tuned[i];
        if (t->used && t->M_bucket == mb && t->N == p->N && t->K == p->K && t->out_type == p->out_type &&
            t->align_a == p->align_a && t->align_b == p->align_b && t->align_c == p->align_c)
            return t;
    }
    return NULL;
}

/* Times the heuristic's candidates res[0 .. n_res-1] for plan p and keeps the fastest in p->algo: res[0]
 * unless another is more than 3% faster, and among those within 1% of the fastest the heuristic's
 * earliest (so that timing noise rarely changes the choice). A candidate that fails to run is skipped;
 * when there is no room for a scratch output or no events, the heuristic's choice stays. The choice is
 * remembered for the shape's rows bucket (tune_bucket): another M of the bucket takes it without timing
 * when cuBLASLt confirms it supports that M. */
int tune_plan(stc_ctx *ctx, stc_gemm_plan *p, const cublasLtMatmulHeuristicResult_t *res, int n_res,
              const tune_operands *t, still_err *err) {
    stc_gemm_tuned *known = find_tuned(ctx, p);
    if (known) {
        cublasLtMatmulHeuristicResult_t check;
        memset(&check, 0, sizeof check);
        if (ctx->lt_api.MatmulAlgoCheck(ctx->lt, p->desc, p->la, p->lb, p->lc, p->lc, &known->algo, &check) ==
            CUBLAS_STATUS_SUCCESS)
            p->algo = known->algo;
        return STILL_OK;   /* (else the heuristic's first choice) */
    }
    void *out = t->C, *scratch = NULL;
    const size_t out_bytes = (size_t)p->M * p->N * (p->out_type == CUDA_R_32F ? 4 : 2);
    if (t->beta != 0.0f) {   /* the call's C holds what it adds to: time into a scratch output instead */
        if (cudaMalloc(&scratch, out_bytes) != cudaSuccess) {
            (void)cudaGetLastError();   /* no room to tune: keep the heuristic's choice */
            return STILL_OK;
        }
        out = scratch;
    }
    cudaEvent_t ev0 = NULL, ev1 = NULL;
    int rc = STILL_OK;
    bool timed = cudaEventCreate(&ev0) == cudaSuccess && cudaEventCreate(&ev1) == cudaSuccess;
    if (!timed) (void)cudaGetLastError();   /* no events: keep the heuristic's choice */
    if (timed && scratch) {
        const cudaError_t e = cudaMemsetAsync(scratch, 0, out_bytes, ctx->stream);
        if (e != cudaSuccess) rc = stc_cuda_fail(err, e, "cudaMemsetAsync (GEMM tuning scratch)", __FILE__, __LINE__);
    }
    /* Rounds over the candidates rather than one candidate's runs back to back: a slow moment of the GPU (its
     * clocks, another process) then costs each candidate one round, not one candidate its only chance; with a
     * single pass the choice changed from run to run by up to a fifth of the product's time. */
    float ms[kMaxTuneAlgos];
    bool ran[kMaxTuneAlgos] = {false}, failed[kMaxTuneAlgos] = {false};
    for (int round = 0; round < kTuneRounds && timed && !rc; round++)
        for (int i = 0; i < n_res && !rc; i++) {
            if (failed[i]) continue;
            still_err terr;
            float t_ms = 0.0f;
            if (time_algo(ctx, p, &res[i].algo, t, out, ev0, ev1, &t_ms, &terr)) {
                /* a candidate that cannot run here: clear its error, the stream must serve the others */
                (void)cudaGetLastError();
                const cudaError_t s2 = cudaStreamSynchronize(ctx->stream);
                if (s2 != cudaSuccess)
                    rc = stc_cuda_fail(err, s2, "cudaStreamSynchronize (GEMM tuning)", __FILE__, __LINE__);
                failed[i] = true, ran[i] = false;
                continue;
            }
            if (!ran[i] || t_ms < ms[i]) ms[i] = t_ms;
            ran[i] = true;
        }
    if (!rc && timed) {
        int best = -1;
        for (int i = 0; i < n_res; i++)
            if (ran[i] && (best < 0 || ms[i] < ms[best])) best = i;
        if (best > 0) {
            for (int i = 0; i < best; i++)   /* the earliest within 1% of the fastest */
                if (ran[i] && ms[i] <= 1.01f * ms[best]) {
                    best = i;
                    break;
                }
            if (ran[0] && ms[best] > 0.97f * ms[0]) best = 0;   /* not clearly faster than the first choice */
        }
        if (best >= 0) {
            p->algo = res[best].algo;
            stc_gemm_tuned *slot = &ctx->tuned[ctx->tuned_next];
            ctx->tuned_next = (ctx->tuned_next + 1) % STC_GEMM_TUNED;
            slot->used = 1, slot->M_bucket = tune_bucket(p->M), slot->N = p->N, slot->K = p->K;
            slot->out_type = p->out_type, slot->align_a = p->align_a, slot->align_b = p->align_b;
            slot->align_c = p->align_c, slot->algo = p->algo;
        }
    }
    cudaError_t e2 = cudaSuccess;
    if (scratch) {   /* the timing runs write it: wait for them before freeing */
        e2 = cudaStreamSynchronize(ctx->stream);
        const cudaError_t f = cudaFree(scratch);
        if (e2 == cudaSuccess) e2 = f;
    }
    if (ev0 && cudaEventDestroy(ev0) != cudaSuccess && e2 == cudaSuccess) e2 = cudaGetLastError();
    if (ev1 && cudaEventDestroy(ev1) != cudaSuccess && e2 == cudaSuccess) e2 = cudaGetLastError();
    if (!rc && e2 != cudaSuccess) rc = stc_cuda_fail(err, e2, "GEMM tuning clean-up", __FILE__, __LINE__);
    return rc;
}

/* Builds the plan for a shape in *p (which the caller has emptied); tune: the call's operands when the
 * candidates are to be timed, else NULL. */
int build_plan(stc_ctx *ctx, stc_gemm_plan *p, int M, int N, int K, cudaDataType_t out_type, int f32_at_b,
               unsigned align_a, unsigned align_b, unsigned align_c, const tune_operands *tune, still_err *err) {
    p->M = M, p->N = N, p->K = K, p->out_type = out_type, p->f32_at_b = f32_at_b;
    p->align_a = align_a, p->align_b = align_b, p->align_c = align_c;
    /* On failure the caller's destroy_plan frees whatever was created. */
    /* f32_at_b 2: fp32 operands through TF32 tensor-core products (10-bit mantissas, fp32 sums) */
    STC_LT(err, ctx->lt_api.MatmulDescCreate(&p->desc, f32_at_b == 2 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                             CUDA_R_32F));
    const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
    if (f32_at_b) {
        /* C[M][N] = Σ_k A[k][M] B[k][N]: column-major, D (N×M, ld N) = Bcm (N×K, ld N) · op(Acm)
         * with Acm the M×K matrix (ld M) transposed. */
        STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_n, sizeof op_n));
        STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_t, sizeof op_t));
        STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->la, CUDA_R_32F, (uint64_t)N, (uint64_t)K, (int64_t)N));
        STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->lb, CUDA_R_32F, (uint64_t)M, (uint64_t)K, (int64_t)M));
    } else {
        STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
        STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
        /* cuBLASLt's A = our W (K×N column-major, ld K), B = our A (K×M, ld K),
         * C = D = our C (N×M, ld N). */
        STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->la, CUDA_R_16BF, (uint64_t)K, (uint64_t)N, (int64_t)K));
        STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->lb, CUDA_R_16BF, (uint64_t)K, (uint64_t)M, (int64_t)K));
    }
    STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->lc, out_type, (uint64_t)N, (uint64_t)M, (int64_t)N));

    cublasLtMatmulPreference_t pref = NULL;
    STC_LT(err, ctx->lt_api.MatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx->lt_workspace_bytes;
    const uint32_t aa = align_a, ab = align_b, ac = align_c;
    cublasStatus_t s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    if (s != CUBLAS_STATUS_SUCCESS) {
        ctx->lt_api.MatmulPreferenceDestroy(pref);
        return stc_lt_fail(err, s, "cublasLtMatmulPreferenceSetAttribute", __FILE__, __LINE__);
    }
    cublasLtMatmulHeuristicResult_t res[kMaxTuneAlgos];
    int n_res = 0;
    const int n_ask = ctx->gemm_tune_algos >= 2 && ctx->gemm_tune_algos <= kMaxTuneAlgos ? ctx->gemm_tune_algos : kTuneAlgos;
    s = ctx->lt_api.MatmulAlgoGetHeuristic(ctx->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, tune ? n_ask : kTuneAlgos, res,
                                           &n_res);
    ctx->lt_api.MatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) return stc_lt_fail(err, s, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    if (n_res < 1)
        return stc_fail(err, STILL_E_UNSUPPORTED,
                        "cuBLASLt has no algorithm for a %s GEMM of %d x %d x %d (%s output, alignments %u/%u/%u)",
                        f32_at_b == 2 ? "tf32" : f32_at_b ? "fp32" : "bf16", M, N, K, out_type == CUDA_R_32F ? "fp32" : "bf16", align_a, align_b,
                        align_c);
    p->algo = res[0].algo;
    p->used = 1;
    if (tune && N == ctx->gemm_force_n && K == ctx->gemm_force_k && ctx->gemm_force_i >= 0) {
        if (ctx->gemm_force_i >= n_res)
            return stc_fail(err, STILL_E_ARG, "STILL_CUDA_GEMM_FORCE: the heuristic offers %d candidates for %d x %d x %d",
                            n_res, M, N, K);
        p->algo = res[ctx->gemm_force_i].algo;
        return STILL_OK;
    }
    if (n_res > 1 && tune) return tune_plan(ctx, p, res, n_res, tune, err);
    return STILL_OK;
}

int gemm(stc_ctx *ctx, const char *fn, int M, int N, int K, const void *A, const void *W, void *C, float beta,
         cudaDataType_t out_type, int f32_at_b, still_err *err) {
    STC_ENTER(ctx, err);
    if (M <= 0 || N <= 0 || K <= 0) return stc_fail(err, STILL_E_ARG, "%s: shape %d x %d x %d", fn, M, N, K);
    if (!A || !W || !C) return stc_fail(err, STILL_E_ARG, "%s: NULL pointer", fn);
    const unsigned al_w = ptr_align(W), al_a = ptr_align(A), al_c = ptr_align(C);
    stc_gemm_plan *p = NULL;
    for (int i = 0; i < STC_GEMM_PLANS; i++) {
        stc_gemm_plan *q = &ctx->plans[i];
        if (q->used && !q->general && q->M == M && q->N == N && q->K == K && q->out_type == out_type && q->f32_at_b == f32_at_b &&
            q->align_a == al_w &&
            q->align_b == al_a && q->align_c == al_c) {
            p = q;
            break;
        }
    }
    if (!p) {
        p = &ctx->plans[ctx->plan_next];
        ctx->plan_next = (ctx->plan_next + 1) % STC_GEMM_PLANS;
        destroy_plan(&ctx->lt_api, p);
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        STC_CUDA(err, cudaStreamIsCapturing(ctx->stream, &cap));
        const tune_operands ops = {A, W, C, beta};
        const bool tune = ctx->gemm_tune && !f32_at_b && M >= kTuneRows && cap == cudaStreamCaptureStatusNone;
        int rc = build_plan(ctx, p, M, N, K, out_type, f32_at_b, al_w, al_a, al_c, tune ? &ops : NULL, err);
        if (rc) {
            destroy_plan(&ctx->lt_api, p);
            return rc;
        }
    }
    const float alpha = 1.0f;
    STC_LT(err, ctx->lt_api.Matmul(ctx->lt, p->desc, &alpha, W, p->la, A, p->lb, &beta, C, p->lc, C, p->lc, &p->algo,
                               ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream));
    return STILL_OK;
}

/* stc_gemm_rm's plan. Row-major C = op(A) op(B) is column-major Cᵀ (N×M, ld ldc) = op(B)ᵀ op(A)ᵀ; a
 * row-major matrix stored [r][ld] is the column-major (ld-strided) matrix of its transpose, so cuBLASLt's
 * first operand is our B (untransposed: N×K as stored, op N; transposed: stored K×N, op T) and its second
 * our A (untransposed: stored K×M, op N; transposed: stored M×K, op T). */
int build_plan_rm(stc_ctx *ctx, stc_gemm_plan *p, int ta, int tb, int M, int N, int K, int64_t lda, int64_t ldb,
                  int64_t ldc, int batch, int64_t sa, int64_t sb, int64_t sc, int in_bf16, int tf32, unsigned al_a,
                  unsigned al_b, unsigned al_c, still_err *err) {
    p->general = 1, p->ta = ta, p->tb = tb, p->M = M, p->N = N, p->K = K, p->lda = lda, p->ldb = ldb, p->ldc = ldc;
    p->batch = batch, p->sa = sa, p->sb = sb, p->sc = sc;
    p->in_bf16 = in_bf16, p->tf32 = tf32, p->out_type = CUDA_R_32F, p->align_a = al_a, p->align_b = al_b,
    p->align_c = al_c;
    const cudaDataType_t it = in_bf16 ? CUDA_R_16BF : CUDA_R_32F;
    STC_LT(err, ctx->lt_api.MatmulDescCreate(&p->desc, !in_bf16 && tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                             CUDA_R_32F));
    const cublasOperation_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
    STC_LT(err, ctx->lt_api.MatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
    STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->la, it, tb ? (uint64_t)K : (uint64_t)N, tb ? (uint64_t)N : (uint64_t)K, ldb));
    STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->lb, it, ta ? (uint64_t)M : (uint64_t)K, ta ? (uint64_t)K : (uint64_t)M, lda));
    STC_LT(err, ctx->lt_api.MatrixLayoutCreate(&p->lc, CUDA_R_32F, (uint64_t)N, (uint64_t)M, ldc));
    if (batch > 1) {   /* cuBLASLt's A is our B (stride sb), its B our A (sa) */
        const int32_t n = batch;
        const struct { cublasLtMatrixLayout_t l; int64_t s; } ls[] = {{p->la, sb}, {p->lb, sa}, {p->lc, sc}};
        for (const auto &e : ls) {
            STC_LT(err, ctx->lt_api.MatrixLayoutSetAttribute(e.l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n));
            STC_LT(err, ctx->lt_api.MatrixLayoutSetAttribute(e.l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &e.s,
                                                             sizeof e.s));
        }
    }
    cublasLtMatmulPreference_t pref = NULL;
    STC_LT(err, ctx->lt_api.MatmulPreferenceCreate(&pref));
    const uint64_t ws = ctx->lt_workspace_bytes;
    const uint32_t aa = al_b, ab = al_a, ac = al_c;   /* cuBLASLt's A is our B */
    cublasStatus_t s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = ctx->lt_api.MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac);
    if (s != CUBLAS_STATUS_SUCCESS) {
        ctx->lt_api.MatmulPreferenceDestroy(pref);
        return stc_lt_fail(err, s, "cublasLtMatmulPreferenceSetAttribute", __FILE__, __LINE__);
    }
    cublasLtMatmulHeuristicResult_t res[1];
    int n_res = 0;
    s = ctx->lt_api.MatmulAlgoGetHeuristic(ctx->lt, p->desc, p->la, p->lb, p->lc, p->lc, pref, 1, res, &n_res);
    ctx->lt_api.MatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS) return stc_lt_fail(err, s, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
    if (n_res < 1)
        return stc_fail(err, STILL_E_UNSUPPORTED, "cuBLASLt has no algorithm for a %s GEMM %c%c of %d x %d x %d",
                        in_bf16 ? "bf16" : "fp32", ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K);
    p->algo = res[0].algo;
    p->used = 1;
    return STILL_OK;
}

}   // namespace

int stc_gemm_rm_batched(stc_ctx *ctx, int ta, int tb, int M, int N, int K, float alpha, const void *A, int64_t lda,
                        int64_t sa, const void *B, int64_t ldb, int64_t sb, float beta, float *C, int64_t ldc,
                        int64_t sc, int batch, int in_bf16, int tf32, still_err *err) {
    STC_ENTER(ctx, err);
    if (M <= 0 || N <= 0 || K <= 0 || batch <= 0)
        return stc_fail(err, STILL_E_ARG, "stc_gemm_rm: shape %d x %d x %d (%d batches)", M, N, K, batch);
    if (!A || !B || !C) return stc_fail(err, STILL_E_ARG, "stc_gemm_rm: NULL pointer");
    if (lda < (ta ? M : K) || ldb < (tb ? K : N) || ldc < N)
        return stc_fail(err, STILL_E_ARG, "stc_gemm_rm: leading dimensions %lld %lld %lld too small", (long long)lda,
                        (long long)ldb, (long long)ldc);
    if (batch > 1 && (sa < 0 || sb < 0 || sc < (int64_t)M * ldc))
        return stc_fail(err, STILL_E_ARG, "stc_gemm_rm: batch strides %lld %lld %lld", (long long)sa, (long long)sb,
                        (long long)sc);
    if (batch == 1) sa = sb = sc = 0;
    ta = !!ta, tb = !!tb, in_bf16 = !!in_bf16, tf32 = !in_bf16 && tf32;
    unsigned al_a = ptr_align(A), al_b = ptr_align(B), al_c = ptr_align(C);
    const int64_t el = in_bf16 ? 2 : 4;   /* every batch's operands as aligned as the first's */
    while (al_a > 1 && (sa * el) % al_a) al_a >>= 1;
    while (al_b > 1 && (sb * el) % al_b) al_b >>= 1;
    while (al_c > 1 && (sc * 4) % al_c) al_c >>= 1;
    stc_gemm_plan *p = NULL;
    for (int i = 0; i < STC_GEMM_PLANS; i++) {
        stc_gemm_plan *q = &ctx->plans[i];
        if (q->used && q->general && q->ta == ta && q->tb == tb && q->M == M && q->N == N && q->K == K &&
            q->lda == lda && q->ldb == ldb && q->ldc == ldc && q->batch == batch && q->sa == sa && q->sb == sb &&
            q->sc == sc && q->in_bf16 == in_bf16 && q->tf32 == tf32 && q->align_a == al_a && q->align_b == al_b &&
            q->align_c == al_c) {
            p = q;
            break;
        }
    }
    if (!p) {
        p = &ctx->plans[ctx->plan_next];
        ctx->plan_next = (ctx->plan_next + 1) % STC_GEMM_PLANS;
        destroy_plan(&ctx->lt_api, p);
        int rc = build_plan_rm(ctx, p, ta, tb, M, N, K, lda, ldb, ldc, batch, sa, sb, sc, in_bf16, tf32, al_a, al_b,
                               al_c, err);
        if (rc) {
            destroy_plan(&ctx->lt_api, p);
            return rc;
        }
    }
    STC_LT(err, ctx->lt_api.Matmul(ctx->lt, p->desc, &alpha, B, p->la, A, p->lb, &beta, C, p->lc, C, p->lc, &p->algo,
                                   ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream));
    return STILL_OK;
}

int stc_gemm_rm(stc_ctx *ctx, int ta, int tb, int M, int N, int K, float alpha, const void *A, int64_t lda,
                const void *B, int64_t ldb, float beta, float *C, int64_t ldc, int in_bf16, int tf32, still_err *err) {
    return stc_gemm_rm_batched(ctx, ta, tb, M, N, K, alpha, A, lda, 0, B, ldb, 0, beta, C, ldc, 0, 1, in_bf16, tf32,
                               err);
}

int stc_gemm_bf16(stc_ctx *ctx, int M, int N, int K, const stc_bf16 *A, const stc_bf16 *W, float *C, float beta,
                  still_err *err) {
    return gemm(ctx, "stc_gemm_bf16", M, N, K, A, W, C, beta, CUDA_R_32F, 0, err);
}

int stc_gemm_bf16_out_bf16(stc_ctx *ctx, int M, int N, int K, const stc_bf16 *A, const stc_bf16 *W, stc_bf16 *C,
                           float beta, still_err *err) {
    return gemm(ctx, "stc_gemm_bf16_out_bf16", M, N, K, A, W, C, beta, CUDA_R_16BF, 0, err);
}

int stc_gemm_f32_at_b(stc_ctx *ctx, int M, int N, int K, const float *A, const float *B, float *C, float beta,
                      still_err *err) {
    /* gemm()'s "W" is cuBLASLt's A operand (our B), its "A" the B operand (our A) */
    return gemm(ctx, "stc_gemm_f32_at_b", M, N, K, A, B, C, beta, CUDA_R_32F, 1, err);
}

int stc_gemm_tf32_at_b(stc_ctx *ctx, int M, int N, int K, const float *A, const float *B, float *C, float beta,
                       still_err *err) {
    return gemm(ctx, "stc_gemm_tf32_at_b", M, N, K, A, B, C, beta, CUDA_R_32F, 2, err);
}
