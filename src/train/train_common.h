/* What both training stages share (still linearize: train.c; still
 * finetune: finetune.c): the checks of still_train_params, the schedule
 * (steps, warm-up, then a cosine down to lr_min), AdamW's update, the part of
 * a checkpoint's fingerprint that names the model and its plan, and a clock. */
#ifndef STILL_TRAIN_COMMON_H
#define STILL_TRAIN_COMMON_H

#include "still.h"
#include "train/train_data.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int n_steps, warmup;
    char ckpt_default[4096];   /* OUTPUT.ckpt when no checkpoint path is given */
} train_schedule;

/* The checks both stages make of their parameters (one-line errors). */
int train_check_params(const still_train_params *p, still_err *err);
/* Resolve P's defaults (lr_min, the checkpoint path into s) and the schedule. */
int train_schedule_init(still_train_params *P, train_schedule *s, still_err *err);
/* The learning rate of a step: linear warm-up, then the cosine to lr_min. */
double train_lr_at(const still_train_params *p, const train_schedule *s, int step);
/* AdamW (β 0.9, 0.999, ε 1e-8, decoupled decay) on n weights at step (0-based),
 * the gradient scaled by gscale (the clip). */
void train_adamw(float *w, const float *g, float *m1, float *m2, size_t n, float lr, float weight_decay,
                 float gscale, int step);
/* FNV-1a of the model (its shape, file size) and every layer's attention plan,
 * then of p's settings and the data (stage 1's fingerprint; stage 2 adds its own). */
uint64_t train_fingerprint(const still_model *m, const still_train_params *p, const train_data *d);
double train_now(void);

#endif
