"""flatgrad's qgZ against DeepSpeed's ZeRO++ qgZ on simulated ranks, error and bytes: the check's ``qgz`` step.

One bucket reduced over ``W = L x N`` ranks, every rank simulated on one device: each rank's gradient is a seeded
``randn`` of ``--rows x --cols`` elements plus a few outliers. Each all_to_all is replaced by the slicing and
stacking it does, so every kernel runs as on a real rank, on that rank's buffers:

* flatgrad ``qgz_int8`` / ``qgz_fp8`` (``QuantizedTwoStage``): the bf16 bucket in the two-stage positions,
  ``quantize`` as L segments, the node all_to_all, ``requantize`` as N segments, the rail all_to_all,
  ``dequantize_sum`` into fp32 (scale 1: the sum), with the wire kernels the reducer calls
  (``wire.wire_kernels(backend)``) on every ``--backends`` entry and on the ``torch`` reference;
* ``2d_reduce_scatter`` in bf16, the baseline: the node sums, then the rail sums, each partial rounded to bf16, in
  rank order as a ring reduce_scatter adds;
* stock qgZ (``deepspeed/runtime/comm/coalesced_collectives.py::all_to_all_quant_reduce``): ``swizzle_quant``
  (int4, symmetric, ``G = max(rows, cols, W)`` groups) of the fp16 gradient, the node all_to_all of codes and
  scales, ``quantized_reduction`` (``G / L`` groups), the rail all_to_all, ``dequantize`` and the sum of its N
  chunks over N, as its code calls them. Its ``QuantizerBuilder`` op is CUDA-only, so it runs only where
  ``QuantizerBuilder().load()`` works on a CUDA device (its JIT build runs in a child process, given
  ``--stock-timeout`` seconds); elsewhere it is reported as ``not measured`` with the reason, which is no failure.
  Stock returns the sum over N (its last divide); the check compares N times it with the sum.

Errors are against the fp64 sum of the fp32 gradients: the largest absolute error and the relative RMS error
``||out - sum|| / ||sum||`` over every rank's shard. flatgrad's part must hold the bounds the project's tests
hold it to: every backend's shards equal the ``torch`` reference chain's bitwise (``tests/test_two_stage.py``'s
qgZ replay), and every element lies within what the wire format's rounding allows of the fp64 sum of the bf16
inputs (``rounding_bound``). Bytes are each rank's all_to_all (or reduce_scatter) send buffer per stage
(``wire_bytes``, ``stock_bytes``, ``bf16_bytes``); a rank keeps 1/L (node) and 1/N (rail) of it. Prints one JSON
line and writes ``--out``; exit status 1 when flatgrad's part fails.

``python -m flatgrad.check.qgz [--device cuda] [--backends cuda,triton] [--local 8] [--nodes 2,4] [--quick]``
(``--device cpu --backends cpu --rows 128 --cols 128`` runs it anywhere, as its test does).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Sequence

import torch

from ..kernels import wire
from ..kernels.wire_reference import dequantize_sum as reference_dequantize_sum
from ..kernels.wire_reference import wire_views
from ..reducer.topology import two_stage_positions
from .summary import stock_text

__all__ = [
    "KINDS", "STOCK_FORMULA", "build_parser", "gradients", "qgz_chain", "rounding_bound", "within_bound", "errors",
    "bf16_two_stage", "wire_bytes", "stock_bytes", "bf16_bytes", "load_stock", "stock_qgz", "run", "main",
]  # fmt: skip

KINDS = ("int8", "fp8")
STOCK_FORMULA = {
    "node": "W*S/2 (int4 codes, two a byte) + 4*G (one fp32 scale a group), G = max(rows, cols, W)",
    "rail": "W*S/(2*L) + 4*G/L",
}
_FP8_HALF_ULP, _FP8_HALF_SUBNORMAL = 2.0**-4, 2.0**-10  # e4m3fn: 3 mantissa bits, subnormal spacing 2^-9
_EPS32 = torch.finfo(torch.float32).eps
_LOAD = "from deepspeed.ops.op_builder import QuantizerBuilder; QuantizerBuilder().load()"


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.qgz", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="where the simulated ranks' tensors live (default cuda)")
    parser.add_argument("--backends", default="cuda,triton", help="comma-separated wire backends (default cuda,triton)")
    parser.add_argument("--local", type=int, default=8, help="L, ranks per node (default 8)")
    parser.add_argument("--nodes", default="2,4", help="comma-separated N, nodes, one case each (default 2,4)")
    parser.add_argument("--rows", type=int, default=1024, help="the bucket's rows (stock's qgZ takes a 2-D gradient)")
    parser.add_argument("--cols", type=int, default=1024, help="the bucket's columns (numel = rows x cols per rank)")
    parser.add_argument("--block", type=int, default=256, help="flatgrad's wire block (default 256)")
    parser.add_argument("--outliers", type=int, default=4, help="outliers per rank's gradient (default 4)")
    parser.add_argument("--stock-timeout", type=float, default=300.0,
                        help="seconds for QuantizerBuilder().load(), its JIT build included (default 300)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a quarter of the elements")
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    return parser


def gradients(world: int, numel: int, outliers: int, seed: int = 0) -> torch.Tensor:
    """``[W, numel]`` fp32: seeded ``randn`` per rank, with ``outliers`` elements of each row at +-64."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(world, numel, generator=gen)
    if outliers:
        at = torch.randint(0, numel, (world, outliers), generator=gen)
        sign = torch.randint(0, 2, (world, outliers), generator=gen).float() * 2 - 1
        g.scatter_(1, at, 64.0 * sign)
    return g


