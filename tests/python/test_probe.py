"""`still probe` on the real model: with a still plan that selects every
token (budget 0, lambda = the chunk) the model is exact softmax attention,
so at every layer the plan's softmax mass on the needle must equal the
teacher's and nothing may go through the linear state; with the committed
adapter the table is complete and its shares add up; bad input gets a
one-line error."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ADAPTER = str(ROOT / "adapters" / "smollm2-135m-still.gguf")
if not os.environ.get("CI"):
    pytestmark = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")


def probe(*args):
    p = subprocess.run([BIN, "probe", "-m", MODEL, "-t", "2", *map(str, args)], capture_output=True, timeout=600, env=ENV)
    return p


def rows(out):
    r = []
    for line in out.splitlines():
        c = [x.strip() for x in line.split("|")[1:-1]]
        if len(c) == 11 and c[0].isdigit():
            r.append(c)
    return r


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    import numpy as np
    rng = np.random.default_rng(3)
    words = ["The vicar", "Her cousin", "A quiet girl", "The carriage", "walked along", "spoke of", "the lane.",
             "the garden.", "at noon.", "in the rain."]
    p = tmp_path_factory.mktemp("probe") / "hay.txt"
    p.write_text(" ".join(f"{rng.choice(words[:4])} {rng.choice(words[4:6])} {rng.choice(words[6:])}" for _ in range(3000)))
    return p


def test_exact_plan_matches_the_teacher(haystack):
    p = probe("--attn", "still", "--budget", "0", "--lambda", "64", "--task", "niah_single_2", "--length", "700",
              "--haystack", haystack)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    r = rows(out)
    assert len(r) == 30
    for c in r:
        teacher, soft, lin = float(c[3]), float(c[4]), float(c[5])
        assert abs(teacher - soft) <= 2e-3 and lin == 0, c
        loc, sel, fold = map(float, c[6].split("/"))
        assert fold == 0 and abs(loc + sel - 1) <= 0.011, c
        n_loc, n_sel, n_fold = map(int, c[7].split("/"))
        assert n_fold == 0 and n_loc + n_sel > 0, c
        assert [float(x) for x in c[9].split("/")] == [0, 0] and c[10] == "—", c   # nothing is left out
    assert "heads where the teacher puts" in out and "leave tokens out" not in out


def test_exact_share_of_dropped_tokens(haystack):
    """Sel empty (--routing none) and no linear branch: every token before
    Local is dropped, so its exact share is the softmax mass outside Local,
    at least the needle's (which lies there); the linear share is 0. The
    ordinary queries' exact share is a share too."""
    p = probe("--attn", "still", "--routing", "none", "--no-linear", "--task", "niah_single_2", "--length", "700",
              "--haystack", haystack, "--ordinary", "8")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    r = rows(out)
    assert len(r) == 30
    depth = float(out.split("(depth ")[1].split(")")[0])
    assert depth < 0.7   # the needle is before the answer's Local (the last 128 of ~700 tokens)
    for c in r:
        teacher = float(c[3])
        lin, exact = map(float, c[9].split("/"))
        assert lin == 0 and teacher - 1e-3 <= exact <= 1, c
        olin, oexact = map(float, c[10].split("/"))
        assert olin == 0 and 0 <= oexact <= 1, c
    assert sum(float(c[9].split("/")[1]) for c in r) > 0.5   # some layers look far back
    assert "8 ordinary queries" in out


def test_committed_adapter_table(haystack):
    p = probe("--adapter", ADAPTER, "--task", "niah_single_2", "--length", "1024", "--haystack", haystack)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    r = rows(out)
    assert len(r) == 30
    n_keys = int(out.split("tokens at")[0].split(":")[-1].split()[0])
    for c in r:
        for x in c[3:6]:
            assert 0 <= float(x) <= 1, c
        assert abs(sum(map(float, c[6].split("/"))) - 1) <= 0.011, c
        assert sum(int(x) for x in c[7].split("(")[0].split("/")) == 3 * n_keys, c   # 3 selection heads (per KV head)
        assert all(0 <= float(x) <= 1 for x in c[9].split("/")), c


def test_probe_errors(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Some text with the word apple in it. What was the word? The word is")
    for args, msg in [(["-f", f], "--needle"), (["-f", f, "--needle", "pear", "--answer", "pear"], "not in the prompt"),
                      ([], "give --task"), (["-f", f, "--needle", "apple", "--answer", "apple", "--ordinary", "5"], "too short"),
                      (["-f", f, "--needle", "apple", "--answer", "apple", "--ordinary", "-1"], "--ordinary")]:
        p = probe(*args)
        err = p.stderr.decode().strip()
        assert p.returncode != 0 and "\n" not in err and msg in err, err
    p = probe("-f", f, "--needle", "apple", "--answer", "apple")
    assert p.returncode == 0 and len(rows(p.stdout.decode())) == 30, p.stderr.decode()
