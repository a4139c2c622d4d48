/* GGUF v2/v3 reader (mmap or memory buffer, fully bounds-checked) and writer.
 *
 * File layout (all integers little-endian):
 *   u32 magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
 *   n_kv x { str key, u32 type, value },
 *   n_tensors x { str name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset },
 *   padding to `general.alignment` (default 32), tensor data.
 *   str = u64 length + bytes; array value = u32 elem_type + u64 n + n values.
 *
 * The reader validates every field before using it and decodes the metadata
 * in two passes over the same code: the first pass validates and counts the
 * array elements, the second fills one pool allocation owned by the file. */
#include "format/gguf.h"

#include "common/common.h"
#include "format/quant.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC_LE 0x46554747u          /* "GGUF" read as little-endian u32 */
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DEPTH 8                   /* max array nesting (1 = plain array) */
#define GGUF_MAX_KEY_LEN 65535u
#define GGUF_MAX_NAME_LEN 65535u
#define GGUF_WRITER_MAX_ALIGNMENT (1u << 24)
#define GGUF_ALIGNMENT_KEY "general.alignment"

/* ---- small helpers ---------------------------------------------------- */

static int type_valid(uint32_t t) { return t <= GGUF_TYPE_FLOAT64; }

const char *gguf_type_name(gguf_type t) {
    switch (t) {
    case GGUF_TYPE_UINT8: return "uint8";
    case GGUF_TYPE_INT8: return "int8";
    case GGUF_TYPE_UINT16: return "uint16";
    case GGUF_TYPE_INT16: return "int16";
    case GGUF_TYPE_UINT32: return "uint32";
    case GGUF_TYPE_INT32: return "int32";
    case GGUF_TYPE_FLOAT32: return "float32";
    case GGUF_TYPE_BOOL: return "bool";
    case GGUF_TYPE_STRING: return "string";
    case GGUF_TYPE_ARRAY: return "array";
    case GGUF_TYPE_UINT64: return "uint64";
    case GGUF_TYPE_INT64: return "int64";
    case GGUF_TYPE_FLOAT64: return "float64";
    }
    return "unknown";
}

/* Bytes a scalar of type t occupies in the file (0 for string/array). */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

/* Smallest possible encoding of one value of type t. */
static size_t min_value_size(uint32_t t) {
    if (t == GGUF_TYPE_STRING) return 8;
    if (t == GGUF_TYPE_ARRAY) return 12;
    return scalar_size(t);
}

static int is_unsigned_type(uint32_t t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_UINT32 ||
           t == GGUF_TYPE_UINT64;
}
static int is_signed_type(uint32_t t) {
    return t == GGUF_TYPE_INT8 || t == GGUF_TYPE_INT16 || t == GGUF_TYPE_INT32 ||
           t == GGUF_TYPE_INT64;
}

/* Printable, single-line, bounded rendering of a (possibly hostile) name. */
typedef struct { char s[96]; } name_buf;
static const char *show(name_buf *b, const char *p, uint64_t len) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    const size_t lim = sizeof b->s - 8;   /* room for an escape and "..." */
    for (uint64_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)p[i];
        if (o >= lim) {
            memcpy(b->s + o, "...", 3);
            o += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            b->s[o++] = (char)c;
        } else {
            b->s[o++] = '\\';
            b->s[o++] = 'x';
            b->s[o++] = hex[c >> 4];
            b->s[o++] = hex[c & 15];
        }
    }
    b->s[o] = '\0';
    return b->s;
}

static int str_cmp(const gguf_str *a, const char *b, size_t blen) {
    size_t n = a->len < blen ? (size_t)a->len : blen;
    int c = n ? memcmp(a->ptr, b, n) : 0;
    if (c) return c;
    return a->len < blen ? -1 : (a->len > blen ? 1 : 0);
}

static uint64_t align_up(uint64_t x, uint64_t a) {   /* a is a power of two */
    return (x + (a - 1)) & ~(a - 1);
}

/* ---- reader ----------------------------------------------------------- */

struct gguf_file {
    const uint8_t *base;
    size_t size;
    void *map;              /* mmap'ed region (gguf_open) or NULL */
    size_t map_size;

    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;

    int64_t n_kv;
    gguf_kv *kvs;
    int64_t *kv_sorted;     /* kv indices sorted by key */
    gguf_value *pool;       /* all array elements, one allocation */
    uint64_t pool_n;

    int64_t n_tensors;
    gguf_tensor *tensors;
    int64_t *tensor_sorted; /* tensor indices sorted by name */
};

typedef struct {
    const uint8_t *p;
    size_t size;
    size_t pos;
    still_err *err;
} reader;

typedef struct {
    gguf_value *pool;       /* NULL in the counting pass */
    uint64_t used;
    uint64_t cap;
} pool_state;

static size_t rd_left(const reader *r) { return r->size - r->pos; }

static int rd_need(reader *r, size_t n, const char *ctx, const char *what) {
    if (rd_left(r) < n)
        return still_fail(r->err, STILL_E_FORMAT,
                          "truncated: %s%s%s needs %zu bytes at offset %zu but only %zu remain",
                          ctx, *ctx ? ": " : "", what, n, r->pos, rd_left(r));
    return STILL_OK;
}

