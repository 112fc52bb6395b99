"""flatgrad.check.zero_step, the check's zero-step step: its flow on 2 gloo CPU ranks, one spawn for every setup."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(200)
def test_zero2_and_zero3_pairs_match_stock_on_two_cpu_ranks(tmp_path) -> None:
    out = tmp_path / "zero_step.json"
    result = subprocess.run(
        [sys.executable, "-m", "flatgrad.check.zero_step", "--device", "cpu", "--world-size", "2", "--steps", "2",
         "--dtype", "fp32", "--out", str(out)],
        capture_output=True, text=True, timeout=190, env=dict(os.environ, DS_ACCELERATOR="cpu"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [p["pair"] for p in doc["pairs"]] == ["zero2", "zero3"] and all(p["losses_match"] for p in doc["pairs"])
    for key in ("stock_zero2", "flatgrad_zero2", "stock_zero3", "flatgrad_zero3"):
        setup = doc["setups"][key]
        assert setup["ok"] and len(setup["losses"]) == 2 and all(len(r) == 2 for r in setup["losses"]), (key, setup)
    assert "zero2: losses match" in result.stdout and "zero3: losses match" in result.stdout


def test_fewer_than_two_steps_are_refused() -> None:
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.zero_step", "--device", "cpu", "--steps", "1"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "--steps must be >= 2" in result.stderr
