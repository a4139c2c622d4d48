/* bAbI qa1-qa5 (Weston et al. 2015) as a small world simulation, for
 * BABILong-style long-context evaluation: the facts of a story are later
 * scattered into long distractor text by the caller.
 *
 * People move between places, pick up, drop and give objects; every action
 * is checked against the world state (a pick-up happens where the object is,
 * a give between two people in the same place), so a story never contradicts
 * itself. The simulation records events; the question is chosen among those
 * whose answer the facts determine, and the sentences are rendered at the end.
 *
 *   qa1  "Where is Mary?"                       her last move
 *   qa2  "Where is the football?"               holder's place, or where it was dropped
 *   qa3  "Where was the football before the kitchen?"
 *                                               the object's place before it arrived
 *                                               there (asked only for a place it
 *                                               visited exactly once)
 *   qa4  "What is north of the garden?" / "What is the garden south of?"
 *                                               static map facts on a grid; the asked
 *                                               relation is stated once, and no other
 *                                               place lies further along that direction
 *   qa5  "Who gave the apple to Bill?" etc.     the last transfer that matches
 *
 * A random simulation is tried a few times; if none of the attempts allows a
 * question (short stories, or long qa3 stories where every place repeats), a
 * last attempt reserves one or two people and an object for a minimal core
 * (e.g. move, pick up, move) placed at random positions among random facts
 * about everyone else, which always allows one. Everything is drawn from a
 * splitmix64 stream seeded by (seed, task, n_facts). */
#include "eval/eval.h"
#include "common/common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BABI_MAX_FACTS 100000
#define BABI_ATTEMPTS 8

static const char *const PEOPLE[] = {"Mary", "John", "Daniel", "Sandra", "Fred", "Bill", "Jeff", "Julie"};
static const char *const PLACES[] = {"kitchen", "garden", "office", "hallway", "bedroom", "bathroom"};
static const char *const OBJECTS[] = {"football", "apple", "milk", "book", "key"};
static const char *const MOVE_VERBS[] = {"went", "journeyed", "travelled", "moved"};
static const char *const PICK_VERBS[] = {"picked up", "got", "grabbed"};
static const char *const DROP_VERBS[] = {"dropped", "put down", "discarded"};
static const char *const GIVE_VERBS[] = {"gave", "handed", "passed"};
static const char *const DIRS[] = {"north", "east", "south", "west"}; /* opposite: (d + 2) & 3 */
static const int DIR_DX[] = {0, 1, 0, -1};
static const int DIR_DY[] = {1, 0, -1, 0};

#define NELEM(a) ((int)(sizeof(a) / sizeof((a)[0])))
enum { NP_ALL = NELEM(PEOPLE), NL_ALL = NELEM(PLACES), NO_ALL = NELEM(OBJECTS) };

/* ---- PRNG ------------------------------------------------------------------ */

typedef struct { uint64_t s; } babi_rng;

