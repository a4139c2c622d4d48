/* Byte-level BPE tokenizer (GPT-2 style) with SmolLM2's pre-tokenizer.
 *
 * Encoding pipeline for a text:
 *   1. Special tokens: CONTROL tokens (only with parse_special) and
 *      USER_DEFINED tokens (always, as Hugging Face does for non-special added
 *      tokens) are matched literally, leftmost-longest; the text between them
 *      goes through steps 2-5.
 *   2. UTF-8 validation: the text is cut into maximal runs of valid UTF-8 and
 *      single invalid bytes (see encode_segment for why).
 *   3. Digit split (pre "smollm" and relatives): every \p{N} code point is a
 *      piece of its own; the text between digits goes to step 4 separately, so
 *      the regex's look-ahead never sees across a digit (like HF's Sequence of
 *      pre-tokenizers, where each pre-tokenizer works on the previous pieces).
 *   4. GPT-2 regex (PCRE2, UTF + UCP, so \p{L}, \p{N}, \s are Unicode-aware).
 *   5. BPE on each piece: start from one symbol per byte (the byte's token,
 *      i.e. bytes_to_unicode(byte)), repeatedly merge the adjacent pair with
 *      the lowest merge rank (ties: leftmost), using a binary heap with lazy
 *      invalidation.
 * Decoding maps every character of a token string back through the inverse of
 * bytes_to_unicode; CONTROL / USER_DEFINED tokens decode to their text. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "text/tokenizer.h"
#include "common/common.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* The GPT-2 pre-tokenizer regex (as in HF's ByteLevel pre-tokenizer):
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * with \s spelled out as the Unicode White_Space set, which is what HF's
 * regex engine (Oniguruma) matches. PCRE2's own \s differs on two code
 * points: it excludes U+0085 (NEL) and includes U+180E (MONGOLIAN VOWEL
 * SEPARATOR, no longer whitespace since Unicode 6.3). */
#define WS "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS "])|[" WS "]+";
#undef WS
/* HF's Digits pre-tokenizer tests Rust's char::is_numeric (categories Nd, Nl,
 * No; Unicode 16 in current Rust) while PCRE2 10.42's \p{N} knows Unicode 14;
 * the numbers added in Unicode 15 and 16 are listed so both agree (harmless
 * with a newer PCRE2). Checked against HF on every code point. */
static const char DIGIT_PATTERN[] =
    "[\\p{N}\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11DE0}-\\x{11DE9}"
    "\\x{11F50}-\\x{11F59}\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{16FF4}-\\x{16FF6}"
    "\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}]";

/* Pre-tokenizer names (tokenizer.ggml.pre) that mean "split every digit, then
 * the GPT-2 regex" (SmolLM2 / StarCoder-style tokenizers). */
static const char *const DIGIT_SPLIT_PRES[] = {
    "smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva",
};
/* Pre-tokenizer names that mean plain GPT-2 (no digit split). */
static const char *const GPT2_PRES[] = { "gpt2", "gpt-2" };

typedef struct {
    uint64_t key;   /* (uint32 left id << 32) | uint32 right id */
    int32_t rank;   /* -1: empty slot */
    int32_t result; /* id of the merged token */
} merge_slot;

typedef struct {
    int32_t id;
    uint32_t len;
    bool always;    /* USER_DEFINED: matched even without parse_special */
} special_tok;

struct tokenizer {
    int32_t n_vocab;
    int32_t *types;                 /* n_vocab */
    char *str_arena;                /* raw token strings, each NUL-terminated */
    size_t *str_off, *str_len;      /* n_vocab */
    char *dec_arena;                /* decoded bytes of every token */
    size_t *dec_off, *dec_len;      /* n_vocab */

    int32_t *vocab_slots;           /* open addressing: token id or -1 */
    size_t vocab_mask;
    merge_slot *merge_slots;
    size_t merge_mask;
    int32_t n_merges;

    int32_t byte_tok[256];          /* token of each single byte, or -1 */

    int32_t bos, eos, unk, pad;
    int32_t eog[4];
    int n_eog;

    special_tok *special;           /* sorted by length, longest first */
    int32_t n_special;
    bool special_first[256];        /* first bytes of any special token */
    bool any_always;

    bool split_digits;
    pcre2_code *re_words, *re_digit;

    char *chat_template;            /* NULL if none */
    char *default_system;           /* NULL if none */
};

/* ---- small helpers --------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;               /* FNV-1a */
    for (size_t i = 0; i < n; i++) { h ^= (unsigned char)s[i]; h *= 0x100000001b3ull; }
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {                  /* splitmix64 finalizer */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static size_t pow2_at_least(size_t n) {
    size_t c = 16;
    while (c < n) c <<= 1;
    return c;
}

/* GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68
 * bytes (0-32, 127-160, 173) to U+0100.. in byte order. */
static void build_byte_map(uint32_t cp[256]) {
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        cp[b] = printable ? (uint32_t)b : next++;
    }
}

static size_t utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12)); out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18)); out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the valid UTF-8 sequence at s (1-4), or 0 if s[0] does not start
 * one. Strict (RFC 3629): no overlongs, no surrogates, nothing above U+10FFFF;
 * this is exactly what PCRE2 accepts in UTF mode. If cp != NULL, stores the
 * code point. */
