"""flatgrad.check.kernels, the check's kernels step: its CPU sweep, and its comparison catching one bit."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flatgrad.check import kernels


@pytest.mark.timeout(240)
def test_sweep_runs_on_the_cpu_backend_and_agrees_with_the_reference() -> None:
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.kernels", "--device", "cpu", "--backends", "cpu"],
                            capture_output=True, text=True, timeout=230)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ok"] and figures["failures"] == [], figures
    assert figures["backends"]["cpu"]["cases"] == figures["cases"] >= 150, figures


def test_a_backend_that_cannot_run_is_a_failure() -> None:
    doc = kernels.run(torch.device("cpu"), ["no-such-backend"], quick=True)
    assert not doc["ok"] and doc["cases"] == 0
    assert "no-such-backend: cannot run on cpu" in doc["failures"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compare_catches_one_flipped_bit(dtype: torch.dtype) -> None:
    expected = torch.linspace(-3, 3, 101).to(dtype)
    actual = expected.clone()
    bits = actual.view(torch.int32 if dtype == torch.float32 else torch.int16)
    bits[57] ^= 1  # the lowest mantissa bit of one element
    assert kernels.same_bits(expected.clone(), expected)
    assert not kernels.same_bits(actual, expected)
    assert "1 elements differ; first at 57" in kernels.first_difference(actual, expected)


def test_compare_tells_signed_zeros_apart_and_matches_any_nan() -> None:
    assert not kernels.same_bits(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    quiet, payload = torch.tensor([float("nan")]), torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert kernels.same_bits(quiet, payload)
    assert "NaN positions differ" in kernels.first_difference(torch.tensor([float("nan")]), torch.tensor([1.0]))
    assert not kernels.same_bits(torch.zeros(3), torch.zeros(3, dtype=torch.bfloat16))


def test_stats_agree_to_fp32_rounding_and_the_nonfinite_flag_exactly() -> None:
    want = torch.tensor([1000.0, 0.0])
    assert kernels.stats_agree(torch.tensor([1000.0 * (1 + 5e-6), 0.0]), want)
    assert not kernels.stats_agree(torch.tensor([1000.5, 0.0]), want)
    assert not kernels.stats_agree(torch.tensor([1000.0, 1.0]), want)
