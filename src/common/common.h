/* Internal helpers shared by every source file. */
#ifndef STILL_COMMON_H
#define STILL_COMMON_H

#include "still.h"
#include <stddef.h>
#include <stdint.h>

/* Record an error (if err != NULL) and return code, so callers can write
 *   return still_fail(err, STILL_E_FORMAT, "bad magic in %s", path);      */
int still_fail(still_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Overflow-checked size arithmetic: return 0 on success, -1 on overflow. */
static inline int still_mul_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}
static inline int still_add_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}

/* Offset of the first invalid UTF-8 sequence in text[0..n), or -1 if it is all
 * valid (overlong forms, surrogates and code points past U+10FFFF are invalid). */
long long still_utf8_invalid_at(const char *text, size_t n);

/* s[0..n) for an error message: printable ASCII as it is, every other byte (and the backslash) as \xNN;
 * cut to fit cap bytes with its terminating zero. */
void still_escape(char *dst, size_t cap, const char *s, size_t n);

/* Atomic output files. still_tmp_open refuses a `path` that exists and is not
 * a regular file (a device, a folder), then creates a temporary file beside it
 * with a unique name (`path`.XXXXXX, created exclusively: never an existing
 * file or a symlink someone left there), mode 0666 less the umask.
 * still_tmp_commit flushes and fsyncs it, closes it and renames it onto
 * `path`; still_tmp_abort closes and removes it. *tmp_path is malloc'ed; both
 * free it. A temporary file still open when SIGTERM, SIGINT or SIGHUP ends
 * the process is removed first (handlers installed at the first temporary
 * file where the signal's disposition is the default; the signal then ends
 * the process as before). */
#include <stdio.h>
int still_tmp_open(const char *path, FILE **fp, char **tmp_path, still_err *err);
int still_tmp_commit(FILE *fp, char *tmp_path, const char *path, still_err *err);
void still_tmp_abort(FILE *fp, char *tmp_path);

#endif
