"""flatgrad's ZeRO-3 backend against stock DeepSpeed ZeRO-3 (real DeepSpeed, CPU, gloo, 2 and 4 ranks).

Every rank function trains stock and flatgrad from the same seed in the same
process, so one launch compares both. Comparisons are bitwise: flatgrad keeps
stock's arithmetic (see [Note: ZeRO-3 reduce path] in
docs/design.md).
"""

from __future__ import annotations

import io
import os

import pytest
import torch

from _ds import MLP, REDUCTIONS, PartitionReads, count_collectives, ds_config, launch, make_batches
from flatgrad.testing.collectives import CollectiveRecorder

D_IN, HIDDEN, D_OUT = 13, 37, 5
MICRO_BATCH = 2
GAS = 2
STEPS = 5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

# Small buckets: several buckets per backward, a parameter larger than a bucket
# (37 x 37), parameters that leave some ranks without data (5 elements on 4 ranks).
# No gradient clipping here: clipped runs take the norm from the unpack stats, in
# another summation order than stock's, and agree to 1e-6, not bitwise
# (test_norm_and_overflow_come_from_the_unpack).
ZERO_CASES = {
    "partitioned": {"bucket": 1000, "stage3_param_persistence_threshold": 0},
    "persistent": {"bucket": 1000},
    "non_contiguous": {"bucket": 2000, "contiguous_gradients": False, "overlap_comm": True},
}


# --------------------------------------------------------------------------- rank-side helpers


def _engine(rank: int, world_size: int, flat: bool, dtype: str, *, flatgrad: dict | None = None,
            accum: str | None = None, overflow_check: bool = False, route: str = "initialize", top: dict | None = None,
            **zero):
    """A ZeRO-3 engine over the seeded MLP.

    ``flat=False``: stock ``deepspeed.initialize``. ``flat=True``: the config gets
    a ``"flatgrad"`` section and goes through ``flatgrad.deepspeed.initialize``
    (``route="initialize"``) or through ``deepspeed.initialize`` under
    ``flatgrad.deepspeed.patch()`` (``route="patch"``).
    """
    import deepspeed

    from flatgrad import deepspeed as flatgrad_ds

    torch.manual_seed(0)
    model = MLP(D_IN, HIDDEN, D_OUT)
    cfg = ds_config(3, gas=GAS, micro_batch=MICRO_BATCH, world_size=world_size, dtype=dtype, **zero)
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    if overflow_check:
        cfg["bf16"]["check_grad_overflow"] = True
    cfg.update(top or {})
    initialize = deepspeed.initialize
    if flat:
        cfg["flatgrad"] = flatgrad or {}
        if route == "initialize":
            initialize = flatgrad_ds.initialize
    if route == "patch":
        flatgrad_ds.patch()
        try:
            return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        finally:
            flatgrad_ds.unpatch()
    return initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _partitions(engine) -> list[torch.Tensor]:
    """This rank's grad partitions in module order (ds_ids count on across engines in one process)."""
    partitions = getattr(engine.optimizer, _GRAD_PARTITIONS)
    return [partitions[p.ds_id].detach().clone() for p in engine.module.parameters()]


def _real(param, rank: int) -> int:
    """Elements of real data in ``rank``'s partition of a ZeRO-3 parameter (the rest is padding)."""
    c = param.partition_numel()
    return max(0, min(c, param.ds_numel - rank * c))


def _state(engine, rank: int) -> dict:
    """This rank's parameter partitions (real data only): the module's and the optimizer's fp32 master."""
    opt = engine.optimizer
    master = []
    for group, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat):
        offset = 0
        for p in group:
            master.append(flat.narrow(0, offset, _real(p, rank)).detach().clone())
            offset += p.partition_numel()
    return {
        "params": [p.ds_tensor.narrow(0, 0, _real(p, rank)).detach().clone() for p in engine.module.parameters()],
        "master": master,
    }


def _flatgrad_ran(engine) -> int:
    """The number of bucket plans flatgrad built (0 when flatgrad is not installed)."""
    reduction = getattr(engine.optimizer, "flatgrad", None)
    return len(reduction.compositions) if reduction is not None else 0


