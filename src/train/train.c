/* Stage-1 training (attention transfer, spec: ../shared/spec/attention.md,
 * "Stage 1"): the model runs its own softmax attention as the teacher; at
 * every layer the observer hands the student kind the same x, q, k, v and the
 * teacher's per-head outputs, and the layer's loss and gradient are computed
 * right there (attn_distill), so nothing of a layer is kept once the next
 * one runs. Layers are independent (teacher forcing), but share one optimizer
 * step: loss = 1000 · mean over trained layers of MSE, averaged over the
 * batch's sequences; AdamW; the gradient norm clipped over all layers
 * together; learning rate warmed up linearly, then a cosine down to lr_min.
 *
 * Data (train_data.c): the files are tokenized one after the other, cut into
 * sequences of seq tokens (the tail shorter than seq is dropped), and the
 * sequences shuffled with the seed; the first val sequences are held out.
 * Training reads the rest in a fresh seeded permutation per epoch, so the
 * sequence of step s is a function of (seed, s) alone, and a resumed run sees
 * the same data as an uninterrupted one.
 *
 * Checkpoint: the adapter GGUF plus still.train.* metadata (step, a
 * fingerprint of every setting that changes the result) and the AdamW
 * moments as blk.N.attn_hybrid.adam_m / adam_v. It loads as an adapter too. */
#include "kinds/attn.h"
#include "kinds/attn_common.h"
#include "common/common.h"
#include "format/gguf.h"
#include "model/model.h"
#include "format/quant.h"
#include "train/train_cuda.h"
#include "train/train_common.h"
#include "train/train_data.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

still_train_params still_train_default_params(void) {
    still_train_params p = {
        .tokens = 1 << 20, .seq = 1024, .batch = 8, .lr = 1e-2f, .lr_min = -1, .warmup = -1, .weight_decay = 0,
        .clip = 1.0f, .val_frac = 0.02f, .val_max = 32, .seed = 0, .ckpt_every = 10,
    };
    return p;
}

void still_train_result_free(still_train_result *r) {
    if (!r) return;
    free(r->val_mse_before), free(r->val_mse_after);
    r->val_mse_before = r->val_mse_after = NULL;
}


/* ---- the per-layer step, run from the teacher's observer ------------------------- */

typedef struct {
    still_model *m;
    gpu_trainer *gpu;         /* training on the GPU (the teacher runs there; no observer) */
    const attn_config *cfg;   /* student configurations, n_ctx = seq */
    float **grad;             /* per layer, NULL: layer not trained */
    double *mse;              /* per layer, this sequence (GPU steps: [batch][layer]) */
    float scale;              /* ∂loss/∂mse of one layer of one sequence */
    int with_grad;
    int rc;
    still_err err;
    float *nope;              /* kinds that read q and k before RoPE (gdn): [seq][H*D + Hk*D], else NULL */
} step_ctx;

/* q and k before RoPE from the teacher's rotated ones (the observer sees them after RoPE): each pair turned
 * back by its angle, as model.c turned it (the same cosines and sines; equal to the unrotated values within
 * float rounding). */
static void unrope(const model_config *c, const float *in, int n_heads, int p0, int T, float *out) {
    const int D = c->head_dim, w = n_heads * D;
    for (int i = 0; i < D / 2; i++) {
        const float inv_freq = (float)pow((double)c->rope_theta, -2.0 * i / D);   /* once per pair, not per token */
        for (int t = 0; t < T; t++) {
            const float ang = (float)(p0 + t) * inv_freq;
            const float cs = cosf(ang), sn = sinf(ang);
            for (int h = 0; h < n_heads; h++) {
                const float *src = in + (size_t)t * w + (size_t)h * D + 2 * i;
                float *dst = out + (size_t)t * w + (size_t)h * D + 2 * i;
                dst[0] = src[0] * cs + src[1] * sn;
                dst[1] = src[1] * cs - src[0] * sn;
            }
        }
    }
}

