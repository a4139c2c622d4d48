/* --cpu-selftest, the softmax attention kernel's side: its fragment / swizzle index arithmetic
 * (cuda/kinds/attn_layout.cuh) against the PTX ISA's definitions of ldmatrix and mma.m16n8k16, its work
 * decomposition, and a CPU emulation of its tiled online softmax with splits against ref_attention. */
#include "kinds/attn_layout.cuh"

#include "harness.cuh"
#include "ref.cuh"
#include "test_groups.cuh"

/* The PTX ISA's fragment layouts of mma.m16n8k16 with .bf16 inputs (lane L,
 * groupID g = L/4, threadID_in_group c = L%4), written out independently of
 * cuda/kinds/attn_layout.cuh:
 *   A (16×16, row-major): register i, half j -> row g + 8·(i%2), col 2c + j + 8·(i/2)
 *   B (16×8, "col"):      register i, half j -> k 2c + j + 8·i, n g
 *   C (16×8):             element e          -> row g + 8·(e/2), col 2c + e%2 */
static int spec_a_row(int L, int i) { return L / 4 + 8 * (i % 2); }
static int spec_a_col(int L, int i, int j) { return 2 * (L % 4) + j + 8 * (i / 2); }
static int spec_b_k(int L, int i, int j) { return 2 * (L % 4) + j + 8 * i; }
static int spec_b_n(int L) { return L / 4; }
static int spec_c_row(int L, int e) { return L / 4 + 8 * (e / 2); }
static int spec_c_col(int L, int e) { return 2 * (L % 4) + e % 2; }

/* Shared memory holding, for a tile of `rows` rows × (chunks·8) columns, the
 * id row·256 + col of each element at the swizzled place cp.async writes it. */
static std::vector<uint16_t> swizzled_tile(int rows, int chunks) {
    std::vector<uint16_t> sm((size_t)rows * chunks * 8, 0xFFFF);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++)
            for (int x = 0; x < 8; x++)
                sm[(size_t)stc_attn::swz_off(r, c, chunks) / 2 + x] = (uint16_t)(r * 256 + c * 8 + x);
    return sm;
}

/* ldmatrix.x4 per the PTX ISA: lane 8i+r gives the address (in bytes) of row
 * r of matrix i; lane L receives, in register i, elements (L/4, 2(L%4)+j) of
 * matrix i, or with .trans elements (2(L%4)+j, L/4). Returns [lane][reg][half]. */
static void ldmatrix_x4(const std::vector<uint16_t> &sm, const int addr[32], bool trans, uint16_t out[32][4][2]) {
    for (int L = 0; L < 32; L++)
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 2; j++) {
                const int row = trans ? 2 * (L % 4) + j : L / 4, col = trans ? L / 4 : 2 * (L % 4) + j;
                out[L][i][j] = sm[(size_t)addr[8 * i + row] / 2 + col];
            }
}

/* The 8 addresses of each ldmatrix phase fall in distinct 16-byte bank groups. */
static bool conflict_free(const int addr[32]) {
    for (int i = 0; i < 4; i++) {
        int seen = 0;
        for (int r = 0; r < 8; r++) seen |= 1 << ((addr[8 * i + r] / 16) % 8);
        if (seen != 0xff) return false;
    }
    return true;
}

