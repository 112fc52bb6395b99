"""The ``cuda`` backend's GPU-only properties: streams, devices, tables, 64-bit indexing.

Values over random layouts are compared with the reference for every backend
in ``tests/test_kernels.py``; this file checks what only a GPU shows:

* the kernels run on the caller's current stream, and per-call tensor tables
  (pinned host memory, async copies) survive many calls queued behind a busy
  stream; a plan's device table is ordered across streams (every stream test
  warms what would synchronize the host, and checks that its sleep outlasted
  the enqueueing, so a kernel on the wrong stream fails it);
* the device guard: tensors on a device other than the current one;
* the user-facing checks of the compiled ops;
* offsets past 2^31 elements (int64 index math end to end);
* a plan's device table: no upload per call, CUDA graph capture and replay.
"""

from __future__ import annotations

import pytest
import torch

import flatgrad
from flatgrad import Layout

if not torch.cuda.is_available():
    pytest.skip(
        f"needs a CUDA device; torch {torch.__version__} (CUDA {torch.version.cuda}) sees none", allow_module_level=True
    )
_STATUS = flatgrad.available_backends()["cuda"]
if not _STATUS.available:
    pytest.skip(f"cuda backend unavailable: {_STATUS.reason}", allow_module_level=True)

DEVICE = torch.device("cuda", torch.cuda.current_device())
# A kernel that keeps a stream busy for a while, so that work queued behind it
# is still pending when the host moves on (about 50 ms on current GPUs).
_SLEEP_CYCLES = 100_000_000


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    differ = _bits(actual) != _bits(expected)
    if differ.any():
        i = int(differ.reshape(-1).nonzero()[0])
        raise AssertionError(f"{int(differ.sum())} elements differ; first at {i}")


def _tensors(numels, dtypes, seed: int, device=DEVICE) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(n, generator=gen, device=device).to(dtype) for n, dtype in zip(numels, dtypes)]


def _assert_still_busy(stream: torch.cuda.Stream) -> None:
    """The sleep on ``stream`` outlasted the host's enqueueing: nothing above synchronized the host,
    so the kernels were queued behind it and the test can fail for the reason it exists."""
    assert not stream.query(), "the stream finished before the host queued everything; raise _SLEEP_CYCLES"


def test_pack_and_unpack_run_on_the_current_stream() -> None:
    """Inputs written on a side stream behind a long kernel are read only after that write."""
    layout = Layout.flat([1000, 4099, 8192 * 3 + 5], world_size=4)
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    tensors = _tensors(layout.numels, dtypes, seed=1)
    shard = torch.randn(layout.shard_numel, device=DEVICE)
    outs = [torch.full((p.length,), 7.0, device=DEVICE) for p in layout.pieces(1)]
    # Warm the cached plans with these very tensors: building a plan uploads its run table with a
    # pageable copy, which synchronizes the host, and would wait out the sleep below.
    flatgrad.pack(tensors, layout, dtype=torch.bfloat16, scale=0.5, backend="cuda")
    flatgrad.unpack(shard, layout, 1, outs, accumulate=True, return_stats=True, backend="cuda")
    for o in outs:
        o.fill_(7.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP_CYCLES)
        for t in tensors:
            t.mul_(2)  # pending until the sleep ends; a kernel on another stream would read the old values
        shard.mul_(2)
        packed = flatgrad.pack(tensors, layout, dtype=torch.bfloat16, scale=0.5, backend="cuda")
        stats = flatgrad.unpack(shard, layout, 1, outs, accumulate=True, return_stats=True, backend="cuda")
    _assert_still_busy(side)
    torch.cuda.current_stream().wait_stream(side)
    expected = flatgrad.pack(tensors, layout, dtype=torch.bfloat16, scale=0.5, backend="torch")
    _assert_bits_equal(packed, expected)
    ref_outs = [torch.full((p.length,), 7.0, device=DEVICE) for p in layout.pieces(1)]
    ref_stats = flatgrad.unpack(shard, layout, 1, ref_outs, accumulate=True, return_stats=True, backend="torch")
    for out, ref in zip(outs, ref_outs):
        _assert_bits_equal(out, ref)
    torch.testing.assert_close(stats.sum_sq, ref_stats.sum_sq, rtol=1e-5, atol=0)
    assert bool(stats.nonfinite) == bool(ref_stats.nonfinite)


