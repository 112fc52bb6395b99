"""``flatgrad plan``: per-backward gradient collectives of stock DeepSpeed and of flatgrad, at any world size.

No GPUs and no processes: models are built on the meta device
(``models``), DeepSpeed 0.19.8's bucketing and partitioning are replayed
(``stock``), flatgrad's are computed from its own code (``flatgrad_schedule``),
and an alpha-beta model prices every call (``cost``). ``report`` prints and
plots; ``command`` is the ``flatgrad plan`` subcommand. tests/test_planner.py
checks every schedule call for call against traces of real DeepSpeed runs.

    from flatgrad import planner
    spec = planner.models.load("gpt2-xl")
    for schedule in planner.schedules(spec, 128):
        print(schedule.name, len(schedule.calls))
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import cost, models
from .cost import CostModel
from .flatgrad_schedule import flatgrad_zero2, flatgrad_zero3
from .models import ModelSpec, describe, load
from .schedule import Collective, Schedule
from .stock import stock_zero2, stock_zero3

__all__ = [
    "Collective",
    "CostModel",
    "ModelSpec",
    "Schedule",
    "describe",
    "flatgrad_zero2",
    "flatgrad_zero3",
    "load",
    "schedules",
    "stock_zero2",
    "stock_zero3",
]


def schedules(
    spec: ModelSpec,
    world_size: int,
    *,
    stages: Sequence[int] = (2, 3),
    bucket_numel: int = 500_000_000,
    dtype: torch.dtype | None = None,
    comm_dtype: torch.dtype | None = None,
    multi_rank_modes: Sequence[bool] = (False, True),
    rank: int = 0,
) -> list[Schedule]:
    """Every schedule asked for, in report order: stock ZeRO-2 (each mode), flatgrad ZeRO-2, stock and flatgrad ZeRO-3."""
    if not stages or any(s not in (2, 3) for s in stages):
        raise ValueError(f"stages must be a non-empty selection of 2 and 3, got {list(stages)}")
    common = dict(bucket_numel=bucket_numel, dtype=dtype, comm_dtype=comm_dtype, rank=rank)
    out: list[Schedule] = []
    if 2 in stages:
        if not multi_rank_modes:
            raise ValueError("multi_rank_modes must name at least one use_multi_rank_bucket_allreduce value")
        for multi in multi_rank_modes:
            out.append(stock_zero2(spec, world_size, use_multi_rank_bucket_allreduce=multi, **common))
        out.append(flatgrad_zero2(spec, world_size, **common))
    if 3 in stages:
        out.append(stock_zero3(spec, world_size, **common))
        out.append(flatgrad_zero3(spec, world_size, **common))
    return out
