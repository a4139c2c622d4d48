/* still — public C API.
 *
 * Every function that can fail returns an int status (STILL_OK == 0, negative
 * on error) and, when given a non-NULL still_err, writes a one-line message
 * into it.  Objects are opaque; each has exactly one owner, which frees it
 * with the matching *_free function. */
#ifndef STILL_H
#define STILL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    STILL_OK = 0,
    STILL_E_IO = -1,          /* file missing, unreadable, unwritable */
    STILL_E_FORMAT = -2,      /* malformed input file or data */
    STILL_E_NOMEM = -3,       /* allocation failed */
    STILL_E_ARG = -4,         /* bad argument / flag / out-of-range value */
    STILL_E_UNSUPPORTED = -5, /* valid but not supported (tensor type, arch) */
    STILL_E_STATE = -6,       /* e.g. context full */
};

typedef struct still_err {
    int code;
    char msg[512];
} still_err;

#ifdef __cplusplus
}
#endif
#endif
