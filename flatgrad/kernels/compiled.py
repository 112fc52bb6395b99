"""The ``cpu`` and ``cuda`` backends: thin wrappers over the compiled ``torch.ops.flatgrad`` ops.

The ops are declared once in ``csrc/flatgrad.cpp`` (``TORCH_LIBRARY(flatgrad, m)``)
with a CPU implementation there and a CUDA one in ``csrc/cuda/``:

* ``flatgrad::pack(Tensor?[] tensors, Tensor runs, Tensor(a!) out, float scale) -> ()``
  (a ``None`` tensor packs as zeros)
* ``flatgrad::unpack(Tensor shard, Tensor runs, Tensor(a!)[] outs, float scale,
  bool accumulate, bool stats) -> Tensor`` (``[sum_sq, nonfinite_count]`` fp32 when
  ``stats``, else an empty tensor)
* ``flatgrad::_pack_table`` / ``flatgrad::_unpack_table``: the same with the
  tensors given as a plan's tensor table (see [Note: plans] in docs/design.md).

``runs`` is a layout's run table on the op's device (see [Note: run tables]).
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from ..layout import Layout
from . import _tables

# Longest run handed to one unit of parallel work. The CPU kernel balances work
# by element ranges itself and needs no split; a CUDA block copies one run.
_MAX_LEN = {"cpu": None, "cuda": 8192}


def _register_fakes() -> None:
    """Shape-only implementations of the ops, so that they trace under ``torch.compile``.

    ``csrc/flatgrad.cpp`` names this module as the home of its fake
    implementations (``set_python_module``).
    """

    @torch.library.register_fake("flatgrad::pack")
    def _pack_fake(tensors: list[torch.Tensor | None], runs: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        return None

    @torch.library.register_fake("flatgrad::_pack_table")
    def _pack_table_fake(table: torch.Tensor, runs: torch.Tensor, out: torch.Tensor, scale: float) -> None:
        return None

    @torch.library.register_fake("flatgrad::_unpack_table")
    def _unpack_table_fake(
        shard: torch.Tensor,
        runs: torch.Tensor,
        table: torch.Tensor,
        out_dtype: torch.dtype,
        scale: float,
        accumulate: bool,
        stats: bool,
    ) -> torch.Tensor:
        return shard.new_empty((2,) if stats else (0,), dtype=torch.float32)

    @torch.library.register_fake("flatgrad::unpack")
    def _unpack_fake(
        shard: torch.Tensor,
        runs: torch.Tensor,
        outs: list[torch.Tensor],
        scale: float,
        accumulate: bool,
        stats: bool,
    ) -> torch.Tensor:
        return shard.new_empty((2,) if stats else (0,), dtype=torch.float32)


def missing_extension(module: str, exc: ImportError) -> str:
    """Why the compiled extension ``module`` (``flatgrad._C``, ``flatgrad._census``) did not import, and what to run."""
    import flatgrad

    package = os.path.dirname(os.path.abspath(flatgrad.__file__))
    root = os.path.dirname(package)
    if os.path.exists(os.path.join(root, "setup.py")):
        fix = (
            f"this is the unbuilt source tree {root}: build it in place with "
            "`pip install --no-build-isolation -e .` from there, or run from another directory to use an installed "
            "flatgrad"
        )
    else:
        fix = "reinstall with `pip install --no-build-isolation flatgrad` against the torch installed now"
    return f"the compiled extension {module} did not import from {package} ({exc}); {fix}"


@functools.lru_cache(maxsize=None)
def _load() -> str:
    """Import the extension (once); returns an empty string or why it is missing."""
    try:
        from .. import _C  # noqa: F401  (registers torch.ops.flatgrad)
    except ImportError as exc:
        return missing_extension("flatgrad._C", exc)
    _register_fakes()
    return ""


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"flatgrad::{op}", key)


def devices(name: str) -> tuple[list[str], str]:
    """Where backend ``name`` (``cpu`` or ``cuda``) runs here, or why nowhere."""
    missing = _load()
    if missing:
        return [], missing
    if name == "cpu":
        return (["cpu"], "") if _has_kernel("pack", "CPU") else ([], "flatgrad._C has no CPU kernels")
    if not _has_kernel("pack", "CUDA"):
        return [], "flatgrad._C was built without CUDA (no nvcc or a CPU-only torch at build time)"
    if not torch.cuda.is_available():
        return [], "no CUDA device is visible"
    return ["cuda"], ""


class _CompiledBackend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.max_len = _MAX_LEN[name]

    def pack(self, tensors: Sequence[torch.Tensor | None], layout: Layout, out: torch.Tensor, scale: float) -> None:
        runs = _tables.pack_runs(layout, out.device, self.max_len)
        torch.ops.flatgrad.pack(list(tensors), runs, out, scale)

    def unpack(
        self,
        shard: torch.Tensor,
        layout: Layout,
        rank: int,
        outs: Sequence[torch.Tensor],
        per_piece: bool,
        scale: float,
        accumulate: bool,
        stats: bool,
    ) -> torch.Tensor | None:
        runs = _tables.unpack_runs(layout, rank, per_piece, shard.device, self.max_len)
        result = torch.ops.flatgrad.unpack(shard, runs, list(outs), scale, accumulate, stats)
        return result if stats else None


def backend(name: str) -> _CompiledBackend:
    return _CompiledBackend(name)


# Importing this module (the one csrc/flatgrad.cpp names) registers the fake
# implementations, so ``import flatgrad.kernels.compiled`` is enough for tracing.
_load()
