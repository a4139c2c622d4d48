#!/usr/bin/env python3
"""Training data with long-range lookups, made from a training text: passages
of the text with a few facts of this script's own wording slipped in at
random places, then a question whose answer is one of them, far back.

Plain next-token text (novels) rarely asks a model to copy a token from
thousands of positions back, so the layers that do it in the teacher
(`still probe`) get little training signal in stage 1 or 2. This makes that
signal from the project's own templates and random values; it shares no
fact sentence or question with the built-in evaluation tasks or with
scripts/make-retrieval-dev.py's development set (use a text that neither of
them uses as a haystack: never the held-out novel).

    scripts/make-longrange-data.py --text FILE [--text FILE ...] -n ITEMS
        [--min-tokens 512] [--max-tokens 3000] [--facts 1..4] [-s SEED]
        [--format jsonl|text] > OUT

--format jsonl (default): one {"instruction", "output"} object a line for
`still finetune --data OUT.jsonl` (the loss on the answer only); text: the
same items as plain text, question and answer included, one after another,
for `still linearize` / `still finetune` on plain text. Lengths are counted
in words (about 0.75 of a token each for English prose), so --max-tokens is
approximate.
"""
import argparse
import json
import random
import re
import string
import sys

NAMES = ["Alder", "Brisk", "Corran", "Delphine", "Emmet", "Fenna", "Gideon", "Halla", "Isolde", "Jory", "Katrin",
         "Leander", "Maelis", "Orrin", "Perrin", "Rowena", "Sorrel", "Thaddeus", "Ulla", "Wendeline"]
TOWNS = ["Oxhollow", "Bramblemoor", "Kestrelford", "Dunmarrow", "Ellsworth Reach", "Gallowmere", "Thistlecombe",
         "Wyvernholt", "Larkspur Quay", "Harrowdene", "Millbrook End", "Saltcoat"]
ITEMS = ["brass key", "walking stick", "music box", "pocket watch", "silver locket", "wool blanket", "oil lamp",
         "leather satchel", "tin whistle", "sketchbook", "spyglass", "sewing kit"]
ANIMALS = ["heron", "badger", "otter", "kestrel", "hare", "wren", "stoat", "plover", "marten", "lark"]


def digits(r, lo, hi):
    n = r.randint(lo, hi)
    return str(r.randint(10 ** (n - 1), 10 ** n - 1))


def word_code(r):
    return "".join(r.choice(string.ascii_uppercase) for _ in range(r.randint(3, 5))) + str(r.randint(2, 9))


# Each template: (fact sentence, question, answer) from fresh random values.
def ferry(r):
    t, v = r.choice(TOWNS), digits(r, 2, 4)
    return f"A ferry ticket to {t} cost {v} crowns that season.", f"How many crowns did a ferry ticket to {t} cost?", v


def shelf(r):
    n, v = r.choice(NAMES), digits(r, 3, 6)
    return (f"{n} kept the ledgers on shelf number {v} of the archive.",
            f"On which shelf of the archive did {n} keep the ledgers?", v)


def password(r):
    n, v = r.choice(NAMES), word_code(r)
    return f"The word that opened {n}'s cellar door was {v}.", f"What word opened {n}'s cellar door?", v


def found(r):
    n, v, t = r.choice(NAMES), r.choice(ITEMS), r.choice(TOWNS)
    return f"In {t}, {n} once found a lost {v} under the bridge.", f"What did {n} find under the bridge in {t}?", v


def ringing(r):
    t, v = r.choice(TOWNS), digits(r, 5, 8)
    return (f"The telegraph office at {t} could be reached on line {v}.",
            f"On which line could the telegraph office at {t} be reached?", v)


def bird(r):
    n, v = r.choice(NAMES), r.choice(ANIMALS)
    return f"Everyone remembered that {n} had a tame {v} as a child.", f"What tame animal did {n} have as a child?", v


def measure(r):
    t, v = r.choice(ITEMS), digits(r, 2, 5)
    return f"The {t} in the front window was priced at {v} pence.", f"What was the {t} in the front window priced at?", v


TEMPLATES = [ferry, shelf, password, found, ringing, bird, measure]


def sentences(text):
    """The text as a list of sentences (whitespace collapsed)."""
    text = re.sub(r"\s+", " ", text).strip()
    # a full stop after a title (Mr. Rushworth) ends no sentence
    ends = r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bMs\.)(?<!\bDr\.)(?<!\bSt\.)(?<=[.!?])\s+(?=[A-Z\"'])"
    return [s for s in re.split(ends, text) if s]


def item(r, sents, a):
    """One passage (a run of sentences of about the chosen length) with facts slipped in between its sentences; the
    question about one of them, whose subject is unique among the passage's facts."""
    want = int(r.randint(a.min_tokens, a.max_tokens) * 0.75)   # words
    start = r.randrange(0, max(1, len(sents) - 1))
    passage, words = [], 0
    for s in sents[start:] + sents[:start]:
        passage.append(s)
        words += len(s.split())
        if words >= want:
            break
    facts, asked = [], set()
    for _ in range(r.randint(a.facts_min, a.facts_max)):
        fact, question, answer = r.choice(TEMPLATES)(r)
        if question in asked:
            continue
        asked.add(question)
        facts.append((fact, question, answer))
    where = sorted(r.sample(range(len(passage) + 1), len(facts))) if len(passage) + 1 >= len(facts) else []
    for (fact, _, _), w in sorted(zip(facts, where), key=lambda x: -x[1]):
        passage.insert(w, fact)
    fact, question, answer = r.choice(facts)
    return " ".join(passage), question, answer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", action="append", required=True, help="training text (repeat); never a held-out text")
    ap.add_argument("-n", "--items", type=int, default=1000)
    ap.add_argument("--min-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=3000)
    ap.add_argument("--facts", default="1..4", help="facts slipped into each passage, a range LO..HI (default 1..4)")
    ap.add_argument("-s", "--seed", type=int, default=0)
    ap.add_argument("--format", choices=["jsonl", "text"], default="jsonl")
    a = ap.parse_args()
    try:
        lo, hi = (int(x) for x in a.facts.split(".."))
    except ValueError:
        sys.exit("make-longrange-data: error: --facts takes LO..HI, e.g. 1..4")
    if not (1 <= lo <= hi <= 20) or a.items < 1 or not (16 <= a.min_tokens <= a.max_tokens):
        sys.exit("make-longrange-data: error: out of range (1 <= facts LO <= HI <= 20, items >= 1, "
                 "16 <= --min-tokens <= --max-tokens)")
    a.facts_min, a.facts_max = lo, hi
    sents = []
    for path in a.text:
        try:
            with open(path, encoding="utf-8") as f:
                sents += sentences(f.read())
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"make-longrange-data: error: {path}: {e}")
    if len(sents) < 50:
        sys.exit("make-longrange-data: error: the texts hold fewer than 50 sentences")
    r = random.Random(a.seed)
    out = sys.stdout
    for _ in range(a.items):
        passage, question, answer = item(r, sents, a)
        if a.format == "jsonl":
            out.write(json.dumps({"instruction": f"{passage}\n\n{question}", "output": f"{answer}."},
                                 ensure_ascii=False) + "\n")
        else:
            out.write(f"{passage}\n\nQuestion: {question}\nAnswer: {answer}.\n\n")


if __name__ == "__main__":
    main()
