"""Stock ``deepspeed.initialize``, kept here while ``patch()`` has replaced it.

Both ``initialize`` (which calls stock underneath) and ``patch`` (which swaps it)
need it; holding it here keeps the imports one way: patch -> initialize -> original.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["forget", "is_saved", "original_initialize", "save"]

_original: Callable | None = None


def original_initialize() -> Callable:
    """Stock ``deepspeed.initialize``, whether or not the patch is active."""
    if _original is not None:
        return _original
    import deepspeed

    return deepspeed.initialize


def save(fn: Callable) -> None:
    """Remember stock ``deepspeed.initialize`` before the patch replaces it."""
    global _original
    _original = fn


def forget() -> Callable | None:
    """Drop the remembered function (the patch is undone); returns it."""
    global _original
    fn, _original = _original, None
    return fn


def is_saved() -> bool:
    """Whether a stock function is remembered, i.e. the patch is active."""
    return _original is not None
