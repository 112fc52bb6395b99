"""Checkpoint saves per rank, stock DeepSpeed against flatgrad in its own layout and in stock's: ZeRO-1/2, fp32.

The question: what does ``"flatgrad": {"checkpoint_layout": "stock"}`` cost at save time? Each rank then
re-partitions its optimizer shard into stock's layout (one ``all_to_all_single`` per state tensor: the fp32
masters, Adam's two moments) before writing it, where stock and flatgrad's own layout write the partitions as
they are. Three saves of the same model, seed and data, after the same training steps:

* ``stock``: stock DeepSpeed's ``engine.save_checkpoint`` (the baseline);
* ``flatgrad``: flatgrad's default layout (its sub-groups);
* ``flatgrad->stock``: flatgrad with ``checkpoint_layout: stock``.

Per configuration: the seconds of ``engine.save_checkpoint`` (min and median over ``--repeat`` saves, the
slowest rank's), the most bytes live at once during a save above those live just before it (the counting CPU
allocator of ``MemoryCensus``: the save's own buffers; stock's and flatgrad's own layout write views of the live
partitions and make next to none), against the rank-0 shard's bytes on disk; time ratios to stock from the same
run. The stock-layout save holds the converted shard (its size again) and, for one state tensor at a time, a send
and a receive buffer of at most one partition each: with Adam in fp32, 1 + 2/3 of a shard (gloo's worker thread
can still hold the previous exchange's buffers when the next are made: up to 2 shards). The saves write into a temporary folder, removed after. Example::

    python bench/checkpoint_save.py                          # ZeRO-1 and 2, W = 2 and 4
    python bench/checkpoint_save.py --stages 2 --world-sizes 2 --width 256 --out save.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from flatgrad.bench._harness import machine_info, machine_line
from flatgrad.testing.census import MemoryCensus
from flatgrad.testing.launch import run_ranks

MODES = {"stock": None, "flatgrad": "flatgrad", "flatgrad->stock": "stock"}  # name -> flatgrad's checkpoint_layout


def _config(stage: int, world_size: int, bucket: int, layout: str | None) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 8 * world_size,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": max(bucket, 10**7)},
    }
    if layout is not None:
        cfg["flatgrad"] = {"checkpoint_layout": layout, "announce": False}
    return cfg


def _rank(rank: int, world_size: int, job: dict) -> dict:
    """Build, train and save one configuration in every mode; this rank's figures per mode."""
    from flatgrad.testing.deepspeed_rank import init_deepspeed

    init_deepspeed(rank, world_size, "cpu")
    import deepspeed
    import deepspeed.comm as dist

    import flatgrad.deepspeed as flatgrad_ds
    from flatgrad.planner import models

    width = job["width"]
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, width, generator=generator), torch.randn(8, width, generator=generator)) for _ in range(2)]
    out = {}
    for name, layout in MODES.items():
        gc.collect()
        torch.manual_seed(0)
        model = models.build("mlp", "cpu", d_in=width, hidden=width, d_out=width, layers=job["layers"])
        initialize = deepspeed.initialize if layout is None else flatgrad_ds.initialize
        cfg = _config(job["stage"], world_size, job["bucket"], layout)
        engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
        times, extra = [], []
        with MemoryCensus("cpu") as census:
            for k in range(job["repeat"] + 1):  # the first save is a warm-up
                gc.collect()
                dist.barrier()
                before = census.now()[0]
                census.reset_peak()
                start = time.perf_counter()
                engine.save_checkpoint(job["folder"], tag=f"{name}-{k}")
                seconds = time.perf_counter() - start
                if k:
                    times.append(seconds)
                    extra.append(census.now()[1] - before)
        shard = os.path.join(job["folder"], f"{name}-1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        out[name] = {
            "seconds": times, "extra_peak": max(extra), "shard_bytes": os.path.getsize(shard) if rank == 0 else 0,
            "params": sum(p.numel() for p in model.parameters()), "groups": len(engine.optimizer.bit16_groups),
        }  # fmt: skip
        engine.destroy()
        dist.barrier()
    return out


def _run(args: argparse.Namespace) -> list[dict]:
    rows = []
    n_params = args.layers * (args.width * args.width + args.width) + args.width
    bucket = max(1, n_params // 8)
    for world_size in args.world_sizes:
        for stage in args.stages:
            folder = tempfile.mkdtemp(prefix="flatgrad-save-")
            try:
                job = dict(stage=stage, width=args.width, layers=args.layers, bucket=bucket, repeat=args.repeat, folder=folder)
                results = run_ranks(_rank, world_size, job, timeout=900)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            row: dict[str, Any] = {"stage": stage, "world_size": world_size, "bucket": bucket}
            for name in MODES:
                per_rank = [r[name] for r in results]
                slowest = [max(times) for times in zip(*(r["seconds"] for r in per_rank))]
                row[name] = {
                    "min_s": min(slowest), "median_s": statistics.median(slowest),
                    "extra_peak": max(r["extra_peak"] for r in per_rank), "shard_bytes": per_rank[0]["shard_bytes"],
                    "params": per_rank[0]["params"], "groups": per_rank[0]["groups"],
                }  # fmt: skip
            rows.append(row)
            print(_table([row]).splitlines()[-1], flush=True)
    return rows


def _table(rows: list[dict]) -> str:
    head = (
        f"{'setup':12} {'mode':16} {'groups':>6} {'save min s':>10} {'median s':>9} {'x stock':>8} "
        f"{'save peak MB':>12} {'shard MB':>9} {'x shard':>8}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        base = row["stock"]
        for name in MODES:
            m = row[name]
            lines.append(
                f"ZeRO-{row['stage']} W={row['world_size']:<3} {name:16} {m['groups']:>6} {m['min_s']:>10.4f} "
                f"{m['median_s']:>9.4f} {m['median_s'] / base['median_s']:>7.2f}x {m['extra_peak'] / 1e6:>12.2f} "
                f"{m['shard_bytes'] / 1e6:>9.2f} {m['extra_peak'] / m['shard_bytes']:>7.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5, help="timed saves per mode (after one warm-up save)")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = _run(args)
    print()
    print(_table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "rows": rows}, f, indent=1)
    return 0
