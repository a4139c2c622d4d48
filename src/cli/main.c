/* still — command-line entry point: dispatches to one command per verb. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

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
};

static void usage(FILE *f) {
    fprintf(f, "usage: still COMMAND [options]     (still COMMAND --help for its options)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-12s %s\n", COMMANDS[i].name, COMMANDS[i].help);
}

int main(int argc, char **argv) {
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
