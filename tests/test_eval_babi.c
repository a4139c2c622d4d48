/* bAbI generator tests. Every story is checked by an independent solver that
 * parses the fact sentences back ("Mary went to the kitchen.", "Fred gave the
 * apple to Bill.", "The office is west of the hallway.", ...), replays the
 * world while checking that no action is impossible (a pick-up where the
 * object is not, a give to someone elsewhere, a contradictory map), answers
 * the question from the replayed state and derives the supporting facts; the
 * generator's answer and supporting facts must match exactly. Plus:
 * determinism, variety across seeds, the sentence format, and errors. */
#include "eval/eval.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* ---- sentence parsing ------------------------------------------------------ */

enum { MAXW = 12, WLEN = 32, MAXN = 16 };

/* Split s (which must end with `end`) into words; returns the count, -1 if malformed. */
static int split(const char *s, char end, char w[MAXW][WLEN]) {
    size_t len = strlen(s);
    if (len < 2 || s[len - 1] != end) return -1;
    int n = 0;
    for (size_t i = 0; i < len - 1;) { /* words of letters, separated by single spaces */
        size_t j = i;
        while (j < len - 1 && isalpha((unsigned char)s[j])) j++;
        if (j == i || j - i >= WLEN || n == MAXW) return -1;
        memcpy(w[n], s + i, j - i);
        w[n++][j - i] = 0;
        if (j == len - 1) break;
        if (s[j] != ' ' || j + 1 == len - 1) return -1;
        i = j + 1;
    }
    return n;
}

typedef struct { char name[MAXN][WLEN]; int n; } table;

static int intern(table *t, const char *w) {
    for (int i = 0; i < t->n; i++)
        if (!strcmp(t->name[i], w)) return i;
    if (t->n == MAXN) return -1;
    snprintf(t->name[t->n], WLEN, "%s", w);
    return t->n++;
}

static int is_name(const char *w) { /* a person: capitalised */
    if (!isupper((unsigned char)w[0])) return 0;
    for (const char *p = w + 1; *p; p++)
        if (!islower((unsigned char)*p)) return 0;
    return 1;
}
static int is_lower(const char *w) {
    for (const char *p = w; *p; p++)
        if (!islower((unsigned char)*p)) return 0;
    return *w != 0;
}
static int one_of(const char *w, const char *const *list) {
    for (; *list; list++)
        if (!strcmp(w, *list)) return 1;
    return 0;
}

enum { F_MOVE, F_PICK, F_DROP, F_GIVE, F_MAP };
typedef struct { int kind, p, q, o, l1, dir, l2; } fact;

static const char *const DIRW[] = {"north", "east", "south", "west", NULL};
static const int DX[] = {0, 1, 0, -1}, DY[] = {1, 0, -1, 0};
static int dir_of(const char *w) {
    for (int d = 0; d < 4; d++)
        if (!strcmp(w, DIRW[d])) return d;
    return -1;
}

typedef struct { table people, places, objects; } vocab;