static void observe_layer(void *data, int layer, int p0, int T, const float *x, const float *q, const float *k,
                          const float *v, const float *out) {
    step_ctx *s = data;
    if (s->rc || !s->grad[layer]) return;
    const attn_config *c = &s->cfg[layer];
    attn_io io = {.q = q, .k = k, .v = v, .x = x, .p0 = p0, .T = T};
    const attn_kind *kind = attn_kind_get(c->kind);
    if (kind->needs_nope) {
        const model_config *mc = &s->m->cfg;
        const size_t qd = (size_t)mc->n_head * mc->head_dim;
        float *qn = s->nope, *kn = s->nope + (size_t)T * qd;
        unrope(mc, q, mc->n_head, p0, T, qn);
        unrope(mc, k, mc->n_head_kv, p0, T, kn);
        io.q_nope = qn, io.k_nope = kn;
    }
    s->rc = attn_distill(attn_kind_get(c->kind), c, s->m->attn_params[layer], &io, out, s->scale,
                         s->with_grad ? s->grad[layer] : NULL, &s->mse[layer], &s->err);
}

/* One sequence through the teacher, every trained layer's loss (and, with
 * sc->with_grad, gradient) on the way. */
static int run_seq(still_context *ctx, step_ctx *sc, const int32_t *tok, int seq, still_err *err) {
    if (sc->gpu) return gpu_trainer_step(sc->gpu, &tok, 1, sc->with_grad, sc->scale, sc->mse, err);
    int rc = still_context_truncate(ctx, 0, err);
    if (!rc) rc = still_decode(ctx, tok, seq, NULL, 0, err);
    if (!rc && sc->rc) rc = sc->rc, *err = sc->err;
    return rc;
}

/* ---- checkpoints ------------------------------------------------------------------ */

typedef struct {
    int n_layer;
    size_t *n;          /* parameters per layer (0: not trained) */
    float **grad, **m1, **m2;
} opt_state;

/* A per-layer metadata array of float32 (NaN for layers not trained). */
static int set_f32_array(gguf_writer *w, const char *key, const double *x, int n, still_err *err) {
    gguf_value *items = calloc((size_t)n, sizeof(gguf_value));
    if (!items) return still_fail(err, STILL_E_NOMEM, "out of memory");
    gguf_value arr = {.type = GGUF_TYPE_ARRAY};
    arr.v.arr.elem_type = GGUF_TYPE_FLOAT32, arr.v.arr.n = (uint64_t)n, arr.v.arr.items = items;
    for (int i = 0; i < n; i++) items[i] = (gguf_value){.type = GGUF_TYPE_FLOAT32, .v.f64 = x[i]};
    int rc = gguf_writer_set(w, key, &arr, err);
    free(items);
    return rc;
}

static int ckpt_write(const still_model *m, const opt_state *o, const char *path, int step, uint64_t fp,
                      const double *val_before, still_err *err) {
    gguf_writer *w;
    int rc = adapter_writer(m, &w, err);
    if (rc) return rc;
    char hex[32];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fp);
    rc = gguf_writer_set_u32(w, "still.train.step", (uint32_t)step, err);
    if (!rc) rc = gguf_writer_set_str(w, "still.train.fingerprint", hex, err);
    if (!rc) rc = set_f32_array(w, "still.train.val_mse_before", val_before, o->n_layer, err);
    for (int l = 0; !rc && l < o->n_layer; l++) {
        if (!o->n[l]) continue;
        char name[64];
        int64_t ne[1] = {(int64_t)o->n[l]};
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.adam_m", l);
        rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, o->m1[l], o->n[l] * sizeof(float), err);
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.adam_v", l);
        if (!rc) rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, o->m2[l], o->n[l] * sizeof(float), err);
    }
    if (!rc) rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}

