"""Calls and bytes per stage of the two-stage reductions on real gloo ranks, beside what ``flatgrad plan`` models.

Each configuration runs ``W`` CPU ranks over gloo as ``N`` nodes of ``L`` (the
reducer's ``node_size``; the ranks share one machine, so the nodes are
simulated, the process groups are real). Per reduction mode one
``BucketReducer`` reduces the same fixed buckets (``align=2``, as under
DeepSpeed); one warm-up backward, then one backward is recorded with
``flatgrad.testing.collectives.CollectiveRecorder``. Every recorded call is put
in a stage by its group: ``node`` (all its ranks on one node), ``rail`` (one
rank per node) or ``flat`` (several nodes, several ranks on each).

Per rank and backward it reports, for each stage, the calls and the bytes the
rank sends (``sent_bytes``, the plan's ring / all_to_all rule), and the bytes
it sends to peers on another node, counted from the call's group: an
all_to_all's chunks for the peers elsewhere; a reduce_scatter's ring share when
its ring successor (the next rank of the group, in order) is elsewhere. A rail
call's peers are all elsewhere and a node call's none, so for the two-stage
modes the count does not depend on the collective's algorithm; for a flat call
over several nodes it assumes the ring. Figures are means over the ranks.

The same buckets are priced with ``flatgrad.planner.cost.reduction_calls``
(the plan's model of ``flatgrad plan --modes``, placed by the reducer's own
``topology.place_ranks``) for every rank, and ``CostModel.inter_node_bytes``
gives the plan's cross-node bytes; ``plan_match`` says whether every rank's
recorded calls (op, elements, dtype, group) equal the plan's, group by group in
issue order (collectives are matched per group; across groups the reducer
interleaves them), and the byte columns are printed side by side.
``overlapped`` says whether a bucket's node stage was issued before an earlier
bucket's rail stage: the stage overlap of [Note: two-stage reductions].

    python bench/hierarchical.py                 # 4 ranks as 2 x 2, 8 as 2 x 4 and 4 x 2
    python bench/hierarchical.py --out hier.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Sequence

import torch
from torch import nn

from ..kernels import DTYPE_NAMES
from ..planner.cost import FLAT_MODES, CostModel, reduction_call, reduction_calls
from ..planner.schedule import Collective
from ..reducer import BucketReducer, registry
from ..testing.collectives import Call, CollectiveRecorder, sent_bytes
from ..testing.launch import run_ranks

__all__ = ["CONFIGS", "MODES", "measure", "format_table", "main"]

CONFIGS = ((4, 2), (8, 4), (8, 2))  # (world size, node size)
MODES = registry.names()  # every mode: its counted calls and bytes against the plan
NUMELS = (3 * 4096, 4096, 1000, 50_000, 7, 30_000, 2048)  # odd sizes: params straddle the segments
BUCKETS = ((0, 1, 2), (3, 4), (5, 6))


def _rank(rank: int, world_size: int, node_size: int, modes: Sequence[str], comm_dtype: str, block: int) -> dict:
    """One rank: per mode, the calls of one recorded backward and the buckets' padded sizes."""
    os.environ.update(LOCAL_WORLD_SIZE=str(node_size), LOCAL_RANK=str(rank % node_size))  # what a launcher tells it
    params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
    buckets = [[params[i] for i in b] for b in BUCKETS]
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for mode in modes:
        reducer = BucketReducer(
            buckets, comm_dtype=DTYPE_NAMES[comm_dtype], reduction=mode, node_size=node_size, block=block, align=2,
            register_hooks=False,
        )  # fmt: skip
        recorder = CollectiveRecorder(deepspeed=False)
        for step in range(2):  # a warm-up backward, then the recorded one
            for p in params:
                p.grad = torch.randn(p.numel(), generator=gen)
            if step == 1:
                recorder.install()
            try:
                for p in reversed(params):
                    reducer.mark_ready(p)
                reducer.finish()
            finally:
                recorder.uninstall()
            reducer.zero_grad()
        out[mode] = {"calls": [tuple(c) for c in recorder.calls], "numels": [lay.numel for lay in reducer.layouts]}
    return out