static uint64_t load_le(const uint8_t *p, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int rd_uint(reader *r, size_t n, uint64_t *out, const char *ctx, const char *what) {
    int rc = rd_need(r, n, ctx, what);
    if (rc) return rc;
    *out = load_le(r->p + r->pos, n);
    r->pos += n;
    return STILL_OK;
}

static int rd_u32(reader *r, uint32_t *out, const char *ctx, const char *what) {
    uint64_t v;
    int rc = rd_uint(r, 4, &v, ctx, what);
    if (rc) return rc;
    *out = (uint32_t)v;
    return STILL_OK;
}

/* Read a length-prefixed string; its bytes stay in the buffer. */
static int rd_str(reader *r, gguf_str *out, const char *ctx, const char *what) {
    uint64_t len;
    int rc = rd_uint(r, 8, &len, ctx, what);
    if (rc) return rc;
    if (len > rd_left(r))
        return still_fail(r->err, STILL_E_FORMAT,
                          "%s%s%s length %llu at offset %zu exceeds the %zu remaining bytes",
                          ctx, *ctx ? ": " : "", what, (unsigned long long)len, r->pos - 8,
                          rd_left(r));
    out->len = len;
    out->ptr = (const char *)(r->p + r->pos);
    r->pos += (size_t)len;
    return STILL_OK;
}

static int parse_value(reader *r, uint32_t type, int depth, gguf_value *out, pool_state *ps,
                       const char *ctx);

static int parse_array(reader *r, int depth, gguf_value *out, pool_state *ps, const char *ctx) {
    uint32_t et;
    uint64_t n;
    int rc;
    if (depth >= GGUF_MAX_DEPTH)
        return still_fail(r->err, STILL_E_FORMAT, "%s: arrays nested deeper than %d levels",
                          ctx, GGUF_MAX_DEPTH);
    if ((rc = rd_u32(r, &et, ctx, "array element type"))) return rc;
    if (!type_valid(et))
        return still_fail(r->err, STILL_E_FORMAT, "%s: unknown array element type %u", ctx, et);
    if ((rc = rd_uint(r, 8, &n, ctx, "array length"))) return rc;
    if (n > rd_left(r) / min_value_size(et))
        return still_fail(r->err, STILL_E_FORMAT,
                          "%s: array of %llu %s elements cannot fit in the %zu remaining bytes",
                          ctx, (unsigned long long)n, gguf_type_name((gguf_type)et), rd_left(r));
    gguf_value *items = NULL;
    if (ps->pool) {
        if (n > ps->cap - ps->used)   /* cannot happen: same input as the counting pass */
            return still_fail(r->err, STILL_E_FORMAT, "%s: internal pool overflow", ctx);
        items = ps->pool + ps->used;
    }
    ps->used += n;   /* n <= bytes left, so the sum never exceeds the file size */
    if (out) {
        out->type = GGUF_TYPE_ARRAY;
        out->v.arr.elem_type = (gguf_type)et;
        out->v.arr.n = n;
        out->v.arr.items = n ? items : NULL;
    }
    for (uint64_t i = 0; i < n; i++) {
        rc = parse_value(r, et, depth + 1, items ? &items[i] : NULL, ps, ctx);
        if (rc) return rc;
    }
    return STILL_OK;
}

static int parse_value(reader *r, uint32_t type, int depth, gguf_value *out, pool_state *ps,
                       const char *ctx) {
    int rc;
    if (type == GGUF_TYPE_ARRAY) return parse_array(r, depth, out, ps, ctx);
    if (type == GGUF_TYPE_STRING) {
        gguf_str s;
        if ((rc = rd_str(r, &s, ctx, "string value"))) return rc;
        if (out) {
            out->type = GGUF_TYPE_STRING;
            out->v.str = s;
        }
        return STILL_OK;
    }
    size_t sz = scalar_size(type);
    if (!sz)
        return still_fail(r->err, STILL_E_FORMAT, "%s: unknown value type %u", ctx, type);
    uint64_t raw;
    if ((rc = rd_uint(r, sz, &raw, ctx, gguf_type_name((gguf_type)type)))) return rc;
    if (type == GGUF_TYPE_BOOL && raw > 1)
        return still_fail(r->err, STILL_E_FORMAT, "%s: bool value %llu is not 0 or 1", ctx,
                          (unsigned long long)raw);
    if (!out) return STILL_OK;
    out->type = (gguf_type)type;
    switch (type) {
    case GGUF_TYPE_INT8: out->v.i64 = (int8_t)(uint8_t)raw; break;
    case GGUF_TYPE_INT16: out->v.i64 = (int16_t)(uint16_t)raw; break;
    case GGUF_TYPE_INT32: out->v.i64 = (int32_t)(uint32_t)raw; break;
    case GGUF_TYPE_INT64: memcpy(&out->v.i64, &raw, 8); break;
    case GGUF_TYPE_FLOAT32: {
        uint32_t b = (uint32_t)raw;
        float f;
        memcpy(&f, &b, 4);
        out->v.f64 = f;
        break;
    }
    case GGUF_TYPE_FLOAT64: memcpy(&out->v.f64, &raw, 8); break;
    default: out->v.u64 = raw; break;   /* unsigned integers and bool */
    }
    return STILL_OK;
}

/* Parse the kv section. With ps->pool == NULL only validates and counts. */
static int parse_kvs(reader *r, uint64_t n_kv, gguf_kv *kvs, pool_state *ps) {
    int rc;
    char ctx[160];
    for (uint64_t i = 0; i < n_kv; i++) {
        gguf_str key;
        uint32_t type;
        name_buf nb;
        snprintf(ctx, sizeof ctx, "kv #%llu", (unsigned long long)i);
        if ((rc = rd_str(r, &key, ctx, "key"))) return rc;
        if (key.len == 0)
            return still_fail(r->err, STILL_E_FORMAT, "kv #%llu: empty key",
                              (unsigned long long)i);
        if (key.len > GGUF_MAX_KEY_LEN)
            return still_fail(r->err, STILL_E_FORMAT, "kv #%llu: key length %llu exceeds %u",
                              (unsigned long long)i, (unsigned long long)key.len,
                              GGUF_MAX_KEY_LEN);
        if (memchr(key.ptr, '\0', (size_t)key.len))
            return still_fail(r->err, STILL_E_FORMAT, "kv #%llu: key '%s' contains a NUL byte",
                              (unsigned long long)i, show(&nb, key.ptr, key.len));
        snprintf(ctx, sizeof ctx, "kv '%s'", show(&nb, key.ptr, key.len));
        if ((rc = rd_u32(r, &type, ctx, "value type"))) return rc;
        if (!type_valid(type))
            return still_fail(r->err, STILL_E_FORMAT, "%s: unknown value type %u", ctx, type);
        gguf_value *out = kvs ? &kvs[i].value : NULL;
        if ((rc = parse_value(r, type, 0, out, ps, ctx))) return rc;
        if (kvs) kvs[i].key = key;
    }
    return STILL_OK;
}

static int cmp_gstr(const gguf_str *a, const gguf_str *b) {
    return str_cmp(a, b->ptr, (size_t)b->len);
}

/* Sort an index array by the gguf_str found at arr[idx] + str_off (bottom-up
 * merge sort: qsort has no context pointer and we keep no globals). */
static void sort_idx(int64_t *idx, int64_t n, const void *arr, size_t stride, size_t str_off) {
    if (n < 2) return;
    int64_t *tmp = malloc((size_t)n * sizeof *tmp);
    if (!tmp) {
        /* fall back to an O(n^2) insertion sort; correctness over speed */
        for (int64_t i = 1; i < n; i++) {
            int64_t v = idx[i], j = i;
            const gguf_str *sv = (const gguf_str *)((const char *)arr + (size_t)v * stride + str_off);
            while (j > 0) {
                const gguf_str *sj = (const gguf_str *)((const char *)arr +
                                                        (size_t)idx[j - 1] * stride + str_off);
                if (cmp_gstr(sj, sv) <= 0) break;
                idx[j] = idx[j - 1];
                j--;
            }
            idx[j] = v;
        }
        return;
    }
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t a = lo, b = mid, o = lo;
            while (a < mid && b < hi) {
                const gguf_str *sa = (const gguf_str *)((const char *)arr +
                                                        (size_t)idx[a] * stride + str_off);
                const gguf_str *sb = (const gguf_str *)((const char *)arr +
                                                        (size_t)idx[b] * stride + str_off);
                tmp[o++] = cmp_gstr(sa, sb) <= 0 ? idx[a++] : idx[b++];
            }
            while (a < mid) tmp[o++] = idx[a++];
            while (b < hi) tmp[o++] = idx[b++];
        }
        memcpy(idx, tmp, (size_t)n * sizeof *idx);
    }
    free(tmp);
}

