"""Two-stage reductions: the node/rail placement, the pack's segment order, and the modes on real gloo ranks.

The nodes are simulated: ``node_size`` splits the ranks of one machine into groups of L,
and the node and rail groups are real process groups over gloo.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flatgrad import kernels
from flatgrad.layout import Layout
from flatgrad.reducer import BucketReducer, LayoutMismatchError, plan_topology, two_stage_positions
from flatgrad.testing.launch import run_ranks

NUMELS = (1031, 37, 4099, 5)  # odd sizes: tensors straddle segments


# ------------------------------------------------------------------ placement and layout (one process)


def test_positions_put_every_segment_where_the_two_stages_leave_it():
    for nodes, local in ((2, 2), (2, 3), (3, 2), (4, 2), (2, 4)):
        positions = two_stage_positions(nodes, local)
        assert sorted(positions) == list(range(nodes * local))
        for n in range(nodes):
            for l in range(local):
                # node stage: local rank l keeps chunk l of L (N segments); rail stage: node n keeps chunk n of that
                assert positions[n * local + l] // nodes == l and positions[n * local + l] % nodes == n


def test_plan_topology_groups_and_subgroups(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    t = plan_topology(2, list(range(6)), 6, 3)
    assert (t.num_nodes, t.local_size, t.node, t.local) == (3, 2, 1, 1)
    assert t.node_ranks == (2, 3) and t.rail_ranks == (1, 3, 5)
    assert t.positions == two_stage_positions(3, 2)
    # an expert-data-parallel group: members 0, 2, 4, 6 of 8 ranks on nodes of 4 -> 2 nodes of 2 members
    t = plan_topology(4, [0, 2, 4, 6], 8, 2)
    assert (t.num_nodes, t.local_size, t.node, t.local, t.node_ranks, t.rail_ranks) == (2, 2, 1, 0, (4, 6), (0, 4))
    assert plan_topology(None, list(range(4)), 4, 0).num_nodes == 1  # no LOCAL_WORLD_SIZE: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert plan_topology(None, list(range(4)), 4, 0).num_nodes == 2


def test_plan_topology_refuses_bad_node_sizes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="node_size must be an int"):
            plan_topology(bad, list(range(4)), 4, 0)
    with pytest.raises(ValueError, match="node_size = 3 does not divide the world size 4"):
        plan_topology(3, list(range(4)), 4, 0)
    with pytest.raises(ValueError, match="members per node differ"):
        plan_topology(2, [0, 1, 2], 4, 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="differs from the launcher's LOCAL_WORLD_SIZE = 4"):
        plan_topology(2, list(range(8)), 8, 0)


@settings(max_examples=40, deadline=None)
@given(
    numels=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    shape=st.sampled_from([(2, 2), (2, 3), (3, 2), (4, 2), (1, 3)]),
    kind=st.sampled_from(["flat", "chunked"]),
    align=st.sampled_from([1, 4]),
    backend=st.sampled_from(["cpu", "torch"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_reordered_pack_writes_each_segment_at_its_position(numels, shape, kind, align, backend, dtype):
    nodes, local = shape
    layout = Layout.make(kind, numels, nodes * local, align)
    ordered = layout.reordered(two_stage_positions(nodes, local))
    gen = torch.Generator().manual_seed(sum(numels))
    tensors = [torch.randn(n, generator=gen) if n % 3 else None for n in numels]
    plain = kernels.pack(tensors, layout, torch.full((layout.numel,), 7.0, dtype=dtype), backend=backend, scale=0.5)
    got = torch.full((layout.numel,), 7.0, dtype=dtype)
    kernels.PackPlan(ordered, tensors, dtype=dtype, backend=backend, device="cpu")(tensors, got, scale=0.5)
    s = layout.shard_numel
    for r in range(layout.world_size):
        p = ordered.position(r)
        assert torch.equal(got[p * s : (p + 1) * s], plain[r * s : (r + 1) * s]), (r, p)
    runs = ordered.pack_runs()
    if runs.numel():
        assert torch.equal(runs[1:, 0], (runs[:, 0] + runs[:, 3])[:-1])  # still tiles the buffer in order
    assert ordered != layout and ordered.digest() != layout.digest() or ordered.positions == ()
    assert ordered.pieces(0) == layout.pieces(0)


def test_reordered_refuses_what_is_not_a_permutation():
    layout = Layout.flat([10], 4)
    with pytest.raises(ValueError, match="one entry per rank"):
        layout.reordered((0, 1, 2))
    with pytest.raises(ValueError, match="permutation"):
        layout.reordered((0, 1, 1, 2))


# ------------------------------------------------------------------ the modes on real ranks


def _grads(rank: int, step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at micro-step ``step``: a wide dynamic range, representable in ``dtype``."""
    gen = torch.Generator().manual_seed(7919 * rank + step)
    return [(torch.randn(n, generator=gen) * torch.rand(n, generator=gen).mul(8).exp2()).to(dtype).float() for n in NUMELS]


