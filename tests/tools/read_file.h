/* Whole-file reading shared by the test tools. */
#ifndef STILL_TOOLS_READ_FILE_H
#define STILL_TOOLS_READ_FILE_H

#include "common/common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Read a file into a malloc'ed buffer with a NUL after its last byte. */
static int read_file(const char *path, void **out, size_t *len, still_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return still_fail(err, STILL_E_IO, "cannot open %s: %s", path, strerror(errno));
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        return still_fail(err, STILL_E_IO, "cannot seek %s", path);
    }
    long n = ftell(f);
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return still_fail(err, STILL_E_IO, "cannot size %s", path);
    }
    char *buf = malloc((size_t)n + 1);
    if (!buf) {
        fclose(f);
        return still_fail(err, STILL_E_NOMEM, "out of memory reading %s", path);
    }
    if (n > 0 && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        fclose(f);
        return still_fail(err, STILL_E_IO, "short read on %s", path);
    }
    fclose(f);
    buf[n] = 0;
    *out = buf;
    *len = (size_t)n;
    return STILL_OK;
}

#endif
