"""Collectives over ``torch.distributed``: the gradients' reduce_scatter path and the parameters' all_gather path.

* ``scatter``: one reduce_scatter (or all_to_all) per bucket, its method and averaging.
* ``gather``: the coalesced in-place all_gather of the ZeRO-1/2 step (``AllGatherPlan``).
* ``collectives``: the seam both gradient collectives are issued through; ``backend``: which backend serves a group.

Callers use the package's names (``comm.reduce_scatter``), and so do the tools that wrap them: a module here
that calls another's wrapped name looks it up on the package per call. See "Collectives" in docs/design.md.
"""

from .backend import backend_name
from .collectives import TORCH_COLLECTIVES, Collectives
from .gather import (
    AllGatherPlan,
    ChunkScatter,
    all_gather_in_place,
    all_gather_into_tensor_coalesced,
    chunk_scatter,
    gather_batches,
)
from .scatter import METHODS, Averaging, all_to_all, averaging, avg_supported, reduce_scatter, resolve_method

__all__ = [
    "AllGatherPlan",
    "Averaging",
    "ChunkScatter",
    "Collectives",
    "METHODS",
    "TORCH_COLLECTIVES",
    "all_gather_in_place",
    "all_gather_into_tensor_coalesced",
    "all_to_all",
    "averaging",
    "avg_supported",
    "backend_name",
    "chunk_scatter",
    "reduce_scatter",
    "resolve_method",
]
