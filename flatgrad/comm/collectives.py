"""The seam the gradient collectives are issued through, so that a framework can route them to its own layer.

See [Note: collectives seam] in docs/design.md.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

__all__ = ["Collectives", "TORCH_COLLECTIVES"]


class Collectives(NamedTuple):
    """The collective calls flatgrad issues for gradients, so that a framework can route them. See [Note: collectives seam].

    Attributes:
        reduce_scatter_tensor: ``(output, input, *, op, group, async_op)``: the tensor form.
        reduce_scatter_list: ``(output, input_list, *, op, group, async_op)``: the list form.
        all_to_all_single: ``(output, input, *, group, async_op)``: equal chunks.
    """

    reduce_scatter_tensor: Callable[..., Any]
    reduce_scatter_list: Callable[..., Any]
    all_to_all_single: Callable[..., Any]


def _torch_reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return single(output, input, **kwargs)


# torch.distributed's functions, looked up at call time (a wrapper installed later is seen).
TORCH_COLLECTIVES = Collectives(
    reduce_scatter_tensor=_torch_reduce_scatter_tensor,
    reduce_scatter_list=lambda output, inputs, **kwargs: dist.reduce_scatter(output, inputs, **kwargs),
    all_to_all_single=lambda output, input, **kwargs: dist.all_to_all_single(output, input, **kwargs),
)