def _stage(group: Sequence[int], node_size: int) -> str:
    nodes = {r // node_size for r in group}
    if len(nodes) == 1:
        return "node"
    return "rail" if len(nodes) == len(group) else "flat"


def _cross_node_bytes(op: str, nbytes: float, group: Sequence[int], rank: int, node_size: int) -> float:
    """Bytes ``rank`` sends to peers on other nodes in one call (see the module docstring)."""
    p = len(group)
    if p <= 1:
        return 0.0
    if op == "all_to_all":
        return nbytes / p * sum(1 for q in group if q // node_size != rank // node_size)
    successor = group[(list(group).index(rank) + 1) % p]
    return nbytes * (p - 1) / p if successor // node_size != rank // node_size else 0.0


def _per_group(calls: list[tuple]) -> dict[tuple, list[tuple]]:
    """The calls of each group in issue order: collectives are matched per group, not across groups."""
    out: dict[tuple, list[tuple]] = {}
    for call in calls:
        out.setdefault(call[3], []).append(call)
    return out


def _overlapped(calls: list[tuple], node_size: int) -> bool:
    """Whether a node stage was issued while an earlier bucket's rail stage was still to come."""
    node_calls = rail_calls = 0
    for call in calls:
        stage = _stage(call[3], node_size)
        node_calls += stage == "node"
        rail_calls += stage == "rail"
        if stage == "node" and node_calls > rail_calls + 1:
            return True
    return False


def _plan_calls(mode: str, numels: Sequence[int], dtype: torch.dtype, world_size: int, node_size: int, rank: int,
                block: int) -> list[Collective]:  # fmt: skip
    group = range(world_size)
    calls: list[Collective] = []
    for numel in numels:
        if mode in FLAT_MODES:
            calls.append(reduction_call(mode, numel, dtype, group, block))
        else:
            calls += reduction_calls(mode, numel, dtype, group, rank=rank, block=block, gpus_per_node=node_size,
                                     world_size=world_size)  # fmt: skip
    return calls


def measure(world_size: int, node_size: int, *, modes: Sequence[str] = MODES, comm_dtype: str = "bf16",
            block: int = 256, timeout: float = 300.0) -> list[dict]:  # fmt: skip
    """One row per mode: per-stage calls and bytes, cross-node bytes (counted and planned), plan agreement."""
    results = run_ranks(_rank, world_size, node_size, tuple(modes), comm_dtype, block, timeout=timeout)
    dtype = DTYPE_NAMES[comm_dtype]
    cost = CostModel(gpus_per_node=node_size)
    rows = []
    for mode in modes:
        stages: dict[str, dict[str, float]] = {}
        cross = planned_cross = 0.0
        match, overlapped = True, False
        for rank, out in enumerate(results):
            recorded = [
                (op.removeprefix("grad_"), numel, dtype_name, tuple(group))
                for _, op, numel, dtype_name, group, _, _ in out[mode]["calls"]
            ]  # fmt: skip
            plan = _plan_calls(mode, out[mode]["numels"], dtype, world_size, node_size, rank, block)
            planned = [(c.op, c.numel, str(c.dtype).replace("torch.", ""), tuple(c.group)) for c in plan]
            match &= _per_group(recorded) == _per_group(planned)
            overlapped |= _overlapped(recorded, node_size)
            planned_cross += sum(cost.inter_node_bytes(c) for c in plan)
            for call in out[mode]["calls"]:
                op, numel, dtype_name, group = call[1], call[2], call[3], tuple(call[4])
                nbytes = numel * getattr(torch, dtype_name).itemsize
                row = stages.setdefault(_stage(group, node_size), {"calls": 0, "bytes_sent": 0.0})
                row["calls"] += 1
                row["bytes_sent"] += sent_bytes(Call(*call), rank)
                cross += _cross_node_bytes(op.removeprefix("grad_"), nbytes, group, rank, node_size)
        ranks = len(results)
        for row in stages.values():
            row["calls"] /= ranks
            row["bytes_sent"] /= ranks
        rows.append({
            "world_size": world_size, "node_size": node_size, "nodes": world_size // node_size, "mode": mode,
            "comm_dtype": comm_dtype, "block": block, "buckets": len(BUCKETS), "stages": stages,
            "cross_node_bytes": cross / ranks, "plan_cross_node_bytes": planned_cross / ranks, "plan_match": match,
            "overlapped": overlapped,
        })  # fmt: skip
    base = next((r["cross_node_bytes"] for r in rows if r["mode"] == "2d_reduce_scatter"), None)
    for r in rows:
        r["cross_vs_2d"] = r["cross_node_bytes"] / base if base else None
    return rows


def format_table(rows: Sequence[dict]) -> str:
    """The rows as text, one line per configuration and mode."""
    header = f"{'W':>3} {'N x L':>6} {'mode':<18} {'node calls/bytes':>18} {'rail calls/bytes':>18} " \
             f"{'flat calls/bytes':>18} {'cross-node B':>13} {'plan':>13} {'vs 2d':>6} match overlap"  # fmt: skip
    lines = [header]
    for r in rows:
        cells = []
        for stage in ("node", "rail", "flat"):
            s = r["stages"].get(stage)
            cells.append(f"{s['calls']:g} / {s['bytes_sent']:,.0f}" if s else "-")
        ratio = f"{r['cross_vs_2d']:.3f}" if r["cross_vs_2d"] is not None else "-"
        lines.append(
            f"{r['world_size']:>3} {r['nodes']:>2} x {r['node_size']:<2} {r['mode']:<18} {cells[0]:>18} {cells[1]:>18} "
            f"{cells[2]:>18} {r['cross_node_bytes']:>13,.0f} {r['plan_cross_node_bytes']:>13,.0f} {ratio:>6} "
            f"{str(r['plan_match']):<5} {r['overlapped']}"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/hierarchical.py``: every configuration of ``CONFIGS``; prints the table, writes ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comm-dtype", choices=tuple(DTYPE_NAMES), default="bf16")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows = []
    for world_size, node_size in CONFIGS:
        rows += measure(world_size, node_size, comm_dtype=args.comm_dtype, block=args.block)
    print(format_table(rows), end="")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if all(r["plan_match"] for r in rows) else 1
