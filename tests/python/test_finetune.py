"""Integration tests of `still finetune` (stage 2, LoRA) on the real model
with small settings: training lowers the held-out loss; a run killed with
SIGKILL and resumed ends with exactly the LoRA of an uninterrupted run; JSONL
instruction data teaches only the answers (the learnt-token count matches
the answers' tokens by Hugging Face `tokenizers`); the written adapter is
llama.cpp's LoRA layout (read with the `gguf` package), loads back for
inference (--adapter, --lora, --lora-scale 0 gives the base model), and
merges (still merge) into a model that computes the same logits; bad input
gets a one-line error before any training."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import gguf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_llama as RL  # noqa: E402
from test_linearize import text  # noqa: E402  (the same English-like sentences)

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
ADAPTER = str(ROOT / "adapters" / "smollm2-135m-still.gguf")
# under CI the model must be there (make test fetches it): a missing one fails
if not os.environ.get("CI"):
    pytestmark = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")
SMALL = ["--seq", "64", "--batch", "2", "--val-max", "2", "-t", "2", "--lora-rank", "4"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("ft") / "train.txt"
    p.write_text(text(400))
    return p


def still(*args, timeout=600):
    return subprocess.run([BIN, *map(str, args)], capture_output=True, timeout=timeout, env=ENV)


def finetune(*args, timeout=600):
    return still("finetune", "-m", MODEL, *args, timeout=timeout)


def lora_tensors(path):
    r = gguf.GGUFReader(str(path))
    return {t.name: np.array(t.data, copy=True) for t in r.tensors if ".lora_" in t.name and not t.name.endswith(("adam_m", "adam_v"))}


def val_losses(stdout):
    rows = {l.split("|")[1].strip(): float(l.split("|")[2]) for l in stdout.decode().splitlines()
            if l.startswith("| before") or l.startswith("| after")}
    return rows["before"], rows["after"]


def assert_one_line_error(p):
    assert p.returncode != 0 and p.returncode < 128, p
    err = p.stderr.decode().strip().splitlines()
    assert err and "error" in err[-1], p.stderr
    # the error is one line; progress lines before it start with "finetune:"
    assert all(l.startswith("finetune:") for l in err[:-1]), p.stderr


def test_training_lowers_the_held_out_loss_and_writes_llama_cpp_lora(tmp_path, data):
    out = tmp_path / "ft.gguf"
    p = finetune(*SMALL, "--data", data, "--tokens", 64 * 2 * 12, "--lr", "3e-3", "--seed", "1", "-o", out)
    assert p.returncode == 0, p.stderr.decode()
    before, after = val_losses(p.stdout)
    assert np.isfinite(before) and after < before - 0.05, (before, after)
    r = gguf.GGUFReader(str(out))
    f = {k: r.fields[k].contents() for k in ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha")}
    assert f == {"general.architecture": "llama", "general.type": "adapter", "adapter.type": "lora",
                 "adapter.lora.alpha": 16.0}
    names = {t.name: t for t in r.tensors}
    # softmax plan: only LoRA tensors (what llama.cpp's loader accepts), q, k, v, o of every layer
    assert len(names) == 30 * 4 * 2 and all(".lora_" in n for n in names)
    a, b = names["blk.3.attn_k.weight.lora_a"], names["blk.3.attn_k.weight.lora_b"]
    assert list(a.shape) == [576, 4] and list(b.shape) == [4, 192]   # ne: [n_in, rank], [rank, n_out]
    assert np.abs(np.array(b.data)).max() > 0   # B moved away from its zero init


def test_sigkill_and_resume_match_an_uninterrupted_run(tmp_path, data):
    common = [*SMALL, "--data", data, "--tokens", 64 * 2 * 10, "--lr", "1e-3", "--ckpt-every", "1", "--seed", "4",
              "--lora-dropout", "0.1", "--adapter", ADAPTER, "--train-attn"]
    # the committed adapter carries stage 2's LoRA (rank 8): a run continues it only with the same shape
    assert_one_line_error(finetune(*common, "-o", tmp_path / "r4.gguf"))
    common += ["--lora-rank", "8"]
    ref = tmp_path / "ref.gguf"
    p = finetune(*common, "-o", ref)
    assert p.returncode == 0, p.stderr.decode()
    out = tmp_path / "cut.gguf"
    ckpt = Path(str(out) + ".ckpt")
    proc = subprocess.Popen([BIN, "finetune", "-m", MODEL, *map(str, common), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    t0, step = time.time(), 0
    while time.time() - t0 < 300 and proc.poll() is None:
        if ckpt.exists():
            try:
                step = int(gguf.GGUFReader(str(ckpt)).fields["still.finetune.step"].parts[-1][0])
            except Exception:
                step = 0   # being replaced right now
            if step >= 3:
                break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL and not out.exists() and step >= 3
    # a checkpoint with a NaN among its AdamW moments is refused by name (it used to train on and fail later)
    r = gguf.GGUFReader(str(ckpt))
    t = next(t for t in r.tensors if t.name.endswith(".adam_v"))
    raw = bytearray(ckpt.read_bytes())
    raw[t.data_offset + 4 * 5:t.data_offset + 4 * 6] = np.array([np.nan], dtype=np.float32).tobytes()
    poisoned = tmp_path / "poisoned.ckpt"
    poisoned.write_bytes(bytes(raw))
    p = finetune(*common, "--resume", "--ckpt", poisoned, "-o", tmp_path / "p.gguf")
    assert_one_line_error(p)
    assert "adam_v" in p.stderr.decode() and "not a valid AdamW moment" in p.stderr.decode(), p.stderr
    p = finetune(*common, "--resume", "-o", out)
    assert p.returncode == 0, p.stderr.decode()
    assert b"(resumed)" in p.stdout
    a, b = lora_tensors(ref), lora_tensors(out)
    assert a.keys() == b.keys() and len(a) == 240
    for k in a:
        assert np.array_equal(a[k], b[k]), f"{k}: the resumed run differs from the uninterrupted one"
    ra, rb = gguf.GGUFReader(str(ref)), gguf.GGUFReader(str(out))
    pa = {t.name: np.array(t.data) for t in ra.tensors if t.name.endswith("attn_hybrid.params")}
    pb = {t.name: np.array(t.data) for t in rb.tensors if t.name.endswith("attn_hybrid.params")}
    assert len(pa) == 30 and all(np.array_equal(pa[k], pb[k]) for k in pa)
    # settings that change the result are refused
    p = finetune(*common, "--resume", "--lr", "2e-3", "-o", tmp_path / "x.gguf", "--ckpt", ckpt)
    assert_one_line_error(p)


def test_instruction_data_teaches_only_the_answers(tmp_path):
    tok = RL.build_tokenizer(RL.load(MODEL))
    answer = "The capital of France is Paris, a city on the Seine."
    ex = [{"instruction": "Name the capital of France.", "input": "Answer in one sentence.", "output": answer},
          {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"},
                        {"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"},
                        {"role": "assistant", "content": answer}]}]
    f = tmp_path / "sft.jsonl"
    # 4 copies of each, a blank line in between: 8 examples; validation takes 2 of them
    f.write_text("\n".join(json.dumps(e) for e in ex * 4) + "\n\n")
    p = finetune("--data", f, "--seq", "256", "--batch", "2", "--tokens", 512, "--val", "0.25", "--val-max", "2",
                 "--lora-rank", "2", "-t", "2", "-o", tmp_path / "o.gguf")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.decode()
    assert "(8 instruction examples)" in out
    n_answer = len(tok.encode(answer, add_special_tokens=False).ids) + 1   # + <|im_end|>
    line = [l for l in out.splitlines() if l.startswith("| validation")][0]
    n_val = float(line.split("(")[1].split()[0])
    # the two held-out examples are one of each kind or two of one: 1 or 2 answers each
    assert n_val in {2 * n_answer, 3 * n_answer, 4 * n_answer}, (n_val, n_answer)


def test_lora_in_inference_and_merge(tmp_path, data):
    out = tmp_path / "ft.gguf"
    p = finetune(*SMALL, "--data", data, "--tokens", 64 * 2 * 6, "--lr", "3e-3", "--lora-targets", "q,v,down",
                 "-o", out)
    assert p.returncode == 0, p.stderr.decode()
    ids = [int(x) for x in still("tokenize", "-m", MODEL, "-p", text(3, 9)).stdout.split()]
    assert len(ids) > 20

    def ppl(*extra):
        f = tmp_path / "p.txt"
        f.write_text(text(60, 5))
        r = still("perplexity", "-m", MODEL, *extra, "-f", f, "-c", "128", "-t", "2")
        assert r.returncode == 0, r.stderr.decode()
        return float(r.stdout.decode().split("PPL = ")[1].split()[0])

    base, tuned = ppl(), ppl("--adapter", out)
    assert tuned < base   # it learnt this text's style
    assert abs(ppl("--lora", out) - tuned) < 1e-9 * tuned
    assert abs(ppl("--lora", out, "--lora-scale", "0") - base) < 1e-9 * base
    merged = tmp_path / "merged.gguf"
    r = still("merge", "-m", MODEL, "--adapter", out, "-o", merged)
    assert r.returncode == 0, r.stderr.decode()
    mr = gguf.GGUFReader(str(merged))
    types = {t.name: t.tensor_type for t in mr.tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_k.weight"] != gguf.GGMLQuantizationType.F16   # not a target: kept as it was
    f = tmp_path / "p.txt"
    r = still("perplexity", "-m", merged, "-f", f, "-c", "128", "-t", "2")
    merged_ppl = float(r.stdout.decode().split("PPL = ")[1].split()[0])
    assert abs(merged_ppl - tuned) < 2e-3 * tuned   # F16 rounding of the merged rows


def test_bad_input_is_a_one_line_error(tmp_path, data):
    out = tmp_path / "o.gguf"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n')
    p = finetune("--data", bad, "-o", out)
    assert_one_line_error(p)
    assert "bad.jsonl:2" in p.stderr.decode()
    noans = tmp_path / "noans.jsonl"
    noans.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert "no assistant answer" in finetune("--data", noans, "-o", out).stderr.decode()
    role = tmp_path / "role.jsonl"
    role.write_text('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}\n')
    assert "unknown role" in finetune("--data", role, "-o", out).stderr.decode()
    for args, msg in [(["--lora-targets", "q,x"], "unknown target"), (["--lora-targets", "q,"], "trailing comma"),
                      (["--lora-rank", "0"], "--lora-rank"), (["--lora-rank", "193"], "out of range for target k"),
                      (["--lora-dropout", "1"], "--lora-dropout"), (["--lr", "-1"], "--lr")]:
        p = finetune("--data", data, *args, "-o", out)
        assert_one_line_error(p)
        assert msg in p.stderr.decode(), (args, p.stderr)
    p = finetune("--data", data, "-o", tmp_path / "no" / "such" / "dir" / "o.gguf")
    assert_one_line_error(p)
    assert "cannot write" in p.stderr.decode()
    p = finetune("--data", tmp_path / "missing.txt", "-o", out)
    assert_one_line_error(p)
    # an adapter made for another model
    tiny = tmp_path / "tiny.gguf"
    subprocess.run([str(Path(BIN).parent / "finetune_tool"), "--write-tiny", str(tiny)], check=True)
    other = tmp_path / "other.gguf"
    r = still("convert", "-m", tiny, "--attn", "still", "-o", other)
    assert r.returncode == 0, r.stderr.decode()
    p = finetune("--data", data, "--adapter", other, "-o", out)
    assert_one_line_error(p)
    assert "made for a model" in p.stderr.decode()
    # a LoRA of another model
    tl = tmp_path / "tiny-lora.gguf"
    r = still("finetune", "-m", tiny, "--data", data, "--seq", "32", "--batch", "1", "--tokens", 32, "--lora-rank", "2",
              "-o", tl)
    assert r.returncode == 0, r.stderr.decode()
    p = still("perplexity", "-m", MODEL, "--lora", tl, "-f", data)
    assert p.returncode == 1 and "shape" in p.stderr.decode()
    assert not out.exists()
