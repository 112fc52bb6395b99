"""BucketReducer on real gloo ranks: shards against an all_reduce reference, collective count, safety.

The exact tests use a small net whose weights, inputs and upstream gradients are
small integers: every gradient, every cross-rank sum and every average over 2
or 4 ranks is then exactly representable in fp32 and bf16, whatever the
reduction order, so the shards must equal the reference bit for bit.
"""

from __future__ import annotations

import copy
import os
from unittest import mock
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flatgrad import comm
from flatgrad.reducer import BucketReducer, LayoutMismatchError, build_buckets
from flatgrad.reducer.shards import widen_in_place
from flatgrad.testing.collectives import count_collectives
from flatgrad.testing.launch import EXITED, run_ranks

BATCH = 2


class _IntNet(nn.Module):
    """Embedding -> Linear -> frozen identity -> (optional branch) -> Linear, plus a param larger than a bucket.

    ``unused`` never takes part in the forward; ``branch`` only on some ranks and
    steps; ``frozen`` does not require grad.
    """

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, width)
        self.lin1 = nn.Linear(width, 4)
        self.frozen = nn.Linear(4, 4)
        self.branch = nn.Linear(4, 4)
        self.unused = nn.Linear(3, 2)
        self.lin2 = nn.Linear(4, 2)
        self.big = nn.Parameter(torch.zeros(7, 11))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=gen))
            self.frozen.weight.copy_(torch.eye(4))
            self.frozen.bias.zero_()
        self.frozen.requires_grad_(False)

    def loss(self, rank: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        idx = torch.tensor([rank % 6, (rank + 3) % 6])  # distinct rows: embedding grads stay small
        h = self.frozen(self.lin1(self.emb(idx)))
        if (rank + step) % 2 == 0:
            h = h + self.branch(h)
        dy = torch.randint(-1, 2, (BATCH, 2), generator=gen).to(h.dtype)
        c = torch.randint(-2, 3, self.big.shape, generator=gen).to(h.dtype)
        return (self.lin2(h) * dy).sum() + (self.big * c).sum()


def _expected_shards(
    reducer: BucketReducer, twin_of: dict, world_size: int, average: bool, scale: float = 1.0
) -> list[torch.Tensor]:
    """The reference: all_reduce of the full gradients (averaged, times ``scale``), sliced to this rank's pieces."""
    params = [p for bucket in reducer.buckets for p in bucket]
    grads = [twin_of[p].grad if twin_of[p].grad is not None else torch.zeros_like(twin_of[p]) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    if average:
        flat /= world_size
    flat *= scale
    full = dict(zip(params, flat.split([p.numel() for p in params])))
    expected = []
    for gs in reducer.grad_shards():
        shard = torch.zeros(gs.layout.shard_numel)
        for piece in gs.pieces:
            src = full[gs.params[piece.tensor_index]]
            shard[piece.shard_offset : piece.shard_offset + piece.length] = src[
                piece.tensor_offset : piece.tensor_offset + piece.length
            ]
        expected.append(shard)
    return expected


def _run_steps(model, twin, reducer, rank, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        model.loss(rank, step).backward()
        reducer.finish()
        twin.loss(rank, step).backward()


_EXACT_CONFIGS = [
    dict(comm_dtype=torch.float32, average=True, layout="flat", align=1),
    dict(comm_dtype=torch.bfloat16, average=True, layout="flat", align=1),
    dict(comm_dtype=torch.float32, average=False, layout="flat", align=1),
    dict(comm_dtype=torch.bfloat16, average=False, layout="chunked", align=1),
    dict(comm_dtype=torch.float32, average=True, layout="chunked", align=4),
    dict(comm_dtype=None, average=True, layout="flat", align=8, param_dtype=torch.bfloat16),
    dict(comm_dtype=torch.float16, average=True, layout="flat", align=1),  # 1/W folded: pre 1/p, post p/W
    dict(comm_dtype=torch.bfloat16, average=True, layout="flat", align=1, no_avg=True),  # 1/W folded into unpack
    dict(comm_dtype=torch.float32, average=False, layout="flat", align=1, prescale=2.0, postscale=0.25),
    dict(comm_dtype=torch.float32, average=True, layout="flat", align=1, comm_buffers=1),  # pack waits for unpack
    dict(comm_dtype=torch.bfloat16, average=True, layout="chunked", align=1, comm_buffers=3),
    dict(comm_dtype=torch.bfloat16, average=False, layout="flat", align=1, accum_dtype=torch.bfloat16),
    dict(comm_dtype=torch.bfloat16, average=True, layout="flat", align=1, reduction="exact"),
    dict(comm_dtype=torch.float32, average=False, layout="chunked", align=4, reduction="exact", comm_buffers=1),
    dict(comm_dtype=torch.float16, average=True, layout="flat", align=1, reduction="exact", comm_buffers=3),
]


def _exact_rank(rank: int, world_size: int) -> list:
    """Per config: (label, [(got, expected)] after 3 accumulated micro-steps, then after a new window of 1)."""
    out = []
    for config in _EXACT_CONFIGS:
        config = dict(config)
        param_dtype = config.pop("param_dtype", torch.float32)
        model = _IntNet().to(param_dtype)
        twin = copy.deepcopy(model)
        twin_of = dict(zip(model.parameters(), twin.parameters()))
        buckets = build_buckets(model, 24)
        if config.pop("no_avg", False):
            # A backend without ReduceOp.AVG (gloo before torch 2.8): the fallback path, on real collectives.
            with mock.patch.object(comm, "avg_supported", return_value=False):
                reducer = BucketReducer(buckets, **config)
            assert reducer._buckets[0].op == dist.ReduceOp.SUM or world_size == 1
        else:
            reducer = BucketReducer(buckets, **config)
        label = f"{config} params {param_dtype} W={world_size}"
        scale = config.get("prescale", 1.0) * config.get("postscale", 1.0)
        assert all(not p.requires_grad for p in model.frozen.parameters())
        assert not any(p is model.frozen.weight for b in reducer.buckets for p in b)
        _run_steps(model, twin, reducer, rank, 3)
        assert all(p.grad is None for p in model.parameters()), "param.grad must be freed once packed"
        assert all(gs.shard.dtype == config.get("accum_dtype", torch.float32) for gs in reducer.grad_shards())
        got = [gs.shard.to(torch.float32, copy=True) for gs in reducer.grad_shards()]
        expected = _expected_shards(reducer, twin_of, world_size, config["average"], scale)
        out.append((label + " after 3 micro-steps", got, expected))
        reducer.zero_grad()
        twin.zero_grad(set_to_none=True)
        _run_steps(model, twin, reducer, rank, 1, first_step=3)
        got = [gs.shard.to(torch.float32, copy=True) for gs in reducer.grad_shards()]
        expected = _expected_shards(reducer, twin_of, world_size, config["average"], scale)
        out.append((label + " after zero_grad + 1", got, expected))
        reducer.remove_hooks()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_equal_allreduce_reference_exactly(world_size):
    results = run_ranks(_exact_rank, world_size, timeout=100)
    for rank, per_config in enumerate(results):
        for label, got, expected in per_config:
            assert len(got) == len(expected)
            for bucket_id, (g, e) in enumerate(zip(got, expected)):
                assert g.dtype == torch.float32
                assert torch.equal(g, e), f"rank {rank} bucket {bucket_id} {label}:\n got {g}\n expected {e}"


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 7))

    def loss(self, rank: int, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(77 * rank + step)
        x = torch.randn(5, 33, generator=gen)
        return self.net(x).square().mean()


def _random_rank(rank: int, world_size: int) -> list:
    """Random fp32 data, 3 micro-steps, hooks off (an integration calls mark_ready itself)."""
    out = []
    for register_hooks in (True, False):
        torch.manual_seed(0)
        model = _MLP()
        twin = copy.deepcopy(model)
        twin_of = dict(zip(model.parameters(), twin.parameters()))
        reducer = BucketReducer(build_buckets(model, 1000), register_hooks=register_hooks)
        for step in range(3):
            model.loss(rank, step).backward()
            if not register_hooks:
                for p in reversed(list(model.parameters())):
                    reducer.mark_ready(p)
            reducer.finish()
            twin.loss(rank, step).backward()
        got = [gs.shard.clone() for gs in reducer.grad_shards()]
        out.append((register_hooks, got, _expected_shards(reducer, twin_of, world_size, True)))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_random_fp32_shards_match_reference(world_size):
    for rank, per_config in enumerate(run_ranks(_random_rank, world_size, timeout=80)):
        for hooks, got, expected in per_config:
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, msg=lambda m: f"rank {rank} hooks={hooks}: {m}")


def _count_rank(rank: int, world_size: int, method: str) -> list:
    model = _IntNet()
    reducer = BucketReducer(build_buckets(model, 24), method=method)
    counts = []
    for step in range(2):
        loss = model.loss(rank, step)
        with count_collectives() as counted:
            loss.backward()
            reducer.finish()
        counts.append(dict(counted))
    return [len(reducer.buckets), counts]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "world_size,method,name",
    [
        (2, "auto", "reduce_scatter"),
        (4, "auto", "reduce_scatter"),
        (2, "tensor", "reduce_scatter_single"),
        (1, "auto", None),
    ],
)
def test_one_reduce_scatter_per_bucket_per_backward(world_size, method, name):
    for rank, (num_buckets, counts) in enumerate(run_ranks(_count_rank, world_size, method, timeout=80)):
        assert num_buckets == 5
        expected = {name: num_buckets} if name else {}  # world size 1: no collective at all
        if name == "reduce_scatter_single" and not hasattr(dist, "reduce_scatter_single"):
            expected = {"reduce_scatter_tensor": num_buckets}
        assert counts == [expected, expected], f"rank {rank}"


