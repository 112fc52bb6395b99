"""Backend registry: what is available, why not, and which one a call gets.

Auto choice per device: CUDA tensors get ``cuda``, then ``triton``, then
``torch``; CPU tensors get ``cpu``, then ``torch``. ``FLATGRAD_BACKEND`` or
``backend=`` forces one, and a forced backend that cannot run raises.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import NamedTuple

import torch

BACKENDS = ("cuda", "triton", "cpu", "torch")
_AUTO = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}
_MODULES = {
    "torch": "flatgrad.kernels.torch_backend",
    "cpu": "flatgrad.kernels.compiled",
    "cuda": "flatgrad.kernels.compiled",
    "triton": "flatgrad.kernels.triton_backend",
}


class BackendStatus(NamedTuple):
    """Whether a backend can run here, and if not, why.

    Attributes:
        available: the backend can run on at least one device type here.
        reason: why not (empty when available).
        devices: the device types it runs on here (``"cpu"``, ``"cuda"``).
    """

    available: bool
    reason: str
    devices: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def _status(name: str) -> BackendStatus:
    try:
        module = importlib.import_module(_MODULES[name])
    except Exception as exc:  # an optional part that fails to import is reported, never raised
        return BackendStatus(False, f"{_MODULES[name]} failed to import: {exc!r}", ())
    devices, reason = module.devices(name)
    return BackendStatus(bool(devices), "" if devices else reason, tuple(devices))


def available_backends() -> dict[str, BackendStatus]:
    """Every backend's status: ``{name: BackendStatus(available, reason, devices)}``."""
    return {name: _status(name) for name in BACKENDS}


@functools.lru_cache(maxsize=None)
def _module(name: str):
    return importlib.import_module(_MODULES[name]).backend(name)


def resolve_backend(backend: str | None, device: torch.device):
    """The backend object for a call on ``device``; forced choices that cannot run raise."""
    forced = backend or os.environ.get("FLATGRAD_BACKEND") or None
    kind = device.type
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {forced!r}")
        status = _status(forced)
        if not status.available:
            raise RuntimeError(f"flatgrad backend {forced!r} is not available: {status.reason}")
        if kind not in status.devices:
            raise RuntimeError(f"flatgrad backend {forced!r} cannot run on {kind} tensors (runs on {status.devices})")
        return _module(forced)
    for name in _AUTO.get(kind, ("torch",)):
        if kind in _status(name).devices:
            return _module(name)
    raise RuntimeError(f"no flatgrad backend runs on {kind} tensors")


def host_backend(backend: str | None) -> str:
    """The backend for the host-side part of a call whose kernels were chosen (or forced) for the accelerator.

    A host tensor cannot take a GPU backend: a forced ``backend`` (or ``FLATGRAD_BACKEND``) is kept
    where it is a host one (``cpu``, ``torch``), else the host's own choice (``cpu``, then ``torch``).
    """
    forced = backend or os.environ.get("FLATGRAD_BACKEND") or None
    if forced in ("cpu", "torch"):
        return forced
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {forced!r}")
    for name in _AUTO["cpu"]:
        if "cpu" in _status(name).devices:
            return name
    raise RuntimeError("no flatgrad backend runs on cpu tensors")
