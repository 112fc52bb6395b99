"""fp16 with dynamic loss scaling, flatgrad against stock DeepSpeed, ZeRO-1/2/3 on two gloo ranks.

``tests/_ds.py`` lets the CPU accelerator report fp16 support (DeepSpeed
refuses fp16 on CPU otherwise). The loss scale starts high, so the first steps
overflow and the scaler walks down to the largest scale whose loss-scaled
gradients fit in fp16; that edge is where an early cast of an accumulated sum
to fp16 would overflow where stock does not. One later step overflows on rank
0 only (its loss blown up), which every rank must skip.
"""

from __future__ import annotations

import pytest
import torch
from _ds import MLP, ds_config, launch, make_batches

pytestmark = pytest.mark.multiproc

D_IN, D_OUT = 13, 5
STEPS, GAS, BLOW_UP_STEP = 16, 4, 11


def _fp16_rank(rank, world_size, stage, accum):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    import flatgrad.deepspeed as fds

    batches = make_batches(rank, STEPS * GAS, 2, D_IN, D_OUT)
    out = {}
    for kind, initialize in (("stock", deepspeed.initialize), ("flatgrad", fds.initialize)):
        torch.manual_seed(0)
        model = MLP(hidden=48)
        cfg = ds_config(stage, gas=GAS, world_size=world_size, bucket=400, dtype="fp16")
        cfg["fp16"].update(initial_scale_power=16, loss_scale_window=4, hysteresis=1)
        if accum == "fp32":
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine, *_ = initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        skipped, scales = [], []
        for k in range(STEPS):
            before = engine.skipped_steps
            for x, y in batches[k * GAS : (k + 1) * GAS]:
                # Targets shifted up on rank 0 and down on rank 1: each rank's gradients keep their
                # sign across micro-steps (its accumulated sum is several times a micro-step's) while
                # the two ranks' sums nearly cancel. The fp16 limit then binds on each rank's sum
                # divided by W before the cast (stock), not on the reduced mean. 64x the gradient
                # from about the same loss value, so that the loss-scaled gradients reach the fp16
                # limit at scales well below 2**16 (the scale itself is no fp16 number beyond that).
                loss = engine(x.half(), (y + 4 - 8 * rank).half())
                loss = 64 * (loss - 0.99 * loss.detach())
                if k == BLOW_UP_STEP and rank == 0:
                    loss = loss * 6e4
                engine.backward(loss)
                engine.step()  # steps the optimizer at the accumulation boundary only
            skipped.append(engine.skipped_steps > before)
            scales.append(float(engine.optimizer.loss_scale))
        params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        out[kind] = {"skipped": skipped, "scales": scales, "params": params}
    return out


CASES = [(stage, accum) for stage in (1, 2, 3) for accum in ("default", "fp32")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage,accum", CASES, ids=[f"zero{s}-accum_{a}" for s, a in CASES])
def test_fp16_loss_scaling_skips_and_scales_like_stock(stage, accum):
    for r in launch(_fp16_rank, 2, stage, accum, timeout=280):
        stock, flat = r["stock"], r["flatgrad"]
        assert any(stock["skipped"][:3]) and stock["skipped"][BLOW_UP_STEP], stock["skipped"]  # the test bites
        assert not all(stock["skipped"]), stock["skipped"]
        assert flat["skipped"] == stock["skipped"]
        assert flat["scales"] == stock["scales"]
        for name, p in stock["params"].items():  # two ranks: the same sums in the same dtypes, so the same bits
            assert torch.equal(flat["params"][name], p), (name, (flat["params"][name] - p).abs().max().item())


def _edited_rank(rank, world_size, stage):
    """Gradients written through DeepSpeed's API after backward (``safe_set_full_grad``): inf on some steps,
    a finite rescale on the others. The step must see them, as stock does."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_set_full_grad

    import flatgrad.deepspeed as fds

    # Even sizes: DeepSpeed's own ZeRO-3 set_fp32_grad_for_param fails on a parameter of 5 elements on 2 ranks.
    batches = make_batches(rank, 6, 2, 12, 6)
    out = {}
    for kind, initialize in (("stock", deepspeed.initialize), ("flatgrad", fds.initialize)):
        torch.manual_seed(0)
        model = MLP(d_in=12, hidden=48, d_out=6)
        cfg = ds_config(stage, world_size=world_size, bucket=400, dtype="fp16", clip=0.5)
        cfg["fp16"].update(initial_scale_power=8, loss_scale_window=2, hysteresis=1)
        engine, *_ = initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
        skipped, scales, norms = [], [], []
        for k, (x, y) in enumerate(batches):
            engine.backward(engine(x.half(), y.half()))
            for p in engine.module.parameters():
                grad = safe_get_full_grad(p)
                safe_set_full_grad(p, torch.full_like(grad, float("inf")) if k % 3 == 1 else grad * 3)
            before = engine.skipped_steps
            engine.step()
            skipped.append(engine.skipped_steps > before)
            scales.append(float(engine.optimizer.loss_scale))
            norms.append(float(engine.get_global_grad_norm() or 0.0))
        params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        out[kind] = {"skipped": skipped, "scales": scales, "norms": norms, "params": params}
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_written_through_deepspeeds_api_are_seen_by_the_step(stage):
    """The norm and overflow come from the unpack's stats; a gradient written after the unpack through
    safe_set_full_grad is not in them, so that step reads the partitions: the same skips, scales and
    norms as stock (DeepSpeed's own TestZeROFloat16 overflow tests write gradients this way)."""
    for rank, out in enumerate(launch(_edited_rank, 2, stage, timeout=220)):
        stock, flat = out["stock"], out["flatgrad"]
        assert stock["skipped"] == [k % 3 == 1 for k in range(6)], stock["skipped"]
        assert flat["skipped"] == stock["skipped"] and flat["scales"] == stock["scales"], (rank, flat, stock)
        for mine, theirs in zip(flat["norms"], stock["norms"]):
            assert abs(mine - theirs) <= 1e-6 * abs(theirs) or mine == theirs, (rank, flat["norms"], stock["norms"])
        for name, value in stock["params"].items():
            err = float((flat["params"][name] - value).abs().max() / value.abs().max())
            assert err <= 1e-6, (rank, name, err)
