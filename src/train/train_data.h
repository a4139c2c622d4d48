/* Training data for both stages: sequences of tokens with a loss weight per
 * position, a held-out split and a seeded order.
 *
 * Plain text files (UTF-8) are tokenized one after the other into one stream
 * and cut into sequences of seq tokens (a tail shorter than seq is dropped);
 * every position predicts the next token with weight 1.
 *
 * Instruction data (stage 2; files ending in .jsonl) is one example per line,
 * either {"instruction": ..., "input": ..., "output": ...} (input optional) or
 * {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]},
 * rendered with the model's chat template (ChatML, the default system prompt
 * when the example has none); only the assistant answers are learnt: weight 1
 * on the positions that predict an answer's tokens and its closing
 * <|im_end|>, 0 elsewhere. Each example is one sequence, cut to seq tokens.
 *
 * The sequences are shuffled with the seed; the first n_val are held out.
 * Training reads the rest in a fresh seeded permutation per epoch, so the
 * sequence of micro-batch g is a function of (seed, g) alone and a resumed run
 * sees the same data as an uninterrupted one. */
#ifndef STILL_TRAIN_DATA_H
#define STILL_TRAIN_DATA_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    int32_t *tok;          /* every sequence's tokens, one after the other */
    float *w;              /* per token: weight of predicting the next token (NULL: text only, all 1) */
    size_t *off;           /* n_seq + 1 offsets into tok */
    int seq;               /* longest sequence */
    int n_seq;
    int *val, n_val;       /* held-out sequence indices */
    int *train, n_train;   /* training sequence indices */
    int *perm, perm_epoch; /* permutation of train for one epoch */
    uint64_t hash;         /* of the tokens and weights */
    long long n_tokens;    /* tokens read */
    int n_examples;        /* JSONL examples kept */
    int n_dropped;         /* examples left out: no answer token within seq */
    int n_cut;             /* examples cut to seq tokens */
} train_data;

typedef struct {
    const char *const *files;
    int n_files;
    int seq;               /* tokens per sequence (the longest for examples) */
    int allow_jsonl;       /* stage 2: .jsonl files are instruction data */
    float val_frac;
    int val_max;
    uint64_t seed;
} train_data_params;

int train_data_load(const still_model *m, const train_data_params *p, train_data *d, still_err *err);
void train_data_free(train_data *d);
/* Sequence i: its tokens, weights (NULL: all 1) and length. */
const int32_t *train_data_seq(const train_data *d, int i, const float **w, int *len);
/* The training sequence of micro-batch g (an index into d's sequences). */
int train_data_train_index(train_data *d, long long g);

/* FNV-1a, shared with the trainers' fingerprints. */
uint64_t train_fnv1a(uint64_t h, const void *p, size_t n);

#endif
