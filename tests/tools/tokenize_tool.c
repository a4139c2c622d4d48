/* tokenize_tool: drive the tokenizer from tests.
 *
 *   tokenize_tool [--special] MODEL.gguf INPUT
 *       INPUT ("-" = stdin) holds length-prefixed records, each
 *           <decimal byte count> '\n' <exactly that many bytes> '\n'
 *       so texts may contain any bytes (NUL, newlines, invalid UTF-8).
 *       For every record prints one line: "OK" or "RTFAIL", then the token ids
 *       separated by spaces. RTFAIL means decode(encode(text)) != text.
 *       --special: parse control tokens (e.g. "<|im_start|>") in the text.
 *   tokenize_tool --chat [--gen] MODEL.gguf INPUT
 *       Records alternate role, content. Renders the conversation with ChatML
 *       (default system prompt taken from the GGUF's chat template), prints the
 *       result as one record (same format) and then an "OK"/"RTFAIL" line with
 *       its ids (encoded with parse_special). --gen adds the generation prompt.
 *   tokenize_tool --info MODEL.gguf
 *       Prints n_vocab, bos, eos and the default system prompt.
 * Exit status: 0 all round trips exact, 1 some round trip failed, 2 error. */
#include "format/gguf.h"
#include "text/tokenizer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char *read_all(const char *path, size_t *len) {
    FILE *fp = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!fp) { perror(path); return NULL; }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb; cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, fp);
        n += r;
        if (r == 0) break;
    }
    if (buf && ferror(fp)) { perror(path); free(buf); buf = NULL; }
    if (fp != stdin) fclose(fp);
    *len = n;
    return buf;
}

typedef struct { const char *p; size_t n; } rec;

/* Parse all records; returns count or -1 on a malformed file. */
static long parse_records(const char *buf, size_t len, rec **out) {
    size_t cap = 16, n = 0, i = 0;
    rec *r = malloc(cap * sizeof *r);
    if (!r) return -1;
    while (i < len) {
        size_t k = 0, digits = 0;
        while (i < len && buf[i] >= '0' && buf[i] <= '9' && digits < 18) { k = k * 10 + (size_t)(buf[i] - '0'); i++; digits++; }
        if (!digits || i >= len || buf[i] != '\n') goto bad;
        i++;
        if (k > len - i || len - i - k < 1 || buf[i + k] != '\n') goto bad;
        if (n == cap) {
            rec *nr = realloc(r, cap * 2 * sizeof *r);
            if (!nr) goto bad;
            r = nr; cap *= 2;
        }
        r[n++] = (rec){ buf + i, k };
        i += k + 1;
    }
    *out = r;
    return (long)n;
bad:
    fprintf(stderr, "malformed record file at byte %zu\n", i);
    free(r);
    return -1;
}

/* Encode, print "OK|RTFAIL ids...", return 0 ok, 1 round-trip failure, 2 error. */
static int run_one(const tokenizer *tok, const char *p, size_t n, int special) {
    still_err err = {0};
    int32_t *ids = NULL; size_t n_ids = 0;
    if (tokenizer_encode(tok, p, n, special, &ids, &n_ids, &err)) {
        fprintf(stderr, "encode: %s\n", err.msg);
        return 2;
    }
    char *text = NULL; size_t tl = 0;
    if (tokenizer_decode(tok, ids, n_ids, &text, &tl, &err)) {
        fprintf(stderr, "decode: %s\n", err.msg);
        free(ids);
        return 2;
    }
    int ok = tl == n && memcmp(text, p, n) == 0;
    /* the per-token decoder must agree with the sequence decoder */
    size_t o = 0;
    for (size_t i = 0; i < n_ids && ok; i++) {
        char buf[256];
        size_t k = tokenizer_decode_token(tok, ids[i], buf, sizeof buf);
        if (k > sizeof buf || o + k > tl || memcmp(buf, text + o, k) != 0) ok = 0;
        o += k;
    }
    if (o != tl) ok = 0;
    fputs(ok ? "OK" : "RTFAIL", stdout);
    for (size_t i = 0; i < n_ids; i++) printf(" %d", ids[i]);
    putchar('\n');
    free(text);
    free(ids);
    return ok ? 0 : 1;
}

