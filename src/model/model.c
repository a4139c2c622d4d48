/* The Llama-architecture model as stored in GGUF: loading, per-sequence
 * context (KV cache + scratch), and the forward pass.
 *
 * Forward for a chunk of T tokens at positions p0 .. p0+T-1:
 *   x = embed(tokens)
 *   per layer:  h = rmsnorm(x) * attn_norm
 *               q, k, v = h Wqᵀ, h Wkᵀ, h Wvᵀ ; rope(q), rope(k) ; append k, v to the cache
 *               x += attention(q, cache) Woᵀ
 *               h = rmsnorm(x) * ffn_norm
 *               x += (silu(h Wgᵀ) ⊙ h Wuᵀ) Wdᵀ
 *   logits = (rmsnorm(x) * output_norm) Eᵀ      (E = token_embd when tied)
 * RoPE rotates adjacent pairs (x[2i], x[2i+1]) by pos * theta^(-2i/D): the
 * GGUF converter permutes Wq/Wk rows so this matches the HF model. */
#include "model/model.h"
#include "kinds/plan.h"
#include "kinds/still/attn_still_rules.h"
#include "kinds/still/attn_still.h"
#include "model/model_cuda.h"

#include "common/common.h"
#include "format/gguf.h"
#include "cpu/kernels.h"
#include "text/tokenizer.h"
#include "kinds/attn.h"
#include "kinds/softmax/attn_softmax.h"
#include "kinds/dsa/attn_dsa.h"
#include "cpu/vecmath.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- loading ------------------------------------------------------------ */

static int get_matrix(const gguf_file *f, const char *name, int64_t n_in, int64_t n_out,
                      weight_matrix *w, still_err *err) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) return still_fail(err, STILL_E_FORMAT, "tensor '%s' is missing", name);
    if (t->n_dims != 2 || t->ne[0] != n_in || t->ne[1] != n_out)
        return still_fail(err, STILL_E_FORMAT, "tensor '%s' has shape [%lld, %lld], expected [%lld, %lld]",
                          name, (long long)t->ne[0], (long long)t->ne[1], (long long)n_in, (long long)n_out);
    if (!tensor_type_supported(t->type))
        return still_fail(err, STILL_E_UNSUPPORTED, "tensor '%s' has unsupported type %s", name,
                          tensor_type_name(t->type));
    w->type = t->type;
    w->n_in = n_in;
    w->n_out = n_out;
    w->data = t->data;
    w->row_bytes = tensor_row_bytes(t->type, n_in);
    return STILL_OK;
}

static int get_vector(const gguf_file *f, const char *name, int64_t n, const float **out, still_err *err) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) return still_fail(err, STILL_E_FORMAT, "tensor '%s' is missing", name);
    if (t->type != TT_F32 || t->ne[0] != n || t->ne[1] * t->ne[2] * t->ne[3] != 1)
        return still_fail(err, STILL_E_FORMAT, "tensor '%s' must be F32 of %lld elements", name, (long long)n);
    *out = (const float *)t->data;
    return STILL_OK;
}

static int read_config(const gguf_file *f, model_config *c, still_err *err) {
    gguf_str arch;
    int rc = gguf_get_str(f, "general.architecture", &arch, err);
    if (rc) return rc;
    if (arch.len != 5 || memcmp(arch.ptr, "llama", 5) != 0)
        return still_fail(err, STILL_E_UNSUPPORTED, "unsupported architecture '%.*s' (only llama)",
                          (int)(arch.len > 64 ? 64 : arch.len), arch.ptr);
    uint32_t u;
    struct { const char *key; int *dst; } ints[] = {
        {"llama.block_count", &c->n_layer},
        {"llama.embedding_length", &c->d_model},
        {"llama.feed_forward_length", &c->d_ff},
        {"llama.attention.head_count", &c->n_head},
        {"llama.context_length", &c->n_ctx_train},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        if ((rc = gguf_get_u32(f, ints[i].key, &u, err))) return rc;
        if (u == 0 || u > (1u << 24)) return still_fail(err, STILL_E_FORMAT, "%s = %u is out of range", ints[i].key, u);
        *ints[i].dst = (int)u;
    }
    c->n_head_kv = c->n_head;
    if (gguf_find(f, "llama.attention.head_count_kv")) {
        if ((rc = gguf_get_u32(f, "llama.attention.head_count_kv", &u, err))) return rc;
        c->n_head_kv = (int)u;
    }
    if (c->n_head_kv <= 0 || c->n_head % c->n_head_kv != 0)
        return still_fail(err, STILL_E_FORMAT, "head_count %d is not a multiple of head_count_kv %d", c->n_head,
                          c->n_head_kv);
    if (c->d_model % c->n_head != 0)
        return still_fail(err, STILL_E_FORMAT, "embedding_length %d not divisible by head_count %d", c->d_model,
                          c->n_head);
    c->head_dim = c->d_model / c->n_head;
    if (c->head_dim % 2 != 0 || c->head_dim > ATT_MAX_HEAD_DIM)
        return still_fail(err, STILL_E_UNSUPPORTED, "head dimension %d unsupported (even, at most %d)", c->head_dim,
                          ATT_MAX_HEAD_DIM);
    if (gguf_find(f, "llama.rope.dimension_count")) {
        if ((rc = gguf_get_u32(f, "llama.rope.dimension_count", &u, err))) return rc;
        if ((int)u != c->head_dim)
            return still_fail(err, STILL_E_UNSUPPORTED, "partial RoPE (dimension_count %u != head dim %d)", u,
                              c->head_dim);
    }
    c->rope_theta = 10000.0f;
    if (gguf_find(f, "llama.rope.freq_base") &&
        (rc = gguf_get_f32(f, "llama.rope.freq_base", &c->rope_theta, err)))
        return rc;
    c->norm_eps = 1e-5f;
    if (gguf_find(f, "llama.attention.layer_norm_rms_epsilon") &&
        (rc = gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &c->norm_eps, err)))
        return rc;
    if (!(c->rope_theta > 0) || !(c->norm_eps > 0) || !isfinite(c->rope_theta) || !isfinite(c->norm_eps))
        return still_fail(err, STILL_E_FORMAT, "invalid rope.freq_base or rms epsilon");
    return STILL_OK;
}