static size_t utf8_valid_len(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned char c = s[0];
    if (c < 0x80) { if (cp) *cp = c; return 1; }
    size_t len; unsigned char lo = 0x80, hi = 0xBF; uint32_t v;
    if (c >= 0xC2 && c <= 0xDF) { len = 2; v = c & 0x1F; }
    else if (c >= 0xE0 && c <= 0xEF) {
        len = 3; v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;
        else if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4; v = c & 0x07;
        if (c == 0xF0) lo = 0x90;
        else if (c == 0xF4) hi = 0x8F;
    } else return 0;
    if (n < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    v = (v << 6) | (s[1] & 0x3F);
    for (size_t i = 2; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3F);
    }
    if (cp) *cp = v;
    return len;
}

/* ---- vocabulary / merge hash tables ---------------------------------------- */

static int32_t vocab_lookup(const tokenizer *t, const char *s, size_t n) {
    size_t i = hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t id = t->vocab_slots[i];
        if (id < 0) return -1;
        if (t->str_len[id] == n && memcmp(t->str_arena + t->str_off[id], s, n) == 0) return id;
        i = (i + 1) & t->vocab_mask;
    }
}

/* Insert id; a later duplicate string replaces the earlier one (as a Python
 * dict or llama.cpp's map built in order would). */
static void vocab_insert(tokenizer *t, int32_t id) {
    const char *s = t->str_arena + t->str_off[id];
    size_t n = t->str_len[id];
    size_t i = hash_bytes(s, n) & t->vocab_mask;
    for (;;) {
        int32_t cur = t->vocab_slots[i];
        if (cur < 0) { t->vocab_slots[i] = id; return; }
        if (t->str_len[cur] == n && memcmp(t->str_arena + t->str_off[cur], s, n) == 0) {
            t->vocab_slots[i] = id;
            return;
        }
        i = (i + 1) & t->vocab_mask;
    }
}

static uint64_t pair_key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

static const merge_slot *merge_lookup(const tokenizer *t, int32_t a, int32_t b) {
    uint64_t key = pair_key(a, b);
    size_t i = hash_u64(key) & t->merge_mask;
    for (;;) {
        const merge_slot *m = &t->merge_slots[i];
        if (m->rank < 0) return NULL;
        if (m->key == key) return m;
        i = (i + 1) & t->merge_mask;
    }
}

/* Keeps the lowest rank for a duplicated pair. */
static void merge_insert(tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t result) {
    uint64_t key = pair_key(a, b);
    size_t i = hash_u64(key) & t->merge_mask;
    for (;;) {
        merge_slot *m = &t->merge_slots[i];
        if (m->rank < 0) { m->key = key; m->rank = rank; m->result = result; return; }
        if (m->key == key) return;
        i = (i + 1) & t->merge_mask;
    }
}

/* ---- construction ------------------------------------------------------------ */

static int cmp_special(const void *a, const void *b) {
    const special_tok *x = a, *y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static int compile_regex(const char *pattern, pcre2_code **out, still_err *err) {
    int ec; PCRE2_SIZE eo;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return still_fail(err, STILL_E_UNSUPPORTED, "tokenizer: cannot compile regex at offset %zu: %s",
                          (size_t)eo, (const char *)msg);
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* optional speed-up; interpreter otherwise */
    *out = re;
    return STILL_OK;
}

static bool name_in(const char *name, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++) if (strcmp(name, list[i]) == 0) return true;
    return false;
}

/* Decoded bytes of token id: the raw text for control/user-defined tokens,
 * otherwise each character mapped back through bytes_to_unicode's inverse
 * (characters outside the byte map are kept as their UTF-8). Writes into out
 * (capacity >= raw length, since decoding never grows) and returns the length. */
static size_t decode_token_string(const char *s, size_t n, int32_t type, const int16_t inv[512], char *out) {
    if (type == TOKEN_TYPE_CONTROL || type == TOKEN_TYPE_USER_DEFINED) {
        memcpy(out, s, n);
        return n;
    }
    size_t o = 0, i = 0;
    while (i < n) {
        uint32_t cp;
        size_t k = utf8_valid_len((const unsigned char *)s + i, n - i, &cp);
        if (k == 0) { out[o++] = s[i++]; continue; }
        if (cp < 512 && inv[cp] >= 0) out[o++] = (char)inv[cp];
        else { memcpy(out + o, s + i, k); o += k; }
        i += k;
    }
    return o;
}