def _train(engine, rank: int, dtype: str, batches, inf_at: int | None = None) -> dict:
    """One forward/backward/step per micro-batch; the losses and the grad partitions after every backward.

    ``plans``: flatgrad's plan count after every micro-step (it must stop growing after the first step).
    """
    losses, partitions, plans = [], [], []
    for i, (x, y) in enumerate(batches):
        loss = engine(x.to(DTYPES[dtype]), y.to(DTYPES[dtype]))
        if i == inf_at and rank == 0:
            loss = loss * float("inf")  # non-finite gradients on one rank: the step must be skipped
        engine.backward(loss)
        partitions.append(_partitions(engine))
        engine.step()
        losses.append(float(loss.detach().float()))
        plans.append(_flatgrad_ran(engine))
    return {"losses": losses, "partitions": partitions, "plans": plans}


def _trajectory(rank: int, world_size: int, flat: bool, dtype: str, inf_at: int | None = None, **options) -> dict:
    """Train STEPS optimizer steps from the seed; every loss and grad partition, and the final state."""
    engine = _engine(rank, world_size, flat, dtype, **options)
    out = _train(engine, rank, dtype, make_batches(rank, STEPS * GAS, MICRO_BATCH, D_IN, D_OUT), inf_at)
    out.update(_state(engine, rank))
    out["accum"] = str(engine.optimizer.gradient_accumulation_dtype)
    out["skipped"] = engine.skipped_steps
    engine.destroy()
    return out


