"""ZeRO-1/2 with CPU optimizer offload under flatgrad, against stock DeepSpeed's offload on real gloo ranks.

Under offload the reducers' shards are the optimizer's host fp32 gradient partitions
(``zero2/reduction.py``, [Note: ZeRO-Offload]); the step is stock's.
"""

from __future__ import annotations

import pytest
import torch
from _ds import MLP, count_collectives, ds_config, launch, make_batches, params_of, train

pytestmark = pytest.mark.multiproc

D_IN, D_OUT = 13, 5


def _initializers():
    import deepspeed

    import flatgrad.deepspeed as fds

    return {"stock": deepspeed.initialize, "flatgrad": fds.initialize}


def _offload_config(stage: int, gas: int, world_size: int, clip: float, pin: bool, dtype: str = "fp32", **zero) -> dict:
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    cfg = ds_config(stage, gas=gas, world_size=world_size, bucket=500, clip=clip, dtype=dtype, **offload, **zero)
    # torch's AdamW on the host partitions: stock offload's default would be DeepSpeedCPUAdam.
    cfg["zero_force_ds_cpu_optimizer"] = False
    return cfg


def _engine(kind: str, cfg: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP()
    engine, *_ = _initializers()[kind](model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


def _equivalence_rank(rank: int, world_size: int, cases: list) -> list:
    out = []
    for stage, gas, clip, pin in cases:
        batches = make_batches(rank, 6 * gas, 2, D_IN, D_OUT)
        result = {}
        for kind in ("stock", "flatgrad"):
            engine = _engine(kind, _offload_config(stage, gas, world_size, clip, pin))
            counter = count_collectives()
            losses = train(engine, batches, backward_counter=counter)
            reduction = getattr(engine.optimizer, "_flatgrad", None)
            result[kind] = {
                "losses": losses,
                "params": params_of(engine),
                "groups": len(engine.optimizer.bit16_groups),
                "reduce_scatters": counter.count("reduce_scatter"),
                "reductions": reduction.reductions if reduction is not None else 0,
                "offload": bool(reduction is not None and reduction.offload),
            }
        out.append(result)
    return out


_TWO_RANK_CASES = [
    (stage, gas, clip, pin) for stage in (2, 1) for gas in (1, 2) for clip in (0.0, 0.05) for pin in (True, False)
    if pin or (gas == 2 and clip)
]


@pytest.mark.timeout(400)
def test_offload_fp32_bitwise_equal_to_stock_offload_on_two_ranks():
    """ZeRO-2 and ZeRO-1 with CPU offload and torch AdamW, accumulation 1 and 2, with and without clipping,
    pinned and pageable: losses and parameters bitwise; one reduce_scatter per sub-group per reduction."""
    for rank_results in launch(_equivalence_rank, 2, _TWO_RANK_CASES, timeout=380):
        for case, r in zip(_TWO_RANK_CASES, rank_results):
            stock, fg = r["stock"], r["flatgrad"]
            stage, gas = case[0], case[1]
            assert fg["offload"] and fg["groups"] > 1 == stock["groups"], case
            reductions = 6 if stage == 1 else 6 * gas
            assert fg["reductions"] == reductions and fg["reduce_scatters"] == reductions * fg["groups"], (case, fg)
            assert fg["losses"] == stock["losses"], case
            for name in stock["params"]:
                assert torch.equal(fg["params"][name], stock["params"][name]), (case, name)
