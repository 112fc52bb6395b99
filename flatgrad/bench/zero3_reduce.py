"""ZeRO-3 reduce path per optimizer step: stock DeepSpeed against flatgrad, in one run.

The question: what does flatgrad's ZeRO-3 backend save on the way from the
parameters' gradients to the grad partitions? Both engines train the same model
(about 50M parameters) from the same seed on real DeepSpeed ZeRO-3 over gloo,
alternating step by step in the same processes, so that machine load falls on
both alike.

Measured per optimizer step (``--gas`` micro-steps), on every rank:
* reduce path: wall time inside ZeRO-3's two per-bucket seams,
  ``__add_grad_to_ipg_bucket`` (stock copies every gradient into the IPG buffer
  there) and ``__reduce_and_partition_ipg_grads`` (re-pack, divide,
  reduce_scatter, per-parameter copy or add; flatgrad: pack, reduce_scatter,
  unpack). Figures are the median over steps of the slowest rank's time.
* collective: the part of it spent in the reduce_scatter call; ``copies`` is
  the rest, the work flatgrad replaces.
* traffic: bytes read plus bytes written by every operation on those seams
  except the collective, from a ``TorchDispatchMode`` over one extra step:
  an elementwise op counts its tensor inputs read and its output written (a
  copy reads its source only; an in-place op also reads its target); views and
  allocations count nothing; ``flatgrad::unpack`` reads the shard (and its
  outputs when accumulating) and writes its outputs. ``ops/bucket`` counts the
  operations that touch memory (kernel launches on a GPU).

* backward: wall time of ``engine.backward`` (the backward with the reduce
  path, and under offload the copies to the host), slowest rank, median.

``--offload`` trains both with CPU optimizer offload (torch's AdamW on the
host, pinned host buffers); ``host writes`` then counts, per step, the writes
into the host grad partitions and fp32 gradients (torch's ``copy_``/``add_``
and flatgrad's unpacks, ``flatgrad.testing.host_writes``). ``--stage`` makes
flatgrad stage every segment through its pinned buffers and unpack it later,
as on a GPU, instead of unpacking into host memory directly.

The last line checks that both engines ended with bitwise equal fp32 master
weights on every rank. Example::

    python bench/zero3_reduce.py                  # 4 ranks, ~50M fp32 params
    python bench/zero3_reduce.py --dtype bf16 --out results.json
    python bench/zero3_reduce.py --offload --hidden 1023 --layers 12
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

_PREFIX = "_DeepSpeedZeroOptimizer_Stage3__"
_SEAMS = ("add_grad_to_ipg_bucket", "reduce_and_partition_ipg_grads")
_ENGINES = ("stock", "flatgrad")


def _model(hidden: int, layers: int):
    import torch

    class Net(torch.nn.Module):
        """``layers`` x (Linear(hidden, hidden) -> tanh -> LayerNorm(hidden)): big weights and small vectors."""

        def __init__(self) -> None:
            super().__init__()
            self.linears = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
            self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))

        def forward(self, x):
            for linear, norm in zip(self.linears, self.norms):
                x = norm(torch.tanh(linear(x)))
            return x.square().mean()

    return Net()


class _Traffic:
    """Bytes read and written, and memory-touching operations, seen by a dispatch mode. See the module docstring."""

    def __init__(self) -> None:
        self.read = self.written = self.ops = 0
        self.by_op: dict[str, int] = {}
        self.in_collective = 0

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        traffic = self

        def tensors(values) -> list:
            out = []
            for v in values:
                if isinstance(v, torch.Tensor):
                    out.append(v)
                elif isinstance(v, (list, tuple)):
                    out.extend(t for t in v if isinstance(t, torch.Tensor))
            return out

        def nbytes(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                schema = func._schema
                namespace, name = schema.name.split("::")
                if traffic.in_collective or name.startswith(("empty", "new_empty")):
                    return result  # what the collective does is not copy traffic; allocations touch nothing
                values = list(args) + [kwargs.get(s.name) for s in schema.arguments[len(args):]]
                written = tensors(
                    [v for a, v in zip(schema.arguments, values) if a.alias_info is not None and a.alias_info.is_write]
                )
                inputs = tensors(list(args) + list(kwargs.values()))
                written_ids = {id(t) for t in written}
                read_only = [t for t in inputs if id(t) not in written_ids]
                if namespace == "flatgrad" and name == "unpack":
                    accumulate = args[4] if len(args) > 4 else kwargs.get("accumulate", False)
                    read = nbytes(read_only) + (nbytes(written) if accumulate else 0)
                elif written:  # in place (the target is read too, except by copy_/zero_/fill_) or into out=
                    inplace = name.endswith("_") and name not in ("copy_", "zero_", "fill_")
                    read = nbytes(read_only) + (nbytes(written) if inplace else 0)
                else:
                    outs = tensors(result if isinstance(result, (list, tuple)) else [result])
                    storages = {t.untyped_storage().data_ptr() for t in inputs}
                    if all(o.untyped_storage().data_ptr() in storages for o in outs):
                        return result  # a view
                    written, read = outs, nbytes(inputs)
                traffic.read += read
                traffic.written += nbytes(written)
                traffic.ops += 1
                key = f"{namespace}::{name}"
                traffic.by_op[key] = traffic.by_op.get(key, 0) + 1
                return result

        return Mode()


class _Probe:
    """Times one engine's ZeRO-3 seams and its reduce_scatter calls; optionally counts their traffic."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collective = 0.0
        self.buckets = 0
        self.traffic: _Traffic | None = None
        self._depth = 0

    def wrap_seam(self, fn: Callable, counts_bucket: bool) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            mode = self.traffic.mode() if self.traffic is not None else contextlib.nullcontext()
            start = time.perf_counter()
            try:
                with mode:
                    return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1
                if counts_bucket:
                    self.buckets += 1

        return timed

    def wrap_collective(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            traffic = self.traffic
            if traffic is not None:
                traffic.in_collective += 1  # gloo copies the result out inside work.wait(): part of the collective
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.collective += time.perf_counter() - start
                if traffic is not None:
                    traffic.in_collective -= 1

        return timed


def _instrument(engine, probe: _Probe) -> None:
    opt = engine.optimizer
    for seam in _SEAMS:
        name = _PREFIX + seam
        # An instance attribute shadows the class method (stock) or wraps flatgrad's installed one.
        setattr(opt, name, probe.wrap_seam(getattr(opt, name), seam.startswith("reduce")))


def _run_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from flatgrad.testing.deepspeed_rank import init_deepspeed

    init_deepspeed(rank, world_size, "cpu")
    import deepspeed
    import deepspeed.comm
    import torch

    import flatgrad.comm
    import flatgrad.deepspeed

    from flatgrad.kernels import DTYPE_NAMES

    dtype = DTYPE_NAMES[args.dtype]
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.gas,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": args.bucket, "stage3_param_persistence_threshold": 0},
    }
    if args.dtype == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if args.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host, for a bitwise comparison
    engines, probes = {}, {}
    for name in _ENGINES:
        torch.manual_seed(0)
        model = _model(args.hidden, args.layers)
        initialize = deepspeed.initialize if name == "stock" else flatgrad.deepspeed.initialize
        cfg = dict(config, flatgrad={"backend": args.backend} if args.backend else {}) if name == "flatgrad" else config
        engines[name] = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        if name == "flatgrad" and args.stage:
            engines[name].optimizer.flatgrad.offload.always_stage = True
        probes[name] = _Probe()
        _instrument(engines[name], probes[name])
    params = sum(p.ds_numel for p in engines["stock"].module.parameters())

    # Both paths' reduce_scatter, looked up at call time: stock's in deepspeed.comm, flatgrad's in flatgrad.comm.
    current: list[_Probe] = [probes["stock"]]
    stock_rs, flat_rs = deepspeed.comm.reduce_scatter_fn, flatgrad.comm.reduce_scatter
    deepspeed.comm.reduce_scatter_fn = lambda *a, **k: current[0].wrap_collective(stock_rs)(*a, **k)
    flatgrad.comm.reduce_scatter = lambda *a, **k: current[0].wrap_collective(flat_rs)(*a, **k)

    g = torch.Generator().manual_seed(1000 + rank)
    steps = args.warmup + args.repeats + 1
    shape = (args.micro_batch, args.hidden)
    batches = [[torch.randn(shape, generator=g).to(dtype) for _ in range(args.gas)] for _ in range(steps)]
    from flatgrad.testing.host_writes import HostWrites

    samples: dict[str, dict[str, list[float]]] = {
        n: {"seconds": [], "collective": [], "backward": []} for n in _ENGINES
    }
    counted = {}
    for step, micro_batches in enumerate(batches):
        last = step == steps - 1
        for name in _ENGINES:
            probe, engine = probes[name], engines[name]
            current[0] = probe
            probe.seconds = probe.collective = 0.0
            probe.buckets = 0
            probe.traffic = _Traffic() if last else None
            opt = engine.optimizer
            host = [opt.grad_partitions_flat_buffer] + [g.grad for g in opt.fp32_partitioned_groups_flat]
            writes = HostWrites(host if args.offload else [])
            backward = 0.0
            for x in micro_batches:
                loss = engine(x)
                start = time.perf_counter()
                with writes if last else contextlib.nullcontext():
                    engine.backward(loss)
                backward += time.perf_counter() - start
                engine.step()
            if last:
                counted[name] = {"read": probe.traffic.read, "written": probe.traffic.written, "ops": probe.traffic.ops,
                                 "buckets": probe.buckets, "by_op": probe.traffic.by_op,
                                 "host_writes": writes.total}
            elif step >= args.warmup:
                samples[name]["seconds"].append(probe.seconds)
                samples[name]["collective"].append(probe.collective)
                samples[name]["backward"].append(backward)
    deepspeed.comm.reduce_scatter_fn, flatgrad.comm.reduce_scatter = stock_rs, flat_rs
    return {
        "params": params,
        "samples": samples,
        "traffic": counted,
        "identical": _real_master(engines["stock"], rank) == _real_master(engines["flatgrad"], rank),
        "backend": _backend_name(engines["flatgrad"]),
    }


