"""Bytes of tensor memory one process holds over a region: at named marks, and at the peak.

* CUDA: the caching allocator's own counters (``torch.cuda.memory_allocated``
  and ``max_memory_allocated``).
* CPU: torch keeps no allocator statistics for the CPU, and the profiler's
  memory events miss every free made on another thread (gloo frees its
  reduce_scatter scratch tensors on its worker threads), so the census installs
  flatgrad's counting CPU allocator (``flatgrad._census``, built from
  ``csrc/census/cpu_memory.cpp`` apart from the kernels' ``flatgrad._C``): it wraps torch's
  and counts every allocation and free, on any thread, in two atomics. It
  costs an atomic add per allocation, so timings taken under it stay honest.

Figures are relative to the moment the census starts: start it before the
model is built to count everything a training setup holds. Only tensor
storages are counted; gloo's own non-tensor buffers are not, for stock and
flatgrad alike. gloo's ``reduce_scatter`` does clone tensors (the other ranks'
chunks for the list form, the whole input for the tensor form; NCCL's
allocates nothing), and those are counted.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..kernels.compiled import missing_extension

__all__ = ["MemoryCensus", "cpu_memory_available", "describe"]


@functools.lru_cache(maxsize=None)
def cpu_memory_available() -> str:
    """An empty string if the counting CPU allocator can be installed, else why not."""
    try:
        from .. import _census  # noqa: F401
    except ImportError as exc:
        return missing_extension("flatgrad._census", exc)
    return ""


def _allocator() -> Any:
    from .. import _census

    return _census


class MemoryCensus:
    """Tensor bytes live on ``device`` over a ``with`` block, at every ``mark`` and at the peak.

    Usage::

        with MemoryCensus("cpu") as census:
            model = build()                 # counted from here on
            census.mark("built")
            census.reset_peak()             # the peak of what follows only
            train_step()
            census.mark("between steps")
        census.at("between steps"), census.peak    # bytes, relative to the start

    Attributes:
        device: ``cpu`` or ``cuda``.
        marks: ``(name, bytes)`` in the order the marks were made.
        peak: the most bytes live at once since the start or the last ``reset_peak`` (valid after the block).
    """

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device).type
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {device!r}")
        if self.device == "cpu":
            why = cpu_memory_available()
            if why:
                raise RuntimeError(f"MemoryCensus on the CPU needs flatgrad's counting allocator: {why}")
        self.marks: list[tuple[str, int]] = []
        self.blocks: dict[str, dict[int, int]] = {}
        self.peak = 0
        self._base = 0

    def now(self) -> tuple[int, int]:
        """``(live, peak)`` bytes now, relative to the start of the census."""
        live, peak = self._raw()
        return live - self._base, peak - self._base

    def _raw(self) -> tuple[int, int]:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        allocated, peak = _allocator().stats()
        return int(allocated), int(peak)

    def reset_peak(self) -> None:
        """Start the peak afresh from what is live now."""
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            _allocator().reset_peak()

    def __enter__(self) -> "MemoryCensus":
        if self.device == "cpu":
            _allocator().install()
        self.reset_peak()
        self._base = self._raw()[0]
        return self

    def settle(self, reads: int = 5, interval: float = 0.002, timeout: float = 1.0) -> int:
        """Wait until the live bytes hold still for ``reads`` reads ``interval`` s apart (at most ``timeout`` s).

        A gloo collective returns before its worker thread has dropped the work's
        references to the call's tensors: in about one call in seven on 2 cores,
        more under load, a tensor the caller has already released is freed a few
        milliseconds later, on that thread. A mark meant to count what the program
        holds settles first. Returns the live bytes it settled at.
        """
        import time

        deadline = time.monotonic() + timeout
        live, still = self.now()[0], 0
        while still < reads and time.monotonic() < deadline:
            time.sleep(interval)
            now = self.now()[0]
            still = still + 1 if now == live else 0
            live = now
        return live

    def mark(self, name: str, blocks: bool = False) -> None:
        """Note what is live now under ``name`` (names may repeat); with ``blocks`` (CPU), every live block too.

        The blocks (``{address: bytes}`` in ``self.blocks[name]``) say *what* is live where a count
        alone says only how much: see ``born`` and ``describe``.
        """
        if blocks and self.device != "cpu":
            raise ValueError("blocks=True needs the counting CPU allocator (a census on cpu)")
        self.marks.append((name, self.now()[0]))
        if blocks:
            self.blocks[name] = dict(_allocator().blocks())

    def born(self, name: str, since: str) -> dict[int, int]:
        """The blocks live at mark ``name`` that were not at mark ``since`` (both made with ``blocks=True``)."""
        before = self.blocks[since]
        return {address: n for address, n in self.blocks[name].items() if address not in before}

    def __exit__(self, *exc: object) -> None:
        self.peak = self.now()[1]

    def at(self, name: str, which: int = -1) -> int:
        """Bytes live at the mark ``name`` (its last occurrence by default)."""
        hits = [v for n, v in self.marks if n == name]
        if not hits:
            raise KeyError(f"no mark {name!r}; marks: {sorted({n for n, _ in self.marks})}")
        return hits[which]


def describe(blocks: dict[int, int]) -> list[str]:
    """What holds each block: the live tensors whose storage starts there (shape and dtype), or its size alone.

    A block no Python tensor shows is held from C++ (autograd's saved tensors, a collective's scratch).
    Call it while the blocks are still live.
    """
    import gc

    holders: dict[int, list[str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                address = obj.untyped_storage().data_ptr()
                if address in blocks:
                    holders.setdefault(address, []).append(f"{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}")
        except (RuntimeError, ReferenceError):  # a tensor without storage (a fake or a freed view)
            continue
    return [
        f"{n} B: " + (", ".join(sorted(set(holders[a]))) if a in holders else "no Python tensor (held from C++)")
        for a, n in sorted(blocks.items(), key=lambda item: -item[1])
    ]