static const gguf_str *idx_str(const void *arr, size_t stride, size_t str_off, int64_t i) {
    return (const gguf_str *)((const char *)arr + (size_t)i * stride + str_off);
}

/* Binary search in a sorted index; returns the element index or -1. */
static int64_t find_sorted(const int64_t *idx, int64_t n, const void *arr, size_t stride,
                           size_t str_off, const char *key) {
    if (!key || !idx) return -1;
    size_t klen = strlen(key);
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        int c = str_cmp(idx_str(arr, stride, str_off, idx[mid]), key, klen);
        if (c == 0) return idx[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

typedef struct { uint64_t off; uint64_t end; int64_t i; } span;
static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->i < y->i ? -1 : (x->i > y->i);
}

static int parse_tensor_info(reader *r, uint64_t i, gguf_tensor *t) {
    int rc;
    char ctx[160];
    name_buf nb;
    snprintf(ctx, sizeof ctx, "tensor #%llu", (unsigned long long)i);
    if ((rc = rd_str(r, &t->name, ctx, "name"))) return rc;
    if (t->name.len == 0)
        return still_fail(r->err, STILL_E_FORMAT, "tensor #%llu: empty name",
                          (unsigned long long)i);
    if (t->name.len > GGUF_MAX_NAME_LEN)
        return still_fail(r->err, STILL_E_FORMAT, "tensor #%llu: name length %llu exceeds %u",
                          (unsigned long long)i, (unsigned long long)t->name.len,
                          GGUF_MAX_NAME_LEN);
    if (memchr(t->name.ptr, '\0', (size_t)t->name.len))
        return still_fail(r->err, STILL_E_FORMAT, "tensor #%llu: name '%s' contains a NUL byte",
                          (unsigned long long)i, show(&nb, t->name.ptr, t->name.len));
    snprintf(ctx, sizeof ctx, "tensor '%s'", show(&nb, t->name.ptr, t->name.len));
    if ((rc = rd_u32(r, &t->n_dims, ctx, "n_dims"))) return rc;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return still_fail(r->err, STILL_E_FORMAT, "%s: n_dims %u out of range 1..%d", ctx,
                          t->n_dims, GGUF_MAX_DIMS);
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        uint64_t v;
        if ((rc = rd_uint(r, 8, &v, ctx, "dimension"))) return rc;
        if (v == 0 || v > (uint64_t)INT64_MAX)
            return still_fail(r->err, STILL_E_FORMAT, "%s: ne[%u] = %lld is not a positive size",
                              ctx, d, (long long)v);
        t->ne[d] = (int64_t)v;
    }
    if ((rc = rd_u32(r, &t->type, ctx, "type"))) return rc;
    if ((rc = rd_uint(r, 8, &t->offset, ctx, "offset"))) return rc;
    return STILL_OK;
}

/* Validate type/shape/size of one tensor and compute nbytes. */
static int check_tensor_shape(gguf_tensor *t, still_err *err) {
    name_buf nb;
    const char *nm = show(&nb, t->name.ptr, t->name.len);
    if (!tensor_type_known(t->type))
        return still_fail(err, STILL_E_FORMAT, "tensor '%s': unknown tensor type %u", nm, t->type);
    int64_t nel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        if (__builtin_mul_overflow(nel, t->ne[d], &nel))
            return still_fail(err, STILL_E_FORMAT,
                              "tensor '%s': element count overflows (ne = %lld x %lld x %lld x %lld)",
                              nm, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                              (long long)t->ne[3]);
    int64_t blk = tensor_type_block_elems(t->type);
    if (blk <= 0 || t->ne[0] % blk != 0)
        return still_fail(err, STILL_E_FORMAT,
                          "tensor '%s': ne[0] = %lld is not a multiple of the %s block size %lld",
                          nm, (long long)t->ne[0], tensor_type_name(t->type), (long long)blk);
    size_t row = tensor_row_bytes(t->type, t->ne[0]);
    if (row == 0)
        return still_fail(err, STILL_E_FORMAT, "tensor '%s': row size overflows (ne[0] = %lld)",
                          nm, (long long)t->ne[0]);
    size_t rows = (size_t)(nel / t->ne[0]), nbytes;
    if (still_mul_overflow(row, rows, &nbytes))
        return still_fail(err, STILL_E_FORMAT, "tensor '%s': byte size overflows", nm);
    t->nbytes = nbytes;
    return STILL_OK;
}

