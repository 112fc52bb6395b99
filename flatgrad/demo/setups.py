"""What ``flatgrad demo`` trains: the setups (stock or flatgrad, ZeRO-2 or ZeRO-3), their configs and models.

Every setup trains the same model from the same seed on the same batches;
only the gradient reduction differs. The ``exact`` and ``int8`` rows are
flatgrad ZeRO-2 with that reduction mode (all_to_all instead of
reduce_scatter; ``int8`` with error feedback); the ``offload`` rows offload the
optimizer to the CPU (pinned host partitions, torch's AdamW there), stock's
offload against flatgrad's. Models come from ``flatgrad.planner.models``,
reduce_scatter; ``int8`` with error feedback). The ``2d_reduce_scatter`` and
``hier_int8`` rows split the ranks into two nodes (``nodes``; simulated: the
ranks share one machine, the node and rail process groups are real; see
[Note: two-stage reductions] in docs/design.md). Models come from ``flatgrad.planner.models``,
the definitions ``flatgrad plan`` schedules:

* ZeRO-2: ``seed-moe``, the seed thread's model (docs/design.md "The seed model"):
  10,026,000 trainable parameters per rank, 16 experts, ``ep_size=4``.
* ZeRO-3: DeepSpeed 0.19 refuses its native MoE under ZeRO-3 ("Native
  DeepSpeed MoE is not supported with ZeRO Stage 3"), and flatgrad's ZeRO-3
  backend refuses AutoEP, its only MoE there. The ZeRO-3 rows first try the
  seed model; when it is refused they train ``DENSE``, the seed model's dense
  shapes (``fc1``, ``fc2`` and one expert's ``fc1``/``fc2``: four 1000x1000
  ``Linear`` layers, 4,005,000 parameters), and the report says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["Setup", "SETUPS", "SEED_MODEL", "DENSE", "by_key", "ds_config", "build_model", "make_batches", "node_size"]


@dataclasses.dataclass(frozen=True)
class Setup:
    """One row of the demo.

    Attributes:
        key: identifier for ``--setups``, JSON and charts.
        label: the row's name in the table.
        stage: the ZeRO stage.
        flatgrad: through ``flatgrad.deepspeed.initialize`` (else stock ``deepspeed.initialize``).
        multi_rank_allreduce: stock ZeRO-2's ``use_multi_rank_bucket_allreduce`` (None: not ZeRO-2 stock).
        reference: the key of the setup whose losses this one is compared with.
        options: the ``"flatgrad"`` config section of a flatgrad setup, as ``(key, value)`` pairs
            (the reduction mode; see [Note: reduction modes] in docs/design.md).
        offload: ``offload_optimizer: {device: cpu, pin_memory: true}`` (ZeRO-Offload).
        nodes: a two-stage setup's number of (simulated) nodes: ``node_size`` is the world size over it,
            and the ranks are told so as a launcher on such nodes would (None: one node).
    """

    key: str
    label: str
    stage: int
    flatgrad: bool
    multi_rank_allreduce: bool | None
    reference: str
    options: tuple[tuple[str, Any], ...] = ()
    offload: bool = False
    nodes: int | None = None


SETUPS: tuple[Setup, ...] = (
    Setup("stock_zero2", "stock ZeRO-2", 2, False, True, "stock_zero2"),
    Setup("stock_zero2_reduce", "stock ZeRO-2, reduce mode", 2, False, False, "stock_zero2"),
    Setup("flatgrad_zero2", "flatgrad ZeRO-2", 2, True, None, "stock_zero2"),
    Setup("flatgrad_zero2_exact", "flatgrad ZeRO-2, exact", 2, True, None, "stock_zero2", (("reduction", "exact"),)),
    Setup("flatgrad_zero2_int8", "flatgrad ZeRO-2, int8 + error feedback", 2, True, None, "stock_zero2",
          (("reduction", "int8"), ("error_feedback", True))),  # fmt: skip
    Setup("flatgrad_zero2_2d", "flatgrad ZeRO-2, 2d_reduce_scatter, 2 nodes", 2, True, None, "stock_zero2",
          (("reduction", "2d_reduce_scatter"),), nodes=2),  # fmt: skip
    Setup("flatgrad_zero2_hier_int8", "flatgrad ZeRO-2, hier_int8, 2 nodes", 2, True, None, "stock_zero2",
          (("reduction", "hier_int8"),), nodes=2),  # fmt: skip
    Setup("stock_zero2_offload", "stock ZeRO-2, CPU offload", 2, False, True, "stock_zero2_offload", offload=True),
    Setup("flatgrad_zero2_offload", "flatgrad ZeRO-2, CPU offload", 2, True, None, "stock_zero2_offload",
          offload=True),  # fmt: skip
    Setup("stock_zero3", "stock ZeRO-3", 3, False, None, "stock_zero3"),
    Setup("flatgrad_zero3", "flatgrad ZeRO-3", 3, True, None, "stock_zero3"),
)

# (name in flatgrad.planner.models.MODELS, factory keyword arguments)
SEED_MODEL: tuple[str, dict[str, Any]] = ("seed-moe", {})
DENSE: tuple[str, dict[str, Any]] = ("mlp", dict(d_in=1000, hidden=1000, d_out=1000, layers=4))


def by_key(keys: list[str] | tuple[str, ...]) -> tuple[Setup, ...]:
    """The setups named by ``keys``, in table order, each reference included; raises naming an unknown key."""
    known = {s.key: s for s in SETUPS}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"--setups: unknown setup(s) {unknown}; known: {list(known)}")
    wanted = set(keys) | {known[k].reference for k in keys}
    return tuple(s for s in SETUPS if s.key in wanted)


def ds_config(setup: Setup, *, world_size: int, micro_batch: int, bucket: int, dtype: str, lr: float) -> dict:
    """The DeepSpeed config of ``setup`` (with a ``"flatgrad"`` section for flatgrad's setups)."""
    zero: dict[str, Any] = {"stage": setup.stage, "reduce_bucket_size": bucket}
    if setup.stage == 2:
        zero["allgather_bucket_size"] = max(bucket, 10**8)
        if setup.multi_rank_allreduce is not None:
            zero["use_multi_rank_bucket_allreduce"] = setup.multi_rank_allreduce
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
    }
    if setup.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host partitions, as the other rows
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype != "fp32":
        raise ValueError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if setup.flatgrad:
        cfg["flatgrad"] = dict(setup.options)
        if setup.nodes is not None:
            cfg["flatgrad"]["node_size"] = node_size(setup, world_size)
    return cfg


def node_size(setup: Setup, world_size: int) -> int | None:
    """Ranks per node of a two-stage setup (None: one node)."""
    if setup.nodes is None:
        return None
    if world_size % setup.nodes:
        raise ValueError(f"setup {setup.key!r} splits the ranks into {setup.nodes} nodes; world size {world_size} does not")
    return world_size // setup.nodes


def build_model(model: tuple[str, dict[str, Any]], seed: int) -> torch.nn.Module:
    """``model`` built on the CPU from ``seed`` (every setup starts from the same weights)."""
    from ..planner import models

    name, kwargs = model
    torch.manual_seed(seed)
    return models.build(name, "cpu", **kwargs)


def make_batches(
    rank: int, steps: int, micro_batch: int, width: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(x, y)`` batch of ``micro_batch x width`` per step, different on every rank, the same for every setup."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return [
        (torch.randn(micro_batch, width, generator=generator), torch.randn(micro_batch, width, generator=generator))
        for _ in range(steps)
    ]
