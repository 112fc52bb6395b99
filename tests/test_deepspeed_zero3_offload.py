"""flatgrad's ZeRO-3 backend with CPU optimizer offload against stock DeepSpeed's offload (real DeepSpeed, CPU, gloo).

Every rank function trains stock and flatgrad from the same seed in the same
process. With torch's AdamW the comparison is bitwise, clipping included: the
offload path keeps stock's cast, accumulation and per-parameter norms (see
[Note: ZeRO-3 optimizer offload] in docs/design.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from flatgrad import kernels
from _ds import MLP, count_collectives, ds_config, launch, make_batches
from test_deepspeed_zero3 import (
    _ZERO3_EXTRA,
    _assert_bitwise,
    _by_kind,
    _deserialized,
    _flatgrad_ran,
    _serialized,
    _state,
)

D_IN, HIDDEN, D_OUT = 13, 37, 5
MICRO_BATCH = 2
STEPS = 4


def _offload(pin: bool = True) -> dict:
    return {"offload_optimizer": {"device": "cpu", "pin_memory": pin}}


# Several buckets per backward, a parameter larger than a bucket, parameters that leave some ranks without data.
BASE = {"bucket": 1000, "stage3_param_persistence_threshold": 0}
# torch's AdamW under offload: DeepSpeed would otherwise force its DeepSpeedCPUAdam.
TORCH_ADAM = {"zero_force_ds_cpu_optimizer": False}


def _engine(rank: int, world_size: int, flat: bool, *, gas: int, clip: float = 0.0, cpu_adam: bool = False,
            top: dict | None = None, stage: bool = False, backend: str | None = None, flatgrad: dict | None = None,
            **zero):
    """A ZeRO-3 engine over the seeded MLP: stock ``deepspeed.initialize`` or ``flatgrad.deepspeed.initialize``."""
    import deepspeed

    from flatgrad import deepspeed as flatgrad_ds

    torch.manual_seed(0)
    model = MLP(D_IN, HIDDEN, D_OUT)
    cfg = ds_config(3, gas=gas, micro_batch=MICRO_BATCH, world_size=world_size, clip=clip, **zero)
    if cpu_adam:
        cfg["optimizer"]["params"].pop("torch_adam")
    else:
        cfg.update(TORCH_ADAM)
    cfg.update(top or {})
    initialize = deepspeed.initialize
    if flat:
        cfg["flatgrad"] = {**({"backend": backend} if backend else {}), **(flatgrad or {})}
        initialize = flatgrad_ds.initialize
    engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    if flat and stage:
        engine.optimizer.flatgrad.offload.always_stage = True  # the accelerator's staged transfer, on the host
    return engine


def _fp32_grads(engine) -> list[torch.Tensor]:
    return [g.grad.detach().clone() for g in engine.optimizer.fp32_partitioned_groups_flat]


def _train(engine, batches) -> dict:
    """Forward/backward/step per micro-batch: losses, the host fp32 gradients at every boundary, the counts."""
    losses, grads, transfers, copies = [], [], [], []
    reduction = getattr(engine.optimizer, "flatgrad", None)
    offload = reduction.offload if reduction is not None else None
    dtype = next(engine.module.parameters()).dtype
    for x, y in batches:
        loss = engine(x.to(dtype), y.to(dtype))
        before = (offload.host_transfers, offload.fp32_copies) if offload is not None else (0, 0)
        engine.backward(loss)
        if offload is not None:
            transfers.append(offload.host_transfers - before[0])
            copies.append(offload.fp32_copies - before[1])
        if engine.is_gradient_accumulation_boundary():
            grads.append(_fp32_grads(engine))
        engine.step()
        losses.append(float(loss.detach().float()))
    return {"losses": losses, "fp32_grads": grads, "transfers": transfers, "fp32_copies": copies}


def _trajectory(rank: int, world_size: int, flat: bool, gas: int, options: dict) -> dict:
    engine = _engine(rank, world_size, flat, gas=gas, **options)
    out = _train(engine, make_batches(rank, STEPS * gas, MICRO_BATCH, D_IN, D_OUT))
    out.update(_state(engine, rank))
    out["plans"] = _flatgrad_ran(engine)
    out["optimizer"] = type(engine.optimizer.optimizer).__name__
    out["accum"] = str(engine.optimizer.grad_partitions_flat_buffer.dtype)
    if flat:
        reduction = engine.optimizer.flatgrad
        out["describe"] = reduction.describe()
        # Buckets holding data on this rank: the most host transfers one backward may make.
        out["buckets"] = sum(1 for c in reduction.compositions.values() if c.ds_ids)
        out["staged"] = bool(reduction.offload.staging_buffers)
        plans = [c.bucket for c in reduction.compositions.values() if c.bucket.unpack_plan is not None]
        out["kernels"] = sorted({(b.pack_plan.backend, b.unpack_plan.backend) for b in plans})
    engine.destroy()
    return out


def _stock_vs_flat(rank: int, world_size: int, gas: int, options: dict) -> bytes:
    return _serialized({
        "stock": _trajectory(rank, world_size, False, gas, options),
        "flat": _trajectory(rank, world_size, True, gas, options),
    })


def _compare(results: list[dict], gas: int, stage: bool = False) -> None:
    """flatgrad ran, moved at most one segment per bucket per micro-step, and matched stock bit for bit."""
    for rank, r in enumerate(results):
        stock, flat = dict(r["stock"]), dict(r["flat"])
        assert stock.pop("plans") == 0 and flat.pop("plans") > 0, f"rank {rank}: flatgrad's path did not run"
        assert "CPU optimizer offload served" in flat.pop("describe")
        buckets = flat.pop("buckets")
        assert flat.pop("staged") == stage, f"rank {rank}: the staging buffers were used: {not stage}"
        flat.pop("kernels")
        transfers, copies = flat.pop("transfers"), flat.pop("fp32_copies")
        assert all(0 < t <= buckets for t in transfers), (rank, transfers, buckets)
        # The boundary's host copies: one per run of partitions, never more than one per parameter.
        n_params = len(stock["params"])
        for step, c in enumerate(copies):
            at_boundary = (step + 1) % gas == 0
            assert (0 < c <= n_params) if at_boundary else c == 0, (rank, step, copies)
        for key in ("transfers", "fp32_copies"):
            stock.pop(key)
        _assert_bitwise(stock, flat, f"rank {rank}")
    losses = results[0]["stock"]["losses"]
    assert losses[0] != losses[-1], "the runs did not train"
    assert any(g.count_nonzero() for g in results[0]["stock"]["fp32_grads"][-1]), "every gradient is zero"


# --------------------------------------------------------------------------- equivalence with torch's AdamW


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world_size,gas,clip,pin,stage",
    [(2, 1, 0.0, True, False), (2, 2, 0.05, False, False), (4, 1, 0.05, True, False), (4, 2, 0.0, True, False),
     (4, 2, 0.05, False, False), (2, 2, 0.05, True, True), (4, 2, 0.0, False, True)],
    ids=lambda v: str(v),
)
def test_offload_bitwise_equal_to_stock_offload(world_size: int, gas: int, clip: float, pin: bool, stage: bool) -> None:
    """fp32, torch's AdamW on the host: losses, host fp32 gradients, final params and masters bitwise stock's.
    ``stage``: the segment goes through the pinned staging buffers and is unpacked later, as on an accelerator."""
    options = {**BASE, **_offload(pin), "clip": clip, "stage": stage}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, world_size, gas, options, timeout=280)]
    for r in results:
        assert r["stock"]["optimizer"] == r["flat"]["optimizer"] == "AdamW"
    _compare(results, gas, stage)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_staged_segment_is_unpacked_by_host_kernels_whatever_backend_is_forced() -> None:
    """``"flatgrad": {"backend": "triton"}`` with the staged transfer: the packs run Triton's kernels on the
    bucket's device, the host-side unpack of every staged segment takes the host's own (``cpu``), as on a GPU
    with ``backend: cuda`` or ``triton``, where those cannot run on host tensors; bitwise stock's."""
    if not kernels.available_backends()["triton"].available:
        pytest.skip("needs Triton (its interpreter runs the pack on CPU tensors)")
    options = {**BASE, **_offload(True), "clip": 0.05, "stage": True, "backend": "triton"}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, 2, 2, options, timeout=280)]
    for rank, r in enumerate(results):
        assert r["flat"]["kernels"] == [("triton", kernels.host_backend("triton"))] == [("triton", "cpu")], rank
    _compare(results, 2, stage=True)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_deprecated_cpu_offload_key_is_served() -> None:
    """``zero_optimization.cpu_offload: true``, which DeepSpeed reads as CPU optimizer offload: served, bitwise."""
    options = {**BASE, "cpu_offload": True, "clip": 0.05}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, 2, 2, options, timeout=280)]
    _compare(results, 2)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("accum", ["fp32", "bf16"])
