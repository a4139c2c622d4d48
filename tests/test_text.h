/* Files and text for the C unit tests that train (test_train.c,
 * test_finetune.c). */
#ifndef STILL_TEST_TEXT_H
#define STILL_TEST_TEXT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static void write_file(const char *path, const char *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        printf("cannot write %s\n", path);
        exit(1);
    }
    fclose(f);
}

/* n characters of English-like text from a seeded draw of words (one token
 * per byte with the tiny byte vocabulary); malloc'ed. */
static char *make_text(size_t n, uint64_t seed) {
    static const char *words[] = {"the ", "river ", "carried ", "a ", "letter ", "to ", "Bath ", "before ", "dawn. ",
                                  "she ", "watched ", "seven ", "apples ", "in ", "silence. "};
    char *t = malloc(n + 1);
    uint64_t s = seed;
    size_t i = 0;
    while (t && i < n) {
        s = s * 6364136223846793005ULL + 1442695040888963407ULL;
        const char *w = words[(s >> 33) % (sizeof words / sizeof words[0])];
        for (; *w && i < n; w++) t[i++] = *w;
    }
    if (t) t[n] = 0;
    return t;
}

#endif
