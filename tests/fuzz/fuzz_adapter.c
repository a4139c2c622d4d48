/* libFuzzer target for adapter files: arbitrary bytes, read as GGUF and applied as an adapter (plan, kind
 * parameters, LoRA) to a tiny random model (tests/tiny_model.h). A refused file must leave a one-line error with
 * the return code; an accepted one must give finite logits for a few tokens or refuse them in one line — never a
 * crash, a sanitizer report or a silently wrong (non-finite) answer. Seeds: tests/tools/adapter_seed.c. Built by
 * tests/run_fuzz.sh. */
#include "format/gguf.h"
#include "model/model.h"
#include "../tiny_model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char model_path[512];

static void remove_model(void) { unlink(model_path); }

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *dir = getenv("TMPDIR");
    snprintf(model_path, sizeof model_path, "%s/still_fuzz_adapter_%ld.gguf", dir && *dir ? dir : "/tmp",
             (long)getpid());
    ref_weights R;
    write_model(model_path, &R);
    ref_weights_free(&R);
    atexit(remove_model);
    return 0;
}

static void one_line(const still_err *err, int rc) {
    if (err->code != rc || err->msg[0] == '\0' || strchr(err->msg, '\n')) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    still_err err = {0, ""};
    int rc = gguf_open_memory(data, size, &f, &err);
    if (rc != STILL_OK) {
        one_line(&err, rc);
        return 0;
    }
    still_model *m = NULL;
    if (still_model_load(model_path, &m, &err) != STILL_OK) abort();   /* the tiny model itself */
    rc = adapter_apply(m, f, &err);
    if (rc != STILL_OK) {
        one_line(&err, rc);
    } else {
        still_context *c = NULL;
        const still_context_params p = {.n_ctx = 64, .n_batch = 6};
        err = (still_err){0, ""};
        rc = still_context_create(m, p, &c, &err);
        if (rc != STILL_OK) {
            one_line(&err, rc);
        } else {
            const int32_t tok[6] = {'T', 'h', 'e', ' ', 'c', 'a'};
            const int nv = still_model_get_info(m).n_vocab;
            float *logits = malloc(sizeof(float) * 6 * (size_t)nv);
            if (!logits) abort();
            rc = still_decode(c, tok, 6, logits, 1, &err);
            if (rc != STILL_OK)
                one_line(&err, rc);
            else
                for (int i = 0; i < 6 * nv; i++)
                    if (!isfinite(logits[i])) abort();   /* accepted: the answer must be a number */
            free(logits);
            still_context_free(c);
        }
    }
    still_model_free(m);
    gguf_close(f);
    return 0;
}
