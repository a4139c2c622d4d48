"""scripts/bench-long.sh (make bench-long), the long-context sweep: one
prefill and one decode cell per (kind, length), each its own process; the
CSVs, summary.md's three tables and the gnuplot PNGs; a second run into the
same OUT re-runs nothing; the peer missing, other settings in OUT and a
failing cell are reported. Tiny lengths, one thread, no llama.cpp."""
import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
SCRIPT = ROOT / "scripts" / "bench-long.sh"

needs_model = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")

FIELDS = ["model", "attn", "test", "n_prompt", "n_gen", "depth", "reps", "tps_mean", "tps_sd", "ms_per_token",
          "peak_rss_mib", "state_mib"]
KINDS = ["softmax", "swa", "lolcats", "liger", "still"]
LABELS = ["softmax", "swa (window 896)", "lolcats", "liger", "still"]
LENGTHS = [128, 256]
NGEN = 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep(out, **env):
    e = dict(os.environ, STILL_BIN=BIN, MODEL=MODEL, OUT=str(out), LENGTHS=" ".join(map(str, LENGTHS)),
             THREADS="1", REPS="1", NGEN=str(NGEN), SKIP_PEER="1", KINDS=" ".join(KINDS))
    e.update(env)
    for k in [k for k, v in e.items() if v is None]:
        del e[k]
    return subprocess.run(["bash", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=300)


def assert_one_line_error(p):
    assert p.returncode == 1, (p.returncode, p.stderr)
    err = p.stderr.strip()
    assert err and "\n" not in err and err.startswith("bench-long: error:"), err


def tables(summary):
    """summary.md -> {section title: (header cells, [row cells])}."""
    out, title = {}, None
    for line in summary.splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif line.startswith("| ") and title:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if title not in out:
                out[title] = (cells, [])
            elif not set("".join(cells)) <= set("-: "):
                out[title][1].append(cells)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long") / "sweep"
    p = sweep(out)
    assert p.returncode == 0, p.stderr
    return out, p


@needs_model
def test_one_prefill_and_one_decode_cell_per_kind_and_length(run):
    out, p = run
    rows = list(csv.DictReader(open(out / "still.csv")))
    assert list(rows[0]) == FIELDS
    got = sorted((r["attn"], int(r["n_prompt"]), int(r["n_gen"]), int(r["depth"])) for r in rows)
    want = sorted([(k, L, 0, 0) for k in KINDS for L in LENGTHS] + [(k, 0, NGEN, L) for k in KINDS for L in LENGTHS])
    assert got == want
    assert all(r["reps"] == "1" and float(r["tps_mean"]) > 0 and float(r["state_mib"]) > 0 for r in rows)
    # one process per cell: the cells' files, each with the exact command
    names = [f"still-{'swa-w896' if k == 'swa' else k}-{t}" for k in KINDS for L in LENGTHS
             for t in (f"pp{L}", f"tg{NGEN}-d{L}")]
    assert sorted(f.stem for f in (out / "cells").glob("*.csv")) == sorted(names)
    assert "--attn swa --window 896 --csv" in (out / "cells" / "still-swa-w896-pp128.cmd").read_text()
    assert "--window" not in (out / "cells" / "still-liger-pp128.cmd").read_text()
    # no peer: its CSV has the same header and no rows
    assert (out / "peer.csv").read_text().strip() == ",".join(FIELDS)
    assert "cells: 20 run, 0 done before, 0 not run (SKIP), 0 failed" in p.stderr


@needs_model
def test_summary_tables(run):
    out, _ = run
    rows = list(csv.DictReader(open(out / "still.csv")))
    pp = {(r["attn"], int(r["n_prompt"])): r for r in rows if r["n_gen"] == "0"}
    tg = {(r["attn"], int(r["depth"])): r for r in rows if r["n_gen"] != "0"}
    summary = (out / "summary.md").read_text()
    head = summary.split("## ")[0]
    assert "threads: 1" in head and "repetitions: 1" in head and "CPU: " in head
    assert "llama.cpp commit: not run" in head and "bench -m " in head and "-fa on" in head
    t = tables(summary)
    assert len(t) == 3
    (prefill, decode, memory) = (t[k] for k in t)
    assert [k for k in t][0].startswith("Prefill") and [k for k in t][1].startswith("Decode")
    assert [k for k in t][2].startswith("Memory")
    for name, (h, body), col in (("prefill", prefill, None), ("decode", decode, "ms_per_token")):
        assert h == [h[0]] + LABELS + ["llama.cpp", "still / softmax"], (name, h)
        assert [int(r[0]) for r in body] == LENGTHS, name
        for r in body:
            L = int(r[0])
            for k, cell in zip(KINDS, r[1:]):
                if col is None:   # seconds = n_prompt / t/s
                    assert float(cell) == pytest.approx(L / float(pp[k, L]["tps_mean"]), abs=6e-4), (k, L)
                else:
                    assert float(cell) == pytest.approx(float(tg[k, L][col]), abs=6e-3), (k, L)
            assert r[6] == "–"   # llama.cpp not run
            assert r[7].endswith("×")
    h, body = memory
    assert h == ["length"] + [f"{x} RSS" for x in LABELS + ["llama.cpp"]] + [f"{x} state" for x in LABELS]
    assert [int(r[0]) for r in body] == LENGTHS
    for r in body:
        L = int(r[0])
        assert [float(c) for c in r[1:6]] == [pytest.approx(float(pp[k, L]["peak_rss_mib"]), abs=0.06) for k in KINDS]
        assert r[6] == "–"
        assert [float(c) for c in r[7:]] == [pytest.approx(float(pp[k, L]["state_mib"]), abs=0.06) for k in KINDS]


@needs_model
@pytest.mark.skipif(shutil.which("gnuplot") is None, reason="gnuplot not installed (Debian: gnuplot-nox)")
def test_plots(run):
    out, _ = run
    for name in ("prefill", "decode", "memory"):
        png = out / f"{name}.png"
        assert png.exists() and png.stat().st_size > 1000, png
        assert png.read_bytes()[:8] == PNG_MAGIC, png
    gp = (out / "plot" / "plot.gp").read_text()
    assert "swa (window 896)" in gp and "still state" in gp and "dt 2" in gp


@needs_model
def test_second_run_reruns_nothing(run):
    out, _ = run
    before = {f.name: f.stat().st_mtime_ns for f in (out / "cells").glob("*.csv")}
    p = sweep(out)
    assert p.returncode == 0, p.stderr
    assert "cells: 0 run, 20 done before" in p.stderr
    assert sum(": skipped (done: " in l for l in p.stderr.splitlines()) == 20
    assert {f.name: f.stat().st_mtime_ns for f in (out / "cells").glob("*.csv")} == before
    # SKIP: matching cells are not run, the others are as before
    p = sweep(out, SKIP="^still-(softmax|liger)-tg")
    assert p.returncode == 0, p.stderr
    assert "cells: 0 run, 16 done before, 4 not run (SKIP), 0 failed" in p.stderr
    assert sum("not run (matches SKIP)" in l for l in p.stderr.splitlines()) == 4
    # other settings into the same OUT: refused, nothing run
    p = sweep(out, THREADS="2")
    assert_one_line_error(p)
    assert "other settings" in p.stderr


@needs_model
def test_missing_peer_is_a_one_line_error(tmp_path):
    p = sweep(tmp_path / "o", SKIP_PEER=None, PEER=str(tmp_path / "nope" / "llama-bench"))
    assert_one_line_error(p)
    assert "llama-bench missing" in p.stderr and "SKIP_PEER=1" in p.stderr
    assert not (tmp_path / "o").exists()


@needs_model
def test_failed_cell_shows_a_dash(tmp_path):
    """A cell that fails is reported, shown as – and makes the run exit 1;
    the summary is still written."""
    p = sweep(tmp_path / "o", KINDS="nope", LENGTHS="16")
    assert p.returncode == 1, p.stderr
    assert "FAILED" in p.stderr and "unknown attention kind" in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("bench-long: error: 2 cell(s) failed")
    t = tables((tmp_path / "o" / "summary.md").read_text())
    assert [body for _, body in t.values()] == [[["16", "–", "–"]], [["16", "–", "–"]], [["16", "–", "–", "–"]]]
    assert not list((tmp_path / "o" / "cells").glob("*.csv"))


@needs_model
def test_peer_from_one_process_at_long_lengths(tmp_path):
    """From PEER_ONE_FROM on, llama.cpp's prefill and decode cells come from
    one peer-prefill-decode process (next to PEER), called with MODEL L NGEN
    THREADS, its two rows split into the two cells; shorter lengths still go
    through llama-bench. Both peers are stand-ins here that log their calls."""
    fake = tmp_path / "peer"
    fake.mkdir()
    log = tmp_path / "calls"
    header = ",".join(FIELDS)
    (fake / "llama-bench").write_text(
        "#!/bin/sh\necho \"llama-bench $*\" >> %s\nexit 3\n" % log)
    (fake / "peer-prefill-decode").write_text(
        "#!/bin/sh\necho \"one $*\" >> %s\n"
        "echo '%s'\n"
        "echo \"$1,llama.cpp,pp$2,$2,0,0,1,100,0,10,50.5,\"\n"
        "echo \"$1,llama.cpp,tg$3 @ d$2,0,$3,$2,1,20,0,50,60.5,\"\n" % (log, header))
    for f in fake.iterdir():
        f.chmod(0o755)
    out = tmp_path / "o"
    p = sweep(out, KINDS="softmax", LENGTHS="128 256", SKIP_PEER=None, PEER=str(fake / "llama-bench"),
              PEER_ONE_FROM="256")
    calls = log.read_text().splitlines()
    # 128: llama-bench (fails: shown as –); 256: one process for both cells
    assert [c.split()[0] for c in calls] == ["llama-bench", "llama-bench", "one"], calls
    assert calls[2].split()[1:] == [MODEL, "256", str(NGEN), "1"]
    assert p.returncode == 1 and "2 cell(s) failed" in p.stderr, p.stderr
    rows = {f.name: list(csv.DictReader(open(f))) for f in (out / "cells").glob("peer-*.csv")}
    assert sorted(rows) == ["peer-pp256.csv", f"peer-tg{NGEN}-d256.csv"]
    assert [(r["test"], r["ms_per_token"]) for r in rows["peer-pp256.csv"]] == [("pp256", "10")]
    assert [(r["test"], r["ms_per_token"]) for r in rows[f"peer-tg{NGEN}-d256.csv"]] == [(f"tg{NGEN} @ d256", "50")]
    summary = (out / "summary.md").read_text()
    assert "From 256 tokens on, llama.cpp's prefill and decode cells come from one process" in summary
    t = tables(summary)
    prefill = next(body for title, (_, body) in t.items() if title.startswith("Prefill"))
    assert prefill[-1][0] == "256" and "2.560" in prefill[-1]   # 256 tokens at 100 t/s