def _reduce(reduction: str, node_size: int, comm_dtype: torch.dtype, rank: int, steps: int, **options) -> BucketReducer:
    params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
    reducer = BucketReducer(
        [params[:2], params[2:]], comm_dtype=comm_dtype, reduction=reduction, node_size=node_size,
        register_hooks=False, **options,
    )  # fmt: skip
    for step in range(steps):
        for p, g in zip(params, _grads(rank, step, comm_dtype)):
            p.grad = g
        for p in reversed(params):
            reducer.mark_ready(p)
        reducer.finish()
    return reducer


def _truth(reducer: BucketReducer, world_size: int, steps: int, comm_dtype: torch.dtype) -> tuple[list, list]:
    """This rank's shards of the fp64 average (summed over micro-steps), and of the average of |grad|."""
    total = [torch.zeros(n, dtype=torch.float64) for n in NUMELS]
    magnitude = [torch.zeros(n, dtype=torch.float64) for n in NUMELS]
    for r in range(world_size):
        for step in range(steps):
            for t, m, g in zip(total, magnitude, _grads(r, step, comm_dtype)):
                t += g.double()
                m += g.double().abs()
    out = []
    for full in (total, magnitude):
        shards, k = [], 0
        for gs in reducer.grad_shards():
            shard = torch.zeros(gs.layout.shard_numel, dtype=torch.float64)
            for piece in gs.pieces:
                src = full[k + piece.tensor_index] / world_size
                shard[piece.shard_offset : piece.shard_offset + piece.length] = src[piece.tensor_offset :][: piece.length]
            shards.append(shard)
            k += len(gs.params)
        out.append(shards)
    return out[0], out[1]


def _twod_rank(rank: int, world_size: int, node_size: int) -> list:
    """Per comm dtype and method: the 2d shards, the flat ones, the fp64 truth and |grad| scale."""
    out = []
    for comm_dtype in (torch.float32, torch.bfloat16):
        for method in ("list", "tensor"):
            twod = _reduce("2d_reduce_scatter", node_size, comm_dtype, rank, 2, method=method)
            flat = _reduce("reduce_scatter", node_size, comm_dtype, rank, 2, method=method)
            assert type(twod.mode).__name__ == "TwoStageReduceScatter"
            truth, magnitude = _truth(twod, world_size, 2, comm_dtype)
            got = [gs.shard.clone() for gs in twod.grad_shards()]
            ref = [gs.shard.clone() for gs in flat.grad_shards()]
            out.append((str(comm_dtype), method, got, ref, truth, magnitude))
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, node_size", [(6, 3), (8, 4)])
def test_2d_reduce_scatter_matches_flat_and_is_no_less_accurate(world_size, node_size):
    eps32 = torch.finfo(torch.float32).eps
    squared: dict = {}  # (dtype, method) -> [2d, flat] squared error of the whole gradient, every rank's shards
    for rank, per_config in enumerate(run_ranks(_twod_rank, world_size, node_size, timeout=220)):
        for dtype, method, got, ref, truth, magnitude in per_config:
            label = f"rank {rank} {dtype} {method}"
            total = squared.setdefault((dtype, method), [0.0, 0.0])
            total[0] += sum(float((g.double() - t).norm() ** 2) for g, t in zip(got, truth))
            total[1] += sum(float((r.double() - t).norm() ** 2) for r, t in zip(ref, truth))
            if dtype == str(torch.float32):
                for g, r, m in zip(got, ref, magnitude):
                    # Both sum 2 x W fp32 terms in some order: each is within (2W - 1) eps of the sum of |terms|.
                    bound = 2 * (2 * world_size - 1) * eps32 * m
                    assert bool(((g.double() - r.double()).abs() <= bound).all()), label
    for (dtype, method), (error_2d, error_flat) in squared.items():
        assert 0 < error_2d <= error_flat, (dtype, method, error_2d**0.5, error_flat**0.5)  # 0 <: rounding is there


