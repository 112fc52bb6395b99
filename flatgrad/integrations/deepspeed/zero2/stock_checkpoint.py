"""A stock ZeRO-1/2 optimizer shard re-partitioned into flatgrad's sub-groups, each rank reading only its own file.

Stock keeps one flat fp32 partition per param group; flatgrad cuts every group into sub-groups
(runs of its params in backward order), each partitioned over the ranks on its own, so an element
of a rank's new partition may lie in another rank's stock shard. One ``all_to_all_single`` per
state tensor moves every element from the rank that read it to the rank that owns it now, and the
result is a shard of flatgrad's layout, which stock's own loader then takes. See [Note: stock
checkpoints under flatgrad] in docs/design.md.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..config import UnsupportedConfigError

__all__ = [
    "FLATGRAD", "STOCK", "CheckpointLoadError", "classify", "repartition", "slice_mappings", "stock_layout", "to_stock",
    "unsplit_hyperparameters", "world_size_error", "world_size_error_type",
]  # fmt: skip

FLATGRAD, STOCK = "flatgrad", "stock"  # what ``classify`` finds a shard's layout to be


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read, or is not a ZeRO-1/2 optimizer shard; the message names the file or key."""


@functools.cache
def world_size_error_type() -> type[UnsupportedConfigError]:
    """The refusal of a checkpoint of another data-parallel world size: an ``UnsupportedConfigError`` that is also
    DeepSpeed's ``ZeRORuntimeException``, which stock raises for the same checkpoint, so that code catching stock's
    refusal catches flatgrad's (made on first use: DeepSpeed is imported only where it runs)."""
    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    return type(
        "CheckpointWorldSizeError", (UnsupportedConfigError, ZeRORuntimeException),
        {"__module__": __name__, "__doc__": "A ZeRO checkpoint saved by another data-parallel world size."},
    )  # fmt: skip


def world_size_error(source: str, saved: int, current: int) -> UnsupportedConfigError:
    """The refusal of a checkpoint of another data-parallel world size, naming both and the universal path."""
    return world_size_error_type()(
        f"{source} was saved by {saved} data-parallel rank(s), this run has {current}: ZeRO partitions do not move "
        "between world sizes. Convert the checkpoint with deepspeed.checkpoint.ds_to_universal and load the result "
        "with 'checkpoint.load_universal': true"
    )


def slice_mappings(
    names: Mapping[Any, str], groups: Sequence[Sequence[torch.Tensor]], offsets: Sequence[Sequence[int]],
    partition_sizes: Sequence[int], rank: int,
) -> list[list[tuple[str, int, int]]]:  # fmt: skip
    """``(name, start, numel)`` of every param's piece in ``rank``'s partition of each flat group, in flat order.

    DeepSpeed saves the same facts per rank as ``param_slice_mappings``
    (``fragment_address`` of each param in the partition), which is how a
    shard's layout is recognised.
    """
    out = []
    for params, starts, size in zip(groups, offsets, partition_sizes):
        lo, hi = rank * size, (rank + 1) * size
        group = []
        for p, start in zip(params, starts):
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                group.append((names[p], a - lo, b - a))
        out.append(group)
    return out


def _saved_mappings(saved: Sequence[Mapping[str, Any]]) -> list[list[tuple[str, int, int]]]:
    """DeepSpeed's saved mappings as ``slice_mappings`` gives them: it lists a group's params unordered by round robin."""
    return [sorted(((name, int(a.start), int(a.numel)) for name, a in group.items()), key=lambda m: m[1]) for group in saved]


def _offsets(numels: Sequence[int], paddings: Sequence[int]) -> list[int]:
    out, at = [], 0
    for n, pad in zip(numels, paddings):
        out.append(at)
        at += n + pad
    return out


