"""Integration tests of `still linearize` (stage-1 attention transfer) on the
real model, with small settings: training lowers the validation error of
every trained layer, a run killed with SIGKILL and resumed from its last
checkpoint ends with exactly the parameters of an uninterrupted run, and bad
input gives a one-line error."""
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
pytestmark = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")

# Small but real: chunk 16 so a 96-token sequence has linear terms.
SMALL = ["--chunk", "16", "--budget", "0", "--lambda", "2", "--seq", "96", "--batch", "2", "--val-max", "2", "-t", "2"]
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")


def text(n_sentences, seed=0):
    """Deterministic English-like text."""
    rng = np.random.default_rng(seed)
    subj = ["The captain", "A small dog", "My neighbour", "The old clock", "Every student", "The river"]
    verb = ["watched", "carried", "forgot", "painted", "followed", "measured"]
    obj = ["the lantern", "a letter from Bath", "seven apples", "the northern road", "her brother", "the garden"]
    tail = ["before dawn.", "with great care.", "for no reason at all.", "while it rained.", "in silence."]
    return " ".join(f"{rng.choice(subj)} {rng.choice(verb)} {rng.choice(obj)} {rng.choice(tail)}"
                     for _ in range(n_sentences)) + "\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("lin") / "train.txt"
    p.write_text(text(900))
    return p


def linearize(*args, timeout=600):
    return subprocess.run([BIN, "linearize", "-m", MODEL, *map(str, args)], capture_output=True, timeout=timeout,
                          env=ENV)


def params(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: np.array(t.data, copy=True) for t in r.tensors if t.name.endswith("attn_hybrid.params")}


def val_table(stdout):
    rows = [l.split("|") for l in stdout.decode().splitlines() if l.startswith("| ") and l[2].isdigit()]
    return [(float(r[3]), float(r[4])) for r in rows]


@pytest.mark.parametrize("kind", ["still", "lolcats"])
def test_training_lowers_validation_error(tmp_path, data, kind):
    out = tmp_path / f"{kind}.gguf"
    p = linearize("--attn", kind, *SMALL, "--data", data, "--tokens", 96 * 2 * 8, "--lr", "1e-2", "-o", out)
    assert p.returncode == 0, p.stderr.decode()
    rows = val_table(p.stdout)
    assert len(rows) == 30
    before = np.array([b for b, _ in rows])
    after = np.array([a for _, a in rows])
    assert np.all(np.isfinite(before)) and np.all(np.isfinite(after))
    assert after.mean() < 0.8 * before.mean(), (before.mean(), after.mean())
    assert (after < before).mean() >= 0.9
    assert not Path(str(out) + ".ckpt").exists(), "the checkpoint is removed once the adapter is written"
    # the adapter runs, and records what it was trained on
    r = gguf.GGUFReader(str(out))
    assert int(r.fields["still.train.steps"].parts[-1][0]) == 8
    q = subprocess.run([BIN, "perplexity", "-m", MODEL, "--adapter", out, "-f", data, "-c", "128", "--chunks", "2"],
                       capture_output=True, timeout=300, env=ENV)
    assert q.returncode == 0, q.stderr.decode()


