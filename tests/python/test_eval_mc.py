"""lm-evaluation-harness style multiple choice (src/eval/eval_mc.c) on the real model.

The engine side is `$STILL_BUILD_DIR/mc_tool MODEL FILE.jsonl [n_ctx]`
(tests/tools/mc_tool.c): one line per item with the log-likelihood of each
choice, then `acc=... acc_norm=... n=...`; errors are one line on stderr, exit 1.

Checked here:
  * items the model cannot get wrong (counting, weekdays, the alphabet,
    repeated phrases) score acc == 1.0;
  * the per-choice log-likelihoods equal an independent computation: the numpy
    forward pass of ref_llama.py, the HF `tokenizers` tokenizer built from the
    GGUF, lm-eval's request construction (context's trailing whitespace moved to
    the continuation, context and continuation tokenized separately, the
    rightmost n_ctx + 1 tokens kept) and a float64 log-softmax, to float
    rounding with the float single-token products (--matvec float), within
    the measured 8-bit rounding with the default int8 ones;
  * acc and acc_norm differ where a long gold choice has the lower total but the
    higher per-byte log-likelihood, and both equal what Python derives from the
    printed numbers;
  * bad input gives a one-line error naming the line, never a crash.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
BUILD_DIR = os.environ.get("STILL_BUILD_DIR")
TOOL = Path(BUILD_DIR or ROOT / "build") / "mc_tool"

if not Path(MODEL).is_file():
    pytest.skip(f"model not fetched ({MODEL}; make model)", allow_module_level=True)
if BUILD_DIR:
    assert TOOL.is_file(), f"{TOOL} missing (build the project first)"
elif not TOOL.is_file():
    pytest.skip("mc_tool not built (set STILL_BUILD_DIR)", allow_module_level=True)

# Items the model is certain about, gold at varied indices, 2-4 choices.
EASY = [
    {"context": "1, 2, 3, 4, 5,", "choices": [" dog", " 6"], "gold": 1},
    {"context": "Monday, Tuesday, Wednesday,", "choices": [" apple", " Thursday", " blue"], "gold": 1},
    {"context": "A, B, C, D, E, F,", "choices": [" G", " 7", " cat", " the"], "gold": 0},
    {"context": "one two three four five six", "choices": [" banana", " window", " seven"], "gold": 2},
    {"context": "January, February, March, April,", "choices": [" May", " Tuesday"], "gold": 0},
    {"context": "hello world hello world hello world hello",
     "choices": [" car", " tree", " house", " world"], "gold": 3},
    {"context": "10, 20, 30, 40, 50,", "choices": [" 60", " dog"], "gold": 0},
    {"context": "red green blue red green blue red green", "choices": [" table", " blue"], "gold": 1},
    {"context": "a b c d e f g h i j k", "choices": [" z", " q", " l"], "gold": 2},
    {"context": "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
     "choices": [" sky", " mat", " river"], "gold": 1},
]

# Long gold choices: lower total log-likelihood than the one-word distractor,
# but far higher per byte (margins of several nats measured on the model).
LONG_GOLD = [
    {"context": "To be or not to be,", "choices": [" that is the question.", " a"], "gold": 0},
    {"context": "Once upon a time,", "choices": [" I", " there lived a king and a queen in a castle."], "gold": 1},
    {"context": "Twinkle, twinkle, little star,", "choices": [" how I wonder what you are.", " and"], "gold": 0},
]


def write_jsonl(path, items, blank_lines=False):
    import json
    lines = []
    for it in items:
        lines.append(json.dumps(it, ensure_ascii=False))
        if blank_lines:
            lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# Passive OpenMP waits: spinning threads crawl when other processes share the cores.
ENV = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))


def run_tool(path, n_ctx=None, timeout=300, matvec=None):
    """matvec: None for the engine's default single-token products (int8 on
    the CPU), "float" for float ones (the reference comparisons' float-rounding
    bars), "int8"."""
    args = [str(TOOL), MODEL, str(path)] + ([str(n_ctx)] if n_ctx is not None else [])
    args += ["--matvec", matvec] if matvec else []
    return subprocess.run(args, capture_output=True, timeout=timeout, env=ENV)


def scores(path, n_ctx=None, matvec=None):
    """(per-item lists of logliks, acc, acc_norm, n) from a successful run."""
    p = run_tool(path, n_ctx, matvec=matvec)
    assert p.returncode == 0, p.stderr.decode()
    lines = p.stdout.decode().strip().split("\n")
    last = dict(kv.split("=") for kv in lines[-1].split())
    ll = [[float(x) for x in ln.split()] for ln in lines[:-1]]
    assert int(last["n"]) == len(ll)
    return ll, float(last["acc"]), float(last["acc_norm"]), int(last["n"])


def first_argmax(xs):
    best = 0
    for i, x in enumerate(xs):
        if x > xs[best]:
            best = i
    return best


def py_acc(items, ll):
    """acc and acc_norm recomputed from the printed numbers (first index wins ties)."""
    acc = sum(first_argmax(l) == it["gold"] for it, l in zip(items, ll)) / len(items)
    norm = sum(first_argmax([x / len(c.encode()) for x, c in zip(l, it["choices"])]) == it["gold"]
               for it, l in zip(items, ll)) / len(items)
    return acc, norm


# ---- 1. certain items ----------------------------------------------------------

def test_easy_items_all_correct(tmp_path):
    path = write_jsonl(tmp_path / "easy.jsonl", EASY, blank_lines=True)
    ll, acc, acc_norm, n = scores(path)
    assert n == len(EASY)
    assert [len(l) for l in ll] == [len(it["choices"]) for it in EASY]
    for it, l in zip(EASY, ll):
        assert all(math.isfinite(x) and x <= 1e-6 for x in l), l
        gold = l[it["gold"]]
        # a clear margin, not a coin toss
        assert all(gold > x + 1.0 for i, x in enumerate(l) if i != it["gold"]), (it, l)
    assert acc == 1.0
    assert acc_norm == 1.0
    assert (acc, acc_norm) == py_acc(EASY, ll)


def test_deterministic_and_independent_of_neighbours(tmp_path):
    """An item scores the same alone as after other items (state reuse is exact
    up to float noise) and two runs print identical numbers: with the default
    (int8) single-token products and with the float ones (both measured
    identical alone and after the neighbours, 2026-12-02)."""
    path = write_jsonl(tmp_path / "easy.jsonl", EASY)
    alone = write_jsonl(tmp_path / "one.jsonl", [EASY[5]])
    for matvec in (None, "float"):
        ll1 = scores(path, matvec=matvec)[0]
        assert scores(path, matvec=matvec)[0] == ll1
        ll_alone = scores(alone, matvec=matvec)[0][0]
        np.testing.assert_allclose(ll_alone, ll1[5], atol=2e-4)


# ---- 2. against the numpy reference ------------------------------------------------

@pytest.fixture(scope="module")
def ref():
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        pytest.skip(f"python package missing: {e}")
    import ref_llama
    model = ref_llama.load(MODEL)
    return ref_llama, model, ref_llama.build_tokenizer(model)


def ref_logliks(ref, item, n_ctx):
    """lm-eval's loglikelihood of each choice, computed independently."""
    ref_llama, model, tok = ref
    ctx = item["context"]
    stripped = ctx.rstrip(" \t\n\r\v\f")
    moved = ctx[len(stripped):]
    ctx_ids = tok.encode(stripped, add_special_tokens=False).ids
    out = []
    for ch in item["choices"]:
        cont = tok.encode(moved + ch, add_special_tokens=False).ids
        window = (ctx_ids + cont)[-(n_ctx + 1):]
        logits = ref_llama.forward(window, model=model)
        lp = ref_llama.log_softmax(logits)
        n = len(cont)
        rows = np.arange(len(window) - n - 1, len(window) - 1)
        out.append(float(lp[rows, np.asarray(window[-n:])].sum()))
    return out


