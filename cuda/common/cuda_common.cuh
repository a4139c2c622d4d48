/* Internal to the CUDA backend: the context's layout, error reporting and
 * the status-checking macros every CUDA / cuBLASLt call goes through.
 *
 * Each checked call that fails returns from the enclosing function with a
 * one-line message naming the call, the file:line and CUDA's (or cuBLASLt's)
 * error string, e.g.
 *   cudaMemcpyAsync failed at cuda/common/context.cu:141: invalid argument (cudaErrorInvalidValue) */
#ifndef STILL_CUDA_COMMON_CUH
#define STILL_CUDA_COMMON_CUH

#include "still_cuda.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef __nv_bfloat16 bf16;

/* ---- cuBLASLt, loaded at run time ------------------------------------------- */

/* The cuBLASLt entry points the backend calls, from dlopen()'d
 * libcublasLt.so.<major> (stc_ctx_create): a build with the CUDA backend then
 * costs a CPU-only run nothing (linking cuBLASLt, 540 MB, added about 150 MB
 * to every run's resident memory) and starts on machines without it. */
struct stc_lt_api {
    void *lib;
    decltype(&cublasLtCreate) Create;
    decltype(&cublasLtDestroy) Destroy;
    decltype(&cublasLtMatmulDescCreate) MatmulDescCreate;
    decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy;
    decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
    decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
    decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
    decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute;
    decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
    decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
    decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
    decltype(&cublasLtMatmulAlgoCheck) MatmulAlgoCheck;
    decltype(&cublasLtMatmul) Matmul;
    decltype(&cublasLtGetStatusString) GetStatusString;
    decltype(&cublasLtGetStatusName) GetStatusName;
};
/* Loads the library and every entry point into api (0), or says which is missing. */
int stc_lt_load(stc_lt_api *api, still_err *err);
void stc_lt_unload(stc_lt_api *api);

/* ---- the context ---------------------------------------------------------- */

/* One cached cuBLASLt plan: descriptors plus the heuristic's algorithm for a
 * shape, output type and pointer alignments (cuda/kernels/gemm.cu). */
struct stc_gemm_plan {
    int used;
    int M, N, K;
    cudaDataType_t out_type;
    int f32_at_b;                   /* 1: the fp32 C = Aᵀ B of stc_gemm_f32_at_b; 2: the same in TF32 */
    unsigned align_a, align_b, align_c;
    /* stc_gemm_rm's plans (general = 1): transposes, leading dimensions, input type, TF32 */
    int general, ta, tb, in_bf16, tf32;
    int64_t lda, ldb, ldc;
    int batch;                      /* strided batches (stc_gemm_rm_batched; 1 otherwise) and their strides */
    int64_t sa, sb, sc;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulAlgo_t algo;
};

enum { STC_GEMM_PLANS = 128 };

/* A tuned algorithm choice, for the products of a rows bucket (cuda/kernels/gemm.cu). */
struct stc_gemm_tuned {
    int used;
    int M_bucket, N, K;
    cudaDataType_t out_type;
    unsigned align_a, align_b, align_c;
    cublasLtMatmulAlgo_t algo;
};

enum { STC_GEMM_TUNED = 32 };

struct stc_ctx {
    int device;
    int sm_count;
    int cc_major, cc_minor;
    size_t smem_optin;              /* max dynamic shared memory per block after opt-in */
    cudaStream_t stream;
    cudaStream_t side;              /* a second stream for work that may overlap the main stream's (still's
                                     * scan beside its attention kernel), forked and joined by the events */
    cudaEvent_t fork_ev, join_ev;
    stc_lt_api lt_api;              /* cuBLASLt's entry points (dlopen) */
    cublasLtHandle_t lt;
    void *lt_workspace;
    size_t lt_workspace_bytes;
    stc_gemm_plan plans[STC_GEMM_PLANS];
    int plan_next;                  /* round-robin eviction */
    stc_gemm_tuned tuned[STC_GEMM_TUNED];
    int tuned_next;
    /* attention: split-K partials (cuda/kinds/softmax/attn_softmax.cu) */
    float *attn_ws;
    size_t attn_ws_bytes;
    unsigned attn_smem_set;         /* bit per kernel configuration whose smem limit was raised */
    int pdl;                        /* Programmatic Dependent Launch for the decode kernels (sm_90+ device and
                                     * code for it) */
    int gemm_tune;                  /* time cuBLASLt's candidate algorithms for large bf16 GEMMs
                                     * (cuda/kernels/gemm.cu; STILL_CUDA_GEMM_TUNE=0 turns it off) */
    int gemm_tune_algos;            /* how many candidates (STILL_CUDA_GEMM_TUNE_ALGOS, 2..32; 0: the default) */
    int gemm_force_n, gemm_force_k, gemm_force_i;   /* STILL_CUDA_GEMM_FORCE=N:K:i (a study of the tuner's choice):
                                                  * the heuristic's candidate i for tuned products of that N, K */
    int attn_wg_probe;              /* whether the still attention's wgmma code is loaded: -1 not probed yet,
                                     * then 0 or 1 (attn_still_attn.cu: attn_wg_available) */
};

