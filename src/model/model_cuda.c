/* The model's forward pass on the CUDA backend (cuda/still_cuda.h): the same
 * steps as forward_chunk() in model.c, with the weights dequantized once to
 * bf16 on the device, GEMMs through cuBLASLt (bf16 in, fp32 accumulate),
 * fp32 activations and residual stream, and a bf16 KV cache read by the
 * flash-attention kernel.
 *
 * One device allocation holds the weights, the KV cache and the activations
 * of one chunk (n_batch tokens), carved into named tensors (gpu_carve).
 *
 * Attention kinds on the GPU so far: softmax (bf16 KV cache, cuda/kinds/softmax/attn_softmax.cu),
 * swa (the same kernel with a window, a bounded cache), still
 * (cuda/kinds/still/attn_still.cu: the layer's state lives on the device, its parameters
 * are uploaded as float32, the gate matrix also as bf16) and lolcats (the
 * still kernels in their lolcats mode: no selection, Hedgehog maps, γ) and
 * liger (swa's kernel and cache for o_swa, cuda/kinds/liger/attn_liger.cu for the
 * decayed linear attention over q and k before RoPE, copied aside first).
 *
 * Decode steps as CUDA graphs: when every layer is still or lolcats, a one-token step
 * with logits (embedding, the layers, the LM head) is recorded once as a
 * CUDA graph and replayed at every later position: still layers read their
 * position from their device counters (RoPE too, stc_rope_at), so the
 * recording does not depend on it. Two graphs: one for the steps at which a
 * chunk leaves Local in some layer (every C-th), one without the leave and
 * scan kernels for the others (stc_still_set_decode_no_leave). Only the
 * token's upload and the logits' download remain outside. Softmax layers take the position from the host
 * (KV cache offsets, key splits), so plans with them run step by step.
 * STILL_CUDA_GRAPHS=0 in the environment turns graphs off (for comparison).
 *
 * Built as stubs that say so when the build has no CUDA backend. */
#include "kinds/attn_rules.h"
#include "model/model_cuda.h"

#include <cblas.h>

#include "common/common.h"
#include "model/model.h"
#include "kinds/still/attn_still_rules.h"
#include "kinds/gdn/attn_gdn_rules.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef STILL_HAVE_CUDA