int tokenizer_create(const tokenizer_desc *d, tokenizer **out, still_err *err) {
    if (!out) return still_fail(err, STILL_E_ARG, "tokenizer_create: out is NULL");
    *out = NULL;
    if (!d || d->n_vocab <= 0 || !d->tokens)
        return still_fail(err, STILL_E_ARG, "tokenizer_create: empty vocabulary");
    if (d->n_merges < 0 || (d->n_merges > 0 && !d->merges))
        return still_fail(err, STILL_E_ARG, "tokenizer_create: bad merges");

    const char *pre = d->pre ? d->pre : "gpt2";
    bool split_digits;
    if (name_in(pre, DIGIT_SPLIT_PRES, sizeof DIGIT_SPLIT_PRES / sizeof *DIGIT_SPLIT_PRES)) split_digits = true;
    else if (name_in(pre, GPT2_PRES, sizeof GPT2_PRES / sizeof *GPT2_PRES)) split_digits = false;
    else return still_fail(err, STILL_E_UNSUPPORTED, "tokenizer: unsupported pre-tokenizer '%s' "
                           "(supported: smollm and its relatives, gpt2)", pre);

    int32_t n = d->n_vocab;
    int rc = STILL_E_NOMEM;
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    t->n_vocab = n;
    t->split_digits = split_digits;

    /* token strings */
    size_t total = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *s = d->tokens[i];
        size_t len = d->token_lens ? d->token_lens[i] : (s ? strlen(s) : 0);
        if (!s && len) { rc = still_fail(err, STILL_E_ARG, "tokenizer: token %d is NULL", i); goto fail; }
        if (len > UINT32_MAX || still_add_overflow(total, len + 1, &total)) {
            rc = still_fail(err, STILL_E_FORMAT, "tokenizer: token %d too long", i);
            goto fail;
        }
    }
    t->types = malloc((size_t)n * sizeof *t->types);
    t->str_off = malloc((size_t)n * sizeof *t->str_off);
    t->str_len = malloc((size_t)n * sizeof *t->str_len);
    t->dec_off = malloc((size_t)n * sizeof *t->dec_off);
    t->dec_len = malloc((size_t)n * sizeof *t->dec_len);
    t->str_arena = malloc(total);
    t->dec_arena = malloc(total);
    if (!t->types || !t->str_off || !t->str_len || !t->dec_off || !t->dec_len || !t->str_arena || !t->dec_arena)
        goto nomem;

    uint32_t byte_cp[256];
    build_byte_map(byte_cp);
    int16_t inv[512];
    for (int i = 0; i < 512; i++) inv[i] = -1;
    for (int b = 0; b < 256; b++) inv[byte_cp[b]] = (int16_t)b;

    size_t off = 0, doff = 0;
    int32_t n_special = 0;
    for (int32_t i = 0; i < n; i++) {
        const char *s = d->tokens[i];
        size_t len = d->token_lens ? d->token_lens[i] : (s ? strlen(s) : 0);
        int32_t type = d->token_types ? d->token_types[i] : TOKEN_TYPE_NORMAL;
        t->types[i] = type;
        if (len) memcpy(t->str_arena + off, s, len);
        t->str_arena[off + len] = '\0';
        t->str_off[i] = off;
        t->str_len[i] = len;
        off += len + 1;
        t->dec_off[i] = doff;
        t->dec_len[i] = decode_token_string(s, len, type, inv, t->dec_arena + doff);
        doff += t->dec_len[i];
        if ((type == TOKEN_TYPE_CONTROL || type == TOKEN_TYPE_USER_DEFINED) && len > 0) n_special++;
    }

    /* vocabulary hash */
    size_t cap = pow2_at_least((size_t)n * 2);
    t->vocab_mask = cap - 1;
    t->vocab_slots = malloc(cap * sizeof *t->vocab_slots);
    if (!t->vocab_slots) goto nomem;
    for (size_t i = 0; i < cap; i++) t->vocab_slots[i] = -1;
    for (int32_t i = 0; i < n; i++) vocab_insert(t, i);

    /* single-byte tokens */
    for (int b = 0; b < 256; b++) {
        char buf[4];
        size_t k = utf8_put(byte_cp[b], buf);
        t->byte_tok[b] = vocab_lookup(t, buf, k);
    }

    /* merges: "left right", split at the first space after the first byte
     * (byte-level token strings never contain a real space) */
    t->n_merges = d->n_merges;
    cap = pow2_at_least((size_t)d->n_merges * 2);
    t->merge_mask = cap - 1;
    t->merge_slots = malloc(cap * sizeof *t->merge_slots);
    if (!t->merge_slots) goto nomem;
    for (size_t i = 0; i < cap; i++) t->merge_slots[i].rank = -1;
    {
        char *tmp = NULL; size_t tmp_cap = 0;
        for (int32_t r = 0; r < d->n_merges; r++) {
            const char *m = d->merges[r];
            size_t len = d->merge_lens ? d->merge_lens[r] : (m ? strlen(m) : 0);
            const char *sp = len > 1 ? memchr(m + 1, ' ', len - 1) : NULL;
            if (!sp || sp + 1 == m + len) {
                free(tmp);
                char shown[4 * 64 + 1];
                still_escape(shown, sizeof shown, m ? m : "", len > 64 ? 64 : len);
                rc = still_fail(err, STILL_E_FORMAT, "tokenizer: merge %d '%s' is not of the form 'a b'", r, shown);
                goto fail;
            }
            size_t la = (size_t)(sp - m), lb = len - la - 1;
            int32_t a = vocab_lookup(t, m, la), b = vocab_lookup(t, sp + 1, lb);
            if (la + lb > tmp_cap) {
                char *nt = realloc(tmp, la + lb);
                if (!nt) { free(tmp); goto nomem; }
                tmp = nt; tmp_cap = la + lb;
            }
            memcpy(tmp, m, la);
            memcpy(tmp + la, sp + 1, lb);
            int32_t res = vocab_lookup(t, tmp, la + lb);
            if (a < 0 || b < 0 || res < 0) {
                free(tmp);
                char shown[4 * 64 + 1];
                still_escape(shown, sizeof shown, m, len > 64 ? 64 : len);
                rc = still_fail(err, STILL_E_FORMAT, "tokenizer: merge %d '%s': %s not in the vocabulary", r, shown,
                                a < 0 ? "left part" : b < 0 ? "right part" : "merged token");
                goto fail;
            }
            merge_insert(t, a, b, r, res);
        }
        free(tmp);
    }

    /* special tokens */
    if (n_special) {
        t->special = malloc((size_t)n_special * sizeof *t->special);
        if (!t->special) goto nomem;
        for (int32_t i = 0; i < n; i++) {
            int32_t type = t->types[i];
            if ((type != TOKEN_TYPE_CONTROL && type != TOKEN_TYPE_USER_DEFINED) || t->str_len[i] == 0) continue;
            special_tok *sp = &t->special[t->n_special++];
            sp->id = i;
            sp->len = (uint32_t)t->str_len[i];
            sp->always = type == TOKEN_TYPE_USER_DEFINED;
            t->special_first[(unsigned char)t->str_arena[t->str_off[i]]] = true;
            if (sp->always) t->any_always = true;
        }
        qsort(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special);
    }

    /* special ids */
    const int32_t ids_in[4] = { d->bos_id, d->eos_id, d->unk_id, d->pad_id };
    for (int k = 0; k < 4; k++) {
        if (ids_in[k] >= n || ids_in[k] < -1) {
            rc = still_fail(err, STILL_E_FORMAT, "tokenizer: special token id %d out of range (n_vocab %d)",
                            ids_in[k], n);
            goto fail;
        }
    }
    t->bos = d->bos_id; t->eos = d->eos_id; t->unk = d->unk_id; t->pad = d->pad_id;
    {
        int32_t cand[3] = { t->eos, vocab_lookup(t, "<|im_end|>", 10), vocab_lookup(t, "<|endoftext|>", 13) };
        for (int k = 0; k < 3; k++) {
            if (cand[k] < 0) continue;
            bool dup = false;
            for (int j = 0; j < t->n_eog; j++) dup |= t->eog[j] == cand[k];
            if (!dup) t->eog[t->n_eog++] = cand[k];
        }
    }

    /* regexes (compiled per tokenizer object: no global state) */
    if ((rc = compile_regex(GPT2_PATTERN, &t->re_words, err))) goto fail;
    if (split_digits && (rc = compile_regex(DIGIT_PATTERN, &t->re_digit, err))) goto fail;

    *out = t;
    return STILL_OK;