static void free_plan(still_model *m) {
    if (m->attn_params)
        for (int l = 0; l < m->cfg.n_layer; l++) free(m->attn_params[l]);
    free(m->attn_params);
    free(m->attn_cfg);
    m->attn_params = NULL;
    m->attn_cfg = NULL;
}

int still_model_load(const char *path, still_model **out, still_err *err) {
    *out = NULL;
    still_model *m = calloc(1, sizeof *m);
    if (!m) return still_fail(err, STILL_E_NOMEM, "out of memory");
    int rc = gguf_open(path, &m->file, err);
    if (rc) goto fail;
    if ((rc = read_config(m->file, &m->cfg, err))) goto fail;
    const model_config *c = &m->cfg;
    const gguf_tensor *emb = gguf_find_tensor(m->file, "token_embd.weight");
    if (!emb) { rc = still_fail(err, STILL_E_FORMAT, "tensor 'token_embd.weight' is missing"); goto fail; }
    m->cfg.n_vocab = (int)emb->ne[1];
    if ((rc = get_matrix(m->file, "token_embd.weight", c->d_model, c->n_vocab, &m->tok_embd, err))) goto fail;
    if (gguf_find_tensor(m->file, "output.weight")) {
        if ((rc = get_matrix(m->file, "output.weight", c->d_model, c->n_vocab, &m->output, err))) goto fail;
    } else {
        m->output = m->tok_embd;   /* tied embeddings */
    }
    if ((rc = get_vector(m->file, "output_norm.weight", c->d_model, &m->output_norm, err))) goto fail;
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    if (!m->layers) { rc = still_fail(err, STILL_E_NOMEM, "out of memory"); goto fail; }
    int qd = c->n_head * c->head_dim, kvd = c->n_head_kv * c->head_dim;
    for (int l = 0; l < c->n_layer; l++) {
        layer_weights *L = &m->layers[l];
        char name[96];
#define MAT(field, suffix, nin, nout)                                              \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);                 \
        if ((rc = get_matrix(m->file, name, nin, nout, &L->field, err))) goto fail;
#define VEC(field, suffix, n)                                                      \
        snprintf(name, sizeof name, "blk.%d." suffix ".weight", l);                 \
        if ((rc = get_vector(m->file, name, n, &L->field, err))) goto fail;
        VEC(attn_norm, "attn_norm", c->d_model)
        VEC(ffn_norm, "ffn_norm", c->d_model)
        MAT(wq, "attn_q", c->d_model, qd)
        MAT(wk, "attn_k", c->d_model, kvd)
        MAT(wv, "attn_v", c->d_model, kvd)
        MAT(wo, "attn_output", qd, c->d_model)
        MAT(w_gate, "ffn_gate", c->d_model, c->d_ff)
        MAT(w_up, "ffn_up", c->d_model, c->d_ff)
        MAT(w_down, "ffn_down", c->d_ff, c->d_model)
#undef MAT
#undef VEC
    }
    /* a layer the metadata does not count (block_count too small) would be ignored silently */
    for (int64_t i = 0; i < gguf_tensor_count(m->file); i++) {
        const gguf_str nm = gguf_tensor_at(m->file, i)->name;
        if (nm.len < 6 || memcmp(nm.ptr, "blk.", 4)) continue;
        size_t k = 4;
        long long blk = 0;
        while (k < nm.len && nm.ptr[k] >= '0' && nm.ptr[k] <= '9' && blk < (1LL << 40)) blk = blk * 10 + (nm.ptr[k++] - '0');
        if (k > 4 && blk >= c->n_layer) {
            rc = still_fail(err, STILL_E_FORMAT, "tensor '%.*s' is past llama.block_count = %d",
                            (int)(nm.len > 96 ? 96 : nm.len), nm.ptr, c->n_layer);
            goto fail;
        }
    }
    if ((rc = tokenizer_from_gguf(m->file, &m->tok, err))) goto fail;
    if (tokenizer_n_vocab(m->tok) != c->n_vocab) {
        rc = still_fail(err, STILL_E_FORMAT, "tokenizer has %d tokens but the embedding has %d rows",
                        tokenizer_n_vocab(m->tok), c->n_vocab);
        goto fail;
    }
    /* A merged linearized model carries its attention plan. */
    if (plan_present(m->file)) {
        const plan_shape ps = model_plan_shape(m);
        attn_plan plan;
        if ((rc = plan_read(&ps, m->file, NULL, 0, &plan, err))) goto fail;
        model_set_plan(m, &plan);
    } else {
        still_attn_params ap = still_attn_default_params();
        if ((rc = still_model_set_attention(m, &ap, err))) goto fail;
    }
    *out = m;
    return STILL_OK;
fail:
    still_model_free(m);
    return rc;
}

/* ---- attention plan (src/kinds/plan.c makes, reads and writes it; the model holds it) ---------- */

plan_shape model_plan_shape(const still_model *m) {
    const model_config *c = &m->cfg;
    plan_shape s = {.n_layer = c->n_layer, .d_model = c->d_model, .n_head = c->n_head, .n_head_kv = c->n_head_kv,
                    .head_dim = c->head_dim, .n_ctx_train = c->n_ctx_train};
    return s;
}

attn_plan model_plan(const still_model *m) {
    attn_plan p = {.n_layer = m->cfg.n_layer, .cfg = m->attn_cfg, .params = m->attn_params, .sel_cache = m->plan_sel_cache};
    return p;
}

void model_set_plan(still_model *m, attn_plan *p) {
    free_plan(m);
    m->attn_cfg = p->cfg;
    m->attn_params = p->params;
    m->plan_sel_cache = p->sel_cache;
    memset(p, 0, sizeof *p);
}

