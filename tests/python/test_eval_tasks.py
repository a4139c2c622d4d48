"""The prompts of `still eval` (src/eval/eval_tasks.c), built with --dry-run --dump
on the real model's tokenizer: each prompt fits its target length to within a
few tokens, every needle / assignment / fact is in the context at a sentence
boundary near its drawn depth, the references are what the question asks for,
and the same seed gives the same prompts. Token counts are checked against
the Hugging Face `tokenizers` library built from the GGUF's vocabulary."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
pytestmark = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")

NEEDLE_TASKS = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
                "niah_multiquery", "vt", "passkey"]
BABI = ["qa1", "qa2", "qa3", "qa4", "qa5"]


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    """Prose with clear sentence boundaries (no dependency on ../shared)."""
    import numpy as np
    rng = np.random.default_rng(1)
    subj = ["The old sailor", "Her cousin", "The vicar", "A quiet girl", "The carriage", "My aunt"]
    verb = ["walked along", "spoke of", "admired", "avoided", "returned to", "described"]
    obj = ["the long terrace", "the abbey", "a distant hill", "the drawing room", "the letters", "the river"]
    paras = []
    for _ in range(400):
        paras.append(" ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)}." for _ in range(6)))
    p = tmp_path_factory.mktemp("hay") / "hay.txt"
    p.write_text("\n\n".join(paras) + "\n")
    return p


def dump(tasks, lengths, samples, haystack, seed=0):
    p = subprocess.run([BIN, "eval", ",".join(tasks), "-m", MODEL, "--lengths", lengths, "--samples", str(samples),
                        "--haystack", str(haystack), "-s", str(seed), "--dry-run", "--dump", "-"],
                       capture_output=True, timeout=600)
    assert p.returncode == 0, p.stderr.decode()
    return [json.loads(l) for l in p.stdout.decode().splitlines()]


def test_lengths_and_needles(haystack):
    rows = dump(NEEDLE_TASKS, "512,2k", 4, haystack)
    assert len(rows) == len(NEEDLE_TASKS) * 2 * 4
    for r in rows:
        # fits the target, within a few tokens (the haystack is cut word by word)
        assert r["length"] - 8 <= r["n_tokens"] <= r["length"], r["n_tokens"]
        ctx = r["user"][r["context_off"]:r["context_off"] + r["context_len"]]
        pos = r["item_pos"]
        assert pos == sorted(pos) and len(pos) >= 1
        for ref in r["refs"]:
            assert ref in ctx, f"{r['task']}: reference {ref} not in the context"
        # each item starts at a sentence boundary (or the context's start)
        for p in pos:
            assert p == 0 or ctx[p - 2:p] in (". ", "? ", "! ", ".\n", '" '), repr(ctx[max(0, p - 5):p + 5])
        if r["length"] >= 2048:
            # the first item sits near its drawn depth (the items' own text,
            # a few percent of the context, is counted in the length here)
            frac = pos[0] / max(1, len(ctx))
            assert abs(frac - r["depth"]) < 0.1, (r["task"], frac, r["depth"])
    # depths spread over the whole context
    depths = [r["depth"] for r in rows]
    assert min(depths) < 0.25 and max(depths) > 0.75


def test_task_semantics(haystack):
    rows = {(r["task"], r["sample"]): r for r in dump(NEEDLE_TASKS, "1k", 3, haystack)}
    for s in range(3):
        r = rows[("niah_single_1", s)]
        assert "The grass is green." in r["user"] and len(r["refs"]) == 1 and len(r["refs"][0]) == 7
        assert r["refs"][0].isdigit()
        r = rows[("niah_single_3", s)]
        u = r["refs"][0]
        assert len(u) == 36 and u.count("-") == 4
        r = rows[("niah_multikey_1", s)]
        assert r["user"].count("One of the special magic numbers for") == 4 and len(r["refs"]) == 1
        r = rows[("niah_multivalue", s)]
        assert len(r["refs"]) == 4
        r = rows[("niah_multiquery", s)]
        assert len(r["refs"]) == 4
        r = rows[("vt", s)]
        assert len(r["refs"]) == 5
        # the chain: VAR r0 = value, VAR r1 = VAR r0, ...
        assert f"VAR {r['refs'][1]} = VAR {r['refs'][0]}." in r["user"]
        r = rows[("passkey", s)]
        assert f"The pass key is {r['refs'][0]}." in r["user"] and r["answer_prefix"] == "The pass key is"


def test_babi_in_prose(haystack):
    rows = dump(BABI, "256,1k", 3, haystack)
    for r in rows:
        ctx = r["user"][r["context_off"]:r["context_off"] + r["context_len"]]
        assert "<context>" in r["user"] and r["first_sentence"] == 1
        assert r["length"] - 8 <= r["n_tokens"] <= r["length"]
        assert len(r["refs"]) == 1 and r["refs"][0].lower() in ctx.lower()


def test_deterministic(haystack):
    a = dump(["niah_single_2", "qa1"], "1k", 2, haystack, seed=5)
    b = dump(["niah_single_2", "qa1"], "1k", 2, haystack, seed=5)
    c = dump(["niah_single_2", "qa1"], "1k", 2, haystack, seed=6)
    assert a == b
    assert [r["user"] for r in a] != [r["user"] for r in c]


def test_errors(haystack):
    def err(*args):
        p = subprocess.run([BIN, "eval", *args], capture_output=True, timeout=120)
        assert p.returncode != 0 and p.returncode < 128
        lines = p.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "error" in lines[0], lines
    err("no_such_task", "-m", MODEL)
    err("passkey", "-m", MODEL, "--lengths", "abc")
    err("-m", MODEL)
    err("passkey", "-m", MODEL, "--compare", "noequals")
    err("niah_single_2", "-m", MODEL, "--haystack", "/nonexistent/file.txt")


def test_run_and_compare(tmp_path, haystack):
    """A real (small) run: the table has a column per configuration, the JSON
    has every cell, and the softmax model finds a pass key at 256 tokens."""
    out = tmp_path / "r.json"
    p = subprocess.run([BIN, "eval", "passkey,niah_single_2", "-m", MODEL, "--lengths", "256", "--samples", "2",
                        "--haystack", str(haystack), "--json", str(out), "--compare", "softmax=--attn softmax",
                        "--compare", "swa=--attn swa --window 64", "-v"],
                       capture_output=True, timeout=600, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode == 0, p.stderr.decode()
    lines = p.stdout.decode().splitlines()
    assert lines[0] == "| task | length | n | softmax | swa |"
    # every cell: the mean and its 95% interval, n samples
    rows = [l.split("|")[1:-1] for l in lines[2:] if l.startswith("| ")]
    assert len(rows) == 2 and all(r[2].strip() == "2" for r in rows)
    for r in rows:
        for c in r[3:]:
            mean, iv = c.split("[")
            lo, hi = map(float, iv.rstrip("] ").split("–"))
            assert lo <= float(mean) <= hi
    d = json.loads(out.read_text())
    assert len(d["results"]) == 2 * 2 and all(len(r["scores"]) == 2 for r in d["results"])
    cell = {(r["config"], r["task"]): r["score"] for r in d["results"]}
    assert cell[("softmax", "passkey")] == 1.0
    for r in d["results"]:
        assert 0 <= r["score"] <= 1 and abs(r["score"] - sum(r["scores"]) / 2) < 1e-9
        assert len(r["outputs"]) == 2 and all(isinstance(o, str) for o in r["outputs"])
        assert r["options"] == {"softmax": "--attn softmax", "swa": "--attn swa --window 64"}[r["config"]]
    # the verbose log prints each sample's output; the JSON keeps the same text
    log = p.stderr.decode(errors="replace")
    for r in d["results"]:
        for i, o in enumerate(r["outputs"]):
            assert f"[{r['config']} {r['task']} 256 #{i}] {r['scores'][i]:.2f}: {o.split(chr(10))[0]}" in log


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_user_tasks(tmp_path, haystack):
    """--tasks FILE.jsonl: fixed contexts with a needle at a given depth, and
    haystack tasks fitted to each length; accepted answers score 0/1; every
    cell reports n and a 95% interval that holds the mean."""
    prose = haystack.read_text()[:6000]
    f = write_jsonl(tmp_path / "mine.jsonl", [
        {"task": "fixed", "context": prose[:2500], "needle": "The secret word of the garden is marigold.",
         "depth": 0.5, "question": "What is the secret word of the garden?", "answers": ["marigold", "Marigold"]},
        {"task": "fixed", "context": prose[2500:5000], "needles": ["Anne keeps 412 pearls.", "Tom keeps 77 coins."],
         "depth": [0.2, 0.8], "question": "How many pearls does Anne keep?", "answers": ["412"],
         "answer_prefix": "Anne keeps"},
        {"task": "hay", "needle": "The code for the vault is 58213.", "question": "What is the code for the vault?",
         "answers": ["58213"], "instruction": "Read the text and answer."},
    ])
    dump = tmp_path / "d.jsonl"
    p = subprocess.run([BIN, "eval", "-m", MODEL, "--tasks", str(f), "--lengths", "300,600", "--samples", "3",
                        "--haystack", str(haystack), "--dry-run", "--dump", str(dump)], capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()
    rows = [json.loads(l) for l in dump.read_text().splitlines()]
    fixed = [r for r in rows if r["task"] == "fixed"]
    hay = [r for r in rows if r["task"] == "hay"]
    # the fixed task: one cell, its two prompts once each (no random depth), length 0
    assert len(fixed) == 2 and all(r["length"] == 0 for r in fixed)
    assert "marigold" in fixed[0]["user"] and fixed[0]["refs"] == ["marigold", "Marigold"] and fixed[0]["any_ref"] == 1
    ctx = fixed[0]["user"][fixed[0]["context_off"]:fixed[0]["context_off"] + fixed[0]["context_len"]]
    pos = fixed[0]["item_pos"][0]
    assert ctx[pos:].startswith("The secret word") and abs(pos / len(ctx) - 0.5) < 0.1
    assert prose[:200] in ctx   # the context is used whole, from its start
    assert fixed[1]["answer_prefix"] == "Anne keeps"
    # the haystack task: fitted to each length, three samples each, the needle somewhere in it
    assert sorted({r["length"] for r in hay}) == [300, 600] and len(hay) == 6
    for r in hay:
        assert r["length"] - 40 <= r["n_tokens"] <= r["length"], r["n_tokens"]
        assert "58213" in r["user"] and r["user"].startswith("Read the text and answer.")
    # a real run on the softmax model
    out = tmp_path / "r.json"
    p = subprocess.run([BIN, "eval", "-m", MODEL, "--tasks", str(f), "--lengths", "300", "--samples", "3",
                        "--haystack", str(haystack), "--json", str(out)], capture_output=True, timeout=600,
                       env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode == 0, p.stderr.decode()
    d = json.loads(out.read_text())
    cells = {(r["task"], r["length"]): r for r in d["results"]}
    assert set(cells) == {("fixed", 0), ("hay", 300)}
    assert cells[("fixed", 0)]["n"] == 2 and cells[("hay", 300)]["n"] == 3
    for r in d["results"]:
        assert all(s in (0, 1) for s in r["scores"])
        lo, hi = r["ci95"]
        assert 0 <= lo <= r["score"] <= hi <= 1
    assert cells[("hay", 300)]["score"] == 1.0   # the original model finds a number in 300 tokens


@pytest.mark.parametrize("row,msg", [
    ({"question": "q", "answers": ["a"], "answer": "x"}, 'unknown key "answer"'),
    ({"question": "q"}, '"answers" is required'),
    ({"answers": ["a"]}, '"question" is required'),
    ({"question": "q", "answers": []}, "non-empty array"),
    ({"question": "q", "answers": ["a"], "depth": 0.3}, "without a needle"),
    ({"question": "q", "answers": ["a"], "needle": "n", "depth": 1.5}, "in [0, 1]"),
    ({"question": "q", "answers": ["a"], "context": "c", "haystack": "h"}, "not both"),
])
def test_user_task_errors(tmp_path, row, msg):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"question": "fine", "answers": ["ok"], "context": "Text."}, row])
    p = subprocess.run([BIN, "eval", "-m", MODEL, "--tasks", str(f), "--dry-run"], capture_output=True, timeout=60)
    err = p.stderr.decode().strip()
    assert p.returncode != 0 and "\n" not in err and msg in err and "bad.jsonl:2" in err, err


def test_user_task_mixing_contexts_and_haystacks_is_refused(tmp_path):
    f = write_jsonl(tmp_path / "mix.jsonl", [{"question": "q", "answers": ["a"], "context": "Text."},
                                             {"question": "q", "answers": ["a"], "needle": "n"}])
    p = subprocess.run([BIN, "eval", "-m", MODEL, "--tasks", str(f), "--dry-run"], capture_output=True, timeout=60)
    assert p.returncode != 0 and "mixes fixed contexts" in p.stderr.decode()


def test_lora_with_compare_is_refused_at_top_level(tmp_path):
    p = subprocess.run([BIN, "eval", "passkey", "-m", MODEL, "--lora", str(tmp_path / "x.gguf"), "--compare",
                        "a=--attn softmax", "--dry-run"], capture_output=True, timeout=60)
    assert p.returncode != 0 and "inside each configuration" in p.stderr.decode()
