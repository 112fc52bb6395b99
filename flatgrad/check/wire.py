"""The wire kernels on a device against the torch reference on the same device, bit for bit: the check's ``wire`` step.

Every mode of the all_to_all reduction (see ``flatgrad/kernels/wire.py``) on
every backend given (default ``cuda`` and ``triton``):

* ``exact``: ``sum_sources`` (fp32 and bf16 sources into fp32 and bf16 outputs,
  with and without accumulate and stats);
* ``int8`` / ``fp8``: ``quantize`` (with and without error feedback), the fused
  ``PackQuantizePlan`` (mixed dtypes, a missing tensor, a scale), and
  ``dequantize_sum`` (accumulate, stats), each on finite gradients and on
  gradients with NaN and inf in some blocks; ``requantize`` (qgZ's fused step
  between its stages, with and without error feedback) of those wires.

Codes, scales, residuals and outputs must equal the reference's bitwise (every
NaN counted as one, as in ``tests/test_wire.py``); stats agree as the tests'
rule says (sum of squares to fp32 rounding, the count exactly). Prints one
line per backend and mode, then one JSON line (the figures ``flatgrad check`` reads);
exit status 1 on any difference or when no backend could run.

``python -m flatgrad.check.wire [--device cuda] [--backends cuda,triton] [--quick]``
(``--device cpu --backends cpu`` runs it anywhere, as its test does).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

__all__ = ["build_parser", "run", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.wire", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where the tensors live (default cuda)")
    parser.add_argument("--backends", default="cuda,triton", help="comma-separated wire backends (default cuda,triton)")
    parser.add_argument("--quick", action="store_true", help="smaller shards")
    return parser


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, every NaN as one."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point and a.element_size() in (2, 4):
        view = {4: torch.int32, 2: torch.int16}[a.element_size()]
        nan = float("nan")
        a, b = torch.where(torch.isnan(a), nan, a).view(view), torch.where(torch.isnan(b), nan, b).view(view)
    return torch.equal(a, b)


def _stats_agree(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is b
    sum_a, sum_b = float(a.sum_sq), float(b.sum_sq)
    close = sum_a == sum_b or abs(sum_a - sum_b) <= 1e-5 * max(abs(sum_a), abs(sum_b))
    return (close or (sum_a != sum_a and sum_b != sum_b)) and bool(a.nonfinite) == bool(b.nonfinite)


def _gradients(n: int, dtype: torch.dtype, device: torch.device, seed: int, nonfinite: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 6, (n // 64 + 1,), generator=gen)).repeat_interleave(64)[:n]
    x[(torch.arange(n) // 97) % 5 == 0] = 0.0
    if nonfinite:
        for at, value in ((5, "nan"), (300, "inf"), (301, "-inf"), (700, "nan"), (701, "inf")):
            x[at % n] = float(value)
    return x.to(dtype).to(device)


def run(device: torch.device, backends: list[str], quick: bool) -> dict:
    """Every wire mode on every backend against the reference; the figures (``ok``, cases, mismatches)."""
    from flatgrad import Layout
    from flatgrad.kernels import wire
    from flatgrad.kernels.wire_reference import wire_views

    world, s = 4, (50_003 if quick else 1_000_003)  # odd: a short last block
    block = 256
    results: dict = {"device": str(device), "shard_numel": s, "world_size": world, "backends": {}}
    mismatches: list[str] = []
    for backend in backends:
        start = time.perf_counter()
        cases = 0

        def check(label: str, ok: bool) -> None:
            nonlocal cases
            cases += 1
            if not ok:
                mismatches.append(f"{backend} {label}")
                print(f"DIFF {backend} {label}", flush=True)

        try:
            for src in (torch.float32, torch.bfloat16):
                recv = _gradients(world * s, src, device, 1, False)
                for out_dtype in (torch.float32, torch.bfloat16):
                    for accumulate, stats in ((False, False), (True, True)):
                        outs, got_stats = [], []
                        for name in ("torch", backend):
                            out = torch.full((s,), 0.5, dtype=out_dtype, device=device)
                            got_stats.append(wire.sum_sources(recv, world, out, 1 / world, accumulate, backend=name,
                                                              return_stats=stats))  # fmt: skip
                            outs.append(out)
                        label = f"exact {src}->{out_dtype} accumulate={accumulate} stats={stats}"
                        check(label, _same(*outs) and _stats_agree(*got_stats))
            for kind in wire.KINDS:
                for nonfinite in (False, True):
                    for src in (torch.float32, torch.bfloat16):
                        packed = _gradients(world * s, src, device, 2, nonfinite)
                        for feedback in (False, True):
                            residual = (torch.randn(world * s, generator=torch.Generator().manual_seed(3)) * 1e-3).to(device)
                            got = []
                            for name in ("torch", backend):
                                w = torch.full((world * wire.segment_bytes(s, block),), 0xAB, dtype=torch.uint8,
                                               device=device)  # fmt: skip
                                r = residual.clone() if feedback else None
                                wire.quantize(packed, world, block, kind, w, r, backend=name)
                                values, scales = wire_views(w, world, s, block, kind)
                                out = torch.full((s,), 0.25, dtype=torch.bfloat16, device=device)
                                st = wire.dequantize_sum(w, world, block, kind, out, 1 / world, True, backend=name,
                                                         return_stats=True)  # fmt: skip
                                got.append((values.view(torch.uint8).clone(), scales.clone(), r, out, st))
                            (v0, s0, r0, o0, st0), (v1, s1, r1, o1, st1) = got
                            label = f"{kind} {src} feedback={feedback} nonfinite={nonfinite}"
                            check(f"quantize {label}", torch.equal(v0, v1) and _same(s0, s1) and _same(r0, r1))
                            check(f"dequantize_sum {label}", _same(o0, o1) and _stats_agree(st0, st1))
                        # W received segments of 3 * out_s elements requantized as 3 segments of out_s: the
                        # output blocks straddle the input ones (out_s is no multiple of the block).
                        segments, out_s = 3, s // 3
                        part = segments * out_s
                        w_in = torch.empty(world * wire.segment_bytes(part, block), dtype=torch.uint8, device=device)
                        wire.quantize(packed[: world * part], world, block, kind, w_in, backend="torch")
                        for feedback in (False, True):
                            got = []
                            for name in ("torch", backend):
                                w = torch.full((segments * wire.segment_bytes(out_s, block),), 0xAB, dtype=torch.uint8,
                                               device=device)  # fmt: skip
                                r = torch.full((segments * out_s,), 1e-3, device=device) if feedback else None
                                wire.requantize(w_in, world, block, kind, w, segments, out_s, r, backend=name)
                                values, scales = wire_views(w, segments, out_s, block, kind)
                                got.append((values.view(torch.uint8).clone(), scales.clone(), r))
                            (v0, s0, r0), (v1, s1, r1) = got
                            label = f"{kind} {src} feedback={feedback} nonfinite={nonfinite}"
                            check(f"requantize {label}", torch.equal(v0, v1) and _same(s0, s1) and _same(r0, r1))
                    numels = [world * s // 3, 17, 0, world * s - world * s // 3 - 81]
                    layout = Layout.chunked(numels, world, align=16)
                    grads = [_gradients(n, d, device, 4 + i, nonfinite) if n else None
                             for i, (n, d) in enumerate(zip(numels, (torch.bfloat16, torch.float32, torch.float16,
                                                                     torch.bfloat16)))]  # fmt: skip
                    grads[1] = None  # a missing gradient packs as zeros
                    got = []
                    for name in ("torch", backend):
                        plan = wire.PackQuantizePlan(layout, grads, block=block, kind=kind, device=device,
                                                     backend=name)  # fmt: skip
                        w = torch.full((plan.wire_bytes,), 0xAB, dtype=torch.uint8, device=device)
                        r = torch.zeros(layout.numel, device=device)
                        plan(grads, w, r, scale=0.5)
                        values, scales = wire_views(w, world, layout.shard_numel, block, kind)
                        got.append((values.view(torch.uint8).clone(), scales.clone(), r))
                    (v0, s0, r0), (v1, s1, r1) = got
                    check(f"pack_quantize {kind} nonfinite={nonfinite}",
                          torch.equal(v0, v1) and _same(s0, s1) and _same(r0, r1))  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            status = "ok"
        except Exception as exc:  # report, then go on with the next backend
            status = f"error: {type(exc).__name__}: {exc}"
            mismatches.append(f"{backend} {status}")
            print(f"FAIL {backend}: {status}", flush=True)
        seconds = time.perf_counter() - start
        results["backends"][backend] = {"cases": cases, "status": status, "seconds": round(seconds, 1)}
        print(f"{backend}: {cases} cases, {status}, {seconds:.1f} s", flush=True)
    results["mismatches"] = mismatches
    results["ok"] = not mismatches and any(b["cases"] for b in results["backends"].values())
    return results


def main(argv: list[str] | None = None) -> int:
    """Run, print the JSON line; exit status 1 on a difference or when nothing could run."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device is visible to torch"}))
        return 1
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = run(device, backends, args.quick)
    print(json.dumps(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
