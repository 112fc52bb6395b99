"""``initialize``: ``deepspeed.initialize`` with flatgrad's gradient reduction installed.

It takes exactly what ``deepspeed.initialize`` takes and returns the same
tuple. The config (``config``, ``config_params`` or ``args.deepspeed_config``)
may carry a ``"flatgrad"`` section, which DeepSpeed never sees. Routing:

* every stage: ``support.check_supported`` refuses what flatgrad does not take over;
* ZeRO stage 1 or 2 -> ``zero2``: the optimizer is built over bucket-sized
  sub-groups (``zero2.prepare``), then the reduce path is installed.
* ZeRO stage 3 -> ``zero3.install`` after DeepSpeed built the engine; DeepSpeed's qgZ key
  (``zero_optimization.zero_quantized_gradients``) runs flatgrad's ``qgz_int8`` and leaves the
  config DeepSpeed sees (``support.take_over_qgz``).
* anything else (stage 0, an unsupported feature) raises
  ``UnsupportedConfigError`` naming the feature and the key; under
  ``patch()`` such configs pass through to stock DeepSpeed instead, with one
  log line saying why (``route`` decides, ``run`` executes).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import logging
import os
from typing import Any

from .config import (
    SECTION,
    FlatgradConfig,
    UnsupportedConfigError,
    check_deepspeed_version,
    load_config,
    split_config,
)
from .original import original_initialize
from .support import check_supported, config_value, take_over_qgz, zero_stage

__all__ = ["QUIET_VAR", "Route", "initialize", "route", "run", "stock_arguments"]

logger = logging.getLogger("flatgrad.deepspeed")


@dataclasses.dataclass
class Route:
    """What ``run`` will do with one ``deepspeed.initialize`` call.

    Attributes:
        backend: ``"zero2"`` (stages 1/2), ``"zero3"``, or ``"stock"`` (flatgrad disabled by its section).
        arguments: the call's arguments by name, the config replaced by one without the section.
        ds_config: the DeepSpeed config without the ``"flatgrad"`` section.
        flatgrad_config: the ``"flatgrad"`` section.
        reason: why the route is stock (empty otherwise).
    """

    backend: str
    arguments: dict
    ds_config: dict
    flatgrad_config: FlatgradConfig
    reason: str = ""


def _bind(args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name, as ``deepspeed.initialize`` would bind them."""
    signature = inspect.signature(original_initialize())
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"flatgrad.deepspeed.initialize takes what deepspeed.initialize takes: {exc}") from None
    return dict(bound.arguments)


def _take_config(arguments: dict) -> Any:
    """Remove the config from ``arguments`` wherever DeepSpeed would have found it."""
    config = arguments.pop("config", None)
    legacy = arguments.pop("config_params", None)
    if config is None:
        config = legacy
    args = arguments.get("args")
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None:
        if config is not None:
            raise ValueError("got a DeepSpeed config both in args.deepspeed_config and as config=; pass one")
        args = copy.copy(args)
        args.deepspeed_config = None
        arguments["args"] = args
        config = from_args
    if config is None:
        raise ValueError("DeepSpeed requires a config: pass config= (a dict or a JSON path) or args.deepspeed_config")
    return config


def _check_zero2_call(arguments: dict, ds_config: dict, flatgrad_config: FlatgradConfig) -> None:
    """Refusals that need the call's objects (the model, a client optimizer or scheduler)."""
    import torch

    from . import zero2

    model = arguments.get("model")
    try:
        from deepspeed.pipe import PipelineModule
    except ImportError:  # pragma: no cover - present in every supported DeepSpeed
        PipelineModule = ()
    if PipelineModule and isinstance(model, PipelineModule):
        raise UnsupportedConfigError(
            "pipeline parallelism (the model is a deepspeed.pipe.PipelineModule, configured by the 'pipeline' "
            "section) is not supported by flatgrad's ZeRO-1/2 backend: the pipeline engine reduces outside ZeRO's hooks"
        )
    optimizer = arguments.get("optimizer")
    if isinstance(optimizer, torch.optim.Optimizer):
        if any(len(s) for s in optimizer.state.values()):
            raise UnsupportedConfigError(
                f"the client optimizer ({type(optimizer).__name__}) already has state; flatgrad must split its param "
                "groups into bucket-sized sub-groups and cannot move existing state. Pass an optimizer that has not "
                "stepped yet, or a callable that builds it, or an 'optimizer' config section"
            )
        scheduler = arguments.get("lr_scheduler")
        passed = scheduler is not None and not callable(scheduler)
        # Every torch LR scheduler sets 'initial_lr' on the groups it is bound to, passed here or not.
        bound = any("initial_lr" in g for g in optimizer.param_groups)
        if passed or bound:
            bucket = flatgrad_config.bucket_numel or int(config_value(ds_config, "zero_optimization.reduce_bucket_size", 500_000_000))
            order = {p: k for k, (_, p) in enumerate(model.named_parameters())} if model is not None else {}
            split = zero2.split_param_groups(optimizer.param_groups, order, bucket)
            if len(split) != len(optimizer.param_groups):
                what = f"the client lr_scheduler ({type(scheduler).__name__})" if passed else "an LR scheduler"
                raise UnsupportedConfigError(
                    f"{what} is bound to the optimizer's {len(optimizer.param_groups)} param group(s), which flatgrad "
                    f"splits into {len(split)} bucket-sized sub-groups (flatgrad.bucket_numel / "
                    "'zero_optimization.reduce_bucket_size'); it would not see the new groups. Pass lr_scheduler as a "
                    "callable (optimizer -> scheduler) so that it is built over the split groups, build it on the "
                    "optimizer initialize returns, or use a 'scheduler' config section"
                )


