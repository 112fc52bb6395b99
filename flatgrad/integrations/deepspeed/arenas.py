"""ZeRO-2's optimizer update over arenas: a run of sub-groups is one tensor to the optimizer.

Bucket-sized sub-groups would make a CPU optimizer loop over many tensors, so
the sub-groups' partitions, gradients and state are slices of arenas and an
elementwise optimizer updates a run of them as one param. See
[Note: optimizer arenas] in docs/design.md.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["ELEMENTWISE", "OptimizerArenas", "same_settings"]

ELEMENTWISE: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

_Run = tuple[int, int, int]  # (arena, first position, end position)


def _same_setting(a: Any, b: Any) -> bool:
    """Whether two param-group settings are equal; tensors count as equal only to themselves."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - settings that do not compare are kept apart
        return False


def same_settings(group: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    """Whether two param groups have the same keys and equal values but for ``params``."""
    if len(group) != len(other):
        return False
    for k, v in group.items():
        if k != "params" and (k not in other or not _same_setting(other[k], v)):
            return False
    return True


def _contiguous_run(pieces: list[torch.Tensor], offsets: list[int]) -> torch.Tensor | None:
    """The one tensor ``pieces`` already are, laid at ``offsets`` of one storage (a run saved and loaded whole)."""
    first = pieces[0]
    storage = first.untyped_storage()
    base = first.storage_offset()
    for piece, offset in zip(pieces, offsets):
        if (piece.untyped_storage().data_ptr() != storage.data_ptr() or piece.storage_offset() != base + offset
                or not piece.is_contiguous() or piece.dtype != first.dtype):  # fmt: skip
            return None
    total = offsets[-1] + pieces[-1].numel()
    if base + total > storage.nbytes() // first.element_size():
        return None
    return first.new_empty(0).set_(storage, base, (total,), (1,))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return _same_setting(a, b)


class _Settings:
    """One param group's settings, compared with others' as ``same_settings`` does, at C speed where it can.

    A step compares every sub-group with its run's first: without tensor
    settings that is one comparison of value tuples and one of type tuples (1
    and 1.0 differ, as there); with tensors, the same objects or the full rule.
    """

    def __init__(self, group: Mapping[str, Any]) -> None:
        self.group = group
        keys = [key for key in group if key != "params"]
        self._get = operator.itemgetter(*keys) if len(keys) > 1 else (lambda g: tuple(g[key] for key in keys))
        self._values = self._get(group)
        self._types = tuple(map(type, self._values))
        self._plain = not any(issubclass(t, torch.Tensor) for t in self._types)  # tensors equal only themselves

    def equal(self, group: Mapping[str, Any]) -> bool:
        """``same_settings(group, self.group)``."""
        if len(group) != len(self.group):
            return False
        try:
            values = self._get(group)
            if self._plain:  # no tensor among this group's: equal types and equal (or the same) values
                return values == self._values and tuple(map(type, values)) == self._types
            if all(map(operator.is_, values, self._values)):
                return True
        except Exception:  # noqa: BLE001 - a missing key, or values that do not compare: the full rule decides
            pass
        return same_settings(group, self.group)


class OptimizerArenas:
    """The fp32 master partitions of each order's sub-groups as slices of one tensor, stepped in runs.

    Args:
        optimizer: DeepSpeed's ``DeepSpeedZeroOptimizer`` (its ``optimizer`` must be
            one of ``ELEMENTWISE``; checked by ``usable``).
        orders: per arena, the sub-group indices in arena order (the reducer's
            ``shard_arena`` order).
    """

    def __init__(self, optimizer: Any, orders: Sequence[Sequence[int]]) -> None:
        o = optimizer
        self.optimizer = o
        self.orders = [list(order) for order in orders]
        parts = o.single_partition_of_fp32_groups
        self.offsets: list[list[int]] = []
        self.masters: list[torch.Tensor] = []
        with torch.no_grad():
            for order in self.orders:
                first = parts[order[0]]
                if any(parts[i].dtype != first.dtype or parts[i].device != first.device or parts[i].dim() != 1
                       for i in order):  # fmt: skip
                    raise ValueError("the fp32 partitions of one process group differ in dtype or device")
                starts = [0]
                for i in order:
                    starts.append(starts[-1] + parts[i].numel())
                master = torch.empty(starts[-1], dtype=first.dtype, device=first.device)
                for i, start in zip(order, starts):
                    master.narrow(0, start, parts[i].numel()).copy_(parts[i])
                    parts[i].set_(master.untyped_storage(), start, parts[i].shape, (1,))
                self.offsets.append(starts)
                self.masters.append(master)
        o._link_all_hp_params()  # DeepSpeed's fragment views of the partitions, made again over the arena
        self._params: dict[_Run, torch.Tensor] = {}
        self._states: dict[_Run, dict] = {}
        self._state_dict_seen = o.optimizer.state
        self._expected: tuple[list, list] | None = None
        self.steps = 0  # steps taken through the arenas (for tests and the demo)

    def usable(self) -> bool:
        """Whether the optimizer's update is elementwise, so a run may be stepped as one tensor."""
        return type(self.optimizer.optimizer) in ELEMENTWISE

    def invalidate(self) -> None:
        """The per-sub-group state was loaded or written: gather it again at the next step."""
        self._states.clear()

    def unshare(self) -> None:
        """Give every sub-group its own scalar state before a step that does not go through the arenas."""
        state = self.optimizer.optimizer.state
        parts = self.optimizer.single_partition_of_fp32_groups
        for (k, start, stop), run_state in self._states.items():
            scalars = [key for key, value in run_state.items() if not self._is_slab(value, (k, start, stop))]
            for i in self.orders[k][start:stop]:
                own = state[parts[i]]
                for key in scalars:
                    if isinstance(own.get(key), torch.Tensor):
                        own[key] = own[key].clone()
        self._states.clear()

    def runs(self) -> list[_Run]:
        """Maximal runs of consecutive sub-groups (in arena order) whose settings are equal."""
        groups = self.optimizer.optimizer.param_groups
        runs = []
        for k, order in enumerate(self.orders):
            ordered = [groups[i] for i in order]
            start = 0
            settings = _Settings(ordered[0])
            for j in range(1, len(order) + 1):
                if j < len(order) and settings.equal(ordered[j]):
                    continue
                runs.append((k, start, j))
                if j < len(order):
                    start, settings = j, _Settings(ordered[j])
        return runs

    def step(self, grads: Sequence[torch.Tensor]) -> bool:
        """One optimizer call over every run; ``grads[k]`` is arena ``k``'s fp32 gradient.

        Returns ``False``, having changed nothing, when the sub-groups' state cannot be
        gathered into runs (state of some sub-groups only, or unequal scalars); the
        caller then steps without the arenas.
        """
        opt = self.optimizer.optimizer
        if opt.state is not self._state_dict_seen:  # load_state_dict replaced it
            self._states.clear()
            self._state_dict_seen = opt.state
        self.check_masters()
        runs = self.runs()
        verdicts = {run: self._can_gather(run) for run in runs if run not in self._states}
        if any(verdict is False for verdict in verdicts.values()):
            return False
        states = [self._states.get(run) or (self._gather(run) if verdicts[run] else None) for run in runs]
        self._states = {run: s for run, s in zip(runs, states) if s is not None}
        groups = opt.param_groups
        merged = []
        for (k, start, stop), run_state in zip(runs, states):
            param = self._param((k, start, stop))
            offsets = self.offsets[k]
            param.grad = grads[k].narrow(0, offsets[start], offsets[stop] - offsets[start])
            if run_state is not None:
                opt.state[param] = run_state
            first = groups[self.orders[k][start]]
            group = {**{key: v for key, v in first.items() if key != "params"}, "params": [param]}
            if "foreach" in group and group["foreach"] is None:
                group["foreach"] = True  # torch's per-tensor path makes two run-sized temporaries, foreach one
            merged.append(group)
        opt.param_groups = merged
        try:
            opt.step()
        finally:
            opt.param_groups = groups
            for run, group in zip(runs, merged):
                k, start, stop = run
                param = group["params"][0]
                param.grad = None
                run_state = opt.state.pop(param, None)
                if run_state and run not in self._states:
                    self._link(run, run_state)
                    self._states[run] = run_state
                first = groups[self.orders[k][start]]
                changed = {
                    key: v for key, v in group.items() if key not in ("params", "foreach") and first.get(key) is not v
                }
                for i in self.orders[k][start:stop] if changed else ():
                    groups[i].update(changed)
                self._refresh_plain_values(run)
        self.steps += 1
        return True

    # -- internals

    def check_masters(self) -> None:
        """Put back any fp32 partition that no longer lies in its arena (replaced, or given other ``.data``).

        DeepSpeed writes the partitions in place (checkpoint loads copy into them);
        a partition pointed elsewhere would leave the optimizer updating the arena
        while DeepSpeed reads the partition. One pointer compare per sub-group.
        """
        parts = self.optimizer.single_partition_of_fp32_groups
        if (self._expected is not None and len(parts) == len(self._expected[0])
                and all(map(operator.is_, parts, self._expected[0]))
                and list(map(torch.Tensor.data_ptr, parts)) == self._expected[1]):  # fmt: skip
            return
        moved = False
        with torch.no_grad():
            for k, order in enumerate(self.orders):
                master = self.masters[k]
                for i, start in zip(order, self.offsets[k]):
                    part = parts[i]
                    if part.data_ptr() != master.data_ptr() + start * master.element_size() or part.dim() != 1:
                        master.narrow(0, start, part.numel()).copy_(part.reshape(-1))
                        part.set_(master.untyped_storage(), start, (part.numel(),), (1,))
                        moved = True
        if moved:
            self.optimizer._link_all_hp_params()
            self.optimizer._hp_optimizer_states_linked = False
        self._expected = (list(parts), [p.data_ptr() for p in parts])

    def _param(self, run: _Run) -> torch.Tensor:
        param = self._params.get(run)
        if param is None:
            k, start, stop = run
            offsets = self.offsets[k]
            param = self.masters[k].narrow(0, offsets[start], offsets[stop] - offsets[start])
            self._params[run] = param
        return param

    def _is_slab(self, value: Any, run: _Run) -> bool:
        """Whether a state value is per element of the run (sliced per sub-group) rather than scalar."""
        return isinstance(value, torch.Tensor) and value.shape == self._param(run).shape

    def _views(self, run: _Run) -> list[tuple[torch.Tensor, int, int]]:
        k, start, stop = run
        parts = self.optimizer.single_partition_of_fp32_groups
        offsets = self.offsets[k]
        return [
            (parts[i], offsets[j] - offsets[start], parts[i].numel())
            for j, i in zip(range(start, stop), self.orders[k][start:stop])
        ]

    def _link(self, run: _Run, run_state: dict) -> None:
        """Point every sub-group's state at its slice of the run's (scalars: the run's own objects)."""
        state = self.optimizer.optimizer.state
        for part, offset, numel in self._views(run):
            own = state[part]
            for key, value in run_state.items():
                own[key] = value.narrow(0, offset, numel) if self._is_slab(value, run) else value
        self.optimizer._hp_optimizer_states_linked = False  # DeepSpeed's fragments: made again after the step

    def _can_gather(self, run: _Run) -> bool | None:
        """Whether the sub-groups' states can make the run's (``None``: none has any yet; ``False``: they
        disagree: state of some only, other keys, unequal scalars). Changes nothing."""
        state = self.optimizer.optimizer.state
        views = self._views(run)
        owns = [state.get(part) for part, _, _ in views]
        if not any(owns):
            return None
        if not all(owns) or any(set(own) != set(owns[0]) for own in owns):
            return False
        for key, value in owns[0].items():
            if not all(isinstance(own[key], torch.Tensor) and own[key].shape == part.shape
                       for own, (part, _, _) in zip(owns, views)):  # fmt: skip
                if not all(_equal(own[key], value) for own in owns):
                    return False
        return True

    def _gather(self, run: _Run) -> dict:
        """The run's state from its sub-groups' (``_can_gather`` said yes), which then view it."""
        state = self.optimizer.optimizer.state
        views = self._views(run)
        owns = [state[part] for part, _, _ in views]
        run_state: dict = {}
        slabs = []
        for key, value in owns[0].items():
            if all(isinstance(own[key], torch.Tensor) and own[key].shape == part.shape
                   for own, (part, _, _) in zip(owns, views)):  # fmt: skip
                slabs.append(key)
            else:
                run_state[key] = value.clone() if isinstance(value, torch.Tensor) else value
        for key in slabs:  # one key at a time: the old per-sub-group tensors go as soon as they are linked
            run_state[key] = _contiguous_run([own[key] for own in owns], [offset for _, offset, _ in views])
            if run_state[key] is None:
                run_state[key] = torch.cat([own[key].reshape(-1) for own in owns])
            for own, (part, offset, numel) in zip(owns, views):
                own[key] = run_state[key].narrow(0, offset, numel)
        for own in owns:
            for key, value in run_state.items():
                if key not in slabs:
                    own[key] = value
        self.optimizer._hp_optimizer_states_linked = False
        return run_state

    def _refresh_plain_values(self, run: _Run) -> None:
        """Copy state values that are not tensors (updated by rebinding, not in place) to the sub-groups."""
        run_state = self._states.get(run)
        if not run_state:
            return
        plain = {key: v for key, v in run_state.items() if not isinstance(v, torch.Tensor)}
        if plain:
            state = self.optimizer.optimizer.state
            for part, _, _ in self._views(run):
                state[part].update(plain)
