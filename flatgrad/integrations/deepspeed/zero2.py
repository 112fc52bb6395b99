"""DeepSpeed ZeRO-1/2 on flatgrad: bucket-aligned sub-groups, one reduce_scatter per sub-group.

[Note: bucket-aligned sub-groups]
A ZeRO-1/2 rank owns one contiguous 1/W slice of every param group's flat
buffer, and gradients arrive in backward order, so a backward bucket of a
stock group belongs to a few ranks only. flatgrad splits every param group,
in backward order (reverse registration order), into sub-groups of about
``bucket_numel`` elements *before* DeepSpeed flattens anything; the sub-groups
copy their group's hyperparameters and keys (``moe``, ``name``, ...).
DeepSpeed then flattens each sub-group and gives every rank an equal 1/W of
it, padded to a multiple of ``W * nccl_start_alignment_factor``: exactly
``Layout.flat(numels, W, align=nccl_start_alignment_factor)``. Each
sub-group is one balanced bucket: one fused pack, one reduce_scatter, one
fused unpack into a partition in DeepSpeed's accumulation dtype (see [Note: accumulation dtype]).
``install`` checks the layout
against DeepSpeed's own bookkeeping (flat buffer offsets, ``partition_size``,
``params_in_partition``, ``first_offset``, insertion offsets) and raises on
any difference, so a DeepSpeed change can never silently scramble gradients.

[Note: ZeRO-2 seams]
DeepSpeed's per-parameter hook calls
``optimizer.reduce_independent_p_g_buckets_and_remove_grads(param, i)`` and
the engine's backward epilogue calls
``optimizer.independent_gradient_partition_epilogue()``; both are looked up
on the instance at call time, so ``install`` replaces them there (DeepSpeed's
DeepCompile uses the same seam). At the accumulation boundary the epilogue
hands ``step()`` each sub-group's partition as
``averaged_gradients[i]``, a ``GradPartitionBufferGroup`` whose
``flat_partition`` step() takes as it is (no copy); the per-piece views keep
the gradient norm, the overflow check and ``safe_get_full_grad`` working
unchanged. ZeRO-1 reduces once at the boundary through the same seams.

[Note: accumulation dtype]
One rule, DeepSpeed's own contract: micro-steps add up in DeepSpeed's gradient
accumulation dtype (``data_types.grad_accum_dtype``; by default the model's
dtype, so bf16 or fp16 like stock, and fp32 for fp32 models). The partition is
allocated in that dtype and the unpack adds each reduced micro-step into it,
rounding once per micro-step, exactly as stock adds its reduced bit16
gradients; so flatgrad's bit16 results equal stock's. With
``grad_accum_dtype: fp32`` the partition is fp32: 4 bytes x P/W, never a
full-size fp32 buffer. ZeRO-1 keeps DeepSpeed's ``param.grad_accum`` (ZeRO-1
reduces once per window); it is divided by the data-parallel size in its own
dtype and cast to the communication dtype afterwards, as stock does, so
loss-scaled fp16 sums do not overflow in the cast.

[Note: ZeRO-2 step statistics]
Before its update, stock's ``step()`` reads every partition twice more: once
for the overflow check (an inf/nan test per piece, then an all_reduce) and
once for the gradient norm (a norm per piece, then an all_reduce per param
group, and one per MoE group). flatgrad's unpack already computes, in the
pass that writes a partition, the sum of squares and the non-finite count of
what it wrote; the last unpack of a window writes the accumulated partition,
so its stats are exactly what both checks need. ``has_overflow`` and
``scaled_global_norm`` are replaced to use them: one all_reduce of
``sub-groups + 1`` floats over the data-parallel group serves both, and MoE
groups are then averaged over their expert group as stock does. Summation
order differs from stock's per-piece norms (within fp32 rounding), so a norm
that clips is stock's instead: read from the partitions per piece of stock's
partitions, in the same one all_reduce (see [Note: stock clipping norm] in
``stock_norm.py``; MoE runs keep the stats). With model
or pipeline parallelism, where stock filters pieces by rank, the norm is read
from the partitions as stock does; so it is in a window where a gradient was
written through DeepSpeed's API after its unpack (``safe_set_full_grad`` ends
in ``update_offload_overflow_tracker`` for params linked by ``_zero_optimizer``,
which ``install`` links and wraps to say so). A write
straight into the partitions, behind DeepSpeed's API, is not seen.

[Note: ZeRO-2 step]
Stock's ``step()`` loops over param groups: per group it builds the fp32
gradient, clips it, calls the optimizer, copies the fp32 partition into the
bit16 one, and all_gathers it. Over bucket-sized sub-groups that is one
optimizer call per sub-group, so the step's cost grew with their number
(``bench/step_sweep.py``: 41x the one-sub-group time at 400 before this).
flatgrad's ``step`` runs the same sequence with the loop merged: the norm and
overflow from the unpack stats (see [Note: ZeRO-2 step statistics]), one
combined scale applied to every gradient as stock applies it per group, one
``optimizer.step()``, one multi-tensor copy into the bit16 partitions, then
the all_gathers and stock's bookkeeping. With an elementwise optimizer (Adam,
AdamW, SGD) under ZeRO-2 the optimizer sees stock's shape: one tensor per run
of sub-groups of equal settings, over arenas (see [Note: optimizer arenas]
in ``arenas.py``); otherwise one multi-tensor update over sub-groups merged
by equal hyperparameters. The arithmetic is stock's, so training is
unchanged (bitwise on 2 ranks in fp32, tested). The partitions are released
right after the update, before the all_gathers, as stock frees its gradients
there. The parameter all_gathers of all sub-groups of a process group go out
as coalesced groups (a ``flatgrad.comm.AllGatherPlan``, planned once): on
NCCL one group with no copies; on gloo one combined gather that stages the
gathered bytes once, as stock's one call per param group stages its group's
flat (see [Note: coalesced all_gather] in ``flatgrad/comm.py``; gloo's own
coalesced form staged (1 + 1/W) times the bytes and copied every buffer one
call at a time). A launch holds at most ``allgather_bucket_size`` elements,
DeepSpeed's own bound on a gather (its chunked all_gather path), packed first
fit largest first: with DeepSpeed's default (5e8), one launch per step for
models up to 500M elements, as stock. What is left per sub-group is host
work: checks over lists at C speed (the partitions still handed over, flats
and params not moved, a settings tuple compared with the run's first), one
row of the stats, and the Python objects DeepSpeed's bookkeeping keeps per
sub-group (a partition's per-parameter views, made at the hand-over and
dropped at the release): about 5 us of CPU per sub-group on this 2-core machine
(timed per phase, 100 against 1 sub-group).

[Note: ZeRO-2 memory]
Stock frees its IPG buffers and gradient partitions between steps, so
flatgrad must too. The reducers' comm buffers are a pool of
``comm_buffers`` buffers of the largest sub-group (by default as many as
stock's IPG buffers: 2 with ``overlap_comm``, else 1), shared by all
sub-groups, with the reduce_scatter in place, and held from a backward's
first launch to its end only, as stock's IPG buffers are (see [Note: comm
buffer pool] in ``flatgrad/reducer.py``): between steps flatgrad holds
nothing stock does not. The partitions exist from the first
micro-step of an accumulation window (ZeRO-1: from the boundary, where it
reduces) until ``step()`` has consumed them: the step wrapper calls the
reducers' ``zero_grad()``, which drops them. Under ZeRO-2 with an elementwise
optimizer a reducer's partitions are one arena, allocated whole at the
window's first launch (see [Note: optimizer arenas]), as stock allocates its
``grads_in_partition`` whole at its first bucket; ZeRO-1 reduces in the
boundary's backward, while the full gradients are still alive, so there one
arena would raise the peak by most of its size (1.5 B/param at 2 ranks in
fp32, ``bench/memory.py``): ZeRO-1 allocates each partition as its bucket
launches. The per-piece views ``step()``
and the norm read are rebuilt from a plan made once, per window.

This module holds no kernels (the reducer packs and unpacks); the few collectives of
the step go through ``flatgrad.comm`` and ``deepspeed.comm``.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ... import comm
from ...layout import Layout, split_numels
from .arenas import ELEMENTWISE, OptimizerArenas, same_settings
from .collectives import deepspeed_collectives
from .config import FlatgradConfig, UnsupportedConfigError, offload_device
from .stock_norm import StockNorm

__all__ = ["Zero2Reduction", "check_supported", "install", "prepare", "split_param_groups"]

logger = logging.getLogger("flatgrad.deepspeed")

_MUON_OPTIMIZERS = ("muon", "muonwithauxadam", "muadam", "muadamw", "musgd")


def _get(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 when absent; the deprecated ``true`` is 1)."""
    zero = ds_config.get("zero_optimization")
    if zero is None:
        return 0
    if isinstance(zero, bool):
        return int(zero)
    return int(zero.get("stage", 0) if isinstance(zero, Mapping) else 0)


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def check_supported(ds_config: Mapping[str, Any]) -> None:
    """Refuse ZeRO-1/2 configs flatgrad does not handle; the error names the feature and the key."""
    stage = zero_stage(ds_config)
    if stage not in (1, 2):
        raise UnsupportedConfigError(f"flatgrad's ZeRO-1/2 backend needs 'zero_optimization.stage' 1 or 2, got {stage}")
    device = offload_device(_get(ds_config, "zero_optimization.offload_optimizer"))
    if device != "none":
        raise UnsupportedConfigError(
            f"optimizer offload to {device!r} is not supported by flatgrad ('zero_optimization.offload_optimizer.device'); "
            "the offload path reduces and copies per parameter on the host"
        )
    if _get(ds_config, "zero_optimization.cpu_offload"):
        raise UnsupportedConfigError(
            "CPU optimizer offload is not supported by flatgrad ('zero_optimization.cpu_offload')"
        )
    if _get(ds_config, "zero_optimization.zenflow") is not None:
        raise UnsupportedConfigError("ZenFlow is not supported by flatgrad ('zero_optimization.zenflow')")
    if _get(ds_config, "zero_optimization.parameter_alignment"):
        raise UnsupportedConfigError(
            "per-parameter alignment padding is not supported by flatgrad ('zero_optimization.parameter_alignment'): "
            "the sub-group layout is a plain concatenation"
        )
    if _get(ds_config, "compile.deepcompile"):
        raise UnsupportedConfigError(
            "DeepCompile owns the same gradient seam; not supported with flatgrad ('compile.deepcompile')"
        )
    if _enabled(ds_config.get("torch_autocast")):
        raise UnsupportedConfigError(
            "torch autocast (per-parameter communication dtypes) is not supported by flatgrad ('torch_autocast.enabled')"
        )
    opt_type = str(_get(ds_config, "optimizer.type", "") or "").lower()
    if opt_type in _MUON_OPTIMIZERS:
        raise UnsupportedConfigError(
            f"the {opt_type!r} optimizer rewrites gradients while DeepSpeed builds the partition, which flatgrad "
            "replaces ('optimizer.type')"
        )
    sp = ds_config.get("sequence_parallel_size", 1)
    if sp not in (None, 1):
        raise UnsupportedConfigError(
            f"sequence parallelism is not supported by flatgrad ('sequence_parallel_size' = {sp})"
        )
    if (
        stage == 1
        and _enabled(ds_config.get("bf16"))
        and str(_get(ds_config, "data_types.grad_accum_dtype", "")).lower()
        in ("fp32", "float32", "float", "torch.float32")
    ):
        raise UnsupportedConfigError(
            "ZeRO-1 with bf16 and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, not ZeRO "
            "('data_types.grad_accum_dtype'); use stage 2, whose partitions accumulate in fp32 then"
        )
    comm = ds_config.get("communication_data_type")
    if comm is not None and str(comm).lower() not in ("fp32", "fp16", "bf16", "float32", "float16", "bfloat16"):
        raise UnsupportedConfigError(
            f"'communication_data_type' {comm!r} is not supported by flatgrad (fp32, fp16, bf16)"
        )


