"""Where flatgrad enters DeepSpeed's ZeRO-3 optimizer: the checks and refusals, the reduction mode, and the
methods replaced on the optimizer instance, stock's kept by the ``Zero3Seams`` that replaces them.

``install`` refuses what it cannot serve by key, makes the buckets' mode (the two-stage node and rail groups once,
after every rank agreed on the placement, so a bad ``node_size`` raises on every rank instead of hanging), binds the
replacements and hands over to ``Zero3Reduction``. See [Note: ZeRO-3 two-stage reduction] in docs/design.md.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

from ....reducer import ReducerConfig, ReduceScatter, ReductionMode, plan_mode, registry
from ..config import FlatgradConfig, UnsupportedConfigError, deepspeed_version, offload_device
from ..stock_methods import StockMethods
from ..support import config_value
from ..zero2.checkpoint import RESIDUALS_KEY
from .reduction import GRAD_PARTITIONS, Zero3Reduction

__all__ = ["ATTRIBUTE", "ZERO3_REDUCTIONS", "Zero3Seams", "check_offload", "install", "raise_on_every_rank",
           "reduction_mode"]  # fmt: skip

_PREFIX = "_DeepSpeedZeroOptimizer_Stage3__"
_ADD_GRAD = _PREFIX + "add_grad_to_ipg_bucket"
_REDUCE = _PREFIX + "reduce_and_partition_ipg_grads"
# The optimizer's attribute that holds the installed ``Zero3Reduction``.
ATTRIBUTE = "flatgrad"
# The reductions ZeRO-3 serves: see [Note: ZeRO-3 two-stage reduction].
ZERO3_REDUCTIONS = registry.names(zero_stage=3)

# DeepSpeed's methods behind safe_set_full_grad / safe_set_local_grad / safe_update_full_grad_vectorized.
_GRAD_WRITERS = ("set_fp32_grad_for_param", "set_local_grad_for_param", "update_fp32_grad_for_param_vectorized")
# The stock methods flatgrad's replacements wrap or fall back on.
_KEPT = ("_get_norm_groups", "has_overflow", "step", "zero_grad", "independent_gradient_partition_epilogue",
         "state_dict", "load_state_dict") + _GRAD_WRITERS
# What the replacement seams call or read on the optimizer, besides the seams themselves.
_METHODS = ("get_param_comm_dtype", "_get_param_partition_group", "_assert_same_partition_group",
            "_gradient_averaging_world_size", "_get_norm_groups", "has_overflow", "step", "zero_grad",
            "independent_gradient_partition_epilogue", "is_gradient_accumulation_boundary", "get_param_id",
            "_constant_buffered_norm2", "state_dict", "load_state_dict") + _GRAD_WRITERS
_STATE = ("ipg_buckets", "param_reduce_events", "max_param_reduce_events", "reduce_and_partition_stream",
          "micro_step_id", "grad_partitions_flat_buffer", "_offload_boundary_param_ids", "enable_sanity_checks",
          "fp16_groups", "dp_process_group", "model_parallel_group", "offload_optimizer")
# What the offload path reads besides, checked when it is on: see [Note: ZeRO-3 optimizer offload].
_OFFLOAD_STATE = ("grad_position", "fp32_partitioned_groups_flat", "norm_for_param_grads",
                  "master_weights_and_grads_dtype", "offload_optimizer_pin_memory", "swap_optimizer", "partial_offload")


class Zero3Seams:
    """The methods flatgrad replaces on one ZeRO-3 optimizer instance, with stock's that the replacements call.

    The two IPG seams go to the ``Zero3Reduction``; the step's norm and overflow to its stats, falling back to
    stock's where the stats do not serve; ``step``, ``zero_grad``, the epilogue, the grad writers and the
    checkpoint's ``state_dict`` / ``load_state_dict`` (the error-feedback residuals) are wrapped.
    """

    def __init__(self, optimizer: Any, reduction: Zero3Reduction) -> None:
        self.optimizer = optimizer
        self.reduction = reduction
        self.stock = StockMethods(optimizer, _KEPT)

    def bind(self) -> None:
        """Replace the seams on the optimizer instance (DeepSpeed looks them up there at call time)."""
        reduction = self.reduction
        self.stock.replace({
            _ADD_GRAD: reduction.add_grad_to_ipg_bucket,
            _REDUCE: reduction.reduce_and_partition_ipg_grads,
            "_get_norm_groups": self.get_norm_groups,
            "has_overflow": self.has_overflow,
            "step": self.step,
            "zero_grad": self.zero_grad,
            "independent_gradient_partition_epilogue": self.independent_gradient_partition_epilogue,
            "state_dict": self.state_dict,
            "load_state_dict": self.load_state_dict,
            **{name: self._edits_grads(getattr(self.stock, name)) for name in _GRAD_WRITERS},
        })  # fmt: skip

    def get_norm_groups(self) -> list[torch.Tensor]:
        """Replaces ``_get_norm_groups``: the norm from the unpack stats, else stock's (see
        [Note: ZeRO-3 step statistics])."""
        norms = self.reduction.stats.norm_groups()
        return self.stock._get_norm_groups() if norms is None else norms

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        """Replaces ``has_overflow``: any inf/nan in any rank's partitions, from the unpack stats, else stock's."""
        overflow = self.reduction.stats.overflow() if partition_gradients else None
        return self.stock.has_overflow(partition_gradients) if overflow is None else overflow

    def step(self, closure: Any = None) -> Any:
        """Wraps ``step``: the window's stats are consumed (or discarded) with it."""
        try:
            return self.stock.step(closure)
        finally:
            self.reduction.stats.end_window()

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        """Wraps ``zero_grad``: it restarts accumulation, so the stats restart too."""
        self.reduction.stats.end_window()
        return self.stock.zero_grad(*args, **kwargs)

    def independent_gradient_partition_epilogue(self) -> None:
        """Wraps stock's epilogue: after it (and its wait for the reduce stream), every staged bucket is unpacked."""
        self.stock.independent_gradient_partition_epilogue()
        self.reduction.drain(everything=True)

    def state_dict(self) -> dict:
        """Wraps ``state_dict``: stock's, plus the compositions' error-feedback residuals where there are any."""
        sd = self.stock.state_dict()
        saved = self.reduction.residuals.state(self.reduction.compositions.values())
        if saved is not None:
            sd[RESIDUALS_KEY] = saved
        return sd

    def load_state_dict(self, state_dict_list: Any, *args: Any, **kwargs: Any) -> Any:
        """Wraps ``load_state_dict``: after stock's load, this rank's saved residuals (kept pending for the
        compositions not built yet); a universal checkpoint (``checkpoint_folder``) carries none."""
        import torch.distributed as tdist

        bound = inspect.signature(self.stock.load_state_dict).bind(state_dict_list, *args, **kwargs)
        universal = bool(bound.arguments.get("checkpoint_folder"))
        mine = None
        if not universal and state_dict_list:
            mine = state_dict_list[tdist.get_rank(self.optimizer.dp_process_group)].get(RESIDUALS_KEY)
        result = self.stock.load_state_dict(state_dict_list, *args, **kwargs)
        source = "universal checkpoint" if universal else "checkpoint"
        self.reduction.residuals.load(mine, self.reduction.compositions.values(), source)
        return result

    def _edits_grads(self, method: Any) -> Any:
        """Wraps a DeepSpeed method that writes grad partitions (``safe_set_full_grad`` and kin): a partition
        written after its unpack is not in the unpack's stats, so this window's step reads the partitions."""

        def edited(*args: Any, **kwargs: Any) -> Any:
            self.reduction.stats.mark_stale()
            return method(*args, **kwargs)

        return edited