def _divided_rank(rank: int, world_size: int, node_size: int) -> list:
    """ZeRO-3's buckets (chunked layout, stock's divide): two-stage and flat, fp32 and bf16 comm."""
    from flatgrad import comm
    from flatgrad.reducer import Bucket, ReduceScatter, TwoStageReduceScatter

    params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
    layout = Layout.chunked(list(NUMELS), world_size)
    topology = plan_topology(node_size, list(range(world_size)), world_size, rank)
    twod = TwoStageReduceScatter(topology)
    twod.connect()
    gen = torch.Generator().manual_seed(rank)
    # Multiples of W: each g / W is a small integer and every sum of them is exact in bf16, whatever the order.
    grads = [torch.randint(-20, 21, (n,), generator=gen).float() * world_size for n in NUMELS]
    out = []
    for comm_dtype in (torch.float32, torch.bfloat16):
        for mode in (twod, ReduceScatter()):
            b = Bucket(
                0, tuple(params), layout, rank, comm_dtype=comm_dtype, averaging=comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0),
                method="tensor", backend=None, mode=mode, prescale=1.0, postscale=1.0, streams=None, divide=True,
            )  # fmt: skip
            buffers = {"input": torch.empty(layout.numel, dtype=comm_dtype)}
            flight = b.reduce([g.to(torch.float32) for g in grads], None, None, buffers=buffers)
            flight.wait()
            shard = [torch.empty(p.length) for p in b.pieces]
            flight.unpack(shard, False, False)
            out.append((str(comm_dtype), mode.name, shard, [tuple(p) for p in b.pieces]))
    return [out, grads]


@pytest.mark.timeout(120)
def test_divided_pack_keeps_stocks_divide_around_the_two_stage_mode():
    world_size = 6  # not a power of two: stock divides the packed buffer, the pre-scale would not
    results = run_ranks(_divided_rank, world_size, 3, timeout=100)
    everyone = [grads for _, grads in results]
    for rank, (out, _) in enumerate(results):
        assert {name for _, name, _, _ in out} == {"2d_reduce_scatter", "reduce_scatter"}
        for dtype, name, shard, pieces in out:
            for got, (tensor_index, tensor_offset, _, length) in zip(shard, pieces):
                full = sum(g[tensor_index] for g in everyone) / world_size
                assert torch.equal(got, full[tensor_offset : tensor_offset + length]), (rank, dtype, name)


def _bad_node_size_rank(rank: int, world_size: int, case: str) -> str:
    node_size = {"no divide": 3, "differs": 2 if rank == 0 else 1, "launcher": 2}[case]
    if case == "launcher" and rank == 1:
        os.environ["LOCAL_WORLD_SIZE"] = "4"
    try:
        BucketReducer([[nn.Parameter(torch.zeros(8))]], reduction="2d_reduce_scatter", node_size=node_size, register_hooks=False)
    except (ValueError, LayoutMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["no divide", "differs", "launcher"])
def test_bad_node_size_raises_on_every_rank(case):
    messages = run_ranks(_bad_node_size_rank, 4, case, timeout=50)
    for rank, message in enumerate(messages):
        assert message != "no error", (rank, case)
        assert "node_size" in message, (rank, message)
    if case == "launcher":
        assert "LOCAL_WORLD_SIZE = 4" in messages[1] and "rank 1" in messages[0], messages


def _one_node_rank(rank: int, world_size: int, reduction: str, node_size: int, flat_mode: str) -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reducer = _reduce(reduction, node_size, torch.float32, rank, 1, block=64)
    flat = _reduce(flat_mode, node_size, torch.float32, rank, 1, block=64)
    same = all(torch.equal(a.shard, b.shard) for a, b in zip(reducer.grad_shards(), flat.grad_shards()))
    return reducer.mode.name, [str(w.message) for w in caught], same


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "reduction, node_size, flat_mode",
    [("2d_reduce_scatter", 4, "reduce_scatter"), ("2d_reduce_scatter", 1, "reduce_scatter"),
     ("hier_int8", 4, "reduce_scatter"), ("hier_fp8", 1, "fp8"), ("hier_exact", 4, "exact"),
     ("qgz_int8", 1, "int8")],
)  # fmt: skip
def test_one_stage_topologies_fall_back_to_the_flat_mode_with_a_warning(reduction, node_size, flat_mode):
    for name, messages, same in run_ranks(_one_node_rank, 4, reduction, node_size, flat_mode, timeout=50):
        assert name == flat_mode and same
        assert any("one stage only" in m and reduction in m for m in messages), messages


# ------------------------------------------------------------------ DeepSpeed ZeRO-2


def _zero2_rank(rank: int, world_size: int, root: str) -> dict:
    from _ds import as_nodes, ds_config, make_batches, params_of, train, train_save_resume

    as_nodes(rank, 2)
    batches = make_batches(rank, 16, 2, 13, 5)
    out: dict = {}
    for reduction in ("reduce_scatter", "2d_reduce_scatter", "hier_int8", "int8"):
        cfg = ds_config(2, gas=2, world_size=world_size, bucket=500, flatgrad={"reduction": reduction, "comm_dtype": "fp32"})
        engine, losses, continued, resumed = train_save_resume(cfg, batches, os.path.join(root, reduction))
        modes = {type(r.mode).__name__ for r in engine.optimizer.flatgrad.reducers}
        out[reduction] = {
            "modes": modes, "losses": losses + continued, "params": params_of(engine),
            "resumed_losses": train(resumed, batches[8:]), "resumed_params": params_of(resumed),
        }  # fmt: skip
    return out