def qgz_chain(kernels: Any, packed: torch.Tensor, local: int, nodes: int, block: int, kind: str) -> dict:
    """flatgrad's qgZ on ``W`` simulated ranks: ``packed[r]`` is rank ``r``'s bucket in the two-stage positions.

    Returns every rank's wires (``node_send``, ``node_recv``, ``rail_send``, rows by rank) and its fp32 shard
    (``out[r]``, the sum over ranks of position ``positions[r]``).
    """
    world, numel = packed.shape
    s = numel // world
    node_seg, rail_seg = wire.segment_bytes(nodes * s, block), wire.segment_bytes(s, block)
    u8: dict[str, Any] = {"dtype": torch.uint8, "device": packed.device}
    node_send = torch.empty(world, local * node_seg, **u8)
    for r in range(world):
        kernels.quantize(packed[r], local, block, kind, node_send[r], None)
    # Node all_to_all: rank n*L+j receives segment j of each node peer n*L+i, in peer order.
    node_recv = node_send.view(nodes, local, local, node_seg).transpose(1, 2).contiguous().view(world, -1)
    rail_send = torch.empty(world, nodes * rail_seg, **u8)
    for r in range(world):
        kernels.requantize(node_recv[r], local, block, kind, rail_send[r], nodes, s, None)
    # Rail all_to_all: rank m*L+j receives segment m of each rail peer n*L+j, in node order.
    rail_recv = rail_send.view(nodes, local, nodes, rail_seg).permute(2, 1, 0, 3).contiguous().view(world, -1)
    out = torch.empty(world, s, dtype=torch.float32, device=packed.device)
    for r in range(world):
        kernels.dequantize_sum(rail_recv[r], nodes, block, kind, out[r], 1.0, False)
    return {"node_send": node_send, "node_recv": node_recv, "rail_send": rail_send, "out": out}


def _allowance(x: torch.Tensor, scales: torch.Tensor, block: int, kind: str) -> torch.Tensor:
    """Per element of ``x`` (fp64, ``[segments, S]``), the most its quantization with ``scales`` can move it.

    int8: half a step (round to nearest; |x| / scale <= 127, so the clamp moves nothing). fp8 e4m3fn: half an ulp
    of ``x / scale``, at most ``2^-4 |y|``, or ``2^-10`` among the subnormals, times the scale.
    """
    sc = scales.double().repeat_interleave(block, dim=1)[:, : x.shape[1]]
    return sc / 2 if kind == "int8" else _FP8_HALF_ULP * x.abs() + _FP8_HALF_SUBNORMAL * sc


