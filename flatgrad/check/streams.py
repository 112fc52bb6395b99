"""The check's ``streams`` step: the reducer's shard delivery and the two-stage reduction's stream order on one GPU.

Every check holds a stream back with ``torch.cuda._sleep`` so that a missing wait shows as wrong data,
and uses small integer weights, inputs and gradients so that every expected value is exact in fp32
and bf16:

* ``targets``: a ``flatgrad.reducer.BucketReducer`` over a 1-rank NCCL group delivers a two-micro-step
  window into host fp32 ``shard_targets``, pinned and pageable, with fp32 and bf16 accumulation
  (bf16 params). ``final_micro_step`` is set before the last micro-step's backward, which runs behind a
  sleep on the current stream; right after ``finish()`` the host targets must hold the window's
  summed gradients (bf16 accumulation: the bf16 shard's values, exactly, in fp32).
* ``deliver``: a window whose last micro-step was not announced; after ``finish()`` the current stream
  sleeps and then fills bucket 0's device shard with 7s; ``deliver()`` must wait for the current
  stream, so the target holds 7s.
* ``two-stage``: ``flatgrad.reducer.TwoStageReduceScatter`` for 2 nodes x 2 ranks, driven through a
  ``flatgrad.reducer.Bucket`` (bind, pack, start, wait, unpack) with stand-in collectives
  (``StandInCollectives``): each call runs on a fresh side stream that first waits for the current
  stream, sleeps, then writes the sum of the group's chunks of its input (the node stage sleeping
  longer than the rail stage). The unpacked shard equals the sum of the packed buffer's 4 segments
  only when the rail stage started after the node stage finished and the unpack after the rail stage.
  Every one of the 4 emulated ranks is checked.

Needs a CUDA GPU (exit status 2 without one). Writes ``--out`` JSON and prints one JSON line;
exit status 1 when a check failed.

``python -m flatgrad.check.streams [--out FILE] [--sleep-cycles N]``
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any, Callable, Sequence

import torch

__all__ = ["SLEEP_CYCLES", "StandInCollectives", "build_parser", "two_stage", "targets", "deliver", "run", "main"]

# Long enough that a missing wait lets the other stream run first.
SLEEP_CYCLES = 100_000_000
_BUCKET_NUMEL = 200


class _Work:
    """A stand-in collective's work: ``wait()`` orders the current stream after it; ``is_completed()`` queries it."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> bool:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()


class StandInCollectives:
    """Collectives that run as if every rank of the group held this rank's input, late, on a side stream.

    ``reduce_scatter_tensor(output, input, group=...)`` writes ``input.view(W, -1).sum(0)`` into ``output``
    (``W``: the group's size); ``all_to_all_single(output, input, group=...)`` writes this rank's chunk of
    ``input`` into every chunk of ``output``, as W identical ranks would send it. Each runs on a new stream
    that first waits for the current one and then sleeps ``sleeps[i]`` cycles (``i``: the call's index,
    the last entry repeated); on CPU it writes at once. ``collectives()`` gives them as
    ``flatgrad.comm.Collectives``.
    """

    def __init__(self, sleeps: Sequence[int]) -> None:
        self.sleeps = list(sleeps)
        self.calls = 0

    def _late(self, write: Callable[[], None], device: torch.device, async_op: bool) -> _Work | None:
        """Run ``write`` behind this call's sleep on a side stream (at once on CPU); its work, or wait for it."""
        cycles = self.sleeps[min(self.calls, len(self.sleeps) - 1)]
        self.calls += 1
        if device.type != "cuda":
            write()
            return _Work(None) if async_op else None
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            write()
            event = torch.cuda.Event()
            event.record(side)
        work = _Work(event)
        if not async_op:
            work.wait()
            return None
        return work

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, *, op: Any = None, group: Any = None,
                              async_op: bool = False) -> _Work | None:  # fmt: skip
        import torch.distributed as dist

        world = dist.get_world_size(group)
        if input.numel() != world * output.numel():
            raise ValueError(f"input has {input.numel()} elements, expected {world} x {output.numel()}")
        return self._late(lambda: output.copy_(input.view(world, -1).sum(0)), input.device, async_op)

    def reduce_scatter_list(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], **kwargs: Any) -> _Work | None:
        return self.reduce_scatter_tensor(output, torch.cat(list(inputs)), **kwargs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *, group: Any = None,
                          async_op: bool = False) -> _Work | None:  # fmt: skip
        import torch.distributed as dist

        world, rank = dist.get_world_size(group), (group.rank() if group is not None else dist.get_rank())
        if input.numel() != output.numel() or input.numel() % world:
            raise ValueError(f"input and output must have one size divisible by {world}, got {input.numel()}, "
                             f"{output.numel()}")  # fmt: skip
        return self._late(lambda: output.view(world, -1).copy_(input.view(world, -1)[rank]), input.device, async_op)

    def collectives(self) -> Any:
        """These calls as the ``flatgrad.comm.Collectives`` a ``Bucket`` takes."""
        from flatgrad import comm

        return comm.Collectives(reduce_scatter_tensor=self.reduce_scatter_tensor,
                                reduce_scatter_list=self.reduce_scatter_list,
                                all_to_all_single=self.all_to_all_single)  # fmt: skip


