/* Evaluation suite (`still eval`): long-context task generators and scorers.
 *
 *   eval_needle.c  RULER-style needle tasks (niah_*, vt, passkey) and the
 *                  placement of facts into a haystack at a target length
 *   eval_babi.c    bAbI qa1-qa5 as a small world simulation (BABILong style)
 *   eval_mc.c      lm-evaluation-harness style multiple choice (JSONL)
 *
 * Every generator is deterministic in its seed. */
#ifndef STILL_EVAL_H
#define STILL_EVAL_H

#include "still.h"

#include <stddef.h>
#include <stdint.h>

/* ---- task prompts (eval_tasks.c) ------------------------------------------- */

extern const char *const EVAL_TASKS[];   /* every task name, in table order */
extern const int EVAL_N_TASKS;

/* One sample of a task, fitted to a target length. */
typedef struct {
    char *user;               /* the user message: instruction, context, question */
    char *answer_prefix;      /* the start of the assistant's reply */
    char **refs;              /* reference values; the score is the fraction found in the output */
    int n_refs;
    int n_tokens;             /* of the whole rendered prompt (count callback) */
    size_t context_off, context_len;   /* the context (haystack + items) within user */
    size_t *item_pos;         /* byte offset of each inserted item within the context */
    int n_items;
    double depth;             /* drawn depth of the first item (0..1), -1 if none */
    int first_sentence;       /* score only the output's first sentence (bAbI) */
    int any_ref;              /* score 1 when any reference is found (user tasks' accepted answers) */
    int max_new;              /* tokens to generate */
} eval_prompt;

/* Tokens of the whole prompt for this user message and answer prefix (chat
 * template included), or < 0 on error. */
typedef int (*eval_count_fn)(void *data, const char *user, const char *answer_prefix);

/* Build sample `seed` of task (see EVAL_TASKS) at target_tokens; haystack: the
 * essay text (tasks with a noise haystack ignore it). */
int eval_make_prompt(const char *task, uint64_t seed, int target_tokens, const char *haystack, size_t haystack_len,
                     eval_count_fn count, void *count_data, eval_prompt *out, still_err *err);
void eval_prompt_free(eval_prompt *p);
/* Fraction of p's references found in output (ASCII case ignored; as whole words at their letter or digit edges,
 * so that a longer number or word holding a reference does not count; bAbI: in the first sentence only). */
double eval_score(const eval_prompt *p, const char *output);

/* ---- user tasks (still eval --tasks FILE.jsonl; eval_tasks.c) --------------
 * One JSON object a line:
 *   "question"       required: the text after the context
 *   "answers"        required: accepted answers; a sample scores 1 when the
 *                    output contains any of them (case-insensitive), or with
 *                    "all_answers": true the fraction of them it contains
 *   "context"        a context used whole (no fitting: the cell's length is the
 *                    prompt's own), or
 *   "haystack"       prose cut to each --lengths target from a seeded offset
 *                    (absent: the command's --haystack)
 *   "needle" / "needles"  sentence(s) inserted at sentence boundaries of the
 *                    context or haystack, at
 *   "depth"          a number or one per needle in [0, 1] (absent: drawn from
 *                    the sample's seed)
 *   optional "task" (the table's row; default: the file's base name),
 *   "instruction" (before the context), "answer_prefix" (the start of the
 *   reply), "max_new" (tokens to generate, default 48). Unknown keys are an
 *   error. */
typedef struct {
    char *task, *instruction, *context, *haystack, *question, *answer_prefix;
    char **needles;
    int n_needles;
    double *depth;        /* n_needles entries, or NULL: drawn from the seed */
    char **answers;
    int n_answers;
    int all_answers, max_new;
} eval_item;

typedef struct {
    eval_item *items;
    int n_items;
} eval_item_set;

int eval_items_load(const char *path, eval_item_set *out, still_err *err);
void eval_items_free(eval_item_set *s);
/* Sample `seed` of item it at target_tokens (ignored for a fixed context). */
int eval_make_prompt_item(const eval_item *it, uint64_t seed, int target_tokens, const char *haystack,
                          size_t haystack_len, eval_count_fn count, void *count_data, eval_prompt *out,
                          still_err *err);

/* ---- bAbI (eval_babi.c) ---------------------------------------------------- */

/* One bAbI story: facts in story order, one question, one answer word
 * (qa1-qa3: a location, e.g. "kitchen"; qa4: a location; qa5: a person or an
 * object, as in the original tasks). Strings are malloc'ed and owned. */
typedef struct {
    char **facts;        /* n_facts sentences, each ending with '.' */
    int n_facts;
    int *supporting;     /* indices into facts of the supporting facts (n_supporting) */
    int n_supporting;
    char *question;      /* ends with '?' */
    char *answer;        /* one word, as it appears in the facts (places and objects lower case, people capitalised) */
} babi_story;

/* task 1..5: qa1 single supporting fact, qa2 two, qa3 three, qa4 two-argument
 * relations, qa5 three-argument relations. n_facts_hint: about how many facts
 * the story should have (the original tasks use 2-10 for qa1; longer stories
 * are allowed). */
int babi_generate(int task, uint64_t seed, int n_facts_hint, babi_story *out, still_err *err);
void babi_story_free(babi_story *s);

/* ---- multiple choice (eval_mc.c) -------------------------------------------- */

/* A JSONL file, one object per line: {"context": str, "choices": [str, ...],
 * "gold": int}. Each choice is scored by the summed log-likelihood of its
 * tokens after the context (acc) and by that sum divided by the choice's
 * length in bytes (acc_norm), as lm-evaluation-harness does. */
typedef struct {
    int n_items;
    double acc, acc_norm;          /* fractions of items */
    double *loglik;                /* per item and choice, row-major, n_choices_total entries (owned) */
    int *item_first_choice;        /* [n_items + 1]: offsets into loglik */
} eval_mc_result;

/* matvec: still_context_params.matvec of the scoring context (STILL_MATVEC_*; 0 the default). */
int eval_mc_run(still_model *m, const char *jsonl_path, int n_ctx, int matvec, eval_mc_result *res, still_err *err);
void eval_mc_result_free(eval_mc_result *r);

#endif