@pytest.mark.timeout(300)
def test_deepspeed_zero2_two_stage_on_two_nodes_of_two_matches_flat_and_checkpoints_load(tmp_path):
    from _ds import launch

    for rank, out in enumerate(launch(_zero2_rank, 4, str(tmp_path), timeout=280)):
        flat, twod, hier = out["reduce_scatter"], out["2d_reduce_scatter"], out["hier_int8"]
        assert twod["modes"] == {"TwoStageReduceScatter"} and flat["modes"] == {"ReduceScatter"}, rank
        assert hier["modes"] == {"HierarchicalQuantized"}, rank
        assert len(twod["losses"]) == len(flat["losses"]) == len(hier["losses"]) == 16
        assert max(abs(a - b) for a, b in zip(twod["losses"], flat["losses"])) <= 1e-6, (rank, twod["losses"], flat["losses"])
        assert hier["losses"] != flat["losses"]  # it did quantize
        # The bound tests/test_deepspeed_zero2.py puts on the flat int8 wire; the flat int8 run is checked beside it.
        for quantized in (hier, out["int8"]):
            torch.testing.assert_close(quantized["losses"], flat["losses"], rtol=0.02, atol=0)
        for run in (flat, twod, hier, out["int8"]):
            assert run["resumed_losses"] == run["losses"][8:], rank  # the checkpoint resumes bitwise
            assert all(torch.equal(run["resumed_params"][n], p) for n, p in run["params"].items()), rank


def _zero3_rank(rank: int, world_size: int, root: str) -> dict:
    from _ds import as_nodes, ds_config, make_batches, train, train_save_resume, zero3_master

    as_nodes(rank, 2)
    batches = make_batches(rank, 16, 2, 13, 5)
    out: dict = {}
    runs = {"flat": ("reduce_scatter", "fp32"), "2d": ("2d_reduce_scatter", "fp32"),
            "flat_bf16": ("reduce_scatter", "bf16"), "2d_bf16": ("2d_reduce_scatter", "bf16")}  # fmt: skip
    for name, (reduction, comm_dtype) in runs.items():
        cfg = ds_config(3, gas=2, world_size=world_size, bucket=500, flatgrad={"reduction": reduction, "comm_dtype": comm_dtype})
        engine, losses, continued, resumed = train_save_resume(cfg, batches, os.path.join(root, name))
        reducer = engine.optimizer.flatgrad
        modes = {(type(c.bucket.mode).__name__, c.bucket.mode.name, c.bucket.divide) for c in reducer.compositions.values()}
        out[name] = {
            "modes": modes, "line": reducer.describe(), "losses": losses + continued,
            "master": zero3_master(engine, rank), "resumed_losses": train(resumed, batches[8:]),
            "resumed_master": zero3_master(resumed, rank),
        }  # fmt: skip
        engine.destroy()
        resumed.destroy()
    return out


@pytest.mark.timeout(400)
def test_deepspeed_zero3_two_stage_on_two_nodes_of_two_matches_flat_and_checkpoints_load(tmp_path):
    from _ds import launch

    for rank, out in enumerate(launch(_zero3_rank, 4, str(tmp_path), timeout=380)):
        flat, twod = out["flat"], out["2d"]
        # fp32 grads, fp32 comm, 4 ranks: stock's divide folds into the pack (a power of two, no cast).
        assert twod["modes"] == {("TwoStageReduceScatter", "2d_reduce_scatter", False)}, (rank, twod["modes"])
        assert flat["modes"] == {("ReduceScatter", "reduce_scatter", False)}, rank
        assert "in the node of 2 rank(s), then one over the rail of 2 node(s)" in twod["line"], twod["line"]
        assert len(twod["losses"]) == len(flat["losses"]) == 16
        assert max(abs(a - b) for a, b in zip(twod["losses"], flat["losses"])) <= 1e-6, (rank, twod["losses"], flat["losses"])
        # A cast to bf16 before the sum: stock's divide of the packed buffer, kept around the two-stage mode.
        assert out["2d_bf16"]["modes"] == {("TwoStageReduceScatter", "2d_reduce_scatter", True)}, rank
        assert out["flat_bf16"]["modes"] == {("ReduceScatter", "reduce_scatter", True)}, rank
        # The bf16 runs are not compared by value (the sums round in two orders and Adam carries that on); the
        # divide they share is checked exactly by test_divided_pack_keeps_stocks_divide_around_the_two_stage_mode.
        for run in out.values():
            assert run["resumed_losses"] == run["losses"][8:], rank  # the checkpoint resumes bitwise
            assert all(torch.equal(a, b) for a, b in zip(run["resumed_master"], run["master"])), rank


