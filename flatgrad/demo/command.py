"""``flatgrad demo``: the seed thread's MoE model trained under stock DeepSpeed and flatgrad, side by side.

Spawns W ranks (4 CPU processes over gloo by default; on a node with 4 or
more GPUs, one rank per GPU over NCCL), trains every setup for a few steps
from the same weights on the same batches, and prints one table: gradient
reductions per backward (counted at ``deepspeed.comm``), MB sent per rank,
backward + reduction time, step time, and the largest loss difference from
stock. It writes the figures as JSON and a PNG chart (``--out-dir``).

    flatgrad demo                          # 4 CPU ranks, about a minute on 2 cores
    flatgrad demo --steps 10 --bucket 5e6 --out-dir results/
    flatgrad demo --setups flatgrad_zero2  # one setup and its stock reference
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from ..cli import positive_int as _positive_int
from . import report
from .setups import SETUPS, by_key

__all__ = ["add_arguments", "run_from_args", "choose_device"]

_EP_SIZE = 4  # the seed model's expert-parallel size: the world size must be a multiple of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` options."""
    parser.add_argument("--world-size", "-w", type=_positive_int, default=None,
                        help=f"ranks, a multiple of {_EP_SIZE} (the seed model's ep_size); default: 4 on CPU, "
                             "every GPU (rounded down to a multiple of 4) on CUDA")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu: gloo ranks; cuda: one rank per GPU over NCCL; auto: cuda with 4 or more GPUs")
    parser.add_argument("--steps", type=_positive_int, default=10,
                        help="training steps per setup (default 10; times leave out the first)")
    parser.add_argument("--micro-batch", type=_positive_int, default=8, help="samples per rank and step (default 8)")
    parser.add_argument("--bucket", type=_positive_int, default=1_000_000,
                        help="zero_optimization.reduce_bucket_size in elements, flatgrad's sub-group size as well "
                             "(default 1e6: the seed thread's small-reduce pattern). Stock ZeRO-2 allocates a "
                             "buffer of this many elements per engine and rank")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="training dtype (default fp32)")
    parser.add_argument("--setups", default=",".join(s.key for s in SETUPS),
                        help=f"comma-separated setups (each with its stock reference); default: all of "
                             f"{', '.join(s.key for s in SETUPS)}")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default 1e-4)")
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and gate noise derive from it")
    parser.add_argument("--out-dir", default="flatgrad-demo-results",
                        help="where demo.json, demo.png and the ranks' logs go (default ./flatgrad-demo-results)")
    parser.add_argument("--json", metavar="FILE", help="write the JSON here instead (default OUT_DIR/demo.json)")
    parser.add_argument("--plot", metavar="FILE.png", help="write the chart here instead (default OUT_DIR/demo.png)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds before the ranks are abandoned and killed (default 900)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)


def choose_device(device: str, world_size: int | None) -> tuple[str, int, str | None]:
    """``(device, world_size, note)`` for the options; raises ``ValueError`` naming the option on bad input."""
    import torch

    if world_size is not None and world_size % _EP_SIZE:
        raise ValueError(
            f"--world-size must be a multiple of {_EP_SIZE} (the seed model's ep_size), got {world_size}"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    note = None
    if device == "auto":
        if gpus >= _EP_SIZE:
            device = "cuda"
        else:
            device = "cpu"
            if gpus:
                note = (f"{gpus} GPU(s) found; the seed model needs a multiple of {_EP_SIZE} ranks (ep_size "
                        f"{_EP_SIZE}), one per GPU: running {world_size or 4} CPU ranks over gloo instead")  # fmt: skip
    if device == "cpu":
        return "cpu", world_size or 4, note
    if gpus == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    usable = gpus // _EP_SIZE * _EP_SIZE
    if world_size is None:
        if usable == 0:
            raise ValueError(f"--device cuda: the seed model needs a multiple of {_EP_SIZE} GPUs, found {gpus}")
        world_size = usable
        if usable != gpus:
            note = f"using {usable} of {gpus} GPUs (a multiple of {_EP_SIZE})"
    elif world_size > gpus:
        raise ValueError(f"--world-size {world_size} needs one GPU per rank; {gpus} visible")
    return "cuda", world_size, note


def _prepare_environment(device: str) -> None:
    """DeepSpeed's accelerator for the ranks (read when the forkserver imports it) and a private extensions dir."""
    os.environ["DS_ACCELERATOR"] = device
    os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), f"flatgrad-demo-extensions-{os.getuid()}")
    )


