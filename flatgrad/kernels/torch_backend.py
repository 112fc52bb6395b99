"""The ``torch`` backend: the reference implementation, on any device."""

from __future__ import annotations

from . import reference


class _TorchBackend:
    name = "torch"
    pack = staticmethod(reference.pack)
    unpack = staticmethod(reference.unpack)


def devices(name: str) -> tuple[list[str], str]:
    """The reference runs wherever torch does."""
    found = ["cpu"]
    if torch_cuda_available():
        found.append("cuda")
    return found, ""


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def backend(name: str) -> _TorchBackend:
    return _TorchBackend()