class _Shaped(nn.Module):
    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(w, 3) for w in widths)


def _mismatch_rank(rank: int, world_size: int) -> list:
    """Three disagreements; each must raise on every rank. Returns (exception type, message) per case."""
    cases = [
        [4, 5, 6] if rank == 0 else [4, 7, 6],  # one param shape differs
        [4, 5, 6] if rank == 0 else [4, 5, 6, 8],  # one more bucket on the other ranks
        "frozen" if rank == world_size - 1 else [4, 5, 6],  # a local setup error on the last rank
    ]
    out = []
    for case in cases:
        if case == "frozen":
            model = _Shaped([4, 5, 6])
            model.layers[0].weight.requires_grad_(False)
            buckets = [list(model.layers[0].parameters())]
        else:
            model = _Shaped(case)
            buckets = [list(layer.parameters()) for layer in reversed(model.layers)]
        try:
            BucketReducer(buckets)
        except Exception as exc:  # every rank must get here
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append((None, "no error"))
    # The group still works after the failed setups: nothing is left half-matched.
    flag = torch.ones(1)
    dist.all_reduce(flag)
    out.append(("all_reduce", float(flag)))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_layout_mismatch_raises_on_every_rank(world_size):
    results = run_ranks(_mismatch_rank, world_size, timeout=80)
    last = world_size - 1
    for rank, (shape, count, local, after) in enumerate(results):
        assert shape[0] == "LayoutMismatchError", (rank, shape)
        assert "bucket 1 param 0" in shape[1] and "(3, 5)" in shape[1] and "(3, 7)" in shape[1], shape[1]
        assert count[0] == "LayoutMismatchError", (rank, count)
        assert "rank 0 has 3 buckets" in count[1] and "has 4" in count[1], count[1]
        assert "bucket 0 param 0 has shape (3, 6)" in count[1] and "(3, 8)" in count[1], count[1]
        if rank == last:
            assert local[0] == "ValueError" and "does not require grad" in local[1], local
        else:
            assert local[0] == "LayoutMismatchError" and f"rank {last} failed" in local[1], local
        assert after == ("all_reduce", float(world_size))
    assert issubclass(LayoutMismatchError, RuntimeError)


PG_TIMEOUT_S = 4.0


def _dead_rank(rank: int, world_size: int, mode: str) -> tuple:
    # A group of its own with a short timeout: the default group's rendezvous needs a long one
    # on a loaded machine. This also runs the reducer on a group that is not the default one.
    group = dist.new_group(timeout=timedelta(seconds=PG_TIMEOUT_S))
    model = _IntNet()
    reducer = BucketReducer(build_buckets(model, 24), process_group=group)
    if rank == world_size - 1:
        if mode == "exit":
            os._exit(0)  # dies after setup, before backward
        time.sleep(PG_TIMEOUT_S + 4)  # hangs past the group's timeout, then leaves
        return "hung"
    start = time.monotonic()
    try:
        model.loss(rank, 0).backward()
        reducer.finish()
    except Exception as exc:
        return time.monotonic() - start, type(exc).__name__, str(exc)
    return time.monotonic() - start, None, "finished without an error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size,mode", [(2, "exit"), (4, "exit"), (2, "hang")])
def test_dead_rank_makes_survivors_raise(world_size, mode):
    results = run_ranks(_dead_rank, world_size, mode, timeout=40, may_exit=(world_size - 1,), grace=1.0)
    assert results[-1] == (EXITED if mode == "exit" else "hung")
    for rank, (elapsed, kind, message) in enumerate(results[:-1]):
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"reduce_scatter of bucket 0 failed on rank {rank}" in message, message
        assert elapsed < PG_TIMEOUT_S + 3.0, f"rank {rank} took {elapsed:.1f}s to fail"


