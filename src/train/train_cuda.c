/* Stage-1 training on the CUDA backend: see train_cuda.h. One device
 * allocation holds every trained layer's parameters, then the gradients, then
 * the two AdamW moments, each as one contiguous array of n_total floats (layer
 * l at offset off[l]), so clipping and AdamW are one kernel each. One still
 * state per trained layer (its own Sel, ring and linear state).
 *
 * The students run beside the teacher: every layer's student only needs
 * that layer's teacher activations, so the observer copies them (q, k, v,
 * the layer input, the teacher's outputs) into the layer's own buffers and
 * hands the layer's forward and backward to one of n_side extra contexts
 * (streams; layer l on side l % n_side, whose states share one workspace),
 * which waits for the copy. STILL_CUDA_TRAIN_STREAMS=0 runs them on the
 * teacher's stream in turn. The default is 4 (H200, 2M tokens with the
 * teacher's passes below: 212k tokens/s with 2, 229k with 3, 234k with 4,
 * 6 or 8; before the passes, one sequence at a time, 2 to 4 all gave
 * 180k).
 *
 * A step's sequences go through the teacher together, up to pass_seqs of
 * them in one pass (8,192 rows, STILL_CUDA_TRAIN_ROWS): the norms and GEMMs
 * run over all their rows at once (at 1,024 rows a GEMM was about a third
 * as fast per row), RoPE and the attention per sequence. The layer copies
 * hold a whole pass; the students run per sequence on their layer's side.
 * After each pass the teacher's stream waits for every side (the next pass
 * overwrites the copies). Recorded as one CUDA graph per step, the students
 * of different layers are parallel branches, and the host waits once a
 * step. */
#include "train/train_cuda.h"

#include "common/common.h"
#include "model/model.h"
#include "model/model_cuda.h"

#include <stdlib.h>
#include <string.h>

/* What the GPU trainer takes, one row per kind with parameters (the still kernels train them; lolcats is their
 * mode): STILL_OK when it trains layer l, else a one-line error. Kinds without a row and with parameters are
 * refused; layers without parameters (softmax, swa) pass through. */
static int stage1_check_still(const attn_config *a, int l, still_err *err) {
    if (a->feature_map != FMAP_NPMAP || a->head_dim != 64)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "training on the GPU: layer %d needs the NP-Map feature map and head dim 64 (got %s, %d)",
                          l, a->feature_map == FMAP_NPMAP ? "NP-Map" : "Hedgehog", a->head_dim);
    return STILL_OK;
}

static int stage1_check_lolcats(const attn_config *a, int l, still_err *err) {
    if (a->head_dim != 64 || a->feature_dim != a->head_dim)
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "training on the GPU: layer %d (lolcats) needs head dim 64 and feature dim = head dim "
                          "(got %d, %d)", l, a->head_dim, a->feature_dim);
    return STILL_OK;
}

static int stage1_check_gdn(const attn_config *a, int l, still_err *err) {
    if (a->head_dim != 64 && a->head_dim != 128)
        return still_fail(err, STILL_E_UNSUPPORTED, "training on the GPU: layer %d (gdn) needs head dim 64 or 128 (got %d)",
                          l, a->head_dim);
    return STILL_OK;
}

static int (*const STAGE1_GPU_KINDS[ATTN_KIND_COUNT])(const attn_config *, int, still_err *) = {
    [ATTN_STILL] = stage1_check_still,
    [ATTN_LOLCATS] = stage1_check_lolcats,
    [ATTN_GDN] = stage1_check_gdn,   /* its own state and kernels (stc_gdn_distill) */
};

/* Checked first, with or without a CUDA backend. */
static int check_plan(const still_model *m, const attn_config *student, still_err *err) {
    for (int l = 0; l < m->cfg.n_layer; l++) {
        const attn_kind *k = attn_kind_get(student[l].kind);
        if (!k->param_count(&student[l])) continue;
        int (*check)(const attn_config *, int, still_err *) = STAGE1_GPU_KINDS[student[l].kind];
        if (!check)
            return still_fail(err, STILL_E_UNSUPPORTED,
                              "training on the GPU: layer %d is '%s' (still, lolcats and gdn train on the GPU; use --device cpu)",
                              l, k->name);
        int rc = check(&student[l], l, err);
        if (rc) return rc;
        if (!m->attn_params[l])
            return still_fail(err, STILL_E_STATE, "training on the GPU: layer %d has no parameters", l);
    }
    return STILL_OK;
}

