"""BucketReducer on CUDA over NCCL: the stream hand-off of [Note: streams] in docs/design.md.

Each test runs real NCCL ranks (one GPU each, spawned) and checks three
hand-offs, each made observable by a ``torch.cuda._sleep`` kernel that holds
one stream back while the other would run ahead if a wait were missing:

1. current -> ``pack_stream``: the first layer's gradients are produced
   behind a sleep on the current stream; a pack that did not wait reads
   uninitialised ``.grad`` memory.
2. ``pack_stream`` -> collective -> ``unpack_stream`` -> current: a sleep is
   queued on ``pack_stream`` before backward; the shards are cloned on the
   current stream right after ``finish()``, which must make it wait.
3. ``record_stream``: right after backward (the packs still held back) the
   test allocates and fills tensors of the gradients' sizes on the current
   stream; the caching allocator must not hand out the freed gradients' memory.

The net's weights, inputs and upstream gradients are small integers, so every
gradient and every average over 2 ranks is exact in fp32 and bf16: shards must
equal the reference (an NCCL all_reduce of a twin model's gradients) bit for
bit. With one rank there is no collective (the reduction is the identity) but
the process group is NCCL's and the stream hand-off is the same; the 2-rank
test adds the NCCL reduce_scatter between the pack and unpack streams.
Without a GPU every test skips, naming the GPUs it needs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatgrad
from flatgrad.reducer import BucketReducer, build_buckets
from flatgrad.testing.launch import run_ranks

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_STATUS = flatgrad.available_backends()

pytestmark = [
    pytest.mark.skipif(_GPUS == 0, reason="needs a CUDA GPU; none is visible"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="needs NCCL; this torch build has none"),
]

# About 50 ms on current GPUs: long enough that a missing wait lets the other stream run first.
_SLEEP_CYCLES = 100_000_000
_BATCH = 2
_BUCKET_NUMEL = 300  # several buckets for the small layers, one of its own for ``big``
_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _backend_param(name: str):
    status = _STATUS[name]
    ok = status.available and "cuda" in status.devices
    why = status.reason or f"{name} does not run on CUDA tensors here"
    return pytest.param(name, id=name, marks=[] if ok else [pytest.mark.skip(reason=f"{name} backend: {why}")])


_BACKENDS = [_backend_param(name) for name in ("cuda", "triton")]


class _Sleep(torch.autograd.Function):
    """Identity forward; backward queues a long kernel on the current stream before passing the gradient on."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(_SLEEP_CYCLES)
        return grad.clone()