/* Returns 0 and fills f, or -1 when the sentence matches no known form. */
static int parse_fact(const char *s, vocab *v, fact *f) {
    static const char *const MOVE[] = {"went", "journeyed", "travelled", "moved", NULL};
    static const char *const PICK1[] = {"got", "grabbed", NULL};
    static const char *const DROP1[] = {"dropped", "discarded", NULL};
    static const char *const GIVE[] = {"gave", "handed", "passed", NULL};
    char w[MAXW][WLEN];
    int n = split(s, '.', w);
    memset(f, -1, sizeof *f);
    if (n == 7 && !strcmp(w[0], "The") && !strcmp(w[2], "is") && !strcmp(w[4], "of") && !strcmp(w[5], "the") &&
        is_lower(w[1]) && is_lower(w[6]) && dir_of(w[3]) >= 0) {
        f->kind = F_MAP, f->l1 = intern(&v->places, w[1]), f->dir = dir_of(w[3]), f->l2 = intern(&v->places, w[6]);
        return f->l1 < 0 || f->l2 < 0 ? -1 : 0;
    }
    if (n < 3 || !is_name(w[0]) || !strcmp(w[0], "The")) return -1;
    f->p = intern(&v->people, w[0]);
    const char *obj = NULL;
    if (n == 5 && one_of(w[1], MOVE) && !strcmp(w[2], "to") && !strcmp(w[3], "the") && is_lower(w[4])) {
        f->kind = F_MOVE, f->l1 = intern(&v->places, w[4]);
        return f->p < 0 || f->l1 < 0 ? -1 : 0;
    } else if (n == 5 && !strcmp(w[1], "picked") && !strcmp(w[2], "up") && !strcmp(w[3], "the")) {
        f->kind = F_PICK, obj = w[4];
    } else if (n == 4 && one_of(w[1], PICK1) && !strcmp(w[2], "the")) {
        f->kind = F_PICK, obj = w[3];
    } else if (n == 4 && one_of(w[1], DROP1) && !strcmp(w[2], "the")) {
        f->kind = F_DROP, obj = w[3];
    } else if (n == 5 && !strcmp(w[1], "put") && !strcmp(w[2], "down") && !strcmp(w[3], "the")) {
        f->kind = F_DROP, obj = w[4];
    } else if (n == 6 && one_of(w[1], GIVE) && !strcmp(w[2], "the") && !strcmp(w[4], "to") && is_name(w[5])) {
        f->kind = F_GIVE, obj = w[3], f->q = intern(&v->people, w[5]);
        if (f->q < 0) return -1;
    } else {
        return -1;
    }
    if (!is_lower(obj)) return -1;
    f->o = intern(&v->objects, obj);
    return f->p < 0 || f->o < 0 ? -1 : 0;
}

/* ---- the solver ------------------------------------------------------------- */

typedef struct {
    int ok;            /* story consistent and question understood */
    char why[200];
    char answer[WLEN];
    int sup[8], nsup;
} verdict;

static void add_sup(verdict *v, int i) {
    for (int k = 0; k < v->nsup; k++)
        if (v->sup[k] == i) return;
    if (v->nsup < 8) v->sup[v->nsup++] = i;
}
static void sort_ints(int *a, int n) {
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && a[j - 1] > a[j]; j--) {
            int t = a[j];
            a[j] = a[j - 1];
            a[j - 1] = t;
        }
}

#define BAD(...) do { v.ok = 0; snprintf(v.why, sizeof v.why, __VA_ARGS__); goto done; } while (0)

