"""flatgrad.check.qgz, the check's qgz step: its CPU run, its bound failing an error above it, stock's bytes and call
sequence (on a torch stand-in for DeepSpeed's CUDA-only quantizer op), and its summary line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flatgrad.check import qgz, summary
from flatgrad.kernels import wire
from flatgrad.reducer.topology import two_stage_positions

CPU_ARGS = ("--device", "cpu", "--backends", "cpu", "--rows", "128", "--cols", "128")


@pytest.mark.timeout(120)
def test_step_runs_on_cpu_within_the_bound_and_reports_stock_as_not_measured(tmp_path) -> None:
    out = tmp_path / "qgz.json"
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.qgz", *CPU_ARGS, "--out", str(out)],
                            capture_output=True, text=True, timeout=110)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc == json.loads(out.read_text())
    assert doc["ok"] and doc["failures"] == [] and list(doc["cases"]) == ["L8xN2", "L8xN4"], doc
    assert doc["stock"]["measured"] is False
    assert "the device is cpu" in doc["stock"]["reason"] and "CUDA-only" in doc["stock"]["reason"]
    assert "stock qgZ: not measured: the device is cpu" in result.stdout
    for label, case in doc["cases"].items():
        n = case["world_size"] // 8
        s = 128 * 128 // case["world_size"]
        for mode in ("qgz_int8", "qgz_fp8"):
            entry = case["flatgrad"][mode]
            assert entry["ok"] and entry["backends"] == {"cpu": "bitwise equal to torch"}, (label, mode, entry)
            # Quantized: less exact than bf16 sums, and still a close sum.
            assert case["2d_reduce_scatter_bf16"]["rel_rms"] < entry["rel_rms"] < 0.1, (label, mode, case)
            expected = {"node": 8 * wire.segment_bytes(n * s, 256), "rail": n * wire.segment_bytes(s, 256)}
            assert case["bytes"][mode] == expected, (label, mode)
        assert case["stock_qgz_int4"]["measured"] is False
        assert case["bytes"]["2d_reduce_scatter_bf16"] == {"node": 2 * 128 * 128, "rail": 2 * n * s}


def _small_case(kind: str, local: int = 4, nodes: int = 2, numel: int = 4096) -> tuple:
    world = local * nodes
    packed = qgz.gradients(world, numel, outliers=3, seed=1).to(torch.bfloat16)
    positions = list(two_stage_positions(nodes, local))
    chain = qgz.qgz_chain(wire.wire_kernels("torch"), packed, local, nodes, 256, kind)
    exact = packed.double().sum(0).view(world, numel // world)[positions]
    return chain, exact, qgz.rounding_bound(packed, chain, local, nodes, 256, kind)


@pytest.mark.parametrize("kind", qgz.KINDS)
def test_an_error_above_the_rounding_bound_fails(kind: str) -> None:
    chain, exact, bound = _small_case(kind)
    verdict = qgz.within_bound(chain["out"], exact, bound)
    assert verdict["ok"] and 0.3 < verdict["worst_error_over_bound"] <= 1.0, verdict  # held, and not a loose bound
    out = chain["out"].clone()
    out[3, 17] = float(exact[3, 17] + 1.5 * bound[3, 17])
    verdict = qgz.within_bound(out, exact, bound)
    assert not verdict["ok"] and verdict["worst_error_over_bound"] == pytest.approx(1.5, rel=1e-6)
    out[3, 17] = float("nan")
    assert not qgz.within_bound(out, exact, bound)["ok"]


def test_the_step_fails_when_flatgrad_is_beyond_its_bound(monkeypatch) -> None:
    tight = qgz.rounding_bound
    monkeypatch.setattr(qgz, "rounding_bound", lambda *a: tight(*a) / 100)
    doc = qgz.run(torch.device("cpu"), ["cpu"], 4, [2], 64, 64)
    assert not doc["ok"]
    assert any("qgz_int8: an element beyond the wire's rounding bound" in f for f in doc["failures"]), doc["failures"]


def test_a_backend_that_differs_from_the_reference_fails(monkeypatch) -> None:
    real = wire.wire_kernels

    class OneBitOff:
        def __init__(self) -> None:
            self._k = real("torch")
            self.quantize, self.requantize = self._k.quantize, self._k.requantize

        def dequantize_sum(self, wire_in, world, block, kind, out, scale, accumulate, stats=False):
            self._k.dequantize_sum(wire_in, world, block, kind, out, scale, accumulate, stats)
            out.view(torch.int32)[5] ^= 1

    monkeypatch.setattr(wire, "wire_kernels", lambda name: OneBitOff() if name == "bad" else real(name))
    doc = qgz.run(torch.device("cpu"), ["bad", "no-such-backend"], 4, [2], 64, 64)
    assert not doc["ok"]
    assert "L4xN2 qgz_int8 bad: DIFFERS from torch" in doc["failures"], doc["failures"]
    assert any(f.startswith("backend no-such-backend: cannot run") for f in doc["failures"]), doc["failures"]


def test_stock_bytes_follow_the_shapes_of_its_code() -> None:
    # G = max(rows, cols, W) groups: int4 codes of the bucket plus a scale a group, then 1/L of both.
    big = {"node": 1024 * 1024 // 2 + 4 * 1024, "rail": 1024 * 1024 // 16 + 4 * 128}
    assert qgz.stock_bytes(8, 2, 1024, 1024) == big
    assert qgz.stock_bytes(8, 4, 16, 64) == {"node": 16 * 64 // 2 + 4 * 64, "rail": 16 * 64 // 16 + 4 * 8}
    assert qgz.bf16_bytes(8, 2, 100) == {"node": 2 * 1600, "rail": 2 * 200}


def test_stock_not_measured_names_what_is_missing(monkeypatch) -> None:
    op, reason = qgz.load_stock(torch.device("cpu"), 10)
    assert op is None and "the device is cpu" in reason
    monkeypatch.setattr(qgz.importlib.util, "find_spec", lambda name: None)
    op, reason = qgz.load_stock(torch.device("cuda"), 10)
    assert op is None and reason.startswith("no deepspeed package")


class FakeQuantizer:
    """A torch stand-in for DeepSpeed's quantizer op, its calls' contract as ``all_to_all_quant_reduce`` uses them.

    int4 symmetric per group (``q = clamp(round(x * 8 / absmax), -8, 7)``, stored scale ``absmax / 8``), two codes a
    byte; ``swizzle_quant`` puts input partition ``p`` of ``W`` at ``(p % L) * N + p // L``; ``quantized_reduction``
    sums the L received tensors and quantizes the sum in ``out_groups`` groups; ``dequantize`` is fp16.
    """

    Symmetric = 0

    @staticmethod
    def _quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = x.float().reshape(groups, -1)
        amax = g.abs().amax(1, keepdim=True)
        scale = torch.where(amax == 0, torch.ones_like(amax), 8 / amax)
        q = torch.clamp(torch.round(g * scale), -8, 7).to(torch.int8).reshape(-1, 2)
        return (q[:, 0] & 0xF) | (q[:, 1] << 4), 1 / scale

    @staticmethod
    def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        q = torch.stack([(codes << 4) >> 4, codes >> 4], 1).float().reshape(scales.shape[0], -1)
        return q * scales

    def swizzle_quant(self, x, groups, bits, kind, pipeline, nodes, local):
        codes, scales = self._quantize(x, groups)
        world = nodes * local
        at = [0] * world
        for p in range(world):
            at[(p % local) * nodes + p // local] = p
        return codes.view(world, -1)[at].reshape(-1), scales.view(world, -1)[at].reshape(-1, 1)

    def quantized_reduction(self, codes, scales, in_groups, out_groups, bits, kind, local):
        total = sum(self._values(c, s) for c, s in zip(codes.chunk(local), scales.chunk(local)))
        return self._quantize(total.reshape(-1), out_groups)

    def dequantize(self, codes, scales, groups, bits, kind):
        return self._values(codes, scales).reshape(-1).half()


@pytest.mark.parametrize("nodes", [2, 4])
def test_stock_call_sequence_ends_each_rank_with_its_partition(nodes: int) -> None:
    """Stock's sequence on the stand-in: rank r's result is partition r of the sum (an int4-close one), and the
    tensors each all_to_all sends have the bytes ``stock_bytes`` says."""
    local, rows, cols = 4, 32, 64
    world = local * nodes
    grads = qgz.gradients(world, rows * cols, outliers=0, seed=2)
    truth = grads.double().sum(0).view(world, -1)
    got = qgz.stock_qgz(FakeQuantizer(), grads, local, nodes, rows, cols)
    assert got["bytes"] == qgz.stock_bytes(local, nodes, rows, cols)
    assert got["out"].shape == truth.shape
    err = qgz.errors(got["out"], truth)["rel_rms"]
    shifted = qgz.errors(got["out"].roll(1, 0), truth)["rel_rms"]  # another rank's partition
    assert err < 0.4 < 1.0 < shifted, (err, shifted)


def test_summary_line_names_the_errors_and_stock(tmp_path) -> None:
    doc = qgz.run(torch.device("cpu"), ["cpu"], 4, [2], 64, 64, out=str(tmp_path / "qgz.json"))
    figures = summary.qgz_figures(str(tmp_path / "qgz.json"))
    line = summary.step_line({"name": "qgz", "status": "passed", "wall_s": 1.0, "figures": figures})
    assert "L4xN2: qgz_int8 rel rms" in line and "qgz_fp8 rel rms" in line
    assert "stock qgZ: not measured: the device is cpu" in line
    text = summary.summary_text(
        {
            "started": "now",
            "quick": False,
            "budget_s": 480,
            "wall_s": 1.0,
            "ok": doc["ok"],
            "steps": [{"name": "qgz", "status": "passed", "wall_s": 1.0, "figures": figures}],
        }
    )
    assert "qgZ on cpu, simulated ranks" in text and "stock_qgz_int4 not measured" in text