def test_per_call_tables_survive_queued_calls() -> None:
    """Many multi-tensor op calls queued behind a busy stream each keep their own pinned tensor table.

    The ops themselves (``torch.ops.flatgrad.pack`` / ``unpack``), not plans: each call writes the
    tensors' addresses into pinned host memory and copies it asynchronously, so a table reused
    before its copy ran would give a later call's addresses to an earlier kernel.
    """
    layout = Layout.chunked([3, 1000, 4097, 12345], world_size=3)
    calls = 32
    sets = [
        _tensors(layout.numels, [torch.float32, torch.bfloat16, torch.float16, torch.float32], seed=s)
        for s in range(calls)
    ]
    shards = [torch.randn(layout.shard_numel, device=DEVICE, dtype=torch.bfloat16) for _ in range(calls)]
    packed = [torch.full((layout.numel,), float("nan"), device=DEVICE) for _ in range(calls)]
    outs = [[torch.zeros(p.length, device=DEVICE) for p in layout.pieces(2)] for _ in range(calls)]
    pack_runs = layout.pack_runs(8192).to(DEVICE)
    unpack_runs = layout.unpack_runs(2, 8192).to(DEVICE)
    torch.ops.flatgrad.pack(sets[0], pack_runs, packed[0], 1.0)  # warm the pinned host allocator
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)  # every call below is enqueued while this runs
    for ts, out in zip(sets, packed):
        torch.ops.flatgrad.pack(ts, pack_runs, out, 1.0)
    for shard, out in zip(shards, outs):
        torch.ops.flatgrad.unpack(shard, unpack_runs, out, 1 / 3, False, False)
    _assert_still_busy(torch.cuda.current_stream())
    torch.cuda.synchronize()
    for ts, got in zip(sets, packed):
        _assert_bits_equal(got, flatgrad.pack(ts, layout, dtype=torch.float32, backend="torch"))
    for shard, out in zip(shards, outs):
        ref = [torch.zeros(p.length, device=DEVICE) for p in layout.pieces(2)]
        flatgrad.unpack(shard, layout, 2, ref, scale=1 / 3, backend="torch")
        for a, b in zip(out, ref):
            _assert_bits_equal(a, b)


def test_a_plan_on_another_stream_waits_for_its_table_upload() -> None:
    """[Note: table streams]: stream A uploads new addresses behind a sleep; a call on stream B with the
    same tensors uploads nothing, and must still wait for A's copy, or it packs the old tensors."""
    layout = Layout.chunked([1000, 4097, 12345], world_size=2)
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    old = _tensors(layout.numels, dtypes, seed=11)
    new = _tensors(layout.numels, dtypes, seed=12)
    plan = flatgrad.PackPlan(layout, old, dtype=torch.float32, backend="cuda")
    out_a = torch.empty(layout.numel, device=DEVICE)
    out_b = torch.full((layout.numel,), float("nan"), device=DEVICE)
    plan(old, out_a)
    plan(new, out_a)  # warm the pinned host allocator for the upload below
    plan(old, out_a)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    a.wait_stream(torch.cuda.current_stream())
    b.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        torch.cuda._sleep(_SLEEP_CYCLES)
        plan(new, out_a)  # new addresses: an upload queued on a, behind the sleep
    uploads = plan.uploads
    with torch.cuda.stream(b):
        plan(new, out_b)  # unchanged since the last call: no upload
    assert plan.uploads == uploads
    _assert_still_busy(a)
    torch.cuda.synchronize()
    expected = flatgrad.pack(new, layout, dtype=torch.float32, backend="torch")
    _assert_bits_equal(out_a, expected)
    _assert_bits_equal(out_b, expected)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensors_on_another_device_than_the_current_one() -> None:
    other = torch.device("cuda", 1)
    layout = Layout.flat([777, 4096], world_size=2)
    tensors = _tensors(layout.numels, [torch.float16, torch.float32], seed=3, device=other)
    with torch.cuda.device(0):
        packed = flatgrad.pack(tensors, layout, dtype=torch.bfloat16, backend="cuda")
        outs = [torch.zeros(p.length, device=other) for p in layout.pieces(0)]
        flatgrad.unpack(packed[: layout.shard_numel], layout, 0, outs, backend="cuda")
    assert packed.device == other
    _assert_bits_equal(packed, flatgrad.pack(tensors, layout, dtype=torch.bfloat16, backend="torch"))
    ref = [torch.zeros(p.length, device=other) for p in layout.pieces(0)]
    flatgrad.unpack(packed[: layout.shard_numel], layout, 0, ref, backend="torch")
    for a, b in zip(outs, ref):
        _assert_bits_equal(a, b)


def test_compiled_ops_reject_bad_operands() -> None:
    """The ops check what the public wrappers may not: devices, dtypes, run-table shape."""
    layout = Layout.flat([10, 20], world_size=2)
    runs = layout.pack_runs(8192).to(DEVICE)
    out = torch.empty(layout.numel, device=DEVICE)
    good = [torch.ones(10, device=DEVICE), torch.ones(20, device=DEVICE)]
    pack, unpack = torch.ops.flatgrad.pack, torch.ops.flatgrad.unpack
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is on cpu"):
        pack([good[0], torch.ones(20)], runs, out, 1.0)
    with pytest.raises(RuntimeError, match=r"tensors\[0\] has dtype Double"):
        pack([torch.ones(10, device=DEVICE, dtype=torch.float64), good[1]], runs, out, 1.0)
    with pytest.raises(RuntimeError, match=r"runs must have shape \[R, 5\]"):
        pack(good, runs[:, :4].contiguous(), out, 1.0)
    with pytest.raises(RuntimeError, match="runs must be int64"):
        pack(good, runs.int(), out, 1.0)
    with pytest.raises(RuntimeError, match="runs is on cpu"):
        unpack(out[:15], layout.unpack_runs(0, 8192), [torch.empty(15, device=DEVICE)], 1.0, False, False)
    unpack_runs = layout.unpack_runs(0, 8192, per_piece=False).to(DEVICE)
    with pytest.raises(RuntimeError, match=r"outs\[1\] has dtype"):
        unpack(
            out[:15], unpack_runs, [torch.empty(15, device=DEVICE), torch.empty(1, device=DEVICE, dtype=torch.half)],
            1.0, False, False,
        )


