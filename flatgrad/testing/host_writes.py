"""Count the writes into given tensors' memory (the offload's host buffers): torch's and flatgrad's unpacks.

A torch function mode is not active inside autograd's hooks, where ZeRO
reduces, so ``HostWrites`` wraps the methods themselves for the duration of a
``with`` block: ``Tensor.copy_`` and ``Tensor.add_`` (what DeepSpeed writes its
grad partitions and fp32 gradients with), and ``flatgrad.reducer.Bucket.unpack``
(flatgrad's fused unpack, which writes through raw pointers). The real methods
run; only the calls whose target lies in one of the given storages count.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..reducer import Bucket

__all__ = ["HostWrites"]


class HostWrites:
    """Counts ``copy_``/``add_`` into, and flatgrad unpacks into, the storages of ``tensors``.

    Attributes:
        torch_writes: ``Tensor.copy_`` and ``Tensor.add_`` calls whose target is in those storages.
        unpacks: ``Bucket.unpack`` calls whose shard is in those storages.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.torch_writes = 0
        self.unpacks = 0
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        """Every counted write."""
        return self.torch_writes + self.unpacks

    def _inside(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages

    def __enter__(self) -> "HostWrites":
        for name in ("copy_", "add_"):
            method = getattr(torch.Tensor, name)

            def counted(t: torch.Tensor, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
                if self._inside(t):
                    self.torch_writes += 1
                return _method(t, *args, **kwargs)

            self._saved.append((torch.Tensor, name, method))
            setattr(torch.Tensor, name, counted)
        unpack = Bucket.unpack

        def counted_unpack(b: Bucket, received: Any, shard: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(shard, (list, tuple)):
                shard = shard[0] if shard else None
            if self._inside(shard):
                self.unpacks += 1
            return unpack(b, received, shard, *args, **kwargs)

        self._saved.append((Bucket, "unpack", unpack))
        Bucket.unpack = counted_unpack  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, method in reversed(self._saved):
            setattr(owner, name, method)
        self._saved.clear()
