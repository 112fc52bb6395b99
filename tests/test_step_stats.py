"""flatgrad.integrations.deepspeed.step_stats: reduced once per step, stale after an edit, forgotten with the window."""

from __future__ import annotations

import torch

from flatgrad.integrations.deepspeed.step_stats import StepStats


def test_the_stats_are_reduced_once_until_forgotten():
    calls = []

    def build() -> torch.Tensor:
        calls.append("build")
        return torch.tensor([4.0, 0.0])

    def all_reduce(t: torch.Tensor) -> None:
        calls.append("all_reduce")
        t.mul_(2)

    window = StepStats()
    assert window.nbytes == 0
    first = window.reduced(build, all_reduce)
    again = window.reduced(build, all_reduce)
    assert again is first and torch.equal(first, torch.tensor([8.0, 0.0]))
    assert calls == ["build", "all_reduce"]
    assert window.nbytes == 8
    window.forget()
    window.reduced(build, all_reduce)
    assert calls == ["build", "all_reduce"] * 2


def test_staleness_lasts_the_window():
    window = StepStats()
    window.mark_stale()
    window.forget()
    assert window.stale
    window.reset()
    assert not window.stale and window.nbytes == 0


def test_overflow_reads_the_nonfinite_count():
    assert StepStats.overflow(torch.tensor(1.0))
    assert not StepStats.overflow(torch.tensor(0.0))
