/* Internal view of the model and its per-sequence context. */
#ifndef STILL_MODEL_H
#define STILL_MODEL_H

#include "still.h"
#include "cpu/kernels.h"
#include "kinds/attn.h"
#include "model/lora.h"
#include "model/decode_threads.h"
#include "kinds/plan.h"

typedef struct gguf_file gguf_file;
typedef struct tokenizer tokenizer;

typedef struct {
    int n_layer, d_model, n_head, n_head_kv, head_dim, d_ff, n_vocab, n_ctx_train;
    float rope_theta, norm_eps;
} model_config;

typedef struct {
    const float *attn_norm, *ffn_norm;
    weight_matrix wq, wk, wv, wo, w_gate, w_up, w_down;
} layer_weights;

struct still_model {
    gguf_file *file;          /* owns the mapping every weight points into */
    model_config cfg;
    layer_weights *layers;    /* n_layer */
    weight_matrix tok_embd, output;
    const float *output_norm;
    tokenizer *tok;
    /* Attention plan, per layer: the kind, its configuration (n_ctx is set
     * per context) and its trainable parameters (owned; NULL if none). */
    attn_config *attn_cfg;
    float **attn_params;
    int plan_sel_cache;       /* the store the plan is sized for (STILL_SEL_F16, _F32 or _Q8; still.attn.sel_cache):
                               * contexts created with STILL_SEL_PLAN use it */
    lora_set *lora;           /* stage-2 LoRA applied on the fly (owned; NULL if none) */
};

typedef struct gpu_context gpu_context;

struct still_context {
    const still_model *m;
    gpu_context *gpu;             /* STILL_DEVICE_CUDA: the GPU forward (model_cuda.c); attn etc. unused */
    int n_ctx, n_batch, n_past;
    attn_state **attn;            /* n_layer states (KV caches for softmax), kinds from the model's plan */
    float *scratch;               /* one allocation carved into the chunk activations below */
    float *x, *h, *q, *k, *v, *att, *gate, *up;
    float *q_nope, *k_nope;       /* q, k before RoPE (for kinds that ask; else NULL) */
    float *rope_inv_freq;
    float *lora_tmp;              /* n_batch x rank floats when the model has a LoRA */
    int matvec_path;              /* 0: float single-token products; else the MATVEC_Q8_* path (quant.h) */
    act_q8 xq;                    /* the quantized activation of the integer path */
    act_q8 *xqm;                  /* prefill's quantized activations, one per row (n_batch), with prefill int8 */
    int mq_path;                  /* prefill's integer path (MATVEC_Q8_VNNI), 0: float */
    weight_matrix *gate_q8;       /* integer path: per still layer with a gate, W_g as Q8_0 (data owned; NULL
                                   * data: none), its product taken with q, k and v in a decode step */
    float *gate_pre;              /* [H*D]: that product's output */
    int fixed_threads;            /* decode steps on all OpenMP threads (no governor) */
    decode_threads threads;       /* the decode steps' thread governor (model/decode_threads.h) */
    uint64_t snap_fp;             /* state snapshots: the fingerprint of model, plan, parameters and LoRA (state_file.c; */
    int snap_fp_ok;               /* computed at the first snapshot: a context's model does not change while it lives) */
    still_layer_observer observer;  /* optional: sees every layer's attention inputs/outputs */
    void *observer_data;         /* head_dim / 2 */
};

const gguf_file *still_model_gguf(const still_model *m);
/* The model's plan (src/kinds/plan.c): its shape as a plan sees it; a view of the plan it holds (not owned);
 * replace it by p (taken over, *p emptied). */
plan_shape model_plan_shape(const still_model *m);
attn_plan model_plan(const still_model *m);
void model_set_plan(still_model *m, attn_plan *p);
/* adapter.c: set a model's plan from a GGUF's (an adapter or a checkpoint). */
int adapter_apply(still_model *m, const gguf_file *f, still_err *err);
/* A GGUF writer already holding m's adapter (architecture, plan, parameters):
 * callers add more (training checkpoints) and write it. */
typedef struct gguf_writer gguf_writer;
int adapter_writer(const still_model *m, gguf_writer **out, still_err *err);
/* The same with the parameters as F16 (f16 != 0) or F32. */
int adapter_writer_typed(const still_model *m, int f16, gguf_writer **out, still_err *err);
const tokenizer *still_model_tokenizer(const still_model *m);
/* The shapes a LoRA of this model has (n_in / n_out of every target). */
lora_shape model_lora_shape(const still_model *m);
/* Replace the model's LoRA by s (taken over; NULL removes it). */
void model_set_lora(still_model *m, lora_set *s);

#endif