static int ckpt_read(still_model *m, opt_state *o, const char *path, uint64_t fp, int *step, double *val_before,
                     still_err *err) {
    if (access(path, F_OK)) return still_fail(err, STILL_E_IO, "--resume: no checkpoint '%s'", path);
    gguf_file *f;
    int rc = gguf_open(path, &f, err);
    if (rc) return rc;
    gguf_str s;
    char hex[32];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fp);
    uint32_t st = 0;
    rc = gguf_get_u32(f, "still.train.step", &st, err);
    if (!rc) rc = gguf_get_str(f, "still.train.fingerprint", &s, err);
    if (!rc && (s.len != strlen(hex) || memcmp(s.ptr, hex, s.len)))
        rc = still_fail(err, STILL_E_ARG,
                        "checkpoint '%s' was made with different settings, model or data (fingerprint %.*s, now %s)",
                        path, (int)(s.len < 20 ? s.len : 20), s.ptr, hex);
    if (!rc) rc = adapter_apply(m, f, err);
    const gguf_value *vb;
    uint64_t nvb;
    if (!rc && !gguf_get_arr(f, "still.train.val_mse_before", GGUF_TYPE_FLOAT32, &vb, &nvb, NULL) &&
        nvb == (uint64_t)o->n_layer)
        for (int l = 0; l < o->n_layer; l++) val_before[l] = vb[l].v.f64;
    for (int l = 0; !rc && l < o->n_layer; l++) {
        if (!o->n[l]) continue;
        for (int which = 0; which < 2 && !rc; which++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.attn_hybrid.adam_%c", l, which ? 'v' : 'm');
            const gguf_tensor *t = gguf_find_tensor(f, name);
            if (!t || t->type != TT_F32 || (size_t)t->ne[0] != o->n[l])
                rc = still_fail(err, STILL_E_FORMAT, "checkpoint '%s': tensor %s missing or of the wrong shape", path,
                                name);
            else {
                float *dst = which ? o->m2[l] : o->m1[l];
                memcpy(dst, t->data, o->n[l] * sizeof(float));
                for (size_t j = 0; !rc && j < o->n[l]; j++)   /* a damaged moment: refused, not blamed on the lr later */
                    if (!isfinite(dst[j]) || (which && dst[j] < 0))
                        rc = still_fail(err, STILL_E_FORMAT, "checkpoint '%s': %s[%zu] = %g is not a valid AdamW moment",
                                        path, name, j, dst[j]);
            }
        }
    }
    gguf_close(f);
    if (!rc) *step = (int)st;
    return rc;
}

/* ---- the trainer ------------------------------------------------------------------ */


/* Per-layer mean MSE over the validation sequences (no gradients). */
static int validate(still_context *ctx, step_ctx *sc, train_data *d, double *out, const char *phase,
                    const still_train_params *p, still_train_progress *pr, double t0, still_err *err) {
    const int L = sc->m->cfg.n_layer;
    double *sum = calloc((size_t)L, sizeof(double));
    if (!sum) return still_fail(err, STILL_E_NOMEM, "out of memory");
    sc->with_grad = 0;
    int rc = STILL_OK;
    for (int i = 0; i < d->n_val && !rc; i++) {
        if ((rc = run_seq(ctx, sc, train_data_seq(d, d->val[i], NULL, NULL), d->seq, err))) break;
        double loss = 0;
        int nt = 0;
        for (int l = 0; l < L; l++)
            if (sc->grad[l]) sum[l] += sc->mse[l], loss += sum[l] / (i + 1), nt++;
        if (p->progress) {
            pr->phase = phase, pr->done = i + 1, pr->total = d->n_val;
            pr->loss = nt ? 1000.0 * loss / nt : 0;
            pr->elapsed_s = train_now() - t0;
            p->progress(p->progress_data, pr);
        }
    }
    for (int l = 0; l < L; l++) out[l] = sc->grad[l] && d->n_val ? sum[l] / d->n_val : NAN;
    free(sum);
    return rc;
}

