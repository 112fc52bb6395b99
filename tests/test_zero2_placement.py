"""ZeRO-1/2's step tensors under CPU offload meet by CUDA's device rule: host partitions and accelerator vectors.

``flatgrad.testing.placement.SameDevice`` refuses a device mix as CUDA does, with ``cpu`` and ``meta``
playing the host and the accelerator (data moves onto ``meta`` only, so each test gives ``cpu`` to the
side whose values are read). See [Note: step placement] in
docs/design.md.
"""

from __future__ import annotations

import pytest
import torch

from flatgrad.integrations.deepspeed.zero2.stats import group_squared_norms
from flatgrad.integrations.deepspeed.zero2.step import unscale_and_clip_
from flatgrad.integrations.deepspeed.zero2.stock_norm import StockNorm
from flatgrad.layout import Layout
from flatgrad.testing.placement import DeviceMixError, SameDevice

META, CPU = torch.device("meta"), torch.device("cpu")


def test_the_mode_refuses_what_cuda_refuses_and_passes_what_it_allows() -> None:
    with SameDevice(host=CPU):
        host = torch.ones(8)
        with pytest.raises(DeviceMixError):
            torch._foreach_mul_([host], torch.tensor(2.0, device=META))  # an accelerator scalar on host tensors
        with pytest.raises(DeviceMixError):
            torch.stack([torch.zeros((), device=META), torch.zeros(())])  # not elementwise: no scalar exception
        with pytest.raises(DeviceMixError):
            torch.zeros(3, dtype=torch.float64, device=META).index_add_(0, torch.zeros(2, dtype=torch.long), host[:2].double())
        torch.empty(8, device=META).mul_(torch.tensor(2.0))  # a 0-dim host tensor is a scalar to the accelerator
        host.to(META)  # copies cross


def _stock_norm(world_size: int = 2) -> tuple[StockNorm, list[int]]:
    """Two sub-groups split from one param group of five tensors, as flatgrad splits it."""
    params = [torch.empty(n) for n in (7, 12, 5, 9, 3)]
    subs = [params[:3], params[3:]]
    layouts = [Layout.flat([p.numel() for p in sub], world_size, 2) for sub in subs]
    return StockNorm([params], subs, layouts, 0, world_size, 2, host_root=True), [lay.shard_numel for lay in layouts]


def test_stock_norm_reads_host_partitions_where_they_are_and_sums_on_the_accelerator() -> None:
    """Offload: the plan's index follows the host partitions; the sums and the norm are on the accelerator."""
    plan, shard_numels = _stock_norm()
    host = [torch.randn(n) for n in shard_numels]
    expected = plan.partial_sums(host)
    with SameDevice(host=CPU):
        sums = plan.partial_sums(host, META)
        assert sums.device == META and plan.index.device == CPU
        assert plan.combine(sums, group=None).device == META  # 2 ranks: no collective
    assert torch.equal(plan.partial_sums(host, CPU), expected)


def test_group_norms_of_host_pieces_are_stacked_on_the_accelerator() -> None:
    with SameDevice(host=CPU):
        total = group_squared_norms([[torch.randn(5), torch.randn(2)], [], [torch.randn(3)]], META)  # empty: a zero
        assert total.device == META and total.shape == (3,)


@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
@pytest.mark.parametrize("norm", [5.0, float("inf"), float("nan"), -1.0])
def test_the_clip_scale_multiplies_the_host_gradients_on_the_host(loss_scale: float, norm: float) -> None:
    """The norm on the accelerator (``cpu`` here, with data), the offloaded gradients on the host (``meta``)."""
    with SameDevice(host=META) as mode:
        grads = [torch.empty(10, device=META), torch.empty(3, device=META)]
        unscale_and_clip_(grads, torch.tensor(norm), clip_grad=1.0, loss_scale=loss_scale)
    muls = [devices for op, devices in mode.ops if op is torch.ops.aten._foreach_mul_.Tensor]
    assert muls == [("meta",)], mode.ops


@pytest.mark.parametrize("norm", [7.25, float("inf"), float("nan"), -1.0])
def test_the_clip_scale_is_stocks_arithmetic(norm: float) -> None:
    """Stock's ``unscale_and_clip_grads``: an invalid norm clips as an infinite one; the products bitwise."""
    grads = [torch.full((4,), 3.0), torch.full((2,), -1.5)]
    clip_norm = torch.tensor(norm if norm == norm and 0 <= norm < float("inf") else float("inf"))
    combined = torch.clamp(((clip_norm / 2.0) + 1e-6) / 0.5, min=1.0) * 2.0
    expected = [g * (1.0 / combined) for g in grads]
    unscale_and_clip_(grads, torch.tensor(norm), clip_grad=0.5, loss_scale=2.0)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))


def test_group_norms_equal_stocks_per_piece_norms() -> None:
    from deepspeed.runtime.zero.utils import get_norm_dtype

    gen = torch.Generator().manual_seed(0)
    groups = [[torch.randn(5, generator=gen), torch.randn(2, generator=gen)], [], [torch.randn(3, generator=gen)]]
    norm_dtype = get_norm_dtype()
    expected = [
        torch.stack([torch.linalg.vector_norm(g.to(norm_dtype), 2.0) for g in grads]).pow(2.0).sum().float()
        if grads else torch.zeros(())
        for grads in groups
    ]  # fmt: skip
    assert torch.equal(group_squared_norms(groups, CPU), torch.stack(expected))