def rounding_bound(packed: torch.Tensor, chain: dict, local: int, nodes: int, block: int, kind: str) -> torch.Tensor:
    """``[W, S]`` fp64: per element of each rank's shard, the most the wire's rounding lets it differ from the sum.

    The node quantize's rounding of every rank's element, plus the requantize's of every node partial (both read
    from the scales on the wires), plus fp32 rounding: each of the sums (L terms, then N) and the products of the
    dequantize within ``2 (L + N) eps32`` of the sum of the magnitudes of every term, as ``tests/test_two_stage.py``
    bounds fp32 sums.
    """
    world, numel = packed.shape
    s = numel // world
    part = nodes * s
    x = packed.double()
    first = torch.zeros(numel, dtype=torch.float64, device=packed.device)
    second = torch.zeros_like(first)
    magnitude = x.abs().sum(0)
    for r in range(world):
        _, scales = wire_views(chain["node_send"][r], local, part, block, kind)
        first += _allowance(x[r].view(local, part), scales, block, kind).view(-1)
    for r in range(world):  # rank n*L+j's node partial covers positions j*N .. j*N+N-1
        j = r % local
        partial = torch.empty(part, dtype=torch.float32, device=packed.device)
        reference_dequantize_sum(chain["node_recv"][r], local, block, kind, partial, 1.0, False)
        _, scales = wire_views(chain["rail_send"][r], nodes, s, block, kind)
        allowed = _allowance(partial.double().view(nodes, s), scales, block, kind).view(-1)
        second[j * part : (j + 1) * part] += allowed
        magnitude[j * part : (j + 1) * part] += partial.double().abs() + allowed
    magnitude += first
    total = first + second + 2 * (local + nodes) * _EPS32 * magnitude
    return total.view(world, s)[list(two_stage_positions(nodes, local))]


