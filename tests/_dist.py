"""Run a function on W real processes joined in one gloo group on 127.0.0.1, for multi-rank tests.

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
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Collection, Iterator

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "RankError", "EXITED", "PRELOAD", "count_collectives", "COLLECTIVES"]

# The store's timeout: ranks of a loaded machine may need a while to all arrive.
_RENDEZVOUS = timedelta(seconds=60)

# Modules the forkserver imports once; every rank is forked with them loaded.
PRELOAD = ["torch", "torch.distributed", "flatgrad", "flatgrad.reducer"]


class _Exited:
    def __repr__(self) -> str:
        return "EXITED"


EXITED = _Exited()
"""The result of a rank in ``may_exit`` that ended without returning."""


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback.

    Attributes:
        rank: the rank that failed.
        remote_traceback: its formatted traceback.
    """

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read only when the server starts (the first run in a session)
    return ctx


def _send(conn: multiprocessing.connection.Connection, status: str, payload: Any) -> None:
    # Plain pickle: multiprocessing's own pickler would pass tensors as shared-memory
    # handles served by this process, which exits right after sending.
    conn.send_bytes(pickle.dumps((status, payload)))


def _rank_main(
    fn: Callable, rank: int, world_size: int, args: tuple, port: int, backend: str,
    pg_timeout: timedelta, threads: int, conn: multiprocessing.connection.Connection,
) -> None:  # fmt: skip
    """A rank's body: join the group, run ``fn``, send ``("ok", result)`` or ``("error", traceback)``."""
    code = 0
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=max(pg_timeout, _RENDEZVOUS))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        result = fn(rank, world_size, *args)
        _send(conn, "ok", result)
        # Leave together: a rank that exits early may reset sockets its peers still read.
        try:
            dist.barrier()
        except Exception:  # a peer is gone (dead-rank tests); the result is already sent
            pass
    except BaseException:  # noqa: BLE001 - everything travels to the test
        code = 1
        try:
            _send(conn, "error", traceback.format_exc())
        except Exception:
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip atexit/destructors of the forked interpreter


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout: timedelta = timedelta(seconds=30),
    backend: str = "gloo",
    may_exit: Collection[int] = (),
    threads: int = 1,
    grace: float = 5.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one process group; results by rank.

    Args:
        fn: a module-level function (it is pickled by name).
        world_size: number of ranks.
        timeout: seconds until the whole run is abandoned (``TimeoutError``).
        pg_timeout: the default group's timeout (``init_process_group(timeout=...)``); it
            also bounds the group's rendezvous, so a test that needs a short timeout
            should make its own group (``dist.new_group(timeout=...)``) inside ``fn``.
        backend: the ``torch.distributed`` backend.
        may_exit: ranks allowed to end without a result (they get ``EXITED``).
        threads: intra-op threads per rank.
        grace: seconds the other ranks get after one fails, before they are killed.
    """
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=max(pg_timeout, _RENDEZVOUS))
    procs, conns = [], []
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, args, store.port, backend, pg_timeout, threads, send),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            procs.append(proc)
            conns.append(recv)
        return _collect(procs, conns, timeout, set(may_exit), grace)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(grace)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        del store


def _collect(
    procs: list, conns: list, timeout: float, may_exit: set[int], grace: float
) -> list[Any]:
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    pending = set(range(world_size))
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout
    while pending:
        now = time.monotonic()
        if now >= deadline:
            if failure is not None:
                break
            raise TimeoutError(f"ranks {sorted(pending)} did not finish within {timeout}s")
        waitables = {conns[r]: r for r in pending}
        waitables.update({procs[r].sentinel: r for r in pending})
        for ready in mp.connection.wait(list(waitables), timeout=deadline - now):
            rank = waitables[ready]
            if rank not in pending:
                continue
            conn = conns[rank]
            if conn.poll():
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                except EOFError:
                    status, payload = "exit", None
            else:
                procs[rank].join(1)
                if procs[rank].exitcode is None:
                    continue  # the sentinel fired spuriously; the result comes next
                status, payload = "exit", None
            pending.discard(rank)
            if status == "ok":
                results[rank] = payload
            elif status == "error":
                if failure is None:
                    failure = (rank, payload)
                    deadline = min(deadline, time.monotonic() + grace)
            elif rank in may_exit:
                results[rank] = EXITED
            elif failure is None:
                procs[rank].join(5)
                failure = (rank, f"rank {rank} exited with code {procs[rank].exitcode} without a result")
                deadline = min(deadline, time.monotonic() + grace)
    if failure is not None:
        raise RankError(*failure)
    return results


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
    ``reduce_scatter_single`` is one call). Use inside a rank: the wrappers
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

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
