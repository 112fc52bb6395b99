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


def time_round_robin(
    runs: Sequence[Callable[[], None]], warmup: int, repeats: int, cuda: bool, settle: int = 1
) -> list[list[float]]:
    """Seconds per call of every ``run``, taking turns, after ``warmup`` calls each.

    Each of the ``repeats`` rounds gives every run ``settle`` untimed calls and
    then one timed call. Turns spread load from other processes over every run
    alike; the settling calls give every timed call the same cache state (its
    own data just touched), whatever ran before it. On CUDA each timed call
    sits between two CUDA events; the host synchronizes before each timed call
    and after the last one, never inside the timed region, so every call starts
    on an idle stream and its time includes any launch overhead the GPU waits on.
    """
    for run in runs:
        for _ in range(warmup):
            run()
    if cuda:
        events: list[list[tuple]] = [[] for _ in runs]
        for _ in range(repeats):
            for run, pairs in zip(runs, events):
                for _ in range(settle):
                    run()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()  # outside the timed region: the timed call starts on an idle stream
                start.record()
                run()
                end.record()
                pairs.append((start, end))
        torch.cuda.synchronize()
        return [[start.elapsed_time(end) / 1e3 for start, end in pairs] for pairs in events]
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


def min_median(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    """``(min, median)`` seconds of ``repeat`` calls of ``fn``, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)
