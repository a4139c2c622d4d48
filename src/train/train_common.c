/* Pieces both training stages share (see train_common.h). */
#include "train/train_common.h"

#include "common/common.h"
#include "format/gguf.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <time.h>

int train_check_params(const still_train_params *p, still_err *err) {
    if (!p->out_path) return still_fail(err, STILL_E_ARG, "no output file given");
    if (p->n_data_files <= 0) return still_fail(err, STILL_E_ARG, "no training data given");
    if (p->seq < 2 || p->seq > (1 << 20)) return still_fail(err, STILL_E_ARG, "sequence length %d out of range", p->seq);
    if (p->batch < 1) return still_fail(err, STILL_E_ARG, "batch must be at least 1, got %d", p->batch);
    if (p->tokens < 1) return still_fail(err, STILL_E_ARG, "token count must be positive");
    if (!(p->lr > 0) || !isfinite(p->lr)) return still_fail(err, STILL_E_ARG, "learning rate must be positive");
    if (p->clip < 0 || p->weight_decay < 0 || !(p->val_frac >= 0 && p->val_frac < 1))
        return still_fail(err, STILL_E_ARG, "clip and weight decay must be >= 0 and the validation fraction in [0, 1)");
    return STILL_OK;
}

int train_schedule_init(still_train_params *P, train_schedule *s, still_err *err) {
    if (P->lr_min < 0) P->lr_min = P->lr / 10;
    long long steps = P->tokens / ((long long)P->seq * P->batch);
    if (steps < 1) steps = 1;
    if (steps > (1 << 30)) return still_fail(err, STILL_E_ARG, "too many steps");
    s->n_steps = (int)steps;
    s->warmup = P->warmup >= 0 ? (P->warmup < s->n_steps ? P->warmup : s->n_steps) : (s->n_steps + 19) / 20;
    if (!P->ckpt_path) {
        if (snprintf(s->ckpt_default, sizeof s->ckpt_default, "%s.ckpt", P->out_path) >= (int)sizeof s->ckpt_default)
            return still_fail(err, STILL_E_ARG, "output path too long");
        P->ckpt_path = s->ckpt_default;
    }
    return STILL_OK;
}

double train_lr_at(const still_train_params *p, const train_schedule *s, int step) {
    if (step < s->warmup) return p->lr * (double)(step + 1) / s->warmup;
    const int span = s->n_steps - s->warmup;
    const double t = span > 1 ? (double)(step - s->warmup) / (span - 1) : 1.0;
    return p->lr_min + (p->lr - p->lr_min) * 0.5 * (1.0 + cos(M_PI * t));
}

void train_adamw(float *w, const float *g, float *m1, float *m2, size_t n, float lr, float weight_decay,
                 float gscale, int step) {
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const float c1 = (float)(1 / (1 - pow(b1, step + 1))), c2 = (float)(1 / (1 - pow(b2, step + 1)));
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) {
        const float gi = g[i] * gscale;
        m1[i] = (float)b1 * m1[i] + (float)(1 - b1) * gi;
        m2[i] = (float)b2 * m2[i] + (float)(1 - b2) * gi * gi;
        w[i] -= lr * (m1[i] * c1 / (sqrtf(m2[i] * c2) + (float)eps) + weight_decay * w[i]);
    }
}

uint64_t train_fingerprint(const still_model *m, const still_train_params *p, const train_data *d) {
    uint64_t h = 0xcbf29ce484222325ULL;
    const model_config *c = &m->cfg;
    const size_t fsz = gguf_file_size(m->file);
    h = train_fnv1a(h, c, sizeof *c);
    h = train_fnv1a(h, &fsz, sizeof fsz);
    for (int l = 0; l < c->n_layer; l++) {
        const attn_config *a = &m->attn_cfg[l];
        const int v[] = {a->kind, a->window, a->chunk, a->feature_dim, a->budget, a->lambda, a->per_kv_head,
                         a->routing, a->linear, a->feature_map, a->gate};
        h = train_fnv1a(h, v, sizeof v);
        h = train_fnv1a(h, &a->seed, sizeof a->seed);
        if (a->sel_global) h = train_fnv1a(h, &a->sel_global, sizeof a->sel_global);   /* (older plans: unchanged) */
        if (a->sel_span) h = train_fnv1a(h, &a->sel_span, sizeof a->sel_span);
        if (a->gate_den) h = train_fnv1a(h, &a->gate_den, sizeof a->gate_den);
    }
    const double f[] = {p->lr, p->lr_min, p->weight_decay, p->clip, p->val_frac};
    const long long i[] = {p->tokens, p->seq, p->batch, p->warmup, p->val_max, (long long)p->seed};
    h = train_fnv1a(h, f, sizeof f);
    h = train_fnv1a(h, i, sizeof i);
    h = train_fnv1a(h, &d->hash, sizeof d->hash);
    return h;
}

double train_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
