"""`still bench` sweeps: comma-separated -p/-n/-d and --attn lists, every
combination a cell; markdown, CSV and JSON output agree; ms/token is
consistent with t/s; state sizes behave per kind; bad lists are one-line
errors. Tiny sizes, one thread (fast even on a busy machine)."""
import csv
import io
import json
import math
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("STILL_BIN", str(ROOT / "build" / "still"))
MODEL = os.environ.get("STILL_MODEL", str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))

needs_model = pytest.mark.skipif(not Path(MODEL).exists(), reason="model not fetched (make model)")

FIELDS = ["model", "attn", "test", "n_prompt", "n_gen", "depth", "reps", "tps_mean", "tps_sd", "ms_per_token",
          "peak_rss_mib", "state_mib"]
SWEEP = ["-p", "16,32", "-n", "0,4", "-d", "0,64", "-r", "2", "--attn", "softmax,swa", "--window", "32", "-t", "1"]


def run(*args, timeout=300):
    return subprocess.run([BIN, *args], capture_output=True, timeout=timeout)


def bench(*args):
    p = run("bench", "-m", MODEL, *args)
    assert p.returncode == 0, p.stderr.decode()
    return p


def assert_one_line_error(p, code=None):
    assert p.returncode != 0, p
    if code is not None:
        assert p.returncode == code, p
    assert p.returncode < 128, f"killed by a signal: {p}"
    err = p.stderr.decode().strip()
    assert err and "\n" not in err, f"expected a one-line error, got {err!r}"
    assert "error" in err
    assert p.stdout == b""


def cells(rows):
    return {(r["attn"], r["test"], int(r["n_prompt"]), int(r["n_gen"]), int(r["depth"]), int(r["reps"]),
             float(r["state_mib"])) for r in rows}


@pytest.fixture(scope="module")
def sweep():
    """The same sweep as CSV and as JSON."""
    c, j = bench(*SWEEP, "--csv"), bench(*SWEEP, "--json")
    reader = csv.DictReader(io.StringIO(c.stdout.decode()))
    assert reader.fieldnames == FIELDS
    rows_csv = list(reader)
    rows_json = json.loads(j.stdout.decode())
    assert isinstance(rows_json, list) and all(list(r) == FIELDS for r in rows_json)
    return c, rows_csv, rows_json


@needs_model
def test_every_combination_is_a_cell(sweep):
    p, rows, _ = sweep
    # kinds × depths × (nonzero p + nonzero n) = 2 × 2 × (2 + 1)
    assert len(rows) == 2 * 2 * 3
    want = {(k, d, np_, ng) for k in ("softmax", "swa") for d in (0, 64)
            for np_, ng in ((16, 0), (32, 0), (0, 4))}
    assert {(r["attn"], int(r["depth"]), int(r["n_prompt"]), int(r["n_gen"])) for r in rows} == want
    # kind-major order, then depth, then the pp tests before the tg tests
    assert [r["attn"] for r in rows] == ["softmax"] * 6 + ["swa"] * 6
    assert [r["test"] for r in rows[:6]] == ["pp16", "pp32", "tg4", "pp16 @ d64", "pp32 @ d64", "tg4 @ d64"]
    assert all(r["model"] == MODEL and r["reps"] == "2" for r in rows)
    # one progress line per cell on stderr
    progress = [l for l in p.stderr.decode().splitlines() if l.startswith("still bench: [")]
    assert len(progress) == len(rows) and progress[-1].startswith("still bench: [12/12] swa tg4 @ d64")


@needs_model
def test_csv_and_json_agree(sweep):
    _, rows_csv, rows_json = sweep
    assert cells(rows_csv) == cells(rows_json)
    assert [(r["attn"], r["test"]) for r in rows_csv] == [(r["attn"], r["test"]) for r in rows_json]
    for r in rows_json:
        assert all(isinstance(r[k], int) for k in ("n_prompt", "n_gen", "depth", "reps"))
        assert all(type(r[k]) in (int, float) and math.isfinite(r[k]) for k in FIELDS[7:]), r   # %.10g: 0 is 0
        assert r["tps_mean"] > 0 and r["tps_sd"] >= 0 and r["peak_rss_mib"] > 50 and r["state_mib"] > 0