static int parse_file(gguf_file *f, still_err *err) {
    reader r = { f->base, f->size, 0, err };
    reader *rp = &r;
    int rc;
    uint32_t magic;
    uint64_t n_tensors, n_kv;

    if ((rc = rd_u32(rp, &magic, "header", "magic"))) return rc;
    if (magic != GGUF_MAGIC_LE) {
        const uint8_t *m = f->base;
        return still_fail(err, STILL_E_FORMAT,
                          "bad magic %02x %02x %02x %02x (expected 'GGUF')", m[0], m[1], m[2],
                          m[3]);
    }
    if ((rc = rd_u32(rp, &f->version, "header", "version"))) return rc;
    if (f->version != 2 && f->version != 3) {
        if ((f->version & 0xffffu) == 0 && f->version != 0)
            return still_fail(err, STILL_E_FORMAT,
                              "unsupported GGUF version 0x%08x (big-endian files are not supported)",
                              f->version);
        return still_fail(err, STILL_E_FORMAT, "unsupported GGUF version %u (expected 2 or 3)",
                          f->version);
    }
    if ((rc = rd_uint(rp, 8, &n_tensors, "header", "tensor count"))) return rc;
    if ((rc = rd_uint(rp, 8, &n_kv, "header", "kv count"))) return rc;
    /* A kv takes at least 8 (key len) + 4 (type) + 1 bytes; a tensor info
     * at least 8 + 4 + 8 + 4 + 8. */
    if (n_kv > rd_left(rp) / 13)
        return still_fail(err, STILL_E_FORMAT,
                          "kv count %llu impossible: only %zu bytes follow the header",
                          (unsigned long long)n_kv, rd_left(rp));
    if (n_tensors > rd_left(rp) / 32)
        return still_fail(err, STILL_E_FORMAT,
                          "tensor count %llu impossible: only %zu bytes follow the header",
                          (unsigned long long)n_tensors, rd_left(rp));

    /* Pass 1: validate the kv section and count array elements. */
    size_t kv_start = r.pos;
    pool_state ps = { NULL, 0, 0 };
    if ((rc = parse_kvs(rp, n_kv, NULL, &ps))) return rc;

    /* Pass 2: decode into owned storage. */
    f->n_kv = (int64_t)n_kv;
    if (n_kv) {
        f->kvs = calloc((size_t)n_kv, sizeof *f->kvs);
        f->kv_sorted = malloc((size_t)n_kv * sizeof *f->kv_sorted);
        if (!f->kvs || !f->kv_sorted)
            return still_fail(err, STILL_E_NOMEM, "out of memory for %llu kvs",
                              (unsigned long long)n_kv);
    }
    if (ps.used) {
        if (ps.used > SIZE_MAX / sizeof(gguf_value))
            return still_fail(err, STILL_E_NOMEM, "too many array elements (%llu)",
                              (unsigned long long)ps.used);
        f->pool = calloc((size_t)ps.used, sizeof *f->pool);
        if (!f->pool)
            return still_fail(err, STILL_E_NOMEM, "out of memory for %llu array elements",
                              (unsigned long long)ps.used);
    }
    f->pool_n = ps.used;
    pool_state ps2 = { f->pool, 0, ps.used };
    r.pos = kv_start;
    if ((rc = parse_kvs(rp, n_kv, f->kvs, &ps2))) return rc;

    /* Duplicate keys. */
    for (int64_t i = 0; i < f->n_kv; i++) f->kv_sorted[i] = i;
    sort_idx(f->kv_sorted, f->n_kv, f->kvs, sizeof(gguf_kv), offsetof(gguf_kv, key));
    for (int64_t i = 1; i < f->n_kv; i++) {
        const gguf_str *a = &f->kvs[f->kv_sorted[i - 1]].key, *b = &f->kvs[f->kv_sorted[i]].key;
        if (cmp_gstr(a, b) == 0) {
            name_buf nb;
            return still_fail(err, STILL_E_FORMAT, "duplicate key '%s'",
                              show(&nb, a->ptr, a->len));
        }
    }

    /* Alignment. */
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_value *al = gguf_find(f, GGUF_ALIGNMENT_KEY);
    if (al) {
        if (al->type != GGUF_TYPE_UINT32)
            return still_fail(err, STILL_E_FORMAT, "%s has type %s, expected uint32",
                              GGUF_ALIGNMENT_KEY, gguf_type_name(al->type));
        uint64_t a = al->v.u64;
        if (a == 0 || (a & (a - 1)) != 0)
            return still_fail(err, STILL_E_FORMAT, "%s = %llu is not a nonzero power of two",
                              GGUF_ALIGNMENT_KEY, (unsigned long long)a);
        f->alignment = (uint32_t)a;
    }

    /* Tensor infos. */
    if (n_tensors > rd_left(rp) / 32)
        return still_fail(err, STILL_E_FORMAT,
                          "tensor count %llu impossible: only %zu bytes follow the metadata",
                          (unsigned long long)n_tensors, rd_left(rp));
    f->n_tensors = (int64_t)n_tensors;
    if (n_tensors) {
        f->tensors = calloc((size_t)n_tensors, sizeof *f->tensors);
        f->tensor_sorted = malloc((size_t)n_tensors * sizeof *f->tensor_sorted);
        if (!f->tensors || !f->tensor_sorted)
            return still_fail(err, STILL_E_NOMEM, "out of memory for %llu tensors",
                              (unsigned long long)n_tensors);
    }
    for (uint64_t i = 0; i < n_tensors; i++)
        if ((rc = parse_tensor_info(rp, i, &f->tensors[i]))) return rc;

    for (int64_t i = 0; i < f->n_tensors; i++) f->tensor_sorted[i] = i;
    sort_idx(f->tensor_sorted, f->n_tensors, f->tensors, sizeof(gguf_tensor),
             offsetof(gguf_tensor, name));
    for (int64_t i = 1; i < f->n_tensors; i++) {
        const gguf_str *a = &f->tensors[f->tensor_sorted[i - 1]].name;
        const gguf_str *b = &f->tensors[f->tensor_sorted[i]].name;
        if (cmp_gstr(a, b) == 0) {
            name_buf nb;
            return still_fail(err, STILL_E_FORMAT, "duplicate tensor name '%s'",
                              show(&nb, a->ptr, a->len));
        }
    }

    f->data_offset = align_up(r.pos, f->alignment);
    if (f->n_tensors > 0 && f->data_offset > f->size)
        return still_fail(err, STILL_E_FORMAT,
                          "data section would start at %llu, past the end of the file (%zu bytes)",
                          (unsigned long long)f->data_offset, f->size);
    uint64_t data_size = f->n_tensors > 0 ? f->size - f->data_offset : 0;

    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        name_buf nb;
        if ((rc = check_tensor_shape(t, err))) return rc;
        const char *nm = show(&nb, t->name.ptr, t->name.len);
        if (t->offset % f->alignment)
            return still_fail(err, STILL_E_FORMAT,
                              "tensor '%s': offset %llu is not a multiple of the alignment %u",
                              nm, (unsigned long long)t->offset, f->alignment);
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return still_fail(err, STILL_E_FORMAT,
                              "tensor '%s': data [%llu, +%zu) extends past the end of the data "
                              "section (%llu bytes)",
                              nm, (unsigned long long)t->offset, t->nbytes,
                              (unsigned long long)data_size);
        t->data = f->base + f->data_offset + t->offset;
    }

    /* Overlaps. */
    if (f->n_tensors > 1) {
        span *sp = malloc((size_t)f->n_tensors * sizeof *sp);
        if (!sp) return still_fail(err, STILL_E_NOMEM, "out of memory checking tensor overlap");
        for (int64_t i = 0; i < f->n_tensors; i++) {
            sp[i].off = f->tensors[i].offset;
            sp[i].end = f->tensors[i].offset + f->tensors[i].nbytes;
            sp[i].i = i;
        }
        qsort(sp, (size_t)f->n_tensors, sizeof *sp, cmp_span);
        for (int64_t i = 1; i < f->n_tensors; i++) {
            if (sp[i].off < sp[i - 1].end) {
                name_buf na, nb2;
                const gguf_tensor *a = &f->tensors[sp[i - 1].i], *b = &f->tensors[sp[i].i];
                rc = still_fail(err, STILL_E_FORMAT,
                                "tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap",
                                show(&na, a->name.ptr, a->name.len),
                                (unsigned long long)sp[i - 1].off,
                                (unsigned long long)sp[i - 1].end,
                                show(&nb2, b->name.ptr, b->name.len),
                                (unsigned long long)sp[i].off, (unsigned long long)sp[i].end);
                free(sp);
                return rc;
            }
        }
        free(sp);
    }
    return STILL_OK;
}

