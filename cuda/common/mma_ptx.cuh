/* Thin wrappers of the PTX instructions the tensor-core kernels use
 * (cp.async, ldmatrix, mma.sync m16n8k16 bf16 and fp16, ex2.approx), for sm_80+.
 * Shared by the softmax (cuda/kinds/softmax/attn_softmax.cu) and still kernels; the
 * fragment layouts they imply are in cuda/kinds/attn_layout.cuh and checked by
 * test_cuda_kernels --cpu-selftest. */
#ifndef STILL_CUDA_MMA_PTX_CUH
#define STILL_CUDA_MMA_PTX_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace stc_ptx {

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* Hopper's wgmma (sm_90a code only): the shared-memory matrix descriptor of a K-major (or, for a B
 * operand, N-major) tile with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7), rows of 128
 * bytes, the tile 1024-byte aligned); sbo_bytes between groups of 8 rows. Adding 2 to it moves the start
 * 32 bytes on (a k-step of 16 halves). */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t sbo_bytes) {
    return (uint64_t)((saddr & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(sbo_bytes >> 4) << 32) |
           ((uint64_t)1 << 62);   /* 128-byte swizzle; the leading offset unused (1) */
}
#endif

/* Orders this thread's ordinary shared-memory writes (and cp.async's) before the tensor cores' reads
 * through the async proxy; a barrier after it makes that hold for the whole block. */
__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* 16 bytes global -> shared, asynchronously; zero-filled when !ok (then src is not read). */
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* 16 bytes to shared memory (synchronous). */
__device__ __forceinline__ void st_shared_16(uint32_t dst, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

/* c += a · b for one m16n8k16 tile: bf16 inputs, fp32 accumulators. */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The same with IEEE half inputs (10-bit mantissa; the still kernel's choice). */
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x (MUFU.EX2; relative error ~2^-22, 2^-inf = 0). */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* Two floats -> bf16x2 (round to nearest even), lo in the low half. */
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Eight floats (two float4, 16-byte aligned) -> eight bf16 as one uint4. */
__device__ __forceinline__ uint4 load8_f32_as_bf16(const float *p) {
    const float4 a = *reinterpret_cast<const float4 *>(p), b = *reinterpret_cast<const float4 *>(p + 4);
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y), pack_bf16(b.z, b.w));
}

/* Two floats -> half2 (round to nearest even, |x| > 65504 -> inf, as
 * src/format/quant.c's f32_to_f16), lo in the low half. */
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Eight fp32 values from shared memory (16-byte aligned address) as eight halves, as load8_f32_as_f16. */
__device__ __forceinline__ uint4 ld_shared_8f_as_f16(uint32_t src) {
    float4 a, b;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(a.x), "=f"(a.y), "=f"(a.z), "=f"(a.w)
                 : "r"(src)
                 : "memory");
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(b.x), "=f"(b.y), "=f"(b.z), "=f"(b.w)
                 : "r"(src + 16)
                 : "memory");
    return make_uint4(pack_f16(a.x, a.y), pack_f16(a.z, a.w), pack_f16(b.x, b.y), pack_f16(b.z, b.w));
}
/* Eight floats (two float4, 16-byte aligned) -> eight halves as one uint4. */
__device__ __forceinline__ uint4 load8_f32_as_f16(const float *p) {
    const float4 a = *reinterpret_cast<const float4 *>(p), b = *reinterpret_cast<const float4 *>(p + 4);
    return make_uint4(pack_f16(a.x, a.y), pack_f16(a.z, a.w), pack_f16(b.x, b.y), pack_f16(b.z, b.w));
}

}   // namespace stc_ptx

#endif