def _small_ints(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, 2, shape, generator=gen).to(dtype)


def two_stage(device: torch.device, cycles: int = SLEEP_CYCLES) -> list[dict[str, Any]]:
    """The two-stage stream order for each of the 4 emulated ranks of 2 nodes x 2; one check entry each."""
    import torch.distributed as dist

    from flatgrad import Layout, comm
    from flatgrad.kernels import reference
    from flatgrad.reducer import Bucket, TwoStageReduceScatter, place_ranks

    numels = (37, 4, 300, 1, 58)
    layout = Layout.flat(list(numels), 4)
    s = layout.shard_numel
    params = tuple(torch.nn.Parameter(torch.zeros(n, device=device)) for n in numels)
    grads = [_small_ints((n,), 11 + i).to(device) for i, n in enumerate(numels)]
    packed = torch.zeros(layout.numel)
    reference.pack([g.cpu() for g in grads], layout, packed, 1.0)
    expected = packed.view(4, s).sum(0)  # every segment, whatever the order they are packed in
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)  # a size-2 group for the stand-ins; it issues nothing

    def check(rank: int, made: list) -> tuple[bool, str]:
        mode = TwoStageReduceScatter(place_ranks(2, [0, 1, 2, 3], 4, rank))
        mode.node_group = mode.rail_group = group
        bucket = Bucket(0, params, layout, rank, comm_dtype=torch.float32,
                        averaging=comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0), method="tensor", backend=None,
                        mode=mode, prescale=1.0, postscale=1.0, streams=None)  # fmt: skip
        stand_in = StandInCollectives([2 * cycles, cycles])  # the node stage finishes last if nothing waits
        buffer = torch.full((layout.numel,), float("nan"), device=device)
        flight = bucket.reduce(grads, group, stand_in.collectives(), buffers={"input": buffer})
        flight.wait()
        shard = torch.full((s,), -1.0, device=device)
        flight.unpack(shard, False, False)
        got = shard.cpu()
        ok = stand_in.calls == 2 and torch.equal(got, expected)
        detail = "" if ok else (f"{stand_in.calls} collective calls; shard differs from the sum of the 4 "
                                f"segments at {int((got != expected).sum())} of {s} elements")  # fmt: skip
        return ok, detail

    return [_entry(f"two-stage rank {rank} of 2x2", lambda made, r=rank: check(r, made)) for rank in range(4)]


class _Net:
    """Small integer weights (fp32 or bf16): ``loss = ((x @ w1) @ w2 + b) . g + e . f``, every gradient exact."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        shapes = {"w1": (24, 16), "w2": (16, 5), "b": (5,), "e": (300,)}
        self.params = [torch.nn.Parameter(_small_ints(shape, 100 + i, dtype).to(device))
                       for i, shape in enumerate(shapes.values())]  # fmt: skip
        self.dtype, self.device = dtype, device

    def inputs(self, micro: int) -> tuple[torch.Tensor, ...]:
        """Micro-step ``micro``'s ``x``, ``g``, ``f`` on the device. Made before a check's sleep: a copy from
        pageable host memory syncs the host with the stream, which would wait the sleep out."""
        shapes = ((2, 24), (2, 5), (300,))
        return tuple(_small_ints(shape, 100 * (k + 2) + micro, self.dtype).to(self.device) for k, shape in enumerate(shapes))

    def loss(self, params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        w1, w2, b, e = params
        x, g, f = inputs
        return (((x @ w1) @ w2 + b) * g).sum() + (e * f).sum()

    def window_grads(self, micros: Sequence[int]) -> list[torch.Tensor]:
        """Each param's gradient summed over ``micros`` in fp32 (a twin of the params; exact)."""
        twin = [p.detach().clone().requires_grad_(True) for p in self.params]
        total = [torch.zeros(p.shape) for p in self.params]
        for micro in micros:
            for t, g in zip(total, torch.autograd.grad(self.loss(twin, self.inputs(micro)), twin)):
                t += g.float().cpu()
        return total


def _expected(reducer: Any, net: _Net, micros: Sequence[int]) -> list[torch.Tensor]:
    """Per bucket: its shard of the window's summed gradients, fp32 on the host (world size 1: the packed bucket)."""
    from flatgrad.kernels import reference

    grads = {id(p): g for p, g in zip(net.params, net.window_grads(micros))}
    shards = []
    for params, layout in zip(reducer.buckets, reducer.layouts):
        out = torch.zeros(layout.numel)
        reference.pack([grads[id(p)] for p in params], layout, out, 1.0)
        shards.append(out.narrow(0, 0, layout.shard_numel))
    return shards


def _reducer(net: _Net, accum: torch.dtype, pinned: bool) -> tuple[Any, list[torch.Tensor]]:
    from flatgrad.reducer import BucketReducer, build_buckets

    buckets = build_buckets(net.params, _BUCKET_NUMEL)
    probe = BucketReducer(buckets, accum_dtype=accum, register_hooks=False)
    sentinel = -7777.0
    hosts = [torch.full((layout.shard_numel,), sentinel, pin_memory=pinned) for layout in probe.layouts]
    return BucketReducer(buckets, accum_dtype=accum, shard_targets=hosts), hosts


