"""Stock DeepSpeed ZeRO-1/2 checkpoints load directly under flatgrad, and bad ones are refused before anything loads.

Real DeepSpeed on CPU, 2 gloo ranks, fp32. See [Note: stock checkpoints under flatgrad] in docs/design.md.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _ds import MLP, ds_config, launch, make_batches, params_of, train

D_IN, D_OUT = 13, 5


def _engine(kind: str, cfg: dict, groups: bool = False, seed: int = 0, scheduler: bool = False):
    """An engine over a fresh ``MLP``; ``groups`` gives it a client AdamW with two param groups (no decay on biases,
    and half the rate), ``scheduler`` a client torch ``LambdaLR`` (its lists have one entry per param group)."""
    import deepspeed

    import flatgrad.deepspeed as fds

    torch.manual_seed(seed)
    model = MLP()
    client = None
    if groups:
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        client = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0, "lr": 5e-3}], lr=1e-2)
    schedule = (lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, _decay)) if scheduler else None
    initialize = {"stock": deepspeed.initialize, "flatgrad": fds.initialize}[kind]
    engine, *_ = initialize(
        model=model, model_parameters=list(model.parameters()), optimizer=client, lr_scheduler=schedule, config=cfg
    )
    return engine


def _decay(step: int) -> float:
    return 1.0 / (1.0 + step)


def _masters(engine) -> list[torch.Tensor]:
    return [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]


# Each cell: (stage, gas, bucket, client optimizer with two param groups, round_robin_gradients).
CELLS = [(2, 2, 500, False, False), (1, 1, 300, True, False), (2, 1, 300, True, True)]


def _stock_resume_rank(rank, world_size, root):
    import deepspeed.comm as dist

    out = []
    for c, (stage, gas, bucket, groups, round_robin) in enumerate(CELLS):
        zero = {"round_robin_gradients": True} if round_robin else {}
        cfg = ds_config(stage, gas=gas, world_size=world_size, bucket=bucket, optimizer=not groups, **zero)
        if groups:
            cfg["zero_allow_untested_optimizer"] = True
        batches = make_batches(rank, 8 * gas, 2, D_IN, D_OUT)
        cut = 4 * gas
        saved = {}
        for kind in ("stock", "flatgrad"):
            engine = _engine(kind, cfg, groups)
            train(engine, batches[:cut])
            saved[kind] = os.path.join(root, f"{c}_{kind}")
            engine.save_checkpoint(saved[kind], tag="t")
            saved[kind + "_groups"] = len(engine.optimizer.bit16_groups)
            if kind == "flatgrad":
                saved["continued"] = train(engine, batches[cut:])
                saved["continued_masters"] = _masters(engine)
            engine.destroy()
        dist.barrier()
        result = {"stock_groups": saved["stock_groups"], "flatgrad_groups": saved["flatgrad_groups"]}
        result["continued"], result["continued_masters"] = saved["continued"], saved["continued_masters"]
        for kind in ("stock", "flatgrad"):
            resumed = _engine("flatgrad", cfg, groups, seed=1)  # other initial weights: all must come from the file
            resumed.load_checkpoint(saved[kind], tag="t")
            at_load = _masters(resumed)
            losses = train(resumed, batches[cut:])
            result[kind] = (losses, _masters(resumed), params_of(resumed), at_load, resumed.global_steps)
            resumed.destroy()
        out.append(result)
    return out


@pytest.mark.timeout(300)
def test_stock_checkpoint_resumes_under_flatgrad_bitwise_like_a_flatgrad_checkpoint(tmp_path):
    """Train N steps under stock and under flatgrad (same seed and data), save both; load each under flatgrad and
    continue M steps: losses, fp32 masters and parameters bitwise equal, and equal to the uninterrupted run. Cells:
    ZeRO-2 with GA 2 and AdamW from the config; ZeRO-1 and ZeRO-2 with round-robin gradients, each with a client
    torch AdamW of two param groups."""
    for rank, cells in enumerate(launch(_stock_resume_rank, 2, str(tmp_path), timeout=280)):
        for cell, r in zip(CELLS, cells):
            assert r["stock_groups"] < r["flatgrad_groups"], (cell, r["stock_groups"], r["flatgrad_groups"])
            s_losses, s_masters, s_params, s_at_load, s_steps = r["stock"]
            f_losses, f_masters, f_params, f_at_load, f_steps = r["flatgrad"]
            assert s_steps == f_steps
            assert all(torch.equal(a, b) for a, b in zip(s_at_load, f_at_load)), (rank, cell)
            assert s_losses == f_losses == r["continued"], (rank, cell)
            assert len(s_masters) == len(f_masters) == len(r["continued_masters"])
            for a, b, c in zip(s_masters, f_masters, r["continued_masters"]):
                assert torch.equal(a, b) and torch.equal(b, c), (rank, cell)
            for name, p in f_params.items():
                assert torch.equal(s_params[name], p), (rank, cell, name)


def _save_one_rank_rank(rank, world_size, root):
    engine = _engine("stock", ds_config(2, world_size=world_size, bucket=500))
    train(engine, make_batches(rank, 2, 2, D_IN, D_OUT))
    engine.save_checkpoint(os.path.join(root, "one_rank"), tag="t")


def _bad_input_rank(rank, world_size, root):
    import deepspeed.comm as dist

    from deepspeed.runtime.zero.utils import ZeRORuntimeException

    import flatgrad.deepspeed as fds
    from flatgrad.integrations.deepspeed.zero2.checkpoint import CheckpointLoadError

    cfg = ds_config(2, world_size=world_size, bucket=500)
    batches = make_batches(rank, 4, 2, D_IN, D_OUT)
    good = os.path.join(root, "good")
    engine = _engine("stock", cfg)
    train(engine, batches[:2])
    engine.save_checkpoint(good, tag="t")
    engine.destroy()
    dist.barrier()
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    def variant(name, edit):
        path = os.path.join(root, name)
        if rank == 0:
            shutil.copytree(good, path)
            edit(os.path.join(path, "t"))
        dist.barrier()
        return path

    def truncate(folder):
        with open(os.path.join(folder, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(folder, shard)) // 2)

    def garbage(folder):
        with open(os.path.join(folder, shard), "wb") as f:
            f.write(os.urandom(4096))

    def edit_state(change):
        def edit(folder):
            sd = torch.load(os.path.join(folder, shard), weights_only=False)
            change(sd["optimizer_state_dict"])
            torch.save(sd, os.path.join(folder, shard))

        return edit

    def zero3(sd):  # the keys of a ZeRO-3 (and MiCS) shard: stage 3, flat fp32 groups
        sd["zero_stage"] = 3
        sd["fp32_flat_groups"] = sd.pop("single_partition_of_fp32_groups")

    def pipeline(folder):  # a pipeline engine saves its modules layer by layer
        shutil.copy(os.path.join(folder, "mp_rank_00_model_states.pt"), os.path.join(folder, "layer_01-model_states.pt"))

    cases = {
        "world size": os.path.join(root, "one_rank"),
        "truncated": variant("truncated", truncate),
        "garbage": variant("garbage", garbage),
        "missing key": variant("missing_key", edit_state(lambda sd: sd.pop("base_optimizer_state"))),
        "zero3": variant("zero3", edit_state(zero3)),
        "pipeline": variant("pipeline", pipeline),
    }
    target = _engine("flatgrad", cfg, seed=1)
    train(target, batches[:1])
    masters, params, steps = _masters(target), params_of(target), target.global_steps
    out = {}
    for name, path in cases.items():
        try:
            target.load_checkpoint(path, tag="t")
            out[name] = None
        except (fds.UnsupportedConfigError, CheckpointLoadError) as exc:
            out[name] = (type(exc).__name__, str(exc))
            out[name + " is stock's"] = isinstance(exc, ZeRORuntimeException)
        unchanged = all(torch.equal(a, b) for a, b in zip(_masters(target), masters))
        unchanged = unchanged and all(torch.equal(p, params[n]) for n, p in params_of(target).items())
        out[name + " unchanged"] = unchanged and target.global_steps == steps
    target.load_checkpoint(good, tag="t")  # the engine still loads a good checkpoint, and trains on
    out["good steps"] = target.global_steps
    out["trains"] = train(target, batches[2:])
    stock_layout = _engine("flatgrad", {**cfg, "flatgrad": {"checkpoint_layout": "stock"}})
    train(stock_layout, batches[:1])
    stock_layout.optimizer.optimizer.param_groups[1]["lr"] = 0.5  # a sub-group's rate apart from its group's
    try:
        stock_layout.save_checkpoint(os.path.join(root, "disagree"), tag="t")
        out["disagree"] = None
    except fds.UnsupportedConfigError as exc:
        out["disagree"] = str(exc)
    folder = os.path.join(root, "disagree", "t")
    out["disagree written"] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    stock_layout.destroy()
    elastic = ds_config(2, world_size=world_size, bucket=500, elastic_checkpoint=True)
    try:
        _engine("flatgrad", {**elastic, "flatgrad": {"checkpoint_layout": "stock"}})
        out["elastic"] = None
    except fds.UnsupportedConfigError as exc:
        out["elastic"] = str(exc)
    return out


@pytest.mark.timeout(240)
def test_bad_checkpoints_are_refused_on_every_rank_naming_the_file_and_nothing_is_loaded(tmp_path):
    """Another world size, a truncated and a garbage rank-0 shard, a shard without a key, a ZeRO-3/MiCS shard and a
    pipeline engine's checkpoint: every rank raises (the bad shard is rank 0's), the message names the file or key,
    and the engine's fp32 masters, parameters and step count are unchanged. Another world size raises DeepSpeed's
    own ``ZeRORuntimeException`` too, as stock does for it. A stock-layout save is refused, naming
    both keys, with ``elastic_checkpoint`` (another kind of shard); a stock-layout save whose sub-groups of one
    group disagree on a hyperparameter is refused naming it, before any file is written.

    DeepSpeed makes neither MiCS (ZeRO-3 over sub-groups of ranks) nor pipeline checkpoints of this model cheaply on
    CPU, so those two are hand-edited from a stock ZeRO-2 checkpoint: a shard with the ZeRO-3 keys (``zero_stage``
    3, ``fp32_flat_groups``), and a folder with a pipeline engine's per-layer module file.
    """
    launch(_save_one_rank_rank, 1, str(tmp_path))
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    for rank, out in enumerate(launch(_bad_input_rank, 2, str(tmp_path), timeout=220)):
        for name in ("world size", "truncated", "garbage", "missing key", "zero3", "pipeline"):
            assert out[name] is not None, (rank, name)
            assert out[name + " unchanged"], (rank, name)
        kind, message = out["world size"]
        assert kind == "CheckpointWorldSizeError", out["world size"]
        assert out["world size is stock's"], "not the ZeRORuntimeException stock raises for another DP world size"
        assert not out["truncated is stock's"]
        assert "saved by 1 data-parallel rank(s), this run has 2" in message, message
        assert "ds_to_universal" in message and "checkpoint.load_universal" in message, message
        for name in ("truncated", "garbage"):
            kind, message = out[name]
            assert kind == "CheckpointLoadError" and os.path.join(name, "t", shard) in message, (rank, out[name])
        kind, message = out["missing key"]
        assert kind == "CheckpointLoadError" and "'base_optimizer_state'" in message and shard in message, message
        kind, message = out["zero3"]
        assert kind == "UnsupportedConfigError" and "ZeRO-3" in message and shard in message, message
        kind, message = out["pipeline"]
        assert kind == "UnsupportedConfigError" and "pipeline" in message and "layer_01" in message, message
        if rank == 1:  # the bad shard is rank 0's: rank 1 says whose it was
            assert "rank 0:" in out["truncated"][1], out["truncated"]
        assert out["good steps"] == 2 and len(out["trains"]) == 2
        assert out["elastic"] is not None and "zero_optimization.elastic_checkpoint" in out["elastic"], out["elastic"]
        assert "flatgrad.checkpoint_layout" in out["elastic"], out["elastic"]
        assert out["disagree"] is not None and "differ in 'lr'" in out["disagree"], out["disagree"]
        assert out["disagree written"] == [], out["disagree written"]  # refused before anything is written


def _differences(a, b, path="") -> list[str]:
    """The key paths where two checkpoint objects differ (tensors bitwise, ``fragment_address`` by its fields, dicts
    by their keys in any order: a dict's order means nothing to a loader; ``param_shapes``' is compared as a list)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
        return [] if same and torch.equal(a, b) else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a, key=str) != sorted(b, key=str):
            return [f"{path} keys {list(a)} != {list(b)}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length {len(a)} != {len(b)}"]
        return [d for k, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{k}]")]
    if hasattr(a, "__dataclass_fields__"):
        return _differences(vars(a), vars(b), path) if type(a) is type(b) else [f"{path} type"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# Each cell: (stage, gas, bucket, client optimizer with two param groups and a client LambdaLR, round_robin_gradients).
ROUND_TRIP = [(2, 2, 500, False, False), (1, 1, 300, True, True)]
SHARD_KEYS = (
    "single_partition_of_fp32_groups", "base_optimizer_state", "group_paddings", "param_alignment_paddings",
    "partition_count", "param_slice_mappings", "zero_stage",
)  # fmt: skip


def _round_trip_rank(rank, world_size, root):
    import deepspeed.comm as dist

    shard = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    out = []
    for c, (stage, gas, bucket, groups, round_robin) in enumerate(ROUND_TRIP):
        zero = {"round_robin_gradients": True} if round_robin else {}
        cfg = ds_config(stage, gas=gas, world_size=world_size, bucket=bucket, optimizer=not groups, **zero)
        if groups:
            cfg["zero_allow_untested_optimizer"] = True
        to_stock = {**cfg, "flatgrad": {"checkpoint_layout": "stock"}}
        batches = make_batches(rank, 12 * gas, 2, D_IN, D_OUT)
        a, b = 4 * gas, 8 * gas
        folder = {k: os.path.join(root, f"{c}_{k}") for k in ("stock_a", "stock_b", "flatgrad_b")}
        engine = _engine("stock", cfg, groups, scheduler=groups)  # the uninterrupted stock run, saving on the way
        straight = train(engine, batches[:a])
        engine.save_checkpoint(folder["stock_a"], tag="t")
        straight += train(engine, batches[a:b])
        engine.save_checkpoint(folder["stock_b"], tag="t")
        straight += train(engine, batches[b:])
        straight_masters, straight_params = _masters(engine), params_of(engine)
        straight_lrs = [g["lr"] for g in engine.optimizer.param_groups]
        engine.destroy()
        dist.barrier()
        engine = _engine("flatgrad", to_stock, groups, seed=1, scheduler=groups)  # flatgrad on: resume stock's
        engine.load_checkpoint(folder["stock_a"], tag="t")
        under_flatgrad = train(engine, batches[a:b])
        engine.save_checkpoint(folder["flatgrad_b"], tag="t")  # in stock's layout
        sub_groups = len(engine.optimizer.bit16_groups)
        engine.destroy()
        dist.barrier()
        result = {"straight": straight, "under_flatgrad": under_flatgrad, "sub_groups": sub_groups}
        for kind in ("stock", "flatgrad"):  # flatgrad off again (stock resumes it), and flatgrad resumes it too
            engine = _engine(kind, cfg if kind == "stock" else to_stock, groups, seed=2, scheduler=groups)
            engine.load_checkpoint(folder["flatgrad_b"], tag="t")
            result[kind] = (train(engine, batches[b:]), _masters(engine), params_of(engine))
            result[kind + "_lrs"] = [g["lr"] for g in engine.optimizer.param_groups]
            result[kind + "_groups"] = len(engine.optimizer.bit16_groups)
            engine.destroy()
        result["straight_masters"], result["straight_params"] = straight_masters, straight_params
        result["straight_lrs"] = straight_lrs
        saved = {
            k: torch.load(os.path.join(folder[k], "t", shard), weights_only=False)["optimizer_state_dict"]
            for k in ("stock_b", "flatgrad_b")
        }  # fmt: skip
        stock_b, flatgrad_b = saved["stock_b"], saved["flatgrad_b"]
        result["shard"] = [d for key in SHARD_KEYS for d in _differences(stock_b[key], flatgrad_b[key], key)]
        if rank == 0:
            model = {
                k: torch.load(os.path.join(folder[k], "t", "mp_rank_00_model_states.pt"), weights_only=False)
                for k in ("stock_b", "flatgrad_b")
            }  # fmt: skip
            shapes = {k: [list(group.items()) for group in m["param_shapes"]] for k, m in model.items()}
            result["shapes"] = _differences(shapes["stock_b"], shapes["flatgrad_b"])  # in order, as zero_to_fp32 reads
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            fp32 = {k: get_fp32_state_dict_from_zero_checkpoint(folder[k], tag="t") for k in ("stock_b", "flatgrad_b")}
            result["fp32"] = _differences(dict(fp32["stock_b"]), dict(fp32["flatgrad_b"]))
        out.append(result)
    return out


@pytest.mark.timeout(400)
def test_stock_to_flatgrad_to_stock_round_trip_trains_bitwise_like_an_uninterrupted_stock_run(tmp_path):
    """flatgrad switched on and off mid-run: stock trains and saves; flatgrad resumes it, trains and saves with
    ``checkpoint_layout: stock``; stock resumes that and trains on. Losses, fp32 masters and parameters are bitwise
    an uninterrupted stock run's; flatgrad's shard is bitwise the shard stock saved at the same step (fp32 masters,
    optimizer state, paddings, slice mappings), the model file's ``param_shapes`` are stock's, and
    ``zero_to_fp32`` reads the same weights from both. flatgrad resumes its stock-layout checkpoint too. Cells: ZeRO-2
    with GA 2 and AdamW from the config; ZeRO-1 with round-robin gradients, a client AdamW of two param groups of
    different rates and a client LambdaLR, whose per-group lists cross between the groups and the sub-groups."""
    for rank, cells in enumerate(launch(_round_trip_rank, 2, str(tmp_path), timeout=380)):
        for cell, r in zip(ROUND_TRIP, cells):
            gas = cell[1]
            assert r["stock_groups"] < r["sub_groups"] == r["flatgrad_groups"], (cell, r["stock_groups"])
            assert r["under_flatgrad"] == r["straight"][4 * gas : 8 * gas], (rank, cell)
            assert r["shard"] == [], (rank, cell, r["shard"])
            if rank == 0:
                assert r["shapes"] == [] and r["fp32"] == [], (cell, r["shapes"], r["fp32"])
            assert r["stock_lrs"] == r["straight_lrs"], (rank, cell, r["stock_lrs"], r["straight_lrs"])
            origins = sorted(set(r["flatgrad_lrs"]))  # each unsplit group's rate, on every one of its sub-groups
            assert origins == sorted(set(r["straight_lrs"])) and len(r["flatgrad_lrs"]) == r["sub_groups"], (rank, cell)
            for kind in ("stock", "flatgrad"):
                losses, masters, params = r[kind]
                assert losses == r["straight"][8 * gas :], (rank, cell, kind)
                if kind == "stock":
                    assert all(torch.equal(x, y) for x, y in zip(masters, r["straight_masters"])), (rank, cell)
                for name, p in params.items():
                    assert torch.equal(r["straight_params"][name], p), (rank, cell, kind, name)
