"""The pure-PyTorch reference implementation of ``pack`` and ``unpack``: the oracle.

Every other backend must produce the same bits as this one wherever the
arithmetic is the same. It walks ``Layout.pieces`` rank by rank and uses only
slicing, ``to`` and ``add_``, so it can be trusted by reading.

Casts are torch's, a scale is one fp32 multiply, and accumulation rounds
once, so that every backend can match this one bitwise. See
[Note: arithmetic contract] in docs/design.md.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import Layout


def _scaled(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if scale == 1.0:
        return x.to(dtype)
    return (x.to(torch.float32) * scale).to(dtype)


@torch.no_grad()
def pack(tensors: Sequence[torch.Tensor | None], layout: Layout, out: torch.Tensor, scale: float) -> None:
    """Fill ``out`` (the whole ``layout.numel`` buffer) from ``tensors``; padding and ``None`` tensors are zero."""
    out.zero_()
    s = layout.shard_numel
    for rank in range(layout.world_size):
        for p in layout.pieces(rank):
            if tensors[p.tensor_index] is None:
                continue
            src = tensors[p.tensor_index].reshape(-1)[p.tensor_offset : p.tensor_offset + p.length]
            begin = layout.position(rank) * s + p.shard_offset
            out[begin : begin + p.length] = _scaled(src, out.dtype, scale)


@torch.no_grad()
def unpack(
    shard: torch.Tensor,
    layout: Layout,
    rank: int,
    outs: Sequence[torch.Tensor],
    per_piece: bool,
    scale: float,
    accumulate: bool,
    stats: bool,
) -> torch.Tensor | None:
    """Write ``rank``'s shard into ``outs``; returns ``[sum_sq, nonfinite_count]`` (fp32) if ``stats``.

    ``per_piece``: ``outs`` holds one tensor per ``layout.pieces(rank)`` entry;
    otherwise ``outs`` is one tensor of ``shard_numel`` elements.
    """
    if per_piece:
        targets = [
            (shard[p.shard_offset : p.shard_offset + p.length], out.view(-1))
            for p, out in zip(layout.pieces(rank), outs)
        ]
    else:
        targets = [(shard, outs[0].view(-1))]
    for src, dst in targets:
        if accumulate:
            dst.add_(_scaled(src, torch.float32, scale))
        else:
            dst.copy_(_scaled(src, dst.dtype, scale))
    if not stats:
        return None
    written = [dst.to(torch.float32) for _, dst in targets]
    flat = torch.cat(written) if written else shard.new_zeros(0, dtype=torch.float32)
    return torch.stack([flat.square().sum(), (~torch.isfinite(flat)).sum().to(torch.float32)])
