/* still — public C API.
 *
 * Every function that can fail returns an int status (STILL_OK == 0, negative
 * on error) and, when given a non-NULL still_err, writes a one-line message
 * into it.  Objects are opaque; each has exactly one owner, which frees it
 * with the matching *_free function. */
#ifndef STILL_H
#define STILL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    STILL_OK = 0,
    STILL_E_IO = -1,          /* file missing, unreadable, unwritable */
    STILL_E_FORMAT = -2,      /* malformed input file or data */
    STILL_E_NOMEM = -3,       /* allocation failed */
    STILL_E_ARG = -4,         /* bad argument / flag / out-of-range value */
    STILL_E_UNSUPPORTED = -5, /* valid but not supported (tensor type, arch) */
    STILL_E_STATE = -6,       /* e.g. context full */
};

typedef struct still_err {
    int code;
    char msg[512];
} still_err;


/* ---- model ------------------------------------------------------------ */

typedef struct still_model still_model;       /* weights + tokenizer (read-only, shareable) */
typedef struct still_context still_context;   /* one sequence's state (KV cache, scratch) */

typedef struct still_model_info {
    int n_layer, d_model, n_head, n_head_kv, head_dim, d_ff, n_vocab, n_ctx_train;
    float rope_theta, norm_eps;
    size_t file_bytes;
    uint64_t n_params;   /* elements of all tensors in the file */
} still_model_info;

int still_model_load(const char *path, still_model **out, still_err *err);
void still_model_free(still_model *m);
still_model_info still_model_get_info(const still_model *m);

/* Attention plan: which kind each layer uses and its hyper-parameters
 * (../shared/spec/attention.md). Strings are copied. */
typedef struct still_attn_params {
    const char *kind;           /* "softmax" (default), "swa", "lolcats", "liger", "still" */
    const char *softmax_layers; /* comma-separated layers kept as softmax (inter-layer hybrids), or NULL */
    int window;                 /* swa window; liger's sliding window (default 64) */
    int chunk;                  /* C (default 64) */
    int feature_dim;            /* Hedgehog F (default 64) */
    int budget;                 /* still: m softmax slots per head (default 896; 0 = uncapped) */
    const char *layer_budgets;  /* still: per-layer budgets replacing budget for the layers named,
                                 * "L=M,A-B=M,..." (NULL: budget everywhere) */
    int lambda;                 /* still: tokens kept per leaving chunk (-1: derived from the budget) */
    int per_kv_head;            /* still: select per KV head */
    const char *selection;      /* still: chunk (default: λ tokens of each leaving chunk join Sel forever) or
                                 * global (Sel keeps the best budget - 2C tokens of the whole history and
                                 * evicts its worst into the linear state) */
    int sel_span;               /* still: a leaving token ranks by the best score within sel_span positions of it
                                 * (in its chunk and the next), so neighbours of a salient token are kept with it
                                 * (default 0: its own score) */
    const char *routing;        /* still: saliency (default), random, keynorm, qk, position, none */
    int linear;                 /* still: linear branch (default 1) */
    const char *no_linear_layers; /* still: layers whose linear branch is off, "L,A-B,..." (NULL: none;
                                   * docs/linear-off-layers.md) */
    const char *feature_map;    /* still: npmap (default) or hedgehog */
    int gate;                   /* still: gate (default 1) */
    int gate_den;               /* still: the gate also scales the linear state's term of the denominator,
                                 * per channel (default 0; docs/gate-den.md) */
    const char *sel_cache;      /* still: the store of the selected tokens the plan's memory is sized for, "f16"
                                 * (NULL, the default), "f32" or "q8" (8 bits + a scale per token and vector);
                                 * contexts use it unless their own sel_cache names another (docs/sel-q8.md) */
    uint64_t seed;              /* parameter initialisation and random routing */
    const char *plan;           /* a plan of any mix of kinds, per layer, with per-layer settings (replaces kind and
                                 * softmax_layers; NULL: none): groups KIND[/key=value...]:LAYERS, e.g.
                                 * "gdn:0-29,softmax:3,7,11,15,19,23,27" or "still/budget=8320:*,softmax:0";
                                 * docs/plans.md */
} still_attn_params;

