"""flatgrad.testing.launch, the multi-rank launcher: results by rank, failures with tracebacks, no leftovers."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from flatgrad.testing.launch import EXITED, RankError, run_ranks


def _sum_ranks(rank: int, world_size: int, offset: int) -> tuple:
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return rank, world_size, float(t), os.getpid()


@pytest.mark.timeout(60)
def test_results_come_back_by_rank():
    results = run_ranks(_sum_ranks, 3, 10, timeout=50)
    assert [r[:3] for r in results] == [(r, 3, 33.0) for r in range(3)]
    assert len({r[3] for r in results}) == 3 and os.getpid() not in {r[3] for r in results}


def _one_fails(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # blocks forever: rank 1 never arrives


@pytest.mark.timeout(60)
def test_a_failing_rank_raises_with_its_traceback_and_the_rest_are_killed():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_one_fails, 2, timeout=50, grace=1.0)
    assert info.value.rank == 1
    assert "ValueError: rank one says no" in str(info.value) and "_one_fails" in info.value.remote_traceback
    assert time.monotonic() - start < 30  # not the full timeout: the blocked rank was killed after the grace


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


@pytest.mark.timeout(60)
def test_timeout_kills_the_ranks():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3"):
        run_ranks(_sleeps, 2, timeout=3, grace=0.5)
    assert time.monotonic() - start < 20


def _exits(rank: int, world_size: int) -> str:
    if rank == 0:
        os._exit(3)
    return "stayed"


@pytest.mark.timeout(60)
def test_exits_without_a_result():
    assert run_ranks(_exits, 2, timeout=50, may_exit=(0,), grace=0.5) == [EXITED, "stayed"]
    with pytest.raises(RankError, match="rank 0 exited with code 3 without a result"):
        run_ranks(_exits, 2, timeout=50, grace=0.5)
