"""Cross-check still's GGUF reader (through tests/tools/gguf_dump) against the
reference reader of the `gguf` PyPI package (gguf-py).

  * the real model (STILL_MODEL; skipped when absent): every kv key, type and
    value, every tensor name/type/shape/offset/size must match;
  * files written by gguf-py's writer, read by our reader;
  * files written by our writer (tests/tools/gguf_seed), read by gguf-py;
  * malformed files make gguf_dump exit non-zero with a one-line error.

The helper binaries are found in STILL_BUILD_DIR (default: build/).
"""
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("STILL_BUILD_DIR", ROOT / "build"))


def _tool(name):
    path = BUILD_DIR / name
    if not path.is_file():
        pytest.fail(f"{path} not found: build the project first (or set STILL_BUILD_DIR)")
    return path


@pytest.fixture(scope="module")
def dump_bin():
    return _tool("gguf_dump")


def run_dump(dump_bin, path):
    p = subprocess.run([str(dump_bin), str(path)], capture_output=True, timeout=120)
    assert p.returncode == 0, f"gguf_dump {path} failed: {p.stderr.decode(errors='replace')}"
    assert p.stderr == b""
    return json.loads(p.stdout.decode("utf-8"))


def _flatten(v):
    if isinstance(v, list):
        out = []
        for x in v:
            out.extend(_flatten(x))
        return out
    return [v]


def _values_equal(ours, theirs):
    if isinstance(theirs, float) or isinstance(ours, float):
        if isinstance(theirs, float) and math.isnan(theirs):
            return isinstance(ours, float) and math.isnan(ours)
        return float(ours) == float(theirs)
    return ours == theirs