# --------------------------------------------------------------------------- sub-groups


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
def prepare(cfg: FlatgradConfig) -> Iterator[None]:
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
        bucket = (
            cfg.bucket_numel if cfg.bucket_numel is not None else int(kwargs.get("reduce_bucket_size", 500_000_000))
        )
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


# --------------------------------------------------------------------------- the reduce path


def _verify_layout(optimizer: Any, i: int, layout: Layout, rank: int) -> None:
    """Raise unless ``layout`` is exactly DeepSpeed's flat buffer and partition of sub-group ``i``."""
    o = optimizer
    params = o.round_robin_bit16_groups[i]

    def fail(what: str) -> None:
        raise RuntimeError(
            f"flatgrad: sub-group {i} ({len(params)} params, {layout.numel_unpadded} elements, world size "
            f"{layout.world_size}) does not match DeepSpeed's own partitioning: {what}. Refusing to train with "
            "a gradient layout that differs from the optimizer's."
        )

    flat = o.bit16_groups_flat[i]
    if flat.numel() != layout.numel:
        fail(f"flat buffer has {flat.numel()} elements, layout {layout.numel}")
    if int(o.partition_size[i]) != layout.shard_numel:
        fail(f"partition_size {o.partition_size[i]} != shard_numel {layout.shard_numel}")
    base, size = flat.data_ptr(), flat.element_size()
    for k, (p, offset) in enumerate(zip(params, layout.offsets)):
        if p.data_ptr() != base + offset * size:
            fail(f"param {k} is not at element offset {offset} of the flat buffer")
    pieces = layout.pieces(rank)
    in_partition = o.params_in_partition[i]
    if [id(params[pc.tensor_index]) for pc in pieces] != [id(p) for p in in_partition]:
        fail(f"params_in_partition of rank {rank} differ from the layout's pieces")
    if int(o.first_offset[i]) != (pieces[0].tensor_offset if pieces else 0):
        fail(f"first_offset {o.first_offset[i]} differs")
    for pc in pieces:
        pid = o.get_param_id(params[pc.tensor_index])
        if int(o.grad_partition_insertion_offset[i][rank][pid]) != pc.shard_offset:
            fail(f"insertion offset of param {pc.tensor_index} differs")
        if int(o.grad_start_offset[i][rank][pid]) != pc.tensor_offset:
            fail(f"start offset of param {pc.tensor_index} differs")


