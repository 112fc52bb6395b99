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
from typing import Any

from . import original
from .config import UnsupportedConfigError
from .initialize import route, run, stock_arguments
from .original import original_initialize

__all__ = ["ENV_VAR", "is_patched", "original_initialize", "patch", "patch_from_env", "unpatch"]

ENV_VAR = "FLATGRAD_DEEPSPEED"

logger = logging.getLogger("flatgrad.deepspeed")

def _routed(*args: Any, **kwargs: Any) -> tuple:
    try:
        p = route(*args, **kwargs)
    except UnsupportedConfigError as exc:
        logger.warning("flatgrad: passing this config to stock DeepSpeed: %s", exc)
        return original_initialize()(**stock_arguments(*args, **kwargs))
    return run(p)


def patch() -> None:
    """Make ``deepspeed.initialize`` go through flatgrad (idempotent)."""
    import deepspeed

    if original.is_saved():
        return
    original.save(deepspeed.initialize)
    routed = functools.wraps(deepspeed.initialize)(_routed)
    routed.__flatgrad_patched__ = True  # type: ignore[attr-defined]
    deepspeed.initialize = routed


def unpatch() -> None:
    """Restore stock ``deepspeed.initialize`` (idempotent)."""
    if not original.is_saved():
        return
    import deepspeed

    deepspeed.initialize = original.forget()


def is_patched() -> bool:
    """Whether ``patch()`` is active."""
    return original.is_saved()


def patch_from_env() -> None:
    """``patch()`` when ``FLATGRAD_DEEPSPEED=1``; any other value leaves DeepSpeed alone."""
    value = os.environ.get(ENV_VAR, "")
    if value == "1":
        patch()
    elif value not in ("", "0"):
        raise ValueError(f"{ENV_VAR} must be 1 (route deepspeed.initialize through flatgrad) or 0, got {value!r}")
