"""flatgrad's DeepSpeed ZeRO-1/2 backend against stock DeepSpeed: real DeepSpeed, CPU accelerator, gloo ranks.

Every multi-rank test trains stock and flatgrad engines from the same seed in
the same rank processes and compares them; see ``tests/_ds.py`` for the
launcher, models and configs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import types

import pytest
import torch
from _ds import (
    MLP, REDUCTIONS, PartitionReads, SeedMoE, count_collectives, ds_config, launch, make_batches, params_of, train,
)
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.multiproc

D_IN, D_OUT = 13, 5


def _initializers():
    import deepspeed

    import flatgrad.deepspeed as fds

    return {"stock": deepspeed.initialize, "flatgrad": fds.initialize}


def _engine(kind: str, cfg: dict, model: torch.nn.Module | None = None, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    model = model if model is not None else MLP()
    engine, *_ = _initializers()[kind](model=model, model_parameters=list(model.parameters()), config=cfg, **kwargs)
    return engine


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor ``max|a - b| / max|a|`` over the named tensors."""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-30)).item() for k in a)


def _losses_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in zip(a, b))


# --------------------------------------------------------------------------- sub-group splitting (no ranks)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 40), min_size=1, max_size=14),
    bucket=st.integers(1, 60),
    frozen=st.sets(st.integers(0, 13)),
    groups=st.integers(1, 3),
)
def test_split_param_groups_backward_order_and_sizes(numels, bucket, frozen, groups):
    from flatgrad.integrations.deepspeed.zero2 import split_param_groups

    params = [torch.nn.Parameter(torch.zeros(n), requires_grad=i not in frozen) for i, n in enumerate(numels)]
    order = {p: i for i, p in enumerate(params)}
    param_groups = [
        {"params": params[g::groups], "lr": 0.1 * (g + 1), "name": f"g{g}", "moe": g == 1} for g in range(groups)
    ]
    param_groups = [g for g in param_groups if g["params"]]
    subs = split_param_groups(param_groups, order, bucket)
    k = 0
    for g in param_groups:
        trainable = [p for p in g["params"] if p.requires_grad and p.numel() > 0]
        mine = []
        previous = None
        while k < len(subs) and subs[k]["name"] == g["name"]:
            sub = subs[k]
            if previous is not None:  # a sub-group closes only when at least half full and the next param overflows it
                closed = sum(p.numel() for p in previous)
                assert 2 * closed >= bucket and closed + sub["params"][0].numel() > bucket
            previous = sub["params"]
            assert {key: v for key, v in sub.items() if key != "params"} == {
                key: v for key, v in g.items() if key != "params"
            }
            size = sum(p.numel() for p in sub["params"])
            assert sub["params"] and (size <= bucket or 2 * (size - sub["params"][-1].numel()) < bucket)
            mine += sub["params"]
            k += 1
        # Backward order (reverse registration), every trainable param exactly once, nothing else.
        assert [id(p) for p in mine] == [id(p) for p in sorted(trainable, key=lambda p: -order[p])]
    assert k == len(subs)


def test_split_param_groups_puts_unregistered_params_last():
    from flatgrad.integrations.deepspeed.zero2 import split_param_groups

    registered = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    stray = torch.nn.Parameter(torch.zeros(2))
    subs = split_param_groups([{"params": [stray, *registered]}], {p: i for i, p in enumerate(registered)}, 100)
    assert [id(p) for p in subs[0]["params"]] == [id(p) for p in (*registered[::-1], stray)]


def test_split_param_groups_rejects_bad_bucket():
    from flatgrad.integrations.deepspeed.zero2 import split_param_groups

    with pytest.raises(ValueError, match="bucket_numel"):
        split_param_groups([{"params": [torch.nn.Parameter(torch.zeros(3))]}], {}, 0)


# --------------------------------------------------------------------------- the clipping norm's plan (no ranks)


@settings(max_examples=80, deadline=None)
@given(
    numels=st.lists(st.integers(0, 30), min_size=1, max_size=10),
    bucket=st.integers(1, 50),
    world_size=st.integers(1, 5),
    groups=st.integers(1, 2),
)
def test_stock_norm_sums_every_element_once_into_its_stock_rank(numels, bucket, world_size, groups):
    """Over all ranks, ``StockNorm.partial_sums`` of flatgrad's sub-group partitions add up to the squared norm of
    each of stock's per-rank partitions of each unsplit group, within fp64 rounding (a norm squared, as stock
    squares its per-piece norms); ranks without elements add zeros."""
    from flatgrad.integrations.deepspeed.zero2.stock_norm import StockNorm
    from flatgrad.integrations.deepspeed.zero2 import split_param_groups
    from flatgrad.layout import Layout

    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    grads = {id(p): torch.arange(1, p.numel() + 1, dtype=torch.float32) * (k + 1) for k, p in enumerate(params)}
    order = {p: i for i, p in enumerate(params)}
    unsplit = [[p for p in params[g::groups] if p.numel() > 0] for g in range(groups)]
    unsplit = [ps for ps in unsplit if ps]
    if not unsplit:
        return
    subs = [sub["params"] for sub in split_param_groups([{"params": ps} for ps in unsplit], order, bucket)]
    layouts = [Layout.flat([p.numel() for p in ps], world_size, 2) for ps in subs]
    total = torch.zeros(len(unsplit) * world_size, dtype=torch.float64)
    for rank in range(world_size):
        plan = StockNorm(unsplit, subs, layouts, rank, world_size, 2, torch.device("cpu"))
        partitions = []
        for ps, layout in zip(subs, layouts):
            flat = torch.zeros(layout.numel)
            for p, offset in zip(ps, layout.offsets):
                flat[offset : offset + p.numel()] = grads[id(p)]
            partitions.append(flat.narrow(0, rank * layout.shard_numel, layout.shard_numel))
        total += plan.partial_sums(partitions)
        assert plan.metadata_bytes() == 8 * len(plan.segments)
    expected = []
    for ps in unsplit:
        stock = Layout.flat([p.numel() for p in ps], world_size, 2)
        flat = torch.zeros(stock.numel, dtype=torch.float64)
        for p, offset in zip(ps, stock.offsets):
            flat[offset : offset + p.numel()] = grads[id(p)].double()
        expected += [float(chunk.pow(2).sum()) for chunk in flat.split(stock.shard_numel)]
    assert torch.allclose(total, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0), (total, expected)


# --------------------------------------------------------------------------- fp32 equivalence


def _equivalence_rank(rank, world_size, cases):
    out = []
    for case in cases:
        stage, clip, gas, *extra = case
        zero, top = (extra + [{}, {}])[:2]
        batches = make_batches(rank, 10 * gas, 2, D_IN, D_OUT)
        result = {}
        for kind in ("stock", "flatgrad"):
            cfg = ds_config(stage, gas=gas, world_size=world_size, bucket=500, clip=clip, **zero)
            cfg.update(top)
            engine = _engine(kind, cfg)
            counter = count_collectives()  # backward passes only
            if top.get("managed_gradient_accumulation") is False:
                losses = []  # the caller owns the boundary: gas backwards, then one step()
                for k, (x, y) in enumerate(batches):
                    loss = engine(x, y)
                    with counter:
                        engine.backward(loss)
                    losses.append(float(loss.detach()))
                    if (k + 1) % gas == 0:
                        engine.step()
            else:
                losses = train(engine, batches, backward_counter=counter)
            reduction = getattr(engine.optimizer, "flatgrad", None)
            used = {
                "reductions": reduction.reductions if reduction is not None else 0,
                "reduce_scatters": counter.count("reduce_scatter"),
                "gradient_collectives": sum(
                    1 for name in ("all_reduce", "reduce") for n, _ in counter.buffers().get(name, []) if n > 1
                ),
            }
            result[kind] = (losses, params_of(engine), len(engine.optimizer.bit16_groups), used)
        out.append(result)
    return out


# Stage, clipping, accumulation steps, extra zero_optimization keys, extra top-level keys.
_BITWISE_CASES = [
    (2, 0.0, 2),
    (1, 0.0, 2),
    (2, 0.0, 2, {"overlap_comm": True}),
    (1, 0.0, 2, {"overlap_comm": True}),
    (2, 0.0, 2, {"round_robin_gradients": True}),
    (2, 0.0, 2, {"reduce_scatter": False}, {"gradient_predivide_factor": 4.0}),
    (2, 0.0, 2, {}, {"managed_gradient_accumulation": False}),
    (2, 0.05, 2),
    (1, 0.05, 2),
    (2, 0.05, 2, {"round_robin_gradients": True}),
]


