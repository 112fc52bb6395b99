"""The optimizer step against the number of ZeRO-1/2 sub-groups: does its cost grow with them?

flatgrad ZeRO-1/2 splits every param group into bucket-sized sub-groups (one
reduce_scatter each), and DeepSpeed's ``step()`` loops over param groups: an
optimizer call, a copy and an all_gather per group. With Hugging Face
Trainer's ``"auto"`` bucket (hidden^2) a 7B model would have about 400.

The model: ``--layers`` bias-free ``Linear(width, width)`` layers (400 equal
params), so that ``reduce_bucket_size`` = P / G gives exactly G sub-groups for
G in ``--sub-groups``. Per G, on the same ranks, stock DeepSpeed (one param
group whatever the bucket) and flatgrad train ``--steps`` timed steps after
``--warmup``, every engine alive at once and all taking turns step by step (so
that load and its drift fall on all alike); per step, the slowest rank's wall
time of ``engine.step()`` at the boundary (the optimizer step alone, started
together on every rank after a barrier, so that it does not absorb the ranks'
skew out of backward at its first collective), its
training-thread CPU time
(``time.thread_time``: what the step computes itself, which holds on a loaded
machine where wall time does not), the wall time of forward + backward + step,
and the collectives ``step()`` issues (a coalesced group counts once).
Figures: median and min over the timed steps, and ratios to flatgrad at G = 1
and to stock at the same G. Also run as ``python bench/zero_step.py
--sub-groups ...``. Example::

    python bench/step_sweep.py                       # G = 1, 10, 100, 400 on 2 ranks
    python bench/step_sweep.py --sub-groups 1 100 --out step_sweep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from flatgrad.bench._harness import machine_info, machine_line
from flatgrad.testing.collectives import CollectiveRecorder
from flatgrad.testing.launch import run_ranks

_SETUPS = ("stock", "flatgrad")
# The collectives step() may issue, counted once each at deepspeed.comm or torch.distributed.
_COUNTED = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "broadcast",
            "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "reduce")  # fmt: skip


class _Deep(torch.nn.Module):
    """``layers`` bias-free square linears with tanh: equal params, so buckets cut them evenly."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def _rank(rank: int, world_size: int, job: dict) -> dict:
    from flatgrad.testing.deepspeed_rank import init_deepspeed

    init_deepspeed(rank, world_size, "cpu")
    import deepspeed

    import flatgrad.deepspeed as flatgrad_ds

    width, layers = job["width"], job["layers"]
    n_params = width * width * layers
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, width, generator=generator), torch.randn(4, width, generator=generator))
               for _ in range(job["warmup"] + job["steps"])]  # fmt: skip
    import torch.distributed as torch_dist

    barrier = torch_dist.barrier  # kept before the recorder wraps anything
    recorder = CollectiveRecorder(_COUNTED).install()
    out: dict[str, Any] = {}
    engines: dict[str, Any] = {}
    try:
        # Every engine is built first, then they take turns step by step: machine load and its drift
        # fall on all of them alike, so the ratios between sub-group counts hold on a busy machine.
        for groups in job["sub_groups"]:
            bucket = n_params // groups
            for setup in _SETUPS:
                torch.manual_seed(0)
                model = _Deep(width, layers)
                cfg = {
                    "train_micro_batch_size_per_gpu": 4,
                    "gradient_accumulation_steps": 1,
                    "train_batch_size": 4 * world_size,
                    "steps_per_print": 10**9,
                    "gradient_clipping": 1.0,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
                    "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket, "allgather_bucket_size": 10**9},
                }
                initialize = deepspeed.initialize
                if setup == "flatgrad":
                    cfg["flatgrad"] = {}
                    initialize = flatgrad_ds.initialize
                key = f"{setup}/{groups}"
                engines[key] = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
                out[key] = {"sub_groups": len(engines[key].optimizer.bit16_groups), "step_s": [], "step_cpu_s": [],
                            "total_s": [], "calls": []}  # fmt: skip
        for k, (x, y) in enumerate(batches):
            for key, engine in engines.items():
                t0 = time.perf_counter()
                loss = engine(x, y)
                engine.backward(loss)
                recorder.reset()
                barrier()  # the step alone: not the ranks' skew out of backward, which its first collective absorbs
                t1, c1 = time.perf_counter(), time.thread_time()
                engine.step()
                t2, c2 = time.perf_counter(), time.thread_time()
                if k >= job["warmup"]:
                    out[key]["step_s"].append(t2 - t1)
                    out[key]["step_cpu_s"].append(c2 - c1)
                    out[key]["total_s"].append(t2 - t0)
                    out[key]["calls"].append(len(recorder.calls))
        for entry in out.values():
            entry["step_calls"] = max(entry.pop("calls"))
    finally:
        for engine in engines.values():
            engine.destroy()
        recorder.uninstall()
    return out


def _figures(per_rank: list[dict], key: str) -> dict:
    entries = [r[key] for r in per_rank]
    steps = len(entries[0]["step_s"])
    slowest = {
        name: [max(e[name][k] for e in entries) for k in range(steps)] for name in ("step_s", "step_cpu_s", "total_s")
    }
    return {
        "sub_groups": entries[0]["sub_groups"],
        "step_calls": max(e["step_calls"] for e in entries),
        **{f"{n}_median": statistics.median(v) for n, v in slowest.items()},
        **{f"{n}_min": min(v) for n, v in slowest.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sub-groups", type=int, nargs="+", default=[1, 10, 100, 400])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    info = machine_info()
    print(machine_line(info), flush=True)
    job = dict(vars(args))
    per_rank = run_ranks(_rank, args.world_size, job, timeout=3600)
    rows = {key: _figures(per_rank, key) for key in per_rank[0]}
    base = rows[f"flatgrad/{args.sub_groups[0]}"]
    print(f"\n{'setup':10} {'G':>4} {'sub-groups':>10} {'step ms (min)':>16} {'x flatgrad G=' + str(args.sub_groups[0]):>15} "
          f"{'x stock':>8} {'step CPU ms (min)':>18} {'CPU x G=' + str(args.sub_groups[0]):>10} {'x stock':>8} "
          f"{'fwd+bwd+step ms':>16} {'step calls':>10}")  # fmt: skip
    for groups in args.sub_groups:
        for setup in _SETUPS:
            r = rows[f"{setup}/{groups}"]
            stock = rows[f"stock/{groups}"]
            print(
                f"{setup:10} {groups:>4} {r['sub_groups']:>10} "
                f"{r['step_s_median'] * 1e3:8.1f} ({r['step_s_min'] * 1e3:5.1f}) "
                f"{r['step_s_median'] / base['step_s_median']:>15.2f} {r['step_s_median'] / stock['step_s_median']:>8.2f} "
                f"{r['step_cpu_s_median'] * 1e3:9.1f} ({r['step_cpu_s_min'] * 1e3:5.1f}) "
                f"{r['step_cpu_s_median'] / base['step_cpu_s_median']:>10.2f} "
                f"{r['step_cpu_s_median'] / stock['step_cpu_s_median']:>8.2f} "
                f"{r['total_s_median'] * 1e3:>16.1f} {r['step_calls']:>10}"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