static uint64_t rng_next(babi_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int rng_below(babi_rng *r, int n) { /* uniform in [0, n), n >= 1 */
    return (int)(((rng_next(r) >> 32) * (uint64_t)n) >> 32);
}
static double rng_unit(babi_rng *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; }

static void shuffle(babi_rng *r, int *a, int n) {
    for (int i = n - 1; i > 0; i--) {
        int j = rng_below(r, i + 1), t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* ---- events and world state ---------------------------------------------- */

enum { EV_MOVE, EV_PICK, EV_DROP, EV_GIVE, EV_MAP };
/* a, b, c are vocabulary indices: MOVE person,-,place; PICK/DROP person,object,-;
 * GIVE giver,object,receiver; MAP place,direction,place ("a is b of c"). */
typedef struct { int kind, verb, a, b, c; } babi_ev;

typedef struct { int loc, s0, s1; } hist_ent; /* place + the facts that establish it */

typedef struct {
    int np, no;                       /* people and objects in play */
    int pname[NP_ALL], oname[NO_ALL]; /* slot -> vocabulary index */
    int ploc[NP_ALL], pmove[NP_ALL], pres[NP_ALL];
    int holder[NO_ALL], lie[NO_ALL], acq[NO_ALL], dsup[NO_ALL][2], ores[NO_ALL];
    hist_ent *hist[NO_ALL];           /* places the object has been, in order */
    int nhist[NO_ALL];
    int (*tr)[4];                     /* transfers: giver slot, object slot, receiver slot, fact */
    int ntr;
    babi_ev *ev;
    int nev;
} world;

typedef struct {
    char text[160];
    const char *answer;
    int sup[4], nsup;
} babi_q;

static void w_reset(world *w) {
    for (int p = 0; p < NP_ALL; p++) w->ploc[p] = w->pmove[p] = -1, w->pres[p] = 0;
    for (int o = 0; o < NO_ALL; o++) {
        w->holder[o] = w->lie[o] = w->acq[o] = -1;
        w->dsup[o][0] = w->dsup[o][1] = -1;
        w->ores[o] = 0;
        w->nhist[o] = 0;
    }
    w->ntr = 0;
    w->nev = 0;
}

static int w_push(world *w, int kind, int verb, int a, int b, int c) {
    babi_ev *e = &w->ev[w->nev];
    e->kind = kind, e->verb = verb, e->a = a, e->b = b, e->c = c;
    return w->nev++;
}

static void hist_add(world *w, int o, int loc, int s0, int s1) {
    hist_ent *h = &w->hist[o][w->nhist[o]++];
    h->loc = loc, h->s0 = s0, h->s1 = s1;
}

static void do_move(world *w, int p, int loc, int verb) {
    int i = w_push(w, EV_MOVE, verb, w->pname[p], -1, loc);
    w->ploc[p] = loc;
    w->pmove[p] = i;
    for (int o = 0; o < w->no; o++)
        if (w->holder[o] == p) hist_add(w, o, loc, w->acq[o], i);
}

static void do_pick(world *w, int p, int o, int verb) {
    int i = w_push(w, EV_PICK, verb, w->pname[p], w->oname[o], -1);
    if (w->lie[o] < 0) hist_add(w, o, w->ploc[p], w->pmove[p], i); /* first placed here */
    w->holder[o] = p;
    w->lie[o] = -1;
    w->acq[o] = i;
}

static void do_drop(world *w, int p, int o, int verb) {
    int i = w_push(w, EV_DROP, verb, w->pname[p], w->oname[o], -1);
    w->lie[o] = w->ploc[p];
    w->dsup[o][0] = i;
    w->dsup[o][1] = w->pmove[p];
    w->holder[o] = -1;
}

static void do_give(world *w, int g, int o, int r, int verb) {
    int i = w_push(w, EV_GIVE, verb, w->pname[g], w->oname[o], w->pname[r]);
    w->holder[o] = r;
    w->acq[o] = i;
    int *t = w->tr[w->ntr++];
    t[0] = g, t[1] = o, t[2] = r, t[3] = i;
}

static int random_place_except(babi_rng *r, int except) {
    if (except < 0) return rng_below(r, NL_ALL);
    int l = rng_below(r, NL_ALL - 1);
    return l >= except ? l + 1 : l;
}

/* One random action by the unreserved people on the unreserved objects.
 * wt: relative weights of move, pick up, drop, give (among the feasible
 * ones; a move is always feasible). coloc: probability that a move goes to
 * where another person is (makes gives possible). */
static void random_step(world *w, babi_rng *r, const double wt[4], double coloc) {
    int picks[NP_ALL * NO_ALL][2], drops[NO_ALL][2], gives[NO_ALL * NP_ALL][3];
    int npick = 0, ndrop = 0, ngive = 0;
    for (int o = 0; o < w->no; o++) {
        if (w->ores[o]) continue;
        int h = w->holder[o];
        if (h < 0) {
            for (int p = 0; p < w->np; p++)
                if (!w->pres[p] && w->ploc[p] >= 0 && (w->lie[o] < 0 || w->lie[o] == w->ploc[p]))
                    picks[npick][0] = p, picks[npick][1] = o, npick++;
        } else if (!w->pres[h]) {
            drops[ndrop][0] = h, drops[ndrop][1] = o, ndrop++;
            for (int q = 0; q < w->np; q++)
                if (q != h && !w->pres[q] && w->ploc[q] == w->ploc[h])
                    gives[ngive][0] = h, gives[ngive][1] = o, gives[ngive][2] = q, ngive++;
        }
    }
    double tot = wt[0] + (npick ? wt[1] : 0) + (ndrop ? wt[2] : 0) + (ngive ? wt[3] : 0);
    double x = rng_unit(r) * tot;
    if (npick && wt[1] > 0 && (x -= wt[1]) < 0) {
        int k = rng_below(r, npick);
        do_pick(w, picks[k][0], picks[k][1], rng_below(r, NELEM(PICK_VERBS)));
        return;
    }
    if (ndrop && wt[2] > 0 && (x -= wt[2]) < 0) {
        int k = rng_below(r, ndrop);
        do_drop(w, drops[k][0], drops[k][1], rng_below(r, NELEM(DROP_VERBS)));
        return;
    }
    if (ngive && wt[3] > 0 && (x -= wt[3]) < 0) {
        int k = rng_below(r, ngive);
        do_give(w, gives[k][0], gives[k][1], gives[k][2], rng_below(r, NELEM(GIVE_VERBS)));
        return;
    }
    int free_p[NP_ALL], nfree = 0;
    for (int p = 0; p < w->np; p++)
        if (!w->pres[p]) free_p[nfree++] = p;
    int p = free_p[rng_below(r, nfree)], loc = -1;
    if (coloc > 0 && rng_unit(r) < coloc) {
        int cand[NP_ALL], nc = 0;
        for (int q = 0; q < w->np; q++)
            if (q != p && !w->pres[q] && w->ploc[q] >= 0 && w->ploc[q] != w->ploc[p]) cand[nc++] = w->ploc[q];
        if (nc) loc = cand[rng_below(r, nc)];
    }
    if (loc < 0) loc = random_place_except(r, w->ploc[p]);
    do_move(w, p, loc, rng_below(r, NELEM(MOVE_VERBS)));
}

/* ---- questions ------------------------------------------------------------- */

static void sort_sup(babi_q *q) { /* sort and drop duplicates and -1 */
    int n = 0;
    for (int i = 0; i < q->nsup; i++) {
        int v = q->sup[i];
        if (v < 0) continue;
        int j = n;
        while (j > 0 && q->sup[j - 1] > v) j--;
        if (j > 0 && q->sup[j - 1] == v) continue;
        memmove(&q->sup[j + 1], &q->sup[j], sizeof(int) * (size_t)(n - j));
        q->sup[j] = v;
        n++;
    }
    q->nsup = n;
}

static int ask_qa1(const world *w, babi_rng *r, babi_q *q) {
    int cand[NP_ALL], nc = 0;
    for (int p = 0; p < w->np; p++)
        if (w->ploc[p] >= 0) cand[nc++] = p;
    if (!nc) return 0;
    int p = cand[rng_below(r, nc)];
    snprintf(q->text, sizeof q->text, "Where is %s?", PEOPLE[w->pname[p]]);
    q->answer = PLACES[w->ploc[p]];
    q->sup[0] = w->pmove[p];
    q->nsup = 1;
    return 1;
}

static int ask_qa2(const world *w, babi_rng *r, babi_q *q) {
    int cand[NO_ALL], nc = 0;
    for (int o = 0; o < w->no; o++)
        if (w->holder[o] >= 0 || w->lie[o] >= 0) cand[nc++] = o;
    if (!nc) return 0;
    int o = cand[rng_below(r, nc)], h = w->holder[o];
    snprintf(q->text, sizeof q->text, "Where is the %s?", OBJECTS[w->oname[o]]);
    if (h >= 0) {
        q->answer = PLACES[w->ploc[h]];
        q->sup[0] = w->acq[o], q->sup[1] = w->pmove[h];
    } else {
        q->answer = PLACES[w->lie[o]];
        q->sup[0] = w->dsup[o][0], q->sup[1] = w->dsup[o][1];
    }
    q->nsup = 2;
    sort_sup(q);
    return 1;
}

static int qa3_ok(const world *w, int o, int k) {
    if (k < 1) return 0;
    for (int j = 0; j < w->nhist[o]; j++)
        if (j != k && w->hist[o][j].loc == w->hist[o][k].loc) return 0;
    return 1;
}

static int ask_qa3(const world *w, babi_rng *r, babi_q *q) {
    int nc = 0;
    for (int o = 0; o < w->no; o++)
        for (int k = 1; k < w->nhist[o]; k++) nc += qa3_ok(w, o, k);
    if (!nc) return 0;
    int pick = rng_below(r, nc);
    for (int o = 0; o < w->no; o++)
        for (int k = 1; k < w->nhist[o]; k++) {
            if (!qa3_ok(w, o, k) || pick-- > 0) continue;
            const hist_ent *a = &w->hist[o][k - 1], *b = &w->hist[o][k];
            snprintf(q->text, sizeof q->text, "Where was the %s before the %s?", OBJECTS[w->oname[o]], PLACES[b->loc]);
            q->answer = PLACES[a->loc];
            q->sup[0] = a->s0, q->sup[1] = a->s1, q->sup[2] = b->s0, q->sup[3] = b->s1;
            q->nsup = 4;
            sort_sup(q);
            return 1;
        }
    return 0; /* not reached */
}

static int ask_qa5(const world *w, babi_rng *r, babi_q *q) {
    if (!w->ntr) return 0;
    const int *t = w->tr[rng_below(r, w->ntr)];
    int type = rng_below(r, 5), last = -1;
    /* which of giver/object/receiver the question names */
    int use_g = type == 2 || type == 3, use_o = type != 2, use_r = type == 0 || type == 2;
    for (int i = 0; i < w->ntr; i++) {
        const int *u = w->tr[i];
        if ((!use_g || u[0] == t[0]) && (!use_o || u[1] == t[1]) && (!use_r || u[2] == t[2])) last = i;
    }
    const int *u = w->tr[last];
    const char *g = PEOPLE[w->pname[t[0]]], *o = OBJECTS[w->oname[t[1]]], *rc = PEOPLE[w->pname[t[2]]];
    switch (type) {
    case 0:
        snprintf(q->text, sizeof q->text, "Who gave the %s to %s?", o, rc);
        q->answer = PEOPLE[w->pname[u[0]]];
        break;
    case 1:
        snprintf(q->text, sizeof q->text, "Who received the %s?", o);
        q->answer = PEOPLE[w->pname[u[2]]];
        break;
    case 2:
        snprintf(q->text, sizeof q->text, "What did %s give to %s?", g, rc);
        q->answer = OBJECTS[w->oname[u[1]]];
        break;
    case 3:
        snprintf(q->text, sizeof q->text, "Who did %s give the %s to?", g, o);
        q->answer = PEOPLE[w->pname[u[2]]];
        break;
    default:
        snprintf(q->text, sizeof q->text, "Who gave the %s?", o);
        q->answer = PEOPLE[w->pname[u[0]]];
        break;
    }
    q->sup[0] = u[3];
    q->nsup = 1;
    return 1;
}

/* ---- world tasks (qa1, qa2, qa3, qa5) ------------------------------------ */

static void choose_subset(babi_rng *r, int *out, int k, int n) {
    int all[16];
    for (int i = 0; i < n; i++) all[i] = i;
    shuffle(r, all, n);
    memcpy(out, all, sizeof(int) * (size_t)k);
}

static void gen_world(int task, int n, babi_rng *r, world *w, babi_q *q) {
    static const double WT[6][4] = {
        {0}, {1, 0, 0, 0}, {0.55, 0.25, 0.20, 0}, {0.60, 0.25, 0.15, 0}, {0}, {0.35, 0.20, 0.05, 0.40},
    };
    const double coloc = task == 5 ? 0.5 : 0.0;
    int np = 4 + n / 25, no = task == 1 ? 0 : 3 + n / 20;
    w->np = np < NP_ALL ? np : NP_ALL;
    w->no = no < NO_ALL ? no : NO_ALL;
    choose_subset(r, w->pname, w->np, NP_ALL);
    choose_subset(r, w->oname, w->no, NO_ALL);

    for (int attempt = 0; attempt <= BABI_ATTEMPTS; attempt++) {
        int fallback = attempt == BABI_ATTEMPTS && task != 1;
        int ncore = 0, pos[4] = {0}, P = -1, R = -1, X = -1, A = -1;
        w_reset(w);
        if (fallback) { /* reserve the core's people and object */
            ncore = task == 2 ? 2 : task == 3 ? 3 : 4;
            P = rng_below(r, w->np);
            X = rng_below(r, w->no);
            w->pres[P] = 1;
            w->ores[X] = 1;
            if (task == 5) {
                R = rng_below(r, w->np - 1);
                if (R >= P) R++;
                w->pres[R] = 1;
            }
            A = rng_below(r, NL_ALL);
            for (int k = 0; k < ncore;) { /* distinct positions, sorted */
                int v = rng_below(r, n), j = k;
                for (int i = 0; i < k; i++) if (pos[i] == v) j = -1;
                if (j < 0) continue;
                while (j > 0 && pos[j - 1] > v) pos[j] = pos[j - 1], j--;
                pos[j] = v;
                k++;
            }
        }
        for (int i = 0, c = 0; i < n; i++) {
            if (c < ncore && pos[c] == i) {
                switch (c++) {
                case 0: do_move(w, P, A, rng_below(r, NELEM(MOVE_VERBS))); break;
                case 1:
                    if (task == 5) do_move(w, R, A, rng_below(r, NELEM(MOVE_VERBS)));
                    else do_pick(w, P, X, rng_below(r, NELEM(PICK_VERBS)));
                    break;
                case 2:
                    if (task == 5) do_pick(w, P, X, rng_below(r, NELEM(PICK_VERBS)));
                    else do_move(w, P, random_place_except(r, A), rng_below(r, NELEM(MOVE_VERBS)));
                    break;
                default: do_give(w, P, X, R, rng_below(r, NELEM(GIVE_VERBS))); break;
                }
            } else {
                random_step(w, r, WT[task], coloc);
            }
        }
        int ok = task == 1 ? ask_qa1(w, r, q) : task == 2 ? ask_qa2(w, r, q) : task == 3 ? ask_qa3(w, r, q) : ask_qa5(w, r, q);
        if (ok) return;
    }
}

/* ---- qa4: map on a grid ---------------------------------------------------- */

static void gen_map(int n, babi_rng *r, world *w, babi_q *q) {
    int k = n + 1 < 3 ? 3 : n + 1 > NL_ALL ? NL_ALL : n + 1;
    int cx[NL_ALL], cy[NL_ALL], place[NL_ALL], cnt = 1;
    cx[0] = cy[0] = 0;
    while (cnt < k) { /* grow a random polyomino */
        int i = rng_below(r, cnt), d = rng_below(r, 4), x = cx[i] + DIR_DX[d], y = cy[i] + DIR_DY[d], taken = 0;
        for (int j = 0; j < cnt; j++) taken |= cx[j] == x && cy[j] == y;
        if (!taken) cx[cnt] = x, cy[cnt] = y, cnt++;
    }
    for (int i = 0; i < NL_ALL; i++) place[i] = i;
    shuffle(r, place, NL_ALL);
    int edges[2 * NL_ALL][3], ne = 0; /* cell a is dir (north or east) of cell b */
    for (int a = 0; a < k; a++)
        for (int b = 0; b < k; b++)
            for (int d = 0; d < 2; d++)
                if (cx[a] == cx[b] + DIR_DX[d] && cy[a] == cy[b] + DIR_DY[d])
                    edges[ne][0] = a, edges[ne][1] = d, edges[ne][2] = b, ne++;
    /* candidate questions: (edge, orientation) with no other cell further along the ray */
    int cand[4 * NL_ALL][2] = {{0}}, nc = 0;
    for (int e = 0; e < ne; e++)
        for (int o = 0; o < 2; o++) {
            int x = o ? edges[e][2] : edges[e][0], y = o ? edges[e][0] : edges[e][2];
            int d = o ? (edges[e][1] + 2) & 3 : edges[e][1], clear = 1;
            for (int c = 0; c < k; c++) {
                if (DIR_DX[d] && cy[c] == cy[y] && (cx[c] - cx[x]) * DIR_DX[d] > 0) clear = 0;
                if (DIR_DY[d] && cx[c] == cx[y] && (cy[c] - cy[x]) * DIR_DY[d] > 0) clear = 0;
            }
            if (clear) cand[nc][0] = e, cand[nc][1] = o, nc++;
        }
    /* nc >= 1: the cell with the largest x, and among those the largest y,
     * has a neighbour to its west or south, and the ray from that neighbour
     * through it is clear. */
    int pick = rng_below(r, nc), qe = cand[pick][0], qo = cand[pick][1];
    int others[2 * NL_ALL], no = 0;
    for (int e = 0; e < ne; e++)
        if (e != qe) others[no++] = e;
    shuffle(r, others, no);
    int qpos = rng_below(r, n);
    for (int i = 0, used = 0; i < n; i++) {
        int e;
        if (i == qpos) e = qe;
        else if (used < no) e = others[used++];
        else e = others[rng_below(r, no)];
        int flip = rng_below(r, 2), a = edges[e][0], d = edges[e][1], b = edges[e][2];
        if (flip) w_push(w, EV_MAP, 0, place[b], (d + 2) & 3, place[a]);
        else w_push(w, EV_MAP, 0, place[a], d, place[b]);
    }
    int x = qo ? edges[qe][2] : edges[qe][0], y = qo ? edges[qe][0] : edges[qe][2];
    int d = qo ? (edges[qe][1] + 2) & 3 : edges[qe][1];
    if (rng_below(r, 2))
        snprintf(q->text, sizeof q->text, "What is %s of the %s?", DIRS[d], PLACES[place[y]]);
    else
        snprintf(q->text, sizeof q->text, "What is the %s %s of?", PLACES[place[y]], DIRS[(d + 2) & 3]);
    q->answer = PLACES[place[x]];
    q->sup[0] = qpos;
    q->nsup = 1;
}

/* ---- rendering ------------------------------------------------------------- */

static char *xprintf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *xprintf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (len < 0) return NULL;
    char *s = malloc((size_t)len + 1);
    if (!s) return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)len + 1, fmt, ap);
    va_end(ap);
    return s;
}

