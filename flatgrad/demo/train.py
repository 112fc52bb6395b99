"""The body of one ``flatgrad demo`` rank: build every setup's engine, train them in turns, measure.

The engines of one ZeRO stage are alive together and take turns step by step,
the first of each step rotating, so that machine load falls on all alike.
ZeRO-2 runs first: building a ZeRO-3 engine replaces
``torch.nn.functional.linear`` for the rest of the process, which would change
the ZeRO-2 engines' backward. Before each setup's step the RNG is reseeded
from the step, so the MoE gate's random token selection is the same for all.

Per setup and step this rank measures wall times (forward, backward =
autograd + DeepSpeed's hooks + the gradient reduction + its epilogue, the
optimizer step, and the whole step), the loss, every collective call (see
``flatgrad.testing.collectives``), and memory. Rank 0 reports progress to the parent with ``send_message``.

The engines of a stage are alive together while timed, so memory is measured
afterwards, each setup built alone under a census. See [Note: demo memory] in
docs/design.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any, Iterator

import torch

from ..kernels import DTYPE_NAMES
from ..testing.census import MemoryCensus
from ..testing.collectives import CollectiveRecorder
from ..testing.deepspeed_rank import init_deepspeed
from ..testing.launch import send_message
from .setups import DENSE, SEED_MODEL, Setup, build_model, ds_config, make_batches, node_size

__all__ = ["Options", "rank_main"]

_WIDTH = 1000  # the seed model's hidden size, and the dense model's


@dataclasses.dataclass(frozen=True)
class Options:
    """What every rank needs to know (picklable).

    Attributes:
        setups: the setups, in table order.
        steps: training steps per setup.
        micro_batch: samples per rank and step.
        bucket: ``reduce_bucket_size`` in elements (flatgrad's sub-group size as well).
        dtype: ``fp32`` or ``bf16``.
        lr: AdamW's learning rate.
        seed: weights, batches and gate noise derive from it.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank).
        log_dir: each rank's stdout and stderr go to ``rank<r>.log`` here (None: inherited).
        fail_rank: this rank raises in its first step (tests the error path).
    """

    setups: tuple[Setup, ...]
    steps: int
    micro_batch: int
    bucket: int
    dtype: str
    lr: float
    seed: int
    device: str
    log_dir: str | None = None
    fail_rank: int | None = None


def _redirect_output(log_dir: str | None, rank: int) -> None:
    """Send this process's stdout/stderr (DeepSpeed's chatter) to ``log_dir/rank<r>.log``."""
    if log_dir is None:
        return
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _inject_failure(rank: int) -> None:
    raise RuntimeError(f"injected failure on rank {rank} (flatgrad demo --fail-rank {rank})")


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _engine(setup: Setup, model: torch.nn.Module, options: Options, world_size: int) -> Any:
    import deepspeed

    import flatgrad.deepspeed as flatgrad_ds

    cfg = ds_config(setup, world_size=world_size, micro_batch=options.micro_batch, bucket=options.bucket,
                    dtype=options.dtype, lr=options.lr)  # fmt: skip
    initialize = flatgrad_ds.initialize if setup.flatgrad else deepspeed.initialize
    with _simulated_nodes(node_size(setup, world_size)):
        return initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


@contextlib.contextmanager
def _simulated_nodes(local_size: int | None) -> Iterator[None]:
    """While an engine is built: tell this rank it is on a node of ``local_size`` ranks, as a launcher would.

    The demo's ranks share one machine; a two-stage setup splits them into nodes (see ``Setup.nodes``).
    """
    if local_size is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update(LOCAL_WORLD_SIZE=str(local_size), LOCAL_RANK=str(torch.distributed.get_rank() % local_size))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _zero3_model(options: Options, world_size: int, zero3: list[Setup]) -> tuple[tuple[str, dict], str | None]:
    """The model the ZeRO-3 rows train: the seed model unless DeepSpeed or flatgrad refuses it (and why)."""
    setup = next((s for s in zero3 if s.flatgrad), zero3[0])
    try:
        engine = _engine(setup, build_model(SEED_MODEL, options.seed), options, world_size)
    except Exception as exc:  # noqa: BLE001 - the refusal is the answer; its text goes into the report
        return DENSE, f"{type(exc).__name__}: {exc}".splitlines()[0]
    engine.destroy()
    return SEED_MODEL, None


def _step(engine: Any, batch: tuple[torch.Tensor, torch.Tensor], recorder: CollectiveRecorder, device: str,
          dtype: torch.dtype) -> dict:  # fmt: skip
    """One training step with wall times; the loss stays a tensor (no host sync here)."""
    x, y = (t.to(engine.device, dtype) for t in batch)
    _synchronize(device)
    recorder.phase = "forward"
    t0 = time.perf_counter()
    loss = engine(x, y)
    _synchronize(device)
    t1 = time.perf_counter()
    recorder.phase = "backward"
    engine.backward(loss)
    _synchronize(device)
    t2 = time.perf_counter()
    recorder.phase = "step"
    engine.step()
    _synchronize(device)
    t3 = time.perf_counter()
    recorder.phase = "other"
    times = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0}
    return {"loss": loss.detach().float(), **times, "calls": recorder.take()}


def _memory(setup: Setup, model: tuple[str, dict], options: Options, world_size: int, batches: list,
            dtype: torch.dtype) -> dict:  # fmt: skip
    """The setup built alone and trained two steps under a census. See [Note: demo memory]."""
    gc.collect()  # what earlier engines left in reference cycles is not this setup's
    with MemoryCensus(options.device) as census:
        engine = _engine(setup, build_model(model, options.seed), options, world_size)
        for x, y in batches[:2]:
            torch.manual_seed(options.seed)
            engine.backward(engine(x.to(engine.device, dtype), y.to(engine.device, dtype)))
            engine.step()
        census.mark("after two steps")
    engine.destroy()
    return {"peak_bytes": census.peak, "held_bytes": census.at("after two steps")}


def _describe(setup: Setup, engine: Any, model_name: str) -> dict:
    """Static facts of an engine: parameters, optimizer groups, flatgrad's buckets."""
    opt = engine.optimizer
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    info: dict[str, Any] = {
        "model": model_name,
        "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainable),  # ZeRO-3: full size
    }
    if setup.stage == 2:
        info["param_groups"] = len(opt.bit16_groups)
        reduction = getattr(opt, "flatgrad", None)
        if reduction is not None:
            info["sub_groups"] = len(opt.bit16_groups)
            info["sub_groups_multi_rank"] = sum(len(r.buckets) for r in reduction.reducers if r.world_size > 1)
    elif setup.flatgrad:
        info["bucket_plans"] = len(opt.flatgrad.compositions)
    return info