_BIG = 2**31 + 5  # elements: offsets past int32 in both the buffer and the tensors


def _need_memory(gib: float) -> None:
    free, _ = torch.cuda.mem_get_info(DEVICE)
    if free < gib * 2**30:
        pytest.skip(f"needs {gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


def test_pack_offsets_past_2_31_elements() -> None:
    _need_memory(24)
    layout = Layout.flat([_BIG, 1001], world_size=4)  # the second tensor starts at an odd offset past 2^31
    tensors = [torch.randn(_BIG, device=DEVICE, dtype=torch.bfloat16), torch.randn(1001, device=DEVICE)]
    tensors[0][-3:] = torch.tensor([1.0, 2.0, 3.0])
    packed = flatgrad.pack(tensors, layout, dtype=torch.bfloat16, backend="cuda")
    assert packed[_BIG - 3 : _BIG].tolist() == [1.0, 2.0, 3.0]
    expected = flatgrad.pack(tensors, layout, dtype=torch.bfloat16, backend="torch")
    _assert_bits_equal(packed, expected)


def test_unpack_offsets_past_2_31_elements() -> None:
    _need_memory(48)
    layout = Layout.flat([_BIG, 1001], world_size=1)  # one rank: the shard itself is past 2^31 elements
    shard = torch.randn(layout.shard_numel, device=DEVICE, dtype=torch.bfloat16)
    outs = [torch.ones(p.length, device=DEVICE) for p in layout.pieces(0)]
    stats = flatgrad.unpack(shard, layout, 0, outs, scale=0.5, accumulate=True, return_stats=True, backend="cuda")
    refs = [torch.ones(p.length, device=DEVICE) for p in layout.pieces(0)]
    flatgrad.unpack(shard, layout, 0, refs, scale=0.5, accumulate=True, backend="torch")
    for a, b in zip(outs, refs):
        _assert_bits_equal(a, b)
    step = 2**28
    want = sum(float(r[i : i + step].double().square().sum()) for r in refs for i in range(0, r.numel(), step))
    assert abs(stats.sum_sq.item() - want) <= 1e-5 * want
    assert not bool(stats.nonfinite)
    del refs
    # A non-finite value past 2^31 elements is counted.
    shard[_BIG + 7] = float("inf")
    stats = flatgrad.unpack(shard, layout, 0, outs, return_stats=True, backend="cuda")
    assert outs[1][7].item() == float("inf") and bool(stats.nonfinite)
    assert outs[0][-1].item() == shard[_BIG - 1].item()


def test_plan_uploads_only_when_pointers_change_and_captures_in_a_cuda_graph() -> None:
    """A plan's table stays on the device: no upload per call, so a call can be captured and replayed."""
    layout = Layout.chunked([3, 1000, 4097, 12345], world_size=4)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float32]
    tensors = _tensors(layout.numels, dtypes, seed=5)
    tensors[2] = None  # a missing gradient packs as zeros
    plan = flatgrad.PackPlan(layout, tensors, dtype=torch.bfloat16, backend="cuda")
    out = torch.empty(layout.numel, device=DEVICE, dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan(tensors, out, scale=0.5)  # uploads once, outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            plan(tensors, out, scale=0.5)
    torch.cuda.current_stream().wait_stream(stream)
    assert plan.uploads == 1
    for t in tensors:
        if t is not None:
            t.mul_(3)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _assert_bits_equal(out, flatgrad.pack(tensors, layout, dtype=torch.bfloat16, scale=0.5, backend="torch"))
    moved = [None if t is None else t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match="during CUDA graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            plan(moved, out)
    plan(moved, out, scale=0.5)  # outside capture the new pointers are uploaded
    assert plan.uploads >= 2
    _assert_bits_equal(out, flatgrad.pack(moved, layout, dtype=torch.bfloat16, scale=0.5, backend="torch"))


def test_plain_op_with_several_tensors_still_refuses_capture() -> None:
    layout = Layout.flat([10, 20], world_size=2)
    tensors = _tensors(layout.numels, [torch.float32, torch.float32], seed=6)
    runs = layout.pack_runs(8192).to(DEVICE)
    out = torch.empty(layout.numel, device=DEVICE)
    stream = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.stream(stream), torch.cuda.graph(torch.cuda.CUDAGraph(), stream=stream):
            torch.ops.flatgrad.pack(tensors, runs, out, 1.0)
