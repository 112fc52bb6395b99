"""flatgrad.check.zero_offload, the check's zero-offload step: every config's flow on one gloo rank on the CPU."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from flatgrad.check import zero_offload

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
def test_every_offload_config_matches_stock_on_cpu(tmp_path) -> None:
    """ZeRO-2 (pinned and pageable, dense and MoE) and ZeRO-3 offload, stock against flatgrad, one gloo rank."""
    out = tmp_path / "zero_offload.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.zero_offload", "--device", "cpu", "--out", str(out)],
                            capture_output=True, text=True, timeout=290, env=env)  # fmt: skip
    doc = json.loads(out.read_text())
    failed = {c["name"]: c["error"] for c in doc["configs"] if not c["ok"]}
    assert result.returncode == 0 and not failed, (failed, result.stdout[-3000:], result.stderr[-3000:])
    names = [c["name"] for c in doc["configs"]]
    assert names == [c["name"] for c in zero_offload.configs("cpu")]
    assert {"zero2-pinned-moe-fp32", "zero2-pageable-moe-fp32", "zero2-pinned-dense-bf16", "zero3-cpu-dense-fp32",
            "zero3-cpu-dense-bf16"} <= set(names)
    assert names[0].startswith("zero3-")  # the staged transfer first: what most needs a GPU
    for c in doc["configs"]:
        assert c["took_over"] is True, c["name"]
        stock, flat = c["losses"]["stock"], c["losses"]["flatgrad"]
        assert len(stock) == len(flat) == 6 and all(math.isfinite(x) for x in stock + flat), c["name"]
        assert stock[0] == flat[0], c["name"]  # the same weights and batch: the first loss is the same
        assert len(set(stock)) > 1, c["name"]  # the steps changed the weights
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is True


def test_a_loss_past_the_tolerance_or_no_takeover_fails_the_config() -> None:
    config = zero_offload.configs("cpu")[0]
    assert config["dtype"] == "fp32" and config["stage"] == 3
    stock = {"losses": [1.0, 0.5, 0.25], "peak": None}
    close = zero_offload.verdict(config, {"stock": stock, "flatgrad": {"losses": [1.0, 0.5, 0.25 * (1 + 5e-7)],
                                                                        "took_over": True}})  # fmt: skip
    assert close["ok"] and close["max_rel_diff"] == pytest.approx(5e-7)
    far = zero_offload.verdict(config, {"stock": stock, "flatgrad": {"losses": [1.0, 0.5, 0.25 * (1 + 2e-6)],
                                                                      "took_over": True}})  # fmt: skip
    assert not far["ok"]
    idle = zero_offload.verdict(config, {"stock": stock, "flatgrad": {"losses": stock["losses"], "took_over": False}})
    assert not idle["ok"] and "did not take over" in idle["error"]
    crashed = zero_offload.verdict(config, {"stock": stock, "flatgrad": {"error": "RuntimeError: boom"}})
    assert not crashed["ok"] and "flatgrad: RuntimeError: boom" in crashed["error"]
    assert zero_offload.max_rel_diff([1.0, float("nan")], [1.0, float("nan")]) == math.inf


def test_unknown_config_names_are_refused_naming_the_known_ones() -> None:
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.zero_offload", "--device", "cpu", "--configs",
                             "zero9-nonsense"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and "zero9-nonsense" in result.stderr and "zero2-pinned-dense-fp32" in result.stderr