def rank_main(rank: int, world_size: int, options: Options) -> dict:
    """Train every setup of ``options`` on this rank; the measurements, by setup key."""
    _redirect_output(options.log_dir, rank)
    init_deepspeed(rank, world_size, options.device)
    dtype = DTYPE_NAMES[options.dtype]
    progress = send_message if rank == 0 else (lambda payload: None)
    batches = make_batches(rank, options.steps, options.micro_batch, _WIDTH, options.seed)
    recorder = CollectiveRecorder().install()
    out: dict[str, Any] = {"setups": {}, "zero3_refusal": None}
    first = True
    try:
        for stage in (2, 3):
            setups = [s for s in options.setups if s.stage == stage]
            if not setups:
                continue
            model = SEED_MODEL
            if stage == 3:
                progress(("phase", "probing ZeRO-3 with the seed MoE model"))
                model, out["zero3_refusal"] = _zero3_model(options, world_size, setups)
            engines = {}
            for setup in setups:
                progress(("phase", f"building {setup.label}"))
                engines[setup.key] = _engine(setup, build_model(model, options.seed), options, world_size)
                out["setups"][setup.key] = {"info": _describe(setup, engines[setup.key], model[0]), "steps": []}
                progress(("built", setup.key))
            recorder.take()  # the engines' construction: not part of any step
            for step in range(options.steps):
                progress(("phase", f"ZeRO-{stage} step {step + 1}/{options.steps}"))
                order = setups[step % len(setups):] + setups[: step % len(setups)]
                for setup in order:
                    torch.manual_seed(options.seed + 7919 * (step + 1))  # the same gate noise for every setup
                    if first and options.fail_rank == rank:
                        _inject_failure(rank)
                    first = False
                    record = _step(engines[setup.key], batches[step], recorder, options.device, dtype)
                    out["setups"][setup.key]["steps"].append(record)
                    progress(("stepped", setup.key))
            for setup in setups:
                if setup.stage == 3 and setup.flatgrad:  # plans are made during the first backward
                    out["setups"][setup.key]["info"].update(_describe(setup, engines[setup.key], model[0]))
                engines[setup.key].destroy()
            engines.clear()
            for setup in setups:
                progress(("phase", f"memory of {setup.label}, built alone"))
                out["setups"][setup.key]["memory"] = _memory(setup, model, options, world_size, batches, dtype)
            recorder.take()
    finally:
        recorder.uninstall()
    for entry in out["setups"].values():  # one host sync for all losses
        losses = torch.stack([r.pop("loss") for r in entry["steps"]]).cpu().tolist() if entry["steps"] else []
        for r, loss in zip(entry["steps"], losses):
            r["loss"] = loss
            r["calls"] = [tuple(c) for c in r["calls"]]
    return out