static char *render(const babi_ev *e) {
    switch (e->kind) {
    case EV_MOVE: return xprintf("%s %s to the %s.", PEOPLE[e->a], MOVE_VERBS[e->verb], PLACES[e->c]);
    case EV_PICK: return xprintf("%s %s the %s.", PEOPLE[e->a], PICK_VERBS[e->verb], OBJECTS[e->b]);
    case EV_DROP: return xprintf("%s %s the %s.", PEOPLE[e->a], DROP_VERBS[e->verb], OBJECTS[e->b]);
    case EV_GIVE:
        return xprintf("%s %s the %s to %s.", PEOPLE[e->a], GIVE_VERBS[e->verb], OBJECTS[e->b], PEOPLE[e->c]);
    default: return xprintf("The %s is %s of the %s.", PLACES[e->a], DIRS[e->b], PLACES[e->c]);
    }
}

/* ---- API ------------------------------------------------------------------- */

void babi_story_free(babi_story *s) {
    if (!s) return;
    if (s->facts)
        for (int i = 0; i < s->n_facts; i++) free(s->facts[i]);
    free(s->facts);
    free(s->supporting);
    free(s->question);
    free(s->answer);
    memset(s, 0, sizeof *s);
}

int babi_generate(int task, uint64_t seed, int n_facts_hint, babi_story *out, still_err *err) {
    static const int MIN_FACTS[6] = {0, 2, 3, 6, 2, 4};
    if (!out) return still_fail(err, STILL_E_ARG, "babi: no output story");
    memset(out, 0, sizeof *out);
    if (task < 1 || task > 5) return still_fail(err, STILL_E_ARG, "babi: task %d out of range 1..5", task);
    if (n_facts_hint < 0 || n_facts_hint > BABI_MAX_FACTS)
        return still_fail(err, STILL_E_ARG, "babi: n_facts %d out of range 0..%d", n_facts_hint, BABI_MAX_FACTS);
    int n = n_facts_hint < MIN_FACTS[task] ? MIN_FACTS[task] : n_facts_hint;

    babi_rng r = {seed};
    r.s = rng_next(&r) ^ (uint64_t)task * 0xD1B54A32D192ED03ull ^ (uint64_t)n * 0x8CB92BA72F3D8DD7ull;
    rng_next(&r);

    world w;
    memset(&w, 0, sizeof w);
    w_reset(&w);
    int nh = task == 1 || task == 4 ? 0 : NO_ALL;
    w.ev = malloc(sizeof *w.ev * (size_t)n);
    w.tr = malloc(sizeof *w.tr * (size_t)n);
    hist_ent *hist = nh ? malloc(sizeof *hist * (size_t)n * (size_t)nh) : NULL;
    if (!w.ev || !w.tr || (nh && !hist)) {
        free(w.ev), free(w.tr), free(hist);
        return still_fail(err, STILL_E_NOMEM, "babi: out of memory (%d facts)", n);
    }
    for (int o = 0; o < nh; o++) w.hist[o] = hist + (size_t)o * (size_t)n;

    babi_q q;
    memset(&q, 0, sizeof q);
    if (task == 4) gen_map(n, &r, &w, &q);
    else gen_world(task, n, &r, &w, &q);

    int rc = STILL_OK;
    out->facts = calloc((size_t)w.nev, sizeof *out->facts);
    out->supporting = malloc(sizeof *out->supporting * (size_t)(q.nsup ? q.nsup : 1));
    out->question = xprintf("%s", q.text);
    out->answer = q.answer ? xprintf("%s", q.answer) : NULL;
    if (out->facts) out->n_facts = w.nev; /* so that babi_story_free frees what was rendered */
    if (!out->facts || !out->supporting || !out->question || !out->answer) rc = STILL_E_NOMEM;
    else {
        for (int i = 0; i < w.nev && rc == STILL_OK; i++)
            if (!(out->facts[i] = render(&w.ev[i]))) rc = STILL_E_NOMEM;
        memcpy(out->supporting, q.sup, sizeof(int) * (size_t)q.nsup);
        out->n_supporting = q.nsup;
    }
    free(w.ev), free(w.tr), free(hist);
    if (rc) {
        babi_story_free(out);
        return still_fail(err, rc, "babi: out of memory (%d facts)", n);
    }
    return STILL_OK;
}
