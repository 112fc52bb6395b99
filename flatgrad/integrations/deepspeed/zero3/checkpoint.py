"""Error-feedback residuals in ZeRO-3 checkpoints: saved per bucket composition, restored as each is built.

The residuals live per composition (``comp.bucket.residual``), and compositions are made lazily in the first
backward. A checkpoint keys each by ``(bucket dtype, its parameters' places in the optimizer's sub-groups)``: the same
in every engine built over the same model (a ``ds_id``, DeepSpeed's ``get_param_id``, counts on across the engines
of one process). The optimizer's
``state_dict`` carries them under the key ZeRO-1/2 uses, only when there are any (stock's layout otherwise); a load
keeps them pending and copies each into its composition when it is built. See [Note: residuals in checkpoints] in
docs/design.md.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from ..zero2.checkpoint import RESIDUALS_KEY
from .composition import Composition

__all__ = ["Zero3Residuals"]


class Zero3Residuals:
    """The residuals of one ZeRO-3 optimizer's compositions, as its checkpoints save and load them.

    Attributes:
        optimizer: the ``DeepSpeedZeroOptimizer_Stage3`` (its parameters' order keys the checkpoint).
        reduction: what every rank agrees the mode is (``ReductionMode.describe()``), saved beside them.
        pending: ``{checkpoint key: saved residual}`` loaded for compositions not built yet.
    """

    def __init__(self, optimizer: Any, reduction: tuple, error_feedback: bool) -> None:
        self.optimizer = optimizer
        self.reduction = tuple(reduction)
        self.error_feedback = error_feedback
        self.pending: dict[tuple, torch.Tensor] = {}
        self._places: dict[int, int] | None = None

    def key(self, comp: Composition) -> tuple:
        """``comp``'s checkpoint key: its bucket dtype and its parameters' places in the sub-groups, in bucket order."""
        if self._places is None:
            params = (p for group in self.optimizer.fp16_groups for p in group)
            self._places = {id(p): i for i, p in enumerate(params)}
        return (comp.key[0], tuple(self._places[id(p)] for p in comp.bucket.params))

    def state(self, compositions: Iterable[Composition]) -> dict | None:
        """``{"reduction", "residuals": {checkpoint key: residual}}``, or ``None`` when no bucket has one."""
        residuals = {self.key(c): c.bucket.residual for c in compositions if c.bucket.residual is not None}
        return {"reduction": self.reduction, "residuals": residuals} if residuals else None

    def load(self, saved: Any, compositions: Iterable[Composition], source: str) -> None:
        """Take ``saved`` (what ``state`` gave, or ``None``): the built compositions' residuals are copied now, the
        others when they are built. Without any for this reduction, they restart at zero with a warning."""
        self.pending = {}
        built = list(compositions)
        for comp in built:
            if comp.bucket.residual is not None:
                comp.bucket.residual.zero_()
        if not self.error_feedback:
            return
        if saved is None or tuple(saved.get("reduction", ())) != self.reduction:
            why = "has none" if saved is None else "has them for another reduction"
            warnings.warn(
                f"flatgrad: the {source} {why} ('{RESIDUALS_KEY}'); the error-feedback residuals restart at zero",
                stacklevel=3,
            )
            return
        self.pending = dict(saved["residuals"])
        for comp in built:
            self.restore(comp)

    def restore(self, comp: Composition) -> None:
        """Copy ``comp``'s pending residual into its bucket; one that does not fit raises, naming the key."""
        if not self.pending:
            return
        key = self.key(comp)
        saved = self.pending.pop(key, None)
        mine = comp.bucket.residual
        if saved is None or mine is None:
            return
        if saved.shape != mine.shape or saved.dtype != mine.dtype:
            raise ValueError(
                f"flatgrad: the checkpoint's '{RESIDUALS_KEY}' residual of bucket {key} is {tuple(saved.shape)} "
                f"{saved.dtype}, this run's is {tuple(mine.shape)} {mine.dtype}"
            )
        mine.copy_(saved)
