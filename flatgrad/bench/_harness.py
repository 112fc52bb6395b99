"""What every benchmark shares: naming the machine, timing calls in turns, the optional plotting import."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import statistics
import time
from typing import Callable, Sequence

import torch

import flatgrad

__all__ = ["load_average", "machine_info", "machine_line", "time_round_robin", "require_matplotlib"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def load_average() -> float | None:
    """The 1-minute load average: other processes' share of the cores while measuring."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info() -> dict:
    """The machine the figures come from: CPU, cores, threads, torch, GPU, backend availability."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "flatgrad": flatgrad.__version__,
        "load_average_1min": load_average(),
        "backends": {
            name: {"available": s.available, "devices": list(s.devices), "reason": s.reason}
            for name, s in flatgrad.available_backends().items()
        },
    }


def machine_line(info: dict) -> str:
    """One line naming the machine, for tables and chart titles."""
    parts = [f"CPU: {info['cpu']} ({info['cpus_usable']} usable cores, {info['torch_threads']} torch threads)"]
    if info["gpu"]:
        parts.append(f"GPU: {info['gpu']} (CUDA {info['cuda']})")
    parts.append(f"torch {info['torch']}")
    loads = [info.get(k) for k in ("load_average_1min", "load_average_1min_end") if info.get(k) is not None]
    if loads:
        parts.append("load average " + " -> ".join(f"{x:.1f}" for x in loads))
    return "; ".join(parts)


CALLS_PER_TIMING = 20  # CUDA: calls between one pair of events; a call's time is their elapsed time / this


def _sleep_rate() -> float:
    """``torch.cuda._sleep`` cycles per second on the current device, measured with events."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(start.elapsed_time(end) / 1e3, 1e-6)


def _cover_cycles(runs: Sequence[Callable[[], None]], calls: int) -> int:
    """Sleep cycles that outlast the host's enqueueing of ``calls`` calls of the slowest run, twice over."""
    slowest = 0.0
    for run in runs:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        slowest = max(slowest, time.perf_counter() - start)
    torch.cuda.synchronize()
    return max(int(2 * slowest * _sleep_rate()), 100_000)


def _time_cuda_batch(run: Callable[[], None], calls: int, cycles: int) -> tuple:
    """Queue a calibrated sleep, then ``calls`` calls of ``run`` between two events; returns the events.

    The sleep keeps the stream busy while the host enqueues, so the start event fires only
    when the GPU reaches the first call and the calls then run back to back: the elapsed
    time is the kernels' alone, without the host's Python overhead or launch gaps.
    """
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    return start, end


def time_round_robin(
    runs: Sequence[Callable[[], None]], warmup: int, repeats: int, cuda: bool, settle: int = 1
) -> list[list[float]]:
    """Seconds per call of every ``run``, taking turns, after ``warmup`` calls each.

    Each of the ``repeats`` rounds gives every run ``settle`` untimed calls and
    then one timing. Turns spread load from other processes over every run
    alike; the settling calls give every timing the same cache state (its own
    data just touched), whatever ran before it. On the CPU a timing is one call.
    On CUDA it is ``CALLS_PER_TIMING`` calls between two CUDA events, queued
    behind a sleep calibrated to outlast the host's enqueueing of them (see
    ``_time_cuda_batch``): the time per call is the GPU's, not the host's.
    """
    for run in runs:
        for _ in range(warmup):
            run()
    if cuda:
        calls = CALLS_PER_TIMING
        cycles = _cover_cycles(runs, calls)
        events: list[list[tuple]] = [[] for _ in runs]
        for _ in range(repeats):
            for run, pairs in zip(runs, events):
                for _ in range(settle):
                    run()
                pairs.append(_time_cuda_batch(run, calls, cycles))
        torch.cuda.synchronize()
        return [[start.elapsed_time(end) / 1e3 / calls for start, end in pairs] for pairs in events]
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, spent in zip(runs, times):
            for _ in range(settle):
                run()
            start = time.perf_counter()
            run()
            spent.append(time.perf_counter() - start)
    return times


def require_matplotlib():
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming what to install."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or flatgrad[bench])") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def min_median(fn: Callable[[], object], repeat: int, cuda: bool = False) -> tuple[float, float]:
    """``(min, median)`` seconds of ``repeat`` calls of ``fn``, after one untimed warm-up call.

    With ``cuda``, each of the ``repeat`` figures is a CUDA timing as in ``time_round_robin``.
    """
    if cuda:
        (times,) = time_round_robin([fn], warmup=1, repeats=repeat, cuda=True, settle=0)
        return min(times), statistics.median(times)
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)
