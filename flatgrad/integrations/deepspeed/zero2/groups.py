"""The sub-group split: every param group cut, in backward order, into bucket-sized sub-groups before DeepSpeed flattens.

A ZeRO-1/2 rank owns one 1/W slice of each flat param group, and gradients arrive in backward
order: split in that order before DeepSpeed flattens, every sub-group is one balanced bucket, and
``install`` checks its layout against DeepSpeed's. See [Note: bucket-aligned sub-groups] in
docs/design.md.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ....layout import split_numels
from ..config import FlatgradConfig, UnsupportedConfigError

__all__ = ["prepare", "split_param_groups"]

logger = logging.getLogger("flatgrad.deepspeed")


def split_param_groups(
    param_groups: Sequence[Mapping[str, Any]], order: Mapping[torch.nn.Parameter, int], bucket_numel: int
) -> list[dict]:
    """Split every group, in backward order, into sub-groups of about ``bucket_numel`` elements.

    ``order`` maps a parameter to its registration index; backward order is
    the reverse. Parameters the optimizer will not own (frozen, or without
    elements) are left out, as DeepSpeed leaves them out. The cuts are
    ``flatgrad.layout.split_numels``'s: a small param joins the next large one
    rather than making a collective of its own. Every sub-group copies
    its group's other keys. See [Note: bucket-aligned sub-groups].
    """
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    out: list[dict] = []
    for group in param_groups:
        params = [p for p in group["params"] if p.requires_grad and p.numel() > 0]
        position = {id(p): k for k, p in enumerate(params)}
        # Registered parameters in reverse registration order; any others after them, as given.
        params.sort(key=lambda p: (0, -order[p]) if p in order else (1, position[id(p)]))
        for start, stop in split_numels([p.numel() for p in params], bucket_numel):
            out.append(_sub_group(group, params[start:stop]))
    return out



def _sub_group(group: Mapping[str, Any], params: list) -> dict:
    sub = {k: v for k, v in group.items() if k != "params"}
    sub["params"] = list(params)
    return sub



def _rebuild_optimizer(optimizer: Any, groups: list[dict]) -> None:
    """Point a state-less torch optimizer at ``groups`` (its own hyperparameters, split)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedConfigError(
            f"flatgrad splits the optimizer's param groups and needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if any(len(s) for s in optimizer.state.values()):
        raise UnsupportedConfigError(
            f"the client optimizer ({type(optimizer).__name__}) already has state; flatgrad must split its param groups "
            "into bucket-sized sub-groups and cannot move existing state. Pass an optimizer that has not stepped yet, "
            "or a callable that builds it, or an 'optimizer' config section"
        )
    optimizer.param_groups = []
    for group in groups:
        optimizer.add_param_group(group)



@contextlib.contextmanager
def prepare(config: FlatgradConfig) -> Iterator[None]:
    """While active, DeepSpeed's ZeRO-1/2 optimizer is built over bucket-sized sub-groups.

    The seam is the engine module's ``DeepSpeedZeroOptimizer`` name, which
    ``DeepSpeedEngine._configure_zero_optimizer`` looks up when it builds the
    optimizer, after DeepSpeed has built the basic optimizer (and its MoE
    groups) and before anything is flattened.
    """
    import deepspeed.runtime.engine as engine_mod
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    current = getattr(engine_mod, "DeepSpeedZeroOptimizer", None)
    if current is not DeepSpeedZeroOptimizer:
        raise UnsupportedConfigError(
            "this DeepSpeed's engine does not build ZeRO-1/2 through deepspeed.runtime.engine.DeepSpeedZeroOptimizer; "
            "flatgrad's ZeRO-1/2 seam is missing (see docs/design.md 'DeepSpeed seams')"
        )

    def build(init_optimizer, param_names, *args, **kwargs):
        bucket = config.bucket_numel
        if bucket is None:
            bucket = int(kwargs.get("reduce_bucket_size", 500_000_000))
        order = {p: k for k, p in enumerate(param_names)}
        if any(getattr(p, "use_muon", False) for g in init_optimizer.param_groups for p in g["params"]):
            raise UnsupportedConfigError(
                "parameters marked use_muon (the Muon optimizer) rewrite gradients while DeepSpeed builds the "
                "partition, which flatgrad replaces ('optimizer.type')"
            )
        from deepspeed.runtime.utils import is_optimized_parameter

        before = len(init_optimizer.param_groups)
        # Stock's flat order of every unsplit group, for the clipping norm: see [Note: stock clipping norm].
        unsplit = [[p for p in group["params"] if is_optimized_parameter(p)] for group in init_optimizer.param_groups]
        groups, origins = [], []
        for g, group in enumerate(init_optimizer.param_groups):
            subs = split_param_groups([group], order, bucket)
            groups += subs
            origins += [g] * len(subs)
        if not groups:
            raise UnsupportedConfigError(
                "the optimizer has no trainable parameters with elements; nothing for ZeRO to partition"
            )
        _rebuild_optimizer(init_optimizer, groups)
        logger.info(
            "flatgrad: %d param group(s) split into %d sub-group(s) of about %d elements", before, len(groups), bucket
        )
        zero = DeepSpeedZeroOptimizer(init_optimizer, param_names, *args, **kwargs)
        zero._flatgrad_origins = (before, origins)
        zero._flatgrad_unsplit = unsplit
        return zero

    engine_mod.DeepSpeedZeroOptimizer = build
    try:
        yield
    finally:
        engine_mod.DeepSpeedZeroOptimizer = current

