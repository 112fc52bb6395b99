"""Where flatgrad enters DeepSpeed's ZeRO-1/2 optimizer: the methods it replaces, checked once, stock's kept, flatgrad's
bound.

DeepSpeed looks its per-parameter hook and its backward epilogue up on the optimizer instance at
call time, so replacing them there is the whole seam; the hand-over to ``step()`` goes through
``averaged_gradients``. See [Note: ZeRO-2 seams] in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..config import UnsupportedConfigError
from ..stock_methods import StockMethods

__all__ = ["SEAMS", "Zero2Seams"]

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
    "offload_states",
    "reload_states",
    "offloaded_states",
)


# The stock methods flatgrad's replacements wrap or fall back on.
_KEPT = (
    "step", "state_dict", "_load_legacy_checkpoint", "has_overflow", "update_offload_overflow_tracker",
    "offload_states", "reload_states",
)  # fmt: skip


class Zero2Seams:
    """The seams of one ``DeepSpeedZeroOptimizer``: stock's methods kept where flatgrad's wrap them or fall back on
    them, and ``bind``, which puts flatgrad's in their place.

    Raises ``UnsupportedConfigError`` unless ``optimizer`` is DeepSpeed's ZeRO-1/2 optimizer with every seam.

    Attributes:
        stock: DeepSpeed's ``step``, ``state_dict``, ``_load_legacy_checkpoint``, ``has_overflow``,
            ``update_offload_overflow_tracker``, ``offload_states`` and ``reload_states``, as they were before
            ``bind``.
    """

    def __init__(self, optimizer: Any):
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        o = optimizer
        if type(o) is not DeepSpeedZeroOptimizer:
            raise UnsupportedConfigError(
                "flatgrad's ZeRO-1/2 backend needs DeepSpeed's DeepSpeedZeroOptimizer, "
                f"the engine built {type(o).__name__}"
            )
        missing = [name for name in SEAMS if not hasattr(o, name)]
        if missing:
            from ..config import deepspeed_version

            raise UnsupportedConfigError(
                f"DeepSpeed {'.'.join(map(str, deepspeed_version()))} lacks the ZeRO-1/2 seams {missing} "
                "flatgrad replaces"
            )
        self.optimizer = o
        self.stock = StockMethods(o, _KEPT)

    def bind(self, replacements: Mapping[str, Callable[..., Any]], adapter: Any) -> None:
        """Replace each method named in ``replacements`` on the optimizer instance, and make ``adapter`` reachable
        as ``optimizer.flatgrad``."""
        o = self.optimizer
        self.stock.replace(replacements)
        for group in o.bit16_groups:  # as DeepSpeed links them under offload: set_full_hp_grad then tells us
            for lp in group:
                if getattr(lp, "_hp_mapping", None) is not None:
                    lp._zero_optimizer = o
        o._release_ipg_buffers()
        o.flatgrad = adapter