def test_offload_bf16_bitwise_equal_to_stock_offload(accum: str) -> None:
    """bf16 training, fp32 or bf16 host grad partitions (cast to the fp32 gradient at the boundary), clipped."""
    options = {**BASE, **_offload(True), "clip": 0.05, "dtype": "bf16",
               "top": {"data_types": {"grad_accum_dtype": accum}}}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, 2, 2, options, timeout=280)]
    for r in results:
        assert r["flat"]["accum"] == str({"fp32": torch.float32, "bf16": torch.bfloat16}[accum])
    _compare(results, 2)


# --------------------------------------------------------------------------- DeepSpeedCPUAdam, parameter offload


@pytest.mark.multiproc
@pytest.mark.timeout(600)
@pytest.mark.parametrize("gas,clip", [(2, 0.05)])
def test_offload_with_deepspeed_cpu_adam_bitwise(gas: int, clip: float) -> None:
    """DeepSpeed's default under offload (``"type": "AdamW"``: DeepSpeedCPUAdam, JIT-built): the host fp32
    gradients it steps on are bitwise stock's, and its kernel is elementwise over the same buffers, so the
    training is bitwise stock's."""
    options = {**BASE, **_offload(True), "clip": clip, "cpu_adam": True}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, 2, gas, options, timeout=580)]
    for r in results:
        assert r["stock"]["optimizer"] == r["flat"]["optimizer"] == "DeepSpeedCPUAdam"
    _compare(results, gas)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,pin", [(2, False), (4, True)])
