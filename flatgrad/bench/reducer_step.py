"""Backward + gradient reduction per step: flatgrad's BucketReducer against DDP's and stock ZeRO-2's patterns.

Question: on W gloo ranks with a transformer-like model (about 50M params), how
long does backward plus reduction take per step, and how much of it is the
reducer's own work (hooks, packing, unpacking, bookkeeping: everything outside
the collectives)? Target: flatgrad's own time <= 0.5x that of both baselines.

Methods, all on the same model, the same buckets (``build_buckets``, backward
order) and the same process, taking turns step by step after one shared forward:

* ``backward``: the hooks do nothing; the floor.
* ``flatgrad``: ``BucketReducer(register_hooks=False)``; the hook calls
  ``mark_ready``: one fused pack, one async reduce_scatter, one fused unpack
  into the rank's fp32 shard per bucket, then ``finish()``.
* ``ddp_allreduce``: DDP's reducer: each gradient is multiplied by 1/W into its
  bucket slot as it arrives (DDP fuses the division into that copy); a complete
  bucket (in bucket order) gets one async ``all_reduce``; at the end every
  param's slice is copied back into ``param.grad``.
* ``zero2_reduce``: stock DeepSpeed ZeRO-2 with ``use_multi_rank_bucket_allreduce:
  false``: each gradient is copied into the IPG bucket and freed; a complete
  bucket is divided by W in place, then gets one async ``dist.reduce`` per
  rank-run (a run of the bucket inside one rank's contiguous 1/W partition of
  all params, to that rank); at the end each rank copies its own runs into its
  fp32 partition.

Timing (wall clock, per rank, ``time.perf_counter``): ``total`` runs from the
start of ``backward()`` to the end of the epilogue (reduced gradients final).
``own`` is the time spent inside the hooks and the epilogue minus the time spent
inside ``torch.distributed`` calls and ``Work.wait()``; it is the reducer's own
work on the training thread. ``own_cpu`` is the same in the training thread's
CPU time (``time.thread_time``): it leaves out the time the thread waited for a
core, so it holds up on a loaded machine where wall time does not. A step's
``total`` is the slowest rank's, its ``own`` the mean over ranks. Ratios are taken step by step, then summarized by
median and min over steps.

Memory per method: ``peak`` during backward + reduction above what was live
before it, and ``held`` between steps, from flatgrad's counting CPU allocator.
See [Note: reducer memory] in docs/design.md.

Bytes sent per rank are modelled for bandwidth-optimal algorithms (ring): a
reduce_scatter of N elements sends (W-1)/W N, an all_reduce 2 (W-1)/W N, a
reduce of n elements about n (reduce-scatter, then a gather to the root).

Usage::

    python bench/reducer_step.py --quick                    # ~5M params, a few steps
    python bench/reducer_step.py --out results.json         # ~50M params, W=4
"""

from __future__ import annotations

import abc
import argparse
import json
import math
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import flatgrad
from flatgrad import comm
from flatgrad.reducer import BucketReducer, build_buckets
from flatgrad.testing.census import MemoryCensus
from flatgrad.testing.collectives import CollectiveRecorder
from flatgrad.testing.launch import run_ranks

METHODS = ("backward", "flatgrad", "ddp_allreduce", "zero2_reduce")
# The collectives timed and counted (each call once).
_TIMED = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor")


# --------------------------------------------------------------------------- model


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-shaped decoder: embeddings, ``layers`` pre-norm blocks, an untied output head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


SIZES = {
    "full": dict(vocab=12288, d=512, layers=12, heads=8, seq=64, batch=2, bucket_numel=6_250_000),
    "quick": dict(vocab=4096, d=256, layers=4, heads=4, seq=32, batch=2, bucket_numel=1_000_000),
}


# --------------------------------------------------------------------------- instrumentation