static verdict solve(int task, const babi_story *s) {
    verdict v;
    memset(&v, 0, sizeof v);
    v.ok = 1;
    vocab voc;
    memset(&voc, 0, sizeof voc);
    int n = s->n_facts;
    fact *f = calloc((size_t)n, sizeof *f);
    /* object location history: place + the fact at which it arrived + its cause */
    int *hloc = malloc(sizeof(int) * (size_t)n * MAXN), *hat = malloc(sizeof(int) * (size_t)n * MAXN),
        *hwhy = malloc(sizeof(int) * (size_t)n * MAXN), nh[MAXN] = {0};
    if (!f || !hloc || !hat || !hwhy) { printf("out of memory\n"); exit(1); }
    int ploc[MAXN], plast[MAXN], holder[MAXN], lie[MAXN], got[MAXN], dropf[MAXN], dropmove[MAXN];
    for (int i = 0; i < MAXN; i++)
        ploc[i] = plast[i] = holder[i] = lie[i] = got[i] = dropf[i] = dropmove[i] = -1;

    for (int i = 0; i < n; i++) {
        if (parse_fact(s->facts[i], &voc, &f[i])) BAD("unparsed fact %d: '%s'", i, s->facts[i]);
        fact *x = &f[i];
        int allowed = task == 1 ? x->kind == F_MOVE
                    : task == 4 ? x->kind == F_MAP
                    : task == 5 ? x->kind != F_MAP
                                : x->kind != F_MAP && x->kind != F_GIVE;
        if (!allowed) BAD("fact %d of an unexpected kind for qa%d: '%s'", i, task, s->facts[i]);
        if (x->kind == F_MAP) continue;
        int before[MAXN];
        for (int o = 0; o < MAXN; o++) before[o] = holder[o] >= 0 ? ploc[holder[o]] : lie[o];
        switch (x->kind) {
        case F_MOVE:
            if (ploc[x->p] == x->l1) BAD("fact %d: moves to where they already are", i);
            ploc[x->p] = x->l1, plast[x->p] = i;
            break;
        case F_PICK:
            if (ploc[x->p] < 0) BAD("fact %d: picks up while nowhere", i);
            if (holder[x->o] >= 0) BAD("fact %d: object already held", i);
            if (lie[x->o] >= 0 && lie[x->o] != ploc[x->p]) BAD("fact %d: object lies elsewhere", i);
            holder[x->o] = x->p, lie[x->o] = -1, got[x->o] = i;
            break;
        case F_DROP:
            if (holder[x->o] != x->p) BAD("fact %d: drops what they do not hold", i);
            holder[x->o] = -1, lie[x->o] = ploc[x->p], dropf[x->o] = i, dropmove[x->o] = plast[x->p];
            break;
        case F_GIVE:
            if (holder[x->o] != x->p) BAD("fact %d: gives what they do not hold", i);
            if (x->q == x->p) BAD("fact %d: gives to themselves", i);
            if (ploc[x->q] < 0 || ploc[x->q] != ploc[x->p]) BAD("fact %d: receiver is not there", i);
            holder[x->o] = x->q, got[x->o] = i;
            break;
        }
        /* record each object's arrival in a new place, with the fact explaining it */
        for (int o = 0; o < voc.objects.n; o++) {
            int now = holder[o] >= 0 ? ploc[holder[o]] : lie[o];
            if (now < 0 || now == before[o]) continue;
            if (before[o] >= 0 && x->kind != F_MOVE) BAD("fact %d: object changed place without a move", i);
            int k = o * n + nh[o]++;
            hloc[k] = now, hat[k] = i;
            hwhy[k] = x->kind == F_MOVE ? got[o] : plast[holder[o]]; /* carried there / picked up there */
        }
    }

    char w[MAXW][WLEN];
    int nw = split(s->question, '?', w);
    if (nw < 0) BAD("malformed question '%s'", s->question);
    if (task == 1) {
        if (nw != 3 || strcmp(w[0], "Where") || strcmp(w[1], "is") || !is_name(w[2])) BAD("qa1 question '%s'", s->question);
        int p = intern(&voc.people, w[2]);
        if (p < 0 || ploc[p] < 0) BAD("qa1: %s's place is unknown", w[2]);
        snprintf(v.answer, WLEN, "%s", voc.places.name[ploc[p]]);
        add_sup(&v, plast[p]);
    } else if (task == 2) {
        if (nw != 4 || strcmp(w[0], "Where") || strcmp(w[1], "is") || strcmp(w[2], "the")) BAD("qa2 question '%s'", s->question);
        int o = intern(&voc.objects, w[3]);
        if (o < 0) BAD("qa2: unknown object");
        if (holder[o] >= 0) {
            snprintf(v.answer, WLEN, "%s", voc.places.name[ploc[holder[o]]]);
            add_sup(&v, got[o]), add_sup(&v, plast[holder[o]]);
        } else if (lie[o] >= 0) {
            snprintf(v.answer, WLEN, "%s", voc.places.name[lie[o]]);
            add_sup(&v, dropf[o]), add_sup(&v, dropmove[o]);
        } else {
            BAD("qa2: the %s's place is unknown", w[3]);
        }
    } else if (task == 3) {
        if (nw != 7 || strcmp(w[0], "Where") || strcmp(w[1], "was") || strcmp(w[2], "the") || strcmp(w[4], "before") ||
            strcmp(w[5], "the"))
            BAD("qa3 question '%s'", s->question);
        int o = intern(&voc.objects, w[3]), l = intern(&voc.places, w[6]);
        if (o < 0 || l < 0) BAD("qa3: unknown words");
        int found = -1, times = 0;
        for (int k = 0; k < nh[o]; k++)
            if (hloc[o * n + k] == l) found = k, times++;
        if (times != 1) BAD("qa3: the %s was in the %s %d times", w[3], w[6], times);
        if (found < 1) BAD("qa3: the %s was nowhere known before the %s", w[3], w[6]);
        int a = o * n + found - 1, b = o * n + found;
        snprintf(v.answer, WLEN, "%s", voc.places.name[hloc[a]]);
        add_sup(&v, hat[a]), add_sup(&v, hwhy[a]), add_sup(&v, hat[b]), add_sup(&v, hwhy[b]);
    } else if (task == 4) {
        /* place every place on a grid from the map facts, one component at a time */
        int np = voc.places.n, cx[MAXN], cy[MAXN], comp[MAXN];
        for (int p = 0; p < np; p++) comp[p] = -1;
        for (int p0 = 0, nc = 0; p0 < np; p0++) {
            if (comp[p0] >= 0) continue;
            comp[p0] = nc, cx[p0] = cy[p0] = 0;
            for (int changed = 1; changed;) {
                changed = 0;
                for (int i = 0; i < n; i++) { /* l1 = l2 + unit(dir) */
                    int a = f[i].l1, b = f[i].l2, d = f[i].dir;
                    if (comp[a] == nc && comp[b] < 0) comp[b] = nc, cx[b] = cx[a] - DX[d], cy[b] = cy[a] - DY[d], changed = 1;
                    else if (comp[b] == nc && comp[a] < 0) comp[a] = nc, cx[a] = cx[b] + DX[d], cy[a] = cy[b] + DY[d], changed = 1;
                }
            }
            nc++;
        }
        for (int i = 0; i < n; i++) {
            int a = f[i].l1, b = f[i].l2, d = f[i].dir;
            if (a == b || comp[a] != comp[b] || cx[a] != cx[b] + DX[d] || cy[a] != cy[b] + DY[d])
                BAD("qa4: fact %d contradicts the map", i);
        }
        for (int a = 0; a < np; a++)
            for (int b = a + 1; b < np; b++)
                if (comp[a] == comp[b] && cx[a] == cx[b] && cy[a] == cy[b]) BAD("qa4: two places in one spot");
        int y, d;
        if (nw == 6 && !strcmp(w[0], "What") && !strcmp(w[1], "is") && dir_of(w[2]) >= 0 && !strcmp(w[3], "of") &&
            !strcmp(w[4], "the")) {
            d = dir_of(w[2]), y = intern(&voc.places, w[5]); /* answer = y + unit(d) */
        } else if (nw == 6 && !strcmp(w[0], "What") && !strcmp(w[1], "is") && !strcmp(w[2], "the") && dir_of(w[4]) >= 0 &&
                   !strcmp(w[5], "of")) {
            d = (dir_of(w[4]) + 2) & 3, y = intern(&voc.places, w[3]); /* y is D of x: x = y - unit(D) */
        } else {
            BAD("qa4 question '%s'", s->question);
        }
        if (y < 0) BAD("qa4: unknown place");
        int x = -1;
        for (int p = 0; p < np; p++)
            if (comp[p] == comp[y] && cx[p] == cx[y] + DX[d] && cy[p] == cy[y] + DY[d]) x = p;
        if (x < 0) BAD("qa4: nothing known %s of the %s", DIRW[d], voc.places.name[y]);
        for (int p = 0; p < np; p++) { /* nothing further in that direction on the same line */
            if (p == x || comp[p] != comp[y]) continue;
            int dx = cx[p] - cx[x], dy = cy[p] - cy[x];
            if ((DX[d] && cy[p] == cy[y] && dx * DX[d] > 0) || (DY[d] && cx[p] == cx[y] && dy * DY[d] > 0))
                BAD("qa4: ambiguous, the %s is also %s of the %s", voc.places.name[p], DIRW[d], voc.places.name[y]);
        }
        snprintf(v.answer, WLEN, "%s", voc.places.name[x]);
        for (int i = 0; i < n; i++)
            if ((f[i].l1 == x && f[i].l2 == y) || (f[i].l1 == y && f[i].l2 == x)) add_sup(&v, i);
    } else {
        int g = -1, o = -1, r = -1, want; /* want: 0 giver, 1 object, 2 receiver */
        if (nw == 6 && !strcmp(w[0], "Who") && !strcmp(w[1], "gave") && !strcmp(w[2], "the") && !strcmp(w[4], "to"))
            o = intern(&voc.objects, w[3]), r = intern(&voc.people, w[5]), want = 0;
        else if (nw == 4 && !strcmp(w[0], "Who") && !strcmp(w[1], "received") && !strcmp(w[2], "the"))
            o = intern(&voc.objects, w[3]), want = 2;
        else if (nw == 6 && !strcmp(w[0], "What") && !strcmp(w[1], "did") && !strcmp(w[3], "give") && !strcmp(w[4], "to"))
            g = intern(&voc.people, w[2]), r = intern(&voc.people, w[5]), want = 1;
        else if (nw == 7 && !strcmp(w[0], "Who") && !strcmp(w[1], "did") && !strcmp(w[3], "give") && !strcmp(w[4], "the") &&
                 !strcmp(w[6], "to"))
            g = intern(&voc.people, w[2]), o = intern(&voc.objects, w[5]), want = 2;
        else if (nw == 4 && !strcmp(w[0], "Who") && !strcmp(w[1], "gave") && !strcmp(w[2], "the"))
            o = intern(&voc.objects, w[3]), want = 0;
        else
            BAD("qa5 question '%s'", s->question);
        int last = -1;
        for (int i = 0; i < n; i++)
            if (f[i].kind == F_GIVE && (g < 0 || f[i].p == g) && (o < 0 || f[i].o == o) && (r < 0 || f[i].q == r)) last = i;
        if (last < 0) BAD("qa5: no such transfer");
        const char *a = want == 0 ? voc.people.name[f[last].p]
                      : want == 1 ? voc.objects.name[f[last].o]
                                  : voc.people.name[f[last].q];
        snprintf(v.answer, WLEN, "%s", a);
        add_sup(&v, last);
    }
    sort_ints(v.sup, v.nsup);
    if (v.nsup && v.sup[0] < 0) BAD("supporting fact missing");
done:
    free(f), free(hloc), free(hat), free(hwhy);
    return v;
}

