"""The gradients' collectives: one reduce_scatter (or all_to_all) per bucket, its method, averaging, async handles.

Module-level functions; the process group is always passed in explicitly
(``None`` means the default group). Streams are the caller's: a collective is
issued on the current stream, and the caller waits on its ``Work`` where it
needs the result. Every call goes through a ``Collectives``, so that a
framework can route it (see [Note: collectives seam]).

``torch.distributed`` spells one reduce_scatter two ways; ``"auto"`` takes
gloo's own (the list form) on gloo and the tensor form elsewhere. See [Note:
reduce_scatter method] in docs/design.md.

Averaging uses ``ReduceOp.AVG`` where the backend has it for the dtype, and
otherwise folds ``1/W`` into the scales the fused kernels apply anyway, so it
never costs a pass of its own. See [Note: averaging] in docs/design.md.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from .backend import backend_name
from .collectives import TORCH_COLLECTIVES, Collectives

__all__ = [
    "Averaging",
    "METHODS",
    "all_to_all",
    "averaging",
    "avg_supported",
    "reduce_scatter",
    "resolve_method",
]

METHODS = ("auto", "tensor", "list")

# Torch release that gave gloo ReduceOp.AVG (pytorch#149781, in 2.8.0).
_GLOO_AVG_SINCE = (2, 8)
# NCCL release that introduced ncclAvg.
_NCCL_AVG_SINCE = (2, 10)


class Averaging(NamedTuple):
    """How a reduction averages over ``world_size`` ranks. See [Note: averaging].

    Attributes:
        op: the reduce op of the collective (``SUM`` or ``AVG``).
        prescale: multiplier applied when packing, before the collective.
        postscale: multiplier applied when unpacking, after the collective.
    """

    op: dist.ReduceOp.RedOpType
    prescale: float
    postscale: float


def resolve_method(method: str, group: dist.ProcessGroup | None, device: torch.device) -> str:
    """``"tensor"`` or ``"list"`` for ``method`` on ``group`` and ``device``. See [Note: reduce_scatter method]."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "auto":
        return method
    return "list" if backend_name(group, device) == "gloo" else "tensor"


@functools.lru_cache(maxsize=None)
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _nccl_version() -> tuple[int, ...]:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU-only build has no NCCL
        return (0,)
    return tuple(version) if isinstance(version, tuple) else (version // 1000, version % 1000 // 100)


def avg_supported(
    group: dist.ProcessGroup | None, dtype: torch.dtype, device: torch.device | None = None
) -> bool:
    """Whether ``group``'s backend implements ``ReduceOp.AVG`` for ``dtype`` tensors on ``device``."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    name = backend_name(group, device)
    if name == "nccl":
        return _nccl_version() >= _NCCL_AVG_SINCE
    if name == "gloo":
        return _torch_version() >= _GLOO_AVG_SINCE
    return False


def _nearest_pow2_sqrt(world_size: int) -> int:
    return 2 ** round(math.log2(world_size) / 2)


def averaging(
    world_size: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> Averaging:
    """The op and the pack/unpack scales that average a reduction of ``dtype`` over ``world_size`` ranks.

    See [Note: averaging]. ``group`` and ``device`` say which backend runs the
    collective (``avg_supported``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size == 1:
        return Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
    if dtype == torch.float16:
        pre = _nearest_pow2_sqrt(world_size)
        return Averaging(dist.ReduceOp.SUM, 1.0 / pre, pre / world_size)
    from . import avg_supported as supported  # the package's name, per call: what wraps it is seen

    if dtype in (torch.float32, torch.bfloat16) and supported(group, dtype, device):
        return Averaging(dist.ReduceOp.AVG, 1.0, 1.0)
    return Averaging(dist.ReduceOp.SUM, 1.0, 1.0 / world_size)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
    method: str = "auto",
    input_chunks: Sequence[torch.Tensor] | None = None,
    collectives: Collectives | None = None,
) -> dist.Work | None:
    """Reduce the ``W * S``-element ``input`` over ``group`` and leave this rank's ``S`` elements in ``output``.

    One collective call (see [Note: reduce_scatter method] for ``method``). With
    ``async_op`` returns the ``Work`` to wait on. ``input_chunks`` may hold the
    ``W`` views ``input.chunk(W)`` made once by the caller, so that the list form
    builds nothing per call. ``collectives`` issues the call (default
    ``torch.distributed``; see [Note: collectives seam]). World size 1: a copy
    (none when ``output`` is ``input``), no collective, and ``None`` is returned.
    """
    world_size = dist.get_world_size(group)
    if input.dim() != 1 or output.dim() != 1:
        raise ValueError(f"input and output must be 1-D, got {tuple(input.shape)} and {tuple(output.shape)}")
    if input.numel() != world_size * output.numel():
        raise ValueError(
            f"input has {input.numel()} elements, expected world_size * output.numel() = "
            f"{world_size} * {output.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"input is {input.dtype} but output is {output.dtype}")
    if world_size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None
    method = resolve_method(method, group, input.device)
    issue = collectives or TORCH_COLLECTIVES
    if method == "tensor":
        return issue.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
    if input_chunks is None:
        input_chunks = list(input.chunk(world_size))
    elif len(input_chunks) != world_size:
        raise ValueError(f"input_chunks has {len(input_chunks)} tensors, expected {world_size}")
    elif not isinstance(input_chunks, list):
        input_chunks = list(input_chunks)
    return issue.reduce_scatter_list(output, input_chunks, op=op, group=group, async_op=async_op)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    collectives: Collectives | None = None,
) -> dist.Work | None:
    """Send chunk ``r`` of the 1-D ``input`` to rank ``r``; chunk ``w`` of ``output`` comes from rank ``w``.

    One ``all_to_all_single`` with equal chunks (``numel / W`` each); the
    reduction modes ``exact``, ``int8`` and ``fp8`` use it instead of a
    reduce_scatter (see docs/design.md, "Reduction modes"). gloo refuses float8
    tensors: pass a ``uint8`` view. ``collectives`` issues the call (see [Note:
    collectives seam]). World size 1: a copy, no collective, and ``None`` is
    returned.
    """
    world_size = dist.get_world_size(group)
    if input.dim() != 1 or output.dim() != 1:
        raise ValueError(f"input and output must be 1-D, got {tuple(input.shape)} and {tuple(output.shape)}")
    if input.numel() != output.numel() or input.numel() % world_size:
        raise ValueError(
            f"input and output must have the same number of elements, a multiple of the world size {world_size}; "
            f"got {input.numel()} and {output.numel()}"
        )
    if input.dtype != output.dtype:
        raise ValueError(f"input is {input.dtype} but output is {output.dtype}")
    if world_size == 1:
        output.copy_(input)
        return None
    return (collectives or TORCH_COLLECTIVES).all_to_all_single(output, input, group=group, async_op=async_op)
