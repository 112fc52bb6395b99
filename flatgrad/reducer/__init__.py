"""The gradient reducer: buckets of gradients, each reduced by one fused pack, one collective, one fused unpack.

``BucketReducer`` schedules the buckets (hooks, launch order, streams, windows);
``ReducerConfig`` holds its settings; each reduction mode is one object in
``modes``; ``pool`` holds the per-micro-step comm buffers; ``shards`` places
a window's shards; ``agreement`` makes every rank raise when the ranks
disagree on the buckets.
"""

from .agreement import LayoutMismatchError, agree, agreement_device
from .config import REDUCTIONS, TWO_STAGE_REDUCTIONS, ReducerConfig
from .bucket import Bucket
from .modes import (
    DividedPack, ExactSum, HierarchicalExact, HierarchicalQuantized, QuantizedTwoStage, QuantizedWire, ReduceScatter, ReductionMode, StagedWork, TwoStageReduceScatter, make_mode,
)  # fmt: skip
from .topology import Topology, default_node_size, place_ranks, plan_topology, two_stage_positions
from .reducer import BucketReducer, GradShard, build_buckets
from .shards import ArenaShards, OwnShards, ShardStore, TargetShards

__all__ = [
    "agree", "agreement_device", "ArenaShards", "Bucket", "BucketReducer", "build_buckets", "default_node_size",
    "DividedPack", "ExactSum", "GradShard", "HierarchicalExact", "HierarchicalQuantized",
    "LayoutMismatchError", "make_mode", "OwnShards", "place_ranks", "plan_topology", "QuantizedTwoStage",
    "QuantizedWire", "ReducerConfig", "ReduceScatter", "ReductionMode", "REDUCTIONS", "ShardStore", "StagedWork",
    "TargetShards", "Topology", "two_stage_positions", "TWO_STAGE_REDUCTIONS", "TwoStageReduceScatter",
]  # fmt: skip
