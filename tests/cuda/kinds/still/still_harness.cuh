/* The still groups' shared parts (still_harness.cu): a case (configuration and length), random inputs,
 * the GPU run of a call schedule, the selection check, the labels, the small cases that the GPU test and
 * the CPU emulation (--cpu-selftest) both run. The reference and the emulation are still_ref.hpp. */
#ifndef STILL_TESTS_CUDA_KINDS_STILL_STILL_HARNESS_CUH
#define STILL_TESTS_CUDA_KINDS_STILL_STILL_HARNESS_CUH

#include "harness.cuh"

/* still_ref.hpp's functions are static: a file that includes it uses only some of them */
#pragma nv_diagnostic push
#pragma nv_diag_suppress 177
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#include "still_ref.hpp"
#pragma GCC diagnostic pop
#pragma nv_diagnostic pop

/* A configuration and a sequence length to test. */
struct still_case {
    const char *name;
    stc_still_config cfg;
    int L;
};

stc_still_config still_cfg(int H, int Hk, int D, int d, int C, int budget, int lambda, int n_ctx);
/* lolcats on the still kernels (GPU only: the CPU emulation of --cpu-selftest is still's) */
stc_still_config lolcats_cfg(int H, int Hk, int C, int n_ctx);
/* Random inputs of a case (still_harness.cu says how they are drawn). */
still_seq make_still_seq(const stc_still_config &c, int L);
/* Sel positions equal to the reference's (per selection head, in Sel order). */
bool check_selection(const char *name, const std::vector<std::vector<int>> &got, const still_ref_result &ref,
                     int Hs);
/* Runs a schedule on the GPU: outputs y [L][H][D] and the Sel positions (still_harness.cu: the options). */
bool run_still_gpu(stc_still *st, const still_seq &s, const std::vector<int> &sched,
                   bool device_pos, std::vector<float> &y, std::vector<std::vector<int>> &sel,
                   std::vector<uint16_t> *yb = nullptr, const dbuf *qkv = nullptr, int64_t ld = 0,
                   const dbuf *kv_f16 = nullptr, int tail = 0);
std::string still_label(const still_case &c, const stc_still_info &info);
/* The cases both the GPU test and the CPU emulation run (the GPU test adds the long SmolLM2 ones). */
std::vector<still_case> still_small_cases(void);

#endif
