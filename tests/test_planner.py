"""``flatgrad plan``: simulated collective schedules, checked against real DeepSpeed call traces.

The core tests run real DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, gloo) at 2, 4
and 8 ranks on three small models (a GPT with tied embeddings and LayerNorms,
an MLP with a frozen layer, a scaled-down seed MoE), record every collective
that one backward issues at ``deepspeed.comm`` and ``torch.distributed`` (op,
size, dtype, destination, group), and require the simulated schedule to equal
that trace call for call, in order, on every rank: stock ZeRO-2 in both
``use_multi_rank_bucket_allreduce`` modes, stock ZeRO-3, flatgrad ZeRO-2 and
flatgrad ZeRO-3. The other tests check the model builders, the traced
backward order, invariants of the schedules over random shapes, the cost model
and the command.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _ds
from flatgrad.planner import models
from flatgrad.planner.flatgrad_schedule import flatgrad_zero2, flatgrad_zero3
from flatgrad.planner.stock import partitions, stock_zero2, stock_zero3
from flatgrad.testing.collectives import Call, CollectiveRecorder

# --------------------------------------------------------------------------- tracing real runs

# Collective entry points recorded (see [Note: counting collectives]); the outermost call counts.
_TRACED = ("reduce", "all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
           "all_to_all_single", "all_to_all", "broadcast", "all_reduce_coalesced", "barrier", "reduce_scatter_single",
           "_reduce_scatter_base", "_all_gather_base", "all_gather_single")  # fmt: skip
_REDUCTION_OPS = ("reduce", "all_reduce", "reduce_scatter")


def _key(call: Call) -> tuple:
    """``(op, numel, dtype, dst, group ranks)``: a reduction by its op, any other collective by its entry point."""
    return (call.op if call.op in _REDUCTION_OPS else call.name, call.numel, call.dtype, call.dst, call.group)


def _batch(model: torch.nn.Module, rank: int) -> tuple:
    """A small real batch for ``model``, different on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    if isinstance(model, (models.GPT, models.Llama)):
        idx = torch.randint(0, model.vocab, (2, 8), generator=g)
        return idx, torch.randint(0, model.vocab, (2, 8), generator=g)
    if isinstance(model, models.MLP):
        return torch.randn(4, model.d_in, generator=g), torch.randn(4, model.d_out, generator=g)
    return torch.randn(8, model.hidden, generator=g), torch.randn(8, model.hidden, generator=g)


