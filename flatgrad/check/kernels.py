"""The check's ``kernels`` step: pack/unpack and their plans on each backend against the ``torch`` reference, bitwise.

A fixed, deterministic sweep (no hypothesis, no tests/): both layouts (``Layout.flat`` and
``Layout.chunked``), several world sizes and alignments, odd sizes and an empty tensor; every pair of
fp32/bf16/fp16 input and output dtypes; ``scale`` 1 and not 1; ``accumulate`` and ``return_stats``;
one tensor per output piece or one shard-sized tensor; a missing (``None``) gradient; tensors that
are misaligned views (storage offsets 1..3); a few non-finite values. Each case runs through the
public call (``flatgrad.pack`` / ``flatgrad.unpack``) and through a plan (``flatgrad.PackPlan`` /
``flatgrad.UnpackPlan``, called twice, the second time on new tensors), on the same device as the
reference. Results must equal the reference's bit for bit, except that any NaN matches any NaN (NaN
payloads are not part of the contract); stats agree to fp32 rounding (their summation order is the
backend's), the non-finite flag exactly. Prints the first differences, and the figures so far as one JSON
line after each backend (the last line has them all); exit status 1 on any difference or when a backend
cannot run.

``python -m flatgrad.check.kernels [--device cuda] [--backends cuda,triton] [--quick]``
(``--device cpu --backends cpu`` runs it anywhere, as its test does).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Iterator, Sequence

import torch

__all__ = ["build_parser", "same_bits", "first_difference", "stats_agree", "layouts", "run", "main"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SPECIALS = (float("inf"), float("-inf"), float("nan"), -0.0, 65520.0, 1e-40)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.kernels",
                                     description=(__doc__ or "").splitlines()[0])  # fmt: skip
    parser.add_argument("--device", default="cuda", help="where the tensors live (default cuda)")
    parser.add_argument("--backends", default="cuda,triton", help="comma-separated backends (default cuda,triton)")
    parser.add_argument("--quick", action="store_true", help="fewer layouts")
    return parser


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """Where ``actual`` differs from ``expected`` bitwise (any NaN matching any NaN), or None when equal."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"dtype/shape {actual.dtype} {tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    a, e = actual.reshape(-1), expected.reshape(-1)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        i = int((nan_a != nan_e).nonzero()[0])
        return f"NaN positions differ; first at {i}: {a[i].item()!r} vs {e[i].item()!r}"
    bits_a, bits_e = _bits(a).masked_fill(nan_a, 0), _bits(e).masked_fill(nan_e, 0)
    if torch.equal(bits_a, bits_e):
        return None
    differ = bits_a != bits_e
    i = int(differ.nonzero()[0])
    return f"{int(differ.sum())} elements differ; first at {i}: {a[i].item()!r} vs {e[i].item()!r}"


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise equal (so -0.0 != +0.0), except that any NaN matches any NaN."""
    return first_difference(actual, expected) is None


def stats_agree(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """``[sum_sq, nonfinite]``: the sum of squares to fp32 rounding (NaN matches NaN), the non-finite part exactly."""
    (sum_a, nonfinite_a), (sum_e, nonfinite_e) = actual.float().tolist(), expected.float().tolist()
    if (nonfinite_a > 0) != (nonfinite_e > 0):
        return False
    if sum_a != sum_a or sum_e != sum_e:
        return sum_a != sum_a and sum_e != sum_e
    return sum_a == sum_e or abs(sum_a - sum_e) <= 1e-5 * max(abs(sum_a), abs(sum_e))


def layouts(quick: bool) -> list[Any]:
    """The sweep's layouts: both kinds, world sizes 1..5, alignments 1 and 4, odd sizes, an empty tensor."""
    from flatgrad import Layout

    shapes = [
        ((7, 0, 1, 33, 1009, 2), 4, 1),
        ((4099, 13, 65537, 3), 3, 4),
        ((5, 250, 11), 1, 1),
    ]
    if not quick:
        shapes.append(((32771, 1, 127, 0, 2001, 64), 5, 4))
    return [Layout.make(kind, numels, world, align) for kind in ("flat", "chunked") for numels, world, align in shapes]


def _values(n: int, dtype: torch.dtype, device: torch.device, seed: int, offset: int) -> torch.Tensor:
    """``n`` deterministic values (a few non-finite), as a view at storage offset ``offset`` of a larger tensor."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-10, 10, (n,), generator=gen).float())
    if n:
        pool = torch.tensor(_SPECIALS)
        at = torch.randint(0, n, (max(1, n // 200),), generator=gen)
        x[at] = pool[torch.randint(0, len(pool), (len(at),), generator=gen)]
    base = torch.zeros(n + offset, dtype=dtype, device=device)
    view = base[offset:]
    view.copy_(x.to(dtype))
    return view


def _pack_cases(quick: bool) -> Iterator[dict]:
    index = 0
    for layout in layouts(quick):
        for in_dtype in _DTYPES:
            for out_dtype in _DTYPES:
                index += 1
                yield dict(layout=layout, in_dtype=in_dtype, out_dtype=out_dtype, scale=(1.0, 1 / 3, -0.5)[index % 3],
                           missing=index % 2 == 0, seed=index)  # fmt: skip


def _unpack_cases(quick: bool) -> Iterator[dict]:
    index = 0
    for layout in layouts(quick):
        for rank in sorted({0, layout.world_size - 1}):
            for shard_dtype in _DTYPES:
                for out_dtype in _DTYPES:
                    index += 1
                    yield dict(layout=layout, rank=rank, shard_dtype=shard_dtype, out_dtype=out_dtype,
                               scale=(1.0, 0.25, 1 / 3)[index % 3], accumulate=index % 2 == 1,
                               stats=index % 4 < 2, per_piece=index % 3 != 0, seed=1000 + index)  # fmt: skip


def _label(case: dict, what: str) -> str:
    layout = case["layout"]
    dtypes = [_NAMES[case[k]] for k in ("in_dtype", "shard_dtype", "out_dtype") if k in case]
    flags = [f"{k}={case[k]}" for k in ("rank", "scale", "missing", "accumulate", "stats", "per_piece") if k in case]
    return (f"{what} {layout.kind} numels={list(layout.numels)} W={layout.world_size} align={layout.align} "
            f"{'->'.join(dtypes)} {' '.join(flags)}")  # fmt: skip


def _check_pack(case: dict, backend: str, device: torch.device) -> list[str]:
    import flatgrad
    from flatgrad.kernels import reference

    layout, scale = case["layout"], case["scale"]

    def tensors() -> list[torch.Tensor | None]:
        made: list[torch.Tensor | None] = [
            _values(n, case["in_dtype"], device, case["seed"] * 64 + i, i % 4) for i, n in enumerate(layout.numels)
        ]
        if case["missing"] and len(made) > 1:
            made[1] = None  # a missing gradient packs as zeros
        return made

    first = tensors()
    expected = torch.full((layout.numel,), float("nan"), dtype=case["out_dtype"], device=device)
    reference.pack(first, layout, expected, scale)
    problems = []
    out = torch.full_like(expected, float("nan"))  # NaN-filled: padding a kernel fails to zero shows as NaN
    flatgrad.pack(first, layout, out, scale=scale, backend=backend)
    if (diff := first_difference(out, expected)) is not None:
        problems.append(f"flatgrad.pack: {diff}")
    plan = flatgrad.PackPlan(layout, first, dtype=case["out_dtype"], device=device, backend=backend)
    for call, given in enumerate((first, tensors())):  # the second call: new tensors, a new table
        out = torch.full_like(expected, float("nan"))
        plan(given, out, scale=scale)
        if (diff := first_difference(out, expected)) is not None:
            problems.append(f"PackPlan call {call + 1}: {diff}")
    return problems


def _check_unpack(case: dict, backend: str, device: torch.device) -> list[str]:
    import flatgrad
    from flatgrad.kernels import reference

    layout, rank = case["layout"], case["rank"]
    lengths = [p.length for p in layout.pieces(rank)] if case["per_piece"] else [layout.shard_numel]
    shard = _values(layout.shard_numel, case["shard_dtype"], device, case["seed"], 1 + case["seed"] % 3)
    start = [_values(n, case["out_dtype"], device, case["seed"] * 64 + k, k % 4) for k, n in enumerate(lengths)]
    flags = dict(scale=case["scale"], accumulate=case["accumulate"], return_stats=case["stats"])
    expected = [o.clone() for o in start]
    want = reference.unpack(shard, layout, rank, expected, case["per_piece"], case["scale"], case["accumulate"],
                            case["stats"])  # fmt: skip

    def outs() -> list[torch.Tensor]:
        fresh = []
        for k, o in enumerate(start):
            base = torch.empty(o.numel() + 1 + k % 3, dtype=o.dtype, device=device)
            fresh.append(base[1 + k % 3:].copy_(o))
        return fresh

    def compare(what: str, got: list[torch.Tensor], stats: torch.Tensor | None) -> list[str]:
        found = [f"{what} out[{k}]: {d}" for k, (g, e) in enumerate(zip(got, expected))
                 if (d := first_difference(g, e)) is not None]  # fmt: skip
        if case["stats"] and (stats is None or not stats_agree(stats, want)):
            found.append(f"{what} stats {None if stats is None else stats.tolist()} vs {want.tolist()}")
        return found

    problems = []
    got = outs()
    result = flatgrad.unpack(shard, layout, rank, got if case["per_piece"] else got[0], backend=backend, **flags)
    stats = None if result is None else torch.stack([result.sum_sq.float(), result.nonfinite.float()])
    problems += compare("flatgrad.unpack", got, stats)
    first = outs()
    plan = flatgrad.UnpackPlan(layout, rank, first if case["per_piece"] else first[0], backend=backend)
    for call, given in enumerate((first, outs())):
        stats = plan(shard, given if case["per_piece"] else given[0], **flags)
        problems += compare(f"UnpackPlan call {call + 1}", given, stats)
    return problems


def run(device: torch.device, backends: Sequence[str], quick: bool, progress: bool = False) -> dict:
    """Every case on every backend; the figures (cases per backend, every failure, ``ok``).

    With ``progress`` the figures so far are printed as a JSON line after each backend.
    """
    import flatgrad

    status = flatgrad.available_backends()
    doc: dict[str, Any] = {"device": str(device), "backends": {}, "cases": 0, "failures": [], "ok": False}
    for backend in backends:
        started, cases, failures = time.perf_counter(), 0, []
        s = status.get(backend)
        if s is None or not s.available or device.type not in s.devices:
            reason = "unknown backend" if s is None else (s.reason or f"does not run on {device.type} tensors")
            failures.append(f"{backend}: cannot run on {device.type}: {reason}")
        else:
            checks = [(_check_pack, c) for c in _pack_cases(quick)] + [(_check_unpack, c) for c in _unpack_cases(quick)]
            for check, case in checks:
                cases += 1
                what = "pack" if check is _check_pack else "unpack"
                try:
                    found = check(case, backend, device)
                except Exception as exc:  # noqa: BLE001 - a crash is a failed case; the sweep goes on
                    found = [f"raised {type(exc).__name__}: {exc}"]
                for problem in found:
                    failures.append(f"{backend} {_label(case, what)}: {problem}")
                    if len(failures) <= 20:
                        print(f"DIFF {failures[-1]}", flush=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        seconds = round(time.perf_counter() - started, 1)
        doc["backends"][backend] = {"cases": cases, "failures": len(failures), "seconds": seconds}
        print(f"{backend}: {cases} cases, {len(failures)} failed, {seconds} s", flush=True)
        doc["cases"] += cases
        doc["failures"] = (doc["failures"] + failures)[:100]
        doc["ok"] = not doc["failures"] and doc["cases"] > 0
        if progress:
            print(json.dumps(doc), flush=True)  # the figures so far: a run cut short keeps the backends it finished
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, print the JSON line; exit status 1 on any difference or when a backend cannot run."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "cases": 0, "failures": ["no CUDA device is visible to torch"]}))
        return 1
    doc = run(device, [b.strip() for b in args.backends.split(",") if b.strip()], args.quick, progress=True)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
