"""The ``flatgrad`` command line: ``flatgrad bench`` runs end to end and writes what it says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import flatgrad
from flatgrad import cli
from flatgrad.bench import pack_unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny configuration: the point is the plumbing, not the figures.
TINY = [
    "bench", "--quick", "--hidden", "32", "--layers", "1", "--small-tensors", "20",
    "--repeats", "2", "--warmup", "0", "--world-size", "4", "--device", "cpu", "--wire-numel", "4096",
]


def _cpu_backends() -> set[str]:
    return {n for n, s in flatgrad.available_backends().items() if "cpu" in s.devices and n != "triton"}


def test_bench_writes_json_with_every_row(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert cli.main([*TINY, "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"machine", "config", "buckets", "results", "skipped", "targets"} <= set(doc)
    assert doc["config"]["world_size"] == 4
    assert doc["machine"]["torch"] == torch.__version__ and doc["machine"]["cpu"]

    rows = doc["results"]
    cases = [c.name for c in pack_unpack.CASES]
    assert {(r["bucket"], r["case"]) for r in rows} == {(b, c) for b in ("transformer", "small") for c in cases}
    for (bucket, case) in {(r["bucket"], r["case"]) for r in rows}:
        group = [r for r in rows if (r["bucket"], r["case"]) == (bucket, case)]
        roles = {r["role"] for r in group}
        baselines = {"a", "b", "c", "d"} if case.startswith("pack") else {"a", "b", "d", "d'"}
        assert roles == baselines | {"flatgrad"}
        assert {r["backend"] for r in group if r["role"] == "flatgrad"} == _cpu_backends()
        roofline = next(r for r in group if r["role"] == "d")
        assert roofline["x_roofline_median"] == 1.0 and roofline["x_roofline_min"] == 1.0
    for r in rows:
        assert r["bytes"] > 0 and 0 < r["min_s"] <= r["median_s"], r
        assert r["gbps_median"] > 0 and r["gbps_min"] >= r["gbps_median"], r
        assert r["x_roofline_median"] > 0 and r["x_ds_median"] > 0, r

    # Bytes are read + written: a pack reads the unpadded tensors and writes the padded buffer.
    info = doc["buckets"]["small"]
    row = next(
        r
        for r in rows
        if (r["bucket"], r["case"], r["layout"]) == ("small", "pack fp32->bf16", "chunked")
        and r["method"] == "flatgrad.pack"
    )
    assert row["bytes"] == info["numel"] * 4 + info["chunked_numel"] * 2

    table = capsys.readouterr().out
    assert "(d) roofline copy_" in table and "(a) deepspeed zero3 cat+div" in table
    assert doc["machine"]["cpu"] in table

    # The reduction modes' W-source unpacks, against the copy roofline.
    wire = doc["wire_unpack"]
    assert (wire["numel"], wire["world"]) == (4096, 4) and wire["copy_bandwidth"] > 0
    modes = [(r["mode"], r["accumulate"]) for r in wire["rows"]]
    assert modes == [(m, a) for m in ("exact (bf16)", "int8", "fp8") for a in (False, True)]
    for r in wire["rows"]:
        assert r["bytes"] > 0 and 0 < r["seconds"] <= r["median_seconds"] and r["vs_roofline"] > 0, r
    assert "W-source unpacks of the reduction modes" in table


def test_bench_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    chart = tmp_path / "chart.png"
    assert cli.main([*TINY, "--buckets", "small", "--plot", str(chart)]) == 0
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--backends", "nope"], "--backends: unknown 'nope'"),
        (["--buckets", "huge"], "--buckets: unknown 'huge'"),
        (["--wire-numel", "-1"], "--wire-numel must be >= 0"),
    ],
)
def test_bench_bad_options_name_the_option(args, message, capsys):
    assert cli.main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_a_wrong_row_is_an_error_not_a_figure():
    good = torch.arange(8, dtype=torch.float32)
    wrong = good.clone()
    wrong[5] += 1
    method = pack_unpack._Method("broken", "flatgrad", "cpu", "flat", 64, lambda: None, lambda: wrong, expected=good)
    with pytest.raises(RuntimeError, match=r"broken \[cpu, flat\] differs from the reference, first at \[\[5\]\]"):
        pack_unpack._check(method)


def test_python_dash_m_flatgrad_lists_bench():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "flatgrad", *args]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)

    done = run("--help")
    assert done.returncode == 0, done.stderr
    assert "bench" in done.stdout
    done = run()
    assert done.returncode == 2 and "COMMAND" in done.stderr
