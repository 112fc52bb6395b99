"""flatgrad.kernels._plan: PackPlan / UnpackPlan reuse, per-call checks and table uploads.

Values are compared bitwise with ``flatgrad.kernels.reference``. On CPU the
plan's table is its host copy; ``uploads`` counts every rewrite of it, which on
CUDA is one host-to-device copy, so a count that stays put means no upload.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flatgrad
from flatgrad import Layout, PackPlan, UnpackPlan
from flatgrad.kernels import DTYPES, clear_plans, reference

STATUS = flatgrad.available_backends()


def _backend(name: str):
    status = STATUS[name]
    ok = status.available and "cpu" in status.devices
    reason = status.reason or f"{name} does not run on CPU tensors here"
    return pytest.param(name, marks=[] if ok else [pytest.mark.skip(reason=f"{name} backend unavailable: {reason}")])


BACKENDS = [_backend(name) for name in ("cpu", "torch", "triton")]
NAN = float("nan")


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def _expected(tensors, layout: Layout, dtype: torch.dtype, scale: float) -> torch.Tensor:
    out = torch.full((layout.numel,), NAN, dtype=dtype)
    reference.pack(tensors, layout, out, scale)
    return out


def _tensors(layout: Layout, dtypes, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(d) for n, d in zip(layout.numels, dtypes)]


@pytest.mark.parametrize("name", BACKENDS)
def test_repeated_calls_upload_nothing_and_new_storage_is_packed(name: str) -> None:
    layout = Layout.chunked([5, 1000, 0, 13, 4099], 4, align=2)
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16, torch.float32]
    tensors = _tensors(layout, dtypes, seed=1)
    plan = PackPlan(layout, tensors, dtype=torch.bfloat16, backend=name)
    out = torch.full((layout.numel,), NAN, dtype=torch.bfloat16)
    plan(tensors, out, scale=0.5)
    assert plan.uploads == 1
    for _ in range(3):
        assert plan(list(tensors), out, scale=0.5) is out  # a new list of the same tensors
    assert plan.uploads == 1
    assert _bits_equal(out, _expected(tensors, layout, torch.bfloat16, 0.5))
    replaced = list(tensors)
    replaced[3] = torch.randn(13).half()  # new storage, same shape: the reducer's next gradient
    plan(replaced, out, scale=0.5)
    assert plan.uploads == 2
    assert _bits_equal(out, _expected(replaced, layout, torch.bfloat16, 0.5))
    fresh = plan(replaced, scale=0.5)  # no out: a new buffer of the plan's dtype
    assert plan.uploads == 2 and _bits_equal(fresh, out)


def test_plan_errors_name_the_tensor_index() -> None:
    layout = Layout.flat([5, 7, 6], 2)
    tensors = [torch.randn(n) for n in layout.numels]
    plan = PackPlan(layout, tensors)
    out = torch.empty(layout.numel)
    plan(tensors, out)
    cases = [
        ([tensors[0], tensors[1], torch.randn(7)], ValueError, "tensors[2] has 7 elements, the layout expects 6"),
        ([tensors[0], tensors[1].half(), tensors[2]], ValueError,
         "tensors[1] has dtype torch.float16, the plan was made for torch.float32"),
        ([tensors[0].to("meta"), tensors[1], tensors[2]], ValueError,
         "tensors[0] is on meta, the plan's device is cpu"),
        ([tensors[0], torch.randn(14)[::2], tensors[2]], ValueError, "tensors[1] is not contiguous"),
        ([tensors[0], tensors[1], "x"], TypeError, "tensors[2] must be a torch.Tensor or None, got str"),
        ([tensors[0], out[3:10], tensors[2]], ValueError, "tensors[1] overlaps out"),
        (tensors[:2], ValueError, "got 2 tensors, the plan has 3"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            plan(bad, out)
    resized = [t.clone() for t in tensors]
    resized[2].resize_(12)  # resized in place after the plan saw it
    with pytest.raises(ValueError, match=re.escape("tensors[2] has 12 elements, the layout expects 6")):
        plan(resized, out)
    plan(tensors, out)  # after the errors the plan still packs the good tensors
    assert _bits_equal(out, _expected(tensors, layout, torch.float32, 1.0))
    with pytest.raises(ValueError, match="out must be 1-D"):
        plan(tensors, torch.empty(layout.numel + 1))


@st.composite
def none_cases(draw):
    numels = draw(st.lists(st.integers(0, 600), min_size=1, max_size=12))
    count = len(numels)
    masks = draw(st.lists(st.lists(st.booleans(), min_size=count, max_size=count), min_size=1, max_size=3))
    return dict(
        layout=Layout.make(draw(st.sampled_from(("flat", "chunked"))), numels, draw(st.integers(1, 6))),
        dtypes=draw(st.lists(st.sampled_from(DTYPES), min_size=count, max_size=count)),
        out_dtype=draw(st.sampled_from(DTYPES)),
        masks=masks,  # one call per mask: True = that tensor is None (a missing gradient)
        scale=draw(st.sampled_from((1.0, 0.5, 1 / 3))),
        seed=draw(st.integers(0, 2**31)),
    )


@pytest.mark.parametrize("name", BACKENDS)
def test_plan_calls_with_changing_none_entries_match_the_reference(name: str) -> None:
    @settings(max_examples=8 if name == "triton" else 40, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(case=none_cases())
    def check(case) -> None:
        layout = case["layout"]
        first = [None if gone else t for t, gone in zip(_tensors(layout, case["dtypes"], 0), case["masks"][0])]
        plan = PackPlan(layout, first, dtype=case["out_dtype"], device="cpu", backend=name)
        for step, mask in enumerate(case["masks"]):
            tensors = _tensors(layout, case["dtypes"], case["seed"] + step)  # new gradients every step
            tensors = [None if gone else t for t, gone in zip(tensors, mask)]
            out = plan(tensors, torch.full((layout.numel,), NAN, dtype=case["out_dtype"]), scale=case["scale"])
            assert _bits_equal(out, _expected(tensors, layout, case["out_dtype"], case["scale"]))

    check()


def test_public_pack_reuses_its_plan_and_replaces_it_for_new_dtypes() -> None:
    clear_plans()
    layout = Layout.chunked([3, 300, 17], 3)
    tensors = [torch.randn(n) for n in layout.numels]
    out = torch.empty(layout.numel, dtype=torch.bfloat16)
    for _ in range(3):
        flatgrad.pack(tensors, layout, out, backend="torch")
    (plan,) = flatgrad.kernels._pack_plans.values()
    assert plan.uploads == 1
    halves = [t.half() for t in tensors]
    flatgrad.pack(halves, layout, out, backend="torch")  # another dtype: full checks, then a new plan
    assert _bits_equal(out, _expected(halves, layout, torch.bfloat16, 1.0))
    (new_plan,) = flatgrad.kernels._pack_plans.values()
    assert new_plan is not plan and new_plan.uploads == 1
    with pytest.raises(ValueError, match=re.escape("tensors[2] has 16 elements, the layout expects 17")):
        flatgrad.pack([halves[0], halves[1], torch.randn(16)], layout, out, backend="torch")
    missing = flatgrad.pack([None, halves[1], None], layout, backend="torch")
    assert missing.dtype == torch.float16
    assert _bits_equal(missing, _expected([None, halves[1], None], layout, torch.float16, 1.0))
    with pytest.raises(ValueError, match="needs out="):
        flatgrad.pack([None, None, None], layout)


@pytest.mark.parametrize("name", BACKENDS)
def test_unpack_plan_reuses_outputs_and_checks_new_ones(name: str) -> None:
    layout = Layout.chunked([5, 1000, 13, 4099], 3)
    rank = 1
    shard = torch.randn(layout.shard_numel).to(torch.bfloat16)
    outs = [torch.ones(p.length) for p in layout.pieces(rank)]
    plan = UnpackPlan(layout, rank, outs, backend=name)
    expected = [o.clone() for o in outs]
    for _ in range(2):
        stats = plan(shard, outs, scale=0.25, accumulate=True, return_stats=True)
        want = reference.unpack(shard, layout, rank, expected, True, 0.25, True, True)
    assert plan.uploads == 1
    assert all(_bits_equal(a, b) for a, b in zip(outs, expected))
    assert stats[1].item() == want[1].item()
    torch.testing.assert_close(stats[0], want[0], rtol=1e-5, atol=0)
    storage = torch.zeros(layout.shard_numel)
    overlapping = [storage[: p.length] for p in layout.pieces(rank)]
    with pytest.raises(ValueError, match=r"out\[\d\] and out\[\d\] overlap"):
        plan(shard, overlapping)
    with pytest.raises(ValueError, match=r"out\[\d\] and out\[\d\] overlap"):
        plan(shard, overlapping)  # refused again: the failed call left no trusted table behind
    resized = [o.clone() for o in outs]
    resized[2] = torch.zeros(resized[2].numel() + 1)
    with pytest.raises(ValueError, match=re.escape(f"out[2] has {outs[2].numel() + 1} elements")):
        plan(shard, resized)
    with pytest.raises(TypeError, match=re.escape("out[0] is None")):
        plan(shard, [None] + outs[1:])
    with pytest.raises(TypeError, match="out must be a list with one tensor per piece"):
        plan(shard, storage)
    fresh = [torch.zeros(p.length) for p in layout.pieces(rank)]
    plan(shard, fresh)
    assert plan.uploads == 2
    want = [torch.zeros(p.length) for p in layout.pieces(rank)]
    reference.unpack(shard, layout, rank, want, True, 1.0, False, False)
    assert all(_bits_equal(a, b) for a, b in zip(fresh, want))


@pytest.mark.parametrize("spelling", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_plans_take_any_spelling_of_the_tensors_device(spelling) -> None:
    """A plan compares every tensor's device with its own: ``cpu:0`` is where a CPU tensor
    (device ``cpu``, no index) lives, as ``cuda`` is where a ``cuda:0`` tensor does."""
    from flatgrad.kernels import wire

    layout = Layout.chunked([5, 70], 2)
    tensors = _tensors(layout, [torch.float32, torch.float32], seed=0)
    plan = PackPlan(layout, tensors, device=spelling, backend="torch")
    assert plan.device == torch.device("cpu")
    assert _bits_equal(plan(tensors), _expected(tensors, layout, torch.float32, 1.0))
    quantize = wire.PackQuantizePlan(layout, tensors, block=32, kind="int8", device=spelling, backend="torch")
    quantize(tensors, torch.empty(quantize.wire_bytes, dtype=torch.uint8))


def test_cuda_without_an_index_is_the_current_device(monkeypatch) -> None:
    from flatgrad.kernels._plan import normalize_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert normalize_device("cuda") == torch.device("cuda", 3)
    assert normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert normalize_device("cuda:1") == torch.device("cuda", 1)
    assert normalize_device("cpu:0") == torch.device("cpu") == normalize_device("cpu")


class _FakeCuda:
    """Streams and events that log what a device table orders, for ``_TensorTable`` on CPU."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.current = "construction"
        self.capturing = False

    def install(self, monkeypatch) -> None:
        fake = self

        class Event:
            count = 0

            def __init__(self) -> None:
                Event.count += 1
                self.id, self.stream = Event.count, None

            def record(self, stream) -> None:
                self.stream = stream
                fake.log.append(("record", stream.name, self.id))

        class Stream:
            def __init__(self, name: str) -> None:
                self.name = name

            def __eq__(self, other) -> bool:
                return isinstance(other, Stream) and other.name == self.name

            def __hash__(self) -> int:
                return hash(self.name)

            def wait_event(self, event) -> None:
                fake.log.append(("wait", self.name, event.id))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(fake.current))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)

    def take(self) -> list[tuple[str, str, int]]:
        log, self.log = self.log, []
        return log