def test_offload_param_with_optimizer_offload_bitwise(world_size: int, pin: bool) -> None:
    """The HF docs' ZeRO-3 shape: parameters and optimizer both offloaded to the CPU; bitwise stock's."""
    options = {**BASE, **_offload(pin), "offload_param": {"device": "cpu", "pin_memory": pin}, "clip": 0.05}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, world_size, 2, options, timeout=280)]
    _compare(results, 2)


# --------------------------------------------------------------------------- counted: collectives and host writes


def _counts(rank: int, world_size: int, gas: int, options: dict) -> dict:
    """Per backward, for stock and flatgrad: the collectives, and the writes into the host grad partitions and
    fp32 gradients (torch's copy_/add_, and flatgrad's unpacks: each the transfer of one bucket's segment)."""
    from flatgrad.testing.host_writes import HostWrites

    out = {}
    for flat in (False, True):
        engine = _engine(rank, world_size, flat, gas=gas, **options)
        opt = engine.optimizer
        host = [opt.grad_partitions_flat_buffer] + [g.grad for g in opt.fp32_partitioned_groups_flat]
        steps = []
        for x, y in make_batches(rank, STEPS * gas, MICRO_BATCH, D_IN, D_OUT):
            loss = engine(x, y)
            with HostWrites(host) as writes, count_collectives(_ZERO3_EXTRA) as counter:
                engine.backward(loss)
            steps.append({
                "collectives": _by_kind(counter),
                "writes": writes.torch_writes,
                "unpacks": writes.unpacks,
                "boundary": engine.is_gradient_accumulation_boundary(),
            })  # fmt: skip
            engine.step()
        out[flat] = {"steps": steps, "params": sum(1 for p in engine.module.parameters() if _has_data(p, rank))}
        engine.destroy()
    return out


def _has_data(param, rank: int) -> bool:
    return param.partition_numel() * rank < param.ds_numel


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_reduce_scatter_and_one_host_transfer_per_bucket(world_size: int) -> None:
    """Per backward: stock's reduce_scatters (one per bucket); one write of each bucket's segment into host memory
    where stock writes every parameter's partition (and adds to it); at the boundary fewer host copies into the
    fp32 gradients than stock's one per parameter."""
    gas = 2
    for rank, r in enumerate(launch(_counts, world_size, gas, {**BASE, **_offload(True)}, timeout=280)):
        stock, flat = r[False], r[True]
        n_params = stock["params"]
        for k, (s, f) in enumerate(zip(stock["steps"], flat["steps"])):
            rs = s["collectives"]["reduce_scatter_tensor"]
            assert f["collectives"]["reduce_scatter_tensor"] == rs and len(rs) == 3, (rank, k, rs)
            assert f["collectives"] == s["collectives"], (rank, k)
            assert s["unpacks"] == 0 and 0 < f["unpacks"] <= len(rs), (rank, k, f["unpacks"])
            # Stock: per parameter a copy (micro-step 0) or an add; at the boundary one more copy, into fp32.
            assert s["writes"] == n_params * (1 + s["boundary"]), (rank, k, s["writes"])
            # flatgrad's torch writes are only the boundary's copies into the fp32 gradients, one per run.
            assert (0 < f["writes"] < n_params) if f["boundary"] else f["writes"] == 0, (rank, k, f["writes"])


# --------------------------------------------------------------------------- checkpoints


