/* Option parsing shared by every command: one table says which flags exist,
 * which commands accept them, and where the value goes. Numbers are parsed
 * strictly (the whole argument, in range) with one-line errors. */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

enum { OPT_STR, OPT_INT, OPT_FLOAT, OPT_U64, OPT_FLAG, OPT_FLAG_OFF, OPT_LLONG, OPT_DATA };

#define ALL_MODEL (CMD_GENERATE | CMD_CHAT | CMD_TOKENIZE | CMD_PERPLEXITY | CMD_INFO | CMD_BENCH | CMD_CONVERT | CMD_MERGE | CMD_SALIENCY | CMD_LINEARIZE | CMD_EVAL | CMD_FINETUNE | CMD_PROBE | CMD_SERVER)
#define SAMPLING (CMD_GENERATE | CMD_CHAT)
#define RUNS_MODEL (CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_CONVERT | CMD_LINEARIZE | CMD_EVAL | CMD_FINETUNE | CMD_PROBE | CMD_SERVER)
#define TRAINS (CMD_LINEARIZE | CMD_FINETUNE)
/* commands that run a model with a LoRA applied on the fly */
#define RUNS_LORA (CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL | CMD_MERGE | CMD_PROBE | CMD_SERVER)

typedef struct {
    const char *short_name, *long_name;
    int kind;
    size_t offset;
    int cmds;
    double lo, hi;            /* numeric range */
    const char *metavar, *help;
} opt_def;

