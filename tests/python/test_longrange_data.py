"""scripts/make-longrange-data.py: every item asks about a fact that its passage holds, far from the question, in
the script's own wording (none of the evaluation's needle phrasings, none of the development set's questions); the
same seed gives the same items; bad arguments are one-line errors."""
import json
import random
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make-longrange-data.py"
DEV = ROOT / "scripts" / "make-retrieval-dev.py"


def text_file(tmp_path):
    """A made-up text of 400 distinct sentences (titles included, which must not end a sentence)."""
    r = random.Random(5)
    words = ["morning", "letter", "garden", "visit", "rain", "carriage", "dinner", "walk", "music", "news"]
    lines = []
    for i in range(400):
        w = " ".join(r.choice(words) for _ in range(r.randint(4, 14)))
        lines.append(f"Sentence {i} told of the {w}, and Mr. Weston agreed.")
    p = tmp_path / "text.txt"
    p.write_text(" ".join(lines), encoding="utf-8")
    return p


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_items_hold_their_answer(tmp_path):
    t = text_file(tmp_path)
    p = run("--text", t, "-n", 60, "--min-tokens", 200, "--max-tokens", 400, "--facts", "2..5", "-s", 7)
    assert p.returncode == 0, p.stderr
    items = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(items) == 60
    far = 0
    for it in items:
        passage, question = it["instruction"].rsplit("\n\n", 1)
        answer = it["output"].rstrip(".")
        assert it["output"] == answer + "." and answer
        assert answer in passage                       # the fact is in the passage
        assert "Mr. Weston" in passage and "Mr.  " not in passage   # titles kept whole
        assert question.endswith("?") and answer not in question
        # facts go between sentences: every text sentence is still whole
        for m in re.finditer(r"Sentence \d+ told of the [a-z ]+", passage):
            assert passage[m.end():].startswith(", and Mr. Weston agreed.")
        far += len(passage) - passage.rfind(answer) > 200
        low = it["instruction"].lower()
        for phrase in ("special magic", "pass key", "passkey", "remember it", "needle"):
            assert phrase not in low
    assert far > 30   # most answers lie far back in the passage


def test_same_seed_same_items_and_text_format(tmp_path):
    t = text_file(tmp_path)
    a = run("--text", t, "-n", 5, "-s", 3, "--min-tokens", 100, "--max-tokens", 200)
    b = run("--text", t, "-n", 5, "-s", 3, "--min-tokens", 100, "--max-tokens", 200)
    c = run("--text", t, "-n", 5, "-s", 4, "--min-tokens", 100, "--max-tokens", 200)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout != c.stdout
    txt = run("--text", t, "-n", 5, "-s", 3, "--min-tokens", 100, "--max-tokens", 200, "--format", "text")
    assert txt.returncode == 0
    qa = [json.loads(line) for line in a.stdout.splitlines()]
    for it in qa:   # the text form carries the same questions and answers
        q = it["instruction"].rsplit("\n\n", 1)[1]
        assert f"Question: {q}\nAnswer: {it['output']}\n" in txt.stdout


def test_no_question_shared_with_the_development_set(tmp_path):
    t = text_file(tmp_path)
    ours = run("--text", t, "-n", 300, "--min-tokens", 50, "--max-tokens", 60, "--facts", "1..1")
    dev = subprocess.run([sys.executable, str(DEV), "-n", "50"], capture_output=True, text=True)
    assert ours.returncode == 0 and dev.returncode == 0, dev.stderr
    ours_q = {json.loads(line)["instruction"].rsplit("\n\n", 1)[1] for line in ours.stdout.splitlines()}
    dev_text = dev.stdout
    # a question's wording without its random subject: the part before the first capitalised name or town
    stems = {q.split(" ")[0] + " " + q.split(" ")[1] + " " + q.split(" ")[2] for q in ours_q}
    assert len(ours_q) > 20
    for q in ours_q:
        assert q not in dev_text
    for stem in stems:
        assert stem not in dev_text, stem


def test_bad_arguments(tmp_path):
    t = text_file(tmp_path)
    for args, what in [(["--facts", "3"], "--facts"), (["--facts", "0..2"], "out of range"),
                       (["-n", "0"], "out of range"), (["--min-tokens", "900", "--max-tokens", "100"], "out of range")]:
        p = run("--text", t, *args)
        assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1 and what in p.stderr, (args, p.stderr)
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    p = run("--text", empty)
    assert p.returncode != 0 and "fewer than 50 sentences" in p.stderr
    p = run("--text", tmp_path / "missing.txt")
    assert p.returncode != 0 and "missing.txt" in p.stderr and len(p.stderr.strip().splitlines()) == 1
