#!/usr/bin/env python3
"""Write a development set of retrieval tasks for `still eval --tasks` and
`still probe --tasks`: facts in the project's own wording (not the built-in
tasks' needle sentences or questions), random values, one JSON object a line.

It is for choosing a plan's settings (e.g. which layers get a larger budget)
without looking at the evaluation's own tasks: run it with a training corpus
as --haystack (never the held-out novel).

    scripts/make-retrieval-dev.py [-n ITEMS_PER_TASK] [-s SEED] > bench/data/retrieval-dev.jsonl
"""
import argparse
import json
import random
import string

FIRST = ["Ada", "Boris", "Celia", "Dmitri", "Edith", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lorenz",
         "Mira", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Stefan", "Tilde", "Ugo", "Vera", "Walt", "Yara", "Zeno"]
LAST = ["Abernathy", "Brandt", "Castell", "Dorrance", "Eckhart", "Falkner", "Grimsby", "Holloway", "Ivers",
        "Jessup", "Kettering", "Lindqvist", "Marlowe", "Norcott", "Oakes", "Pennick", "Quayle", "Rutledge"]
PLACES = ["Westerholm", "Brackenridge", "Sallowmere", "Duncliff", "Orrinsby", "Tamberlow", "Quillhaven",
          "Marrowgate", "Fenwick Cross", "Ashcombe", "Lyndale", "Corvesham", "Pellingford", "Hartwell Bay"]
THINGS = ["lantern", "violin", "compass", "teapot", "umbrella", "telescope", "kettle", "saddle", "anchor",
          "bicycle", "notebook", "hourglass", "canoe", "typewriter", "globe", "harmonica", "microscope"]
COLOURS = ["crimson", "amber", "teal", "violet", "ochre", "indigo", "scarlet", "olive", "maroon", "turquoise"]


def number(r, lo=4, hi=8):
    n = r.randint(lo, hi)
    return str(r.randint(10 ** (n - 1), 10 ** n - 1))


def code(r):
    a = "".join(r.choice(string.ascii_uppercase) for _ in range(2))
    return f"{a}{r.randint(10, 99)}-{r.choice(string.ascii_uppercase)}{r.randint(100, 999)}"


def person(r):
    return f"{r.choice(FIRST)} {r.choice(LAST)}"


# (task, needle, question, answer), each built from fresh random values
def locker(r):
    p, v = person(r), number(r)
    return "dev_locker", f"The combination of {p}'s locker at the station is {v}.", \
        f"What is the combination of {p}'s locker at the station?", v


def dock(r):
    t, v = r.choice(THINGS), number(r, 2, 4)
    c = r.choice(COLOURS)
    return "dev_dock", f"Yesterday the {c} crate with the {t} was unloaded at dock {v}.", \
        f"At which dock was the {c} crate with the {t} unloaded?", v


def permit(r):
    p, v = person(r), code(r)
    return "dev_permit", f"A fishing permit with the serial {v} was issued to {p}.", \
        f"What is the serial of the fishing permit issued to {p}?", v


def hometown(r):
    p, v = person(r), r.choice(PLACES)
    return "dev_hometown", f"{p} grew up in a small house near the harbour of {v}.", \
        f"Near the harbour of which town did {p} grow up?", v


def owner(r):
    t, c, p = r.choice(THINGS), r.choice(COLOURS), person(r)
    return "dev_owner", f"The {c} {t} on the top shelf belongs to {p}.", \
        f"Who owns the {c} {t} on the top shelf?", p


def price(r):
    t, v = r.choice(THINGS), number(r, 3, 5)
    return "dev_price", f"At the auction the old {t} sold for {v} crowns.", \
        f"For how many crowns did the old {t} sell at the auction?", v


TASKS = [locker, dock, permit, hometown, owner, price]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=50, help="items per task (default 50)")
    ap.add_argument("-s", "--seed", type=int, default=2602)
    a = ap.parse_args()
    r = random.Random(a.seed)
    for make in TASKS:
        for _ in range(a.n):
            task, needle, question, answer = make(r)
            print(json.dumps({"task": task, "needle": needle, "question": question, "answers": [answer]}))


if __name__ == "__main__":
    main()