def _refusals_rank(rank: int, world_size: int) -> dict:
    """Setup refusals and misuse, each with the message it raises (world size 1)."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = (None, "no error")

    dense = nn.Parameter(torch.zeros(3))
    attempt("sparse param", lambda: BucketReducer([[dense, nn.Parameter(torch.zeros(4, 4).to_sparse())]]))
    attempt("mixed devices", lambda: BucketReducer([[dense, nn.Parameter(torch.zeros(3, device="meta"))]]))
    attempt("mixed dtypes", lambda: BucketReducer([[dense, nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]]))
    attempt("duplicate", lambda: BucketReducer([[dense], [dense]]))
    attempt("empty bucket", lambda: BucketReducer([[dense], []]))
    attempt("sparse module", lambda: build_buckets(nn.Embedding(5, 2, sparse=True), 10))
    for bad in (0, True, 1.5):
        attempt(f"comm_buffers={bad!r}", lambda: BucketReducer([[dense]], comm_buffers=bad))
    attempt("accum_dtype int", lambda: BucketReducer([[dense]], accum_dtype=torch.int32))
    attempt("collectives", lambda: BucketReducer([[dense]], collectives=torch.distributed))
    other = nn.Parameter(torch.zeros(5))
    attempt("shard_arena repeat", lambda: BucketReducer([[dense], [other]], shard_arena=[0, 0]))
    attempt("shard_arena short", lambda: BucketReducer([[dense], [other]], shard_arena=[0]))

    emb = nn.Embedding(5, 2, sparse=True)
    reducer = BucketReducer([list(emb.parameters())])
    attempt("sparse grad", lambda: emb(torch.tensor([1, 2])).sum().backward())
    reducer.remove_hooks()

    model = _IntNet()
    reducer = BucketReducer(build_buckets(model, 24))
    model.loss(0, 0).backward()
    attempt("zero_grad mid-step", reducer.zero_grad)
    attempt("second backward", lambda: model.loss(0, 1).backward())
    reducer.finish()
    attempt("zero_grad after finish", reducer.zero_grad)
    attempt("second hooked reducer", lambda: BucketReducer(build_buckets(model, 24)))
    reducer.remove_hooks()
    attempt("hooked again after remove_hooks", lambda: BucketReducer(build_buckets(model, 24)).remove_hooks())

    lin = nn.Linear(4, 4)
    BucketReducer([list(lin.parameters())])
    lin.weight.data = lin.weight.data[:2]
    attempt("resized param", lambda: (lin.weight.sum() + lin.bias.sum()).backward())
    return out


@pytest.mark.timeout(60)
def test_setup_refusals_and_misuse():
    (out,) = run_ranks(_refusals_rank, 1, timeout=50)
    kind, message = out["sparse param"]
    assert kind == "ValueError" and "buckets[0][1]" in message and "sparse" in message
    kind, message = out["mixed devices"]
    assert kind == "ValueError" and "meta" in message and "buckets[0][1]" in message
    assert out["mixed dtypes"][0] == "ValueError" and "comm_dtype" in out["mixed dtypes"][1]
    assert out["duplicate"][0] == "ValueError" and "buckets[0][0]" in out["duplicate"][1]
    assert out["empty bucket"][0] == "TypeError" and "buckets[1]" in out["empty bucket"][1]
    assert out["sparse module"][0] == "ValueError" and "sparse" in out["sparse module"][1]
    for bad in (0, True, 1.5):
        kind, message = out[f"comm_buffers={bad!r}"]
        assert kind == "ValueError" and "comm_buffers" in message and repr(bad) in message
    assert out["accum_dtype int"][0] == "ValueError" and "accum_dtype" in out["accum_dtype int"][1]
    assert out["collectives"][0] == "TypeError" and "collectives must be a flatgrad.comm.Collectives" in out["collectives"][1]
    for case in ("shard_arena repeat", "shard_arena short"):
        kind, message = out[case]
        assert kind == "ValueError" and "shard_arena must be a permutation of range(2)" in message, out[case]
    assert out["sparse grad"][0] == "ValueError" and "sparse gradient" in out["sparse grad"][1]
    kind, message = out["second hooked reducer"]
    assert kind == "ValueError" and "another BucketReducer" in message and "remove_hooks" in message
    assert out["hooked again after remove_hooks"] == (None, "no error")
    kind, message = out["resized param"]
    assert kind == "ValueError" and "planned for 16" in message and "8 elements" in message
    assert out["zero_grad mid-step"][0] == "RuntimeError" and "finish() first" in out["zero_grad mid-step"][1]
    # A second backward before finish() marks params ready twice: refused, naming the cause.
    assert out["second backward"][0] == "RuntimeError" and "ready twice" in out["second backward"][1]
    assert out["zero_grad after finish"] == (None, "no error")


@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=20),
    frozen=st.lists(st.booleans(), min_size=20, max_size=20),
    bucket_numel=st.integers(1, 120),
)
@settings(max_examples=60, deadline=None)
def test_build_buckets_order_and_sizes(numels, frozen, bucket_numel):
    params = [nn.Parameter(torch.zeros(n), requires_grad=not f) for n, f in zip(numels, frozen)]
    buckets = build_buckets(params, bucket_numel)
    trainable = [p for p in params if p.requires_grad]
    flat = [p for b in buckets for p in b]
    assert [id(p) for p in flat] == [id(p) for p in reversed(trainable)]
    sizes = [sum(p.numel() for p in b) for b in buckets]
    for b, size in zip(buckets, sizes):  # over the target only by one large param after less than half a bucket
        assert b and (size <= bucket_numel or 2 * (size - b[-1].numel()) < bucket_numel)
    for i in range(len(buckets) - 1):  # a bucket closes only when at least half full and the next param overflows it
        assert 2 * sizes[i] >= bucket_numel and sizes[i] + buckets[i + 1][0].numel() > bucket_numel


def test_build_buckets_splits_devices_and_dtypes():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    c = nn.Parameter(torch.zeros(2, device="meta"))
    assert [[id(p) for p in bk] for bk in build_buckets([a, b, c], 100)] == [[id(c)], [id(b)], [id(a)]]
    with pytest.raises(ValueError, match="bucket_numel"):
        build_buckets([a], 0)
    with pytest.raises(TypeError, match="one tensor"):
        build_buckets(a, 10)


def test_reducer_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        BucketReducer([[nn.Parameter(torch.zeros(2))]])


def _seam_rank(rank: int, world_size: int) -> dict:
    """A reducer issues every collective through the ``Collectives`` it is given, with the same result."""
    from flatgrad import comm

    out: dict = {}
    for reduction, method in (("reduce_scatter", "list"), ("reduce_scatter", "tensor"), ("exact", "auto")):
        shards = []
        issued: list[str] = []
        for given in (None, "recording"):
            collectives = None
            if given:
                torch_ = comm.TORCH_COLLECTIVES

                def record(name, fn):
                    def call(*args, **kwargs):
                        issued.append(name)
                        return fn(*args, **kwargs)

                    return call

                collectives = comm.Collectives(*(record(n, f) for n, f in zip(comm.Collectives._fields, torch_)))
            model = _IntNet()
            reducer = BucketReducer(
                build_buckets(model, 24), method=method, reduction=reduction, collectives=collectives
            )
            model.loss(rank, 0).backward()
            reducer.finish()
            shards.append([gs.shard.clone() for gs in reducer.grad_shards()])
            reducer.remove_hooks()
            n_buckets = len(reducer.layouts)
        out[f"{reduction}/{method}"] = (
            issued, n_buckets, all(torch.equal(a, b) for a, b in zip(shards[0], shards[1])),
        )  # fmt: skip
    return out


@pytest.mark.timeout(60)
def test_collectives_go_through_the_given_seam():
    expected = {
        "reduce_scatter/list": "reduce_scatter_list",
        "reduce_scatter/tensor": "reduce_scatter_tensor",
        "exact/auto": "all_to_all_single",
    }
    for rank, out in enumerate(run_ranks(_seam_rank, 2, timeout=50)):
        for case, name in expected.items():
            issued, n_buckets, same = out[case]
            assert issued == [name] * n_buckets and n_buckets > 1, (rank, case, issued)
            assert same, (rank, case)


def _arena_shards_rank(rank: int, world_size: int) -> dict:
    """With ``shard_arena`` the shards are slices of one tensor in the given order, with the same values."""
    shards, arenas = [], []
    for order in (None, "reversed"):
        model = _IntNet()
        buckets = build_buckets(model, 24)
        positions = list(reversed(range(len(buckets)))) if order else None
        reducer = BucketReducer(buckets, shard_arena=positions)
        for step in range(2):  # the second micro-step adds into the arena's slices
            model.loss(rank, step).backward()
            reducer.finish()
        got = reducer.grad_shards()
        shards.append([gs.shard.clone() for gs in got])
        arena = reducer.shard_arena
        if arena is not None:
            starts = [gs.shard.data_ptr() - arena.data_ptr() for gs in got]
            arenas.append((arena.numel(), [s // arena.element_size() for s in starts], [gs.shard.numel() for gs in got]))
        reducer.zero_grad()
        arenas.append(("after zero_grad", reducer.shard_arena is None))
        reducer.remove_hooks()
    return {"equal": all(torch.equal(a, b) for a, b in zip(*shards)), "arenas": arenas, "buckets": len(shards[0])}


@pytest.mark.timeout(60)
def test_shard_arena_lays_the_shards_in_one_tensor_in_the_given_order():
    for rank, out in enumerate(run_ranks(_arena_shards_rank, 2, timeout=50)):
        assert out["buckets"] > 1 and out["equal"], (rank, out)
        none_after, (numel, starts, numels), arena_after = out["arenas"]
        assert none_after == ("after zero_grad", True) and arena_after == ("after zero_grad", True)
        assert numel == sum(numels)
        # Reversed order: the last bucket first, each right after the next one.
        for b in range(len(numels)):
            assert starts[b] == sum(numels[b + 1 :]), (starts, numels)


def _move_shards_rank(rank: int, world_size: int) -> dict:
    """``move_shards``: own and arena shards go to another device (``meta``, the one other device a CPU has), an
    arena whole with its shards its slices there; moved home (here: already home) the values are kept and the
    next window trains; targets refuse."""
    out: dict = {}
    for case in ("own", "arena"):
        model = _IntNet()
        buckets = build_buckets(model, 24)
        reducer = BucketReducer(buckets, shard_arena=list(range(len(buckets))) if case == "arena" else None)
        reducer.move_shards("meta")  # before any backward: nothing to move
        for step in range(2):
            model.loss(rank, step).backward()
            reducer.finish()
            before = [gs.shard.clone() for gs in reducer.grad_shards()]
            reducer.move_shards("meta" if step == 0 else None)
            moved = reducer.grad_shards()
            arena = reducer.shard_arena
            if step == 0:
                one_arena = arena is None or all(
                    gs.shard.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr() for gs in moved
                )  # fmt: skip
                out[case, "away"] = one_arena and all(gs.shard.device.type == "meta" for gs in moved) and (
                    arena is None or arena.device.type == "meta"
                )  # fmt: skip
            else:
                out[case, "home"] = all(torch.equal(a, gs.shard) for a, gs in zip(before, moved))
            reducer.zero_grad()  # a fresh window after each: the next backward writes fresh shards
        out[case, "trains"] = bool(before) and all(torch.isfinite(a).all().item() for a in before)
        reducer.remove_hooks()
    model = _IntNet()
    buckets = build_buckets(model, 24)
    reducer = BucketReducer(buckets)
    targets = [torch.zeros(layout.shard_numel) for layout in reducer.layouts]
    reducer.remove_hooks()
    reducer = BucketReducer(buckets, shard_targets=targets)
    model.loss(rank, 0).backward()
    reducer.finish()
    try:
        reducer.move_shards("meta")
        out["targets"] = None
    except RuntimeError as exc:
        out["targets"] = str(exc)
    reducer.remove_hooks()
    return out


@pytest.mark.timeout(60)
def test_move_shards_moves_own_and_arena_shards_and_refuses_targets():
    for rank, out in enumerate(run_ranks(_move_shards_rank, 2, timeout=50)):
        for case in ("own", "arena"):
            assert out[case, "away"] and out[case, "home"] and out[case, "trains"], (rank, case, out)
        assert out["targets"] is not None and "shard_targets" in out["targets"], out["targets"]


def _targets_rank(rank: int, world_size: int) -> dict:
    """``shard_targets``: in place (fp32 targets, fp32 accumulation) and delivered (bf16 accumulation, fp32
    targets), against the same run with the reducer's own shards; two windows, two micro-steps each."""
    out: dict = {}
    for case, accum in (("in_place", torch.float32), ("delivered", torch.bfloat16), ("deliver_call", torch.bfloat16)):
        runs = []
        for targeted in (False, True):
            model = _IntNet()
            buckets = build_buckets(model, 24)
            reducer = BucketReducer(buckets, accum_dtype=accum, comm_dtype=torch.bfloat16, collect_stats=True)
            targets = None
            if targeted:
                targets = [torch.full((layout.shard_numel,), 7.0) for layout in reducer.layouts]
                reducer.remove_hooks()
                reducer = BucketReducer(
                    buckets, accum_dtype=accum, comm_dtype=torch.bfloat16, collect_stats=True, shard_targets=targets
                )
            windows = []
            for window in range(2):
                for micro in range(2):
                    if targeted and case != "deliver_call":
                        reducer.final_micro_step = micro == 1
                    model.loss(rank, 2 * window + micro).backward()
                    reducer.finish()
                if targeted and case == "deliver_call":
                    reducer.deliver()
                shards = reducer.grad_shards()
                windows.append(
                    {
                        "values": [gs.shard.float().clone() for gs in shards],
                        "stats": [s.clone() for s in reducer.shard_stats()],
                        "are_targets": targets is not None and all(gs.shard is t for gs, t in zip(shards, targets)),
                    }
                )
                reducer.zero_grad()
            runs.append((windows, reducer.shard_bytes, [t.clone() for t in targets] if targets else None))
            reducer.remove_hooks()
        (own, own_bytes, _), (tgt, tgt_bytes, final_targets) = runs
        out[case] = {
            "equal": all(
                torch.equal(a, b) for w0, w1 in zip(own, tgt) for a, b in zip(w0["values"], w1["values"])
            ),
            "stats_equal": all(
                torch.equal(a, b) for w0, w1 in zip(own, tgt) for a, b in zip(w0["stats"], w1["stats"])
            ),
            "are_targets": [w["are_targets"] for w in tgt],
            "targets_hold_last_window": all(
                torch.equal(t, v) for t, v in zip(final_targets, own[-1]["values"])
            ),
            "bytes": (own_bytes, tgt_bytes),
        }
    return out


