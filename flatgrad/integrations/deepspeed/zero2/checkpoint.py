"""Checkpoints under flatgrad's sub-groups: universal checkpoints are paired with the groups they were split from,
stock ZeRO-1/2 ones are re-partitioned into the sub-groups, others are refused, clearly, before anything is loaded;
error-feedback residuals travel with them.

Before the engine loads anything, every rank reads and checks its own optimizer shard, and the
ranks agree: a bad shard on one rank raises on every rank, naming the file, with the engine's state
untouched. See [Note: stock checkpoints under flatgrad] in docs/design.md.

With ``error_feedback`` the reducers' residuals are training state, like the optimizer's moments:
they go into the optimizer's ``state_dict`` only when there are any, so other checkpoints keep
stock's layout. See [Note: residuals in checkpoints] in docs/design.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import torch

from ..arenas import OptimizerArenas
from ..config import UnsupportedConfigError
from .scheduler_state import SchedulerState
from .stock_checkpoint import (
    STOCK,
    CheckpointLoadError,
    classify,
    repartition,
    stock_layout,
    to_stock,
    unsplit_hyperparameters,
    world_size_error,
    world_size_error_type,
)

__all__ = ["RESIDUALS_KEY", "CheckpointLoadError", "Zero2Checkpoints"]

RESIDUALS_KEY = "flatgrad_reducers"  # the optimizer state_dict's key: see [Note: residuals in checkpoints]


class Zero2Checkpoints:
    """The ZeRO-1/2 optimizer's checkpoint saver and loaders, under flatgrad's sub-groups.

    Args:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer``.
        reducers: its reducers, whose residuals travel with the checkpoint.
        arenas: the optimizer arenas, invalidated by a load, or ``None``.
        stock_state_dict: DeepSpeed's own ``state_dict``, which ``state_dict`` wraps.
        stock_load_legacy: DeepSpeed's own ``_load_legacy_checkpoint``, which ``load_legacy`` wraps.
        layout: ``"flatgrad"`` (save the sub-groups as they are) or ``"stock"`` (``engine.save_checkpoint`` writes
            stock's layout of the unsplit groups): ``flatgrad.checkpoint_layout``.
    """

    def __init__(
        self,
        optimizer: Any,
        reducers: Sequence[Any],
        arenas: OptimizerArenas | None,
        stock_state_dict: Callable[[], dict],
        stock_load_legacy: Callable[..., Any],
        layout: str = "flatgrad",
    ):
        self.optimizer = optimizer
        self.layout = layout
        self._saving_stock = False  # inside ``engine.save_checkpoint`` with ``layout`` stock: ``state_dict`` converts
        self.reducers = reducers
        self.arenas = arenas
        self.stock_state_dict = stock_state_dict
        self.stock_load_legacy = stock_load_legacy
        self._checked: str | None = None  # the shard ``load_checkpoint`` checked for the coming ``load_legacy``

    def state_dict(self) -> dict:
        """Wraps the optimizer's ``state_dict``: stock's, plus the reducers' residuals where there are any; inside a
        stock-layout ``engine.save_checkpoint``, in stock's layout (collective then, as that save is)."""
        sd = self.stock_state_dict()
        states = [r.state_dict() for r in self.reducers]
        if any(t is not None for state in states for t in state["residuals"]):
            sd[RESIDUALS_KEY] = states
        return to_stock(self.optimizer, sd) if self._saving_stock else sd

    def _restore_residuals(self, saved: Any, source: str) -> None:
        """Put saved residuals back, or restart them at zero with a warning: see [Note: residuals in checkpoints]."""
        states = [r.state_dict() for r in self.reducers]
        if not any(t is not None for state in states for t in state["residuals"]):
            return
        if saved is not None and len(saved) == len(states) and all(
            tuple(s.get("reduction", ())) == tuple(mine["reduction"]) and _residuals_fit(s, mine)
            for s, mine in zip(saved, states)
        ):  # checked in full first: by now stock's load has replaced the rest of the state
            for r, s in zip(self.reducers, saved):
                r.load_state_dict(s)
            return
        for state in states:
            for t in state["residuals"]:
                if t is not None:
                    t.zero_()
        why = "has none" if saved is None else "has them for another reduction or other buckets"
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

    def attach(self, engine: Any) -> None:
        """Wrap ``engine.load_checkpoint``: every rank's optimizer shard is read and checked, and the ranks agree,
        before stock's load touches the engine; stock then loads the shard read here, not a second copy. With
        ``layout`` stock, wrap ``engine.save_checkpoint`` too: see [Note: flatgrad checkpoints in stock's layout].
        The engine's LR scheduler loads a stock checkpoint's per-group lists into the sub-groups, and with ``layout``
        stock saves them per unsplit group (``SchedulerState``)."""
        self._attach_load(engine)
        if self.layout == STOCK:
            self._attach_save(engine)
        scheduler = getattr(engine, "lr_scheduler", None)
        if callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None)):
            unsplit, origins = self.optimizer._flatgrad_origins
            SchedulerState(scheduler, origins, unsplit, collapse=self.layout == STOCK)

    def _attach_save(self, engine: Any) -> None:
        """``engine.save_checkpoint`` writes each rank's optimizer shard, and the model file's ``param_shapes``, in
        stock's layout of the unsplit groups."""
        if engine.zero_elastic_checkpoint():
            raise UnsupportedConfigError(
                "'flatgrad.checkpoint_layout': 'stock' writes stock's default shards; "
                "'zero_optimization.elastic_checkpoint' saves another kind"
            )
        o = self.optimizer
        if any(o.is_moe_group(g) for g in o.optimizer.param_groups):
            raise UnsupportedConfigError(
                "'flatgrad.checkpoint_layout': 'stock' does not re-partition a model with MoE param groups (groups "
                "marked 'moe'); save in flatgrad's layout and convert with deepspeed.checkpoint.ds_to_universal"
            )
        unsplit, origins = o._flatgrad_origins
        unsplit_hyperparameters(o.optimizer.param_groups, origins, unsplit)  # an empty group: refused now
        stock = engine.save_checkpoint

        @functools.wraps(stock)
        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            import deepspeed.comm as dist

            unsplit_hyperparameters(o.optimizer.param_groups, origins, unsplit)  # before anything is written
            shapes = stock_layout(o, dist.get_world_size(group=o.dp_process_group)).param_shapes(o.param_names)
            shadowed = engine.__dict__.get("_get_zero_param_shapes")
            engine._get_zero_param_shapes = lambda: shapes
            self._saving_stock = True
            try:
                return stock(*args, **kwargs)
            finally:
                self._saving_stock = False
                if shadowed is None:
                    del engine._get_zero_param_shapes
                else:
                    engine._get_zero_param_shapes = shadowed

        engine.save_checkpoint = save_checkpoint

    def _attach_load(self, engine: Any) -> None:
        stock = engine.load_checkpoint
        signature = inspect.signature(stock)

        @functools.wraps(stock)
        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            a = signature.bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            tag = a["tag"]
            if tag is None:
                latest = os.path.join(a["load_dir"], "latest")
                if os.path.isfile(latest):
                    with open(latest) as f:
                        tag = f.read().strip()
            if (
                tag is None or not a["load_optimizer_states"] or a["load_module_only"]
                or engine.load_universal_checkpoint() or engine.zero_nvme_offload_optimizer()
            ):  # fmt: skip
                return stock(*args, **kwargs)
            state = self._read_own_shard(engine, a["load_dir"], tag)
            with self._serving(engine, state):
                return stock(*args, **kwargs)

        engine.load_checkpoint = load_checkpoint

    def _read_own_shard(self, engine: Any, load_dir: str, tag: Any) -> dict:
        """This rank's optimizer shard, read and checked; raise on every rank if any rank's is not loadable."""
        import glob

        import deepspeed.comm as dist
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

        o = self.optimizer
        group = o.dp_process_group
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        folder = os.path.join(load_dir, str(tag))

        def shard(dp_rank: int) -> str:
            name = engine._get_rank_zero_ckpt_name(
                load_dir, tag, engine.checkpoint_mp_rank, dp_rank, engine.bfloat16_enabled()
            )
            old = name.replace("_optim_states.pt", "optim_states.pt")  # DeepSpeed's older name, which it also reads
            return old if not os.path.exists(name) and os.path.exists(old) else name

        path, state, kind, error = shard(rank), None, None, None
        try:
            layers = sorted(glob.glob(os.path.join(folder, "layer_*-model_states.pt")))
            if layers:
                raise UnsupportedConfigError(
                    f"{folder} was saved by a pipeline engine ({os.path.basename(layers[0])}): its ZeRO shards hold "
                    "one pipeline stage's parameters each, and flatgrad's ZeRO-1/2 does not run pipeline parallelism"
                )
            saved = 0
            while os.path.exists(shard(saved)):
                saved += 1
            if saved == 0:
                raise CheckpointLoadError(f"{folder} holds no ZeRO optimizer shard ({shard(0)} is missing)")
            if saved != world_size:
                names = os.path.basename(shard(0)) + ("" if saved == 1 else f" .. {os.path.basename(shard(saved - 1))}")
                raise world_size_error(f"{folder} ({names})", saved, world_size)
            try:
                loaded = engine.checkpoint_engine.load(path, map_location="cpu")
            except Exception as exc:
                raise CheckpointLoadError(f"{path} cannot be read: {type(exc).__name__}: {exc}") from exc
            if not isinstance(loaded, dict) or OPTIMIZER_STATE_DICT not in loaded:
                raise CheckpointLoadError(f"{path} has no '{OPTIMIZER_STATE_DICT}': it is not a ZeRO optimizer shard")
            state = loaded[OPTIMIZER_STATE_DICT]
            kind = classify(o, state, path)
        except (UnsupportedConfigError, CheckpointLoadError) as exc:
            error = exc
        _agree(group, error, kind)
        self._checked = path
        return state

    @contextlib.contextmanager
    def _serving(self, engine: Any, state: dict) -> Iterator[None]:
        """While active, the engine's ZeRO load gets the shard already read (stock reads only its own rank's too)."""
        import deepspeed.comm as dist

        name = "_get_all_zero_checkpoints"
        if engine.zero_elastic_checkpoint() or getattr(engine, "_autoep_folding_spec", None) is not None:
            yield  # stock reads every rank's shard, or checks metadata on the way: its own reader
            return
        group = self.optimizer.dp_process_group
        rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        shadowed = engine.__dict__.get(name)
        setattr(engine, name, lambda *args, **kwargs: [state if r == rank else None for r in range(world_size)])
        try:
            yield
        finally:
            if shadowed is None:
                delattr(engine, name)
            else:
                setattr(engine, name, shadowed)
            self._checked = None

    def load_legacy(
        self, state_dict_list: list, load_optimizer_states: bool = True, load_from_fp32_weights: bool = False
    ) -> Any:
        """Wraps ``_load_legacy_checkpoint``: a stock shard is re-partitioned into the sub-groups first; a shard of
        other sub-groups is refused, clearly.

        A checkpoint of flatgrad with another bucket size has other groups, which
        DeepSpeed itself would refuse with a message about ``parameter_alignment``.
        """
        import deepspeed.comm as dist

        o = self.optimizer
        group = o.dp_process_group
        rank = dist.get_rank(group=group)
        mine = state_dict_list[rank]  # as DeepSpeed reads it
        checked, self._checked = self._checked, None
        if (load_optimizer_states or load_from_fp32_weights) and mine is not None:
            if checked is not None:  # ``load_checkpoint`` classified it, and the ranks agreed
                kind = classify(o, mine, checked)
            else:
                kind, error = None, None
                try:
                    kind = classify(o, mine, f"the ZeRO optimizer shard of rank {rank}")
                except (UnsupportedConfigError, CheckpointLoadError) as exc:
                    error = exc
                _agree(group, error, kind)
            if kind == STOCK:
                state_dict_list = list(state_dict_list)
                state_dict_list[rank] = repartition(o, mine)
        try:
            result = self.stock_load_legacy(state_dict_list, load_optimizer_states, load_from_fp32_weights)
        finally:
            if self.arenas is not None:
                self.arenas.invalidate()
        if load_optimizer_states:
            self._restore_residuals(None if mine is None else mine.get(RESIDUALS_KEY), "checkpoint")
        return result


