"""Test-session environment: CPU DeepSpeed, a private extensions dir, Triton's interpreter without a GPU.

These must be set before torch, triton or deepspeed are imported, hence here.
``FLATGRAD_REQUIRE_BACKENDS=cpu,triton`` (set by CI) turns a backend that is
unexpectedly missing into a failure instead of a skip.
"""

from __future__ import annotations

import os
import pathlib

_ROOT = pathlib.Path(__file__).resolve().parent.parent

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".torch_extensions"))


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


if not _cuda_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session) -> None:
    required = [b for b in os.environ.get("FLATGRAD_REQUIRE_BACKENDS", "").split(",") if b]
    if not required:
        return
    import flatgrad

    status = flatgrad.available_backends()
    missing = {b: status[b].reason for b in required if not status[b].available}
    if missing:
        raise RuntimeError(f"FLATGRAD_REQUIRE_BACKENDS: required backends are unavailable: {missing}")
