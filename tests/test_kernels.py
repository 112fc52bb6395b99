"""flatgrad.kernels: every backend against the reference, and the public API's checks.

Every backend other than the ``torch`` oracle is compared with
``flatgrad.kernels.reference`` over hypothesis-generated layouts, dtypes,
scales and flags; results must be bitwise equal (``assert_bits_equal``), except
that NaN payloads are not part of the contract: torch's own CPU casts give
different NaN bits on their vector and scalar paths, so a NaN matches any NaN.
A backend that cannot run on this machine is skipped with its reason; with no
GPU the Triton backend runs on CPU tensors under Triton's interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``), on small cases only.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flatgrad
from flatgrad import Layout
from flatgrad.kernels import BACKENDS, DTYPES, reference
from flatgrad.kernels._backends import host_backend, resolve_backend

STATUS = flatgrad.available_backends()
CANDIDATES = tuple(name for name in BACKENDS if name != "torch")
INF, NAN = float("inf"), float("nan")

# Numels: zero, one, primes, and sizes around the CPU kernel's 32K-element work unit.
PRIMES = (2, 3, 5, 7, 11, 13, 31, 127, 251, 1009, 4099)
LARGE = (32768, 32771, 65537)
SCALES = (1.0, 0.5, 1 / 3, 0.125, 2.0, -1.5, 1.0 + 2.0**-40)  # the last is 1.0 in fp32 yet not 1.0
SPECIALS = (INF, -INF, NAN, 0.0, -0.0, 1e-40, -3e-45, 6e-8, 65504.0, 65520.0, 3.0e38, -1e-30)


def _device(name: str) -> str | None:
    devices = STATUS[name].devices
    return "cpu" if "cpu" in devices else ("cuda" if "cuda" in devices else None)


def _interpreted(name: str) -> bool:
    """Triton on CPU tensors runs in its (slow) interpreter: small cases only."""
    return name == "triton" and _device(name) == "cpu"


def _backend_param(name: str):
    status = STATUS[name]
    marks = [] if status.available else [pytest.mark.skip(reason=f"{name} backend unavailable: {status.reason}")]
    return pytest.param(name, marks=marks, id=name)


BACKEND_PARAMS = [_backend_param(name) for name in CANDIDATES]
# Largest buffer per generated case, and examples per hypothesis test.
MAX_NUMEL = {"interpreted": 100_000, "compiled": 400_000}
# FLATGRAD_TEST_EXAMPLES overrides the compiled backends' count (the GPU check, flatgrad/check/plan.py, lowers it).
EXAMPLES = {"interpreted": 10, "compiled": int(os.environ.get("FLATGRAD_TEST_EXAMPLES", "100"))}


def _budget(name: str) -> str:
    return "interpreted" if _interpreted(name) else "compiled"


def _run_examples(name: str, strategy, check, examples: int | None = None) -> None:
    """Run ``check(name, case)`` over hypothesis cases, sized for the backend."""

    @settings(
        max_examples=examples or EXAMPLES[_budget(name)],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(case=strategy)
    def run(case) -> None:
        check(name, case)

    run()


# ---------------------------------------------------------------------------
# Helpers


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equal (so -0.0 != +0.0), except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(actual)
    assert torch.equal(nan, torch.isnan(expected)), "NaN positions differ"
    a_bits = _bits(actual).masked_fill(nan, 0)
    e_bits = _bits(expected).masked_fill(nan, 0)
    if not torch.equal(a_bits, e_bits):
        differ = a_bits != e_bits
        i = int(differ.reshape(-1).nonzero()[0])
        a, e = actual.reshape(-1)[i].item(), expected.reshape(-1)[i].item()
        raise AssertionError(f"{int(differ.sum())} elements differ; first at {i}: {a!r} vs {e!r}")


def assert_stats_match(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """sum_sq to fp32 rounding (its order is backend-specific), the non-finite count exactly."""
    assert actual.dtype == torch.float32 and actual.shape == (2,), (actual.dtype, actual.shape)
    assert actual[1].item() == expected[1].item(), f"nonfinite count {actual[1].item()} vs {expected[1].item()}"
    torch.testing.assert_close(actual[0].cpu(), expected[0].cpu(), rtol=1e-5, atol=0, equal_nan=True)


def _values(n: int, dtype: torch.dtype, gen: torch.Generator, specials: bool) -> torch.Tensor:
    """Values spread over 2^-14..2^14, many of them exact rounding ties of bf16 or fp16."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-14, 15, (n,), generator=gen).float())
    bits = x.view(torch.int32)
    tie = torch.randint(0, 4, (n,), generator=gen)
    bits = torch.where(tie == 0, (bits & -0x10000) | 0x8000, bits)  # halfway between two bf16
    bits = torch.where(tie == 1, (bits & -0x2000) | 0x1000, bits)  # halfway between two fp16
    x = bits.view(torch.float32)
    if specials and n:
        k = max(1, n // 50)
        pool = torch.tensor(SPECIALS)
        x[torch.randint(0, n, (k,), generator=gen)] = pool[torch.randint(0, len(pool), (k,), generator=gen)]
    return x.to(dtype)


def _shape(n: int, shaped: bool) -> tuple[int, ...]:
    if not shaped:
        return (n,)
    if n == 1:
        return ()
    return (4, n // 4) if n % 4 == 0 else (n,)


def _rank_slice(layout: Layout, rank: int) -> slice:
    return slice(rank * layout.shard_numel, (rank + 1) * layout.shard_numel)


# ---------------------------------------------------------------------------
# Strategies


@st.composite
def layouts(draw, max_numel: int, max_world: int = 16) -> Layout:
    kind = draw(st.sampled_from(("flat", "chunked")))
    world = draw(st.integers(1, max_world))
    align = draw(st.integers(1, 8))
    small = st.one_of(st.sampled_from((0, 1) + PRIMES), st.integers(0, 2000))
    count = draw(st.integers(0, 40))  # drawn first: st.lists alone favours short lists
    numels = draw(st.lists(small, min_size=count, max_size=count))
    if draw(st.integers(0, 3)) == 0:  # a quarter of the cases cross 32K-element work units
        for n in draw(st.lists(st.sampled_from(LARGE), min_size=1, max_size=2)):
            numels.insert(draw(st.integers(0, len(numels))), n)
    layout = Layout.make(kind, numels, world, align)
    assume(layout.numel <= max_numel)
    return layout


def _scales(layout: Layout):
    return st.sampled_from(SCALES + (1 / layout.world_size,))


@st.composite
def pack_cases(draw, max_numel: int) -> dict:
    layout = draw(layouts(max_numel))
    if draw(st.booleans()):  # mixed input dtypes in one call
        in_dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=layout.num_tensors, max_size=layout.num_tensors))
    else:
        in_dtypes = [draw(st.sampled_from(DTYPES))] * layout.num_tensors
    count = layout.num_tensors
    missing = draw(st.lists(st.booleans(), min_size=count, max_size=count)) if draw(st.booleans()) else [False] * count
    return dict(
        layout=layout,
        in_dtypes=in_dtypes,
        missing=missing,  # None entries: missing gradients, packed as zeros
        out_dtype=draw(st.sampled_from(DTYPES)),
        scale=draw(_scales(layout)),
        shaped=draw(st.booleans()),
        specials=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@st.composite
def unpack_cases(draw, max_numel: int) -> dict:
    layout = draw(layouts(max_numel))
    return dict(
        layout=layout,
        rank=draw(st.integers(0, layout.world_size - 1)),
        shard_dtype=draw(st.sampled_from(DTYPES)),
        out_dtype=draw(st.sampled_from(DTYPES)),
        per_piece=draw(st.booleans()),
        scale=draw(_scales(layout)),
        accumulate=draw(st.booleans()),
        stats=draw(st.booleans()),
        specials=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# ---------------------------------------------------------------------------
# Backends against the reference


def _check_pack(name: str, case: dict) -> None:
    layout, device = case["layout"], _device(name)
    gen = torch.Generator().manual_seed(case["seed"])
    tensors = [
        _values(n, dtype, gen, case["specials"]).reshape(_shape(n, case["shaped"])).to(device)
        for n, dtype in zip(layout.numels, case["in_dtypes"])
    ]
    tensors = [None if gone else t for t, gone in zip(tensors, case["missing"])]
    # NaN-filled buffers: padding the kernel fails to zero shows up as NaN.
    expected = torch.full((layout.numel,), NAN, dtype=case["out_dtype"], device=device)
    reference.pack(tensors, layout, expected, case["scale"])
    out = torch.full_like(expected, NAN)
    result = flatgrad.pack(tensors, layout, out, scale=case["scale"], backend=name)  # through a cached plan
    assert result is out
    assert_bits_equal(out, expected)
    out.fill_(NAN)  # the backend object itself (the compiled backends' plain op, not the plan's)
    resolve_backend(name, out.device).pack(tensors, layout, out, case["scale"])
    assert_bits_equal(out, expected)


def _unpack_inputs(case: dict, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    layout, gen = case["layout"], torch.Generator().manual_seed(case["seed"])
    shard = _values(layout.shard_numel, case["shard_dtype"], gen, case["specials"]).to(device)
    lengths = [p.length for p in layout.pieces(case["rank"])] if case["per_piece"] else [layout.shard_numel]
    outs = [_values(n, case["out_dtype"], gen, case["specials"]).to(device) for n in lengths]
    return shard, outs


def _check_unpack(name: str, case: dict) -> None:
    layout, rank, device = case["layout"], case["rank"], _device(name)
    shard, outs = _unpack_inputs(case, device)
    expected = [o.clone() for o in outs]
    flags = (case["per_piece"], case["scale"], case["accumulate"], case["stats"])
    want = reference.unpack(shard, layout, rank, expected, *flags)
    got = resolve_backend(name, shard.device).unpack(shard, layout, rank, outs, *flags)
    for o, e in zip(outs, expected):
        assert_bits_equal(o, e)
    if case["stats"]:
        assert_stats_match(got, want)
    else:
        assert got is None


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_pack_matches_reference(name: str) -> None:
    _run_examples(name, pack_cases(MAX_NUMEL[_budget(name)]), _check_pack)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_unpack_matches_reference(name: str) -> None:
    _run_examples(name, unpack_cases(MAX_NUMEL[_budget(name)]), _check_unpack)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
@pytest.mark.parametrize(
    "kind, numels, world_size, align",
    [("flat", (1_000_003, 0, 7, 2_500_001, 65_537), 8, 4), ("chunked", (1_048_576, 3, 1_200_007, 1), 16, 1)],
)
def test_large_buckets_match_reference(name: str, kind: str, numels: tuple, world_size: int, align: int) -> None:
    if _interpreted(name):
        pytest.skip("no GPU: Triton's interpreter is too slow for buckets of millions of elements")
    device = _device(name)
    layout = Layout.make(kind, numels, world_size, align)
    gen = torch.Generator().manual_seed(7)
    mixed = [_values(n, DTYPES[i % 3], gen, specials=i == 1).to(device) for i, n in enumerate(numels)]
    uniform = [t.to(torch.bfloat16) for t in mixed]
    for tensors, out_dtype, scale in ((mixed, torch.bfloat16, 0.125), (uniform, torch.bfloat16, 1.0),
                                      (mixed, torch.float32, 1.0)):
        expected = torch.full((layout.numel,), NAN, dtype=out_dtype, device=device)
        reference.pack(tensors, layout, expected, scale)
        buffer = flatgrad.pack(tensors, layout, torch.full_like(expected, NAN), scale=scale, backend=name)
        assert_bits_equal(buffer, expected)
    backend = resolve_backend(name, buffer.device)
    for rank in (0, world_size - 1):  # shards of the last (fp32) buffer
        shard = buffer[_rank_slice(layout, rank)]
        for per_piece, out_dtype, accumulate, stats in ((True, torch.float32, True, True),
                                                       (False, torch.bfloat16, False, False)):
            lengths = [p.length for p in layout.pieces(rank)] if per_piece else [layout.shard_numel]
            outs = [_values(n, out_dtype, gen, specials=False).to(device) for n in lengths]
            expected_outs = [o.clone() for o in outs]
            args = (per_piece, 1 / world_size, accumulate, stats)
            want = reference.unpack(shard, layout, rank, expected_outs, *args)
            got = backend.unpack(shard, layout, rank, outs, *args)
            for o, e in zip(outs, expected_outs):
                assert_bits_equal(o, e)
            if stats:
                assert_stats_match(got, want)


@given(
    numels=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    world_size=st.integers(1, 5),
    kind=st.sampled_from(("flat", "chunked")),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
@settings(max_examples=50, deadline=None)
def test_reference_packs_none_as_zeros(numels, world_size, kind, dtype, data) -> None:
    """The oracle itself: a None entry packs exactly as a tensor of +0.0 does."""
    layout = Layout.make(kind, numels, world_size)
    missing = data.draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    tensors = [torch.randn(n).to(dtype) for n in numels]
    with_none = [None if gone else t for t, gone in zip(tensors, missing)]
    with_zeros = [torch.zeros_like(t) if gone else t for t, gone in zip(tensors, missing)]
    got = torch.full((layout.numel,), NAN, dtype=dtype)
    want = torch.full((layout.numel,), NAN, dtype=dtype)
    reference.pack(with_none, layout, got, 0.5)
    reference.pack(with_zeros, layout, want, 0.5)
    assert_bits_equal(got, want)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_pack_zeroes_padding(name: str) -> None:
    device = _device(name)
    for layout in (Layout.flat([5, 7, 13], 4, align=8), Layout.chunked([5, 0, 7, 13, 1], 4, align=3)):
        tensors = [torch.randn(n, device=device) for n in layout.numels]
        out = flatgrad.pack(tensors, layout, torch.full((layout.numel,), NAN, device=device), backend=name)
        real = torch.zeros(layout.numel, dtype=torch.bool)
        for rank in range(layout.world_size):
            for p in layout.pieces(rank):
                begin = rank * layout.shard_numel + p.shard_offset
                real[begin : begin + p.length] = True
        assert layout.numel > layout.numel_unpadded
        assert torch.equal(_bits(out.cpu())[~real], torch.zeros(int((~real).sum()), dtype=torch.int32))
        assert not torch.isnan(out).any()


@st.composite
def round_trip_cases(draw, max_numel: int, max_world: int) -> dict:
    return dict(
        layout=draw(layouts(max_numel, max_world)),
        grad_dtype=draw(st.sampled_from(DTYPES)),
        comm_dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _check_round_trip(name: str, case: dict) -> None:
    """pack on every rank, sum the buffers as reduce_scatter would, unpack every shard with 1/W.

    Gradients are small integers, so every sum is exact in every dtype and the
    result must equal the averaged full gradients exactly.
    """
    layout, device = case["layout"], _device(name)
    world, gen = layout.world_size, torch.Generator().manual_seed(case["seed"])
    grads = [
        [torch.randint(-8, 9, (n,), generator=gen).to(case["grad_dtype"]).to(device) for n in layout.numels]
        for _ in range(world)
    ]
    buffers = [
        flatgrad.pack(g, layout, torch.empty(layout.numel, dtype=case["comm_dtype"], device=device), backend=name)
        for g in grads
    ]
    reduced = torch.stack([b.float() for b in buffers]).sum(0).to(case["comm_dtype"])
    averaged = [sum(g[i].float() for g in grads) * (1 / world) for i in range(layout.num_tensors)]
    assembled = [torch.full((n,), NAN, device=device) for n in layout.numels]
    for rank in range(world):
        pieces = layout.pieces(rank)
        outs = [torch.empty(p.length, device=device) for p in pieces]
        flatgrad.unpack(reduced[_rank_slice(layout, rank)], layout, rank, outs, scale=1 / world, backend=name)
        for p, o in zip(pieces, outs):
            assert torch.equal(o, averaged[p.tensor_index][p.tensor_offset : p.tensor_offset + p.length])
            assembled[p.tensor_index][p.tensor_offset : p.tensor_offset + p.length] = o
    for a, e in zip(assembled, averaged):
        assert torch.equal(a, e)  # every element came back exactly once (NaN would fail)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_round_trip_equals_averaged_gradients(name: str) -> None:
    small = _interpreted(name)
    strategy = round_trip_cases(20_000 if small else 200_000, 4 if small else 16)
    _run_examples(name, strategy, _check_round_trip, examples=3 if small else 25)


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_unpack_public_stats(name: str) -> None:
    """The public wrapper turns [sum_sq, count] into UnpackStats(sum_sq, nonfinite flag)."""
    device = _device(name)
    layout = Layout.chunked([300, 1, 77], 3, align=2)
    for bad in (None, INF, NAN):
        shard = torch.randn(layout.shard_numel, device=device)
        if bad is not None:
            shard[layout.pieces(1)[0].shard_offset] = bad
        outs = [torch.zeros(p.length, device=device) for p in layout.pieces(1)]
        expected = [o.clone() for o in outs]
        want = reference.unpack(shard, layout, 1, expected, True, 0.5, True, True)
        stats = flatgrad.unpack(shard, layout, 1, outs, scale=0.5, accumulate=True, return_stats=True, backend=name)
        assert isinstance(stats, flatgrad.UnpackStats)
        assert stats.nonfinite.dtype == torch.bool and bool(stats.nonfinite) == (bad is not None)
        torch.testing.assert_close(stats.sum_sq.cpu(), want[0].cpu(), rtol=1e-5, atol=0, equal_nan=True)
        assert flatgrad.unpack(shard, layout, 1, outs, backend=name) is None


@pytest.mark.parametrize("name", BACKEND_PARAMS)
def test_stats_do_not_depend_on_thread_count(name: str) -> None:
    device = _device(name)
    numels = (30_011, 7, 40_009) if _interpreted(name) else (300_007, 7, 400_009)
    layout = Layout.flat(numels, 2)
    gen = torch.Generator().manual_seed(3)
    shard = _values(layout.shard_numel, torch.bfloat16, gen, specials=False).to(device)
    backend = resolve_backend(name, shard.device)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs = [torch.zeros(p.length, device=device) for p in layout.pieces(0)]
            results.append(backend.unpack(shard, layout, 0, outs, True, 0.25, True, True))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(_bits(r), _bits(results[0])) for r in results)


# ---------------------------------------------------------------------------
# The compiled ops themselves: schema, fake implementations, internal checks

COMPILED_DEVICES = [d for d in ("cpu", "cuda") if d in STATUS[d].devices]
needs_cpu_ops = pytest.mark.skipif(
    not STATUS["cpu"].available, reason=f"cpu backend unavailable: {STATUS['cpu'].reason}"
)


def _op_samples(device: str) -> list[tuple[str, tuple]]:
    gen = torch.Generator().manual_seed(11)
    samples = []
    for layout, dtypes, out_dtype in (
        (Layout.chunked([5, 7, 13, 1], 3, align=2), (torch.float32, torch.bfloat16, torch.float16, torch.float32),
         torch.bfloat16),
        (Layout.flat([70_001, 3], 2, align=8), (torch.bfloat16, torch.bfloat16), torch.bfloat16),
    ):
        tensors = [_values(n, d, gen, specials=False).to(device) for n, d in zip(layout.numels, dtypes)]
        runs = layout.pack_runs(None if device == "cpu" else 8192).to(device)
        for scale in (1.0, 0.5):
            samples.append(("pack", (tensors, runs, torch.empty(layout.numel, dtype=out_dtype, device=device), scale)))
        missing = [None] + tensors[1:]  # a missing tensor packs as zeros
        samples.append(("pack", (missing, runs, torch.empty(layout.numel, dtype=out_dtype, device=device), 0.5)))
        plan = flatgrad.PackPlan(layout, missing, dtype=out_dtype, device=device, backend=device)
        plan(missing)  # fills the plan's table
        samples.append(("_pack_table", (plan._table.on_device, plan._runs, plan(missing), 0.5)))
        shard = _values(layout.shard_numel, out_dtype, gen, specials=False).to(device)
        for per_piece, accumulate, stats in ((True, True, True), (False, False, False), (True, False, True)):
            lengths = [p.length for p in layout.pieces(1)] if per_piece else [layout.shard_numel]
            runs = layout.unpack_runs(1, None if device == "cpu" else 8192, per_piece=per_piece).to(device)
            outs = [torch.zeros(n, device=device) for n in lengths]
            samples.append(("unpack", (shard, runs, outs, 0.5, accumulate, stats)))
            plan = flatgrad.UnpackPlan(layout, 1, outs if per_piece else outs[0], backend=device)
            plan(shard, outs if per_piece else outs[0])  # fills the plan's table
            table_args = (shard, plan._runs, plan._table.on_device, torch.float32, 0.5, accumulate, stats)
            samples.append(("_unpack_table", table_args))
    return samples


@pytest.mark.parametrize("device", COMPILED_DEVICES or [pytest.param("cpu", marks=needs_cpu_ops)])
def test_opcheck(device: str) -> None:
    for op, args in _op_samples(device):
        # The plans' _*_table ops reach their tensors through raw addresses, which the
        # schema cannot name: eager only, so AOT tracing is not among their checks.
        utils = ("test_schema", "test_autograd_registration", "test_faketensor") if op.startswith("_") else None
        kwargs = {} if utils is None else {"test_utils": utils}
        torch.library.opcheck(getattr(torch.ops.flatgrad, op).default, args, **kwargs)


@needs_cpu_ops
def test_ops_trace_under_torch_compile() -> None:
    layout = Layout.chunked([5, 7, 13], 3, align=2)
    pack_runs, unpack_runs = layout.pack_runs(), layout.unpack_runs(1)
    tensors = [torch.randn(n) for n in layout.numels]

    def step(tensors, buffer, outs):
        torch.ops.flatgrad.pack(tensors, pack_runs, buffer, 0.5)
        return torch.ops.flatgrad.unpack(buffer[_rank_slice(layout, 1)], unpack_runs, outs, 0.25, True, True)

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        buffer = torch.empty(layout.numel, dtype=torch.bfloat16)
        outs = [torch.ones(p.length) for p in layout.pieces(1)]
        results.append((fn(tensors, buffer, outs), buffer, outs))
    (s0, b0, o0), (s1, b1, o1) = results
    assert torch.equal(s0, s1) and torch.equal(_bits(b0), _bits(b1))
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))


def _pack_op_args(layout: Layout) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    return [torch.randn(n) for n in layout.numels], layout.pack_runs().clone(), torch.empty(layout.numel)


@needs_cpu_ops
def test_pack_op_rejects_bad_runs_and_tensors() -> None:
    layout = Layout.chunked([5, 7, 13], 3)
    tensors, runs, out = _pack_op_args(layout)
    pack = torch.ops.flatgrad.pack
    with pytest.raises(RuntimeError, match="runs must be int64"):
        pack(tensors, runs.int(), out, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("runs must have shape [R, 5]")):
        pack(tensors, runs[:, :4].contiguous(), out, 1.0)
    bad = runs.clone()
    bad[2, 1] = 3
    with pytest.raises(RuntimeError, match=re.escape("runs[2] reads tensors[3], but 3 tensors were given")):
        pack(tensors, bad, out, 1.0)
    bad = runs.clone()
    bad[0, 2] = 4  # tensor 0 has 5 elements: reading 2 from offset 4 overruns it
    with pytest.raises(RuntimeError, match=re.escape("runs[0] reads [4, 6) of tensors[0]")):
        pack(tensors, bad, out, 1.0)
    swapped = runs[[0, 2, 1] + list(range(3, runs.shape[0]))].contiguous()
    with pytest.raises(RuntimeError, match=re.escape("runs[1] starts at 5, expected 2")):
        pack(tensors, swapped, out, 1.0)
    with pytest.raises(RuntimeError, match="runs cover"):
        pack(tensors, runs, torch.empty(layout.numel + 1), 1.0)
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        pack(tensors, runs, torch.empty(2 * layout.numel)[::2], 1.0)
    with pytest.raises(RuntimeError, match=re.escape("tensors[1] must be contiguous")):
        pack([tensors[0], torch.randn(14)[::2], tensors[2]], runs, out, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("tensors[2] has dtype Double")):
        pack([tensors[0], tensors[1], tensors[2].double()], runs, out, 1.0)


@needs_cpu_ops
def test_unpack_op_rejects_bad_runs_and_tensors() -> None:
    layout = Layout.chunked([5, 7, 13], 3)
    runs = layout.unpack_runs(1).clone()
    shard, outs = torch.randn(layout.shard_numel), [torch.zeros(p.length) for p in layout.pieces(1)]
    unpack = torch.ops.flatgrad.unpack
    with pytest.raises(RuntimeError, match=re.escape("runs must have shape [R, 4]")):
        unpack(shard, layout.pack_runs(), outs, 1.0, False, False)
    bad = runs.clone()
    bad[1, 1] = 3
    with pytest.raises(RuntimeError, match=re.escape("runs[1] writes outs[3], but 3 outs were given")):
        unpack(shard, bad, outs, 1.0, False, False)
    bad = runs.clone()
    bad[2, 0] = layout.shard_numel - 1
    with pytest.raises(RuntimeError, match=re.escape("runs[2] reads")):
        unpack(shard, bad, outs, 1.0, False, False)
    bad = runs.clone()
    bad[0, 2] = 1
    with pytest.raises(RuntimeError, match=re.escape("runs[0] writes [1, 3) of outs[0], which has 2 elements")):
        unpack(shard, bad, outs, 1.0, False, False)
    with pytest.raises(RuntimeError, match=re.escape("outs[1] must be contiguous")):
        unpack(shard, runs, [outs[0], torch.zeros(6)[::2], outs[2]], 1.0, False, False)
    with pytest.raises(RuntimeError, match="shard has dtype"):
        unpack(shard.double(), runs, outs, 1.0, False, False)


# ---------------------------------------------------------------------------
# The public wrappers' argument checks (backend-independent)


def _pack_setup():
    layout = Layout.flat([5, 7, 6], 2)
    return layout, [torch.randn(n) for n in layout.numels]


def test_pack_rejects_bad_arguments() -> None:
    layout, ts = _pack_setup()
    cases = [
        (dict(tensors=ts, layout="flat"), TypeError, "layout must be a flatgrad.Layout"),
        (dict(tensors=torch.randn(18), layout=layout), TypeError, "tensors must be a list or tuple"),
        (dict(tensors=ts[:2], layout=layout), ValueError, "got 2 tensors, the layout has 3"),
        (dict(tensors=ts, layout=layout, scale=True), TypeError, "scale must be a float"),
        (dict(tensors=ts, layout=layout, out=[0.0]), TypeError, "out must be a torch.Tensor"),
        (dict(tensors=[ts[0], ts[1].to_sparse(), ts[2]], layout=layout), ValueError,
         "tensors[1] must be a dense (strided) tensor"),
        (dict(tensors=ts, layout=layout, out=torch.zeros(layout.numel).to_sparse()), ValueError,
         "out must be a dense (strided) tensor"),
        (dict(tensors=[ts[0], ts[1], ts[2].double()], layout=layout), ValueError, "tensors[2] has dtype torch.float64"),
        (dict(tensors=[ts[0], ts[1].to("meta"), ts[2]], layout=layout), ValueError,
         "tensors[1] is on meta, expected cpu"),
        (dict(tensors=[ts[0], ts[1], torch.randn(7)], layout=layout), ValueError,
         "tensors[2] has 7 elements, the layout expects 6"),
        (dict(tensors=[ts[0], torch.randn(14)[::2], ts[2]], layout=layout), ValueError, "tensors[1] is not contiguous"),
        (dict(tensors=[], layout=Layout.flat([], 2)), ValueError, "needs out="),
        (dict(tensors=[ts[0], ts[1].half(), ts[2]], layout=layout), ValueError, "mixed dtypes"),
        (dict(tensors=ts, layout=layout, dtype=torch.float64), ValueError, "dtype must be one of"),
        (dict(tensors=ts, layout=layout, out=torch.empty(layout.numel), dtype=torch.bfloat16), ValueError,
         "disagrees with out.dtype"),
        (dict(tensors=ts, layout=layout, out=torch.empty(layout.numel + 2)), ValueError,
         f"out must be 1-D with {layout.numel} elements"),
        (dict(tensors=ts, layout=layout, out=torch.empty(2, layout.numel // 2)), ValueError, "out must be 1-D"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            flatgrad.pack(**kwargs)


def test_pack_rejects_out_aliasing_an_input() -> None:
    layout, ts = _pack_setup()
    storage = torch.zeros(layout.numel + 4)
    inside = storage[2:9]  # tensors[1] (7 elements) lies inside out's memory
    with pytest.raises(ValueError, match=re.escape("out overlaps tensors[1]")):
        flatgrad.pack([ts[0], inside, ts[2]], layout, storage[: layout.numel])


def test_unpack_rejects_bad_arguments() -> None:
    layout = Layout.chunked([5, 7, 13], 4)
    s = layout.shard_numel
    shard = torch.randn(s)
    outs = [torch.zeros(p.length) for p in layout.pieces(0)]
    cases = [
        (dict(layout="chunked"), TypeError, "layout must be a flatgrad.Layout"),
        (dict(rank=4), ValueError, "rank must be in [0, 4), got 4"),
        (dict(rank=-1), ValueError, "rank must be in [0, 4), got -1"),
        (dict(rank=True), ValueError, "rank must be an int"),
        (dict(scale="0.5"), TypeError, "scale must be a float"),
        (dict(shard=torch.randn(s + 1)), ValueError, f"shard has {s + 1} elements, the layout expects {s}"),
        (dict(shard=torch.randn(s, 1)), ValueError, "shard must be 1-D"),
        (dict(shard=torch.randn(2 * s)[::2]), ValueError, "shard is not contiguous"),
        (dict(shard=shard.double()), ValueError, "shard has dtype torch.float64"),
        (dict(shard=shard.to_sparse()), ValueError, "shard must be a dense (strided) tensor"),
        (dict(out=torch.zeros(s + 1)), ValueError, f"out has {s + 1} elements, the layout expects {s}"),
        (dict(out=torch.zeros(s, 1)), ValueError, "out must be 1-D"),
        (dict(out=torch.zeros(s, device="meta")), ValueError, "out is on meta, expected cpu"),
        (dict(out=outs[:2]), ValueError, f"out has 2 tensors, rank 0 owns {len(outs)} pieces"),
        (dict(out=[outs[0], torch.zeros(outs[1].numel() + 1), outs[2]]), ValueError,
         f"out[1] has {outs[1].numel() + 1} elements, the layout expects {outs[1].numel()}"),
        (dict(out=[outs[0], outs[1].bfloat16(), outs[2]]), ValueError,
         "out[1] has dtype torch.bfloat16, out[0] has torch.float32"),
        (dict(out=[outs[0], outs[1], torch.zeros(2 * outs[2].numel())[::2]]), ValueError, "out[2] is not contiguous"),
        (dict(out=[outs[0], outs[1].to_sparse(), outs[2]]), ValueError, "out[1] must be a dense (strided) tensor"),
        (dict(out=3), TypeError, "out must be a tensor or a list of tensors"),
    ]
    for overrides, error, message in cases:
        kwargs = dict(shard=shard, layout=layout, rank=0, out=outs, scale=1.0)
        kwargs.update(overrides)
        with pytest.raises(error, match=re.escape(message)):
            flatgrad.unpack(**kwargs)


def test_unpack_rejects_out_aliasing_the_shard() -> None:
    layout = Layout.chunked([5, 7, 13], 4)
    s = layout.shard_numel
    storage = torch.zeros(2 * s)
    with pytest.raises(ValueError, match="out overlaps shard"):
        flatgrad.unpack(storage[:s], layout, 0, storage[1 : s + 1])
    pieces = layout.pieces(0)
    outs = [torch.zeros(p.length) for p in pieces]
    outs[1] = storage[3 : 3 + pieces[1].length]
    with pytest.raises(ValueError, match=re.escape("out[1] overlaps shard")):
        flatgrad.unpack(storage[:s], layout, 0, outs)


# ---------------------------------------------------------------------------
# Backend choice


def test_forced_backend_that_cannot_run_raises_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLATGRAD_BACKEND", raising=False)
    layout, ts = _pack_setup()
    cuda = STATUS["cuda"]
    if cuda.available:
        message = re.escape("flatgrad backend 'cuda' cannot run on cpu tensors")
    else:
        message = re.escape(f"flatgrad backend 'cuda' is not available: {cuda.reason}")
    with pytest.raises(RuntimeError, match=message):
        flatgrad.pack(ts, layout, backend="cuda")
    with pytest.raises(RuntimeError, match=message):
        flatgrad.unpack(torch.zeros(layout.shard_numel), layout, 0, torch.zeros(layout.shard_numel), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        flatgrad.pack(ts, layout, backend="fortran")


def test_flatgrad_backend_env_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    layout, ts = _pack_setup()
    cpu = torch.device("cpu")
    monkeypatch.delenv("FLATGRAD_BACKEND", raising=False)
    assert resolve_backend(None, cpu).name == ("cpu" if STATUS["cpu"].available else "torch")
    monkeypatch.setenv("FLATGRAD_BACKEND", "torch")
    assert resolve_backend(None, cpu).name == "torch"
    monkeypatch.setenv("FLATGRAD_BACKEND", "fortran")
    with pytest.raises(ValueError, match="backend must be one of"):
        flatgrad.pack(ts, layout)
    monkeypatch.setenv("FLATGRAD_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="flatgrad backend 'cuda'"):
        flatgrad.pack(ts, layout)
    # An explicit backend= wins over the environment.
    assert_bits_equal(flatgrad.pack(ts, layout, backend="torch"), torch.cat(ts + [torch.zeros(layout.numel - 18)]))
    if STATUS["cpu"].available:
        monkeypatch.setenv("FLATGRAD_BACKEND", "cpu")
        assert resolve_backend(None, cpu).name == "cpu"


def test_host_backend_keeps_a_forced_host_backend_and_replaces_an_accelerator_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host-side part of a call forced onto the accelerator (a staged unpack) takes the host's backend."""
    monkeypatch.delenv("FLATGRAD_BACKEND", raising=False)
    host_choice = "cpu" if STATUS["cpu"].available else "torch"
    for forced, expected in ((None, host_choice), ("cuda", host_choice), ("triton", host_choice), ("torch", "torch")):
        assert host_backend(forced) == expected, forced
        assert "cpu" in STATUS[host_backend(forced)].devices
        resolve_backend(host_backend(forced), torch.device("cpu"))  # runs on host tensors
    monkeypatch.setenv("FLATGRAD_BACKEND", "cuda")
    assert host_backend(None) == host_choice
    monkeypatch.setenv("FLATGRAD_BACKEND", "torch")
    assert host_backend(None) == "torch" and host_backend("cuda") == host_choice  # backend= wins over the env
    with pytest.raises(ValueError, match="backend must be one of"):
        host_backend("fortran")


def test_every_backend_reports_its_status() -> None:
    for name in BACKENDS:
        status = STATUS[name]
        assert status.available == bool(status.devices)
        assert status.available or status.reason, f"{name} is unavailable without a reason"
    assert STATUS["torch"].available and "cpu" in STATUS["torch"].devices


def test_unpack_rejects_overlapping_out_pieces_and_nonfinite_scale() -> None:
    layout = Layout.chunked([4, 4], 2)
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] overlap"):
        flatgrad.unpack(torch.ones(layout.shard_numel), layout, 0, [buf[:2], buf[1:3]])
    flatgrad.unpack(torch.ones(layout.shard_numel), layout, 0, [buf[:2], buf[2:4]])  # adjacent is fine
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            flatgrad.pack([torch.ones(4), torch.ones(4)], layout, scale=bad)
        with pytest.raises(ValueError, match="scale must be finite"):
            flatgrad.unpack(torch.ones(layout.shard_numel), layout, 0, torch.zeros(layout.shard_numel), scale=bad)