def _agree_on_setup(group: Any, local_error: Exception | None) -> None:
    """Raise on every rank of ``group`` if the setup failed on any (the reducer's agreement step).

    A rank that raised alone would leave the others waiting forever in the
    reducers' first collective. See [Note: layout agreement] in ``flatgrad.reducer``.
    """
    import torch.distributed as tdist

    from ...reducer import _agree, _agreement_device

    rank, world_size = tdist.get_rank(group), tdist.get_world_size(group)
    if world_size > 1:
        _agree(group, rank, world_size, [], local_error, _agreement_device(group))
    if local_error is not None:
        raise local_error


def _arena_positions(indices: Sequence[int]) -> list[int]:
    """Each bucket's place in its reducer's arenas: sub-group index order, as the master arena's."""
    rank_of = {i: k for k, i in enumerate(sorted(indices))}
    return [rank_of[i] for i in indices]


def _view_plan(
    layout: Layout, rank: int, params: Sequence[torch.Tensor]
) -> list[tuple[int, int, torch.Size | None]]:
    """``(offset, length, shape)`` of every view step() expects of the partition, in partition order.

    One view per piece (shaped like its param when it holds all of it), and one
    per gap of padding, marked by ``shape is None``.
    """
    plan: list[tuple[int, int, torch.Size | None]] = []
    cursor = 0
    for pc in layout.pieces(rank):
        if pc.shard_offset > cursor:
            plan.append((cursor, pc.shard_offset - cursor, None))
        p = params[pc.tensor_index]
        whole = pc.tensor_offset == 0 and pc.length == p.numel()
        plan.append((pc.shard_offset, pc.length, p.shape if whole else torch.Size([pc.length])))
        cursor = pc.shard_offset + pc.length
    if cursor < layout.shard_numel:
        plan.append((cursor, layout.shard_numel - cursor, None))
    return plan


def _partition_views(shard: torch.Tensor, plan: list[tuple[int, int, torch.Size | None]]) -> list[torch.Tensor]:
    """The views of ``plan`` over ``shard``; padding views carry ``_zero_padding`` as step() expects."""
    views: list[torch.Tensor] = []
    for offset, length, shape in plan:
        view = shard.narrow(0, offset, length)
        if shape is None:
            view._zero_padding = True
        elif len(shape) != 1:
            view = view.view(shape)
        views.append(view)
    return views


