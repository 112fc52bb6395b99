"""flatgrad.integrations.deepspeed.zero2.scheduler_state: an LR scheduler's per-group lists across the sub-groups."""

from __future__ import annotations

import pytest
import torch

from flatgrad.integrations.deepspeed.config import UnsupportedConfigError
from flatgrad.integrations.deepspeed.zero2.scheduler_state import SchedulerState

ORIGINS = [0, 0, 1, 1, 1]  # five sub-groups split from two groups


def _optimizer(rates: list[float]) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in rates], lr=1.0)


def test_a_stock_state_loads_into_the_sub_groups_and_saves_back_per_group():
    stock = torch.optim.lr_scheduler.LambdaLR(_optimizer([0.1, 0.2]), lambda step: 0.5**step)
    stock.step()
    stock.step()
    saved = stock.state_dict()
    sub = torch.optim.lr_scheduler.LambdaLR(_optimizer([0.1, 0.1, 0.2, 0.2, 0.2]), lambda step: 0.5**step)
    state = SchedulerState(sub, ORIGINS, 2, collapse=True)
    sub.load_state_dict(saved)
    assert sub.base_lrs == [0.1, 0.1, 0.2, 0.2, 0.2] and sub.last_epoch == 2
    sub.step()
    stock.step()
    assert [g["lr"] for g in sub.optimizer.param_groups] == [stock.optimizer.param_groups[g]["lr"] for g in ORIGINS]
    back = sub.state_dict()
    assert back == stock.state_dict(), (back, stock.state_dict())
    assert "state_dict" not in back and "load_state_dict" not in back  # the wrappers are not saved
    state.collapse = False
    assert sub.state_dict()["base_lrs"] == [0.1, 0.1, 0.2, 0.2, 0.2]


def test_sub_groups_that_disagree_are_refused_naming_the_key():
    sub = torch.optim.lr_scheduler.StepLR(_optimizer([0.1, 0.3, 0.2, 0.2, 0.2]), step_size=2)
    SchedulerState(sub, ORIGINS, 2, collapse=True)
    with pytest.raises(UnsupportedConfigError, match=r"'base_lrs'.*param group 0.*sub-groups 0 and 1"):
        sub.state_dict()


def test_nested_schedulers_are_converted_and_other_lists_left_alone():
    def sequential(opt):
        first = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        second = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return torch.optim.lr_scheduler.SequentialLR(opt, [first, second], milestones=[2])

    stock = sequential(_optimizer([0.1, 0.2]))
    for _ in range(3):
        stock.step()
    sub = sequential(_optimizer([0.1, 0.1, 0.2, 0.2, 0.2]))
    SchedulerState(sub, ORIGINS, 2, collapse=True)
    sub.load_state_dict(stock.state_dict())
    assert sub._schedulers[1].base_lrs == [0.1, 0.1, 0.2, 0.2, 0.2]
    assert sub._milestones == [2]  # a list of another meaning, of any length, stays as it is
    assert sub.state_dict()["_schedulers"] == stock.state_dict()["_schedulers"]


def test_without_a_split_nothing_changes():
    sched = torch.optim.lr_scheduler.StepLR(_optimizer([0.1, 0.2]), step_size=2)
    SchedulerState(sched, [0, 1], 2, collapse=True)
    assert sched.state_dict()["base_lrs"] == [0.1, 0.2]