def _zero3_bad_rank(rank: int, world_size: int, case: str, reduction: str) -> str:
    from _ds import MLP, ds_config

    import flatgrad.deepspeed as fds

    os.environ.pop("LOCAL_WORLD_SIZE", None)
    node_size = {"no-divide": 3, "differs": 4 if rank == 0 else 2}[case]
    cfg = ds_config(3, world_size=world_size, flatgrad={"reduction": reduction, "node_size": node_size})
    try:
        fds.initialize(model=MLP(), config=cfg)
    except fds.UnsupportedConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("reduction", ["2d_reduce_scatter", "qgz_int8"])
@pytest.mark.parametrize("case", ["no-divide", "differs"])
def test_deepspeed_zero3_bad_node_size_raises_on_every_rank(case, reduction):
    from _ds import launch

    for rank, message in enumerate(launch(_zero3_bad_rank, 4, case, reduction, timeout=180)):
        assert "node_size" in message and f"this is rank {rank}" in message, (rank, message)
        assert f"'flatgrad.reduction' = {reduction!r}" in message, message
        if case == "no-divide":
            assert "does not divide the world size 4" in message, message


# ------------------------------------------------------------------ hier_int8 / hier_fp8


def _hier_expected(reducer, everyone, rank, world_size, comm_dtype, block, kind, residuals, shards) -> None:
    """Every rank's pack, node sum (two ranks: one addition, order-free), quantize and rail exchange, replayed."""
    from flatgrad.kernels import reference, wire_reference

    t = reducer.topology
    n_nodes, local = t.num_nodes, t.local_size
    me_node, me_local = divmod(rank, local)
    for b, layout in enumerate(reducer.layouts):
        s = layout.shard_numel
        packed = []
        for r in range(world_size):
            buf = torch.empty(layout.numel, dtype=comm_dtype)
            reference.pack(everyone[r][b], layout, buf, 1.0)
            packed.append(buf)
        segments = []
        for n in range(n_nodes):  # the rail peer on node n: its node chunk holds the segments of ranks (m, me_local)
            stage = torch.cat([
                sum(packed[n * local + l][(m * local + me_local) * s :][:s].float() for l in range(local)).to(comm_dtype)
                for m in range(n_nodes)
            ])  # fmt: skip
            w = torch.zeros(n_nodes * wire_reference.segment_bytes(s, block), dtype=torch.uint8)
            wire_reference.quantize(stage, n_nodes, block, kind, w, residuals[n][b])
            seg = wire_reference.segment_bytes(s, block)
            segments.append(w[me_node * seg : (me_node + 1) * seg])
        accumulate = shards[b] is not None
        if shards[b] is None:
            shards[b] = torch.empty(s)
        wire_reference.dequantize_sum(torch.cat(segments), n_nodes, block, kind, shards[b], 1.0 / world_size, accumulate)


def _hier_rank(rank: int, world_size: int) -> list:
    out = []
    block = 64
    for reduction, feedback, comm_dtype in (
        ("hier_int8", False, torch.float32), ("hier_int8", True, torch.bfloat16), ("hier_fp8", True, torch.float32),
    ):  # fmt: skip
        params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
        reducer = BucketReducer(
            [params[:2], params[2:]], comm_dtype=comm_dtype, reduction=reduction, node_size=2, block=block,
            error_feedback=feedback, register_hooks=False,
        )  # fmt: skip
        assert type(reducer.mode).__name__ == "HierarchicalQuantized"
        assert (reducer.residual_bytes > 0) == feedback
        n_nodes = reducer.topology.num_nodes
        residuals = [[torch.zeros(n_nodes * lay.shard_numel) if feedback else None for lay in reducer.layouts] for _ in range(n_nodes)]
        shards: list = [None] * len(reducer.layouts)
        for step in range(3):  # one window of 2 micro-steps, then a window of 1
            grads = _grads(rank, step, comm_dtype)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            for p in reversed(params):
                reducer.mark_ready(p)
            reducer.finish()
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, [grads[:2], grads[2:]])
            _hier_expected(reducer, everyone, rank, world_size, comm_dtype, block, reduction.removeprefix("hier_"), residuals, shards)
            if step != 0:
                out.append((f"{reduction} feedback={feedback} {comm_dtype} step {step}", [gs.shard.clone() for gs in reducer.grad_shards()], [x.clone() for x in shards]))
                reducer.zero_grad()
                shards = [None] * len(shards)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [4, 6])
def test_hier_quantized_bitwise_equal_reference(world_size):
    for rank, per_mode in enumerate(run_ranks(_hier_rank, world_size, timeout=180)):
        for label, got, expected in per_mode:
            for b, (g, e) in enumerate(zip(got, expected)):
                assert torch.equal(g, e), f"rank {rank} bucket {b} {label}: max diff {(g - e).abs().max()}"


