"""Shared helpers for the DeepSpeed integration tests: launching real ranks, models, configs, training.

Every multi-rank test spawns real processes that join a gloo group on
127.0.0.1 and run real DeepSpeed with ``DS_ACCELERATOR=cpu``. A rank function
is a module-level function ``fn(rank, world_size, *args)``; its return value
(anything picklable, tensors on CPU) comes back to the test, one per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable

import torch

from flatgrad.testing.collectives import CollectiveRecorder
from flatgrad.testing.deepspeed_rank import PRELOAD as DEEPSPEED_PRELOAD
from flatgrad.testing.deepspeed_rank import init_deepspeed
from flatgrad.testing.launch import PRELOAD, run_ranks

__all__ = [
    "MLP",
    "COUNTED",
    "SeedMoE",
    "as_nodes",
    "count_collectives",
    "ds_config",
    "launch",
    "make_batches",
    "train",
    "train_save_resume",
    "zero3_master",
]


# --------------------------------------------------------------------------- launching

# The ranks fork from one forkserver: DeepSpeed imported there once is paid once per session.
for _name in DEEPSPEED_PRELOAD:
    if _name not in PRELOAD:
        PRELOAD.append(_name)


def _ds_rank(rank: int, world_size: int, fn: Callable, args: tuple) -> Any:
    """A rank's DeepSpeed setup (CPU accelerator, no shm op, ``deepspeed.comm`` over the group), then ``fn``."""
    init_deepspeed(rank, world_size, "cpu")
    import deepspeed

    # DeepSpeed refuses fp16 on the CPU accelerator unless oneDNN has fp16 kernels; torch's CPU
    # kernels compute fp16 correctly (slowly), which is all these tests need to exercise loss scaling.
    accelerator = deepspeed.accelerator.get_accelerator()
    accelerator.is_fp16_supported = lambda: True
    return fn(rank, world_size, *args)


def launch(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` with DeepSpeed on ``world_size`` real gloo ranks; results by rank."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return run_ranks(
        _ds_rank, world_size, fn, args, timeout=timeout, pg_timeout=timedelta(seconds=max(60.0, timeout))
    )


# --------------------------------------------------------------------------- configs


def ds_config(
    stage: int = 2,
    *,
    gas: int = 1,
    micro_batch: int = 2,
    world_size: int = 2,
    bucket: int = 1000,
    clip: float = 0.0,
    dtype: str = "fp32",
    lr: float = 1e-2,
    optimizer: bool = True,
    flatgrad: dict | None = None,
    **zero: Any,
) -> dict:
    """A small DeepSpeed config for CPU tests (torch Adam from the config unless ``optimizer=False``)."""
    cfg: dict = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro_batch * gas * world_size,
        "steps_per_print": 10**9,
        "gradient_clipping": clip,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": 10**8, **zero},
    }
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    if flatgrad is not None:
        cfg["flatgrad"] = flatgrad
    return cfg


# --------------------------------------------------------------------------- models


class MLP(torch.nn.Module):
    """A small MLP with odd-sized parameters so that partitions straddle parameters.

    ``unused=True`` adds a parameter that never gets a gradient; ``frozen=True``
    freezes the first layer.
    """

    def __init__(
        self,
        d_in: int = 13,
        hidden: int = 37,
        d_out: int = 5,
        layers: int = 3,
        unused: bool = False,
        frozen: bool = False,
    ):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.scale = torch.nn.Parameter(torch.ones(d_out))
        if unused:
            self.unused = torch.nn.Linear(7, 3)
        if frozen:
            for p in self.layers[0].parameters():
                p.requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return torch.nn.functional.mse_loss(x * self.scale, y)


class SeedMoE(torch.nn.Module):
    """The model of the ZeRO-2 seed thread (docs/design.md "The seed model"), optionally scaled down.

    ``hidden=1000, num_experts=16, ep_size=4`` is the thread's model: 10,026,000
    trainable parameters per rank.
    """

    def __init__(self, hidden: int = 1000, num_experts: int = 16, ep_size: int = 4):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.fc1 = torch.nn.Linear(hidden, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)

        class SimpleExpert(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = torch.nn.Linear(hidden, hidden)
                self.fc2 = torch.nn.Linear(hidden, hidden)

            def forward(self, x):
                return self.fc2(torch.relu(self.fc1(x)))

        self.moe = MoE(hidden_size=hidden, expert=SimpleExpert(), num_experts=num_experts, ep_size=ep_size, k=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        out, aux, _ = self.moe(h)
        return torch.nn.functional.mse_loss(out, y) + 0.01 * aux


def make_batches(
    rank: int, n: int, micro_batch: int, d_in: int, d_out: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` deterministic micro-batches, different on every rank."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    return [
        (torch.randn(micro_batch, d_in, generator=g), torch.randn(micro_batch, d_out, generator=g)) for _ in range(n)
    ]