int still_model_set_attention(still_model *m, const still_attn_params *p, still_err *err) {
    const plan_shape s = model_plan_shape(m);
    attn_plan plan;
    int rc = plan_from_params(&s, p, &plan, err);
    if (rc) return rc;
    /* dsa layers whose indexer starts from the layer's own projections (plan "ifrom"): the rows of KV head g's
     * query heads of W_q and of head g of W_k */
    const int64_t D = m->cfg.head_dim, G = m->cfg.n_head / m->cfg.n_head_kv, d = m->cfg.d_model;
    for (int l = 0; !rc && l < plan.n_layer; l++) {
        const attn_config *a = &plan.cfg[l];
        if (a->kind != ATTN_DSA || a->index_from < 0 || !plan.params[l]) continue;
        float *wq = malloc(sizeof(float) * (size_t)(G * D * d)), *wk = malloc(sizeof(float) * (size_t)(D * d));
        rc = wq && wk ? STILL_OK : still_fail(err, STILL_E_NOMEM, "out of memory");
        if (!rc) rc = weight_rows_to_f32(&m->layers[l].wq, a->index_from * G * D, G * D, wq, err);
        if (!rc) rc = weight_rows_to_f32(&m->layers[l].wk, a->index_from * D, D, wk, err);
        if (!rc) attn_dsa_init_from_projections(a, plan.params[l], wq, wk);
        free(wq), free(wk);
    }
    if (rc) {
        plan_free(&plan);
        return rc;
    }
    model_set_plan(m, &plan);
    return STILL_OK;
}

const char *still_model_layer_kind(const still_model *m, int layer) {
    if (layer < 0 || layer >= m->cfg.n_layer) return NULL;
    return attn_kind_get(m->attn_cfg[layer].kind)->name;
}

lora_shape model_lora_shape(const still_model *m) {
    const model_config *c = &m->cfg;
    const int qd = c->n_head * c->head_dim, kvd = c->n_head_kv * c->head_dim;
    lora_shape sh = {.n_layer = c->n_layer,
                     .n_in = {c->d_model, c->d_model, c->d_model, qd, c->d_model, c->d_model, c->d_ff},
                     .n_out = {qd, kvd, kvd, c->d_model, c->d_ff, c->d_ff, c->d_model}};
    return sh;
}

void model_set_lora(still_model *m, lora_set *s) {
    lora_free(m->lora);
    m->lora = s;
}

int still_model_load_lora(still_model *m, const char *path, float scale, still_err *err) {
    if (!(scale >= -1e6f && scale <= 1e6f)) return still_fail(err, STILL_E_ARG, "LoRA scale %g out of range", scale);
    gguf_file *f;
    int rc = gguf_open(path, &f, err);
    if (rc) return rc;
    lora_set *s = NULL;
    const lora_shape sh = model_lora_shape(m);
    if (!lora_present(f))
        rc = still_fail(err, STILL_E_FORMAT, "'%s' is not a LoRA adapter (general.type = adapter, adapter.type = lora)", path);
    else rc = lora_read(f, &sh, &s, err);
    gguf_close(f);
    if (rc) {
        /* keep the one-line message, with the file named */
        char msg[sizeof err->msg];
        if (err) {
            snprintf(msg, sizeof msg, "%s", err->msg);
            if (!strstr(msg, path)) still_fail(err, rc, "%s: %s", path, msg);
        }
        return rc;
    }
    s->user_scale = scale;
    model_set_lora(m, s);
    return STILL_OK;
}

int still_model_has_lora(const still_model *m) { return m->lora != NULL; }

void still_model_drop_lora(still_model *m) { model_set_lora(m, NULL); }

void still_model_free(still_model *m) {
    if (!m) return;
    lora_free(m->lora);
    free_plan(m);
    tokenizer_free(m->tok);
    free(m->layers);
    gguf_close(m->file);
    free(m);
}

still_model_info still_model_get_info(const still_model *m) {
    const model_config *c = &m->cfg;
    still_model_info i = {
        .n_layer = c->n_layer, .d_model = c->d_model, .n_head = c->n_head, .n_head_kv = c->n_head_kv,
        .head_dim = c->head_dim, .d_ff = c->d_ff, .n_vocab = c->n_vocab, .n_ctx_train = c->n_ctx_train,
        .rope_theta = c->rope_theta, .norm_eps = c->norm_eps, .file_bytes = gguf_file_size(m->file),
    };
    for (int64_t t = 0; t < gguf_tensor_count(m->file); t++) {
        const gguf_tensor *g = gguf_tensor_at(m->file, t);
        i.n_params += (uint64_t)(g->ne[0] * g->ne[1] * g->ne[2] * g->ne[3]);
    }
    return i;
}

const gguf_file *still_model_gguf(const still_model *m) { return m->file; }
const tokenizer *still_model_tokenizer(const still_model *m) { return m->tok; }

/* ---- context ------------------------------------------------------------ */