void selftest_fragments(void) {
    using namespace stc_attn;
    for (int D : {64, 128}) {
        const int CH = D / 8;
        for (int MT : {1, 2}) {
            const int BM = kWarps * 16 * MT;
            bool ok_q = true, ok_k = true, ok_v = true, banks = true;
            /* Q: A fragments of every warp, m-tile and k-step */
            const std::vector<uint16_t> sq = swizzled_tile(BM, CH);
            for (int w = 0; w < kWarps; w++)
                for (int mt = 0; mt < MT; mt++)
                    for (int ks = 0; ks < D / 16; ks++) {
                        int addr[32];
                        uint16_t got[32][4][2];
                        for (int L = 0; L < 32; L++)
                            addr[L] = swz_off(w * MT * 16 + mt * 16 + ldm_rowmajor_row(L), 2 * ks + ldm_rowmajor_chunk(L), CH);
                        banks = banks && conflict_free(addr);
                        ldmatrix_x4(sq, addr, false, got);
                        for (int L = 0; L < 32; L++)
                            for (int i = 0; i < 4; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int row = w * MT * 16 + mt * 16 + spec_a_row(L, i);
                                    const int col = 16 * ks + spec_a_col(L, i, j);
                                    ok_q = ok_q && got[L][i][j] == row * 256 + col;
                                }
                    }
            /* K [key][dim]: B fragments of Q·Kᵀ (n = key, k = dim) */
            const std::vector<uint16_t> skv = swizzled_tile(kBlockN, CH);
            for (int ks = 0; ks < D / 16; ks++)
                for (int np = 0; np < kBlockN / 16; np++) {
                    int addr[32];
                    uint16_t got[32][4][2];
                    for (int L = 0; L < 32; L++) addr[L] = swz_off(np * 16 + ldm_nk_row(L), 2 * ks + ldm_nk_chunk(L), CH);
                    banks = banks && conflict_free(addr);
                    ldmatrix_x4(skv, addr, false, got);
                    for (int L = 0; L < 32; L++)
                        for (int half_tile = 0; half_tile < 2; half_tile++)   /* n-tiles 2np, 2np+1 */
                            for (int i = 0; i < 2; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int key = 16 * np + 8 * half_tile + spec_b_n(L), dim = 16 * ks + spec_b_k(L, i, j);
                                    ok_k = ok_k && got[L][2 * half_tile + i][j] == key * 256 + dim;
                                }
                }
            /* V [key][dim] with .trans: B fragments of P·V (k = key, n = dim) */
            for (int kk = 0; kk < kBlockN / 16; kk++)
                for (int dp = 0; dp < D / 16; dp++) {
                    int addr[32];
                    uint16_t got[32][4][2];
                    for (int L = 0; L < 32; L++)
                        addr[L] = swz_off(kk * 16 + ldm_rowmajor_row(L), 2 * dp + ldm_rowmajor_chunk(L), CH);
                    banks = banks && conflict_free(addr);
                    ldmatrix_x4(skv, addr, true, got);
                    for (int L = 0; L < 32; L++)
                        for (int half_tile = 0; half_tile < 2; half_tile++)   /* dim n-tiles 2dp, 2dp+1 */
                            for (int i = 0; i < 2; i++)
                                for (int j = 0; j < 2; j++) {
                                    const int key = 16 * kk + spec_b_k(L, i, j), dim = 16 * dp + 8 * half_tile + spec_b_n(L);
                                    ok_v = ok_v && got[L][2 * half_tile + i][j] == key * 256 + dim;
                                }
                }
            /* cp.async stores: 8 consecutive threads write 8 distinct bank groups */
            for (int rows : {BM, kBlockN})
                for (int base = 0; base < rows * CH; base += 8) {
                    int seen = 0;
                    for (int t = base; t < base + 8; t++) seen |= 1 << ((swz_off(t / CH, t % CH, CH) / 16) % 8);
                    banks = banks && seen == 0xff;
                }
            report(ok_q, "selftest D=%d MT=%d: ldmatrix of swizzled Q gives the PTX A fragments", D, MT);
            report(ok_k, "selftest D=%d MT=%d: ldmatrix of swizzled K gives the B fragments of Q·Kᵀ", D, MT);
            report(ok_v, "selftest D=%d MT=%d: ldmatrix.trans of swizzled V gives the B fragments of P·V", D, MT);
            report(banks, "selftest D=%d MT=%d: ldmatrix phases and cp.async stores are bank-conflict free", D, MT);
        }
    }
    /* The kernel's swz_off_add (lane part once, then constants) is swz_off. */
    bool ok_add = true;
    for (int CH : {8, 16})
        for (int row = 0; row < 128; row++)
            for (int c = 0; c < CH; c++)
                for (int ra = 0; ra < 256; ra += 8)
                    for (int ca = 0; c + ca < CH; ca += 2)
                        if ((c & ca) == 0)
                            ok_add = ok_add && stc_attn::swz_off_add(row, c, ra, ca, CH) == stc_attn::swz_off(row + ra, c + ca, CH);
    report(ok_add, "selftest: swz_off_add (hoisted lane part) equals swz_off");
    /* P·V's A operand from S's accumulators, and the accumulator helpers */
    bool ok = true;
    for (int L = 0; L < 32; L++) {
        for (int e = 0; e < 4; e++)
            ok = ok && stc_attn::acc_row(L, e) == spec_c_row(L, e) && stc_attn::acc_col(L, e) == spec_c_col(L, e);
        for (int kk = 0; kk < 4; kk++)
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 2; j++) {
                    const int nt = 2 * kk + stc_attn::p_frag_ntile(i), e = stc_attn::p_frag_e(i) + j;
                    /* the S element the kernel packs here, vs what the A fragment must hold */
                    ok = ok && spec_c_row(L, e) == spec_a_row(L, i) && 8 * nt + spec_c_col(L, e) == 16 * kk + spec_a_col(L, i, j);
                }
    }
    report(ok, "selftest: S accumulators repacked as P·V's A fragments match the PTX layouts");
}