#define OFF(f) offsetof(cli_opts, f)
static const opt_def OPTS[] = {
    {"-m", "--model", OPT_STR, OFF(model), ALL_MODEL, 0, 0, "FILE", "model GGUF file (required)"},
    {"-p", "--prompt", OPT_STR, OFF(prompt), CMD_GENERATE | CMD_CHAT | CMD_TOKENIZE, 0, 0, "TEXT", "prompt text"},
    {"-f", "--file", OPT_STR, OFF(file), CMD_GENERATE | CMD_TOKENIZE | CMD_PERPLEXITY | CMD_SALIENCY | CMD_PROBE, 0, 0, "FILE",
     "read the prompt / text from FILE"},
    {"-n", "--n-predict", OPT_INT, OFF(n_predict), CMD_GENERATE | CMD_CHAT | CMD_SERVER, 0, 1 << 24, "N",
     "number of tokens to generate (default 128; chat: per reply, default 512; server: a request that names no "
     "max_tokens, default 512)"},
    {"-c", "--ctx-size", OPT_INT, OFF(n_ctx), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_SALIENCY | CMD_BENCH | CMD_SERVER, 1,
     1 << 22, "N", "context size in tokens (default: 4096 generate/chat, 512 perplexity, 2048 saliency, bench: d+p+n; "
     "server: per slot, 8192)"},
    {"-b", "--batch-size", OPT_INT, OFF(n_batch), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_SALIENCY | CMD_EVAL | CMD_SERVER, 1, 1 << 16, "N",
     "prefill chunk size in tokens (default 512; server: a slot's prompt goes in chunks of N, the other slots "
     "step between them)"},
    {NULL, "--host", OPT_STR, OFF(host), CMD_SERVER, 0, 0, "ADDR",
     "server: IPv4 or IPv6 address to listen on (default 127.0.0.1: this machine only)"},
    {NULL, "--port", OPT_INT, OFF(port), CMD_SERVER, 0, 65535, "N", "server: port (default 8080; 0: any free one)"},
    {"-np", "--parallel", OPT_INT, OFF(n_parallel), CMD_SERVER, 1, 1024, "N",
     "server: slots, the sequences in flight at once (default 4); each keeps its conversation's state for the next "
     "request that continues it"},
    {NULL, "--api-key", OPT_STR, OFF(api_key), CMD_SERVER, 0, 0, "KEY",
     "server: require Authorization: Bearer KEY on every request but / and /health (default: $STILL_API_KEY if "
     "set, else none)"},
    {NULL, "--queue", OPT_INT, OFF(queue_max), CMD_SERVER, 1, 1 << 20, "N",
     "server: requests that may wait for a slot (default 64); beyond, 503 with Retry-After"},
    {NULL, "--cache-ram", OPT_INT, OFF(cache_mib), CMD_SERVER, 0, 1 << 24, "MIB",
     "server: MiB of finished conversations' states kept in memory, least recently used dropped first (default "
     "1024; 0: none): a conversation whose slot went to another continues from its state"},
    {NULL, "--state-dir", OPT_STR, OFF(state_dir), CMD_SERVER, 0, 0, "DIR",
     "server: where POST /slots/ID?action=save|restore keeps slot files (default: none, the actions refused)"},
    {NULL, "--http-threads", OPT_INT, OFF(http_threads), CMD_SERVER, 1, 4096, "N",
     "server: HTTP connections served at once (default 256)"},
    {"-b", "--batch-size", OPT_INT, OFF(bench_b), CMD_BENCH, 1, 1 << 16, "N",
     "prefill chunk size in tokens (default: 512 on the CPU; on the GPU the whole context up to 65536)"},
    {"-t", "--threads", OPT_INT, OFF(threads), ALL_MODEL, 1, 1024, "N", "number of threads (default: all cores)"},
    {NULL, "--temp", OPT_FLOAT, OFF(sp.temp), SAMPLING, 0, 100, "T", "temperature, 0 = greedy (default 0.8)"},
    {NULL, "--top-k", OPT_INT, OFF(sp.top_k), SAMPLING, 0, 1 << 30, "K", "top-k, 0 = off (default 40)"},
    {NULL, "--top-p", OPT_FLOAT, OFF(sp.top_p), SAMPLING, 1e-9, 1, "P", "top-p, 1 = off (default 0.95)"},
    {NULL, "--min-p", OPT_FLOAT, OFF(sp.min_p), SAMPLING, 0, 1, "P", "min-p, 0 = off (default 0.05)"},
    {NULL, "--repeat-penalty", OPT_FLOAT, OFF(sp.repeat_penalty), SAMPLING, 1e-6, 100, "X",
     "repetition penalty, 1 = off (default 1.0)"},
    {NULL, "--repeat-last-n", OPT_INT, OFF(sp.repeat_last_n), SAMPLING, 0, 1 << 20, "N",
     "tokens considered by the penalty (default 64)"},
    {"-s", "--seed", OPT_U64, OFF(sp.seed), SAMPLING, 0, 0, "N", "random seed (default 42)"},
    {NULL, "--system", OPT_STR, OFF(system), CMD_CHAT, 0, 0, "TEXT", "system prompt (default: the model's)"},
    {NULL, "--json", OPT_FLAG, OFF(json), CMD_TOKENIZE, 0, 0, NULL, "print a JSON array"},
    {NULL, "--no-parse-special", OPT_FLAG, OFF(no_special), CMD_GENERATE | CMD_TOKENIZE, 0, 0, NULL,
     "treat special-token text like <|im_start|> as plain text"},
    {NULL, "--no-display-prompt", OPT_FLAG, OFF(no_display_prompt), CMD_GENERATE, 0, 0, NULL,
     "print only the generated text, not the prompt before it (as llama.cpp's)"},
    {"-p", "--n-prompt", OPT_STR, OFF(bench_p), CMD_BENCH, 0, 0, "N,N,..",
     "prompt tokens of the pp tests, 0 = none (default 512)"},
    {"-n", "--n-gen", OPT_STR, OFF(bench_n), CMD_BENCH, 0, 0, "N,N,..",
     "generated tokens of the tg tests, 0 = none (default 128)"},
    {"-d", "--depth", OPT_STR, OFF(bench_d), CMD_BENCH, 0, 0, "N,N,..",
     "context depths before each test (default 0)"},
    {"-r", "--repetitions", OPT_INT, OFF(reps), CMD_BENCH, 1, 1000, "N", "repetitions per test (default 5)"},
    {NULL, "--csv", OPT_FLAG, OFF(csv), CMD_BENCH, 0, 0, NULL, "print CSV instead of the markdown table"},
    {NULL, "--no-warmup", OPT_FLAG, OFF(no_warmup), CMD_BENCH, 0, 0, NULL,
     "skip the warm-up run before the repetitions (long contexts)"},
    {NULL, "--interleave", OPT_FLAG, OFF(interleave), CMD_BENCH, 0, 0, NULL,
     "tg tests: one context per depth, one token in each in turn (all depths see the same machine conditions)"},
    {NULL, "--json", OPT_FLAG, OFF(json), CMD_BENCH, 0, 0, NULL,
     "print a JSON array of objects instead of the markdown table"},
    {NULL, "--chunks", OPT_INT, OFF(chunks), CMD_PERPLEXITY, 1, 1 << 30, "N", "evaluate at most N chunks (default all)"},
    {NULL, "--adapter", OPT_STR, OFF(adapter), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_MERGE | CMD_EVAL | CMD_LINEARIZE | CMD_CONVERT | CMD_FINETUNE | CMD_PROBE | CMD_SERVER, 0, 0,
     "FILE", "linearized model from an adapter GGUF (still convert / linearize / finetune; its LoRA too); linearize, finetune: start from it"},
    {NULL, "--lora", OPT_STR, OFF(lora), RUNS_LORA, 0, 0, "FILE",
     "apply a LoRA adapter GGUF (llama.cpp's layout) on the fly, after --adapter"},
    {NULL, "--lora-scale", OPT_FLOAT, OFF(lora_scale), RUNS_LORA, -1e6, 1e6, "X",
     "scale of the LoRA update (default 1; llama.cpp's --lora-scaled)"},
    {"-o", "--output", OPT_STR, OFF(output), CMD_CONVERT | CMD_MERGE | TRAINS, 0, 0, "FILE", "output GGUF (required)"},
    {NULL, "--data", OPT_DATA, OFF(data), CMD_LINEARIZE, 0, 0, "FILE", "UTF-8 training text (repeat for more files; required)"},
    {NULL, "--data", OPT_DATA, OFF(data), CMD_FINETUNE, 0, 0, "FILE",
     "UTF-8 training text, or instruction data as .jsonl (repeat for more files; required)"},
    {NULL, "--tokens", OPT_LLONG, OFF(tp.tokens), TRAINS, 1, 1e15, "N",
     "training tokens; steps = N / (seq * batch) (default 1048576)"},
    {NULL, "--seq", OPT_INT, OFF(tp.seq), TRAINS, 2, 1 << 20, "N", "tokens per training sequence (default 1024)"},
    {NULL, "--batch", OPT_INT, OFF(tp.batch), TRAINS, 1, 1 << 20, "N",
     "sequences per optimizer step, gradients accumulated (default 8)"},
    {NULL, "--lr", OPT_FLOAT, OFF(tp.lr), CMD_LINEARIZE, 1e-12, 10, "X", "peak learning rate (default 1e-2)"},
    {NULL, "--lr", OPT_FLOAT, OFF(tp.lr), CMD_FINETUNE, 1e-12, 10, "X", "peak learning rate (default 1e-4)"},
    {NULL, "--lr-min", OPT_FLOAT, OFF(tp.lr_min), TRAINS, 0, 10, "X", "final learning rate of the cosine (default lr/10)"},
    {NULL, "--warmup", OPT_INT, OFF(tp.warmup), TRAINS, 0, 1 << 30, "N", "warm-up steps (default 5% of the steps)"},
    {NULL, "--weight-decay", OPT_FLOAT, OFF(tp.weight_decay), TRAINS, 0, 10, "X", "AdamW weight decay (default 0)"},
    {NULL, "--clip", OPT_FLOAT, OFF(tp.clip), TRAINS, 0, 1e9, "X", "gradient-norm clip, 0 = off (default 1)"},
    {NULL, "--val", OPT_FLOAT, OFF(tp.val_frac), TRAINS, 0, 0.9, "F",
     "held-out fraction of the sequences for validation (default 0.02)"},
    {NULL, "--val-max", OPT_INT, OFF(tp.val_max), TRAINS, 0, 1 << 20, "N", "at most N validation sequences (default 32)"},
    {"-s", "--seed", OPT_U64, OFF(tp.seed), TRAINS | CMD_EVAL, 0, 0, "N",
     "linearize / finetune: data shuffling (and LoRA init) seed; eval: sample seed (default 0)"},
    {NULL, "--lora-rank", OPT_INT, OFF(lora_rank), CMD_FINETUNE, 1, 65536, "R", "LoRA rank (default 8)"},
    {NULL, "--lora-alpha", OPT_FLOAT, OFF(lora_alpha), CMD_FINETUNE, 1e-6, 1e6, "A",
     "LoRA alpha: the update is scaled by alpha / rank (default 16)"},
    {NULL, "--lora-dropout", OPT_FLOAT, OFF(lora_dropout), CMD_FINETUNE, 0, 0.99, "P",
     "dropout on the LoRA inputs while training (default 0)"},
    {NULL, "--lora-targets", OPT_STR, OFF(lora_targets), CMD_FINETUNE, 0, 0, "T,T,..",
     "matrices that get a LoRA: q, k, v, o, gate, up, down, all (default q,k,v,o)"},
    {NULL, "--fp32", OPT_FLAG, OFF(fp32), CMD_FINETUNE, 0, 0, NULL,
     "--device cuda: frozen weights and their products in fp32 instead of bf16 (slower)"},
    {NULL, "--train-attn", OPT_FLAG, OFF(train_attn), CMD_FINETUNE, 0, 0, NULL,
     "also train the attention plan's own parameters (feature maps, gate, window factor)"},
    {NULL, "--lengths", OPT_STR, OFF(lengths), CMD_EVAL, 0, 0, "L,L,..",
     "prompt lengths in tokens, k = 1024 (default 1k,2k,4k,8k)"},
    {NULL, "--samples", OPT_INT, OFF(samples), CMD_EVAL, 1, 1 << 20, "N", "samples per task and length (default 10)"},
    {NULL, "--task", OPT_STR, OFF(probe_task), CMD_PROBE, 0, 0, "NAME", "a built-in still eval task (niah_single_1, ...)"},
    {NULL, "--length", OPT_INT, OFF(probe_length), CMD_PROBE, 16, 1 << 22, "N", "the task prompt's length in tokens (default 4096)"},
    {NULL, "--sample", OPT_INT, OFF(probe_sample), CMD_PROBE, 0, 1 << 30, "I", "which sample of the task (default 0, as still eval's first)"},
    {NULL, "--ordinary", OPT_INT, OFF(probe_ordinary), CMD_PROBE, 0, 4096, "N",
     "also N ordinary queries spread over the prompt: the linear state's share against exact softmax's there (default 0)"},
    {NULL, "--needle", OPT_STR, OFF(needle), CMD_PROBE, 0, 0, "TEXT",
     "the text whose tokens are followed (default: the answer); -f: required"},
    {NULL, "--answer", OPT_STR, OFF(answer), CMD_PROBE, 0, 0, "TEXT", "the answer the queries predict (-f: required)"},
    {NULL, "--haystack", OPT_STR, OFF(haystack), CMD_PROBE, 0, 0, "FILE", "prose for the task's haystack (as still eval)"},
    {NULL, "--tasks", OPT_STR, OFF(task_file), CMD_PROBE, 0, 0, "FILE", "a still eval task file; --sample picks the item"},
    {"-s", "--seed", OPT_U64, OFF(tp.seed), CMD_PROBE, 0, 0, "N", "sample seed, as still eval's (default 0)"},
    {NULL, "--tasks", OPT_STR, OFF(task_file), CMD_EVAL, 0, 0, "FILE",
     "your own retrieval tasks, one JSON object a line (context or haystack + needles, question, accepted answers; "
     "README, still eval)"},
    {NULL, "--haystack", OPT_STR, OFF(haystack), CMD_EVAL, 0, 0, "FILE",
     "prose for the essay haystacks (default ../shared/data/corpus/austen/emma.txt when present)"},
    {NULL, "--compare", OPT_DATA, OFF(data), CMD_EVAL, 0, 0, "NAME=OPTS",
     "a configuration to run, e.g. 'swa=--attn swa --window 896' (repeat for a column each)"},
    {NULL, "--json", OPT_STR, OFF(json_out), CMD_EVAL, 0, 0, "FILE", "results as JSON (default still-eval.json)"},
    {NULL, "--dump", OPT_STR, OFF(dump), CMD_EVAL, 0, 0, "FILE", "write every prompt as JSON lines (- = stdout)"},
    {NULL, "--dry-run", OPT_FLAG, OFF(dry_run), CMD_EVAL, 0, 0, NULL, "build the prompts (see --dump) but run nothing"},
    {NULL, "--ckpt-every", OPT_INT, OFF(tp.ckpt_every), TRAINS, 0, 1 << 30, "N",
     "checkpoint every N steps, 0 = never (default 10; 500 with --device cuda)"},
    {NULL, "--ckpt", OPT_STR, OFF(tp.ckpt_path), TRAINS, 0, 0, "FILE", "checkpoint file (default: OUTPUT.ckpt)"},
    {NULL, "--resume", OPT_FLAG, OFF(tp.resume), TRAINS, 0, 0, NULL,
     "continue from the checkpoint (same settings and data required)"},
    {NULL, "--attn", OPT_STR, OFF(ap.kind), RUNS_MODEL & ~CMD_BENCH, 0, 0, "KIND",
     "attention of every layer: softmax (default), swa, lolcats, liger, still, gdn, dsa"},
    {NULL, "--attn", OPT_STR, OFF(ap.kind), CMD_BENCH, 0, 0, "KIND,KIND,..",
     "attention kinds to compare, each for every layer: softmax, swa, lolcats, liger, still, gdn, dsa "
     "(default: the model's own plan)"},
    {NULL, "--softmax-layers", OPT_STR, OFF(ap.softmax_layers), RUNS_MODEL, 0, 0, "L,L,..",
     "layers kept as softmax (inter-layer hybrid)"},
    {NULL, "--plan", OPT_STR, OFF(ap.plan), RUNS_MODEL, 0, 0, "SPEC",
     "any mix of kinds per layer, in place of --attn and --softmax-layers: KIND[/key=value..]:LAYERS groups, "
     "later groups re-assigning the layers they name, e.g. gdn:0-29,softmax:3,7,11 (docs/plans.md)"},
    {NULL, "--window", OPT_INT, OFF(ap.window), RUNS_MODEL, 1, 1 << 22, "W", "swa / liger window (default 64)"},
    {NULL, "--chunk", OPT_INT, OFF(ap.chunk), RUNS_MODEL | CMD_SALIENCY, 1, 1 << 16, "C",
     "lolcats / still chunk size (default 64)"},
    {NULL, "--top-k", OPT_INT, OFF(topk), CMD_SALIENCY, 1, 1024, "K", "tokens selected per chunk (default 6)"},
    {NULL, "--feature-dim", OPT_INT, OFF(ap.feature_dim), RUNS_MODEL, 1, 4096, "F", "Hedgehog feature size (default 64)"},
    {NULL, "--budget", OPT_INT, OFF(ap.budget), RUNS_MODEL, 0, 1 << 22, "M",
     "still: softmax slots per head (default 896; 0 = uncapped)"},
    {NULL, "--layer-budgets", OPT_STR, OFF(ap.layer_budgets), RUNS_MODEL, 0, 0, "L=M,A-B=M,..",
     "still: per-layer budgets for the layers named (the others keep --budget); e.g. 14-18=8320"},
    {NULL, "--lambda", OPT_INT, OFF(ap.lambda), RUNS_MODEL, -1, 1 << 16, "N",
     "still: tokens kept per chunk (default -1: from the budget)"},
    {NULL, "--routing", OPT_STR, OFF(ap.routing), RUNS_MODEL, 0, 0, "R",
     "still: saliency (default), random, keynorm, qk, position, none"},
    {NULL, "--per-kv-head", OPT_FLAG, OFF(ap.per_kv_head), RUNS_MODEL, 0, 0, NULL, "still: select per KV head"},
    {NULL, "--selection", OPT_STR, OFF(ap.selection), RUNS_MODEL, 0, 0, "S",
     "still: chunk (default: lambda tokens per leaving chunk, kept forever) or global (the best budget-2C "
     "tokens of the whole history; the worst are evicted into the linear state)"},
    {NULL, "--sel-span", OPT_INT, OFF(ap.sel_span), RUNS_MODEL, 0, 64, "R",
     "still: a leaving token ranks by the best score within R positions of it (neighbours of a salient token "
     "are kept with it; default 0)"},
    {NULL, "--no-linear", OPT_FLAG_OFF, OFF(ap.linear), RUNS_MODEL, 0, 0, NULL, "still: drop the linear branch"},
    {NULL, "--no-linear-layers", OPT_STR, OFF(ap.no_linear_layers), RUNS_MODEL, 0, 0, "L,A-B,..",
     "still: drop the linear branch in the layers named only (the others keep it); e.g. 14-15,20-22; '' turns it "
     "back on everywhere (over an adapter's list)"},
    {NULL, "--feature-map", OPT_STR, OFF(ap.feature_map), RUNS_MODEL, 0, 0, "F", "still: npmap (default) or hedgehog"},
    {NULL, "--no-gate", OPT_FLAG_OFF, OFF(ap.gate), RUNS_MODEL, 0, 0, NULL, "still: no gate on the linear branch"},
    {NULL, "--gate-den", OPT_FLAG, OFF(ap.gate_den), RUNS_MODEL, 0, 0, NULL,
     "still: the gate also scales the linear state's share of the denominator, per channel (docs/gate-den.md)"},
    {NULL, "--attn-seed", OPT_U64, OFF(ap.seed), RUNS_MODEL | CMD_SALIENCY, 0, 0, "N",
     "seed of new attention parameters and random routing (default 0)"},
    {NULL, "--sel-cache", OPT_STR, OFF(sel_cache), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL | CMD_CONVERT, 0,
     0, "TYPE", "still: storage of the selected tokens' keys and values: f16, f32 (CPU only), or q8 (8 bits and a scale per token; CPU and CUDA); "
     "default: the plan's (an adapter's still.attn.sel_cache, else f16); convert writes it into the plan"},
    {NULL, "--fixed-threads", OPT_FLAG, OFF(fixed_threads), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL | CMD_SERVER,
     0, 0, NULL, "CPU decode steps always on all -t threads (default: a governor also tries half of them and keeps "
     "the faster, so that a busy machine does not collapse decode)"},
    {NULL, "--matvec", OPT_STR, OFF(matvec), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL | CMD_SERVER, 0, 0,
     "PATH", "CPU single-token products: int8 (default: 8-bit activations, integer dot products on "
     "Q4_0/Q4_1/Q5_x/Q8_0/Q4_K/Q5_K/Q6_K weights, the best path of this CPU; int8-portable, int8-avx2, int8-vnni (AVX-512), int8-avxvnni (VEX) force one) "
     "or float (float activations, the prefill's products to rounding); --device cuda: float"},
    {NULL, "--prefill", OPT_STR, OFF(prefill), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL, 0, 0,
     "PATH", "CPU products of several tokens: float (default) or int8 (8-bit activations as --matvec int8's, integer "
     "products on Q4_0/Q4_1/Q8_0 weights where the CPU has AVX-512 VNNI, float elsewhere)"},
    {NULL, "--device", OPT_STR, OFF(device), CMD_GENERATE | CMD_CHAT | CMD_PERPLEXITY | CMD_BENCH | CMD_EVAL | TRAINS | CMD_SERVER,
     0, 0, "DEV", "cpu (default) or cuda (GPU 0: every kind; linearize: still, lolcats, gdn)"},
    {NULL, "--outtype", OPT_STR, OFF(outtype), CMD_CONVERT | TRAINS, 0, 0, "TYPE",
     "adapter parameters as f32 (default) or f16 (half the file)"},
    {"-v", "--verbose", OPT_FLAG, OFF(verbose), ALL_MODEL, 0, 0, NULL, "print timing details to stderr"},
};
#define N_OPTS (sizeof OPTS / sizeof OPTS[0])

