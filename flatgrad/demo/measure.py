"""Inside a demo rank: every collective call recorded where DeepSpeed and flatgrad issue it, and per-rank bytes.

[Note: counting collectives]
DeepSpeed keeps its own references to torch's functions and calls them
through ``deepspeed.comm``; flatgrad calls ``torch.distributed`` directly. The
recorder therefore wraps the entry points of both modules and records only the
outermost call, so a ``deepspeed.comm.reduce`` that reaches
``torch.distributed.reduce`` is one call, and ZeRO-3's ``reduce_scatter_fn`` ->
``reduce_scatter_tensor`` -> ``reduce_scatter_single`` chain is one call too.
Every call is recorded with the phase it happened in (``forward``,
``backward``, ``step``; set by the trainer), its op (DeepSpeed's wrapper names
folded onto the torch op they issue), the elements of its buffer (a
reduce_scatter's whole input, an all_gather's whole output), its dtype, the
global ranks of its group, and a reduce's destination. A coalesced group
(``torch.distributed._coalescing_manager``) is one launch: recorded once, with
the op and group of the calls in it and the sum of their elements; so is
flatgrad's ``comm.all_gather_into_tensor_coalesced`` (the ZeRO-1/2 step's
parameter all_gathers), which issues a coalesced group in one call. A call on a one-rank
group is a call (stock ZeRO-2 issues those for MoE experts when every expert
group has one rank); it sends no bytes. flatgrad's reduction modes move a
bucket with ``flatgrad.comm.all_to_all``; the ``all_to_all_single`` it issues
(none on a one-rank group, where it copies) is recorded as
``grad_all_to_all``, a gradient reduction, unlike the all_to_alls of an MoE
layer's dispatch and combine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from ..plan.cost import DEFAULT
from ..plan.schedule import Collective

__all__ = ["Call", "CollectiveRecorder", "REDUCTION_OPS", "sent_bytes"]

# Gradient reductions, the calls the demo compares; everything else is recorded for the JSON only.
# ``grad_all_to_all`` is flatgrad's all_to_all of a reduction mode (``flatgrad.comm.all_to_all``), told
# apart from other all_to_alls (an MoE layer's dispatch runs one in backward too).
REDUCTION_OPS = ("reduce", "all_reduce", "reduce_scatter", "grad_all_to_all")

# Entry points of flatgrad's own comm layer that relabel the collective they issue (none on a one-rank group).
_FLATGRAD_OPS = {"all_to_all": "grad_all_to_all"}

# Entry point -> the op it issues. ``deepspeed.comm`` and ``torch.distributed`` share most names.
_OPS = {
    "reduce": "reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_coalesced": "all_gather",
    "_all_gather_base": "all_gather",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
}


class Call(NamedTuple):
    """One recorded collective call (see [Note: counting collectives])."""

    phase: str
    op: str
    numel: int
    dtype: str
    group: tuple[int, ...]
    dst: int | None


def _buffer(values: list[Any]) -> tuple[int, str]:
    """Elements and dtype of a call's buffer: a list argument summed, else the largest tensor."""
    lists = [v for v in values if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]
    if lists:
        return sum(t.numel() for t in lists[-1]), str(lists[-1][0].dtype).replace("torch.", "")
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return 0, ""
    largest = max(tensors, key=lambda t: t.numel())
    return largest.numel(), str(largest.dtype).replace("torch.", "")