/* For a configuration, every row sees every key tile it needs exactly once
 * (over all splits and warps; a warp may also run tiles that are entirely
 * masked for some of its rows, which contribute nothing), tiles without the
 * mask are fully visible to all the warp's rows, and splits_used() counts
 * the splits with work. */
static bool check_decomposition(int T, int p0, int H, int Hk, int D, int sm, int forced) {
    using namespace stc_attn;
    const plan p = make_plan(T, p0, H, Hk, D, sm, forced);
    if (p.n_splits < 1 || p.n_splits > kMaxSplits || p.tiles_per_split * (p.n_splits - 1) >= p.n_key_tiles) return false;
    std::vector<int> count((size_t)p.rows * p.n_key_tiles, 0);
    std::vector<int> used_splits(p.n_row_tiles, 0);
    for (int bx = 0; bx < p.n_row_tiles * Hk; bx++)
        for (int split = 0; split < p.n_splits; split++) {
            int tile, hk, t_lo, t_hi;
            cta_coords(bx, Hk, p.n_row_tiles, &tile, &hk);
            if (tile < 0 || tile >= p.n_row_tiles || hk < 0 || hk >= Hk) return false;
            const int r0 = tile * p.block_m;
            token_range(r0, p.block_m, p.rows, p.G, &t_lo, &t_hi);
            const int n_tiles = key_tiles(p0, t_hi);
            const int jb = split * p.tiles_per_split, je = imin(n_tiles, jb + p.tiles_per_split);
            if (jb >= je) continue;
            if (hk == 0) used_splits[tile]++;
            for (int w = 0; w < kWarps; w++) {
                const int wr0 = r0 + w * p.mt * 16;
                if (wr0 >= p.rows) continue;
                int wt_lo, wt_hi;
                token_range(wr0, p.mt * 16, p.rows, p.G, &wt_lo, &wt_hi);
                for (int j = jb; j < je; j++) {
                    const int kbase = j * kBlockN;
                    if (tile_skipped(kbase, p0, wt_hi)) continue;
                    const bool mask = tile_needs_mask(kbase, p0, wt_lo);
                    for (int r = wr0; r < imin(wr0 + p.mt * 16, p.rows); r++) {
                        const int pos = p0 + r / p.G;
                        if (!mask && kbase + kBlockN - 1 > pos) return false;   /* unmasked but not visible */
                        if (hk == 0) count[(size_t)r * p.n_key_tiles + j]++;
                    }
                }
            }
        }
    for (int r = 0; r < p.rows; r++) {
        const int need = key_tiles(p0, r / p.G);
        for (int j = 0; j < p.n_key_tiles; j++) {
            const int c = count[(size_t)r * p.n_key_tiles + j];
            if (j < need && c != 1) return false;
        }
    }
    for (int tile = 0; tile < p.n_row_tiles; tile++)
        if (used_splits[tile] != splits_used(tile, p.block_m, p.rows, p.G, p0, p.tiles_per_split)) return false;
    return true;
}

/* The kernel's arithmetic on the CPU, row by row: the same decomposition,
 * per-warp skip / mask decisions, zero-filled keys past the block's last
 * one, running max with the -inf guard, exp2 with the folded scale, P
 * rounded to bf16 for P·V, the split partials and their combination. */