@pytest.mark.timeout(150)
def test_fp32_bitwise_equal_to_stock_on_two_ranks():
    """ZeRO-2 and ZeRO-1 (and their options), 10 steps, accumulation 2, with and without clipping: losses and
    parameters bitwise."""
    results = launch(_equivalence_rank, 2, _BITWISE_CASES)
    for rank_results in results:
        for case, r in zip(_BITWISE_CASES, rank_results):
            (s_loss, s_par, s_groups, s_used), (f_loss, f_par, f_groups, f_used) = r["stock"], r["flatgrad"]
            assert s_groups == 1 and f_groups > 1, case  # flatgrad really split the group
            # ... and reduced: one finish per backward (ZeRO-1: per boundary), one reduce_scatter per
            # sub-group each time, no gradient all_reduce or reduce (stock issues those).
            finishes = 10 if case[0] == 1 else 10 * case[2]
            assert f_used["reductions"] == finishes, (case, f_used)
            assert f_used["reduce_scatters"] == finishes * f_groups, (case, f_used)
            assert f_used["gradient_collectives"] == 0 and s_used["gradient_collectives"] > 0, (case, f_used, s_used)
            assert f_loss == s_loss, case
            for name in s_par:
                assert torch.equal(f_par[name], s_par[name]), (case, name)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "world_size,cases",
    [(4, [(2, 0.0, 2), (2, 0.05, 2), (1, 0.05, 2)])],
    ids=["4ranks"],
)
def test_fp32_close_to_stock_with_clipping_and_on_four_ranks(world_size, cases):
    """4 ranks, with and without clipping: gloo adds 4 ranks' gradients in another order in stock's all_reduce
    than in flatgrad's reduce_scatter (see test_above_two_ranks_...): within 1e-6."""
    for rank_results in launch(_equivalence_rank, world_size, cases, timeout=180):
        for (stage, clip, _), r in zip(cases, rank_results):
            (s_loss, s_par, *_), (f_loss, f_par, *_) = r["stock"], r["flatgrad"]
            assert _losses_rel(s_loss, f_loss) <= 1e-6, (stage, clip)
            assert _max_rel(s_par, f_par) <= 1e-6, (stage, clip)


# --------------------------------------------------------------------------- optimizer x accumulation x frozen matrix


class _ResidualStack(torch.nn.Module):
    """An embedding, pre-LayerNorm residual MLP blocks, a never-called ``Linear``, an optional frozen
    ``Linear`` applied as ``x + frozen(x)``, and an untied head: a small transformer's parameter shapes."""

    def __init__(self, vocab: int = 48, d: int = 32, hidden: int = 96, blocks: int = 3, frozen: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, d))
            for _ in range(blocks)
        )  # fmt: skip
        self.unused = torch.nn.Linear(d, 7)
        self.frozen = torch.nn.Linear(d, d) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        if self.frozen is not None:
            x = x + self.frozen(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


_MATRIX_BUCKETS = {5: 6250, 1: 10**8}  # reduce_bucket_size -> that many sub-groups of _ResidualStack
_MATRIX_CLIP = 0.5  # below the norms seen here, so every step clips


def _token_batches(rank: int, n: int, vocab: int = 48) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4321 + 7919 * rank)
    return [(torch.randint(vocab, (2, 6), generator=g), torch.randint(vocab, (2, 6), generator=g)) for _ in range(n)]


def _matrix_engine(kind: str, optimizer: str, gas: int, frozen: bool, sub_groups: int, world_size: int):
    torch.manual_seed(0)
    model = _ResidualStack(frozen=frozen)
    cfg = ds_config(2, gas=gas, world_size=world_size, bucket=_MATRIX_BUCKETS[sub_groups], clip=_MATRIX_CLIP,
                    optimizer=False, contiguous_gradients=True, overlap_comm=False)  # fmt: skip
    client = None
    if optimizer == "AdamW":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
    elif optimizer == "Adam":
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False}}
    else:
        cfg["zero_allow_untested_optimizer"] = True
        client = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = _initializers()[kind](
        model=model, model_parameters=list(model.parameters()), optimizer=client, config=cfg
    )
    return engine


def _matrix_rank(rank, world_size, cells):
    out = []
    for optimizer, gas, frozen, sub_groups in cells:
        batches = _token_batches(rank, 4 * gas)
        result = {}
        for kind in ("stock", "flatgrad"):
            engine = _matrix_engine(kind, optimizer, gas, frozen, sub_groups, world_size)
            expected = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[optimizer]
            assert type(engine.optimizer.optimizer) is expected, type(engine.optimizer.optimizer)
            losses, norms = [], []
            for x, y in batches:
                loss = engine(x, y)
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                engine.step()
                losses.append(float(loss.detach()))
                if boundary:
                    norms.append(float(engine.optimizer._global_grad_norm))
            result[kind] = (losses, params_of(engine), len(engine.optimizer.bit16_groups), norms)
            engine.destroy()
        out.append(result)
    return out


def _matrix_cells(optimizer: str) -> list[tuple[str, int, bool, int]]:
    return [(optimizer, gas, frozen, sub) for gas in (1, 2, 3) for frozen in (True, False) for sub in (5, 1)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("optimizer", ["AdamW", "Adam", "SGD"])
def test_zero2_optimizer_accumulation_frozen_matrix_bitwise_like_stock_with_clipping(optimizer):
    """torch Adam, AdamW and SGD x GA 1, 2, 3 x a frozen layer in the forward or none x 1 or 5 sub-groups, with
    an unused layer and clipping on every step, 2 ranks, 4 steps: losses, parameters and the clipping norm
    bitwise like stock."""
    cells = _matrix_cells(optimizer)
    differ = _matrix_differences(cells, launch(_matrix_rank, 2, cells, timeout=290))
    assert not differ, differ


def _matrix_differences(cells: list, results: list) -> list[tuple]:
    """The cells (and ranks) where flatgrad is not bitwise like stock: what differs, by how much."""
    differ = []
    for rank, rank_results in enumerate(results):
        for cell, r in zip(cells, rank_results):
            (s_loss, s_par, s_groups, s_norms), (f_loss, f_par, f_groups, f_norms) = r["stock"], r["flatgrad"]
            assert s_groups == 1 and f_groups == cell[3], (cell, f_groups)
            assert len(f_norms) == len(s_norms) == 4 and all(n > _MATRIX_CLIP for n in s_norms), (cell, s_norms)
            params = [name for name in s_par if not torch.equal(f_par[name], s_par[name])]
            if f_norms != s_norms or f_loss != s_loss or params:
                norm_steps = [k for k, (a, b) in enumerate(zip(f_norms, s_norms)) if a != b]
                differ.append((rank, cell, {"norm_steps": norm_steps, "params": len(params),
                                            "max_rel": _max_rel(s_par, f_par), "losses": _losses_rel(s_loss, f_loss)}))
    return differ


def _rounding_causes_rank(rank: int, world_size: int) -> dict[str, bool]:
    """Whether, on the same fp32 data, stock's reduction and flatgrad's round differently at this world size.

    Stock's ZeRO-2 divides a bucket by W, then all_reduces it; flatgrad's pack multiplies by 1/W, then
    reduce_scatters. Both are exact on 2 ranks (one addition, and 1/2 is a power of two).
    """
    import torch.distributed as tdist

    from flatgrad import comm

    g = torch.Generator().manual_seed(99 + rank)
    data = torch.randn(world_size * 4096, generator=g)
    reduced = data / world_size
    tdist.all_reduce(reduced)
    scattered = torch.empty(4096)
    comm.reduce_scatter(scattered, data / world_size, method="list")
    mine = reduced.chunk(world_size)[rank]
    return {
        "divide_vs_multiply": not torch.equal(data / world_size, data * (1.0 / world_size)),
        "all_reduce_vs_reduce_scatter": not torch.equal(mine, scattered),
    }


def _wide_rank(rank: int, world_size: int, cell: tuple[str, int, bool, int]) -> dict:
    """The matrix cell at ``world_size`` ranks: the first window's reduced gradients of stock and flatgrad, and
    stock's own norm code run on flatgrad's gradients against flatgrad's norm."""
    from deepspeed.utils import safe_get_full_grad

    optimizer, gas, frozen, sub_groups = cell
    batches = _token_batches(rank, gas)
    engines = {
        kind: _matrix_engine(kind, optimizer, gas, frozen, sub_groups, world_size) for kind in ("stock", "flatgrad")
    }
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for kind, engine in engines.items():
        for k, (x, y) in enumerate(batches[:gas]):
            engine.backward(engine(x, y))
            if k + 1 < gas:
                engine.step()  # inside the window: counts the micro-step
        assert engine.is_gradient_accumulation_boundary()
        grads[kind] = {
            n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad
        }  # fmt: skip
    # Stock's norm code over flatgrad's gradients, written into stock's partition as stock's pieces hold them.
    stock = engines["stock"].optimizer
    names = {id(p): n for n, p in engines["stock"].module.named_parameters()}
    first = int(stock.first_offset[0])
    pieces = [g for g in stock.averaged_gradients[0] if not getattr(g, "_zero_padding", False)]
    for k, (piece, p) in enumerate(zip(pieces, stock.params_in_partition[0])):
        start = first if k == 0 else 0
        piece.copy_(grads["flatgrad"][names[id(p)]].reshape(-1)[start : start + piece.numel()].view_as(piece))
    stock_code_norm = float(stock.scaled_global_norm())
    flatgrad_norm = float(engines["flatgrad"].optimizer.scaled_global_norm())
    for engine in engines.values():
        engine.destroy()
    return {"grads": grads, "norms": (stock_code_norm, flatgrad_norm)}


@pytest.mark.timeout(240)
def test_above_two_ranks_gradients_round_differently_in_stock_and_flatgrad_and_the_norm_is_still_stocks():
    """Above 2 ranks flatgrad is not bitwise like stock, for a cause in the arithmetic of the reduction, shown
    here on plain tensors: stock divides by W (3: inexact) and all_reduces, flatgrad multiplies by 1/W and
    reduce_scatters (gloo adds W > 2 ranks in another order); on 2 ranks both are exact. Given flatgrad's
    gradients, stock's own norm code gives flatgrad's clipping norm bitwise on 3 and 4 ranks; the first
    window's reduced gradients differ by at most 1e-6 of each tensor's largest."""
    for world_size in (2, 3, 4):
        causes = launch(_rounding_causes_rank, world_size)
        expected = {"divide_vs_multiply": world_size == 3, "all_reduce_vs_reduce_scatter": world_size > 2}
        assert all(c == expected for c in causes), (world_size, causes)
    cell = ("AdamW", 2, True, 5)
    for world_size in (3, 4):
        for rank, out in enumerate(launch(_wide_rank, world_size, cell, timeout=200)):
            stock_code_norm, flatgrad_norm = out["norms"]
            assert flatgrad_norm == stock_code_norm, (world_size, rank, out["norms"])
            assert _max_rel(out["grads"]["stock"], out["grads"]["flatgrad"]) <= 1e-6, (world_size, rank)


# --------------------------------------------------------------------------- collectives


def _collectives_rank(rank, world_size, stage, gas):
    batches = make_batches(rank, 3 * gas, 2, D_IN, D_OUT)
    out = {}
    for kind in ("stock", "flatgrad"):
        engine = _engine(kind, ds_config(stage, gas=gas, world_size=world_size, bucket=500))
        per_backward, per_step = [], []
        with count_collectives() as counter:
            for i, (x, y) in enumerate(batches):
                loss = engine(x, y)
                counter.reset()
                engine.backward(loss)
                per_backward.append({k: list(v) for k, v in counter.buffers().items()})
                counter.reset()
                engine.step()
                per_step.append({k: list(v) for k, v in counter.buffers().items()})
        out[kind] = (per_backward, len(engine.optimizer.bit16_groups), per_step)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [2, 1])