int gpu_context_create(const still_model *m, int n_ctx, int n_batch, int sel_cache, gpu_context **out, still_err *err) {
    (void)m, (void)n_ctx, (void)n_batch, (void)sel_cache;
    *out = NULL;
    return still_fail(err, STILL_E_UNSUPPORTED,
                      "this build has no CUDA backend (build where nvcc is found, or configure with -DSTILL_CUDA=ON)");
}
void gpu_context_free(gpu_context *g) { (void)g; }
int gpu_context_reset(gpu_context *g, still_err *err) {
    (void)g;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_context_truncate(gpu_context *g, int n_past, int n, still_err *err) {
    (void)g, (void)n_past, (void)n;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
size_t gpu_context_state_bytes(const gpu_context *g) { (void)g; return 0; }
int gpu_context_state_regions(gpu_context *g, int l, int n_past, gpu_region *out, int max) {
    (void)g, (void)l, (void)n_past, (void)out, (void)max;
    return -1;
}
int gpu_region_read(gpu_context *g, const gpu_region *r, void *host, still_err *err) {
    (void)g, (void)r, (void)host;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_region_write(gpu_context *g, const gpu_region *r, const void *host, still_err *err) {
    (void)g, (void)r, (void)host;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_context_state_restored(gpu_context *g, int n_past, still_err *err) {
    (void)g, (void)n_past;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_forward_chunk(gpu_context *g, const int32_t *tokens, int T, int p0, float *logits, int all_logits,
                      still_err *err) {
    (void)g, (void)tokens, (void)T, (void)p0, (void)logits, (void)all_logits;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
void *gpu_context_device(gpu_context *g) { (void)g; return NULL; }
int gpu_observed_enqueue(gpu_context *g, const int32_t *tokens_dev, int T, int seq, gpu_layer_observer fn, void *data,
                         still_err *err) {
    (void)g, (void)tokens_dev, (void)T, (void)seq, (void)fn, (void)data;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}

#else

#include "still_cuda.h"

typedef struct gpu_kind gpu_kind;

typedef struct {
    const gpu_kind *kind;          /* the kind the context was made for (the plan may change later: stage 1's
                                    * trainer makes it with its teacher plan); what the layer holds */
    stc_bf16 *wq, *wk, *wv, *wo, *w_gate, *w_up, *w_down;
    float *attn_norm, *ffn_norm;
    stc_bf16 *k_cache, *v_cache;   /* softmax: [n_ctx][Hk][D]; swa, liger: [kv_rows][Hk][D] from position kv_base; NULL otherwise */
    int kv_rows, kv_base;          /* swa, liger: rows of its cache and the position of row 0 */
    stc_liger *liger;              /* liger: the linear branch's state */
    stc_still *still;              /* still: the device state */
    float *still_params;           /* still: parameters (CPU layout), own allocation */
    stc_bf16 *x_rows;              /* the rows a kind adds after wv in the fused matrix, bf16 (still with a gate:
                                    * Wg; gdn: W_g, w_β, w_α), NULL for none */
    stc_gdn *gdn;                  /* gdn: the device state */
    float *gdn_params;             /* gdn: parameters (CPU layout), own allocation */
    int n_fused;                   /* rows of the fused q | k | v (| Wg) matrix at wq */
} gpu_layer;

struct gpu_context {
    stc_ctx *dev;
    const still_model *m;
    int n_ctx, n_batch;
    int sel_q8;                    /* still layers keep Sel in 8 bits (--sel-cache q8) */
    int still_owner;               /* the still layer whose workspace the others share (-1: none) */
    void *arena;                   /* the one device allocation */
    size_t arena_bytes, kv_bytes;
    gpu_layer *layers;
    void *tok_embd_raw;            /* the embedding table as in the file (quantized rows) */
    stc_bf16 *output;              /* LM head [n_vocab][d] */
    float *output_norm;
    /* activations of one chunk */
    int32_t *tokens;               /* [n_batch] */
    float *x, *q, *k, *v, *att, *gate, *qkv1, *logits;
    float *q_nope, *k_nope;        /* liger: q and k before RoPE (NULL without liger layers) */
    void *liger_ws;                /* liger: the linear branch's workspace, liger_ws_bytes */
    size_t liger_ws_bytes;
    float *gdn_pre;                /* gdn: a call's W_g x | w_β x | w_α x rows [n_batch][gdn_ld] (NULL without gdn) */
    int gdn_ld;
    void *gdn_ws;                  /* gdn: the kernels' workspace, gdn_ws_bytes */
    size_t gdn_ws_bytes;
    stc_bf16 *xb, *qb, *attb, *ffb;
    /* stage-1 training (gpu_observed_enqueue): the layer input in fp32 and the
     * teacher's per-head outputs in fp32, allocated on the first observed call */
    float *obs_x, *obs_att;
    gpu_layer_observer observer;
    void *observer_data;
    int obs_seq;                   /* observed forward: tokens per sequence (T is a whole number of them) */
    int graphs;                    /* decode steps as CUDA graphs (every layer still) */
    int fused_decode;              /* one-token steps through cuda/kernels/gemv.cu (else, for shapes it does not take:
                                    * cuBLASLt and separate kernels) */
    int fused_qkv;                 /* still prefill: q | k | v | gate from one GEMM into qkv, read in place
                                    * (else: a GEMM each, packed rows) */
    int qkv_ld;                    /* floats per token row of qkv (the widest fused matrix) */
    float *qkv;                    /* [n_batch][qkv_ld]; q, k, v are carved from the same space */
    int local_f16;                 /* still prefill (fused rows): k and v also in half from the RoPE pass, the
                                    * attention's Local tiles copied from them (else, for rows that are not a
                                    * multiple of 16 bytes: converted from the fp32 rows in the kernel) */
    stc_f16 *kvh;                  /* [2][n_batch][kvd]: that call's k, then v, in half */
    stc_graph *decode_graph[2];    /* [a chunk leaves]: recorded at the first such step */
};

/* ---- the kinds on the GPU: one row per kind, as src/kinds/attn.c's table is for the CPU ----
 * What the forward needs to know of a layer's kind: the cache it keeps, the device state it makes, how it
 * attends. The rest of this file asks the row, never the kind; a kind without a row does not run here. */
typedef enum { GPU_KV_NONE = 0, GPU_KV_ALL, GPU_KV_WINDOW } gpu_kv;

/* One call's attention step: q, k, v of T tokens from position p0 (RoPE applied when roped), the layer's cache
 * rows for them (kc, vc from row rel), its window (0: none), its device position counter (pos) */
typedef struct {
    float *q, *k, *v;
    int T, p0, rel, window, one, roped;
    stc_bf16 *kc, *vc;
    const int *pos;
} gpu_attn_io;

struct gpu_kind {
    int on_gpu;
    gpu_kv kv;            /* the bf16 KV cache it keeps: every position, or the window's (and a chunk) */
    int still_kernels;    /* its state lives in cuda/attn_still*.cu (still; lolcats as their mode) */
    int lolcats_mode;     /* still kernels: the lolcats mode (no selection, Hedgehog maps, γ) */
    int liger_branch;     /* a decayed linear branch over q and k before RoPE (cuda/kinds/liger/attn_liger.cu) */
    int nope;             /* reads q and k as projected, never RoPE'd, and keeps no cache (gdn) */
    int graphs;           /* decode steps may be recorded as a CUDA graph (the position from device counters) */
    /* rows the layer adds to the fused q | k | v matrix (still's gate), 0 for none */
    size_t (*extra_qkv_rows)(const attn_config *ac, size_t qd);
    int (*create)(gpu_context *g, int l, still_err *err);   /* device state beyond the cache; NULL: none */
    int (*attend)(gpu_context *g, int l, const gpu_attn_io *io, still_err *err);
};
static const gpu_kind *gpu_kind_of(int kind);
static size_t gdn_extra_rows(const attn_config *ac, size_t qd);

/* Bump allocation from the arena (256-byte aligned); with base NULL only
 * counts the bytes. */
static void *gpu_carve(char *base, size_t *off, size_t bytes) {
    size_t at = (*off + 255) & ~(size_t)255;
    *off = at + bytes;
    return base ? base + at : NULL;
}

/* Rows of logits computed per LM-head product (all_logits runs in slices). */
static int gpu_logit_rows(const gpu_context *g) { return g->n_batch < 256 ? g->n_batch : 256; }

/* Lay out every tensor; returns the arena size. */
static size_t gpu_layout(gpu_context *g, char *base) {
    const model_config *c = &g->m->cfg;
    const size_t d = (size_t)c->d_model, qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim;
    const size_t ff = (size_t)c->d_ff, V = (size_t)c->n_vocab, T = (size_t)g->n_batch, bf = sizeof(stc_bf16);
    size_t off = 0;
    for (int l = 0; l < c->n_layer; l++) {
        gpu_layer *L = &g->layers[l];
        /* wq, wk, wv as one [qd + 2 kvd][d] matrix (one GEMM for a decode
         * step), w_gate and w_up as one [2 ff][d] (one GEMM, SwiGLU reads
         * the two halves of each output row) */
        const attn_config *ac = &g->m->attn_cfg[l];
        const gpu_kind *gk = L->kind;
        const size_t n_wg = gk->extra_qkv_rows ? gk->extra_qkv_rows(ac, qd) : 0;   /* still: Wg [H·D][d] */
        L->n_fused = (int)(qd + 2 * kvd + n_wg);
        L->wq = gpu_carve(base, &off, (size_t)L->n_fused * d * bf);
        L->wk = L->wq ? L->wq + qd * d : NULL;
        L->wv = L->wk ? L->wk + kvd * d : NULL;
        L->x_rows = L->wv && n_wg ? L->wv + kvd * d : NULL;
        L->wo = gpu_carve(base, &off, d * qd * bf);
        L->w_gate = gpu_carve(base, &off, 2 * ff * d * bf);
        L->w_up = L->w_gate ? L->w_gate + ff * d : NULL;
        L->w_down = gpu_carve(base, &off, d * ff * bf);
        L->attn_norm = gpu_carve(base, &off, d * sizeof(float));
        L->ffn_norm = gpu_carve(base, &off, d * sizeof(float));
    }
    g->tok_embd_raw = gpu_carve(base, &off, (size_t)g->m->tok_embd.row_bytes * V);
    g->output = gpu_carve(base, &off, V * d * bf);
    g->output_norm = gpu_carve(base, &off, d * sizeof(float));
    size_t kv0 = off;
    for (int l = 0; l < c->n_layer; l++) {
        const attn_config *ac = &g->m->attn_cfg[l];
        const gpu_kv kv = g->layers[l].kind->kv;
        const int windowed = kv == GPU_KV_WINDOW;
        if (kv == GPU_KV_NONE) continue;
        /* swa keeps the last window - 1 positions and a chunk, at their
         * positions from kv_base; with room for 2 (window - 1), a shift copies
         * between regions that do not overlap (gpu_swa_make_room) */
        int rows = g->n_ctx;
        if (windowed && (long long)2 * (ac->window - 1) + g->n_batch < rows)
            rows = 2 * (ac->window - 1) + g->n_batch;
        g->layers[l].kv_rows = rows;
        g->layers[l].k_cache = gpu_carve(base, &off, (size_t)rows * kvd * bf);
        g->layers[l].v_cache = gpu_carve(base, &off, (size_t)rows * kvd * bf);
    }
    g->kv_bytes = off - kv0;
    g->tokens = gpu_carve(base, &off, T * sizeof(int32_t));
    g->x = gpu_carve(base, &off, T * d * sizeof(float));
    /* q, k, v packed, or (a still prefill) the rows of one GEMM's q | k | v | gate output in the same space */
    int widest = (int)(qd + 2 * kvd);
    for (int l = 0; l < c->n_layer; l++) widest = g->layers[l].n_fused > widest ? g->layers[l].n_fused : widest;
    g->qkv_ld = widest;
    g->qkv = gpu_carve(base, &off, T * (size_t)widest * sizeof(float));
    g->q = g->qkv;
    g->k = g->q ? g->q + T * qd : NULL;
    g->v = g->k ? g->k + T * kvd : NULL;
    g->att = gpu_carve(base, &off, T * qd * sizeof(float));
    g->gate = gpu_carve(base, &off, T * 2 * ff * sizeof(float));   /* [T][gate | up] */
    /* one token's q | k | v (| the kind's rows: still's gate, gdn's gate, β, α) */
    g->qkv1 = gpu_carve(base, &off, (size_t)(widest > (int)(2 * qd + 2 * kvd) ? widest : (int)(2 * qd + 2 * kvd)) *
                                        sizeof(float));
    int n_still = 0;   /* the half copies of k and v serve the still kernels' prefills (still, lolcats) */
    for (int l = 0; l < c->n_layer; l++)
        n_still += g->layers[l].kind->still_kernels;
    /* 64 rows of padding: the still attention kernel's zero-filled copies of rows past a call's end take
     * their would-be address (cuda/kinds/still/attn_still_attn.cu) */
    g->kvh = n_still ? gpu_carve(base, &off, (2 * T + 64) * kvd * sizeof(stc_f16)) : NULL;
    g->logits = gpu_carve(base, &off, (size_t)gpu_logit_rows(g) * V * sizeof(float));
    int n_liger = 0;
    for (int l = 0; l < c->n_layer; l++) n_liger += g->layers[l].kind->liger_branch;
    if (n_liger) {
        g->q_nope = gpu_carve(base, &off, T * qd * sizeof(float));
        g->k_nope = gpu_carve(base, &off, T * kvd * sizeof(float));
        g->liger_ws_bytes = stc_liger_workspace_bytes(c->n_head, c->n_head_kv, c->head_dim, g->n_batch);
        g->liger_ws = gpu_carve(base, &off, g->liger_ws_bytes);
    }
    int n_gdn = 0;
    for (int l = 0; l < c->n_layer; l++) n_gdn += g->layers[l].kind->nope;
    if (n_gdn) {
        attn_config shape = {.n_head_kv = c->n_head_kv};
        g->gdn_ld = (int)gdn_extra_rows(&shape, qd);   /* the zero rows too: 16-byte rows for the product */
        g->gdn_pre = gpu_carve(base, &off, T * (size_t)g->gdn_ld * sizeof(float));
        g->gdn_ws_bytes = stc_gdn_workspace_bytes(c->n_head, c->n_head_kv, c->head_dim, g->n_batch);
        g->gdn_ws = gpu_carve(base, &off, g->gdn_ws_bytes);
    }
    g->xb = gpu_carve(base, &off, T * d * bf);
    g->qb = gpu_carve(base, &off, T * qd * bf);
    g->attb = gpu_carve(base, &off, T * qd * bf);
    g->ffb = gpu_carve(base, &off, T * ff * bf);
    return off;
}

static int upload_matrix(gpu_context *g, const weight_matrix *w, stc_bf16 *dst, still_err *err) {
    if (!stc_type_supported(w->type))
        return still_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: weight type %u not supported", w->type);
    return stc_dequant_to_bf16(g->dev, w->type, w->data, w->n_out, w->n_in, dst, err);
}

/* A matrix with layer l's LoRA target t folded in: the GPU keeps its weights
 * as bf16, so W + s B A is formed in float on the host and rounded to bf16
 * once, when the context is created (the same bf16 rounding the matrix gets
 * without LoRA; nothing is added per token). */
static int upload_matrix_lora(gpu_context *g, const weight_matrix *w, int l, lora_target t, stc_bf16 *dst,
                              still_err *err) {
    const lora_set *lo = g->m->lora;
    if (!lo || !lora_A(lo, l, t)) return upload_matrix(g, w, dst, err);
    const int ni = (int)w->n_in, no = (int)w->n_out, r = lo->rank;
    if (lo->n_in[t] != ni || lo->n_out[t] != no)
        return still_fail(err, STILL_E_ARG, "LoRA of layer %d does not match the weight's shape", l);
    float *W = malloc(sizeof(float) * (size_t)ni * no);
    if (!W) return still_fail(err, STILL_E_NOMEM, "out of memory folding the LoRA");
    int rc = weight_rows_to_f32(w, 0, no, W, err);
    if (!rc) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, no, ni, r, lora_scale(lo), lora_B(lo, l, t), r,
                    lora_A(lo, l, t), ni, 1.0f, W, ni);
        rc = stc_dequant_to_bf16(g->dev, TT_F32, W, no, ni, dst, err);
        if (!rc) rc = stc_ctx_sync(g->dev, err);   /* the host buffer is freed next */
    }
    free(W);
    return rc;
}

/* Layer l's still state: its configuration from the model's plan, its
 * parameters on the device, the gate matrix as bf16, one workspace shared by
 * every still layer and reserved for n_batch tokens. */
void gpu_still_config(const attn_config *a, int n_ctx, stc_still_config *out) {
    const int lol = gpu_kind_of(a->kind)->lolcats_mode;   /* lolcats: the same kernels, see stc_still_config.lolcats */
    const stc_still_config sc = {
        .n_head = a->n_head, .n_head_kv = a->n_head_kv, .head_dim = a->head_dim, .d_model = a->d_model,
        .n_ctx = n_ctx, .chunk = a->chunk, .budget = lol ? 0 : a->budget, .lambda = lol ? 0 : a->lambda,
        .per_kv_head = lol ? 0 : a->per_kv_head, .routing = lol ? (int)ROUTE_NONE : (int)a->routing,
        .linear = lol ? 1 : a->linear, .feature_map = lol ? (int)FMAP_HEDGEHOG : (int)a->feature_map,
        .feature_dim = a->feature_dim, .gate = lol ? 0 : a->gate, .gate_den = lol ? 0 : a->gate_den, .seed = a->seed, .lolcats = lol,
        .sel_global = lol ? 0 : a->sel_global, .sel_span = lol ? 0 : a->sel_span,
    };
    *out = sc;
}

static int still_layer_create(gpu_context *g, int l, still_err *err) {
    const attn_config *a = &g->m->attn_cfg[l];
    gpu_layer *L = &g->layers[l];
    const int lol = gpu_kind_of(a->kind)->lolcats_mode;
    stc_still_config sc;
    gpu_still_config(a, g->n_ctx, &sc);
    sc.sel_q8 = !lol && g->sel_q8;   /* (lolcats has no Sel) */
    stc_still_info info;
    int rc = stc_still_resolve(&sc, &info, err);
    if (!rc) rc = stc_still_create(g->dev, &sc, &L->still, err);
    if (rc) return rc;
    const size_t np = info.param_count;
    if (np) {
        const float *p = g->m->attn_params[l];
        if (!p) return still_fail(err, STILL_E_STATE, "CUDA backend: layer %d has no still parameters", l);
        rc = stc_malloc(g->dev, np * sizeof(float), "still parameters", (void **)&L->still_params, err);
        if (!rc) rc = stc_memcpy_h2d(g->dev, L->still_params, p, np * sizeof(float), err);
        if (!rc && !lol && a->linear && a->gate) {   /* Wg [H·D][d] follows the NP-Map parameters */
            const size_t H = (size_t)a->n_head, D = (size_t)a->head_dim, n_wg = H * D * (size_t)a->d_model;
            const size_t at = still_par_wg((int)H, (int)D, (int)D, 0);
            /* into the fused matrix: a decode step's one GEMM also gives the gate's x·Wgᵀ */
            rc = stc_f32_to_bf16(g->dev, L->still_params + at, L->x_rows, (int64_t)n_wg, err);
            if (!rc) stc_still_set_gate_bf16(L->still, L->x_rows);
            if (!rc) stc_still_set_decode_gate_pre(L->still, g->qkv1 + (size_t)(L->n_fused - (int)(H * D)));
        }
    }
    if (rc) return rc;
    if (g->still_owner < 0) {
        g->still_owner = l;
        return stc_still_reserve(g->dev, L->still, g->n_batch, err);
    }
    /* then reserve for this layer's needs too (another cap or chunk may need more), so that no call
     * grows the shared workspace later, under a recorded graph */
    rc = stc_still_share_workspace(L->still, g->layers[g->still_owner].still, err);
    return rc ? rc : stc_still_reserve(g->dev, L->still, g->n_batch, err);
}

int gpu_context_reset(gpu_context *g, still_err *err) {
    for (int l = 0; l < g->m->cfg.n_layer; l++) g->layers[l].kv_base = 0;
    for (int l = 0; l < g->m->cfg.n_layer; l++) {
        int rc = g->layers[l].still ? stc_still_reset(g->dev, g->layers[l].still, err) : STILL_OK;
        if (!rc && g->layers[l].liger) rc = stc_liger_reset(g->dev, g->layers[l].liger, err);
        if (!rc && g->layers[l].gdn) rc = stc_gdn_reset(g->dev, g->layers[l].gdn, err);
        if (rc) return rc;
    }
    return STILL_OK;
}

int gpu_context_truncate(gpu_context *g, int n_past, int n, still_err *err) {
    if (n == 0) return gpu_context_reset(g, err);
    for (int l = 0; l < g->m->cfg.n_layer; l++) {
        const gpu_layer *L = &g->layers[l];
        if (L->still || L->liger || L->gdn)
            return still_fail(err, STILL_E_ARG,
                              "cannot truncate a %d-token context to %d tokens (%s's linear state is folded; "
                              "only 0 or %d)", n_past, n, L->still ? "still" : L->liger ? "liger" : "gdn", n_past);
        const int window = L->kind->kv == GPU_KV_WINDOW ? g->m->attn_cfg[l].window : 0;
        if (window && attn_window_first(n, window) < L->kv_base)
            return still_fail(err, STILL_E_ARG,
                              "cannot truncate a %d-token context to %d tokens (swa's cache on the GPU holds positions "
                              "from %d on, the window before %d needs %d)", n_past, n, L->kv_base, n,
                              attn_window_first(n, window));
    }
    return STILL_OK;
}

int gpu_context_state_regions(gpu_context *g, int l, int n_past, gpu_region *out, int max) {
    gpu_layer *L = &g->layers[l];
    const size_t kvd = (size_t)g->m->cfg.n_head_kv * g->m->cfg.head_dim;
    int n = 0;
    if (L->kind->kv != GPU_KV_NONE) {
        if (max < 3) return -1;
        const int windowed = L->kind->kv == GPU_KV_WINDOW;
        const size_t rows = windowed ? (size_t)L->kv_rows : (size_t)n_past;   /* a window's: all, from kv_base */
        out[n++] = (gpu_region){L->k_cache, rows * kvd * sizeof(stc_bf16), 0};
        out[n++] = (gpu_region){L->v_cache, rows * kvd * sizeof(stc_bf16), 0};
        if (windowed) out[n++] = (gpu_region){&L->kv_base, sizeof L->kv_base, 1};
    }
    stc_region r[32];
    int k = 0;
    if (L->still) k = stc_still_regions(L->still, r, 32);
    else if (L->liger) k = stc_liger_regions(L->liger, r, 32);
    else if (L->gdn) k = stc_gdn_regions(L->gdn, r, 32);
    if (k < 0 || n + k > max) return -1;
    for (int i = 0; i < k; i++) out[n++] = (gpu_region){r[i].dev, r[i].bytes, 0};
    return n;
}

int gpu_region_read(gpu_context *g, const gpu_region *r, void *host, still_err *err) {
    if (r->host) {
        memcpy(host, r->p, r->bytes);
        return STILL_OK;
    }
    int rc = stc_memcpy_d2h(g->dev, host, r->p, r->bytes, err);
    return rc ? rc : stc_ctx_sync(g->dev, err);
}

int gpu_region_write(gpu_context *g, const gpu_region *r, const void *host, still_err *err) {
    if (r->host) {
        memcpy(r->p, host, r->bytes);
        return STILL_OK;
    }
    int rc = stc_memcpy_h2d(g->dev, r->p, host, r->bytes, err);
    return rc ? rc : stc_ctx_sync(g->dev, err);   /* the host buffer may go next */
}

int gpu_context_state_restored(gpu_context *g, int n_past, still_err *err) {
    for (int l = 0; l < g->m->cfg.n_layer; l++) {
        gpu_layer *L = &g->layers[l];
        stc_still_set_position(L->still, n_past);
        stc_liger_set_n_seen(L->liger, n_past);
        stc_gdn_set_n_seen(L->gdn, n_past);
    }
    return stc_ctx_sync(g->dev, err);
}

void gpu_context_free(gpu_context *g) {
    if (!g) return;
    if (g->dev) {
        /* workspace owners last: layers that share a workspace go first */
        for (int pass = 0; pass < 2 && g->layers; pass++)
            for (int l = g->m->cfg.n_layer - 1; l >= 0; l--) {
                gpu_layer *L = &g->layers[l];
                if (!L->still || (pass == 0) == (l == g->still_owner)) continue;
                stc_still_free(L->still);
                stc_free(g->dev, L->still_params);
                L->still = NULL;
            }
        for (int l = 0; g->layers && l < g->m->cfg.n_layer; l++) {
            stc_liger_free(g->layers[l].liger);
            stc_gdn_free(g->layers[l].gdn);
            stc_free(g->dev, g->layers[l].gdn_params);
        }
        stc_graph_free(g->decode_graph[0]);
        stc_graph_free(g->decode_graph[1]);
        stc_free(g->dev, g->obs_x);
        stc_free(g->dev, g->obs_att);
        stc_free(g->dev, g->arena);
        stc_ctx_free(g->dev);
    }
    free(g->layers);
    free(g);
}

int gpu_context_create(const still_model *m, int n_ctx, int n_batch, int sel_cache, gpu_context **out, still_err *err) {
    *out = NULL;
    const model_config *c = &m->cfg;
    if (sel_cache != STILL_SEL_F16 && sel_cache != STILL_SEL_Q8)
        return still_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: the selected tokens are stored in half or 8 bits "
                          "(--sel-cache f16 or q8), not f32");
    for (int l = 0; l < c->n_layer; l++) {
        const gpu_kind *gk = gpu_kind_of(m->attn_cfg[l].kind);
        if (!gk)
            return still_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: layer %d is '%s', which runs on the CPU only "
                              "(--device cpu)", l, attn_kind_get(m->attn_cfg[l].kind)->name);
        if (gk->kv == GPU_KV_WINDOW && m->attn_cfg[l].window <= 0)
            return still_fail(err, STILL_E_ARG, "CUDA backend: layer %d (%s) needs a positive window, got %d", l,
                              attn_kind_get(m->attn_cfg[l].kind)->name, m->attn_cfg[l].window);
    }
    if (c->head_dim != 64 && c->head_dim != 128)
        return still_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: head dim %d (64 or 128 supported)", c->head_dim);
    if (!stc_type_supported(m->tok_embd.type))
        return still_fail(err, STILL_E_UNSUPPORTED, "CUDA backend: embedding type %u not supported", m->tok_embd.type);
    gpu_context *g = calloc(1, sizeof *g);
    if (!g || !(g->layers = calloc((size_t)c->n_layer, sizeof *g->layers))) {
        free(g);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    g->m = m, g->n_ctx = n_ctx, g->n_batch = n_batch, g->still_owner = -1, g->sel_q8 = sel_cache == STILL_SEL_Q8;
    for (int l = 0; l < c->n_layer; l++) g->layers[l].kind = gpu_kind_of(m->attn_cfg[l].kind);
    int rc = stc_ctx_create(0, &g->dev, err);
    if (rc) goto fail;
    g->arena_bytes = gpu_layout(g, NULL);
    char what[96];
    snprintf(what, sizeof what, "weights, a %d-token KV cache and %d-token activations", n_ctx, n_batch);
    if ((rc = stc_malloc(g->dev, g->arena_bytes, what, &g->arena, err))) goto fail;
    gpu_layout(g, g->arena);
    for (int l = 0; l < c->n_layer && !rc; l++) {
        const layer_weights *W = &m->layers[l];
        gpu_layer *L = &g->layers[l];
        const size_t nb = sizeof(float) * (size_t)c->d_model;
        if (!rc) rc = upload_matrix_lora(g, &W->wq, l, LORA_Q, L->wq, err);
        if (!rc) rc = upload_matrix_lora(g, &W->wk, l, LORA_K, L->wk, err);
        if (!rc) rc = upload_matrix_lora(g, &W->wv, l, LORA_V, L->wv, err);
        if (!rc) rc = upload_matrix_lora(g, &W->wo, l, LORA_O, L->wo, err);
        if (!rc) rc = upload_matrix_lora(g, &W->w_gate, l, LORA_GATE, L->w_gate, err);
        if (!rc) rc = upload_matrix_lora(g, &W->w_up, l, LORA_UP, L->w_up, err);
        if (!rc) rc = upload_matrix_lora(g, &W->w_down, l, LORA_DOWN, L->w_down, err);
        if (!rc) rc = stc_memcpy_h2d(g->dev, L->attn_norm, W->attn_norm, nb, err);
        if (!rc) rc = stc_memcpy_h2d(g->dev, L->ffn_norm, W->ffn_norm, nb, err);
    }
    if (!rc) rc = stc_memcpy_h2d(g->dev, g->tok_embd_raw, m->tok_embd.data,
                                 m->tok_embd.row_bytes * (size_t)c->n_vocab, err);
    if (!rc) rc = upload_matrix(g, &m->output, g->output, err);
    if (!rc) rc = stc_memcpy_h2d(g->dev, g->output_norm, m->output_norm, sizeof(float) * (size_t)c->d_model, err);
    for (int l = 0; l < c->n_layer && !rc; l++) {
        const gpu_kind *gk = g->layers[l].kind;
        if (gk->create) rc = gk->create(g, l, err);
    }
    if (!rc) rc = stc_ctx_sync(g->dev, err);
    if (rc) goto fail;
    g->graphs = c->n_layer > 0;
    for (int l = 0; l < c->n_layer; l++) g->graphs &= g->layers[l].kind->graphs;
    const char *env = getenv("STILL_CUDA_GRAPHS");
    if (env && !strcmp(env, "0")) g->graphs = 0;
    /* the gemv kernels' inputs: d_model (q|k|v, gate|up, LM head), H·D (o_proj), d_ff (down_proj) */
    const int qd_in = c->n_head * c->head_dim;
    g->fused_decode = c->d_model % 8 == 0 && c->d_ff % 8 == 0 && qd_in % 8 == 0 && c->d_model <= 12288 &&
                      c->d_ff <= 12288 && qd_in <= 12288;
    g->fused_qkv = g->qkv_ld % 4 == 0 && c->head_dim % 4 == 0;
    g->local_f16 = ((size_t)c->n_head_kv * c->head_dim) % 8 == 0;   /* 16-byte rows */
    *out = g;
    return STILL_OK;
fail:
    gpu_context_free(g);
    return rc;
}

size_t gpu_context_state_bytes(const gpu_context *g) {
    if (!g) return 0;
    size_t n = g->kv_bytes;
    for (int l = 0; l < g->m->cfg.n_layer; l++)
        n += stc_still_state_bytes(g->layers[l].still) + stc_liger_state_bytes(g->layers[l].liger) +
             stc_gdn_state_bytes(g->layers[l].gdn);
    return n;
}

/* swa: before T tokens at p0, make the cache hold p0 - window + 1 .. p0 + T - 1
 * at their positions: when the chunk would run past the last row, the last
 * window - 1 positions move to row 0 (kv_rows >= 2 (window - 1) + n_batch, so
 * they move by more than their length: no overlap). */
static int gpu_swa_make_room(gpu_context *g, gpu_layer *L, int window, int p0, int T, still_err *err) {
    if (p0 + T - L->kv_base <= L->kv_rows) return STILL_OK;
    const model_config *c = &g->m->cfg;
    const size_t kvd = (size_t)c->n_head_kv * c->head_dim, bf = sizeof(stc_bf16);
    const int keep_from = attn_window_first(p0, window) > L->kv_base ? attn_window_first(p0, window) : L->kv_base;
    const size_t n = (size_t)(p0 - keep_from) * kvd * bf, src = (size_t)(keep_from - L->kv_base) * kvd;
    int rc = stc_memcpy_d2d(g->dev, L->k_cache, L->k_cache + src, n, err);
    if (!rc) rc = stc_memcpy_d2d(g->dev, L->v_cache, L->v_cache + src, n, err);
    if (!rc) L->kv_base = keep_from;
    return rc;
}

/* still and lolcats (the still kernels): RoPE from the layer's device position, then the kernels */
static int still_attend(gpu_context *g, int l, const gpu_attn_io *io, still_err *err) {
    const model_config *c = &g->m->cfg;
    const gpu_layer *L = &g->layers[l];
    int rc = STILL_OK;
    if (!io->roped)
        rc = stc_rope_at(g->dev, io->q, io->k, io->T, c->n_head, c->n_head_kv, c->head_dim, io->pos, c->rope_theta,
                         NULL, NULL, err);
    if (!rc && io->one)
        rc = stc_still_forward(g->dev, L->still, L->still_params, io->q, io->k, io->v, g->xb, io->T,
                               STC_STILL_P0_DEVICE, g->att, err);
    else if (!rc)   /* the outputs in bf16 for o_proj straight from the kernels (g->att: scratch) */
        rc = stc_still_forward_bf16(g->dev, L->still, L->still_params, io->q, io->k, io->v, g->xb, io->T,
                                    STC_STILL_P0_DEVICE, g->att, g->attb, err);
    return rc;
}

/* softmax and swa: RoPE into the bf16 cache, then the flash kernel (windowed for swa); with an observer (stage 1's
 * teacher) the outputs in fp32 too */
static int softmax_attend(gpu_context *g, int l, const gpu_attn_io *io, still_err *err) {
    const model_config *c = &g->m->cfg;
    const int D = c->head_dim, H = c->n_head, Hk = c->n_head_kv, qd = H * D, kvd = Hk * D, T = io->T, one = io->one;
    const gpu_layer *L = &g->layers[l];
    stc_ctx *dev = g->dev;
    float *q = io->q, *k = io->k, *v = io->v;
    int rc = STILL_OK;
    if (!io->roped && !g->observer)
        rc = stc_rope(dev, q, k, T, H, Hk, D, io->p0, c->rope_theta, g->qb, io->kc, v, io->vc, err);
    if (!rc && io->window)
        rc = stc_attn_softmax_window(dev, g->qb, L->k_cache, L->v_cache, T, io->rel, H, Hk, D, io->window,
                                     one ? g->att : NULL, one ? NULL : g->attb, 0, err);
    else if (!rc && g->observer) {
        /* the teacher's outputs in fp32 for the observer, then bf16; each sequence from position 0
         * (RoPE and the causal attention per sequence, the sequences side by side in the cache) */
        for (int s0 = 0; s0 < T && !rc; s0 += g->obs_seq) {
            const int n = T - s0 < g->obs_seq ? T - s0 : g->obs_seq;
            const size_t oq = (size_t)s0 * qd, ok = (size_t)s0 * kvd;
            rc = stc_rope(dev, q + oq, k + ok, n, H, Hk, D, 0, c->rope_theta, g->qb + oq, L->k_cache + ok,
                          v + ok, L->v_cache + ok, err);
            if (!rc)
                rc = stc_attn_softmax(dev, g->qb + oq, L->k_cache + ok, L->v_cache + ok, n, 0, H, Hk, D,
                                      g->obs_att + oq, NULL, err);
        }
        if (!rc) rc = g->observer(g->observer_data, l, T, g->obs_x, g->xb, q, k, v, g->obs_att, err);
        if (!rc) rc = stc_f32_to_bf16(dev, g->obs_att, g->attb, (int64_t)T * qd, err);
    } else if (!rc)
        rc = stc_attn_softmax(dev, g->qb, L->k_cache, L->v_cache, T, io->rel, H, Hk, D, one ? g->att : NULL,
                              one ? NULL : g->attb, err);
    return rc;
}

/* liger: q and k copied aside before RoPE (the linear branch reads them so), swa's kernel in fp32 for o_swa, then
 * 0.5 o_swa + 0.5 o_lin */
static int liger_attend(gpu_context *g, int l, const gpu_attn_io *io, still_err *err) {
    const model_config *c = &g->m->cfg;
    const int D = c->head_dim, H = c->n_head, Hk = c->n_head_kv, qd = H * D, kvd = Hk * D, T = io->T;
    const gpu_layer *L = &g->layers[l];
    stc_ctx *dev = g->dev;
    int rc = stc_memcpy_d2d(dev, g->q_nope, io->q, sizeof(float) * (size_t)T * qd, err);
    if (!rc) rc = stc_memcpy_d2d(dev, g->k_nope, io->k, sizeof(float) * (size_t)T * kvd, err);
    if (!io->roped && !g->observer && !rc)
        rc = stc_rope(dev, io->q, io->k, T, H, Hk, D, io->p0, c->rope_theta, g->qb, io->kc, io->v, io->vc, err);
    if (!rc)
        rc = stc_attn_softmax_window(dev, g->qb, L->k_cache, L->v_cache, T, io->rel, H, Hk, D, io->window, g->att,
                                     NULL, 0, err);
    if (!rc)
        rc = stc_liger_forward(dev, L->liger, g->q_nope, g->k_nope, io->v, T, g->liger_ws, g->liger_ws_bytes, g->att,
                               err);
    if (!io->one && !rc) rc = stc_f32_to_bf16(dev, g->att, g->attb, (int64_t)T * qd, err);
    return rc;
}

static int liger_create(gpu_context *g, int l, still_err *err) {
    const model_config *c = &g->m->cfg;
    return stc_liger_create(g->dev, c->n_head, c->n_head_kv, c->head_dim, &g->layers[l].liger, err);
}

/* gdn: the state and parameters on the device; W_g, w_β and w_α as bf16 rows after wv in the fused matrix (a
 * decode step's one product gives them with q, k and v; a prefill's product of their own, gdn_attend) */
static size_t gdn_extra_rows(const attn_config *ac, size_t qd) {
    return (qd + 2 * (size_t)ac->n_head_kv + 3) & ~(size_t)3;   /* zero rows up to a multiple of 4: the fused rows'
                                                                   * width stays one that still's prefill takes */
}

static int gdn_layer_create(gpu_context *g, int l, still_err *err) {
    const model_config *c = &g->m->cfg;
    const attn_config *a = &g->m->attn_cfg[l];
    gpu_layer *L = &g->layers[l];
    const int H = a->n_head, Hk = a->n_head_kv, D = a->head_dim, d = a->d_model;
    const float *p = g->m->attn_params[l];
    if (!p) return still_fail(err, STILL_E_STATE, "CUDA backend: layer %d has no gdn parameters", l);
    if (H != c->n_head || Hk != c->n_head_kv || D != c->head_dim || d != c->d_model)
        return still_fail(err, STILL_E_ARG, "CUDA backend: layer %d's gdn shape differs from the model's", l);
    const size_t np = gdn_par_count_conv(H, Hk, d, D, a->conv), HD = (size_t)H * D;   /* with the convolution's */
    int rc = stc_gdn_create(g->dev, H, Hk, D, d, a->norm, a->conv, &L->gdn, err);
    if (!rc) rc = stc_malloc(g->dev, np * sizeof(float), "gdn parameters", (void **)&L->gdn_params, err);
    if (!rc) rc = stc_memcpy_h2d(g->dev, L->gdn_params, p, np * sizeof(float), err);
    if (!rc) rc = stc_f32_to_bf16(g->dev, L->gdn_params + gdn_par_wg(Hk, d, D), L->x_rows, (int64_t)(HD * d), err);
    if (!rc)
        rc = stc_f32_to_bf16(g->dev, L->gdn_params + gdn_par_wbeta(Hk, d), L->x_rows + HD * d, (int64_t)Hk * d, err);
    if (!rc)
        rc = stc_f32_to_bf16(g->dev, L->gdn_params + gdn_par_walpha(Hk, d), L->x_rows + (HD + Hk) * d,
                             (int64_t)Hk * d, err);
    const size_t pad = gdn_extra_rows(a, HD) - (HD + 2 * (size_t)Hk);
    if (!rc && pad) rc = stc_memset(g->dev, L->x_rows + (HD + 2 * Hk) * d, 0, pad * d * sizeof(stc_bf16), err);
    return rc;
}

/* gdn: q and k as projected (no RoPE), the pre-activations from the fused rows (one token: the decode step's
 * product put them after v) or from their own product with the normalised input, then the kernels */
static int gdn_attend(gpu_context *g, int l, const gpu_attn_io *io, still_err *err) {
    const model_config *c = &g->m->cfg;
    const int d = c->d_model, qd = c->n_head * c->head_dim, kvd = c->n_head_kv * c->head_dim, T = io->T;
    const gpu_layer *L = &g->layers[l];
    const float *pre = g->gdn_pre;
    int ld = g->gdn_ld, rc = STILL_OK;
    if (T == 1) pre = io->q + qd + 2 * kvd, ld = L->n_fused - qd - 2 * kvd;   /* q is qkv1: q | k | v | rows */
    else rc = stc_gemm_bf16(g->dev, T, g->gdn_ld, d, g->xb, L->x_rows, g->gdn_pre, 0.0f, err);
    if (!rc)
        rc = stc_gdn_forward(g->dev, L->gdn, L->gdn_params, io->q, io->k, io->v, pre, ld, T, g->gdn_ws,
                             g->gdn_ws_bytes, io->one ? g->att : NULL, io->one ? NULL : g->attb, err);
    return rc;
}

/* still's gate: Wg [H·D][d] in the fused matrix, so that a decode step's one GEMM also gives x·Wgᵀ */
static size_t still_gate_rows(const attn_config *ac, size_t qd) { return ac->linear && ac->gate ? qd : 0; }

static const gpu_kind GPU_KINDS[ATTN_KIND_COUNT] = {
    [ATTN_SOFTMAX] = {.on_gpu = 1, .kv = GPU_KV_ALL, .attend = softmax_attend},
    [ATTN_SWA] = {.on_gpu = 1, .kv = GPU_KV_WINDOW, .attend = softmax_attend},
    [ATTN_LIGER] = {.on_gpu = 1, .kv = GPU_KV_WINDOW, .liger_branch = 1, .create = liger_create,
                    .attend = liger_attend},
    [ATTN_LOLCATS] = {.on_gpu = 1, .still_kernels = 1, .lolcats_mode = 1, .graphs = 1,
                      .create = still_layer_create, .attend = still_attend},
    [ATTN_STILL] = {.on_gpu = 1, .still_kernels = 1, .graphs = 1, .extra_qkv_rows = still_gate_rows,
                    .create = still_layer_create, .attend = still_attend},
    [ATTN_GDN] = {.on_gpu = 1, .nope = 1, .graphs = 1, .extra_qkv_rows = gdn_extra_rows, .create = gdn_layer_create,
                  .attend = gdn_attend},
};

/* The kind's row; NULL for a kind the CUDA backend does not run. */
static const gpu_kind *gpu_kind_of(int kind) {
    return (unsigned)kind < ATTN_KIND_COUNT && GPU_KINDS[kind].on_gpu ? &GPU_KINDS[kind] : NULL;
}

/* Enqueue the layers for the T tokens in g->tokens at position p0 (no host
 * synchronisation). Still layers take their position from their device
 * counters (which equal p0: model.c tracks it), so the same sequence serves
 * every position when recorded as a graph. */
/* Enqueue the layers for T tokens from position p0. out_rows: how many of the call's last rows need the
 * last layer's output (T: all of them, for all the logits or an observer; 1: the last token's logits; 0: none).
 * The last layer's o_proj and feed-forward block then run on those rows only, as llama.cpp does: every
 * layer's caches and states are still updated for all T tokens, and the rows a caller reads come out as they
 * would with all rows within rounding (the products are per row; cuBLASLt may sum in another order for
 * another row count). */
static int gpu_enqueue_layers(gpu_context *g, int T, int p0, int out_rows, still_err *err) {
    const still_model *m = g->m;
    const model_config *c = &m->cfg;
    const int d = c->d_model, D = c->head_dim, H = c->n_head, Hk = c->n_head_kv, V = c->n_vocab;
    const int qd = H * D, kvd = Hk * D, ff = c->d_ff;
    const float eps = c->norm_eps;
    stc_ctx *dev = g->dev;
    /* one token: matrix-vector kernels with the norms, RoPE, SwiGLU and the residual fused in (cuda/kernels/gemv.cu),
     * fp32 activations throughout */
    const int one = T == 1 && g->fused_decode && !g->observer;
    int rc = stc_embed_quant(dev, m->tok_embd.type, g->tok_embd_raw, V, d, g->tokens, T, g->x, err);
    for (int l = 0; l < c->n_layer && !rc; l++) {
        gpu_layer *L = &g->layers[l];
        const gpu_kind *gk = L->kind;
        const int liger = gk->liger_branch;
        /* softmax, swa, liger: the cache holds positions kv_base .. (softmax: kv_base = 0) */
        const int window = gk->kv == GPU_KV_WINDOW && !g->observer ? m->attn_cfg[l].window : 0;
        if (window && !rc) rc = gpu_swa_make_room(g, L, window, p0, T, err);
        const int rel = p0 - L->kv_base;
        stc_bf16 *kc = L->k_cache ? L->k_cache + (size_t)rel * kvd : NULL, *vc = L->v_cache ? L->v_cache + (size_t)rel * kvd : NULL;
        const int *pos = L->still ? stc_still_n_seen_dev(L->still) : NULL;   /* still: its device counter */
        /* the rows whose output the layer must give: the last n_out (the last layer: those the caller reads) */
        const int n_out = l == c->n_layer - 1 && out_rows < T && !g->observer ? (out_rows > 0 ? out_rows : 0) : T;
        /* q, k, v (RoPE'd unless liger still needs them as they are) */
        float *q = g->q, *k = g->k, *v = g->v;
        int roped = 0;
        /* a still prefill: one GEMM for q | k | v | gate, rows of n_fused floats, RoPE and the kernels in place */
        const int fused_rows = gk->still_kernels && T > 1 && g->fused_qkv && !g->observer && L->n_fused % 4 == 0;
        if (gk->still_kernels && T > 1) stc_still_set_position(L->still, p0);   /* (global selection cuts the call by it) */
        if (fused_rows) {
            const int ld = L->n_fused;
            if (!rc) rc = stc_rmsnorm(dev, g->x, L->attn_norm, T, d, eps, NULL, g->xb, err);
            if (!rc) rc = stc_gemm_bf16(dev, T, ld, d, g->xb, L->wq, g->qkv, 0.0f, err);
            stc_f16 *kh = g->local_f16 && g->kvh ? g->kvh : NULL, *vh = kh ? kh + (size_t)T * kvd : NULL;
            if (!rc)
                rc = stc_rope_at_ld(dev, g->qkv, g->qkv + qd, ld, T, H, Hk, D, pos, c->rope_theta,
                                    vh ? g->qkv + qd + kvd : NULL, kh, vh, err);
            if (!rc)   /* the outputs in bf16 for o_proj straight from the kernels (g->att: scratch) */
                rc = stc_still_forward_qkv(dev, L->still, L->still_params, g->qkv, ld, T,
                                           n_out < T ? T - (n_out > 0 ? n_out : 1) : 0, STC_STILL_P0_DEVICE, g->att,
                                           g->attb, kh, vh, err);
        } else if (one) {
            q = g->qkv1, k = q + qd, v = k + kvd;   /* (then the gate's pre-activations, still with a gate) */
            const int cache = gk->kv != GPU_KV_NONE && !liger;   /* (liger: RoPE after q and k are copied aside) */
            const stc_gemv_rope r = {.n_head = H, .n_head_kv = Hk, .head_dim = D, .rotate = !liger && !gk->nope,
                                     .theta = c->rope_theta, .p0 = gk->still_kernels ? 0 : p0, .p0_dev = pos,
                                     .q_bf16 = cache ? g->qb : NULL, .k_bf16 = cache ? kc : NULL,
                                     .v_bf16 = cache ? vc : NULL};
            if (!rc) rc = stc_gemv_qkv(dev, g->x, L->attn_norm, eps, d, L->wq, L->n_fused, q, &r, err);
            roped = r.rotate;
        } else {
            if (!rc) rc = stc_rmsnorm(dev, g->x, L->attn_norm, T, d, eps, g->observer ? g->obs_x : NULL, g->xb, err);
            if (T == 1) {
                q = g->qkv1, k = q + qd, v = k + kvd;
                if (!rc) rc = stc_gemm_bf16(dev, 1, L->n_fused, d, g->xb, L->wq, q, 0.0f, err);
            } else {
                if (!rc) rc = stc_gemm_bf16(dev, T, qd, d, g->xb, L->wq, q, 0.0f, err);
                if (!rc) rc = stc_gemm_bf16(dev, T, kvd, d, g->xb, L->wk, k, 0.0f, err);
                if (!rc) rc = stc_gemm_bf16(dev, T, kvd, d, g->xb, L->wv, v, 0.0f, err);
            }
        }
        /* the attention's per-head outputs: fp32 in g->att for one token (the o_proj product reads them),
         * else bf16 in g->attb (a still prefill of fused rows: done above) */
        if (!fused_rows && !rc) {
            const gpu_attn_io io = {.q = q, .k = k, .v = v, .T = T, .p0 = p0, .rel = rel, .window = window, .one = one,
                                    .roped = roped, .kc = kc, .vc = vc, .pos = pos};
            rc = gk->attend(g, l, &io, err);
        }
        if (one) {
            if (!rc) rc = stc_gemv(dev, g->att, NULL, eps, qd, L->wo, d, g->x, 1.0f, err);   /* + residual */
            if (!rc) rc = stc_gemv_swiglu(dev, g->x, L->ffn_norm, eps, d, L->w_gate, ff, g->gate, err);
            if (!rc) rc = stc_gemv(dev, g->gate, NULL, eps, ff, L->w_down, d, g->x, 1.0f, err);   /* + residual */
            continue;
        }
        /* o_proj and the feed-forward block for those rows (n of them from r0); in 8K / 4K row blocks
         * (the gate | up output in L2) a 16K prefill was 3% / 9% slower, in 16K / 8K blocks a 64K one 2% / 4%
         * (session 17) */
        const int n = n_out;
        if (n == 0) continue;
        const int r0 = T - n;
        float *x = g->x + (size_t)r0 * d;
        if (!rc) rc = stc_gemm_bf16(dev, n, d, qd, g->attb + (size_t)r0 * qd, L->wo, x, 1.0f, err);   /* + residual */
        if (!rc) rc = stc_rmsnorm(dev, x, L->ffn_norm, n, d, eps, NULL, g->xb, err);
        /* gate | up in bf16 (g->gate's fp32 space holds it twice over), then SwiGLU from it */
        stc_bf16 *gu = (stc_bf16 *)g->gate;
        if (!rc) rc = stc_gemm_bf16_out_bf16(dev, n, 2 * ff, d, g->xb, L->w_gate, gu, 0.0f, err);
        if (!rc) rc = stc_swiglu_bf16(dev, gu, gu + ff, n, ff, 2 * ff, g->ffb, err);
        if (!rc) rc = stc_gemm_bf16(dev, n, d, ff, g->ffb, L->w_down, x, 1.0f, err);  /* + residual */
    }
    return rc;
}

/* Enqueue the final norm and the LM head for n rows of x from row t0 into g->logits. */
static int gpu_enqueue_head(gpu_context *g, int t0, int n, still_err *err) {
    const model_config *c = &g->m->cfg;
    const int d = c->d_model;
    if (n == 1 && g->fused_decode)   /* one row: the norm fused into a matrix-vector kernel */
        return stc_gemv(g->dev, g->x + (size_t)t0 * d, g->output_norm, c->norm_eps, d, g->output, c->n_vocab,
                        g->logits, 0.0f, err);
    int rc = stc_rmsnorm(g->dev, g->x + (size_t)t0 * d, g->output_norm, n, d, c->norm_eps, NULL, g->xb, err);
    if (!rc) rc = stc_gemm_bf16(g->dev, n, c->n_vocab, d, g->xb, g->output, g->logits, 0.0f, err);
    return rc;
}

/* One decode step with logits through the recorded graph (recorded now if
 * this is the first). g->tokens holds the token. */
static int gpu_decode_step_graph(gpu_context *g, int p0, float *logits, still_err *err) {
    const int n_layer = g->m->cfg.n_layer;
    int leaves = 0, rc;
    for (int l = 0; l < n_layer; l++) leaves |= stc_still_leaves_at(g->layers[l].still, p0, 1) > 0;
    stc_graph **graph = &g->decode_graph[leaves];
    if (!*graph) {
        if ((rc = stc_graph_begin(g->dev, err))) return rc;
        for (int l = 0; l < n_layer; l++) stc_still_set_decode_no_leave(g->layers[l].still, !leaves);
        rc = gpu_enqueue_layers(g, 1, p0, 1, err);
        for (int l = 0; l < n_layer; l++) stc_still_set_decode_no_leave(g->layers[l].still, 0);
        if (!rc) rc = gpu_enqueue_head(g, 0, 1, err);
        still_err end_err = {0};
        const int rc_end = stc_graph_end(g->dev, rc == 0, graph, &end_err);
        if (rc) return rc;
        if (rc_end) {
            if (err) *err = end_err;
            return rc_end;
        }
    }
    rc = stc_graph_launch(g->dev, *graph, err);
    if (!rc) rc = stc_memcpy_d2h(g->dev, logits, g->logits, sizeof(float) * (size_t)g->m->cfg.n_vocab, err);
    return rc;
}

void *gpu_context_device(gpu_context *g) { return g ? g->dev : NULL; }

int gpu_observed_enqueue(gpu_context *g, const int32_t *tokens_dev, int T, int seq, gpu_layer_observer fn, void *data,
                         still_err *err) {
    const model_config *c = &g->m->cfg;
    if (T <= 0 || T > g->n_batch || T > g->n_ctx)
        return still_fail(err, STILL_E_ARG, "CUDA forward: %d tokens (at most %d)", T, g->n_batch < g->n_ctx ? g->n_batch : g->n_ctx);
    if (seq <= 0 || T % seq)
        return still_fail(err, STILL_E_ARG, "CUDA observed forward: %d tokens are not whole sequences of %d", T, seq);
    /* the plan may have changed since the context was made (the trainer made it with its teacher plan):
     * what counts is what the context holds, a full KV cache at every layer */
    for (int l = 0; l < c->n_layer; l++)
        if (g->layers[l].still || g->layers[l].liger || !g->layers[l].k_cache || g->layers[l].kv_rows < g->n_ctx)
            return still_fail(err, STILL_E_ARG, "CUDA observed forward: layer %d is not softmax (the teacher is)", l);
    if (!tokens_dev) return still_fail(err, STILL_E_ARG, "CUDA observed forward: no tokens");
    int rc = STILL_OK;
    if (!g->obs_x) rc = stc_malloc(g->dev, sizeof(float) * (size_t)g->n_batch * c->d_model, "training layer inputs", (void **)&g->obs_x, err);
    if (!rc && !g->obs_att)
        rc = stc_malloc(g->dev, sizeof(float) * (size_t)g->n_batch * c->n_head * c->head_dim, "training teacher outputs",
                        (void **)&g->obs_att, err);
    if (!rc && tokens_dev != g->tokens) rc = stc_memcpy_d2d(g->dev, g->tokens, tokens_dev, sizeof(int32_t) * (size_t)T, err);
    if (rc) return rc;
    g->observer = fn, g->observer_data = data, g->obs_seq = seq;
    rc = gpu_enqueue_layers(g, T, 0, T, err);
    g->observer = NULL, g->observer_data = NULL;
    return rc;
}

int gpu_forward_chunk(gpu_context *g, const int32_t *tokens, int T, int p0, float *logits, int all_logits,
                      still_err *err) {
    const model_config *c = &g->m->cfg;
    const int V = c->n_vocab;
    stc_ctx *dev = g->dev;
    if (T <= 0 || T > g->n_batch) return still_fail(err, STILL_E_ARG, "CUDA forward: %d tokens per chunk", T);
    if (p0 + T > g->n_ctx)
        return still_fail(err, STILL_E_STATE, "context full: %d tokens + %d new > context size %d", p0, T, g->n_ctx);
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= V)
            return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", tokens[t], V);
    int rc = stc_memcpy_h2d(dev, g->tokens, tokens, sizeof(int32_t) * (size_t)T, err);
    if (rc) return rc;
    if (T == 1 && logits && g->graphs) return gpu_decode_step_graph(g, p0, logits, err);
    rc = gpu_enqueue_layers(g, T, p0, !logits ? 0 : all_logits ? T : 1, err);
    if (!rc && logits) {
        const int first = all_logits ? 0 : T - 1, rows = gpu_logit_rows(g);
        for (int t0 = first; t0 < T && !rc; t0 += rows) {
            const int n = T - t0 < rows ? T - t0 : rows;
            rc = gpu_enqueue_head(g, t0, n, err);
            if (!rc) rc = stc_memcpy_d2h(dev, logits + (size_t)(t0 - first) * V, g->logits, sizeof(float) * (size_t)n * V, err);
        }
    }
    if (!rc) rc = stc_ctx_sync(dev, err);
    return rc;
}

#endif
