/* A one-turn chat prompt as token ids (still eval, still probe). */
#include "cli.h"

#include <stdlib.h>
#include <string.h>

/* The prompt as token ids: template markers parsed as special tokens, the
 * texts as plain text. */
int cli_chat_ids(const still_model *m, const char *system, const char *user, const char *prefix, int32_t **out,
                 size_t *n_out) {
    const char *parts[] = {"<|im_start|>system\n", system, "<|im_end|>\n<|im_start|>user\n", user,
                           "<|im_end|>\n<|im_start|>assistant\n", prefix};
    const int special[] = {1, 0, 1, 0, 1, 0};
    size_t n = 0, cap = 0;
    int32_t *all = NULL;
    for (int i = system ? 0 : 2; i < 6; i++) {
        int32_t *ids = NULL;
        size_t k = 0;
        still_err err = {0};
        const char *text = i == 2 && !system ? "<|im_start|>user\n" : parts[i];
        if (still_tokenize(m, text, strlen(text), special[i], &ids, &k, &err)) {
            free(all);
            return -1;
        }
        if (n + k > cap) {
            cap = (n + k) * 2 + 16;
            int32_t *na = realloc(all, cap * sizeof *na);
            if (!na) {
                free(ids), free(all);
                return -1;
            }
            all = na;
        }
        memcpy(all + n, ids, k * sizeof *ids);
        n += k;
        free(ids);
    }
    *out = all, *n_out = n;
    return 0;
}


int cli_chat_count(void *data, const char *user, const char *prefix) {
    const cli_prompt_counter *c = data;
    int32_t *ids;
    size_t n;
    if (cli_chat_ids(c->m, c->system, user, prefix, &ids, &n)) return -1;
    free(ids);
    return (int)n;
}