def test_one_reduce_scatter_per_sub_group_and_no_reduce(stage):
    """Counted at deepspeed.comm (and torch.distributed): one reduce_scatter per sub-group per reduction."""
    gas = 2
    for r in launch(_collectives_rank, 2, stage, gas):
        stock, _, stock_steps = r["stock"]
        flat, n_sub, flat_steps = r["flatgrad"]
        # step(): the gradient norm costs one all_reduce for all sub-groups, as for stock's one group.
        for s_calls, f_calls in zip(stock_steps, flat_steps):
            assert len(f_calls.get("all_reduce", [])) == len(s_calls.get("all_reduce", [])), (s_calls, f_calls)
        assert n_sub > 1
        # The counter sees DeepSpeed's own gradient collectives (so the zeros below mean something).
        assert any(
            numel > 1 for calls in stock for name in ("all_reduce", "reduce") for numel, _ in calls.get(name, [])
        )
        for i, calls in enumerate(flat):
            reduces = stage == 2 or (i + 1) % gas == 0  # ZeRO-1 reduces at the accumulation boundary only
            assert len(calls.get("reduce_scatter", [])) == (n_sub if reduces else 0), (i, calls)
            assert "reduce" not in calls and "reduce_scatter_tensor" not in calls
            assert all(numel <= 1 for numel, _ in calls.get("all_reduce", [])), calls["all_reduce"]


# --------------------------------------------------------------------------- bf16


def _fp64_twin(world_size: int, model: torch.nn.Module, steps: int, gas: int, lr: float) -> dict[str, torch.Tensor]:
    """Plain fp64 SGD on the same data: the mean gradient over ranks and micro-batches, as DeepSpeed computes it."""
    twin = MLP(hidden=64).double()
    twin.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    data = [make_batches(r, steps * gas, 2, D_IN, D_OUT) for r in range(world_size)]
    for k in range(steps):
        twin.zero_grad()
        for r in range(world_size):
            for x, y in data[r][k * gas : (k + 1) * gas]:
                (twin(x.bfloat16().double(), y.bfloat16().double()) / (gas * world_size)).backward()
        with torch.no_grad():
            for p in twin.parameters():
                p -= lr * p.grad
    return {n: p.detach() for n, p in twin.named_parameters()}


def _bf16_rank(rank, world_size):
    from deepspeed.utils import safe_get_full_fp32_param

    # Inputs and initial weights exactly representable in bf16; SGD, so that parameter errors add up
    # linearly (Adam's normalisation makes tiny gradient differences on near-zero elements chaotic).
    steps, gas, lr = 10, 4, 0.05
    batches = [(x.bfloat16().float(), y.bfloat16().float()) for x, y in make_batches(rank, steps * gas, 2, D_IN, D_OUT)]
    out = {}
    for accum in ("default", "fp32"):
        for kind in ("stock", "flatgrad"):
            torch.manual_seed(0)
            model = MLP(hidden=64)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.bfloat16().float())
            initial = {k: v.clone() for k, v in model.state_dict().items()}
            cfg = ds_config(2, gas=gas, world_size=world_size, bucket=1000, dtype="bf16", optimizer=False)
            cfg["optimizer"] = {"type": "SGD", "params": {"lr": lr}}
            cfg["zero_allow_untested_optimizer"] = True
            if accum == "fp32":
                cfg["data_types"] = {"grad_accum_dtype": "fp32"}
            engine = _engine(kind, cfg, model=model)
            train(engine, batches, dtype=torch.bfloat16)
            out[kind, accum] = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    twin_model = MLP(hidden=64)
    twin_model.load_state_dict(initial)
    twin = _fp64_twin(world_size, twin_model, steps, gas, lr)
    errors = {}
    for key, params in out.items():
        err = torch.cat([(params[n].double() - twin[n]).reshape(-1) for n in twin]).abs()
        errors[key] = (err.max().item(), err.sum().item())
    equal = {accum: all(torch.equal(out["stock", accum][n], out["flatgrad", accum][n]) for n in twin) for accum in ("default", "fp32")}
    return equal, errors


@pytest.mark.timeout(200)
def test_bf16_accumulates_in_deepspeeds_grad_accum_dtype_bitwise_like_stock():
    """10 steps, accumulation 4, bf16: micro-steps add up in ``data_types.grad_accum_dtype`` (bf16 by default).

    flatgrad's partitions equal stock's bitwise either way; the errors against an fp64 twin
    (plain fp64 SGD on the same data from the same weights) are reported, and fp32
    accumulation must be no worse than bf16 in summed error.
    """
    for equal, errors in launch(_bf16_rank, 2, timeout=190):
        print({f"{k[0]}/{k[1]}": f"max {m:.3e} sum {s:.4e}" for k, (m, s) in errors.items()})
        assert equal == {"default": True, "fp32": True}, (equal, errors)
        assert errors["flatgrad", "fp32"][1] <= errors["flatgrad", "default"][1], errors


def _two_backwards_rank(rank, world_size):
    """Two engine.backward() calls before one step (two losses): both must count, as in stock's fp32-accum path."""
    from deepspeed.utils import safe_get_full_fp32_param

    batches = make_batches(rank, 4, 2, D_IN, D_OUT)
    out = {}
    for kind in ("stock", "flatgrad"):
        torch.manual_seed(0)
        model = MLP(hidden=32)
        cfg = ds_config(2, world_size=world_size, bucket=300, dtype="bf16", optimizer=False)
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1.0}}
        cfg["zero_allow_untested_optimizer"] = True
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine = _engine(kind, cfg, model=model)
        before = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        for (x1, y1), (x2, y2) in zip(batches[::2], batches[1::2]):
            engine.backward(engine(x1.bfloat16(), y1.bfloat16()))
            engine.backward(engine(x2.bfloat16(), y2.bfloat16()))
            engine.step()
        out[kind] = {n: safe_get_full_fp32_param(p) - before[n] for n, p in engine.module.named_parameters()}
    return {
        n: ((out["flatgrad"][n] - out["stock"][n]).abs().max().item(), out["stock"][n].abs().max().item())
        for n in out["stock"]
    }


@pytest.mark.timeout(120)
def test_two_backwards_before_one_step_both_count():
    for result in launch(_two_backwards_rank, 2):
        for name, (diff, update) in result.items():
            # Dropping the first backward changes the update by most of its size; bf16 rounding by ~1%.
            assert diff <= 0.05 * update, (name, diff, update)


