"""Fused ``pack`` / ``unpack`` with one API over four backends.

Backends:
* ``torch``: the reference oracle (``reference.py``), always available.
* ``cpu``: compiled C++ (``csrc/flatgrad.cpp``), registered as ``torch.ops.flatgrad``.
* ``cuda``: compiled CUDA (``csrc/cuda/``), the same ops, one launch per call.
* ``triton``: Triton kernels (``triton_backend.py``).

The wrappers here validate arguments once, resolve the backend and dispatch
through a plan (``PackPlan`` / ``UnpackPlan``, see [Note: plans] in
docs/design.md); the backends assume valid input.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import NamedTuple, Sequence, Union

import torch

from ..layout import Layout
from . import reference
from ._backends import BACKENDS, BackendStatus, available_backends, host_backend, resolve_backend
from ._plan import DTYPES, PackPlan, UnpackPlan, check_pack_tensors, check_scale, check_tensor, overlaps

__all__ = [
    "pack", "unpack", "PackPlan", "UnpackPlan", "UnpackStats", "clear_plans", "available_backends", "BackendStatus",
    "BACKENDS", "DTYPES", "DTYPE_NAMES", "host_backend", "resolve_backend", "reference",
]  # fmt: skip

DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # config and CLI spelling


class UnpackStats(NamedTuple):
    """Statistics of the values ``unpack`` wrote, computed in the same pass.

    Attributes:
        sum_sq: 0-dim fp32 tensor, the sum of squares (for the gradient norm).
        nonfinite: 0-dim bool tensor, whether any value is inf or nan (for the overflow check).
    """

    sum_sq: torch.Tensor
    nonfinite: torch.Tensor


# The public pack and unpack keep the plans of their recent layouts, so a repeated
# call pays one C check of the tensors. See [Note: plan cache] in docs/design.md.
_PLAN_CACHE_SIZE = 32
_pack_plans: collections.OrderedDict[tuple, PackPlan] = collections.OrderedDict()
_unpack_plans: collections.OrderedDict[tuple, UnpackPlan] = collections.OrderedDict()
_plans_lock = threading.Lock()


def _cached(cache: collections.OrderedDict, key: tuple):
    plan = cache.get(key)
    if plan is not None:
        try:
            cache.move_to_end(key)
        except KeyError:  # another thread evicted it meanwhile; this call still uses the plan
            pass
    return plan


def _remember(cache: collections.OrderedDict, key: tuple, plan) -> None:
    with _plans_lock:
        cache[key] = plan
        while len(cache) > _PLAN_CACHE_SIZE:
            cache.popitem(last=False)


def clear_plans() -> None:
    """Drop the plans the public ``pack`` and ``unpack`` keep (tests, or to free their tables)."""
    with _plans_lock:
        _pack_plans.clear()
        _unpack_plans.clear()


def pack(
    tensors: Sequence[torch.Tensor | None],
    layout: Layout,
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Pack ``tensors`` into one rank-aligned buffer of ``layout.numel`` elements, in one pass.

    Copies, casts to the comm dtype (``dtype``, or ``out``'s), multiplies by
    ``scale`` and zeroes the padding. A ``None`` entry is a missing tensor: its
    range is written as zeros. Returns the buffer (``out`` if given). Repeated
    calls reuse a cached ``PackPlan`` (see [Note: plan cache]).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    key = (layout, backend, os.environ.get("FLATGRAD_BACKEND"))
    plan = _cached(_pack_plans, key)
    # Without out= or dtype= the buffer's dtype comes from the tensors; the plan's
    # is theirs as long as every slot's dtype is fixed (no None in its example).
    if plan is not None and (out is not None or dtype is not None or not plan.open_slots):
        try:
            return plan(tensors, out, scale=scale, dtype=dtype)
        except (TypeError, ValueError):
            pass  # the full checks below raise the right error, or make a plan for the new tensors
    device = _check_pack_args(tensors, layout, out, scale, dtype)
    plan = PackPlan(layout, tensors, dtype=dtype, device=device, backend=backend)
    _remember(_pack_plans, key, plan)
    return plan(tensors, out, scale=scale, dtype=dtype)


def _check_pack_args(tensors, layout, out, scale, dtype) -> torch.device:
    """Every check of ``pack``'s arguments, with errors naming the argument; returns the device."""
    check_scale(scale)
    device = None if out is None else check_tensor("out", out).device
    device, present = check_pack_tensors(
        layout, tensors, device, "pack of zero tensors (or only None) needs out= (nothing gives the device)"
    )
    if out is None:
        if dtype is None:
            dtypes = {t.dtype for _, t in present}
            if len(dtypes) != 1:
                raise ValueError(f"tensors have mixed dtypes {sorted(map(str, dtypes))}; pass dtype= for the buffer")
        elif dtype not in DTYPES:
            raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {dtype}")
    else:
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
        if out.dim() != 1 or out.numel() != layout.numel:
            raise ValueError(f"out must be 1-D with {layout.numel} elements, got shape {tuple(out.shape)}")
        for i, t in present:
            if overlaps(out, t):
                raise ValueError(f"out overlaps tensors[{i}]; pack cannot run in place")
    return device