def raise_on_every_rank(group: Any, error: str | None, payload: Any, *, what: str, key: str, advice: str = "") -> list:
    """Exchange this rank's ``error`` (``None``: it succeeded) and ``payload`` with every rank of ``group`` in one
    ``all_gather_object``; when any rank failed, every rank raises, naming the failing rank and ``key``, instead
    of the others hanging in a later collective. Returns every rank's payload, in group rank order."""
    import torch.distributed as tdist

    rank = tdist.get_rank(group)
    everyone: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(everyone, (error, payload), group=group)
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        r, e = failed[0]
        raise UnsupportedConfigError(f"{what} on rank {r} ({key}; this is rank {rank}): {e}{advice}")
    return [p for _, p in everyone]


def _check_seams(opt: Any) -> None:
    """Refuse a DeepSpeed whose ZeRO-3 optimizer lacks what flatgrad replaces or relies on, naming the version."""
    cls = type(opt)
    missing = [name for name in (_ADD_GRAD, _REDUCE) + _METHODS if not callable(getattr(cls, name, None))]
    missing += [name for name in _STATE if not hasattr(opt, name)]
    if getattr(opt, "offload_optimizer", False):
        missing += [name for name in _OFFLOAD_STATE if not hasattr(opt, name)]
    if not isinstance(getattr(opt, GRAD_PARTITIONS, None), dict):
        missing.append(GRAD_PARTITIONS)
    if missing:
        version = ".".join(map(str, deepspeed_version()))
        raise UnsupportedConfigError(
            f"DeepSpeed {version}: {cls.__name__} lacks {missing}, which flatgrad's ZeRO-3 backend replaces or "
            "uses (docs/design.md 'DeepSpeed seams'); it is written against DeepSpeed 0.19.8"
        )


