"""``flatgrad plan``: the per-backward gradient collectives of stock DeepSpeed and of flatgrad, without GPUs.

Builds the model on the meta device, replays DeepSpeed 0.19.8's and flatgrad's
bucketing for every world size asked for, and prints calls, sizes, bytes per
rank, padding and a modelled time (text; ``--json`` and ``--plot`` as well).

    flatgrad plan gpt2-xl --world-size 128 1024
    flatgrad plan seed-moe --world-size 8 --bucket 1000000 --stage 2
    flatgrad plan mypackage.models:build --model-arg layers=4 --json plan.json --plot plan.png
    flatgrad plan llama-7b -w 8 128 1024 --modes            # flatgrad ZeRO-2 under every reduction mode
    flatgrad plan llama-7b -w 8 128 1024 --modes --stage 3  # flatgrad ZeRO-3 under every reduction mode
    flatgrad plan llama-7b -w 8 16 64 128 1024 --modes exact int8 --plot modes.png
    flatgrad plan gpt2-xl -w 8 64 --offload                 # host copies per backward under optimizer offload
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from ..cli import positive_int as _positive_int
from ..kernels import DTYPE_NAMES
from . import models, report, schedules
from .cost import MODES, CostModel
from .flatgrad_schedule import flatgrad_zero2, flatgrad_zero3
from .memory import gradient_path_memory
from .offload import offload_copies
from .schedule import element_size

__all__ = ["add_arguments", "run_from_args"]

_DTYPES = DTYPE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` options."""
    parser.add_argument("model", help=f"one of {', '.join(models.MODELS)}, or module:factory (a callable returning an nn.Module)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the model's factory (repeatable), e.g. n_layer=4")
    parser.add_argument("--world-size", "-w", type=_positive_int, nargs="+", default=[128, 1024],
                        help="data-parallel world sizes (default: 128 1024)")
    parser.add_argument("--bucket", type=_positive_int, default=500_000_000,
                        help="zero_optimization.reduce_bucket_size in elements (default 5e8, DeepSpeed's); "
                             "flatgrad's sub-group size as well")
    parser.add_argument("--stage", choices=("2", "3", "all"), default="all", help="ZeRO stage(s) to plan (default: all)")
    parser.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16",
                        help="training dtype of the parameters and gradients (default bf16)")
    parser.add_argument("--comm-dtype", choices=tuple(_DTYPES), default=None,
                        help="communication_data_type (default: --dtype)")
    parser.add_argument("--use-multi-rank-bucket-allreduce", choices=("true", "false", "both"), default="both",
                        help="stock ZeRO-2's mode: all_reduce per bucket (true, DeepSpeed's default) or one reduce "
                             "per destination rank (false); default: both")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose view to show (destinations, expert groups)")
    parser.add_argument("--order", choices=("auto", "trace", "reverse"), default="auto",
                        help="backward hook order: traced on the meta device (auto, when the model can run there) "
                             "or reverse registration")
    link = parser.add_argument_group("link model (alpha-beta; defaults from public nccl-tests and NCCL figures, see flatgrad/planner/cost.py)")
    defaults = CostModel()
    link.add_argument("--nvlink-busbw", type=float, default=defaults.nvlink_busbw_gbps, metavar="GB/s")
    link.add_argument("--ib-busbw", type=float, default=defaults.ib_busbw_gbps, metavar="GB/s")
    link.add_argument("--alpha-us", type=float, default=defaults.alpha_us, help="fixed latency per call")
    link.add_argument("--nvlink-hop-us", type=float, default=defaults.nvlink_hop_us, help="latency per ring step inside a node")
    link.add_argument("--ib-hop-us", type=float, default=defaults.ib_hop_us, help="latency per ring step between nodes")
    link.add_argument("--gpus-per-node", type=_positive_int, default=defaults.gpus_per_node)
    link.add_argument("--ib-nic", type=float, default=defaults.ib_nic_gbps, metavar="GB/s",
                      help="one GPU's NIC line rate: an all_to_all's traffic to other nodes goes through it")
    parser.add_argument("--modes", nargs="*", choices=MODES, metavar="MODE",
                        help="instead of the schedule table: flatgrad ZeRO-2 (--stage 3: ZeRO-3) under each reduction "
                             "mode (default: all "
                             f"of {', '.join(MODES)}), its bytes, alpha and bandwidth terms, and who wins")
    parser.add_argument("--block", type=_positive_int, default=256, help="int8/fp8 elements per scale (default 256)")
    parser.add_argument("--offload", action="store_true",
                        help="instead of the schedule table: host copies per backward under CPU optimizer offload, "
                             "stock's against flatgrad's (see [Note: offload copies])")
    parser.add_argument("--json", metavar="FILE", help="write the full report, every call included, as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="FILE.png", help="write a chart: calls, modelled time, call sizes")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``flatgrad plan``; returns the exit status (2 on bad input, with the reason on stderr)."""
    try:
        cost = CostModel(
            nvlink_busbw_gbps=args.nvlink_busbw, ib_busbw_gbps=args.ib_busbw, alpha_us=args.alpha_us,
            nvlink_hop_us=args.nvlink_hop_us, ib_hop_us=args.ib_hop_us, gpus_per_node=args.gpus_per_node,
            ib_nic_gbps=args.ib_nic,
        )  # fmt: skip
        kwargs = models.parse_model_args(args.model_arg)
        if args.modes is not None:
            return _run_modes(args, cost, kwargs)
        if args.offload:
            return _run_offload(args, kwargs)
        stages = (2, 3) if args.stage == "all" else (int(args.stage),)
        spec = models.load(args.model, order=args.order, zero3=3 in stages, **kwargs)
        modes = {"true": (True,), "false": (False,), "both": (False, True)}[args.use_multi_rank_bucket_allreduce]
        dtype = _DTYPES[args.dtype]
        comm_dtype = _DTYPES[args.comm_dtype] if args.comm_dtype else None
        runs = []
        for world_size in args.world_size:
            if not 0 <= args.rank < world_size:
                raise ValueError(f"--rank {args.rank} is not a rank of world size {world_size}")
            runs.append((world_size, schedules(
                spec, world_size, stages=stages, bucket_numel=args.bucket, dtype=dtype, comm_dtype=comm_dtype,
                multi_rank_modes=modes, rank=args.rank,
            )))  # fmt: skip
    except (ValueError, TypeError) as exc:
        print(f"flatgrad plan: error: {exc}", file=sys.stderr)
        return 2
    config = {
        "dtype": args.dtype, "comm_dtype": args.comm_dtype or args.dtype, "bucket": f"{args.bucket:,} elements",
        "rank": args.rank,
    }  # fmt: skip
    grad_bytes = element_size(dtype)
    comm_bytes = element_size(comm_dtype or dtype)
    memory = {
        (w, s.key): gradient_path_memory(s.key, spec.numel, w, args.bucket, grad_bytes, comm_bytes)
        for w, schedules_of_w in runs
        for s in schedules_of_w
        if not s.unavailable
    }
    doc = report.json_report(spec, runs, cost, config, memory)
    return _emit(
        args, doc, lambda: report.text_report(spec, runs, cost, config, memory),
        lambda path: report.plot(path, spec, runs, cost),
    )  # fmt: skip


def _emit(args: argparse.Namespace, doc: dict, text: Callable[[], str], plot: Callable[[str], None]) -> int:
    """Write the report as ``--json`` and ``--plot`` ask: JSON on stdout for ``--json -``, else the text."""
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
            print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _run_modes(args: argparse.Namespace, cost: CostModel, kwargs: dict) -> int:
    """``flatgrad plan --modes``: flatgrad ZeRO-2's backward (``--stage 3``: ZeRO-3's) under each reduction mode, per
    world size."""
    zero3 = args.stage == "3"
    spec = models.load(args.model, order=args.order, zero3=zero3, **kwargs)
    schedule = flatgrad_zero3 if zero3 else flatgrad_zero2
    dtype = _DTYPES[args.dtype]
    comm_dtype = _DTYPES[args.comm_dtype] if args.comm_dtype else None
    modes = args.modes or list(MODES)
    if "reduce_scatter" not in modes:
        modes = ["reduce_scatter", *modes]  # the baseline every ratio is against
    runs = []
    for world_size in args.world_size:
        if not 0 <= args.rank < world_size:
            raise ValueError(f"--rank {args.rank} is not a rank of world size {world_size}")
        runs.append((world_size, [
            schedule(spec, world_size, bucket_numel=args.bucket, dtype=dtype, comm_dtype=comm_dtype,
                     rank=args.rank, reduction=mode, block=args.block, gpus_per_node=cost.gpus_per_node)
            for mode in modes
        ]))  # fmt: skip
    config = {
        "dtype": args.dtype, "comm_dtype": args.comm_dtype or args.dtype, "bucket": f"{args.bucket:,} elements",
        "block": args.block, "rank": args.rank, "stage": 3 if zero3 else 2,
    }  # fmt: skip
    doc = {
        "model": {"name": spec.name, "trainable_numel": spec.numel},
        "config": config,
        "cost_model": {k: getattr(cost, k) for k in cost.__dataclass_fields__},
        "modes": report.mode_rows(runs, cost),
    }
    return _emit(
        args, doc, lambda: report.modes_text(spec, runs, cost, config),
        lambda path: report.modes_plot(path, spec, runs, cost),
    )  # fmt: skip


def _run_offload(args: argparse.Namespace, kwargs: dict) -> int:
    """``flatgrad plan --offload``: host copies of one backward at the boundary, per world size."""
    spec = models.load(args.model, order=args.order, zero3=False, **kwargs)
    rows = []
    for world_size in args.world_size:
        if not 0 <= args.rank < world_size:
            raise ValueError(f"--rank {args.rank} is not a rank of world size {world_size}")
        copies = offload_copies(spec, world_size, bucket_numel=args.bucket, rank=args.rank)
        rows.append({"world_size": world_size, **copies._asdict()})
    doc = {"model": {"name": spec.name, "trainable_numel": spec.numel}, "bucket": args.bucket, "rank": args.rank,
           "offload_copies": rows}  # fmt: skip

    def text() -> str:
        lines = [
            f"{spec.name}: {spec.numel:,} trainable elements, bucket {args.bucket:,}; host copies of rank {args.rank} "
            "in one backward at the boundary under CPU optimizer offload",
            f"{'W':>6} {'stock ZeRO-1/2':>15} {'flatgrad ZeRO-1/2 (GPU)':>24} {'stock ZeRO-3':>13} "
            f"{'flatgrad ZeRO-3 (GPU)':>22}",
        ]
        for r in rows:
            lines.append(
                f"{r['world_size']:>6} {r['stock_zero2']:>15,} {r['flatgrad_zero2']:>24,} {r['stock_zero3']:>13,} "
                f"{r['flatgrad_zero3']:>22,}"
            )
        lines.append("stock: one copy per parameter piece of the rank's partition (ZeRO-3: per parameter with data "
                     "there); flatgrad: one per bucket-sized sub-group (ZeRO-3: per bucket) on a GPU rank, none on a CPU rank, "
                     "where the unpack writes the host partitions")
        return "\n".join(lines) + "\n"

    return _emit(args, doc, text, lambda path: None)