static const char *cmd_summary(int cmd) {
    switch (cmd) {
    case CMD_GENERATE: return "generate text from a prompt, streaming tokens as they are produced";
    case CMD_CHAT: return "multi-turn ChatML chat (turns from -p, then stdin; the model state is kept)";
    case CMD_TOKENIZE: return "print the token ids of a text, one per line";
    case CMD_PERPLEXITY: return "perplexity of a text file (llama-perplexity protocol)";
    case CMD_INFO: return "print a model's metadata and tensor table";
    case CMD_BENCH: return "benchmark prompt processing and generation (llama-bench style table)";
    case CMD_CONVERT: return "write an adapter GGUF for --attn KIND with freshly initialised (untrained) parameters";
    case CMD_MERGE: return "write one self-describing GGUF: the base model plus an adapter";
    case CMD_SALIENCY: return "local-global consistency of self-saliency selection vs full attention (STILL paper)";
    case CMD_EVAL: return "long-context tasks (RULER needles, passkey, variable tracking, bAbI in long prose): still eval TASK[,TASK...] -m M";
    case CMD_LINEARIZE: return "stage-1 attention transfer: train --attn KIND's new parameters to reproduce softmax attention";
    case CMD_FINETUNE: return "stage 2: LoRA fine-tuning of a (linearized) model on next-token prediction";
    case CMD_SERVER: return "an OpenAI-compatible HTTP server (chat and text completions, streaming, slots that keep each conversation's state)";
    case CMD_PROBE: return "where a retrieval prompt's needle goes, layer by layer: the teacher's attention to it against the plan's softmax and linear parts";
    }
    return "";
}