class _Progress:
    """The parent's progress bar (tqdm on stderr), fed by rank 0's messages."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                print("flatgrad demo: no progress bar (pip install tqdm)", file=sys.stderr)
            else:
                self._bar = tqdm(total=total, desc=description, unit="step", file=sys.stderr, dynamic_ncols=True)

    def __call__(self, rank: int, message: Any) -> None:
        if self._bar is None:
            return
        kind, value = message
        if kind == "phase":
            self._bar.set_description(value)
        else:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _sigterm_interrupts() -> Any:
    """While the ranks run, SIGTERM stops them like Ctrl-C does; the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _interrupt)


def _check_plot_path(args: argparse.Namespace) -> bool:
    """Whether to plot; an explicit ``--plot`` without matplotlib is an error, the default one a note."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if args.plot:
            raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
        print("flatgrad demo: no chart (pip install matplotlib)", file=sys.stderr)
        return False
    return True


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``flatgrad demo``; returns the exit status (2 on bad input, 1 when a rank fails)."""
    from ..testing import deepspeed_rank, launch
    from .train import Options, rank_main

    started = time.perf_counter()
    try:
        setups = by_key([k.strip() for k in args.setups.split(",") if k.strip()])
        if not setups:
            raise ValueError("--setups names no setup")
        device, world_size, note = choose_device(args.device, args.world_size)
        if args.fail_rank is not None and not 0 <= args.fail_rank < world_size:
            raise ValueError(f"--fail-rank {args.fail_rank} is not a rank of world size {world_size}")
        plotting = _check_plot_path(args)
    except ValueError as exc:
        print(f"flatgrad demo: error: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"flatgrad demo: {note}", file=sys.stderr)
    log_dir = os.path.join(args.out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    json_path = args.json or os.path.join(args.out_dir, "demo.json")
    plot_path = args.plot or os.path.join(args.out_dir, "demo.png")
    options = Options(
        setups=setups, steps=args.steps, micro_batch=args.micro_batch, bucket=args.bucket, dtype=args.dtype,
        lr=args.lr, seed=args.seed, device=device, log_dir=os.path.abspath(log_dir), fail_rank=args.fail_rank,
    )  # fmt: skip
    _prepare_environment(device)
    from ..bench._harness import machine_info, machine_line

    machine = machine_info()
    threads = max(1, (machine["cpus_usable"] or 1) // world_size)
    machine["torch_threads"] = threads  # per rank
    backend = "nccl" if device == "cuda" else "gloo"
    progress = _Progress(
        total=len(setups) * (1 + args.steps),
        description=f"starting {world_size} {device.upper()} ranks ({backend})",
        enabled=not args.no_progress,
    )
    previous = _sigterm_interrupts()
    try:
        per_rank = launch.run_ranks(
            rank_main, world_size, options,
            timeout=args.timeout,
            pg_timeout=timedelta(seconds=max(60.0, min(args.timeout, 600.0))),
            backend=backend,
            threads=threads,
            start_method="spawn" if device == "cuda" else "forkserver",
            preload=launch.PRELOAD + deepspeed_rank.PRELOAD + ["flatgrad.demo.train"],
            on_message=progress,
        )  # fmt: skip
    except launch.RankError as exc:
        progress.close()
        print(f"flatgrad demo: rank {exc.rank} failed (its output: {os.path.join(log_dir, f'rank{exc.rank}.log')}); "
              f"the other ranks were stopped.\n{exc.remote_traceback}", file=sys.stderr)  # fmt: skip
        return 1
    except TimeoutError as exc:
        progress.close()
        print(f"flatgrad demo: {exc} (--timeout {args.timeout:g}); the ranks were stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.close()
        print("flatgrad demo: interrupted; the ranks were stopped", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    progress.close()
    summary = report.summarize(setups, per_rank)
    machine["load_average_1min_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    wall = time.perf_counter() - started
    sys.stdout.write(report.text_table(summary, world_size, device, machine_line(machine)))
    doc = {
        "command": "flatgrad demo",
        "config": {
            "world_size": world_size, "device": device, "backend": backend, "steps": args.steps,
            "micro_batch": args.micro_batch, "bucket": args.bucket, "dtype": args.dtype, "lr": args.lr,
            "seed": args.seed, "setups": [s.key for s in setups],
        },
        "machine": machine,
        "wall_s": wall,
        "footnotes": report.footnotes(summary, world_size),
        **summary,
    }  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {json_path}")
    if plotting:
        os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
        report.plot(plot_path, summary, world_size, device)
        print(f"wrote {plot_path}")
    print(f"demo took {wall:.0f} s")
    return 0

