"""Reports of collective schedules: summaries, a text table, JSON, and a PNG chart."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from .cost import CostModel
from .memory import GradientPathMemory
from .models import ModelSpec
from .schedule import Schedule, size_histogram

__all__ = ["summarize", "text_report", "json_report", "plot"]


Memory = Mapping[tuple[int, str], GradientPathMemory]


def summarize(
    schedule: Schedule, cost: CostModel, calls: bool = True, memory: GradientPathMemory | None = None
) -> dict[str, Any]:
    """One schedule's figures (and, with ``calls``, every call) as plain data."""
    sizes = sorted(c.nbytes for c in schedule.calls)
    out: dict[str, Any] = {
        "name": schedule.name,
        "key": schedule.key,
        "world_size": schedule.world_size,
        "rank": schedule.rank,
        "note": schedule.note,
        "unavailable": schedule.unavailable,
        "calls": len(schedule.calls),
        "ops": dict(schedule.ops()),
        "numel": schedule.numel,
        "payload_numel": schedule.payload,
        "bytes": schedule.nbytes,
        "bytes_sent": cost.schedule_sent_bytes(schedule),
        "padding_overhead": schedule.padding_overhead,
        "time_s": cost.schedule_time(schedule),
        "smallest_bytes": sizes[0] if sizes else 0,
        "median_bytes": statistics.median(sizes) if sizes else 0,
        "largest_bytes": sizes[-1] if sizes else 0,
        "histogram": [list(b) for b in size_histogram(schedule.calls)],
    }
    if memory is not None:
        out["gradient_path_bytes"] = {"between": memory.between, "peak": memory.peak}
    if calls:
        out["call_list"] = [
            [c.op, c.numel, str(c.dtype).replace("torch.", ""), c.dst, [c.group.start, c.group.stop, c.group.step], c.payload]
            for c in schedule.calls
        ]
    return out


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _ops(ops: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) or "-"


def text_report(
    spec: ModelSpec,
    runs: Sequence[tuple[int, Sequence[Schedule]]],
    cost: CostModel,
    config: Mapping[str, Any],
    memory: Memory | None = None,
) -> str:
    """A plain-text table per world size, then each schedule's call-size histogram.

    Columns: calls per backward, the ops, call sizes (smallest, median, largest),
    the bytes the simulated rank sends, padding as a share of the gradient
    elements, the modelled time of the calls in series (``cost``), and with
    ``memory`` the gradient path's bytes per rank between steps / at the peak
    (``flatgrad.plan.memory``).
    """
    lines = [
        f"flatgrad plan: {spec.name}, {spec.numel:,} trainable parameters, backward order {spec.order_source}",
        "  " + ", ".join(f"{k} {v}" for k, v in config.items()),
        f"  link model: NVLink {cost.nvlink_busbw_gbps:g} GB/s, IB {cost.ib_busbw_gbps:g} GB/s, alpha {cost.alpha_us:g} us, "
        f"hop {cost.nvlink_hop_us:g} us (NVLink) / {cost.ib_hop_us:g} us (IB), {cost.gpus_per_node} GPUs per node",
    ]
    header = ("schedule", "calls", "ops", "smallest", "median", "largest", "bytes sent", "padding", "time", "grad mem")
    for world_size, schedules in runs:
        rows = []
        for s in schedules:
            f = summarize(s, cost, calls=False)
            if s.unavailable:
                rows.append((s.name, "-", "not possible: " + s.unavailable, "", "", "", "", "", "", ""))
                continue
            rows.append((
                s.name, str(f["calls"]), _ops(f["ops"]), _bytes(f["smallest_bytes"]), _bytes(f["median_bytes"]),
                _bytes(f["largest_bytes"]), _bytes(f["bytes_sent"]), f"{100 * f['padding_overhead']:.3f}%",
                _time(f["time_s"]), _memory_cell(memory, world_size, s.key),
            ))  # fmt: skip
        widths = [max(len(r[i]) for r in [header, *rows] if not (r[1] == "-" and i >= 2)) for i in range(len(header))]
        lines += ["", f"world size {world_size}"]
        lines.append("  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        for r in rows:
            if r[1] == "-":
                lines.append(f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2]}")
            else:
                lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        lines.append("call sizes (power-of-two byte bins, lower bound: count)")
        for s in schedules:
            if s.calls:
                bins = ", ".join(f"{_bytes(lo)}: {n}" for lo, _, n in size_histogram(s.calls))
                lines.append(f"  {s.name}: {bins}")
    if memory:
        lines.append(
            "grad mem: the gradient path's bytes per rank, between steps / at the peak (model states and activations "
            "are equal for all schedules and left out; formulas in flatgrad/plan/memory.py, measured by bench/memory.py)"
        )
    return "\n".join(lines) + "\n"


def _memory_cell(memory: Memory | None, world_size: int, key: str) -> str:
    m = memory.get((world_size, key)) if memory else None
    return "-" if m is None else f"{_bytes(m.between)} / {_bytes(m.peak)}"


def json_report(
    spec: ModelSpec,
    runs: Sequence[tuple[int, Sequence[Schedule]]],
    cost: CostModel,
    config: Mapping[str, Any],
    memory: Memory | None = None,
) -> dict[str, Any]:
    """Everything in the text report, plus every call, as JSON-ready data."""
    return {
        "model": {"name": spec.name, "trainable_numel": spec.numel, "params": len(spec.params), "order_source": spec.order_source},
        "config": dict(config),
        "cost_model": {k: getattr(cost, k) for k in cost.__dataclass_fields__},
        "world_sizes": [
            {"world_size": w, "schedules": [summarize(s, cost, memory=(memory or {}).get((w, s.key))) for s in schedules]}
            for w, schedules in runs
        ],
    }


def plot(path: str, spec: ModelSpec, runs: Sequence[tuple[int, Sequence[Schedule]]], cost: CostModel) -> None:
    """A PNG: per world size, calls per backward, modelled time, and the call-size distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 3, figsize=(16, 4.2 * len(runs)), squeeze=False)
    for row, (world_size, schedules) in enumerate(runs):
        shown = [s for s in schedules if not s.unavailable]
        names = [s.name.replace(", ", "\n") for s in shown]
        colors = ["#c44e52" if s.key.startswith("stock") else "#4c72b0" for s in shown]
        ax = axes[row][0]
        ax.bar(names, [len(s.calls) for s in shown], color=colors)
        ax.set_yscale("log")
        ax.set_title(f"{spec.name}, {world_size} ranks: collective calls per backward")
        ax = axes[row][1]
        ax.bar(names, [cost.schedule_time(s) * 1e3 for s in shown], color=colors)
        ax.set_title("modelled reduction time (ms), calls in series")
        ax = axes[row][2]
        for s in shown:
            if s.calls:
                sizes = sorted(c.nbytes for c in s.calls)
                ax.step(sizes, range(1, len(sizes) + 1), where="post", label=s.name)
        ax.set_xscale("log")
        ax.set_xlabel("call size (bytes)")
        ax.set_ylabel("calls up to this size")
        ax.set_title("call-size distribution")
        ax.legend(fontsize=7)
        for ax in axes[row][:2]:
            ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
