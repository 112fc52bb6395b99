"""ZeRO-2 backward + reduction and step: stock DeepSpeed (both reduce modes) against flatgrad, in one run.

The question: what does flatgrad's ZeRO-2 backend (bucket-aligned sub-groups,
one reduce_scatter per sub-group, fp32 partitions) change in a training step,
against the two ways stock DeepSpeed ZeRO-2 reduces?

Setups, on the same model, seed, batches and ``reduce_bucket_size``, all three
engines alive in the same rank processes and taking turns step by step (so that
machine load falls on all alike):

* ``stock``: DeepSpeed's default, ``use_multi_rank_bucket_allreduce: true``: an
  ``all_reduce`` of each IPG bucket, then every rank copies its own runs.
* ``stock_reduce``: ``use_multi_rank_bucket_allreduce: false``: one
  ``dist.reduce`` per run of a bucket that lies in one rank's partition.
* ``flatgrad``: ``flatgrad.deepspeed.initialize``: per sub-group one fused
  pack, one ``reduce_scatter``, one fused unpack into the fp32 partition.

Models (``--models``): ``moe``, the seed thread's model (10,026,000 parameters
per rank, 16 experts, ep_size 4; ``--moe-bucket`` 1e6 as in docs/design.md's
reproduction of the thread's 23 reduces), and ``transformer``, about 52M
parameters (``--transformer-bucket`` 5e6).

Measured per step, on every rank (``time.perf_counter``; CPU figures with
``time.thread_time``):

* ``backward``: wall time of ``engine.backward(loss)``: autograd, DeepSpeed's
  hooks, the reduction and the epilogue. A step's figure is the slowest rank's.
* ``step``: wall time of ``engine.step()`` (norm, clipping, optimizer, all_gather).
* ``own`` / ``own_cpu``: time inside the reduction seams, ``process_gradients``
  (what DeepSpeed's per-parameter hook runs) and
  ``independent_gradient_partition_epilogue``, minus the time spent inside
  ``torch.distributed`` collectives and ``Work.wait()``/``is_completed()`` there:
  each setup's own non-collective work in backward + reduction (hooks, copies,
  bookkeeping). Wall and training-thread CPU time; the CPU figure leaves out
  the time the thread waited for a core, so it holds on a loaded machine. Mean
  over ranks.
* ``calls``: gradient collectives issued during backward, per step (a call on a
  one-rank group counts: stock issues those for MoE experts at 4 ranks);
  ``step calls``: collectives issued by ``step()`` (gradient norm, overflow
  check, parameter all_gather), counted at ``deepspeed.comm`` (a coalesced
  group once; ``flatgrad.testing.collectives``).
* ``MB/rank``: bytes each rank sends for those collectives, by ``flatgrad plan``'s
  model of bandwidth-optimal (ring) algorithms on the call's group of W ranks
  (``flatgrad.testing.collectives.sent_bytes``): a reduce_scatter of N elements
  sends (W-1)/W N, an all_reduce 2 (W-1)/W N, a reduce of n elements n when
  rooted at another rank, nothing when rooted here.

Figures are the median and the min over the timed steps; ratios are to
``stock`` in the same run. The last line per model gives the largest relative
difference of flatgrad's fp32 master weights from stock's after the run
(summation order only: gloo sums 4 ranks in another order than stock's
all_reduce). Example::

    python bench/zero_step.py                        # both models, 4 ranks
    python bench/zero_step.py --models moe --steps 4 --out zero_step.json
    python bench/zero_step.py --sub-groups 1 10 100 400 --world-size 2   # the step against the sub-group count
    python bench/zero_step.py --offload --models transformer           # CPU optimizer offload, all three setups

With ``--offload`` every setup offloads the optimizer to the CPU (``pin_memory``,
torch's AdamW on the host partitions), ``backward`` includes the copies of the
reduced gradients into the host partitions, and ``host copies`` counts them per
step: stock's per-parameter copies (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``
and, accumulating, ``async_accumulate_grad_in_cpu_via_gpu``), flatgrad's per-bucket
deliveries (none where the unpack writes the host partition in place, as on a CPU
rank accumulating in fp32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flatgrad.testing.collectives import CollectiveRecorder

SETUPS = ("stock", "stock_reduce", "flatgrad")
# The collectives counted and timed, at deepspeed.comm and torch.distributed.
_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather", "all_gather_into_tensor",
                "all_to_all_single", "broadcast")  # fmt: skip
_GRADIENT_OPS = ("all_reduce", "reduce", "reduce_scatter")


# --------------------------------------------------------------------------- models


def _seed_moe():
    """docs/design.md "The seed model", as ``flatgrad plan`` and ``flatgrad demo`` define it."""
    import torch

    from flatgrad.planner.models import SimpleMoeModel

    hidden = 1000

    def batch(generator, micro_batch):
        return torch.randn(micro_batch, hidden, generator=generator), torch.randn(
            micro_batch, hidden, generator=generator
        )

    return SimpleMoeModel(hidden=hidden, num_experts=16, ep_size=4, k=1), batch


def _transformer(vocab: int = 8192, d_model: int = 512, layers: int = 14, seq: int = 32):
    import torch

    class Transformer(torch.nn.Module):
        """A GPT-like stack of ``layers`` encoder layers (causal mask), ~52M parameters at the defaults."""

        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d_model)
            self.pos = torch.nn.Parameter(torch.zeros(seq, d_model))
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    d_model, 8, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(layers)
            )
            self.norm = torch.nn.LayerNorm(d_model)
            self.head = torch.nn.Linear(d_model, vocab, bias=False)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, tokens, targets):
            x = self.embed(tokens) + self.pos
            for block in self.blocks:
                x = block(x, src_mask=self.mask, is_causal=True)
            logits = self.head(self.norm(x))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))

    def batch(generator, micro_batch):
        tokens = torch.randint(vocab, (micro_batch, seq + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Transformer(), batch


_MODELS = {"moe": _seed_moe, "transformer": _transformer}


# --------------------------------------------------------------------------- instrumentation


class _Probe:
    """Times the reduction seams and the collectives inside them."""

    def __init__(self) -> None:
        self.in_seam = 0
        self.reset()

    def reset(self) -> None:
        self.seam_wall = self.seam_cpu = self.coll_wall = self.coll_cpu = 0.0

    def timed(self, fn, *, seam: bool = False, collective: bool = False):
        probe = self

        def wrapper(*args, **kwargs):
            if (seam and probe.in_seam) or (collective and not probe.in_seam):
                return fn(*args, **kwargs)
            w0, c0 = time.perf_counter(), time.thread_time()
            if seam:
                probe.in_seam += 1
            try:
                return fn(*args, **kwargs)
            finally:
                w, c = time.perf_counter() - w0, time.thread_time() - c0
                if seam:
                    probe.in_seam -= 1
                    probe.seam_wall += w
                    probe.seam_cpu += c
                else:
                    probe.coll_wall += w
                    probe.coll_cpu += c

        return wrapper


class _TimedWork:
    """A ``Work`` whose waiting counts as collective time."""

    def __init__(self, work, probe: _Probe) -> None:
        self._work = work
        self.wait = probe.timed(work.wait, collective=True)
        self.is_completed = probe.timed(work.is_completed, collective=True)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _time_collectives(probe: _Probe) -> None:
    """Time collectives at ``deepspeed.comm`` and ``torch.distributed``, each call once, at the outer layer.

    DeepSpeed's communication backend keeps its own references to some torch
    functions (its all_gather), so the outer ``deepspeed.comm`` layer is wrapped
    too. The ``Work`` of an async call times its waiting as collective time.
    """
    import deepspeed.comm as ds_comm
    import torch.distributed as dist

    depth = [0]

    def wrap(fn):
        timed = probe.timed(fn, collective=True)

        def collective(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            try:
                result = timed(*args, **kwargs)
            finally:
                depth[0] -= 1
            return _TimedWork(result, probe) if result is not None and hasattr(result, "wait") else result

        return collective

    for module in (ds_comm, dist):
        for name in _COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is not None:
                setattr(module, name, wrap(fn))


def _install_seam_probe(optimizer: Any, probe: _Probe) -> None:
    for name in ("process_gradients", "independent_gradient_partition_epilogue"):
        setattr(optimizer, name, probe.timed(getattr(optimizer, name), seam=True))


_STOCK_HOST_COPIES = ("async_inplace_copy_grad_to_fp32_buffer_from_gpu", "async_accumulate_grad_in_cpu_via_gpu")


def _host_copy_counter(optimizer: Any):
    """A function returning the host copies made so far: flatgrad's deliveries, or stock's per-parameter copies."""
    reduction = getattr(optimizer, "flatgrad", None)
    if reduction is not None:
        return lambda: sum(r.target_copies for r in reduction.reducers)
    count = [0]
    for name in _STOCK_HOST_COPIES:
        method = getattr(optimizer, name)

        def counted(*args, _method=method, **kwargs):
            count[0] += 1
            return _method(*args, **kwargs)

        setattr(optimizer, name, counted)
    return lambda: count[0]


# --------------------------------------------------------------------------- ranks


def _config(setup: str, args: argparse.Namespace, bucket: int, world_size: int) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": args.micro_batch * world_size,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": max(bucket, 10**8),
            "use_multi_rank_bucket_allreduce": setup != "stock_reduce",
        },
    }
    if args.offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if setup == "flatgrad" and args.backend:
        cfg["flatgrad"] = {"backend": args.backend}
    return cfg


def _run_model(
    rank: int, world_size: int, model_name: str, args: argparse.Namespace, probe: _Probe, recorder: CollectiveRecorder
) -> dict:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    import flatgrad.deepspeed as fds
    from flatgrad.testing.collectives import sent_bytes

    bucket = args.moe_bucket if model_name == "moe" else args.transformer_bucket
    engines, batch_fn, n_params, host_copies = {}, None, 0, {}
    for setup in SETUPS:
        torch.manual_seed(0)
        model, batch_fn = _MODELS[model_name]()
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        init = fds.initialize if setup == "flatgrad" else deepspeed.initialize
        cfg = _config(setup, args, bucket, world_size)
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=cfg)
        _install_seam_probe(engine.optimizer, probe)
        host_copies[setup] = _host_copy_counter(engine.optimizer)
        engines[setup] = engine
    sub_groups = len(engines["flatgrad"].optimizer.bit16_groups)
    generator = torch.Generator().manual_seed(1000 + rank)
    rows: dict[str, list[dict]] = {s: [] for s in SETUPS}
    for step in range(args.warmup + args.steps):
        x, y = batch_fn(generator, args.micro_batch)
        order = SETUPS[step % 3 :] + SETUPS[: step % 3]  # rotate who goes first
        for setup in order:
            engine = engines[setup]
            probe.reset()
            recorder.reset()
            recorder.phase = "forward"
            loss = engine(x, y)
            recorder.phase = "backward"
            copies = host_copies[setup]()
            t0 = time.perf_counter()
            engine.backward(loss)
            backward = time.perf_counter() - t0
            own_wall, own_cpu = probe.seam_wall - probe.coll_wall, probe.seam_cpu - probe.coll_cpu
            recorder.phase = "step"
            t0 = time.perf_counter()
            engine.step()
            step_time = time.perf_counter() - t0
            recorder.phase = "other"
            if step >= args.warmup:
                grad_calls = [c for c in recorder.calls if c.phase == "backward" and c.op in _GRADIENT_OPS]
                rows[setup].append(
                    {
                        "backward": backward,
                        "step": step_time,
                        "own": own_wall,
                        "own_cpu": own_cpu,
                        "calls": len(grad_calls),
                        "calls_by_op": {op: sum(1 for c in grad_calls if c.op == op) for op in _GRADIENT_OPS},
                        "sent": sum(sent_bytes(c, rank) for c in grad_calls),
                        "step_calls": sum(1 for c in recorder.calls if c.phase == "step"),
                        "host_copies": host_copies[setup]() - copies,
                    }
                )
    stock = {n: safe_get_full_fp32_param(p) for n, p in engines["stock"].module.named_parameters()}
    flat = {n: safe_get_full_fp32_param(p) for n, p in engines["flatgrad"].module.named_parameters()}
    max_rel = max(((stock[n] - flat[n]).abs().max() / stock[n].abs().max().clamp(min=1e-30)).item() for n in stock)
    return {"rows": rows, "n_params": n_params, "sub_groups": sub_groups, "max_rel": max_rel, "bucket": bucket}


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from flatgrad.testing.deepspeed_rank import init_deepspeed
    from flatgrad.testing.collectives import CollectiveRecorder

    init_deepspeed(rank, world_size, "cpu")
    probe = _Probe()
    recorder = CollectiveRecorder(_COLLECTIVES).install()
    _time_collectives(probe)
    return {name: _run_model(rank, world_size, name, args, probe, recorder) for name in args.models}


# --------------------------------------------------------------------------- report


def summarize(per_rank: list[dict], model: str) -> dict:
    """Per setup: median/min over steps of the slowest rank's times, mean over ranks of own time, calls, bytes."""
    ranks = [r[model] for r in per_rank]
    steps = len(ranks[0]["rows"]["stock"])
    out: dict[str, Any] = {
        "n_params_per_rank": ranks[0]["n_params"], "sub_groups": ranks[0]["sub_groups"], "bucket": ranks[0]["bucket"],
        "max_rel_fp32_vs_stock": max(r["max_rel"] for r in ranks), "steps": steps, "setups": {},
    }  # fmt: skip
    for setup in SETUPS:
        series = {
            "backward": [max(r["rows"][setup][k]["backward"] for r in ranks) for k in range(steps)],
            "step": [max(r["rows"][setup][k]["step"] for r in ranks) for k in range(steps)],
            "own": [statistics.fmean(r["rows"][setup][k]["own"] for r in ranks) for k in range(steps)],
            "own_cpu": [statistics.fmean(r["rows"][setup][k]["own_cpu"] for r in ranks) for k in range(steps)],
        }
        figures = {name: {"median": statistics.median(v), "min": min(v)} for name, v in series.items()}
        figures["calls_per_step"] = statistics.median(r["rows"][setup][k]["calls"] for r in ranks for k in range(steps))
        figures["calls_by_op"] = ranks[0]["rows"][setup][0]["calls_by_op"]
        figures["host_copies"] = statistics.median(
            r["rows"][setup][k]["host_copies"] for r in ranks for k in range(steps)
        )
        figures["step_calls"] = statistics.median(
            r["rows"][setup][k]["step_calls"] for r in ranks for k in range(steps)
        )
        figures["sent_MB_per_rank"] = (
            statistics.fmean(r["rows"][setup][k]["sent"] for r in ranks for k in range(steps)) / 1e6
        )
        out["setups"][setup] = figures
    base = out["setups"]["stock"]
    for setup in SETUPS:
        fig = out["setups"][setup]
        fig["ratio_to_stock"] = {
            name: fig[name]["median"] / base[name]["median"] if base[name]["median"] else float("nan")
            for name in ("backward", "step", "own", "own_cpu")
        }
        fig["ratio_to_stock"]["sent"] = (
            fig["sent_MB_per_rank"] / base["sent_MB_per_rank"] if base["sent_MB_per_rank"] else float("nan")
        )
    return out


