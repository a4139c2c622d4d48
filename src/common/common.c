#include "common/common.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int still_fail(still_err *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

/* ---- atomic output files ------------------------------------------------------- */

/* The temporary files being written, so that a terminating signal (SIGTERM, SIGINT, SIGHUP) removes them before
 * the process dies of it: the one piece of process-wide state here, because a signal handler can reach nothing
 * else. Slots are claimed and released atomically; a ninth file at once is written untracked. The handlers are
 * installed at the first temporary file, only for signals whose disposition is still the default. */
enum { TMP_SLOTS = 8 };
static char *tmp_live[TMP_SLOTS];
static int tmp_handlers;

static void tmp_on_signal(int sig) {
    for (int i = 0; i < TMP_SLOTS; i++) {
        char *p = __atomic_load_n(&tmp_live[i], __ATOMIC_SEQ_CST);
        if (p) unlink(p);   /* async-signal-safe */
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

static void tmp_track(char *p) {
    int expect = 0;
    if (__atomic_compare_exchange_n(&tmp_handlers, &expect, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        const int sigs[] = {SIGTERM, SIGINT, SIGHUP};
        for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
            struct sigaction old, sa;
            if (sigaction(sigs[i], NULL, &old) != 0 || (old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = tmp_on_signal;
            sigemptyset(&sa.sa_mask);
            sigaction(sigs[i], &sa, NULL);
        }
    }
    for (int i = 0; i < TMP_SLOTS; i++) {
        char *none = NULL;
        if (__atomic_compare_exchange_n(&tmp_live[i], &none, p, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return;
    }
}

static void tmp_untrack(const char *p) {
    for (int i = 0; i < TMP_SLOTS; i++) {
        char *mine = (char *)p;
        __atomic_compare_exchange_n(&tmp_live[i], &mine, NULL, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
}

int still_tmp_open(const char *path, FILE **fp, char **tmp_path, still_err *err) {
    *fp = NULL, *tmp_path = NULL;
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return still_fail(err, STILL_E_IO, "cannot write %s: it exists and is not a regular file", path);
    const size_t n = strlen(path);
    char *tmp = malloc(n + 8);
    if (!tmp) return still_fail(err, STILL_E_NOMEM, "out of memory writing %s", path);
    memcpy(tmp, path, n);
    memcpy(tmp + n, ".XXXXXX", 8);
    const int fd = mkstemp(tmp);   /* O_CREAT | O_EXCL: a fresh file, never through a symlink */
    if (fd < 0) {
        const int e = errno;
        free(tmp);
        return still_fail(err, STILL_E_IO, "cannot create a temporary file beside %s: %s", path, strerror(e));
    }
    const mode_t mask = umask(0);   /* mkstemp makes 0600; give the output the usual 0666 & ~umask */
    umask(mask);
    if (fchmod(fd, 0666 & ~mask) != 0 || !(*fp = fdopen(fd, "wb"))) {
        const int e = errno;
        close(fd);
        unlink(tmp);
        free(tmp);
        return still_fail(err, STILL_E_IO, "cannot write %s: %s", path, strerror(e));
    }
    *tmp_path = tmp;
    tmp_track(tmp);
    return STILL_OK;
}

int still_tmp_commit(FILE *fp, char *tmp_path, const char *path, still_err *err) {
    int e = 0;
    if (fflush(fp) != 0) e = errno;
    if (!e && fsync(fileno(fp)) != 0 && errno != EINVAL) e = errno;
    if (fclose(fp) != 0 && !e) e = errno;
    if (!e && rename(tmp_path, path) != 0) e = errno;
    tmp_untrack(tmp_path);
    if (e) {
        unlink(tmp_path);
        free(tmp_path);
        return still_fail(err, STILL_E_IO, "cannot write %s: %s", path, strerror(e));
    }
    free(tmp_path);
    return STILL_OK;
}

void still_tmp_abort(FILE *fp, char *tmp_path) {
    if (fp) fclose(fp);
    if (tmp_path) tmp_untrack(tmp_path), unlink(tmp_path);
    free(tmp_path);
}

/* ---- text ---------------------------------------------------------------------- */

long long still_utf8_invalid_at(const char *text, size_t n) {
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0;
    while (i < n) {
        const unsigned c = s[i];
        int len;
        unsigned min;
        if (c < 0x80) { i++; continue; }
        if (c >= 0xC2 && c <= 0xDF) len = 2, min = 0x80;
        else if (c >= 0xE0 && c <= 0xEF) len = 3, min = 0x800;
        else if (c >= 0xF0 && c <= 0xF4) len = 4, min = 0x10000;
        else return (long long)i;
        if (i + (size_t)len > n) return (long long)i;
        unsigned cp = c & (0x7F >> len);
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return (long long)i;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return (long long)i;
        i += (size_t)len;
    }
    return -1;
}

void still_escape(char *dst, size_t cap, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    if (!cap) return;
    for (size_t i = 0; i < n && o + 5 <= cap; i++) {
        const unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '\\') dst[o++] = (char)c;
        else dst[o++] = '\\', dst[o++] = 'x', dst[o++] = hex[c >> 4], dst[o++] = hex[c & 15];
    }
    dst[o] = 0;
}