void cli_print_help(int cmd, const char *cmd_name) {
    printf("usage: still %s [options]\n%s\n\noptions:\n", cmd_name, cmd_summary(cmd));
    for (size_t i = 0; i < N_OPTS; i++) {
        const opt_def *d = &OPTS[i];
        if (!(d->cmds & cmd)) continue;
        char left[64];
        snprintf(left, sizeof left, "%s%s%s%s%s", d->short_name ? d->short_name : "", d->short_name ? ", " : "    ",
                 d->long_name, d->metavar ? " " : "", d->metavar ? d->metavar : "");
        printf("  %-28s %s\n", left, d->help);
    }
    printf("  %-28s %s\n", "-h, --help", "show this help");
}

static int parse_value(const opt_def *d, const char *cmd_name, const char *flag, const char *arg, cli_opts *o) {
    char *base = (char *)o + d->offset;
    char *end;
    errno = 0;
    switch (d->kind) {
    case OPT_STR:
        *(const char **)base = arg;
        return 0;
    case OPT_INT: {
        long v = strtol(arg, &end, 10);
        if (errno || end == arg || *end || v < d->lo || v > d->hi) {
            fprintf(stderr, "still %s: error: %s expects an integer in [%.0f, %.0f], got '%s'\n", cmd_name, flag,
                    d->lo, d->hi, arg);
            return -1;
        }
        *(int *)base = (int)v;
        return 0;
    }
    case OPT_FLOAT: {
        double v = strtod(arg, &end);
        if (errno || end == arg || *end || !isfinite(v) || v < d->lo || v > d->hi) {
            fprintf(stderr, "still %s: error: %s expects a number in [%g, %g], got '%s'\n", cmd_name, flag, d->lo,
                    d->hi, arg);
            return -1;
        }
        *(float *)base = (float)v;
        return 0;
    }
    case OPT_LLONG: {
        long long v = strtoll(arg, &end, 10);
        if (errno || end == arg || *end || v < d->lo || v > d->hi) {
            fprintf(stderr, "still %s: error: %s expects an integer in [%.0f, %.0f], got '%s'\n", cmd_name, flag,
                    d->lo, d->hi, arg);
            return -1;
        }
        *(long long *)base = v;
        return 0;
    }
    case OPT_DATA:
        if (o->n_data >= CLI_MAX_DATA) {
            fprintf(stderr, "still %s: error: at most %d %s files\n", cmd_name, CLI_MAX_DATA, flag);
            return -1;
        }
        o->data[o->n_data++] = arg;
        return 0;
    case OPT_U64: {
        if (arg[0] == '-') goto bad_u64;
        unsigned long long v = strtoull(arg, &end, 10);
        if (errno || end == arg || *end) goto bad_u64;
        *(uint64_t *)base = v;
        return 0;
    bad_u64:
        fprintf(stderr, "still %s: error: %s expects a non-negative integer, got '%s'\n", cmd_name, flag, arg);
        return -1;
    }
    }
    return -1;
}

