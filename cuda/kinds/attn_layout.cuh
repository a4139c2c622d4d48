/* The index arithmetic of the attention kernel (cuda/kinds/softmax/attn_softmax.cu), kept
 * apart as __host__ __device__ functions so the GPU test's --cpu-selftest can
 * check it on a machine without a GPU: the shared-memory swizzle, which lane
 * supplies which row address to ldmatrix, which accumulator element a lane
 * holds, and the work decomposition (row tiles, key tiles, splits).
 *
 * Rows. For one KV head hk, the G = H / Hk query heads that share it and the
 * T query tokens form T·G rows: row r is token t = r / G, head
 * h = hk·G + r % G (token-major). A thread block takes BLOCK_M consecutive
 * rows, so its G heads share every K/V tile it loads (grouped-query reuse),
 * and a decode step (T = 1) is G rows of one block. Each of the 4 warps owns
 * MT·16 consecutive rows (MT m16 tiles of the mma).
 *
 * Keys. Row r (position p0 + t) attends keys 0 .. p0 + t. A block's keys are
 * 0 .. p0 + t_hi (t_hi its last token), taken in tiles of 64 (kBlockN); the
 * tiles may be divided among `n_splits` blocks (split-K), each then writing
 * unnormalised partial results that a second kernel combines. */
#ifndef STILL_CUDA_ATTN_LAYOUT_CUH
#define STILL_CUDA_ATTN_LAYOUT_CUH

#ifdef __CUDACC__
#define STC_HD __host__ __device__ __forceinline__
#else
#define STC_HD static inline
#endif

