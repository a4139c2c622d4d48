/* Stage 2 (spec "Stage 2"): LoRA fine-tuning of a linearized model on
 * next-token prediction through the whole hybrid model (train_lm.c does one
 * sequence's forward and backward).
 *
 * Step: batch sequences (train_data.c), loss = Σ w_t CE_t / Σ w_t over the
 * step's learnt positions, gradients accumulated over the sequences; global
 * gradient-norm clip; AdamW on every trained tensor (LoRA A and B, and with
 * train_attn the plan's attention parameters); learning rate warmed up
 * linearly, then a cosine down to lr_min, as stage 1.
 *
 * Checkpoint (atomic, every ckpt_every steps): the adapter GGUF (plan,
 * parameters, LoRA) plus still.finetune.step / .fingerprint and each trained
 * tensor's AdamW moments as "<name>.adam_m" / "<name>.adam_v". It loads as an
 * adapter too. --resume continues from it; the fingerprint (model, plan,
 * LoRA settings, every hyper-parameter, the data) must match.
 *
 * --device cuda runs each sequence through train_lm_cuda.c instead (the same
 * algorithm on the GPU; softmax and swa plans so far); the steps, AdamW and
 * checkpoints stay here, on the host. */
#include "common/common.h"
#include "format/gguf.h"
#include "model/lora.h"
#include "model/model.h"
#include "train/train_common.h"
#include "train/train_data.h"
#include "train/train_lm.h"
#include "train/train_lm_cuda.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

still_finetune_params still_finetune_default_params(void) {
    still_finetune_params p = {
        .train = still_train_default_params(), .lora_rank = 8, .lora_alpha = 16, .lora_dropout = 0,
        .lora_targets = "q,k,v,o", .train_attn = 0,
    };
    p.train.lr = 1e-4f;
    return p;
}


/* One trained tensor: weights, gradient, AdamW moments. */
typedef struct {
    char name[80];
    float *w, *g, *m1, *m2;
    size_t n;
} group;

typedef struct {
    group *g;
    int n, cap;
} groups;

static int groups_add(groups *gs, const char *name, float *w, float *g, size_t n, still_err *err) {
    if (gs->n == gs->cap) {
        int nc = gs->cap * 2 + 16;
        group *ng = realloc(gs->g, sizeof *ng * (size_t)nc);
        if (!ng) return still_fail(err, STILL_E_NOMEM, "out of memory");
        gs->g = ng, gs->cap = nc;
    }
    group *x = &gs->g[gs->n];
    memset(x, 0, sizeof *x);
    snprintf(x->name, sizeof x->name, "%s", name);
    x->w = w, x->g = g, x->n = n;
    x->m1 = calloc(n, sizeof(float)), x->m2 = calloc(n, sizeof(float));
    if (!x->m1 || !x->m2) {
        free(x->m1), free(x->m2);
        return still_fail(err, STILL_E_NOMEM, "out of memory for the optimizer state");
    }
    gs->n++;
    return STILL_OK;
}

static void groups_free(groups *gs) {
    for (int i = 0; i < gs->n; i++) free(gs->g[i].m1), free(gs->g[i].m2);
    free(gs->g);
    memset(gs, 0, sizeof *gs);
}

/* Everything that changes the result. */
/* Everything that changes the result: stage 1's fingerprint, then LoRA's settings. */
static uint64_t fingerprint(const still_model *m, const still_finetune_params *p, unsigned targets,
                            const train_data *d) {
    uint64_t h = train_fingerprint(m, &p->train, d);
    const double f[] = {p->lora_alpha, p->lora_dropout};
    const long long i[] = {p->lora_rank, targets, p->train_attn};
    h = train_fnv1a(h, f, sizeof f);
    return train_fnv1a(h, i, sizeof i);
}

/* One sequence's forward (and backward) on the CPU or the GPU. */
typedef struct {
    lm_train *cpu;
    lm_train_cuda *gpu;
    int gpu_batch;                 /* sequences the GPU trainer takes at once */
} trainer;

/* Sequences per GPU pass: the step's batch, up to 16,384 rows (about 2.6 GB of activations for SmolLM2). */
static int gpu_batch_of(int batch, int seq) {
    const int cap = 16384 / (seq > 0 ? seq : 1);
    return batch < cap ? batch : cap < 1 ? 1 : cap;
}

