"""An LR scheduler's per-group state across the sub-group split: stock's unsplit groups in, and out on request.

A torch scheduler built over the ZeRO-1/2 optimizer keeps lists with one entry per param group
(``base_lrs``, ``_last_lr``, ``lr_lambdas``, ``min_lrs``): under flatgrad, one per sub-group. A
stock checkpoint's lists have one per unsplit group; loaded as they are, the scheduler would zip
them with the sub-groups and leave every sub-group past the shorter list at a stale rate. So a
load expands a list of the unsplit groups' length to the sub-groups, and with ``checkpoint_layout``
stock a save collapses it back. See [Note: flatgrad checkpoints in stock's layout] in docs/design.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..config import UnsupportedConfigError

__all__ = ["SchedulerState"]


def _equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


class SchedulerState:
    """Wraps ``scheduler.state_dict`` and ``load_state_dict`` on the instance, so every caller (DeepSpeed's model file,
    the Hugging Face ``Trainer``'s ``scheduler.pt``) sees the same conversion.

    Args:
        scheduler: the engine's LR scheduler (any object with ``state_dict`` and ``load_state_dict``).
        origins: for each sub-group, the index of the unsplit group it was split from.
        unsplit: the number of unsplit groups.
        collapse: ``state_dict`` gives the unsplit groups' lists (``checkpoint_layout`` stock).
    """

    _WRAPPED = ("state_dict", "load_state_dict")  # instance attributes, kept out of the state torch saves
    # torch's schedulers' lists of one entry per param group; ``_schedulers`` holds the state of the schedulers that
    # SequentialLR and ChainedScheduler run, each converted the same way.
    PER_GROUP = frozenset(
        {"base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs", "base_momentums", "max_momentums"}
    )

    def __init__(self, scheduler: Any, origins: Sequence[int], unsplit: int, collapse: bool):
        self.origins = list(origins)
        self.unsplit = unsplit
        self.collapse = collapse
        stock_state_dict, stock_load = scheduler.state_dict, scheduler.load_state_dict

        @functools.wraps(stock_state_dict)
        def state_dict() -> dict:
            sd = {k: v for k, v in stock_state_dict().items() if k not in self._WRAPPED}
            return self.to_groups(sd) if self.collapse else sd

        @functools.wraps(stock_load)
        def load_state_dict(sd: dict) -> Any:
            return stock_load(self.to_sub_groups(sd))

        scheduler.state_dict, scheduler.load_state_dict = state_dict, load_state_dict

    def _per_group(self, key: str, value: Any, length: int) -> bool:
        return (
            key in self.PER_GROUP and isinstance(value, (list, tuple)) and len(value) == length
            and len(self.origins) != self.unsplit
        )  # fmt: skip

    @staticmethod
    def _nested(sd: dict, convert: Any) -> dict:
        nested = sd.get("_schedulers")
        if isinstance(nested, list) and all(isinstance(n, dict) or n is None for n in nested):
            sd["_schedulers"] = [n if n is None else convert(n) for n in nested]
        return sd

    def to_groups(self, sd: dict) -> dict:
        """Each per-sub-group list as one entry per unsplit group (its first sub-group's, which all its sub-groups
        must share; else refuse, naming the key)."""
        out = self._nested(dict(sd), self.to_groups)
        for key, value in sd.items():
            if not self._per_group(key, value, len(self.origins)):
                continue
            first = {g: self.origins.index(g) for g in range(self.unsplit)}
            for s, g in enumerate(self.origins):
                if not _equal(value[s], value[first[g]]):
                    raise UnsupportedConfigError(
                        f"'flatgrad.checkpoint_layout': 'stock' needs the LR scheduler's '{key}' to agree over the "
                        f"sub-groups of param group {g}, and sub-groups {first[g]} and {s} hold {value[first[g]]!r} "
                        f"and {value[s]!r}"
                    )
            out[key] = type(value)(value[first[g]] for g in range(self.unsplit))
        return out

    def to_sub_groups(self, sd: dict) -> dict:
        """Each list of one entry per unsplit group (a stock checkpoint's) as one entry per sub-group."""
        out = self._nested(dict(sd), self.to_sub_groups)
        for key, value in sd.items():
            if self._per_group(key, value, self.unsplit):
                out[key] = type(value)(value[g] for g in self.origins)
        return out
