"""DeepSpeed's communication layer as flatgrad's ``Collectives``.

Stock DeepSpeed issues its gradient collectives through ``deepspeed.comm``, so
its comms logger (``"comms_logger"`` in the config), its profiler and any code
that wraps ``deepspeed.comm`` see them. flatgrad's reduce_scatters and
all_to_alls go the same way under DeepSpeed (see [Note: collectives seam] in
docs/design.md): the tensor form through ``reduce_scatter_fn`` (what
stock ZeRO-3 calls), the list form through ``reduce_scatter``, the reduction
modes through ``all_to_all_single``. The functions are looked up on
``deepspeed.comm`` at every call, so a wrapper installed later is seen too.
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Collectives

__all__ = ["deepspeed_collectives"]


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    import deepspeed.comm as ds_comm

    return ds_comm.reduce_scatter_fn(output, input, **kwargs)


def _reduce_scatter_list(output: torch.Tensor, inputs: list[torch.Tensor], **kwargs: Any) -> Any:
    import deepspeed.comm as ds_comm

    return ds_comm.reduce_scatter(output, inputs, **kwargs)


def _all_to_all_single(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    import deepspeed.comm as ds_comm

    return ds_comm.all_to_all_single(output, input, **kwargs)


def deepspeed_collectives() -> Collectives:
    """flatgrad's gradient collectives issued through ``deepspeed.comm``."""
    return Collectives(
        reduce_scatter_tensor=_reduce_scatter_tensor,
        reduce_scatter_list=_reduce_scatter_list,
        all_to_all_single=_all_to_all_single,
    )