static void file_free(gguf_file *f) {
    if (!f) return;
    free(f->kvs);
    free(f->kv_sorted);
    free(f->pool);
    free(f->tensors);
    free(f->tensor_sorted);
    if (f->map) munmap(f->map, f->map_size);
    free(f);
}

void gguf_close(gguf_file *f) { file_free(f); }

int gguf_open_memory(const void *data, size_t size, gguf_file **out, still_err *err) {
    if (!out) return still_fail(err, STILL_E_ARG, "gguf_open_memory: out is NULL");
    *out = NULL;
    if (!data && size)
        return still_fail(err, STILL_E_ARG, "gguf_open_memory: NULL buffer of size %zu", size);
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return still_fail(err, STILL_E_NOMEM, "out of memory");
    f->base = data;
    f->size = data ? size : 0;
    int rc = parse_file(f, err);
    if (rc) {
        file_free(f);
        return rc;
    }
    *out = f;
    return STILL_OK;
}

/* Prefix err->msg with the path so the message stays one line. */
static int fail_path(still_err *err, int rc, const char *path) {
    if (err) {
        char tmp[sizeof err->msg];
        int n = snprintf(tmp, sizeof tmp, "%s: %s", path, err->msg);
        if (n >= 0) memcpy(err->msg, tmp, sizeof tmp);
        err->code = rc;
    }
    return rc;
}

int gguf_open(const char *path, gguf_file **out, still_err *err) {
    if (!out) return still_fail(err, STILL_E_ARG, "gguf_open: out is NULL");
    *out = NULL;
    if (!path) return still_fail(err, STILL_E_ARG, "gguf_open: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return still_fail(err, STILL_E_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return still_fail(err, STILL_E_IO, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return still_fail(err, STILL_E_IO, "%s is not a regular file", path);
    }
    if (st.st_size < 0 || (uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return still_fail(err, STILL_E_IO, "%s: file too large", path);
    }
    size_t size = (size_t)st.st_size;
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return still_fail(err, STILL_E_IO, "cannot mmap %s: %s", path, strerror(e));
        }
    }
    close(fd);

    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        if (map) munmap(map, size);
        return still_fail(err, STILL_E_NOMEM, "out of memory");
    }
    f->base = map;
    f->size = size;
    f->map = map;
    f->map_size = size;
    int rc = parse_file(f, err);
    if (rc) {
        file_free(f);
        return fail_path(err, rc, path);
    }
    *out = f;
    return STILL_OK;
}

uint32_t gguf_version(const gguf_file *f) { return f ? f->version : 0; }
uint32_t gguf_alignment(const gguf_file *f) { return f ? f->alignment : 0; }
size_t gguf_file_size(const gguf_file *f) { return f ? f->size : 0; }
uint64_t gguf_data_offset(const gguf_file *f) { return f ? f->data_offset : 0; }

int64_t gguf_kv_count(const gguf_file *f) { return f ? f->n_kv : 0; }

const gguf_kv *gguf_kv_at(const gguf_file *f, int64_t i) {
    if (!f || i < 0 || i >= f->n_kv) return NULL;
    return &f->kvs[i];
}

const gguf_value *gguf_find(const gguf_file *f, const char *key) {
    if (!f) return NULL;
    int64_t i = find_sorted(f->kv_sorted, f->n_kv, f->kvs, sizeof(gguf_kv),
                            offsetof(gguf_kv, key), key);
    return i < 0 ? NULL : &f->kvs[i].value;
}

int64_t gguf_tensor_count(const gguf_file *f) { return f ? f->n_tensors : 0; }

const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) {
    if (!f || i < 0 || i >= f->n_tensors) return NULL;
    return &f->tensors[i];
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (!f) return NULL;
    int64_t i = find_sorted(f->tensor_sorted, f->n_tensors, f->tensors, sizeof(gguf_tensor),
                            offsetof(gguf_tensor, name), name);
    return i < 0 ? NULL : &f->tensors[i];
}

/* ---- typed getters ---------------------------------------------------- */

