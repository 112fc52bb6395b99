"""The gradient reducer: buckets of gradients, each reduced by one fused pack, one collective, one fused unpack.

``BucketReducer`` schedules the buckets (hooks, launch order, streams, windows);
``ReducerConfig`` holds its settings; each reduction mode is one object in
``modes`` with one entry in ``registry``; ``setup`` plans a group's mode; ``pool`` holds the per-micro-step comm buffers; ``shards`` places
a window's shards; ``agreement`` makes every rank raise when the ranks
disagree on the buckets.
"""

from .agreement import LayoutMismatchError, agree, agreement_device
from .config import REDUCTIONS, TWO_STAGE_REDUCTIONS, ReducerConfig
from .bucket import Bucket, InFlight
from .modes import (
    BucketPlan, ExactSum, HierarchicalExact, HierarchicalQuantized, QuantizedTwoStage, QuantizedWire, ReduceScatter,
    ReductionMode, StagedWork, TwoStageReduceScatter, Views,
)  # fmt: skip
from .registry import MODES, ModeEntry, Stage, build_mode, check_options
from .setup import ModePlan, plan_mode
from .topology import Topology, default_node_size, place_ranks, plan_topology, two_stage_positions
from .reducer import BucketReducer, GradShard, build_buckets
from .shards import ArenaShards, OwnShards, ShardStore, TargetShards

__all__ = [
    "agree", "agreement_device", "ArenaShards", "Bucket", "BucketPlan", "BucketReducer", "build_buckets",
    "build_mode", "check_options", "default_node_size", "ExactSum", "GradShard", "HierarchicalExact",
    "HierarchicalQuantized", "InFlight", "LayoutMismatchError", "ModeEntry", "ModePlan", "MODES", "OwnShards",
    "place_ranks", "plan_mode", "plan_topology", "QuantizedTwoStage", "QuantizedWire", "ReducerConfig",
    "ReduceScatter", "ReductionMode", "REDUCTIONS", "ShardStore", "Stage", "StagedWork", "TargetShards", "Topology",
    "two_stage_positions", "TWO_STAGE_REDUCTIONS", "TwoStageReduceScatter", "Views",
]  # fmt: skip
