"""The one registry of reduction modes: every list of mode names, and every mode's construction, comes from it.

For each mode it holds the name, its class, the stages it runs (one for the flat modes, the node
stage then the rail stage for the two-stage ones), the ZeRO stages that serve it, and the wire kind
it quantizes to. The planner prices a mode from its stages; ``ReducerConfig``, the DeepSpeed
config, the ZeRO-3 list, the benches and the docs' table derive from ``MODES``. A new mode is one
class in ``flatgrad.reducer.modes`` plus one entry here. See [Note: mode registry] in docs/design.md.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

from ..kernels import wire
from .modes import (
    ExactSum, HierarchicalExact, HierarchicalQuantized, QuantizedTwoStage, QuantizedWire, ReduceScatter, ReductionMode,
    TwoStageReduceScatter,
)  # fmt: skip
from .topology import Topology

__all__ = ["MODES", "ModeEntry", "Stage", "build_mode", "check_options", "entry", "names"]


@dataclasses.dataclass(frozen=True)
class Stage:
    """One collective of a mode, as the planner prices it.

    Attributes:
        collective: ``"reduce_scatter"`` or ``"all_to_all"``.
        payload: what moves: ``"comm"`` (the comm dtype), ``"fp32"`` (fp32 partial sums) or ``"wire"``
            (the quantized wire of the mode's kind).
        flat: the flat mode that runs this stage alone, when the other stage is empty (one node, or one
            rank per node).
    """

    collective: str
    payload: str
    flat: str


@dataclasses.dataclass(frozen=True)
class ModeEntry:
    """One reduction mode.

    Attributes:
        name: the ``reduction`` value that names it.
        cls: its ``ReductionMode`` class.
        stages: its collectives in order: one (flat), or the node stage then the rail stage.
        zero_stages: the DeepSpeed ZeRO stages whose integration serves it.
        kind: the wire kind (``"int8"``, ``"fp8"``) of a quantized mode, else ``None``; ``block`` and
            ``error_feedback`` apply to these only.
        summary: one line for the docs' table of modes.
    """

    name: str
    cls: type[ReductionMode]
    stages: tuple[Stage, ...]
    zero_stages: frozenset[int]
    kind: str | None
    summary: str

    @property
    def two_stage(self) -> bool:
        """Whether it runs a node stage and a rail stage."""
        return len(self.stages) == 2


_EVERY_STAGE = frozenset((1, 2, 3))  # every ZeRO stage's integration serves every mode


def _flat(name: str, cls: type[ReductionMode], stage: Stage, kind: str | None, summary: str) -> ModeEntry:
    return ModeEntry(name, cls, (stage,), _EVERY_STAGE, kind, summary)


_RS = Stage("reduce_scatter", "comm", "reduce_scatter")
_A2A = Stage("all_to_all", "comm", "exact")
_FP32 = Stage("all_to_all", "fp32", "exact")


def _wire(kind: str) -> Stage:
    return Stage("all_to_all", "wire", kind)


MODES: tuple[ModeEntry, ...] = (
    _flat("reduce_scatter", ReduceScatter, _RS, None, "one reduce_scatter of the comm dtype, in place"),
    _flat("exact", ExactSum, _A2A, None, "one all_to_all of the comm dtype, fp32 sums in rank order"),
    _flat("int8", QuantizedWire, _wire("int8"), "int8", "fused pack-quantize, one all_to_all of the int8 wire"),
    _flat("fp8", QuantizedWire, _wire("fp8"), "fp8", "fused pack-quantize, one all_to_all of the fp8 wire"),
    ModeEntry("2d_reduce_scatter", TwoStageReduceScatter, (_RS, _RS), _EVERY_STAGE, None,
              "reduce_scatter in the node, then over the rail"),
    ModeEntry("hier_exact", HierarchicalExact, (_A2A, _FP32), _EVERY_STAGE, None,
              "all_to_all in the node, fp32 partials all_to_all over the rail: fixed-order fp32 sums"),
    ModeEntry("hier_int8", HierarchicalQuantized, (_RS, _wire("int8")), _EVERY_STAGE, "int8",
              "reduce_scatter in the node, the int8 wire over the rail"),
    ModeEntry("hier_fp8", HierarchicalQuantized, (_RS, _wire("fp8")), _EVERY_STAGE, "fp8",
              "reduce_scatter in the node, the fp8 wire over the rail"),
    ModeEntry("qgz_int8", QuantizedTwoStage, (_wire("int8"), _wire("int8")), _EVERY_STAGE, "int8",
              "int8 wire in the node, requantize, int8 wire over the rail (ZeRO++ qgZ)"),
    ModeEntry("qgz_fp8", QuantizedTwoStage, (_wire("fp8"), _wire("fp8")), _EVERY_STAGE, "fp8",
              "fp8 wire in the node, requantize, fp8 wire over the rail"),
)  # fmt: skip

_BY_NAME = {m.name: m for m in MODES}


def names(*, zero_stage: int | None = None, two_stage: bool | None = None) -> tuple[str, ...]:
    """The modes' names, in registry order; only those a ZeRO stage serves, or only flat / two-stage ones."""
    return tuple(
        m.name for m in MODES
        if (zero_stage is None or zero_stage in m.zero_stages) and (two_stage is None or m.two_stage == two_stage)
    )  # fmt: skip


def entry(name: str, key: str = "reduction") -> ModeEntry:
    """The registry entry of ``name``; an unknown name raises naming ``key`` and every mode."""
    found = _BY_NAME.get(name) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"{key} must be one of {names()}, got {name!r}")
    return found