/* The STILL_PLAN_* bit of an attention option (by its offset in cli_opts). */
static unsigned plan_bit(size_t offset) {
    static const struct { size_t offset; unsigned bit; } bits[] = {
        {OFF(ap.window), STILL_PLAN_WINDOW}, {OFF(ap.chunk), STILL_PLAN_CHUNK},
        {OFF(ap.budget), STILL_PLAN_BUDGET}, {OFF(ap.lambda), STILL_PLAN_LAMBDA},
        {OFF(ap.routing), STILL_PLAN_ROUTING}, {OFF(ap.per_kv_head), STILL_PLAN_PER_KV_HEAD},
        {OFF(ap.linear), STILL_PLAN_LINEAR}, {OFF(ap.seed), STILL_PLAN_SEED}, {OFF(ap.selection), STILL_PLAN_SELECTION},
        {OFF(ap.sel_span), STILL_PLAN_SEL_SPAN}, {OFF(ap.layer_budgets), STILL_PLAN_LAYER_BUDGETS},
        {OFF(ap.no_linear_layers), STILL_PLAN_NO_LINEAR_LAYERS}, {OFF(ap.gate_den), STILL_PLAN_GATE_DEN},
        {OFF(ap.softmax_layers), STILL_PLAN_SOFTMAX_LAYERS}, {OFF(ap.feature_dim), STILL_PLAN_FEATURE_DIM},
        {OFF(ap.feature_map), STILL_PLAN_FEATURE_MAP}, {OFF(ap.gate), STILL_PLAN_GATE},
        {OFF(ap.plan), STILL_PLAN_PLAN},
    };
    for (size_t i = 0; i < sizeof bits / sizeof bits[0]; i++)
        if (bits[i].offset == offset) return bits[i].bit;
    return 0;
}