class _Clock:
    """Wall and thread-CPU seconds spent in hooks, and inside collectives (calls and waits), since the last reset."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.hook = self.comm = 0.0  # wall
        self.hook_cpu = self.comm_cpu = 0.0  # this thread's CPU time
        self.pack_cpu = self.unpack_cpu = 0.0  # flatgrad's kernels, this thread's CPU time


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


class _TimedWork:
    """A ``Work`` whose ``wait()`` time counts as collective time."""

    __slots__ = ("work", "clock")

    def __init__(self, work: Any, clock: _Clock) -> None:
        self.work, self.clock = work, clock

    def wait(self, *args: Any) -> Any:
        wall, cpu = _now()
        try:
            return self.work.wait(*args)
        finally:
            self.clock.comm += time.perf_counter() - wall
            self.clock.comm_cpu += time.thread_time() - cpu

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _time_collectives(clock: _Clock) -> None:
    """Route this process's ``torch.distributed`` collectives through ``clock``."""
    for name in _TIMED:
        if not hasattr(dist, name):
            continue
        fn = getattr(dist, name)

        def timed(*args: Any, _fn: Callable = fn, **kwargs: Any) -> Any:
            wall, cpu = _now()
            try:
                out = _fn(*args, **kwargs)
            finally:
                clock.comm += time.perf_counter() - wall
                clock.comm_cpu += time.thread_time() - cpu
            return _TimedWork(out, clock) if out is not None else None

        setattr(dist, name, timed)


def _time_plans(reducer: BucketReducer, clock: _Clock) -> None:
    """Count the CPU time of every bucket's pack and unpack plan on ``clock`` (the plans exist after one step)."""

    def timed(plan: Any, field: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return plan(*args, **kwargs)
            finally:
                setattr(clock, field, getattr(clock, field) + time.thread_time() - start)

        return call

    for b in reducer._buckets:
        b.pack_plan = timed(b.pack_plan, "pack_cpu")
        b.unpack_plan = timed(b.unpack_plan, "unpack_cpu")


# --------------------------------------------------------------------------- the methods


class _Method(abc.ABC):
    """One reduction strategy: ``on_grad`` from the hook, ``finish`` after backward."""

    name = ""

    @abc.abstractmethod
    def on_grad(self, p: nn.Parameter) -> None:
        """Count ``p``'s gradient in; reduce what is ready."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Reduce what is left after the backward and wait for it."""

    def after_step(self, params: list[nn.Parameter]) -> None:
        """Untimed cleanup between steps."""
        for p in params:
            p.grad = None

    def held_bytes(self) -> int:
        """Bytes of the buffers the method keeps between steps."""
        return 0


class _Backward(_Method):
    name = "backward"

    def on_grad(self, p: nn.Parameter) -> None:
        pass

    def finish(self) -> None:
        pass


class _Flatgrad(_Method):
    name = "flatgrad"

    def __init__(self, buckets: list[list[nn.Parameter]]) -> None:
        self.reducer = BucketReducer(buckets, register_hooks=False)

    def on_grad(self, p: nn.Parameter) -> None:
        self.reducer.mark_ready(p)

    def finish(self) -> None:
        self.reducer.finish()

    def after_step(self, params: list[nn.Parameter]) -> None:
        self.reducer.zero_grad()
        super().after_step(params)

    def held_bytes(self) -> int:
        return self.reducer.comm_buffer_bytes


class _InOrderBuckets(_Method):
    """Buckets complete by count and are reduced strictly in bucket order (as DDP and flatgrad do)."""

    def __init__(self, buckets: list[list[nn.Parameter]]) -> None:
        self.buckets = buckets
        self.where = {p: (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket)}
        self.pending = [len(b) for b in buckets]
        self.next = 0
        self.works: list[Any] = []

    def _bucket_done(self, b: int) -> None:
        self.pending[b] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self.reduce(self.next)
            self.next += 1

    def _reset(self) -> None:
        self.pending = [len(b) for b in self.buckets]
        self.next = 0
        self.works.clear()

    @abc.abstractmethod
    def reduce(self, b: int) -> None:
        """Reduce bucket ``b``."""


class _DDPAllReduce(_InOrderBuckets):
    name = "ddp_allreduce"

    def __init__(self, buckets: list[list[nn.Parameter]], world_size: int) -> None:
        super().__init__(buckets)
        self.factor = 1.0 / world_size
        self.flat = [torch.empty(sum(p.numel() for p in b)) for b in buckets]
        self.views = {}
        for b, bucket in enumerate(buckets):
            offset = 0
            for p in bucket:
                self.views[p] = self.flat[b][offset : offset + p.numel()]
                offset += p.numel()

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat)

    def on_grad(self, p: nn.Parameter) -> None:
        torch.mul(p.grad.view(-1), self.factor, out=self.views[p])  # DDP's fused divide-and-copy
        self._bucket_done(self.where[p][0])

    def reduce(self, b: int) -> None:
        self.works.append(dist.all_reduce(self.flat[b], async_op=True))

    def finish(self) -> None:
        for b in range(self.next, len(self.buckets)):
            self.reduce(b)
        for work in self.works:
            work.wait()
        for p, view in self.views.items():
            if p.grad is not None:
                p.grad.view(-1).copy_(view)
        self._reset()


