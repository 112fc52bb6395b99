"""flatgrad.bench._harness: what a CUDA timing queues, checked on CPU with a logging stand-in for torch.cuda."""

from __future__ import annotations

import torch

from flatgrad.bench import _harness


def test_cuda_timing_queues_calls_behind_a_calibrated_sleep(monkeypatch):
    """A CUDA timing is CALLS_PER_TIMING calls between two events, behind a sleep: the start event
    fires when the GPU reaches the first call, not when the host starts enqueueing."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            self.at = len(log)
            log.append("record")

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:  # ms: one per logged step between the two records
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(f"sleep {cycles}"))
    (times,) = _harness.time_round_robin([lambda: log.append("call")], warmup=1, repeats=2, cuda=True, settle=0)
    calls = _harness.CALLS_PER_TIMING
    assert len(times) == 2
    timed = log[-(2 * (calls + 4)) - 1 :]  # the two timings and the final sync
    for k in range(2):
        batch = timed[k * (calls + 4) : (k + 1) * (calls + 4)]
        assert batch[0] == "sync" and batch[1].startswith("sleep ") and int(batch[1].split()[1]) > 0, batch[:3]
        assert batch[2] == "record" and batch[-1] == "record", batch
        assert batch[3:-1] == ["call"] * calls
    # (calls + 1) log steps between the events, over `calls` calls, in seconds
    assert times == [(calls + 1) / 1e3 / calls] * 2
