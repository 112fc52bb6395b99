"""The check's figures and summary: what each finished step measured, and the summary text and JSON."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from .plan import Context, Step

__all__ = [
    "last_json", "pytest_figures", "bench_figures", "zero_figures", "offload_figures", "qgz_figures", "stock_text",
    "figures", "step_line", "summary_text", "write_summary",
]  # fmt: skip


def last_json(output: str) -> dict | None:
    """The last line of ``output`` that is a JSON object (None when there is none)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def pytest_figures(output: str) -> dict[str, Any]:
    """A pytest run's counts, skip reasons and failures, read from its ``-q -rfEs`` output."""
    counts = {}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", summary[-1]):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"counts": counts, "skipped": skips[:20], "failures": failures[:20]}


def bench_figures(path: str, device: str = "cuda") -> dict[str, Any]:
    """Per case and backend: GB/s and the ratios to the roofline (d), ``_chunk_cat`` (c) and DeepSpeed (a).

    Read from ``flatgrad bench --out`` JSON, transformer bucket, chunked layout, median times; ``x_deepspeed``
    is taken from the row doing DeepSpeed's work (the 1/W pre-divide) where there is one.
    """
    with open(path) as f:
        doc = json.load(f)
    cases: dict[str, Any] = {}
    for row in doc["results"]:
        if row["device"] != device or row["bucket"] != "transformer":
            continue
        case = cases.setdefault(row["case"], {"backends": {}})
        if row["role"] in ("a", "c", "d"):
            case[{"a": "deepspeed_zero3_gbps", "c": "chunk_cat_gbps", "d": "roofline_gbps"}[row["role"]]] = round(
                row["gbps_median"], 1
            )
        if row["role"] != "flatgrad" or row["layout"] != "chunked":
            continue
        entry = case["backends"].setdefault(row["backend"], {})
        if row["method"] in ("flatgrad.pack", "flatgrad.unpack -> 1 out") and row["scale"] == 1.0:
            entry.update(gbps=round(row["gbps_median"], 1), x_roofline=row["x_roofline_median"],
                         x_chunk_cat=row.get("x_chunk_cat_median"))  # fmt: skip
            entry.setdefault("x_deepspeed", row["x_ds_median"])
        if row["scale"] != 1.0:  # the 1/W pre-divide: the same work as DeepSpeed's cat + div
            entry["x_deepspeed"] = row["x_ds_median"]
    return {"gpu": doc["machine"].get("gpu"), "bucket": doc["buckets"].get("transformer"), "cases": cases}


def zero_figures(path: str) -> dict[str, Any]:
    """The pairs' verdicts and each setup's losses and memory, from ``python -m flatgrad.check.zero_step --out`` JSON."""
    with open(path) as f:
        doc = json.load(f)
    setups = {
        key: {k: s.get(k) for k in ("ok", "model", "allocated_after_build", "max_memory_allocated", "losses", "error")}
        for key, s in doc["setups"].items()
    }
    return {"world_size": doc["world_size"], "gpu": doc["gpu"], "pairs": doc["pairs"], "setups": setups}


def offload_figures(path: str) -> dict[str, Any]:
    """Each offload config's verdict, losses and peak memory, from ``flatgrad.check.zero_offload --out`` JSON."""
    with open(path) as f:
        doc = json.load(f)
    return {"device": doc["device"], "gpu": doc.get("gpu"), "ok": doc["ok"], "configs": doc["configs"]}


def qgz_figures(path: str) -> dict[str, Any]:
    """The cases' errors and bytes and stock's status, from ``python -m flatgrad.check.qgz --out`` JSON."""
    with open(path) as f:
        doc = json.load(f)
    keep = ("device", "local_size", "bucket", "block", "stock", "stock_formula", "cases", "failures", "ok")
    return {k: doc[k] for k in keep if k in doc}


def stock_text(doc: dict) -> str:
    """``stock qgZ ...`` of a qgz step's figures: its error in the largest case, or why it was not measured."""
    cases = doc.get("cases") or {}
    if cases:
        label, case = list(cases.items())[-1]
        stock = case.get("stock_qgz_int4") or {}
        if stock.get("measured"):
            return f"stock qgZ {label}: rel rms {stock['rel_rms']:.2e}, max abs {stock['max_abs']:.3g}"
        if stock.get("reason"):
            return f"stock qgZ: not measured: {stock['reason']}"
    return f"stock qgZ: not measured: {(doc.get('stock') or {}).get('reason') or 'not reached'}"