REF_ITEMS = [
    EASY[1],
    {"context": "Question: What colour is the sky on a clear day?\nAnswer:",
     "choices": [" blue", " green with purple dots", " It is blue."], "gold": 0},
    # trailing whitespace moves into the continuation (lm-eval's _encode_pair)
    {"context": "The capital of France is ", "choices": ["Paris", "a banana", "Berlin, probably"], "gold": 0},
    LONG_GOLD[0],
]


def test_logliks_match_reference(tmp_path, ref):
    """With the float single-token products: the reference to float rounding."""
    path = write_jsonl(tmp_path / "ref.jsonl", REF_ITEMS)
    ll = scores(path, matvec="float")[0]
    worst = 0.0
    for it, got in zip(REF_ITEMS, ll):
        want = ref_logliks(ref, it, 2048)
        worst = max(worst, max(abs(a - b) for a, b in zip(got, want)))
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0, err_msg=str(it))
    print(f"\nmax |loglik engine - reference| = {worst:.2e}")


# The default single-token products (int8: 8-bit activations, src/cpu/matvec_q8.c)
# score every one-token continuation (its logits row is the only row of its
# call); longer continuations are scored from a prefill of several tokens,
# float whatever the setting. Measured against the reference on REF_ITEMS,
# EASY and LONG_GOLD (2026-12-02): one-token continuations off by at most
# 0.263 nats (default path, AVX-512 VNNI) / 0.241 (portable path), the
# longer ones by at most 2.4e-5 (as the float path), the chosen answer the
# reference's on every item. Bars: 0.5 nats per one-token continuation, the
# float bar (1e-3) for longer ones, the same choice on every item.
INT8_ONE_TOKEN_ATOL = 0.5


