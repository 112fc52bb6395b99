"""flatgrad.comm: the reduce_scatter methods and the averaging rule, on real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from flatgrad import comm
from flatgrad.testing.collectives import count_collectives
from flatgrad.testing.launch import RankError, run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHARD = 5


def _input(rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    # Small integers: every sum and every average over 2 or 4 ranks is exact in fp16 and bf16.
    return (torch.arange(world_size * SHARD) % 7 - 3 + 2 * rank).to(dtype)


def _expected(rank: int, world_size: int, dtype: torch.dtype, average: bool) -> torch.Tensor:
    total = sum(_input(r, world_size, torch.float32) for r in range(world_size))
    if average:
        total = total / world_size
    return total[rank * SHARD : (rank + 1) * SHARD].to(dtype)


def _methods_rank(rank: int, world_size: int) -> dict:
    """Every method x dtype x op, sync and async; each issues exactly one collective."""
    out = {}
    for method in comm.METHODS:
        for dtype in DTYPES:
            for op, average in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, True)):
                for async_op in (False, True):
                    inp = _input(rank, world_size, dtype)
                    output = torch.full((SHARD,), 99.0, dtype=dtype)
                    with count_collectives() as counted:
                        work = comm.reduce_scatter(output, inp, op=op, async_op=async_op, method=method)
                        if async_op and work is not None:
                            work.wait()
                    key = (method, str(dtype), str(op), async_op)
                    expected = _expected(rank, world_size, dtype, average)
                    out[key] = (output, expected, sum(counted.values()), work is None)
    # Chunk views made once by the caller give the same result as chunking per call.
    inp = _input(rank, world_size, torch.float32)
    output = torch.empty(SHARD)
    with count_collectives() as counted:
        work = comm.reduce_scatter(output, inp, method="list", input_chunks=list(inp.chunk(world_size)))
    expected = _expected(rank, world_size, torch.float32, False)
    out["input_chunks"] = (output, expected, sum(counted.values()), work is None)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_scatter_every_method_dtype_and_op(world_size):
    for rank, results in enumerate(run_ranks(_methods_rank, world_size, timeout=80)):
        for key, (got, expected, calls, no_work) in results.items():
            assert torch.equal(got, expected), f"rank {rank} {key}: got {got}, expected {expected}"
            if world_size == 1:
                assert calls == 0 and no_work, f"{key}: world size 1 must be a copy, not a collective"
            else:
                assert calls == 1, f"{key}: {calls} collectives"
                if key != "input_chunks" and key[3]:
                    assert not no_work, f"{key}: async_op must return a Work"


def _resolution_rank(rank: int, world_size: int) -> dict:
    cpu = torch.device("cpu")
    out = {
        "backend": comm.backend_name(None, cpu),
        "auto": comm.resolve_method("auto", None, cpu),
        "forced": comm.resolve_method("tensor", None, cpu),
        "avg fp32": comm.avg_supported(None, torch.float32, cpu),
        "avg int": comm.avg_supported(None, torch.int64, cpu),
        "averaging fp32": tuple(comm.averaging(world_size, torch.float32, None, cpu)),
        "averaging bf16": tuple(comm.averaging(world_size, torch.bfloat16, None, cpu)),
        "averaging fp16": tuple(comm.averaging(world_size, torch.float16, None, cpu)),
    }
    errors = {}
    for name, call in {
        "size": lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * world_size + 1)),
        "dtype": lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * world_size, dtype=torch.bfloat16)),
        "2-D": lambda: comm.reduce_scatter(torch.empty(3), torch.empty(world_size, 3)),
        "method": lambda: comm.reduce_scatter(torch.empty(3), torch.empty(3 * world_size), method="ring"),
        "chunks": lambda: comm.reduce_scatter(
            torch.empty(3), torch.empty(3 * world_size), method="list", input_chunks=[torch.empty(3)] * (world_size + 1)
        ),
    }.items():
        try:
            call()
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


@pytest.mark.timeout(60)
def test_method_and_averaging_resolution_on_gloo():
    (out, _) = run_ranks(_resolution_rank, 2, timeout=50)
    assert out["backend"] == "gloo"
    assert out["auto"] == "list"  # see [Note: reduce_scatter method]
    assert out["forced"] == "tensor"
    assert out["avg int"] is False
    gloo_avg = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)
    assert out["avg fp32"] is gloo_avg
    avg = dist.ReduceOp.AVG
    if gloo_avg:
        assert out["averaging fp32"] == (avg, 1.0, 1.0) and out["averaging bf16"] == (avg, 1.0, 1.0)
    else:
        assert out["averaging fp32"] == (dist.ReduceOp.SUM, 1.0, 0.5)
    assert out["averaging fp16"] == (dist.ReduceOp.SUM, 1.0, 0.5)  # sqrt(2) rounds to the power of two 1
    assert set(out["errors"]) == {"size", "dtype", "2-D", "method", "chunks"}, out["errors"]
    assert "world_size * output.numel()" in out["errors"]["size"]


@given(world_size=st.integers(1, 4096))
@settings(max_examples=200, deadline=None)
def test_fp16_averaging_splits_one_over_w(world_size):
    # fp16 never needs a group: its division is always folded (overflow/underflow risk).
    op, pre, post = comm.averaging(world_size, torch.float16)
    assert op == dist.ReduceOp.SUM
    assert math.isclose(pre * post, 1.0 / world_size, rel_tol=1e-12)
    if world_size > 1:
        p = 1.0 / pre
        assert p == 2 ** round(math.log2(p)), "the pre-divide must be a power of two (exact in fp16)"
        assert math.sqrt(world_size) / 2 <= p <= 2 * math.sqrt(world_size)
    else:
        assert (pre, post) == (1.0, 1.0)


def test_averaging_rejects_bad_world_size():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="world_size"):
            comm.averaging(bad, torch.float32)


def _in_place_rank(rank: int, world_size: int) -> list:
    """Every method and dtype: the reduce_scatter whose output is this rank's chunk of its input, vs out of place."""
    failures = []
    for method in ("list", "tensor"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            # Random values of a real bucket's size: the sum order matters, so the bits must match.
            buffer = torch.randn(world_size * 4099, generator=torch.Generator().manual_seed(rank)).to(dtype)
            separate = torch.empty(buffer.numel() // world_size, dtype=dtype)
            comm.reduce_scatter(separate, buffer.clone(), method=method)
            chunks = list(buffer.chunk(world_size))
            comm.reduce_scatter(chunks[rank], buffer, method=method, input_chunks=chunks, async_op=True).wait()
            if not torch.equal(chunks[rank], separate):
                failures.append((method, str(dtype)))
    return failures


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_in_place_reduce_scatter_gives_the_bits_of_out_of_place(world_size):
    """The reducer's comm buffers reduce in place (see [Note: comm buffer pool]); gloo must give the same bits."""
    for rank, failures in enumerate(run_ranks(_in_place_rank, world_size, timeout=80)):
        assert not failures, f"rank {rank}: {failures}"


def _greedy_batches(sizes: list[int], batch_numel: int | None) -> int:
    """How many coalesced groups ``all_gather_in_place`` should launch: first fit, largest first."""
    if batch_numel is None:
        return 1
    bins: list[int] = []
    for n in sorted(sizes, reverse=True):
        for j, filled in enumerate(bins):
            if filled + n <= batch_numel:
                bins[j] += n
                break
        else:
            bins.append(n)
    return len(bins)


def _gather_rank(rank: int, world_size: int) -> list:
    """Many buffers gathered in place against one out-of-place all_gather per buffer; the launches issued."""
    out = []
    gen = torch.Generator().manual_seed(11)
    sizes = [int(n) * world_size for n in torch.randint(1, 20, (9,), generator=gen)]
    for dtype in (torch.float32, torch.bfloat16):
        for batch_numel in (None, 3 * max(sizes), max(sizes), 1):
            mine = [
                torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + k)).to(dtype) for k, n in enumerate(sizes)
            ]
            expected = []
            for b in mine:
                e = torch.empty_like(b)
                dist.all_gather_into_tensor(e, b.chunk(world_size)[rank].clone())
                expected.append(e)
            buffers = [b.clone() for b in mine]
            with count_collectives() as counter:
                calls = comm.all_gather_in_place(buffers, batch_numel=batch_numel)
            out.append((
                str(dtype), batch_numel, calls, sum(counter.values()), _greedy_batches(sizes, batch_numel),
                all(torch.equal(b, e) for b, e in zip(buffers, expected)),
            ))  # fmt: skip
    # A plan kept across steps gathers what its buffers' own chunks hold at each call.
    buffers = [torch.zeros(n) for n in sizes]
    plan = comm.AllGatherPlan(buffers, batch_numel=max(sizes))
    for step in (1, 2):
        for k, b in enumerate(buffers):
            b.chunk(world_size)[rank].fill_(step * 1000 + rank * 10 + k)
        plan()
        want = [torch.cat([torch.full((n // world_size,), step * 1000.0 + r * 10 + k) for r in range(world_size)])
                for k, n in enumerate(sizes)]  # fmt: skip
        out.append(("plan", step, len(plan), all(torch.equal(b, w) for b, w in zip(buffers, want))))
    # With a source, this rank's chunks come from it (the buffers' own are stale), in buffer order.
    for b in buffers:
        b.chunk(world_size)[rank].fill_(-1.0)
    source = torch.cat([torch.full((n // world_size,), 3000.0 + rank * 10 + k) for k, n in enumerate(sizes)])
    plan(source)
    want = [torch.cat([torch.full((n // world_size,), 3000.0 + r * 10 + k) for r in range(world_size)])
            for k, n in enumerate(sizes)]  # fmt: skip
    out.append(("plan", 3, len(plan), all(torch.equal(b, w) for b, w in zip(buffers, want))))
    try:
        plan(source[1:])
    except ValueError as exc:
        out.append(("bad source", str(exc)))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_in_place_gathers_every_buffer_in_place(world_size):
    """One coalesced launch per batch of at most ``batch_numel`` elements (unbounded: one), bitwise as per-buffer calls."""
    for rank, rows in enumerate(run_ranks(_gather_rank, world_size, timeout=80)):
        (bad,) = [row for row in rows if row[0] == "bad source"]
        assert "source must be 1-D with" in bad[1], bad
        plan_rows = [row for row in rows if row[0] == "plan"]
        rows = [row for row in rows if row[0] not in ("plan", "bad source")]
        for dtype, batch_numel, calls, issued, batches, equal in rows:
            assert equal, (rank, dtype, batch_numel)
            assert calls == issued == batches, (rank, dtype, batch_numel, calls, issued, batches)
        assert [row[4] for row in rows[:4]] == [1, rows[1][4], rows[2][4], 9] and rows[2][4] > rows[1][4] > 1
        assert [row[1] for row in plan_rows] == [1, 2, 3] and all(row[3] for row in plan_rows), plan_rows
        assert plan_rows[0][2] == rows[2][4]  # the same batches as all_gather_in_place with that bound
    with pytest.raises(RankError, match=r"buffers\[0\] must be 1-D with a multiple of 2"):
        run_ranks(_bad_gather_rank, 2, timeout=60)
    with pytest.raises(RankError, match=r"batch_numel must be a positive int or None, got 0"):
        run_ranks(_bad_batch_rank, 2, timeout=60)


def _coalesced_gather_rank(rank: int, world_size: int) -> list:
    """``all_gather_into_tensor_coalesced`` out of place and in place, on the world and on a sub-group of the
    odd ranks (whose group ranks are not the global ones), against one ``all_gather_into_tensor`` per buffer."""
    out = []
    groups = [None]
    odd = dist.new_group([r for r in range(world_size) if r % 2])  # every rank takes part in new_group
    if rank % 2:
        groups.append(odd)
    for group in groups:
        w, me = dist.get_world_size(group), dist.get_rank(group)
        for dtype in (torch.float32, torch.bfloat16):
            sizes = [1, 7, 3, 12]
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(rank * 50 + n)).to(dtype) for n in sizes]
            expected = []
            for t in inputs:
                e = torch.empty(w * t.numel(), dtype=dtype)
                dist.all_gather_into_tensor(e, t, group=group)
                expected.append(e)
            outputs = [torch.full((w * n,), -1.0, dtype=dtype) for n in sizes]
            comm.all_gather_into_tensor_coalesced(outputs, inputs, group=group)
            in_place = [torch.zeros(w * n, dtype=dtype) for n in sizes]
            for buffer, t in zip(in_place, inputs):
                buffer.view(w, -1)[me].copy_(t)
            comm.all_gather_into_tensor_coalesced(in_place, [b.view(w, -1)[me] for b in in_place], group=group)
            out.append((group is None, str(dtype), all(torch.equal(o, e) for o, e in zip(outputs, expected)),
                        all(torch.equal(o, e) for o, e in zip(in_place, expected))))  # fmt: skip
        # AllGatherPlan with a source on this group (one rank for the odd group of 2: nothing is sent).
        buffers = [torch.zeros(w * n) for n in (3, 5)]
        source = torch.arange(8, dtype=torch.float32) + 100 * rank
        comm.AllGatherPlan(buffers, group=group)(source)
        gathered = [torch.empty(w * 8) for _ in range(1)]
        dist.all_gather_into_tensor(gathered[0], source, group=group)
        per_rank = gathered[0].view(w, 8)
        want = [torch.cat([per_rank[r, :3] for r in range(w)]), torch.cat([per_rank[r, 3:] for r in range(w)])]
        out.append(("plan", w, all(torch.equal(b, x) for b, x in zip(buffers, want))))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_coalesced_all_gather_gives_the_bits_of_one_call_per_buffer(world_size):
    """[Note: coalesced all_gather]: on gloo the combined point-to-point gather, also on a sub-group."""
    for rank, rows in enumerate(run_ranks(_coalesced_gather_rank, world_size, timeout=80)):
        plans = [row for row in rows if row[0] == "plan"]
        rows = [row for row in rows if row[0] != "plan"]
        assert len(rows) == (4 if rank % 2 else 2), (rank, rows)
        assert len(plans) == (2 if rank % 2 else 1) and all(ok for _, _, ok in plans), (rank, plans)
        for world, dtype, out_of_place, in_place in rows:
            assert out_of_place and in_place, (rank, world, dtype)


_SCATTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32)


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    dtype=st.sampled_from(_SCATTER_DTYPES),
    backend=st.sampled_from(["auto", "torch"]),
    planned=st.booleans(),
)
@settings(max_examples=60, deadline=None)
def test_chunk_scatter_copies_the_bits_into_every_chunk_and_nothing_else(sizes, dtype, backend, planned):
    """The gloo gather's copy out of a received message: planned kernel (fp32/bf16/fp16, compiled backend) or
    ``_foreach_copy_`` (other dtypes, the torch backend, a one-off copy): every chunk gets its slice bit for bit
    (NaN payloads, -0.0, infinities), the rows of other ranks stay untouched, and zero-sized chunks are skipped."""
    import os

    old = os.environ.get("FLATGRAD_BACKEND")
    if backend == "torch":
        os.environ["FLATGRAD_BACKEND"] = "torch"
    try:
        buffers = [torch.full((3 * n,), 7, dtype=dtype) for n in sizes]
        chunks = [b.view(3, -1)[1] for b in buffers]
        bits_dtype, top = (torch.int16, 2**15) if dtype.itemsize == 2 else (torch.int32, 2**31)
        bits = torch.randint(-top, top - 1, (sum(sizes),), dtype=bits_dtype)
        flat = bits.view(dtype)  # every bit pattern: NaNs with payloads, -0.0, inf, subnormals
        scatter = comm.chunk_scatter(chunks, planned=planned)
        scatter(flat)
        comm.chunk_scatter(chunks, planned=planned)(flat)  # made again: the same
        kernel = planned and dtype != torch.int32 and backend == "auto" and any(sizes)
        assert (scatter.table_bytes > 0) == kernel, (scatter.table_bytes, dtype, backend, planned)  # metadata
        for buffer, chunk, piece in zip(buffers, chunks, flat.split(sizes)):
            assert torch.equal(chunk.view(bits.dtype), piece.view(bits.dtype))
            rows = buffer.view(3, -1)
            assert torch.equal(rows[0], torch.full_like(rows[0], 7)) and torch.equal(rows[2], torch.full_like(rows[2], 7))
    finally:
        if old is None:
            os.environ.pop("FLATGRAD_BACKEND", None)
        else:
            os.environ["FLATGRAD_BACKEND"] = old


def _bad_batch_rank(rank: int, world_size: int) -> None:
    comm.all_gather_in_place([torch.zeros(4)], batch_numel=0)


def _bad_gather_rank(rank: int, world_size: int) -> None:
    comm.all_gather_in_place([torch.zeros(3)])