# (model name, model kwargs): small, but every feature that shapes a schedule is there: tied and
# LayerNorm parameters (traced order), a frozen layer, expert groups (ep_size 2 divides 2, 4 and 8).
CASE_MODELS = {
    "gpt": ("gpt", dict(vocab=97, n_positions=16, d=24, n_layer=2, n_head=2)),
    "mlp": ("mlp", dict(d_in=13, hidden=37, d_out=5, layers=3, frozen=True)),
    "moe": ("seed-moe", dict(hidden=24, num_experts=4, ep_size=2, k=1)),
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Bucket sizes in elements: several buckets per backward, parameters larger than a bucket (GPT's wte,
# the MLP's layers.1.weight), and a bucket filled exactly (the MLP's first four gradients: 5+5+185+37).
BUCKET = {"gpt": 1000, "mlp": 232, "moe": 1000}


def _real_trace(
    model_key: str, stage: int, multi_rank: bool, use_flatgrad: bool, dtype: str, zero: tuple, rank: int, world_size: int
) -> list[tuple]:
    """One real backward under DeepSpeed on this rank; its collectives in order."""
    import deepspeed

    from flatgrad import deepspeed as flatgrad_ds

    name, kwargs = CASE_MODELS[model_key]
    torch.manual_seed(0)
    model = models.build(name, "cpu", **kwargs)
    config = _ds.ds_config(
        stage, world_size=world_size, bucket=BUCKET[model_key], dtype=dtype, use_multi_rank_bucket_allreduce=multi_rank,
        **dict(zero),
    )  # fmt: skip
    if dtype == "bf16":
        config["data_types"] = {"grad_accum_dtype": "fp32"}  # ZeRO-2's fp32 partition buffer: own slices kept apart
    if stage == 3:
        del config["zero_optimization"]["use_multi_rank_bucket_allreduce"]
    if use_flatgrad:
        config["flatgrad"] = {}
        initialize = flatgrad_ds.initialize
    else:
        initialize = deepspeed.initialize
    linear = torch.nn.functional.linear
    try:
        engine, *_ = initialize(model=model, model_parameters=list(model.parameters()), config=config)
        loss = engine(*_batch(model, rank))
        with CollectiveRecorder(_TRACED) as tracer:
            engine.backward(loss)
        engine.destroy()
    finally:
        # ZeRO-3 replaces torch.nn.functional.linear for the rest of the process (memory_efficient_linear),
        # which would give later ZeRO-2 cases ZeRO-3's hook order; each case starts from a clean process state.
        torch.nn.functional.linear = linear
    return [_key(c) for c in tracer.calls]


CASES = (  # (model, stage, use_multi_rank_bucket_allreduce, flatgrad, dtype, other zero_optimization keys)
    [(m, 2, multi, False, "fp32", ()) for m in CASE_MODELS for multi in (False, True)]
    + [(m, 2, True, True, "fp32", ()) for m in CASE_MODELS]
    + [("gpt", 2, False, False, "bf16", ()), ("gpt", 2, True, True, "bf16", ())]
    + [("mlp", 2, False, False, "fp32", (("reduce_scatter", False),))]
    + [("gpt", 2, False, False, "fp32", (("contiguous_gradients", False),))]
    + [(m, 3, True, f, "fp32", ()) for m in ("gpt", "mlp") for f in (False, True)]
)


def _traces_rank(rank: int, world_size: int, cases: list) -> list[list[tuple]]:
    return [_real_trace(*case, rank, world_size) for case in cases]


@functools.lru_cache(maxsize=None)
def _spec(model_key: str) -> models.ModelSpec:
    name, kwargs = CASE_MODELS[model_key]
    return models.load(name, **kwargs)


def _simulated(case: tuple, world_size: int, rank: int) -> list[tuple]:
    model_key, stage, multi, use_flatgrad, dtype, zero = case
    spec = _spec(model_key)
    common = dict(bucket_numel=BUCKET[model_key], rank=rank, dtype=_DTYPES[dtype])
    if stage == 2 and use_flatgrad:
        schedule = flatgrad_zero2(spec, world_size, **common)
    elif stage == 2:
        grad_accum = torch.float32 if dtype == "bf16" else None
        schedule = stock_zero2(
            spec, world_size, use_multi_rank_bucket_allreduce=multi, grad_accum_dtype=grad_accum, **dict(zero), **common
        )  # fmt: skip
    elif use_flatgrad:
        schedule = flatgrad_zero3(spec, world_size, **common)
    else:
        schedule = stock_zero3(spec, world_size, **common)
    return [c.key() for c in schedule.calls]


# Collectives a backward may issue besides gradient reductions: the MoE's expert all-to-alls, and
# ZeRO-3's parameter all-gathers. Everything else must be in the schedule.
_OTHER_OPS = {"all_to_all_single", "all_gather_into_tensor", "all_gather"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_simulated_schedule_equals_real_deepspeed_trace(world_size: int) -> None:
    traces = _ds.launch(_traces_rank, world_size, CASES, timeout=230)
    for rank, per_case in enumerate(traces):
        for case, trace in zip(CASES, per_case):
            reductions = [c for c in trace if c[0] in ("reduce", "all_reduce", "reduce_scatter")]
            others = {c[0] for c in trace} - {"reduce", "all_reduce", "reduce_scatter"}
            assert others <= _OTHER_OPS, f"{case} rank {rank}: unexpected collectives {others}"
            simulated = _simulated(case, world_size, rank)
            assert reductions, f"{case} rank {rank}: the real backward issued no reduction"
            assert simulated == reductions, f"{case} at {world_size} ranks, rank {rank}:\nsimulated {simulated}\nreal      {reductions}"
    # The cases exercise what they are meant to: several buckets, straddling partitions, expert groups.
    moe_reduce = _simulated(("moe", 2, False, False, "fp32", ()), world_size, 0)
    assert {c[4] for c in moe_reduce} == {tuple(range(world_size)), tuple(range(0, world_size, 2))}
    assert len({c[3] for c in _simulated(("gpt", 2, False, False, "fp32", ()), world_size, 0)}) == world_size


# --------------------------------------------------------------------------- models


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_builtin_models_have_their_published_sizes() -> None:
    assert _numel(models.build("gpt2-xl")) == 1_557_611_200
    assert _numel(models.build("llama-7b")) == 6_738_415_616
    seed = models.load("seed-moe")
    assert seed.numel == 10_026_000  # the seed thread's figure
    experts = [p for p in seed.params if p.expert_group is not None]
    assert {p.expert_group for p in experts} == {"ep_size_4"} and sum(p.numel for p in experts) == 8_008_000
    assert sum(p.numel for p in seed.params if p.expert_group is None) == 2_018_000
    assert all(p.device.type == "meta" for p in seed.parameters)


def _cpu_hook_order(module: torch.nn.Module, zero3: bool) -> list[int]:
    """The hook order of one real CPU backward (optionally under DeepSpeed ZeRO-3's linear)."""
    import torch.nn.functional as F

    index = {id(p): i for i, p in enumerate(module.parameters())}
    order: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda q: order.append(index[id(q)])) for p in module.parameters() if p.requires_grad]
    linear = F.linear
    if zero3:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        F.linear = zero3_linear_wrap
    try:
        args = _batch(module, 0)
        module(*args).backward()
    finally:
        F.linear = linear
        for h in hooks:
            h.remove()
    return order


@pytest.mark.parametrize(
    "name, kwargs",
    [("gpt", dict(n_layer=2)), ("mlp", dict(frozen=True)), ("llama-7b", dict(vocab=50, d=16, n_layer=2, n_head=2, d_ff=24))],
)
def test_traced_backward_order_is_the_real_cpu_order(name: str, kwargs: dict) -> None:
    spec = models.load(name, **kwargs)
    assert spec.order_source == "traced"
    torch.manual_seed(0)
    cpu = models.build(name, "cpu", **kwargs)
    assert list(spec.backward_order) == _cpu_hook_order(cpu, zero3=False)
    assert list(spec.zero3_backward_order) == _cpu_hook_order(cpu, zero3=True)
    # The order is not reverse registration (LayerNorm: weight first) wherever norms or ZeRO-3 are involved.
    reverse = [i for i in reversed(range(len(spec.params))) if spec.params[i].requires_grad]
    if name != "mlp":
        assert list(spec.backward_order) != reverse
    if name != "llama-7b":  # biased Linears: ZeRO-3's linear yields the weight's grad before the bias's
        assert list(spec.zero3_backward_order) != list(spec.backward_order)


def test_model_loading_by_module_factory_and_bad_names() -> None:
    spec = models.load("flatgrad.planner.models:MLP", d_in=3, hidden=4, d_out=2, layers=2, frozen=True)
    assert spec.numel == 4 * 2 + 2 + 2  # the frozen first layer is not counted
    assert {p.name for p in spec.params if not p.requires_grad} == {"layers.0.weight", "layers.0.bias"}
    assert not set(spec.backward_order) & {p.index for p in spec.params if not p.requires_grad}
    with pytest.raises(ValueError, match="unknown model 'gpt3'"):
        models.load("gpt3")
    with pytest.raises(ValueError, match="cannot import module"):
        models.load("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        models.load("flatgrad.planner.models:nope")
    assert models.parse_model_args(["n_layer=2", "frozen=true", "eps=1e-5", "name=x"]) == {
        "n_layer": 2, "frozen": True, "eps": 1e-5, "name": "x"}  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        models.parse_model_args(["n_layer"])


# --------------------------------------------------------------------------- schedule invariants


class _Params(torch.nn.Module):
    """Parameters of the given numels, registered in order (backward: reverse registration)."""

    def __init__(self, numels: list[int]) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(n, device="meta")) for n in numels)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=30),
    world_size=st.integers(1, 64),
    bucket=st.integers(1, 20000),
)
def test_schedules_reduce_every_element_exactly_once(numels: list[int], world_size: int, bucket: int) -> None:
    from flatgrad.layout import Layout

    spec = models.describe(_Params(numels), "params")
    total = sum(numels)
    world = range(world_size)
    layout = Layout.flat(numels, world_size, 2)  # DeepSpeed flattens in registration order

    # Stock ZeRO-2, reduce: what each rank receives is exactly its partition's real elements.
    reduce = stock_zero2(spec, world_size, bucket_numel=bucket, use_multi_rank_bucket_allreduce=False)
    assert {c.op for c in reduce.calls} == {"reduce"} and all(c.group == world for c in reduce.calls)
    received = [sum(c.numel for c in reduce.calls if c.dst == r) for r in world]
    assert received == [sum(p.length for p in layout.pieces(r)) for r in world]
    assert partitions(spec, world_size)[0].partition_size == layout.shard_numel
    # Stock ZeRO-2, all_reduce: every element once, one call per bucket.
    allreduce = stock_zero2(spec, world_size, bucket_numel=bucket, use_multi_rank_bucket_allreduce=True)
    assert {c.op for c in allreduce.calls} == {"all_reduce"} and allreduce.numel == total
    # flatgrad ZeRO-2: balanced buckets, padding below 2 x world size each.
    flat = flatgrad_zero2(spec, world_size, bucket_numel=bucket)
    if world_size == 1:
        assert flat.calls == ()
    else:
        assert flat.payload == total
        assert all(c.numel % (2 * world_size) == 0 and 0 <= c.numel - c.payload < 2 * world_size for c in flat.calls)
        assert len(flat.calls) <= len(allreduce.calls) + sum(n > bucket for n in numels)
    # ZeRO-3: every parameter padded to a multiple of the world size, stock and flatgrad alike.
    z3 = stock_zero3(spec, world_size, bucket_numel=bucket)
    assert z3.payload == total and z3.numel == sum(-(-n // world_size) * world_size for n in numels)
    assert [c.key() for c in flatgrad_zero3(spec, world_size, bucket_numel=bucket).calls] == (
        [c.key() for c in z3.calls] if world_size > 1 else [])  # fmt: skip


def test_seed_model_reproduces_the_measured_figures() -> None:
    """docs/design.md "The seed model": measured with real DeepSpeed 0.19.8 on CPU/gloo."""
    seed = models.load("seed-moe")
    assert stock_zero2(seed, 8).ops() == {"all_reduce": 2}
    reduce = stock_zero2(seed, 8, use_multi_rank_bucket_allreduce=False)
    assert reduce.ops() == {"reduce": 10}
    small = stock_zero2(seed, 4, bucket_numel=1_000_000, use_multi_rank_bucket_allreduce=False)
    assert small.ops() == {"reduce": 23} and sum(c.numel < 10_000 for c in small.calls) == 10
    # flatgrad: one reduce_scatter per sub-group; experts reduce over their own 2-rank groups at 8 ranks.
    flat = flatgrad_zero2(seed, 8)
    assert [(c.numel, len(c.group)) for c in flat.calls] == [(8_008_000, 2), (-(-2_018_000 // 16) * 16, 8)]
    assert stock_zero3(seed, 8).unavailable and not stock_zero3(seed, 8).calls


def test_bad_arguments_raise_clear_errors() -> None:
    seed = models.load("seed-moe")
    with pytest.raises(ValueError, match="not a multiple of expert group 'ep_size_4'"):
        stock_zero2(seed, 6)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        flatgrad_zero2(seed, 0)
    with pytest.raises(ValueError, match="bucket_numel must be a positive int"):
        stock_zero3(models.load("mlp"), 4, bucket_numel=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        stock_zero2(models.load("mlp"), 4, rank=4)


# --------------------------------------------------------------------------- cost model


def test_cost_model_follows_nccl_tests_conventions() -> None:
    from flatgrad.planner.cost import CostModel
    from flatgrad.planner.schedule import Collective

    cost = CostModel()
    one_gb = 250_000_000  # fp32 elements
    node = Collective("all_reduce", one_gb, torch.float32, range(8))
    assert cost.bus_bytes(node) == pytest.approx(1e9 * 2 * 7 / 8)
    assert cost.time(node) == pytest.approx((3.6 + 14 * 0.47) * 1e-6 + 1e9 * 2 * 7 / 8 / 450e9)
    rs = Collective("reduce_scatter", one_gb, torch.float32, range(16))  # two nodes: one IB hop each way
    assert cost.time(rs) == pytest.approx((3.6 + 14 * 0.47 + 1 * 2.7) * 1e-6 + 1e9 * 15 / 16 / 400e9)
    reduce = Collective("reduce", one_gb, torch.float32, range(16), dst=3)
    assert cost.bus_bytes(reduce) == 1e9 and cost.time(reduce) > cost.time(rs)
    assert cost.time(Collective("reduce", 10, torch.float32, range(1), dst=0)) == pytest.approx(3.6e-6)
    assert cost.sent_bytes(reduce, 3) == 0 and cost.sent_bytes(reduce, 0) == 1e9
    # A rank sends every gradient slice except its own partition's: the same volume in reduce mode as a reduce_scatter.
    spec = models.load("mlp")
    for rank in range(4):
        sent = cost.schedule_sent_bytes(stock_zero2(spec, 4, use_multi_rank_bucket_allreduce=False, rank=rank))
        own = sum(c.nbytes for c in stock_zero2(spec, 4, use_multi_rank_bucket_allreduce=False).calls if c.dst == rank)
        assert sent == spec.numel * 4 - own
    for group in (range(16), range(3, 40, 2), range(5, 1024, 4), range(1, 1024, 8), range(2, 1024, 32), range(7, 8)):
        assert cost.nodes(group) == len({r // 8 for r in group})
    with pytest.raises(ValueError, match="ib_busbw_gbps must be positive"):
        CostModel(ib_busbw_gbps=0)


# --------------------------------------------------------------------------- the command


def test_plan_command_writes_text_json_and_png(tmp_path, capsys) -> None:
    from flatgrad import cli

    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "seed-moe", "--model-arg", "hidden=24", "--model-arg", "num_experts=4", "--model-arg", "ep_size=2",
            "-w", "4", "8", "--bucket", "1000", "--dtype", "fp32", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "world size 4" in text and "world size 8" in text and "not possible" in text
    doc = json.loads(out.read_text())
    assert [w["world_size"] for w in doc["world_sizes"]] == [4, 8]
    spec = models.load("seed-moe", hidden=24, num_experts=4, ep_size=2)
    for entry in doc["world_sizes"]:
        by_key = {s["key"]: s for s in entry["schedules"]}
        assert set(by_key) == {"stock_zero2_reduce", "stock_zero2_allreduce", "flatgrad_zero2", "stock_zero3", "flatgrad_zero3"}
        expected = stock_zero2(spec, entry["world_size"], bucket_numel=1000, use_multi_rank_bucket_allreduce=False)
        got = by_key["stock_zero2_reduce"]
        assert got["calls"] == len(expected.calls) == len(got["call_list"])
        assert [c[1] for c in got["call_list"]] == [c.numel for c in expected.calls]
        assert sum(n for _, _, n in got["histogram"]) == got["calls"]
        assert got["time_s"] > by_key["flatgrad_zero2"]["time_s"] > 0
        assert by_key["stock_zero3"]["unavailable"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_command_rejects_bad_input(capsys) -> None:
    from flatgrad import cli

    assert cli.main(["plan", "seed-moe", "-w", "6", "--stage", "2"]) == 2
    assert "not a multiple of expert group 'ep_size_4'" in capsys.readouterr().err
    assert cli.main(["plan", "nonexistent-model"]) == 2
    assert "unknown model 'nonexistent-model'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["plan", "mlp", "--world-size", "0"])


def test_reduction_modes_cost_and_bytes() -> None:
    from flatgrad.planner.cost import DEFAULT, reduction_call

    group = range(8)
    numel = 8 * 1_000_000
    rs = reduction_call("reduce_scatter", numel, torch.bfloat16, group)
    exact = reduction_call("exact", numel, torch.bfloat16, group)
    assert DEFAULT.bus_bytes(exact) == DEFAULT.bus_bytes(rs)
    assert DEFAULT.time(exact) == DEFAULT.time(rs)
    for kind in ("int8", "fp8"):
        q = reduction_call(kind, numel, torch.bfloat16, group)
        assert DEFAULT.bus_bytes(q) <= 0.53 * DEFAULT.bus_bytes(rs)
        assert DEFAULT.time(q) < DEFAULT.time(rs)
    with pytest.raises(ValueError, match="reduction"):
        reduction_call("int4", numel, torch.bfloat16, group)


# --------------------------------------------------------------------------- reduction modes at scale


def test_all_to_all_cost_is_per_peer_sends_hand_computed() -> None:
    """[Note: all_to_all cost] on hand-computed cases: one node, two nodes, a rail; rings for comparison."""
    from flatgrad.planner.cost import CostModel
    from flatgrad.planner.schedule import Collective

    cost = CostModel()
    nbytes = 32e6
    # One node: the ring's figures (7 NVLink hops; (p - 1) / p of the bytes at the NVLink busbw).
    a2a = Collective("all_to_all", 16_000_000, torch.bfloat16, range(8))
    assert cost.latency(a2a) == pytest.approx((3.6 + 7 * 0.47) * 1e-6)
    assert cost.bandwidth_time(a2a) == pytest.approx(nbytes * 7 / 8 / 450e9)
    assert cost.inter_node_bytes(a2a) == 0
    # Two nodes of 8: 7 peers on NVLink, 8 over IB through the rank's own 50 GB/s NIC; the IB half dominates.
    a2a = Collective("all_to_all", 16_000_000, torch.bfloat16, range(16))
    assert cost.latency(a2a) == pytest.approx((3.6 + 7 * 0.47 + 8 * 2.7) * 1e-6)
    assert cost.inter_node_bytes(a2a) == pytest.approx(nbytes * 8 / 16)
    assert cost.bandwidth_time(a2a) == pytest.approx(nbytes * 8 / 16 / 50e9)
    assert cost.time(a2a) == pytest.approx(cost.latency(a2a) + cost.bandwidth_time(a2a))
    # The ring over the same ranks: 14 NVLink steps and 1 IB step, 15/16 of the bytes at 400 GB/s; 1 hop in 8 on IB.
    rs = Collective("reduce_scatter", 16_000_000, torch.bfloat16, range(16))
    assert cost.latency(rs) == pytest.approx((3.6 + 14 * 0.47 + 2.7) * 1e-6)
    assert cost.bandwidth_time(rs) == pytest.approx(nbytes * 15 / 16 / 400e9)
    assert cost.inter_node_bytes(rs) == pytest.approx(nbytes * 15 / 16 / 8)
    # A rail (one rank per node, 128 nodes): a ring gets one NIC, and every all_to_all peer is on IB.
    rail = range(3, 1024, 8)
    rs = Collective("reduce_scatter", 1_280_000, torch.bfloat16, rail)
    assert cost.local(rail) == 1
    assert cost.latency(rs) == pytest.approx((3.6 + 127 * 2.7) * 1e-6)
    assert cost.bandwidth_time(rs) == pytest.approx(2_560_000 * 127 / 128 / 50e9)
    a2a = Collective("all_to_all", 1_280_000, torch.bfloat16, rail)
    assert cost.latency(a2a) == pytest.approx(cost.latency(rs))
    assert cost.bandwidth_time(a2a) == pytest.approx(cost.bandwidth_time(rs))
    # The NIC figure is a knob: twice the NIC, half the IB-bound all_to_all time.
    fast = CostModel(ib_nic_gbps=100.0)
    assert fast.bandwidth_time(Collective("all_to_all", 16_000_000, torch.bfloat16, range(16))) == pytest.approx(
        nbytes * 8 / 16 / 100e9
    )
    with pytest.raises(ValueError, match="ib_nic_gbps must be positive"):
        CostModel(ib_nic_gbps=0)


def test_hierarchical_reduction_calls_hand_computed() -> None:
    from flatgrad.planner.cost import MODES, reduction_calls

    numel, group = 32 * 4096, range(32)  # 4 nodes of 8; rank 13 is local rank 5 of node 1
    calls = {m: reduction_calls(m, numel, torch.bfloat16, group, rank=13) for m in MODES}
    node, rail = range(8, 16), range(5, 32, 8)
    assert [(c.op, c.numel, c.dtype, c.group) for c in calls["2d_reduce_scatter"]] == [
        ("reduce_scatter", numel, torch.bfloat16, node), ("reduce_scatter", numel // 8, torch.bfloat16, rail)]  # fmt: skip
    assert [(c.op, c.numel, c.dtype, c.group) for c in calls["hier_exact"]] == [
        ("all_to_all", numel, torch.bfloat16, node), ("all_to_all", numel // 8, torch.float32, rail)]  # fmt: skip
    # int8 wire: per segment round16(elements) + round16(4 bytes x blocks of 256).
    node_wire = 8 * (16384 + 4 * 64)  # 16384 elements per node member
    rail_wire = 4 * (4096 + 4 * 16)  # the rank's 16384-element node partial, over 4 nodes
    assert [(c.op, c.numel, c.dtype, c.group) for c in calls["hier_int8"]] == [
        ("reduce_scatter", numel, torch.bfloat16, node), ("all_to_all", rail_wire, torch.uint8, rail)]  # fmt: skip
    assert [(c.op, c.numel, c.group) for c in calls["qgz_int8"]] == [
        ("all_to_all", node_wire, node), ("all_to_all", rail_wire, rail)]  # fmt: skip
    assert [(c.op, c.numel, c.group) for c in calls["int8"]] == [("all_to_all", 32 * (4096 + 64), group)]
    # One node: only the node stage is left.
    assert [c.op for c in reduction_calls("hier_int8", 8 * 256, torch.bfloat16, range(8), rank=3)] == ["reduce_scatter"]
    with pytest.raises(ValueError, match="whole nodes"):
        reduction_calls("qgz_int8", 12 * 256, torch.bfloat16, range(12))
    with pytest.raises(ValueError, match="whole nodes"):  # 4, 8 and 4 ranks on three nodes
        reduction_calls("hier_exact", 16 * 256, torch.bfloat16, range(4, 20), rank=4)
    # A strided group (MoE's expert data parallelism) spread evenly over nodes: the reducer's placement.
    strided = reduction_calls("2d_reduce_scatter", 32 * 256, torch.bfloat16, range(1, 64, 2), rank=11)
    assert [c.group for c in strided] == [range(9, 17, 2), range(3, 64, 8)]
    with pytest.raises(ValueError, match="multiple of the group size"):
        reduction_calls("2d_reduce_scatter", 32 * 256 + 1, torch.bfloat16, group)
    with pytest.raises(ValueError, match="reduction must be one of"):
        reduction_calls("int4", 32 * 256, torch.bfloat16, group)


def test_mode_schedules_keep_the_buckets_and_price_them() -> None:
    from flatgrad.planner.cost import DEFAULT, MODES
    from flatgrad.planner.report import mode_rows

    spec = models.load("gpt", n_layer=2)
    for world_size in (8, 16):
        base = flatgrad_zero2(spec, world_size, bucket_numel=20_000)
        by_mode = {m: flatgrad_zero2(spec, world_size, bucket_numel=20_000, reduction=m) for m in MODES}
        assert by_mode["reduce_scatter"] == base
        shape = lambda s: [(c.numel, c.dtype, c.group) for c in s.calls]  # noqa: E731
        assert shape(by_mode["exact"]) == shape(base)
        assert {c.op for c in by_mode["exact"].calls} == {"all_to_all"}
        assert len(by_mode["qgz_int8"].calls) == (2 if world_size > 8 else 1) * len(base.calls)
        rows = {r["mode"]: r for r in mode_rows([(world_size, list(by_mode.values()))], DEFAULT)}
        assert rows["reduce_scatter"]["vs_reduce_scatter"] == 1.0
        for r in rows.values():
            assert r["time_s"] == pytest.approx(r["latency_s"] + r["bandwidth_s"])
            assert r["overlapped_s"] <= r["time_s"] * (1 + 1e-12)
        if world_size == 8:  # one node: exact costs what the ring costs, int8 about half the bytes
            assert rows["exact"]["time_s"] == pytest.approx(rows["reduce_scatter"]["time_s"])
            assert rows["int8"]["bytes_sent"] < 0.53 * rows["reduce_scatter"]["bytes_sent"]
        else:  # two nodes: the flat all_to_all pushes half its bytes through one NIC
            assert rows["exact"]["ib_bytes_sent"] == pytest.approx(rows["exact"]["bytes_sent"] * 8 / 15)
            # Bandwidth: (8/16 of the bytes at 50 GB/s) / (15/16 at 400 GB/s) = 64/15, bucket for bucket.
            assert rows["exact"]["bandwidth_s"] / rows["reduce_scatter"]["bandwidth_s"] == pytest.approx(64 / 15)
            assert rows["exact"]["vs_reduce_scatter"] > 1
    # MoE expert groups are strided: placed as the reducer places them, their members on a node form its node group.
    moe = models.load("seed-moe", hidden=24, num_experts=4, ep_size=2)
    hier = flatgrad_zero2(moe, 16, bucket_numel=1000, reduction="hier_int8")
    assert hier.unavailable is None and range(0, 8, 2) in {c.group for c in hier.calls}
    assert "whole nodes" in flatgrad_zero2(moe, 12, bucket_numel=1000, reduction="hier_int8").unavailable
    with pytest.raises(ValueError, match="reduction must be one of"):
        flatgrad_zero2(spec, 8, reduction="int4")


def test_plan_command_modes_table_json_and_png(tmp_path, capsys) -> None:
    from flatgrad import cli

    out, png = tmp_path / "modes.json", tmp_path / "modes.png"
    argv = ["plan", "gpt", "--model-arg", "n_layer=2", "-w", "8", "16", "--bucket", "20000", "--modes",
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "world size 8" in text and "world size 16" in text and "qgz_int8" in text and "fastest:" in text
    rows = json.loads(out.read_text())["modes"]
    modes = __import__("flatgrad.planner.cost", fromlist=["MODES"]).MODES
    assert {r["mode"] for r in rows} == set(modes)
    assert [r["world_size"] for r in rows].count(16) == len(modes)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    argv = ["plan", "gpt", "--model-arg", "n_layer=2", "-w", "16", "--bucket", "20000", "--modes", "exact"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "\nreduce_scatter " in text and "\nexact " in text and "\nint8 " not in text and "qgz_int8" not in text
    with pytest.raises(SystemExit):
        cli.main(["plan", "gpt", "--modes", "int4"])


# --------------------------------------------------------------------------- ZeRO-3 under every reduction mode


def _zero3_modes_rank(rank: int, world_size: int, modes: tuple[str, ...]) -> dict[str, list[tuple]]:
    """Per mode, flatgrad ZeRO-3's gradient collectives in one real backward, on ranks placed as 2 nodes of 2."""
    import warnings

    from flatgrad import deepspeed as flatgrad_ds

    _ds.as_nodes(rank, 2)
    name, kwargs = CASE_MODELS["mlp"]
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        model = models.build(name, "cpu", **kwargs)
        config = _ds.ds_config(3, world_size=world_size, bucket=BUCKET["mlp"], flatgrad={"reduction": mode})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine, *_ = flatgrad_ds.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        loss = engine(*_batch(model, rank))
        with CollectiveRecorder(_TRACED) as tracer:
            engine.backward(loss)
        engine.destroy()
        grads = {"reduce_scatter": "reduce_scatter", "grad_all_to_all": "all_to_all", "all_to_all": "all_to_all"}
        out[mode] = [(grads[c.op], c.numel, c.dtype, c.group) for c in tracer.calls if c.op in grads]
    return out


@pytest.mark.timeout(300)
def test_zero3_plan_of_every_mode_equals_the_counted_calls_and_bytes() -> None:
    """The planner prices ZeRO-3 under every registered mode: its calls, element counts (wire bytes for the
    quantized stages), dtypes and groups equal the ones a real flatgrad ZeRO-3 backward issues, per rank."""
    from flatgrad.planner.cost import MODES

    spec = models.load(CASE_MODELS["mlp"][0], zero3=True, **CASE_MODELS["mlp"][1])
    for rank, counted in enumerate(_ds.launch(_zero3_modes_rank, 4, MODES, timeout=280)):
        for mode in MODES:
            plan = flatgrad_zero3(spec, 4, bucket_numel=BUCKET["mlp"], rank=rank, reduction=mode, gpus_per_node=2)
            planned = [(c.op, c.numel, str(c.dtype).replace("torch.", ""), tuple(c.group)) for c in plan.calls]
            assert counted[mode], (mode, rank)
            assert sorted(counted[mode]) == sorted(planned), f"{mode} rank {rank}:\ncounted {counted[mode]}\nplanned {planned}"
