/* Stage-1 training on the CUDA backend (train_cuda.c), driven by src/train/train.c
 * when still_train_params.device is STILL_DEVICE_CUDA: the teacher (the model
 * with softmax everywhere) runs on the GPU, and at every trained layer the
 * student's loss and gradient come from stc_still_distill on the same q, k,
 * v and x. Parameters, gradients and the AdamW moments live on the device;
 * the host copies (the model's attn_params, the moments) are brought up to
 * date by gpu_trainer_download for checkpoints and the adapter. */
#ifndef STILL_TRAIN_CUDA_H
#define STILL_TRAIN_CUDA_H

#include "kinds/attn.h"
#include "still.h"

#include <stdint.h>

typedef struct gpu_trainer gpu_trainer;

/* student: the plan being trained (n_ctx = seq), teacher: the same with
 * softmax everywhere; at most max_seqs sequences a step. Uploads the weights
 * and every trained layer's parameters (m->attn_params). Only still layers
 * train on the GPU. */
int gpu_trainer_create(still_model *m, const attn_config *student, const attn_config *teacher, int seq,
                       int max_seqs, gpu_trainer **out, still_err *err);
void gpu_trainer_free(gpu_trainer *t);
int gpu_trainer_zero_grad(gpu_trainer *t, still_err *err);
/* n (1 .. max_seqs) sequences of seq tokens, seqs[i] on the host:
 * mse[i·n_layer + l] (host; 0 for layers not trained) gets sequence i's
 * MSE at layer l; with_grad adds scale · ∂MSE/∂params of every sequence.
 * The teacher runs the sequences side by side (train_cuda.c); returns when
 * all are done. */
int gpu_trainer_step(gpu_trainer *t, const int32_t *const *seqs, int n, int with_grad, float scale, double *mse,
                     still_err *err);
/* Σ grad² over every trained parameter. */
int gpu_trainer_grad_sumsq(gpu_trainer *t, double *out, still_err *err);
/* AdamW on every trained parameter (stc_adamw's arguments). */
int gpu_trainer_adamw(gpu_trainer *t, float lr, double b1, double b2, double eps, float wd, float gscale, float c1,
                      float c2, still_err *err);
/* Device -> host: the parameters into m->attn_params, the moments into m1[l], m2[l] (per trained layer). */
int gpu_trainer_download(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err);
/* Host -> device: the moments (after a checkpoint was read; the parameters came at creation). */
int gpu_trainer_upload_moments(gpu_trainer *t, float *const *m1, float *const *m2, still_err *err);

#endif