class _Zero2Reduce(_InOrderBuckets):
    name = "zero2_reduce"

    def __init__(self, buckets: list[list[nn.Parameter]], rank: int, world_size: int) -> None:
        super().__init__(buckets)
        self.rank, self.world_size = rank, world_size
        total = sum(p.numel() for b in buckets for p in b)
        self.partition_numel = math.ceil(total / world_size)
        self.partition = torch.zeros(self.partition_numel)  # this rank's fp32 gradient partition (kept, as stock's)
        self.flat = [torch.empty(sum(p.numel() for p in b)) for b in buckets]
        self.views = {}
        # Per bucket, the rank-runs (dst, bucket offset, length, partition offset) of the global partitioning.
        self.runs: list[list[tuple[int, int, int, int]]] = []
        start = 0
        for b, bucket in enumerate(buckets):
            offset = 0
            for p in bucket:
                self.views[p] = self.flat[b][offset : offset + p.numel()]
                offset += p.numel()
            runs, pos, end = [], start, start + offset
            while pos < end:
                dst = pos // self.partition_numel
                stop = min(end, (dst + 1) * self.partition_numel)
                runs.append((dst, pos - start, stop - pos, pos - dst * self.partition_numel))
                pos = stop
            self.runs.append(runs)
            start = end
        self.first_micro_step = True

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat) + self.partition.numel() * 4

    def on_grad(self, p: nn.Parameter) -> None:
        self.views[p].copy_(p.grad.view(-1))  # into the IPG bucket
        p.grad = None
        self._bucket_done(self.where[p][0])

    def reduce(self, b: int) -> None:
        flat = self.flat[b]
        flat.div_(self.world_size)
        for dst, offset, length, _ in self.runs[b]:
            self.works.append((b, dist.reduce(flat.narrow(0, offset, length), dst=dst, async_op=True)))

    def finish(self) -> None:
        for b in range(self.next, len(self.buckets)):
            self.reduce(b)
        for _, work in self.works:
            work.wait()
        for b, runs in enumerate(self.runs):
            for dst, offset, length, at in runs:
                if dst == self.rank:
                    target = self.partition.narrow(0, at, length)
                    source = self.flat[b].narrow(0, offset, length)
                    target.copy_(source) if self.first_micro_step else target.add_(source)
        self._reset()

    def calls_per_step(self) -> int:
        return sum(len(r) for r in self.runs)


# --------------------------------------------------------------------------- one rank


def _check_flatgrad_against_ddp(flat: _Flatgrad, ddp: _DDPAllReduce) -> float:
    """Max abs difference between flatgrad's shards and the same pieces of DDP's all-reduced grads."""
    worst = 0.0
    for gs in flat.reducer.grad_shards():
        for piece in gs.pieces:
            ref = ddp.views[gs.params[piece.tensor_index]][piece.tensor_offset : piece.tensor_offset + piece.length]
            got = gs.shard[piece.shard_offset : piece.shard_offset + piece.length]
            worst = max(worst, (got - ref).abs().max().item())
    return worst