def test_a_device_table_is_ordered_across_streams_on_every_use(monkeypatch) -> None:
    """[Note: table streams]: a use on another stream waits for the last write, an upload waits
    for other streams' reads, the first upload waits for the construction stream."""
    from flatgrad.kernels._plan import _TensorTable

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    table = _TensorTable([(4, 0)], torch.device("cpu"), "cuda")  # a separate "device" copy, on CPU
    (_, _, zeros), = cuda.take()
    cuda.current = "a"
    table.upload()
    assert cuda.take() == [("wait", "a", zeros), ("record", "a", zeros)]  # the written event, re-recorded
    table.acquire()
    table.release()
    (_, _, read_a), = cuda.take()  # same stream: a record, no wait
    cuda.current = "b"  # unchanged pointers: no upload, but b must wait for a's copy
    table.acquire()
    assert cuda.take() == [("wait", "b", zeros)]
    table.release()
    (_, _, read_b), = cuda.take()
    table.acquire()  # already ordered after that write: no second wait
    assert cuda.take() == []
    table.release()
    cuda.take()
    cuda.current = "a"  # a new upload on a waits for b's kernel
    table.upload()
    assert ("wait", "a", read_b) in cuda.take()
    cuda.capturing = True  # during capture nothing is recorded or waited on
    cuda.current = "c"
    table.acquire()
    table.release()
    assert cuda.take() == []