def within_bound(out: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> dict[str, Any]:
    """Whether every ``|out - exact| <= bound`` (NaN fails), and the worst ratio of error to bound."""
    error = (out.double() - exact.double()).abs()
    ok = bool((error <= bound).all())
    worst = float((error / bound.clamp_min(torch.finfo(torch.float64).tiny)).max()) if error.numel() else 0.0
    return {"ok": ok, "worst_error_over_bound": worst}


def errors(out: torch.Tensor, truth: torch.Tensor) -> dict[str, float]:
    """The largest absolute error and ``||out - truth|| / ||truth||`` (fp64)."""
    diff = out.double() - truth
    return {"max_abs": float(diff.abs().max()), "rel_rms": float(diff.norm() / truth.norm())}


def bf16_two_stage(grads: torch.Tensor, local: int, nodes: int) -> torch.Tensor:
    """``[W, S]``: rank r's shard under bf16 ``2d_reduce_scatter``, node sums then rail sums, each rounded to bf16."""
    world, numel = grads.shape
    g = grads.to(torch.bfloat16).view(nodes, local, world, numel // world)
    node = g[:, 0]
    for i in range(1, local):
        node = node + g[:, i]
    total = node[0]
    for n in range(1, nodes):
        total = total + node[n]
    return total


def wire_bytes(local: int, nodes: int, s: int, block: int) -> dict[str, int]:
    """flatgrad qgZ's send buffer per rank: L segments of ``N * S`` elements (node), N of ``S`` (rail)."""
    return {"node": local * wire.segment_bytes(nodes * s, block), "rail": nodes * wire.segment_bytes(s, block)}


def stock_bytes(local: int, nodes: int, rows: int, cols: int) -> dict[str, int]:
    """Stock qgZ's send buffers per rank (``STOCK_FORMULA``), from the shapes ``all_to_all_quant_reduce`` makes."""
    world, numel = local * nodes, rows * cols
    groups = max(rows, cols, world)
    return {"node": numel // 2 + 4 * groups, "rail": numel // (2 * local) + 4 * (groups // local)}


def bf16_bytes(local: int, nodes: int, s: int) -> dict[str, int]:
    """bf16 ``2d_reduce_scatter``'s reduce_scatter inputs per rank: the bucket (node), its node chunk (rail)."""
    return {"node": 2 * local * nodes * s, "rail": 2 * nodes * s}


def load_stock(device: torch.device, timeout: float) -> tuple[Any, str]:
    """DeepSpeed's quantizer op, or None and why it cannot be had here.

    The first ``QuantizerBuilder().load()`` compiles the op; it runs in a child process given ``timeout`` seconds
    (SIGINT first, so that torch's build lock is released and ninja keeps what it compiled), then the cached op
    is loaded here.
    """
    if importlib.util.find_spec("deepspeed") is None:
        return None, "no deepspeed package (pip install deepspeed==0.19.8, or carry .whl/ as bench/gpu_check.sh does)"
    if device.type != "cuda":
        return None, (f"the device is {device.type}: DeepSpeed's QuantizerBuilder op (swizzle_quant, "
                      "quantized_reduction, dequantize) is CUDA-only")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", _LOAD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGINT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.communicate(timeout=10)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        return None, (
            f"QuantizerBuilder().load() (its JIT build) did not finish within {timeout:g} s; what ninja "
            "compiled stays in TORCH_EXTENSIONS_DIR, so a rerun with a larger --stock-timeout goes on"
        )
    if proc.returncode != 0:
        last = next((line for line in reversed(output.strip().splitlines()) if line.strip()), "")
        return None, f"QuantizerBuilder().load() failed (exit {proc.returncode}): {last[:300]}"
    try:
        from deepspeed.ops.op_builder import QuantizerBuilder

        return QuantizerBuilder().load(), ""
    except Exception as exc:  # reported, not raised: stock's part is optional
        return None, f"QuantizerBuilder().load() failed: {type(exc).__name__}: {exc}"[:400]


def stock_qgz(op: Any, grads: torch.Tensor, local: int, nodes: int, rows: int, cols: int) -> dict:
    """Stock qgZ on ``W`` simulated ranks, calling its op as ``all_to_all_quant_reduce`` does.

    Rank ``r`` (node ``r // L``) ends with partition ``r`` of the gradient; ``out[r]`` is N times what stock
    returns (the sum), fp32. Also the bytes of the tensors each all_to_all sent.
    """
    world = local * nodes
    groups = max(rows, cols, world)
    x = grads.to(torch.float16).view(world, rows, cols)
    sent = [op.swizzle_quant(x[r], groups, 4, op.Symmetric, 1, nodes, local) for r in range(world)]
    reduced = []
    for r in range(world):
        n, j = divmod(r, local)
        codes = torch.cat([sent[n * local + i][0].chunk(local)[j] for i in range(local)])
        scales = torch.cat([sent[n * local + i][1].chunk(local)[j] for i in range(local)])
        reduced.append(op.quantized_reduction(codes, scales, groups, groups // local, 4, op.Symmetric, local))
    out = []
    for r in range(world):
        m, j = divmod(r, local)
        codes = torch.cat([reduced[n * local + j][0].chunk(nodes)[m] for n in range(nodes)])
        scales = torch.cat([reduced[n * local + j][1].chunk(nodes)[m] for n in range(nodes)])
        final = op.dequantize(codes, scales, scales.numel(), 4, op.Symmetric)
        out.append((sum(list(final.chunk(nodes))) / nodes).view(-1).float() * nodes)
    nbytes = {
        "node": sent[0][0].numel() * sent[0][0].element_size() + sent[0][1].numel() * 4,
        "rail": reduced[0][0].numel() * reduced[0][0].element_size() + reduced[0][1].numel() * 4,
    }
    return {"out": torch.stack(out), "bytes": nbytes}


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _case(device: torch.device, local: int, nodes: int, rows: int, cols: int, outliers: int) -> tuple:
    """One case's gradients (``[W, numel]`` fp32 on ``device``) and the fp64 sum of each rank's shard."""
    world, numel = local * nodes, rows * cols
    grads = gradients(world, numel, outliers, seed=nodes).to(device)
    return grads, grads.double().sum(0).view(world, numel // world)


def _flatgrad_case(grads: torch.Tensor, truth: torch.Tensor, chains: dict, local: int, nodes: int, block: int,
                   label: str, failures: list[str]) -> dict[str, Any]:  # fmt: skip
    """flatgrad's qgZ modes (each backend bitwise against the torch chain, the chain within the rounding bound)."""
    world, numel = grads.shape
    s = numel // world
    positions = list(two_stage_positions(nodes, local))
    order = [0] * world  # the pack: position positions[r] holds natural shard r
    for r, p in enumerate(positions):
        order[p] = r
    packed = grads.to(torch.bfloat16).view(world, world, s)[:, order].reshape(world, numel)
    exact = packed.double().sum(0).view(world, s)[positions]
    reference = wire.wire_kernels("torch")
    found: dict[str, Any] = {}
    for kind in KINDS:
        mode = f"qgz_{kind}"
        chain = qgz_chain(reference, packed, local, nodes, block, kind)
        verdict = within_bound(chain["out"], exact, rounding_bound(packed, chain, local, nodes, block, kind))
        entry = {**errors(chain["out"], truth), **verdict, "backends": {}}
        if not verdict["ok"]:
            failures.append(f"{label} {mode}: an element beyond the wire's rounding bound "
                            f"({verdict['worst_error_over_bound']:.3g} x)")  # fmt: skip
        for name, kernels in chains.items():
            try:
                same = _bitwise(qgz_chain(kernels, packed, local, nodes, block, kind)["out"], chain["out"])
            except Exception as exc:  # reported, then the next backend
                same, entry["backends"][name] = False, f"error: {type(exc).__name__}: {exc}"
            else:
                entry["backends"][name] = "bitwise equal to torch" if same else "DIFFERS from torch"
            if not same:
                failures.append(f"{label} {mode} {name}: {entry['backends'][name]}")
        found[mode] = entry
    return found


def _write(doc: dict, out: str) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


def run(device: torch.device, backends: Sequence[str], local: int, nodes_list: Sequence[int], rows: int, cols: int,
        block: int = 256, outliers: int = 4, stock_timeout: float = 300.0, out: str = "") -> dict:  # fmt: skip
    """Every case (one per N): flatgrad's qgZ and bf16 ``2d_reduce_scatter`` first, then stock qgZ where it loads.

    ``out`` (if given) is written once flatgrad's part is done and again at the end, so that a step stopped
    while stock's op builds keeps flatgrad's figures.
    """
    numel = rows * cols
    doc: dict[str, Any] = {
        "device": str(device), "local_size": local, "bucket": {"rows": rows, "cols": cols, "numel": numel},
        "block": block, "outliers_per_rank": outliers, "stock_formula": STOCK_FORMULA, "cases": {}, "failures": [],
        "stock": {"measured": False, "reason": "not reached"},
    }  # fmt: skip
    failures: list[str] = doc["failures"]
    chains: dict[str, Any] = {}
    for name in backends:
        try:
            chains[name] = wire.wire_kernels(name)
        except Exception as exc:  # reported: a backend that cannot run fails the step
            failures.append(f"backend {name}: cannot run: {type(exc).__name__}: {exc}")
    for nodes in nodes_list:
        world, label = local * nodes, f"L{local}xN{nodes}"
        if numel % world or (numel // world) % 2:
            failures.append(f"{label}: {numel} elements do not split into {world} even shards")
            continue
        start = time.perf_counter()
        s = numel // world
        grads, truth = _case(device, local, nodes, rows, cols, outliers)
        case: dict[str, Any] = {"world_size": world, "shard_numel": s}
        case["flatgrad"] = _flatgrad_case(grads, truth, chains, local, nodes, block, label, failures)
        case["2d_reduce_scatter_bf16"] = errors(bf16_two_stage(grads, local, nodes), truth)
        case["bytes"] = {
            "qgz_int8": wire_bytes(local, nodes, s, block), "qgz_fp8": wire_bytes(local, nodes, s, block),
            "stock_qgz_int4": stock_bytes(local, nodes, rows, cols),
            "2d_reduce_scatter_bf16": bf16_bytes(local, nodes, s),
        }  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        case["seconds"] = round(time.perf_counter() - start, 2)
        doc["cases"][label] = case
    doc["ok"] = not failures and bool(doc["cases"])
    _write(doc, out)
    op, reason = load_stock(device, stock_timeout)
    doc["stock"] = {"measured": op is not None, "reason": reason}
    for label, case in doc["cases"].items():
        if op is None:
            case["stock_qgz_int4"] = {"measured": False, "reason": reason}
            continue
        nodes = case["world_size"] // local
        grads, truth = _case(device, local, nodes, rows, cols, outliers)
        try:
            stock = stock_qgz(op, grads, local, nodes, rows, cols)
            case["stock_qgz_int4"] = {
                "measured": True,
                **errors(stock["out"], truth),
                "sent_bytes": stock["bytes"],
                "bytes_match_formula": stock["bytes"] == case["bytes"]["stock_qgz_int4"],
            }
        except Exception as exc:  # stock's part is optional: reported, not a failure
            case["stock_qgz_int4"] = {"measured": False, "reason": f"{type(exc).__name__}: {exc}"[:400]}
    doc["stock"]["measured"] = any(c.get("stock_qgz_int4", {}).get("measured") for c in doc["cases"].values())
    _write(doc, out)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print a line per case and the JSON line; exit status 1 when flatgrad's part fails."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device is visible to torch"}))
        return 1
    rows, cols = (args.rows // 2, args.cols // 2) if args.quick else (args.rows, args.cols)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
    doc = run(device, backends, args.local, nodes, rows, cols, args.block, args.outliers, args.stock_timeout, args.out)
    for label, case in doc["cases"].items():
        fg = case["flatgrad"]
        print(
            f"{label}: "
            + ", ".join(
                f"{m} rel rms {e['rel_rms']:.2e} (bound {'ok' if e['ok'] else 'EXCEEDED'})" for m, e in fg.items()
            )
            + f", bf16 2d_reduce_scatter rel rms {case['2d_reduce_scatter_bf16']['rel_rms']:.2e}",
            flush=True,
        )
    print(stock_text(doc), flush=True)
    for failure in doc["failures"]:
        print(f"FAIL {failure}", flush=True)
    print(json.dumps(doc))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