namespace stc_attn {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBlockN = 64;     /* keys per tile */
constexpr int kMaxSplits = 256;

/* ---- shared memory ----------------------------------------------------------------
 * A tile row (one query row, or one key's K or V) is D bf16 = D/8 chunks of
 * 16 bytes. Chunk c of row r is stored at chunk position c ^ (r & 7) of the
 * row: the 8 rows an ldmatrix phase reads at the same logical chunk then sit
 * in 8 different 16-byte bank groups (no conflicts), and a cp.async of 8
 * consecutive chunks of a row stays one contiguous 128-byte line. */
STC_HD int swz_off(int row, int chunk, int chunks_per_row) {
    return (row * chunks_per_row + (chunk ^ (row & 7))) * 16;
}
/* The same for (row + row_add, chunk + chunk_add) with row_add a multiple of 8
 * and chunk_add even: then the XOR pattern of the lane's own (row, chunk)
 * carries over, so the kernel computes chunk ^ (row & 7) once per lane and
 * each unrolled access costs an XOR with a constant. */
STC_HD int swz_off_add(int row, int chunk, int row_add, int chunk_add, int chunks_per_row) {
    return (row + row_add) * chunks_per_row * 16 + ((chunk_add ^ (chunk ^ (row & 7))) * 16);
}

/* ---- ldmatrix.x4 lane addresses -------------------------------------------------------
 * ldmatrix.x4 reads four 8×8 bf16 matrices; lanes 8i .. 8i+7 give the row
 * addresses of matrix i, and afterwards lane L holds, in register i, the two
 * elements (L/4, 2(L%4)) and (L/4, 2(L%4)+1) of matrix i (with .trans: the
 * elements (2(L%4), L/4) and (2(L%4)+1, L/4)). The functions give, for a
 * lane, the row (0..15) and the 16-byte chunk (0..1) of the 16×16 block that
 * the lane addresses.
 *
 * Row-major operands — the A operand Q [query][dim], and V [key][dim] read
 * with .trans as the B operand of P·V: matrices (rows 0-7, chunk 0),
 * (rows 8-15, chunk 0), (rows 0-7, chunk 1), (rows 8-15, chunk 1), giving the
 * A fragment a0..a3 of m16n8k16, or for V the B fragments {b0, b1} of dims
 * 0-7 and {b0, b1} of dims 8-15. */
STC_HD int ldm_rowmajor_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
STC_HD int ldm_rowmajor_chunk(int lane) { return lane >> 4; }
/* K [key][dim] as the B operand of Q·Kᵀ (B "col" layout = [n][k] storage):
 * matrices (keys 0-7, chunk 0), (keys 0-7, chunk 1), (keys 8-15, chunk 0),
 * (keys 8-15, chunk 1), giving {b0, b1} of keys 0-7 and {b0, b1} of keys 8-15. */
STC_HD int ldm_nk_row(int lane) { return (lane & 7) + (lane >> 4) * 8; }
STC_HD int ldm_nk_chunk(int lane) { return (lane >> 3) & 1; }

/* ---- mma.m16n8k16 accumulator ------------------------------------------------------------
 * Lane L holds C elements e = 0..3 at row L/4 + 8(e/2), column 2(L%4) + e%2.
 * These are also where the A fragment of the next mma expects them: the
 * scores of keys 16k .. 16k+15 (n-tiles 2k and 2k+1) become the bf16 A
 * operand of P·V's k-step k as {C(2k)[0,1], C(2k)[2,3], C(2k+1)[0,1], C(2k+1)[2,3]}. */
STC_HD int acc_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
STC_HD int acc_col(int lane, int e) { return 2 * (lane & 3) + (e & 1); }
/* A register i (0..3) of P·V's k-step k packs accumulator elements e and e+1,
 * e = p_frag_e(i), of S n-tile 2k + p_frag_ntile(i). */
STC_HD int p_frag_ntile(int i) { return i >> 1; }
STC_HD int p_frag_e(int i) { return (i & 1) * 2; }

/* ---- work decomposition --------------------------------------------------------------------- */

STC_HD int imin(int a, int b) { return a < b ? a : b; }
STC_HD int imax(int a, int b) { return a > b ? a : b; }
STC_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

/* Tokens covered by rows r_begin .. r_begin + n_rows - 1 (clipped to rows_total). */
STC_HD void token_range(int r_begin, int n_rows, int rows_total, int G, int *t_lo, int *t_hi) {
    *t_lo = r_begin / G;
    *t_hi = (imin(r_begin + n_rows, rows_total) - 1) / G;
}
/* Key tiles a block whose last token is t_hi needs (keys 0 .. p0 + t_hi). */
STC_HD int key_tiles(int p0, int t_hi) { return ceil_div(p0 + t_hi + 1, kBlockN); }
/* A warp whose last token is t_hi has nothing to do in the tile starting at key kbase. */
STC_HD bool tile_skipped(int kbase, int p0, int t_hi) { return kbase > p0 + t_hi; }
/* ... and needs the causal mask in it unless every key of it is visible to its first token. */
STC_HD bool tile_needs_mask(int kbase, int p0, int t_lo) { return kbase + kBlockN - 1 > p0 + t_lo; }
/* Block index -> (row tile, KV head): the last row tiles (the most keys
 * under the causal mask) are scheduled first, KV heads interleaved. */
STC_HD void cta_coords(int bx, int Hk, int n_row_tiles, int *tile, int *hk) {
    *hk = bx % Hk;
    *tile = n_row_tiles - 1 - bx / Hk;
}

struct plan {
    int G, rows;          /* heads per KV head; rows per KV head = T·G */
    int mt, block_m;      /* m16 tiles per warp; rows per block = 64·mt */
    int n_row_tiles;      /* blocks per KV head (grid.x = n_row_tiles · Hk) */
    int n_key_tiles;      /* key tiles of the last row tile (the most) */
    int tiles_per_split;
    int n_splits;         /* grid.y */
};

/* The decomposition for a call; forced_splits > 0 fixes the number of
 * splits (capped at the number of key tiles). Rules: 128-row blocks (two m16
 * tiles per warp: each K/V fragment read from shared memory feeds two mma)
 * when D = 64 and they alone fill the GPU, else 64-row blocks; when the
 * blocks are fewer than the multiprocessors, split the keys so that about
 * two blocks per multiprocessor run, each on at least two key tiles. */
static inline plan make_plan(int T, int p0, int H, int Hk, int D, int sm_count, int forced_splits) {
    plan p;
    p.G = H / Hk;
    p.rows = T * p.G;
    p.mt = (D == 64 && ceil_div(p.rows, 128) * Hk >= sm_count) ? 2 : 1;
    p.block_m = kWarps * 16 * p.mt;
    p.n_row_tiles = ceil_div(p.rows, p.block_m);
    p.n_key_tiles = key_tiles(p0, T - 1);
    const int ctas = p.n_row_tiles * Hk;
    int s;
    if (forced_splits > 0) {
        s = forced_splits;
    } else if (ctas >= sm_count) {
        s = 1;
    } else {
        s = ceil_div(2 * sm_count, ctas);
        const int cap = p.n_key_tiles / 2 > 1 ? p.n_key_tiles / 2 : 1;
        if (s > cap) s = cap;
    }
    if (s > kMaxSplits) s = kMaxSplits;
    if (s > p.n_key_tiles) s = p.n_key_tiles;
    if (s < 1) s = 1;
    p.tiles_per_split = ceil_div(p.n_key_tiles, s);
    p.n_splits = ceil_div(p.n_key_tiles, p.tiles_per_split);   /* no split left empty everywhere */
    return p;
}

/* Splits that hold work for a block of row tile `tile` (the rest return at once). */
STC_HD int splits_used(int tile, int block_m, int rows, int G, int p0, int tiles_per_split) {
    int t_lo, t_hi;
    token_range(tile * block_m, block_m, rows, G, &t_lo, &t_hi);
    return ceil_div(key_tiles(p0, t_hi), tiles_per_split);
}

}   // namespace stc_attn

#endif