@dataclasses.dataclass
class CollectiveRecorder:
    """Records the collectives of this rank process while installed; the trainer sets ``phase``.

    Attributes:
        phase: the label the next calls are recorded under.
        calls: the calls recorded since the last ``take()``.
    """

    phase: str = "other"
    calls: list[Call] = dataclasses.field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = dataclasses.field(default_factory=list)
    _depth: int = 0
    _pending: list | None = None
    _groups: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    _batch: list[Call] | None = None  # the calls of an open coalesced group
    _label: str | None = None

    def install(self) -> "CollectiveRecorder":
        """Wrap the collective entry points of ``deepspeed.comm`` (if importable) and ``torch.distributed``."""
        modules: list[Any] = [dist]
        try:
            import deepspeed.comm as ds_comm

            modules.insert(0, ds_comm)
        except ImportError:
            pass
        for module in modules:
            for name, op in _OPS.items():
                fn = getattr(module, name, None)
                if callable(fn):
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(op, fn))
        self._saved.append((dist, "_coalescing_manager", dist._coalescing_manager))
        dist._coalescing_manager = self._wrap_coalescing(dist._coalescing_manager)
        from .. import comm  # the reducer calls comm.all_to_all through the module: wrapping the attribute is seen

        for name, op in _FLATGRAD_OPS.items():
            fn = getattr(comm, name)
            self._saved.append((comm, name, fn))
            setattr(comm, name, self._relabel(op, fn))
        fn = comm.all_gather_into_tensor_coalesced
        self._saved.append((comm, "all_gather_into_tensor_coalesced", fn))
        comm.all_gather_into_tensor_coalesced = self._wrap("all_gather", fn, outputs_first=True)
        return self

    def _wrap_coalescing(self, manager: Callable) -> Callable:
        @contextlib.contextmanager
        def coalesced(*args: Any, **kwargs: Any) -> Any:
            outer = self._depth == 0 and self._batch is None
            if outer:
                self._batch = []
            try:
                with manager(*args, **kwargs) as cm:
                    yield cm
            finally:
                if outer:
                    batch, self._batch = self._batch, None
                    if batch:
                        self.calls.append(batch[0]._replace(numel=sum(c.numel for c in batch)))

        return coalesced

    def _record(self, call: Call) -> None:
        (self.calls if self._batch is None else self._batch).append(call)

    def uninstall(self) -> None:
        """Put the original functions back."""
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def take(self) -> list[Call]:
        """The calls recorded so far; the record starts empty again."""
        calls, self.calls = self.calls, []
        return calls

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(dist.get_world_size()))
        ranks = self._groups.get(id(group))
        if ranks is None:
            ranks = self._groups[id(group)] = tuple(dist.get_process_group_ranks(group))
        return ranks

    def _wrap(self, op: str, fn: Callable, outputs_first: bool = False) -> Callable:
        """``outputs_first``: the call's first argument is its list of outputs, the buffer recorded."""
        signature = _signature_with_group(fn)

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                numel, dtype = _buffer([args[0]] if outputs_first else list(args) + list(kwargs.values()))
                self._pending = [self._label or op, numel, dtype, None, None]
            if self._pending is not None and signature is not None:
                self._resolve(signature, args, kwargs)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._finish()

        return recorded

    def _relabel(self, op: str, fn: Callable) -> Callable:
        """``fn`` records nothing itself; the collective it issues, if any, is recorded as ``op``."""

        @functools.wraps(fn)
        def relabelled(*args: Any, **kwargs: Any) -> Any:
            saved, self._label = self._label, op
            try:
                return fn(*args, **kwargs)
            finally:
                self._label = saved

        return relabelled

    def _resolve(self, signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
        """Fill the pending call's group ranks and destination from a call with a real signature."""
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return
        pending = self._pending
        pending[3] = self._group_ranks(bound.get("group"))
        if pending[0] == "reduce":
            pending[4] = bound.get("dst")
        self._pending = None
        self._record(Call(self.phase, *pending))  # type: ignore[arg-type]

    def _finish(self) -> None:
        """A call whose group was never named (no inner call with a signature): the default group."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending[3] = self._group_ranks(None)
            self._record(Call(self.phase, *pending))  # type: ignore[arg-type]


def _signature_with_group(fn: Callable) -> inspect.Signature | None:
    """``fn``'s signature if it names a ``group``, else that of the function it wraps, else None.

    DeepSpeed's ``timed_op`` hides the signature behind ``*args, **kwargs``
    without ``functools.wraps``; the decorated function is in its closure. A
    call whose signature stays unknown takes its group from the first
    ``torch.distributed`` call made inside it.
    """
    candidates = [fn] + [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if callable(c.cell_contents)]
    for candidate in candidates:
        try:
            signature = inspect.signature(candidate)
        except (TypeError, ValueError):
            continue
        if "group" in signature.parameters:
            return signature
    return None


def sent_bytes(call: Call, rank: int) -> float:
    """Bytes ``rank`` sends in a gradient reduction, by the same model as ``flatgrad plan``.

    Ring algorithms: ``2 (p - 1) / p`` of the buffer for ``all_reduce``,
    ``(p - 1) / p`` for ``reduce_scatter``, the whole buffer for a ``reduce``
    rooted at another rank, nothing for one rooted here or on a one-rank group.
    ``grad_all_to_all``: the ``p - 1`` chunks that go to other ranks, ``(p - 1) / p``
    of the buffer (the quantized wire's bytes for int8 / fp8).
    See [Note: cost model] in ``flatgrad/plan/cost.py``.
    """
    if call.op not in REDUCTION_OPS:
        raise ValueError(f"sent_bytes models gradient reductions {REDUCTION_OPS}, got {call.op!r}")
    if len(call.group) <= 1:
        return 0.0
    op = "all_to_all" if call.op == "grad_all_to_all" else call.op
    collective = Collective(op, call.numel, getattr(torch, call.dtype), _as_range(call.group), call.dst)
    return DEFAULT.sent_bytes(collective, rank)


def _as_range(ranks: tuple[int, ...]) -> range:
    """A group's ranks as the ``range`` ``plan`` uses; DeepSpeed's groups are evenly strided."""
    step = ranks[1] - ranks[0] if len(ranks) > 1 else 1
    as_range = range(ranks[0], ranks[-1] + step, step)
    if tuple(as_range) != ranks:
        raise ValueError(f"group ranks {ranks} are not evenly strided")
    return as_range
