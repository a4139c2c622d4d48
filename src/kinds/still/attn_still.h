/* The still kind's diagnosis interface (still probe): where given tokens of
 * a whole sequence went and how much of the attention given queries pay to
 * them, through the softmax part and through the linear state. */
#ifndef STILL_ATTN_STILL_H
#define STILL_ATTN_STILL_H

#include "kinds/attn.h"

enum { ROUTE_LOCAL = 0, ROUTE_SEL = 1, ROUTE_FOLDED = 2, ROUTE_DROPPED = 3 };

typedef struct {
    int n_q, n_k, H, Hs, C;
    /* per selection head and key, as seen from the first query */
    signed char *route;   /* [Hs][n_k]: ROUTE_* */
    int *rank;            /* [Hs][n_k]: the key's self-saliency rank in its chunk (1 = the highest; 0: its chunk
                           * has not left Local, or the routing is not saliency) */
    double *score;        /* [Hs][n_k]: its saliency score (summed over the G heads per KV head) */
    /* per query head and query: shares of the output's denominator */
    double *w_soft;       /* [H][n_q]: the keys' softmax weights Σ e_j / den (j in Local ∪ Sel) */
    double *w_lin;        /* [H][n_q]: the keys' linear weights Σ φq·φk_j / den (j folded) */
    double *w_local, *w_sel, *w_fold;   /* [H][n_q]: all Local keys', all Sel keys', the whole linear state's */
    double *w_exact;      /* [H][n_q]: the share the tokens outside Local ∪ Sel would have with exact softmax
                           * weights, Σ e^{s_j - m} / (that + the softmax part's): what w_fold estimates */
} still_explain;

/* A still layer's routing sizes after checking its configuration: λ (tokens kept per leaving chunk), capped
 * (a budget is set) and cap (Sel's capacity per selection head), as the layer's forward uses them. */
int attn_still_routing(const attn_config *c, int *lam, int *capped, int *cap, still_err *err);
/* A still layer's gate: W_g [H*D][d_model] and b_g [H*D] inside its parameters; 0 (and NULLs) when the
 * configuration has no gate on a linear branch. */
int attn_still_gate(const attn_config *c, const float *params, const float **Wg, const float **bg);

/* The selection the forward makes over a whole sequence io (p0 = 0), as the backwards and the diagnosis use it:
 * one float forward on a fresh state (its output into y [T][H*D]) with a recorder. rec [Hs][T] (zeroed by the
 * caller) gets 1 for every token in Sel at the end; sel_pos [Hs][T]: the first n_selpos[hs] entries of row hs are
 * those positions in order; *max_sel the largest count. allow_evict 0: a global selection's eviction is an error
 * (a selection fixed for every query). Used by the backwards (here) and the float64 reference backward
 * (tests/ref/attn_still_ref.c). */
int attn_still_record_selection(const attn_config *c, const float *params, const attn_io *io, float *y,
                                unsigned char *rec, int *sel_pos, int *n_selpos, int *max_sel, int allow_evict,
                                still_err *err);

/* For a whole sequence io (p0 = 0) of a still layer: the queries qs[n_q] and
 * the keys ks[n_k] (positions, ks all before the first query's chunk or in
 * it). The selection is the forward's own (recorded from one forward). */
int attn_still_explain(const attn_config *c, const float *params, const attn_io *io, const int *qs, int n_q,
                       const int *ks, int n_k, still_explain *out, still_err *err);
void still_explain_free(still_explain *e);

#endif