def _serialized(obj) -> bytes:
    """Tensors travel back by value (the launcher's queue would share them through file descriptors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _deserialized(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _stock_vs_flat(rank: int, world_size: int, dtype: str, options: dict, inf_at: int | None = None,
                   flat_options: dict | None = None) -> bytes:
    """Stock with ``options`` and flatgrad with ``options`` updated by ``flat_options``, from the same seed."""
    return _serialized({
        "stock": _trajectory(rank, world_size, False, dtype, inf_at, **options),
        "flat": _trajectory(rank, world_size, True, dtype, inf_at, **{**options, **(flat_options or {})}),
    })


# --------------------------------------------------------------------------- comparisons


def _assert_bitwise(a, b, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_bitwise(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        # NaN payloads and signs are the arithmetic library's choice; every other value must match bit for bit.
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), f"{what}: NaNs at different places"
        assert torch.equal(a[~nan].view(torch.uint8), b[~nan].view(torch.uint8)), f"{what}: not bitwise equal"
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _compare(results: list[dict]) -> None:
    """Every rank: flatgrad ran, built its plans once, and matched stock bit for bit; and the runs trained."""
    for rank, r in enumerate(results):
        stock, flat = dict(r["stock"]), dict(r["flat"])
        stock_plans, plans = stock.pop("plans"), flat.pop("plans")
        assert set(stock_plans) == {0} and plans[-1] > 0, f"rank {rank}: flatgrad's path did not run"
        # One plan per bucket composition, built in the first step (GAS micro-steps) and reused after.
        assert plans[GAS - 1:] == [plans[-1]] * (len(plans) - GAS + 1), f"rank {rank}: plans rebuilt: {plans}"
        _assert_bitwise(stock, flat, f"rank {rank}")
    # The comparison has teeth: the loss moved and the gradients were not all zero.
    losses = results[0]["stock"]["losses"]
    assert losses[0] != losses[-1], "the runs did not train"
    assert any(t.count_nonzero() for t in results[0]["stock"]["partitions"][-1]), "every gradient is zero"


# --------------------------------------------------------------------------- equivalence


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", sorted(ZERO_CASES))
def test_fp32_bitwise_equal_to_stock(world_size: int, case: str) -> None:
    """Grad partitions after every backward, losses, and final params: bitwise equal to stock on every rank."""
    results = [_deserialized(r) for r in launch(_stock_vs_flat, world_size, "fp32", ZERO_CASES[case], timeout=200)]
    _compare(results)


_BF16_COMM = {"top": {"communication_data_type": "bf16"}}
_FLAT_BF16_COMM = {"top": {}, "flatgrad": {"comm_dtype": "bf16"}}

# name: (world size, stock's options, flatgrad's changes to them)
FEATURES = {
    # Parameter offload moves the parameters' partitions only; the gradient path stays flatgrad's.
    "param_offload": (2, {"offload_param": {"device": "cpu"}}, {}),
    # hpZ: secondary parameter partitions of 2 ranks; gradients still reduce over all 4.
    "hpz": (4, {"zero_hpz_partition_size": 2}, {}),
    # torch autocast: one IPG bucket per comm dtype; fp32 gradients cast to bf16 before the divide, as stock does.
    "autocast": (2, {"top": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}}, {}),
    # A world size that is not a power of two: the buffer is divided in place (x * 1/3 is not x / 3).
    "three_ranks": (3, {}, {}),
    # flatgrad's comm_dtype does what DeepSpeed's communication_data_type does.
    "comm_dtype": (2, _BF16_COMM, _FLAT_BF16_COMM),
}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features_bitwise_equal_to_stock(feature: str) -> None:
    world_size, options, flat_options = FEATURES[feature]
    options = {**ZERO_CASES["partitioned"], **options}
    results = launch(_stock_vs_flat, world_size, "fp32", options, None, flat_options, timeout=200)
    results = [_deserialized(r) for r in results]
    _compare(results)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("accum", ["fp32", "bf16"])
def test_bf16_equal_to_stock(world_size: int, accum: str) -> None:
    """bf16 training, fp32 or bf16 grad partitions: equal to stock (bitwise, tighter than one bf16 ulp)."""
    options = {**ZERO_CASES["partitioned"], "accum": accum}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, world_size, "bf16", options, timeout=200)]
    for r in results:
        assert r["flat"]["accum"] == str(DTYPES[accum])
    _compare(results)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_overflow_skips_the_step_like_stock() -> None:
    """Non-finite gradients on one rank: the overflow check sees them in the partitions and skips the step."""
    options = {**ZERO_CASES["persistent"], "overflow_check": True}
    results = [_deserialized(r) for r in launch(_stock_vs_flat, 2, "bf16", options, 4, timeout=200)]
    for r in results:
        assert r["stock"]["skipped"] == 1
    _compare(results)


# --------------------------------------------------------------------------- collectives


# Also the ``deepspeed.comm`` wrappers ZeRO-3 calls (they reach torch through DeepSpeed's own references) and
# ``torch.distributed.reduce_scatter_single`` (what ``flatgrad.comm`` calls on torch >= 2.13).
_ZERO3_EXTRA = ("reduce_scatter_fn", "allgather_fn", "all_gather_coalesced", "reduce_scatter_single")
# DeepSpeed's wrappers, named after what they call.
_SAME = {
    "reduce_scatter_fn": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "allgather_fn": "all_gather_into_tensor",
}


def _counter() -> CollectiveRecorder:
    return count_collectives(_ZERO3_EXTRA)


def _by_kind(counter: CollectiveRecorder) -> dict[str, list[tuple[int, str]]]:
    """``{collective: [(numel, dtype), ...]}`` with DeepSpeed's wrappers named after what they call."""
    out: dict[str, list[tuple[int, str]]] = {}
    for name, calls in counter.buffers().items():
        out.setdefault(_SAME.get(name, name), []).extend(calls)
    return out


def _collectives(rank: int, world_size: int, options: dict, flat_options: dict) -> dict:
    out = {}
    for flat in (False, True):
        with _counter() as counter:
            engine = _engine(rank, world_size, flat, "fp32", **(dict(options, **flat_options) if flat else options))
            _train(engine, rank, "fp32", make_batches(rank, STEPS * GAS, MICRO_BATCH, D_IN, D_OUT))
        out[flat] = _by_kind(counter)
        engine.destroy()
    return out


