"""--plan (issue 29 item 3): any mix of kinds per layer with per-layer settings. A plan converts to an adapter
whose per-layer kinds and settings are the plan's (read back with the `gguf` package), the adapter gives the
plan's perplexity to the last digit, later groups re-assign layers, and bad plans get a one-line error naming
the offending part and exit status 2 before any work."""
import os
import subprocess
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
TEXT = ROOT.parent / "shared" / "data" / "corpus" / "austen" / "northangerabbey.txt"

needs_model = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")
needs_text = pytest.mark.skipif(not TEXT.exists(), reason="shared corpus missing (../shared/data)")


def run(*args):
    return subprocess.run([BIN, *args], capture_output=True, text=True, timeout=600)


def meta(path):
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("still.attn.")}


def ppl(*args):
    p = run("perplexity", "-m", MODEL, "-f", str(TEXT), "-c", "256", "--chunks", "2", "-t", "2", *args)
    assert p.returncode == 0, p.stderr
    line = [l for l in p.stdout.splitlines() + p.stderr.splitlines() if l.startswith("PPL = ")]
    assert line, p.stdout + p.stderr
    return line[-1]


@needs_model
@needs_text
def test_mixed_plan_round_trip(tmp_path):
    plan = "still/budget=8320/linear=0:7,still:0-6,8-26,gdn:27-28,swa/window=100:29"
    out = tmp_path / "mix.gguf"
    p = run("convert", "-m", MODEL, "--plan", plan, "-o", str(out))
    assert p.returncode == 0, p.stderr
    m = meta(out)
    kinds = m["still.attn.layer_kinds"]
    assert kinds == ["still"] * 27 + ["gdn", "gdn", "swa"]
    assert m["still.attn.layer_budgets"][7] == 8320
    assert [b for i, b in enumerate(m["still.attn.layer_budgets"]) if i != 7 and kinds[i] == "still"] == [896] * 26
    assert m["still.attn.layer_linear"][7] == 0 and m["still.attn.layer_linear"][6] == 1
    assert m["still.attn.layer_window"][29] == 100
    assert ppl("--plan", plan) == ppl("--adapter", str(out))


@needs_model
@needs_text
def test_gdn_conv_round_trip(tmp_path):
    """gdn's short convolution is a per-layer setting: written only when some layer has one, read back as it was
    (the perplexity of the plan and of its adapter identical), its weights part of the layer's parameters."""
    plan = "softmax:0-27,gdn/conv=4:28,gdn:29"
    out = tmp_path / "conv.gguf"
    p = run("convert", "-m", MODEL, "--plan", plan, "-o", str(out))
    assert p.returncode == 0, p.stderr
    m = meta(out)
    assert list(m["still.attn.layer_conv"]) == [0] * 28 + [4, 0]
    r = gguf.GGUFReader(str(out))
    sizes = {t.name: int(t.n_elements) for t in r.tensors}
    names = sorted(n for n in sizes if "28" in n) + sorted(n for n in sizes if "29" in n)
    assert len(names) == 2 and sizes[names[0]] - sizes[names[1]] == 4 * (9 + 2 * 3) * 64, sizes
    assert ppl("--plan", plan) == ppl("--adapter", str(out))
    plain = tmp_path / "plain.gguf"
    p = run("convert", "-m", MODEL, "--plan", "softmax:0-27,gdn:28-29", "-o", str(plain))
    assert p.returncode == 0 and "still.attn.layer_conv" not in meta(plain), p.stderr