# --------------------------------------------------------------------------- memory


def _memory_rank(rank, world_size, stage, dtype):
    """Bytes live between steps and at the peak, stock and flatgrad, counted from before the model is built.

    Also whether flatgrad's fp32 partitions exist inside an accumulation window and are gone after step().
    """
    from flatgrad.testing.census import MemoryCensus, describe

    batches = make_batches(rank, 4, 2, 64, 64)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    out = {}
    for kind in ("stock", "flatgrad"):
        gc.collect()  # the last engine's reference cycles, freed before the census starts and not inside it
        with MemoryCensus("cpu") as census:
            torch.manual_seed(0)
            model = MLP(d_in=64, hidden=96, d_out=64, layers=6)
            n = sum(p.numel() for p in model.parameters())
            cfg = ds_config(stage, world_size=world_size, gas=2, bucket=n // 4, dtype=dtype)
            engine = _engine(kind, cfg, model=model)
            census.mark("built", blocks=True)
            census.reset_peak()
            alive = []
            for x, y in batches:
                engine.backward(engine(x.to(torch_dtype), y.to(torch_dtype)))
                reduction = getattr(engine.optimizer, "flatgrad", None)
                if reduction is not None:
                    alive.append(reduction.reducers[0].has_shards())
                engine.step()
                if reduction is not None:
                    alive.append(reduction.window.partitions is not None or reduction.reducers[0].has_shards())
            census.settle()  # gloo's worker threads free the step's last collective tensors a little later
            census.mark("between steps", blocks=True)
            # What was made after the build and is still live between steps, besides the optimizer's state,
            # described while it is live: a failure of the bound below names it (flatgrad's tables, or else).
            state = {t.untyped_storage().data_ptr() for st in engine.optimizer.optimizer.state.values()
                     for t in st.values() if torch.is_tensor(t)}  # fmt: skip
            held = describe({a: b for a, b in census.born("between steps", "built").items() if a not in state})
        largest = max(lay.numel for lay in reduction.layouts) if kind == "flatgrad" else n // 4
        out[kind] = {
            "between": census.at("between steps"), "peak": census.peak,
            "alive": alive, "largest": largest, "pool": sum(r.comm_buffer_bytes for r in reduction.reducers)
            if kind == "flatgrad" else 0, "scalars": _optimizer_scalar_bytes(engine),
            "kept": reduction.metadata_bytes() if kind == "flatgrad" else 0, "held": held,
        }  # fmt: skip
        engine.destroy()
        del engine, model
    return out


def _optimizer_scalar_bytes(engine) -> int:
    """Bytes of the optimizer's one-element state tensors (Adam's ``step``): one set per (sub-)group."""
    return sum(
        v.element_size()
        for state in engine.optimizer.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.numel() == 1
    )


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage,dtype", [(2, "bf16"), (2, "fp32"), (1, "fp32")])
def test_memory_between_steps_and_peak_within_the_targets_of_stock(stage, dtype):
    """Between steps <= stock; peak <= stock + 1 fp32 bucket.

    Three terms are named, not hidden: the tables flatgrad keeps (``metadata_bytes()``, about
    1.6 KB here), the optimizer's per-group scalars (Adam's ``step``) of the extra sub-groups, and gloo's
    own copy of the other ranks' chunks inside its reduce_scatter ((W-1)/W of a bucket, measured in
    bench/memory.py; NCCL's reduce_scatter allocates nothing), which stock's all_reduce does not make.
    A ``gc.collect()`` before each census: a flaky pass once hid the kept bytes behind stock's engine
    freed inside flatgrad's census. The between-steps mark settles first (``MemoryCensus.settle``): a gloo
    collective returns before its worker thread drops the call's tensors, so a mark right after ``step()`` can
    count the step's last all_reduce (flatgrad's 7-element fp32 step statistics, 28 B here; stock's norm, 4 B)
    or all-gather for one run and not the other.
    """
    comm, world_size = (2 if dtype == "bf16" else 4), 2
    for rank, out in enumerate(launch(_memory_rank, world_size, stage, dtype, timeout=190)):
        stock, fg = out["stock"], out["flatgrad"]
        # The partitions: alive after every backward of a window (ZeRO-1: from the boundary), gone after step().
        expected = [stage == 2, stage == 2, True, False] * 2
        assert fg["alive"] == expected, (rank, fg["alive"])
        assert fg["pool"] == fg["largest"] * comm  # stock's IPG buffers: one without overlap_comm
        metadata = fg["kept"] + fg["scalars"] - stock["scalars"]
        assert 0 < fg["kept"] <= stock["between"] // 100, (rank, fg["kept"])  # named, and small beside the state
        # The pool lives for one backward, as stock's IPG buffers do: between steps nothing more than stock.
        # On failure the message lists what each held between steps besides the optimizer's state.
        assert fg["between"] <= stock["between"] + metadata, (rank, fg["between"] - stock["between"], metadata,
                                                              fg["held"], stock["held"])  # fmt: skip
        gloo_copy = (world_size - 1) * fg["largest"] * comm // world_size
        assert fg["peak"] <= stock["peak"] + 4 * fg["largest"] + gloo_copy + metadata, (rank, stock, fg)


def _pool_slots_rank(rank: int, world_size: int) -> dict:
    out = {}
    for name, zero, flatgrad in (
        ("default", {}, {}),
        ("overlap_comm", {"overlap_comm": True}, {}),
        ("set", {"overlap_comm": True}, {"comm_buffers": 1}),
    ):
        engine = _engine("flatgrad", ds_config(2, bucket=600, flatgrad=flatgrad, **zero))
        reducer = engine.optimizer.flatgrad.reducers[0]
        out[name] = reducer.comm_buffer_bytes // (max(lay.numel for lay in reducer.layouts) * 4)
        engine.destroy()
    return out


@pytest.mark.timeout(120)
def test_comm_buffers_default_to_stocks_ipg_buffers():
    """As many comm buffers as stock's IPG buffers (2 with overlap_comm, else 1) unless 'comm_buffers' says."""
    for out in launch(_pool_slots_rank, 2, timeout=110):
        assert out == {"default": 1, "overlap_comm": 2, "set": 1}, out


# --------------------------------------------------------------------------- step statistics




def _stats_rank(rank, world_size, moe, clip):
    """Norms from the unpack stats against norms read from the partitions, and which ops step() runs on them."""
    import deepspeed.comm as ds_dist

    batches = make_batches(rank, 3, 4, 64 if moe else D_IN, 64 if moe else D_OUT)
    out = {}
    for kind in ("stock", "flatgrad"):
        torch.manual_seed(0)
        model = SeedMoE(hidden=64, num_experts=4, ep_size=2) if moe else MLP()
        cfg = ds_config(2, micro_batch=4, gas=2, world_size=world_size, bucket=3000 if moe else 300, clip=clip)
        engine = _engine(kind, cfg, model=model)
        norms, reads, step_calls, global_norms = [], [], [], []
        for k, (x, y) in enumerate(batches):
            engine.backward(engine(x, y))
            reduction = getattr(engine.optimizer, "flatgrad", None)
            if reduction is not None and engine.is_gradient_accumulation_boundary():
                from_stats = reduction.stats.scaled_global_norm()
                reduction.window.step_stats.forget()
                squared = reduction.stats.squared_norms_from_partitions().sqrt()
                from deepspeed.runtime.utils import combine_grad_norm_groups

                if engine.optimizer.has_moe_layers:
                    for pg, indices in reduction.stats.moe_groups:
                        scaled = squared[indices] / ds_dist.get_world_size(group=pg)
                        ds_dist.all_reduce(scaled, group=pg)
                        squared[indices] = scaled
                from_partitions = combine_grad_norm_groups(list(squared.unbind()), norm_type=2)
                norms.append((float(from_stats), float(from_partitions)))
                reduction.window.step_stats.forget()
                partitions = [p.flat_partition for p in reduction.window.partitions]
                with PartitionReads(partitions) as recorder, count_collectives() as counter:
                    engine.step()
                reads.append(recorder.ops)
                step_calls.append({op: len(v) for op, v in counter.buffers().items()})
            else:
                with count_collectives() as counter:
                    engine.step()
                if k % 2 == 1:
                    step_calls.append({op: len(v) for op, v in counter.buffers().items()})
            if k % 2 == 1:
                global_norms.append(float(engine.optimizer._global_grad_norm))
        multi_rank = 0
        if kind == "flatgrad":
            multi_rank = sum(len(r.buckets) for r in engine.optimizer.flatgrad.reducers if r.world_size > 1)
        out[kind] = {
            "norms": norms, "reads": reads, "params": params_of(engine), "step_calls": step_calls,
            "multi_rank_sub_groups": multi_rank, "global_norms": global_norms,
        }  # fmt: skip
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world_size,moe,clip", [(2, False, 0.0), (2, False, 0.05), (4, False, 0.05), (4, True, 0.05)]
)
def test_norm_and_overflow_come_from_the_unpack_with_no_pass_over_the_partitions(world_size, moe, clip):
    """The norm step() uses equals the norm read from the partitions (1e-6); the overflow check and the norm
    come from the unpack stats with no reduction over the partitions, except the clipping norm of a run
    without MoE, which is stock's (see [Note: stock clipping norm]): one fp64 norm per piece, as stock reads
    them, and bitwise stock's norm. Clipping with MoE gives stock's parameters within 1e-6. The norm and
    overflow collectives are no more than stock's although there are several sub-groups, but for the clipping
    norm above 2 ranks: one more, per param group."""
    stock_norm = clip > 0 and not moe
    for rank, out in enumerate(launch(_stats_rank, world_size, moe, clip, timeout=230)):
        flat, stock = out["flatgrad"], out["stock"]
        assert flat["norms"], "no boundary step was checked"
        for from_stats, from_partitions in flat["norms"]:
            assert abs(from_stats - from_partitions) <= 1e-6 * from_partitions, (from_stats, from_partitions)
        for ops in flat["reads"]:
            assert ops, "the recorder saw no op on the partitions (the optimizer must read them)"
            assert [op for op in ops if op in REDUCTIONS] == (["_foreach_norm"] if stock_norm else []), ops
        if stock_norm:
            assert flat["global_norms"] == stock["global_norms"], (flat["global_norms"], stock["global_norms"])
        if clip == 0.0 or (stock_norm and world_size == 2):
            for name, value in stock["params"].items():
                assert torch.equal(flat["params"][name], value), (rank, name)
        else:  # MoE's summation order; 4 ranks': see test_fp32_close_to_stock_with_clipping_and_on_four_ranks
            assert _max_rel(stock["params"], flat["params"]) <= 1e-6
        assert flat["multi_rank_sub_groups"] > 1
        gathers = (
            "all_gather_into_tensor", "all_gather_single", "_coalescing_manager", "all_gather_into_tensor_coalesced",
        )  # fmt: skip
        assert len(flat["step_calls"]) == len(stock["step_calls"]) > 0
        for mine, theirs in zip(flat["step_calls"], stock["step_calls"]):
            # Norm and overflow: one all_reduce for all sub-groups, no more than stock's.
            others = lambda calls: sum(n for op, n in calls.items() if op not in gathers)  # noqa: E731
            assert others(mine) <= others(theirs) + (stock_norm and world_size > 2), (mine, theirs)
            # The parameter all_gathers of all sub-groups: one coalesced launch per process group (gloo too,
            # within allgather_bucket_size, see [Note: ZeRO-2 step]) whatever the number of sub-groups.
            gathered = lambda calls: sum(calls.get(op, 0) for op in gathers)  # noqa: E731
            assert gathered(mine) <= gathered(theirs), (mine, theirs)
            assert gathered(mine) < flat["multi_rank_sub_groups"], (mine, flat["multi_rank_sub_groups"])


