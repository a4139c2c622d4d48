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

#endif
