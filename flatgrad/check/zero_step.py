"""ZeRO-2 and ZeRO-3 training steps on the visible GPUs: stock DeepSpeed against flatgrad, losses and peak memory.

The question: does flatgrad's DeepSpeed backend train the demo's models on
GPUs as stock DeepSpeed does, and what GPU memory does each take?

Pairs (``flatgrad.demo.setups``), each trained from the same weights on the
same batches, one rank per visible GPU over NCCL:

* ZeRO-2: ``stock_zero2`` against ``flatgrad_zero2`` on the seed MoE model,
  with ``ep_size = gcd(W, 4)`` so that it fits any number of GPUs (on one GPU
  every one of the 16 experts is local).
* ZeRO-3: ``stock_zero3`` against ``flatgrad_zero3`` on the demo's dense
  ZeRO-3 model (DeepSpeed 0.19 refuses its MoE under ZeRO-3).

The ranks are spawned once and build the setups' engines one after another
(imports and the process group are paid once, before the first step). Before
each setup the previous engine is destroyed and the cache emptied; the memory
figures count what is allocated above what was left
before the setup (peak stats are reset there; the figure covers building the
engine and the steps). Reported per setup: the losses of every step and rank,
the memory allocated once the engine is built (model and optimizer states), the
peak, and each step's wall time; an exception fails that setup and the next one
runs, and results arrive setup by setup, so a run cut short keeps the setups it
finished. The first step's loss depends only on the
weights; every later one depends on the updates, hence on the reduced
gradients, so ``--steps`` must be at least 2. A pair passes when the largest
relative loss difference over ranks and steps is within ``--rtol``.

    python -m flatgrad.check.zero_step --out zero_gpu.json
    python -m flatgrad.check.zero_step --steps 3 --dtype fp32
    python -m flatgrad.check.zero_step --device cpu --world-size 2   # the same flow on gloo ranks, no memory figures
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Sequence

__all__ = ["build_parser", "run", "main"]

_PAIRS = (("zero2", "stock_zero2", "flatgrad_zero2"), ("zero3", "stock_zero3", "flatgrad_zero3"))
_RTOL = {"fp32": 1e-4, "bf16": 1e-2}
_WIDTH = 1000  # the demo models' input and output width


def _model_for(pair: str, world_size: int) -> tuple[str, dict[str, Any]]:
    from flatgrad.demo.setups import DENSE

    if pair == "zero2":
        return "seed-moe", {"ep_size": math.gcd(world_size, 4)}
    return DENSE


def _setup(rank: int, world_size: int, key: str, options: dict) -> dict:
    """Build ``key``'s engine on this rank's device, train ``options["steps"]`` steps; losses, memory, times."""
    import gc

    import deepspeed
    import torch

    import flatgrad.deepspeed as flatgrad_ds
    from flatgrad.demo.setups import build_model, by_key, ds_config, make_batches
    from flatgrad.kernels import DTYPE_NAMES

    cuda = options["device"] == "cuda"

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    synchronize()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    setup = next(s for s in by_key([key]) if s.key == key)
    dtype = DTYPE_NAMES[options["dtype"]]
    cfg = ds_config(setup, world_size=world_size, micro_batch=options["micro_batch"], bucket=options["bucket"],
                    dtype=options["dtype"], lr=options["lr"])  # fmt: skip
    model = build_model(tuple(options["models"][key]), options["seed"])
    initialize = flatgrad_ds.initialize if setup.flatgrad else deepspeed.initialize
    engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    try:
        synchronize()
        built = torch.cuda.memory_allocated() - base if cuda else None
        batches = make_batches(rank, options["steps"], options["micro_batch"], _WIDTH, options["seed"])
        losses, times = [], []
        for step, batch in enumerate(batches):
            torch.manual_seed(options["seed"] + 7919 * (step + 1))  # the same gate noise for every setup
            x, y = (t.to(engine.device, dtype) for t in batch)
            synchronize()
            start = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            synchronize()
            times.append(time.perf_counter() - start)
            losses.append(loss.detach().float().item())
        return {
            "losses": losses,
            "step_s": times,
            "allocated_after_build": built,
            "max_memory_allocated": torch.cuda.max_memory_allocated() - base if cuda else None,
        }
    finally:
        engine.destroy()


def _rank(rank: int, world_size: int, keys: list[str], options: dict) -> dict[str, dict]:
    """Every setup in turn on this rank, each result also sent as it is done (an exception fails that setup only)."""
    from flatgrad.testing.deepspeed_rank import init_deepspeed
    from flatgrad.testing.launch import send_message

    init_deepspeed(rank, world_size, options["device"])
    results = {}
    for key in keys:
        try:
            results[key] = _setup(rank, world_size, key, options)
        except Exception as exc:  # noqa: BLE001 - a failed setup is a result; the others still run
            results[key] = {"error": f"{type(exc).__name__}: {exc}"}
        send_message((key, results[key]))
    return results


def _compare(stock: list[list[float]], mine: list[list[float]]) -> float:
    """The largest ``|mine - stock| / |stock|`` over ranks and steps (inf where a loss is not finite)."""
    worst = 0.0
    for stock_rank, mine_rank in zip(stock, mine):
        for a, b in zip(stock_rank, mine_rank):
            if not (math.isfinite(a) and math.isfinite(b)):
                return math.inf
            worst = max(worst, abs(b - a) / max(abs(a), 1e-30))
    return worst


def run(args: argparse.Namespace) -> dict:
    """Train every pair's two setups in turn; the JSON document (failures recorded, never raised)."""
    import torch

    from flatgrad.testing import launch

    cuda = args.device == "cuda"
    if cuda:
        world_size = torch.cuda.device_count()
        if world_size == 0:
            raise RuntimeError("--device cuda: no CUDA device is visible")
    else:
        world_size = args.world_size
        os.environ["DS_ACCELERATOR"] = "cpu"  # read by DeepSpeed when the spawned ranks import it
    rtol = args.rtol if args.rtol is not None else _RTOL[args.dtype]
    doc: dict[str, Any] = {
        "benchmark": "zero_step",
        "device": args.device,
        "world_size": world_size,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "config": {"steps": args.steps, "dtype": args.dtype, "micro_batch": args.micro_batch, "bucket": args.bucket,
                   "lr": args.lr, "seed": args.seed, "rtol": rtol},  # fmt: skip
        "setups": {},
        "pairs": [],
    }
    keys = [key for _, stock_key, flatgrad_key in _PAIRS for key in (stock_key, flatgrad_key)]
    models = {key: list(_model_for(pair, world_size)) for pair, *pair_keys in _PAIRS for key in pair_keys}
    options = {"device": args.device, "steps": args.steps, "dtype": args.dtype, "micro_batch": args.micro_batch,
               "bucket": args.bucket, "lr": args.lr, "seed": args.seed, "models": models}  # fmt: skip
    print(f"zero_step: {', '.join(keys)} on {world_size} {args.device} rank(s)", flush=True)
    arrived: dict[str, dict[int, dict]] = {key: {} for key in keys}
    started = time.perf_counter()

    def on_message(rank: int, message: tuple[str, dict]) -> None:
        key, result = message
        arrived[key][rank] = result
        if len(arrived[key]) == world_size:
            print(f"zero_step: {key} done at {time.perf_counter() - started:.1f} s", flush=True)

    failure = None
    try:
        launch.run_ranks(
            _rank, world_size, keys, options, backend="nccl" if cuda else "gloo", start_method="spawn",
            timeout=args.timeout, pg_timeout=timedelta(seconds=min(args.timeout, 120.0)), preload=[],
            on_message=on_message,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the setups not finished are failures, the finished ones stand
        failure = f"{type(exc).__name__}: {exc}"
    for key in keys:
        model = models[key]
        entry: dict[str, Any] = {"model": model[0], "model_kwargs": model[1]}
        per_rank = [arrived[key].get(r) for r in range(world_size)]
        errors = [r["error"] for r in per_rank if r is not None and "error" in r]
        if errors or any(r is None for r in per_rank):
            entry.update(ok=False, error=errors[0] if errors else f"not finished: {failure}")
        else:
            entry.update(
                ok=True,
                losses=[r["losses"] for r in per_rank],
                step_s=[r["step_s"] for r in per_rank],
                allocated_after_build=max(r["allocated_after_build"] or 0 for r in per_rank) if cuda else None,
                max_memory_allocated=max(r["max_memory_allocated"] for r in per_rank) if cuda else None,
            )
        doc["setups"][key] = entry
    for pair, stock_key, flatgrad_key in _PAIRS:
        stock, mine = doc["setups"][stock_key], doc["setups"][flatgrad_key]
        verdict: dict[str, Any] = {"pair": pair, "stock": stock_key, "flatgrad": flatgrad_key, "rtol": rtol}
        if stock["ok"] and mine["ok"]:
            diff = _compare(stock["losses"], mine["losses"])
            verdict.update(
                max_rel_loss_diff=diff,
                losses_match=diff <= rtol,
                memory_ratio=mine["max_memory_allocated"] / stock["max_memory_allocated"] if cuda else None,
            )
        else:
            verdict.update(max_rel_loss_diff=None, losses_match=False, memory_ratio=None)
        doc["pairs"].append(verdict)
    doc["ok"] = all(p["losses_match"] for p in doc["pairs"])
    return doc


def format_table(doc: dict) -> str:
    """One line per setup (losses of rank 0, memory, median step time) and one verdict per pair."""
    mib = 2**20
    lines = [f"ZeRO steps on {doc['world_size']} x {doc['gpu'] or 'CPU (gloo)'}, {doc['config']['dtype']}, "
             f"{doc['config']['steps']} steps"]  # fmt: skip
    lines.append(f"  {'setup':<16} {'model':<9} {'states MiB':>10} {'peak MiB':>9} {'step ms':>8}  losses (rank 0)")
    for key, s in doc["setups"].items():
        if not s["ok"]:
            lines.append(f"  {key:<16} {s['model']:<9} FAILED: {s['error'].splitlines()[0][:200]}")
            continue
        step_ms = statistics.median(t for rank in s["step_s"] for t in rank[1:] or rank) * 1e3
        losses = " ".join(f"{x:.6g}" for x in s["losses"][0])
        states, peak = (f"{x / mib:.1f}" if x is not None else "-" for x in
                        (s["allocated_after_build"], s["max_memory_allocated"]))  # fmt: skip
        lines.append(f"  {key:<16} {s['model']:<9} {states:>10} {peak:>9} {step_ms:>8.1f}  {losses}")
    for p in doc["pairs"]:
        if p["max_rel_loss_diff"] is None:
            lines.append(f"  {p['pair']}: not compared (a setup failed)")
            continue
        verdict = "match" if p["losses_match"] else "DIFFER"
        line = f"  {p['pair']}: losses {verdict} (max rel diff {p['max_rel_loss_diff']:.2e}, rtol {p['rtol']:g})"
        if p["memory_ratio"] is not None:
            line += f"; peak memory flatgrad/stock {p['memory_ratio']:.3f}"
        lines.append(line)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without DeepSpeed or a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.zero_step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: one NCCL rank per visible GPU (default); "
                             "cpu: --world-size gloo ranks, no memory figures")
    parser.add_argument("--world-size", type=int, default=1, help="ranks with --device cpu (default 1)")
    parser.add_argument("--steps", type=int, default=2, help="training steps per setup, >= 2 (default 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="training dtype (default bf16)")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per rank and step (default 8)")
    parser.add_argument("--bucket", type=int, default=1_000_000, help="reduce_bucket_size in elements (default 1e6)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and gate noise derive from it")
    parser.add_argument("--rtol", type=float, help="largest relative loss difference that passes "
                        f"(default {_RTOL['fp32']:g} for fp32, {_RTOL['bf16']:g} for bf16)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for all setups before the ranks are killed (default 300)")
    parser.add_argument("--out", help="write the JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print the table, write the JSON; exit status 1 when a setup failed or a pair's losses differ."""
    args = build_parser().parse_args(argv)
    if args.steps < 2:
        print("zero_step: --steps must be >= 2 (the first loss does not depend on the gradients)", file=sys.stderr)
        return 2
    try:
        doc = run(args)
    except RuntimeError as exc:
        print(f"zero_step: {exc}", file=sys.stderr)
        return 2
    print(format_table(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