@pytest.mark.timeout(90)
def test_shard_targets_receive_the_window_in_place_or_by_one_delivery():
    for rank, out in enumerate(run_ranks(_targets_rank, 2, timeout=80)):
        for case, got in out.items():
            assert got["equal"] and got["stats_equal"], (rank, case, got)
            assert got["are_targets"] == [True, True], (rank, case, got)
            assert got["targets_hold_last_window"], (rank, case)
        own_bytes, in_place_bytes = out["in_place"]["bytes"]
        assert own_bytes > 0 and in_place_bytes == 0, out["in_place"]["bytes"]
        assert out["delivered"]["bytes"][1] == out["delivered"]["bytes"][0]


def _bad_targets_rank(rank: int, world_size: int) -> list[str]:
    model = _IntNet()
    buckets = build_buckets(model, 24)
    probe = BucketReducer(buckets, register_hooks=False)
    good = [torch.zeros(layout.shard_numel) for layout in probe.layouts]
    cases = {
        "count": good[:-1],
        "numel": [torch.zeros(layout.shard_numel + (rank == 1)) for layout in probe.layouts],
        "dtype": [t.long() for t in good],
        "narrow": [t.bfloat16() for t in good],  # narrower than the fp32 accumulation: no room to widen into
        "arena": good,
    }
    errors = []
    for name, targets in cases.items():
        try:
            BucketReducer(
                buckets, register_hooks=False, shard_targets=targets,
                shard_arena=list(range(len(buckets))) if name == "arena" else None,
            )  # fmt: skip
        except (ValueError, TypeError, LayoutMismatchError) as exc:
            errors.append(f"{name}: {exc}")
        else:
            errors.append(f"{name}: no error")
    try:
        probe.deliver()
    except RuntimeError as exc:
        errors.append(f"deliver: {exc}")
    return errors


