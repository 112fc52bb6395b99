"""DeepSpeed inside a rank that ``flatgrad.testing.launch.run_ranks`` started, for the demo, benches and tests."""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["init_deepspeed", "PRELOAD"]

# Modules for the launcher's forkserver to import once when the ranks run DeepSpeed (``run_ranks(preload=...)``):
# DeepSpeed's engine imports torch._dynamo and compiles Muon's decorators on first use, ~20 s of CPU per process.
PRELOAD = [
    "torch._dynamo", "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.moe.layer", "flatgrad.deepspeed",
]  # fmt: skip


def init_deepspeed(rank: int, world_size: int, device: str) -> None:
    """DeepSpeed over the group the launcher made: accelerator, no JIT shm op, quiet logs."""
    # One node: the launcher gave rank r GPU r % device_count. DeepSpeed reads these; it finds the
    # process group already made, so MASTER_PORT is never used to connect.
    local_rank = rank % torch.cuda.device_count() if device == "cuda" else rank
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )  # fmt: skip
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)