@pytest.mark.parametrize("matvec", [None, "int8-portable"])
def test_logliks_int8_match_reference(tmp_path, ref, matvec):
    items = REF_ITEMS + EASY + LONG_GOLD
    path = write_jsonl(tmp_path / "int8.jsonl", items)
    ll = scores(path, matvec=matvec)[0]
    if matvec is None:
        assert ll == scores(path, matvec="int8")[0], "the default is the int8 path"
    assert ll != scores(path, matvec="float")[0], "the int8 path is not the float one"
    _, _, tok = ref
    worst = {1: 0.0, 2: 0.0}
    for it, got in zip(items, ll):
        want = ref_logliks(ref, it, 2048)
        ctx = it["context"]
        moved = ctx[len(ctx.rstrip(" \t\n\r\v\f")):]
        for g, w, ch in zip(got, want, it["choices"]):
            one = len(tok.encode(moved + ch, add_special_tokens=False).ids) == 1
            worst[1 if one else 2] = max(worst[1 if one else 2], abs(g - w))
            assert abs(g - w) < (INT8_ONE_TOKEN_ATOL if one else 1e-3), (it, ch, g, w)
        assert first_argmax(got) == first_argmax(want), (it, got, want)
    print(f"\nmatvec {matvec or 'default'}: max |loglik - reference| one-token {worst[1]:.3e}, longer {worst[2]:.2e}")
    assert worst[1] > 1e-3, "no one-token continuation went through the int8 products"


def test_left_truncation_matches_reference(tmp_path, ref):
    """With a small n_ctx the context is cut on the left to the rightmost
    n_ctx + 1 tokens, as lm-eval does; a continuation alone longer than n_ctx
    is an error."""
    item = {"context": "one two three four five six seven eight nine ten eleven twelve",
            "choices": [" thirteen", " apple pie and custard"], "gold": 0}
    path = write_jsonl(tmp_path / "trunc.jsonl", [item])
    ll_full = scores(path, matvec="float")[0][0]
    for n_ctx in (6, 9):
        got = scores(path, n_ctx, matvec="float")[0][0]
        want = ref_logliks(ref, item, n_ctx)
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)
        assert got != ll_full
    p = run_tool(path, 3)   # " apple pie and custard" is more than 3 tokens
    assert p.returncode == 1
    err = p.stderr.decode().strip()
    assert "\n" not in err and ":1:" in err and "choice 1" in err, err


# ---- 3. acc vs acc_norm ----------------------------------------------------------------

