/* Unit tests for the GGUF reader/writer (src/format/gguf.c).
 *
 *  - writer -> reader round trip of every value type (nested arrays too) and
 *    several tensors of different types, through a file and a memory buffer;
 *  - the writer's output is compared byte for byte with an independent
 *    serializer written here;
 *  - malformed input: every truncation of a valid file, targeted corruptions
 *    of each header/kv/tensor field, nesting depth, and random byte flips.
 *    Each must fail with STILL_E_FORMAT and a non-empty one-line message.
 *
 * Prints "N passed, N failed" and exits non-zero on any failure. */
#include "common/common.h"
#include "format/gguf.h"
#include "format/quant.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    int pass, fail;
} tctx;

static void check_(tctx *t, int ok, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static void check_(tctx *t, int ok, const char *file, int line, const char *fmt, ...) {
    if (ok) {
        t->pass++;
        return;
    }
    t->fail++;
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}
#define CHECK(t, cond, ...) check_((t), !!(cond), __FILE__, __LINE__, __VA_ARGS__)

/* ---- an independent little serializer --------------------------------- */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void b_put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n) nc *= 2;
        b->p = realloc(b->p, nc);
        if (!b->p) abort();
        b->cap = nc;
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void b_uint(buf *b, uint64_t v, int n) {
    uint8_t x[8];
    for (int i = 0; i < n; i++) x[i] = (uint8_t)(v >> (8 * i));
    b_put(b, x, (size_t)n);
}
static void b_str(buf *b, const char *s, size_t len) {
    b_uint(b, len, 8);
    b_put(b, s, len);
}
static void b_pad(buf *b, size_t align) {
    while (b->n % align) b_uint(b, 0, 1);
}

static void patch(uint8_t *p, size_t off, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[off + (size_t)i] = (uint8_t)(v >> (8 * i));
}

/* Reference file content. */
#define REF_NKV 6
#define REF_NT 3
typedef struct {
    size_t magic, version, n_tensors, n_kv;
    size_t key_len[REF_NKV], key[REF_NKV], vtype[REF_NKV], val[REF_NKV];
    size_t tname_len[REF_NT], tname[REF_NT], tndims[REF_NT], tne[REF_NT][4], ttype[REF_NT],
        toff[REF_NT];
    size_t data_start;
} layout;

static const char *ref_keys[REF_NKV] = { "general.architecture", "general.alignment", "test.aaa",
                                         "test.bbb", "test.ccc", "test.ddd" };
static const char *ref_tnames[REF_NT] = { "tensor.a", "tensor.b", "tensor.c" };
static const uint32_t ref_ttypes[REF_NT] = { TT_F32, TT_Q8_0, TT_F16 };
static const uint32_t ref_tndims[REF_NT] = { 2, 2, 1 };
static const int64_t ref_tne[REF_NT][2] = { { 8, 2 }, { 32, 2 }, { 16, 1 } };
static const size_t ref_tbytes[REF_NT] = { 64, 68, 32 };
static const uint64_t ref_toff[REF_NT] = { 0, 64, 160 };   /* data ends at 192: aligned */

static uint8_t ref_tdata(int t, size_t i) { return (uint8_t)(i * 7u + (unsigned)t * 31u + 1u); }

static void build_ref(buf *b, layout *L) {
    memset(b, 0, sizeof *b);
    L->magic = b->n;
    b_put(b, "GGUF", 4);
    L->version = b->n;
    b_uint(b, 3, 4);
    L->n_tensors = b->n;
    b_uint(b, REF_NT, 8);
    L->n_kv = b->n;
    b_uint(b, REF_NKV, 8);
    for (int i = 0; i < REF_NKV; i++) {
        L->key_len[i] = b->n;
        L->key[i] = b->n + 8;
        b_str(b, ref_keys[i], strlen(ref_keys[i]));
        L->vtype[i] = b->n;
        static const uint32_t types[REF_NKV] = { GGUF_TYPE_STRING, GGUF_TYPE_UINT32,
                                                 GGUF_TYPE_ARRAY,  GGUF_TYPE_ARRAY,
                                                 GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL };
        b_uint(b, types[i], 4);
        L->val[i] = b->n;
        switch (i) {
        case 0: b_str(b, "llama", 5); break;
        case 1: b_uint(b, 32, 4); break;
        case 2:
            b_uint(b, GGUF_TYPE_UINT32, 4);
            b_uint(b, 3, 8);
            for (int k = 1; k <= 3; k++) b_uint(b, (uint64_t)k, 4);
            break;
        case 3:   /* [["a","bc"],["d"]] */
            b_uint(b, GGUF_TYPE_ARRAY, 4);
            b_uint(b, 2, 8);
            b_uint(b, GGUF_TYPE_STRING, 4);
            b_uint(b, 2, 8);
            b_str(b, "a", 1);
            b_str(b, "bc", 2);
            b_uint(b, GGUF_TYPE_STRING, 4);
            b_uint(b, 1, 8);
            b_str(b, "d", 1);
            break;
        case 4: {
            float f = 1.5f;
            uint32_t u;
            memcpy(&u, &f, 4);
            b_uint(b, u, 4);
            break;
        }
        case 5: b_uint(b, 1, 1); break;
        }
    }
    for (int t = 0; t < REF_NT; t++) {
        L->tname_len[t] = b->n;
        L->tname[t] = b->n + 8;
        b_str(b, ref_tnames[t], strlen(ref_tnames[t]));
        L->tndims[t] = b->n;
        b_uint(b, ref_tndims[t], 4);
        for (uint32_t d = 0; d < ref_tndims[t]; d++) {
            L->tne[t][d] = b->n;
            b_uint(b, (uint64_t)ref_tne[t][d], 8);
        }
        L->ttype[t] = b->n;
        b_uint(b, ref_ttypes[t], 4);
        L->toff[t] = b->n;
        b_uint(b, ref_toff[t], 8);
    }
    b_pad(b, 32);
    L->data_start = b->n;
    for (int t = 0; t < REF_NT; t++) {
        while (b->n < L->data_start + ref_toff[t]) b_uint(b, 0, 1);
        for (size_t i = 0; i < ref_tbytes[t]; i++) b_uint(b, ref_tdata(t, i), 1);
    }
    b_pad(b, 32);
}