def _collective_methods(numel: int, world_size: int, repeats: int) -> dict:
    """Seconds per call of reduce_scatter (list / tensor form) and all_reduce of one buffer, taking turns."""
    x = torch.randn(numel - numel % world_size)
    out = torch.empty(x.numel() // world_size)
    runs = {
        "reduce_scatter list": lambda: comm.reduce_scatter(out, x, method="list"),
        "reduce_scatter tensor": lambda: comm.reduce_scatter(out, x, method="tensor"),
        "all_reduce": lambda: dist.all_reduce(x),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(repeats + 1):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            if i:
                times[name].append(time.perf_counter() - start)
    return times


def _rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    size = dict(SIZES["quick" if args.quick else "full"])
    bucket_numel = args.bucket_numel or size.pop("bucket_numel")
    size.pop("bucket_numel", None)
    batch = size.pop("batch")
    torch.manual_seed(0)
    model = TinyGPT(**size)
    params = [p for p in model.parameters() if p.requires_grad]
    buckets = build_buckets(model, bucket_numel)
    clock = _Clock()
    recorder = CollectiveRecorder(_TIMED, deepspeed=False).install()  # inside the timing: its cost is comm time
    _time_collectives(clock)

    flat = _Flatgrad(buckets)
    ddp = _DDPAllReduce(buckets, world_size)
    zero2 = _Zero2Reduce(buckets, rank, world_size)
    methods: list[_Method] = [_Backward(), flat, ddp, zero2]
    active: list[_Method] = [methods[0]]

    def hook(p: nn.Parameter) -> None:
        wall, cpu = _now()
        active[0].on_grad(p)
        clock.hook += time.perf_counter() - wall
        clock.hook_cpu += time.thread_time() - cpu

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    gen = torch.Generator().manual_seed(1 + rank)
    fields = ("total", "own", "own_cpu", "comm", "calls", "pack_cpu", "unpack_cpu", "peak_bytes", "held_bytes")
    census = MemoryCensus("cpu")  # see [Note: reducer memory]
    census.__enter__()
    records: dict[str, dict[str, list[float]]] = {m.name: {f: [] for f in fields} for m in methods}
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=gen)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
        if step == 0:  # correctness first: flatgrad's shards against DDP's all-reduced gradients
            for method in (ddp, flat):
                active[0] = method
                loss.backward(retain_graph=True)
                method.finish()
                for p in params:  # the next backward must not accumulate onto these
                    p.grad = None
            check = _check_flatgrad_against_ddp(flat, ddp)
            flat.after_step(params)
            _time_plans(flat.reducer, clock)  # the plans the reducer made in this first step
        order = methods[step % len(methods) :] + methods[: step % len(methods)]  # turns: no method always first
        for k, method in enumerate(order):
            active[0] = method
            dist.barrier()
            clock.reset()
            recorder.reset()
            census.reset_peak()
            before = census.now()[0]
            start = time.perf_counter()
            loss.backward(retain_graph=k < len(order) - 1)
            middle, middle_cpu = _now()
            method.finish()
            end, end_cpu = _now()
            peak = census.now()[1] - before
            if step >= args.warmup:
                rec = records[method.name]
                rec["total"].append(end - start)
                rec["own"].append(clock.hook + (end - middle) - clock.comm)
                rec["own_cpu"].append(clock.hook_cpu + (end_cpu - middle_cpu) - clock.comm_cpu)
                rec["comm"].append(clock.comm)
                rec["pack_cpu"].append(clock.pack_cpu)
                rec["unpack_cpu"].append(clock.unpack_cpu)
                rec["calls"].append(len(recorder.calls))
                rec["peak_bytes"].append(peak)
                rec["held_bytes"].append(method.held_bytes())
            method.after_step(params)
        del loss
    largest = max(sum(p.numel() for p in b) for b in buckets)
    collectives = _collective_methods(largest, world_size, args.collective_repeats)
    meta = {
        "rank": rank,
        "check_max_abs_diff_vs_ddp": check,
        "zero2_reduce_calls_per_step": zero2.calls_per_step(),
        "kernel_backends": sorted(set(flat.reducer.kernel_backends)),
        "reduce_op": str(flat.reducer._buckets[0].op),
        "method": flat.reducer._buckets[0].method,
        "threads": torch.get_num_threads(),
    }
    return dict(
        records=records, meta=meta, collectives=collectives, num_params=sum(p.numel() for p in params),
        buckets=[sum(p.numel() for p in b) for b in buckets], size=dict(size, batch=batch, bucket_numel=bucket_numel),
    )  # fmt: skip


# --------------------------------------------------------------------------- summary


def _summary(run: dict, world_size: int) -> dict:
    records = run["records"]
    steps = len(records[0]["flatgrad"]["total"])
    per_step: dict[str, dict[str, list[float]]] = {}
    for name in METHODS:
        per_step[name] = {
            "total": [max(r[name]["total"][s] for r in records) for s in range(steps)],
            "own": [statistics.fmean(r[name]["own"][s] for r in records) for s in range(steps)],
            "own_cpu": [statistics.fmean(r[name]["own_cpu"][s] for r in records) for s in range(steps)],
            "pack_cpu": [statistics.fmean(r[name]["pack_cpu"][s] for r in records) for s in range(steps)],
            "unpack_cpu": [statistics.fmean(r[name]["unpack_cpu"][s] for r in records) for s in range(steps)],
            "comm": [statistics.fmean(r[name]["comm"][s] for r in records) for s in range(steps)],
        }
    n = run["num_params"]
    elem = 4
    zero2_calls = run["meta"][0]["zero2_reduce_calls_per_step"]
    modeled_bytes = {
        "backward": 0,
        "flatgrad": (world_size - 1) / world_size * sum(run["buckets"]) * elem,
        "ddp_allreduce": 2 * (world_size - 1) / world_size * n * elem,
        "zero2_reduce": n * elem,
    }
    calls = {name: int(statistics.median(records[0][name]["calls"])) for name in METHODS}
    table = {}
    for name in METHODS:
        s = per_step[name]
        table[name] = {
            "total_ms_median": 1e3 * statistics.median(s["total"]),
            "total_ms_min": 1e3 * min(s["total"]),
            "own_ms_median": 1e3 * statistics.median(s["own"]),
            "own_ms_min": 1e3 * min(s["own"]),
            "own_cpu_ms_median": 1e3 * statistics.median(s["own_cpu"]),
            "own_cpu_ms_min": 1e3 * min(s["own_cpu"]),
            "pack_cpu_ms_median": 1e3 * statistics.median(s["pack_cpu"]),
            "unpack_cpu_ms_median": 1e3 * statistics.median(s["unpack_cpu"]),
            "collective_ms_median": 1e3 * statistics.median(s["comm"]),
            "collective_calls_per_step": calls[name],
            "bytes_sent_per_rank_modeled": modeled_bytes[name],
            "peak_mb_median": statistics.median(max(r[name]["peak_bytes"][i] for r in records) for i in range(steps))
            / 1e6,
            "held_mb": max(max(r[name]["held_bytes"]) for r in records) / 1e6,
        }
    ratios = {}
    for base in ("ddp_allreduce", "zero2_reduce"):
        for kind in ("total", "own", "own_cpu"):
            r = [f / b for f, b in zip(per_step["flatgrad"][kind], per_step[base][kind])]
            ratios[f"flatgrad/{base} {kind}"] = {"median": statistics.median(r), "min": min(r)}
    collectives = {}
    for name in run["collectives"][0]:
        per_rep = [max(c[name][i] for c in run["collectives"]) for i in range(len(run["collectives"][0][name]))]
        collectives[name] = {"ms_median": 1e3 * statistics.median(per_rep), "ms_min": 1e3 * min(per_rep)}
    ar = collectives["all_reduce"]["ms_median"]
    for name in collectives:
        collectives[name]["x_all_reduce"] = collectives[name]["ms_median"] / ar
    return dict(table=table, ratios=ratios, steps=steps, zero2_calls=zero2_calls, collectives=collectives)


def _print(result: dict) -> None:
    s = result["summary"]
    print(f"# {result['machine_line']}")
    print(
        f"# W={result['world_size']} gloo ranks, {result['num_params'] / 1e6:.1f}M params, "
        f"{len(result['buckets'])} buckets, {s['steps']} steps, flatgrad kernels: {result['kernel_backends']}, "
        f"op {result['reduce_op']}, reduce_scatter method {result['method']!r}"
    )
    print(f"# check: flatgrad shards vs DDP all_reduce, max abs diff {result['check_max_abs_diff_vs_ddp']:.3g}")
    head = (
        f"{'method':<14} {'total ms med/min':>18} {'own ms med/min':>16} {'own cpu ms med/min':>19} "
        f"{'coll ms':>9} {'calls':>6} {'MB sent/rank':>13} {'peak MB':>8} {'held MB':>8}"
    )
    print(head)
    print("-" * len(head))
    for name, row in s["table"].items():
        print(
            f"{name:<14} {row['total_ms_median']:>9.1f}/{row['total_ms_min']:<8.1f} "
            f"{row['own_ms_median']:>7.1f}/{row['own_ms_min']:<8.1f} "
            f"{row['own_cpu_ms_median']:>10.1f}/{row['own_cpu_ms_min']:<8.1f} {row['collective_ms_median']:>9.1f} "
            f"{row['collective_calls_per_step']:>6} {row['bytes_sent_per_rank_modeled'] / 1e6:>13.1f} "
            f"{row['peak_mb_median']:>8.1f} {row['held_mb']:>8.1f}"
        )
    print(
        "peak MB: the most tensor memory the method added during backward + reduction above what was live "
        "before it (median over steps); held MB: its buffers kept between steps"
    )
    f = s["table"]["flatgrad"]
    rest = f["own_cpu_ms_median"] - f["pack_cpu_ms_median"] - f["unpack_cpu_ms_median"]
    print(
        f"flatgrad own cpu: pack {f['pack_cpu_ms_median']:.1f} ms + unpack {f['unpack_cpu_ms_median']:.1f} ms "
        f"+ hooks/bookkeeping/freeing grads {rest:.1f} ms (the backward row's hooks alone: "
        f"{s['table']['backward']['own_cpu_ms_median']:.1f} ms)"
    )
    print()
    for name, r in s["ratios"].items():
        target = "  (target <= 0.5)" if "own" in name else ""
        print(f"{name:<30} median {r['median']:.3f}  min {r['min']:.3f}{target}")
    print()
    print(f"# one bucket of {max(result['buckets']) / 1e6:.2f}M fp32 elements, per call:")
    for name, c in s["collectives"].items():
        print(f"{name:<24} {c['ms_median']:>8.1f} ms (min {c['ms_min']:.1f})  {c['x_all_reduce']:.2f}x all_reduce")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a ~5M-param model and fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 12, quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2, quick 1)")
    parser.add_argument("--bucket-numel", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--collective-repeats", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (5 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.collective_repeats = args.collective_repeats or (5 if args.quick else 7)

    from flatgrad.bench._harness import machine_info, machine_line

    per_rank = run_ranks(
        _rank_main, args.world_size, args, timeout=3600, pg_timeout=timedelta(seconds=300), threads=args.threads
    )
    run = dict(per_rank[0], **{key: [r[key] for r in per_rank] for key in ("records", "meta", "collectives")})
    info = machine_info()
    meta = run["meta"][0]
    result = dict(
        bench="reducer_step", world_size=args.world_size, quick=args.quick, machine=info,
        machine_line=machine_line(info), num_params=run["num_params"], buckets=run["buckets"], size=run["size"],
        kernel_backends=meta["kernel_backends"], reduce_op=meta["reduce_op"], method=meta["method"],
        check_max_abs_diff_vs_ddp=max(m["check_max_abs_diff_vs_ddp"] for m in run["meta"]),
        available_backends={k: v.available for k, v in flatgrad.available_backends().items()},
        summary=_summary(run, args.world_size), raw=run["records"],
    )  # fmt: skip
    _print(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