nomem:
    rc = still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
fail:
    tokenizer_free(t);
    return rc;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->types);
    free(t->str_arena); free(t->str_off); free(t->str_len);
    free(t->dec_arena); free(t->dec_off); free(t->dec_len);
    free(t->vocab_slots);
    free(t->merge_slots);
    free(t->special);
    if (t->re_words) pcre2_code_free(t->re_words);
    if (t->re_digit) pcre2_code_free(t->re_digit);
    free(t->chat_template);
    free(t->default_system);
    free(t);
}

/* ---- accessors ------------------------------------------------------------------ */

int32_t tokenizer_n_vocab(const tokenizer *t) { return t->n_vocab; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const tokenizer *t) { return t->eos; }

int32_t tokenizer_find(const tokenizer *t, const char *text) {
    if (!text) return -1;
    return vocab_lookup(t, text, strlen(text));
}

int tokenizer_is_eog(const tokenizer *t, int32_t id) {
    if (id < 0) return 0;
    for (int k = 0; k < t->n_eog; k++) if (t->eog[k] == id) return 1;
    return 0;
}

int32_t tokenizer_token_type(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_vocab ? t->types[id] : 0;
}

const char *tokenizer_token_str(const tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_vocab) { if (len) *len = 0; return NULL; }
    if (len) *len = t->str_len[id];
    return t->str_arena + t->str_off[id];
}

/* ---- encoding --------------------------------------------------------------------- */

typedef struct { int32_t id, prev, next; } bpe_sym;        /* prev/next: -1 = none; id -1: merged away */
typedef struct { int32_t rank, left, right, left_id, right_id; } bpe_pair;

typedef struct {
    const tokenizer *t;
    int32_t *ids; size_t n_ids, cap_ids;
    bpe_sym *syms; size_t cap_syms;
    bpe_pair *heap; size_t n_heap, cap_heap;
    pcre2_match_data *md;
    still_err *err;
} enc_state;

/* Ensure the array whose pointer is at pp (any T **) holds need elements. */
static int grow(void *pp, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return STILL_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) {
        if (still_mul_overflow(c, 2, &c)) return STILL_E_NOMEM;
    }
    size_t bytes;
    if (still_mul_overflow(c, elem, &bytes)) return STILL_E_NOMEM;
    void *p;
    memcpy(&p, pp, sizeof p);
    void *np = realloc(p, bytes);
    if (!np) return STILL_E_NOMEM;
    memcpy(pp, &np, sizeof np);
    *cap = c;
    return STILL_OK;
}

static int emit(enc_state *s, int32_t id) {
    if (grow(&s->ids, &s->cap_ids, s->n_ids + 1, sizeof *s->ids))
        return still_fail(s->err, STILL_E_NOMEM, "tokenizer: out of memory");
    s->ids[s->n_ids++] = id;
    return STILL_OK;
}

static bool pair_less(const bpe_pair *a, const bpe_pair *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->left < b->left;
}

static void heap_push(enc_state *s, bpe_pair p) {       /* capacity reserved by caller */
    size_t i = s->n_heap++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!pair_less(&p, &s->heap[parent])) break;
        s->heap[i] = s->heap[parent];
        i = parent;
    }
    s->heap[i] = p;
}