static const gguf_value *get_checked(const gguf_file *f, const char *key, still_err *err,
                                     int *rc) {
    const gguf_value *v = gguf_find(f, key);
    if (!v) *rc = still_fail(err, STILL_E_FORMAT, "missing key '%s'", key ? key : "(null)");
    return v;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, still_err *err) {
    int rc = STILL_OK;
    const gguf_value *v = get_checked(f, key, err, &rc);
    if (!v) return rc;
    if (is_unsigned_type(v->type)) {
        if (v->v.u64 > UINT32_MAX)
            return still_fail(err, STILL_E_FORMAT, "key '%s': value %llu does not fit in uint32",
                              key, (unsigned long long)v->v.u64);
        *out = (uint32_t)v->v.u64;
        return STILL_OK;
    }
    if (is_signed_type(v->type)) {
        if (v->v.i64 < 0 || v->v.i64 > (int64_t)UINT32_MAX)
            return still_fail(err, STILL_E_FORMAT, "key '%s': value %lld does not fit in uint32",
                              key, (long long)v->v.i64);
        *out = (uint32_t)v->v.i64;
        return STILL_OK;
    }
    return still_fail(err, STILL_E_FORMAT, "key '%s' has type %s, expected an integer", key,
                      gguf_type_name(v->type));
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, still_err *err) {
    int rc = STILL_OK;
    const gguf_value *v = get_checked(f, key, err, &rc);
    if (!v) return rc;
    if (v->type != GGUF_TYPE_FLOAT32 && v->type != GGUF_TYPE_FLOAT64)
        return still_fail(err, STILL_E_FORMAT, "key '%s' has type %s, expected a float", key,
                          gguf_type_name(v->type));
    *out = (float)v->v.f64;
    return STILL_OK;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out, still_err *err) {
    int rc = STILL_OK;
    const gguf_value *v = get_checked(f, key, err, &rc);
    if (!v) return rc;
    if (v->type != GGUF_TYPE_BOOL)
        return still_fail(err, STILL_E_FORMAT, "key '%s' has type %s, expected bool", key,
                          gguf_type_name(v->type));
    *out = v->v.u64 != 0;
    return STILL_OK;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, still_err *err) {
    int rc = STILL_OK;
    const gguf_value *v = get_checked(f, key, err, &rc);
    if (!v) return rc;
    if (v->type != GGUF_TYPE_STRING)
        return still_fail(err, STILL_E_FORMAT, "key '%s' has type %s, expected string", key,
                          gguf_type_name(v->type));
    *out = v->v.str;
    return STILL_OK;
}

int gguf_get_arr(const gguf_file *f, const char *key, gguf_type elem_type,
                 const gguf_value **items, uint64_t *n, still_err *err) {
    int rc = STILL_OK;
    const gguf_value *v = get_checked(f, key, err, &rc);
    if (!v) return rc;
    if (v->type != GGUF_TYPE_ARRAY)
        return still_fail(err, STILL_E_FORMAT, "key '%s' has type %s, expected array of %s", key,
                          gguf_type_name(v->type), gguf_type_name(elem_type));
    if (v->v.arr.elem_type != elem_type)
        return still_fail(err, STILL_E_FORMAT, "key '%s' is an array of %s, expected %s", key,
                          gguf_type_name(v->v.arr.elem_type), gguf_type_name(elem_type));
    *items = v->v.arr.items;
    *n = v->v.arr.n;
    return STILL_OK;
}

/* ---- writer ----------------------------------------------------------- */

typedef struct {
    char *key;
    gguf_value v;            /* deep copy: strings and item arrays owned */
} wkv;

typedef struct {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    void *data;
    size_t nbytes;
} wtensor;

struct gguf_writer {
    wkv *kvs;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
};

static void value_free(gguf_value *v) {
    if (v->type == GGUF_TYPE_STRING) {
        free((char *)v->v.str.ptr);
    } else if (v->type == GGUF_TYPE_ARRAY) {
        for (uint64_t i = 0; i < v->v.arr.n; i++) value_free(&v->v.arr.items[i]);
        free(v->v.arr.items);
    }
    memset(v, 0, sizeof *v);
}

/* Validate and deep-copy src into dst (dst is left zeroed on failure). */
static int value_copy(gguf_value *dst, const gguf_value *src, int depth, const char *key,
                      still_err *err) {
    memset(dst, 0, sizeof *dst);
    if (!type_valid((uint32_t)src->type))
        return still_fail(err, STILL_E_ARG, "kv '%s': unknown value type %d", key, (int)src->type);
    dst->type = src->type;
    switch (src->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: {
        uint64_t max = src->type == GGUF_TYPE_UINT8 ? UINT8_MAX
                     : src->type == GGUF_TYPE_UINT16 ? UINT16_MAX : UINT32_MAX;
        if (src->v.u64 > max)
            return still_fail(err, STILL_E_ARG, "kv '%s': value %llu out of range for %s", key,
                              (unsigned long long)src->v.u64, gguf_type_name(src->type));
        dst->v.u64 = src->v.u64;
        return STILL_OK;
    }
    case GGUF_TYPE_INT8: case GGUF_TYPE_INT16: case GGUF_TYPE_INT32: {
        int64_t lo = src->type == GGUF_TYPE_INT8 ? INT8_MIN
                   : src->type == GGUF_TYPE_INT16 ? INT16_MIN : INT32_MIN;
        int64_t hi = src->type == GGUF_TYPE_INT8 ? INT8_MAX
                   : src->type == GGUF_TYPE_INT16 ? INT16_MAX : INT32_MAX;
        if (src->v.i64 < lo || src->v.i64 > hi)
            return still_fail(err, STILL_E_ARG, "kv '%s': value %lld out of range for %s", key,
                              (long long)src->v.i64, gguf_type_name(src->type));
        dst->v.i64 = src->v.i64;
        return STILL_OK;
    }
    case GGUF_TYPE_UINT64: dst->v.u64 = src->v.u64; return STILL_OK;
    case GGUF_TYPE_INT64: dst->v.i64 = src->v.i64; return STILL_OK;
    case GGUF_TYPE_BOOL: dst->v.u64 = src->v.u64 != 0; return STILL_OK;
    case GGUF_TYPE_FLOAT32: dst->v.f64 = (double)(float)src->v.f64; return STILL_OK;
    case GGUF_TYPE_FLOAT64: dst->v.f64 = src->v.f64; return STILL_OK;
    case GGUF_TYPE_STRING: {
        uint64_t len = src->v.str.len;
        if (len && !src->v.str.ptr)
            return still_fail(err, STILL_E_ARG, "kv '%s': string of length %llu has NULL data",
                              key, (unsigned long long)len);
        if (len >= SIZE_MAX)
            return still_fail(err, STILL_E_ARG, "kv '%s': string too long", key);
        char *p = malloc((size_t)len + 1);
        if (!p) return still_fail(err, STILL_E_NOMEM, "kv '%s': out of memory", key);
        if (len) memcpy(p, src->v.str.ptr, (size_t)len);
        p[len] = '\0';
        dst->v.str.ptr = p;
        dst->v.str.len = len;
        return STILL_OK;
    }
    case GGUF_TYPE_ARRAY: {
        uint64_t n = src->v.arr.n;
        gguf_type et = src->v.arr.elem_type;
        if (depth + 1 > GGUF_MAX_DEPTH)
            return still_fail(err, STILL_E_ARG, "kv '%s': arrays nested deeper than %d levels",
                              key, GGUF_MAX_DEPTH);
        if (!type_valid((uint32_t)et))
            return still_fail(err, STILL_E_ARG, "kv '%s': unknown array element type %d", key,
                              (int)et);
        if (n && !src->v.arr.items)
            return still_fail(err, STILL_E_ARG, "kv '%s': array of %llu items has NULL items",
                              key, (unsigned long long)n);
        if (n > SIZE_MAX / sizeof(gguf_value))
            return still_fail(err, STILL_E_ARG, "kv '%s': array too long", key);
        gguf_value *items = n ? calloc((size_t)n, sizeof *items) : NULL;
        if (n && !items) return still_fail(err, STILL_E_NOMEM, "kv '%s': out of memory", key);
        dst->v.arr.elem_type = et;
        dst->v.arr.n = 0;
        dst->v.arr.items = items;
        for (uint64_t i = 0; i < n; i++) {
            if (src->v.arr.items[i].type != et) {
                value_free(dst);
                return still_fail(err, STILL_E_ARG,
                                  "kv '%s': array element %llu has type %s, expected %s", key,
                                  (unsigned long long)i,
                                  gguf_type_name(src->v.arr.items[i].type), gguf_type_name(et));
            }
            int rc = value_copy(&items[i], &src->v.arr.items[i], depth + 1, key, err);
            if (rc) {
                value_free(dst);
                return rc;
            }
            dst->v.arr.n = i + 1;
        }
        return STILL_OK;
    }
    }
    return still_fail(err, STILL_E_ARG, "kv '%s': unknown value type", key);
}