@needs_model
def test_ms_per_token_is_the_mean_of_the_repetitions(sweep):
    """ms/token = mean over the repetitions of 1000 · seconds / tokens. With
    two repetitions their t/s are mean ± sd/√2, so ms/token follows exactly
    from the reported mean and sd; it is never below 1000 / mean t/s."""
    _, rows_csv, rows_json = sweep
    for r in rows_csv + rows_json:
        mean, sd, ms = float(r["tps_mean"]), float(r["tps_sd"]), float(r["ms_per_token"])
        x1, x2 = mean + sd / math.sqrt(2), mean - sd / math.sqrt(2)
        assert ms == pytest.approx(1000 * (1 / x1 + 1 / x2) / 2, rel=1e-6), r
        assert ms >= 1000 / mean * (1 - 1e-9)


@needs_model
def test_state_sizes_per_kind(sweep):
    _, rows, _ = sweep
    state = {(r["attn"], r["test"]): float(r["state_mib"]) for r in rows}
    for t in ("pp16", "pp32", "tg4"):
        # softmax keeps every token: a deeper context needs a bigger cache
        assert state["softmax", t + " @ d64"] > state["softmax", t], state
        # swa never needs more than softmax
        for d in ("", " @ d64"):
            assert state["swa", t + d] <= state["softmax", t + d], state
    # Once the contexts are longer than the window (plus the ring's two
    # blocks of 64), swa's state is the same at every depth, softmax's grows.
    # One repetition: ms/token is then exactly 1000 / t/s.
    p = bench("-p", "8", "-n", "0", "-d", "192,448", "-r", "1", "--attn", "softmax,swa", "--window", "32", "-t", "1",
              "--json")
    rows = json.loads(p.stdout.decode())
    got = {(r["attn"], r["depth"]): r["state_mib"] for r in rows}
    assert got["swa", 192] == got["swa", 448] < got["softmax", 192] < got["softmax", 448], got
    for r in rows:
        assert r["tps_sd"] == 0 and r["ms_per_token"] == pytest.approx(1000 / r["tps_mean"], rel=1e-6), r


@needs_model
def test_markdown_table():
    """The default output: a markdown table, the model's own plan without
    --attn, the attention state in the last column."""
    p = bench("-p", "8", "-n", "2", "-r", "1", "-t", "1")
    lines = p.stdout.decode().strip().splitlines()
    assert len(lines) == 4
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[4:] == ["attn", "threads", "test", "t/s", "ms/token", "peak RSS so far", "attn state"]
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    assert [r[4] for r in rows] == ["softmax", "softmax"] and [r[5] for r in rows] == ["1", "1"]
    assert [r[6] for r in rows] == ["pp8", "tg2"]
    assert all(" ± " in r[7] and r[-1].endswith(" MiB") and r[-2].endswith(" MiB") for r in rows)


@needs_model
@pytest.mark.parametrize("args, code", [
    (["-p", "1,,2"], 2),
    (["-p", "1,"], 2),
    (["-p", "x"], 2),
    (["-p", "+5"], 2),
    (["-n", "1.5"], 2),
    (["-d", "-5"], 2),
    (["-p", "99999999999"], 2),
    (["-p", ",".join(["1"] * 17)], 2),
    (["-p", "0", "-n", "0"], 2),
    (["-p", "4194304", "-d", "1"], 2),
    (["--csv", "--json"], 2),
    (["--attn", "softmax,,swa"], 2),
    (["--attn", "softmax,nope", "-p", "4", "-n", "0", "-r", "1", "-t", "1"], 1),   # checked before any cell runs
    (["--attn", "swa,still", "--routing", "nope", "-p", "4", "-n", "0", "-r", "1", "-t", "1"], 1),
])
def test_bad_lists(args, code):
    assert_one_line_error(run("bench", "-m", MODEL, *args), code)


@needs_model
def test_other_commands_take_one_kind():
    assert_one_line_error(run("generate", "-m", MODEL, "-p", "x", "--attn", "softmax,swa"), 2)
    assert_one_line_error(run("perplexity", "-m", MODEL, "-f", "x", "--attn", "swa,"), 2)


