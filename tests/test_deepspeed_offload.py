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


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)).item() for k in a)


@pytest.mark.timeout(300)
def test_offload_fp32_on_four_ranks_within_the_reduction_order_of_stock():
    """4 ranks: gloo adds the ranks' gradients in another order in stock's reduce than in flatgrad's
    reduce_scatter (as without offload, see tests/test_deepspeed_zero2.py): within 1e-6; one
    reduce_scatter per sub-group per reduction."""
    cases = [(2, 2, 0.05, True), (1, 2, 0.0, True), (2, 1, 0.0, False)]
    for rank_results in launch(_equivalence_rank, 4, cases, timeout=280):
        for case, r in zip(cases, rank_results):
            stock, fg = r["stock"], r["flatgrad"]
            reductions = 6 if case[0] == 1 else 6 * case[1]
            assert fg["offload"] and fg["reduce_scatters"] == reductions * fg["groups"], (case, fg)
            assert _max_rel(stock["params"], fg["params"]) <= 1e-6, case
            assert max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], fg["losses"])) <= 1e-6, case


def _cpu_adam_rank(rank: int, world_size: int, dtype: str) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    batches = make_batches(rank, 8, 2, D_IN, D_OUT)
    out = {}
    for kind in ("stock", "flatgrad"):
        cfg = _offload_config(2, 2, world_size, 0.05, True, dtype=dtype)
        del cfg["zero_force_ds_cpu_optimizer"]
        cfg["optimizer"]["params"].pop("torch_adam")
        engine = _engine(kind, cfg)
        out[kind] = {
            "optimizer": type(engine.optimizer.optimizer).__name__,
            "losses": train(engine, batches, dtype=torch.bfloat16 if dtype == "bf16" else None),
            "params": params_of(engine),
            "masters": {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()},
        }
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_with_deepspeeds_cpu_adam(dtype: str):
    """DeepSpeedCPUAdam, the default optimizer under offload: flatgrad steps it per sub-group, stock once per
    param group. Its update is elementwise, but its vector body and its scalar tail round differently (see
    ``test_cpu_adam_rounds_its_scalar_tail_unlike_its_vector_body``), and a sub-group's partition ends where
    stock's does not: within 1e-6 relative, the losses too; the bf16 model's partitions are delivered by one
    cast-copy per bucket."""
    for out in launch(_cpu_adam_rank, 2, dtype, timeout=380):
        stock, fg = out["stock"], out["flatgrad"]
        assert stock["optimizer"] == fg["optimizer"] == "DeepSpeedCPUAdam"
        assert max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], fg["losses"])) <= 1e-6, dtype
        assert _max_rel(stock["masters"], fg["masters"]) <= 1e-6, dtype


def test_cpu_adam_rounds_its_scalar_tail_unlike_its_vector_body():
    """The cause named above: one DeepSpeedCPUAdam step over a tensor and over two slices of it differ only in
    the elements a slice's scalar tail (its last < 16 elements, the widest SIMD width) updates."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    gen = torch.Generator().manual_seed(0)
    weights, grads = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    cut = 333
    whole = torch.nn.Parameter(weights.clone())
    parts = [torch.nn.Parameter(weights[:cut].clone()), torch.nn.Parameter(weights[cut:].clone())]
    one, two = DeepSpeedCPUAdam([whole], lr=1e-2), DeepSpeedCPUAdam(parts, lr=1e-2)
    for _ in range(3):
        whole.grad, parts[0].grad, parts[1].grad = grads.clone(), grads[:cut].clone(), grads[cut:].clone()
        one.step()
        two.step()
    split = torch.cat([p.detach() for p in parts])
    differ = set((whole.detach() != split).nonzero().flatten().tolist())
    tails = set(range(cut - 16, cut)) | set(range(1000 - 16, 1000))
    assert differ <= tails, sorted(differ - tails)
    assert ((whole.detach() - split).abs() / whole.detach().abs()).max() <= 1e-6