int gguf_writer_create(gguf_writer **out, still_err *err) {
    if (!out) return still_fail(err, STILL_E_ARG, "gguf_writer_create: out is NULL");
    *out = calloc(1, sizeof **out);
    if (!*out) return still_fail(err, STILL_E_NOMEM, "out of memory");
    return STILL_OK;
}

void gguf_writer_free(gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        value_free(&w->kvs[i].v);
    }
    free(w->kvs);
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w);
}

static int grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 16;
    while (nc < need) nc *= 2;
    if (nc > SIZE_MAX / elem) return -1;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

int gguf_writer_set(gguf_writer *w, const char *key, const gguf_value *v, still_err *err) {
    if (!w || !key || !v) return still_fail(err, STILL_E_ARG, "gguf_writer_set: NULL argument");
    size_t klen = strlen(key);
    if (klen == 0) return still_fail(err, STILL_E_ARG, "gguf_writer_set: empty key");
    if (klen > GGUF_MAX_KEY_LEN)
        return still_fail(err, STILL_E_ARG, "gguf_writer_set: key length %zu exceeds %u", klen,
                          GGUF_MAX_KEY_LEN);
    if (strcmp(key, GGUF_ALIGNMENT_KEY) == 0) {
        if (v->type != GGUF_TYPE_UINT32)
            return still_fail(err, STILL_E_ARG, "%s must be uint32, got %s", key,
                              gguf_type_name(v->type));
        uint64_t a = v->v.u64;
        if (a == 0 || (a & (a - 1)) || a > GGUF_WRITER_MAX_ALIGNMENT)
            return still_fail(err, STILL_E_ARG, "%s = %llu must be a power of two <= %u", key,
                              (unsigned long long)a, GGUF_WRITER_MAX_ALIGNMENT);
    }
    gguf_value copy;
    int rc = value_copy(&copy, v, 0, key, err);
    if (rc) return rc;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {   /* replace in place, keep order */
            value_free(&w->kvs[i].v);
            w->kvs[i].v = copy;
            return STILL_OK;
        }
    }
    char *k = strdup(key);
    if (!k || grow((void **)&w->kvs, &w->cap_kv, w->n_kv + 1, sizeof *w->kvs)) {
        free(k);
        value_free(&copy);
        return still_fail(err, STILL_E_NOMEM, "out of memory adding kv '%s'", key);
    }
    w->kvs[w->n_kv].key = k;
    w->kvs[w->n_kv].v = copy;
    w->n_kv++;
    return STILL_OK;
}

int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v, still_err *err) {
    gguf_value x = { .type = GGUF_TYPE_UINT32, .v.u64 = v };
    return gguf_writer_set(w, key, &x, err);
}

int gguf_writer_set_f32(gguf_writer *w, const char *key, float v, still_err *err) {
    gguf_value x = { .type = GGUF_TYPE_FLOAT32, .v.f64 = v };
    return gguf_writer_set(w, key, &x, err);
}

int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v, still_err *err) {
    gguf_value x = { .type = GGUF_TYPE_BOOL, .v.u64 = v ? 1 : 0 };
    return gguf_writer_set(w, key, &x, err);
}