# --------------------------------------------------------------------------- optimizer arenas


def _arena_rank(rank, world_size):
    batches = make_batches(rank, 16, 2, D_IN, D_OUT)
    cfg = ds_config(2, gas=2, world_size=world_size, bucket=500)
    stock = _engine("stock", cfg)
    stock_losses = train(stock, batches[:12])
    engine = _engine("flatgrad", cfg)
    opt, reduction = engine.optimizer.optimizer, engine.optimizer.flatgrad
    parts = engine.optimizer.single_partition_of_fp32_groups
    tensors_per_call = []
    opt.register_step_pre_hook(lambda o, *_: tensors_per_call.append(sum(len(g["params"]) for g in o.param_groups)))
    losses = train(engine, batches[:6])
    shared = {
        "moments_in_one_storage": len({opt.state[p]["exp_avg"].untyped_storage().data_ptr() for p in parts}) == 1,
        "one_step_tensor": len({id(opt.state[p]["step"]) for p in parts}) == 1,
        "masters_in_one_storage": len({p.untyped_storage().data_ptr() for p in parts}) == 1,
    }
    # torch's load_state_dict replaces the state (every tensor its own copy here): gathered again, bitwise.
    saved = opt.state_dict()
    opt.load_state_dict({
        "state": {k: {n: v.clone() for n, v in s.items()} for k, s in saved["state"].items()},
        "param_groups": saved["param_groups"],
    })  # fmt: skip
    parts[1].data = parts[1].data.clone()  # a partition given other memory: put back into its arena at the next step
    losses += train(engine, batches[6:12])
    params = params_of(engine)
    # One sub-group's settings diverge: its run splits off; each sub-group's step counts once per step.
    before = [p.detach().clone() for p in parts]
    opt.param_groups[0]["lr"] = 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    train(engine, batches[12:14])
    runs_after_split = len(reduction.arenas.runs())
    # A scheduler sets every sub-group's lr alike, each its own float object: still one run.
    for group in opt.param_groups:
        group["lr"] = float("1e-3")
        group["weight_decay"] = float(str(opt.param_groups[-1]["weight_decay"]))
    return {
        "stock_losses": stock_losses,
        "stock_params": params_of(stock),
        "losses": losses,
        "params": params,
        "sub_groups": len(parts),
        "tensors_per_call": tensors_per_call,
        "shared": shared,
        "arena_steps": reduction.arenas.steps,
        "runs_after_split": runs_after_split,
        "runs_after_scheduler": len(reduction.arenas.runs()),
        "steps_after_split": [float(opt.state[p]["step"]) for p in parts],
        "frozen_unchanged": torch.equal(before[0], parts[0].detach()),
        "others_changed": all(not torch.equal(b, p.detach()) for b, p in zip(before[1:], parts[1:])),
    }


@pytest.mark.timeout(150)
def test_optimizer_steps_one_tensor_per_run_over_arenas_bitwise_like_stock():
    """Under ZeRO-2 the optimizer sees one tensor per run of sub-groups (not one per sub-group), the
    sub-groups' state are views of one run state, a state_dict load is gathered again, and training stays
    bitwise equal to stock (also after a partition was given other memory); a sub-group whose settings diverge
    is stepped apart, each step counted once."""
    for rank, out in enumerate(launch(_arena_rank, 2)):
        assert out["sub_groups"] > 2, out["sub_groups"]
        assert out["tensors_per_call"] == [1] * 6 + [2], out["tensors_per_call"]  # the split step: 2 runs
        assert all(out["shared"].values()), out["shared"]
        assert out["arena_steps"] == 7
        assert out["losses"] == out["stock_losses"], rank
        for name, value in out["stock_params"].items():
            assert torch.equal(out["params"][name], value), (rank, name)
        assert out["runs_after_split"] == 2 and out["runs_after_scheduler"] == 1
        assert out["steps_after_split"] == [7.0] * out["sub_groups"], out["steps_after_split"]
        assert out["frozen_unchanged"] and out["others_changed"]


_SETTING_VALUES = (1, 1.0, True, 0.5, 0.5000001, (0.9, 0.999), [0.9, 0.999], None, "adam", float("nan"),
                   torch.tensor(0.5), torch.tensor(0.5), torch.tensor([0.9, 0.999]))  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    first=st.dictionaries(st.sampled_from(["lr", "betas", "eps", "foreach", "name"]), st.sampled_from(_SETTING_VALUES)),
    edits=st.lists(st.tuples(st.sampled_from(["lr", "betas", "eps", "foreach", "name", "extra"]),
                             st.one_of(st.none(), st.sampled_from(_SETTING_VALUES))), max_size=3),
)  # fmt: skip
def test_run_settings_compare_as_same_settings(first, edits):
    """The arenas' fast comparison of a sub-group with its run's first (identical objects, or equal plain
    values in one tuple comparison) decides as ``same_settings``: 1 and 1.0 differ, tensors equal only
    themselves, a missing or extra key differs, a value that does not compare differs."""
    from flatgrad.integrations.deepspeed.arenas import _Settings, same_settings

    a = {"params": [torch.zeros(1)], **first}
    b = {"params": [torch.zeros(1)], **first}
    for key, value in edits:  # None as the edit: drop the key
        if value is None:
            b.pop(key, None)
        else:
            b[key] = value
    c = {key: (float(repr(v)) if type(v) is float and v == v else v) for key, v in b.items()}  # equal, other objects
    for group in (b, c):
        assert _Settings(a).equal(group) == same_settings(group, a)


# --------------------------------------------------------------------------- checkpoints


def _checkpoint_rank(rank, world_size, root):
    import deepspeed.comm as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    batches = make_batches(rank, 20, 2, D_IN, D_OUT)
    cfg = ds_config(2, gas=2, world_size=world_size, bucket=500)
    engine = _engine("flatgrad", cfg)
    train(engine, batches[:10])
    path = os.path.join(root, "flatgrad")
    engine.save_checkpoint(path, tag="step5")
    at_save = params_of(engine)
    continued = train(engine, batches[10:])
    final = params_of(engine)
    dist.barrier()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(path, tag="step5") if rank == 0 else None
    resumed = _engine("flatgrad", cfg, seed=1)  # other initial weights: all must come from the checkpoint
    resumed.load_checkpoint(path, tag="step5")
    resumed_losses = train(resumed, batches[10:])
    return {
        "continued": continued,
        "final": final,
        "at_save": at_save,
        "consolidated": consolidated,
        "resumed_losses": resumed_losses,
        "resumed_final": params_of(resumed),
    }


