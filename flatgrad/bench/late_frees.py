"""Bytes still live when ``engine.step()`` returns that gloo's worker threads free a few milliseconds later.

A gloo collective returns before its worker thread has dropped the work's references to the
call's tensors, so a memory mark taken right after ``step()`` may count the step's last
collectives (the parameter all-gather, the norm's all_reduce) or not, run to run. Per step,
for stock DeepSpeed and flatgrad (ZeRO-2, the model and batches of the between-steps memory
test, accumulation 2): the live bytes right after ``step()`` minus those after
``MemoryCensus.settle()``; the table counts the steps by that difference. ``--busy N`` runs N
busy-looping processes beside the ranks, as a loaded CI machine would. Example::

    python bench/late_frees.py --steps 60 --busy 2
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os

import torch

from flatgrad.bench._harness import machine_info, machine_line
from flatgrad.testing.census import MemoryCensus
from flatgrad.testing.launch import run_ranks


def _rank(rank: int, world_size: int, job: dict) -> list[int]:
    from flatgrad.testing.deepspeed_rank import init_deepspeed

    init_deepspeed(rank, world_size, "cpu")
    import deepspeed

    import flatgrad.deepspeed as flatgrad_ds
    from flatgrad.planner import models

    torch.manual_seed(0)
    model = models.build("mlp", "cpu", d_in=64, hidden=96, d_out=64, layers=6)
    n = sum(p.numel() for p in model.parameters())
    dtype = torch.bfloat16 if job["dtype"] == "bf16" else torch.float32
    cfg = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4 * world_size,
        "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": n // 4, "allgather_bucket_size": 10**8},
    }  # fmt: skip
    if job["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if job["mode"] == "flatgrad":
        cfg["flatgrad"] = {"announce": False}
    initialize = flatgrad_ds.initialize if job["mode"] == "flatgrad" else deepspeed.initialize
    engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    generator = torch.Generator().manual_seed(rank)
    late = []
    with MemoryCensus("cpu") as census:
        for _ in range(2 * job["steps"]):
            x, y = torch.randn(2, 64, generator=generator), torch.randn(2, 64, generator=generator)
            engine.backward(engine(x.to(dtype), y.to(dtype)))
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                now = census.now()[0]
                late.append(now - census.settle())
    engine.destroy()
    return late


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the ranks")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        return _report(args)
    finally:
        for p in busy:
            p.terminate()


def _spin() -> None:
    while True:
        pass


def _report(args: argparse.Namespace) -> int:
    print(machine_line(machine_info()) + f"; {args.busy} busy process(es) beside the ranks", flush=True)
    print(f"{'mode':9} {'dtype':5} {'steps':>6} {'late':>5}  bytes freed after step() returned: steps")
    for mode in ("stock", "flatgrad"):
        for dtype in ("fp32", "bf16"):
            job = {"mode": mode, "dtype": dtype, "steps": args.steps}
            per_rank = run_ranks(_rank, args.world_size, job, timeout=600)
            counts = collections.Counter(b for late in per_rank for b in late if b)
            steps = sum(len(late) for late in per_rank)
            sizes = ", ".join(f"{b} B: {c}" for b, c in sorted(counts.items()))
            print(f"{mode:9} {dtype:5} {steps:>6} {sum(counts.values()):>5}  {sizes or '-'}", flush=True)
    return 0