int gguf_writer_set_str(gguf_writer *w, const char *key, const char *s, still_err *err) {
    if (!s) return still_fail(err, STILL_E_ARG, "gguf_writer_set_str: NULL string for '%s'",
                              key ? key : "(null)");
    gguf_value x = { .type = GGUF_TYPE_STRING, .v.str = { strlen(s), s } };
    return gguf_writer_set(w, key, &x, err);
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const int64_t *ne, const void *data, size_t nbytes, still_err *err) {
    if (!w || !name || !ne)
        return still_fail(err, STILL_E_ARG, "gguf_writer_add_tensor: NULL argument");
    size_t nlen = strlen(name);
    if (nlen == 0 || nlen > GGUF_MAX_NAME_LEN)
        return still_fail(err, STILL_E_ARG, "tensor name length %zu out of range 1..%u", nlen,
                          GGUF_MAX_NAME_LEN);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return still_fail(err, STILL_E_ARG, "duplicate tensor name '%s'", name);
    if (!tensor_type_known(type))
        return still_fail(err, STILL_E_ARG, "tensor '%s': unknown tensor type %u", name, type);
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return still_fail(err, STILL_E_ARG, "tensor '%s': n_dims %u out of range 1..%d", name,
                          n_dims, GGUF_MAX_DIMS);
    wtensor t = { .type = type, .n_dims = n_dims, .ne = { 1, 1, 1, 1 } };
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] <= 0)
            return still_fail(err, STILL_E_ARG, "tensor '%s': ne[%u] = %lld is not positive",
                              name, d, (long long)ne[d]);
        t.ne[d] = ne[d];
    }
    gguf_tensor chk = { .name = { nlen, name }, .n_dims = n_dims, .type = type };
    memcpy(chk.ne, t.ne, sizeof chk.ne);
    still_err e2;
    if (check_tensor_shape(&chk, &e2))
        return still_fail(err, STILL_E_ARG, "%s", e2.msg);
    if (chk.nbytes != nbytes)
        return still_fail(err, STILL_E_ARG, "tensor '%s': got %zu bytes of data, expected %zu",
                          name, nbytes, chk.nbytes);
    if (!data) return still_fail(err, STILL_E_ARG, "tensor '%s': NULL data", name);
    t.nbytes = nbytes;
    t.name = strdup(name);
    t.data = malloc(nbytes);
    if (!t.name || !t.data ||
        grow((void **)&w->tensors, &w->cap_tensors, w->n_tensors + 1, sizeof *w->tensors)) {
        free(t.name);
        free(t.data);
        return still_fail(err, STILL_E_NOMEM, "out of memory adding tensor '%s'", name);
    }
    memcpy(t.data, data, nbytes);
    w->tensors[w->n_tensors++] = t;
    return STILL_OK;
}

typedef struct {
    FILE *fp;
    int failed;
    int err_no;
} wout;

static void w_fail(wout *o) {
    if (!o->failed) {
        o->failed = 1;
        o->err_no = errno ? errno : EIO;
    }
}
static void w_bytes(wout *o, const void *p, size_t n) {
    if (!o->failed && n && fwrite(p, 1, n, o->fp) != n) w_fail(o);
}
static void w_uint(wout *o, uint64_t v, size_t n) {
    uint8_t b[8];
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)(v >> (8 * i));
    w_bytes(o, b, n);
}
static void w_str(wout *o, const char *p, uint64_t len) {
    w_uint(o, len, 8);
    w_bytes(o, p, (size_t)len);
}
static void w_zeros(wout *o, uint64_t n) {
    static const uint8_t z[256];
    while (n) {
        size_t k = n < sizeof z ? (size_t)n : sizeof z;
        w_bytes(o, z, k);
        n -= k;
    }
}

static void w_value(wout *o, const gguf_value *v) {
    switch (v->type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL:
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32:
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
        w_uint(o, v->v.u64, scalar_size(v->type));   /* two's complement low bytes */
        break;
    case GGUF_TYPE_FLOAT32: {
        float f = (float)v->v.f64;
        uint32_t b;
        memcpy(&b, &f, 4);
        w_uint(o, b, 4);
        break;
    }
    case GGUF_TYPE_FLOAT64: {
        uint64_t b;
        memcpy(&b, &v->v.f64, 8);
        w_uint(o, b, 8);
        break;
    }
    case GGUF_TYPE_STRING: w_str(o, v->v.str.ptr, v->v.str.len); break;
    case GGUF_TYPE_ARRAY:
        w_uint(o, (uint32_t)v->v.arr.elem_type, 4);
        w_uint(o, v->v.arr.n, 8);
        for (uint64_t i = 0; i < v->v.arr.n; i++) w_value(o, &v->v.arr.items[i]);
        break;
    }
}

int gguf_writer_write(gguf_writer *w, const char *path, still_err *err) {
    if (!w || !path) return still_fail(err, STILL_E_ARG, "gguf_writer_write: NULL argument");
    if (!*path) return still_fail(err, STILL_E_ARG, "gguf_writer_write: empty path");
    uint64_t align = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kvs[i].key, GGUF_ALIGNMENT_KEY) == 0) align = w->kvs[i].v.v.u64;

    /* Tensor offsets within the data section. */
    uint64_t *offs = NULL;
    if (w->n_tensors) {
        offs = malloc(w->n_tensors * sizeof *offs);
        if (!offs) return still_fail(err, STILL_E_NOMEM, "out of memory writing %s", path);
    }
    uint64_t cur = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        offs[i] = cur;
        cur = align_up(cur + w->tensors[i].nbytes, align);
    }

    char *tmp = NULL;
    wout o = { NULL, 0, 0 };
    int orc = still_tmp_open(path, &o.fp, &tmp, err);
    if (orc) {
        free(offs);
        return orc;
    }
    w_uint(&o, GGUF_MAGIC_LE, 4);
    w_uint(&o, 3, 4);
    w_uint(&o, w->n_tensors, 8);
    w_uint(&o, w->n_kv, 8);
    uint64_t pos = 24;
    for (size_t i = 0; i < w->n_kv; i++) {
        w_str(&o, w->kvs[i].key, strlen(w->kvs[i].key));
        w_uint(&o, (uint32_t)w->kvs[i].v.type, 4);
        w_value(&o, &w->kvs[i].v);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        w_str(&o, t->name, strlen(t->name));
        w_uint(&o, t->n_dims, 4);
        for (uint32_t d = 0; d < t->n_dims; d++) w_uint(&o, (uint64_t)t->ne[d], 8);
        w_uint(&o, t->type, 4);
        w_uint(&o, offs[i], 8);
    }
    if (!o.failed) {
        long p = ftell(o.fp);
        if (p < 0) w_fail(&o);
        else pos = (uint64_t)p;
    }
    if (w->n_tensors) {
        w_zeros(&o, align_up(pos, align) - pos);
        for (size_t i = 0; i < w->n_tensors; i++) {
            const wtensor *t = &w->tensors[i];
            w_bytes(&o, t->data, t->nbytes);
            uint64_t end = offs[i] + t->nbytes;
            w_zeros(&o, align_up(end, align) - end);
        }
    }
    free(offs);
    if (o.failed) {
        int rc = still_fail(err, STILL_E_IO, "error writing %s: %s", path, strerror(o.err_no));
        still_tmp_abort(o.fp, tmp);
        return rc;
    }
    if ((orc = still_tmp_commit(o.fp, tmp, path, err))) return orc;
    return STILL_OK;
}
