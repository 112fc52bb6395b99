"""The gradient reducer: buckets of gradients, each reduced by one fused pack, one collective, one fused unpack.

``BucketReducer`` schedules the buckets (hooks, launch order, streams, windows);
``ReducerConfig`` holds its settings; each reduction mode is one object in
``modes``; ``pool`` holds the per-micro-step comm buffers; ``shards`` places
a window's shards; ``agreement`` makes every rank raise when the ranks
disagree on the buckets.
"""

from .agreement import LayoutMismatchError, agree, agreement_device
from .config import REDUCTIONS, ReducerConfig
from .bucket import Bucket
from .modes import DividedReduceScatter, ExactSum, QuantizedWire, ReduceScatter, ReductionMode, make_mode
from .reducer import BucketReducer, GradShard, build_buckets
from .shards import ArenaShards, OwnShards, ShardStore, TargetShards

__all__ = [
    "ArenaShards", "Bucket", "BucketReducer", "DividedReduceScatter", "ExactSum", "GradShard", "LayoutMismatchError", "OwnShards", "QuantizedWire", "REDUCTIONS", "ReduceScatter",
    "ReducerConfig", "ReductionMode", "ShardStore", "TargetShards", "agree", "agreement_device", "build_buckets", "make_mode",
]  # fmt: skip