# name: (world size, stock's options, flatgrad's changes to them, reduce_scatters per backward or None)
COLLECTIVES = {
    # 3 buckets per backward: the 37x37 weight alone, the rest in 1000-element buckets.
    "2_ranks": (2, ZERO_CASES["partitioned"], {}, 3),
    "4_ranks": (4, ZERO_CASES["partitioned"], {}, 3),
    # flatgrad's bucket_numel sets ZeRO-3's bucket size: the same buckets as stock's reduce_bucket_size.
    "bucket_numel": (
        2, {**ZERO_CASES["partitioned"], "bucket": 400}, {"bucket": 1000, "flatgrad": {"bucket_numel": 400}}, None
    ),
    # flatgrad's comm_dtype: the reduce_scatters carry bf16, as with DeepSpeed's communication_data_type.
    "comm_dtype": (2, {**ZERO_CASES["partitioned"], **_BF16_COMM}, _FLAT_BF16_COMM, 3),
}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(COLLECTIVES))
def test_same_collectives_as_stock(case: str) -> None:
    """Counted at deepspeed.comm (torch.distributed for flatgrad.comm): the same calls, sizes and dtypes as
    stock, but the step's norm all_reduces: one per step ([sum_sq, nonfinite] from the unpack stats, fp32)
    against stock's one per sub-group (its norm, in the norm dtype)."""
    world_size, options, flat_options, per_backward = COLLECTIVES[case]
    for rank, r in enumerate(launch(_collectives, world_size, options, flat_options, timeout=200)):
        stock, flat = r[False], r[True]
        reduce_scatters = stock.get("reduce_scatter_tensor", [])
        assert reduce_scatters, f"rank {rank}: no reduce_scatter counted"
        if per_backward is not None:
            count = len(reduce_scatters)
            assert count == per_backward * STEPS * GAS, f"rank {rank}: {count} reduce_scatters"
        mine, theirs = flat.pop("all_reduce"), stock.pop("all_reduce")
        assert mine == [(2, "float32")] * STEPS and len(theirs) >= STEPS, (rank, mine, theirs)
        assert flat == stock, f"rank {rank}: collectives differ from stock"


# --------------------------------------------------------------------------- step statistics


def _norm_rank(rank: int, world_size: int, dtype: str, options: dict) -> dict:
    """Per boundary: the norm DeepSpeed computed, whether flatgrad's stats served it, the ops step() ran on
    the grad partitions and the all_reduces it issued; and the final state."""
    batches = make_batches(rank, STEPS * GAS, MICRO_BATCH, D_IN, D_OUT)
    out = {}
    for flat in (False, True):
        engine = _engine(rank, world_size, flat, dtype, **options)
        opt = engine.optimizer
        norms, served, reads, reduces, skipped = [], [], [], [], []
        for i, (x, y) in enumerate(batches):
            loss = engine(x.to(DTYPES[dtype]), y.to(DTYPES[dtype]))
            if dtype == "fp16" and i == 2 * GAS - 1 and rank == world_size - 1:
                loss = loss * float("inf")  # one rank overflows at the second boundary: the step is skipped
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary and flat:
                served.append(opt.flatgrad.stats.usable())
            with PartitionReads([opt.grad_partitions_flat_buffer]) as recorder, _counter() as counter:
                engine.step()
            if boundary:
                norms.append(float(engine.get_global_grad_norm()))
                reads.append(recorder.ops)
                reduces.append(len(counter.buffers().get("all_reduce", [])))
                skipped.append(engine.skipped_steps)
        out[flat] = {
            "norms": norms, "served": served, "reads": reads, "reduces": reduces, "skipped": skipped,
            "sub_groups": len(opt.fp16_groups), **_state(engine, rank),
        }  # fmt: skip
        engine.destroy()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)) if b.numel() else 0.0


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,dtype", [(2, "fp32"), (4, "fp32"), (2, "fp16")])
def test_norm_and_overflow_come_from_the_unpack(world_size: int, dtype: str) -> None:
    """ZeRO-3: the norm from the unpack stats is stock's (1e-6), clipping gives stock's weights
    (1e-6), fp16 skips the same steps, step() runs no norm or overflow op on the grad partitions, and it
    issues no more all_reduces than stock (one, against one per sub-group)."""
    options = {"bucket": 400, "stage3_param_persistence_threshold": 0, "clip": 0.05, "sub_group_size": 200}
    for rank, r in enumerate(launch(_norm_rank, world_size, dtype, options, timeout=280)):
        stock, flat = r[False], r[True]
        assert flat["served"] and all(flat["served"]), f"rank {rank}: the stats did not serve every step"
        assert len(flat["norms"]) == len(stock["norms"]) == STEPS
        for mine, theirs in zip(flat["norms"], stock["norms"]):
            assert abs(mine - theirs) <= 1e-6 * abs(theirs) or (mine == theirs), (rank, flat["norms"], stock["norms"])
        assert flat["skipped"] == stock["skipped"], (rank, flat["skipped"], stock["skipped"])
        assert (stock["skipped"][-1] >= 1) == (dtype == "fp16"), (rank, stock["skipped"])
        for key in ("params", "master"):
            for k, (a, b) in enumerate(zip(flat[key], stock[key])):
                assert _rel(a, b) <= 1e-6, (rank, key, k, _rel(a, b))
        # One pass over the partitions per step, the optimizer's flatten of each sub-group; stock adds its norm's.
        skips = [b - a for a, b in zip([0] + flat["skipped"], flat["skipped"])]
        for mine, theirs, skip in zip(flat["reads"], stock["reads"], skips):
            assert mine == ([] if skip else ["flatten_dense_tensors"] * flat["sub_groups"]), (rank, mine, skip)
            assert not [op for op in mine if op in REDUCTIONS], (rank, mine)
            assert len(theirs) > len(mine) and "to" in theirs or skip, (rank, theirs)
        for mine, theirs in zip(flat["reduces"], stock["reduces"]):
            assert mine <= theirs, (rank, flat["reduces"], stock["reduces"])
        assert sum(stock["reduces"]) > sum(flat["reduces"]), (flat["sub_groups"], stock["reduces"], flat["reduces"])