/* ---- per-story checks ------------------------------------------------------- */

static int word_in(const char *sentence, const char *word) {
    size_t l = strlen(word);
    for (const char *p = sentence; (p = strstr(p, word)); p++) {
        int start = p == sentence || p[-1] == ' ';
        int end = p[l] == ' ' || p[l] == '.' || p[l] == '?' || !p[l];
        if (start && end) return 1;
    }
    return 0;
}

static int n_stories, n_checked_fail;

static void check_story(int task, uint64_t seed, int hint, const babi_story *s) {
    int bad0 = n_fail;
    n_stories++;
    CHECK(s->n_facts >= 1 && s->n_facts >= hint && s->n_facts <= (hint > 10 ? hint : 10),
          "qa%d seed %llu hint %d: %d facts", task, (unsigned long long)seed, hint, s->n_facts);
    int fmt_ok = s->facts && s->question && s->answer;
    for (int i = 0; fmt_ok && i < s->n_facts; i++) {
        size_t l = s->facts[i] ? strlen(s->facts[i]) : 0;
        fmt_ok = l > 1 && s->facts[i][l - 1] == '.' && !strchr(s->facts[i], '?') && !strchr(s->facts[i], '\n') &&
                 isupper((unsigned char)s->facts[i][0]);
    }
    if (fmt_ok) {
        size_t l = strlen(s->question);
        fmt_ok = l > 1 && s->question[l - 1] == '?' && isupper((unsigned char)s->question[0]) && *s->answer &&
                 !strchr(s->answer, ' ') && !strchr(s->answer, '.');
    }
    CHECK(fmt_ok, "qa%d seed %llu hint %d: sentence format", task, (unsigned long long)seed, hint);
    if (!fmt_ok) return;
    int sup_ok = s->n_supporting >= 1 && s->supporting;
    for (int i = 0; sup_ok && i < s->n_supporting; i++)
        sup_ok = s->supporting[i] >= 0 && s->supporting[i] < s->n_facts && (i == 0 || s->supporting[i] > s->supporting[i - 1]);
    CHECK(sup_ok, "qa%d seed %llu hint %d: supporting indices", task, (unsigned long long)seed, hint);
    if (!sup_ok) return;
    int in_sup = 0;
    for (int i = 0; i < s->n_supporting; i++) in_sup |= word_in(s->facts[s->supporting[i]], s->answer);
    CHECK(in_sup, "qa%d seed %llu: answer '%s' not in a supporting fact", task, (unsigned long long)seed, s->answer);
    if (task <= 4) CHECK(is_lower(s->answer), "qa%d: answer '%s' not lower case", task, s->answer);

    verdict v = solve(task, s);
    CHECK(v.ok, "qa%d seed %llu hint %d: %s", task, (unsigned long long)seed, hint, v.why);
    if (v.ok) {
        CHECK(!strcmp(v.answer, s->answer), "qa%d seed %llu hint %d: '%s' answered '%s', the facts say '%s'", task,
              (unsigned long long)seed, hint, s->question, s->answer, v.answer);
        int same = v.nsup == s->n_supporting;
        for (int i = 0; same && i < v.nsup; i++) same = v.sup[i] == s->supporting[i];
        CHECK(same, "qa%d seed %llu hint %d: supporting facts differ (%d from the generator, %d from the solver)", task,
              (unsigned long long)seed, hint, s->n_supporting, v.nsup);
    }
    if (n_fail != bad0 && n_checked_fail++ < 3) { /* show the first few failing stories */
        for (int i = 0; i < s->n_facts; i++) printf("    %d %s\n", i, s->facts[i]);
        printf("    Q: %s A: %s\n", s->question, s->answer);
    }
}