@needs_model
@needs_text
def test_gdn_norm_round_trip(tmp_path):
    """gdn's output norm is a per-layer setting (plan key norm; a plan's default is none): written for every layer
    whenever a layer is gdn, read back as it was; a file without the key (written before it existed) has the norm on
    every gdn layer, as those files were trained."""
    from test_adapter_malformed import read, write
    plan = "softmax:0-27,gdn/norm=1:28,gdn:29"
    out = tmp_path / "norm.gguf"
    p = run("convert", "-m", MODEL, "--plan", plan, "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert list(meta(out)["still.attn.layer_norm"]) == [0] * 28 + [1, 0]
    assert ppl("--plan", plan) == ppl("--adapter", str(out))
    both = tmp_path / "both.gguf"
    p = run("convert", "-m", MODEL, "--plan", "softmax:0-27,gdn/norm=1:28-29", "-o", str(both))
    assert p.returncode == 0, p.stderr
    kv, tensors = read(both)
    del kv["still.attn.layer_norm"]
    old = tmp_path / "old.gguf"
    write(old, kv, tensors)
    with_norm, without = ppl("--adapter", str(old)), ppl("--plan", "softmax:0-27,gdn:28-29")
    assert with_norm == ppl("--adapter", str(both)) and with_norm != without, (with_norm, without)
    p = run("convert", "-m", MODEL, "--plan", "softmax:0-29", "-o", str(tmp_path / "s.gguf"))
    assert p.returncode == 0 and "still.attn.layer_norm" not in meta(tmp_path / "s.gguf"), p.stderr


@needs_model
@needs_text
def test_dsa_round_trip(tmp_path):
    """dsa's indexer shape and top-K are per-layer settings, written whenever a layer is dsa (0 on the others) and
    read back as they were: the plan and its adapter give the same perplexity, at a context where the top-K is
    sparse (-c 256, topk 100: 156 positions of the last query left out)."""
    plan = "softmax:0-26,dsa/topk=100/iheads=2/idim=16:27,dsa/topk=65:28,dsa:29"
    out = tmp_path / "dsa.gguf"
    p = run("convert", "-m", MODEL, "--plan", plan, "-o", str(out))
    assert p.returncode == 0, p.stderr
    m = meta(out)
    assert list(m["still.attn.layer_topk"]) == [0] * 27 + [100, 65, 512]
    assert list(m["still.attn.layer_index_heads"]) == [0] * 27 + [2, 4, 4]
    assert list(m["still.attn.layer_index_dim"]) == [0] * 27 + [16, 64, 64]
    r = gguf.GGUFReader(str(out))
    sizes = {t.name: int(t.n_elements) for t in r.tensors}
    assert sizes["blk.27.attn_hybrid.params"] == (2 * 16 + 16 + 2) * 576 + 2 + 576 * 576 + 576, sizes
    assert ppl("--plan", plan) == ppl("--adapter", str(out))
    dense = ppl("--plan", "softmax:0-26,dsa/topk=1000/iheads=2/idim=16:27,dsa/topk=1000:28-29")
    assert dense != ppl("--plan", plan), "the top-K left nothing out"
    p = run("convert", "-m", MODEL, "--plan", "softmax:0-27,gdn:28-29", "-o", str(tmp_path / "g.gguf"))
    assert p.returncode == 0 and "still.attn.layer_topk" not in meta(tmp_path / "g.gguf"), p.stderr


@needs_model
def test_later_groups_reassign(tmp_path):
    out = tmp_path / "p.gguf"
    p = run("convert", "-m", MODEL, "--plan", "gdn:0-29,softmax:3,7,11,15,19,23,27", "-o", str(out))
    assert p.returncode == 0, p.stderr
    kinds = meta(out)["still.attn.layer_kinds"]
    assert kinds == ["softmax" if l % 4 == 3 else "gdn" for l in range(30)]
    p = run("convert", "-m", MODEL, "--plan", "still:*,softmax:0", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert meta(out)["still.attn.layer_kinds"] == ["softmax"] + ["still"] * 29


@needs_model
@pytest.mark.parametrize("plan,says", [
    ("gdn:0-28", "layer 29 has no kind"),
    ("gdn:0-29,softmax:3,3", "layer 3 named twice"),
    ("gdn:0-29,softmax:2-4,3", "layer 3 named twice"),
    ("foo:0-29", "unknown attention kind 'foo'"),
    ("gdn:0-30", "'0-30' is not a layer"),
    ("gdn:5-2", "'5-2' is not a layer"),
    ("gdn/window=3:*", "the gdn kind takes no window"),
    ("still/budget=-5:*", "budget=-5"),
    ("swa/window=abc:*", "window=abc"),
    ("swa/size=3:*", "'size=3'"),
    ("gdn/conv=9:*", "conv=9"),
    ("still/conv=4:*", "the still kind takes no conv"),
    ("gdn/norm=2:*", "norm=2"),
    ("still/norm=1:*", "the still kind takes no norm"),
    ("dsa/topk=64:*", "topk=64"),
    ("dsa/iheads=0:*", "iheads=0"),
    ("softmax/topk=100:*", "the softmax kind takes no topk"),
    ("0-3,gdn:*", "'0-3' comes before any KIND"),
    ("gdn:*,", "ends with a comma"),
    ("", "empty plan"),
])
def test_bad_plans(tmp_path, plan, says):
    p = run("convert", "-m", MODEL, "--plan", plan, "-o", str(tmp_path / "x.gguf"))
    assert p.returncode == 2, (plan, p.returncode, p.stderr)
    err = p.stderr.strip()
    assert "\n" not in err and says in err, (plan, err)
    assert not (tmp_path / "x.gguf").exists()


@needs_model
def test_plan_excludes_attn_and_adapter(tmp_path):
    p = run("convert", "-m", MODEL, "--attn", "still", "--plan", "gdn:*", "-o", str(tmp_path / "x.gguf"))
    assert p.returncode == 2 and "drop --attn" in p.stderr
    adapter = ROOT / "adapters" / "smollm2-135m-still.gguf"
    p = run("perplexity", "-m", MODEL, "--adapter", str(adapter), "--plan", "gdn:*", "-f", __file__)
    assert p.returncode == 2 and "--plan" in p.stderr
