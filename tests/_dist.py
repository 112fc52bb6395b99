"""Run a function on W real processes joined in one gloo group on 127.0.0.1, for multi-rank tests.

The launcher itself lives in ``flatgrad/testing/launch.py`` (``flatgrad demo``
uses the same one); this module re-exports it and adds ``count_collectives``.

Usage::

    def _rank_fn(rank, world_size, n):          # module level, so it pickles by name
        ...                                     # torch.distributed is initialized here
        return some_picklable_result            # tensors must be on the CPU

    results = run_ranks(_rank_fn, 4, 1000, timeout=60)   # one result per rank

* The ranks are forked from a forkserver that has imported torch once (fast,
  and safe: the server never ran a kernel, so no OpenMP pool is forked).
* The rendezvous is a ``TCPStore`` this process opens on a free port (port 0),
  so there is no port race between tests.
* If a rank raises, ``run_ranks`` raises ``RankError`` with that rank's
  traceback (the first to fail), after giving the other ranks ``grace``
  seconds and killing whatever is left. It never waits past ``timeout``.
* A rank listed in ``may_exit`` may leave without a result (a test of a dead
  rank); its result is ``EXITED``.
* Every rank runs with ``threads`` intra-op threads (1 by default: the ranks
  share few cores).
* ``count_collectives()`` counts, inside a rank, the ``torch.distributed``
  collectives a block of code calls.

The forkserver is one per test session and shared with any other helper that
uses one (``tests/_ds.py`` does): whoever starts it first fixes its preload
list, which changes only how fast ranks start. A script (not a test) that
calls ``run_ranks`` needs the ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Callable, Iterator

import torch.distributed as dist

from flatgrad.testing.launch import EXITED, PRELOAD, RankError, run_ranks

__all__ = ["run_ranks", "RankError", "EXITED", "PRELOAD", "count_collectives", "COLLECTIVES"]


# Every collective entry point of torch.distributed, counted by ``count_collectives``.
COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "all_gather_object", "all_gather_coalesced", "broadcast",
    "broadcast_object_list", "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter",
    "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
    "batch_isend_irecv",
)  # fmt: skip


@contextlib.contextmanager
def count_collectives() -> Iterator[collections.Counter]:
    """Count calls to every ``torch.distributed`` collective made in the block, by name.

    Only outermost calls count (``reduce_scatter_tensor`` calling
    ``reduce_scatter_single`` is one call), and a coalesced group
    (``_coalescing_manager``) is one launch, counted as ``_coalescing_manager``
    and not by the calls in it; so is flatgrad's
    ``comm.all_gather_into_tensor_coalesced``, counted under its name. Use inside a rank: the wrappers
    patch this process's ``torch.distributed`` module and are removed on exit.
    """
    counts: collections.Counter = collections.Counter()
    depth = [0]
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    coalescing = dist._coalescing_manager

    @contextlib.contextmanager
    def coalesced(*args: Any, **kwargs: Any) -> Iterator[Any]:
        # One launch for the whole group: counted once, the calls inside it not at all.
        if depth[0] == 0:
            counts["_coalescing_manager"] += 1
        depth[0] += 1
        try:
            with coalescing(*args, **kwargs) as manager:
                yield manager
        finally:
            depth[0] -= 1

    from flatgrad import comm

    flatgrad_gather = comm.all_gather_into_tensor_coalesced
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    dist._coalescing_manager = coalesced
    comm.all_gather_into_tensor_coalesced = wrap("all_gather_into_tensor_coalesced", flatgrad_gather)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        dist._coalescing_manager = coalescing
        comm.all_gather_into_tensor_coalesced = flatgrad_gather