def _check_engine(engine: Any) -> Any:
    """The engine's ``DeepSpeedZeroOptimizer_Stage3``, or refused by key for what flatgrad's ZeRO-3 does not serve."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    opt = getattr(engine, "optimizer", None)
    if type(opt) is not DeepSpeedZeroOptimizer_Stage3:
        if opt is None or type(opt).__name__ == "DeepSpeedZeRoOffload":
            why = (
                "no optimizer was given (no 'optimizer' config section, no client optimizer), so DeepSpeed reduces "
                "no gradients"
            )
        else:
            why = "SuperOffload (zero_optimization.offload_optimizer.super_offload) and subclasses are not supported"
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-3 backend needs a DeepSpeedZeroOptimizer_Stage3; the engine has "
            f"{type(opt).__name__}: {why}"
        )
    if getattr(opt, ATTRIBUTE, None) is not None:
        raise RuntimeError("flatgrad's ZeRO-3 backend is already installed on this optimizer")
    _check_seams(opt)
    if opt.offload_optimizer:
        if opt.swap_optimizer:
            raise UnsupportedConfigError(
                "flatgrad's ZeRO-3 backend does not support NVMe optimizer offload "
                "('zero_optimization.offload_optimizer.device' = 'nvme'); offload to 'cpu' instead"
            )
        if opt.partial_offload != 1.0:
            raise UnsupportedConfigError(
                f"flatgrad's ZeRO-3 backend does not support partial optimizer offload "
                f"('zero_optimization.offload_optimizer.ratio' = {opt.partial_offload}); use ratio 1"
            )
    if not opt.reduce_scatter:
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend needs zero_optimization.reduce_scatter=true")
    if getattr(opt, "zenflow", False):
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend does not support ZenFlow (zero_optimization.zenflow)")
    if opt.all2all_process_group is not None:
        raise UnsupportedConfigError(
            "the engine was built with DeepSpeed's own qgZ ('zero_optimization.zero_quantized_gradients'); build it "
            "with flatgrad.deepspeed.initialize, which serves that key with flatgrad's qgz_int8"
        )
    if any(getattr(p, "ds_zero_placement_family", None) == "autoep_expert" for g in opt.fp16_groups for p in g):
        raise UnsupportedConfigError("flatgrad's ZeRO-3 backend does not support AutoEP (expert_parallel.enabled)")
    return opt


def check_offload(ds_config: Mapping[str, Any]) -> None:
    """Refuse, before DeepSpeed starts, the ZeRO-3 optimizer offload variants flatgrad does not serve, by key.

    NVMe offload is refused by ``support.REFUSALS``; here: partial offload
    (``offload_optimizer.ratio`` < 1) and SuperOffload.
    """
    section = config_value(ds_config, "zero_optimization.offload_optimizer")
    if offload_device(section) != "cpu":
        return
    ratio = section.get("ratio", 1.0)
    if ratio is not None and float(ratio) != 1.0:
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-3 backend does not support partial optimizer offload "
            f"('zero_optimization.offload_optimizer.ratio' = {ratio!r}); use ratio 1"
        )
    if section.get("super_offload"):
        raise UnsupportedConfigError(
            "flatgrad's ZeRO-3 backend does not support SuperOffload "
            f"('zero_optimization.offload_optimizer.super_offload' = {section.get('super_offload')!r})"
        )


def _resize_ipg_buffers(opt: Any, config: FlatgradConfig) -> None:
    """Give the IPG buffers (flatgrad's pack target) the bucket size and comm dtype flatgrad will use."""
    dtype = config.torch_comm_dtype()
    for bucket in opt.ipg_buckets.values():
        buffer = bucket.buffer
        if buffer is None:
            continue
        want = (opt.reduce_bucket_size, dtype or buffer.dtype)
        if (buffer.numel(), buffer.dtype) != want:
            bucket.buffer = torch.empty(want[0], dtype=want[1], device=buffer.device)


def _partition_members(opt: Any, key: str, reduction: str) -> tuple[Any, tuple[int, ...]]:
    """The one partition group of the trainable parameters, with its members' global ranks; else refused, naming
    ``key``, the config key that asked for ``reduction``."""
    import torch.distributed as tdist

    groups: dict[tuple[int, ...], Any] = {}
    for p in (p for g in opt.fp16_groups for p in g if p.requires_grad):
        group = opt._get_param_partition_group(p)
        groups.setdefault(tuple(tdist.get_process_group_ranks(group)), group)
    if len(groups) != 1:
        raise UnsupportedConfigError(
            f"{key} asks for {reduction!r}, a two-stage reduction, which under ZeRO-3 needs one partition group for "
            f"every trainable parameter; this model has {len(groups)} (MoE or MiCS): use a flat reduction "
            f"('flatgrad.reduction' = 'reduce_scatter', 'exact', 'int8' or 'fp8')"
        )
    members, group = next(iter(groups.items()))
    return group, members


def reduction_mode(opt: Any, config: FlatgradConfig) -> ReductionMode:
    """The buckets' mode: a flat one, or a two-stage one with its node and rail groups made once.

    Every rank exchanges its placement (or its error) before any group is made, so a bad or differing
    ``node_size`` raises on every rank instead of hanging: see [Note: ZeRO-3 two-stage reduction].
    """
    if config.reduction == "reduce_scatter":
        return ReduceScatter()
    if config.reduction not in ZERO3_REDUCTIONS:
        raise UnsupportedConfigError(
            f"'flatgrad.reduction' = {config.reduction!r} is not supported by flatgrad's ZeRO-3 backend; use one of "
            f"{ZERO3_REDUCTIONS} ('zero_optimization.stage' = 3)"
        )
    import torch.distributed as tdist

    wanted = ReducerConfig(
        reduction=config.reduction, block=config.block, error_feedback=config.error_feedback,
        node_size=config.node_size,
    )  # fmt: skip
    if not registry.entry(config.reduction).two_stage:
        return plan_mode(wanted, opt.dp_process_group).mode
    key = f"'{config.reduction_key or 'flatgrad.reduction'}'"
    group, _ = _partition_members(opt, key, config.reduction)
    rank = tdist.get_rank(group)
    planned, error = None, None
    try:
        planned = plan_mode(wanted, group, "'flatgrad.node_size'")
    except ValueError as exc:
        error = str(exc)
    node_sizes = raise_on_every_rank(
        group, error, None if planned is None or planned.topology is None else planned.topology.node_size,
        what=f"flatgrad's ZeRO-3 two-stage reduction ({key} = {config.reduction!r}) failed",
        key="'flatgrad.node_size'",
    )  # fmt: skip
    sizes = dict(enumerate(node_sizes))
    if len(set(sizes.values())) != 1:
        raise UnsupportedConfigError(
            f"the ranks disagree on 'flatgrad.node_size' (per rank: {sizes}; this is rank {rank}) for {key} = "
            f"{config.reduction!r}: every rank must place the ranks on the same nodes"
        )
    planned.mode.connect()
    return planned.mode


def _agree_on_staging(reduction: Zero3Reduction) -> None:
    """Allocate the staging buffers where the grads are not in host memory; every rank learns of any rank's
    failure (one exchange at install), so all raise instead of the others hanging in the first reduce_scatter."""
    offload = reduction.offload
    nbytes = reduction.staging_bytes()
    error = None
    if offload.needs_staging():
        try:
            offload.allocate_staging(nbytes)
        except (RuntimeError, MemoryError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    raise_on_every_rank(
        reduction.optimizer.dp_process_group, error, None,
        what=(
            f"flatgrad's ZeRO-3 optimizer offload could not allocate its pinned host staging buffers (2 x "
            f"{nbytes} bytes)"
        ),
        key="'zero_optimization.offload_optimizer'",
        advice="; lower 'zero_optimization.reduce_bucket_size' or free host memory",
    )  # fmt: skip


def install(engine: Any, config: FlatgradConfig) -> Zero3Reduction | None:
    """Install flatgrad's reduce path into ``engine``'s ZeRO-3 optimizer (nothing when disabled).

    Call after ``deepspeed.initialize`` and before the first backward. The
    seams become instance attributes of the optimizer, and the ``Zero3Reduction``
    stays reachable as ``engine.optimizer.flatgrad``. Raises
    ``UnsupportedConfigError`` for engines it cannot serve.
    """
    if not config.enabled:
        return None
    opt = _check_engine(engine)
    reduction = Zero3Reduction(opt, config, reduction_mode(opt, config))
    if config.bucket_numel is not None:
        opt.reduce_bucket_size = config.bucket_numel
    _resize_ipg_buffers(opt, config)
    Zero3Seams(opt, reduction).bind()
    if reduction.offload.enabled:
        _agree_on_staging(reduction)
    setattr(opt, ATTRIBUTE, reduction)
    return reduction
