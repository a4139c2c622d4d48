/* Shared pieces of the `still` command line. */
#ifndef STILL_CLI_H
#define STILL_CLI_H

#include "still.h"
#include <stddef.h>
#include <stdint.h>

/* Which command is parsing (bit mask for the option table). */
enum {
    CMD_GENERATE = 1 << 0, CMD_CHAT = 1 << 1, CMD_TOKENIZE = 1 << 2, CMD_PERPLEXITY = 1 << 3,
    CMD_INFO = 1 << 4, CMD_BENCH = 1 << 5, CMD_CONVERT = 1 << 6, CMD_MERGE = 1 << 7, CMD_SALIENCY = 1 << 8,
    CMD_LINEARIZE = 1 << 9, CMD_EVAL = 1 << 10, CMD_FINETUNE = 1 << 11, CMD_PROBE = 1 << 12, CMD_SERVER = 1 << 13,
};

typedef struct {
    int cmd;
    const char *model;
    const char *prompt;
    const char *file;
    int n_predict;     /* tokens to generate */
    int n_ctx;         /* context size (0 = command default) */
    int n_batch;       /* prefill chunk */
    int threads;       /* 0 = all cores */
    int json;          /* tokenize, bench: JSON output */
    int csv;           /* bench: CSV output */
    int no_warmup;     /* bench: no warm-up run before the timed repetitions */
    int interleave;    /* bench: generation tests at all depths step by step in turn */
    int no_special;    /* tokenize/generate: do not parse special tokens in the text */
    int no_display_prompt; /* generate: print only the generated text */
    const char *bench_p;   /* bench: -p list, parsed by cmd_bench */
    const char *bench_n;   /* bench: -n list */
    const char *bench_d;   /* bench: -d list */
    int reps;          /* bench: -r */
    int bench_b;       /* bench: -b (0 = the device's default) */
    int chunks;        /* perplexity: max chunks (0 = all) */
    int topk;          /* saliency: tokens selected per chunk */
    const char *system;/* chat: system prompt */
    int verbose;
    still_sampler_params sp;
    still_attn_params ap;   /* --attn and its options */
    int attn_given;         /* --attn or --plan was on the command line */
    int kind_given;         /* --attn was */
    unsigned plan_given;    /* STILL_PLAN_* bits of the attention options given */
    const char *adapter;    /* --adapter FILE */
    const char *output;     /* -o FILE */
    still_train_params tp;  /* linearize */
#define CLI_MAX_DATA 256
    const char *data[CLI_MAX_DATA];   /* --data FILE (repeatable) */
    int n_data;             /* (eval: the --compare NAME=OPTIONS entries) */
    const char *lengths;    /* eval */
    const char *task_file;  /* eval, probe: --tasks FILE.jsonl */
    const char *probe_task; /* probe: --task NAME */
    int probe_length, probe_sample, probe_ordinary;
    const char *needle, *answer;
    int samples;
    const char *haystack;
    const char *json_out;
    const char *dump;
    int dry_run;
    const char *sel_cache;  /* --sel-cache f16|f32|q8 (NULL: the plan's) */
    const char *device;     /* --device cpu|cuda (NULL: cpu) */
    int fixed_threads;      /* --fixed-threads: decode steps always on all threads (no governor) */
    const char *prefill;    /* --prefill float|int8 (NULL: float) */
    const char *matvec;     /* --matvec float|int8|int8-portable|int8-avx2|int8-vnni (NULL: the default, int8 on the CPU) */
    const char *outtype;    /* --outtype f32|f16: adapter parameters (NULL: f32) */
    /* LoRA */
    const char *lora;       /* --lora FILE: a LoRA adapter applied on the fly */
    float lora_scale;       /* --lora-scale (default 1) */
    int lora_rank;          /* finetune */
    float lora_alpha, lora_dropout;
    const char *lora_targets;
    int train_attn;
    int fp32;                     /* finetune --fp32 */
    /* server */
    const char *host;       /* --host (default 127.0.0.1) */
    int port;               /* --port (default 8080; 0: any free port) */
    int n_parallel;         /* -np: slots */
    const char *api_key;    /* --api-key */
    int queue_max;          /* --queue */
    int http_threads;       /* --http-threads: connections served at once */
    int cache_mib;          /* --cache-ram: MiB of conversation states kept */
    const char *state_dir;  /* --state-dir */
} cli_opts;

/* Parse argv (after the command name). Returns 0 on success, 1 if --help was
 * printed, -1 on error (message already printed). */
int cli_parse(int cmd, const char *cmd_name, int argc, char **argv, cli_opts *o);
void cli_print_help(int cmd, const char *cmd_name);

/* --device as still_context_params.device (STILL_DEVICE_*). */
int cli_device(const cli_opts *o);
/* --matvec as still_context_params.matvec (STILL_MATVEC_*; none given: STILL_MATVEC_DEFAULT; -1: not a known name). */
int cli_matvec(const cli_opts *o);
/* --prefill as still_context_params.prefill (STILL_PREFILL_*; none given: float; -1: not a known name). */
int cli_prefill(const cli_opts *o);
/* --sel-cache as still_context_params.sel_cache (STILL_SEL_*). */
int cli_sel_cache(const cli_opts *o);
/* Load the model named by -m and set the thread count. */
int cli_load_model(const cli_opts *o, still_model **m);   /* 0, or the exit code (message printed): 2 for plan flags the model refuses, else 1 */
/* Read a whole file into a malloc'ed NUL-terminated buffer. */
int cli_read_file(const char *path, char **data, size_t *len);
/* The input text of -p or -f (exactly one must be given): a malloc'ed copy
 * in *text. Returns 0, or the exit code to return (message printed). */
int cli_input_text(const cli_opts *o, const char *cmd_name, char **text, size_t *len);
/* A one-turn ChatML prompt (system, user, then the assistant's reply started
 * with prefix) as token ids: the template's markers parsed as special tokens,
 * the texts as plain text; *out malloc'ed. 0 or -1. */
int cli_chat_ids(const still_model *m, const char *system, const char *user, const char *prefix, int32_t **out,
                 size_t *n_out);
/* Its token count, as an eval_count_fn (data: a cli_prompt_counter). */
typedef struct {
    const still_model *m;
    const char *system;
} cli_prompt_counter;
int cli_chat_count(void *data, const char *user, const char *prefix);
/* Print a token's bytes to stdout. */
void cli_print_token(const still_model *m, int32_t id);
/* Training progress on stderr (still_train_params.progress; data: a cli_progress). */
typedef struct {
    int tty;
    const char *name;   /* the command, as the line's prefix */
} cli_progress;
void cli_on_progress(void *data, const still_train_progress *p);
/* Peak resident set size in bytes. */
size_t cli_peak_rss(void);
double cli_now(void);

int cmd_generate(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_linearize(int argc, char **argv);
int cmd_finetune(int argc, char **argv);
int cmd_probe(int argc, char **argv);
int cmd_server(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_merge(int argc, char **argv);
int cmd_saliency(int argc, char **argv);

#endif
