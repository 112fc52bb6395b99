"""Record every collective a rank process issues: entry point, op, buffer, group, destination, phase.

One recorder for the demo, the benches and the tests. It wraps the entry
points of ``deepspeed.comm`` and ``torch.distributed`` (DeepSpeed keeps its own
references to torch's functions; flatgrad calls torch directly) and flatgrad's
comm layer, and records only the outermost call; a coalesced group is one
launch. See [Note: counting collectives] in docs/design.md.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from ..planner.cost import DEFAULT
from ..planner.schedule import Collective

__all__ = [
    "Call", "CollectiveRecorder", "count_collectives", "sent_bytes", "ENTRY_POINTS", "TORCH_COLLECTIVES",
    "REDUCTION_OPS",
]  # fmt: skip

# Gradient reductions, the calls the demo compares; everything else is recorded for the JSON only.
# ``grad_all_to_all`` is flatgrad's all_to_all of a reduction mode (``flatgrad.comm.all_to_all``), told
# apart from other all_to_alls (an MoE layer's dispatch runs one in backward too).
REDUCTION_OPS = ("reduce", "all_reduce", "reduce_scatter", "grad_all_to_all")

# Entry point -> the op it issues, the recorder's default entry points. ``deepspeed.comm`` and
# ``torch.distributed`` share most names; an entry point missing here is recorded under its own name as op.
ENTRY_POINTS = {
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

# Every collective entry point of torch.distributed, for counting all of them (``count_collectives``).
TORCH_COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "all_gather_object", "all_gather_coalesced", "broadcast",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)  # fmt: skip

# Entry points of flatgrad's own comm layer that relabel the collective they issue (none on a one-rank group).
_FLATGRAD_OPS = {"all_to_all": "grad_all_to_all"}

_COALESCED = "_coalescing_manager"
_FLATGRAD_GATHER = "all_gather_into_tensor_coalesced"


class Call(NamedTuple):
    """One recorded collective call (see [Note: counting collectives])."""

    phase: str
    op: str
    numel: int
    dtype: str
    group: tuple[int, ...]
    dst: int | None
    name: str = ""


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


class CollectiveRecorder:
    """Records the collectives of this rank process while installed (or inside ``with``).

    Args:
        names: the entry points to wrap (default ``ENTRY_POINTS``), in ``torch.distributed``
            and, with ``deepspeed``, in ``deepspeed.comm`` and ``deepspeed.comm.comm``; flatgrad's
            comm layer is always seen.
        deepspeed: wrap DeepSpeed's comm modules too, if they import.

    Attributes:
        phase: the label the next calls are recorded under.
        calls: the calls recorded since the last ``take()`` or ``reset()``.
        counts: how many calls each entry point made, over the same span.
    """

    def __init__(self, names: Iterable[str] | None = None, *, deepspeed: bool = True) -> None:
        self.names = tuple(ENTRY_POINTS if names is None else names)
        self.deepspeed = deepspeed
        self.phase = "other"
        self.calls: list[Call] = []
        self.counts: collections.Counter = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []
        self._depth = 0
        self._pending: list | None = None
        self._groups: dict[int, tuple[int, ...]] = {}
        self._batch: list[Call] | None = None  # the calls of an open coalesced group
        self._label: str | None = None

    def install(self) -> "CollectiveRecorder":
        """Wrap the entry points; ``uninstall`` puts them back."""
        modules: list[Any] = [dist]
        if self.deepspeed:
            try:
                import deepspeed.comm as ds_comm
                import deepspeed.comm.comm as ds_module
            except ImportError:
                pass
            else:
                # The package re-exports the module's functions; DeepSpeed calls both, and the module's
                # own chains (reduce_scatter_fn -> reduce_scatter_tensor) reach torch through references
                # DeepSpeed keeps, so both are wrapped.
                modules[:0] = [ds_comm, ds_module]
        for module in modules:
            for name in self.names:
                fn = getattr(module, name, None)
                if callable(fn):
                    self._replace(module, name, self._wrap(name, ENTRY_POINTS.get(name, name), fn))
        self._replace(dist, _COALESCED, self._wrap_coalescing(dist._coalescing_manager))
        from .. import comm  # the reducer calls comm.all_to_all through the module: wrapping the attribute is seen

        for name, op in _FLATGRAD_OPS.items():
            self._replace(comm, name, self._relabel(op, getattr(comm, name)))
        gather = comm.all_gather_into_tensor_coalesced
        self._replace(comm, _FLATGRAD_GATHER, self._wrap(_FLATGRAD_GATHER, "all_gather", gather, outputs_first=True))
        return self

    def uninstall(self) -> None:
        """Put the original functions back."""
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def __enter__(self) -> "CollectiveRecorder":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def take(self) -> list[Call]:
        """The calls recorded so far; the record starts empty again."""
        calls = self.calls
        self.reset()
        return calls

    def reset(self) -> None:
        """Forget the calls and counts recorded so far."""
        self.calls = []
        self.counts = collections.Counter()

    def count(self, name: str) -> int:
        """Calls made to the entry point ``name``."""
        return self.counts[name]

    def buffers(self) -> dict[str, list[tuple[int, str]]]:
        """``(numel, dtype)`` of every recorded call, by entry point, in the order they were first called."""
        out: dict[str, list[tuple[int, str]]] = {}
        for call in self.calls:
            out.setdefault(call.name, []).append((call.numel, call.dtype))
        return out

    def _replace(self, module: Any, name: str, wrapper: Callable) -> None:
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, wrapper)

    def _wrap_coalescing(self, manager: Callable) -> Callable:
        @contextlib.contextmanager
        def coalesced(*args: Any, **kwargs: Any) -> Iterator[Any]:
            outer = self._depth == 0 and self._batch is None
            if outer:
                self._batch = []
            try:
                with manager(*args, **kwargs) as cm:
                    yield cm
            finally:
                if outer:
                    batch, self._batch = self._batch, None
                    first = batch[0] if batch else Call(self.phase, "", 0, "", (), None)
                    self._record(first._replace(numel=sum(c.numel for c in batch), name=_COALESCED))

        return coalesced

    def _record(self, call: Call) -> None:
        if self._batch is not None:
            self._batch.append(call)
            return
        self.calls.append(call)
        self.counts[call.name] += 1

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return tuple(range(dist.get_world_size()))
        ranks = self._groups.get(id(group))
        if ranks is None:
            ranks = self._groups[id(group)] = tuple(dist.get_process_group_ranks(group))
        return ranks

    def _wrap(self, name: str, op: str, fn: Callable, outputs_first: bool = False) -> Callable:
        """``outputs_first``: the call's first argument is its list of outputs, the buffer recorded."""
        signature = _signature_with_group(fn)

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                numel, dtype = _buffer([args[0]] if outputs_first else list(args) + list(kwargs.values()))
                self._pending = [self._label or op, numel, dtype, None, None, name]
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


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Count the calls to every ``torch.distributed`` collective made in the block, by entry point.

    The counter follows [Note: counting collectives]: outermost calls only, a
    coalesced group once as ``_coalescing_manager``, flatgrad's coalesced gather
    once as ``all_gather_into_tensor_coalesced``. Use inside a rank: the wrappers
    patch this process's modules and are removed on exit.
    """
    with CollectiveRecorder(TORCH_COLLECTIVES, deepspeed=False) as recorder:
        yield recorder.counts


def sent_bytes(call: Call, rank: int) -> float:
    """Bytes ``rank`` sends in a gradient reduction, by the same model as ``flatgrad plan``.

    Ring algorithms: ``2 (p - 1) / p`` of the buffer for ``all_reduce``,
    ``(p - 1) / p`` for ``reduce_scatter``, the whole buffer for a ``reduce``
    rooted at another rank, nothing for one rooted here or on a one-rank group.
    ``grad_all_to_all``: the ``p - 1`` chunks that go to other ranks, ``(p - 1) / p``
    of the buffer (the quantized wire's bytes for int8 / fp8).
    See [Note: cost model] in docs/design.md.
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
