"""``patch()``: route every later ``deepspeed.initialize`` call through flatgrad.

An existing training script changes by one line (``flatgrad.deepspeed.patch()``),
or by none: ``FLATGRAD_DEEPSPEED=1`` in the environment makes ``import flatgrad``
call ``patch()``. Under the patch, a config flatgrad does not handle (ZeRO
stage 0, an unsupported feature, ``"flatgrad": {"enabled": false}``) passes
through to stock DeepSpeed unchanged, with one log line saying why; only the
explicit ``flatgrad.deepspeed.initialize`` refuses such configs.

The patch replaces the ``deepspeed.initialize`` attribute: code that bound
``from deepspeed import initialize`` before ``patch()`` keeps stock DeepSpeed.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, Callable

from .config import UnsupportedConfigError

__all__ = ["ENV_VAR", "is_patched", "original_initialize", "patch", "patch_from_env", "unpatch"]

ENV_VAR = "FLATGRAD_DEEPSPEED"

logger = logging.getLogger("flatgrad.deepspeed")

_original: Callable | None = None


def original_initialize() -> Callable:
    """Stock ``deepspeed.initialize``, whether or not the patch is active."""
    if _original is not None:
        return _original
    import deepspeed

    return deepspeed.initialize


def _routed(*args: Any, **kwargs: Any) -> tuple:
    from .initialize import plan, run, stock_arguments

    try:
        p = plan(*args, **kwargs)
    except UnsupportedConfigError as exc:
        logger.warning("flatgrad: passing this config to stock DeepSpeed: %s", exc)
        return original_initialize()(**stock_arguments(*args, **kwargs))
    return run(p)


def patch() -> None:
    """Make ``deepspeed.initialize`` go through flatgrad (idempotent)."""
    global _original
    import deepspeed

    if _original is not None:
        return
    _original = deepspeed.initialize
    routed = functools.wraps(_original)(_routed)
    routed.__flatgrad_patched__ = True  # type: ignore[attr-defined]
    deepspeed.initialize = routed


def unpatch() -> None:
    """Restore stock ``deepspeed.initialize`` (idempotent)."""
    global _original
    if _original is None:
        return
    import deepspeed

    deepspeed.initialize = _original
    _original = None


def is_patched() -> bool:
    """Whether ``patch()`` is active."""
    return _original is not None


def patch_from_env() -> None:
    """``patch()`` when ``FLATGRAD_DEEPSPEED=1``; any other value leaves DeepSpeed alone."""
    value = os.environ.get(ENV_VAR, "")
    if value == "1":
        patch()
    elif value not in ("", "0"):
        raise ValueError(f"{ENV_VAR} must be 1 (route deepspeed.initialize through flatgrad) or 0, got {value!r}")