def _residual_checkpoint_rank(rank, world_size, root):
    import warnings

    from flatgrad.integrations.deepspeed.zero2.checkpoint import RESIDUALS_KEY

    batches = make_batches(rank, 16, 2, D_IN, D_OUT)
    feedback = {"reduction": "int8", "error_feedback": True, "block": 32}
    cfg = ds_config(2, world_size=world_size, bucket=500, flatgrad=feedback)
    engine = _engine("flatgrad", cfg)
    train(engine, batches[:8])
    path = os.path.join(root, "feedback")
    engine.save_checkpoint(path, tag="t")
    saved = [r.detach().clone() for red in engine.optimizer.flatgrad.reducers for r in red.state_dict()["residuals"]]
    continued = train(engine, batches[8:])
    out = {"continued": continued, "saved_nonzero": all(bool(r.abs().sum() > 0) for r in saved)}
    # Without the residuals the run goes another way: the comparison below can fail.
    cleared = _engine("flatgrad", cfg, seed=1)
    cleared.load_checkpoint(path, tag="t")
    for red in cleared.optimizer.flatgrad.reducers:
        for r in red.state_dict()["residuals"]:
            r.zero_()
    out["cleared"] = train(cleared, batches[8:])
    resumed = _engine("flatgrad", cfg, seed=1)
    resumed.load_checkpoint(path, tag="t")
    out["resumed"] = train(resumed, batches[8:])
    # A checkpoint of a run without feedback: this run's residuals restart at zero, with a warning naming the key.
    plain = _engine("flatgrad", ds_config(2, world_size=world_size, bucket=500, flatgrad={"reduction": "int8", "block": 32}))
    train(plain, batches[:8])
    plain_path = os.path.join(root, "plain")
    plain.save_checkpoint(plain_path, tag="t")
    out["plain_has_key"] = RESIDUALS_KEY in plain.optimizer.state_dict()
    restart = _engine("flatgrad", cfg, seed=1)
    train(restart, batches[:2])  # residuals nonzero before the load
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restart.load_checkpoint(plain_path, tag="t")
    out["warnings"] = [str(w.message) for w in caught if RESIDUALS_KEY in str(w.message)]
    out["restart_zero"] = all(
        not bool(r.any()) for red in restart.optimizer.flatgrad.reducers for r in red.state_dict()["residuals"]
    )
    return out


@pytest.mark.timeout(200)
def test_error_feedback_residuals_travel_in_checkpoints(tmp_path):
    for rank, r in enumerate(launch(_residual_checkpoint_rank, 2, str(tmp_path), timeout=180)):
        assert r["saved_nonzero"], rank
        assert r["resumed"] == r["continued"], rank  # bitwise: the residuals came back
        assert r["cleared"] != r["continued"], rank
        assert not r["plain_has_key"], rank  # no residuals, no key: the checkpoint is stock's layout
        assert r["warnings"] and "restart at zero" in r["warnings"][0], (rank, r["warnings"])
        assert r["restart_zero"], rank


@pytest.mark.timeout(120)
def test_checkpoint_round_trip_continues_bitwise_and_zero_to_fp32_gives_live_weights(tmp_path):
    results = launch(_checkpoint_rank, 2, str(tmp_path))
    for r in results:
        assert r["resumed_losses"] == r["continued"]
        for name, p in r["final"].items():
            assert torch.equal(r["resumed_final"][name], p), name
    consolidated = results[0]["consolidated"]
    assert consolidated.keys() == results[0]["at_save"].keys()
    for name, p in results[0]["at_save"].items():
        assert torch.equal(consolidated[name].float(), p), name


def _mismatched_checkpoint_rank(rank, world_size, root):
    import flatgrad.deepspeed as fds

    batches = make_batches(rank, 2, 2, D_IN, D_OUT)
    messages = {}
    for name, (src, src_bucket), (dst, dst_bucket) in (
        ("stock to flatgrad", ("stock", 500), ("flatgrad", 500)),
        ("flatgrad to stock", ("flatgrad", 500), ("stock", 500)),
        ("other bucket size", ("flatgrad", 300), ("flatgrad", 900)),
        ("same bucket size", ("flatgrad", 300), ("flatgrad", 300)),
    ):
        engine = _engine(src, ds_config(2, world_size=world_size, bucket=src_bucket))
        train(engine, batches)
        path = os.path.join(root, name.replace(" ", "_"))
        engine.save_checkpoint(path, tag="t")
        target = _engine(dst, ds_config(2, world_size=world_size, bucket=dst_bucket))
        try:
            target.load_checkpoint(path, tag="t")
            messages[name] = None
        except (fds.UnsupportedConfigError, RuntimeError) as exc:
            messages[name] = (type(exc).__name__, str(exc))
    return messages


@pytest.mark.timeout(180)
def test_checkpoint_of_other_sub_groups_is_refused_with_the_bucket_key(tmp_path):
    """A checkpoint of flatgrad with another bucket size is refused; a stock one is re-partitioned (its bitwise
    resumption: tests/test_deepspeed_checkpoint.py)."""
    for m in launch(_mismatched_checkpoint_rank, 2, str(tmp_path)):
        assert m["same bucket size"] is None
        assert m["stock to flatgrad"] is None
        kind, message = m["other bucket size"]
        assert kind == "UnsupportedConfigError", m["other bucket size"]
        assert "zero_optimization.reduce_bucket_size" in message and "load_universal" in message, message
        assert m["flatgrad to stock"] is not None  # stock refuses with its own error; no state is mixed up


def _universal_rank(rank, world_size, root, src, dst):
    import deepspeed.comm as dist
    from deepspeed.checkpoint import ds_to_universal

    batches = make_batches(rank, 20, 2, D_IN, D_OUT)
    cfg = ds_config(2, gas=2, world_size=world_size, bucket=500)
    engine = _engine(src, cfg)
    train(engine, batches[:10])
    path = os.path.join(root, f"{src}_to_{dst}")
    engine.save_checkpoint(path, tag="step5")
    reference = train(engine, batches[10:])
    reference_final = params_of(engine)
    dist.barrier()
    if rank == 0:
        args = types.SimpleNamespace(
            input_folder=os.path.join(path, "step5"), output_folder=os.path.join(path, "step5_universal"),
            num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
        )  # fmt: skip
        ds_to_universal.main(args)
    dist.barrier()
    cfg_universal = dict(cfg, checkpoint={"load_universal": True})
    resumed = _engine(dst, cfg_universal, seed=1)
    resumed.load_checkpoint(path, tag="step5_universal")
    losses = train(resumed, batches[10:])
    return reference, reference_final, losses, params_of(resumed), len(resumed.optimizer.bit16_groups)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("src,dst", [("stock", "flatgrad"), ("flatgrad", "stock")])
def test_universal_checkpoint_moves_between_stock_and_flatgrad(tmp_path, src, dst):
    """Stock ZeRO-2 checkpoints resume under flatgrad (other param groups) and vice versa, bitwise."""
    for reference, reference_final, losses, final, groups in launch(_universal_rank, 2, str(tmp_path), src, dst):
        assert (groups > 1) == (dst == "flatgrad")
        assert losses == reference
        for name, p in reference_final.items():
            assert torch.equal(final[name], p), name


# --------------------------------------------------------------------------- unused and frozen parameters


def _unused_frozen_rank(rank, world_size):
    out = []
    for stage in (2, 1):
        batches = make_batches(rank, 8, 2, D_IN, D_OUT)
        result = {}
        for kind in ("stock", "flatgrad"):
            torch.manual_seed(0)
            model = MLP(unused=True, frozen=True)
            engine = _engine(kind, ds_config(stage, gas=2, world_size=world_size, bucket=300), model=model)
            result[kind] = (train(engine, batches), params_of(engine))
        out.append(result)
    return out


@pytest.mark.timeout(120)
def test_unused_and_frozen_parameters_match_stock_bitwise():
    for rank_results in launch(_unused_frozen_rank, 2):
        for r in rank_results:
            (s_loss, s_par), (f_loss, f_par) = r["stock"], r["flatgrad"]
            assert f_loss == s_loss
            for name in s_par:
                assert torch.equal(f_par[name], s_par[name]), name
            # Frozen weights never move; the unused layer only decays.
            assert torch.equal(f_par["layers.0.weight"], s_par["layers.0.weight"])


# --------------------------------------------------------------------------- the seed MoE model