# --------------------------------------------------------------------------- checkpoints


def _checkpoints(rank: int, world_size: int, root: str) -> bytes:
    """Save after 2 steps with one backend, load into the other, continue 3 steps; both ways; then zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    batches = make_batches(rank, STEPS * GAS, MICRO_BATCH, D_IN, D_OUT)
    head, tail = batches[: 2 * GAS], batches[2 * GAS :]
    out = {}
    for saver in (True, False):
        path = os.path.join(root, "flat" if saver else "stock")
        engine = _engine(rank, world_size, saver, "fp32", **ZERO_CASES["partitioned"])
        _train(engine, rank, "fp32", head)
        engine.save_checkpoint(path, tag="step2")
        continued = _train(engine, rank, "fp32", tail)
        continued.pop("plans")
        continued.update(_state(engine, rank))
        engine.destroy()
        loader = _engine(rank, world_size, not saver, "fp32", **ZERO_CASES["partitioned"])
        loader.load_checkpoint(path, tag="step2")
        resumed = _train(loader, rank, "fp32", tail)
        assert (resumed.pop("plans")[-1] > 0) == (not saver)
        resumed.update(_state(loader, rank))
        out["flat->stock" if saver else "stock->flat"] = {"continued": continued, "resumed": resumed}
        if saver:
            loader.destroy()
            continue
        # ``loader`` is flatgrad's engine: save it and convert with DeepSpeed's zero_to_fp32.
        import deepspeed

        loader.save_checkpoint(path, tag="final")
        with deepspeed.zero.GatheredParameters(list(loader.module.parameters())):
            live = {n: p.detach().clone() for n, p in loader.module.named_parameters()}
        torch.distributed.barrier()
        converted = get_fp32_state_dict_from_zero_checkpoint(path, tag="final") if rank == 0 else None
        out["zero_to_fp32"] = {"live": live, "converted": converted, "plans": _flatgrad_ran(loader)}
        loader.destroy()
    return _serialized(out)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_checkpoints_interchange_with_stock(tmp_path) -> None:
    """flatgrad -> stock and stock -> flatgrad resume identically; zero_to_fp32 of flatgrad's checkpoint is live."""
    results = [_deserialized(r) for r in launch(_checkpoints, 2, str(tmp_path), timeout=200)]
    for rank, r in enumerate(results):
        for direction in ("flat->stock", "stock->flat"):
            _assert_bitwise(r[direction]["continued"], r[direction]["resumed"], f"rank {rank} {direction}")
        # Both directions continue the same (bitwise equal) training.
        _assert_bitwise(r["flat->stock"]["continued"], r["stock->flat"]["continued"], f"rank {rank} stock vs flat")
    z = results[0]["zero_to_fp32"]
    assert z["plans"] > 0
    assert z["converted"].keys() == z["live"].keys()
    for name, live in z["live"].items():
        _assert_bitwise(z["converted"][name].reshape(live.shape), live, f"zero_to_fp32 {name}")