static int trainer_seq(trainer *tr, const int32_t *tok, const float *w, int T, float scale, uint64_t drop_seed,
                       const lm_grads *g, double *loss_sum, double *w_sum, still_err *err) {
    return tr->gpu ? lm_train_cuda_seq(tr->gpu, tok, w, T, scale, drop_seed, g, loss_sum, w_sum, err)
                   : lm_train_seq(tr->cpu, tok, w, T, scale, drop_seed, g, loss_sum, w_sum, err);
}

/* Mean cross-entropy per learnt token over the validation sequences. */
static int validate(trainer *tr, train_data *d, const char *phase, const still_train_params *p,
                    still_train_progress *pr, double t0, double *mean, double *n_tok, still_err *err) {
    double ls = 0, ws = 0;
    for (int i = 0; i < d->n_val; i++) {
        const float *w;
        int len;
        const int32_t *tok = train_data_seq(d, d->val[i], &w, &len);
        double l, n;
        int rc = trainer_seq(tr, tok, w, len, 0, 0, NULL, &l, &n, err);
        if (rc) return rc;
        ls += l, ws += n;
        if (p->progress) {
            pr->phase = phase, pr->done = i + 1, pr->total = d->n_val;
            pr->loss = ws > 0 ? ls / ws : 0;
            pr->elapsed_s = train_now() - t0;
            p->progress(p->progress_data, pr);
        }
    }
    *mean = ws > 0 ? ls / ws : NAN;
    *n_tok = ws;
    return STILL_OK;
}

static int ckpt_write(const still_model *m, const groups *gs, const char *path, int step, uint64_t fp, double vb,
                      still_err *err) {
    gguf_writer *w;
    int rc = adapter_writer(m, &w, err);
    if (rc) return rc;
    char hex[32];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fp);
    rc = gguf_writer_set_u32(w, "still.finetune.step", (uint32_t)step, err);
    if (!rc) rc = gguf_writer_set_str(w, "still.finetune.fingerprint", hex, err);
    if (!rc) rc = gguf_writer_set_f32(w, "still.finetune.val_loss_before", (float)vb, err);
    for (int i = 0; !rc && i < gs->n; i++) {
        const group *g = &gs->g[i];
        char name[96];
        int64_t ne[1] = {(int64_t)g->n};
        snprintf(name, sizeof name, "%s.adam_m", g->name);
        rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, g->m1, g->n * sizeof(float), err);
        snprintf(name, sizeof name, "%s.adam_v", g->name);
        if (!rc) rc = gguf_writer_add_tensor(w, name, TT_F32, 1, ne, g->m2, g->n * sizeof(float), err);
    }
    if (!rc) rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}

/* The checkpoint's step and moments (its adapter was loaded before). */
static int ckpt_moments(const gguf_file *f, const groups *gs, const char *path, int *step, double *vb, still_err *err) {
    uint32_t st;
    int rc = gguf_get_u32(f, "still.finetune.step", &st, err);
    if (rc) return rc;
    float v;
    if (!gguf_get_f32(f, "still.finetune.val_loss_before", &v, NULL)) *vb = v;
    for (int i = 0; i < gs->n; i++)
        for (int which = 0; which < 2; which++) {
            char name[96];
            snprintf(name, sizeof name, "%s.adam_%c", gs->g[i].name, which ? 'v' : 'm');
            const gguf_tensor *t = gguf_find_tensor(f, name);
            if (!t || t->type != TT_F32 || (size_t)t->ne[0] != gs->g[i].n)
                return still_fail(err, STILL_E_FORMAT, "checkpoint '%s': tensor %s missing or of the wrong shape", path, name);
            float *dst = which ? gs->g[i].m2 : gs->g[i].m1;
            memcpy(dst, t->data, gs->g[i].n * sizeof(float));
            /* a damaged moment would surface steps later as a non-finite loss, blamed on the learning rate */
            for (size_t j = 0; j < gs->g[i].n; j++)
                if (!isfinite(dst[j]) || (which && dst[j] < 0))
                    return still_fail(err, STILL_E_FORMAT, "checkpoint '%s': %s[%zu] = %g is not a valid AdamW moment",
                                      path, name, j, dst[j]);
        }
    *step = (int)st;
    return STILL_OK;
}