static std::vector<double> emulate_attention(const std::vector<uint16_t> &q, const std::vector<uint16_t> &k,
                                             const std::vector<uint16_t> &v, int T, int p0, int H, int Hk, int D,
                                             int sm, int forced) {
    using namespace stc_attn;
    const plan p = make_plan(T, p0, H, Hk, D, sm, forced);
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)D));
    std::vector<double> out((size_t)T * H * D, NAN);
    const size_t n_part = (size_t)p.n_splits * Hk * p.rows;
    std::vector<float> part_o(n_part * D, NAN), part_m(n_part, NAN), part_l(n_part, NAN);
    std::vector<float> s(kBlockN), o(D);
    for (int bx = 0; bx < p.n_row_tiles * Hk; bx++)
        for (int split = 0; split < p.n_splits; split++) {
            int tile, hk, t_lo, t_hi;
            cta_coords(bx, Hk, p.n_row_tiles, &tile, &hk);
            const int r0 = tile * p.block_m;
            token_range(r0, p.block_m, p.rows, p.G, &t_lo, &t_hi);
            const int n_keys = p0 + t_hi + 1, n_tiles = key_tiles(p0, t_hi);
            const int jb = split * p.tiles_per_split, je = imin(n_tiles, jb + p.tiles_per_split);
            if (jb >= je) continue;
            for (int w = 0; w < kWarps; w++) {
                const int wr0 = r0 + w * p.mt * 16;
                if (wr0 >= p.rows) continue;
                int wt_lo, wt_hi;
                token_range(wr0, p.mt * 16, p.rows, p.G, &wt_lo, &wt_hi);
                for (int r = wr0; r < imin(wr0 + p.mt * 16, p.rows); r++) {
                    const int t = r / p.G, h = hk * p.G + r % p.G, pos = p0 + t;
                    const uint16_t *qr = &q[((size_t)t * H + h) * D];
                    float m = -INFINITY, l = 0;
                    for (auto &x : o) x = 0;
                    for (int j = jb; j < je; j++) {
                        const int kbase = j * kBlockN;
                        if (tile_skipped(kbase, p0, wt_hi)) continue;
                        const bool mask = tile_needs_mask(kbase, p0, wt_lo);
                        for (int jj = 0; jj < kBlockN; jj++) {
                            const int key = kbase + jj;
                            float dot = 0;
                            if (key < n_keys)
                                for (int d = 0; d < D; d++)
                                    dot += bf2f(qr[d]) * bf2f(k[((size_t)key * Hk + hk) * D + d]);
                            s[jj] = mask && key > pos ? -INFINITY : dot;
                        }
                        float mx = m;
                        for (float x : s) mx = fmaxf(mx, x);
                        const float msc = mx == -INFINITY ? 0.0f : mx * sl2;
                        const float corr = exp2f(m * sl2 - msc);
                        m = mx;
                        float sum = 0;
                        for (auto &x : o) x *= corr;
                        for (int jj = 0; jj < kBlockN; jj++) {
                            const float pj = exp2f(fmaf(s[jj], sl2, -msc));
                            sum += pj;
                            const int key = kbase + jj;
                            if (key >= n_keys) continue;   /* zero-filled V row */
                            const float pb = bf2f(f2bf(pj));
                            for (int d = 0; d < D; d++) o[d] += pb * bf2f(v[((size_t)key * Hk + hk) * D + d]);
                        }
                        l = l * corr + sum;
                    }
                    if (p.n_splits == 1) {
                        for (int d = 0; d < D; d++) out[((size_t)t * H + h) * D + d] = o[d] / l;
                    } else {
                        const size_t pr = ((size_t)split * Hk + hk) * p.rows + r;
                        for (int d = 0; d < D; d++) part_o[pr * D + d] = o[d];
                        part_m[pr] = m, part_l[pr] = l;
                    }
                }
            }
        }
    if (p.n_splits > 1)
        for (int hk = 0; hk < Hk; hk++)
            for (int r = 0; r < p.rows; r++) {
                const int ns = splits_used(r / p.block_m, p.block_m, p.rows, p.G, p0, p.tiles_per_split);
                float mx = -INFINITY;
                for (int s2 = 0; s2 < ns; s2++) mx = fmaxf(mx, part_m[((size_t)s2 * Hk + hk) * p.rows + r]);
                const int t = r / p.G, h = hk * p.G + r % p.G;
                for (int d = 0; d < D; d++) {
                    float acc = 0, lsum = 0;
                    for (int s2 = 0; s2 < ns; s2++) {
                        const size_t pr = ((size_t)s2 * Hk + hk) * p.rows + r;
                        const float wgt = exp2f((part_m[pr] - mx) * sl2);
                        lsum += part_l[pr] * wgt;
                        acc += part_o[pr * D + d] * wgt;
                    }
                    out[((size_t)t * H + h) * D + d] = acc / lsum;
                }
            }
    return out;
}

