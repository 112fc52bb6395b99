"""The wire kernels (flatgrad/kernels/wire.py): every backend bitwise against the torch reference."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flatgrad
from flatgrad.kernels import wire, wire_reference
from flatgrad.layout import Layout

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCKS = [32, 64, 256, 4096]


def _backends() -> list[str]:
    names = ["cpu"]
    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("flatgrad.kernels.wire_triton"):
        names.append("triton")
    return names


def _gradients(world_size: int, shard_numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random gradients with blocks of very different magnitudes, some all-zero runs and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(world_size * shard_numel, generator=gen)
    x = x * torch.exp2(torch.randint(-12, 6, (world_size * shard_numel // 64 + 1,), generator=gen)).repeat_interleave(64)[: x.numel()]
    x[(torch.arange(x.numel()) // 97) % 5 == 0] = 0.0
    return x.to(dtype)


def _wire_buffer(world_size: int, shard_numel: int, block: int) -> torch.Tensor:
    return torch.full((world_size * wire.segment_bytes(shard_numel, block),), 0xAB, dtype=torch.uint8)


def assert_stats_match(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    """The regular unpack's rule (tests/test_kernels.py): sum_sq to fp32 rounding, since the
    order of its sum is backend-specific (the reference sums in fp32 in torch's order, the
    compiled backends per fixed chunk in double); the non-finite count exactly."""
    assert actual is not None and expected is not None
    assert actual.dtype == torch.float32 and actual.shape == (2,), (actual.dtype, actual.shape)
    assert actual[1].item() == expected[1].item(), f"nonfinite count {actual[1].item()} vs {expected[1].item()}"
    torch.testing.assert_close(actual[0].cpu(), expected[0].cpu(), rtol=1e-5, atol=0, equal_nan=True)


def _meaningful(w: torch.Tensor, world_size: int, s: int, block: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    values, scales = wire_reference.wire_views(w, world_size, s, block, kind)
    return values.view(torch.uint8).clone(), scales.clone()


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=25, deadline=None)
@given(
    world_size=st.integers(1, 5),
    shard_numel=st.integers(1, 700),
    dtype=st.sampled_from(DTYPES),
    block=st.sampled_from(BLOCKS),
    kind=st.sampled_from(wire.KINDS),
    feedback=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_quantize_matches_reference(backend, world_size, shard_numel, dtype, block, kind, feedback, seed):
    packed = _gradients(world_size, shard_numel, dtype, seed)
    residual = (torch.randn(packed.numel(), generator=torch.Generator().manual_seed(seed)) * 1e-3) if feedback else None
    results = []
    for name in ("torch", backend):
        w = _wire_buffer(world_size, shard_numel, block)
        r = None if residual is None else residual.clone()
        wire.quantize(packed, world_size, block, kind, w, r, backend=name)
        results.append((*_meaningful(w, world_size, shard_numel, block, kind), r))
    (v0, s0, r0), (v1, s1, r1) = results
    assert torch.equal(s0, s1), "scales differ"
    assert torch.equal(v0, v1), f"values differ at {(v0 != v1).nonzero()[:5].tolist()}"
    if feedback:
        assert torch.equal(r0, r1), "residuals differ"


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=25, deadline=None)
@given(
    world_size=st.integers(1, 5),
    shard_numel=st.integers(1, 700),
    out_dtype=st.sampled_from(DTYPES),
    block=st.sampled_from(BLOCKS),
    kind=st.sampled_from(wire.KINDS),
    scale=st.sampled_from([1.0, 0.25, 1 / 3]),
    accumulate=st.booleans(),
    stats=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_dequantize_sum_matches_reference(
    backend, world_size, shard_numel, out_dtype, block, kind, scale, accumulate, stats, seed
):
    w = _wire_buffer(world_size, shard_numel, block)
    wire.quantize(_gradients(world_size, shard_numel, torch.float32, seed), world_size, block, kind, w, backend="torch")
    start = torch.randn(shard_numel, generator=torch.Generator().manual_seed(seed + 1)).to(out_dtype)
    if stats and seed % 3 == 0:  # the stats count what is written: an inf from the accumulated start
        start[seed % shard_numel] = float("inf")
    outs, results = [], []
    for name in ("torch", backend):
        out = start.clone()
        results.append(wire.wire_kernels(name).dequantize_sum(w, world_size, block, kind, out, scale, accumulate, stats))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]), f"differ at {(outs[0] != outs[1]).nonzero()[:5].tolist()}"
    if stats:
        assert_stats_match(results[1], results[0])
    else:
        assert results == [None, None]


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=25, deadline=None)
@given(
    world_size=st.integers(1, 6),
    shard_numel=st.integers(1, 3000),
    src_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from(DTYPES),
    scale=st.sampled_from([1.0, 0.25, 1 / 3]),
    accumulate=st.booleans(),
    stats=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sum_sources_matches_reference(
    backend, world_size, shard_numel, src_dtype, out_dtype, scale, accumulate, stats, seed
):
    recv = _gradients(world_size, shard_numel, src_dtype, seed)
    if stats and seed % 3 == 0:  # non-finite sources give non-finite sums, which the stats count
        recv[seed % recv.numel()] = float("inf") if seed % 2 else float("nan")
    start = torch.randn(shard_numel, generator=torch.Generator().manual_seed(seed + 1)).to(out_dtype)
    outs, results = [], []
    for name in ("torch", backend):
        out = start.clone()
        results.append(wire.wire_kernels(name).sum_sources(recv, world_size, out, scale, accumulate, stats))
        outs.append(out)
    same = (outs[0] == outs[1]) | (outs[0].isnan() & outs[1].isnan())
    assert same.all(), f"differ at {(~same).nonzero()[:5].tolist()}"
    if stats:
        assert_stats_match(results[1], results[0])
    else:
        assert results == [None, None]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("op", ["sum_sources", "int8", "fp8"])
def test_unpack_stats_do_not_depend_on_thread_count(backend, op):
    """Fixed chunks, summed in order: the same bits with 1 and 2 threads (several chunks of work)."""
    world_size, s, block = 3, 100_003 if backend == "cpu" else 5000, 256
    grads = _gradients(world_size, s, torch.float32, 7)
    w = _wire_buffer(world_size, s, block)
    if op != "sum_sources":
        wire.quantize(grads, world_size, block, op, w, backend="torch")
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.empty(s)
            kernels = wire.wire_kernels(backend)
            if op == "sum_sources":
                results.append(kernels.sum_sources(grads, world_size, out, 0.5, False, True))
            else:
                results.append(kernels.dequantize_sum(w, world_size, block, op, out, 0.5, False, True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_public_unpacks_return_unpack_stats(backend):
    from flatgrad.kernels import UnpackStats

    recv = torch.tensor([3.0, 0.0, 4.0, float("inf")])
    out = torch.empty(2)
    stats = wire.sum_sources(recv, 2, out, backend=backend, return_stats=True)
    assert isinstance(stats, UnpackStats) and stats.nonfinite.dtype == torch.bool
    assert bool(stats.nonfinite) and stats.sum_sq.item() == float("inf")
    assert wire.sum_sources(recv[:2], 2, out[:1], backend=backend) is None
    w = _wire_buffer(2, 64, 32)
    wire.quantize(torch.arange(128.0) - 64, 2, 32, "int8", w, backend="torch")
    out = torch.empty(64)
    stats = wire.dequantize_sum(w, 2, 32, "int8", out, backend=backend, return_stats=True)
    assert not bool(stats.nonfinite)
    torch.testing.assert_close(stats.sum_sq, out.square().sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["torch"] + _backends())
@pytest.mark.parametrize("shard_numel", [256, 15])
def test_fp8_decode_matches_torch_cast(backend, shard_numel):
    """Every e4m3fn byte, NaN bits included, decodes to torch's float8_e4m3fn -> float32 cast: through
    the vector loop (256-element blocks) and through the scalar tail (15-element shards)."""
    codes = torch.arange(256, dtype=torch.uint8)
    for start in range(0, 256, shard_numel):
        chunk = codes[start : start + shard_numel]
        s = chunk.numel()
        w = torch.zeros(wire.segment_bytes(s, 256), dtype=torch.uint8)
        values, scales = wire_reference.wire_views(w, 1, s, 256, "fp8")
        values.view(torch.uint8).copy_(chunk.view(1, -1))
        scales.fill_(1.0)
        out = torch.empty(s)
        wire.dequantize_sum(w, 1, 256, "fp8", out, backend=backend)
        want = chunk.view(torch.float8_e4m3fn).to(torch.float32)
        if backend == "triton":  # its NaN bits are not pinned (see [Note: wire arithmetic contract])
            assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out[~want.isnan()], want[~want.isnan()])
        else:
            assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (start, out, want)


def test_reference_sums_in_rank_order():
    """fp32 addition is not associative: (1e8 + 1) - 1e8 is 0 in rank order 0, 1, 2, and 1 in order 1, 2, 0."""
    recv = torch.tensor([1e8, 1.0, -1e8])
    out = torch.empty(1)
    wire_reference.sum_sources(recv, 3, out, 1.0, False)
    assert out.item() == 0.0


def test_reference_quantize_contract():
    """absmax/127 scales, round half to even, zero blocks, fp8 saturation."""
    x = torch.tensor([127.0, 2.5, -3.5, 0.5] + [0.0] * 4)
    w = _wire_buffer(2, 4, 32)
    wire_reference.quantize(x, 2, 32, "int8", w, None)
    values, scales = wire_reference.wire_views(w, 2, 4, 32, "int8")
    assert values[0].tolist() == [127, 2, -4, 0] and scales.tolist() == [[1.0], [0.0]]
    assert values[1].tolist() == [0, 0, 0, 0]
    y = torch.tensor([448.0, 1000.0 * (448 / 1000), -1e-9, 0.0])
    wire_reference.quantize(y, 1, 32, "fp8", w, None)
    values, scales = wire_reference.wire_views(w, 1, 4, 32, "fp8")
    assert scales.item() == 1.0 and values[0].to(torch.float32).tolist()[:2] == [448.0, 448.0]


@pytest.mark.parametrize("kind", wire.KINDS)
def test_wire_bytes_at_most_053_of_bf16(kind):
    for s in (4096, 100_003, 1 << 20):
        assert wire.segment_bytes(s, 256) <= 0.53 * 2 * s, s


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_error_feedback_carries_the_error(backend):
    """Quantizing the same gradient twice with feedback: the two dequantized sends average closer to it."""
    g = _gradients(2, 512, torch.float32, 3)
    res = torch.zeros_like(g)
    sent = []
    for _ in range(2):
        w = _wire_buffer(2, 512, 256)
        wire.quantize(g, 2, 256, "int8", w, res, backend=backend)
        values, scales = wire_reference.wire_views(w, 2, 512, 256, "int8")
        sent.append(values.to(torch.float32) * scales.repeat_interleave(256, 1))
    once = (sent[0].reshape(-1) - g).abs().sum()
    twice = ((sent[0] + sent[1]).reshape(-1) / 2 - g).abs().sum()
    assert twice < once
    torch.testing.assert_close((sent[0] + sent[1]).reshape(-1) + res, 2 * g)  # nothing is lost, only delayed


@pytest.mark.parametrize("backend", ["torch"] + _backends())
@pytest.mark.parametrize("kind", wire.KINDS)
def test_nonfinite_input_gives_nonfinite_output(backend, kind):
    g = torch.ones(2 * 64)
    g[5] = float("nan")
    w = _wire_buffer(2, 64, 32)
    wire.quantize(g, 2, 32, kind, w, backend=backend)
    out = torch.zeros(64)
    wire.dequantize_sum(w, 2, 32, kind, out, backend=backend)
    assert not torch.isfinite(out[:32]).all()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: wire.quantize(torch.zeros(8), 2, 48, "int8", torch.zeros(999, dtype=torch.uint8)), "block"),
        (lambda: wire.quantize(torch.zeros(8), 2, 8192, "int8", torch.zeros(999, dtype=torch.uint8)), "block"),
        (lambda: wire.quantize(torch.zeros(8), 2, 32, "int4", torch.zeros(999, dtype=torch.uint8)), "kind"),
        (lambda: wire.quantize(torch.zeros(8), 3, 32, "int8", torch.zeros(999, dtype=torch.uint8)), "multiple"),
        (lambda: wire.quantize(torch.zeros(8), 2, 32, "int8", torch.zeros(9, dtype=torch.uint8)), "bytes"),
        (lambda: wire.sum_sources(torch.zeros(8), 2, torch.zeros(3)), "recv"),
        (lambda: wire.dequantize_sum(torch.zeros(999), 2, 32, "int8", torch.zeros(3)), "wire"),
        (lambda: _requantize_call(wire_in=_bytes(10)), "wire_in"),
        (lambda: _requantize_call(wire_in=_bytes(999).view(torch.int8)), "wire_in"),
        (lambda: _requantize_call(wire_in=_bytes(1000).view(2, 500)), "wire_in"),
        (lambda: _requantize_call(wire_out=_bytes(10)), "wire_out"),
        (lambda: _requantize_call(wire_out=torch.zeros(999)), "wire_out"),
        (lambda: _requantize_call(residual=torch.zeros(7)), "residual"),
        (lambda: _requantize_call(residual=torch.zeros(3 * 20, dtype=torch.float64)), "residual"),
        (lambda: _requantize_call(sources=0), "sources"),
        (lambda: _requantize_call(segments=True), "segments"),
        (lambda: _requantize_call(shard_numel=-1), "shard_numel"),
        (lambda: _requantize_call(block=48), "block"),
        (lambda: _requantize_call(kind="int4"), "kind"),
        (lambda: _requantize_call(wire_out="wire"), "wire_out"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


def test_fp8_refused_by_name_without_float8(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="reduction.*fp8|fp8.*float8"):
        wire.check_kind("fp8", "reduction")


def test_compiled_ops_have_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    wire.wire_kernels("cpu")
    with FakeTensorMode():
        out = torch.empty(4)
        assert torch.ops.flatgrad.wire_sum(torch.empty(8), 2, out, 1.0, False, True).shape == (2,)
        assert torch.ops.flatgrad.wire_sum(torch.empty(8), 2, out, 1.0, False, False).shape == (0,)
        stats = torch.ops.flatgrad.wire_dequantize_sum(torch.empty(200, dtype=torch.uint8), 2, 32, 0, out, 1.0, True, True)
        assert stats.shape == (2,) and stats.dtype == torch.float32
        torch.ops.flatgrad.wire_quantize(torch.empty(8), 2, 32, 1, torch.empty(200, dtype=torch.uint8), None)
        table, runs = torch.empty(3, 2, dtype=torch.int64), torch.empty(4, 5, dtype=torch.int64)
        wire_buf = torch.empty(200, dtype=torch.uint8)
        torch.ops.flatgrad._pack_quantize_table(table, runs, 8, 2, 32, 0, 1.0, wire_buf, None)
        wire_in = torch.empty(400, dtype=torch.uint8)
        torch.ops.flatgrad.wire_requantize(wire_in, 2, 32, 0, wire_buf, 2, 4, torch.empty(8))


# ---------------------------------------------------------------------------------------------
# The fused pack-quantize ([Note: pack-quantize] in docs/design.md)


def _pack_quantize_case(numels, dtypes, missing, world_size, kind_layout, align, seed):
    layout = Layout.make(kind_layout, numels, world_size, align)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for i, (n, dtype) in enumerate(zip(numels, dtypes)):
        if i in missing:
            grads.append(None)
            continue
        g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-10, 6, (), generator=gen)).item()
        g[(torch.arange(n) // 37) % 4 == 0] = 0.0
        grads.append(g.to(dtype))
    return layout, grads


def _pack_quantized(backend, layout, grads, block, kind, scale, residual, plan=False):
    w = _wire_buffer(layout.world_size, layout.shard_numel, block)
    r = None if residual is None else residual.clone()
    if plan:
        plan_ = wire.PackQuantizePlan(layout, grads, block=block, kind=kind, device=w.device, backend=backend)
        plan_(grads, w, r, scale=scale)
    else:
        wire.pack_quantize(grads, layout, block, kind, w, r, scale=scale, backend=backend)
    return (*_meaningful(w, layout.world_size, layout.shard_numel, block, kind), r)


@pytest.mark.parametrize("backend", _backends())
@settings(max_examples=30, deadline=None)
@given(
    numels=st.lists(st.integers(0, 400), min_size=1, max_size=6).filter(lambda n: sum(n) > 0),
    data=st.data(),
    world_size=st.integers(1, 4),
    kind_layout=st.sampled_from(["flat", "chunked"]),
    align=st.sampled_from([1, 4, 16]),
    block=st.sampled_from(BLOCKS),
    kind=st.sampled_from(wire.KINDS),
    scale=st.sampled_from([1.0, 0.5, 1 / 3]),
    feedback=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_pack_quantize_matches_reference(
    backend, numels, data, world_size, kind_layout, align, block, kind, scale, feedback, seed
):
    dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=len(numels), max_size=len(numels)))
    missing = data.draw(st.sets(st.integers(0, len(numels) - 1)))
    layout, grads = _pack_quantize_case(numels, dtypes, missing, world_size, kind_layout, align, seed)
    residual = None
    if feedback:
        residual = torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed + 1)) * 1e-3
    v0, s0, r0 = _pack_quantized("torch", layout, grads, block, kind, scale, residual)
    v1, s1, r1 = _pack_quantized(backend, layout, grads, block, kind, scale, residual, plan=True)
    assert torch.equal(s0, s1), "scales differ"
    assert torch.equal(v0, v1), f"values differ at {(v0 != v1).nonzero()[:5].tolist()}"
    if feedback:
        assert torch.equal(r0, r1), "residuals differ"


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_reference_pack_quantize_is_fp32_pack_then_quantize(feedback, scale):
    """The contract: what pack(dtype=float32, scale) followed by quantize writes, bit for bit."""
    layout, grads = _pack_quantize_case([100, 33, 0, 500], DTYPES + [torch.bfloat16], {1}, 3, "chunked", 8, 5)
    residual = torch.randn(layout.numel) * 1e-2 if feedback else None
    expected = _wire_buffer(3, layout.shard_numel, 64)
    r_expected = None if residual is None else residual.clone()
    packed = flatgrad.pack(grads, layout, dtype=torch.float32, scale=scale, backend="torch")
    wire.quantize(packed, 3, 64, "int8", expected, r_expected, backend="torch")
    v, s, r = _pack_quantized("torch", layout, grads, 64, "int8", scale, residual)
    assert torch.equal(v, _meaningful(expected, 3, layout.shard_numel, 64, "int8")[0])
    assert torch.equal(s, _meaningful(expected, 3, layout.shard_numel, 64, "int8")[1])
    if feedback:
        assert torch.equal(r, r_expected)


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_pack_quantize_plan_reuses_its_table(backend):
    layout, grads = _pack_quantize_case([300, 70], [torch.bfloat16, torch.float32], set(), 2, "flat", 1, 0)
    plan = wire.PackQuantizePlan(layout, [None, None], block=32, kind="fp8", device="cpu", backend=backend)
    w = torch.empty(plan.wire_bytes, dtype=torch.uint8)
    plan(grads, w)
    plan(grads, w)
    assert plan.uploads == 1
    plan([g.clone() for g in grads], w)  # new gradients every step: one table refresh
    assert plan.uploads == 2
    expected = _pack_quantized("torch", layout, grads, 32, "fp8", 1.0, None)
    assert torch.equal(_meaningful(w, 2, layout.shard_numel, 32, "fp8")[0], expected[0])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p, g, w: p(g, w.to(torch.int8)), "wire"),
        (lambda p, g, w: p(g, w[:10]), "wire"),
        (lambda p, g, w: p(g, w, torch.zeros(3)), "residual"),
        (lambda p, g, w: p(g, w, torch.zeros(p.layout.numel, dtype=torch.float64)), "residual"),
        (lambda p, g, w: p([g[0], torch.zeros(5)], w), r"tensors\[1\]"),
        (lambda p, g, w: p([g[0]], w), "tensors|2"),
        (lambda p, g, w: p(g, w, scale=float("nan")), "scale"),
        (lambda p, g, w: wire.PackQuantizePlan(p.layout, g, block=48, kind="int8"), "block"),
        (lambda p, g, w: wire.PackQuantizePlan(p.layout, g, block=32, kind="int4"), "kind"),
        (lambda p, g, w: wire.PackQuantizePlan(p.layout, [None, None], block=32, kind="int8"), "device"),
    ],
)
def test_pack_quantize_bad_input_names_the_argument(call, message):
    layout, grads = _pack_quantize_case([300, 70], [torch.float32, torch.float32], set(), 2, "flat", 1, 0)
    plan = wire.PackQuantizePlan(layout, grads, block=32, kind="int8", backend="cpu")
    with pytest.raises((ValueError, TypeError), match=message):
        call(plan, grads, torch.zeros(plan.wire_bytes, dtype=torch.uint8))


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """fp32 bits, every NaN as one (a NaN's sign and payload are not part of the contract; the codes are)."""
    return None if t is None else torch.where(torch.isnan(t), float("nan"), t).view(torch.int32)


def _nonfinite_packed(world_size: int, s: int, dtype: torch.dtype) -> torch.Tensor:
    """Ones, with a NaN in block 0, +inf in block 1, -inf and NaN in block 2, +inf and -inf in block 3 (block 32)."""
    x = torch.linspace(-3.0, 5.0, world_size * s)
    for at, value in ((5, "nan"), (40, "inf"), (70, "-inf"), (71, "nan"), (100, "inf"), (101, "-inf")):
        x[at] = float(value)
    return x.to(dtype)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", wire.KINDS)
@pytest.mark.parametrize("feedback", [False, True])
def test_nonfinite_input_matches_reference(backend, kind, feedback):
    """NaN and inf in a block give the reference's codes (NaN: int8 0, fp8 0x7F), scales and residual, bitwise."""
    world_size, s, block = 2, 96, 32
    for dtype in (torch.float32, torch.bfloat16):
        packed = _nonfinite_packed(world_size, s, dtype)
        residual = torch.full((world_size * s,), 1e-3) if feedback else None
        results = []
        for name in ("torch", backend):
            w = _wire_buffer(world_size, s, block)
            r = None if residual is None else residual.clone()
            wire.quantize(packed, world_size, block, kind, w, r, backend=name)
            out = torch.full((s,), 7.0)
            wire.dequantize_sum(w, world_size, block, kind, out, backend=name)
            results.append((*_meaningful(w, world_size, s, block, kind), _bits(r), _bits(out)))
        (v0, s0, r0, o0), (v1, s1, r1, o1) = results
        assert torch.equal(_bits(s0), _bits(s1)), f"{dtype}: scales differ: {s0.tolist()} vs {s1.tolist()}"
        assert torch.equal(v0, v1), f"{dtype}: values differ at {(v0 != v1).nonzero()[:5].tolist()}"
        assert torch.equal(o0, o1), f"{dtype}: dequantized values differ"
        if feedback:
            assert torch.equal(r0, r1), f"{dtype}: residuals differ"
        # The same through the fused pack-quantize.
        layout = Layout.flat([world_size * s], world_size)
        v2, s2, r2 = _pack_quantized(backend, layout, [packed], block, kind, 1.0, residual, plan=True)
        v3, s3, r3 = _pack_quantized("torch", layout, [packed], block, kind, 1.0, residual)
        assert torch.equal(v2, v3) and torch.equal(_bits(s2), _bits(s3)), f"{dtype}: pack-quantize differs"
        if feedback:
            assert torch.equal(_bits(r2), _bits(r3)), f"{dtype}: pack-quantize residuals differ"


@pytest.mark.parametrize("kind", wire.KINDS)
def test_reference_nonfinite_blocks_dequantize_to_nan(kind):
    """A block holding NaN or inf decodes to NaN in every element; NaN's code is int8 0 / fp8 0x7F; other blocks stay finite."""
    world_size, s, block = 1, 160, 32
    packed = _nonfinite_packed(world_size, s, torch.float32)
    w = _wire_buffer(world_size, s, block)
    wire.quantize(packed, world_size, block, kind, w, backend="torch")
    values, scales = _meaningful(w, world_size, s, block, kind)
    assert torch.isnan(scales[0, 0]) and torch.isinf(scales[0, 1]) and torch.isnan(scales[0, 2])
    assert torch.isinf(scales[0, 3]) and torch.isfinite(scales[0, 4])
    nan_code = 0 if kind == "int8" else 0x7F
    for at in (5, 40, 70, 71, 100, 101):
        assert values[0, at].item() == nan_code, (at, values[0, at].item())
    out = torch.zeros(s)
    wire.dequantize_sum(w, world_size, block, kind, out, backend="torch")
    assert torch.isnan(out[: 4 * block]).all(), out[: 4 * block]
    assert torch.isfinite(out[4 * block :]).all()


# ---------------------------------------------------------------------------------------------
# The fused requantize ([Note: requantize] in docs/design.md)


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def _requantize_call(**changes) -> None:
    """A valid ``wire.requantize`` (2 sources of 3 * 20 elements into 3 segments of 20), with ``changes``."""
    args = {
        "wire_in": _bytes(2 * wire.segment_bytes(60, 32)), "sources": 2, "block": 32, "kind": "int8",
        "wire_out": _bytes(3 * wire.segment_bytes(20, 32)), "segments": 3, "shard_numel": 20, "residual": None,
    }  # fmt: skip
    args.update(changes)
    wire.requantize(**args, backend="cpu")


def _received_wire(sources: int, part: int, block: int, kind: str, large: bool, seed: int) -> torch.Tensor:
    """``sources`` wire segments of ``part`` elements, as a node all_to_all delivers them: quantized gradients
    with all-zero blocks and, when ``large``, values near fp32's top, some of whose sums over the sources overflow."""
    x = _gradients(sources, part, torch.float32, seed).view(sources, part)
    if large:
        at = torch.arange(part)
        big = (at // 45) % 7 == 3
        x[:, big] *= 2.0**120
        x[:, big & (at % 45 == 0)] = 3e38  # two sources of it sum to inf
    w = _wire_buffer(sources, part, block)
    wire_reference.quantize(x.reshape(-1), sources, block, kind, w, None)
    return w


def _composed(wire_in, sources, block, kind, segments, s, residual):
    """What the two kernels the requantize replaces write: ``dequantize_sum`` into fp32, then ``quantize``."""
    partial = torch.empty(segments * s)
    wire_reference.dequantize_sum(wire_in, sources, block, kind, partial, 1.0, False)
    w = _wire_buffer(segments, s, block)
    r = None if residual is None else residual.clone()
    wire_reference.quantize(partial, segments, block, kind, w, r)
    values, scales = _meaningful(w, segments, s, block, kind)
    return values, _bits(scales), _bits(r)


@pytest.mark.parametrize("backend", ["torch"] + _backends())
@settings(max_examples=25, deadline=None)
@given(
    sources=st.integers(1, 4),
    segments=st.integers(1, 4),
    shard_numel=st.one_of(st.integers(1, 40), st.integers(1, 700), st.sampled_from([32, 64, 255, 256, 257, 512])),
    block=st.sampled_from([32, 64, 256]),
    kind=st.sampled_from(wire.KINDS),
    feedback=st.booleans(),
    large=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_requantize_matches_dequantize_sum_then_quantize(
    backend, sources, segments, shard_numel, block, kind, feedback, large, seed
):
    """Bitwise the reference composition: codes, scales and residual, whatever the blocks' alignment."""
    s, part = shard_numel, segments * shard_numel
    wire_in = _received_wire(sources, part, block, kind, large, seed)
    residual = torch.randn(part, generator=torch.Generator().manual_seed(seed + 1)) * 1e-3 if feedback else None
    v0, s0, r0 = _composed(wire_in, sources, block, kind, segments, s, residual)
    w = _wire_buffer(segments, s, block)
    r = None if residual is None else residual.clone()
    wire.requantize(wire_in, sources, block, kind, w, segments, s, r, backend=backend)
    v1, s1 = _meaningful(w, segments, s, block, kind)
    assert torch.equal(s0, _bits(s1)), "scales differ"
    assert torch.equal(v0, v1), f"values differ at {(v0 != v1).nonzero()[:5].tolist()}"
    if feedback:
        assert torch.equal(r0, _bits(r)), f"residuals differ at {(r0 != _bits(r)).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_requantize_leaves_the_wires_padding_and_inputs_alone(backend):
    """It writes the N segments' values and scales only, and reads wire_in without changing it."""
    sources, segments, s, block = 3, 2, 40, 32
    wire_in = _received_wire(sources, segments * s, block, "fp8", False, 11)
    before = wire_in.clone()
    w = torch.full((segments * wire.segment_bytes(s, block) + 64,), 0xAB, dtype=torch.uint8)
    wire.requantize(wire_in, sources, block, "fp8", w, segments, s, backend=backend)
    assert torch.equal(wire_in, before)
    assert (w[segments * wire.segment_bytes(s, block) :] == 0xAB).all()
    seg = w[: segments * wire.segment_bytes(s, block)].view(segments, -1)
    assert (seg[:, s : wire_reference.round16(s)] == 0xAB).all()  # the padding after the values


def test_requantize_refuses_overlapping_wires():
    wire_in = _bytes(2 * wire.segment_bytes(60, 32) + 3 * wire.segment_bytes(20, 32))
    with pytest.raises(ValueError, match="overlap"):
        _requantize_call(wire_in=wire_in, wire_out=wire_in[16:])


def test_qgz_pool_holds_no_fp32_partial():
    """The qgZ mode's pool is the comm-dtype input and four wires; its residual stays numel + N * S fp32."""
    from flatgrad.reducer.modes import QuantizedTwoStage
    from flatgrad.reducer.topology import Topology

    topology = Topology(4, 2, 4, 0, 0, (0, 1, 2, 3), (0, 4), tuple(range(8)))
    mode = QuantizedTwoStage(topology, "qgz_int8", 64, True)
    layout = Layout.flat([1000], 8)
    slots = mode.pool_slots([layout], torch.bfloat16)
    assert [(purpose, dtype) for purpose, _, dtype in slots] == [
        ("input", torch.bfloat16), ("wire_send", torch.uint8), ("wire_recv", torch.uint8), ("rail_send", torch.uint8),
        ("rail_recv", torch.uint8),
    ]  # fmt: skip
    assert mode.residual(layout, torch.device("cpu")).numel() == layout.numel + 2 * layout.shard_numel


# ---------------------------------------------------------------------------------------------
# 64-bit offsets in the Triton wire kernels, through the interpreter, without a large allocation


def _lazy(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over an anonymous mapping of ``nbytes``: untouched pages read as zeros and cost no memory."""
    import mmap

    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=dtype)


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs Triton's interpreter (TRITON_INTERPRET=1): it runs one program over a large logical size",
)

# Sizes that fit in i32 (so the launcher passes them as i32) while W * size does not. The source
# pointer is 2^31 elements into its mapping: an offset that wraps to a negative i32 still lands
# inside it (on zeros), so the old arithmetic gives a wrong sum instead of a fault.
_WRAP = 2**31


@needs_interpreter
def test_triton_sum_offsets_past_2_31_elements():
    from flatgrad.kernels import wire_triton

    world_size, s, block = 3, 2**30 + 1024, 1024  # source 2 starts at 2^31 + 2048 elements
    mapping = _lazy((_WRAP + world_size * s) * 2, torch.bfloat16)
    recv = mapping[_WRAP:]
    for w in range(world_size):
        recv[w * s : w * s + block] = float(w + 1)
    out = torch.full((block,), float("nan"))  # program 0 only: the first block of the shard
    dummy = torch.zeros(2, dtype=torch.int32)
    wire_triton._sum_kernel[(1,)](
        recv, out, s, world_size, 1.0, dummy.view(torch.float32), dummy, ACCUMULATE=False, STATS=False, BLOCK=block,
    )  # fmt: skip
    assert out.tolist() == [6.0] * block, f"got {out[:4].tolist()}: a source offset past 2^31 wrapped"


@needs_interpreter
@pytest.mark.parametrize("kind", wire.KINDS)
def test_triton_dequantize_sum_offsets_past_2_gib(kind):
    from flatgrad.kernels import wire_triton

    world_size, s, block = 3, 2**30, 4096
    seg = wire.segment_bytes(s, block)  # fits in i32; segment 2 starts past 2 GiB
    mapping = _lazy(_WRAP + world_size * seg, torch.uint8)
    wire_buf = mapping[_WRAP:]
    one = 1 if kind == "int8" else 0x38  # fp8 e4m3fn 1.0
    for w in range(world_size):
        wire_buf[w * seg : w * seg + block] = one
        wire_buf[w * seg + wire_reference.round16(s) :][:4].view(torch.float32)[0] = float(w + 1)
    out = torch.full((block,), float("nan"))
    dummy = torch.zeros(2, dtype=torch.int32)
    wire_triton._dequantize_sum_kernel[(1,)](
        wire_buf.view(torch.int8), wire_buf.view(torch.float32), out, s, seg, wire_reference.round16(s), world_size,
        1.0, dummy.view(torch.float32), dummy, KIND=wire_triton._KINDS[kind], ACCUMULATE=False, STATS=False,
        BLOCK=block,
    )  # fmt: skip
    assert out.tolist() == [6.0] * block, f"got {out[:4].tolist()}: a segment offset past 2 GiB wrapped"


@needs_interpreter
@pytest.mark.parametrize("kind", wire.KINDS)
def test_triton_requantize_offsets_past_2_gib(kind):
    from flatgrad.kernels import wire_triton

    sources, s, block = 3, 2**30, 4096  # one output segment: the partial is s elements
    seg_in = wire.segment_bytes(s, block)  # fits in i32; source 2 starts past 2 GiB
    wire_in = _lazy(_WRAP + sources * seg_in, torch.uint8)[_WRAP:]
    one = 1 if kind == "int8" else 0x38  # fp8 e4m3fn 1.0
    for w in range(sources):
        wire_in[w * seg_in : w * seg_in + block] = one
        wire_in[w * seg_in + wire_reference.round16(s) :][:4].view(torch.float32)[0] = float(w + 1)
    seg = wire.segment_bytes(s, block)
    wire_out = _lazy(seg, torch.uint8)
    wire_triton._requantize_kernel[(1,)](
        wire_in.view(torch.int8), wire_in.view(torch.float32), wire_out.view(torch.float32),
        wire_out.view(torch.int8), wire_out.view(torch.float32), sources, seg_in, wire_reference.round16(s), s, seg,
        wire_reference.round16(s), wire.nblocks(s, block), KIND=wire_triton._KINDS[kind], HAS_RES=False, BLOCK=block,
    )  # fmt: skip
    values, scales = wire_reference.wire_views(wire_out, 1, s, block, kind)
    assert scales[0, 0].item() == torch.tensor(6.0).div(wire.QMAX[kind]).item(), "a source offset past 2 GiB wrapped"
    assert values[0, :block].to(torch.float32).tolist() == [wire.QMAX[kind]] * block  # 6 / (6 / Q) is Q


@needs_interpreter
def test_triton_wire_launches_enter_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: each of the wire launches must enter the tensors' one."""
    import contextlib

    from flatgrad.kernels import wire_triton

    entered = []

    def on_device(device):
        entered.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(wire_triton, "_on_device", on_device)
    kernels = wire_triton.Backend()
    world_size, s, block = 2, 64, 32
    packed = torch.randn(world_size * s)
    w = _wire_buffer(world_size, s, block)
    launches = {
        "sum_sources": lambda: kernels.sum_sources(packed, world_size, torch.empty(s), 1.0, False),
        "quantize": lambda: kernels.quantize(packed, world_size, block, "int8", w, None),
        "pack_quantize": lambda: kernels.pack_quantize(
            [packed], Layout.flat([world_size * s], world_size), 1.0, block, "int8", w, None
        ),
        "dequantize_sum": lambda: kernels.dequantize_sum(w, world_size, block, "int8", torch.empty(s), 1.0, False),
        "requantize": lambda: kernels.requantize(
            _wire_buffer(world_size, world_size * s, block), world_size, block, "int8", w, world_size, s, None
        ),
    }
    for name, launch in launches.items():
        entered.clear()
        launch()
        assert entered == [torch.device("cpu")], f"{name} launched without entering the tensors' device"


@pytest.mark.parametrize("backend", ["torch"] + _backends())
def test_misaligned_wire_is_refused_by_name(backend):
    """The fp32 scales sit at 16-byte multiples from the wire's start: a wire 1 byte off is refused, naming it."""
    world_size, s, block = 2, 64, 32
    packed = torch.randn(world_size * s)
    misaligned = _wire_buffer(world_size, s, block + 4)[1:]  # still large enough
    layout = Layout.flat([world_size * s], world_size)
    calls = {
        "quantize": lambda: wire.quantize(packed, world_size, block, "int8", misaligned, backend=backend),
        "dequantize_sum": lambda: wire.dequantize_sum(misaligned, world_size, block, "fp8", torch.empty(s), backend=backend),
        "pack_quantize": lambda: wire.pack_quantize([packed], layout, block, "int8", misaligned, backend=backend),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"wire must start at a 4-byte aligned address"):
            call()
    wire_in, wire_out = _wire_buffer(world_size, world_size * s, block), _wire_buffer(world_size, s, block)
    for key, (a, b) in (("wire_in", (wire_in[1:], wire_out)), ("wire_out", (wire_in, misaligned))):
        with pytest.raises(ValueError, match=rf"{key} must start at a 4-byte aligned address"):
            wire.requantize(a, world_size, block, "int8", b, world_size, s, backend=backend)
    if backend == "cpu":  # the compiled ops check it too, for callers that skip the wrappers
        ops = torch.ops.flatgrad
        with pytest.raises(RuntimeError, match=r"wire_quantize: wire must start at a 4-byte aligned"):
            ops.wire_quantize(packed, world_size, block, 0, misaligned, None)
        with pytest.raises(RuntimeError, match=r"wire_dequantize_sum: wire must start at a 4-byte aligned"):
            ops.wire_dequantize_sum(misaligned, world_size, block, 0, torch.empty(s), 1.0, False, False)
        with pytest.raises(RuntimeError, match=r"wire_requantize: wire_in and wire_out must start at 4-byte aligned"):
            ops.wire_requantize(wire_in[1:], world_size, block, 0, wire_out, world_size, s, None)