def _residuals_fit(saved: Any, mine: dict) -> bool:
    """Whether a reducer's saved residuals are, bucket by bucket, of the shapes and dtypes of this reducer's."""
    theirs = saved.get("residuals") if isinstance(saved, dict) else None
    if not isinstance(theirs, (list, tuple)) or len(theirs) != len(mine["residuals"]):
        return False
    return all(
        (a is None) == (b is None) and (a is None or (torch.is_tensor(a) and a.shape == b.shape and a.dtype == b.dtype))
        for a, b in zip(theirs, mine["residuals"])
    )


def _agree(group: Any, error: Exception | None, kind: str | None) -> None:
    """Raise on every rank of ``group`` if any rank's shard failed its check, or if the ranks' shards are of different
    layouts; a rank raising alone would leave the others waiting in the re-partition's collective."""
    import deepspeed.comm as dist

    world_size = dist.get_world_size(group=group)
    mine = (kind, None if error is None else (type(error).__name__, str(error)))
    if world_size == 1:
        everyone = [mine]
    else:
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, (_, e) in enumerate(everyone) if e is not None]
    if failed:
        r, (cls, message) = failed[0]
        kinds_of = (world_size_error_type(), UnsupportedConfigError, CheckpointLoadError)
        kind_of = next((k for k in kinds_of if k.__name__ == cls), CheckpointLoadError)
        raise kind_of(f"rank {r}: {message} (this is rank {dist.get_rank(group=group)})")
    kinds = sorted({k for k, _ in everyone})
    if len(kinds) > 1:
        raise CheckpointLoadError(f"the ranks' ZeRO optimizer shards are of different layouts: {kinds}")
