"""Checkpoints under flatgrad's sub-groups: universal checkpoints are paired with the groups they were split from,
legacy ones are refused, clearly, when their groups are not flatgrad's; error-feedback residuals travel with them.

With ``error_feedback`` the reducers' residuals are training state, like the optimizer's moments:
they go into the optimizer's ``state_dict`` only when there are any, so other checkpoints keep
stock's layout. See [Note: residuals in checkpoints] in docs/design.md.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Sequence

import torch

from ..arenas import OptimizerArenas
from ..config import UnsupportedConfigError

__all__ = ["RESIDUALS_KEY", "Zero2Checkpoints"]

RESIDUALS_KEY = "flatgrad_reducers"  # the optimizer state_dict's key: see [Note: residuals in checkpoints]


class Zero2Checkpoints:
    """The ZeRO-1/2 optimizer's checkpoint saver and loaders, under flatgrad's sub-groups.

    Args:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer``.
        reducers: its reducers, whose residuals travel with the checkpoint.
        arenas: the optimizer arenas, invalidated by a load, or ``None``.
        stock_state_dict: DeepSpeed's own ``state_dict``, which ``state_dict`` wraps.
        stock_load_legacy: DeepSpeed's own ``_load_legacy_checkpoint``, which ``load_legacy`` wraps.
    """

    def __init__(
        self,
        optimizer: Any,
        reducers: Sequence[Any],
        arenas: OptimizerArenas | None,
        stock_state_dict: Callable[[], dict],
        stock_load_legacy: Callable[..., Any],
    ):
        self.optimizer = optimizer
        self.reducers = reducers
        self.arenas = arenas
        self.stock_state_dict = stock_state_dict
        self.stock_load_legacy = stock_load_legacy

    def state_dict(self) -> dict:
        """Wraps the optimizer's ``state_dict``: stock's, plus the reducers' residuals where there are any."""
        sd = self.stock_state_dict()
        states = [r.state_dict() for r in self.reducers]
        if any(t is not None for state in states for t in state["residuals"]):
            sd[RESIDUALS_KEY] = states
        return sd

    def _restore_residuals(self, saved: Any, source: str) -> None:
        """Put saved residuals back, or restart them at zero with a warning: see [Note: residuals in checkpoints]."""
        states = [r.state_dict() for r in self.reducers]
        if not any(t is not None for state in states for t in state["residuals"]):
            return
        if saved is not None and len(saved) == len(states) and all(
            tuple(s.get("reduction", ())) == tuple(mine["reduction"]) for s, mine in zip(saved, states)
        ):
            for i, (r, s) in enumerate(zip(self.reducers, saved)):
                try:
                    r.load_state_dict(s)
                except ValueError as exc:
                    raise ValueError(f"flatgrad: the checkpoint's '{RESIDUALS_KEY}'[{i}] does not fit: {exc}") from exc
            return
        for state in states:
            for t in state["residuals"]:
                if t is not None:
                    t.zero_()
        why = "has none" if saved is None else "has them for another reduction or another bucket count"
        warnings.warn(
            f"flatgrad: the {source} {why} ('{RESIDUALS_KEY}'); the error-feedback residuals restart at zero",
            stacklevel=3,
        )

    def load_universal(self, lp_groups_name: str, checkpoint_dir: str) -> None:
        """Replaces ``load_hp_checkpoint_state_from_checkpoint_dir`` (universal checkpoints).

        DeepSpeed pairs the optimizer's param groups with the saved ones by
        position and silently skips groups past the saved count. A checkpoint
        saved without flatgrad has the unsplit groups, so each sub-group is
        paired with the group it was split from; per-parameter state (fp32
        weights, moments, step) comes from the per-parameter files as usual.
        """
        from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
        from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank
        from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

        o = self.optimizer
        zero_dir = os.path.join(checkpoint_dir, "zero")
        path = os.path.join(zero_dir, "optimizer_state.pt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} (the universal checkpoint's optimizer state) is missing")
        optim_sd = torch.load(path, weights_only=False)
        o._load_global_state(optim_sd)
        saved = optim_sd["param_groups"]
        groups = o.optimizer.param_groups
        unsplit, origins = getattr(o, "_flatgrad_origins", (len(groups), list(range(len(groups)))))
        if len(saved) == len(groups):
            pairing = list(range(len(groups)))
        elif len(saved) == unsplit:
            pairing = list(origins)
        elif all(
            {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in saved[0].items() if k != "params"}
            for g in saved
        ):
            pairing = [0] * len(groups)
        else:
            raise RuntimeError(
                f"flatgrad: the universal checkpoint has {len(saved)} param groups with different hyperparameters; "
                f"this optimizer has {len(groups)} sub-groups split from {unsplit} groups, and no pairing is certain"
            )
        tp_rank = bwc_tensor_model_parallel_rank(mpu=o.mpu)
        if o.mpu is None:
            tp_world_size = 1
        elif hasattr(o.mpu, "get_slice_parallel_world_size"):
            tp_world_size = o.mpu.get_slice_parallel_world_size()
        else:
            tp_world_size = o.mpu.get_tensor_model_parallel_world_size()
        ep_rank, ep_size = _get_universal_checkpoint_ep_info()
        lp_groups = getattr(o, lp_groups_name)
        for i, (group, j) in enumerate(zip(groups, pairing)):
            keys, steps = set(), []
            for lp in lp_groups[i]:
                if lp._hp_mapping is None:
                    continue
                step = lp.load_hp_checkpoint_state(
                    os.path.join(zero_dir, o.param_names[lp]), tp_rank, tp_world_size, ep_rank=ep_rank, ep_size=ep_size
                )
                keys.update(lp._hp_mapping.get_optim_state_keys())
                steps.append(step)
            hp_param = group["params"][0]
            if steps and any(step != steps[0] for step in steps):
                raise RuntimeError(f"flatgrad: sub-group {i} restored unequal optimizer steps {steps}")
            if steps and steps[0] is not None:
                o.optimizer.state[hp_param]["step"] = steps[0]
            map_to_flat_opt_states(hp_param, lp_groups[i], o.optimizer.state, keys)
            for key, value in saved[j].items():
                if key != "params":
                    group[key] = value
        if self.arenas is not None:
            self.arenas.invalidate()
        self._restore_residuals(None, "universal checkpoint")

    def load_legacy(
        self, state_dict_list: list, load_optimizer_states: bool = True, load_from_fp32_weights: bool = False
    ) -> Any:
        """Wraps ``_load_legacy_checkpoint``: refuse, clearly, optimizer states of other sub-groups.

        The saved per-group parameter counts must be flatgrad's: a checkpoint of stock
        DeepSpeed (unsplit groups) or of another bucket size has other groups, which
        DeepSpeed refuses with a message about ``parameter_alignment``.
        """
        from deepspeed.checkpoint.constants import PARAM_ALIGNMENT_PADDINGS

        import deepspeed.comm as dist

        o = self.optimizer
        mine = state_dict_list[dist.get_rank(group=o.dp_process_group)]  # as DeepSpeed reads it
        saved = mine.get(PARAM_ALIGNMENT_PADDINGS) if mine is not None else None
        current = [len(g) for g in o.round_robin_bit16_padding]
        if (load_optimizer_states or load_from_fp32_weights) and saved is not None:
            if [len(g) for g in saved] != current:
                raise UnsupportedConfigError(
                    f"the checkpoint's ZeRO optimizer has {len(saved)} param group(s) of {[len(g) for g in saved]} "
                    f"params, flatgrad's has {len(current)} bucket-sized sub-groups of {current}: it was saved by "
                    "stock DeepSpeed or by flatgrad with another bucket size ('flatgrad.bucket_numel' / "
                    "'zero_optimization.reduce_bucket_size'). Load it with the bucket size it was saved with, or "
                    "convert it to a universal checkpoint (deepspeed.checkpoint.ds_to_universal) and load that "
                    "with 'checkpoint.load_universal'"
                )
        try:
            result = self.stock_load_legacy(state_dict_list, load_optimizer_states, load_from_fp32_weights)
        finally:
            if self.arenas is not None:
                self.arenas.invalidate()
        if load_optimizer_states:
            self._restore_residuals(None if mine is None else mine.get(RESIDUALS_KEY), "checkpoint")
        return result