def _moe_rank(rank, world_size, steps):
    from deepspeed.utils import safe_get_full_grad

    from flatgrad import Layout
    from flatgrad.integrations.deepspeed.zero2 import partitions as zero2_partitions

    batches = make_batches(rank, steps, 4, 1000, 1000)
    out = {}
    for kind in ("stock", "flatgrad"):
        torch.manual_seed(0)
        model = SeedMoE()
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        engine = _engine(kind, ds_config(2, micro_batch=4, world_size=world_size, bucket=10**6), model=model)
        optimizer = engine.optimizer
        losses, grads, calls = [], None, []
        with count_collectives() as counter:
            for i, (x, y) in enumerate(batches):
                loss = engine(x, y)
                counter.reset()
                engine.backward(loss)
                calls.append({k: list(v) for k, v in counter.buffers().items()})
                counter.reset()
                if i == 0:
                    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
                engine.step()
                losses.append(float(loss.detach()))
        groups = [(bool(g.get("moe", False)), g.get("name")) for g in optimizer.optimizer.param_groups]
        wrong_layout_refused = None
        if kind == "flatgrad":
            # The install-time check can fail: a layout over another world size is refused.
            params = optimizer.round_robin_bit16_groups[0]
            wrong = Layout.flat([p.numel() for p in params], 2 * optimizer.partition_count[0], 2)
            try:
                zero2_partitions.verify_layout(optimizer, 0, wrong, 0)
                wrong_layout_refused = False
            except RuntimeError as exc:
                wrong_layout_refused = "does not match DeepSpeed" in str(exc)
        out[kind] = {
            "losses": losses,
            "grads": grads,
            "calls": calls,
            "groups": groups,
            "n_params": n_params,
            "refused": wrong_layout_refused,
        }
    return out


@pytest.mark.timeout(180)
def test_seed_moe_model_on_four_ranks():
    """The seed thread's model: 10,026,000 params per rank, 16 experts, ep_size 4 (expert groups of 1 rank)."""
    for r in launch(_moe_rank, 4, 3, timeout=170):
        stock, flat = r["stock"], r["flatgrad"]
        assert flat["n_params"] == 10_026_000
        assert flat["refused"] is True
        # Expert sub-groups keep their MoE group name; the dense ones theirs.
        assert (
            {name for moe, name in flat["groups"] if moe}
            == {name for moe, name in stock["groups"] if moe}
            == {"ep_size_4"}
        )
        n_dense = sum(1 for moe, _ in flat["groups"] if not moe)
        assert len(flat["groups"]) > len(stock["groups"])
        # First-step gradients (same weights on both) agree to summation order; losses follow.
        assert _max_rel(stock["grads"], flat["grads"]) <= 1e-6
        assert _losses_rel(stock["losses"], flat["losses"]) <= 1e-5
        for calls in flat["calls"]:
            # One reduce_scatter per dense sub-group; expert groups have one rank here: no collective.
            assert len(calls.get("reduce_scatter", [])) == n_dense, calls.keys()
            assert "reduce" not in calls
            assert all(numel <= 1 for numel, _ in calls.get("all_reduce", []))


# --------------------------------------------------------------------------- optimizers and schedulers


def _client_rank(rank, world_size):
    batches = make_batches(rank, 12, 2, D_IN, D_OUT)
    out = {}
    for kind, init in _initializers().items():
        # A client optimizer object (rebuilt over the sub-groups) and a client scheduler callable.
        torch.manual_seed(0)
        model = MLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        engine, zero, _, scheduler = init(
            model=model, optimizer=optimizer, config=ds_config(2, gas=2, world_size=world_size, bucket=500, optimizer=False),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        )  # fmt: skip
        client = (train(engine, batches), params_of(engine), len(scheduler.base_lrs), len(zero.param_groups),
                  sorted({g["lr"] for g in zero.param_groups}))  # fmt: skip
        # A scheduler DeepSpeed builds from the config sees the sub-groups.
        torch.manual_seed(0)
        cfg = ds_config(2, gas=2, world_size=world_size, bucket=500)
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4},
        }
        engine, zero, _, scheduler = init(model=MLP(), config=cfg, model_parameters=None)
        lrs = []
        for x, y in batches:
            engine.backward(engine(x, y))
            engine.step()
            lrs.append(sorted({g["lr"] for g in zero.param_groups}))
        out[kind] = {
            "client": client,
            "lrs": lrs,
            "scheduler_groups": len(scheduler.optimizer.param_groups),
            "groups": len(zero.param_groups),
        }
    return out


@pytest.mark.timeout(120)
def test_client_optimizer_is_rebuilt_and_schedulers_see_the_sub_groups():
    for r in launch(_client_rank, 2):
        stock, flat = r["stock"], r["flatgrad"]
        (s_loss, s_par, _, s_groups, s_lr), (f_loss, f_par, f_lrs, f_groups, f_lr) = stock["client"], flat["client"]
        assert s_groups == 1 and f_groups > 1
        assert f_lrs == f_groups  # the callable scheduler was built over the sub-groups
        assert f_loss == s_loss and f_lr == s_lr
        for name in s_par:
            assert torch.equal(f_par[name], s_par[name]), name
        assert flat["scheduler_groups"] == flat["groups"] > 1
        assert flat["lrs"] == stock["lrs"]  # one lr, the same every step, in every sub-group


# --------------------------------------------------------------------------- refusals (no ranks needed)


def _cfg_with(stage: int = 2, **changes) -> dict:
    cfg = ds_config(stage)
    for dotted, value in changes.items():
        node = cfg
        keys = dotted.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return cfg


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "cfg,key",
    [
        (
            _cfg_with(zero_optimization__offload_optimizer={"device": "nvme", "nvme_path": "/tmp"}),
            "zero_optimization.offload_optimizer.device",
        ),
        (_cfg_with(zero_optimization__zenflow={"topk_ratio": 0.1}), "zero_optimization.zenflow"),
        (_cfg_with(zero_optimization__parameter_alignment=True), "zero_optimization.parameter_alignment"),
        (_cfg_with(compile={"deepcompile": True}), "compile.deepcompile"),
        (_cfg_with(torch_autocast={"enabled": True}), "torch_autocast.enabled"),
        (_cfg_with(optimizer={"type": "Muon", "params": {"lr": 0.01}}), "optimizer.type"),
        (_cfg_with(sequence_parallel_size=2), "sequence_parallel_size"),
        (_cfg_with(1, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}), "data_types.grad_accum_dtype"),
        (_cfg_with(0), "zero_optimization.stage"),
        (_cfg_with(flatgrad={"bucket_numell": 10}), "bucket_numell"),
        (_cfg_with(flatgrad={"comm_buffers": 0}), "flatgrad.comm_buffers"),
        (_cfg_with(flatgrad={"comm_buffers": 1.5}), "flatgrad.comm_buffers"),
        (_cfg_with(flatgrad={"reduction": "mean"}), "flatgrad.reduction"),
        (_cfg_with(flatgrad={"reduction": "int8", "block": 100}), "flatgrad.block"),
        (_cfg_with(flatgrad={"reduction": "int8", "block": 8192}), "flatgrad.block"),
        (_cfg_with(flatgrad={"reduction": "exact", "error_feedback": True}), "flatgrad.error_feedback"),
        (_cfg_with(flatgrad={"checkpoint_layout": "universal"}), "flatgrad.checkpoint_layout"),
    ],
    ids=[
        "nvme-offload",
        "zenflow",
        "alignment",
        "deepcompile",
        "autocast",
        "muon",
        "sequence",
        "bf16-zero1",
        "stage0",
        "typo",
        "comm_buffers-0",
        "comm_buffers-float",
        "reduction-unknown",
        "block-not-pow2",
        "block-too-large",
        "feedback-without-quantization",
        "checkpoint-layout-unknown",
    ],
)
def test_unsupported_configs_are_refused_at_initialize_naming_the_key(cfg, key):
    import flatgrad.deepspeed as fds

    with pytest.raises(fds.UnsupportedConfigError) as info:
        fds.initialize(model=MLP(), config=cfg)
    assert key in str(info.value)


@pytest.mark.timeout(60)
def test_client_optimizer_with_state_and_bound_scheduler_are_refused():
    import flatgrad.deepspeed as fds

    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(fds.UnsupportedConfigError, match="lr_scheduler"):
        fds.initialize(model=model, optimizer=optimizer, config=ds_config(2, bucket=100, optimizer=False),
                       lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))  # fmt: skip
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.StepLR(fresh, 1)  # bound to the groups, though never passed to initialize
    with pytest.raises(fds.UnsupportedConfigError, match="an LR scheduler is bound"):
        fds.initialize(model=model, optimizer=fresh, config=ds_config(2, bucket=100, optimizer=False))
    model(*make_batches(0, 1, 2, D_IN, D_OUT)[0]).backward()
    optimizer.step()
    with pytest.raises(fds.UnsupportedConfigError, match="already has state"):
        fds.initialize(model=model, optimizer=optimizer, config=ds_config(2, optimizer=False))


# --------------------------------------------------------------------------- patch() and pass-through


