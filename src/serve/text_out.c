/* The server's text filter (text_out.h). */
#include "serve/text_out.h"

#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at s[0..n), 0 when it is invalid, -1 when it is valid so far but cut short. */
static int utf8_seq(const unsigned char *s, size_t n) {
    const unsigned c = s[0];
    if (c < 0x80) return 1;
    int len;
    unsigned lo = 0x80, hi = 0xBF;   /* the allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    for (int i = 1; i < len; i++) {
        if ((size_t)i >= n) return -1;
        const unsigned b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return 0;
    }
    return len;
}

int utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        const int k = utf8_seq((const unsigned char *)s + i, n - i);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

/* Bytes at the end of s[0..n) that begin a character not finished yet. */
static size_t utf8_unfinished_tail(const char *s, size_t n) {
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        const unsigned char c = (unsigned char)s[n - back];
        if ((c & 0xC0) != 0x80) return utf8_seq((const unsigned char *)s + n - back, back) < 0 ? back : 0;
    }
    return 0;
}

static int reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *b = realloc(*buf, c);
    if (!b) return -1;
    *buf = b, *cap = c;
    return 0;
}

/* s[0..n) into t->out with every invalid byte (and an unfinished character at the end) as U+FFFD. */
static const char *release(text_out *t, const char *s, size_t n, size_t *n_out) {
    if (reserve(&t->out, &t->cap_out, n * 3 + 1)) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        const int k = s[i] ? utf8_seq((const unsigned char *)s + i, n - i) : 0;   /* NUL too: texts are C strings */
        if (k > 0) {
            memcpy(t->out + o, s + i, (size_t)k);
            o += (size_t)k, i += (size_t)k;
        } else {
            memcpy(t->out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += k < 0 ? n - i : 1;   /* a cut-short character is one replacement */
        }
    }
    t->out[o] = 0;
    *n_out = o;
    return t->out;
}

void text_out_init(text_out *t, const char *const *stop, int n_stop) {
    memset(t, 0, sizeof *t);
    t->stop = stop, t->n_stop = n_stop;
}

const char *text_out_push(text_out *t, const char *s, size_t n, size_t *n_out) {
    *n_out = 0;
    if (t->stopped) return release(t, "", 0, n_out);
    if (reserve(&t->pend, &t->cap_pend, t->n_pend + n + 1)) return NULL;
    memcpy(t->pend + t->n_pend, s, n);
    t->n_pend += n;
    /* the earliest stop string ends the text before it */
    size_t first = t->n_pend;
    for (int i = 0; i < t->n_stop; i++) {
        const size_t L = strlen(t->stop[i]);
        if (L == 0 || L > t->n_pend) continue;
        for (size_t p = 0; p + L <= t->n_pend && p < first; p++)
            if (!memcmp(t->pend + p, t->stop[i], L)) {
                first = p;
                break;
            }
    }
    if (first < t->n_pend) {
        t->stopped = 1;
        const char *r = release(t, t->pend, first, n_out);
        t->n_pend = 0;
        return r;
    }
    /* hold back the longest end that may still become a stop string, or an unfinished character */
    size_t hold = utf8_unfinished_tail(t->pend, t->n_pend);
    for (int i = 0; i < t->n_stop; i++) {
        const size_t L = strlen(t->stop[i]);
        if (L == 0) continue;
        for (size_t k = L - 1; k > hold; k--)
            if (k <= t->n_pend && !memcmp(t->pend + t->n_pend - k, t->stop[i], k)) {
                hold = k;
                break;
            }
    }
    const size_t go = t->n_pend - hold;
    const char *r = release(t, t->pend, go, n_out);
    if (r) {
        memmove(t->pend, t->pend + go, hold);
        t->n_pend = hold;
    }
    return r;
}

const char *text_out_flush(text_out *t, size_t *n_out) {
    const char *r = release(t, t->pend ? t->pend : "", t->stopped ? 0 : t->n_pend, n_out);
    if (r) t->n_pend = 0;
    return r;
}

void text_out_free(text_out *t) {
    free(t->pend);
    free(t->out);
    memset(t, 0, sizeof *t);
}
