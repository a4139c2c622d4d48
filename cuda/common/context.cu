/* Device context, errors, device memory and copies. */
#include "common/cuda_common.cuh"

#include <dlfcn.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ----------------------------------------------------------------- */

int stc_fail(still_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

/* "cuda/common/context.cu" from a full path (the part from the last "cuda/" on, else
 * the base name). */
static const char *short_path(const char *file) {
    const char *best = NULL;
    for (const char *p = strstr(file, "cuda/"); p; p = strstr(p + 1, "cuda/")) best = p;
    if (best) return best;
    const char *slash = strrchr(file, '/');
    return slash ? slash + 1 : file;
}

/* The called function's name from the call's source text: up to the first
 * '(' ("cudaMalloc(&p, n)" -> "cudaMalloc"). */
static void call_name(const char *call, char *out, size_t cap) {
    size_t n = strcspn(call, "(");
    while (n > 0 && call[n - 1] == ' ') n--;
    if (n >= cap) n = cap - 1;
    memcpy(out, call, n);
    out[n] = 0;
}

int stc_cuda_fail(still_err *err, cudaError_t e, const char *call, const char *file, int line) {
    char name[96];
    call_name(call, name, sizeof name);
    int code = STC_E_DEVICE;
    if (e == cudaErrorMemoryAllocation) code = STILL_E_NOMEM;
    else if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorNoKernelImageForDevice ||
             e == cudaErrorUnsupportedPtxVersion)
        code = STILL_E_UNSUPPORTED;
    int rc = stc_fail(err, code, "%s failed at %s:%d: %s (%s)", name, short_path(file), line, cudaGetErrorString(e),
                      cudaGetErrorName(e));
    (void)cudaGetLastError();   /* clear a non-sticky error so later calls do not report it again */
    return rc;
}

/* cuBLAS status names (the library's own strings need the library, which may be what failed to load). */
static const char *lt_status_name(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED (out of memory)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "unknown cuBLAS status";
    }
}

int stc_lt_fail(still_err *err, cublasStatus_t s, const char *call, const char *file, int line) {
    char name[96];
    call_name(call, name, sizeof name);
    const int code = s == CUBLAS_STATUS_ALLOC_FAILED ? (int)STILL_E_NOMEM : (int)STC_E_DEVICE;
    return stc_fail(err, code, "%s failed at %s:%d: %s (%d)", name, short_path(file), line, lt_status_name(s), (int)s);
}

/* ---- cuBLASLt at run time ------------------------------------------------------------------ */

#define STC_STR2(x) #x
#define STC_STR(x) STC_STR2(x)