# ------------------------------------------------------------------ the bench's counts and the plan


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, node_size", [(4, 2), (8, 4), (8, 2)])
def test_bench_counts_equal_the_plan_and_hier_int8_halves_the_cross_node_bytes(world_size, node_size):
    from flatgrad.bench.hierarchical import measure

    rows = {r["mode"]: r for r in measure(world_size, node_size, timeout=200)}
    for mode, r in rows.items():
        assert r["plan_match"], mode
        assert r["cross_node_bytes"] == pytest.approx(r["plan_cross_node_bytes"], rel=1e-12), mode
    twod, hier = rows["2d_reduce_scatter"], rows["hier_int8"]
    assert set(twod["stages"]) == set(hier["stages"]) == {"node", "rail"}
    assert twod["stages"]["node"]["calls"] == twod["stages"]["rail"]["calls"] == rows["reduce_scatter"]["stages"]["flat"]["calls"]
    assert 0 < hier["cross_node_bytes"] <= 0.55 * twod["cross_node_bytes"]
    assert twod["cross_node_bytes"] < rows["reduce_scatter"]["cross_node_bytes"]
    assert twod["overlapped"] and hier["overlapped"]  # a node stage went out before an earlier rail stage


# ------------------------------------------------------------------ hier_exact


def _hier_exact_expected(reducer, everyone, rank, world_size, comm_dtype, shards) -> None:
    """The fixed-order fp32 sums replayed from every rank's gradients: a function of the inputs alone."""
    from flatgrad.kernels import reference, wire_reference

    t = reducer.topology
    n_nodes, local = t.num_nodes, t.local_size
    me_node, me_local = divmod(rank, local)
    for b, layout in enumerate(reducer.layouts):
        s = layout.shard_numel
        packed = []
        for r in range(world_size):
            buf = torch.empty(layout.numel, dtype=comm_dtype)
            reference.pack(everyone[r][b], layout, buf, 1.0)
            packed.append(buf)
        partials = []
        for n in range(n_nodes):  # the rail peer on node n sums its node's L chunks for this rank's segment
            sources = torch.cat([packed[n * local + l][(me_node * local + me_local) * s :][:s] for l in range(local)])
            partial = torch.empty(s)
            wire_reference.sum_sources(sources, local, partial, 1.0, False)
            partials.append(partial)
        accumulate = shards[b] is not None
        if shards[b] is None:
            shards[b] = torch.empty(s)
        wire_reference.sum_sources(torch.cat(partials), n_nodes, shards[b], 1.0 / world_size, accumulate)


def _hier_exact_rank(rank: int, world_size: int, node_size: int) -> list:
    out = []
    for comm_dtype in (torch.float32, torch.bfloat16):
        runs = []
        for _ in range(2):  # run to run
            reducer = _reduce("hier_exact", node_size, comm_dtype, rank, 2)
            assert type(reducer.mode).__name__ == "HierarchicalExact"
            runs.append([gs.shard.clone() for gs in reducer.grad_shards()])
        shards: list = [None] * len(reducer.layouts)
        for step in range(2):
            everyone = [[g[:2], g[2:]] for g in (_grads(r, step, comm_dtype) for r in range(world_size))]
            _hier_exact_expected(reducer, everyone, rank, world_size, comm_dtype, shards)
        truth, _ = _truth(reducer, world_size, 2, comm_dtype)
        flat = _reduce("reduce_scatter", node_size, comm_dtype, rank, 2)
        out.append((str(comm_dtype), runs, shards, truth, [gs.shard.clone() for gs in flat.grad_shards()]))
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size, node_size", [(6, 3), (8, 4)])
def test_hier_exact_is_a_fixed_function_of_the_gradients(world_size, node_size):
    squared: dict = {}
    for rank, per_dtype in enumerate(run_ranks(_hier_exact_rank, world_size, node_size, timeout=180)):
        for dtype, (first, second), expected, truth, flat in per_dtype:
            for b, (g, h, e) in enumerate(zip(first, second, expected)):
                assert torch.equal(g, h), f"rank {rank} bucket {b} {dtype}: differs run to run"
                assert torch.equal(g, e), f"rank {rank} bucket {b} {dtype}: max diff {(g - e).abs().max()}"
            total = squared.setdefault(dtype, [0.0, 0.0])
            total[0] += sum(float((g.double() - t).norm() ** 2) for g, t in zip(first, truth))
            total[1] += sum(float((f.double() - t).norm() ** 2) for f, t in zip(flat, truth))
    # bf16: fp32 sums instead of bf16 hops are more accurate than the flat reduce_scatter. (fp32 is not claimed:
    # the 1/W is an fp32 multiply by a rounded 1/W, one rounding more than gloo's AVG division when W is not a
    # power of two; at W = 6 the error is 1.05x the flat one's.)
    exact, flat = squared[str(torch.bfloat16)]
    assert exact < flat, (exact**0.5, flat**0.5)