still_attn_params still_attn_default_params(void);
/* Switch every layer (but softmax_layers) to a kind. New parameters start at
 * the spec's initialisation (an untrained conversion). Contexts created
 * earlier must be freed first. */
int still_model_set_attention(still_model *m, const still_attn_params *p, still_err *err);
/* Linearized models: an adapter GGUF holds the plan and the new parameters
 * only; a merged GGUF is the base model plus the adapter, loadable alone.
 * Loading an adapter replaces the plan. Files are written atomically. */
int still_model_load_adapter(still_model *m, const char *path, still_err *err);
/* As still_model_load_adapter, then replace the plan settings named in mask
 * (STILL_PLAN_* bits) by over's. Only settings that do not change the
 * parameters can be replaced (budget, layer budgets, lambda, routing, per-KV-head, selection, linear
 * branch and its per-layer switch, the gate's place in the denominator, the selected store, window, chunk,
 * seed); any other bit is STILL_E_ARG. */
enum {
    STILL_PLAN_WINDOW = 1u << 0, STILL_PLAN_CHUNK = 1u << 1, STILL_PLAN_BUDGET = 1u << 2,
    STILL_PLAN_LAMBDA = 1u << 3, STILL_PLAN_ROUTING = 1u << 4, STILL_PLAN_PER_KV_HEAD = 1u << 5,
    STILL_PLAN_LINEAR = 1u << 6, STILL_PLAN_SEED = 1u << 7,
    STILL_PLAN_SOFTMAX_LAYERS = 1u << 8, STILL_PLAN_FEATURE_DIM = 1u << 9,
    STILL_PLAN_FEATURE_MAP = 1u << 10, STILL_PLAN_GATE = 1u << 11, STILL_PLAN_SELECTION = 1u << 12,
    STILL_PLAN_SEL_SPAN = 1u << 13, STILL_PLAN_LAYER_BUDGETS = 1u << 14, STILL_PLAN_NO_LINEAR_LAYERS = 1u << 15,
    STILL_PLAN_GATE_DEN = 1u << 16, STILL_PLAN_SEL_CACHE = 1u << 17, STILL_PLAN_PLAN = 1u << 18,
    STILL_PLAN_OVERRIDABLE = ((1u << 8) - 1) | STILL_PLAN_SELECTION | STILL_PLAN_SEL_SPAN | STILL_PLAN_LAYER_BUDGETS |
                             STILL_PLAN_NO_LINEAR_LAYERS | STILL_PLAN_GATE_DEN | STILL_PLAN_SEL_CACHE,
};
int still_model_load_adapter_with(still_model *m, const char *path, const still_attn_params *over, unsigned mask,
                                  still_err *err);
int still_model_save_adapter(const still_model *m, const char *path, still_err *err);
/* The same with the parameters stored as type: F32 (what still_model_save_adapter
 * writes) or F16 (half the size; a parameter beyond f16's range is an error). */
enum { STILL_ADAPTER_F32 = 0, STILL_ADAPTER_F16 = 1 };
int still_model_save_adapter_as(const still_model *m, const char *path, int type, still_err *err);
int still_model_save_merged(const still_model *m, const char *path, still_err *err);
/* LoRA (stage 2, still finetune): load the LoRA tensors of an adapter GGUF
 * stored as llama.cpp stores them (general.type = adapter, adapter.type =
 * lora, blk.N.<tensor>.weight.lora_a / .lora_b) and apply them on the fly,
 * scaled by scale (1: as trained; llama.cpp's --lora-scaled). Replaces any
 * LoRA the model has; an adapter with LoRA tensors loads them too
 * (still_model_load_adapter). Contexts created earlier must be freed first. */