#ifndef STILL_HAVE_CUDA

int gpu_trainer_create(still_model *m, const attn_config *student, const attn_config *teacher, int seq,
                       int max_seqs, gpu_trainer **out, still_err *err) {
    (void)teacher, (void)seq, (void)max_seqs;
    *out = NULL;
    int rc = check_plan(m, student, err);
    if (rc) return rc;
    return still_fail(err, STILL_E_UNSUPPORTED,
                      "this build has no CUDA backend (build where nvcc is found, or configure with -DSTILL_CUDA=ON)");
}
void gpu_trainer_free(gpu_trainer *t) { (void)t; }
int gpu_trainer_zero_grad(gpu_trainer *t, still_err *err) {
    (void)t;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_trainer_step(gpu_trainer *t, const int32_t *const *seqs, int n, int with_grad, float scale, double *mse,
                     still_err *err) {
    (void)t, (void)seqs, (void)n, (void)with_grad, (void)scale, (void)mse;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_trainer_grad_sumsq(gpu_trainer *t, double *out, still_err *err) {
    (void)t, (void)out;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_trainer_adamw(gpu_trainer *t, float lr, double b1, double b2, double eps, float wd, float gscale, float c1,
                      float c2, still_err *err) {
    (void)t, (void)lr, (void)b1, (void)b2, (void)eps, (void)wd, (void)gscale, (void)c1, (void)c2;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_trainer_download(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err) {
    (void)t, (void)m1, (void)m2;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}
int gpu_trainer_upload_moments(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err) {
    (void)t, (void)m1, (void)m2;
    return still_fail(err, STILL_E_UNSUPPORTED, "this build has no CUDA backend");
}

#else

#include "still_cuda.h"

struct gpu_trainer {
    still_model *m;
    gpu_context *g;          /* the teacher */
    stc_ctx *dev;
    int L, seq, max_seqs;    /* layers, tokens per sequence, sequences per gpu_trainer_step */
    int pass_seqs;           /* sequences per teacher pass */
    int n_trained;
    size_t *off, *n;         /* per layer: offset into the arrays, parameter count (0: not trained) */
    int *slot;               /* per layer: its place among the trained layers (-1: not trained) */
    size_t n_total;
    void *arena;             /* params | grad | m1 | m2 (n_total floats each), mse [max_seqs][L] and Σ² (doubles) */
    float *params, *grad, *m1, *m2;
    double *mse_dev, *sumsq_dev;
    int32_t *tokens_dev;     /* [max_seqs][seq] */
    stc_still **st;          /* per trained still or lolcats layer */
    stc_gdn **gd;            /* per trained gdn layer */
    int n_side;              /* extra contexts the students run on (0: the teacher's) */
    stc_ctx **side;
    void *copies;            /* per trained layer: its teacher activations for a pass (layer_copy) */
    size_t copy_bytes;       /* per layer */
    stc_graph *graph;        /* a training step (with gradients) as a CUDA graph; NULL until recorded */
    int graph_seqs;          /* the sequences it holds */
    float graph_scale;       /* and the scale it was recorded with */
    int use_graph;           /* STILL_CUDA_GRAPHS=0 turns it off */
    int grad_ran;            /* a step with gradients has run (every workspace exists): recording is safe */
    /* the current step and pass */
    int with_grad, first;    /* first: the pass's first sequence in the step */
    float scale;
};

/* The context layer l's student runs on: the trained layers in turn over the sides (n_side is at
 * most the number of trained layers, so every side gets work: a side with none would leave the
 * teacher waiting on a stream outside a graph's recording, which CUDA refuses). */
static stc_ctx *student_ctx(const gpu_trainer *t, int l) {
    return t->n_side && t->slot[l] >= 0 ? t->side[t->slot[l] % t->n_side] : t->dev;
}

/* Layer l's copy of its teacher activations for T tokens (a pass), carved from
 * t->copies: q and the teacher's outputs [T][H·D], k and v [T][Hk·D], the
 * layer input in fp32 and bf16 [T][d]. */
typedef struct {
    float *q, *k, *v, *att, *x;
    stc_bf16 *xb;
} layer_copy;

static size_t carve(size_t *off, size_t bytes) {
    const size_t at = (*off + 255) & ~(size_t)255;
    *off = at + bytes;
    return at;
}

static size_t layer_copy_at(const model_config *c, int T, char *base, layer_copy *out) {
    const size_t qd = (size_t)T * c->n_head * c->head_dim, kvd = (size_t)T * c->n_head_kv * c->head_dim,
                 xd = (size_t)T * c->d_model;
    size_t off = 0;
    const size_t oq = carve(&off, qd * 4), ok = carve(&off, kvd * 4), ov = carve(&off, kvd * 4),
                 oa = carve(&off, qd * 4), ox = carve(&off, xd * 4), ob = carve(&off, xd * 2);
    if (out && base) {
        out->q = (float *)(base + oq), out->k = (float *)(base + ok), out->v = (float *)(base + ov);
        out->att = (float *)(base + oa), out->x = (float *)(base + ox), out->xb = (stc_bf16 *)(base + ob);
    }
    return (off + 255) & ~(size_t)255;
}

void gpu_trainer_free(gpu_trainer *t) {
    if (!t) return;
    if (t->dev && t->st) {
        /* per context: layers sharing its first state's workspace first, the owner last */
        for (int c = 0; c < (t->n_side ? t->n_side : 1); c++) {
            int owner = -1;
            for (int l = 0; l < t->L; l++)
                if (t->st[l] && (!t->n_side || t->slot[l] % t->n_side == c)) {
                    if (owner < 0) owner = l;
                    else stc_still_free(t->st[l]);
                }
            if (owner >= 0) stc_still_free(t->st[owner]);
        }
    }
    for (int l = 0; t->gd && l < t->L; l++) stc_gdn_free(t->gd[l]);
    stc_graph_free(t->graph);
    if (t->dev) stc_free(t->dev, t->arena), stc_free(t->dev, t->copies), stc_free(t->dev, t->tokens_dev);
    for (int c = 0; t->side && c < t->n_side; c++) stc_ctx_free(t->side[c]);
    gpu_context_free(t->g);   /* frees the device context last */
    free(t->side), free(t->st), free(t->gd), free(t->off), free(t->n), free(t->slot);
    free(t);
}

int gpu_trainer_create(still_model *m, const attn_config *student, const attn_config *teacher, int seq,
                       int max_seqs, gpu_trainer **out, still_err *err) {
    *out = NULL;
    if (max_seqs < 1 || seq < 1)
        return still_fail(err, STILL_E_ARG, "training on the GPU: %d sequences of %d tokens a step", max_seqs, seq);
    const int L = m->cfg.n_layer;
    gpu_trainer *t = calloc(1, sizeof *t);
    if (!t) return still_fail(err, STILL_E_NOMEM, "out of memory");
    t->m = m, t->L = L, t->seq = seq, t->max_seqs = max_seqs;
    const char *env = getenv("STILL_CUDA_GRAPHS");
    t->use_graph = !(env && !strcmp(env, "0"));
    t->off = calloc((size_t)L, sizeof(size_t));
    t->n = calloc((size_t)L, sizeof(size_t));
    t->slot = calloc((size_t)L, sizeof(int));
    t->st = calloc((size_t)L, sizeof(stc_still *));
    t->gd = calloc((size_t)L, sizeof(stc_gdn *));
    env = getenv("STILL_CUDA_TRAIN_STREAMS");
    t->n_side = env ? atoi(env) : 4;
    if (t->n_side < 0) t->n_side = 0;
    if (t->n_side > L) t->n_side = L;
    env = getenv("STILL_CUDA_TRAIN_ROWS");
    long rows = env && atol(env) > 0 ? atol(env) : 8192;
    if (rows > (1L << 22)) rows = 1L << 22;   /* keeps pass_seqs · seq in an int */
    t->pass_seqs = rows / seq < 1 ? 1 : rows / seq > max_seqs ? max_seqs : (int)(rows / seq);
    t->side = calloc((size_t)(t->n_side ? t->n_side : 1), sizeof(stc_ctx *));
    int rc = STILL_OK;
    if (!t->off || !t->n || !t->slot || !t->st || !t->gd || !t->side) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto fail;
    }
    /* which layers train (still and lolcats: check_plan) */
    if ((rc = check_plan(m, student, err))) goto fail;
    for (int l = 0; l < L; l++) {
        const size_t np = attn_kind_get(student[l].kind)->param_count(&student[l]);
        t->slot[l] = -1;
        if (np) t->off[l] = t->n_total, t->n[l] = np, t->n_total += (np + 63) / 64 * 64, t->slot[l] = t->n_trained++;
    }
    if (t->n_side > t->n_trained) t->n_side = t->n_trained;   /* no side without a student */
    {
        attn_config *plan = m->attn_cfg;
        m->attn_cfg = (attn_config *)teacher;
        rc = gpu_context_create(m, t->pass_seqs * seq, t->pass_seqs * seq, STILL_SEL_F16, &t->g, err);
        m->attn_cfg = plan;
        if (rc) goto fail;
    }
    t->dev = gpu_context_device(t->g);
    {
        const size_t bytes = 4 * t->n_total * sizeof(float) + ((size_t)max_seqs * L + 1) * sizeof(double);
        if ((rc = stc_malloc(t->dev, bytes, "training parameters, gradients and AdamW moments", &t->arena, err)))
            goto fail;
        t->params = t->arena, t->grad = t->params + t->n_total, t->m1 = t->grad + t->n_total,
        t->m2 = t->m1 + t->n_total;
        t->mse_dev = (double *)(t->m2 + t->n_total), t->sumsq_dev = t->mse_dev + (size_t)max_seqs * L;
        if ((rc = stc_memset(t->dev, t->arena, 0, bytes, err))) goto fail;
    }
    if ((rc = stc_malloc(t->dev, sizeof(int32_t) * (size_t)max_seqs * seq, "training token ids", (void **)&t->tokens_dev,
                         err)))
        goto fail;
    if (t->n_side && t->n_trained) {   /* the students' contexts and the teacher activations' copies */
        for (int c = 0; c < t->n_side && !rc; c++) rc = stc_ctx_create(stc_ctx_device(t->dev), &t->side[c], err);
        t->copy_bytes = layer_copy_at(&m->cfg, t->pass_seqs * seq, NULL, NULL);
        if (!rc)
            rc = stc_malloc(t->dev, t->copy_bytes * (size_t)t->n_trained, "training: the teacher's activations per layer",
                            &t->copies, err);
        if (rc) goto fail;
    }
    for (int l = 0; l < L && !rc; l++) {
        if (!t->n[l]) continue;
        if (student[l].kind == ATTN_GDN) {   /* a state of its own; its workspace grows on the first sequence */
            const attn_config *a = &student[l];
            rc = stc_gdn_create(student_ctx(t, l), a->n_head, a->n_head_kv, a->head_dim, a->d_model, a->norm,
                                a->conv, &t->gd[l], err);
            if (!rc)
                rc = stc_memcpy_h2d(t->dev, t->params + t->off[l], m->attn_params[l], t->n[l] * sizeof(float), err);
            continue;
        }
        stc_still_config sc;
        gpu_still_config(&student[l], seq, &sc);
        rc = stc_still_create(student_ctx(t, l), &sc, &t->st[l], err);
        if (!rc) rc = stc_memcpy_h2d(t->dev, t->params + t->off[l], m->attn_params[l], t->n[l] * sizeof(float), err);
        for (int o = 0; o < l && !rc; o++)   /* the first still state on the same context owns the workspace */
            if (t->st[o] && student_ctx(t, o) == student_ctx(t, l)) {
                rc = stc_still_share_workspace(t->st[l], t->st[o], err);
                break;
            }
    }
    if (rc) goto fail;
    *out = t;
    return STILL_OK;
fail:
    gpu_trainer_free(t);
    return rc;
}

int gpu_trainer_zero_grad(gpu_trainer *t, still_err *err) {
    return stc_memset(t->dev, t->grad, 0, t->n_total * sizeof(float), err);
}

/* The teacher's stream waits for every student (after the last sequence). */
static int join_students(gpu_trainer *t, still_err *err) {
    int rc = STILL_OK;
    for (int c = 0; c < t->n_side; c++) {   /* every side, even after a failure (the first error is kept) */
        still_err e = {0};
        const int rc_c = stc_ctx_wait(t->dev, t->side[c], &e);
        if (rc_c && !rc) {
            rc = rc_c;
            if (err) *err = e;
        }
    }
    return rc;
}

static int observe(void *data, int layer, int T, const float *x_f32, const void *x_bf16, const float *q,
                   const float *k, const float *v, const float *att, still_err *err) {
    gpu_trainer *t = data;
    if (!t->st[layer] && !t->gd[layer]) return STILL_OK;
    const model_config *c = &t->m->cfg;
    const size_t qd = (size_t)c->n_head * c->head_dim, kvd = (size_t)c->n_head_kv * c->head_dim, d = (size_t)c->d_model;
    const size_t o = t->off[layer];
    stc_ctx *ctx = student_ctx(t, layer);
    int rc = STILL_OK;
    if (t->n_side) {   /* copies the teacher's next layer cannot overwrite, then the students on their side */
        const size_t rows = (size_t)T;
        layer_copy lc;
        layer_copy_at(c, t->pass_seqs * t->seq, (char *)t->copies + t->copy_bytes * (size_t)t->slot[layer], &lc);
        rc = stc_memcpy_d2d(t->dev, lc.q, q, rows * qd * 4, err);
        if (!rc) rc = stc_memcpy_d2d(t->dev, lc.k, k, rows * kvd * 4, err);
        if (!rc) rc = stc_memcpy_d2d(t->dev, lc.v, v, rows * kvd * 4, err);
        if (!rc) rc = stc_memcpy_d2d(t->dev, lc.att, att, rows * qd * 4, err);
        if (!rc) rc = stc_memcpy_d2d(t->dev, lc.x, x_f32, rows * d * 4, err);
        if (!rc) rc = stc_memcpy_d2d(t->dev, lc.xb, x_bf16, rows * d * 2, err);
        if (!rc) rc = stc_ctx_wait(ctx, t->dev, err);
        q = lc.q, k = lc.k, v = lc.v, att = lc.att, x_f32 = lc.x, x_bf16 = lc.xb;
    }
    for (int i = 0; i * t->seq < T && !rc; i++) {   /* sequence first + i of the step */
        const size_t r = (size_t)i * t->seq;
        if (t->gd[layer]) {   /* q and k arrive rotated (each sequence from position 0): gdn reads them before RoPE */
            rc = stc_gdn_distill(ctx, t->gd[layer], t->params + o, q + r * qd, k + r * kvd, v + r * kvd, x_f32 + r * d,
                                 t->seq, c->rope_theta, att + r * qd, t->scale, t->with_grad ? t->grad + o : NULL,
                                 t->mse_dev + (size_t)(t->first + i) * t->L + layer, err);
            continue;
        }
        rc = stc_still_distill(ctx, t->st[layer], t->params + o, q + r * qd, k + r * kvd, v + r * kvd,
                               (const stc_bf16 *)x_bf16 + r * d, x_f32 + r * d, t->seq, att + r * qd, t->scale,
                               t->with_grad ? t->grad + o : NULL, t->mse_dev + (size_t)(t->first + i) * t->L + layer,
                               err);
    }
    return rc;
}

/* Every sequence of the step through the teacher in passes, the students
 * beside it; after each pass the teacher's stream waits for the students
 * (also after a failure, so that nothing still runs when the caller reuses
 * the buffers). */
static int enqueue_step(gpu_trainer *t, int n, still_err *err) {
    int rc = STILL_OK;
    for (int i = 0; i < n && !rc; i += t->pass_seqs) {
        const int np = n - i < t->pass_seqs ? n - i : t->pass_seqs;
        t->first = i;
        rc = gpu_observed_enqueue(t->g, t->tokens_dev + (size_t)i * t->seq, np * t->seq, t->seq, observe, t, err);
        still_err join_err = {0};
        const int rc_join = join_students(t, &join_err);
        if (!rc && rc_join) {
            rc = rc_join;
            if (err) *err = join_err;
        }
    }
    return rc;
}

int gpu_trainer_step(gpu_trainer *t, const int32_t *const *seqs, int n, int with_grad, float scale, double *mse,
                     still_err *err) {
    if (n < 1 || n > t->max_seqs)
        return still_fail(err, STILL_E_ARG, "training on the GPU: %d sequences in a step (1 .. %d)", n, t->max_seqs);
    const int V = t->m->cfg.n_vocab;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < t->seq; j++)
            if (seqs[i][j] < 0 || seqs[i][j] >= V)
                return still_fail(err, STILL_E_ARG, "token id %d out of range (vocab %d)", seqs[i][j], V);
    int rc = STILL_OK;
    for (int i = 0; i < n && !rc; i++)
        rc = stc_memcpy_h2d(t->dev, t->tokens_dev + (size_t)i * t->seq, seqs[i], sizeof(int32_t) * (size_t)t->seq, err);
    if (!rc) rc = stc_memset(t->dev, t->mse_dev, 0, sizeof(double) * (size_t)n * t->L, err);
    if (rc) return rc;
    /* training steps replay one CUDA graph: their work differs only in the tokens (the same sequence
     * count and scale at every step); validation (no gradients) runs launch by launch */
    if (with_grad && t->graph && (t->graph_seqs != n || t->graph_scale != scale)) {
        stc_graph_free(t->graph);
        t->graph = NULL;
    }
    t->with_grad = with_grad, t->scale = scale;
    if (with_grad && t->graph) {
        rc = stc_graph_launch(t->dev, t->graph, err);
    } else if (with_grad && t->use_graph && t->grad_ran) {   /* record after a plain run allocated the workspaces */
        if ((rc = stc_graph_begin(t->dev, err))) return rc;
        rc = enqueue_step(t, n, err);
        still_err end_err = {0};
        const int rc_end = stc_graph_end(t->dev, rc == 0, &t->graph, &end_err);
        if (!rc && rc_end) {
            if (err) *err = end_err;
            rc = rc_end;
        }
        if (!rc) t->graph_seqs = n, t->graph_scale = scale, rc = stc_graph_launch(t->dev, t->graph, err);
    } else {
        rc = enqueue_step(t, n, err);
    }
    if (rc) {   /* drain what was enqueued before the failure, on every stream */
        still_err ignored = {0};
        (void)stc_ctx_sync(t->dev, &ignored);
        for (int c = 0; c < t->n_side; c++) (void)stc_ctx_sync(t->side[c], &ignored);
        return rc;
    }
    if ((rc = stc_ctx_sync(t->dev, err))) return rc;
    if (with_grad) t->grad_ran = 1;
    return stc_memcpy_d2h(t->dev, mse, t->mse_dev, sizeof(double) * (size_t)n * t->L, err);
}

int gpu_trainer_grad_sumsq(gpu_trainer *t, double *out, still_err *err) {
    int rc = stc_sumsq(t->dev, t->grad, (int64_t)t->n_total, t->sumsq_dev, err);
    if (!rc) rc = stc_memcpy_d2h(t->dev, out, t->sumsq_dev, sizeof(double), err);
    return rc;
}

int gpu_trainer_adamw(gpu_trainer *t, float lr, double b1, double b2, double eps, float wd, float gscale, float c1,
                      float c2, still_err *err) {
    return stc_adamw(t->dev, t->params, t->grad, t->m1, t->m2, (int64_t)t->n_total, lr, b1, b2, eps, wd, gscale, c1, c2,
                     err);
}

int gpu_trainer_download(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err) {
    int rc = STILL_OK;
    for (int l = 0; l < t->L && !rc; l++) {
        if (!t->n[l]) continue;
        const size_t o = t->off[l], b = t->n[l] * sizeof(float);
        rc = stc_memcpy_d2h(t->dev, t->m->attn_params[l], t->params + o, b, err);
        if (!rc && m1) rc = stc_memcpy_d2h(t->dev, m1[l], t->m1 + o, b, err);
        if (!rc && m2) rc = stc_memcpy_d2h(t->dev, m2[l], t->m2 + o, b, err);
    }
    return rc;
}

int gpu_trainer_upload_moments(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err) {
    int rc = STILL_OK;
    for (int l = 0; l < t->L && !rc; l++) {
        if (!t->n[l]) continue;
        const size_t o = t->off[l], b = t->n[l] * sizeof(float);
        rc = stc_memcpy_h2d(t->dev, t->m1 + o, m1[l], b, err);
        if (!rc) rc = stc_memcpy_h2d(t->dev, t->m2 + o, m2[l], b, err);
    }
    return rc;
}

#endif
