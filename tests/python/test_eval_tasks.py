"""The prompts of `still eval` (src/eval_tasks.c), built with --dry-run --dump
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
    assert lines[0] == "| task | length | softmax | swa |"
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
