/* The index arithmetic of the still attention kind on the GPU
 * (cuda/attn_still*.cu), kept apart as __host__ __device__ functions so the
 * GPU test's --cpu-selftest can check it without a GPU: which chunks a call
 * touches and which leave Local during it, how many Sel entries a chunk
 * sees, the work decomposition of every kernel, the key list of an attention
 * block, the routing hash and the saliency score.
 *
 * Terms (spec: ../shared/spec/attention.md, "The chunk terrace" and "still").
 * Chunk of position t: c(t) = t / C. Chunk c leaves Local when position
 * (c + 2) C arrives: its top-n tokens join Sel (n = min(λ, C, slots left)),
 * the rest are folded into the linear state S, z. A call processes positions
 * p0 .. p0 + T - 1 (p0 = tokens seen so far, kept in device memory, so every
 * grid size below depends on T alone and a decode step can be replayed in a
 * CUDA graph).
 *
 * Facts the algorithm rests on (checked by the self-test):
 * - After n tokens, chunks 0 .. n_left(n) - 1 have left; the ring of recent
 *   tokens holds exactly positions n_left(n)·C .. n - 1 (at most 2C).
 * - Each leaving chunk contributes exactly min(λ, C, cap - used) tokens, so
 *   the Sel count after k chunks have left is sel_count(k) = min(k·λ, cap)
 *   (λ already clamped to C): Sel slots of chunk c' are
 *   sel_count(c') .. sel_count(c' + 1) - 1, known in advance, and a query
 *   in chunk c sees the prefix of sel_count(c - 1) entries. Selection of
 *   every leaving chunk is independent of the others: chunk-parallel.
 * - A query in chunk c sees S_c = the fold of chunks <= c - 2: the state at
 *   the start of the call plus the first (c - 1 - leave_first) folds of the
 *   call (a prefix sum over the call's leaving chunks). */
#ifndef STILL_CUDA_ATTN_STILL_LAYOUT_CUH
#define STILL_CUDA_ATTN_STILL_LAYOUT_CUH

#include <math.h>
#include <stdint.h>

#include "kinds/still/attn_still_rules.h"

#ifdef __CUDACC__
#define STC_SHD __host__ __device__ __forceinline__
#else
#define STC_SHD static inline
#endif