def _patch_rank(rank, world_size):
    import logging

    import deepspeed
    from deepspeed.pipe import PipelineModule

    import flatgrad.deepspeed as fds

    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("flatgrad.deepspeed").addHandler(Capture())
    original = deepspeed.initialize
    fds.patch()
    fds.patch()  # idempotent
    out = {"patched": deepspeed.initialize is not original and fds.is_patched()}
    batch = make_batches(rank, 1, 2, D_IN, D_OUT)
    routed = {}
    for name, cfg in (
        ("stage2", ds_config(2, world_size=world_size, bucket=500)),
        ("stage0", ds_config(0, world_size=world_size, flatgrad={"bucket_numel": 100})),
        ("disabled", ds_config(2, world_size=world_size, flatgrad={"enabled": False})),
    ):
        torch.manual_seed(0)
        model = MLP()
        before = len(records)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        train(engine, batch)
        routed[name] = (hasattr(engine.optimizer, "flatgrad"), records[before:])
    torch.manual_seed(0)
    model = MLP()
    before = len(records)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(3, world_size=world_size, optimizer=False))
    routed["zero3 without optimizer"] = (hasattr(engine.optimizer, "flatgrad"), records[before:])
    out["routed"] = routed
    fds.unpatch()
    out["restored"] = deepspeed.initialize is original and not fds.is_patched()
    try:
        fds.initialize(
            model=PipelineModule(layers=[torch.nn.Linear(4, 4)], num_stages=1),
            config=ds_config(2, world_size=world_size),
        )
        out["pipeline"] = None
    except fds.UnsupportedConfigError as exc:
        out["pipeline"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_patch_routes_initialize_and_passes_unhandled_configs_through_with_one_log_line():
    for r in launch(_patch_rank, 2):
        assert r["patched"] and r["restored"]
        flatgrad_on, logs = r["routed"]["stage2"]
        assert flatgrad_on and logs == []
        for name, key in (
            ("stage0", "zero_optimization.stage"),
            ("disabled", "flatgrad.enabled"),
            ("zero3 without optimizer", "without an optimizer"),
        ):
            flatgrad_on, logs = r["routed"][name]
            assert not flatgrad_on
            assert len(logs) == 1 and "stock DeepSpeed" in logs[0] and key in logs[0], logs
        assert r["pipeline"] is not None and "PipelineModule" in r["pipeline"]


@pytest.mark.timeout(120)
def test_environment_variable_patches_on_import():
    code = "import flatgrad, deepspeed; print(getattr(deepspeed.initialize, '__flatgrad_patched__', False))"
    env = dict(os.environ, FLATGRAD_DEEPSPEED="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH")) if p
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
    env["FLATGRAD_DEEPSPEED"] = "yes"
    done = subprocess.run(
        [sys.executable, "-c", "import flatgrad"], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode != 0 and "FLATGRAD_DEEPSPEED" in done.stderr


# --------------------------------------------------------------------------- take-over line, setup agreement


def _takeover_rank(rank, world_size):
    import contextlib
    import io

    from flatgrad.integrations.deepspeed.initialize import QUIET_VAR

    def stderr_lines(config: dict, quiet: str | None) -> list[str]:
        if quiet is None:
            os.environ.pop(QUIET_VAR, None)
        else:
            os.environ[QUIET_VAR] = quiet
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _engine("flatgrad", config)
        os.environ.pop(QUIET_VAR, None)
        return [line for line in err.getvalue().splitlines() if line.startswith("flatgrad:")]

    shown = [stderr_lines(ds_config(stage, world_size=world_size, bucket=500), None) for stage in (1, 2, 3)]
    quiet = stderr_lines(ds_config(2, world_size=world_size, bucket=500), "1")
    off = stderr_lines({**ds_config(2, world_size=world_size, bucket=500), "flatgrad": {"announce": False}}, None)
    return shown, quiet, off


@pytest.mark.timeout(150)
def test_take_over_is_one_stderr_line_on_rank_0_under_default_logging():
    (shown0, quiet0, off0), (shown1, quiet1, off1) = launch(_takeover_rank, 2, timeout=140)
    assert shown1 == [[], [], []] and quiet1 == [] and off1 == []
    assert quiet0 == [] and off0 == []
    for stage, lines in zip((1, 2, 3), shown0):
        assert len(lines) == 1, lines
        assert f"ZeRO-{stage} gradient reduction taken over" in lines[0], lines[0]
        assert "sub-group" in lines[0] and "bucket" in lines[0] and "reduce_scatter (" in lines[0], lines[0]


def _setup_failure_rank(rank, world_size):
    import deepspeed

    from flatgrad.integrations.deepspeed import zero2
    from flatgrad.integrations.deepspeed.config import FlatgradConfig

    cfg = FlatgradConfig()
    torch.manual_seed(0)
    model = MLP()
    with zero2.prepare(cfg):
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=list(model.parameters()), config=ds_config(2, world_size=world_size, bucket=500)
        )
    if rank == 1:
        engine.optimizer.first_offset[0] += 1  # DeepSpeed's bookkeeping disagrees with the layout on this rank only
    try:
        zero2.install(engine, cfg)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.timeout(150)
def test_layout_check_failing_on_one_rank_raises_on_every_rank():
    first, second = launch(_setup_failure_rank, 2, timeout=100)
    assert second is not None and "first_offset" in second, second
    assert first is not None and "rank 1 failed" in first and "first_offset" in first, first
def _reduction_modes_rank(rank: int, world_size: int) -> dict:
    import flatgrad.deepspeed as fds

    out = {}
    for flatgrad in (
        {},
        {"reduction": "exact"},
        {"reduction": "int8", "error_feedback": True, "block": 64},
        {"reduction": "fp8", "block": 64},
    ):
        torch.manual_seed(0)
        engine, *_ = fds.initialize(model=MLP(), config=ds_config(2, flatgrad=flatgrad))
        # Every mode's unpack computes the stats: the step takes its norm and overflow from them.
        assert engine.optimizer.flatgrad.stats.usable(), flatgrad
        losses = train(engine, make_batches(rank, 4, 2, 13, 5))
        out[flatgrad.get("reduction", "reduce_scatter")] = (losses, params_of(engine))
    return out


@pytest.mark.timeout(150)
def test_reduction_modes_through_zero2():
    """fp32 on 2 ranks: one addition per element, so ``exact`` equals the reduce_scatter bitwise; int8/fp8 are close."""
    for out in launch(_reduction_modes_rank, 2, timeout=140):
        base_losses, base_params = out["reduce_scatter"]
        losses, params = out["exact"]
        assert losses == base_losses
        assert all(torch.equal(params[n], base_params[n]) for n in base_params)
        for mode in ("int8", "fp8"):
            losses, params = out[mode]
            assert params.keys() == base_params.keys()
            assert any(not torch.equal(params[n], base_params[n]) for n in base_params), mode  # it did quantize
            assert losses[0] == base_losses[0]
            torch.testing.assert_close(losses, base_losses, rtol=0.02, atol=0, msg=mode)


def _coalesce_rank(rank: int, world_size: int) -> dict:
    out = {}
    batches = make_batches(rank, 4, 2, D_IN, D_OUT)
    for kind in ("stock", "flatgrad"):
        for coalesce in (False, True):
            engine = _engine(kind, ds_config(2, gas=4, bucket=400))
            counter = count_collectives()
            with counter:
                with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
                    for i, (x, y) in enumerate(batches):
                        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
                        engine.backward(engine(x, y))
            engine.step()
            calls = counter.take()
            out[kind, coalesce] = (
                sum(c.op in ("reduce_scatter", "reduce", "all_reduce") for c in calls), params_of(engine),
            )  # fmt: skip
            engine.destroy()
    return out


@pytest.mark.timeout(150)
def test_coalesce_grad_reduction_issues_one_reduction_pass_and_trains_as_stock():
    """``engine.coalesce_grad_reduction()`` (DeepSpeed's): four backwards inside it issue one reduction pass at its
    exit, not one per backward; the step after it equals stock's coalesced step bitwise (fp32, 2 ranks), as the
    step without it equals stock's step without it. DeepSpeed's own count of this
    (``TestCoalesceCollectiveCount``) counts only stock's reduce entry points: see ``.ci/ds_wide.txt``."""
    for out in launch(_coalesce_rank, 2, timeout=140):
        plain, plain_params = out["flatgrad", False]
        coalesced, coalesced_params = out["flatgrad", True]
        assert plain > 0 and coalesced > 0, (plain, coalesced)
        assert coalesced * 4 == plain, (plain, coalesced)  # one pass of the same buckets instead of four
        stock_params = out["stock", True][1]
        diff = {n: (coalesced_params[n] - p).abs().max().item() for n, p in stock_params.items()}
        assert not any(diff.values()), diff
        diff = {n: (plain_params[n] - p).abs().max().item() for n, p in out["stock", False][1].items()}
        assert not any(diff.values()), diff