def _checkpoints(rank: int, world_size: int, root: str) -> bytes:
    """Under flatgrad offload: save after 2 steps, continue; a fresh flatgrad engine (and a stock one) loads the
    checkpoint and continues the same; then the final checkpoint through DeepSpeed's zero_to_fp32."""
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    gas = 2
    options = {**BASE, **_offload(True), "clip": 0.05}
    batches = make_batches(rank, STEPS * gas, MICRO_BATCH, D_IN, D_OUT)
    head, tail = batches[: 2 * gas], batches[2 * gas :]

    def run(engine, batches) -> dict:
        out = _train(engine, batches)
        out.update(_state(engine, rank))
        return {k: out[k] for k in ("losses", "fp32_grads", "params", "master")}

    engine = _engine(rank, world_size, True, gas=gas, **options)
    _train(engine, head)
    engine.save_checkpoint(root, tag="step2")
    out = {"continued": run(engine, tail)}
    engine.destroy()
    for flat in (True, False):
        loader = _engine(rank, world_size, flat, gas=gas, **options)
        loader.load_checkpoint(root, tag="step2")
        out["flat" if flat else "stock"] = run(loader, tail)
        if flat:
            out["plans"] = _flatgrad_ran(loader)
            loader.save_checkpoint(root, tag="final")
            with deepspeed.zero.GatheredParameters(list(loader.module.parameters())):
                live = {n: p.detach().clone() for n, p in loader.module.named_parameters()}
            torch.distributed.barrier()
            converted = get_fp32_state_dict_from_zero_checkpoint(root, tag="final") if rank == 0 else None
            out["zero_to_fp32"] = {"live": live, "converted": converted}
        loader.destroy()
    return _serialized(out)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_offload_checkpoints_resume_and_convert(tmp_path) -> None:
    """A checkpoint saved under flatgrad offload resumes under flatgrad offload (and stock's) bitwise as the run
    that kept going; zero_to_fp32 of flatgrad's final checkpoint is the live parameters."""
    results = [_deserialized(r) for r in launch(_checkpoints, 2, str(tmp_path), timeout=280)]
    for rank, r in enumerate(results):
        assert r["plans"] > 0
        _assert_bitwise(r["continued"], r["flat"], f"rank {rank} flat resume")
        _assert_bitwise(r["continued"], r["stock"], f"rank {rank} stock resume")
    z = results[0]["zero_to_fp32"]
    assert z["converted"].keys() == z["live"].keys()
    for name, live in z["live"].items():
        _assert_bitwise(z["converted"][name].reshape(live.shape), live, f"zero_to_fp32 {name}")


# --------------------------------------------------------------------------- the patch: engaged, or passed through


def _patched(rank: int, world_size: int) -> bytes:
    """Under ``patch()``: CPU optimizer offload engages flatgrad; partial offload passes to stock, with one warning."""
    import logging

    import deepspeed

    from flatgrad import deepspeed as flatgrad_ds

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("flatgrad.deepspeed")
    logger.addHandler(handler)
    out = {}
    cases = {
        "served": {**BASE, **_offload(False)},
        "partial": {**BASE, "offload_optimizer": {"device": "cpu", "ratio": 0.5}, "cpu_adam": True},
    }
    try:
        for name, options in cases.items():
            del records[:]
            gas = 2
            torch.manual_seed(0)
            model = MLP(D_IN, HIDDEN, D_OUT)
            batches = make_batches(rank, STEPS * gas, MICRO_BATCH, D_IN, D_OUT)
            stock = _engine(rank, world_size, False, gas=gas, **options)
            expected = _train(stock, batches)["losses"] + [_state(stock, rank)]
            stock.destroy()
            cfg = ds_config(3, gas=gas, micro_batch=MICRO_BATCH, world_size=world_size,
                            **{k: v for k, v in options.items() if k != "cpu_adam"})
            if options.get("cpu_adam"):
                cfg["optimizer"]["params"].pop("torch_adam")
            else:
                cfg.update(TORCH_ADAM)
            cfg["flatgrad"] = {}
            flatgrad_ds.patch()
            try:
                engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
            finally:
                flatgrad_ds.unpatch()
            got = _train(engine, batches)["losses"] + [_state(engine, rank)]
            out[name] = {"expected": expected, "got": got, "plans": _flatgrad_ran(engine), "records": list(records)}
            engine.destroy()
    finally:
        logger.removeHandler(handler)
    return _serialized(out)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_patch_engages_offload_and_passes_partial_offload_through() -> None:
    for rank, r in enumerate(_deserialized(x) for x in launch(_patched, 2, timeout=280)):
        served, partial = r["served"], r["partial"]
        assert served["plans"] > 0 and not [m for m in served["records"] if "stock DeepSpeed" in m], served["records"]
        _assert_bitwise(served["expected"], served["got"], f"rank {rank} served")
        assert partial["plans"] == 0
        warned = [m for m in partial["records"] if "stock DeepSpeed" in m]
        assert len(warned) == 1 and "zero_optimization.offload_optimizer.ratio" in warned[0], partial["records"]
        _assert_bitwise(partial["expected"], partial["got"], f"rank {rank} pass-through")