@pytest.mark.timeout(60)
def test_bad_shard_targets_are_refused_on_every_rank_naming_the_argument():
    results = run_ranks(_bad_targets_rank, 2, timeout=50)
    for rank, errors in enumerate(results):
        count, numel, dtype, narrow, arena, deliver = errors
        assert "shard_targets must be a list of" in count, count
        assert "shard_targets[0] has dtype torch.bfloat16; a target has the accumulation dtype" in narrow, narrow
        # Only rank 1's targets are wrong: rank 0 raises too, having heard of it.
        assert "shard_targets[0]" in numel or "rank 1" in numel, (rank, numel)
        assert "dtype torch.int64" in dtype, dtype
        assert "exclusive" in arena, arena
        assert "deliver() needs a reducer made with shard_targets" in deliver


# --------------------------------------------------------------------------- memory: pool and shard lifetime


def _pool_rank(rank: int, world_size: int) -> list:
    """Random bucket plans: every bucket's buffer comes from the pool, fits, and its output is its own chunk."""
    gen = torch.Generator().manual_seed(5)
    failures = []
    for case in range(40):
        n_buckets = int(torch.randint(1, 7, (), generator=gen))
        buckets = [
            [nn.Parameter(torch.zeros(int(n))) for n in torch.randint(1, 60, (int(torch.randint(1, 4, (), generator=gen)),), generator=gen)]
            for _ in range(n_buckets)
        ]
        comm_buffers = int(torch.randint(1, 4, (), generator=gen))
        layout = ("flat", "chunked")[case % 2]
        reducer = BucketReducer(buckets, comm_buffers=comm_buffers, layout=layout, register_hooks=False)
        if reducer._pools is not None:
            failures.append((case, "a pool is held outside a micro-step"))
        reducer._acquire_pools()
        pool = reducer._pools[(torch.device("cpu"), torch.float32)]
        largest = max(lay.numel for lay in reducer.layouts)
        if len(pool) != min(comm_buffers, n_buckets) or any(t.numel() != largest for t in pool):
            failures.append((case, "pool shape", len(pool), [t.numel() for t in pool], largest))
        if reducer.comm_buffer_bytes != len(pool) * largest * 4:
            failures.append((case, "comm_buffer_bytes", reducer.comm_buffer_bytes))
        for k, b in enumerate(reducer._buckets):
            home = pool[k % len(pool)]
            s = b.layout.shard_numel
            if b.views.input.data_ptr() != home.data_ptr() or b.views.input.numel() != b.layout.numel > home.numel():
                failures.append((case, k, "input not in its pool buffer"))
            if b.views.received.data_ptr() != home.data_ptr() + rank * s * 4 or b.views.received.numel() != s:
                failures.append((case, k, "output is not this rank's chunk of the input"))
            expected_previous = reducer._buckets[k - len(pool)] if k >= len(pool) else None
            if b.previous is not expected_previous:
                failures.append((case, k, "previous occupant"))
        reducer.finish()  # a micro-step with nothing marked: everything launches, then the pool goes back
        if reducer._pools is not None or any(b.views is not None for b in reducer._buckets):
            failures.append((case, "finish() kept the pool"))
    return failures


@pytest.mark.timeout(60)
def test_comm_pool_holds_every_bucket_and_reduce_scatters_in_place():
    for rank, failures in enumerate(run_ranks(_pool_rank, 2, timeout=50)):
        assert not failures, f"rank {rank}: {failures[:5]}"