def _qgz_note(figures: dict) -> str:
    label, case = list(figures["cases"].items())[-1]
    modes = ", ".join(f"{m} rel rms {e['rel_rms']:.2e}{'' if e['ok'] else ' BEYOND BOUND'}"
                      for m, e in case["flatgrad"].items())  # fmt: skip
    return f"{label}: {modes}, bf16 2d {case['2d_reduce_scatter_bf16']['rel_rms']:.2e}; {stock_text(figures)}"


def figures(step: Step, record: dict, ctx: Context) -> dict[str, Any]:
    """What a finished step measured, read from its output or its JSON (empty when there is none)."""
    output = record.get("output", "")
    try:
        if step.kind == "pytest":
            return pytest_figures(output)
        if step.kind == "bench":
            return bench_figures(os.path.join(ctx.out, "bench.json"))
        if step.report == "zero_step.json":
            return zero_figures(os.path.join(ctx.out, step.report))
        if step.report == "zero_offload.json":
            return offload_figures(os.path.join(ctx.out, step.report))
        if step.report == "qgz.json":
            return qgz_figures(os.path.join(ctx.out, step.report))
        if step.kind == "module":
            return last_json(output) or {}
    except (OSError, KeyError, ValueError, TypeError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
    return {}


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def step_line(r: dict) -> str:
    """One step's line of the summary: name, status, wall time and a note."""
    figures = r.get("figures") or {}
    note = r.get("reason", "")
    if r["name"] == "build" and r["status"] == "passed":
        note = f"{'cached' if r.get('cached') else 'compiled'}, TORCH_CUDA_ARCH_LIST={r.get('arch_list')}"
    elif "counts" in figures:
        note = ", ".join(f"{n} {what}" for what, n in figures["counts"].items()) or "no pytest summary line"
    elif figures.get("pairs"):
        note = ", ".join(f"{p['pair']} losses {'match' if p['losses_match'] else 'DIFFER'}" for p in figures["pairs"])
    elif figures.get("configs"):
        matched = sum(bool(c.get("ok")) for c in figures["configs"])
        note = f"{matched} of {len(figures['configs'])} configs match stock"
    elif r["name"] == "qgz" and figures.get("cases"):
        note = _qgz_note(figures)
    elif "cases" in figures and "failures" in figures:
        note = f"{figures['cases']} cases, {len(figures['failures'])} failed"
    elif r["name"] == "env" and figures:
        gpus = figures.get("gpus") or []
        note = (f"{len(gpus)} x {gpus[0]['name'] if gpus else '-'}, torch {figures.get('torch')}, "
                f"deepspeed {figures.get('deepspeed')}")  # fmt: skip
    if not note and r["status"] in ("failed", "timeout", "interrupted"):
        note = next((line.strip() for line in reversed(r.get("tail", "").splitlines()) if line.strip()), "")[:160]
    wall = f"{r['wall_s']:7.1f} s" if "wall_s" in r else " " * 9
    return f"  {r['name']:<13} {r['status']:<8} {wall}  {note}"


def summary_text(doc: dict) -> str:
    """The summary as text: one line per step, the bench ratios, the ZeRO steps, then every failure's tail."""
    lines = [f"flatgrad check {doc['started']}, {'quick, ' if doc['quick'] else ''}budget {doc['budget_s']:g} s, "
             f"wall {doc['wall_s']:.0f} s: {'ALL PASSED' if doc['ok'] else 'FAILURES'}", ""]  # fmt: skip
    lines += [step_line(r) for r in doc["steps"]]
    steps = {r["name"]: r for r in doc["steps"]}
    bench = (steps.get("bench") or {}).get("figures") or {}
    if bench.get("cases"):
        numel = (bench.get("bucket") or {}).get("numel", 0)
        lines += ["", f"pack/unpack, transformer bucket ({numel:,} elements), median GB/s and ratios: x(d) to the "
                  "copy roofline, x(c) to torch._chunk_cat, x(a) to DeepSpeed ZeRO-3"]  # fmt: skip
        for case, c in bench["cases"].items():
            lines.append(f"  {case}: (d) {c.get('roofline_gbps')} GB/s, (c) {c.get('chunk_cat_gbps', '-')} GB/s, "
                         f"(a) {c.get('deepspeed_zero3_gbps')} GB/s")  # fmt: skip
            for backend, b in c["backends"].items():
                ratios = "  ".join(f"x({tag}) {_fmt_ratio(b.get(key))}" for tag, key in
                                   (("d", "x_roofline"), ("c", "x_chunk_cat"), ("a", "x_deepspeed")))  # fmt: skip
                lines.append(f"    {backend:<7} {b.get('gbps', '-'):>8} GB/s  {ratios}")
    zero = (steps.get("zero-step") or {}).get("figures") or {}
    if zero.get("setups"):
        where = f"{zero['world_size']} x {zero['gpu'] or 'CPU'}"
        lines += ["", f"ZeRO steps on {where}: peak torch.cuda.max_memory_allocated"]
        for key, s in zero["setups"].items():
            if s["ok"]:
                peak = s["max_memory_allocated"]
                peak_text = f"{peak / 2**20:9.1f} MiB" if peak is not None else "        - MiB"
                lines.append(f"  {key:<15} {s['model']:<9} peak {peak_text}  "
                             f"losses rank 0: {' '.join(f'{x:.6g}' for x in s['losses'][0])}")  # fmt: skip
            else:
                lines.append(f"  {key:<15} FAILED: {(s.get('error') or '').splitlines()[0][:300]}")
        for p in zero["pairs"]:
            if p["max_rel_loss_diff"] is not None:
                lines.append(f"  {p['pair']}: losses {'match' if p['losses_match'] else 'DIFFER'} "
                             f"(max rel diff {p['max_rel_loss_diff']:.2e}), peak memory flatgrad/stock "
                             f"{_fmt_ratio(p['memory_ratio'])}")  # fmt: skip
    offload = (steps.get("zero-offload") or {}).get("figures") or {}
    if offload.get("configs"):
        lines += ["", f"ZeRO offload, stock against flatgrad on {offload.get('gpu') or offload.get('device')}: "
                  "losses, peak torch.cuda.max_memory_allocated"]  # fmt: skip
        for c in offload["configs"]:
            if c.get("error"):
                lines.append(f"  {c['name']:<34} FAILED: {c['error'].splitlines()[0][:300]}")
                continue
            peaks = c.get("peak") or {}
            memory = "  ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in peaks.items() if v is not None)
            lines.append(f"  {c['name']:<34} {'match' if c['ok'] else 'DIFFER'} (max rel diff "
                         f"{c['max_rel_diff']:.2e}, rtol {c['rtol']:g}){'  ' + memory if memory else ''}")  # fmt: skip
    qgz = (steps.get("qgz") or {}).get("figures") or {}
    if qgz.get("cases"):
        lines += ["", f"qgZ on {qgz.get('device')}, simulated ranks ({qgz['bucket']['numel']:,} elements a rank): "
                  "relative RMS error against the fp64 sum; send bytes a rank, node + rail"]  # fmt: skip
        for label, case in qgz["cases"].items():
            b = case["bytes"]
            sizes = "  ".join(f"{m} {v['node'] + v['rail']:,} B" for m, v in b.items())
            errs = "  ".join(f"{m} {e['rel_rms']:.2e}" for m, e in case["flatgrad"].items())
            stock = case.get("stock_qgz_int4") or {}
            stock_err = f"{stock['rel_rms']:.2e}" if stock.get("measured") else "not measured"
            lines.append(f"  {label}: {errs}  2d_reduce_scatter_bf16 {case['2d_reduce_scatter_bf16']['rel_rms']:.2e}  "
                         f"stock_qgz_int4 {stock_err}")  # fmt: skip
            lines.append(f"    bytes: {sizes}")
        if not (qgz.get("stock") or {}).get("measured"):
            lines.append(f"  stock qgZ: not measured: {(qgz.get('stock') or {}).get('reason')}")
    for r in doc["steps"]:
        if r["status"] in ("failed", "timeout", "interrupted"):
            lines += ["", f"--- {r['name']} {r['status']} (exit {r.get('rc')}); "
                      f"{r.get('reason') or 'last lines of its output'}:"]
            failures = (r.get("figures") or {}).get("failures") or []
            lines += [f"  {f}" for f in failures]
            lines += ["  " + line for line in r.get("tail", "").splitlines()]
    lines.append("")
    return "\n".join(lines)


def write_summary(doc: dict, out: str) -> None:
    """Write ``summary.json`` and ``summary.txt`` under ``out``."""
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary_text(doc))
