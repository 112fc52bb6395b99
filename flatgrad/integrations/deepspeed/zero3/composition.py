"""One ZeRO-3 bucket composition: the parameters of an IPG bucket in order, their layout and flatgrad bucket, and
where this rank's pieces of it go. Made once per composition by the reduction; read by the offload and the stats.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ....layout import Layout
from ....reducer import Bucket

__all__ = ["Composition"]


class Composition(NamedTuple):
    """Everything static about one bucket composition (same parameters, same order)."""

    layout: Layout
    group: Any
    rank: int
    comm_dtype: torch.dtype
    bucket: Bucket  # the pack -> reduce_scatter -> unpack every flatgrad reduction runs
    ds_ids: tuple[int, ...]  # parameters with data in this rank's segment, in segment order
    lengths: tuple[int, ...]  # their piece lengths
    key: tuple  # (bucket dtype, every parameter's ds_id in bucket order): the same on every rank
    bucket_ds_ids: frozenset[int]  # every parameter of the bucket, for [Note: ZeRO-3 step statistics]
    piece_params: tuple  # the parameters of ``ds_ids``, in segment order
    temporaries: tuple  # the mode's pool slots besides the IPG buffer: (purpose, elements, dtype), made per reduce