# --------------------------------------------------------------------------- refusal and pass-through


# config key -> the fragment that turns the feature on: (section, {key: value})
REFUSED = {
    # CPU optimizer offload is served (tests/test_deepspeed_zero3_offload.py); these variants of it are not.
    "zero_optimization.offload_optimizer.device": ("zero_optimization", {"offload_optimizer": {"device": "nvme"}}),
    "zero_optimization.offload_optimizer.ratio": (
        "zero_optimization", {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    ),
    "zero_optimization.offload_optimizer.super_offload": (
        "zero_optimization", {"offload_optimizer": {"device": "cpu", "super_offload": True}}
    ),
    "zero_optimization.reduce_scatter": ("zero_optimization", {"reduce_scatter": False}),
    "zero_optimization.zenflow": ("zero_optimization", {"zenflow": {"topk_ratio": 0.1}}),
    "compile.deepcompile": ("compile", {"deepcompile": True}),
    "expert_parallel.enabled": ("expert_parallel", {"enabled": True}),
}


def _with_features(keys) -> dict:
    cfg = ds_config(3)
    for key in keys:
        section, fragment = REFUSED[key]
        cfg.setdefault(section, {}).update(fragment)
    return cfg


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", sorted(REFUSED))
def test_initialize_refuses_unsupported_features(key: str) -> None:
    """flatgrad.deepspeed.initialize raises before DeepSpeed starts, naming the feature's config key."""
    from flatgrad import deepspeed as flatgrad_ds

    cfg = _with_features([key])
    cfg["flatgrad"] = {}
    model = torch.nn.Linear(3, 2)
    with pytest.raises(flatgrad_ds.UnsupportedConfigError, match=key.replace(".", r"\.")):
        flatgrad_ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_given_as_deepspeeds_enum_is_judged_as_its_name(stage: int) -> None:
    """DeepSpeed's own tests write ``{"device": OffloadDeviceEnum.cpu}``: judged at planning exactly as ``"cpu"``
    (NVMe refused, naming the key), so that ``patch()`` can still hand a refused config to stock DeepSpeed.
    """
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    from flatgrad.integrations.deepspeed.config import UnsupportedConfigError
    from flatgrad.integrations.deepspeed.support import check_supported as check
    from flatgrad.integrations.deepspeed.support import refusals

    for device in (OffloadDeviceEnum.cpu, OffloadDeviceEnum.nvme):
        as_enum, as_name = ds_config(stage), ds_config(stage)
        as_enum["zero_optimization"]["offload_optimizer"] = {"device": device}
        as_name["zero_optimization"]["offload_optimizer"] = {"device": device.value}
        assert refusals(as_enum) == refusals(as_name)
        if device is OffloadDeviceEnum.nvme:
            with pytest.raises(UnsupportedConfigError, match="offload_optimizer"):
                check(as_enum)
    cfg = ds_config(stage)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": OffloadDeviceEnum.none}
    check(cfg)


def _without_optimizer(rank: int, world_size: int) -> str:
    from flatgrad import deepspeed as flatgrad_ds

    model = MLP(D_IN, HIDDEN, D_OUT)
    cfg = ds_config(3, world_size=world_size, optimizer=False, flatgrad={})
    try:
        flatgrad_ds.initialize(model=model, config=cfg)
    except flatgrad_ds.UnsupportedConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_initialize_refuses_an_engine_without_optimizer() -> None:
    """Without an optimizer DeepSpeed builds no ZeRO-3 gradient path; flatgrad says so (before DeepSpeed starts)."""
    for message in launch(_without_optimizer, 2, timeout=100):
        assert "without an optimizer" in message and "'optimizer' config section" in message, message


def _patched(rank: int, world_size: int) -> bytes:
    """Under patch(): a supported ZeRO-3 config runs flatgrad, an unsupported one runs stock, with one log line."""
    import logging

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("flatgrad.deepspeed")
    logger.addHandler(handler)
    try:
        out = {
            "supported": {
                "stock": _trajectory(rank, world_size, False, "fp32", **ZERO_CASES["partitioned"]),
                "flat": _trajectory(rank, world_size, True, "fp32", route="patch", **ZERO_CASES["partitioned"]),
            },
        }
        supported_records = list(records)
        unsupported = {**ZERO_CASES["partitioned"], "reduce_scatter": False}
        out["unsupported"] = {
            "stock": _trajectory(rank, world_size, False, "fp32", **unsupported),
            "patched": _trajectory(rank, world_size, True, "fp32", route="patch", **unsupported),
        }
        out["records"] = (supported_records, records[len(supported_records):])
    finally:
        logger.removeHandler(handler)
    return _serialized(out)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_patch_routes_zero3_and_passes_unsupported_through() -> None:
    results = [_deserialized(r) for r in launch(_patched, 2, timeout=200)]
    _compare([r["supported"] for r in results])
    for rank, r in enumerate(results):
        stock, patched = r["unsupported"]["stock"], r["unsupported"]["patched"]
        assert set(patched["plans"]) == {0}, f"rank {rank}: flatgrad ran on a config it refuses"
        _assert_bitwise(stock, patched, f"rank {rank} pass-through")
        before, after = r["records"]
        assert before == []
        assert len(after) == 1 and "zero_optimization.reduce_scatter" in after[0], after


# --------------------------------------------------------------------------- every reduction mode


# name: (the flatgrad section, the mode class it runs, exact: within 1e-6 of flat, else the ZeRO-2 int8 bound)
MODE_RUNS = {
    "exact": ({"reduction": "exact"}, "ExactSum", True),
    "2d_reduce_scatter": ({"reduction": "2d_reduce_scatter"}, "TwoStageReduceScatter", True),
    "hier_exact": ({"reduction": "hier_exact"}, "HierarchicalExact", True),
    "int8": ({"reduction": "int8"}, "QuantizedWire", False),
    "int8_ef": ({"reduction": "int8", "error_feedback": True}, "QuantizedWire", False),
    "fp8": ({"reduction": "fp8"}, "QuantizedWire", False),
    "fp8_ef": ({"reduction": "fp8", "error_feedback": True}, "QuantizedWire", False),
    "hier_int8_ef": ({"reduction": "hier_int8", "error_feedback": True}, "HierarchicalQuantized", False),
    "hier_fp8": ({"reduction": "hier_fp8"}, "HierarchicalQuantized", False),
    "qgz_int8": ({"reduction": "qgz_int8"}, "QuantizedTwoStage", False),
    "qgz_fp8_ef": ({"reduction": "qgz_fp8", "error_feedback": True}, "QuantizedTwoStage", False),
}


def _every_mode(rank: int, world_size: int, root: str) -> dict:
    """Every mode on 2 nodes of 2, one after the other: losses, then a checkpoint resumed (residuals included)."""
    from _ds import as_nodes, train, train_save_resume, zero3_master

    from flatgrad.integrations.deepspeed.zero2.checkpoint import RESIDUALS_KEY

    as_nodes(rank, 2)
    batches = make_batches(rank, 8, 2, 13, 5)
    out: dict = {}
    for name, (section, _, _) in {"flat": ({"reduction": "reduce_scatter"}, None, True), **MODE_RUNS}.items():
        cfg = ds_config(3, gas=2, world_size=world_size, bucket=500, flatgrad={**section, "comm_dtype": "fp32"})
        path = os.path.join(root, name)
        engine, losses, continued, resumed = train_save_resume(cfg, batches, path, at=4)
        reduction = engine.optimizer.flatgrad
        saved = torch.load(os.path.join(path, "t", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"), weights_only=False)
        saved = saved["optimizer_state_dict"].get(RESIDUALS_KEY)
        out[name] = {
            "modes": {type(c.bucket.mode).__name__ for c in reduction.compositions.values()},
            "divide": {c.bucket.divide for c in reduction.compositions.values()},
            "line": reduction.describe(), "losses": losses + continued, "master": zero3_master(engine, rank),
            "residuals": None if saved is None else {k: v.clone() for k, v in saved["residuals"].items()},
            "resumed_losses": train(resumed, batches[4:]), "resumed_master": zero3_master(resumed, rank),
        }  # fmt: skip
        residuals = resumed.optimizer.flatgrad.residuals
        out[name]["resumed_pending"] = len(residuals.pending)  # every saved residual found its composition
        engine.destroy()
        resumed.destroy()
    return out


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_every_mode_on_two_nodes_of_two_matches_flat_and_checkpoints_resume(tmp_path) -> None:
    """ZeRO-3 serves every mode: the exact ones within 1e-6 of flat flatgrad, the quantized ones within the bound
    ZeRO-2's int8 wire has (tests/test_deepspeed_zero2.py); every checkpoint resumes bitwise, residuals included."""
    for rank, out in enumerate(launch(_every_mode, 4, str(tmp_path), timeout=380)):
        flat = out["flat"]
        for name, (section, cls, exact) in MODE_RUNS.items():
            run = out[name]
            assert run["modes"] == {cls}, (name, run["modes"])
            assert run["divide"] == {False}, name  # fp32 on 4 ranks: stock's divide folds into the pack
            assert section["reduction"] in run["line"], run["line"]
            assert len(run["losses"]) == len(flat["losses"]) == 8
            if exact:
                assert max(abs(a - b) for a, b in zip(run["losses"], flat["losses"])) <= 1e-6, (name, rank)
            else:
                assert run["losses"] != flat["losses"], name  # it did quantize
                torch.testing.assert_close(run["losses"], flat["losses"], rtol=0.02, atol=0, msg=name)
            assert run["resumed_losses"] == run["losses"][4:], (name, rank)  # the checkpoint resumes bitwise
            assert all(torch.equal(a, b) for a, b in zip(run["resumed_master"], run["master"])), (name, rank)
            if section.get("error_feedback"):
                assert run["residuals"] and any(bool(t.any()) for t in run["residuals"].values()), name
                assert run["resumed_pending"] == 0, name
            else:
                assert run["residuals"] is None, name  # stock's checkpoint layout


@pytest.mark.parametrize("asked_by", ["flatgrad.reduction", "zero_optimization.zero_quantized_gradients"])
def test_two_stage_mode_on_several_partition_groups_is_refused_naming_the_key(monkeypatch, asked_by: str) -> None:
    """MoE or MiCS: the parameters reduce over several partition groups, and a two-stage mode needs one. The check
    reads the parameters' groups only (no collective), so every rank raises the same error, naming the key.

    DeepSpeed 0.19.8 builds no ZeRO-3 engine with several partition groups that reaches this check (it refuses its
    native MoE under ZeRO-3; MiCS's optimizer class and AutoEP are refused by flatgrad before it), so the optimizer
    here is a stand-in holding two parameters of two groups."""
    import dataclasses
    import types

    import torch.distributed as tdist

    from flatgrad.integrations.deepspeed.config import FlatgradConfig, UnsupportedConfigError
    from flatgrad.integrations.deepspeed.zero3.seams import reduction_mode

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    groups = {id(params[0]): "dense", id(params[1]): "experts"}
    monkeypatch.setattr(tdist, "get_process_group_ranks", lambda g: (0, 1, 2, 3) if g == "dense" else (0, 2))
    opt = types.SimpleNamespace(fp16_groups=[params], _get_param_partition_group=lambda p: groups[id(p)])
    config = dataclasses.replace(FlatgradConfig.from_dict({"reduction": "qgz_int8"}), reduction_key=asked_by)
    with pytest.raises(UnsupportedConfigError, match=f"'{asked_by}' asks for 'qgz_int8'.*this model has 2"):
        reduction_mode(opt, config)