static bpe_pair heap_pop(enc_state *s) {
    bpe_pair top = s->heap[0], last = s->heap[--s->n_heap];
    size_t i = 0, n = s->n_heap;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_less(&s->heap[c + 1], &s->heap[c])) c++;
        if (!pair_less(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

static void try_pair(enc_state *s, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const merge_slot *m = merge_lookup(s->t, s->syms[left].id, s->syms[right].id);
    if (!m) return;
    heap_push(s, (bpe_pair){ m->rank, left, right, s->syms[left].id, s->syms[right].id });
}

/* BPE of one pre-tokenized piece (valid UTF-8, n > 0).
 * Bytes without a single-byte token are skipped, and their neighbours become
 * adjacent symbols (as in HF's BPE model without an unk token, and llama.cpp). */
static int bpe_piece(enc_state *s, const char *p, size_t n) {
    const int32_t *bt = s->t->byte_tok;
    if (n == 1) return bt[(unsigned char)p[0]] >= 0 ? emit(s, bt[(unsigned char)p[0]]) : STILL_OK;
    if (n > INT32_MAX / 4) return still_fail(s->err, STILL_E_ARG, "tokenizer: piece of %zu bytes is too long", n);
    /* each merge pushes at most 2 pairs: heap never exceeds (n-1) + 2(n-1) */
    if (grow(&s->syms, &s->cap_syms, n, sizeof *s->syms) ||
        grow(&s->heap, &s->cap_heap, 3 * n, sizeof *s->heap))
        return still_fail(s->err, STILL_E_NOMEM, "tokenizer: out of memory");
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = bt[(unsigned char)p[i]];
        if (id < 0) continue;
        s->syms[m].id = id;
        s->syms[m].prev = m - 1;
        s->syms[m].next = m + 1;
        m++;
    }
    if (m == 0) return STILL_OK;
    s->syms[m - 1].next = -1;
    s->n_heap = 0;
    for (int32_t i = 0; i + 1 < m; i++) try_pair(s, i, i + 1);
    while (s->n_heap) {
        bpe_pair pr = heap_pop(s);
        bpe_sym *l = &s->syms[pr.left], *r = &s->syms[pr.right];
        /* stale entry? (a side was merged away or changed since the push;
         * symbol ids only ever grow longer, so equal ids mean unchanged) */
        if (l->id != pr.left_id || r->id != pr.right_id || l->next != pr.right) continue;
        const merge_slot *mg = merge_lookup(s->t, l->id, r->id);
        l->id = mg->result;
        l->next = r->next;
        if (r->next >= 0) s->syms[r->next].prev = pr.left;
        r->id = -1; r->prev = r->next = -1;
        try_pair(s, l->prev, pr.left);
        try_pair(s, pr.left, l->next);
    }
    for (int32_t i = 0; i >= 0; i = s->syms[i].next) {
        int rc = emit(s, s->syms[i].id);
        if (rc) return rc;
    }
    return STILL_OK;
}

/* pcre2_match on valid UTF-8; if the JIT runs out of its (small, default)
 * stack on some odd input, the interpreter is tried instead. */
static int match_at(const pcre2_code *re, const char *p, size_t n, size_t off, pcre2_match_data *md) {
    int m = pcre2_match(re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK, md, NULL);
    if (m == PCRE2_ERROR_JIT_STACKLIMIT)
        m = pcre2_match(re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    return m;
}

/* GPT-2 regex over a valid UTF-8 string, each match to BPE. */
static int regex_pieces(enc_state *s, const char *p, size_t n) {
    size_t off = 0;
    int rc;
    while (off < n) {
        int m = match_at(s->t->re_words, p, n, off, s->md);
        if (m == PCRE2_ERROR_NOMATCH) return bpe_piece(s, p + off, n - off);   /* cannot happen: every char matches */
        if (m < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(m, msg, sizeof msg);
            return still_fail(s->err, STILL_E_STATE, "tokenizer: regex match failed: %s", (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
        size_t a = ov[0], b = ov[1];
        if (a > off && (rc = bpe_piece(s, p + off, a - off))) return rc;     /* unmatched gap: cannot happen */
        if (b <= a) {                                   /* empty match: cannot happen; take one char */
            b = a + utf8_valid_len((const unsigned char *)p + a, n - a, NULL);
        }
        if ((rc = bpe_piece(s, p + a, b - a))) return rc;
        off = b;
    }
    return STILL_OK;
}

/* A maximal valid UTF-8 run: digit split (if enabled), then the regex. */
static int encode_valid(enc_state *s, const char *p, size_t n) {
    if (!s->t->split_digits) return regex_pieces(s, p, n);
    size_t off = 0, prev = 0;
    int rc;
    while (off < n) {
        int m = match_at(s->t->re_digit, p, n, off, s->md);
        if (m == PCRE2_ERROR_NOMATCH) break;
        if (m < 0) return still_fail(s->err, STILL_E_STATE, "tokenizer: digit match failed (%d)", m);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(s->md);
        size_t a = ov[0], b = ov[1];
        if (a > prev && (rc = regex_pieces(s, p + prev, a - prev))) return rc;
        if ((rc = bpe_piece(s, p + a, b - a))) return rc;
        off = prev = b;
    }
    if (prev < n) return regex_pieces(s, p + prev, n - prev);
    return STILL_OK;
}

/* Text between special tokens (arbitrary bytes).
 *
 * Invalid UTF-8: the regex pre-tokenizer (and HF, whose input is always a
 * valid string) is only defined on valid UTF-8, so the text is cut into
 * maximal valid runs and single invalid bytes, and each invalid byte becomes
 * its own single-byte token. Decoding maps that token back to the same byte,
 * so the round trip is exact; the tokenization of all valid text is exactly
 * what a reference tokenizer gives for it; and no byte is replaced by U+FFFD
 * (which could not round-trip). Merging invalid bytes into neighbouring
 * pieces was rejected: the pieces next to a bad byte would then differ from
 * any reference, for no gain on input that is not text anyway.
 *
 * Caveat: a byte-level vocabulary need not have all 256 byte tokens.
 * SmolLM2's lacks 21 (0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2
 * 0xF5-0xFF, bytes that never or hardly occur in its training text). No token
 * decodes to such a byte, so it cannot be represented at all; like HF's BPE
 * without an unk token and llama.cpp, it is dropped (emitting the unk id, here
 * <|endoftext|>, would inject an end-of-text marker into the prompt). Input
 * containing such bytes therefore does not round-trip; everything else does. */
static int encode_segment(enc_state *s, const char *p, size_t n) {
    size_t i = 0, run = 0;
    int rc;
    while (i < n) {
        size_t k = utf8_valid_len((const unsigned char *)p + i, n - i, NULL);
        if (k) { i += k; continue; }
        if (i > run && (rc = encode_valid(s, p + run, i - run))) return rc;
        int32_t id = s->t->byte_tok[(unsigned char)p[i]];
        if (id >= 0 && (rc = emit(s, id))) return rc;
        run = ++i;
    }
    if (n > run) return encode_valid(s, p + run, n - run);
    return STILL_OK;
}

/* Longest special token matching at p, or -1. */
static int32_t match_special(const tokenizer *t, const char *p, size_t n, int parse_special, size_t *len) {
    for (int32_t k = 0; k < t->n_special; k++) {
        const special_tok *sp = &t->special[k];
        if (!parse_special && !sp->always) continue;
        if (sp->len <= n && memcmp(p, t->str_arena + t->str_off[sp->id], sp->len) == 0) {
            *len = sp->len;
            return sp->id;
        }
    }
    return -1;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, int parse_special,
                     int32_t **ids, size_t *n_ids, still_err *err) {
    if (!t || !ids || !n_ids || (!text && len))
        return still_fail(err, STILL_E_ARG, "tokenizer_encode: bad arguments");
    *ids = NULL; *n_ids = 0;
    enc_state s = { .t = t, .err = err };
    s.md = pcre2_match_data_create(1, NULL);
    if (!s.md) return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    int rc = STILL_OK;
    bool look = t->n_special > 0 && (parse_special || t->any_always);
    size_t seg = 0, i = 0;
    while (look && i < len) {
        size_t sl;
        int32_t id;
        if (t->special_first[(unsigned char)text[i]] &&
            (id = match_special(t, text + i, len - i, parse_special, &sl)) >= 0) {
            if (i > seg && (rc = encode_segment(&s, text + seg, i - seg))) goto done;
            if ((rc = emit(&s, id))) goto done;
            i += sl;
            seg = i;
        } else {
            i++;
        }
    }
    if (len > seg) rc = encode_segment(&s, text + seg, len - seg);
done:
    pcre2_match_data_free(s.md);
    free(s.syms);
    free(s.heap);
    if (rc) { free(s.ids); return rc; }
    if (!s.ids) {                                     /* empty text: still hand back a valid buffer */
        s.ids = malloc(sizeof *s.ids);
        if (!s.ids) return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    }
    *ids = s.ids;
    *n_ids = s.n_ids;
    return STILL_OK;
}

/* ---- decoding ---------------------------------------------------------------------- */

size_t tokenizer_decode_token(const tokenizer *t, int32_t id, char *buf, size_t cap) {
    if (!t || id < 0 || id >= t->n_vocab) return 0;
    size_t n = t->dec_len[id];
    if (buf && cap) memcpy(buf, t->dec_arena + t->dec_off[id], n < cap ? n : cap);
    return n;
}

int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, char **text, size_t *len, still_err *err) {
    if (!t || !text || (!ids && n)) return still_fail(err, STILL_E_ARG, "tokenizer_decode: bad arguments");
    *text = NULL;
    if (len) *len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return still_fail(err, STILL_E_ARG, "tokenizer_decode: token id %d out of range (n_vocab %d)",
                              ids[i], t->n_vocab);
        if (still_add_overflow(total, t->dec_len[ids[i]], &total))
            return still_fail(err, STILL_E_NOMEM, "tokenizer_decode: output too large");
    }
    char *out = malloc(total + 1);
    if (!out) return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(out + o, t->dec_arena + t->dec_off[ids[i]], t->dec_len[ids[i]]);
        o += t->dec_len[ids[i]];
    }
    out[o] = '\0';
    *text = out;
    if (len) *len = o;
    return STILL_OK;
}

/* ---- chat ----------------------------------------------------------------------------- */

int chatml_render(const char *const *roles, const char *const *contents, size_t n,
                  int add_generation_prompt, const char *default_system,
                  char **out, still_err *err) {
    static const char START[] = "<|im_start|>", END[] = "<|im_end|>\n", GEN[] = "<|im_start|>assistant\n";
    if (!out || (n && (!roles || !contents))) return still_fail(err, STILL_E_ARG, "chatml_render: bad arguments");
    *out = NULL;
    bool add_sys = n > 0 && default_system && (!roles[0] || strcmp(roles[0], "system") != 0);
    size_t total = 1;
    size_t per = (sizeof START - 1) + 1 + (sizeof END - 1);
    if (add_sys) total += per + strlen("system") + strlen(default_system);
    for (size_t i = 0; i < n; i++) {
        if (!roles[i] || !contents[i])
            return still_fail(err, STILL_E_ARG, "chatml_render: message %zu has no role or content", i);
        size_t add = per + strlen(roles[i]);
        if (still_add_overflow(add, strlen(contents[i]), &add) || still_add_overflow(total, add, &total))
            return still_fail(err, STILL_E_NOMEM, "chatml_render: conversation too large");
    }
    if (add_generation_prompt) total += sizeof GEN - 1;
    char *buf = malloc(total);
    if (!buf) return still_fail(err, STILL_E_NOMEM, "chatml_render: out of memory");
    char *p = buf;
#define PUT(s, l) do { size_t l_ = (l); memcpy(p, (s), l_); p += l_; } while (0)
    for (size_t i = 0; i < n; i++) {
        if (i == 0 && add_sys) {
            PUT(START, sizeof START - 1); PUT("system\n", 7);
            PUT(default_system, strlen(default_system)); PUT(END, sizeof END - 1);
        }
        PUT(START, sizeof START - 1); PUT(roles[i], strlen(roles[i])); PUT("\n", 1);
        PUT(contents[i], strlen(contents[i])); PUT(END, sizeof END - 1);
    }
    if (add_generation_prompt) PUT(GEN, sizeof GEN - 1);
#undef PUT
    *p = '\0';
    *out = buf;
    return STILL_OK;
}

/* Extract the default system prompt from a ChatML template: the literal between
 * "<|im_start|>system\n" (real newline or the two characters "\n") and the
 * next "<|im_end|>", with Jinja string escapes undone. NULL if there is no
 * such literal, or if it is not a plain string (contains quotes or Jinja
 * delimiters, e.g. "'<|im_start|>system\n' + message['content']"). */
static char *extract_default_system(const char *tmpl) {
    static const char *const heads[] = { "<|im_start|>system\n", "<|im_start|>system\\n" };
    for (size_t h = 0; h < 2; h++) {
        const char *a = strstr(tmpl, heads[h]);
        if (!a) continue;
        a += strlen(heads[h]);
        const char *b = strstr(a, "<|im_end|>");
        if (!b) continue;
        char *s = malloc((size_t)(b - a) + 1);
        if (!s) return NULL;
        size_t o = 0;
        bool ok = true;
        for (const char *p = a; p < b && ok; p++) {
            if (*p == '\\' && p + 1 < b) {
                p++;
                switch (*p) {
                case 'n': s[o++] = '\n'; break;
                case 't': s[o++] = '\t'; break;
                case 'r': s[o++] = '\r'; break;
                case '\\': case '\'': case '"': s[o++] = *p; break;
                default: ok = false;
                }
            } else if (*p == '\'' || *p == '"' || ((*p == '{' || *p == '}') && p + 1 < b &&
                       (p[1] == '{' || p[1] == '%' || p[1] == '}'))) {
                ok = false;
            } else {
                s[o++] = *p;
            }
        }
        if (ok && o > 0) { s[o] = '\0'; return s; }
        free(s);
    }
    return NULL;
}

int tokenizer_set_chat_template(tokenizer *t, const char *tmpl, size_t len, still_err *err) {
    if (!t || (!tmpl && len)) return still_fail(err, STILL_E_ARG, "tokenizer_set_chat_template: bad arguments");
    if (tmpl && memchr(tmpl, '\0', len))
        return still_fail(err, STILL_E_FORMAT, "tokenizer: chat template contains a NUL byte");
    char *copy = malloc(len + 1);
    if (!copy) return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    if (len) memcpy(copy, tmpl, len);
    copy[len] = '\0';
    free(t->chat_template);
    free(t->default_system);
    t->chat_template = copy;
    t->default_system = extract_default_system(copy);
    return STILL_OK;
}

const char *tokenizer_chat_template(const tokenizer *t) { return t->chat_template; }
const char *tokenizer_default_system(const tokenizer *t) { return t->default_system; }

/* ---- GGUF ------------------------------------------------------------------------------ */

static bool is_int_type(gguf_type ty) {
    return ty == GGUF_TYPE_UINT8 || ty == GGUF_TYPE_INT8 || ty == GGUF_TYPE_UINT16 || ty == GGUF_TYPE_INT16 ||
           ty == GGUF_TYPE_UINT32 || ty == GGUF_TYPE_INT32 || ty == GGUF_TYPE_UINT64 || ty == GGUF_TYPE_INT64;
}
static bool is_signed_type(gguf_type ty) {
    return ty == GGUF_TYPE_INT8 || ty == GGUF_TYPE_INT16 || ty == GGUF_TYPE_INT32 || ty == GGUF_TYPE_INT64;
}

/* Optional token id: -1 if the key is absent. */
static int opt_token_id(const gguf_file *f, const char *key, int32_t *out, still_err *err) {
    *out = -1;
    if (!gguf_find(f, key)) return STILL_OK;
    uint32_t v;
    int rc = gguf_get_u32(f, key, &v, err);
    if (rc) return rc;
    if (v > INT32_MAX) return still_fail(err, STILL_E_FORMAT, "%s: token id %u out of range", key, v);
    *out = (int32_t)v;
    return STILL_OK;
}

/* String array (tokens or merges) into pointer/length arrays. */
static int get_strings(const gguf_file *f, const char *key, const char ***strs, size_t **lens, int32_t *count,
                       still_err *err) {
    const gguf_value *items; uint64_t n;
    int rc = gguf_get_arr(f, key, GGUF_TYPE_STRING, &items, &n, err);
    if (rc) return rc;
    if (n > INT32_MAX) return still_fail(err, STILL_E_FORMAT, "%s: too many entries (%llu)", key,
                                         (unsigned long long)n);
    *strs = malloc((n ? n : 1) * sizeof **strs);
    *lens = malloc((n ? n : 1) * sizeof **lens);
    if (!*strs || !*lens) {
        free(*strs); free(*lens); *strs = NULL; *lens = NULL;
        return still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory");
    }
    for (uint64_t i = 0; i < n; i++) {
        if (items[i].v.str.len > SIZE_MAX / 2) {
            free(*strs); free(*lens); *strs = NULL; *lens = NULL;
            return still_fail(err, STILL_E_FORMAT, "%s[%llu]: string too long", key, (unsigned long long)i);
        }
        (*strs)[i] = items[i].v.str.ptr;
        (*lens)[i] = (size_t)items[i].v.str.len;
    }
    *count = (int32_t)n;
    return STILL_OK;
}

int tokenizer_from_gguf(const gguf_file *f, tokenizer **out, still_err *err) {
    if (!f || !out) return still_fail(err, STILL_E_ARG, "tokenizer_from_gguf: bad arguments");
    *out = NULL;
    int rc;
    gguf_str s;

    if (!gguf_find(f, "tokenizer.ggml.model"))
        return still_fail(err, STILL_E_FORMAT, "GGUF has no tokenizer (tokenizer.ggml.model is missing)");
    if ((rc = gguf_get_str(f, "tokenizer.ggml.model", &s, err))) return rc;
    if (!(s.len == 4 && memcmp(s.ptr, "gpt2", 4) == 0))
        return still_fail(err, STILL_E_UNSUPPORTED,
                          "tokenizer model '%.*s' is not supported (only 'gpt2' byte-level BPE is)",
                          (int)(s.len > 64 ? 64 : s.len), s.ptr);

    char pre[64] = "gpt2";    /* absent: the original GPT-2 pre-tokenizer */
    if (gguf_find(f, "tokenizer.ggml.pre")) {
        if ((rc = gguf_get_str(f, "tokenizer.ggml.pre", &s, err))) return rc;
        if (s.len >= sizeof pre || memchr(s.ptr, '\0', s.len))
            return still_fail(err, STILL_E_UNSUPPORTED, "tokenizer: unsupported pre-tokenizer '%.*s'",
                              (int)(s.len > 64 ? 64 : s.len), s.ptr);
        memcpy(pre, s.ptr, s.len);
        pre[s.len] = '\0';
    }

    tokenizer_desc d = { .pre = pre };
    const char **toks = NULL, **merges = NULL;
    size_t *tok_lens = NULL, *merge_lens = NULL;
    int32_t *types = NULL;
    tokenizer *t = NULL;

    if ((rc = get_strings(f, "tokenizer.ggml.tokens", &toks, &tok_lens, &d.n_vocab, err))) goto done;
    if (d.n_vocab == 0) { rc = still_fail(err, STILL_E_FORMAT, "tokenizer.ggml.tokens is empty"); goto done; }
    if (!gguf_find(f, "tokenizer.ggml.merges")) {
        rc = still_fail(err, STILL_E_FORMAT, "gpt2 tokenizer without tokenizer.ggml.merges");
        goto done;
    }
    if ((rc = get_strings(f, "tokenizer.ggml.merges", &merges, &merge_lens, &d.n_merges, err))) goto done;

    const gguf_value *tv = gguf_find(f, "tokenizer.ggml.token_type");
    if (tv) {
        if (tv->type != GGUF_TYPE_ARRAY || !is_int_type(tv->v.arr.elem_type) || tv->v.arr.n != (uint64_t)d.n_vocab) {
            rc = still_fail(err, STILL_E_FORMAT, "tokenizer.ggml.token_type: expected %d integers", d.n_vocab);
            goto done;
        }
        types = malloc((size_t)d.n_vocab * sizeof *types);
        if (!types) { rc = still_fail(err, STILL_E_NOMEM, "tokenizer: out of memory"); goto done; }
        bool sgn = is_signed_type(tv->v.arr.elem_type);
        for (int32_t i = 0; i < d.n_vocab; i++) {
            const gguf_value *it = &tv->v.arr.items[i];
            int64_t v = sgn ? it->v.i64 : (it->v.u64 > INT32_MAX ? -1 : (int64_t)it->v.u64);
            types[i] = v >= 0 && v <= 64 ? (int32_t)v : 0;
        }
    }

    d.tokens = toks; d.token_lens = tok_lens; d.token_types = types;
    d.merges = merges; d.merge_lens = merge_lens;
    if ((rc = opt_token_id(f, "tokenizer.ggml.bos_token_id", &d.bos_id, err)) ||
        (rc = opt_token_id(f, "tokenizer.ggml.eos_token_id", &d.eos_id, err)) ||
        (rc = opt_token_id(f, "tokenizer.ggml.unknown_token_id", &d.unk_id, err)) ||
        (rc = opt_token_id(f, "tokenizer.ggml.padding_token_id", &d.pad_id, err)))
        goto done;

    if ((rc = tokenizer_create(&d, &t, err))) goto done;
    if (gguf_find(f, "tokenizer.chat_template")) {
        if ((rc = gguf_get_str(f, "tokenizer.chat_template", &s, err)) ||
            (rc = tokenizer_set_chat_template(t, s.ptr, (size_t)s.len, err))) {
            tokenizer_free(t);
            t = NULL;
            goto done;
        }
    }
    *out = t;
done:
    free(toks); free(tok_lens); free(merges); free(merge_lens); free(types);
    return rc;
}