int still_model_load_lora(still_model *m, const char *path, float scale, still_err *err);
int still_model_has_lora(const still_model *m);
/* Remove the model's LoRA (if any). */
void still_model_drop_lora(still_model *m);
/* Attention kind name of layer l. */
const char *still_model_layer_kind(const still_model *m, int layer);

typedef struct still_context_params {
    int n_ctx;      /* maximum sequence length (tokens) */
    int n_batch;    /* prefill chunk size (tokens per forward) */
    int sel_cache;  /* still: storage of the selected tokens' keys and values: STILL_SEL_PLAN (0, the
                       default: the plan's, still_attn_params.sel_cache, IEEE half unless it says
                       otherwise, like llama.cpp's f16 KV cache), or STILL_SEL_F16, STILL_SEL_F32
                       (CPU only) or STILL_SEL_Q8 (8 bits + a scale per token and vector) */
    int device;     /* STILL_DEVICE_CPU (0, default) or STILL_DEVICE_CUDA (GPU 0; builds
                       with the CUDA backend; every attention kind but still with Hedgehog maps) */
    int matvec;     /* CPU single-token products (decode): STILL_MATVEC_DEFAULT (0: _INT8 on the
                       CPU, float products with the CUDA device), STILL_MATVEC_INT8 (the
                       activation quantized once to 8-bit blocks, integer dot products on Q4_0 /
                       Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights by the best path the running CPU has; other
                       types as float) or STILL_MATVEC_FLOAT (float activations, the prefill's
                       products to rounding); _INT8_PORTABLE / _INT8_AVX2 / _INT8_VNNI (AVX-512) /
                       _INT8_AVXVNNI (VEX) force one
                       path. The integer paths are the CPU's: asked for explicitly, they are
                       refused with the CUDA device. Prefill (several tokens): see prefill. */
    int fixed_threads; /* CPU decode steps: 0 (default) lets a governor run each step on all the OpenMP
                       threads or on half of them, whichever its timings find faster (a busy machine makes
                       spinning threads collapse; src/model/decode_threads.h); 1 always uses all of them */
    int prefill;    /* CPU products of several tokens (prefill): STILL_PREFILL_FLOAT (0, default: float
                       activations) or STILL_PREFILL_INT8 (each token's activation quantized to 8-bit
                       blocks as decode's, integer products on Q4_0 / Q4_1 / Q8_0 weights where the CPU has
                       AVX-512 VNNI; other types and CPUs as float). Refused with the CUDA device. */
} still_context_params;
enum { STILL_MATVEC_DEFAULT = 0, STILL_MATVEC_FLOAT = 1, STILL_MATVEC_INT8 = 2, STILL_MATVEC_INT8_PORTABLE = 3,
       STILL_MATVEC_INT8_AVX2 = 4, STILL_MATVEC_INT8_VNNI = 5, STILL_MATVEC_INT8_AVXVNNI = 6 };
enum { STILL_PREFILL_FLOAT = 0, STILL_PREFILL_INT8 = 1 };
enum { STILL_SEL_PLAN = 0, STILL_SEL_F16 = 1, STILL_SEL_F32 = 2, STILL_SEL_Q8 = 3 };
enum { STILL_DEVICE_CPU = 0, STILL_DEVICE_CUDA = 1 };

int still_context_create(const still_model *m, still_context_params p, still_context **out, still_err *err);
void still_context_free(still_context *c);
int still_context_n_past(const still_context *c);
/* Forget everything (or keep only the first n tokens: n <= n_past). */
int still_context_truncate(still_context *c, int n, still_err *err);
/* Bytes of the attention state (KV cache, or the kind's state) as allocated. */
size_t still_context_state_bytes(const still_context *c);
/* Snapshots of the sequence state (CPU and CUDA contexts; each device reads only its own): save writes the state
 * after n_past tokens to f; load reads one back into a context of the same model, adapter, plan, n_ctx and device,
 * which then continues exactly as the saved one would have (bit for bit). A damaged, truncated or foreign snapshot
 * is refused (err says why) before the context is touched (on the GPU a device error while copying can leave it
 * partly written). The format is a cache's: host byte order, for this build. */
