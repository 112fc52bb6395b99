"""ReducerConfig: every setting of a ``BucketReducer`` in one documented, validated, frozen dataclass."""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import DTYPES
from . import registry

__all__ = ["LAYOUT_KINDS", "REDUCTIONS", "TWO_STAGE_REDUCTIONS", "ReducerConfig"]

LAYOUT_KINDS = ("flat", "chunked")
REDUCTIONS = registry.names()
TWO_STAGE_REDUCTIONS = registry.names(two_stage=True)


@dataclasses.dataclass(frozen=True)
class ReducerConfig:
    """How a ``BucketReducer`` moves every bucket; validated at construction, each error naming its field.

    Attributes:
        comm_dtype: dtype of the packed buffer and the collective (``None``: each bucket's param dtype,
            which must then be uniform).
        layout: ``"flat"`` or ``"chunked"`` (see ``flatgrad.Layout``).
        align: layout alignment in elements.
        average: divide the sum by the world size (see [Note: averaging] in docs/design.md);
            ``False`` sums.
        prescale: extra multiplier applied in pack.
        postscale: extra multiplier applied in unpack.
        backend: flatgrad kernel backend (``None``: automatic per device).
        method: reduce_scatter method (see [Note: reduce_scatter method] in docs/design.md).
        comm_buffers: how many bucket-sized comm buffers the buckets of one device and comm dtype share
            (see [Note: comm buffer pool]); 1 serialises pack and collective, 2 (the default) overlaps
            them as stock's double IPG buffer does.
        accum_dtype: dtype of the gradient shards, which accumulate micro-steps (fp32 by default;
            see [Note: shard lifetime]).
        collect_stats: every unpack also computes, in the same pass, the sum of squares and the
            non-finite count of the shard it wrote, for the gradient norm and the overflow check
            without reading the shards again.
        reduction: a name of ``REDUCTIONS``, ``"reduce_scatter"`` by default: each mode is one entry of
            ``flatgrad.reducer.registry.MODES`` (the docs' table of modes lists them; see
            [Note: reduction modes] and [Note: two-stage reductions] in docs/design.md).
        block: the quantized modes (those with a wire ``kind`` in the registry): elements per fp32 scale, a power
            of two in [32, 4096].
        error_feedback: the quantized modes: carry each rank's quantization error into its next
            quantize.
        node_size: two-stage reductions: ranks per node (``None``: the launcher's
            ``LOCAL_WORLD_SIZE``, else the world size); it must divide the world size and equal
            ``LOCAL_WORLD_SIZE`` where that is set.
    """

    comm_dtype: torch.dtype | None = None
    layout: str = "flat"
    align: int = 1
    average: bool = True
    prescale: float = 1.0
    postscale: float = 1.0
    backend: str | None = None
    method: str = "auto"
    comm_buffers: int = 2
    accum_dtype: torch.dtype = torch.float32
    collect_stats: bool = False
    reduction: str = "reduce_scatter"
    block: int = 256
    error_feedback: bool = False
    node_size: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUT_KINDS:
            raise ValueError(f"layout must be one of {LAYOUT_KINDS}, got {self.layout!r}")
        if self.comm_dtype is not None and self.comm_dtype not in DTYPES:
            raise ValueError(f"comm_dtype must be one of fp32, bf16, fp16, got {self.comm_dtype}")
        for name in ("prescale", "postscale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        if isinstance(self.comm_buffers, bool) or not isinstance(self.comm_buffers, int) or self.comm_buffers < 1:
            raise ValueError(f"comm_buffers must be an int >= 1, got {self.comm_buffers!r}")
        if self.accum_dtype not in DTYPES:
            raise ValueError(f"accum_dtype must be one of fp32, bf16, fp16, got {self.accum_dtype!r}")
        registry.check_options(self.reduction, self.block, self.error_feedback)
        if self.node_size is not None and (
            isinstance(self.node_size, bool) or not isinstance(self.node_size, int) or self.node_size < 1
        ):
            raise ValueError(f"node_size must be an int >= 1 or None, got {self.node_size!r}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The field names, which ``BucketReducer`` also takes as keyword arguments."""
        return tuple(f.name for f in dataclasses.fields(cls))