def test_flatgrad_config_takes_node_size_and_the_two_stage_reductions():
    from flatgrad.integrations.deepspeed.config import FlatgradConfig, UnsupportedConfigError
    from flatgrad.reducer import ReducerConfig

    for reduction in ("2d_reduce_scatter", "hier_int8", "hier_fp8", "hier_exact"):
        assert FlatgradConfig.from_dict({"reduction": reduction, "node_size": 8}).node_size == 8
        assert ReducerConfig(reduction=reduction, node_size=8).node_size == 8
    assert FlatgradConfig.from_dict({"reduction": "hier_int8", "error_feedback": True}).error_feedback
    for bad in (0, -2, 1.5, True, "8"):
        with pytest.raises(UnsupportedConfigError, match="'flatgrad.node_size' must be a positive int"):
            FlatgradConfig.from_dict({"node_size": bad})
        with pytest.raises(ValueError, match="node_size must be an int >= 1"):
            ReducerConfig(node_size=bad)
    with pytest.raises(UnsupportedConfigError, match="'flatgrad.error_feedback' needs"):
        FlatgradConfig.from_dict({"reduction": "2d_reduce_scatter", "error_feedback": True})
    with pytest.raises(ValueError, match="error_feedback needs a quantized reduction"):
        ReducerConfig(reduction="hier_exact", error_feedback=True)


# ------------------------------------------------------------------ qgz_int8 / qgz_fp8


def _qgz_expected(reducer, everyone, rank, world_size, comm_dtype, block, kind, residuals, shards) -> None:
    """Every rank's pack, node quantize, node dequantize-sum, requantize and rail exchange, replayed."""
    from flatgrad.kernels import reference, wire_reference

    t = reducer.topology
    n_nodes, local = t.num_nodes, t.local_size
    me_node, me_local = divmod(rank, local)
    for b, layout in enumerate(reducer.layouts):
        s, part = layout.shard_numel, n_nodes * layout.shard_numel
        ordered = layout.reordered(t.positions)
        node_seg, rail_seg = wire_reference.segment_bytes(part, block), wire_reference.segment_bytes(s, block)
        rail_segments = []
        for n in range(n_nodes):  # the rail peer on node n: its node partial, requantized, segment me_node
            node_segments = []
            for l in range(local):
                r = n * local + l
                packed = torch.empty(layout.numel, dtype=comm_dtype)
                reference.pack(everyone[r][b], ordered, packed, 1.0)
                w = torch.zeros(local * node_seg, dtype=torch.uint8)
                first = None if residuals is None else residuals["node"][r][b]
                wire_reference.quantize(packed, local, block, kind, w, first)
                node_segments.append(w[me_local * node_seg : (me_local + 1) * node_seg])
            partial = torch.empty(part)
            wire_reference.dequantize_sum(torch.cat(node_segments), local, block, kind, partial, 1.0, False)
            w = torch.zeros(n_nodes * rail_seg, dtype=torch.uint8)
            second = None if residuals is None else residuals["rail"][n][b]
            wire_reference.quantize(partial, n_nodes, block, kind, w, second)
            rail_segments.append(w[me_node * rail_seg : (me_node + 1) * rail_seg])
        accumulate = shards[b] is not None
        if shards[b] is None:
            shards[b] = torch.empty(s)
        wire_reference.dequantize_sum(torch.cat(rail_segments), n_nodes, block, kind, shards[b], 1.0 / world_size, accumulate)