int still_finetune(still_model *m, const still_finetune_params *fp, still_finetune_result *res, still_err *err) {
    memset(res, 0, sizeof *res);
    res->val_loss_before = res->val_loss_after = NAN;
    const still_train_params *p0 = &fp->train;
    const model_config *c = &m->cfg;
    const int L = c->n_layer;
    int rc = train_check_params(p0, err);
    if (rc) return rc;
    if (p0->device != STILL_DEVICE_CPU && p0->device != STILL_DEVICE_CUDA)
        return still_fail(err, STILL_E_ARG, "still finetune: unknown device");
    unsigned targets = 0;
    rc = lora_parse_targets(fp->lora_targets ? fp->lora_targets : "q,k,v,o", &targets, err);
    if (rc) return rc;
    if (!(fp->lora_dropout >= 0 && fp->lora_dropout < 1))
        return still_fail(err, STILL_E_ARG, "--lora-dropout must be in [0, 1), got %g", fp->lora_dropout);
    const lora_shape sh = model_lora_shape(m);
    if (m->lora && (m->lora->rank != fp->lora_rank || m->lora->targets != targets ||
                    fabsf(m->lora->alpha - fp->lora_alpha) > 1e-6f * fp->lora_alpha))
        return still_fail(err, STILL_E_ARG,
                          "the adapter already has a LoRA (rank %d, alpha %g, its own targets) that differs from the options; "
                          "continue it with the same --lora-rank, --lora-alpha and --lora-targets", m->lora->rank,
                          m->lora->alpha);
    {   /* check rank and targets before reading any data */
        lora_set *probe;
        if ((rc = lora_create(&sh, fp->lora_rank, fp->lora_alpha, targets, &probe, err))) return rc;
        lora_free(probe);
    }
    /* the output must be writable before hours of training */
    {
        char probe[4096];
        if (snprintf(probe, sizeof probe, "%s.probe%ld", p0->out_path, (long)getpid()) >= (int)sizeof probe)
            return still_fail(err, STILL_E_ARG, "output path too long");
        FILE *f = fopen(probe, "wb");
        if (!f) return still_fail(err, STILL_E_IO, "cannot write the output '%s'", p0->out_path);
        fclose(f);
        remove(probe);
    }

    still_train_params P = *p0;
    train_schedule sch;
    if ((rc = train_schedule_init(&P, &sch, err))) return rc;
    const int n_steps = sch.n_steps;

    train_data d = {0};
    groups gs = {0};
    lora_set *grad = NULL;
    float **attn_grad = calloc((size_t)L, sizeof(float *));
    trainer tr = {0};
    gguf_file *ck = NULL;
    if (!attn_grad) return still_fail(err, STILL_E_NOMEM, "out of memory");

    still_train_progress pr = {.n_steps = n_steps};
    const double t0 = train_now();
    if (P.progress) pr.phase = "data", P.progress(P.progress_data, &pr);
    {
        const train_data_params dp = {.files = P.data_files, .n_files = P.n_data_files, .seq = P.seq,
                                      .allow_jsonl = 1, .val_frac = P.val_frac, .val_max = P.val_max, .seed = P.seed};
        if ((rc = train_data_load(m, &dp, &d, err))) goto done;
    }
    res->n_tokens_data = d.n_tokens, res->n_train_seqs = d.n_train, res->n_val_seqs = d.n_val;
    res->n_examples = d.n_examples, res->n_steps = n_steps;
    res->n_examples_dropped = d.n_dropped, res->n_examples_cut = d.n_cut;
    const uint64_t fpr = fingerprint(m, fp, targets, &d);

    /* Resume: the checkpoint's plan, parameters and LoRA replace the model's. */
    int step = 0;
    double vb = NAN;
    if (P.resume) {
        if (access(P.ckpt_path, F_OK)) {
            rc = still_fail(err, STILL_E_IO, "--resume: no checkpoint '%s'", P.ckpt_path);
            goto done;
        }
        if ((rc = gguf_open(P.ckpt_path, &ck, err))) goto done;
        gguf_str s;
        char hex[32];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fpr);
        if ((rc = gguf_get_str(ck, "still.finetune.fingerprint", &s, err))) goto done;
        if (s.len != strlen(hex) || memcmp(s.ptr, hex, s.len)) {
            rc = still_fail(err, STILL_E_ARG,
                            "checkpoint '%s' was made with different settings, model or data (fingerprint %.*s, now %s)",
                            P.ckpt_path, (int)(s.len < 20 ? s.len : 20), s.ptr, hex);
            goto done;
        }
        if ((rc = still_model_load_adapter(m, P.ckpt_path, err))) goto done;
        if (!m->lora) {
            rc = still_fail(err, STILL_E_FORMAT, "checkpoint '%s' holds no LoRA", P.ckpt_path);
            goto done;
        }
    } else if (!m->lora) {
        lora_set *s;
        if ((rc = lora_create(&sh, fp->lora_rank, fp->lora_alpha, targets, &s, err))) goto done;
        lora_init(s, P.seed ^ 0x10aa5eedULL);
        model_set_lora(m, s);
    }
    /* What trains: LoRA, and the kinds' parameters with train_attn. */
    if ((rc = lora_create(&sh, m->lora->rank, m->lora->alpha > 0 ? m->lora->alpha : 1, m->lora->targets, &grad, err)))
        goto done;
    for (int l = 0; l < L && !rc; l++)
        for (int t = 0; t < LORA_N_TARGETS && !rc; t++) {
            if (!lora_A(m->lora, l, (lora_target)t)) continue;
            char name[80];
            const size_t na = (size_t)m->lora->rank * m->lora->n_in[t], nb = (size_t)m->lora->n_out[t] * m->lora->rank;
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_a", l, lora_target_tensor((lora_target)t));
            rc = groups_add(&gs, name, lora_A(m->lora, l, (lora_target)t), lora_A(grad, l, (lora_target)t), na, err);
            snprintf(name, sizeof name, "blk.%d.%s.weight.lora_b", l, lora_target_tensor((lora_target)t));
            if (!rc) rc = groups_add(&gs, name, lora_B(m->lora, l, (lora_target)t), lora_B(grad, l, (lora_target)t), nb, err);
            res->n_lora_params += na + nb;
        }
    for (int l = 0; l < L && !rc && fp->train_attn; l++) {
        const size_t n = attn_kind_get(m->attn_cfg[l].kind)->param_count(&m->attn_cfg[l]);
        if (!n) continue;
        if (!(attn_grad[l] = calloc(n, sizeof(float)))) {
            rc = still_fail(err, STILL_E_NOMEM, "out of memory");
            break;
        }
        char name[80];
        snprintf(name, sizeof name, "blk.%d.attn_hybrid.params", l);
        rc = groups_add(&gs, name, m->attn_params[l], attn_grad[l], n, err);
        res->n_attn_params += n;
    }
    if (rc) goto done;
    if (fp->train_attn && !res->n_attn_params) {
        rc = still_fail(err, STILL_E_ARG, "--train-attn: the attention plan has no parameters to train");
        goto done;
    }
    if (ck) {
        if ((rc = ckpt_moments(ck, &gs, P.ckpt_path, &step, &vb, err))) goto done;
        gguf_close(ck), ck = NULL;
        if (step > n_steps) step = n_steps;
        res->start_step = step;
    }
    if (p0->device == STILL_DEVICE_CUDA) {
        tr.gpu_batch = gpu_batch_of(P.batch, d.seq);
        if ((rc = lm_train_cuda_create(m, m->lora, d.seq, tr.gpu_batch, fp->lora_dropout, fp->gpu_fp32, &tr.gpu, err)))
            goto done;
    } else if ((rc = lm_train_create(m, m->lora, d.seq, fp->lora_dropout, &tr.cpu, err)))
        goto done;
    const lm_grads lg = {.lora = grad, .attn = attn_grad};

    if (step == 0) {
        if ((rc = validate(&tr, &d, "val-before", &P, &pr, t0, &res->val_loss_before, &res->val_tokens, err))) goto done;
    } else
        res->val_loss_before = vb;

    const double t_train = train_now();
    const int step0 = step;
    double loss = 0;
    long long tok_done = 0;
    for (; step < n_steps; step++) {
        for (int i = 0; i < gs.n; i++) memset(gs.g[i].g, 0, gs.g[i].n * sizeof(float));
        /* the step's learnt positions, for the mean */
        double wsum = 0;
        for (int b = 0; b < P.batch; b++) {
            const float *w;
            int len;
            train_data_seq(&d, train_data_train_index(&d, (long long)step * P.batch + b), &w, &len);
            if (!w) wsum += len - 1;
            else
                for (int t = 0; t + 1 < len; t++) wsum += w[t];
        }
        const float scale = wsum > 0 ? (float)(1.0 / wsum) : 0.0f;
        double ls = 0;
        for (int b = 0; b < P.batch && !rc;) {
            /* the GPU: the next sequences of one length together (at most gpu_batch); the CPU: one at a time */
            const int32_t *tok[64];
            const float *w[64];
            uint64_t seeds[64];
            int len = 0, nb = 0;
            const int most = tr.gpu ? (tr.gpu_batch < 64 ? tr.gpu_batch : 64) : 1;
            for (; nb < most && b + nb < P.batch; nb++) {
                const long long gi = (long long)step * P.batch + b + nb;
                int li;
                const int32_t *tk = train_data_seq(&d, train_data_train_index(&d, gi), &w[nb], &li);
                if (nb > 0 && li != len) break;
                tok[nb] = tk, len = li, seeds[nb] = P.seed * 0x9e3779b97f4a7c15ULL + (uint64_t)gi;
            }
            double l, n;
            rc = tr.gpu ? lm_train_cuda_batch(tr.gpu, tok, w, nb, len, scale, seeds, &lg, &l, &n, err)
                        : lm_train_seq(tr.cpu, tok[0], w[0], len, scale, seeds[0], &lg, &l, &n, err);
            ls += l, tok_done += (long long)nb * len, res->n_target_tokens += (long long)n, b += nb;
        }
        if (rc) goto done;
        loss = wsum > 0 ? ls / wsum : 0;
        double g2 = 0;
        for (int i = 0; i < gs.n; i++)
            for (size_t j = 0; j < gs.g[i].n; j++) g2 += (double)gs.g[i].g[j] * gs.g[i].g[j];
        const double gn = sqrt(g2);
        if (!isfinite(gn) || !isfinite(loss)) {
            rc = still_fail(err, STILL_E_STATE, "training diverged at step %d (loss %g, gradient norm %g); try a lower --lr",
                            step + 1, loss, gn);
            goto done;
        }
        const float gscale = P.clip > 0 && gn > P.clip ? (float)(P.clip / gn) : 1.0f;
        const double lr = train_lr_at(&P, &sch, step);
        for (int i = 0; i < gs.n; i++)
            train_adamw(gs.g[i].w, gs.g[i].g, gs.g[i].m1, gs.g[i].m2, gs.g[i].n, (float)lr, P.weight_decay, gscale, step);
        const int done_steps = step + 1;
        if (P.ckpt_every > 0 && done_steps % P.ckpt_every == 0 && done_steps < n_steps &&
            (rc = ckpt_write(m, &gs, P.ckpt_path, done_steps, fpr, res->val_loss_before, err)))
            goto done;
        if (P.progress) {
            const double el = train_now() - t_train;
            pr.phase = "train", pr.step = done_steps, pr.done = done_steps, pr.total = n_steps;
            pr.tokens_done = (long long)done_steps * P.batch * P.seq;
            pr.loss = loss, pr.grad_norm = gn, pr.lr = lr;
            pr.tokens_per_s = el > 0 ? (double)tok_done / el : 0;
            pr.elapsed_s = train_now() - t0;
            pr.eta_s = done_steps > step0 ? el / (done_steps - step0) * (n_steps - done_steps) : 0;
            P.progress(P.progress_data, &pr);
        }
    }
    res->train_seconds = train_now() - t_train;
    res->tokens_per_s = res->train_seconds > 0 ? (double)tok_done / res->train_seconds : 0;
    res->final_loss = loss;
    {
        double n;
        if ((rc = validate(&tr, &d, "val-after", &P, &pr, t0, &res->val_loss_after, &n, err))) goto done;
        res->val_tokens = n;
    }

    /* The adapter: plan, parameters, LoRA, and what it was trained on. */
    {
        gguf_writer *w;
        if ((rc = adapter_writer_typed(m, P.adapter_f16, &w, err))) goto done;
        gguf_value tok = {.type = GGUF_TYPE_UINT64, .v.u64 = (uint64_t)n_steps * P.batch * P.seq};
        rc = gguf_writer_set(w, "still.finetune.tokens", &tok, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.finetune.steps", (uint32_t)n_steps, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.finetune.seq", (uint32_t)P.seq, err);
        if (!rc) rc = gguf_writer_set_u32(w, "still.finetune.batch", (uint32_t)P.batch, err);
        if (!rc) rc = gguf_writer_set_f32(w, "still.finetune.lr", P.lr, err);
        if (!rc) rc = gguf_writer_set_f32(w, "still.finetune.val_loss_before", (float)res->val_loss_before, err);
        if (!rc) rc = gguf_writer_set_f32(w, "still.finetune.val_loss_after", (float)res->val_loss_after, err);
        if (!rc) rc = gguf_writer_write(w, P.out_path, err);
        gguf_writer_free(w);
        if (rc) goto done;
    }
    remove(P.ckpt_path);   /* finished: the adapter supersedes the checkpoint */
    if (P.progress) pr.phase = "done", pr.elapsed_s = train_now() - t0, P.progress(P.progress_data, &pr);

done:
    gguf_close(ck);
    lm_train_free(tr.cpu);
    lm_train_cuda_free(tr.gpu);
    train_data_free(&d);
    groups_free(&gs);
    lora_free(grad);
    for (int l = 0; l < L; l++) free(attn_grad[l]);
    free(attn_grad);
    return rc;
}
