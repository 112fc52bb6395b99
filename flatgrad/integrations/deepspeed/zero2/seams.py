"""Where flatgrad enters DeepSpeed's ZeRO-1/2 optimizer: the methods it replaces, checked and bound once.

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
"""

from __future__ import annotations

from typing import Any

from ..config import FlatgradConfig, UnsupportedConfigError
from .reduction import Zero2Reduction

__all__ = ["SEAMS", "bind", "install"]

SEAMS = (
    "reduce_independent_p_g_buckets_and_remove_grads",
    "independent_gradient_partition_epilogue",
    "finalize_gradient_accumulation_boundary",
    "setup_buckets",
    "load_hp_checkpoint_state_from_checkpoint_dir",
    "_load_legacy_checkpoint",
    "state_dict",
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



def bind(reduction: Zero2Reduction) -> None:
    """Replace DeepSpeed's methods on the optimizer instance with ``reduction``'s, keeping stock's where it wraps them."""
    self = reduction
    o = self.optimizer
    self._stock_load_legacy = o._load_legacy_checkpoint
    o._load_legacy_checkpoint = self.load_legacy
    self._stock_state_dict = o.state_dict
    o.state_dict = self.state_dict
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


def install(engine: Any, cfg: FlatgradConfig) -> Zero2Reduction:
    """Install flatgrad's reduce path into a ZeRO-1/2 engine built under ``prepare``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    o = engine.optimizer
    if type(o) is not DeepSpeedZeroOptimizer:
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-1/2 backend needs DeepSpeed's DeepSpeedZeroOptimizer, the engine built {type(o).__name__}"
        )
    missing = [name for name in SEAMS if not hasattr(o, name)]
    if missing:
        from ..config import deepspeed_version

        raise UnsupportedConfigError(
            f"DeepSpeed {'.'.join(map(str, deepspeed_version()))} lacks the ZeRO-1/2 seams {missing} flatgrad replaces"
        )
    reduction = Zero2Reduction(o, cfg)
    bind(reduction)
    return reduction

