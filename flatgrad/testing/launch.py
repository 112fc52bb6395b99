"""Run a function on W real processes joined in one process group: the multi-rank tests, the benches, ``flatgrad demo``.

Usage::

    def _rank_fn(rank, world_size, n):          # module level, so it pickles by name
        ...                                     # torch.distributed is initialized here
        return some_picklable_result            # tensors must be on the CPU

    results = run_ranks(_rank_fn, 4, 1000, timeout=60)   # one result per rank

* The ranks are forked from a forkserver that has imported ``preload`` once
  (fast, and safe: the server never ran a kernel, so no OpenMP pool is
  forked). ``start_method="spawn"`` starts fresh interpreters instead; use it
  for CUDA ranks.
* The rendezvous is a ``TCPStore`` this process opens on a free port (port 0),
  so there is no port race between runs.
* If a rank raises, ``run_ranks`` raises ``RankError`` with that rank's
  traceback (the first to fail), after giving the other ranks ``grace``
  seconds and killing whatever is left. It never waits past ``timeout``, and
  it leaves no rank running, whatever ends it (an error, a timeout, Ctrl-C);
  on Linux a rank also dies with its parent process.
* A rank listed in ``may_exit`` may leave without a result (a test of a dead
  rank); its result is ``EXITED``.
* A rank may call ``send_message(obj)`` any number of times; the parent gets
  ``on_message(rank, obj)`` as they arrive (progress bars).
* Every rank runs with ``threads`` intra-op threads (1 by default: the ranks
  share few cores). With ``backend="nccl"`` rank r uses GPU ``r % device_count``.

The forkserver is one per parent process: whoever starts it first fixes its
preload list, which changes only how fast ranks start. It exits with the
parent. A script that calls ``run_ranks`` needs the ``if __name__ ==
"__main__":`` guard.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Collection, Sequence

import torch
import torch.distributed as dist

__all__ = ["run_ranks", "send_message", "RankError", "EXITED", "PRELOAD"]

# The store's timeout: ranks of a loaded machine may need a while to all arrive.
_RENDEZVOUS = timedelta(seconds=60)

# Modules the forkserver imports once when ``run_ranks`` gets no ``preload``; every rank is forked with them
# loaded. Callers may append to it before the first run of a process (tests/_ds.py adds DeepSpeed).
PRELOAD = ["torch", "torch.distributed", "flatgrad", "flatgrad.reducer"]

# This rank's end of its pipe to the parent, set in ``_rank_main`` (None in the parent).
_CONN: multiprocessing.connection.Connection | None = None


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


def _flatgrad_file() -> str:
    import flatgrad

    return os.path.abspath(flatgrad.__file__)


def _start_forkserver() -> None:
    """Start the forkserver (once per process) so that its preload imports this process's flatgrad.

    The server is ``python -c ...``, whose ``sys.path`` starts with its working
    directory, and CPython does not give it the parent's ``sys.path`` before it
    imports the preload list: started from a source checkout, it would import that
    unbuilt tree, not the installed package. So it starts in the directory that
    holds the parent's ``flatgrad``. Forked ranks then take the parent's
    ``sys.path`` and working directory back (``multiprocessing.spawn.prepare``).
    """
    from multiprocessing import forkserver

    cwd = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(_flatgrad_file())))
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(cwd)


def _context(start_method: str, preload: Sequence[str]) -> mp.context.BaseContext:
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preload))  # read only when the server starts (the first run in a process)
        _start_forkserver()
    return ctx


def _check_same_flatgrad(parent_file: str) -> None:
    """Raise unless this rank imported the parent's flatgrad (a source tree can shadow an installed package)."""
    mine = _flatgrad_file()
    if mine != parent_file:
        raise ImportError(
            f"this rank imported flatgrad from {mine}, but the process that started it uses {parent_file}; "
            "start it with the parent's sys.path (flatgrad.testing.launch.run_ranks does)"
        )


def _send(conn: multiprocessing.connection.Connection, status: str, payload: Any) -> None:
    # Plain pickle: multiprocessing's own pickler would pass tensors as shared-memory
    # handles served by this process, which may exit right after sending.
    conn.send_bytes(pickle.dumps((status, payload)))


def send_message(payload: Any) -> None:
    """From inside a rank: hand ``payload`` (picklable) to the parent's ``on_message``; a no-op elsewhere."""
    if _CONN is not None:
        _send(_CONN, "message", payload)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank when its parent (the forkserver, or the caller under spawn) exits.

    The forkserver exits when the caller does, so a caller killed without a
    chance to clean up (SIGKILL, or SIGTERM outside ``run_ranks``) takes its
    ranks along instead of leaving them blocked in a collective.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the prctl took effect
        os._exit(1)


def _rank_main(
    fn: Callable, rank: int, world_size: int, args: tuple, port: int, backend: str,
    pg_timeout: timedelta, threads: int, conn: multiprocessing.connection.Connection, parent_flatgrad: str,
) -> None:  # fmt: skip
    """A rank's body: join the group, run ``fn``, send ``("ok", result)`` or ``("error", traceback)``."""
    global _CONN
    _CONN = conn
    code = 0
    try:
        _die_with_parent()
        _check_same_flatgrad(parent_flatgrad)
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=max(pg_timeout, _RENDEZVOUS))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
        result = fn(rank, world_size, *args)
        _send(conn, "ok", result)
        # Leave together: a rank that exits early may reset sockets its peers still read.
        try:
            dist.barrier()
        except Exception:  # a peer is gone (dead-rank tests); the result is already sent
            pass
    except BaseException:  # noqa: BLE001 - everything travels to the parent
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
    start_method: str = "forkserver",
    preload: Sequence[str] | None = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes in one process group; results by rank.

    Args:
        fn: a module-level function (it is pickled by name).
        world_size: number of ranks.
        timeout: seconds until the whole run is abandoned (``TimeoutError``).
        pg_timeout: the default group's timeout (``init_process_group(timeout=...)``); it
            also bounds the group's rendezvous, so a test that needs a short timeout
            should make its own group (``dist.new_group(timeout=...)``) inside ``fn``.
        backend: the ``torch.distributed`` backend (``gloo``, or ``nccl``: one GPU per rank).
        may_exit: ranks allowed to end without a result (they get ``EXITED``).
        threads: intra-op threads per rank.
        grace: seconds the other ranks get after one fails, before they are killed.
        start_method: ``forkserver`` (fast; CPU ranks) or ``spawn`` (CUDA ranks).
        preload: modules the forkserver imports when it starts (default ``PRELOAD``).
        on_message: called in this process with ``(rank, payload)`` for every ``send_message``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    ctx = _context(start_method, PRELOAD if preload is None else preload)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=max(pg_timeout, _RENDEZVOUS))
    procs, conns = [], []
    finished = False
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, args, store.port, backend, pg_timeout, threads, send, _flatgrad_file()),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            send.close()
            procs.append(proc)
            conns.append(recv)
        results = _collect(procs, conns, timeout, set(may_exit), grace, on_message)
        finished = True
        return results
    finally:
        # Ranks that returned are leaving by themselves: give them ``grace`` seconds in all. After
        # a failure, a timeout or an interrupt the rest already had their grace: kill them now.
        deadline = time.monotonic() + (grace if finished else 0.0)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5)
        for conn in conns:
            conn.close()
        del store


def _collect(
    procs: list, conns: list, timeout: float, may_exit: set[int], grace: float,
    on_message: Callable[[int, Any], None] | None,
) -> list[Any]:  # fmt: skip
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
            if status == "message":
                if on_message is not None and failure is None:
                    on_message(rank, payload)
                continue
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
