"""Dequantization (and matmul) of still against the gguf-py reference.

The C side is driven through tests/tools/dequant_tool (found in
$STILL_BUILD_DIR, or built here with gcc when that is unset).  Random valid
blocks of every supported type, data quantized by gguf-py itself, and a few
real tensors of the model at $STILL_MODEL (skipped if absent) must dequantize
bit-exactly like gguf.quants.dequantize (every product in the block formulas is exact in
float32 — a half scale times a small integer — so one rounding at most, the same
on every path; +0 == -0 and NaN == NaN).
"""
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(os.environ.get("STILL_MODEL", "/tmp/model/SmolLM2-135M-Instruct.Q4_1.gguf"))

# Types supported by both still and gguf-py's dequantize (Q8_1 has no
# gguf-py dequantizer; it is covered by tests/test_quant.c).
TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0,
         QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]

# byte offsets of the fp16 scale fields inside a block
SCALE_OFFSETS = {
    QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
    QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
}


@pytest.fixture(scope="session")
def tool(tmp_path_factory):
    bdir = os.environ.get("STILL_BUILD_DIR")
    if bdir:
        exe = Path(bdir) / "dequant_tool"
        assert exe.exists(), f"{exe} missing (build the project first)"
        return exe
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler and STILL_BUILD_DIR unset")
    exe = tmp_path_factory.mktemp("tool") / "dequant_tool"
    src = [ROOT / "src" / f for f in ("common.c", "quant.c", "matmul.c")] + [ROOT / "tests" / "tools" / "dequant_tool.c"]
    subprocess.run([cc, "-std=gnu11", "-O2", "-march=native", "-fopenmp", "-D_GNU_SOURCE",
                    f"-I{ROOT / 'include'}", f"-I{ROOT / 'src'}", *map(str, src), "-lm", "-o", str(exe)],
                   check=True)
    return exe


def run_dequant(tool, tmp_path, qtype, raw):
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(np.ascontiguousarray(raw).tobytes())
    subprocess.run([str(tool), str(int(qtype)), str(inp), str(out)], check=True)
    return np.fromfile(out, dtype=np.float32)


def assert_bit_exact(got, want, what):
    """Bit-exact (+0 == -0, NaN == NaN); the message gives the ulp distance of the first difference."""
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, f"{what}: shape {got.shape} vs {want.shape}"
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    if same.all():
        return
    # ulp distance on the monotonic integer mapping of floats
    def ordered(a):
        i = a.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    ulps = np.abs(ordered(got) - ordered(want))
    bad = ~same
    assert not bad.any(), (f"{what}: {bad.sum()} of {got.size} values differ (up to {ulps[bad].max()} ulp); "
                           f"first at {np.argmax(bad)}: got {got[bad][0]!r} want {want[bad][0]!r}")


def random_halves(rng, n, lo_exp, hi_exp):
    """Random finite fp16 bit patterns with unbiased exponent in [lo_exp, hi_exp]."""
    e = rng.integers(lo_exp + 15, hi_exp + 16, size=n).clip(1, 30).astype(np.uint16)
    m = rng.integers(0, 1024, size=n, dtype=np.uint16)
    s = rng.integers(0, 2, size=n, dtype=np.uint16)
    return (s << 15) | (e << 10) | m