def build_mode(
    name: str, world_size: int, *, block: int = 256, error_feedback: bool = False, topology: Topology | None = None
) -> ReductionMode:
    """The mode ``name`` for a group of ``world_size`` ranks placed on nodes as ``topology`` says.

    A one-rank group sends nothing, so every mode is ``ReduceScatter`` there. A two-stage mode needs
    ``topology``; where one of its stages is empty (one node, or one rank per node) it is the flat mode of
    the stage that is left, with a warning. See [Note: two-stage reductions] in docs/design.md.
    """
    mode = entry(name)
    if world_size == 1:
        return ReduceScatter()
    if mode.two_stage:
        if topology is None:
            raise ValueError(f"reduction {name!r} needs the group's topology (node and rail placement)")
        if not topology.two_stage:
            left = mode.stages[0] if topology.num_nodes == 1 else mode.stages[1]
            flat = build_mode(left.flat, world_size, block=block, error_feedback=error_feedback)
            warnings.warn(
                f"flatgrad: reduction {name!r} on {topology.num_nodes} node(s) of {topology.local_size} "
                f"rank(s) has one stage only; running {flat.name!r} (node_size={topology.node_size})",
                stacklevel=3,
            )
            return flat
    return mode.cls.build(mode.name, mode.kind, block, error_feedback if mode.kind else False, topology)


def check_options(name: str, block: int, error_feedback: bool, key: Callable[[str], str] = str) -> ModeEntry:
    """Validate ``name``, ``block`` and ``error_feedback`` together; each error names its field as ``key(field)``
    (``"reduction"``, or ``"'flatgrad.reduction'"`` for a DeepSpeed config). Returns the mode's entry."""
    mode = entry(name, key("reduction"))
    wire.check_block(block, key("block"))
    if not isinstance(error_feedback, bool):
        raise ValueError(f"{key('error_feedback')} must be True or False, got {error_feedback!r}")
    if mode.kind is not None:
        wire.check_kind(mode.kind, key("reduction"))
    elif error_feedback:
        quantized = ", ".join(m.name for m in MODES if m.kind)
        raise ValueError(f"{key('error_feedback')} needs a quantized {key('reduction')} ({quantized}), not {name!r}")
    return mode