int still_context_state_save(const still_context *c, FILE *f, still_err *err);
int still_context_state_load(still_context *c, FILE *f, still_err *err);

/* Observe every layer's attention of each forward chunk (analysis tools,
 * training): x [T][d_model] the normed layer input, q [T][H*D] and k, v
 * [T][Hk*D] after RoPE, out [T][H*D] the per-head outputs, for tokens at
 * positions p0 .. p0+T-1. NULL switches it off. */
typedef void (*still_layer_observer)(void *data, int layer, int p0, int T, const float *x, const float *q,
                                     const float *k, const float *v, const float *out);
void still_context_set_observer(still_context *ctx, still_layer_observer fn, void *data);

/* Feed n tokens (appended after n_past) in chunks of n_batch.
 * logits: NULL, or n_vocab floats receiving the last token's logits, or, when
 * all_logits is set, n * n_vocab floats (one row per token). */
int still_decode(still_context *c, const int32_t *tokens, int n, float *logits, int all_logits, still_err *err);
/* One token for each of n sequences (distinct CPU contexts of one model; n at most the first context's n_batch) in
 * one forward: the weights are read once for all of them (on the 8-bit decode path; row by row otherwise), each
 * sequence's attention runs on its own state. logits: n × n_vocab floats. Each sequence's logits and state come out
 * bit for bit as still_decode of that token alone gives them. A failure midway leaves the contexts unusable
 * (truncate them to 0). */
int still_decode_batch(still_context *const *ctxs, int n, const int32_t *tokens, float *logits, still_err *err);

/* ---- tokenizer (the model's) ------------------------------------------ */

int still_tokenize(const still_model *m, const char *text, size_t len, int parse_special,
                   int32_t **ids, size_t *n_ids, still_err *err);   /* *ids malloc'ed */
/* Bytes of one token; returns its length (may exceed cap: then truncated). */
size_t still_token_to_piece(const still_model *m, int32_t id, char *buf, size_t cap);
int still_token_is_eog(const still_model *m, int32_t id);
/* The default system prompt of the model's chat template, or NULL. */
const char *still_model_default_system(const still_model *m);

/* ---- stage-1 training: attention transfer (still linearize) ------------ */

/* Train the new attention parameters of the model's plan (set it first with
 * still_model_set_attention) so that every trainable layer reproduces the
 * model's own softmax attention: teacher-forced, layer-wise distillation,
 * loss = 1000 · mean over trained layers of MSE(per-head outputs), AdamW,
 * global gradient clipping, linear warm-up then cosine decay. The trained
 * parameters are left in the model's plan and written to out_path. */
struct still_train_progress;
typedef struct still_train_params {
    const char *const *data_files;   /* UTF-8 text files */
    int n_data_files;
    long long tokens;     /* training tokens (steps = tokens / (seq * batch), at least 1) */
    int seq;              /* tokens per sequence (default 1024) */
    int batch;            /* sequences per optimizer step, gradients accumulated (default 8) */
    float lr;             /* peak learning rate (default 1e-2) */
    float lr_min;         /* final learning rate of the cosine (default lr / 10; < 0: that default) */
    int warmup;           /* warm-up steps (default -1: 5% of the steps) */
    float weight_decay;   /* decoupled (AdamW), default 0 */
    float clip;           /* global gradient-norm clip (default 1; 0 = off) */
    float val_frac;       /* held-out fraction of the sequences (default 0.02) */
    int val_max;          /* at most this many validation sequences (default 32) */
    uint64_t seed;        /* data order (default 0); the parameters' initialisation is the plan's seed */
    int ckpt_every;       /* checkpoint every N steps (default 10; 0 = only at the end) */
    const char *ckpt_path;/* default: out_path + ".ckpt" */
    int resume;           /* continue from ckpt_path */
    const char *out_path; /* the trained adapter GGUF (required) */
    int adapter_f16;      /* write the adapter's parameters as F16 (checkpoints stay F32) */
    int device;           /* STILL_DEVICE_CPU (default) or STILL_DEVICE_CUDA: the teacher, the losses, the
                           * gradients and AdamW on GPU 0 (still layers, NP-Map, head dim 64) */
    /* Progress, called after every step and validation pass (may be NULL). */
    void (*progress)(void *data, const struct still_train_progress *p);
    void *progress_data;
} still_train_params;

