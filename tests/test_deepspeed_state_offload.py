"""``engine.offload_states`` / ``reload_states`` (DeepSpeed's) under flatgrad's ZeRO-1/2, against stock: real
DeepSpeed, CPU accelerator, gloo ranks."""

from __future__ import annotations

import pytest
import torch
from _ds import MLP, ds_config, launch, make_batches, params_of, train

pytestmark = pytest.mark.multiproc

CASES = {
    "zero1": ds_config(1),
    "zero2": ds_config(2, bucket=400),
    "zero2-bf16": ds_config(2, bucket=400, dtype="bf16"),
    "zero2-offload": ds_config(2, bucket=400, offload_optimizer={"device": "cpu"}),
}


def _engine(kind: str, cfg: dict):
    import deepspeed

    import flatgrad.deepspeed as fds

    torch.manual_seed(0)
    model = MLP()
    init = fds.initialize if kind == "flatgrad" else deepspeed.initialize
    engine, *_ = init(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def _run(kind: str, cfg: dict, include, batches, dtype) -> tuple[dict, dict]:
    """Two steps; between the second's backward and its step, ``offload_states(include)`` and ``reload_states``
    (``include == "none"``: neither)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    engine = _engine(kind, cfg)
    train(engine, batches[:1], dtype)
    x, y = batches[1]
    engine.backward(engine(x.to(dtype), y.to(dtype)))
    o = engine.optimizer
    seen: dict = {}
    if include != "none":
        host_grads = [m.grad for m in o.single_partition_of_fp32_groups]
        grads = [t.clone() for g in o.averaged_gradients.values() if g is not None for t in g]
        # Stock hands step() the gradients in averaged_gradients, but under CPU offload, where it leaves them empty.
        seen["averaged_gradients as stock's"] = bool(grads) != bool(o.cpu_offload)
        engine.offload_states(include=include, pin_memory=False)
        seen["marked"] = OffloadStateTypeEnum.lp_grads in o.offloaded_states
        engine.reload_states()
        seen["cleared"] = not o.offloaded_states
        now = [t for g in o.averaged_gradients.values() if g is not None for t in g]
        seen["grads kept"] = len(now) == len(grads) and all(torch.equal(a, b) for a, b in zip(grads, now))
        if kind == "flatgrad":  # flatgrad's moves ran, and the hand-over views the reducers' shards, wherever they are
            seen["flatgrad's"] = o.offload_states.__self__ is o.reload_states.__self__ is o.flatgrad.state_offload
            storages = {gs.shard.untyped_storage().data_ptr() for r in o.flatgrad.reducers for gs in r.grad_shards()}
            seen["views shards"] = all(t.untyped_storage().data_ptr() in storages for t in now)
        # Under CPU offload the optimizer's host gradients stay the very tensors it steps with.
        kept = (m.grad for m in o.single_partition_of_fp32_groups)
        seen["host grads kept"] = all(a is b for a, b in zip(host_grads, kept))
    engine.step()
    params = params_of(engine)
    engine.destroy()
    return params, seen


def _offload_states_rank(rank: int, world_size: int, case: str) -> dict:
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    cfg = CASES[case]
    dtype = torch.bfloat16 if "bf16" in case else torch.float32
    batches = make_batches(rank, 2, 2, 13, 5)
    out = {}
    for include in ("none", [OffloadStateTypeEnum.lp_grads], None):
        label = "none" if include == "none" else ("lp_grads" if include else "all")
        for kind in ("stock", "flatgrad"):
            out[kind, label] = _run(kind, cfg, include, batches, dtype)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_and_reload_states_between_backward_and_step_change_nothing(case):
    """``offload_states`` of the gradients (``lp_grads``) or of every state, then ``reload_states``, between a
    backward and its step: the gradients, the optimizer's host gradients under CPU offload and the step after are
    as without them, bitwise, and as stock's (fp32 on 2 ranks; bf16 against flatgrad's own run), and flatgrad's
    hand-over still views its reducers' shards. On a CPU the shards stay where they are (the offload's device is
    theirs); ``test_reducer.py::test_move_shards_moves_own_and_arena_shards_and_refuses_targets`` moves them."""
    for rank, out in enumerate(launch(_offload_states_rank, 2, case, timeout=180)):
        base, _ = out["flatgrad", "none"]
        for label in ("lp_grads", "all"):
            params, seen = out["flatgrad", label]
            assert all(seen.values()), (rank, case, label, seen)
            assert all(torch.equal(params[n], p) for n, p in base.items()), (rank, case, label)
            stock, stock_seen = out["stock", label]
            assert all(stock_seen.values()), (rank, case, label, stock_seen)
            if "bf16" not in case:
                assert all(torch.equal(stock[n], p) for n, p in params.items()), (rank, case, label)