def _lifetime_rank(rank: int, world_size: int) -> dict:
    """Shard bytes are allocated by the first micro-step and released by zero_grad(), measured by a census."""
    from flatgrad.testing.census import MemoryCensus

    model = _IntNet()
    reducer = BucketReducer(build_buckets(model, 24))
    out: dict = {"shard_bytes": reducer.shard_bytes}
    try:
        reducer.grad_shards()
    except RuntimeError as exc:
        out["before"] = str(exc)
    out["largest_bucket_bytes"] = max(lay.numel for lay in reducer.layouts) * 4
    out["comm_buffer_bytes"] = reducer.comm_buffer_bytes
    out["pointers"] = []
    with MemoryCensus("cpu") as census:
        census.mark("start")
        for step in range(2):
            model.loss(rank, step).backward()
            reducer.finish()
            out["pointers"].append([gs.shard.data_ptr() for gs in reducer.grad_shards()])
            census.mark(f"after micro-step {step}")
        out["shards"] = [gs.shard.clone() for gs in reducer.grad_shards()]
        census.mark("read")
        reducer.zero_grad()
        census.mark("after zero_grad")
    out["marks"] = dict(census.marks)
    out["plan_bytes"] = reducer.plan_bytes()
    try:
        reducer.grad_shards()
    except RuntimeError as exc:
        out["after"] = str(exc)
    reducer.remove_hooks()
    return out


@pytest.mark.timeout(60)
def test_shards_live_from_the_first_micro_step_until_zero_grad_and_the_pool_for_one_micro_step():
    for out in run_ranks(_lifetime_rank, 2, timeout=50):
        marks, shard_bytes = out["marks"], out["shard_bytes"]
        assert shard_bytes > 0
        assert "zero_grad" in out["before"] and "zero_grad" in out["after"]
        # The second micro-step adds into the same shards: no new shard memory.
        assert out["pointers"][0] == out["pointers"][1]
        assert marks["after micro-step 0"] - marks["start"] >= shard_bytes
        # The comm buffer pool is given back by finish(): once the shards are gone only the plans' tables
        # (made at the first unpack) are left, and at most gloo's late-freed scratch, as below.
        assert out["comm_buffer_bytes"] >= 2 * out["largest_bucket_bytes"]
        left = marks["after zero_grad"] - marks["start"] - shard_bytes  # less the clones read from the shards
        assert left <= out["plan_bytes"] + out["largest_bucket_bytes"] // 2, (marks, out["plan_bytes"])
        assert sum(t.numel() * t.element_size() for t in out["shards"]) == shard_bytes
        # zero_grad() frees the shards (the clones read from them stay). gloo's worker threads may
        # free the scratch copies of the last reduce_scatter in between: at most half a bucket at W=2.
        freed = marks["read"] - marks["after zero_grad"]
        assert shard_bytes <= freed <= shard_bytes + out["largest_bucket_bytes"] // 2, (marks, shard_bytes)


def _overlap_rank(rank: int, world_size: int, comm_buffers: int) -> list:
    """The order of launches and of blocking waits for a buffer's previous occupant, on a real reducer."""
    model = _MLP()
    reducer = BucketReducer(build_buckets(model, 600), comm_buffers=comm_buffers)
    events = []
    launch, drain = reducer._launch, reducer._drain

    def spy_launch(b):
        events.append(("launch", b.id))
        launch(b)

    def spy_drain(block, through=None):
        if through is not None:
            events.append(("wait for", through.id))
        drain(block, through)

    reducer._launch, reducer._drain = spy_launch, spy_drain
    model.loss(rank, 0).backward()
    reducer.finish()
    reducer.remove_hooks()
    return [len(reducer.buckets), events]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("comm_buffers", [1, 2])
def test_pack_of_the_next_bucket_overlaps_the_collective_with_two_buffers(comm_buffers):
    n_buckets, events = run_ranks(_overlap_rank, 2, comm_buffers, timeout=50)[0]
    assert n_buckets >= 3
    # The blocking waits made inside each launch (before its pack), by launched bucket.
    waits: dict[int, list[int]] = {}
    current = None
    for kind, bucket in events:
        if kind == "launch":
            current = bucket
            waits[bucket] = []
        else:
            waits[current].append(bucket)
    # A launch waits only for its buffer's previous occupant, comm_buffers launches back. One
    # buffer: bucket 1 waits for bucket 0. Two: bucket 1 packs while bucket 0's collective may run.
    assert all(w == k - comm_buffers for k, ws in waits.items() for w in ws), events
    assert waits[1] == ([0] if comm_buffers == 1 else []), events


# ---------------------------------------------------------------- reduction modes (all_to_all + fused W-source unpack)

_MODES = [
    ("exact", False, torch.bfloat16),
    ("exact", False, torch.float32),
    ("int8", False, torch.bfloat16),
    ("int8", True, torch.bfloat16),
    ("fp8", False, torch.float32),
    ("fp8", True, torch.bfloat16),
]


def _mode_expected(reducer, per_rank_grads, rank, world_size, reduction, block, residuals, shards):
    """Every rank's pack, wire and exchange replayed with the torch reference, for this rank's shards."""
    from flatgrad.kernels import reference, wire_reference

    for b, layout in enumerate(reducer.layouts):
        s = layout.shard_numel
        accumulate = shards[b] is not None
        if shards[b] is None:
            shards[b] = torch.empty(s)
        if reduction == "exact":
            packed = []
            for r in range(world_size):
                buf = torch.empty(layout.numel, dtype=reducer._buckets[b].comm_dtype)
                reference.pack(per_rank_grads[r][b], layout, buf, 1.0)
                packed.append(buf)
            recv = torch.cat([p[rank * s : (rank + 1) * s] for p in packed])
            wire_reference.sum_sources(recv, world_size, shards[b], 1.0 / world_size, accumulate)
            continue
        seg = wire_reference.segment_bytes(s, block)
        segments = []
        for r in range(world_size):
            w = torch.zeros(world_size * seg, dtype=torch.uint8)
            # int8/fp8 quantize the fp32 pack: see [Note: pack-quantize]
            wire_reference.pack_quantize(per_rank_grads[r][b], layout, 1.0, block, reduction, w, residuals[r][b])
            segments.append(w[rank * seg : (rank + 1) * seg])
        wire_reference.dequantize_sum(torch.cat(segments), world_size, block, reduction, shards[b], 1.0 / world_size, accumulate)