def random_blocks(rng, qtype, nblocks):
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    if qtype == QT.F32:
        return (rng.standard_normal(nblocks) * 10).astype(np.float32).view(np.uint8)
    if qtype == QT.F16:
        h = rng.integers(0, 65536, size=nblocks, dtype=np.uint32).astype(np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # no inf / NaN; subnormals stay
        return h.view(np.uint8)
    if qtype == QT.BF16:
        h = rng.integers(0, 65536, size=nblocks, dtype=np.uint32).astype(np.uint16)
        h[(h & 0x7F80) == 0x7F80] &= 0xBFFF
        return h.view(np.uint8)
    raw = rng.integers(0, 256, size=(nblocks, block_bytes), dtype=np.uint16).astype(np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        raw[:, off:off + 2] = random_halves(rng, nblocks, -14, 1).reshape(-1, 1).view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_random_blocks(tool, tmp_path, qtype):
    rng = np.random.default_rng(int(qtype) + 1234)
    block_elems, _ = GGML_QUANT_SIZES[qtype]
    nblocks = 4096 if block_elems == 1 else (2048 if block_elems == 32 else 256)
    raw = random_blocks(rng, qtype, nblocks)
    want = gguf.quants.dequantize(raw.reshape(-1), qtype)
    got = run_dequant(tool, tmp_path, qtype, raw)
    assert_bit_exact(got, want, qtype.name)


@pytest.mark.parametrize("qtype", [QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0],
                         ids=lambda t: t.name)
def test_gguf_quantized(tool, tmp_path, qtype):
    """Data quantized by gguf-py itself (realistic scales, all-equal blocks, zeros)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 256)).astype(np.float32) * np.float32(0.05)
    x[3] = 0.0                 # all-zero row (d == 0)
    x[5] = np.float32(0.125)   # constant row
    x[7] *= 1000.0
    q = gguf.quants.quantize(x, qtype)
    want = gguf.quants.dequantize(q, qtype)
    got = run_dequant(tool, tmp_path, qtype, q)
    assert_bit_exact(got, want, qtype.name)


def test_bad_input(tool, tmp_path):
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    inp.write_bytes(b"\0" * 21)  # not a whole number of Q4_1 blocks
    r = subprocess.run([str(tool), str(int(QT.Q4_1)), str(inp), str(out)], capture_output=True, text=True)
    assert r.returncode != 0 and "blocks" in r.stderr
    r = subprocess.run([str(tool), "15", str(inp), str(out)], capture_output=True, text=True)  # Q8_K
    assert r.returncode != 0 and "not supported" in r.stderr


def run_matmul(tool, tmp_path, qtype, w_raw, n_in, n_out, x):
    wf, xf, yf = tmp_path / "w.bin", tmp_path / "x.bin", tmp_path / "y.bin"
    wf.write_bytes(np.ascontiguousarray(w_raw).tobytes())
    x = np.ascontiguousarray(x, dtype=np.float32)
    xf.write_bytes(x.tobytes())
    subprocess.run([str(tool), "matmul", str(int(qtype)), str(n_in), str(n_out), str(x.shape[0]),
                    str(wf), str(xf), str(yf)], check=True)
    return np.fromfile(yf, dtype=np.float32).reshape(x.shape[0], n_out)


def check_matmul(got, w, x, what):
    w = w.astype(np.float64)
    x = x.astype(np.float64)
    ref = x @ w.T
    scale = np.abs(x) @ np.abs(w).T  # sum_i |x_i w_i|: the natural size of rounding errors
    err = np.abs(got - ref) / np.maximum(scale, 1e-30)
    assert err.max() < 1e-5, f"{what}: max relative error {err.max():.3g}"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("n_tok", [1, 3, 9, 40])
def test_matmul_random(tool, tmp_path, qtype, n_tok):
    rng = np.random.default_rng(int(qtype) * 100 + n_tok)
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_in = 512 if block_elems == 256 else 96
    n_out = 37
    if block_elems == 1:
        # float weights: moderate values (random bit patterns would overflow)
        f = rng.standard_normal(n_out * n_in).astype(np.float32)
        if qtype == QT.F16:
            raw = f.astype(np.float16).view(np.uint8)
        elif qtype == QT.BF16:
            raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = f.view(np.uint8)
    else:
        raw = random_blocks(rng, qtype, n_out * n_in // block_elems)
    w = gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(n_out, n_in)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    got = run_matmul(tool, tmp_path, qtype, raw, n_in, n_out, x)
    check_matmul(got, w, x, f"{qtype.name} n_tok={n_tok}")


@pytest.fixture(scope="module")
def model():
    if not MODEL.exists():
        pytest.skip(f"model {MODEL} not present")
    return gguf.GGUFReader(str(MODEL))


def pick_tensors(reader):
    seen, out = set(), []
    for t in reader.tensors:
        key = (t.tensor_type, tuple(int(d) for d in t.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


def test_model_tensors(tool, tmp_path, model):
    tensors = pick_tensors(model)
    assert tensors
    for t in tensors:
        qtype = QT(int(t.tensor_type))
        data = np.asarray(t.data)
        if qtype not in (QT.F32, QT.F16, QT.BF16) and data.shape[0] > 2048:
            data = data[:2048]  # the embedding matrix: first rows suffice
        raw = data.view(np.uint8)
        want = gguf.quants.dequantize(raw, qtype)
        got = run_dequant(tool, tmp_path, qtype, raw)
        assert_bit_exact(got, want, f"{t.name} ({qtype.name})")


def test_model_matmul(tool, tmp_path, model):
    rng = np.random.default_rng(3)
    for t in pick_tensors(model):
        qtype = QT(int(t.tensor_type))
        if len(t.shape) != 2:
            continue
        raw = np.asarray(t.data).view(np.uint8)
        if raw.shape[0] > 4096:
            raw = raw[:4096]
        n_out = raw.shape[0]
        n_in = int(t.shape[0])
        w = gguf.quants.dequantize(raw, qtype).reshape(n_out, n_in)
        for n_tok in (1, 17):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            got = run_matmul(tool, tmp_path, qtype, raw, n_in, n_out, x)
            check_matmul(got, w, x, f"{t.name} n_tok={n_tok}")


def test_quantize_q8_0_matches_gguf(tool, tmp_path):
    """quantize_row_q8_0 (the still gate's 8-bit copy for decode steps) gives
    gguf-py's Q8_0 blocks byte for byte: random rows at several scales, a
    zero block, a block with one large value, exact halves."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(32 * 64) * s for s in (1e-3, 0.05, 1.0, 40.0)] +
                       [np.zeros(32), np.r_[np.full(31, 0.01), 9.0], np.arange(-16, 16) * 0.5]).astype(np.float32)
    inp, out = tmp_path / "x.bin", tmp_path / "q.bin"
    inp.write_bytes(x.tobytes())
    subprocess.run([str(tool), "quant8", str(inp), str(out)], check=True)
    got = np.fromfile(out, dtype=np.uint8)
    want = gguf.quants.quantize(x.reshape(-1, 32), QT.Q8_0).reshape(-1)
    assert got.shape == want.shape
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[0]}"
    # and it dequantizes back within half a step per element, plus what rounding the step to a half costs
    back = run_dequant(tool, tmp_path, QT.Q8_0, got).reshape(-1, 32)
    step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
    d16 = got.reshape(-1, 34)[:, :2].copy().view(np.float16).astype(np.float64)
    bound = 0.5 * step + 127 * np.abs(d16 - step) + 1e-12
    assert (np.abs(back - x.reshape(-1, 32)) <= bound * 1.0001).all()