void selftest_decomposition(void) {
    int bad = 0, n = 0;
    /* fixed shapes, then random ones, for several GPU sizes */
    const int fixed[][6] = {{1, 0, 9, 3, 64, 0},    {1, 65535, 9, 3, 64, 0}, {16384, 0, 9, 3, 64, 0},
                            {2000, 37, 9, 3, 64, 0}, {37, 2000, 9, 3, 64, 5}, {1, 4095, 8, 1, 128, 0},
                            {600, 0, 32, 32, 64, 2}, {513, 7, 8, 8, 64, 0},   {3, 1, 8, 2, 128, 300}};
    for (int sm : {132, 8, 1})
        for (auto &f : fixed) {
            n++;
            if (!check_decomposition(f[0], f[1], f[2], f[3], f[4], sm, f[5])) {
                bad++;
                printf("  decomposition wrong: T=%d p0=%d H=%d Hk=%d D=%d sm=%d splits=%d\n", f[0], f[1], f[2], f[3],
                       f[4], sm, f[5]);
            }
        }
    for (int i = 0; i < 300; i++) {
        const int Hk = 1 + g_rng.below(4), G = 1 + g_rng.below(8), T = 1 + g_rng.below(i < 150 ? 300 : 3000);
        const int p0 = g_rng.below(3) ? g_rng.below(5000) : 0, D = g_rng.below(2) ? 64 : 128;
        const int sm = 1 + g_rng.below(200), forced = g_rng.below(3) ? 0 : g_rng.below(40);
        n++;
        if (!check_decomposition(T, p0, G * Hk, Hk, D, sm, forced)) {
            bad++;
            printf("  decomposition wrong: T=%d p0=%d H=%d Hk=%d D=%d sm=%d splits=%d\n", T, p0, G * Hk, Hk, D, sm,
                   forced);
        }
    }
    report(bad == 0, "selftest: %d decompositions: each row gets each visible key tile exactly once (%d wrong)", n, bad);
    /* plan choices the performance depends on */
    const stc_attn::plan big = stc_attn::make_plan(16384, 0, 9, 3, 64, 132, 0);
    const stc_attn::plan dec = stc_attn::make_plan(1, 65535, 9, 3, 64, 132, 0);
    report(big.mt == 2 && big.n_splits == 1 && dec.n_splits >= 64 && dec.block_m == 64,
           "selftest: plans: 16K prefill %d-row blocks, %d split(s); 64K decode %d splits of %d tiles", big.block_m,
           big.n_splits, dec.n_splits, dec.tiles_per_split);
}

void selftest_emulation(void) {
    const int cases[][7] = {
        /* T, p0, H, Hk, D, sm, forced splits */
        {1, 0, 9, 3, 64, 132, 0},   {1, 700, 9, 3, 64, 132, 0}, {37, 0, 9, 3, 64, 132, 0}, {50, 130, 9, 3, 64, 132, 0},
        {20, 300, 9, 3, 64, 132, 4}, {90, 5, 8, 2, 128, 132, 0}, {200, 0, 8, 8, 64, 3, 0},  {70, 64, 8, 1, 64, 132, 3},
        {200, 0, 9, 3, 64, 132, 4},  /* splits in which some rows see no key yet: the -inf guard */
    };
    for (auto &c : cases) {
        const int T = c[0], p0 = c[1], H = c[2], Hk = c[3], D = c[4], L = p0 + T;
        const std::vector<uint16_t> q = rand_bf16((size_t)T * H * D, 2.0), k = rand_bf16((size_t)L * Hk * D, 1.0),
                                    v = rand_bf16((size_t)L * Hk * D, 1.0);
        const std::vector<double> ref = ref_attention(q, k, v, T, p0, H, Hk, D);
        const std::vector<double> emu = emulate_attention(q, k, v, T, p0, H, Hk, D, c[5], c[6]);
        const stc_attn::plan p = stc_attn::make_plan(T, p0, H, Hk, D, c[5], c[6]);
        char name[160];
        snprintf(name, sizeof name, "selftest: emulated kernel T=%d p0=%d H=%d Hk=%d D=%d (rows/block %d, splits %d) vs reference",
                 T, p0, H, Hk, D, p.block_m, p.n_splits);
        check_rel(name, emu, ref, 1e-2);
    }
}
