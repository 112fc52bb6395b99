"""flatgrad: one fused pack, one reduce_scatter and one fused unpack per gradient bucket.

Public surface: layouts (``Layout``), the fused kernels (``pack``, ``unpack``),
their reusable plans (``PackPlan``, ``UnpackPlan``) and backend discovery
(``available_backends``). The reducer and the DeepSpeed integration live in
their own modules.
"""

import os as _os

from .kernels import BackendStatus, PackPlan, UnpackPlan, UnpackStats, available_backends, pack, unpack
from .layout import Layout, Piece

__all__ = [
    "Layout", "Piece", "pack", "unpack", "PackPlan", "UnpackPlan", "UnpackStats", "available_backends", "BackendStatus",
]  # fmt: skip
__version__ = "0.1.0"

if _os.environ.get("FLATGRAD_DEEPSPEED", "") not in ("", "0"):
    # FLATGRAD_DEEPSPEED=1: route every later deepspeed.initialize through flatgrad (see flatgrad.deepspeed).
    from .integrations.deepspeed.patch import patch_from_env as _patch_from_env

    _patch_from_env()