def _real_master(engine, rank: int) -> list[bytes]:
    """This rank's fp32 master weights without the partitions' padding (which holds whatever memory held)."""
    opt, out = engine.optimizer, []
    for group, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat):
        offset = 0
        for p in group:
            real = max(0, min(p.partition_numel(), p.ds_numel - rank * p.partition_numel()))
            out.append(flat.detach().narrow(0, offset, real).numpy().tobytes())
            offset += p.partition_numel()
    return out


def _backend_name(engine) -> str:
    import torch

    from flatgrad.kernels import resolve_backend

    reducer = engine.optimizer.flatgrad
    return resolve_backend(reducer.config.backend, torch.device("cpu")).name


def summarize(results: list[dict]) -> dict:
    """Per engine: median over steps of the slowest rank's times; rank 0's traffic; ratios flatgrad / stock."""
    out: dict[str, Any] = {"params": results[0]["params"], "backend": results[0]["backend"],
                           "identical": all(r["identical"] for r in results)}
    for name in _ENGINES:
        per_step = list(zip(*(r["samples"][name]["seconds"] for r in results)))
        coll = list(zip(*(r["samples"][name]["collective"] for r in results)))
        slowest = [max(s) for s in per_step]
        copies = [max(s - c for s, c in zip(ss, cs)) for ss, cs in zip(per_step, coll)]
        backward = [max(s) for s in zip(*(r["samples"][name]["backward"] for r in results))]
        t = results[0]["traffic"][name]
        out[name] = {
            "backward_ms": {"median": 1e3 * statistics.median(backward), "min": 1e3 * min(backward)},
            "host_writes_per_step": t["host_writes"],
            "reduce_path_ms": {"median": 1e3 * statistics.median(slowest), "min": 1e3 * min(slowest)},
            "copies_ms": {"median": 1e3 * statistics.median(copies), "min": 1e3 * min(copies)},
            "traffic_bytes": t["read"] + t["written"],
            "read_bytes": t["read"],
            "written_bytes": t["written"],
            "buckets_per_step": t["buckets"],
            "ops_per_bucket": t["ops"] / max(1, t["buckets"]),
            "ops": t["by_op"],
        }
    s, f = out["stock"], out["flatgrad"]
    out["ratio"] = {
        "reduce_path_median": f["reduce_path_ms"]["median"] / s["reduce_path_ms"]["median"],
        "reduce_path_min": f["reduce_path_ms"]["min"] / s["reduce_path_ms"]["min"],
        "copies_median": f["copies_ms"]["median"] / s["copies_ms"]["median"],
        "copies_min": f["copies_ms"]["min"] / s["copies_ms"]["min"],
        "traffic": f["traffic_bytes"] / s["traffic_bytes"],
        "backward_median": f["backward_ms"]["median"] / s["backward_ms"]["median"],
        "ops_per_bucket": f["ops_per_bucket"] / s["ops_per_bucket"],
    }
    return out


