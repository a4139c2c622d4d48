/* still eval's scoring (src/eval/eval_tasks.c eval_score) on hand-written cases:
 * partial credit over several references, any-reference tasks, ASCII case,
 * whole-word edges (a longer number or word holding a reference does not
 * count; punctuation around it does not matter), bAbI's first-sentence rule. */
#include "check.h"
#include "eval/eval.h"

#include <string.h>

static double score(const char *const *refs, int n, int first_sentence, int any_ref, const char *out) {
    eval_prompt p;
    memset(&p, 0, sizeof p);
    p.refs = (char **)refs, p.n_refs = n, p.first_sentence = first_sentence, p.any_ref = any_ref;
    return eval_score(&p, out);
}

int main(void) {
    const char *one[] = {"4609832"};
    CHECK(score(one, 1, 0, 0, " 4609832.") == 1, "the number with a full stop");
    CHECK(score(one, 1, 0, 0, "The number is (4609832)") == 1, "in brackets");
    CHECK(score(one, 1, 0, 0, "4609832") == 1, "the whole output");
    CHECK(score(one, 1, 0, 0, " 46098322.") == 0, "a longer number holding the reference");
    CHECK(score(one, 1, 0, 0, " 14609832") == 0, "a digit before it");
    CHECK(score(one, 1, 0, 0, " 460983") == 0, "a fragment");
    CHECK(score(one, 1, 0, 0, "") == 0, "an empty output");
    const char *two[] = {"4609832", "6348515", "1122334", "9988776"};
    CHECK(score(two, 4, 0, 0, "4609832, 6348515 and 99887766") == 0.5, "two of four (the third a longer number)");
    CHECK(score(two, 4, 0, 1, "nothing but 1122334") == 1, "any reference counts once");
    CHECK(score(two, 4, 0, 1, "none here") == 0, "any reference, none found");
    const char *word[] = {"yes"}, *uuid[] = {"a3f1-9b2c"}, *name[] = {"Mary"};
    CHECK(score(word, 1, 0, 0, "Yesterday.") == 0, "a word holding the reference");
    CHECK(score(word, 1, 0, 0, "YES, it is.") == 1, "ASCII case ignored");
    CHECK(score(uuid, 1, 0, 0, "id: A3F1-9B2C!") == 1, "a reference with inner punctuation");
    CHECK(score(name, 1, 1, 0, "  Mary is in the kitchen. John is not.") == 1, "bAbI: first sentence");
    CHECK(score(name, 1, 1, 0, "The kitchen. Mary went there.") == 0, "bAbI: only the first sentence counts");
    CHECK(score(name, 1, 0, 0, "The kitchen. Mary went there.") == 1, "other tasks: the whole output");
    CHECK(score(one, 0, 0, 0, "4609832") == 0, "no references: 0");
    return CHECK_SUMMARY();
}