def _modes_rank(rank: int, world_size: int) -> list:
    """Per mode: (label, got, expected) after a window of 2 micro-steps, then after a new window of 1."""
    out = []
    block = 64
    for reduction, feedback, comm_dtype in _MODES:
        torch.manual_seed(0)
        model = _MLP()
        twin = copy.deepcopy(model)
        twin_of = dict(zip(model.parameters(), twin.parameters()))
        reducer = BucketReducer(
            build_buckets(model, 1500), comm_dtype=comm_dtype, reduction=reduction, block=block, error_feedback=feedback
        )
        assert (reducer.residual_bytes > 0) == feedback
        residuals = [[torch.zeros(layout.numel) if feedback else None for layout in reducer.layouts] for _ in range(world_size)]
        shards: list = [None] * len(reducer.layouts)
        step = 0
        for window, micro_steps in enumerate((2, 1)):
            for _ in range(micro_steps):
                model.loss(rank, step).backward()
                reducer.finish()
                twin.zero_grad(set_to_none=True)
                twin.loss(rank, step).backward()
                mine = [[twin_of[p].grad.clone() for p in bucket] for bucket in reducer.buckets]
                everyone: list = [None] * world_size
                dist.all_gather_object(everyone, mine)
                _mode_expected(reducer, everyone, rank, world_size, reduction, block, residuals, shards)
                step += 1
            got = [gs.shard.clone() for gs in reducer.grad_shards()]
            out.append((f"{reduction} feedback={feedback} {comm_dtype} window {window}", got, [t.clone() for t in shards]))
            reducer.zero_grad()
            shards = [None] * len(shards)
        reducer.remove_hooks()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduction_modes_bitwise_equal_reference(world_size):
    results = run_ranks(_modes_rank, world_size, timeout=180)
    for rank, per_mode in enumerate(results):
        for label, got, expected in per_mode:
            for b, (g, e) in enumerate(zip(got, expected)):
                assert torch.equal(g, e), f"rank {rank} bucket {b} {label}: max diff {(g - e).abs().max()}"


def _state_rank(rank: int, world_size: int) -> dict:
    """A reducer's residuals through state_dict / load_state_dict, and the loads it refuses."""
    def make(**options):
        torch.manual_seed(0)
        model = _MLP()
        return model, BucketReducer(build_buckets(model, 1500), reduction="int8", block=64, **options)

    model, reducer = make(error_feedback=True)
    model.loss(rank, 0).backward()
    reducer.finish()
    state = reducer.state_dict()
    saved = [t.clone() for t in state["residuals"]]
    _, other = make(error_feedback=True)
    other.load_state_dict(state)
    out = {
        "nonzero": all(bool(t.any()) for t in saved),
        "restored": all(torch.equal(a, b) for a, b in zip(other.state_dict()["residuals"], saved)),
        "copied": all(a.data_ptr() != b.data_ptr() for a, b in zip(other.state_dict()["residuals"], saved)),
        "errors": [],
    }
    _, plain = make()
    bad = [
        (plain, state),  # another reduction (no feedback)
        (other, {**state, "residuals": state["residuals"][:-1]}),
        (other, {**state, "residuals": [t[:-1] for t in state["residuals"]]}),
        (other, {"reduction": state["reduction"]}),
    ]
    before = [t.clone() for t in other.state_dict()["residuals"]]
    for target, loaded in bad:
        try:
            target.load_state_dict(loaded)
            out["errors"].append("no error")
        except ValueError as exc:
            out["errors"].append(str(exc))
    out["untouched"] = all(torch.equal(a, b) for a, b in zip(other.state_dict()["residuals"], before))
    return out


@pytest.mark.timeout(60)
def test_state_dict_round_trips_the_residuals_and_refuses_what_does_not_fit():
    for out in run_ranks(_state_rank, 2, timeout=50):
        assert out["nonzero"] and out["restored"] and out["copied"]
        reduction, count, shape, missing = out["errors"]
        assert "state['reduction']" in reduction, reduction
        assert "state['residuals'] has" in count, count
        assert "state['residuals'][0]" in shape, shape
        assert "'residuals'" in missing, missing
        assert out["untouched"]  # a refused load copies nothing


def _error_rank(rank: int, world_size: int) -> dict:
    """Error of each mode's averaged gradient vs an fp64 average of the same (bf16-representable) gradients."""
    gen = torch.Generator().manual_seed(rank)
    errors = {}
    for reduction in ("reduce_scatter", "exact"):
        param = nn.Parameter(torch.zeros(1 << 16))
        reducer = BucketReducer([[param]], comm_dtype=torch.bfloat16, reduction=reduction)
        gen.manual_seed(rank)
        grad = (torch.randn(param.numel(), generator=gen) * torch.rand(param.numel(), generator=gen).exp2()).bfloat16()
        param.grad = grad.float()
        reducer.mark_ready(param)
        reducer.finish()
        full = grad.double()
        dist.all_reduce(full)
        truth = (full / world_size)[reducer.grad_shards()[0].pieces[0].tensor_offset :][: reducer.layouts[0].shard_numel]
        errors[reduction] = (reducer.grad_shards()[0].shard.double()[: truth.numel()] - truth).norm().item()
        reducer.remove_hooks()
    return errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [4])
def test_exact_error_at_most_bf16_reduce_scatter(world_size):
    for errors in run_ranks(_error_rank, world_size, timeout=50):
        assert errors["exact"] <= errors["reduce_scatter"], errors
        assert errors["reduce_scatter"] > 0, errors  # bf16 hops round: the comparison can fail