/* Build the same content through the writer. */
static int write_ref(const char *path, still_err *err) {
    gguf_writer *w = NULL;
    int rc = gguf_writer_create(&w, err);
    if (rc) return rc;
    gguf_value u32s[3], inner0[2], inner1[1], outer[2], v;
    for (int k = 0; k < 3; k++) u32s[k] = (gguf_value){ .type = GGUF_TYPE_UINT32, .v.u64 = (uint64_t)k + 1 };
    inner0[0] = (gguf_value){ .type = GGUF_TYPE_STRING, .v.str = { 1, "a" } };
    inner0[1] = (gguf_value){ .type = GGUF_TYPE_STRING, .v.str = { 2, "bc" } };
    inner1[0] = (gguf_value){ .type = GGUF_TYPE_STRING, .v.str = { 1, "d" } };
    outer[0] = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, 2, inner0 } };
    outer[1] = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, 1, inner1 } };
    if (!rc) rc = gguf_writer_set_str(w, "general.architecture", "llama", err);
    if (!rc) rc = gguf_writer_set_u32(w, "general.alignment", 32, err);
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_UINT32, 3, u32s } };
    if (!rc) rc = gguf_writer_set(w, "test.aaa", &v, err);
    v = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 2, outer } };
    if (!rc) rc = gguf_writer_set(w, "test.bbb", &v, err);
    if (!rc) rc = gguf_writer_set_f32(w, "test.ccc", 1.5f, err);
    if (!rc) rc = gguf_writer_set_bool(w, "test.ddd", true, err);
    for (int t = 0; t < REF_NT && !rc; t++) {
        uint8_t data[128];
        for (size_t i = 0; i < ref_tbytes[t]; i++) data[i] = ref_tdata(t, i);
        rc = gguf_writer_add_tensor(w, ref_tnames[t], ref_ttypes[t], ref_tndims[t], ref_tne[t],
                                    data, ref_tbytes[t], err);
    }
    if (!rc) rc = gguf_writer_write(w, path, err);
    gguf_writer_free(w);
    return rc;
}

static int read_whole(const char *path, buf *b) {
    memset(b, 0, sizeof *b);
    FILE *fp = fopen(path, "rb");
    if (!fp) return -1;
    uint8_t tmp[4096];
    size_t k;
    while ((k = fread(tmp, 1, sizeof tmp, fp)) > 0) b_put(b, tmp, k);
    fclose(fp);
    return 0;
}

/* ---- helpers ------------------------------------------------------------ */

static int msg_ok(const still_err *e) {
    return e->msg[0] != '\0' && strchr(e->msg, '\n') == NULL;
}

/* Walk everything a caller may touch, to let ASan see out-of-bounds reads. */
static unsigned walk_value(const gguf_value *v) {
    unsigned h = (unsigned)v->type;
    if (v->type == GGUF_TYPE_STRING) {
        for (uint64_t i = 0; i < v->v.str.len; i++) h = h * 31 + (unsigned char)v->v.str.ptr[i];
    } else if (v->type == GGUF_TYPE_ARRAY) {
        for (uint64_t i = 0; i < v->v.arr.n; i++) {
            if (v->v.arr.items[i].type != v->v.arr.elem_type) abort();
            h = h * 31 + walk_value(&v->v.arr.items[i]);
        }
    } else {
        h = h * 31 + (unsigned)v->v.u64;
    }
    return h;
}

static unsigned walk_file(const gguf_file *f, const uint8_t *base, size_t size) {
    unsigned h = 0;
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        const gguf_kv *kv = gguf_kv_at(f, i);
        h = h * 31 + walk_value(&kv->value);
        char key[256];
        if (kv->key.len < sizeof key) {
            memcpy(key, kv->key.ptr, (size_t)kv->key.len);
            key[kv->key.len] = '\0';
            if (gguf_find(f, key) != &kv->value) abort();
        }
    }
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        const uint8_t *d = t->data;
        if (base && (d < base || t->nbytes > size || d + t->nbytes > base + size)) abort();
        h = h * 31 + d[0] + d[t->nbytes - 1];
    }
    return h;
}

/* Expect a malformed buffer to be rejected cleanly. The buffer is copied to
 * an exact-size heap block so ASan catches any overread. */
static void expect_bad(tctx *t, const uint8_t *data, size_t size, const char *what,
                       const char *substr) {
    uint8_t *copy = malloc(size ? size : 1);
    if (size) memcpy(copy, data, size);
    gguf_file *f = NULL;
    still_err e = { 0, "" };
    int rc = gguf_open_memory(copy, size, &f, &e);
    CHECK(t, rc == STILL_E_FORMAT, "%s: expected STILL_E_FORMAT, got %d (%s)", what, rc, e.msg);
    CHECK(t, f == NULL, "%s: out not NULL on failure", what);
    CHECK(t, msg_ok(&e), "%s: message empty or multi-line: '%s'", what, e.msg);
    CHECK(t, e.code == rc, "%s: err.code %d != rc %d", what, e.code, rc);
    if (substr)
        CHECK(t, strstr(e.msg, substr) != NULL, "%s: message '%s' lacks '%s'", what, e.msg,
              substr);
    if (getenv("GGUF_TEST_VERBOSE")) printf("%-32s -> %s\n", what, e.msg);
    if (f) gguf_close(f);
    free(copy);
}

typedef struct {
    const char *what;
    size_t off;
    uint64_t val;
    int width;
    const char *substr;
} corruption;

/* ---- tests -------------------------------------------------------------- */