/* Programmatic Dependent Launch, device side (no-ops before sm_90):
 * stc_pdl_trigger lets the next kernel in the stream, when it is launched
 * with the programmatic-serialization attribute, start before this one
 * ends; stc_pdl_wait blocks until the previous kernel has completed and its
 * memory is visible. A kernel reads nothing an earlier kernel writes before
 * stc_pdl_wait. */
static __device__ __forceinline__ void stc_pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
static __device__ __forceinline__ void stc_pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Launch kernel on the context's stream with the programmatic-serialization
 * attribute when ctx->pdl (else a plain launch): the kernel may start while
 * the previous one finishes, so it must call stc_pdl_wait before it reads
 * anything an earlier kernel writes. */
template <typename... Params, typename... Args>
static inline cudaError_t stc_launch_pdl(const stc_ctx *ctx, void (*kernel)(Params...), dim3 grid, dim3 block,
                                         size_t smem, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = ctx->stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr, cfg.numAttrs = ctx->pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

/* ---- errors ----------------------------------------------------------------- */

/* Record an error (err may be NULL) and return code. */
int stc_fail(still_err *err, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Message for a failed CUDA call; returns the matching code (STILL_E_NOMEM,
 * STILL_E_UNSUPPORTED or STC_E_DEVICE). `call` is the call's source text. */
int stc_cuda_fail(still_err *err, cudaError_t e, const char *call, const char *file, int line);
int stc_lt_fail(still_err *err, cublasStatus_t s, const char *call, const char *file, int line);

#define STC_CUDA(err, call)                                                              \
    do {                                                                                 \
        cudaError_t stc_e_ = (call);                                                     \
        if (stc_e_ != cudaSuccess) return stc_cuda_fail((err), stc_e_, #call, __FILE__, __LINE__); \
    } while (0)

#define STC_LT(err, call)                                                                \
    do {                                                                                 \
        cublasStatus_t stc_s_ = (call);                                                  \
        if (stc_s_ != CUBLAS_STATUS_SUCCESS) return stc_lt_fail((err), stc_s_, #call, __FILE__, __LINE__); \
    } while (0)

/* After a <<<...>>> launch: reports a bad configuration (or an earlier
 * asynchronous fault) naming the kernel. */
#define STC_LAUNCHED(err, kernel_name)                                                   \
    do {                                                                                 \
        cudaError_t stc_e_ = cudaGetLastError();                                         \
        if (stc_e_ != cudaSuccess) return stc_cuda_fail((err), stc_e_, "launch of " kernel_name, __FILE__, __LINE__); \
    } while (0)

/* Every API entry point: a context, and its device current in this thread. */
#define STC_ENTER(ctx, err)                                                              \
    do {                                                                                 \
        if (!(ctx)) return stc_fail((err), STILL_E_ARG, "%s: NULL context", __func__);   \
        STC_CUDA(err, cudaSetDevice((ctx)->device));                                     \
    } while (0)

/* ---- small launch helpers ---------------------------------------------------- */

/* Blocks for n items at `per_block` items a block, capped for grid-stride loops. */
/* A switch of the STILL_CUDA_* kind: on unless the variable is set to "0". */
static inline bool stc_env_on(const char *name) {
    const char *v = getenv(name);
    return !(v && !strcmp(v, "0"));
}

static inline unsigned stc_blocks(int64_t n, int per_block) {
    int64_t b = (n + per_block - 1) / per_block;
    if (b < 1) b = 1;
    if (b > (int64_t)1 << 20) b = (int64_t)1 << 20;
    return (unsigned)b;
}

/* bf16 <-> fp32 helpers usable in device code. */
static __device__ __forceinline__ float stc_bf16_to_f32(bf16 x) { return __bfloat162float(x); }

#endif
