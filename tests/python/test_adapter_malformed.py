"""Malformed adapter files (issue 28's test gap "beyond truncation"): copies
of the committed adapter with one thing wrong each, written with the `gguf`
package, must be refused with a one-line error naming the problem and exit
status 1, by every command that loads an adapter, before any work; the
unchanged copy must load and give the committed file's perplexity."""
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ADAPTER = ROOT / "adapters" / "smollm2-135m-still.gguf"

needs_model = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")
VT = gguf.GGUFValueType


def read(path):
    """(kv, tensors): kv maps key -> (type, sub_type, value); tensors a list of [name, array]."""
    r = gguf.GGUFReader(str(path))
    kv = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == VT.ARRAY else None
        kv[k] = (f.types[0], sub, f.contents())
    tensors = [[t.name, np.array(t.data, copy=True)] for t in r.tensors]
    return kv, tensors


def write(path, kv, tensors):
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (vt, sub, v) in kv.items():
        w.add_key_value(k, v, vt, sub_type=sub)
    for name, a in tensors:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_kv(key, sub, value):
    def f(kv, tensors):
        kv[key] = (VT.ARRAY, sub, value)
    return f


def tensor(tensors, name):
    return next(t for t in tensors if t[0] == name)


def set_kv(key, value):
    def f(kv, tensors):
        vt, sub, _ = kv[key]
        kv[key] = (vt, sub, value)
    return f


def kinds(edit):
    def f(kv, tensors):
        vt, sub, v = kv["still.attn.layer_kinds"]
        kv["still.attn.layer_kinds"] = (vt, sub, edit(list(v)))
    return f


def params(name, edit):
    def f(kv, tensors):
        t = tensor(tensors, name)
        t[1] = edit(t[1].copy())
    return f


def drop(name):
    def f(kv, tensors):
        tensors[:] = [t for t in tensors if t[0] != name]
    return f


def with_nan(a):
    a.reshape(-1)[5] = np.nan
    return a


CASES = {
    # the base model it was made for differs from the one given
    "another base model (heads)": (set_kv("still.base.head_count", 8), "made for a model with head_count = 8"),
    "another base model (layers)": (set_kv("still.base.block_count", 24), "made for a model with block_count = 24"),
    "another base model (width)": (set_kv("still.base.embedding_length", 960), "embedding_length = 960"),
    # the plan
    "a layer count that is wrong": (kinds(lambda v: v[:29]), "29 layer kinds for a 30-layer model"),
    # a plan may mix kinds (test_mixed_kinds_load_and_round_trip), but a layer's parameters must be its kind's
    "a layer of another kind with this kind's parameters": (kinds(lambda v: v[:3] + ["lolcats"] + v[4:]),
                                                            "blk.3.attn_hybrid.params"),
    "a per-layer window out of range": (add_kv("still.attn.layer_window", VT.INT32, [64] * 29 + [0]),
                                        "window 0 out of range"),
    "per-layer lambdas for the wrong layer count": (add_kv("still.attn.layer_lambda", VT.INT32, [19] * 3),
                                                    "3 layer lambdas for a 30-layer model"),
    "an unknown kind": (kinds(lambda v: v[:3] + ["gdn2"] + v[4:]), "unknown attention kind 'gdn2'"),
    "a budget out of range": (set_kv("still.attn.budget", -5), "out of range"),
    "a chunk out of range": (set_kv("still.attn.chunk", 0), "out of range"),
    "per-layer budgets for the wrong layer count": (set_kv("still.attn.layer_budgets", [2576] * 12),
                                                    "12 layer budgets for a 30-layer model"),
    "a per-layer linear switch that is not 0 or 1": (set_kv("still.attn.layer_linear", [1] * 29 + [2]),
                                                     "linear switch 2 is not 0 or 1"),
    # the parameters
    "a parameter tensor with the wrong element count": (
        params("blk.3.attn_hybrid.params", lambda a: a.reshape(-1)[:-1]), "blk.3.attn_hybrid.params"),
    "a parameter tensor missing": (drop("blk.5.attn_hybrid.params"), "'blk.5.attn_hybrid.params' is missing"),
    "a non-finite parameter": (params("blk.3.attn_hybrid.params", with_nan), "non-finite"),
    # the LoRA
    "a LoRA tensor of the wrong shape": (params("blk.0.attn_q.weight.lora_a", lambda a: a[:7]), "blk.0.attn_q"),
    "a LoRA half missing": (drop("blk.2.attn_v.weight.lora_b"), "blk.2.attn_v"),
    "a non-finite LoRA value": (params("blk.4.attn_output.weight.lora_b", with_nan), "blk.4.attn_output"),
}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("t") / "t.txt"
    f.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 8)
    return f