static void test_reference_and_malformed(tctx *t, const char *dir) {
    buf ref;
    layout L;
    build_ref(&ref, &L);

    /* The reference buffer itself is valid. */
    still_err e = { 0, "" };
    gguf_file *f = NULL;
    int rc = gguf_open_memory(ref.p, ref.n, &f, &e);
    CHECK(t, rc == STILL_OK, "reference buffer rejected: %s", e.msg);
    if (f) {
        CHECK(t, gguf_version(f) == 3, "version");
        CHECK(t, gguf_alignment(f) == 32, "alignment");
        CHECK(t, gguf_data_offset(f) == L.data_start, "data offset %llu != %zu",
              (unsigned long long)gguf_data_offset(f), L.data_start);
        CHECK(t, gguf_kv_count(f) == REF_NKV && gguf_tensor_count(f) == REF_NT, "counts");
        for (int i = 0; i < REF_NT; i++) {
            const gguf_tensor *tt = gguf_find_tensor(f, ref_tnames[i]);
            CHECK(t, tt && tt->nbytes == ref_tbytes[i] && tt->offset == ref_toff[i] &&
                         tt->data == ref.p + L.data_start + ref_toff[i],
                  "tensor %s", ref_tnames[i]);
        }
        walk_file(f, ref.p, ref.n);
        gguf_close(f);
    }

    /* The writer produces exactly the same bytes. */
    char path[512];
    snprintf(path, sizeof path, "%s/ref.gguf", dir);
    rc = write_ref(path, &e);
    CHECK(t, rc == STILL_OK, "write_ref: %s", e.msg);
    buf got;
    CHECK(t, read_whole(path, &got) == 0, "read back %s", path);
    CHECK(t, got.n == ref.n && memcmp(got.p, ref.p, ref.n) == 0,
          "writer output differs from reference serializer (%zu vs %zu bytes)", got.n, ref.n);
    free(got.p);
    unlink(path);

    /* (a) every truncation */
    int trunc_bad = 0;
    for (size_t len = 0; len < ref.n; len++) {
        uint8_t *copy = malloc(len ? len : 1);
        memcpy(copy, ref.p, len);
        gguf_file *g = NULL;
        still_err e2 = { 0, "" };
        int r2 = gguf_open_memory(copy, len, &g, &e2);
        if (r2 != STILL_E_FORMAT || g || !msg_ok(&e2)) {
            if (trunc_bad++ < 5)
                fprintf(stderr, "truncation at %zu: rc=%d msg='%s'\n", len, r2, e2.msg);
        }
        gguf_close(g);
        free(copy);
    }
    CHECK(t, trunc_bad == 0, "%d truncations of %zu accepted or badly reported", trunc_bad, ref.n);

    /* (b) targeted corruptions */
    const uint64_t U64 = UINT64_MAX;
    const corruption cs[] = {
        { "magic", L.magic, 'X', 1, "magic" },
        { "magic all zero", L.magic, 0, 4, "magic" },
        { "version 1", L.version, 1, 4, "version" },
        { "version 4", L.version, 4, 4, "version" },
        { "version 0", L.version, 0, 4, "version" },
        { "version big-endian", L.version, 0x03000000u, 4, "big-endian" },
        { "n_tensors max", L.n_tensors, U64, 8, "tensor count" },
        { "n_tensors 2^40", L.n_tensors, 1ull << 40, 8, "tensor count" },
        { "n_tensors +1", L.n_tensors, REF_NT + 1, 8, NULL },
        { "n_kv max", L.n_kv, U64, 8, "kv count" },
        { "n_kv 2^33", L.n_kv, 1ull << 33, 8, "kv count" },
        { "n_kv +1", L.n_kv, REF_NKV + 1, 8, NULL },
        { "n_kv -1", L.n_kv, REF_NKV - 1, 8, NULL },
        { "key len max", L.key_len[0], U64, 8, "key length" },
        { "key len 2^20", L.key_len[0], 1u << 20, 8, "key length" },
        { "key len 0", L.key_len[2], 0, 8, "empty key" },
        { "key len +1", L.key_len[0], strlen(ref_keys[0]) + 1, 8, NULL },
        { "key NUL", L.key[2], 0, 1, "NUL" },
        { "value type 13", L.vtype[0], 13, 4, "unknown value type 13" },
        { "value type max", L.vtype[4], 0xffffffffu, 4, "unknown value type" },
        { "string len max", L.val[0], U64, 8, "string value length" },
        { "string len huge", L.val[0], 1ull << 31, 8, "string value length" },
        { "array etype 13", L.val[2], 13, 4, "element type 13" },
        { "array n max", L.val[2] + 4, U64, 8, "cannot fit" },
        { "array n 2^40", L.val[2] + 4, 1ull << 40, 8, "cannot fit" },
        { "array n +1", L.val[2] + 4, 4, 8, NULL },
        { "nested etype 13", L.val[3] + 12, 13, 4, "element type" },
        { "nested inner n max", L.val[3] + 16, U64, 8, "cannot fit" },
        { "nested outer n max", L.val[3] + 4, U64, 8, "cannot fit" },
        { "alignment 0", L.val[1], 0, 4, "power of two" },
        { "alignment 3", L.val[1], 3, 4, "power of two" },
        { "alignment 48", L.val[1], 48, 4, "power of two" },
        { "alignment 2^31", L.val[1], 1u << 31, 4, "past the end" },
        { "alignment 64", L.val[1], 64, 4, "alignment" },
        { "alignment type int32", L.vtype[1], GGUF_TYPE_INT32, 4, "expected uint32" },
        { "alignment type float32", L.vtype[1], GGUF_TYPE_FLOAT32, 4, "expected uint32" },
        { "bool 2", L.val[5], 2, 1, "bool" },
        { "tensor name len max", L.tname_len[1], U64, 8, "name length" },
        { "tensor name len 0", L.tname_len[1], 0, 8, "empty name" },
        { "tensor name NUL", L.tname[1] + 3, 0, 1, "NUL" },
        { "n_dims 0", L.tndims[0], 0, 4, "n_dims" },
        { "n_dims 5", L.tndims[0], 5, 4, "n_dims" },
        { "n_dims max", L.tndims[0], 0xffffffffu, 4, "n_dims" },
        { "ne0 = 0", L.tne[0][0], 0, 8, "ne[0]" },
        { "ne1 = 0", L.tne[0][1], 0, 8, "ne[1]" },
        { "ne0 negative", L.tne[0][0], U64, 8, "ne[0]" },
        { "ne1 = 2^62 (element overflow)", L.tne[0][1], 1ull << 62, 8, "overflow" },
        { "ne0 = 2^61 (byte size overflow)", L.tne[0][0], 1ull << 61, 8, "overflow" },
        { "ne1 = 2^40 (data past end)", L.tne[0][1], 1ull << 40, 8, "past the end" },
        { "ne0 not block multiple", L.tne[1][0], 33, 8, "block size" },
        { "ne0 < block", L.tne[1][0], 16, 8, "block size" },
        { "ne0 grows into next tensor", L.tne[0][0], 16, 8, "overlap" },
        { "tensor type 99", L.ttype[0], 99, 4, "unknown tensor type 99" },
        { "tensor type 4", L.ttype[1], 4, 4, "unknown tensor type 4" },
        { "tensor type max", L.ttype[2], 0xffffffffu, 4, "unknown tensor type" },
        { "offset unaligned", L.toff[1], 65, 8, "alignment" },
        { "offset overlap a", L.toff[1], 32, 8, "overlap" },
        { "offset overlap c", L.toff[1], 96, 8, "overlap" },
        { "offset same as a", L.toff[2], 0, 8, "overlap" },
        { "offset past end", L.toff[2], 192, 8, "past the end" },
        { "offset 2^40", L.toff[0], 1ull << 40, 8, "past the end" },
        { "offset wraps", L.toff[0], U64 - 31, 8, "past the end" },
        { "duplicate tensor name", L.tname[1] + 7, 'a', 1, "duplicate tensor name 'tensor.a'" },
        { "duplicate key", L.key[3] + 5, 0x616161u /* "aaa" */, 3,
          "duplicate key 'test.aaa'" },
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        uint8_t *c = malloc(ref.n);
        memcpy(c, ref.p, ref.n);
        patch(c, cs[i].off, cs[i].val, cs[i].width);
        expect_bad(t, c, ref.n, cs[i].what, cs[i].substr);
        free(c);
    }

    /* Empty and tiny inputs. */
    expect_bad(t, (const uint8_t *)"", 0, "empty", "truncated");
    expect_bad(t, (const uint8_t *)"GGUF", 4, "magic only", "version");
    expect_bad(t, ref.p, 0, "empty (non-NULL)", NULL);

    /* (c) random byte mutations: must never crash; accepted results must be
     * internally consistent (walk_file aborts otherwise). */
    uint64_t s = 0x9e3779b97f4a7c15ull;
    int accepted = 0;
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t *c = malloc(ref.n);
        memcpy(c, ref.p, ref.n);
        int nflip = 1 + iter % 4;
        for (int k = 0; k < nflip; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            size_t off = (size_t)(s % (L.data_start + 8));   /* mostly the header */
            c[off] = (uint8_t)(iter & 1 ? c[off] ^ (1u << (s >> 40) % 8) : (s >> 32));
        }
        gguf_file *g = NULL;
        still_err e2 = { 0, "" };
        int r2 = gguf_open_memory(c, ref.n, &g, &e2);
        if (r2 == STILL_OK) {
            accepted++;
            walk_file(g, c, ref.n);
            gguf_close(g);
        } else if (!msg_ok(&e2) || g) {
            CHECK(t, 0, "mutation %d: bad failure report rc=%d '%s'", iter, r2, e2.msg);
        }
        free(c);
    }
    CHECK(t, accepted < 20000, "every mutation accepted?");
    free(ref.p);
}