def _entry(name: str, check: Callable[[list], tuple[bool, str]]) -> dict[str, Any]:
    """One check's entry: ``check(made)`` gives ``(ok, detail)``; a crash is a failed check, and the hooks of
    every reducer it appended to ``made`` are removed whatever happened."""
    made: list = []
    try:
        ok, detail = check(made)
    except Exception as exc:  # noqa: BLE001 - a crash is a failed check; the next one runs
        ok, detail = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"
    finally:
        for reducer in made:
            reducer.remove_hooks()
    return {"name": name, "ok": ok, "detail": detail}


def targets(cycles: int = SLEEP_CYCLES) -> list[dict[str, Any]]:
    """Delivery into pinned and pageable host fp32 targets, fp32 and bf16 accumulation; one entry per case."""

    def check(accum: torch.dtype, pinned: bool, made: list) -> tuple[bool, str]:
        net = _Net(accum, torch.device("cuda"))
        reducer, hosts = _reducer(net, accum, pinned)
        made.append(reducer)
        for micro in range(2):
            reducer.final_micro_step = micro == 1
            inputs = net.inputs(micro)
            if micro == 1:
                torch.cuda._sleep(cycles)  # the last backward's gradients come late
            net.loss(net.params, inputs).backward()
            reducer.finish()
        got = [h.clone() for h in hosts]  # read at once: finish() must have waited for the delivery
        want = _expected(reducer, net, range(2))
        shards = [gs.shard for gs in reducer.grad_shards()]
        bad = [b for b, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
        not_targets = [b for b, (s, h) in enumerate(zip(shards, hosts)) if s is not h]
        ok = not bad and not not_targets and reducer.target_copies > 0
        detail = "" if ok else (f"buckets whose host target differs: {bad}; shards that are not the targets: "
                                f"{not_targets}; target copies {reducer.target_copies}")  # fmt: skip
        reducer.zero_grad()
        return ok, detail

    entries = []
    for accum in (torch.float32, torch.bfloat16):
        for pinned in (True, False):
            name = f"targets {'pinned' if pinned else 'pageable'} host fp32, {str(accum).split('.')[-1]} accumulation"
            entries.append(_entry(name, lambda made, a=accum, p=pinned: check(a, p, made)))
    return entries


def deliver(cycles: int = SLEEP_CYCLES) -> list[dict[str, Any]]:
    """``deliver()`` after an unannounced last micro-step waits for the current stream; one entry."""

    def check(made: list) -> tuple[bool, str]:
        net = _Net(torch.bfloat16, torch.device("cuda"))
        reducer, hosts = _reducer(net, torch.bfloat16, True)
        made.append(reducer)
        net.loss(net.params, net.inputs(0)).backward()
        reducer.finish()  # final_micro_step left False: nothing delivered yet
        shards = reducer.grad_shards()
        torch.cuda._sleep(cycles)
        shards[0].shard.fill_(7)  # behind the sleep, on the current stream
        reducer.deliver()
        got = [h.clone() for h in hosts]
        want = _expected(reducer, net, [0])
        want[0] = torch.full_like(want[0], 7.0)
        bad = [b for b, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]
        reducer.zero_grad()
        return not bad, "" if not bad else f"buckets whose host target differs after deliver(): {bad} (bucket 0 must be all 7s)"

    return [_entry("deliver() waits for the current stream", check)]


def run(cycles: int = SLEEP_CYCLES) -> dict[str, Any]:
    """Every check on GPU 0: the reducer's under a 1-rank NCCL group, then the two-stage order; the figures."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    entries: list[dict[str, Any]] = []
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        parts: list[Callable[[int], list[dict[str, Any]]]] = [targets, deliver]
        for part in parts:
            entries += part(cycles)
    finally:
        dist.destroy_process_group()
    entries += two_stage(torch.device("cuda"), cycles)
    torch.cuda.synchronize()
    failures = [f"{e['name']}: {e['detail']}" for e in entries if not e["ok"]]
    return {"gpu": torch.cuda.get_device_name(0), "checks": entries, "cases": len(entries), "failures": failures,
            "ok": not failures}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.streams",
                                     description=(__doc__ or "").splitlines()[0])  # fmt: skip
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--sleep-cycles", type=int, default=SLEEP_CYCLES,
                        help=f"cycles each torch.cuda._sleep holds a stream back (default {SLEEP_CYCLES:.0e})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run every check; 0 when all pass, 1 when one fails, 2 without a CUDA GPU."""
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("streams: needs a CUDA GPU; none is visible to torch", file=sys.stderr)
        return 2
    doc = run(args.sleep_cycles)
    for entry in doc["checks"]:
        detail = f": {entry['detail']}" if entry["detail"] else ""
        print(f"{'ok  ' if entry['ok'] else 'FAIL'} {entry['name']}{detail}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("gpu", "cases", "failures", "ok")}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