int still_context_create(const still_model *m, still_context_params p, still_context **out, still_err *err) {
    *out = NULL;
    const model_config *c = &m->cfg;
    if (p.n_ctx <= 0 || p.n_ctx > (1 << 22))
        return still_fail(err, STILL_E_ARG, "context size %d out of range (1 .. %d)", p.n_ctx, 1 << 22);
    if (p.sel_cache < STILL_SEL_PLAN || p.sel_cache > STILL_SEL_Q8)
        return still_fail(err, STILL_E_ARG, "unknown selected-token cache type %d", p.sel_cache);
    if (p.sel_cache == STILL_SEL_PLAN) p.sel_cache = m->plan_sel_cache ? m->plan_sel_cache : STILL_SEL_F16;
    if (p.device != STILL_DEVICE_CPU && p.device != STILL_DEVICE_CUDA)
        return still_fail(err, STILL_E_ARG, "unknown device %d", p.device);
    if (p.matvec < STILL_MATVEC_DEFAULT || p.matvec > STILL_MATVEC_INT8_AVXVNNI)
        return still_fail(err, STILL_E_ARG, "unknown matrix-vector path %d", p.matvec);
    /* the default: the integer products on the CPU, the GPU's own (float) products with CUDA */
    if (p.matvec == STILL_MATVEC_DEFAULT) p.matvec = p.device == STILL_DEVICE_CUDA ? STILL_MATVEC_FLOAT : STILL_MATVEC_INT8;
    if (p.matvec != STILL_MATVEC_FLOAT && p.device == STILL_DEVICE_CUDA)
        return still_fail(err, STILL_E_ARG, "the integer matrix-vector paths are the CPU's (not with the CUDA device)");
    /* as MATVEC_Q8_* of quant.h: PORTABLE 1, AVX2 2, VNNI 3, AVXVNNI 4 */
    const int mv_path = p.matvec == STILL_MATVEC_FLOAT  ? 0
                        : p.matvec == STILL_MATVEC_INT8 ? matvec_q8_best_path()
                                                        : p.matvec - STILL_MATVEC_INT8;
    if (mv_path && !matvec_q8_path_available(mv_path))
        return still_fail(err, STILL_E_UNSUPPORTED, "this CPU has no %s path for integer products",
                          matvec_q8_path_name(mv_path));
    if (p.prefill != STILL_PREFILL_FLOAT && p.prefill != STILL_PREFILL_INT8)
        return still_fail(err, STILL_E_ARG, "unknown prefill path %d", p.prefill);
    if (p.prefill == STILL_PREFILL_INT8 && p.device == STILL_DEVICE_CUDA)
        return still_fail(err, STILL_E_ARG, "the integer prefill is the CPU's (not with the CUDA device)");
    if (p.n_batch <= 0) p.n_batch = 512;
    if (p.n_batch > p.n_ctx) p.n_batch = p.n_ctx;
    still_context *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return still_fail(err, STILL_E_NOMEM, "out of memory");
    ctx->m = m;
    ctx->n_ctx = p.n_ctx;
    ctx->n_batch = p.n_batch;
    if (p.device == STILL_DEVICE_CUDA) {
        int rc = gpu_context_create(m, p.n_ctx, p.n_batch, p.sel_cache, &ctx->gpu, err);
        if (rc) {
            free(ctx);
            return rc;
        }
        *out = ctx;
        return STILL_OK;
    }
    size_t kvd = (size_t)c->n_head_kv * c->head_dim;
    ctx->attn = calloc((size_t)c->n_layer, sizeof *ctx->attn);
    if (!ctx->attn) {
        free(ctx);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    int needs_nope = 0;
    for (int l = 0; l < c->n_layer; l++) {
        attn_config ac = m->attn_cfg[l];
        ac.n_ctx = p.n_ctx;
        ac.sel_type = p.sel_cache == STILL_SEL_F32 ? SEL_F32 : p.sel_cache == STILL_SEL_Q8 ? SEL_Q8 : SEL_F16;
        const attn_kind *k = attn_kind_get(ac.kind);
        needs_nope |= k->needs_nope;
        int rc = k->state_create(&ac, &ctx->attn[l], err);
        if (rc) {
            still_context_free(ctx);
            return rc;
        }
    }
    /* The states are reserved, not touched, until the context fills them: a context whose attention state
     * alone exceeds the machine's memory would run until it is killed. Say so up front. */
    {
        const size_t need = still_context_state_bytes(ctx);
        const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
        const double have = pages > 0 && page > 0 ? (double)pages * (double)page : 0;
        if (have > 0 && (double)need > have) {
            still_context_free(ctx);
            return still_fail(err, STILL_E_NOMEM, "a %d-token context needs %.1f GiB of attention state (KV cache) "
                              "for this plan, more than this machine's %.1f GiB of memory: use a smaller context",
                              p.n_ctx, need / 1073741824.0, have / 1073741824.0);
        }
    }
    /* One scratch allocation carved into the per-chunk activations. */
    size_t T = (size_t)p.n_batch, d = c->d_model, qd = (size_t)c->n_head * c->head_dim, ff = c->d_ff;
    size_t n_floats = T * (d /*x*/ + d /*h*/ + qd /*q*/ + 2 * kvd /*k,v*/ + qd /*att*/ + 2 * ff /*gate,up*/ +
                           (needs_nope ? qd + kvd : 0) /*q_nope, k_nope*/);
    ctx->scratch = malloc(n_floats * sizeof(float));
    ctx->rope_inv_freq = malloc((size_t)(c->head_dim / 2) * sizeof(float));
    if (m->lora) ctx->lora_tmp = malloc(T * (size_t)m->lora->rank * sizeof(float));
    ctx->matvec_path = mv_path;
    ctx->fixed_threads = p.fixed_threads != 0;
    const size_t widest = d > qd ? (d > ff ? d : ff) : (qd > ff ? qd : ff);
    const int xq_ok = !mv_path || widest % 32 || act_q8_init(&ctx->xq, (int64_t)widest) == STILL_OK;
    int xqm_ok = 1;
    if (p.prefill == STILL_PREFILL_INT8 && widest % 32 == 0 && matmul_q8_supported(TT_Q4_1, MATVEC_Q8_VNNI) &&
        (xqm_ok = (ctx->xqm = calloc((size_t)T, sizeof(act_q8))) != NULL)) {
        ctx->mq_path = MATVEC_Q8_VNNI;
        for (size_t i = 0; i < T && xqm_ok; i++) xqm_ok = act_q8_init(&ctx->xqm[i], (int64_t)widest) == STILL_OK;
    }
    if (!ctx->scratch || !ctx->rope_inv_freq || (m->lora && !ctx->lora_tmp) || !xq_ok || !xqm_ok) {
        still_context_free(ctx);
        return still_fail(err, STILL_E_NOMEM, "out of memory allocating a %d-token context", p.n_ctx);
    }
    float *s = ctx->scratch;
    ctx->x = s;    s += T * d;
    ctx->h = s;    s += T * d;
    ctx->q = s;    s += T * qd;
    ctx->k = s;    s += T * kvd;
    ctx->v = s;    s += T * kvd;
    ctx->att = s;  s += T * qd;
    ctx->gate = s; s += T * ff;
    ctx->up = s;   s += T * ff;
    if (needs_nope) {
        ctx->q_nope = s; s += T * qd;
        ctx->k_nope = s; s += T * kvd;
    }
    for (int i = 0; i < c->head_dim / 2; i++)
        ctx->rope_inv_freq[i] = (float)pow((double)c->rope_theta, -2.0 * i / c->head_dim);
    if (mv_path && d % 32 == 0) {   /* the still gates in 8 bits for the decode step's integer products */
        int rc = STILL_OK;
        for (int l = 0; l < c->n_layer && !rc; l++) {
            const float *Wg, *bg;
            const attn_kind *kind = attn_kind_get(m->attn_cfg[l].kind);
            if (!kind->x_gate || !kind->x_gate(&m->attn_cfg[l], m->attn_params[l], &Wg, &bg)) continue;
            if (!ctx->gate_q8 && !(ctx->gate_q8 = calloc((size_t)c->n_layer, sizeof *ctx->gate_q8))) rc = STILL_E_NOMEM;
            if (!ctx->gate_pre && !(ctx->gate_pre = malloc(sizeof(float) * qd))) rc = STILL_E_NOMEM;
            void *q8 = rc ? NULL : malloc(qd * (d / 32) * 34);
            if (!q8) rc = STILL_E_NOMEM;
            for (size_t row = 0; row < qd && !rc; row++) rc = quantize_row_q8_0(Wg + row * d, (uint8_t *)q8 + row * (d / 32) * 34, (int64_t)d);
            if (rc) {
                free(q8);
                break;
            }
            ctx->gate_q8[l] = (weight_matrix){.type = TT_Q8_0, .n_in = (int64_t)d, .n_out = (int64_t)qd, .data = q8,
                                              .row_bytes = (d / 32) * 34};
        }
        if (rc) {
            still_context_free(ctx);
            return rc == STILL_E_NOMEM ? still_fail(err, rc, "out of memory for the gates' 8-bit copies")
                                       : still_fail(err, rc, "a still gate weight is not finite");
        }
    }
    *out = ctx;
    return STILL_OK;
}

void still_context_free(still_context *ctx) {
    if (!ctx) return;
    gpu_context_free(ctx->gpu);
    act_q8_free(&ctx->xq);
    for (int64_t i = 0; ctx->xqm && i < ctx->n_batch; i++) act_q8_free(&ctx->xqm[i]);
    free(ctx->xqm);
    if (ctx->attn)
        for (int l = 0; l < ctx->m->cfg.n_layer; l++)
            if (ctx->attn[l]) attn_kind_get(ctx->attn[l]->cfg.kind)->state_free(ctx->attn[l]);
    free(ctx->attn);
    free(ctx->scratch);
    free(ctx->rope_inv_freq);
    free(ctx->lora_tmp);
    if (ctx->gate_q8)
        for (int l = 0; l < ctx->m->cfg.n_layer; l++) free((void *)ctx->gate_q8[l].data);
    free(ctx->gate_q8), free(ctx->gate_pre);
    free(ctx);
}

int still_context_n_past(const still_context *ctx) { return ctx->n_past; }

void still_context_set_observer(still_context *ctx, still_layer_observer fn, void *data) {
    ctx->observer = fn;
    ctx->observer_data = data;
}
size_t still_context_state_bytes(const still_context *ctx) {
    if (ctx->gpu) return gpu_context_state_bytes(ctx->gpu);
    size_t n = 0;
    for (int l = 0; l < ctx->m->cfg.n_layer; l++) n += attn_kind_get(ctx->attn[l]->cfg.kind)->state_bytes(ctx->attn[l]);
    return n;
}

int still_context_truncate(still_context *ctx, int n, still_err *err) {
    if (n < 0 || n > ctx->n_past)
        return still_fail(err, STILL_E_ARG, "cannot truncate a %d-token context to %d tokens", ctx->n_past, n);
    if (ctx->gpu) {   /* KV cache rows past n are overwritten later; still states fold tokens */
        if (n == ctx->n_past) return STILL_OK;
        int rc = gpu_context_truncate(ctx->gpu, ctx->n_past, n, err);
        if (rc) return rc;
        ctx->n_past = n;
        return STILL_OK;
    }
    for (int l = 0; l < ctx->m->cfg.n_layer; l++) {
        int rc = attn_kind_get(ctx->attn[l]->cfg.kind)->state_truncate(ctx->attn[l], n, err);
        if (rc) return rc;
    }
    ctx->n_past = n;
    return STILL_OK;
}

/* ---- kernels used by the forward pass ------------------------------------ */

static void rmsnorm(float *out, const float *x, const float *w, int n, float eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

/* Rotate adjacent pairs of each head of one token's vector. */
static void rope(float *vec, int n_heads, int head_dim, int pos, const float *inv_freq) {
    for (int i = 0; i < head_dim / 2; i++) {
        float angle = (float)pos * inv_freq[i];
        float cs = cosf(angle), sn = sinf(angle);
        for (int h = 0; h < n_heads; h++) {
            float *p = vec + (size_t)h * head_dim + 2 * i;
            float a = p[0], b = p[1];
            p[0] = a * cs - b * sn;
            p[1] = a * sn + b * cs;
        }
    }
}

/* Does W take the integer path for `rows` rows of input on this context? */
static int int8_takes(const still_context *ctx, const weight_matrix *W, int rows) {
    return rows == 1 && ctx->matvec_path && matvec_q8_supported(W->type) && W->n_in <= ctx->xq.n_max &&
           W->n_in % 32 == 0;
}

/* Y[i] = X W[i]ᵀ for n matrices of one input X (`rows` rows). One row on a
 * context with the integer path: X is quantized to 8-bit blocks once
 * (*xq_of remembers which input ctx->xq holds) and the Q4_0 / Q4_1 / Q5_0 /
 * Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrices take integer dot products, all in one parallel
 * region when every matrix does; anything else goes through matmul. */
static void ctx_matmul_many(still_context *ctx, const weight_matrix *const *W, float *const *Y, int n, const float *X,
                            int rows, const float **xq_of) {
    if (rows > 1 && ctx->mq_path && rows <= ctx->n_batch) {   /* prefill int8: the rows quantized once */
        for (int i = 0; i < n; i++) {
            int rc = STILL_E_ARG;
            if (matmul_q8_supported(W[i]->type, ctx->mq_path) && W[i]->n_in <= ctx->xqm[0].n_max && W[i]->n_in % 32 == 0) {
                rc = STILL_OK;
                if (*xq_of != X || ctx->xqm[0].n != W[i]->n_in) {
                    int bad = 0;
                    const int64_t n_in = W[i]->n_in;
#pragma omp parallel for schedule(static) reduction(| : bad) if (rows * n_in >= 16384)
                    for (int r = 0; r < rows; r++) bad |= act_q8_quantize(&ctx->xqm[r], X + (size_t)r * n_in, n_in) != STILL_OK;
                    rc = bad ? STILL_E_ARG : STILL_OK;
                }
                *xq_of = rc ? NULL : X;
                if (!rc) rc = matmul_q8(W[i], ctx->xqm, rows, Y[i], ctx->mq_path);
            }
            if (rc) matmul(W[i], X, Y[i], rows);   /* another type, or a NaN / inf (float carries it) */
        }
        return;
    }
    int all = 1;
    for (int i = 0; i < n; i++) all &= int8_takes(ctx, W[i], rows) && W[i]->n_in == W[0]->n_in;
    for (int i = 0; i < n; i++) {
        if (int8_takes(ctx, W[i], rows)) {
            if (*xq_of != X || ctx->xq.n != W[i]->n_in) {
                if (act_q8_quantize(&ctx->xq, X, W[i]->n_in) != STILL_OK) {   /* a NaN or inf: float carries it */
                    *xq_of = NULL, all = 0;
                    matmul(W[i], X, Y[i], rows);
                    continue;
                }
                *xq_of = X;
            }
            const int rc = all ? matvec_q8_many(W, Y, n, &ctx->xq, ctx->matvec_path)
                               : matvec_q8(W[i], &ctx->xq, Y[i], ctx->matvec_path);
            if (rc == STILL_OK && all) return;
            if (rc == STILL_OK) continue;
            all = 0;
        }
        matmul(W[i], X, Y[i], rows);
    }
}

static void ctx_matmul(still_context *ctx, const weight_matrix *W, const float *X, float *Y, int rows,
                       const float **xq_of) {
    ctx_matmul_many(ctx, &W, &Y, 1, X, rows, xq_of);
}

/* Forward one chunk of T tokens starting at ctx->n_past. If logits != NULL,
 * writes logits of the last token (all_logits == 0) or of every token. */
static int forward_chunk(still_context *ctx, const int32_t *tokens, int T, float *logits, int all_logits,
                         still_err *err) {
    const still_model *m = ctx->m;
    const model_config *c = &m->cfg;
    const int d = c->d_model, D = c->head_dim, H = c->n_head, Hk = c->n_head_kv;
    const int qd = H * D, kvd = Hk * D, ff = c->d_ff;
    const int p0 = ctx->n_past;
    float *x = ctx->x, *h = ctx->h, *q = ctx->q, *k = ctx->k, *v = ctx->v, *att = ctx->att;

    for (int t = 0; t < T; t++) {
        if (tokens[t] < 0 || tokens[t] >= c->n_vocab)
            return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", tokens[t], c->n_vocab);
        const uint8_t *row = (const uint8_t *)m->tok_embd.data + (size_t)tokens[t] * m->tok_embd.row_bytes;
        int rc = dequantize_row(m->tok_embd.type, row, x + (size_t)t * d, d, err);
        if (rc) return rc;
    }

    for (int l = 0; l < c->n_layer; l++) {
        const layer_weights *L = &m->layers[l];
        for (int t = 0; t < T; t++) rmsnorm(h + (size_t)t * d, x + (size_t)t * d, L->attn_norm, d, c->norm_eps);
        const lora_set *lo = m->lora;
        float *lt = ctx->lora_tmp;
        const float *xq_of = NULL;   /* the input ctx->xq holds (the integer path) */
        /* one token on the integer path: a still layer's gate product joins q, k and v */
        const weight_matrix *gq = ctx->gate_q8 && ctx->gate_q8[l].data && int8_takes(ctx, &L->wq, T) ? &ctx->gate_q8[l] : NULL;
        {
            const weight_matrix *const Wqkv[4] = {&L->wq, &L->wk, &L->wv, gq};
            float *const Yqkv[4] = {q, k, v, ctx->gate_pre};
            ctx_matmul_many(ctx, Wqkv, Yqkv, gq ? 4 : 3, h, T, &xq_of);
        }
        lora_apply(lo, l, LORA_Q, h, q, T, lt);
        lora_apply(lo, l, LORA_K, h, k, T, lt);
        lora_apply(lo, l, LORA_V, h, v, T, lt);
        if (ctx->q_nope) {
            memcpy(ctx->q_nope, q, sizeof(float) * (size_t)T * qd);
            memcpy(ctx->k_nope, k, sizeof(float) * (size_t)T * kvd);
        }
        for (int t = 0; t < T; t++) {
            rope(q + (size_t)t * qd, H, D, p0 + t, ctx->rope_inv_freq);
            rope(k + (size_t)t * kvd, Hk, D, p0 + t, ctx->rope_inv_freq);
        }
        attn_io io = {.q = q, .k = k, .v = v, .q_nope = ctx->q_nope, .k_nope = ctx->k_nope, .x = h, .p0 = p0, .T = T,
                      .gate_pre = gq ? ctx->gate_pre : NULL};
        int rc = attn_kind_get(ctx->attn[l]->cfg.kind)->forward(ctx->attn[l], m->attn_params[l], &io, att, err);
        if (rc) return rc;
        if (ctx->observer) ctx->observer(ctx->observer_data, l, p0, T, h, q, k, v, att);
        /* The last layer's o_proj and feed-forward block only for the rows whose logits are asked for (none
         * without logits), as llama.cpp does; each row's products are its own, so those rows come out the same
         * within rounding (one row takes the matrix-vector path, several the GEMM: other summation orders). */
        const int n = l == c->n_layer - 1 && !ctx->observer ? (!logits ? 0 : all_logits ? T : 1) : T;
        float *xr = x + (size_t)(T - n) * d;
        ctx_matmul(ctx, &L->wo, att + (size_t)(T - n) * qd, h, n, &xq_of);
        lora_apply(lo, l, LORA_O, att + (size_t)(T - n) * qd, h, n, lt);
        for (size_t i = 0; i < (size_t)n * d; i++) xr[i] += h[i];

        for (int t = 0; t < n; t++) rmsnorm(h + (size_t)t * d, xr + (size_t)t * d, L->ffn_norm, d, c->norm_eps);
        xq_of = NULL;   /* h was rewritten */
        {
            const weight_matrix *const Wgu[2] = {&L->w_gate, &L->w_up};
            float *const Ygu[2] = {ctx->gate, ctx->up};
            ctx_matmul_many(ctx, Wgu, Ygu, 2, h, n, &xq_of);
        }
        lora_apply(lo, l, LORA_GATE, h, ctx->gate, n, lt);
        lora_apply(lo, l, LORA_UP, h, ctx->up, n, lt);
        float *restrict gate = ctx->gate;
        const float *restrict up = ctx->up;
#pragma omp simd
        for (size_t i = 0; i < (size_t)n * ff; i++) gate[i] = vec_silu(gate[i]) * up[i];
        ctx_matmul(ctx, &L->w_down, ctx->gate, h, n, &xq_of);
        lora_apply(lo, l, LORA_DOWN, ctx->gate, h, n, lt);
        for (size_t i = 0; i < (size_t)n * d; i++) xr[i] += h[i];
    }
    ctx->n_past += T;

    if (logits) {
        int first = all_logits ? 0 : T - 1;
        int n = T - first;
        for (int t = first; t < T; t++)
            rmsnorm(h + (size_t)(t - first) * d, x + (size_t)t * d, m->output_norm, d, c->norm_eps);
        const float *xq_of = NULL;
        ctx_matmul(ctx, &m->output, h, logits, n, &xq_of);
    }
    return STILL_OK;
}

/* ---- several sequences' decode steps in one forward (still_decode_batch) ------------------------------ */

/* Y[i] rows j = W[i] X row j for n rows of one input each (n_in floats apart), as a single decode step of that
 * row computes them: with every matrix on the integer path, each row quantized as ctx_matmul_many does and the
 * weights read once for all rows (matvec_q8_batch); otherwise row by row through ctx_matmul_many. */
static void batch_matmul(still_context *c0, const weight_matrix *const *W, float *const *Y, int nW, const float *X,
                         int n, act_q8 *xs) {
    const int64_t n_in = W[0]->n_in;
    int all = c0->matvec_path != 0;
    for (int i = 0; i < nW; i++) all &= int8_takes(c0, W[i], 1) && W[i]->n_in == n_in;
    if (all) {
        int ok = 1;
        for (int j = 0; j < n && ok; j++) ok = act_q8_quantize(&xs[j], X + (size_t)j * n_in, n_in) == STILL_OK;
        if (ok && matvec_q8_batch(W, Y, nW, xs, n, c0->matvec_path) == STILL_OK) return;
    }
    for (int j = 0; j < n; j++) {
        float *Yj[8];
        for (int i = 0; i < nW; i++) Yj[i] = Y[i] + (size_t)j * W[i]->n_out;
        const float *xq_of = NULL;
        ctx_matmul_many(c0, W, Yj, nW, X + (size_t)j * n_in, 1, &xq_of);
    }
}

int still_decode_batch(still_context *const *ctxs, int n, const int32_t *tokens, float *logits, still_err *err) {
    if (n < 1 || !ctxs || !tokens || !logits) return still_fail(err, STILL_E_ARG, "decode batch: no sequences");
    still_context *c0 = ctxs[0];
    const still_model *m = c0->m;
    const model_config *c = &m->cfg;
    if (n > c0->n_batch)
        return still_fail(err, STILL_E_ARG, "decode batch: %d sequences, more than the first context's batch (%d)", n,
                          c0->n_batch);
    for (int j = 0; j < n; j++) {
        if (ctxs[j]->m != m || ctxs[j]->gpu || ctxs[j]->observer)
            return still_fail(err, STILL_E_ARG, "decode batch: every context must be a CPU context of one model, "
                              "without an observer");
        for (int i = 0; i < j; i++)
            if (ctxs[i] == ctxs[j]) return still_fail(err, STILL_E_ARG, "decode batch: a context appears twice");
        if (ctxs[j]->n_past >= ctxs[j]->n_ctx)
            return still_fail(err, STILL_E_STATE, "context full: %d tokens + 1 new > context size %d", ctxs[j]->n_past,
                              ctxs[j]->n_ctx);
        if (tokens[j] < 0 || tokens[j] >= c->n_vocab)
            return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", tokens[j], c->n_vocab);
    }
    const int d = c->d_model, D = c->head_dim, H = c->n_head, Hk = c->n_head_kv, qd = H * D, kvd = Hk * D;
    const int ff = c->d_ff, V = c->n_vocab;
    float *x = c0->x, *h = c0->h, *q = c0->q, *k = c0->k, *v = c0->v, *att = c0->att;
    act_q8 *xs = calloc((size_t)n, sizeof *xs);
    float *gate_pre = malloc(sizeof(float) * (size_t)n * qd);
    int rc = xs && gate_pre ? STILL_OK : still_fail(err, STILL_E_NOMEM, "out of memory");
    for (int j = 0; j < n && !rc && c0->matvec_path; j++) rc = act_q8_init(&xs[j], c0->xq.n_max);
    if (rc) {
        if (!err || !err->msg[0]) still_fail(err, STILL_E_NOMEM, "out of memory");
        goto out;
    }
    for (int j = 0; j < n && !rc; j++) {
        const uint8_t *row = (const uint8_t *)m->tok_embd.data + (size_t)tokens[j] * m->tok_embd.row_bytes;
        rc = dequantize_row(m->tok_embd.type, row, x + (size_t)j * d, d, err);
    }
    for (int l = 0; l < c->n_layer && !rc; l++) {
        const layer_weights *L = &m->layers[l];
        const lora_set *lo = m->lora;
        float *lt = c0->lora_tmp;
        for (int j = 0; j < n; j++) rmsnorm(h + (size_t)j * d, x + (size_t)j * d, L->attn_norm, d, c->norm_eps);
        const weight_matrix *gq = c0->gate_q8 && c0->gate_q8[l].data && int8_takes(c0, &L->wq, 1) ? &c0->gate_q8[l] : NULL;
        {
            const weight_matrix *const Wqkv[4] = {&L->wq, &L->wk, &L->wv, gq};
            float *const Yqkv[4] = {q, k, v, gate_pre};
            batch_matmul(c0, Wqkv, Yqkv, gq ? 4 : 3, h, n, xs);
        }
        for (int j = 0; j < n; j++) {
            const float *hj = h + (size_t)j * d;
            float *qj = q + (size_t)j * qd, *kj = k + (size_t)j * kvd, *vj = v + (size_t)j * kvd;
            lora_apply(lo, l, LORA_Q, hj, qj, 1, lt);
            lora_apply(lo, l, LORA_K, hj, kj, 1, lt);
            lora_apply(lo, l, LORA_V, hj, vj, 1, lt);
            if (c0->q_nope) {
                memcpy(c0->q_nope + (size_t)j * qd, qj, sizeof(float) * (size_t)qd);
                memcpy(c0->k_nope + (size_t)j * kvd, kj, sizeof(float) * (size_t)kvd);
            }
            const int p = ctxs[j]->n_past;
            rope(qj, H, D, p, c0->rope_inv_freq);
            rope(kj, Hk, D, p, c0->rope_inv_freq);
            attn_io io = {.q = qj, .k = kj, .v = vj, .q_nope = c0->q_nope ? c0->q_nope + (size_t)j * qd : NULL,
                          .k_nope = c0->k_nope ? c0->k_nope + (size_t)j * kvd : NULL, .x = hj, .p0 = p, .T = 1,
                          .gate_pre = gq ? gate_pre + (size_t)j * qd : NULL};
            rc = attn_kind_get(ctxs[j]->attn[l]->cfg.kind)
                     ->forward(ctxs[j]->attn[l], m->attn_params[l], &io, att + (size_t)j * qd, err);
            if (rc) break;
        }
        if (rc) break;
        {
            const weight_matrix *Wo = &L->wo;
            batch_matmul(c0, &Wo, &h, 1, att, n, xs);
        }
        for (int j = 0; j < n; j++) lora_apply(lo, l, LORA_O, att + (size_t)j * qd, h + (size_t)j * d, 1, lt);
        for (size_t i = 0; i < (size_t)n * d; i++) x[i] += h[i];
        for (int j = 0; j < n; j++) rmsnorm(h + (size_t)j * d, x + (size_t)j * d, L->ffn_norm, d, c->norm_eps);
        {
            const weight_matrix *const Wgu[2] = {&L->w_gate, &L->w_up};
            float *const Ygu[2] = {c0->gate, c0->up};
            batch_matmul(c0, Wgu, Ygu, 2, h, n, xs);
        }
        for (int j = 0; j < n; j++) {
            lora_apply(lo, l, LORA_GATE, h + (size_t)j * d, c0->gate + (size_t)j * ff, 1, lt);
            lora_apply(lo, l, LORA_UP, h + (size_t)j * d, c0->up + (size_t)j * ff, 1, lt);
        }
        float *restrict gate = c0->gate;
        const float *restrict up = c0->up;
#pragma omp simd
        for (size_t i = 0; i < (size_t)n * ff; i++) gate[i] = vec_silu(gate[i]) * up[i];
        {
            const weight_matrix *Wd = &L->w_down;
            batch_matmul(c0, &Wd, &h, 1, c0->gate, n, xs);
        }
        for (int j = 0; j < n; j++) lora_apply(lo, l, LORA_DOWN, c0->gate + (size_t)j * ff, h + (size_t)j * d, 1, lt);
        for (size_t i = 0; i < (size_t)n * d; i++) x[i] += h[i];
    }
    if (!rc) {
        for (int j = 0; j < n; j++) rmsnorm(h + (size_t)j * d, x + (size_t)j * d, m->output_norm, d, c->norm_eps);
        const weight_matrix *Wout = &m->output;
        batch_matmul(c0, &Wout, &logits, 1, h, n, xs);
        for (int j = 0; j < n; j++) ctxs[j]->n_past++;
        (void)V;
    }
out:
    for (int j = 0; xs && j < n; j++) act_q8_free(&xs[j]);
    free(xs), free(gate_pre);
    return rc;
}

int still_decode(still_context *ctx, const int32_t *tokens, int n, float *logits, int all_logits, still_err *err) {
    if (n <= 0) return still_fail(err, STILL_E_ARG, "no tokens to decode");
    if (n > ctx->n_ctx - ctx->n_past)
        return still_fail(err, STILL_E_STATE, "context full: %d tokens + %d new > context size %d", ctx->n_past,
                          n, ctx->n_ctx);
    const int V = ctx->m->cfg.n_vocab;
    for (int i = 0; i < n; i += ctx->n_batch) {
        int T = n - i < ctx->n_batch ? n - i : ctx->n_batch;
        int last = i + T == n;
        float *out = NULL;
        if (logits && all_logits) out = logits + (size_t)i * V;
        else if (logits && last) out = logits;
        int rc;
        if (!ctx->gpu && T == 1 && !ctx->fixed_threads) {   /* a decode step: the governor picks the threads */
            const int n_max = omp_get_max_threads(), t = decode_threads_begin(&ctx->threads, n_max);
            const double t0 = omp_get_wtime();
            if (t != n_max) omp_set_num_threads(t);
            rc = forward_chunk(ctx, tokens + i, T, out, all_logits, err);
            if (t != n_max) omp_set_num_threads(n_max);
            decode_threads_end(&ctx->threads, omp_get_wtime() - t0);
        } else
            rc = ctx->gpu ? gpu_forward_chunk(ctx->gpu, tokens + i, T, ctx->n_past, out, all_logits, err)
                          : forward_chunk(ctx, tokens + i, T, out, all_logits, err);
        if (rc) return rc;
        if (ctx->gpu) ctx->n_past += T;
    }
    return STILL_OK;
}

/* ---- tokenizer wrappers --------------------------------------------------- */

int still_tokenize(const still_model *m, const char *text, size_t len, int parse_special, int32_t **ids,
                   size_t *n_ids, still_err *err) {
    return tokenizer_encode(m->tok, text, len, parse_special, ids, n_ids, err);
}

size_t still_token_to_piece(const still_model *m, int32_t id, char *buf, size_t cap) {
    return tokenizer_decode_token(m->tok, id, buf, cap);
}

int still_token_is_eog(const still_model *m, int32_t id) { return tokenizer_is_eog(m->tok, id); }

const char *still_model_default_system(const still_model *m) { return tokenizer_default_system(m->tok); }