static int same_story(const babi_story *a, const babi_story *b) {
    if (a->n_facts != b->n_facts || a->n_supporting != b->n_supporting) return 0;
    for (int i = 0; i < a->n_facts; i++)
        if (strcmp(a->facts[i], b->facts[i])) return 0;
    for (int i = 0; i < a->n_supporting; i++)
        if (a->supporting[i] != b->supporting[i]) return 0;
    return !strcmp(a->question, b->question) && !strcmp(a->answer, b->answer);
}

static uint64_t story_hash(const babi_story *s) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i <= s->n_facts; i++)
        for (const char *p = i < s->n_facts ? s->facts[i] : s->question; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return h;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* which question form a story uses, for coverage counts */
static int qform(int task, const babi_story *s) {
    if (task == 4) return strncmp(s->question, "What is the ", 12) == 0;
    if (task == 5) {
        if (!strncmp(s->question, "Who received", 12)) return 1;
        if (!strncmp(s->question, "What did", 8)) return 2;
        if (!strncmp(s->question, "Who did", 7)) return 3;
        return strstr(s->question, " to ") ? 0 : 4;
    }
    if (task == 2) { /* is the object held (1) or lying (0)? */
        for (int i = s->n_supporting - 1; i >= 0; i--) {
            const char *f = s->facts[s->supporting[i]];
            if (strstr(f, " dropped ") || strstr(f, " put down ") || strstr(f, " discarded ")) return 0;
        }
        return 1;
    }
    return 0;
}

int main(void) {
    static const int hints[] = {0, 2, 10, 50};
    enum { SEEDS = 300 };
    int forms[6][5] = {{0}};
    int qa3_three = 0, qa3_total = 0;

    /* 1. every task x seed x length: the independent solver agrees */
    for (int task = 1; task <= 5; task++)
        for (int h = 0; h < (int)(sizeof hints / sizeof hints[0]); h++)
            for (uint64_t seed = 0; seed < SEEDS; seed++) {
                babi_story s;
                still_err err = {0};
                int rc = babi_generate(task, seed * 7919 + 13, hints[h], &s, &err);
                CHECK(rc == 0, "qa%d seed %llu hint %d: %s", task, (unsigned long long)seed, hints[h], err.msg);
                if (rc) continue;
                check_story(task, seed, hints[h], &s);
                forms[task][qform(task, &s)]++;
                if (task == 3) qa3_total++, qa3_three += s.n_supporting == 3;
                babi_story_free(&s);
            }
    /* long stories */
    for (int task = 1; task <= 5; task++)
        for (uint64_t seed = 0; seed < 20; seed++) {
            int hint = seed < 18 ? 300 : 3000;
            babi_story s;
            still_err err = {0};
            int rc = babi_generate(task, seed, hint, &s, &err);
            CHECK(rc == 0, "qa%d long: %s", task, err.msg);
            if (rc) continue;
            CHECK(s.n_facts == hint, "qa%d: %d facts for hint %d", task, s.n_facts, hint);
            check_story(task, seed, hint, &s);
            babi_story_free(&s);
        }

    /* 2. coverage: every question form occurs */
    CHECK(forms[2][0] > 0 && forms[2][1] > 0, "qa2: held %d, dropped %d", forms[2][1], forms[2][0]);
    CHECK(forms[4][0] > 0 && forms[4][1] > 0, "qa4 forms %d %d", forms[4][0], forms[4][1]);
    for (int k = 0; k < 5; k++) CHECK(forms[5][k] > 0, "qa5 form %d never asked", k);
    CHECK(qa3_three * 2 > qa3_total, "qa3: only %d of %d questions have three supporting facts", qa3_three, qa3_total);

    /* 3. determinism and variety */
    for (int task = 1; task <= 5; task++) {
        uint64_t hs[200];
        int nh = 0;
        for (uint64_t seed = 0; seed < 200; seed++) {
            babi_story a, b;
            still_err err = {0};
            if (babi_generate(task, seed, 10, &a, &err)) { CHECK(0, "%s", err.msg); continue; }
            if (babi_generate(task, seed, 10, &b, &err)) { CHECK(0, "%s", err.msg); babi_story_free(&a); continue; }
            CHECK(same_story(&a, &b), "qa%d seed %llu: not deterministic", task, (unsigned long long)seed);
            hs[nh++] = story_hash(&a);
            babi_story_free(&a);
            babi_story_free(&b);
        }
        qsort(hs, (size_t)nh, sizeof hs[0], cmp_u64);
        int distinct = nh > 0;
        for (int i = 1; i < nh; i++) distinct += hs[i] != hs[i - 1];
        CHECK(distinct >= nh * 95 / 100, "qa%d: only %d distinct stories of %d seeds", task, distinct, nh);
        babi_story a, b;
        still_err err = {0};
        if (!babi_generate(task, 1, 10, &a, &err)) {
            if (!babi_generate(task, 2, 10, &b, &err)) {
                CHECK(!same_story(&a, &b), "qa%d: seeds 1 and 2 give the same story", task);
                babi_story_free(&b);
            }
            babi_story_free(&a);
        }
    }

    /* 4. errors */
    static const int bad_tasks[] = {0, 6, -1, 100};
    for (int i = 0; i < 4; i++) {
        babi_story s;
        still_err err = {0};
        int rc = babi_generate(bad_tasks[i], 1, 10, &s, &err);
        CHECK(rc == STILL_E_ARG, "task %d: rc %d", bad_tasks[i], rc);
        CHECK(err.msg[0] && !strchr(err.msg, '\n'), "task %d: message '%s'", bad_tasks[i], err.msg);
        CHECK(s.facts == NULL && s.n_facts == 0 && s.question == NULL, "task %d: output not cleared", bad_tasks[i]);
        babi_story_free(&s);
    }
    {
        babi_story s;
        still_err err = {0};
        CHECK(babi_generate(1, 1, -1, &s, &err) == STILL_E_ARG && err.msg[0], "negative n_facts accepted");
        babi_story_free(&s);
        CHECK(babi_generate(1, 1, 1 << 30, &s, &err) == STILL_E_ARG, "huge n_facts accepted");
        babi_story_free(&s);
        CHECK(babi_generate(1, 1, 10, NULL, &err) == STILL_E_ARG, "NULL output accepted");
        CHECK(babi_generate(9, 1, 10, &s, NULL) == STILL_E_ARG, "NULL err must be allowed");
        babi_story z;
        memset(&z, 0, sizeof z);
        babi_story_free(&z); /* zeroed struct */
        babi_story_free(NULL);
        CHECK(babi_generate(3, 5, 20, &s, &err) == 0, "%s", err.msg);
        babi_story_free(&s);
        babi_story_free(&s); /* freeing twice is harmless: free clears the struct */
        CHECK(s.facts == NULL && s.answer == NULL, "free does not clear");
    }

    printf("%d stories checked by the solver\n", n_stories);
    return CHECK_SUMMARY();
}
