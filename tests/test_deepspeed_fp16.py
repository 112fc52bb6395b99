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
