/* logits_tool MODEL IDS_FILE OUT_FILE [--chunk N] [--matvec float|int8|int8-portable|int8-avx2|int8-vnni|int8-avxvnni]
 * Runs the prompt (one token id per line in IDS_FILE) through the engine as a
 * prefill in chunks of N tokens (default 512) and writes the float32 logits of
 * every position (n_tok x n_vocab, little-endian, row-major) to OUT_FILE.
 * --matvec: the single-token products (chunks of one token); default the
 * engine's (int8 on the CPU).
 * Used by tests/python/test_logits.py to compare with the numpy reference. */
#include "still.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: logits_tool MODEL IDS_FILE OUT_FILE [--chunk N] [--matvec float|int8|int8-portable|int8-avx2|int8-vnni|int8-avxvnni]\n");
        return 2;
    }
    int chunk = 512, matvec = STILL_MATVEC_DEFAULT;
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--chunk") && i + 1 < argc) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--matvec") && i + 1 < argc) {
            static const char *const names[] = {"float", "int8", "int8-portable", "int8-avx2", "int8-vnni",
                                                "int8-avxvnni"};
            matvec = -1;
            for (int k = 0; k < 6; k++)
                if (!strcmp(argv[i + 1], names[k])) matvec = STILL_MATVEC_FLOAT + k;   /* STILL_MATVEC_* in this order */
            if (matvec < 0) { fprintf(stderr, "logits_tool: unknown --matvec '%s'\n", argv[i + 1]); return 2; }
            i++;
        } else { fprintf(stderr, "logits_tool: unknown argument '%s'\n", argv[i]); return 2; }
    }
    FILE *f = fopen(argv[2], "r");
    if (!f) { fprintf(stderr, "logits_tool: cannot open %s\n", argv[2]); return 1; }
    size_t cap = 1024, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    long v;
    while (fscanf(f, "%ld", &v) == 1) {
        if (n == cap) ids = realloc(ids, (cap *= 2) * sizeof *ids);
        ids[n++] = (int32_t)v;
    }
    fclose(f);
    if (n == 0) { fprintf(stderr, "logits_tool: no token ids in %s\n", argv[2]); return 1; }

    still_err err = {0};
    still_model *m;
    if (still_model_load(argv[1], &m, &err)) { fprintf(stderr, "logits_tool: %s\n", err.msg); return 1; }
    still_model_info info = still_model_get_info(m);
    still_context *ctx;
    still_context_params cp = {.n_ctx = (int)n, .n_batch = chunk, .matvec = matvec};
    if (still_context_create(m, cp, &ctx, &err)) { fprintf(stderr, "logits_tool: %s\n", err.msg); return 1; }
    float *logits = malloc(n * (size_t)info.n_vocab * sizeof(float));
    if (!logits || still_decode(ctx, ids, (int)n, logits, 1, &err)) {
        fprintf(stderr, "logits_tool: %s\n", err.msg);
        return 1;
    }
    FILE *o = fopen(argv[3], "wb");
    if (!o || fwrite(logits, sizeof(float), n * (size_t)info.n_vocab, o) != n * (size_t)info.n_vocab) {
        fprintf(stderr, "logits_tool: cannot write %s\n", argv[3]);
        return 1;
    }
    fclose(o);
    free(logits);
    free(ids);
    still_context_free(ctx);
    still_model_free(m);
    return 0;
}