int stc_lt_load(stc_lt_api *api, still_err *err) {
    memset(api, 0, sizeof *api);
    /* the major version this backend was compiled against first, then the unversioned name */
    const char *names[] = {"libcublasLt.so." STC_STR(CUBLAS_VER_MAJOR), "libcublasLt.so"};
    char why[256] = "";
    for (const char *n : names) {
        api->lib = dlopen(n, RTLD_NOW | RTLD_LOCAL);
        if (api->lib) break;
        const char *e = dlerror();
        snprintf(why, sizeof why, "%s", e ? e : n);
    }
    if (!api->lib)
        return stc_fail(err, STILL_E_UNSUPPORTED,
                        "CUDA backend: cannot load cuBLASLt (libcublasLt.so." STC_STR(CUBLAS_VER_MAJOR)
                        "): %s; install the CUDA toolkit's cuBLAS or add its lib64 directory to LD_LIBRARY_PATH",
                        why);
#define STC_LT_SYM(field, sym)                                                                            \
    do {                                                                                                   \
        *(void **)&api->field = dlsym(api->lib, #sym);                                                     \
        if (!api->field) {                                                                                 \
            stc_lt_unload(api);                                                                            \
            return stc_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: cuBLASLt has no %s (too old?)", #sym); \
        }                                                                                                  \
    } while (0)
    STC_LT_SYM(Create, cublasLtCreate);
    STC_LT_SYM(Destroy, cublasLtDestroy);
    STC_LT_SYM(MatmulDescCreate, cublasLtMatmulDescCreate);
    STC_LT_SYM(MatmulDescDestroy, cublasLtMatmulDescDestroy);
    STC_LT_SYM(MatmulDescSetAttribute, cublasLtMatmulDescSetAttribute);
    STC_LT_SYM(MatrixLayoutCreate, cublasLtMatrixLayoutCreate);
    STC_LT_SYM(MatrixLayoutDestroy, cublasLtMatrixLayoutDestroy);
    STC_LT_SYM(MatrixLayoutSetAttribute, cublasLtMatrixLayoutSetAttribute);
    STC_LT_SYM(MatmulPreferenceCreate, cublasLtMatmulPreferenceCreate);
    STC_LT_SYM(MatmulPreferenceDestroy, cublasLtMatmulPreferenceDestroy);
    STC_LT_SYM(MatmulPreferenceSetAttribute, cublasLtMatmulPreferenceSetAttribute);
    STC_LT_SYM(MatmulAlgoGetHeuristic, cublasLtMatmulAlgoGetHeuristic);
    STC_LT_SYM(MatmulAlgoCheck, cublasLtMatmulAlgoCheck);
    STC_LT_SYM(Matmul, cublasLtMatmul);
    STC_LT_SYM(GetStatusString, cublasLtGetStatusString);
    STC_LT_SYM(GetStatusName, cublasLtGetStatusName);
#undef STC_LT_SYM
    return STILL_OK;
}

void stc_lt_unload(stc_lt_api *api) {
    if (api->lib) dlclose(api->lib);
    memset(api, 0, sizeof *api);
}

/* ---- devices ------------------------------------------------------------------ */

/* Why there is no usable device, or NULL when there is one (n >= 1). */
static const char *no_device_reason(cudaError_t e, int n, char *buf, size_t cap) {
    if (e == cudaSuccess && n > 0) return NULL;
    if (e == cudaSuccess || e == cudaErrorNoDevice) {
        snprintf(buf, cap, "no CUDA device found");
    } else if (e == cudaErrorInsufficientDriver) {
        int rt = 0, drv = 0;
        cudaRuntimeGetVersion(&rt);
        cudaDriverGetVersion(&drv);
        if (drv == 0)
            snprintf(buf, cap, "no CUDA device found (no CUDA driver is installed)");
        else
            snprintf(buf, cap, "no CUDA device found: the driver (CUDA %d.%d) is older than this build's runtime (%d.%d)",
                     drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
    } else {
        snprintf(buf, cap, "no CUDA device found: cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e),
                 cudaGetErrorName(e));
    }
    (void)cudaGetLastError();
    return buf;
}

int stc_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

int stc_device_info(char *buf, size_t cap) {
    if (!buf || cap == 0) return STILL_E_ARG;
    buf[0] = 0;
    int n = 0;
    char why[256];
    cudaError_t e = cudaGetDeviceCount(&n);
    if (no_device_reason(e, n, why, sizeof why)) {
        snprintf(buf, cap, "%s", why);
        return STILL_E_UNSUPPORTED;
    }
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    size_t used = 0;
    for (int d = 0; d < n && used + 1 < cap; d++) {
        cudaDeviceProp p;
        if (cudaGetDeviceProperties(&p, d) != cudaSuccess) {
            (void)cudaGetLastError();
            used += (size_t)snprintf(buf + used, cap - used, "%s%d: (properties unavailable)", d ? "\n" : "", d);
            continue;
        }
        int smem_optin = 0;
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d);
        int w = snprintf(buf + used, cap - used,
                         "%s%d: %s, compute %d.%d, %d SMs, %.1f GiB, L2 %.1f MiB, smem/block %d KiB; "
                         "driver CUDA %d.%d, runtime %d.%d",
                         d ? "\n" : "", d, p.name, p.major, p.minor, p.multiProcessorCount,
                         (double)p.totalGlobalMem / (1u << 30), (double)p.l2CacheSize / (1u << 20), smem_optin / 1024,
                         drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
        if (w < 0) break;
        used += (size_t)w;
        if (used >= cap) used = cap - 1;
    }
    return STILL_OK;
}

/* A kernel whose attributes tell whether this binary has code the device can
 * run (sm_90 machine code, or compute_90 PTX the driver compiles). */
static __global__ void probe_kernel(int *x) {
    if (x) *x = 0;
}

int stc_ctx_create(int device, stc_ctx **out, still_err *err) {
    if (!out) return stc_fail(err, STILL_E_ARG, "stc_ctx_create: NULL output");
    *out = NULL;
    int n = 0;
    char why[256];
    cudaError_t e = cudaGetDeviceCount(&n);
    if (no_device_reason(e, n, why, sizeof why)) return stc_fail(err, STILL_E_UNSUPPORTED, "%s", why);
    if (device < 0 || device >= n)
        return stc_fail(err, STILL_E_ARG, "CUDA device %d requested, but there %s %d (0 .. %d)", device,
                        n == 1 ? "is" : "are", n, n - 1);
    stc_ctx *ctx = (stc_ctx *)calloc(1, sizeof *ctx);
    if (!ctx) return stc_fail(err, STILL_E_NOMEM, "out of host memory");
    ctx->device = device;
    int rc = STILL_OK;
#define TRY(call)                                                                                  \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            rc = stc_cuda_fail(err, e_, #call, __FILE__, __LINE__);                                \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
    {
        TRY(cudaSetDevice(device));
        int smem = 0;
        TRY(cudaDeviceGetAttribute(&ctx->sm_count, cudaDevAttrMultiProcessorCount, device));
        TRY(cudaDeviceGetAttribute(&ctx->cc_major, cudaDevAttrComputeCapabilityMajor, device));
        TRY(cudaDeviceGetAttribute(&ctx->cc_minor, cudaDevAttrComputeCapabilityMinor, device));
        TRY(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
        ctx->smem_optin = (size_t)smem;
        cudaFuncAttributes fa;
        e = cudaFuncGetAttributes(&fa, probe_kernel);
        if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
            (void)cudaGetLastError();
            cudaDeviceProp p;
            const char *name = cudaGetDeviceProperties(&p, device) == cudaSuccess ? p.name : "?";
            rc = stc_fail(err, STILL_E_UNSUPPORTED,
                          "CUDA device %d (%s, compute %d.%d) cannot run this build's code (built for sm_90a; "
                          "reconfigure with -DCMAKE_CUDA_ARCHITECTURES=<yours>, at least 80)",
                          device, name, ctx->cc_major, ctx->cc_minor);
            goto fail;
        }
        TRY(e);
        if (ctx->cc_major < 8) {
            rc = stc_fail(err, STILL_E_UNSUPPORTED,
                          "CUDA device %d has compute capability %d.%d; the kernels need bf16 tensor cores (8.0+)",
                          device, ctx->cc_major, ctx->cc_minor);
            goto fail;
        }
        TRY(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
        /* The side stream at the device's greatest priority, so that a prefill's scan (attn_still.cu) is
         * dispatched between the attention kernel's blocks instead of after them: prefill +1.7% at 16K, +1.9%
         * at 64K against the default priority (bench/results/2026-12-01-gpu-prefill-session16.md). */
        {
            int least = 0, greatest = 0;
            TRY(cudaDeviceGetStreamPriorityRange(&least, &greatest));
            TRY(cudaStreamCreateWithPriority(&ctx->side, cudaStreamNonBlocking, greatest));
        }
        TRY(cudaEventCreateWithFlags(&ctx->fork_ev, cudaEventDisableTiming));
        TRY(cudaEventCreateWithFlags(&ctx->join_ev, cudaEventDisableTiming));
        /* PDL needs the device (sm_90+) and this build's code for it: the kernels' griddepcontrol.wait exists
         * only in code compiled for compute 9.0+ (fa: the probe kernel as it will run here) */
        ctx->pdl = ctx->cc_major >= 9 && fa.ptxVersion >= 90 && fa.binaryVersion >= 90;
        ctx->gemm_tune = stc_env_on("STILL_CUDA_GEMM_TUNE");
        const char *algos = getenv("STILL_CUDA_GEMM_TUNE_ALGOS");
        ctx->gemm_tune_algos = algos ? atoi(algos) : 0;
        const char *force = getenv("STILL_CUDA_GEMM_FORCE");   /* unset, "" or "0": off */
        ctx->gemm_force_n = ctx->gemm_force_k = ctx->gemm_force_i = -1;
        ctx->attn_wg_probe = -1;
        if (force && force[0] && strcmp(force, "0")) {
            char tail = 0;
            if (sscanf(force, "%d:%d:%d%c", &ctx->gemm_force_n, &ctx->gemm_force_k, &ctx->gemm_force_i, &tail) != 3 ||
                ctx->gemm_force_n < 1 || ctx->gemm_force_k < 1 || ctx->gemm_force_i < 0) {
                rc = stc_fail(err, STILL_E_ARG, "STILL_CUDA_GEMM_FORCE: expected N:K:i (positive N, K; i >= 0), got \"%s\"",
                              force);
                goto fail;
            }
        }
    }
#undef TRY
    if ((rc = stc_lt_load(&ctx->lt_api, err))) goto fail;
    {
        cublasStatus_t s = ctx->lt_api.Create(&ctx->lt);
        if (s != CUBLAS_STATUS_SUCCESS) {
            ctx->lt = NULL;
            rc = stc_lt_fail(err, s, "cublasLtCreate(&ctx->lt)", __FILE__, __LINE__);
            goto fail;
        }
    }
    /* cuBLAS's recommendation for Hopper: 32 MiB of workspace. */
    ctx->lt_workspace_bytes = (size_t)32 << 20;
    if ((rc = stc_malloc(ctx, ctx->lt_workspace_bytes, "the cuBLASLt workspace", &ctx->lt_workspace, err))) goto fail;
    *out = ctx;
    return STILL_OK;
fail:
    stc_ctx_free(ctx);
    return rc;
}

void stc_ctx_free(stc_ctx *ctx) {
    if (!ctx) return;
    if (cudaSetDevice(ctx->device) != cudaSuccess) (void)cudaGetLastError();
    if (ctx->stream) cudaStreamSynchronize(ctx->stream);
    if (ctx->side) cudaStreamSynchronize(ctx->side);
    for (int i = 0; i < STC_GEMM_PLANS; i++) {
        stc_gemm_plan *p = &ctx->plans[i];
        if (p->la) ctx->lt_api.MatrixLayoutDestroy(p->la);
        if (p->lb) ctx->lt_api.MatrixLayoutDestroy(p->lb);
        if (p->lc) ctx->lt_api.MatrixLayoutDestroy(p->lc);
        if (p->desc) ctx->lt_api.MatmulDescDestroy(p->desc);
    }
    if (ctx->lt) ctx->lt_api.Destroy(ctx->lt);
    stc_lt_unload(&ctx->lt_api);
    cudaFree(ctx->lt_workspace);
    cudaFree(ctx->attn_ws);
    if (ctx->stream) cudaStreamDestroy(ctx->stream);
    if (ctx->side) cudaStreamDestroy(ctx->side);
    if (ctx->fork_ev) cudaEventDestroy(ctx->fork_ev);
    if (ctx->join_ev) cudaEventDestroy(ctx->join_ev);
    (void)cudaGetLastError();
    free(ctx);
}

int stc_ctx_sync(stc_ctx *ctx, still_err *err) {
    STC_ENTER(ctx, err);
    STC_CUDA(err, cudaStreamSynchronize(ctx->stream));
    return STILL_OK;
}

int stc_ctx_device(const stc_ctx *ctx) { return ctx ? ctx->device : 0; }

int stc_ctx_wait(stc_ctx *ctx, stc_ctx *other, still_err *err) {
    STC_ENTER(ctx, err);
    if (!other || other->device != ctx->device)
        return stc_fail(err, STILL_E_ARG, "stc_ctx_wait: no other context on device %d", ctx->device);
    if (other == ctx) return STILL_OK;
    cudaEvent_t ev;
    STC_CUDA(err, cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaError_t e = cudaEventRecord(ev, other->stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(ctx->stream, ev, 0);
    cudaEventDestroy(ev);   /* released once the wait is done */
    if (e != cudaSuccess) return stc_cuda_fail(err, e, "cudaEventRecord / cudaStreamWaitEvent", __FILE__, __LINE__);
    return STILL_OK;
}

/* ---- CUDA graphs ------------------------------------------------------------------- */

struct stc_graph {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
};

int stc_graph_begin(stc_ctx *ctx, still_err *err) {
    STC_ENTER(ctx, err);
    STC_CUDA(err, cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeThreadLocal));
    return STILL_OK;
}

int stc_graph_end(stc_ctx *ctx, int ok, stc_graph **out, still_err *err) {
    if (out) *out = NULL;
    STC_ENTER(ctx, err);
    cudaGraph_t graph = NULL;
    const cudaError_t e = cudaStreamEndCapture(ctx->stream, &graph);
    if (!ok || e != cudaSuccess || !out) {
        if (graph) cudaGraphDestroy(graph);
        (void)cudaGetLastError();   /* clear the error a failed recording leaves */
        if (!ok || !out) return ok ? stc_fail(err, STILL_E_ARG, "stc_graph_end: NULL out") : STILL_OK;
        return stc_cuda_fail(err, e, "cudaStreamEndCapture", __FILE__, __LINE__);
    }
    stc_graph *g = (stc_graph *)calloc(1, sizeof *g);
    if (!g) {
        cudaGraphDestroy(graph);
        return stc_fail(err, STILL_E_NOMEM, "out of memory");
    }
    g->graph = graph;
    const cudaError_t ei = cudaGraphInstantiate(&g->exec, graph, 0);
    if (ei != cudaSuccess) {
        cudaGraphDestroy(graph);
        free(g);
        return stc_cuda_fail(err, ei, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
    *out = g;
    return STILL_OK;
}

int stc_graph_launch(stc_ctx *ctx, const stc_graph *g, still_err *err) {
    STC_ENTER(ctx, err);
    if (!g) return stc_fail(err, STILL_E_ARG, "stc_graph_launch: NULL graph");
    STC_CUDA(err, cudaGraphLaunch(g->exec, ctx->stream));
    return STILL_OK;
}

void stc_graph_free(stc_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    if (g->graph) cudaGraphDestroy(g->graph);
    free(g);
}

void *stc_ctx_stream(const stc_ctx *ctx) { return ctx ? (void *)ctx->stream : NULL; }

int stc_ctx_sm_count(const stc_ctx *ctx) { return ctx ? ctx->sm_count : 0; }

/* ---- memory ----------------------------------------------------------------------- */

int stc_malloc(stc_ctx *ctx, size_t bytes, const char *what, void **out_dev, still_err *err) {
    if (!out_dev) return stc_fail(err, STILL_E_ARG, "stc_malloc: NULL output");
    *out_dev = NULL;
    STC_ENTER(ctx, err);
    if (bytes == 0) bytes = 1;
    cudaError_t e = cudaMalloc(out_dev, bytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        *out_dev = NULL;
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        (void)cudaGetLastError();
        return stc_fail(err, STILL_E_NOMEM, "CUDA out of memory allocating %.1f MiB for %s (%.1f MiB free of %.1f MiB)",
                        (double)bytes / 1048576.0, what ? what : "a buffer", (double)free_b / 1048576.0,
                        (double)total_b / 1048576.0);
    }
    if (e != cudaSuccess) {
        *out_dev = NULL;
        return stc_cuda_fail(err, e, "cudaMalloc", __FILE__, __LINE__);
    }
    return STILL_OK;
}

void stc_free(stc_ctx *ctx, void *dev) {
    if (!ctx || !dev) return;
    if (cudaSetDevice(ctx->device) != cudaSuccess) (void)cudaGetLastError();
    /* Kernels enqueued earlier may still use the buffer. */
    cudaStreamSynchronize(ctx->stream);
    cudaFree(dev);
    (void)cudaGetLastError();
}

int stc_memcpy_h2d(stc_ctx *ctx, void *dst_dev, const void *src_host, size_t bytes, still_err *err) {
    STC_ENTER(ctx, err);
    if (bytes == 0) return STILL_OK;
    if (!dst_dev || !src_host) return stc_fail(err, STILL_E_ARG, "stc_memcpy_h2d: NULL pointer");
    STC_CUDA(err, cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, ctx->stream));
    STC_CUDA(err, cudaStreamSynchronize(ctx->stream));
    return STILL_OK;
}

int stc_memcpy_d2d(stc_ctx *ctx, void *dst_dev, const void *src_dev, size_t bytes, still_err *err) {
    STC_ENTER(ctx, err);
    if (bytes == 0) return STILL_OK;
    if (!dst_dev || !src_dev) return stc_fail(err, STILL_E_ARG, "stc_memcpy_d2d: NULL pointer");
    const char *d = (const char *)dst_dev, *s = (const char *)src_dev;
    if (d < s + bytes && s < d + bytes) return stc_fail(err, STILL_E_ARG, "stc_memcpy_d2d: overlapping regions");
    STC_CUDA(err, cudaMemcpyAsync(dst_dev, src_dev, bytes, cudaMemcpyDeviceToDevice, ctx->stream));
    return STILL_OK;
}

int stc_memcpy_d2h(stc_ctx *ctx, void *dst_host, const void *src_dev, size_t bytes, still_err *err) {
    STC_ENTER(ctx, err);
    if (bytes == 0) return STILL_OK;
    if (!dst_host || !src_dev) return stc_fail(err, STILL_E_ARG, "stc_memcpy_d2h: NULL pointer");
    STC_CUDA(err, cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, ctx->stream));
    STC_CUDA(err, cudaStreamSynchronize(ctx->stream));
    return STILL_OK;
}

int stc_memset(stc_ctx *ctx, void *dst_dev, int value, size_t bytes, still_err *err) {
    STC_ENTER(ctx, err);
    if (bytes == 0) return STILL_OK;
    if (!dst_dev) return stc_fail(err, STILL_E_ARG, "stc_memset: NULL pointer");
    STC_CUDA(err, cudaMemsetAsync(dst_dev, value, bytes, ctx->stream));
    return STILL_OK;
}