def train(
    engine,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype | None = None,
    backward_counter: CollectiveRecorder | None = None,
) -> list[float]:
    """One forward/backward/step per micro-batch; returns the losses (floats).

    ``backward_counter`` counts the collectives of the backward passes only.
    """
    losses = []
    for x, y in batches:
        if dtype is not None:
            x, y = x.to(dtype), y.to(dtype)
        loss = engine(x, y)
        if backward_counter is None:
            engine.backward(loss)
        else:
            with backward_counter:
                engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


def params_of(engine) -> dict[str, torch.Tensor]:
    """The engine's module parameters, detached fp32 copies by name."""
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


# --------------------------------------------------------------------------- counting collectives


# The entry points the DeepSpeed tests count, at deepspeed.comm and torch.distributed.
COUNTED = (
    "reduce_scatter", "reduce_scatter_tensor", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "all_to_all_single", "broadcast", "all_reduce_coalesced",
)  # fmt: skip


def count_collectives(extra: Sequence[str] = ()) -> CollectiveRecorder:
    """A recorder of the ``COUNTED`` collectives (and ``extra``) DeepSpeed and flatgrad call in this rank process."""
    return CollectiveRecorder(COUNTED + tuple(extra))


# --------------------------------------------------------------------------- reads of the gradient partitions


class PartitionReads(torch.overrides.TorchFunctionMode):
    """Records the torch ops that touch any of the given tensors' storages (a real run, only observed)."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tensors}
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages for a in flat):
            self.ops.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


# The ops of a norm or an overflow check: the step must run none of them on the partitions.
REDUCTIONS = (
    "norm", "vector_norm", "linalg_vector_norm", "_foreach_norm",
    "isinf", "isnan", "isfinite", "sum", "abs", "max", "amax",
)  # fmt: skip


# --------------------------------------------------------------------------- nodes and checkpoints


def as_nodes(rank: int, node_size: int) -> None:
    """What a launcher on nodes of ``node_size`` ranks tells each rank (the ranks here share one machine)."""
    os.environ.update(LOCAL_WORLD_SIZE=str(node_size), LOCAL_RANK=str(rank % node_size))


def train_save_resume(cfg: dict, batches: list, path: str, at: int = 8) -> tuple:
    """Train ``at`` micro-steps from seed 0, save, train the rest; a second engine (other initial weights) loads the
    checkpoint. Returns (engine, losses before the save, losses after it, the resumed engine, not trained yet)."""
    import deepspeed.comm as ds_dist

    import flatgrad.deepspeed as fds

    torch.manual_seed(0)
    engine, *_ = fds.initialize(model=MLP(), config=cfg)
    losses = train(engine, batches[:at])
    engine.save_checkpoint(path, tag="t")
    continued = train(engine, batches[at:])
    ds_dist.barrier()
    torch.manual_seed(1)  # other initial weights: all must come from the checkpoint
    resumed, *_ = fds.initialize(model=MLP(), config=cfg)
    resumed.load_checkpoint(path, tag="t")
    return engine, losses, continued, resumed


def zero3_master(engine, rank: int) -> list[torch.Tensor]:
    """This rank's fp32 master partitions, their real data only: the padding after a parameter's last element is
    uninitialized (ZeRO-3 keeps no full parameters between steps)."""
    opt, out = engine.optimizer, []
    for group, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat):
        offset = 0
        for p in group:
            c = p.partition_numel()
            out.append(flat.narrow(0, offset, max(0, min(c, p.ds_numel - rank * c))).detach().clone())
            offset += c
    return out