namespace stillk {

constexpr int kRows = 64;        /* query rows (positions of one head) per attention / linear block */
constexpr int kKeys = 64;        /* keys per attention tile */
constexpr int kScoreRows = 64;   /* query positions per scoring block (64-aligned in absolute positions) */
constexpr int kMaxChunk = 128;   /* largest C the kernels take */
constexpr float kDenEps = STILL_DEN_EPS;         /* src/kinds/still/attn_still_rules.h */
constexpr float kFmapClamp = STILL_FMAP_CLAMP;
constexpr float kNormFloor = STILL_NORM_FLOOR;

/* Routing ids (attn_still_rules.h; src/kinds/attn.h's attn_routing has the same values). */
enum { R_SALIENCY = STILL_ROUTE_SALIENCY, R_RANDOM = STILL_ROUTE_RANDOM, R_KEYNORM = STILL_ROUTE_KEYNORM,
       R_QK = STILL_ROUTE_QK, R_POSITION = STILL_ROUTE_POSITION, R_NONE = STILL_ROUTE_NONE };

STC_SHD int smin(int a, int b) { return a < b ? a : b; }
STC_SHD int smax(int a, int b) { return a > b ? a : b; }
STC_SHD int cdiv(int a, int b) { return (a + b - 1) / b; }   /* a >= 0, b > 0 */

/* x / d for 0 <= x < 2^31 and a divisor d >= 1 fixed per call, as a multiply-high, an add and a shift
 * (the round-up method of Granlund and Montgomery): shift = ceil(log2 d), mul = 2^32 (2^shift - d) / d + 1,
 * x / d = (mulhi(x, mul) + x) >> shift. The kernels' block geometry divides by the chunk size and by the
 * row tiles per chunk, which the hardware does in about twenty instructions a division otherwise
 * (--cpu-selftest checks fdiv against the division). */
struct fast_div {
    uint32_t mul, shift;
};
STC_SHD fast_div make_fast_div(int d) {
    uint32_t s = 0;
    while (s < 31 && (1u << s) < (uint32_t)d) s++;
    fast_div f;
    f.mul = (uint32_t)(((uint64_t)1 << 32) * (((uint64_t)1 << s) - (uint64_t)d) / (uint64_t)d + 1);
    f.shift = s;
    return f;
}
STC_SHD int fdiv(int x, fast_div f) {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi((uint32_t)x, f.mul);
#else
    const uint32_t hi = (uint32_t)(((uint64_t)(uint32_t)x * f.mul) >> 32);
#endif
    return (int)((hi + (uint32_t)x) >> f.shift);
}

/* Chunks that have left Local once n tokens are seen (chunk c leaves at
 * position (c + 2) C, so it has left when (c + 2) C <= n - 1). */
STC_SHD int n_left(int n, int C) { return n >= 1 && (n - 1) / C >= 1 ? (n - 1) / C - 1 : 0; }

/* Sel entries per selection head after k chunks have left (lam <= C). */
STC_SHD int sel_count(int k, int lam, int cap) {
    const long long v = (long long)k * lam;
    return v < cap ? (int)v : cap;
}

/* What one call (positions p0 .. p0 + T - 1, T >= 1) touches. */
struct call_geom {
    int p0, T;
    int c_first, c_last;          /* query chunks */
    int leave_first, n_leaves;    /* chunks leave_first .. leave_first + n_leaves - 1 leave during the call */
    int ring_lo;                  /* the ring holds positions ring_lo .. p0 - 1 at the start (= leave_first·C) */
    int end_lo;                   /* ... and end_lo .. p0 + T - 1 at the end */
};

/* make_geom with the chunk size's divisions by fc = make_fast_div(C) (the kernels' version). */
STC_SHD int n_left_fd(int n, fast_div fc) {
    const int q = n >= 1 ? fdiv(n - 1, fc) : 0;
    return q >= 1 ? q - 1 : 0;
}
STC_SHD call_geom make_geom_fd(int p0, int T, int C, fast_div fc) {
    call_geom g;
    g.p0 = p0, g.T = T;
    g.c_first = fdiv(p0, fc);
    g.c_last = fdiv(p0 + T - 1, fc);
    g.leave_first = n_left_fd(p0, fc);
    const int end_left = n_left_fd(p0 + T, fc);
    g.n_leaves = end_left - g.leave_first;
    g.ring_lo = g.leave_first * C;
    g.end_lo = end_left * C;
    return g;
}

STC_SHD call_geom make_geom(int p0, int T, int C) {
    call_geom g;
    g.p0 = p0, g.T = T;
    g.c_first = p0 / C;
    g.c_last = (p0 + T - 1) / C;
    g.leave_first = n_left(p0, C);
    g.n_leaves = n_left(p0 + T, C) - g.leave_first;
    g.ring_lo = g.leave_first * C;
    g.end_lo = n_left(p0 + T, C) * C;
    return g;
}

/* Upper bounds from T alone (the grid sizes; blocks beyond the actual
 * count for this p0 return at once). */
STC_SHD int max_query_chunks(int T, int C) { return (T + C - 2) / C + 1; }
STC_SHD int max_leaves(int T, int C) { return (T + C - 1) / C; }
STC_SHD int max_score_tiles(int T) { return (T + kScoreRows - 2) / kScoreRows + 1; }
STC_SHD int row_tiles(int C) { return cdiv(C, kRows); }

/* ---- attention and linear blocks: (query chunk c = c_first + qi, row tile rt, head) ----
 * Rows: the positions [lo, hi] of chunk c in row tile rt that this call
 * processes (lo > hi: none). */
STC_SHD void block_rows(const call_geom &g, int C, int c, int rt, int *lo, int *hi) {
    const int a = c * C + rt * kRows, b = c * C + smin(C, (rt + 1) * kRows) - 1;
    *lo = smax(a, g.p0);
    *hi = smin(b, g.p0 + g.T - 1);
}

/* The keys of an attention block of chunk c whose last row is at position
 * hi: Sel entries 0 .. ns - 1 in tiles 0 .. n_sel_tiles - 1 (the last one
 * padded), then the Local positions lo_pos .. hi from tile n_sel_tiles on. */
struct key_list {
    int ns, n_sel_tiles, lo_pos, n_tiles;
};

STC_SHD key_list make_keys(int c, int hi, int C, int lam, int cap) {
    key_list k;
    k.ns = sel_count(c >= 1 ? c - 1 : 0, lam, cap);
    k.n_sel_tiles = cdiv(k.ns, kKeys);
    k.lo_pos = c >= 1 ? (c - 1) * C : 0;
    k.n_tiles = k.n_sel_tiles + cdiv(hi - k.lo_pos + 1, kKeys);
    return k;
}
/* Position of column 0 of Local tile j (j >= n_sel_tiles). */
STC_SHD int tile_pos0(const key_list &k, int j) { return k.lo_pos + (j - k.n_sel_tiles) * kKeys; }
/* A row at position pos sees key columns 0 .. tile_limit of tile j (none when
 * negative; all when >= kKeys - 1). Sel keys are visible to every row of the
 * chunk; Local keys up to the row's own position. */
STC_SHD int tile_limit(const key_list &k, int j, int pos) {
    if (j < k.n_sel_tiles) return k.ns - j * kKeys - 1;
    return pos - tile_pos0(k, j);
}
/* Tile row r (0 .. kKeys - 1) holds a key at all (else it is zero-filled):
 * a Sel entry below ns, or a Local position up to the block's last row hi. */
STC_SHD bool tile_row_valid(const key_list &k, int j, int r, int hi) {
    if (j < k.n_sel_tiles) return j * kKeys + r < k.ns;
    return tile_pos0(k, j) + r <= hi;
}

/* Linear state seen by chunk c (>= 2): 0 = the state at the start of the
 * call, i >= 1 = after the call's first i folds (prefix slot i - 1). */
STC_SHD int lin_index(const call_geom &g, int c) { return smax(0, c - 1 - g.leave_first); }

/* ---- scoring blocks --------------------------------------------------------------------
 * Block b takes the positions [tq0, tq0 + 63] ∩ [p0, p0 + T - 1],
 * tq0 = (p0 / 64 + b) · 64. Token t's window is R(t) = max(0, t - C + 1) .. t;
 * the block reads keys in 64-key sub-tiles s = 0 .. n_sub - 1 starting at
 * tq0 + 64 (s - J), J = cdiv(C - 1, 64). Tiles are aligned to absolute
 * positions, so a token's score is computed the same way whatever the call
 * split. */
STC_SHD int score_tile_q0(int p0, int b) { return (p0 / kScoreRows + b) * kScoreRows; }
STC_SHD int score_sub_before(int C) { return cdiv(C - 1, kKeys); }
STC_SHD bool in_window(int key, int t, int C) { return key >= 0 && key <= t && key > t - C; }

/* ---- routing ---------------------------------------------------------------------------- */

/* The routing rules are src/kinds/still/attn_still_rules.h's, the CPU's too (one definition): the random routing's hash,
 * the position routing's offsets, the self-saliency score f(p). */
STC_SHD double route_random(uint64_t seed, int hs, int pos) { return still_route_random(seed, hs, pos); }
STC_SHD int position_offset(int i, int n, int C) { return still_position_offset(i, n, C); }
STC_SHD double saliency_of_p(double p) { return still_saliency_of_p(p); }
/* Ranking (the caller maps NaN to -inf first: still_rank_value). */
STC_SHD bool ranks_before(double a, int i, double b, int j) { return still_ranks_before(a, i, b, j); }

}   // namespace stillk

#endif
