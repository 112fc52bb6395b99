"""DeepSpeed's own methods of one optimizer instance, kept before flatgrad's replacements are set on it.

DeepSpeed looks its seams up on the optimizer instance at call time, so flatgrad's replacement of a method is an
instance attribute, and the stock method it wraps or falls back on is the one kept here (``stock.step(...)``).
Both ZeRO stages keep and bind their seams through it. See [Note: ZeRO-2 seams] in docs/design.md.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

__all__ = ["StockMethods"]


class StockMethods:
    """Stock's bound methods ``names`` of ``optimizer``, read as attributes; ``replace`` sets flatgrad's in their place."""

    def __init__(self, optimizer: Any, names: Iterable[str]) -> None:
        self._optimizer = optimizer
        self._kept = {name: getattr(optimizer, name) for name in names}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self.__dict__["_kept"][name]
        except KeyError:
            raise AttributeError(f"stock's {name!r} was not kept") from None

    def replace(self, replacements: Mapping[str, Callable[..., Any]]) -> None:
        """Set each replacement on the optimizer instance, under the name of the method it replaces."""
        for name, method in replacements.items():
            setattr(self._optimizer, name, method)