typedef struct still_train_progress {
    const char *phase;    /* "data", "val-before", "train", "val-after", "done" */
    int step, n_steps;    /* optimizer steps done / total */
    int done, total;      /* sequences done / total in the current phase */
    long long tokens_done;/* training tokens processed (all phases: sequences * seq) */
    double loss;          /* training: last step's loss; validation: running mean loss */
    double grad_norm, lr;
    double tokens_per_s;  /* training throughput so far (this run) */
    double elapsed_s, eta_s;
} still_train_progress;

typedef struct still_train_result {
    int n_layer;
    int n_steps, start_step;      /* start_step > 0 when resumed */
    long long n_tokens_data;      /* tokens read from the data files */
    int n_train_seqs, n_val_seqs;
    double *val_mse_before;       /* [n_layer] per-layer validation MSE (NaN: layer not trained) */
    double *val_mse_after;
    double train_seconds, tokens_per_s;
    double final_loss;
} still_train_result;

still_train_params still_train_default_params(void);
int still_train(still_model *m, const still_train_params *p, still_train_result *res, still_err *err);
void still_train_result_free(still_train_result *r);

/* ---- stage-2 training: LoRA fine-tuning (still finetune) --------------- */

/* Train LoRA tensors on the model's projection matrices (and optionally the
 * plan's own attention parameters) on next-token cross-entropy through the
 * whole model with its attention plan (spec "Stage 2"): plain text (every
 * token learnt) or JSONL instruction data (answers only, see train_data.h),
 * AdamW, global gradient clipping, linear warm-up then cosine decay, held-out
 * loss and perplexity before and after, atomic checkpoints and resume. The
 * frozen weights stay in their GGUF types. The result (the plan, its
 * parameters and the LoRA) is left in the model and written to
 * train.out_path as one adapter GGUF. */
typedef struct still_finetune_params {
    still_train_params train;   /* data, tokens, seq, batch, lr (default 1e-4), schedule, clip, validation,
                                 * seed (data order and LoRA init), checkpoints, output, device */
    int lora_rank;              /* default 8 */
    float lora_alpha;           /* default 16 (scale alpha / rank) */
    float lora_dropout;         /* dropout on each LoRA input during training (default 0) */
    const char *lora_targets;   /* "q,k,v,o" (default); also gate, up, down, all */
    int train_attn;             /* also train the attention plan's own parameters */
    int gpu_fp32;               /* on the GPU: the frozen weights and their products in fp32, not bf16 (slower; the
                                 * gradient the CPU computes, where a plan amplifies bf16 rounding) */
} still_finetune_params;

typedef struct still_finetune_result {
    int n_steps, start_step;
    long long n_tokens_data;       /* tokens read */
    int n_train_seqs, n_val_seqs, n_examples;
    int n_examples_dropped;        /* JSONL examples left out: no answer token within seq */
    int n_examples_cut;            /* JSONL examples cut to seq tokens */
    long long n_target_tokens;     /* learnt positions seen in training */
    size_t n_lora_params, n_attn_params;
    double val_loss_before, val_loss_after;   /* mean cross-entropy per learnt token (NaN: no validation) */
    double val_tokens;             /* learnt tokens in the validation set */
    double train_seconds, tokens_per_s, final_loss;
} still_finetune_result;