def test_sigkill_and_resume_match_an_uninterrupted_run(tmp_path, data):
    common = ["--attn", "still", *SMALL, "--data", data, "--tokens", 96 * 2 * 12, "--ckpt-every", "1", "--seed", "3"]
    ref = tmp_path / "ref.gguf"
    p = linearize(*common, "-o", ref)
    assert p.returncode == 0, p.stderr.decode()

    out = tmp_path / "cut.gguf"
    ckpt = Path(str(out) + ".ckpt")
    proc = subprocess.Popen([BIN, "linearize", "-m", MODEL, *map(str, common), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    t0 = time.time()
    step = 0
    while time.time() - t0 < 300 and proc.poll() is None:
        if ckpt.exists():
            try:
                step = int(gguf.GGUFReader(str(ckpt)).fields["still.train.step"].parts[-1][0])
            except Exception:
                step = 0   # being replaced right now
            if step >= 3:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    assert ckpt.exists() and step >= 3
    # the checkpoint is complete (written to a temporary file, then renamed)
    assert len(params(ckpt)) == 30

    p = linearize(*common, "--resume", "-o", out)
    assert p.returncode == 0, p.stderr.decode()
    assert b"(resumed)" in p.stdout
    a, b = params(ref), params(out)
    assert a.keys() == b.keys() and len(a) == 30
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: resumed run differs from the uninterrupted one"
    # validation before training is carried through the checkpoint
    rows = val_table(p.stdout)
    assert all(np.isfinite(bf) for bf, _ in rows)


def test_resume_refuses_other_settings(tmp_path, data):
    out = tmp_path / "a.gguf"
    ckpt = Path(str(out) + ".ckpt")
    common = ["--attn", "still", *SMALL, "--data", data, "--ckpt-every", "1"]
    proc = subprocess.Popen([BIN, "linearize", "-m", MODEL, *map(str, common), "--tokens", "2304", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    t0 = time.time()
    while not ckpt.exists() and time.time() - t0 < 300 and proc.poll() is None:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert ckpt.exists()
    p = linearize(*common, "--tokens", "2304", "--lr", "5e-3", "--resume", "-o", out)
    assert p.returncode == 1
    assert "different settings" in one_line_error(p)


def one_line_error(p):
    """Progress lines may come first; the error is one line, and the last."""
    assert p.returncode != 0 and p.returncode < 128, p
    lines = p.stderr.decode().strip().splitlines()
    errors = [l for l in lines if "error:" in l]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    return errors[0]


def test_errors(tmp_path, data):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"valid text then \xff\xfe invalid bytes\n")
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.\n")
    ok = ["--attn", "still", *SMALL, "--tokens", "192"]
    assert "empty" in one_line_error(linearize(*ok, "--data", empty, "-o", tmp_path / "o.gguf"))
    assert "UTF-8" in one_line_error(linearize(*ok, "--data", bad, "-o", tmp_path / "o.gguf"))
    assert "too few" in one_line_error(linearize(*ok, "--data", short, "-o", tmp_path / "o.gguf"))
    assert "cannot write" in one_line_error(linearize(*ok, "--data", data, "-o", tmp_path / "no" / "dir" / "o.gguf"))
    assert "cannot read" in one_line_error(linearize(*ok, "--data", tmp_path / "missing.txt", "-o", tmp_path / "o.gguf"))
    assert "no checkpoint" in one_line_error(linearize(*ok, "--data", data, "--resume", "-o", tmp_path / "r.gguf"))
    assert "nothing to train" in one_line_error(
        linearize("--attn", "liger", *SMALL, "--data", data, "-o", tmp_path / "o.gguf"))
    assert "no training data" in one_line_error(linearize("--attn", "still", "-o", tmp_path / "o.gguf"))
    assert "no attention kind" in one_line_error(linearize("--data", data, "-o", tmp_path / "o.gguf"))
    assert "--seq" in one_line_error(linearize(*ok, "--data", data, "--seq", "1", "-o", tmp_path / "o.gguf"))
    assert "--lr" in one_line_error(linearize(*ok, "--data", data, "--lr", "nan", "-o", tmp_path / "o.gguf"))
    # the GPU trainer: still (NP-Map) and lolcats with feature dim = head dim (checked before any device is
    # touched); without a GPU, a clear error
    assert "feature dim = head dim" in one_line_error(
        linearize("--attn", "lolcats", "--feature-dim", "32", *SMALL, "--tokens", "192", "--data", data,
                  "--device", "cuda", "-o", tmp_path / "o.gguf"))
    assert "NP-Map" in one_line_error(
        linearize("--attn", "still", "--feature-map", "hedgehog", *SMALL, "--tokens", "192", "--data", data,
                  "--device", "cuda", "-o", tmp_path / "o.gguf"))
    p = linearize(*ok, "--data", data, "--device", "cuda", "-o", tmp_path / "g.gguf")
    if p.returncode != 0:
        assert "CUDA" in one_line_error(p)
    assert "--device" in one_line_error(linearize(*ok, "--data", data, "--device", "tpu", "-o", tmp_path / "o.gguf"))
    assert not (tmp_path / "o.gguf").exists()
