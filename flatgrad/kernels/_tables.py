"""Device copies of a layout's run tables, made once and reused by every call.

See [Note: run tables] in docs/design.md. A table is uploaded to a
device the first time a backend asks for it there; after that a lookup is a
dict access, with no host sync and no upload on the hot path.
"""

from __future__ import annotations

import threading

import torch

from ..layout import Layout

_cache: dict[tuple, torch.Tensor] = {}
_lock = threading.Lock()


def _cached(key: tuple, make) -> torch.Tensor:
    table = _cache.get(key)
    if table is None:
        with _lock:
            table = _cache.get(key)
            if table is None:
                table = make()
                _cache[key] = table
    return table


def pack_runs(layout: Layout, device: torch.device, max_len: int) -> torch.Tensor:
    """``layout.pack_runs(max_len)`` on ``device``."""
    return _cached(("pack", layout, device, max_len), lambda: layout.pack_runs(max_len).to(device))


def unpack_runs(layout: Layout, rank: int, per_piece: bool, device: torch.device, max_len: int) -> torch.Tensor:
    """``layout.unpack_runs(rank, max_len, per_piece=...)`` on ``device``."""
    return _cached(
        ("unpack", layout, rank, per_piece, device, max_len),
        lambda: layout.unpack_runs(rank, max_len, per_piece=per_piece).to(device),
    )


def nbytes() -> int:
    """Bytes held by the cached device tables (counted in flatgrad's memory figures)."""
    with _lock:
        return sum(t.numel() * t.element_size() for t in _cache.values())


def clear() -> None:
    """Drop every cached device table (tests, or to free device memory)."""
    with _lock:
        _cache.clear()