class Zero2Reduction:
    """flatgrad's reduce path inside one ``DeepSpeedZeroOptimizer`` (ZeRO-1 or 2).

    One ``BucketReducer`` per process group (the data-parallel group, and one
    expert-data-parallel group per MoE group name), one bucket per sub-group.
    See [Note: ZeRO-2 seams].
    """

    def __init__(self, optimizer: Any, cfg: FlatgradConfig):
        import deepspeed.comm as dist
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

        from ...reducer import BucketReducer

        o = optimizer
        self.optimizer = o
        self.cfg = cfg
        align = int(o.nccl_start_alignment_factor)
        if any(any(pad) for pad in o.round_robin_bit16_padding):
            raise UnsupportedConfigError(
                "per-parameter alignment padding ('zero_optimization.parameter_alignment') is not supported by flatgrad"
            )
        if getattr(o, "cpu_offload", False):
            raise UnsupportedConfigError(
                "optimizer offload ('zero_optimization.offload_optimizer') is not supported by flatgrad"
            )

        # Scales reproduce stock's arithmetic: with reduce_scatter (the default, and required for
        # MoE) every gradient, expert ones included, is divided by the data-parallel size before
        # the sum; without it, by the predivide factor before and the rest after.
        dp = dist.get_world_size(group=o.dp_process_group) / float(o.sequence_parallel_size)
        if not o.gradient_average:
            prescale, postscale = 1.0, 1.0
        elif o.reduce_scatter or not o.postscale_gradients:
            prescale, postscale = 1.0 / dp, 1.0
        else:
            pd = float(o.gradient_predivide_factor)
            prescale = 1.0 / pd
            postscale = pd / dp if pd != dist.get_world_size(group=o.dp_process_group) else 1.0
        comm_dtype = cfg.torch_comm_dtype() or o.communication_data_type
        # ZeRO-1 with a wider accumulation dtype keeps DeepSpeed's param.grad_accum; it is
        # pre-scaled in that dtype before the cast to the comm dtype, as stock does. See grad_ready.
        self._accum_prescale = prescale if o.use_grad_accum_attribute else None
        if o.use_grad_accum_attribute:
            prescale = 1.0

        groups: dict[int, tuple[Any, list[int]]] = {}
        self.layouts: list[Layout] = []
        local_error: Exception | None = None
        try:
            for i, params in enumerate(o.round_robin_bit16_groups):
                pg = o.real_dp_process_group[i]
                layout = Layout.flat([p.numel() for p in params], dist.get_world_size(group=pg), align)
                _verify_layout(o, i, layout, dist.get_rank(group=pg))
                self.layouts.append(layout)
                groups.setdefault(id(pg), (pg, []))[1].append(i)
        except Exception as exc:  # exchanged below so that every rank raises, then re-raised
            local_error = exc
        _agree_on_setup(o.dp_process_group, local_error)
        # A reducer launches its buckets strictly in bucket order (collectives match by issue
        # order), so order each reducer's sub-groups by when they complete in backward: when
        # their earliest-registered parameter's gradient arrives. Sub-groups of one param group
        # are in that order already; this interleaves several param groups correctly.
        position = {id(p): k for k, p in enumerate(o.param_names)}
        unknown = len(position)

        def completes(i: int) -> int:
            return -min(position.get(id(p), unknown) for p in o.round_robin_bit16_groups[i])

        for _, indices in groups.values():
            indices.sort(key=completes)
        # With an elementwise optimizer the step updates runs of sub-groups as one tensor: the
        # shards of a reducer are then one arena, in sub-group order. See [Note: optimizer arenas].
        use_arenas = type(o.optimizer) in ELEMENTWISE and o.partition_gradients

        self.reducers: list[Any] = []
        concat_position: list[int] = [0] * len(self.layouts)  # sub-group -> its row in the reducers' stats, stacked
        self._step_stats: torch.Tensor | None = None
        self.methods: set[str] = set()
        self.device = torch.device(get_accelerator().current_device_name())
        self._slot: list[tuple[Any, int]] = [None] * len(self.layouts)  # type: ignore[list-item]
        self._reducer_of: dict[int, Any] = {}
        for pg, indices in groups.values():
            reducer = BucketReducer(
                [list(o.round_robin_bit16_groups[i]) for i in indices],
                process_group=pg,
                comm_dtype=comm_dtype,
                layout="flat",
                align=align,
                average=False,
                prescale=prescale,
                postscale=postscale,
                backend=cfg.backend,
                register_hooks=False,
                method=cfg.reduce_scatter,
                comm_buffers=cfg.comm_buffers or (2 if o.overlap_comm else 1),
                collect_stats=True,
                accum_dtype=o.gradient_accumulation_dtype,
                reduction=cfg.reduction,
                block=cfg.block,
                error_feedback=cfg.error_feedback,
                collectives=deepspeed_collectives(),
                shard_arena=_arena_positions(indices) if use_arenas else None,
            )
            for b, i in enumerate(indices):
                if reducer.layouts[b] != self.layouts[i]:
                    raise RuntimeError(f"flatgrad: the reducer's layout of sub-group {i} differs from DeepSpeed's")
                self._slot[i] = (reducer, b)
                concat_position[i] = sum(len(r.layouts) for r in self.reducers) + b
                for p in o.round_robin_bit16_groups[i]:
                    self._reducer_of[id(p)] = reducer
            self.reducers.append(reducer)
            self.methods.add(comm.resolve_method(cfg.reduce_scatter, pg, self.device))

        # How step()'s per-piece views lie in each sub-group's partition, planned once; the
        # partitions themselves live for one accumulation window. See [Note: ZeRO-2 memory].
        self._buffer_group = GradPartitionBufferGroup
        self._stats_order = torch.tensor(concat_position, dtype=torch.long, device=self.device)
        self._view_plans = [
            _view_plan(layout, self._slot[i][0].rank, o.round_robin_bit16_groups[i])
            for i, layout in enumerate(self.layouts)
        ]
        self.partitions: list[Any] | None = None
        self._gather_plan: list[tuple[comm.AllGatherPlan, list[int]]] | None = None
        self._stats_stale = False
        self._bit16_viewed = [False] * len(self.layouts)
        self._bit16_checks: tuple[list, list, list] | None = None
        self._bit16_copy_lists: tuple[list, list] | None = None
        self._window_open = False
        self.reductions = 0
        # MoE sub-groups by expert group, for the norm (stock averages them over that group).
        moe: dict[int, tuple[Any, list[int]]] = {}
        for i, group in enumerate(o.optimizer.param_groups):
            if o.has_moe_layers and o.is_moe_param_group[i]:
                pg = o.real_dp_process_group[i]
                moe.setdefault(id(pg), (pg, []))[1].append(i)
        self._moe_groups = [
            (pg, torch.tensor(indices, dtype=torch.long, device=self.device)) for pg, indices in moe.values()
        ]
        self.arenas: OptimizerArenas | None = None
        if use_arenas:
            self.arenas = OptimizerArenas(o, [sorted(indices) for _, indices in groups.values()])
        self._bit16_params = [p for group in o.bit16_groups for p in group]
        # On gloo the step's gather copies every chunk anyway: it takes this rank's bit16 partitions
        # straight from the master arena (one cast), instead of a copy per sub-group first.
        self._gather_from_arenas = self.arenas is not None and all(
            comm.backend_name(r.process_group, self.device) == "gloo" for r in self.reducers
        )
        from deepspeed.runtime.constants import PIPE_REPLICATED

        self._pipe_replicated = any(getattr(p, PIPE_REPLICATED, False) for p in self._bit16_params)
        self._stock_norm: StockNorm | None = None  # planned at the first clipped step

    # -- window: the micro-steps whose gradients one step() consumes

    def _open_window(self) -> None:
        # A new window starts with fresh partitions, unless step() has not consumed the last
        # hand-over yet (several backwards at one boundary): then the reducers keep adding to
        # them, as PyTorch accumulates .grad until step. step() releases them (see step()).
        self._window_open = True

    # -- the replaced seams

    def grad_ready(self, param: torch.nn.Parameter, i: int) -> None:
        """Replaces ``reduce_independent_p_g_buckets_and_remove_grads``: mark ``param`` ready."""
        o = self.optimizer
        if param.numel() == 0:
            return
        if not getattr(param, "ds_grad_is_ready", True):
            return
        if o.use_grad_accum_attribute and getattr(param, "grad_accum", None) is not None:
            # ZeRO-1 with a wider accumulation dtype (fp16 params, fp32 grad_accum): divide in
            # that dtype, then cast to the communication dtype, as stock does; casting first
            # would overflow loss-scaled sums above the fp16 range.
            param.grad = param.grad_accum.mul_(self._accum_prescale).to(param.dtype)
            param.grad_accum = None
        if param.grad is None:
            return
        o._maybe_reduce_autoep_folding_tp_gradient(param, param.grad)
        self._open_window()
        self._reducer_of[id(param)].mark_ready(param)

    def epilogue(self) -> None:
        """Replaces ``independent_gradient_partition_epilogue``: finish, and hand over at the boundary."""
        o = self.optimizer
        self._open_window()
        for r in self.reducers:
            r.finish()  # every bucket launched, so every param.grad is dropped (stock: _clear_param_grad_only)
        self.reductions += 1
        if o.is_gradient_accumulation_boundary():
            self._hand_over()
        o._release_ipg_buffers()  # the next backward counts a new micro-step (setup_buckets)
        o._epilogue_ran_this_backward = True

    def finalize(self) -> None:
        """Replaces ``finalize_gradient_accumulation_boundary`` (``managed_gradient_accumulation: false``)."""
        self.optimizer.set_gradient_accumulation_boundary(True)
        if self._window_open:
            self._hand_over()

    def setup_buckets(self) -> None:
        """Replaces ``setup_buckets``: count the micro-step, allocate no IPG bucket (flatgrad has its own)."""
        o = self.optimizer
        if not o.ready_for_gradients:
            o.micro_step_id += 1
            o.ready_for_gradients = True

    def _hand_over(self) -> None:
        o = self.optimizer
        if self.partitions is None:
            shards = {id(r): [gs.shard for gs in r.grad_shards()] for r in self.reducers}
            self.partitions = []
            for i, plan in enumerate(self._view_plans):
                reducer, b = self._slot[i]
                shard = shards[id(reducer)][b]
                self.partitions.append(self._buffer_group(_partition_views(shard, plan), shard))
        for i, partition in enumerate(self.partitions):
            o.averaged_gradients[i] = partition
        self._step_stats = None  # this hand-over's stats are reduced when step() first asks
        self._window_open = False

    def _handed_over(self) -> bool:
        """Whether DeepSpeed's ``averaged_gradients`` still hold this window's partitions, every one."""
        held = map(self.optimizer.averaged_gradients.get, range(len(self.partitions)))
        return all(map(operator.is_, held, self.partitions))

    def step(self, closure: Any = None) -> None:
        """Replaces ``step``: stock's update in one optimizer call for all sub-groups, then release the partitions.

        See [Note: ZeRO-2 step]. Without a hand-over to consume (a step with no
        backward) it is stock's step.
        """
        if self.partitions is None or not self._handed_over():
            if self.arenas is not None:
                self.arenas.unshare()
            result = self._stock_step(closure)
            self.release()
            return result
        try:
            self._step()
        finally:
            if self.partitions is not None:  # _step releases them before its all_gathers, unless it stopped early
                self.release()
        return None

    def _step(self) -> None:
        """DeepSpeed 0.19's ZeRO-1/2 ``step()`` (no offload, no Muon: both refused), with its per-group loop merged."""
        from deepspeed.runtime.utils import is_invalid_grad_norm
        from deepspeed.runtime.zero.stage_1_and_2 import (
            INITIAL_MICRO_STEP_ID,
            OPTIMIZER_ALLGATHER_TIMER,
            OPTIMIZER_GRADIENTS_TIMER,
            OPTIMIZER_STEP_TIMER,
            OPTIMIZER_TIMERS,
        )

        import deepspeed.comm as dist

        o = self.optimizer
        o.micro_step_id = INITIAL_MICRO_STEP_ID
        if not o.compute_grad_norm:
            o._global_grad_norm = None
        o.overflow = False
        if o.check_grad_overflow:
            o.check_overflow(partition_gradients=o.partition_gradients)
        norm = None
        if o.compute_grad_norm and not o.overflow:
            norm = o.scaled_global_norm()
            if (o.dtype != torch.bfloat16 or o.check_grad_overflow) and is_invalid_grad_norm(norm):
                o.overflow = True
        prev_scale = o.loss_scale
        o._update_scale(o.overflow)
        if o.overflow:
            if o.compute_grad_norm:
                o._global_grad_norm = float("inf")
            o.zero_grad(set_to_none=True)
            o._release_preflattened_grad_buffers()
            for k in o.averaged_gradients.keys():
                o.averaged_gradients[k] = None
                o.all_grad_tensors[k] = None
            for timer in OPTIMIZER_TIMERS:
                o.timers(timer).start()
                o.timers(timer).stop()
            return
        o._commit_muon_momentum()
        if norm is not None:
            o._global_grad_norm = norm / prev_scale

        o.timers(OPTIMIZER_GRADIENTS_TIMER).start()
        arenas = self.arenas if self.arenas is not None and self.arenas.usable() else None
        arena_grads = self._arena_grads() if arenas is not None else None
        grads = arena_grads if arena_grads is not None else self._sub_group_grads()
        self._unscale_and_clip(grads, norm)
        o.timers(OPTIMIZER_GRADIENTS_TIMER).stop()

        o.timers(OPTIMIZER_STEP_TIMER).start()
        stepped = arena_grads is not None and arenas.step(arena_grads)
        if not stepped:
            if self.arenas is not None:  # a step past the arenas counts scalars per sub-group: [Note: optimizer arenas]
                self.arenas.unshare()
            if arena_grads is not None:
                for k, order in enumerate(arenas.orders):
                    for i, start, stop in zip(order, arenas.offsets[k], arenas.offsets[k][1:]):
                        o.single_partition_of_fp32_groups[i].grad = arena_grads[k].narrow(0, start, stop - start)
            self._optimizer_step_all()
        o._lazy_init_hp_params_optimizer_state()
        del grads, arena_grads  # the partitions go with self.release() below, as stock frees its gradients there
        if not stepped:  # the arenas set no sub-group's .grad
            for part in o.single_partition_of_fp32_groups:
                part.grad = None
        if self._gather_from_arenas:  # the gather writes the bit16 partitions: see [Note: ZeRO-2 step]
            if not stepped:  # arenas.step() checked them already
                self.arenas.check_masters()
        else:
            with torch.no_grad():
                torch._foreach_copy_(*self._bit16_copies())
        self.release()  # the partitions are consumed: free them before the all_gather, as stock frees its grads
        o.timers(OPTIMIZER_STEP_TIMER).stop()

        o.timers(OPTIMIZER_ALLGATHER_TIMER).start()
        for k, gather in enumerate(self._gathers()):  # see [Note: ZeRO-2 step]
            if self._gather_from_arenas:
                with torch.no_grad():
                    gather(self.arenas.masters[k].to(o.bit16_groups_flat[self.arenas.orders[k][0]].dtype))
            else:
                gather()
        o.timers(OPTIMIZER_ALLGATHER_TIMER).stop()
        self._update_bit16_views()
        o.timers.log(OPTIMIZER_TIMERS)

    def _sub_group_grads(self) -> list[torch.Tensor]:
        """Stock's per-group gradient hand-over: each sub-group's partition in fp32 as its master's ``.grad``."""
        o = self.optimizer
        grads = []
        for i in range(len(o.bit16_groups)):
            o.free_grad_in_param_list(o.params_not_in_partition[i])
            grad = o._get_preflattened_grad_partition(i).to(o.single_partition_of_fp32_groups[i].dtype)
            if grad.numel() != o.partition_size[i]:
                raise RuntimeError(
                    f"flatgrad: sub-group {i}'s partition has {grad.numel()} elements, not {o.partition_size[i]}"
                )
            o.single_partition_of_fp32_groups[i].grad = grad
            o.free_grad_in_param_list(o.params_in_partition[i])
            o._release_preflattened_grad_buffers(i)
            o.averaged_gradients[i] = None
            o.all_grad_tensors[i] = None
            grads.append(grad)
        return grads

    def _arena_grads(self) -> list[torch.Tensor] | None:
        """The hand-over for the arenas: each reducer's gradient arena in fp32, one cast for all its sub-groups.

        ``None`` when a reducer holds no arena (the partitions were not its shards).
        See [Note: optimizer arenas].
        """
        o = self.optimizer
        arenas = [r.shard_arena for r in self.reducers]
        if any(a is None for a in arenas):
            return None
        grads = []
        for arena, master in zip(arenas, self.arenas.masters):
            if arena.numel() != master.numel():
                raise RuntimeError(f"flatgrad: a gradient arena has {arena.numel()} elements, its master {master.numel()}")
            grads.append(arena.to(master.dtype))
        o.free_grad_in_param_list(self._bit16_params)
        # Every partition is flatgrad's (step() checked): none has DeepSpeed's preflattened buffers to release.
        o.averaged_gradients.update(dict.fromkeys(range(len(self.layouts))))
        o.all_grad_tensors.update(dict.fromkeys(range(len(self.layouts))))
        return grads

    def _unscale_and_clip(self, grads: list[torch.Tensor], norm: Any) -> None:
        """Stock's ``unscale_and_clip_grads`` with one multi-tensor multiply: the same scale, the same products.

        Stock computes one combined scale from the global norm and multiplies every
        group's gradient by it, one ``mul_`` per group (per sub-group here).
        """
        from deepspeed.runtime.utils import is_invalid_grad_norm

        o = self.optimizer
        if o.clip_grad == 0.0 and o.loss_scale == 1.0:
            return
        combined_scale = o.loss_scale
        if o.clip_grad > 0.0:
            clip_norm = norm
            if is_invalid_grad_norm(clip_norm):
                clip_norm = torch.tensor(float("inf"), dtype=torch.float, device=o.device)
            clip = torch.clamp(((clip_norm / o.loss_scale) + 1e-6) / o.clip_grad, min=1.0)
            combined_scale = clip * o.loss_scale
        torch._foreach_mul_(grads, 1.0 / combined_scale)

    def _update_bit16_views(self) -> None:
        """Stock's ``_update_model_bit16_weights`` for every sub-group whose params are not views of its flat.

        Stock points every param at its slice of the bit16 flat again after each
        all_gather: one Python loop over the params of every sub-group per step.
        The all_gather writes the flats in place, so after the first step that only
        repeats itself; it runs again for a sub-group whose flat or whose first or
        last param moved (a checkpoint load, a user's ``p.data = ...``).
        """
        o = self.optimizer
        checked = self._bit16_checks
        if (checked is not None and len(checked[0]) == len(o.bit16_groups_flat)
                and all(map(operator.is_, o.bit16_groups_flat, checked[0]))
                and list(map(torch.Tensor.data_ptr, checked[1])) == checked[2]):  # fmt: skip
            return  # the common case, checked at C speed: no flat replaced, no param moved
        ends = []
        for i, flat in enumerate(o.bit16_groups_flat):
            params, offsets = o.round_robin_bit16_groups[i], o.round_robin_bit16_offsets[i]
            base, size = flat.data_ptr(), flat.element_size()
            pairs = [(params[0], base + offsets[0] * size), (params[-1], base + offsets[-1] * size)]
            if any(p.data_ptr() != ptr for p, ptr in pairs) or not self._bit16_viewed[i]:
                o._update_model_bit16_weights(i)
                self._bit16_viewed[i] = True
            ends += pairs
        self._bit16_checks = (list(o.bit16_groups_flat), [p for p, _ in ends], [ptr for _, ptr in ends])

    def _bit16_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This rank's bit16 partition of every sub-group and its fp32 master, listed once (again if a flat moved)."""
        o = self.optimizer
        cached = self._bit16_copy_lists
        flats = o.bit16_groups_flat
        if cached is None or len(cached[0]) != len(flats) or not all(map(operator.is_, flats, cached[0])):
            bit16 = [o.parallel_partitioned_bit16_groups[i][reducer.rank] for i, (reducer, _) in enumerate(self._slot)]
            cached = self._bit16_copy_lists = (list(flats), bit16)
        return cached[1], o.single_partition_of_fp32_groups

    def _gathers(self) -> list[comm.AllGatherPlan]:
        """The step's all_gathers, one ``AllGatherPlan`` per reducer, planned once (again if a flat was replaced).

        NCCL coalesces with no copy: no bound. gloo stages the elements of a
        launch once, so a launch holds at most DeepSpeed's
        ``allgather_bucket_size`` elements, the bound DeepSpeed's own chunked
        all_gather keeps. See [Note: ZeRO-2 step].
        """
        o = self.optimizer
        flats = o.bit16_groups_flat
        if self._gather_plan is not None and all(
            all(map(operator.is_, map(flats.__getitem__, indices), plan.buffers)) for plan, indices in self._gather_plan
        ):
            return [plan for plan, _ in self._gather_plan]
        plans = []
        for reducer in self.reducers:
            indices = sorted(i for i, (r, _) in enumerate(self._slot) if r is reducer)
            batch_numel = None
            if comm.backend_name(reducer.process_group, flats[indices[0]].device) != "nccl":
                batch_numel = max(1, int(o.allgather_bucket_size))
            plan = comm.AllGatherPlan([flats[i] for i in indices], group=reducer.process_group, batch_numel=batch_numel)
            plans.append((plan, indices))
        self._gather_plan = plans
        return [plan for plan, _ in plans]

    def _optimizer_step_all(self) -> None:
        """One ``optimizer.step()`` for every sub-group: sub-groups of equal hyperparameters become one group.

        Stock calls the optimizer once per param group; over bucket-sized sub-groups
        that is one call per sub-group, each a multi-tensor update of one tensor.
        Merging sub-groups of equal hyperparameters (those split from one param
        group, as long as a scheduler keeps them equal) makes one multi-tensor
        update over all their partitions; the state is per parameter, so the
        update is the same. What the optimizer writes back into a group's keys goes
        back to every sub-group of it.

        A merged group whose ``foreach`` is ``None`` (torch's "let me choose") runs
        with ``foreach=True``: torch picks the per-tensor loop for CPU tensors, which
        was sized for stock's one flat tensor per group and costs a Python loop per
        sub-group here; the multi-tensor kernels compute the same update (bitwise
        against stock, tested). A ``foreach`` the user set is left as it is.
        """
        o = self.optimizer
        groups = o.optimizer.param_groups
        merged: list[dict] = []
        members: list[list[dict]] = []
        last = -1  # the merged group the previous sub-group joined: sub-groups of one param group come in a row
        for group in groups:
            if last >= 0 and same_settings(group, members[last][-1]):
                k = last
            else:
                k = next((j for j, candidate in enumerate(merged) if same_settings(group, candidate)), -1)
            if k < 0:
                merged.append({**{key: v for key, v in group.items() if key != "params"}, "params": []})
                members.append([])
            merged[k]["params"].extend(group["params"])
            members[k].append(group)
            last = k if k >= 0 else len(merged) - 1
        chose = [g for g, subs in zip(merged, members) if len(subs) > 1 and "foreach" in g and g["foreach"] is None]
        for group in chose:
            group["foreach"] = True
        o.optimizer.param_groups = merged
        try:
            o.optimizer.step()
        finally:
            o.optimizer.param_groups = groups
            for group in chose:
                group["foreach"] = None
        for group, subs in zip(merged, members):
            for sub in subs:
                for k, v in group.items():
                    if k != "params":
                        sub[k] = v

    def release(self) -> None:
        """Drop this window's fp32 partitions (step() has consumed them, or skipped the step)."""
        o = self.optimizer
        if self.partitions is not None:
            for i, partition in enumerate(self.partitions):
                if o.averaged_gradients.get(i) is partition:
                    o.averaged_gradients[i] = None
        self.partitions = None
        self._step_stats = None
        self._stats_stale = False
        for r in self.reducers:
            r.zero_grad()

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

    def _grad_edited(self, grad: Any) -> None:
        """Wraps ``update_offload_overflow_tracker``, which DeepSpeed's ``safe_set_full_grad`` calls after writing.

        DeepSpeed calls it for params linked to the optimizer by ``_zero_optimizer``,
        which it sets under offload only; ``install`` links every param. A gradient
        written into a partition after its unpack is not in the unpack's stats: this
        window's step reads the partitions, as stock does.
        """
        self._stats_stale = True
        self._stock_update_overflow_tracker(grad)

    def _stats_usable(self) -> bool:
        """Whether the unpack stats give stock's norm: no model parallelism, no pipe-replicated params, no
        gradient edited through DeepSpeed's API since the unpack."""
        o = self.optimizer
        if self._stats_stale:
            return False
        if o.mpu is not None or o.model_parallel_group is not None:
            return False
        if not all(r.stats_available for r in self.reducers):
            return False  # a reducer made without collect_stats (every reduction mode's unpack computes them)
        return not self._pipe_replicated  # read once at install: pipeline modules mark tied weights when built

    def _reduced_stats(self) -> torch.Tensor:
        """Per sub-group squared norm, then the non-finite count, summed over the ranks: one all_reduce.

        The values come from the last unpack of every sub-group (the accumulated
        partition as written, see ``BucketReducer.shard_stats``), so no partition is
        read again; computed once per step and shared by ``has_overflow`` and
        ``scaled_global_norm``. See [Note: ZeRO-2 step statistics]. When the norm
        clips (``_clips_as_stock``) the squared norms are instead the fp64 sums over
        stock's partitions, read from the partitions as stock reads them, in the
        same all_reduce (fp64). See [Note: stock clipping norm].
        """
        import deepspeed.comm as dist

        if self._step_stats is None:
            o = self.optimizer
            rows = [stats for reducer in self.reducers for stats in reducer.shard_stats()]
            stacked = torch.stack(rows).to(self.device).index_select(0, self._stats_order)  # [G, 2]: sum_sq, nonfinite
            nonfinite = stacked[:, 1].sum().reshape(1)
            if self._clips_as_stock():  # fp64 sums of stock's partitions instead: see [Note: stock clipping norm]
                partitions = [p.flat_partition for p in self.partitions]
                total = torch.cat([self._stock_norm_plan().partial_sums(partitions), nonfinite.double()])
            else:
                total = torch.cat([stacked[:, 0], nonfinite])
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)
            self._step_stats = total
        return self._step_stats

    def has_overflow(self, partition_gradients: bool = True) -> bool:
        """Replaces ``has_overflow``: any inf/nan in any rank's partitions, from the unpack stats."""
        if not self._stats_usable() or self.partitions is None:
            return self._stock_has_overflow(partition_gradients)
        return bool(self._reduced_stats()[-1].item() > 0)  # stock returns a bool too (one host sync)

    def scaled_global_norm(self, norm_type: float = 2) -> torch.Tensor:
        """Replaces ``scaled_global_norm``: stock's gradient norm from the unpack stats, one all_reduce in all.

        Stock reads every partition again and reduces every param group's squared
        norm with its own all_reduce (and each MoE group's again over its expert
        group); with bucket-sized sub-groups that is one collective per sub-group
        per step. Here the per-sub-group sums come from the unpack's stats, in the
        same vector as the overflow count (see ``_reduced_stats``), then go through
        stock's masking and combination, so clipping and the overflow decision
        follow stock's rule. See [Note: ZeRO-2 step statistics].
        """
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import combine_grad_norm_groups, mask_nan_or_inf_with_val_inplace

        o = self.optimizer
        if norm_type != 2:
            raise ValueError(f"only the L2 gradient norm is supported, got norm_type={norm_type}")
        if self.partitions is not None and self._clips_as_stock():
            return self._stock_norm_plan().combine(self._reduced_stats()[:-1], o.dp_process_group)
        if self._stats_usable() and self.partitions is not None:
            total = self._reduced_stats()[:-1].clone()
        else:
            total = self._squared_norms_from_partitions()
        total = total.pow(1.0 / 2.0)
        mask_nan_or_inf_with_val_inplace(total, device=self.device)
        if o.has_moe_layers:
            for pg, indices in self._moe_groups:
                scaled = total[indices] * 1.0 / dist.get_world_size(group=pg)
                dist.all_reduce(scaled, group=pg)
                total[indices] = scaled
        # Stock passes G group norms, which it stacks: the vector as one group is that stack, with no G views.
        return combine_grad_norm_groups([total], norm_type=2)

    def _clips_as_stock(self) -> bool:
        """Whether this step's norm clips and comes from ``StockNorm``: clipping on, no MoE, no model or
        pipeline parallelism (those keep their own paths), stats for the overflow count."""
        o = self.optimizer
        if o.clip_grad <= 0.0 or o.has_moe_layers or o.mpu is not None or o.model_parallel_group is not None:
            return False
        return not self._pipe_replicated and all(r.stats_available for r in self.reducers)

    def _stock_norm_plan(self) -> StockNorm:
        """Where stock's partitions lie in this rank's partitions: planned once, at the first clipped step."""
        import deepspeed.comm as dist

        if self._stock_norm is None:
            o = self.optimizer
            world_size = dist.get_world_size(group=o.dp_process_group)
            unsplit = o._flatgrad_unsplit
            if o.round_robin_gradients:  # stock's flat order then: DeepSpeed's own reorder of each group
                unsplit = [o._round_robin_reorder(params, world_size)[0] for params in unsplit]
            self._stock_norm = StockNorm(
                unsplit, o.round_robin_bit16_groups, self.layouts, dist.get_rank(group=o.dp_process_group),
                world_size, int(o.nccl_start_alignment_factor), self.device,
            )  # fmt: skip
        return self._stock_norm

    def _squared_norms_from_partitions(self) -> torch.Tensor:
        """Stock's per-group squared norms, read from the partitions (model or pipeline parallel runs)."""
        import deepspeed.comm as dist
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.utils import is_model_parallel_parameter
        from deepspeed.runtime.zero.utils import get_norm_dtype

        o = self.optimizer
        norm_dtype = get_norm_dtype()
        sums = []
        for i in range(len(o.bit16_groups)):
            grads = (g for g in o.averaged_gradients[i] if not getattr(g, "_zero_padding", False))
            norms = [
                torch.linalg.vector_norm(g.data.to(norm_dtype).detach(), ord=2.0)
                for g, p in zip(grads, o.params_in_partition[i])
                if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
                and (is_model_parallel_parameter(p) or o.model_parallel_rank == 0)
            ]
            sums.append(
                torch.stack(norms).pow(2.0).sum().float()
                if norms
                else torch.zeros((), dtype=torch.float32, device=self.device)
            )
        total = torch.stack(sums)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=o.dp_process_group)
        o._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        return total

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
            return self._stock_load_legacy(state_dict_list, load_optimizer_states, load_from_fp32_weights)
        finally:
            if self.arenas is not None:
                self.arenas.invalidate()

    def metadata_bytes(self) -> int:
        """Bytes flatgrad keeps between steps besides gradients and optimizer state, counted in memory figures.

        The kernels' cached run tables, the reducers' plan tables, the gather
        plans' copy tables (gloo), the stats order, the clipping norm's plan
        (``StockNorm``, after a clipped step), and inside a window the stats:
        hundreds of bytes to KBs, which memory targets against stock name rather
        than hide.
        """
        from ...kernels import _tables

        gathers = sum(plan.table_bytes for plan, _ in self._gather_plan or ())
        step_stats = self._step_stats.nbytes if self._step_stats is not None else 0
        stock_norm = self._stock_norm.metadata_bytes() if self._stock_norm is not None else 0
        return (
            _tables.nbytes() + sum(r.metadata_bytes() for r in self.reducers) + gathers
            + self._stats_order.nbytes + step_stats + stock_norm
        )  # fmt: skip

    def describe(self) -> str:
        """The take-over line: stage, sub-groups, buckets, reduction method."""
        o = self.optimizer
        unsplit = getattr(o, "_flatgrad_origins", (len(self.layouts), None))[0]
        return (
            f"flatgrad: ZeRO-{2 if o.partition_gradients else 1} gradient reduction taken over: {unsplit} param group(s) "
            f"split into {len(self.layouts)} sub-group(s) = {len(self.layouts)} bucket(s) on {len(self.reducers)} "
            f"process group(s), per bucket one fused pack, one reduce_scatter ({', '.join(sorted(self.methods))}), "
            f"one fused unpack into the {o.gradient_accumulation_dtype} partition"
        )

    def install(self) -> None:
        o = self.optimizer
        self._stock_load_legacy = o._load_legacy_checkpoint
        o._load_legacy_checkpoint = self.load_legacy
        self._stock_step = o.step
        o.step = self.step
        o.reduce_independent_p_g_buckets_and_remove_grads = self.grad_ready
        o.independent_gradient_partition_epilogue = self.epilogue
        o.finalize_gradient_accumulation_boundary = self.finalize
        o.setup_buckets = self.setup_buckets
        o.load_hp_checkpoint_state_from_checkpoint_dir = self.load_universal
        o.scaled_global_norm = self.scaled_global_norm
        self._stock_has_overflow = o.has_overflow
        o.has_overflow = self.has_overflow
        self._stock_update_overflow_tracker = o.update_offload_overflow_tracker
        o.update_offload_overflow_tracker = self._grad_edited
        for group in o.bit16_groups:  # as DeepSpeed links them under offload: set_full_hp_grad then tells us
            for lp in group:
                if getattr(lp, "_hp_mapping", None) is not None:
                    lp._zero_optimizer = o
        o._release_ipg_buffers()
        o._flatgrad = self