static int usage(void) {
    fprintf(stderr, "usage: tokenize_tool [--special] MODEL INPUT\n"
                    "       tokenize_tool --chat [--gen] MODEL INPUT\n"
                    "       tokenize_tool --info MODEL\n");
    return 2;
}

int main(int argc, char **argv) {
    int special = 0, chat = 0, gen = 0, info = 0, a = 1;
    for (; a < argc && strncmp(argv[a], "--", 2) == 0; a++) {
        if (strcmp(argv[a], "--special") == 0) special = 1;
        else if (strcmp(argv[a], "--chat") == 0) chat = 1;
        else if (strcmp(argv[a], "--gen") == 0) gen = 1;
        else if (strcmp(argv[a], "--info") == 0) info = 1;
        else return usage();
    }
    if (argc - a != (info ? 1 : 2)) return usage();

    still_err err = {0};
    gguf_file *f = NULL;
    tokenizer *tok = NULL;
    if (gguf_open(argv[a], &f, &err)) { fprintf(stderr, "%s\n", err.msg); return 2; }
    int rc = tokenizer_from_gguf(f, &tok, &err);
    gguf_close(f);
    if (rc) { fprintf(stderr, "%s\n", err.msg); return 2; }

    if (info) {
        const char *sys = tokenizer_default_system(tok);
        printf("n_vocab %d\nbos %d\neos %d\nim_end %d\neog_im_end %d\ndefault_system %s\n",
               tokenizer_n_vocab(tok), tokenizer_bos(tok), tokenizer_eos(tok),
               tokenizer_find(tok, "<|im_end|>"), tokenizer_is_eog(tok, tokenizer_find(tok, "<|im_end|>")),
               sys ? sys : "(none)");
        tokenizer_free(tok);
        return 0;
    }

    size_t len;
    char *buf = read_all(argv[a + 1], &len);
    rec *recs = NULL;
    long n = buf ? parse_records(buf, len, &recs) : -1;
    if (n < 0) { free(buf); tokenizer_free(tok); return 2; }

    int status = 0;
    if (chat) {
        if (n % 2) { fprintf(stderr, "--chat needs role/content record pairs\n"); status = 2; goto out; }
        size_t m = (size_t)n / 2;
        char **roles = calloc(m + 1, sizeof *roles), **contents = calloc(m + 1, sizeof *contents);
        int bad = !roles || !contents;
        for (size_t i = 0; i < m && !bad; i++) {
            roles[i] = strndup(recs[2 * i].p, recs[2 * i].n);
            contents[i] = strndup(recs[2 * i + 1].p, recs[2 * i + 1].n);
            bad = !roles[i] || !contents[i];
        }
        char *out = NULL;
        if (bad) { fprintf(stderr, "out of memory\n"); status = 2; }
        else if (chatml_render((const char *const *)roles, (const char *const *)contents, m, gen,
                               tokenizer_default_system(tok), &out, &err)) {
            fprintf(stderr, "%s\n", err.msg); status = 2;
        } else {
            size_t ol = strlen(out);
            printf("%zu\n", ol);
            fwrite(out, 1, ol, stdout);
            putchar('\n');
            status = run_one(tok, out, ol, 1);
        }
        free(out);
        for (size_t i = 0; i < m; i++) {
            if (roles) free(roles[i]);
            if (contents) free(contents[i]);
        }
        free(roles); free(contents);
    } else {
        for (long i = 0; i < n; i++) {
            int r = run_one(tok, recs[i].p, recs[i].n, special);
            if (r > status) status = r;
            if (r == 2) break;
        }
    }
out:
    fflush(stdout);
    free(recs);
    free(buf);
    tokenizer_free(tok);
    return status;
}
