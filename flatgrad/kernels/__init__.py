"""Fused ``pack`` / ``unpack`` with one API over four backends.

Backends:
* ``torch``: the reference oracle (``reference.py``), always available.
* ``cpu``: compiled C++ (``csrc/flatgrad.cpp``), registered as ``torch.ops.flatgrad``.
* ``cuda``: compiled CUDA (``csrc/cuda/``), the same ops, one launch per call.
* ``triton``: Triton kernels (``triton_backend.py``).

The wrappers here validate arguments once, resolve the backend and dispatch;
the backends assume valid input.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Union

import torch

from ..layout import Layout
from . import reference
from ._backends import BACKENDS, BackendStatus, available_backends, resolve_backend

__all__ = ["pack", "unpack", "UnpackStats", "available_backends", "BackendStatus", "BACKENDS", "DTYPES", "DTYPE_NAMES"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # config and CLI spelling


class UnpackStats(NamedTuple):
    """Statistics of the values ``unpack`` wrote, computed in the same pass.

    Attributes:
        sum_sq: 0-dim fp32 tensor, the sum of squares (for the gradient norm).
        nonfinite: 0-dim bool tensor, whether any value is inf or nan (for the overflow check).
    """

    sum_sq: torch.Tensor
    nonfinite: torch.Tensor


def _check_tensor(name: str, t: object, *, device: torch.device | None = None, numel: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: fp32, bf16, fp16")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, the layout expects {numel}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass {name}.contiguous()")
    return t


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def pack(
    tensors: Sequence[torch.Tensor],
    layout: Layout,
    out: torch.Tensor | None = None,
    *,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Pack ``tensors`` into one rank-aligned buffer of ``layout.numel`` elements, in one pass.

    Copies, casts to the comm dtype (``dtype``, or ``out``'s), multiplies by
    ``scale`` and zeroes the padding. Returns the buffer (``out`` if given).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("tensors must be a list or tuple of tensors")
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"got {len(tensors)} tensors, the layout has {layout.num_tensors}")
    scale = _check_scale(scale)
    if out is not None:
        device = _check_tensor("out", out).device
    elif tensors:
        device = _check_tensor("tensors[0]", tensors[0]).device
    else:
        raise ValueError("pack of zero tensors needs out= (nothing gives the device)")
    for i, (t, n) in enumerate(zip(tensors, layout.numels)):
        _check_tensor(f"tensors[{i}]", t, device=device, numel=n)
    if out is None:
        if dtype is None:
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) != 1:
                raise ValueError(f"tensors have mixed dtypes {sorted(map(str, dtypes))}; pass dtype= for the buffer")
            dtype = dtypes.pop()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of fp32, bf16, fp16, got {dtype}")
        out = torch.empty(layout.numel, dtype=dtype, device=device)
    else:
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}")
        if out.dim() != 1 or out.numel() != layout.numel:
            raise ValueError(f"out must be 1-D with {layout.numel} elements, got shape {tuple(out.shape)}")
        for i, t in enumerate(tensors):
            if _overlaps(out, t):
                raise ValueError(f"out overlaps tensors[{i}]; pack cannot run in place")
    impl = resolve_backend(backend, device)
    impl.pack(tensors, layout, out, scale)
    return out


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
    the values written, computed in the same pass.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a flatgrad.Layout, got {type(layout).__name__}")
    rank = layout._check_rank(rank)
    scale = _check_scale(scale)
    _check_tensor("shard", shard, numel=layout.shard_numel)
    if shard.dim() != 1:
        raise ValueError(f"shard must be 1-D, got shape {tuple(shard.shape)}")
    device = shard.device
    if isinstance(out, torch.Tensor):
        _check_tensor("out", out, device=device, numel=layout.shard_numel)
        if out.dim() != 1:
            raise ValueError(f"out must be 1-D, got shape {tuple(out.shape)}")
        outs, per_piece = [out], False
    elif isinstance(out, Sequence):
        pieces = layout.pieces(rank)
        if len(out) != len(pieces):
            raise ValueError(f"out has {len(out)} tensors, rank {rank} owns {len(pieces)} pieces")
        for k, (o, p) in enumerate(zip(out, pieces)):
            _check_tensor(f"out[{k}]", o, device=device, numel=p.length)
            if o.dtype != out[0].dtype:
                raise ValueError(f"out[{k}] has dtype {o.dtype}, out[0] has {out[0].dtype}; use one dtype")
        outs, per_piece = list(out), True
    else:
        raise TypeError(f"out must be a tensor or a list of tensors, got {type(out).__name__}")
    if per_piece:
        order = sorted(range(len(outs)), key=lambda k: (outs[k].data_ptr(), k))
        for a, b in zip(order, order[1:]):
            if _overlaps(outs[a], outs[b]):
                raise ValueError(f"out[{a}] and out[{b}] overlap; every piece needs its own memory")
    for k, o in enumerate(outs):
        if _overlaps(o, shard):
            raise ValueError(f"out[{k}] overlaps shard; unpack cannot run in place" if per_piece else "out overlaps shard")
    impl = resolve_backend(backend, device)
    stats = impl.unpack(shard, layout, rank, outs, per_piece, scale, bool(accumulate), bool(return_stats))
    if not return_stats:
        return None
    return UnpackStats(stats[0], stats[1] > 0)