def compare(ours, path):
    """Compare gguf_dump's JSON for `path` with gguf-py's view of it."""
    reader = gguf.GGUFReader(str(path))
    VT = gguf.GGUFValueType

    assert ours["version"] == int(reader.fields["GGUF.version"].contents())
    assert ours["alignment"] == reader.alignment
    assert ours["data_offset"] == reader.data_offset
    assert ours["file_size"] == os.path.getsize(path)

    ref_fields = [(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    assert [kv["key"] for kv in ours["kv"]] == [k for k, _ in ref_fields], "kv keys/order differ"
    assert len(ours["kv"]) == int(reader.fields["GGUF.kv_count"].contents())

    for kv, (key, field) in zip(ours["kv"], ref_fields):
        main_type = field.types[0]
        assert kv["type"] == main_type.name.lower(), f"{key}: type {kv['type']} vs {main_type.name}"
        ref = field.contents()
        if main_type == VT.ARRAY:
            if len(field.types) > 1:
                assert kv["elem_type"] == field.types[1].name.lower(), f"{key}: element type"
            mine = kv["value"]
            if kv["elem_type"] == "array":
                mine = _flatten(mine)  # gguf-py flattens nested arrays
            assert isinstance(ref, list)
            assert len(mine) == len(ref), f"{key}: {len(mine)} vs {len(ref)} elements"
            bad = [i for i, (a, b) in enumerate(zip(mine, ref)) if not _values_equal(a, b)]
            assert not bad, f"{key}: element {bad[0]} differs: {mine[bad[0]]!r} vs {ref[bad[0]]!r}"
        else:
            assert _values_equal(kv["value"], ref), f"{key}: {kv['value']!r} vs {ref!r}"

    assert len(ours["tensors"]) == len(reader.tensors)
    for t, rt in zip(ours["tensors"], reader.tensors):
        assert t["name"] == rt.name
        assert t["type"] == int(rt.tensor_type), f"{rt.name}: type"
        assert t["dims"] == [int(x) for x in rt.shape], f"{rt.name}: dims {t['dims']} vs {rt.shape}"
        assert ours["data_offset"] + t["offset"] == rt.data_offset, f"{rt.name}: offset"
        assert t["nbytes"] == int(rt.n_bytes), f"{rt.name}: nbytes"
        assert t["offset"] % ours["alignment"] == 0
    return reader


# --------------------------------------------------------------------------


def test_real_model_matches_gguf_py(dump_bin):
    model = os.environ.get("STILL_MODEL")
    if not model or not os.path.isfile(model):
        pytest.skip("STILL_MODEL not set or missing")
    ours = run_dump(dump_bin, model)
    reader = compare(ours, model)
    assert len(ours["tensors"]) > 0
    # sanity: the big arrays are really there in full
    toks = next(kv for kv in ours["kv"] if kv["key"] == "tokenizer.ggml.tokens")
    assert len(toks["value"]) == len(reader.fields["tokenizer.ggml.tokens"].data)


def _write_with_gguf_py(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo \"world\"\n\ttab")
    w.add_array("t.arr_int", [1, 2, 3, 4])
    w.add_array("t.arr_float", [0.5, -1.25, 3.0])
    w.add_array("t.arr_str", ["a", "", "▁b", "<|im_end|>"])
    w.add_array("t.arr_empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("a.f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("b.f16", rng.standard_normal((5,)).astype(np.float16))
    q8 = rng.integers(0, 256, size=(2, 34 * 2), dtype=np.uint8)
    w.add_tensor("c.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, size=(2, 144), dtype=np.uint8)
    w.add_tensor("d.q4_k", q4k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_file_written_by_gguf_py(dump_bin, tmp_path):
    path = tmp_path / "pywritten.gguf"
    _write_with_gguf_py(path)
    ours = run_dump(dump_bin, path)
    compare(ours, path)
    assert len(ours["tensors"]) == 4


def test_files_written_by_our_writer(dump_bin, tmp_path):
    seed = _tool("gguf_seed")
    subprocess.run([str(seed), str(tmp_path)], check=True, timeout=60)
    files = sorted(tmp_path.glob("seed_*.gguf"))
    assert len(files) >= 4
    for path in files:
        ours = run_dump(dump_bin, path)
        compare(ours, path)
    types = run_dump(dump_bin, tmp_path / "seed_types.gguf")
    nested = next(kv for kv in types["kv"] if kv["key"] == "seed.nested.int32")
    assert nested["value"] == [[1, -2, 3], [3]]
    assert run_dump(dump_bin, tmp_path / "seed_align.gguf")["alignment"] == 64


def _expect_failure(dump_bin, path):
    p = subprocess.run([str(dump_bin), str(path)], capture_output=True, timeout=60)
    err = p.stderr.decode(errors="replace")
    assert p.returncode != 0, f"gguf_dump accepted malformed {path}"
    assert p.stdout == b""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gguf_dump: ") and len(lines[0]) > 11, err
    return lines[0]


def test_malformed_files_rejected(dump_bin, tmp_path):
    good = tmp_path / "good.gguf"
    _write_with_gguf_py(good)
    data = good.read_bytes()
    # every prefix that loses tensor bytes is invalid
    end = _data_end(run_dump(dump_bin, good))
    cuts = sorted({0, 3, 4, 8, 23, 24, 40, 100, end // 2, end - 1})
    for n in cuts:
        bad = tmp_path / f"trunc_{n}.gguf"
        bad.write_bytes(data[:n])
        _expect_failure(dump_bin, bad)

    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    assert "magic" in _expect_failure(dump_bin, bad)

    bad = tmp_path / "version.gguf"
    bad.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    assert "version" in _expect_failure(dump_bin, bad)

    bad = tmp_path / "count.gguf"
    bad.write_bytes(data[:8] + (2**60).to_bytes(8, "little") + data[16:])
    assert "tensor count" in _expect_failure(dump_bin, bad)

    _expect_failure(dump_bin, tmp_path / "does_not_exist.gguf")
    _expect_failure(dump_bin, tmp_path)  # a directory


def _data_end(dump):
    return max(dump["data_offset"] + t["offset"] + t["nbytes"] for t in dump["tensors"])


def test_real_model_truncated(dump_bin, tmp_path):
    model = os.environ.get("STILL_MODEL")
    if not model or not os.path.isfile(model):
        pytest.skip("STILL_MODEL not set or missing")
    with open(model, "rb") as f:
        head = f.read(4 << 20)
    for n in (1000, 1 << 20, len(head)):
        bad = tmp_path / f"model_{n}.gguf"
        bad.write_bytes(head[:n])
        _expect_failure(dump_bin, bad)
    # missing only the last byte of tensor data
    bad = tmp_path / "model_minus1.gguf"
    with open(model, "rb") as src, open(bad, "wb") as dst:
        remaining = _data_end(run_dump(dump_bin, model)) - 1
        while remaining:
            chunk = src.read(min(remaining, 8 << 20))
            dst.write(chunk)
            remaining -= len(chunk)
    assert "past the end" in _expect_failure(dump_bin, bad)