def _bad_reduction_rank(rank: int, world_size: int) -> list[str]:
    messages = []
    for kwargs in (dict(reduction="mean"), dict(reduction="int8", block=48), dict(reduction="exact", error_feedback=True)):
        try:
            BucketReducer([[nn.Parameter(torch.zeros(4))]], register_hooks=False, **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.timeout(30)
def test_bad_reduction_arguments_name_the_key():
    messages = run_ranks(_bad_reduction_rank, 1, timeout=25)[0]
    assert len(messages) == 3
    assert "reduction" in messages[0] and "block" in messages[1] and "error_feedback" in messages[2]


def _collectives_rank(rank: int, world_size: int) -> dict:
    param = nn.Parameter(torch.zeros(1000))
    out = {}
    for reduction in ("exact", "int8"):
        reducer = BucketReducer([[param]], comm_dtype=torch.bfloat16, reduction=reduction)
        param.grad = torch.ones(1000)
        with count_collectives() as counts:
            reducer.mark_ready(param)
            reducer.finish()
        out[reduction] = dict(counts)
        reducer.remove_hooks()
    return out


@pytest.mark.timeout(30)
def test_modes_issue_one_all_to_all_per_bucket():
    for counts in run_ranks(_collectives_rank, 2, timeout=25):
        assert counts == {"exact": {"all_to_all_single": 1}, "int8": {"all_to_all_single": 1}}, counts


def _mode_stats_rank(rank: int, world_size: int) -> dict:
    """Per mode: each bucket's shard_stats() and the stats read from the shard it wrote, after a window of
    2 micro-steps (the stats are of the accumulated shard), then with an inf gradient on rank 0."""
    out = {}
    for reduction in ("reduce_scatter", "exact", "int8", "fp8"):
        torch.manual_seed(0)
        model = _MLP()
        reducer = BucketReducer(
            build_buckets(model, 1500), comm_dtype=torch.bfloat16, reduction=reduction, block=64,
            error_feedback=reduction in ("int8", "fp8"), collect_stats=True,
        )  # fmt: skip
        assert reducer.stats_available
        rows = []
        for poison in (False, True):
            for step in range(2):
                handle = None
                if poison and rank == 0 and step == 1:  # before the reducer's hook packs and drops the grad

                    def _inf(g: torch.Tensor) -> torch.Tensor:
                        g = g.clone()
                        g.view(-1)[0] = float("inf")
                        return g

                    handle = next(model.parameters()).register_hook(_inf)
                model.loss(rank, step).backward()
                if handle is not None:
                    handle.remove()
                reducer.finish()
            stats = reducer.shard_stats()
            for gs, got in zip(reducer.grad_shards(), stats):
                written = gs.shard.float()
                rows.append((got.clone(), written.square().sum(), int((~torch.isfinite(written)).sum())))
            reducer.zero_grad()
        out[reduction] = rows
        reducer.remove_hooks()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_stats_of_every_mode_equal_the_norm_of_the_shard_written(world_size):
    """The unpack's stats (fused in sum_sources / dequantize_sum for the all_to_all modes) are the sum of
    squares (to fp32 rounding: the kernel sums per fixed chunk in double, torch here in fp32) and the
    exact non-finite count of the accumulated shard."""
    results = run_ranks(_mode_stats_rank, world_size, timeout=110)
    for reduction in results[0]:  # the inf reached some rank's shard, and its stats count it
        assert any(count > 0 for out in results for _, _, count in out[reduction]), reduction
    for rank, out in enumerate(results):
        for reduction, rows in out.items():
            for got, sum_sq, count in rows:
                assert got.dtype == torch.float32 and got.shape == (2,)
                assert got[1].item() == count, (rank, reduction, got, count)
                if count == 0:
                    assert sum_sq > 0
                    torch.testing.assert_close(got[0], sum_sq, rtol=1e-5, atol=0, msg=f"rank {rank} {reduction}")


def _quantized_pool_rank(rank: int, world_size: int) -> list:
    """int8/fp8 buckets hold wire buffers only: no comm-dtype buffer (the fused pack-quantize)."""
    from flatgrad.kernels import wire

    failures = []
    dtypes = (torch.float32, torch.bfloat16, torch.float32)  # comm_dtype None: one per bucket, one wire pool for all
    sizes = ([300, 7], [1000], [64, 64, 5])
    buckets = [[nn.Parameter(torch.zeros(n, dtype=d)) for n in ns] for ns, d in zip(sizes, dtypes)]
    for reduction in ("int8", "fp8"):
        reducer = BucketReducer(buckets, reduction=reduction, block=64, register_hooks=False)
        seg = max(world_size * wire.segment_bytes(lay.shard_numel, 64) for lay in reducer.layouts)
        if reducer.comm_buffer_bytes != 2 * 2 * seg:  # send and receive wires, 2 pool slots each
            failures.append((reduction, "comm_buffer_bytes", reducer.comm_buffer_bytes, 4 * seg))
        reducer._acquire_pools()
        if any(t.dtype != torch.uint8 for b in reducer._buckets for t in (b.views.input, b.views.received)):
            failures.append((reduction, "a comm-dtype buffer was allocated"))
        if any(key[0] not in ("wire_send", "wire_recv") for key in reducer._pools):
            failures.append((reduction, "pools", list(reducer._pools)))
    return failures


@pytest.mark.timeout(60)
def test_quantized_modes_allocate_no_comm_dtype_buffer():
    for failures in run_ranks(_quantized_pool_rank, 2, timeout=50):
        assert failures == []



def _one_rank_modes_rank(rank: int, world_size: int) -> dict:
    """Every mode on a one-rank group: the shard it writes, and whether it keeps wire or residual buffers."""
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(300, generator=gen), torch.randn(77, generator=gen)]
    out = {}
    for reduction, extra in (("reduce_scatter", {}), ("exact", {}), ("int8", {"error_feedback": True}), ("fp8", {})):
        params = [nn.Parameter(torch.zeros(g.numel())) for g in grads]
        reducer = BucketReducer([params], register_hooks=False, comm_dtype=torch.bfloat16, reduction=reduction, **extra)
        for p, g in zip(params, grads):
            p.grad = g.clone()
            reducer.mark_ready(p)
        reducer.finish()
        b = reducer._buckets[0]
        out[reduction] = (reducer.grad_shards()[0].shard.clone(), type(b.mode).__name__ == "ReduceScatter" and b.residual is None)
    return out


@pytest.mark.timeout(30)
def test_one_rank_group_sends_nothing_so_every_mode_copies():
    """On a one-rank group (an MoE expert group of one rank) a mode's wire would only add rounding: every
    mode writes the plain path's shard, bitwise, and keeps no wire or error-feedback buffers."""
    out = run_ranks(_one_rank_modes_rank, 1, timeout=25)[0]
    plain, _ = out["reduce_scatter"]
    assert plain.abs().sum() > 0
    for reduction, (shard, no_wire) in out.items():
        assert torch.equal(shard, plain), reduction
        assert no_wire, reduction


@pytest.mark.parametrize("narrow, wide", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.float64)])  # fmt: skip
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 31, 1000, 4099])
def test_widen_in_place_equals_the_cast(narrow: torch.dtype, wide: torch.dtype, n: int) -> None:
    """A bit16 delivery lands in the head of its fp32 target and is widened there: bitwise the cast."""
    gen = torch.Generator().manual_seed(n)
    values = (torch.randn(n, generator=gen) * 1e3).to(narrow)
    values[::7] = float("inf")
    values[3::11] = float("nan")
    target = torch.full((n,), 12345.0, dtype=wide)
    target.view(torch.uint8)[: n * values.element_size()].copy_(values.view(torch.uint8))
    widen_in_place(target, narrow)
    expected = values.to(wide)
    nan = expected.isnan()
    assert torch.equal(target.isnan(), nan)  # a NaN's payload bits may differ between cast kernels
    assert torch.equal(target[~nan].view(torch.uint8), expected[~nan].view(torch.uint8))


def test_widen_in_place_refuses_a_target_too_narrow() -> None:
    with pytest.raises(ValueError, match="twice as wide"):
        widen_in_place(torch.zeros(4, dtype=torch.bfloat16), torch.bfloat16)