int cli_parse(int cmd, const char *cmd_name, int argc, char **argv, cli_opts *o) {
    memset(o, 0, sizeof *o);
    o->cmd = cmd;
    o->n_predict = cmd == CMD_CHAT || cmd == CMD_SERVER ? 512 : 128;
    o->host = "127.0.0.1";
    o->port = 8080;
    o->n_parallel = 4;
    o->queue_max = 64;
    o->http_threads = 256;
    o->cache_mib = 1024;
    o->n_batch = 512;
    o->bench_p = "512";
    o->bench_n = "128";
    o->bench_d = "0";
    o->reps = 5;
    o->topk = 6;
    o->sp = still_sampler_default_params();
    o->ap = still_attn_default_params();
    o->tp = still_train_default_params();
    o->tp.ckpt_every = -1;   /* not given: cmd_linearize picks the device's default */
    if (cmd == CMD_FINETUNE) {
        const still_finetune_params f = still_finetune_default_params();
        o->tp.lr = f.train.lr;
        o->lora_rank = f.lora_rank, o->lora_alpha = f.lora_alpha, o->lora_dropout = f.lora_dropout;
        o->lora_targets = f.lora_targets;
    }
    o->lora_scale = 1.0f;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            cli_print_help(cmd, cmd_name);
            return 1;
        }
        /* --flag=value form */
        char name[64];
        const char *inline_val = NULL;
        const char *eq = strncmp(a, "--", 2) == 0 ? strchr(a, '=') : NULL;
        if (eq && (size_t)(eq - a) < sizeof name) {
            memcpy(name, a, (size_t)(eq - a));
            name[eq - a] = 0;
            inline_val = eq + 1;
            a = name;
        }
        const opt_def *d = NULL;
        for (size_t j = 0; j < N_OPTS && !d; j++)
            if ((OPTS[j].cmds & cmd) && ((OPTS[j].short_name && !strcmp(a, OPTS[j].short_name)) ||
                                          !strcmp(a, OPTS[j].long_name)))
                d = &OPTS[j];
        if (!d) {
            fprintf(stderr, "still %s: error: unknown option '%s' (see still %s --help)\n", cmd_name, argv[i],
                    cmd_name);
            return -1;
        }
        if (cmd != CMD_SALIENCY) o->plan_given |= plan_bit(d->offset);
        if (d->kind == OPT_FLAG || d->kind == OPT_FLAG_OFF) {
            if (inline_val) {
                fprintf(stderr, "still %s: error: %s takes no value\n", cmd_name, a);
                return -1;
            }
            *(int *)((char *)o + d->offset) = d->kind == OPT_FLAG;
            continue;
        }
        const char *val = inline_val;
        if (!val) {
            if (i + 1 >= argc) {
                fprintf(stderr, "still %s: error: %s needs a value (%s)\n", cmd_name, a, d->metavar);
                return -1;
            }
            val = argv[++i];
        }
        if (parse_value(d, cmd_name, a, val, o)) return -1;
        if (d->offset == OFF(ap.kind)) o->attn_given = 1, o->kind_given = 1;
        if (d->offset == OFF(ap.plan)) o->attn_given = 1;   /* a plan sets the attention as --attn does */
    }
    if (o->kind_given && o->ap.plan) {
        fprintf(stderr, "still %s: error: --plan gives every layer its kind: drop --attn\n", cmd_name);
        return -1;
    }
    if (o->attn_given && cmd != CMD_BENCH && strchr(o->ap.kind, ',')) {
        fprintf(stderr, "still %s: error: --attn takes one kind, got '%s' (lists are for still bench)\n", cmd_name,
                o->ap.kind);
        return -1;
    }
    if (o->adapter && o->attn_given) {
        fprintf(stderr, "still %s: error: give either %s or --adapter, not both\n", cmd_name, o->ap.plan ? "--plan" : "--attn");
        return -1;
    }
    if (o->adapter && (o->plan_given & ~(unsigned)STILL_PLAN_OVERRIDABLE)) {
        fprintf(stderr, "still %s: error: --softmax-layers, --feature-dim, --feature-map and --no-gate are fixed "
                        "by the adapter's parameters; only --window, --chunk, --budget, --layer-budgets, --lambda, "
                        "--routing, --per-kv-head, --selection, --sel-span, --no-linear, --no-linear-layers, --gate-den and --attn-seed can override its plan\n", cmd_name);
        return -1;
    }
    if (o->plan_given && !o->adapter && !o->attn_given) {
        fprintf(stderr, "still %s: error: attention options need --attn KIND or --adapter FILE\n", cmd_name);
        return -1;
    }
    if (o->lora_scale != 1.0f && !o->lora) {
        fprintf(stderr, "still %s: error: --lora-scale needs --lora FILE\n", cmd_name);
        return -1;
    }
    if (o->outtype && strcmp(o->outtype, "f32") && strcmp(o->outtype, "f16")) {
        fprintf(stderr, "still %s: error: --outtype takes f32 or f16, got '%s'\n", cmd_name, o->outtype);
        return -1;
    }
    if (o->sel_cache && strcmp(o->sel_cache, "f16") && strcmp(o->sel_cache, "f32") && strcmp(o->sel_cache, "q8")) {
        fprintf(stderr, "still %s: error: --sel-cache takes f16, f32 or q8, got '%s'\n", cmd_name, o->sel_cache);
        return -1;
    }
    if (o->sel_cache) {   /* also the plan's store: an adapter's is replaced, convert writes it */
        o->ap.sel_cache = o->sel_cache;
        o->plan_given |= STILL_PLAN_SEL_CACHE;
    }
    if (o->matvec && cli_matvec(o) < 0) {
        fprintf(stderr, "still %s: error: --matvec takes float, int8, int8-portable, int8-avx2, int8-vnni or int8-avxvnni, got '%s'\n",
                cmd_name, o->matvec);
        return -1;
    }
    if (o->prefill && cli_prefill(o) < 0) {
        fprintf(stderr, "still %s: error: --prefill takes float or int8, got '%s'\n", cmd_name, o->prefill);
        return -1;
    }
    if (o->device && strcmp(o->device, "cpu") && strcmp(o->device, "cuda")) {
        fprintf(stderr, "still %s: error: --device takes cpu or cuda, got '%s'\n", cmd_name, o->device);
        return -1;
    }
    if (!o->model) {
        fprintf(stderr, "still %s: error: no model given (use -m FILE)\n", cmd_name);
        return -1;
    }
    return 0;
}