still_finetune_params still_finetune_default_params(void);
int still_finetune(still_model *m, const still_finetune_params *p, still_finetune_result *res, still_err *err);

/* ---- diagnosis: where a needle goes (still probe) ----------------------- */

/* For one prompt of n tokens processed whole, given key positions (e.g. a
 * needle's value tokens) and query positions (e.g. those that predict the
 * answer), per layer and query head, averaged over the queries:
 *   teacher   the softmax model's attention mass on the keys (the same
 *             weights with the plan replaced by softmax),
 *   soft, lin the plan's shares of its output's denominator that go to the
 *             keys through its softmax part (Local ∪ Sel) and its linear
 *             state (still layers; softmax layers: soft = their mass),
 *   local, sel, fold  the shares of all Local keys, all Sel keys, the whole
 *             linear state (still layers; NaN otherwise);
 *   exact     the share the tokens outside Local ∪ Sel (folded, or dropped
 *             without a linear branch) would have with exact softmax weights:
 *             what fold estimates (still layers);
 *   ord_fold, ord_exact  fold and exact averaged over n_ordinary queries
 *             spread evenly over the prompt before the first query (NaN when
 *             n_ordinary is 0): how the linear state does for queries that
 *             retrieve nothing in particular;
 * and per layer, selection head and key: where the key went as seen from the
 * first query (0 Local, 1 Sel, 2 folded into the linear state, 3 dropped;
 * -1: not a still layer) and its self-saliency rank in its chunk (1 = the
 * highest; 0: not ranked). dsa layers: soft is the mass their selection and
 * softmax give the keys, and per layer, over the queries and the ordinary
 * queries that select, recall is the share of the teacher's best topk − 64
 * older positions (its attention summed over the heads) that the indexer
 * picks, kept the share of the teacher's attention on the older positions
 * that the selection keeps (NaN for other kinds). CPU only. */
typedef struct still_probe_result {
    int n_layer, n_head, n_sel_head, n_keys, n_queries, n_ordinary;
    double *recall, *kept;                               /* [n_layer] */
    double *teacher, *soft, *lin, *local, *sel, *fold;   /* [n_layer][n_head] */
    double *exact, *ord_fold, *ord_exact;                /* [n_layer][n_head] */
    signed char *route;                                  /* [n_layer][n_sel_head][n_keys] */
    int *rank;                                           /* [n_layer][n_sel_head][n_keys] */
} still_probe_result;

int still_probe(still_model *m, const int32_t *tokens, int n, const int *keys, int n_keys, const int *queries,
                int n_queries, int n_ordinary, still_probe_result *r, still_err *err);
void still_probe_result_free(still_probe_result *r);

/* ---- sampling ----------------------------------------------------------- */

typedef struct still_sampler_params {
    float temp;            /* <= 0: greedy */
    int top_k;             /* <= 0: off */
    float top_p;           /* >= 1: off */
    float min_p;           /* <= 0: off */
    float repeat_penalty;  /* 1: off */
    int repeat_last_n;     /* window for the penalty */
    uint64_t seed;
} still_sampler_params;

still_sampler_params still_sampler_default_params(void);
typedef struct still_sampler still_sampler;
int still_sampler_create(still_sampler_params p, int n_vocab, still_sampler **out, still_err *err);
void still_sampler_free(still_sampler *s);
/* Remember an accepted token (for the repetition penalty). */
void still_sampler_accept(still_sampler *s, int32_t id);
/* Pick a token from logits (modified in place). */
int32_t still_sampler_sample(still_sampler *s, float *logits);

#ifdef __cplusplus
}
#endif
#endif