_SEAMS = (
    "reduce_independent_p_g_buckets_and_remove_grads",
    "independent_gradient_partition_epilogue",
    "finalize_gradient_accumulation_boundary",
    "setup_buckets",
    "load_hp_checkpoint_state_from_checkpoint_dir",
    "_load_legacy_checkpoint",
    "round_robin_bit16_padding",
    "scaled_global_norm",
    "has_overflow",
    "update_offload_overflow_tracker",
    "averaged_gradients",
    "round_robin_bit16_groups",
    "params_in_partition",
    "first_offset",
    "partition_size",
)


def install(engine: Any, cfg: FlatgradConfig) -> Zero2Reduction:
    """Install flatgrad's reduce path into a ZeRO-1/2 engine built under ``prepare``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    o = engine.optimizer
    if type(o) is not DeepSpeedZeroOptimizer:
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-1/2 backend needs DeepSpeed's DeepSpeedZeroOptimizer, the engine built {type(o).__name__}"
        )
    missing = [name for name in _SEAMS if not hasattr(o, name)]
    if missing:
        from .config import deepspeed_version

        raise UnsupportedConfigError(
            f"DeepSpeed {'.'.join(map(str, deepspeed_version()))} lacks the ZeRO-1/2 seams {missing} flatgrad replaces"
        )
    reduction = Zero2Reduction(o, cfg)
    reduction.install()
    return reduction