int cli_device(const cli_opts *o) {
    return o->device && !strcmp(o->device, "cuda") ? STILL_DEVICE_CUDA : STILL_DEVICE_CPU;
}

int cli_matvec(const cli_opts *o) {
    static const char *const names[] = {"float", "int8", "int8-portable", "int8-avx2", "int8-vnni", "int8-avxvnni"};
    if (!o->matvec) return STILL_MATVEC_DEFAULT;   /* int8 on the CPU, float with --device cuda */
    for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
        if (!strcmp(o->matvec, names[i])) return STILL_MATVEC_FLOAT + i;   /* STILL_MATVEC_* in this order */
    return -1;
}

int cli_prefill(const cli_opts *o) {
    if (!o->prefill || !strcmp(o->prefill, "float")) return STILL_PREFILL_FLOAT;
    return !strcmp(o->prefill, "int8") ? STILL_PREFILL_INT8 : -1;
}

int cli_sel_cache(const cli_opts *o) {
    if (!o->sel_cache) return STILL_SEL_PLAN;   /* the plan's (an adapter's, else f16) */
    if (!strcmp(o->sel_cache, "f16")) return STILL_SEL_F16;
    return !strcmp(o->sel_cache, "f32") ? STILL_SEL_F32 : STILL_SEL_Q8;   /* validated by cli_parse */
}

