"""Reports of collective schedules: summaries, a text table, JSON, and a PNG chart."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from .cost import FLAT_MODES, CostModel
from .memory import GradientPathMemory
from .models import ModelSpec
from .schedule import Schedule, size_histogram

__all__ = ["summarize", "text_report", "json_report", "plot", "mode_rows", "modes_text", "modes_plot"]


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
    (``flatgrad.planner.memory``).
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
            "are equal for all schedules and left out; formulas in flatgrad/planner/memory.py, measured by bench/memory.py)"
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


# --------------------------------------------------------------------------- reduction modes

ModeRuns = Sequence[tuple[int, Sequence[Schedule]]]


def mode_rows(runs: ModeRuns, cost: CostModel) -> list[dict[str, Any]]:
    """One row per (world size, mode schedule): bytes, alpha and bandwidth terms, times, ratio to reduce_scatter.

    ``time_s`` adds the calls in series; ``overlapped_s`` lets the intra-node calls
    of a hierarchical mode run beside its inter-node calls (bucket k's rail stage
    under bucket k+1's node stage: the larger of the two sums), a lower bound.
    """
    rows = []
    for world_size, schedules in runs:
        base = next((s for s in schedules if s.key in ("flatgrad_zero2", "flatgrad_zero3")), None)
        base_time = cost.schedule_time(base) if base is not None and not base.unavailable else None
        for s in schedules:
            mode = s.key.removeprefix("flatgrad_zero2").removeprefix("flatgrad_zero3").removeprefix("_") or "reduce_scatter"
            row: dict[str, Any] = {"world_size": world_size, "mode": mode, "unavailable": s.unavailable}
            if not s.unavailable:
                intra = sum(cost.time(c) for c in s.calls if cost.nodes(c.group) <= 1)
                inter = sum(cost.time(c) for c in s.calls if cost.nodes(c.group) > 1)
                time_s = cost.schedule_time(s)
                row.update(
                    calls=len(s.calls), ops=dict(s.ops()), bytes_sent=cost.schedule_sent_bytes(s),
                    ib_bytes_sent=cost.schedule_inter_node_bytes(s), latency_s=cost.schedule_latency(s),
                    bandwidth_s=time_s - cost.schedule_latency(s), time_s=time_s, overlapped_s=max(intra, inter),
                    vs_reduce_scatter=time_s / base_time if base_time else None,
                )  # fmt: skip
            rows.append(row)
    return rows


def modes_text(spec: ModelSpec, runs: ModeRuns, cost: CostModel, config: Mapping[str, Any]) -> str:
    """``flatgrad plan --modes``: per world size, each reduction mode's flatgrad ZeRO-2 (or ZeRO-3) backward, and who
    wins."""
    lines = [
        f"flatgrad plan --modes: {spec.name}, {spec.numel:,} trainable parameters, flatgrad ZeRO-{config.get('stage', 2)}",
        "  " + ", ".join(f"{k} {v}" for k, v in config.items() if k != "stage"),
        f"  link model: NVLink {cost.nvlink_busbw_gbps:g} GB/s, IB {cost.ib_busbw_gbps:g} GB/s ring busbw / "
        f"{cost.ib_nic_gbps:g} GB/s per NIC, alpha {cost.alpha_us:g} us, hop {cost.nvlink_hop_us:g} us (NVLink) / "
        f"{cost.ib_hop_us:g} us (IB), {cost.gpus_per_node} GPUs per node",
    ]
    header = ("mode", "calls", "ops", "bytes sent", "IB bytes", "alpha", "bandwidth", "time", "overlapped", "vs RS")
    rows = mode_rows(runs, cost)
    for world_size, _ in runs:
        table = []
        for r in (r for r in rows if r["world_size"] == world_size):
            if r["unavailable"]:
                table.append((r["mode"], "-", "not possible: " + r["unavailable"]))
                continue
            table.append((
                r["mode"], str(r["calls"]), _ops(r["ops"]), _bytes(r["bytes_sent"]), _bytes(r["ib_bytes_sent"]),
                _time(r["latency_s"]), _time(r["bandwidth_s"]), _time(r["time_s"]), _time(r["overlapped_s"]),
                f"{r['vs_reduce_scatter']:.2f}x" if r["vs_reduce_scatter"] else "-",
            ))  # fmt: skip
        full = [t for t in table if len(t) == len(header)]
        widths = [max(len(t[i]) for t in [header, *full]) for i in range(len(header))]
        lines += ["", f"world size {world_size}"]
        lines.append("  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
        for t in table:
            if len(t) != len(header):
                lines.append(f"{t[0].ljust(widths[0])}  {t[1].rjust(widths[1])}  {t[2]}")
            else:
                lines.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))))
        ok = [r for r in rows if r["world_size"] == world_size and not r["unavailable"]]
        if ok:
            best = min(ok, key=lambda r: r["time_s"])
            flat = min((r for r in ok if r["mode"] in FLAT_MODES), key=lambda r: r["time_s"])
            lines.append(
                f"fastest: {best['mode']} ({_time(best['time_s'])}); "
                f"fastest flat mode (what the reducer runs): {flat['mode']} ({_time(flat['time_s'])})"
            )
    lines.append(
        "bytes sent / IB bytes: per rank per backward (IB: to other nodes, averaged over the group); "
        "alpha / bandwidth: the latency and byte terms of time (calls in series); overlapped: a hierarchical mode's node and rail stages "
        "of different buckets at once (lower bound); vs RS: time / reduce_scatter's. fp8 moves int8's bytes. "
        "Model: [Note: all_to_all cost] in docs/design.md"
    )
    return "\n".join(lines) + "\n"


def modes_plot(path: str, spec: ModelSpec, runs: ModeRuns, cost: CostModel) -> None:
    """A PNG: modelled time of each mode against world size (series and overlapped), and its ratio to reduce_scatter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in mode_rows(runs, cost) if not r["unavailable"]]
    fig, (ax_time, ax_ratio) = plt.subplots(1, 2, figsize=(14, 5.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        if mode == "fp8":  # int8's bytes, int8's time
            continue
        mine = [r for r in rows if r["mode"] == mode]
        ws = [r["world_size"] for r in mine]
        style = "-" if mode in FLAT_MODES else "--"
        (line,) = ax_time.plot(ws, [r["time_s"] * 1e3 for r in mine], style, marker="o", label=mode)
        ax_ratio.plot(ws, [r["vs_reduce_scatter"] for r in mine], style, marker="o", color=line.get_color(), label=mode)
        if style == "--":
            ax_ratio.plot(ws, [r["overlapped_s"] / r["time_s"] * r["vs_reduce_scatter"] for r in mine], ":",
                          color=line.get_color(), label=f"{mode}, overlapped")  # fmt: skip
    for ax in (ax_time, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"data-parallel ranks ({cost.gpus_per_node} per node)")
        ax.axvline(cost.gpus_per_node, color="0.7", linewidth=0.8)
    ax_time.set_yscale("log")
    ax_time.set_ylabel("modelled reduction time per backward (ms), calls in series")
    stage = 3 if runs and runs[0][1] and runs[0][1][0].key.startswith("flatgrad_zero3") else 2
    ax_time.set_title(f"{spec.name}, flatgrad ZeRO-{stage}: reduction modes on the modelled NCCL cluster")
    ax_ratio.axhline(1.0, color="k", linewidth=0.8)
    ax_ratio.set_yscale("log")
    ax_ratio.set_ylabel("time / reduce_scatter's (below 1: the mode wins)")
    ax_ratio.set_title("against reduce_scatter")
    ax_time.legend(fontsize=8)
    ax_ratio.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