class _StockLayout:
    """Stock's flat layout of every unsplit group on this optimizer's ranks: its params in stock's flat order, each
    param's alignment padding, and each group's partition size.

    ``of_shard`` takes the paddings and sizes a shard's keys give, ``of_optimizer``
    computes them as DeepSpeed's ``DeepSpeedZeroOptimizer`` does for the unsplit groups.
    """

    def __init__(self, o: Any, paddings: Sequence[Sequence[int]], partition_sizes: Sequence[int], world_size: int):
        self.given = o._flatgrad_unsplit  # each group's params as the group lists them
        unsplit = self.given
        if o.round_robin_gradients:  # stock's flat order then: DeepSpeed's own reorder of each group
            unsplit = [o._round_robin_reorder(params, world_size)[0] for params in unsplit]
        self.groups = unsplit
        self.paddings = [list(pad) for pad in paddings]
        self.partition_sizes = [int(size) for size in partition_sizes]
        self.world_size = world_size
        self.fits = len(self.paddings) == len(unsplit) == len(self.partition_sizes) and all(
            len(pad) == len(params) for pad, params in zip(self.paddings, unsplit)
        )
        if not self.fits:
            return
        self.offsets = [_offsets([p.numel() for p in params], pad) for params, pad in zip(unsplit, self.paddings)]
        alignment = o.nccl_start_alignment_factor * world_size
        for params, pad, size in zip(unsplit, self.paddings, self.partition_sizes):
            flat = math.ceil((sum(p.numel() for p in params) + sum(pad)) / alignment) * alignment
            self.fits = self.fits and flat == size * world_size

    @classmethod
    def of_shard(cls, o: Any, sd: Mapping[str, Any], world_size: int) -> "_StockLayout":
        """The layout a stock shard's keys describe (``fits`` says whether it is one of these params)."""
        from deepspeed.checkpoint import constants as keys

        fp32 = sd[keys.SINGLE_PARTITION_OF_FP32_GROUPS]
        paddings = sd.get(keys.PARAM_ALIGNMENT_PADDINGS) or [[0] * len(params) for params in o._flatgrad_unsplit]
        sizes = [int(t.numel()) + int(pad) for t, pad in zip(fp32, sd[keys.GROUP_PADDINGS])]
        if len(fp32) != len(o._flatgrad_unsplit):
            sizes = []
        return cls(o, paddings, sizes, world_size)

    @classmethod
    def of_optimizer(cls, o: Any, world_size: int) -> "_StockLayout":
        """The layout stock DeepSpeed gives these groups: after each param but the last, the padding to
        ``parameter_alignment``'s 16 bytes; the group padded to ``nccl_start_alignment_factor`` x W, cut in W."""
        alignment = o.nccl_start_alignment_factor * world_size
        unsplit = o._flatgrad_unsplit
        if o.round_robin_gradients:
            unsplit = [o._round_robin_reorder(params, world_size)[0] for params in unsplit]
        paddings, sizes = [], []
        for params in unsplit:
            size = params[0].element_size() if params else 1
            step = 16 // math.gcd(16, size) if getattr(o, "parameter_alignment", False) else 1
            pad, at = [], 0
            for k, p in enumerate(params):
                at += p.numel()
                pad.append(0 if k == len(params) - 1 else (-at) % step)
                at += pad[-1]
            paddings.append(pad)
            sizes.append(math.ceil(at / alignment) * alignment // world_size)
        return cls(o, paddings, sizes, world_size)

    def group_paddings(self, rank: int) -> list[int]:
        """Each group's padding at the end of ``rank``'s partition (DeepSpeed's ``groups_padding``)."""
        out = []
        for params, pad, size in zip(self.groups, self.paddings, self.partition_sizes):
            used = sum(p.numel() for p in params) + sum(pad)
            out.append(min(size, max(0, (rank + 1) * size - used)))
        return out

    def linked(self, names: Mapping[Any, str], rank: int) -> list[list[tuple[str, int, int]]]:
        """``(name, start, numel)`` of each param's piece in ``rank``'s partitions, where stock links it (its
        ``_hp_mapping``), in the order the group lists its params.

        DeepSpeed links each param at its flat offset only where the group has
        alignment padding; otherwise at the running sum of the group's params
        in the order the group lists them, which under round-robin gradients is
        not the flat order. Recognising a shard reproduces that.
        """
        offsets = []
        for given, params, starts, pad in zip(self.given, self.groups, self.offsets, self.paddings):
            if any(pad):
                at = {id(p): start for p, start in zip(params, starts)}
                offsets.append([at[id(p)] for p in given])
            else:
                offsets.append(_offsets([p.numel() for p in given], [0] * len(given)))
        return slice_mappings(names, self.given, offsets, self.partition_sizes, rank)

    def saved_mappings(self, names: Mapping[Any, str], rank: int) -> list[list[tuple[str, int, int]]]:
        """Stock's ``param_slice_mappings`` for this layout on ``rank``, in ``_saved_mappings``' order."""
        return [sorted(group, key=lambda m: m[1]) for group in self.linked(names, rank)]

    def param_shapes(self, names: Mapping[Any, str]) -> list[dict]:
        """What stock saves as the model file's ``param_shapes``: each group's names and shapes in its flat order."""
        return [OrderedDict((names[p], p.shape) for p in params) for params in self.groups]


def stock_layout(o: Any, world_size: int) -> _StockLayout:
    """Stock DeepSpeed's layout of this optimizer's unsplit param groups over ``world_size`` ranks."""
    return _StockLayout.of_optimizer(o, world_size)


def classify(o: Any, sd: Any, source: str) -> str:
    """``FLATGRAD`` or ``STOCK``: whose sub-groups the ZeRO-1/2 optimizer shard ``sd`` holds; else raise, naming ``source``.

    The saved ``param_slice_mappings`` (every param's place in this rank's
    partitions) are compared with flatgrad's and with stock's layout of the
    same params: only an exact match is taken.
    """
    import deepspeed.comm as dist
    from deepspeed.checkpoint.constants import (
        BASE_OPTIMIZER_STATE,
        FP32_FLAT_GROUPS,
        GROUP_PADDINGS,
        OPTIMIZER_STATE_DICT,
        PARAM_ALIGNMENT_PADDINGS,
        PARAM_SLICE_MAPPINGS,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
        ZERO_STAGE,
    )

    if not isinstance(sd, Mapping):
        raise CheckpointLoadError(f"{source} holds no ZeRO optimizer state (its '{OPTIMIZER_STATE_DICT}' is {type(sd).__name__})")
    stage = sd.get(ZERO_STAGE)
    if (stage is not None and int(stage) == 3) or FP32_FLAT_GROUPS in sd:
        raise UnsupportedConfigError(
            f"{source} was saved by a ZeRO-3 engine (MiCS included: '{ZERO_STAGE}' {stage!r}, "
            f"'{FP32_FLAT_GROUPS}'); this run is ZeRO-{2 if o.partition_gradients else 1}"
        )
    for key in (BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS, GROUP_PADDINGS, PARTITION_COUNT):
        if key not in sd:
            raise CheckpointLoadError(f"{source} lacks the key '{key}' of a ZeRO-1/2 optimizer shard")
    group = o.dp_process_group
    rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    counts = sd[PARTITION_COUNT]
    counts = list(counts) if isinstance(counts, (list, tuple)) else [counts]
    if any(int(c) != world_size for c in counts):
        raise world_size_error(source, int(next(c for c in counts if int(c) != world_size)), world_size)
    current = [len(g) for g in o.round_robin_bit16_padding]
    saved = sd.get(PARAM_SLICE_MAPPINGS)
    if saved is None:  # no mappings saved: only the param counts per group tell
        paddings = sd.get(PARAM_ALIGNMENT_PADDINGS)
        if paddings is None or [len(g) for g in paddings] == current:
            return FLATGRAD
        raise _other_groups(paddings, current)
    saved = _saved_mappings(saved)
    if saved == _saved_mappings(o._param_slice_mappings):
        return FLATGRAD
    if any(o.is_moe_group(g) for g in o.optimizer.param_groups):
        raise UnsupportedConfigError(
            f"{source} holds other sub-groups than flatgrad's, and flatgrad does not re-partition the shards of a "
            "model with MoE groups: convert it with deepspeed.checkpoint.ds_to_universal and load that with "
            "'checkpoint.load_universal'"
        )
    layout = _StockLayout.of_shard(o, sd, world_size)
    if not layout.fits or saved != layout.saved_mappings(o.param_names, rank):
        raise _other_groups(sd.get(PARAM_ALIGNMENT_PADDINGS) or saved, current)
    if not isinstance(sd[BASE_OPTIMIZER_STATE], Mapping):
        raise UnsupportedConfigError(
            f"{source} is a stock ZeRO-1/2 shard saved with 'zero_optimization.elastic_checkpoint', which flatgrad "
            "does not re-partition: convert it with deepspeed.checkpoint.ds_to_universal and load that with "
            "'checkpoint.load_universal'"
        )
    return STOCK


def _other_groups(saved: Sequence[Sequence[Any]], current: list[int]) -> UnsupportedConfigError:
    return UnsupportedConfigError(
        f"the checkpoint's ZeRO optimizer has {len(saved)} param group(s) of {[len(g) for g in saved]} "
        f"params, flatgrad's has {len(current)} bucket-sized sub-groups of {current}: it was saved by "
        "flatgrad with another bucket size ('flatgrad.bucket_numel' / 'zero_optimization.reduce_bucket_size') "
        "or by stock DeepSpeed with other param groups. Load it with the bucket size it was saved with, or "
        "convert it to a universal checkpoint (deepspeed.checkpoint.ds_to_universal) and load that "
        "with 'checkpoint.load_universal'"
    )


def _moves(
    o: Any, layout: _StockLayout, origins: Sequence[int], rank: int, world_size: int
) -> tuple[list[list[tuple[int, int, int]]], list[list[tuple[int, int, int]]]]:
    """Per peer, the ``(group, offset, count)`` runs this rank sends from its stock partitions and receives into its
    sub-group partitions; both sides list them in the same order, so the runs need no labels on the wire."""
    send: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    recv: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    where = [{id(p): at for p, at in zip(params, starts)} for params, starts in zip(layout.groups, layout.offsets)]
    for s, (params, starts) in enumerate(zip(o.round_robin_bit16_groups, o.round_robin_bit16_offsets)):
        g, new_size = origins[s], int(o.partition_size[s])
        old_size = layout.partition_sizes[g]
        for p, new_start in zip(params, starts):
            old_start, k, n = where[g][id(p)], 0, p.numel()
            while k < n:
                a, b = old_start + k, new_start + k
                src, dst = a // old_size, b // new_size
                count = min(n - k, (src + 1) * old_size - a, (dst + 1) * new_size - b)
                if src == rank:
                    send[dst].append((g, a - rank * old_size, count))
                if dst == rank:
                    recv[src].append((s, b - rank * new_size, count))
                k += count
    return send, recv


def _exchange(
    old: Sequence[torch.Tensor], sizes: Sequence[int], send: list, recv: list, group: Any
) -> list[torch.Tensor]:
    """One tensor per sub-group (zeros where nothing lands: the padding), filled from ``old`` (one per stock group)."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    dtype = old[0].dtype
    parts = [old[g].narrow(0, at, count) for runs in send for g, at, count in runs]
    buffer = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=dtype, device=device)
    received = torch.empty(sum(c for runs in recv for _, _, c in runs), dtype=dtype, device=device)
    dist.all_to_all_single(
        received, buffer, output_split_sizes=[sum(c for _, _, c in runs) for runs in recv],
        input_split_sizes=[sum(c for _, _, c in runs) for runs in send], group=group,
    )  # fmt: skip
    del buffer
    received = received.cpu()
    new = [torch.zeros(size, dtype=dtype) for size in sizes]
    at = 0
    for runs in recv:
        for s, offset, count in runs:
            new[s].narrow(0, offset, count).copy_(received.narrow(0, at, count))
            at += count
    return new


def _partitioned_keys(states: Sequence[Mapping[str, Any]], sizes: Sequence[int]) -> list[str]:
    """The optimizer state keys holding one flat tensor of its group's partition size in every group (Adam's moments)."""
    return sorted(
        key for key in states[0]
        if all(
            torch.is_tensor(state.get(key)) and state[key].dim() == 1 and state[key].numel() == int(size)
            for state, size in zip(states, sizes)
        )
    )  # fmt: skip


def repartition(o: Any, sd: Mapping[str, Any]) -> dict:
    """This rank's shard in flatgrad's sub-groups, from its stock shard ``sd`` (``classify`` said ``STOCK``).

    Collective over the data-parallel group: every rank calls it with its own shard.
    The fp32 partitions and every optimizer state tensor of a partition's size
    (Adam's ``exp_avg``, ``exp_avg_sq``) move; the other state (``step``) and
    the hyperparameters are copied from the group each sub-group was split from.
    """
    import deepspeed.comm as dist
    from deepspeed.checkpoint import constants as keys

    group = o.dp_process_group
    rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    layout = _StockLayout.of_shard(o, sd, world_size)
    origins = o._flatgrad_origins[1]
    send, recv = _moves(o, layout, origins, rank, world_size)
    sizes = [int(size) for size in o.partition_size]

    def padded(t: torch.Tensor, size: int) -> torch.Tensor:
        t = t.detach().reshape(-1)
        return torch.cat([t, t.new_zeros(size - t.numel())]) if t.numel() < size else t

    fp32 = [padded(t, size) for t, size in zip(sd[keys.SINGLE_PARTITION_OF_FP32_GROUPS], layout.partition_sizes)]
    masters = _exchange(fp32, sizes, send, recv, group)
    del fp32
    base = sd[keys.BASE_OPTIMIZER_STATE]
    saved_groups = base["param_groups"]
    states = [base["state"].get(g["params"][0], {}) for g in saved_groups]
    partitioned = _partitioned_keys(states, layout.partition_sizes)
    new_states: list[dict] = [{} for _ in sizes]
    for key in partitioned:
        for s, t in enumerate(_exchange([state[key] for state in states], sizes, send, recv, group)):
            new_states[s][key] = t
    for s, g in enumerate(origins):
        for key, value in states[g].items():
            if key not in partitioned:
                new_states[s][key] = value.clone() if torch.is_tensor(value) else value
    out = {k: v for k, v in sd.items() if k not in (keys.BASE_OPTIMIZER_STATE, keys.SINGLE_PARTITION_OF_FP32_GROUPS)}
    out[keys.BASE_OPTIMIZER_STATE] = {
        "state": {s: state for s, state in enumerate(new_states) if state},
        "param_groups": [{**saved_groups[g], "params": [s]} for s, g in enumerate(origins)],
    }
    out[keys.SINGLE_PARTITION_OF_FP32_GROUPS] = [
        t[: size - int(pad)] for t, size, pad in zip(masters, sizes, o.groups_padding)
    ]
    out[keys.GROUP_PADDINGS] = list(o.groups_padding)
    out[keys.PARAM_ALIGNMENT_PADDINGS] = [list(pad) for pad in o.round_robin_bit16_padding]
    out[keys.PARTITION_COUNT] = list(o.partition_count)
    out[keys.PARAM_SLICE_MAPPINGS] = o._param_slice_mappings
    return out


def unsplit_hyperparameters(groups: Sequence[Mapping[str, Any]], origins: Sequence[int], unsplit: int) -> list[dict]:
    """Each unsplit group's hyperparameters (every key but ``params``), from the sub-groups split from it, which must
    agree; else refuse, naming the key. ``groups``: the sub-groups' param groups (live or saved)."""
    out = []
    for g in range(unsplit):
        mine = [s for s, origin in enumerate(origins) if origin == g]
        if not mine:
            raise UnsupportedConfigError(
                f"'flatgrad.checkpoint_layout': 'stock' found param group {g} without trainable params with elements; "
                "stock's layout of it is empty"
            )
        hyper = {k: v for k, v in groups[mine[0]].items() if k != "params"}
        for t in mine[1:]:
            other = {k: v for k, v in groups[t].items() if k != "params"}
            if other != hyper:
                key = next(k for k in sorted(set(hyper) | set(other), key=str) if hyper.get(k) != other.get(k))
                raise UnsupportedConfigError(
                    f"'flatgrad.checkpoint_layout': 'stock' needs the sub-groups of param group {g} to agree, and "
                    f"sub-groups {mine[0]} and {t} differ in '{key}' ({hyper.get(key)!r} against {other.get(key)!r})"
                )
        out.append(hyper)
    return out


def to_stock(o: Any, sd: Mapping[str, Any]) -> dict:
    """This rank's shard in stock's layout of the unsplit groups, from its shard ``sd`` in flatgrad's sub-groups.

    Collective over the data-parallel group, the inverse of ``repartition``:
    every piece of every sub-group partition goes back to the rank and offset
    stock gives it, one ``all_to_all_single`` per state tensor. The result is
    what stock DeepSpeed saves for the same fp32 masters and optimizer state,
    so stock loads it, and so does flatgrad (as a stock shard).
    """
    import deepspeed.comm as dist
    from deepspeed.checkpoint import constants as keys
    from deepspeed.utils.tensor_fragment import fragment_address

    group = o.dp_process_group
    rank, world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
    layout = stock_layout(o, world_size)
    origins = o._flatgrad_origins[1]
    unsplit = len(layout.groups)
    recv, send = _moves(o, layout, origins, rank, world_size)  # the load's moves, run backwards
    sizes = layout.partition_sizes
    masters = _exchange([t.detach().reshape(-1) for t in o.single_partition_of_fp32_groups], sizes, send, recv, group)
    base = sd[keys.BASE_OPTIMIZER_STATE]
    groups = base["param_groups"]
    states = [base["state"].get(g["params"][0], {}) for g in groups]
    first = {g: origins.index(g) for g in range(unsplit) if g in origins}
    partitioned = _partitioned_keys(states, o.partition_size)
    moved = {key: _exchange([state[key] for state in states], sizes, send, recv, group) for key in partitioned}
    new_states: list[dict] = [{} for _ in range(unsplit)]
    new_groups = [{**hyper, "params": [g]} for g, hyper in enumerate(unsplit_hyperparameters(groups, origins, unsplit))]
    for g in range(unsplit):
        s = first[g]
        for key, value in states[s].items():  # in the optimizer's own key order, as stock's shard has it
            if key in moved:
                new_states[g][key] = moved[key][g]
            else:
                new_states[g][key] = value.clone() if torch.is_tensor(value) else value
    paddings = layout.group_paddings(rank)
    out = {k: v for k, v in sd.items() if k not in (keys.BASE_OPTIMIZER_STATE, keys.SINGLE_PARTITION_OF_FP32_GROUPS)}
    out[keys.BASE_OPTIMIZER_STATE] = {
        "state": {g: state for g, state in enumerate(new_states) if state},
        "param_groups": new_groups,
    }
    out[keys.SINGLE_PARTITION_OF_FP32_GROUPS] = [t[: size - pad] for t, size, pad in zip(masters, sizes, paddings)]
    out[keys.GROUP_PADDINGS] = paddings
    out[keys.PARAM_ALIGNMENT_PADDINGS] = layout.paddings
    out[keys.PARTITION_COUNT] = [world_size] * unsplit
    out[keys.PARAM_SLICE_MAPPINGS] = [
        OrderedDict((name, fragment_address(numel=numel, start=start)) for name, start, numel in pieces)
        for pieces in layout.linked(o.param_names, rank)
    ]
    return out