int cli_load_model(const cli_opts *o, still_model **m) {
    if (o->threads > 0) omp_set_num_threads(o->threads);
    still_err err = {0};
    if (still_model_load(o->model, m, &err)) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        return 1;
    }
    int rc = STILL_OK, from_flags = 0;
    if (o->adapter) rc = still_model_load_adapter_with(*m, o->adapter, &o->ap, o->plan_given, &err);
    else if ((o->cmd & RUNS_MODEL) && o->attn_given) rc = still_model_set_attention(*m, &o->ap, &err), from_flags = 1;
    if (!rc && o->lora) rc = still_model_load_lora(*m, o->lora, o->lora_scale, &err);
    if (rc) {
        fprintf(stderr, "still: error: %s\n", err.msg);
        still_model_free(*m);
        *m = NULL;
        /* a plan the flags alone made (no adapter file) that the model refuses: a bad command line */
        return from_flags && rc == STILL_E_ARG ? 2 : 1;
    }
    return 0;
}

int cli_read_file(const char *path, char **data, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "still: error: cannot open '%s': %s\n", path, strerror(errno));
        return -1;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (n < cap) break;
        char *nb = realloc(buf, (cap *= 2) + 1);
        if (!nb) { free(buf); buf = NULL; break; }
        buf = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        fprintf(stderr, "still: error: cannot read '%s'\n", path);
        return -1;
    }
    buf[n] = 0;
    *data = buf;
    *len = n;
    return 0;
}

int cli_input_text(const cli_opts *o, const char *cmd_name, char **text, size_t *len) {
    if (!o->prompt == !o->file) {
        fprintf(stderr, "still %s: error: give exactly one of -p TEXT or -f FILE\n", cmd_name);
        return 2;
    }
    if (o->file) return cli_read_file(o->file, text, len) ? 1 : 0;
    *len = strlen(o->prompt);
    *text = strdup(o->prompt);
    if (!*text) {
        fprintf(stderr, "still %s: error: out of memory\n", cmd_name);
        return 1;
    }
    return 0;
}

void cli_print_token(const still_model *m, int32_t id) {
    char buf[256];
    size_t n = still_token_to_piece(m, id, buf, sizeof buf);
    fwrite(buf, 1, n < sizeof buf ? n : sizeof buf, stdout);
}

size_t cli_peak_rss(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (size_t)ru.ru_maxrss * 1024;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}