/* Arrays nested `levels` deep: header with one kv "deep". */
static void build_nested(buf *b, int levels) {
    memset(b, 0, sizeof *b);
    b_put(b, "GGUF", 4);
    b_uint(b, 3, 4);
    b_uint(b, 0, 8);
    b_uint(b, 1, 8);
    b_str(b, "deep", 4);
    b_uint(b, GGUF_TYPE_ARRAY, 4);
    for (int i = 1; i < levels; i++) {
        b_uint(b, GGUF_TYPE_ARRAY, 4);
        b_uint(b, 1, 8);
    }
    b_uint(b, GGUF_TYPE_UINT8, 4);
    b_uint(b, 1, 8);
    b_uint(b, 42, 1);
}

static void test_nesting(tctx *t) {
    buf b;
    for (int levels = 1; levels <= 8; levels++) {
        build_nested(&b, levels);
        gguf_file *f = NULL;
        still_err e = { 0, "" };
        int rc = gguf_open_memory(b.p, b.n, &f, &e);
        CHECK(t, rc == STILL_OK, "nesting %d rejected: %s", levels, e.msg);
        if (f) {
            const gguf_value *v = gguf_find(f, "deep");
            for (int i = 1; v && i < levels; i++) v = v->v.arr.n == 1 ? &v->v.arr.items[0] : NULL;
            CHECK(t, v && v->type == GGUF_TYPE_ARRAY && v->v.arr.elem_type == GGUF_TYPE_UINT8 &&
                         v->v.arr.n == 1 && v->v.arr.items[0].v.u64 == 42,
                  "nesting %d decoded wrong", levels);
            gguf_close(f);
        }
        free(b.p);
    }
    build_nested(&b, 9);
    expect_bad(t, b.p, b.n, "nesting 9", "nested deeper");
    free(b.p);
    build_nested(&b, 100000);
    expect_bad(t, b.p, b.n, "nesting 100000", "nested deeper");
    free(b.p);

    /* A zero-kv, zero-tensor file is valid. */
    memset(&b, 0, sizeof b);
    b_put(&b, "GGUF", 4);
    b_uint(&b, 2, 4);   /* version 2 accepted too */
    b_uint(&b, 0, 8);
    b_uint(&b, 0, 8);
    gguf_file *f = NULL;
    still_err e = { 0, "" };
    CHECK(t, gguf_open_memory(b.p, b.n, &f, &e) == STILL_OK, "empty v2 file: %s", e.msg);
    CHECK(t, f && gguf_kv_count(f) == 0 && gguf_tensor_count(f) == 0 && gguf_version(f) == 2,
          "empty file counts");
    CHECK(t, gguf_find(f, "x") == NULL && gguf_find_tensor(f, "x") == NULL &&
                 gguf_kv_at(f, 0) == NULL && gguf_tensor_at(f, -1) == NULL,
          "lookups on empty file");
    gguf_close(f);
    free(b.p);
}