def run(*args):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, timeout=300)


def one_line_error(p):
    assert p.returncode == 1, (p.returncode, p.stderr)
    err = p.stderr.decode().strip()
    assert err and "\n" not in err and "error" in err, err
    return err


@needs_model
def test_unchanged_copy_loads(tmp_path, text):
    """The copier itself is faithful: the copy gives the committed file's perplexity to the last digit."""
    kv, tensors = read(ADAPTER)
    write(tmp_path / "same.gguf", kv, tensors)
    ppl = [run("perplexity", "-m", MODEL, "--adapter", a, "-f", text, "-c", "64", "--chunks", "1")
           for a in (ADAPTER, tmp_path / "same.gguf")]
    assert ppl[0].returncode == 0 and ppl[1].returncode == 0, ppl[1].stderr
    assert ppl[0].stdout.decode().splitlines()[-1] == ppl[1].stdout.decode().splitlines()[-1]


@needs_model
@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_adapter_is_refused(tmp_path, text, case):
    mutate, expect = CASES[case]
    kv, tensors = read(ADAPTER)
    mutate(kv, tensors)
    bad = tmp_path / "bad.gguf"
    write(bad, kv, tensors)
    for cmd in (["perplexity", "-f", text, "-c", "64", "--chunks", "1"], ["generate", "-p", "Hello", "-n", "4"],
                ["convert", "-o", tmp_path / "out.gguf"]):
        p = run(cmd[0], "-m", MODEL, "--adapter", bad, *cmd[1:])
        err = one_line_error(p)
        assert expect in err, (cmd[0], err)
        assert not (tmp_path / "out.gguf").exists()


def ppl_line(*args, text):
    p = run("perplexity", "-m", MODEL, *args, "-f", text, "-c", "128", "--chunks", "2")
    assert p.returncode == 0, p.stderr
    return p.stdout.decode().splitlines()[-1]


@needs_model
def test_mixed_kinds_load_and_round_trip(tmp_path, text):
    """A plan may mix kinds layer by layer (src/kinds/plan.c): the committed still adapter with layers 3 and 9 made
    swa (no parameters) and layer 3's window its own loads, computes something else than the file it came
    from, and `still convert` writes it back with the same plan (the same perplexity, the per-layer kinds and
    windows in the file)."""
    kv, tensors = read(ADAPTER)
    k = list(kv["still.attn.layer_kinds"][2])
    k[3] = k[9] = "swa"
    kv["still.attn.layer_kinds"] = (VT.ARRAY, VT.STRING, k)
    kv["still.attn.layer_window"] = (VT.ARRAY, VT.INT32, [64] * 3 + [128] + [64] * 26)
    tensors = [t for t in tensors if t[0] not in ("blk.3.attn_hybrid.params", "blk.9.attn_hybrid.params")]
    mixed = tmp_path / "mixed.gguf"
    write(mixed, kv, tensors)
    got = ppl_line("--adapter", mixed, text=text)
    assert got != ppl_line("--adapter", ADAPTER, text=text)
    again = tmp_path / "again.gguf"
    p = run("convert", "-m", MODEL, "--adapter", mixed, "--outtype", "f16", "-o", again)
    assert p.returncode == 0, p.stderr
    assert ppl_line("--adapter", again, text=text) == got
    r = gguf.GGUFReader(str(again))
    assert [str(bytes(r.fields["still.attn.layer_kinds"].parts[i]), "utf-8")
            for i in r.fields["still.attn.layer_kinds"].data] == k
    assert r.fields["still.attn.layer_window"].contents() == [64] * 3 + [128] + [64] * 26
    # one window everywhere again: the per-layer key is not written
    kv["still.attn.layer_window"] = (VT.ARRAY, VT.INT32, [64] * 30)
    write(mixed, kv, tensors)
    p = run("convert", "-m", MODEL, "--adapter", mixed, "--outtype", "f16", "-o", again)
    assert p.returncode == 0, p.stderr
    assert "still.attn.layer_window" not in gguf.GGUFReader(str(again)).fields