def _ms(figure: dict) -> str:
    return f"{figure['median'] * 1e3:.1f}/{figure['min'] * 1e3:.1f}"


def format_table(model: str, s: dict) -> str:
    """One model's figures as a text table."""
    header = (
        f"{model}: {s['n_params_per_rank']:,} params/rank, reduce_bucket_size {s['bucket']:,}, "
        f"flatgrad sub-groups {s['sub_groups']}, {s['steps']} timed steps "
        "(ms: median/min; x: median / stock's median)"
    )
    columns = (
        "setup",
        "backward",
        "step",
        "own",
        "own_cpu",
        "calls",
        "MB/rank",
        "step calls",
        "host copies",
        "bwd x",
        "own x",
        "cpu x",
        "MB x",
    )
    widths = (13, 15, 15, 13, 13, 6, 8, 10, 11, 6, 6, 6, 6)
    lines = [header, " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(columns, widths)))]
    for setup, f in s["setups"].items():
        r = f["ratio_to_stock"]
        cells = (
            setup, _ms(f["backward"]), _ms(f["step"]), _ms(f["own"]), _ms(f["own_cpu"]), f"{f['calls_per_step']:.0f}",
            f"{f['sent_MB_per_rank']:.2f}", f"{f['step_calls']:.0f}", f"{f['host_copies']:.0f}",
            f"{r['backward']:.2f}", f"{r['own']:.2f}",
            f"{r['own_cpu']:.2f}", f"{r['sent']:.2f}",
        )  # fmt: skip
        ops = ",".join(f"{op}={n}" for op, n in f["calls_by_op"].items() if n)
        row = " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths)))
        lines.append(f"{row}  ({ops})")
    lines.append(
        f"flatgrad fp32 weights vs stock after the run: max relative difference {s['max_rel_fp32_vs_stock']:.2e}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--models", nargs="+", choices=sorted(_MODELS), default=["moe", "transformer"])
    parser.add_argument("--moe-bucket", type=int, default=1_000_000)
    parser.add_argument("--transformer-bucket", type=int, default=5_000_000)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", default=None, help="flatgrad kernel backend (default: auto)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--offload", action="store_true", help="every setup offloads the optimizer to the CPU (pinned, torch AdamW)"
    )
    parser.add_argument(
        "--sub-groups", type=int, nargs="+", default=None, metavar="G",
        help="run the sub-group sweep instead (bench/step_sweep.py: the optimizer step at G = 1, 10, 100, 400 "
        "sub-groups on one model, flatgrad against stock); --world-size, --warmup, --steps and --out apply",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.sub_groups:
        from flatgrad.bench import step_sweep

        sweep = ["--sub-groups", *map(str, args.sub_groups), "--world-size", str(args.world_size)]
        sweep += ["--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--out", args.out] if args.out else [])
        return step_sweep.main(sweep)
    if args.world_size % 4 and "moe" in args.models:
        parser.error("the seed MoE model needs a world size that is a multiple of 4 (ep_size 4)")
    from flatgrad.bench._harness import load_average, machine_info, machine_line
    from flatgrad.testing.launch import run_ranks

    info = machine_info()
    per_rank = run_ranks(_rank, args.world_size, args, timeout=args.timeout, threads=args.threads)
    info["load_average_1min_end"] = load_average()
    summary = {model: summarize(per_rank, model) for model in args.models}
    print(machine_line(info))
    offload = ", CPU optimizer offload (pinned)" if args.offload else ""
    print(f"{args.world_size} gloo ranks, {args.threads} torch thread(s) each, micro-batch {args.micro_batch}{offload}")
    for model in args.models:
        print()
        print(format_table(model, summary[model]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "args": vars(args), "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