static int value_eq(const gguf_value *a, const gguf_value *b) {
    if (a->type != b->type) return 0;
    switch (a->type) {
    case GGUF_TYPE_STRING:
        return a->v.str.len == b->v.str.len &&
               (a->v.str.len == 0 || memcmp(a->v.str.ptr, b->v.str.ptr, a->v.str.len) == 0);
    case GGUF_TYPE_ARRAY:
        if (a->v.arr.elem_type != b->v.arr.elem_type || a->v.arr.n != b->v.arr.n) return 0;
        for (uint64_t i = 0; i < a->v.arr.n; i++)
            if (!value_eq(&a->v.arr.items[i], &b->v.arr.items[i])) return 0;
        return 1;
    case GGUF_TYPE_FLOAT32:
    case GGUF_TYPE_FLOAT64:
        return memcmp(&a->v.f64, &b->v.f64, 8) == 0 || (isnan(a->v.f64) && isnan(b->v.f64));
    default: return a->v.u64 == b->v.u64;
    }
}

#define N_RT_TENSORS 5
static void test_roundtrip(tctx *t, const char *dir) {
    still_err e = { 0, "" };
    gguf_writer *w = NULL;
    CHECK(t, gguf_writer_create(&w, &e) == STILL_OK, "writer create");
    if (!w) return;

    /* Scalars: every type, with edge values. */
    struct { const char *key; gguf_value v; } sc[] = {
        { "t.u8", { GGUF_TYPE_UINT8, { .u64 = 255 } } },
        { "t.i8", { GGUF_TYPE_INT8, { .i64 = -128 } } },
        { "t.u16", { GGUF_TYPE_UINT16, { .u64 = 65535 } } },
        { "t.i16", { GGUF_TYPE_INT16, { .i64 = -32768 } } },
        { "t.u32", { GGUF_TYPE_UINT32, { .u64 = 4000000000u } } },
        { "t.i32", { GGUF_TYPE_INT32, { .i64 = INT32_MIN } } },
        { "t.f32", { GGUF_TYPE_FLOAT32, { .f64 = -0.15625 } } },
        { "t.bool", { GGUF_TYPE_BOOL, { .u64 = 1 } } },
        { "t.u64", { GGUF_TYPE_UINT64, { .u64 = UINT64_MAX } } },
        { "t.i64", { GGUF_TYPE_INT64, { .i64 = INT64_MIN } } },
        { "t.f64", { GGUF_TYPE_FLOAT64, { .f64 = 3.141592653589793 } } },
        { "t.f32inf", { GGUF_TYPE_FLOAT32, { .f64 = INFINITY } } },
        { "t.i32pos", { GGUF_TYPE_INT32, { .i64 = 7 } } },
    };
    size_t nsc = sizeof sc / sizeof sc[0];
    for (size_t i = 0; i < nsc; i++)
        CHECK(t, gguf_writer_set(w, sc[i].key, &sc[i].v, &e) == STILL_OK, "set %s: %s",
              sc[i].key, e.msg);

    /* Strings (deep-copied: the source buffer is scribbled over afterwards). */
    char sbuf[32];
    strcpy(sbuf, "h\xc3\xa9llo");
    CHECK(t, gguf_writer_set_str(w, "t.str", sbuf, &e) == STILL_OK, "set str");
    memset(sbuf, 'Z', sizeof sbuf - 1);
    CHECK(t, gguf_writer_set_str(w, "t.empty", "", &e) == STILL_OK, "set empty str");
    gguf_value snul = { .type = GGUF_TYPE_STRING, .v.str = { 3, "a\0b" } };
    CHECK(t, gguf_writer_set(w, "t.strnul", &snul, &e) == STILL_OK, "set str with NUL");

    /* Arrays: of every scalar type, of strings, empty, nested with ragged rows. */
    gguf_value items[13][3];
    static const gguf_type scal[] = { GGUF_TYPE_UINT8, GGUF_TYPE_INT8, GGUF_TYPE_UINT16,
                                      GGUF_TYPE_INT16, GGUF_TYPE_UINT32, GGUF_TYPE_INT32,
                                      GGUF_TYPE_FLOAT32, GGUF_TYPE_BOOL, GGUF_TYPE_UINT64,
                                      GGUF_TYPE_INT64, GGUF_TYPE_FLOAT64 };
    for (size_t k = 0; k < sizeof scal / sizeof scal[0]; k++) {
        for (int j = 0; j < 3; j++) {
            items[k][j].type = scal[k];
            if (scal[k] == GGUF_TYPE_FLOAT32 || scal[k] == GGUF_TYPE_FLOAT64)
                items[k][j].v.f64 = 0.5 * j - 1;
            else if (scal[k] == GGUF_TYPE_BOOL)
                items[k][j].v.u64 = (uint64_t)(j & 1);
            else if (scal[k] == GGUF_TYPE_INT8 || scal[k] == GGUF_TYPE_INT16 ||
                     scal[k] == GGUF_TYPE_INT32 || scal[k] == GGUF_TYPE_INT64)
                items[k][j].v.i64 = j - 1;
            else
                items[k][j].v.u64 = (uint64_t)j * 100;
        }
        char key[32];
        snprintf(key, sizeof key, "a.%s", gguf_type_name(scal[k]));
        gguf_value arr = { .type = GGUF_TYPE_ARRAY, .v.arr = { scal[k], 3, items[k] } };
        CHECK(t, gguf_writer_set(w, key, &arr, &e) == STILL_OK, "set %s: %s", key, e.msg);
    }
    gguf_value strs[3] = { { .type = GGUF_TYPE_STRING, .v.str = { 3, "abc" } },
                           { .type = GGUF_TYPE_STRING, .v.str = { 0, NULL } },
                           { .type = GGUF_TYPE_STRING, .v.str = { 2, "\xe2\x96" } } };
    gguf_value astr = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_STRING, 3, strs } };
    CHECK(t, gguf_writer_set(w, "a.string", &astr, &e) == STILL_OK, "set a.string");
    gguf_value aempty = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_INT32, 0, NULL } };
    CHECK(t, gguf_writer_set(w, "a.empty", &aempty, &e) == STILL_OK, "set a.empty");
    /* [[1,2,3],[],[[...]]] is not homogeneous; use [[[1,2,3]],[[]],[[1],[2,3]]] */
    gguf_value i32s[3] = { { GGUF_TYPE_INT32, { .i64 = 1 } },
                           { GGUF_TYPE_INT32, { .i64 = 2 } },
                           { GGUF_TYPE_INT32, { .i64 = 3 } } };
    gguf_value l1a[1] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 3, i32s } } } };
    gguf_value l1b[1] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 0, NULL } } } };
    gguf_value l1c[2] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 1, i32s } } },
                          { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_INT32, 2, i32s + 1 } } } };
    gguf_value l2[3] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_ARRAY, 1, l1a } } },
                         { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_ARRAY, 1, l1b } } },
                         { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_ARRAY, 2, l1c } } } };
    gguf_value nested = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 3, l2 } };
    CHECK(t, gguf_writer_set(w, "a.nested", &nested, &e) == STILL_OK, "set a.nested: %s", e.msg);
    gguf_value sarr[2] = { { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_STRING, 3, strs } } },
                           { GGUF_TYPE_ARRAY, { .arr = { GGUF_TYPE_STRING, 1, strs } } } };
    gguf_value nested_s = { .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 2, sarr } };
    CHECK(t, gguf_writer_set(w, "a.nested_str", &nested_s, &e) == STILL_OK, "set nested_str");
    /* Deep copy: scribble over the sources. */
    i32s[0].v.i64 = 999;
    strs[0].v.str.ptr = "xyz";

    /* Replacing a key keeps one entry with the new value. */
    CHECK(t, gguf_writer_set_u32(w, "t.replace", 1, &e) == STILL_OK, "set replace");
    CHECK(t, gguf_writer_set_u32(w, "t.replace", 2, &e) == STILL_OK, "set replace 2");
    CHECK(t, gguf_writer_set_u32(w, "general.alignment", 64, &e) == STILL_OK, "set alignment");

    /* Tensors of several types; sizes chosen so padding is exercised. */
    struct { const char *name; uint32_t type; uint32_t nd; int64_t ne[4]; } ts[N_RT_TENSORS] = {
        { "tok_embd.weight", TT_F32, 2, { 5, 3, 1, 1 } },
        { "blk.0.attn_q.weight", TT_Q4_0, 2, { 64, 2, 1, 1 } },
        { "blk.0.ffn.weight", TT_Q8_0, 3, { 32, 1, 2, 1 } },
        { "blk.0.q6k", TT_Q6_K, 4, { 256, 1, 1, 2 } },
        { "output_norm.weight", TT_F16, 1, { 7, 1, 1, 1 } },
    };
    uint8_t *tdata[N_RT_TENSORS];
    size_t tbytes[N_RT_TENSORS];
    for (int i = 0; i < N_RT_TENSORS; i++) {
        tbytes[i] = tensor_row_bytes(ts[i].type, ts[i].ne[0]) *
                    (size_t)(ts[i].ne[1] * ts[i].ne[2] * ts[i].ne[3]);
        tdata[i] = malloc(tbytes[i]);
        for (size_t j = 0; j < tbytes[i]; j++) tdata[i][j] = (uint8_t)(j * 13 + (size_t)i);
        CHECK(t, gguf_writer_add_tensor(w, ts[i].name, ts[i].type, ts[i].nd, ts[i].ne, tdata[i],
                                        tbytes[i], &e) == STILL_OK,
              "add tensor %s: %s", ts[i].name, e.msg);
    }

    /* Writer argument errors. */
    int64_t ne2[2] = { 32, 2 };
    CHECK(t, gguf_writer_add_tensor(w, "tok_embd.weight", TT_F32, 2, ne2, tdata[0], 256, &e) ==
                 STILL_E_ARG && msg_ok(&e),
          "duplicate tensor accepted");
    CHECK(t, gguf_writer_add_tensor(w, "x", TT_F32, 2, ne2, tdata[0], 3, &e) == STILL_E_ARG,
          "wrong nbytes accepted");
    CHECK(t, gguf_writer_add_tensor(w, "x", 99, 2, ne2, tdata[0], 256, &e) == STILL_E_ARG,
          "unknown type accepted");
    CHECK(t, gguf_writer_add_tensor(w, "x", TT_F32, 5, ne2, tdata[0], 256, &e) == STILL_E_ARG,
          "n_dims 5 accepted");
    CHECK(t, gguf_writer_add_tensor(w, "x", TT_F32, 0, ne2, tdata[0], 256, &e) == STILL_E_ARG,
          "n_dims 0 accepted");
    int64_t ne_bad[2] = { 0, 2 };
    CHECK(t, gguf_writer_add_tensor(w, "x", TT_F32, 2, ne_bad, tdata[0], 0, &e) == STILL_E_ARG,
          "ne 0 accepted");
    int64_t ne_blk[1] = { 33 };
    CHECK(t, gguf_writer_add_tensor(w, "x", TT_Q8_0, 1, ne_blk, tdata[0], 36, &e) == STILL_E_ARG,
          "non-block-multiple accepted");
    CHECK(t, gguf_writer_add_tensor(w, "", TT_F32, 2, ne2, tdata[0], 256, &e) == STILL_E_ARG,
          "empty name accepted");
    gguf_value bad = { .type = GGUF_TYPE_UINT8, .v.u64 = 256 };
    CHECK(t, gguf_writer_set(w, "bad", &bad, &e) == STILL_E_ARG && msg_ok(&e), "u8 256 accepted");
    bad = (gguf_value){ .type = GGUF_TYPE_INT16, .v.i64 = 40000 };
    CHECK(t, gguf_writer_set(w, "bad", &bad, &e) == STILL_E_ARG, "i16 40000 accepted");
    bad = (gguf_value){ .type = (gguf_type)13 };
    CHECK(t, gguf_writer_set(w, "bad", &bad, &e) == STILL_E_ARG, "type 13 accepted");
    gguf_value mixed[2] = { { GGUF_TYPE_INT32, { .i64 = 1 } }, { GGUF_TYPE_UINT32, { .u64 = 1 } } };
    bad = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_INT32, 2, mixed } };
    CHECK(t, gguf_writer_set(w, "bad", &bad, &e) == STILL_E_ARG, "mixed array accepted");
    bad = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 1, &nested } };
    gguf_value deeper[8];
    deeper[0] = bad;
    for (int i = 1; i < 8; i++)
        deeper[i] = (gguf_value){ .type = GGUF_TYPE_ARRAY, .v.arr = { GGUF_TYPE_ARRAY, 1, &deeper[i - 1] } };
    CHECK(t, gguf_writer_set(w, "bad", &deeper[7], &e) == STILL_E_ARG, "too deep accepted");
    CHECK(t, gguf_writer_set_u32(w, "general.alignment", 48, &e) == STILL_E_ARG,
          "alignment 48 accepted");
    CHECK(t, gguf_writer_set_f32(w, "general.alignment", 32, &e) == STILL_E_ARG,
          "float alignment accepted");
    CHECK(t, gguf_writer_set_u32(w, "", 1, &e) == STILL_E_ARG, "empty key accepted");

    char path[512];
    snprintf(path, sizeof path, "%s/rt.gguf", dir);
    CHECK(t, gguf_writer_write(w, path, &e) == STILL_OK, "write: %s", e.msg);
    char tmpp[600];
    snprintf(tmpp, sizeof tmpp, "%s.tmp", path);
    CHECK(t, access(tmpp, F_OK) != 0, "tmp file left behind");

    /* Unwritable paths. */
    CHECK(t, gguf_writer_write(w, "/nonexistent-dir-still/x.gguf", &e) == STILL_E_IO && msg_ok(&e),
          "write to missing dir");
    CHECK(t, gguf_writer_write(w, "", &e) == STILL_E_ARG && msg_ok(&e), "write to empty path");
    char dpath[512];
    snprintf(dpath, sizeof dpath, "%s/adir", dir);
    mkdir(dpath, 0700);
    CHECK(t, gguf_writer_write(w, dpath, &e) == STILL_E_IO && msg_ok(&e),
          "write over a directory");
    snprintf(tmpp, sizeof tmpp, "%s.tmp", dpath);
    CHECK(t, access(tmpp, F_OK) != 0, "tmp file left after failed rename");
    rmdir(dpath);
    gguf_writer_free(w);

    /* Read back through mmap and through memory. */
    buf whole;
    CHECK(t, read_whole(path, &whole) == 0, "read %s", path);
    for (int mode = 0; mode < 2; mode++) {
        gguf_file *f = NULL;
        int rc = mode == 0 ? gguf_open(path, &f, &e) : gguf_open_memory(whole.p, whole.n, &f, &e);
        CHECK(t, rc == STILL_OK, "open mode %d: %s", mode, e.msg);
        if (!f) continue;
        CHECK(t, gguf_version(f) == 3 && gguf_alignment(f) == 64, "version/alignment");
        CHECK(t, gguf_data_offset(f) % 64 == 0, "data offset aligned");
        CHECK(t, gguf_file_size(f) == whole.n, "file size");
        for (size_t i = 0; i < nsc; i++) {
            const gguf_value *v = gguf_find(f, sc[i].key);
            gguf_value expect = sc[i].v;
            if (expect.type == GGUF_TYPE_FLOAT32) expect.v.f64 = (float)expect.v.f64;
            CHECK(t, v && value_eq(v, &expect), "value of %s", sc[i].key);
        }
        gguf_str s;
        CHECK(t, gguf_get_str(f, "t.str", &s, &e) == STILL_OK && s.len == 6 &&
                     memcmp(s.ptr, "h\xc3\xa9llo", 6) == 0,
              "t.str");
        CHECK(t, gguf_get_str(f, "t.empty", &s, &e) == STILL_OK && s.len == 0, "t.empty");
        CHECK(t, gguf_get_str(f, "t.strnul", &s, &e) == STILL_OK && s.len == 3 &&
                     memcmp(s.ptr, "a\0b", 3) == 0,
              "t.strnul");
        for (size_t k = 0; k < sizeof scal / sizeof scal[0]; k++) {
            char key[32];
            snprintf(key, sizeof key, "a.%s", gguf_type_name(scal[k]));
            const gguf_value *it;
            uint64_t n;
            CHECK(t, gguf_get_arr(f, key, scal[k], &it, &n, &e) == STILL_OK && n == 3, "%s", key);
            for (uint64_t j = 0; j < 3 && n == 3; j++)
                CHECK(t, value_eq(&it[j], &items[k][j]), "%s[%llu]", key, (unsigned long long)j);
        }
        const gguf_value *it;
        uint64_t n;
        CHECK(t, gguf_get_arr(f, "a.string", GGUF_TYPE_STRING, &it, &n, &e) == STILL_OK && n == 3 &&
                     it[0].v.str.len == 3 && memcmp(it[0].v.str.ptr, "abc", 3) == 0 &&
                     it[1].v.str.len == 0 && it[2].v.str.len == 2,
              "a.string");
        CHECK(t, gguf_get_arr(f, "a.empty", GGUF_TYPE_INT32, &it, &n, &e) == STILL_OK && n == 0,
              "a.empty");
        i32s[0].v.i64 = 1;
        strs[0].v.str.ptr = "abc";
        CHECK(t, value_eq(gguf_find(f, "a.nested"), &nested), "a.nested");
        CHECK(t, value_eq(gguf_find(f, "a.nested_str"), &nested_s), "a.nested_str");
        i32s[0].v.i64 = 999;
        strs[0].v.str.ptr = "xyz";
        uint32_t u;
        CHECK(t, gguf_get_u32(f, "t.replace", &u, &e) == STILL_OK && u == 2, "t.replace");
        int64_t nrep = 0;
        for (int64_t i = 0; i < gguf_kv_count(f); i++) {
            const gguf_kv *kv = gguf_kv_at(f, i);
            nrep += kv->key.len == 9 && memcmp(kv->key.ptr, "t.replace", 9) == 0;
        }
        CHECK(t, nrep == 1, "t.replace appears %lld times", (long long)nrep);
        CHECK(t, gguf_kv_count(f) == (int64_t)nsc + 3 + 11 + 4 + 2, "kv count %lld",
              (long long)gguf_kv_count(f));

        /* Typed getters, good and bad. */
        CHECK(t, gguf_get_u32(f, "t.u8", &u, &e) == STILL_OK && u == 255, "u32 from u8");
        CHECK(t, gguf_get_u32(f, "t.i32pos", &u, &e) == STILL_OK && u == 7, "u32 from i32");
        CHECK(t, gguf_get_u32(f, "t.i32", &u, &e) == STILL_E_FORMAT && strstr(e.msg, "t.i32"),
              "negative i32 as u32");
        CHECK(t, gguf_get_u32(f, "t.u64", &u, &e) == STILL_E_FORMAT, "huge u64 as u32");
        CHECK(t, gguf_get_u32(f, "t.str", &u, &e) == STILL_E_FORMAT, "string as u32");
        CHECK(t, gguf_get_u32(f, "missing.key", &u, &e) == STILL_E_FORMAT &&
                     strstr(e.msg, "missing.key"),
              "missing key");
        float fl;
        CHECK(t, gguf_get_f32(f, "t.f32", &fl, &e) == STILL_OK && fl == -0.15625f, "f32");
        CHECK(t, gguf_get_f32(f, "t.f64", &fl, &e) == STILL_OK && fl == (float)3.141592653589793,
              "f32 from f64");
        CHECK(t, gguf_get_f32(f, "t.u32", &fl, &e) == STILL_E_FORMAT, "f32 from u32");
        bool bo = false;
        CHECK(t, gguf_get_bool(f, "t.bool", &bo, &e) == STILL_OK && bo, "bool");
        CHECK(t, gguf_get_bool(f, "t.u8", &bo, &e) == STILL_E_FORMAT, "bool from u8");
        CHECK(t, gguf_get_str(f, "t.u8", &s, &e) == STILL_E_FORMAT, "str from u8");
        CHECK(t, gguf_get_arr(f, "a.string", GGUF_TYPE_INT32, &it, &n, &e) == STILL_E_FORMAT,
              "arr wrong elem type");
        CHECK(t, gguf_get_arr(f, "t.u8", GGUF_TYPE_UINT8, &it, &n, &e) == STILL_E_FORMAT,
              "arr from scalar");

        /* Tensors */
        CHECK(t, gguf_tensor_count(f) == N_RT_TENSORS, "tensor count");
        for (int i = 0; i < N_RT_TENSORS; i++) {
            const gguf_tensor *tt = gguf_tensor_at(f, i);
            CHECK(t, tt && tt == gguf_find_tensor(f, ts[i].name), "tensor %d lookup", i);
            if (!tt) continue;
            CHECK(t, tt->name.len == strlen(ts[i].name) &&
                         memcmp(tt->name.ptr, ts[i].name, tt->name.len) == 0,
                  "tensor %d name", i);
            CHECK(t, tt->type == ts[i].type && tt->n_dims == ts[i].nd, "tensor %s type/dims",
                  ts[i].name);
            for (int d = 0; d < 4; d++)
                CHECK(t, tt->ne[d] == ts[i].ne[d], "tensor %s ne[%d]", ts[i].name, d);
            CHECK(t, tt->offset % 64 == 0, "tensor %s offset %llu unaligned", ts[i].name,
                  (unsigned long long)tt->offset);
            CHECK(t, tt->nbytes == tbytes[i] && memcmp(tt->data, tdata[i], tbytes[i]) == 0,
                  "tensor %s data", ts[i].name);
            if (mode == 1)
                CHECK(t, (const uint8_t *)tt->data == whole.p + gguf_data_offset(f) + tt->offset,
                      "tensor %s data pointer", ts[i].name);
        }
        CHECK(t, gguf_find_tensor(f, "nope") == NULL && gguf_find_tensor(f, "blk.0") == NULL,
              "find missing tensor");
        walk_file(f, NULL, 0);
        gguf_close(f);
    }
    free(whole.p);
    for (int i = 0; i < N_RT_TENSORS; i++) free(tdata[i]);

    /* Reader I/O errors. */
    gguf_file *f = NULL;
    CHECK(t, gguf_open("/nonexistent-still/x.gguf", &f, &e) == STILL_E_IO && msg_ok(&e) && !f,
          "open missing file");
    CHECK(t, gguf_open(dir, &f, &e) == STILL_E_IO && msg_ok(&e) && !f, "open directory");
    char epath[512];
    snprintf(epath, sizeof epath, "%s/empty.gguf", dir);
    FILE *fp = fopen(epath, "wb");
    if (fp) fclose(fp);
    CHECK(t, gguf_open(epath, &f, &e) == STILL_E_FORMAT && msg_ok(&e) && strstr(e.msg, epath),
          "open empty file: %s", e.msg);
    unlink(epath);
    unlink(path);

    /* A writer with nothing in it produces a valid file. */
    gguf_writer *w2 = NULL;
    gguf_writer_create(&w2, &e);
    snprintf(path, sizeof path, "%s/empty2.gguf", dir);
    CHECK(t, gguf_writer_write(w2, path, &e) == STILL_OK, "write empty");
    gguf_writer_free(w2);
    CHECK(t, gguf_open(path, &f, &e) == STILL_OK && gguf_kv_count(f) == 0 &&
                 gguf_tensor_count(f) == 0,
          "read empty: %s", e.msg);
    gguf_close(f);
    unlink(path);
}

int main(void) {
    tctx t = { 0, 0 };
    char dir[] = "/tmp/still_test_gguf_XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_reference_and_malformed(&t, dir);
    test_nesting(&t);
    test_roundtrip(&t, dir);
    if (rmdir(dir) != 0) fprintf(stderr, "warning: could not remove %s: %s\n", dir, strerror(errno));
    printf("%d passed, %d failed\n", t.pass, t.fail);
    return t.fail ? 1 : 0;
}
