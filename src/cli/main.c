/* still — command-line entry point: dispatches to one command per verb. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *openblas_get_corename(void);

/* OpenBLAS picks its kernels for the CPU when it loads. Debian 12's
 * OpenBLAS 0.3.21 does not know CPUs newer than itself (e.g. Emerald Rapids)
 * and falls back to its SSE3 "Prescott" kernels, 3-5x slower than what the
 * CPU can run. When that happened and the CPU has AVX-512 (or AVX2), name
 * the right kernel family and start the program again, once; an explicit
 * OPENBLAS_CORETYPE is always respected. */
static void openblas_fix_coretype(char **argv) {
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename();
    if (!core || strcmp(core, "Prescott")) return;
    __builtin_cpu_init();
    const char *want = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? "SkylakeX"
                       : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? "Haswell"
                                                                                         : NULL;
    if (!want) return;
    setenv("OPENBLAS_CORETYPE", want, 1);
    execv("/proc/self/exe", argv);   /* returns only on failure: carry on with the slow kernels */
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *help;
} COMMANDS[] = {
    {"generate", cmd_generate, "generate text from a prompt (streams tokens)"},
    {"chat", cmd_chat, "multi-turn ChatML chat, model state kept between turns"},
    {"tokenize", cmd_tokenize, "print token ids of a text"},
    {"perplexity", cmd_perplexity, "perplexity of a text file"},
    {"info", cmd_info, "model metadata and tensor table"},
    {"bench", cmd_bench, "prompt-processing / generation benchmark"},
    {"convert", cmd_convert, "write an untrained adapter for an attention kind"},
    {"merge", cmd_merge, "base model + adapter -> one GGUF"},
    {"saliency", cmd_saliency, "self-saliency local-global consistency analysis"},
    {"eval", cmd_eval, "long-context evaluation: needle, passkey, variable tracking, bAbI tasks"},
    {"linearize", cmd_linearize, "stage-1 training: distil softmax attention into --attn KIND"},
    {"probe", cmd_probe, "diagnosis: where a needle goes in a linearized model, layer by layer"},
    {"finetune", cmd_finetune, "stage-2 training: LoRA fine-tuning through the whole (hybrid) model"},
    {"server", cmd_server, "OpenAI-compatible HTTP server: completions, streaming, per-conversation state"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: still COMMAND [options]     (still COMMAND --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-12s %s\n", COMMANDS[i].name, COMMANDS[i].help);
}

int main(int argc, char **argv) {
    openblas_fix_coretype(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (!strcmp(argv[1], COMMANDS[i].name)) return COMMANDS[i].fn(argc - 2, argv + 2);
    fprintf(stderr, "still: error: unknown command '%s' (see still --help)\n", argv[1]);
    return 2;
}