def test_no_warmup_runs_each_test_reps_times():
    """--no-warmup (as llama-bench's) still gives one row per cell; with -r 1
    ms/token is exactly 1000 / t/s."""
    rows = list(csv.DictReader(io.StringIO(
        bench("-p", "16", "-n", "4", "-r", "1", "-t", "1", "--no-warmup", "--csv").stdout.decode())))
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert abs(float(r["ms_per_token"]) - 1000 / float(r["tps_mean"])) < 1e-6 * float(r["ms_per_token"])


@needs_model
def test_interleave_gives_the_same_cells_in_its_order():
    """--interleave: the pp tests first (per depth), then each n's tg tests at
    every depth together; the same cells (kind, test, depth, reps, state) as
    without it, state sizes per depth included, and t/s consistent with
    ms/token."""
    args = ["-p", "16", "-n", "4,6", "-d", "0,200", "-r", "2", "-t", "1", "--attn", "softmax,still", "--csv"]
    plain = list(csv.DictReader(io.StringIO(bench(*args).stdout.decode())))
    inter = list(csv.DictReader(io.StringIO(bench(*args, "--interleave").stdout.decode())))
    assert cells(inter) == cells(plain)
    assert [(r["attn"], r["test"]) for r in inter] == [
        (k, t) for k in ("softmax", "still")
        for t in ("pp16", "pp16 @ d200", "tg4", "tg4 @ d200", "tg6", "tg6 @ d200")]
    for r in inter:
        ms, tps = float(r["ms_per_token"]), float(r["tps_mean"])
        assert ms > 0 and tps > 0 and ms >= 1000 / tps * (1 - 1e-9)
    # softmax's cache grows with depth, still's state is fixed
    state = {(r["attn"], r["test"]): float(r["state_mib"]) for r in inter}
    assert state["softmax", "tg4 @ d200"] > state["softmax", "tg4"]
    assert state["still", "tg4 @ d200"] == state["still", "tg4"]


@needs_model
def test_batch_size_column_only_when_given():
    """-b N: the prefill chunk. Without it the schema is unchanged (above);
    with it the markdown table gains an n_batch column before test and CSV /
    JSON an n_batch field last, the chunk each context used (at most its
    size: a tg2 context holds 2 tokens)."""
    p = bench("-p", "40", "-n", "2", "-r", "1", "-t", "1", "-b", "16")
    lines = p.stdout.decode().strip().splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[4:8] == ["attn", "threads", "n_batch", "test"]
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]
    assert [(r[6], r[7]) for r in rows] == [("16", "pp40"), ("2", "tg2")]
    c = bench("-p", "40", "-n", "2", "-r", "1", "-t", "1", "-b", "16", "--csv")
    reader = csv.DictReader(io.StringIO(c.stdout.decode()))
    assert reader.fieldnames == FIELDS + ["n_batch"]
    assert [(r["test"], r["n_batch"]) for r in reader] == [("pp40", "16"), ("tg2", "2")]
    j = json.loads(bench("-p", "40", "-n", "0", "-r", "1", "-t", "1", "-b", "64", "--json").stdout.decode())
    assert list(j[0]) == FIELDS + ["n_batch"] and j[0]["n_batch"] == 40   # the context holds 40
    # --interleave's contexts (one per depth) report theirs too: 2 tokens at depth 0, 30 + 2 at depth 30
    j = json.loads(bench("-p", "0", "-n", "2", "-d", "0,30", "-r", "1", "-t", "1", "-b", "16", "--interleave",
                         "--json").stdout.decode())
    assert [(r["depth"], r["n_batch"]) for r in j] == [(0, 2), (30, 16)]
    # the largest chunk the option takes runs (clamped to the context)
    j = json.loads(bench("-p", "8", "-n", "0", "-r", "1", "-t", "1", "-b", "65536", "--json").stdout.decode())
    assert j[0]["n_batch"] == 8


@pytest.mark.parametrize("value", ["0", "-3", "x", "65537"])
def test_bad_batch_size(value):
    p = run("bench", "-m", MODEL, "-p", "8", "-b", value)
    assert_one_line_error(p, code=2)
    assert "-b expects an integer in [1, 65536]" in p.stderr.decode()   # refused as a -b value, not as an unknown option
