"""Cross-rank agreement on the buckets: every rank builds the same ones, or every rank raises.

A rank with a different layout would reduce mismatched elements or hang, so
the ranks gather a fixed-size digest and, on a difference, every rank raises
the same error. See [Note: layout agreement] in docs/design.md.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist

from .. import comm

__all__ = ["LayoutMismatchError", "agree", "agreement_device"]


class LayoutMismatchError(RuntimeError):
    """The ranks of a process group disagree on the buckets. See [Note: layout agreement]."""


def agreement_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the digest tensor lives: a CUDA device when the group's backend needs one (NCCL), else the CPU."""
    name = comm.backend_name(group, torch.device("cpu"))
    if name == "gloo":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _digest(world_size: int, description: list[tuple], failed: bool) -> torch.Tensor:
    blob = hashlib.sha256(repr((world_size, description)).encode()).digest()
    return torch.tensor([int(failed), len(description), *struct.unpack("<3q", blob[:24])], dtype=torch.int64)


def agree(
    group: dist.ProcessGroup | None,
    rank: int,
    world_size: int,
    description: list[tuple],
    local_error: Exception | None,
    device: torch.device,
) -> None:
    """Check that every rank built the same buckets; raise on every rank if not. See [Note: layout agreement]."""
    mine = _digest(world_size, description, local_error is not None).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    rows = [g.cpu() for g in gathered]
    if all(not bool(r[0]) and torch.equal(r, rows[0]) for r in rows):
        return
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, (None if local_error is None else repr(local_error), description), group=group)
    failed = [(r, err) for r, (err, _) in enumerate(everyone) if err is not None]
    if failed:
        if local_error is not None:
            return  # the caller raises this rank's own error
        r, err = failed[0]
        raise LayoutMismatchError(f"flatgrad: rank {r} failed to set up its BucketReducer: {err} (this is rank {rank})")
    raise LayoutMismatchError(_mismatch_message(rank, [d for _, d in everyone]))


def _mismatch_message(rank: int, descriptions: list[list[tuple]]) -> str:
    """Name the first bucket and param where some rank differs from rank 0."""
    base = descriptions[0]
    for other, desc in enumerate(descriptions):
        if desc == base:
            continue
        message = f"flatgrad: ranks disagree on the gradient buckets (this is rank {rank}): "
        if len(base) != len(desc):
            message += f"rank 0 has {len(base)} buckets, rank {other} has {len(desc)}; "
        return message + _first_difference(base, desc, other)
    return "flatgrad: ranks disagree on the gradient buckets (digests differ, descriptions equal)"


def _first_difference(base: list[tuple], desc: list[tuple], other: int) -> str:
    for b in range(max(len(base), len(desc))):
        if b >= len(base) or b >= len(desc):
            return f"bucket {b} exists on rank {0 if b < len(base) else other} only"
        if base[b] == desc[b]:
            continue
        *settings0, params0 = base[b]
        *settings1, params1 = desc[b]
        for i in range(min(len(params0), len(params1))):
            if params0[i] != params1[i]:
                (s0, d0), (s1, d1) = params0[i], params1[i]
                return f"bucket {b} param {i} has shape {s0} {d0} on rank 0 but shape {s1} {d1} on rank {other}"
        if len(params0) != len(params1):
            return f"bucket {b} has {len(params0)} params on rank 0 and {len(params1)} on rank {other}"
        names = ("layout", "align", "comm dtype", "reduce op", "reduce_scatter method", "reduction", "node_size")
        causes = sorted(zip(names, settings0, settings1), key=lambda row: row[0] not in ("node_size", "reduction"))
        for name, v0, v1 in causes:  # the node size and the reduction decide the op: name them first
            if v0 != v1:
                return f"bucket {b} uses {name} {v0} on rank 0 but {v1} on rank {other}"
    return f"rank 0 and rank {other} differ"