OutArg = Union[torch.Tensor, Sequence[torch.Tensor]]


def unpack(
    shard: torch.Tensor,
    layout: Layout,
    rank: int,
    out: OutArg,
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    return_stats: bool = False,
    backend: str | None = None,
) -> UnpackStats | None:
    """Write ``rank``'s reduced shard into ``out`` with cast, scale, and copy or accumulate, in one pass.

    ``out`` is one 1-D tensor of ``layout.shard_numel`` elements, or a list with
    one tensor per ``layout.pieces(rank)`` entry (each of that piece's length).
    With ``return_stats`` returns the sum of squares and a non-finite flag of
    the values written, computed in the same pass. Repeated calls reuse a
    cached ``UnpackPlan`` (see [Note: plan cache]).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    rank = layout._check_rank(rank)
    key = (layout, rank, isinstance(out, torch.Tensor), backend, os.environ.get("FLATGRAD_BACKEND"))
    plan = _cached(_unpack_plans, key)
    if plan is None:
        _check_unpack_args(shard, layout, rank, out, scale)
    else:
        try:
            stats = plan(shard, out, scale=scale, accumulate=bool(accumulate), return_stats=bool(return_stats))
        except (TypeError, ValueError):
            _check_unpack_args(shard, layout, rank, out, scale)  # raises the right error, or the plan is replaced
            plan = None
    if plan is None:
        plan = UnpackPlan(layout, rank, out, backend=backend)
        _remember(_unpack_plans, key, plan)
        stats = plan(shard, out, scale=scale, accumulate=bool(accumulate), return_stats=bool(return_stats))
    if not return_stats:
        return None
    return UnpackStats(stats[0], stats[1] > 0)


def _check_unpack_args(shard, layout, rank, out, scale) -> None:
    """Every check of ``unpack``'s arguments, with errors naming the argument."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    rank = layout._check_rank(rank)
    check_scale(scale)
    check_tensor("shard", shard, numel=layout.shard_numel)
    if shard.dim() != 1:
        raise ValueError(f"shard must be 1-D, got shape {tuple(shard.shape)}")
    device = shard.device
    if isinstance(out, torch.Tensor):
        check_tensor("out", out, device=device, numel=layout.shard_numel)
        if out.dim() != 1:
            raise ValueError(f"out must be 1-D, got shape {tuple(out.shape)}")
        outs, per_piece = [out], False
    elif isinstance(out, Sequence):
        pieces = layout.pieces(rank)
        if len(out) != len(pieces):
            raise ValueError(f"out has {len(out)} tensors, rank {rank} owns {len(pieces)} pieces")
        for k, (o, p) in enumerate(zip(out, pieces)):
            check_tensor(f"out[{k}]", o, device=device, numel=p.length)
            if o.dtype != out[0].dtype:
                raise ValueError(f"out[{k}] has dtype {o.dtype}, out[0] has {out[0].dtype}; use one dtype")
        outs, per_piece = list(out), True
    else:
        raise TypeError(f"out must be a tensor or a list of tensors, got {type(out).__name__}")
    if per_piece:
        order = sorted(range(len(outs)), key=lambda k: (outs[k].data_ptr(), k))
        for a, b in zip(order, order[1:]):
            if overlaps(outs[a], outs[b]):
                raise ValueError(f"out[{a}] and out[{b}] overlap; every piece needs its own memory")
    for k, o in enumerate(outs):
        if overlaps(o, shard):
            raise ValueError(f"out[{k}] overlaps shard; unpack cannot run in place" if per_piece else "out overlaps shard")