def test_acc_norm_prefers_long_gold(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", LONG_GOLD)
    ll, acc, acc_norm, _ = scores(path)
    for it, l in zip(LONG_GOLD, ll):
        g = it["gold"]
        other = 1 - g
        per_byte = [x / len(c.encode()) for x, c in zip(l, it["choices"])]
        # verified on the numbers, with margins, rather than assumed
        assert l[other] > l[g] + 1.0, (it, l)
        assert per_byte[g] > per_byte[other] + 0.3, (it, per_byte)
    assert acc == 0.0
    assert acc_norm == 1.0
    assert (acc, acc_norm) == py_acc(LONG_GOLD, ll)
    # mixed with the easy set: fractions over all items
    mixed = EASY + LONG_GOLD
    ll, acc, acc_norm, n = scores(write_jsonl(tmp_path / "mixed.jsonl", mixed))
    assert n == len(mixed)
    assert acc == pytest.approx(len(EASY) / len(mixed), abs=1e-6)
    assert acc_norm == pytest.approx(1.0)
    assert (round(acc, 6), round(acc_norm, 6)) == tuple(round(x, 6) for x in py_acc(mixed, ll))


def test_ties_first_index_wins(tmp_path):
    item = {"context": "1, 2, 3, 4, 5,", "choices": [" dog", " dog", " dog"], "gold": 0}
    ll, acc, acc_norm, _ = scores(write_jsonl(tmp_path / "tie.jsonl", [item]))
    assert ll[0][0] == ll[0][1] == ll[0][2]
    assert acc == 1.0 and acc_norm == 1.0
    item["gold"] = 2
    _, acc, acc_norm, _ = scores(write_jsonl(tmp_path / "tie2.jsonl", [item]))
    assert acc == 0.0 and acc_norm == 0.0


# ---- 4. errors -----------------------------------------------------------------------

GOOD = b'{"context": "1, 2, 3,", "choices": [" 4", " x"], "gold": 0}\n'


def assert_one_line_error(p, *needles):
    assert p.returncode == 1, p
    assert p.stdout == b"", p
    err = p.stderr.decode(errors="replace").strip()
    assert err and "\n" not in err, f"expected a one-line error, got {err!r}"
    assert "error" in err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.mark.parametrize("bad, what", [
    (b'{"context": "a", "choices": [" b", " c"], "gold": 0', "malformed JSON"),
    (b'{"context": "a", "choices": [" b"], "gold": 0} trailing', "malformed JSON"),
    (b'not json at all', "malformed JSON"),
    (b'["context", "choices", "gold"]', "object"),
    (b'{"context": "a", "choices": [" b", " c"], "gold": 2}', "out of range"),
    (b'{"context": "a", "choices": [" b", " c"], "gold": -1}', "out of range"),
    (b'{"context": "a", "choices": [" b", " c"], "gold": 0.5}', "integer"),
    (b'{"context": "a", "choices": [" b", " c"], "gold": "0"}', "integer"),
    (b'{"context": "a", "choices": [], "gold": 0}', "empty"),
    (b'{"context": "a", "choices": " b", "gold": 0}', "array"),
    (b'{"context": "a", "choices": [" b", 7], "gold": 0}', "choice 1"),
    (b'{"context": "a", "choices": [" b", ""], "gold": 0}', "choice 1 is empty"),
    (b'{"context": 5, "choices": [" b"], "gold": 0}', "context"),
    (b'{"choices": [" b"], "gold": 0}', "missing field \"context\""),
    (b'{"context": "a", "gold": 0}', "missing field \"choices\""),
    (b'{"context": "a", "choices": [" b"]}', "missing field \"gold\""),
    (b'{"context": "", "choices": [" b"], "gold": 0}', "empty context"),
    (b'{"context": "   ", "choices": [" b"], "gold": 0}', "empty context"),
    (b'{"context": "caf\xc3", "choices": [" b"], "gold": 0}', "UTF-8"),
    (b'{"context": "a", "choices": [" \xff\xfe"], "gold": 0}', "UTF-8"),
    (b'{"context": "a", "choices": [" \xed\xa0\x80"], "gold": 0}', "UTF-8"),
    (b'{"context": "a", "choices": [" \\udc00"], "gold": 0}', "malformed JSON"),
])
def test_bad_line(tmp_path, bad, what):
    # line 1 good, line 2 blank (still counted), line 3 bad, line 4 good
    path = tmp_path / "bad.jsonl"
    path.write_bytes(GOOD + b"\n" + bad + b"\n" + GOOD)
    assert_one_line_error(run_tool(path), f"{path}:3:", what)


def test_missing_and_empty_files(tmp_path):
    missing = tmp_path / "nope.jsonl"
    assert_one_line_error(run_tool(missing), str(missing))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n\n")
    assert_one_line_error(run_tool(empty), "no items")
    bad_model = subprocess.run([str(TOOL), str(tmp_path / "nope.gguf"), str(empty)], capture_output=True, env=ENV)
    assert_one_line_error(bad_model)


def test_crlf_and_last_line_without_newline(tmp_path):
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(GOOD.replace(b"\n", b"\r\n") + b"\r\n" + GOOD.rstrip(b"\n"))
    ll, acc, _, n = scores(path)
    assert n == 2 and ll[0] == ll[1] and acc == 1.0