class _IntNet(nn.Module):
    """Linear(16, 64) -> Linear(64, 8), plus a 512x1024 param with a linear loss term; integer weights."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(16, 64)
        self.lin2 = nn.Linear(64, 8)
        self.big = nn.Parameter(torch.zeros(512, 1024))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=gen))

    def loss(self, rank: int, step: int, slow_first_layer: bool) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        device = self.big.device
        x = torch.randint(-1, 2, (_BATCH, 16), generator=gen).float().to(device)
        dy = torch.randint(-1, 2, (_BATCH, 8), generator=gen).float().to(device)
        c = torch.randint(-2, 3, self.big.shape, generator=gen).float().to(device)
        h = self.lin1(x)
        if slow_first_layer:
            h = _Sleep.apply(h)  # lin1's gradients are made after the sleep
        return (self.lin2(h) * dy).sum() + (self.big * c).sum()


def _expected(reducer: BucketReducer, twin_of: dict, world_size: int) -> list[torch.Tensor]:
    """The twin's gradients all_reduced over NCCL, averaged, laid out as this rank's shards."""
    params = [p for bucket in reducer.buckets for p in bucket]
    flat = torch.cat([twin_of[p].grad.reshape(-1).float() for p in params])
    dist.all_reduce(flat)
    flat /= world_size
    full = dict(zip(params, flat.split([p.numel() for p in params])))
    shards = []
    for gs in reducer.grad_shards():
        shard = torch.zeros_like(gs.shard)
        for piece in gs.pieces:
            src = full[gs.params[piece.tensor_index]]
            shard[piece.shard_offset : piece.shard_offset + piece.length] = src[
                piece.tensor_offset : piece.tensor_offset + piece.length
            ]
        shards.append(shard)
    return shards


def _compare(label: str, got: list[torch.Tensor], expected: list[torch.Tensor]) -> list[str]:
    errors = []
    for bucket_id, (g, e) in enumerate(zip(got, expected)):
        if not torch.equal(g, e):
            bad = int((g != e).sum())
            errors.append(f"{label}: bucket {bucket_id}: {bad} of {g.numel()} elements differ from the reference")
    return errors


def _handoff_rank(rank: int, world_size: int, backend: str) -> list[str]:
    """Every comm dtype through ``_handoff``; the mismatches found, as text."""
    return [
        f"comm {name}: {error}"
        for name, dtype in _COMM_DTYPES.items()
        for error in _handoff(rank, world_size, backend, dtype)
    ]


def _handoff(rank: int, world_size: int, backend: str, comm_dtype: torch.dtype) -> list[str]:
    """Three phases, one per hand-off (see the module docstring); the mismatches found, as text."""
    device = torch.device("cuda", torch.cuda.current_device())
    model = _IntNet().to(device)
    twin = copy.deepcopy(model)
    twin_of = dict(zip(model.parameters(), twin.parameters()))
    reducer = BucketReducer(build_buckets(model, _BUCKET_NUMEL), comm_dtype=comm_dtype, backend=backend)
    assert set(reducer.kernel_backends) == {backend}, reducer.kernel_backends
    assert len(reducer.buckets) >= 3, [len(b) for b in reducer.buckets]
    pack_stream = reducer._buckets[0].pack_stream
    assert pack_stream is not None and pack_stream != torch.cuda.current_stream(device)
    errors: list[str] = []

    # 1. current -> pack_stream: lin1's gradients come after a sleep on the current stream.
    model.loss(rank, 0, slow_first_layer=True).backward()
    reducer.finish()
    twin.loss(rank, 0, slow_first_layer=False).backward()
    torch.cuda.synchronize()
    errors += _compare("gradients made behind a sleep", [gs.shard.clone() for gs in reducer.grad_shards()],
                       _expected(reducer, twin_of, world_size))  # fmt: skip

    # 2 and 3. pack_stream held back; freed gradients' sizes reallocated and filled on the current stream;
    # the shards read on the current stream right after finish(). Two micro-steps: copy, then add.
    reducer.zero_grad()
    twin.zero_grad(set_to_none=True)
    sizes = [p.numel() for p in model.parameters()]
    for step in (1, 2):
        pack_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(pack_stream):
            torch.cuda._sleep(_SLEEP_CYCLES)
        model.loss(rank, step, slow_first_layer=False).backward()
        junk = [torch.full((n,), 12345.0, device=device) for n in sizes]
        reducer.finish()
        got = [gs.shard.clone() for gs in reducer.grad_shards()]
        del junk
        twin.loss(rank, step, slow_first_layer=False).backward()
        torch.cuda.synchronize()
        errors += _compare(f"micro-step {step} read right after finish()", got, _expected(reducer, twin_of, world_size))
    reducer.remove_hooks()
    return errors


def _check(world_size: int, backend: str) -> None:
    results = run_ranks(_handoff_rank, world_size, backend, backend="nccl", start_method="spawn", timeout=150)
    errors = [f"rank {rank}: {e}" for rank, errs in enumerate(results) for e in errs]
    assert not errors, "\n".join(errors)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", _BACKENDS)
def test_stream_handoff_one_rank_nccl(backend: str) -> None:
    _check(1, backend)


@pytest.mark.timeout(180)
@pytest.mark.skipif(_GPUS < 2, reason=f"needs 2 CUDA GPUs, {_GPUS} visible")
@pytest.mark.parametrize("backend", _BACKENDS)
def test_stream_handoff_two_ranks_nccl(backend: str) -> None:
    _check(2, backend)