def _qgz_rank(rank: int, world_size: int) -> list:
    out = []
    block = 64
    for reduction, feedback, comm_dtype in (
        ("qgz_int8", False, torch.float32), ("qgz_int8", True, torch.bfloat16), ("qgz_fp8", True, torch.float32),
    ):  # fmt: skip
        params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
        reducer = BucketReducer(
            [params[:2], params[2:]], comm_dtype=comm_dtype, reduction=reduction, node_size=2, block=block,
            error_feedback=feedback, register_hooks=False,
        )  # fmt: skip
        assert type(reducer.mode).__name__ == "QuantizedTwoStage"
        n_nodes = reducer.topology.num_nodes
        residuals = None
        if feedback:
            residuals = {
                "node": [[torch.zeros(lay.numel) for lay in reducer.layouts] for _ in range(world_size)],
                "rail": [[torch.zeros(n_nodes * lay.shard_numel) for lay in reducer.layouts] for _ in range(n_nodes)],
            }
        shards: list = [None] * len(reducer.layouts)
        for step in range(3):  # a window of 2 micro-steps, then one of 1
            grads = _grads(rank, step, comm_dtype)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            for p in reversed(params):
                reducer.mark_ready(p)
            reducer.finish()
            everyone: list = [None] * world_size
            dist.all_gather_object(everyone, [grads[:2], grads[2:]])
            kind = reduction.removeprefix("qgz_")
            _qgz_expected(reducer, everyone, rank, world_size, comm_dtype, block, kind, residuals, shards)
            if step != 0:
                got = [gs.shard.clone() for gs in reducer.grad_shards()]
                out.append((f"{reduction} feedback={feedback} {comm_dtype} step {step}", got, [x.clone() for x in shards]))
                reducer.zero_grad()
                shards = [None] * len(shards)
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [4, 6])
def test_qgz_bitwise_equal_reference(world_size):
    for rank, per_mode in enumerate(run_ranks(_qgz_rank, world_size, timeout=180)):
        for label, got, expected in per_mode:
            for b, (g, e) in enumerate(zip(got, expected)):
                assert torch.equal(g, e), f"rank {rank} bucket {b} {label}: max diff {(g - e).abs().max()}"


# ------------------------------------------------------------------ a strided subgroup (MoE's expert data parallelism)


@contextlib.contextmanager
def _new_groups():
    """Record the ranks of every ``torch.distributed.new_group`` this process makes (the real call runs)."""
    made: list[tuple[int, ...]] = []
    real = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        made.append(tuple(ranks) if ranks is not None else ())
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    try:
        yield made
    finally:
        dist.new_group = real


def _world_groups_rank(rank: int, world_size: int) -> list:
    """4 ranks as 2 nodes x 2: a reducer of every two-stage mode, each making its node and rail groups."""
    os.environ.update(LOCAL_WORLD_SIZE="2", LOCAL_RANK=str(rank % 2))
    with _new_groups() as made:
        for reduction in ("2d_reduce_scatter", "hier_int8", "hier_exact", "qgz_int8"):
            params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
            BucketReducer([params[:2], params[2:]], reduction=reduction, register_hooks=False)
    return made


@pytest.mark.timeout(120)
def test_every_rank_makes_the_same_groups_in_the_same_order():
    """Every rank enters every node and rail group's creation, in one order: what NCCL's communicator split
    needs where DeepSpeed binds the default group to a device (see [Note: two-stage reductions])."""
    made = run_ranks(_world_groups_rank, 4, timeout=100)
    expected = [(0, 1), (2, 3), (0, 2), (1, 3)] * 4
    for rank, calls in enumerate(made):
        assert calls == expected, (rank, calls)


def _subgroup_rank(rank: int, world_size: int) -> dict:
    """8 ranks on nodes of 4; the even and the odd ranks each reduce over their own group (2 nodes x 2 members)."""
    os.environ.update(LOCAL_WORLD_SIZE="4", LOCAL_RANK=str(rank % 4))
    groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]  # every rank makes both, in one order
    group = groups[rank % 2]
    out = {"made": []}
    for reduction in ("reduce_scatter", "2d_reduce_scatter"):
        params = [nn.Parameter(torch.zeros(n)) for n in NUMELS]
        with _new_groups() as made:
            reducer = BucketReducer([params[:2], params[2:]], process_group=group, reduction=reduction,
                                    register_hooks=False)  # fmt: skip
        out["made"] += made
        gen = torch.Generator().manual_seed(rank)
        for p in params:  # small integers: every sum is exact, whatever its order
            p.grad = torch.randint(-8, 9, (p.numel(),), generator=gen).float()
        for p in reversed(params):
            reducer.mark_ready(p)
        reducer.finish()
        out[reduction] = ([gs.shard.clone() for gs in reducer.grad_shards()], reducer.topology)
    return out


@pytest.mark.timeout(120)
def test_2d_reduce_scatter_over_a_strided_subgroup_places_its_members_by_node():
    for rank, out in enumerate(run_ranks(_subgroup_rank, 8, timeout=100)):
        (flat, _), (twod, topology) = out["reduce_scatter"], out["2d_reduce_scatter"]
        assert (topology.num_nodes, topology.local_size) == (2, 2), rank
        # Every member of a parent makes all of its node groups, then all of its rail groups.
        parent = list(range(rank % 2, 8, 2))
        assert out["made"] == [tuple(parent[:2]), tuple(parent[2:]), (parent[0], parent[2]), (parent[1], parent[3])]
        assert topology.node_ranks == tuple(r for r in range(rank % 2, 8, 2) if r // 4 == rank // 4), rank
        assert topology.rail_ranks == (rank % 4, rank % 4 + 4), rank
        for b, (a, c) in enumerate(zip(twod, flat)):
            assert torch.equal(a, c), (rank, b)