def format_table(summary: dict, args: argparse.Namespace) -> str:
    lines = [
        f"ZeRO-3 reduce path per step: {summary['params'] / 1e6:.1f}M params, {args.world_size} gloo ranks, "
        f"{args.dtype}, "
        f"reduce_bucket_size {args.bucket:,}, gas {args.gas}, flatgrad backend {summary['backend']!r}, "
        + ("CPU optimizer offload" + (" (staged), " if args.stage else ", ") if args.offload else "") +
        f"{args.repeats} timed steps",
        f"{'':10} {'reduce path ms':>22} {'copies ms':>22} {'traffic MB':>11} {'buckets':>8} {'ops/bucket':>11}",
        f"{'':10} {'median':>11}{'min':>11} {'median':>11}{'min':>11}",
    ]
    for name in _ENGINES:
        e = summary[name]
        lines.append(
            f"{name:10} {e['reduce_path_ms']['median']:11.1f}{e['reduce_path_ms']['min']:11.1f} "
            f"{e['copies_ms']['median']:11.1f}{e['copies_ms']['min']:11.1f} {e['traffic_bytes'] / 1e6:11.1f} "
            f"{e['buckets_per_step']:8d} {e['ops_per_bucket']:11.1f}"
        )
    r = summary["ratio"]
    lines.append(
        f"{'ratio':10} {r['reduce_path_median']:11.2f}{r['reduce_path_min']:11.2f} {r['copies_median']:11.2f}"
        f"{r['copies_min']:11.2f} {r['traffic']:11.2f} {'':8} {r['ops_per_bucket']:11.2f}"
    )
    for name in _ENGINES:
        e = summary[name]
        writes = f", {e['host_writes_per_step']} host writes per step" if args.offload else ""
        lines.append(f"backward {name}: {e['backward_ms']['median']:.1f} ms median, {e['backward_ms']['min']:.1f} min"
                     f"{writes}")
    lines.append(f"backward flatgrad/stock = {r['backward_median']:.2f} (median)")
    lines.append(f"ops: stock {summary['stock']['ops']}")
    lines.append(f"ops: flatgrad {summary['flatgrad']['ops']}")
    target = "met" if r["traffic"] <= 0.5 else "NOT met"
    lines.append(f"pack/unpack copy traffic flatgrad/stock = {r['traffic']:.2f} (target <= 0.5: {target})")
    lines.append(f"fp32 master weights bitwise identical on every rank: {summary['identical']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1531, help="odd on purpose: partitions need padding")
    parser.add_argument("--layers", type=int, default=21)
    parser.add_argument("--bucket", type=int, default=5_000_000, help="zero_optimization.reduce_bucket_size")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", default=None, help="flatgrad kernel backend (default: auto)")
    parser.add_argument("--offload", action="store_true", help="offload_optimizer: {device: cpu}, torch AdamW")
    parser.add_argument("--stage", action="store_true", help="with --offload: flatgrad stages every segment")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=None, help="write the raw figures as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", f"/tmp/flatgrad_tx_{os.getuid()}")
    from flatgrad.bench._harness import machine_info, machine_line
    from flatgrad.testing.launch import run_ranks

    results = run_ranks(_run_rank, args.world_size, args, timeout=args.timeout, threads=args.threads)
    summary = summarize(results)

    info = machine_info()
    print(machine_line(info))
    print(format_table(summary, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "machine": info, "summary": summary, "ranks": results}, f, indent=1)
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