# --------------------------------------------------------------------------- a staging buffer that cannot be allocated


def _staging_fails_on_one_rank(rank: int, world_size: int) -> str:
    """Rank 1's pinned staging allocation fails (as when pinned host memory runs out): every rank must raise."""
    from flatgrad.integrations.deepspeed.zero3.offload import Zero3Offload

    # The CPU accelerator keeps the grads in host memory and stages nothing; these engines stage, as on a GPU.
    Zero3Offload.needs_staging = lambda self: True
    if rank == 1:
        def refuse(self, nbytes: int) -> None:
            raise RuntimeError("out of memory (pinned host allocation)")

        Zero3Offload.allocate_staging = refuse
    try:
        _engine(rank, world_size, True, gas=1, **BASE, **_offload(True))
    except Exception as exc:  # noqa: BLE001 - the message is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_staging_that_cannot_be_allocated_raises_on_every_rank() -> None:
    messages = launch(_staging_fails_on_one_rank, 2, timeout=100)
    for rank, message in enumerate(messages):
        assert message.startswith("UnsupportedConfigError") and "staging buffers" in message, (rank, message)
        assert "zero_optimization.offload_optimizer" in message, message
        # Every rank names the rank that failed, and why.
        assert f"on rank 1 ('zero_optimization.offload_optimizer'; this is rank {rank})" in message, message
        assert "RuntimeError: out of memory (pinned host allocation)" in message, message


# --------------------------------------------------------------------------- every reduction mode

# Every mode, and error feedback on a flat and a two-stage quantized wire.
OFFLOAD_MODES = (
    ("exact", False), ("int8", True), ("fp8", False), ("2d_reduce_scatter", False), ("hier_exact", False),
    ("hier_int8", False), ("hier_fp8", False), ("qgz_int8", True), ("qgz_fp8", False),
)  # fmt: skip


def _every_mode(rank: int, world_size: int) -> dict:
    """Each mode on 2 nodes of 2: without offload, then with the optimizer and the parameters offloaded and every
    segment staged through the pinned buffers (as on a GPU): what arrived (the sources, or the wire bytes) is unpacked
    on the host."""
    from _ds import as_nodes, train

    from flatgrad.integrations.deepspeed.zero3.offload import Zero3Offload

    as_nodes(rank, 2)
    # As on a GPU: the staging buffers are allocated at install (sized by the largest ``received``), and a segment
    # that outgrew them would replace one, which the test would see.
    Zero3Offload.needs_staging = lambda self: True
    batches = make_batches(rank, 4, MICRO_BATCH, D_IN, D_OUT)
    out: dict = {}
    for reduction, feedback in OFFLOAD_MODES:
        section = {"reduction": reduction, "error_feedback": feedback}
        for offload in (False, True):
            options = {**BASE, **({**_offload(True), "offload_param": {"device": "cpu"}} if offload else {})}
            engine = _engine(rank, world_size, True, gas=2, stage=offload, flatgrad=section, **options)
            r = engine.optimizer.flatgrad
            out[reduction, feedback, offload] = {
                "losses": train(engine, batches),
                "modes": {c.bucket.mode.name for c in r.compositions.values()},
                "staging": [b.numel() for b in r.offload.staging_buffers], "largest": r.staging_bytes(),
                "transfers": r.offload.host_transfers,
            }  # fmt: skip
            engine.destroy()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_offload_serves_every_mode() -> None:
    """With the optimizer and the parameters offloaded and the segments staged, every mode trains as it does without
    offload."""
    for rank, out in enumerate(launch(_every_mode, 4, timeout=280)):
        for reduction, feedback in OFFLOAD_MODES:
            plain, offloaded = out[reduction, feedback, False], out[reduction, feedback, True]
            assert plain["modes"] == offloaded["modes"] == {reduction}, (reduction, plain["modes"])
            assert offloaded["transfers"] > 0 and offloaded["staging"] == [offloaded["largest"]] * 2, offloaded
            torch.testing.assert_close(offloaded["losses"], plain["losses"], rtol=1e-6, atol=0, msg=reduction)