int still_train(still_model *m, const still_train_params *p, still_train_result *res, still_err *err) {
    memset(res, 0, sizeof *res);
    const int L = m->cfg.n_layer;
    int rc0 = train_check_params(p, err);
    if (rc0) return rc0;
    if (m->lora && p->device == STILL_DEVICE_CUDA)
        return still_fail(err, STILL_E_UNSUPPORTED, "stage 1 on the GPU with a LoRA in the model is not supported (its teacher "
                                                    "would run without it); use --device cpu");
    still_train_params P = *p;
    train_schedule sch;
    if ((rc0 = train_schedule_init(&P, &sch, err))) return rc0;
    const int n_steps = sch.n_steps;

    /* Which layers train, with what. */
    opt_state o = {.n_layer = L};
    o.n = calloc((size_t)L, sizeof(size_t));
    o.grad = calloc((size_t)L, sizeof(float *));
    o.m1 = calloc((size_t)L, sizeof(float *));
    o.m2 = calloc((size_t)L, sizeof(float *));
    attn_config *cfg = calloc((size_t)L, sizeof *cfg), *teacher = calloc((size_t)L, sizeof *teacher);
    /* per layer; on the GPU a step's sequences run as one batch, [batch][layer] */
    double *mse = calloc((size_t)L * (size_t)P.batch, sizeof(double));
    const int32_t **seqs = calloc((size_t)P.batch, sizeof *seqs);
    res->val_mse_before = calloc((size_t)L, sizeof(double));
    res->val_mse_after = calloc((size_t)L, sizeof(double));
    res->n_layer = L;
    train_data d = {0};
    still_context *ctx = NULL;
    gpu_trainer *gpu = NULL;
    float *nope = NULL;   /* q and k before RoPE for a student kind that reads them (observe_layer) */
    int rc = STILL_OK, n_trained = 0;
    if (!o.n || !o.grad || !o.m1 || !o.m2 || !cfg || !teacher || !mse || !seqs || !res->val_mse_before ||
        !res->val_mse_after) {
        rc = still_fail(err, STILL_E_NOMEM, "out of memory");
        goto done;
    }
    for (int l = 0; l < L; l++) {
        const attn_kind *k = attn_kind_get(m->attn_cfg[l].kind);
        cfg[l] = m->attn_cfg[l];
        cfg[l].n_ctx = P.seq;
        teacher[l] = m->attn_cfg[l];
        teacher[l].kind = ATTN_SOFTMAX;
        o.n[l] = k->param_count(&cfg[l]);
        if (!o.n[l]) continue;
        if (!k->backward) {
            rc = still_fail(err, STILL_E_UNSUPPORTED, "attention kind '%s' cannot be trained yet", k->name);
            goto done;
        }
        o.grad[l] = calloc(o.n[l], sizeof(float));
        o.m1[l] = calloc(o.n[l], sizeof(float));
        o.m2[l] = calloc(o.n[l], sizeof(float));
        if (!o.grad[l] || !o.m1[l] || !o.m2[l]) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory for layer %d's optimizer state", l);
            goto done;
        }
        n_trained++;
    }
    if (!n_trained) {
        rc = still_fail(err, STILL_E_ARG, "the attention plan has nothing to train (kind '%s' has no stage-1 parameters)",
                        attn_kind_get(m->attn_cfg[0].kind)->name);
        goto done;
    }

    still_train_progress pr = {.n_steps = n_steps};
    const double t0 = train_now();
    if (P.progress) pr.phase = "data", P.progress(P.progress_data, &pr);
    {
        const train_data_params dp = {.files = P.data_files, .n_files = P.n_data_files, .seq = P.seq,
                                      .val_frac = P.val_frac, .val_max = P.val_max, .seed = P.seed};
        if ((rc = train_data_load(m, &dp, &d, err))) goto done;
        res->n_tokens_data = d.n_tokens;
    }
    res->n_train_seqs = d.n_train, res->n_val_seqs = d.n_val, res->n_steps = n_steps;
    const uint64_t fp = train_fingerprint(m, &P, &d);

    int step = 0;
    for (int l = 0; l < L; l++) res->val_mse_before[l] = NAN;
    if (P.resume) {
        if ((rc = ckpt_read(m, &o, P.ckpt_path, fp, &step, res->val_mse_before, err))) goto done;
        if (step > n_steps) step = n_steps;
        res->start_step = step;
    }

    /* The teacher: this model with softmax everywhere (contexts take their
     * kinds from the plan; the student's parameters stay in the plan). */
    if (P.device == STILL_DEVICE_CUDA) {
        if ((rc = gpu_trainer_create(m, cfg, teacher, P.seq, P.batch, &gpu, err))) goto done;
        if (step > 0 && (rc = gpu_trainer_upload_moments(gpu, o.m1, o.m2, err))) goto done;
    } else {
        attn_config *student = m->attn_cfg;
        m->attn_cfg = teacher;
        rc = still_context_create(m, (still_context_params){.n_ctx = P.seq, .n_batch = P.seq}, &ctx, err);
        m->attn_cfg = student;
        if (rc) goto done;
    }
    for (int l = 0; l < L && !gpu && !nope; l++)
        if (attn_kind_get(cfg[l].kind)->needs_nope &&
            !(nope = malloc(sizeof(float) * (size_t)P.seq * (size_t)(m->cfg.n_head + m->cfg.n_head_kv) * m->cfg.head_dim))) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory for the student's inputs before RoPE");
            goto done;
        }
    step_ctx sc = {.m = m, .gpu = gpu, .cfg = cfg, .grad = o.grad, .mse = mse, .nope = nope};
    if (ctx) still_context_set_observer(ctx, observe_layer, &sc);

    if (step == 0 && (rc = validate(ctx, &sc, &d, res->val_mse_before, "val-before", &P, &pr, t0, err))) goto done;

    const double t_train = train_now();
    const int step0 = step;
    double loss = 0;
    for (; step < n_steps; step++) {
        if (sc.gpu) rc = gpu_trainer_zero_grad(sc.gpu, err);
        else
            for (int l = 0; l < L; l++)
                if (o.grad[l]) memset(o.grad[l], 0, o.n[l] * sizeof(float));
        sc.with_grad = 1;
        sc.scale = 1000.0f / (float)(n_trained * P.batch);
        loss = 0;
        if (sc.gpu) {   /* the step's sequences in one call (they overlap on the device) */
            for (int b = 0; b < P.batch; b++)
                seqs[b] = train_data_seq(&d, train_data_train_index(&d, (long long)step * P.batch + b), NULL, NULL);
            rc = gpu_trainer_step(sc.gpu, seqs, P.batch, 1, sc.scale, mse, err);
            for (int b = 0; b < P.batch && !rc; b++)
                for (int l = 0; l < L; l++)
                    if (o.grad[l]) loss += 1000.0 * mse[(size_t)b * L + l] / (n_trained * P.batch);
        } else
            for (int b = 0; b < P.batch && !rc; b++) {
                rc = run_seq(ctx, &sc, train_data_seq(&d, train_data_train_index(&d, (long long)step * P.batch + b), NULL, NULL),
                             P.seq, err);
                for (int l = 0; l < L; l++)
                    if (o.grad[l]) loss += 1000.0 * mse[l] / (n_trained * P.batch);
            }
        if (rc) goto done;
        /* global gradient norm, clip, AdamW */
        double g2 = 0;
        if (sc.gpu) {
            if ((rc = gpu_trainer_grad_sumsq(sc.gpu, &g2, err))) goto done;
        } else
            for (int l = 0; l < L; l++)
                for (size_t i = 0; i < o.n[l]; i++) g2 += (double)o.grad[l][i] * o.grad[l][i];
        const double gn = sqrt(g2);
        if (!isfinite(gn) || !isfinite(loss)) {
            rc = still_fail(err, STILL_E_STATE, "training diverged at step %d (loss %g, gradient norm %g); try a lower --lr",
                            step + 1, loss, gn);
            goto done;
        }
        const float gscale = P.clip > 0 && gn > P.clip ? (float)(P.clip / gn) : 1.0f;
        const double lr = train_lr_at(&P, &sch, step);
        const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
        const double bc1 = 1 - pow(b1, step + 1), bc2 = 1 - pow(b2, step + 1);
        if (sc.gpu && (rc = gpu_trainer_adamw(sc.gpu, (float)lr, b1, b2, eps, P.weight_decay, gscale, (float)(1 / bc1),
                                              (float)(1 / bc2), err)))
            goto done;
        for (int l = 0; l < L && !sc.gpu; l++)
            if (o.n[l]) train_adamw(m->attn_params[l], o.grad[l], o.m1[l], o.m2[l], o.n[l], (float)lr, P.weight_decay, gscale, step);
        const int done_steps = step + 1;
        if ((P.ckpt_every > 0 && done_steps % P.ckpt_every == 0 && done_steps < n_steps)) {
            if (sc.gpu && (rc = gpu_trainer_download(sc.gpu, o.m1, o.m2, err))) goto done;
            if ((rc = ckpt_write(m, &o, P.ckpt_path, done_steps, fp, res->val_mse_before, err))) goto done;
        }
        if (P.progress) {
            const double el = train_now() - t_train;
            pr.phase = "train", pr.step = done_steps, pr.done = done_steps, pr.total = n_steps;
            pr.tokens_done = (long long)done_steps * P.batch * P.seq;
            pr.loss = loss, pr.grad_norm = gn, pr.lr = lr;
            pr.tokens_per_s = el > 0 ? (double)(done_steps - step0) * P.batch * P.seq / el : 0;
            pr.elapsed_s = train_now() - t0;
            pr.eta_s = done_steps > step0 ? el / (done_steps - step0) * (n_steps - done_steps) : 0;
            P.progress(P.progress_data, &pr);
        }
    }
    res->train_seconds = train_now() - t_train;
    res->tokens_per_s = res->train_seconds > 0 ? (double)(n_steps - step0) * P.batch * P.seq / res->train_seconds : 0;
    res->final_loss = loss;

    if ((rc = validate(ctx, &sc, &d, res->val_mse_after, "val-after", &P, &pr, t0, err))) goto done;
    if (sc.gpu && (rc = gpu_trainer_download(sc.gpu, NULL, NULL, err))) goto done;

    /* The adapter, with what it was trained on. */
    {
        gguf_writer *w;
        if ((rc = adapter_writer_typed(m, P.adapter_f16, &w, err))) goto done;
        rc = set_f32_array(w, "still.train.val_mse_before", res->val_mse_before, L, err);
        if (!rc) rc = set_f32_array(w, "still.train.val_mse_after", res->val_mse_after, L, err);
        gguf_value tok = {.type = GGUF_TYPE_UINT64, .v.u64 = (uint64_t)n_steps * P.batch * P.seq};
        if (!rc) rc = gguf_writer_set(w, "still.train.tokens", &tok, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.train.steps", (uint32_t)n_steps, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.train.seq", (uint32_t)P.seq, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.train.batch", (uint32_t)P.batch, err);
        if (!rc) rc = gguf_writer_set_f32(w, "still.train.lr", P.lr, err);
        if (!rc) rc = gguf_writer_write(w, P.out_path, err);
        gguf_writer_free(w);
        if (rc) goto done;
    }
    remove(P.ckpt_path);   /* finished: the adapter supersedes the checkpoint */
    if (P.progress) pr.phase = "done", pr.elapsed_s = train_now() - t0, P.progress(P.progress_data, &pr);

done:
    still_context_free(ctx);
    gpu_trainer_free(gpu);
    train_data_free(&d);
    for (int l = 0; l < L && o.n; l++) {
        if (o.grad) free(o.grad[l]);
        if (o.m1) free(o.m1[l]);
        if (o.m2) free(o.m2[l]);
    }
    free(o.n), free(o.grad), free(o.m1), free(o.m2), free(cfg), free(teacher), free(mse), free(seqs), free(nope);
    if (rc) still_train_result_free(res);
    return rc;
}