def stock_arguments(*args: Any, **kwargs: Any) -> dict:
    """The call's arguments for stock DeepSpeed: the config without the ``"flatgrad"`` section (not validated)."""
    arguments = _bind(args, kwargs)
    ds_config = load_config(_take_config(arguments))
    ds_config.pop(SECTION, None)
    arguments["config"] = ds_config
    return arguments


def route(*args: Any, **kwargs: Any) -> Route:
    """Decide the route of one ``deepspeed.initialize(*args, **kwargs)`` call; raise if flatgrad cannot take it."""
    arguments = _bind(args, kwargs)
    ds_config, flatgrad_config = split_config(_take_config(arguments))
    flatgrad_config = take_over_qgz(ds_config, flatgrad_config)
    arguments["config"] = ds_config
    if not flatgrad_config.enabled:
        return Route("stock", arguments, ds_config, flatgrad_config, "the 'flatgrad.enabled' config key is false")
    check_deepspeed_version()
    check_supported(ds_config)
    stage = zero_stage(ds_config)
    if stage in (1, 2):
        _check_zero2_call(arguments, ds_config, flatgrad_config)
        return Route("zero2", arguments, ds_config, flatgrad_config)
    if stage == 3:
        try:
            zero3 = importlib.import_module(f"{__package__}.zero3")  # it needs DeepSpeed's stage-3 optimizer
        except ImportError as exc:
            raise UnsupportedConfigError(
                f"flatgrad's ZeRO-3 backend is not available ({exc}) ('zero_optimization.stage' = 3)"
            ) from exc
        zero3.check_offload(ds_config)
        if flatgrad_config.reduction not in zero3.ZERO3_REDUCTIONS:
            raise UnsupportedConfigError(
                f"'flatgrad.reduction' = {flatgrad_config.reduction!r} is not supported by flatgrad's ZeRO-3 backend (ZeRO-1/2 "
                f"only); use one of {zero3.ZERO3_REDUCTIONS} ('zero_optimization.stage' = 3)"
            )
        if arguments.get("optimizer") is None and "optimizer" not in ds_config:
            raise UnsupportedConfigError(
                "a ZeRO-3 engine without an optimizer (no 'optimizer' config section and no optimizer argument) "
                "reduces no gradients: DeepSpeed builds it for inference (ZeRO-Inference / frozen models), "
                "which needs no flatgrad"
            )
        return Route("zero3", arguments, ds_config, flatgrad_config)
    raise UnsupportedConfigError(
        f"ZeRO stage {stage} has no gradient partitioning for flatgrad to replace ('zero_optimization.stage'); "
        "flatgrad handles stages 1, 2 and 3"
    )


QUIET_VAR = "FLATGRAD_QUIET"


def _announce(message: str, flatgrad_config: FlatgradConfig) -> None:
    """The take-over line, once on rank 0, on stderr: visible under DeepSpeed's default WARNING level.

    ``FLATGRAD_QUIET=1`` or ``"flatgrad": {"announce": false}`` silences it; it
    also goes to the ``flatgrad.deepspeed`` logger at INFO on every rank.
    """
    import sys

    import torch.distributed as dist

    logger.info(message)
    if not flatgrad_config.announce or os.environ.get(QUIET_VAR, "") not in ("", "0"):
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(message, file=sys.stderr, flush=True)


def run(p: Route) -> tuple:
    """Execute a route: call DeepSpeed, with flatgrad's reduce path on the flatgrad backends."""
    original = original_initialize()
    if p.backend == "stock":
        logger.warning("flatgrad: passing this config to stock DeepSpeed: %s", p.reason)
        return original(**p.arguments)
    if p.backend == "zero2":
        from . import zero2

        with zero2.prepare(p.flatgrad_config):
            result = original(**p.arguments)
        _announce(zero2.install(result[0], p.flatgrad_config).describe(), p.flatgrad_config)
        return result
    if p.backend == "zero3":
        from .zero3 import install as zero3_install

        result = original(**p.arguments)
        _announce(zero3_install(result[0], p.flatgrad_config).describe(), p.flatgrad_config)
        return result
    raise ValueError(f"unknown route {p.backend!r}")


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``deepspeed.initialize`` with flatgrad's reduce path: same arguments, same returned tuple.

    Raises ``UnsupportedConfigError`` (naming the feature and the config key)
    for configs flatgrad does not handle, e.g. ZeRO stage 0 or CPU offload.
    """
    return run(route(*args, **kwargs))
