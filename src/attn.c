/* The registry of attention kinds. */
#include "attn.h"

#include <string.h>

extern const attn_kind attn_kind_softmax, attn_kind_swa;
extern const attn_kind attn_kind_lolcats, attn_kind_liger;
extern const attn_kind attn_kind_still;

static const attn_kind *const KINDS[ATTN_KIND_COUNT] = {
    [ATTN_SOFTMAX] = &attn_kind_softmax,
    [ATTN_SWA] = &attn_kind_swa,
    [ATTN_LOLCATS] = &attn_kind_lolcats,
    [ATTN_LIGER] = &attn_kind_liger,
    [ATTN_STILL] = &attn_kind_still,
};

const attn_kind *attn_kind_get(attn_kind_id id) {
    return (unsigned)id < ATTN_KIND_COUNT ? KINDS[id] : NULL;
}

const attn_kind *attn_kind_find(const char *name, attn_kind_id *id) {
    for (int i = 0; i < ATTN_KIND_COUNT; i++)
        if (KINDS[i] && !strcmp(KINDS[i]->name, name)) {
            if (id) *id = (attn_kind_id)i;
            return KINDS[i];
        }
    return NULL;
}
