"""Hugging Face ``Trainer`` with the Transformers DeepSpeed guide's ZeRO-2 and ZeRO-3 example configs (optimizer
offload; ZeRO-3 parameter offload too), unchanged, on 2 real gloo ranks: stock DeepSpeed against
``flatgrad.deepspeed.patch()``.

The configs below are the guide's examples as a user copies them: CPU offload with
pinned memory, ``overlap_comm``, and ``"auto"`` for everything the ``Trainer`` fills
in. The model is a small GPT-2 built from its config (no download).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _ds import launch

pytestmark = pytest.mark.multiproc

transformers = pytest.importorskip("transformers", reason="the Trainer tests need the transformers package")
pytest.importorskip("accelerate", reason="transformers' DeepSpeed integration needs the accelerate package")

HF_ZERO2_OFFLOAD = {
    "fp16": {
        "enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip


HF_ZERO3_OFFLOAD = {
    "fp16": HF_ZERO2_OFFLOAD["fp16"],
    "optimizer": HF_ZERO2_OFFLOAD["optimizer"],
    "scheduler": HF_ZERO2_OFFLOAD["scheduler"],
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}  # fmt: skip


def _full_params(engine) -> dict:
    """The module's weights, gathered in full under ZeRO-3 (each rank holds a partition)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _gpt2(samples: int) -> tuple:
    """The small GPT-2 from seed 0 (built from its config, no download), and ``samples`` sequences of 16 tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    gen = torch.Generator().manual_seed(0)
    return model, [{"input_ids": ids, "labels": ids} for ids in torch.randint(128, (samples, 16), generator=gen)]


def _trainer_rank(rank: int, world_size: int, root: str, ds_config: dict) -> dict:
    import os

    import flatgrad.deepspeed as fds

    out = {}
    for kind in ("stock", "flatgrad"):
        if kind == "flatgrad":
            fds.patch()
        from transformers import Trainer, TrainingArguments

        model, data = _gpt2(64)
        args = TrainingArguments(
            output_dir=os.path.join(root, kind), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=6, learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
            report_to=[], use_cpu=True, seed=0, data_seed=0, deepspeed=copy.deepcopy(ds_config),
            disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        engine = trainer.model_wrapped
        out[kind] = {
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "flatgrad": getattr(engine.optimizer, "flatgrad", None) is not None,
            "offload": any(bool(getattr(engine.optimizer, name, False)) for name in ("cpu_offload", "offload_optimizer")),
            "params": _full_params(engine),
        }
        if kind == "flatgrad":
            fds.unpatch()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ds_config", [HF_ZERO2_OFFLOAD, HF_ZERO3_OFFLOAD], ids=["zero2", "zero3"])
def test_trainer_with_the_guides_offload_configs_engages_flatgrad_and_trains_like_stock(tmp_path, ds_config):
    for out in launch(_trainer_rank, 2, str(tmp_path), ds_config, timeout=580):
        stock, fg = out["stock"], out["flatgrad"]
        assert stock["offload"] and fg["offload"]
        assert not stock["flatgrad"] and fg["flatgrad"], "flatgrad did not take the Trainer's engine"
        assert len(fg["losses"]) == len(stock["losses"]) == 6
        # The Trainer logs losses to 4 decimals: the weights after 6 steps carry the finer comparison. Both run
        # DeepSpeedCPUAdam, whose scalar tail rounds unlike its vector body (tests/test_deepspeed_offload.py).
        assert max(abs(a - b) / abs(a) for a, b in zip(stock["losses"], fg["losses"])) <= 1e-5, (stock, fg)
        worst = max(
            ((stock["params"][n] - p).abs().max() / stock["params"][n].abs().max()).item() for n, p in fg["params"].items()
        )
        assert worst <= 1e-5, worst


# A ZeRO-3 + bf16 + overlap_comm config asking for DeepSpeed's ZeRO++ qgZ, as fine-tuning frameworks ship it.
HF_ZERO3_QGZ = {
    **{k: v for k, v in HF_ZERO3_OFFLOAD.items() if k not in ("fp16", "optimizer", "scheduler", "zero_optimization")},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        **{k: v for k, v in HF_ZERO3_OFFLOAD["zero_optimization"].items() if not k.startswith("offload_")},
        "zero_quantized_gradients": True,
    },
}


def _qgz_rank(rank: int, world_size: int, root: str) -> dict:
    import os
    import warnings

    from transformers import Trainer, TrainingArguments

    import flatgrad.deepspeed as fds

    fds.patch()
    model, data = _gpt2(16)
    args = TrainingArguments(
        output_dir=os.path.join(root, "qgz"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=True,
        seed=0, deepspeed=copy.deepcopy(HF_ZERO3_QGZ), disable_tqdm=True,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    fds.unpatch()
    engine = trainer.model_wrapped
    reduction = getattr(engine.optimizer, "flatgrad", None)
    return {
        "line": None if reduction is None else reduction.describe(),
        "modes": set() if reduction is None else {c.bucket.mode.name for c in reduction.compositions.values()},
        "ds_qgz": engine.zero_quantized_gradients(),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "warnings": [str(w.message) for w in caught if "flatgrad" in str(w.message)],
    }


@pytest.mark.timeout(300)
def test_trainer_with_the_qgz_key_under_zero3_bf16_runs_flatgrads_qgz(tmp_path):
    """The qgZ key engages flatgrad (DeepSpeed sees no qgZ); one node: flatgrad's qgz_int8 is the flat int8, and
    the take-over line and a warning say so."""
    for out in launch(_qgz_rank, 2, str(tmp_path), timeout=280):
        assert out["line"] is not None, "flatgrad did not take the Trainer's engine"
        assert "DeepSpeed's qgZ ('zero_optimization.zero_quantized_gradients') runs as flatgrad's qgz_int8" in out["line"]
        assert "on one node (or one rank per node) is the flat int8" in out["line"], out["line"]
        assert out["modes"] == {"int8"} and not out["ds_qgz"], out
        assert any("'qgz_int8'" in w and "'int8'" in w for w in out["warnings"]), out["warnings"]
        assert len(out["losses"]) == 2 and all(math.isfinite(loss) for loss in out["losses"]), out["losses"]


# The guide's ZeRO-2 example without offload and in fp32, with torch's AdamW: the round trip is bitwise there. Its
# buckets are cut to 5000 elements so that flatgrad splits this small model into several sub-groups.
HF_ZERO2_FP32 = {
    **{k: v for k, v in HF_ZERO2_OFFLOAD.items() if k not in ("fp16", "optimizer", "zero_optimization")},
    "optimizer": {"type": "AdamW", "params": {**HF_ZERO2_OFFLOAD["optimizer"]["params"], "torch_adam": True}},
    "zero_optimization": {
        **{k: v for k, v in HF_ZERO2_OFFLOAD["zero_optimization"].items() if k != "offload_optimizer"},
        "reduce_bucket_size": 5000,
    },
}


def _round_trip_rank(rank: int, world_size: int, root: str, scheduler: str) -> dict:
    import os

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import flatgrad.deepspeed as fds

    def run(kind: str, out: str, resume: str | None) -> dict:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        model = GPT2LMHeadModel(config)
        gen = torch.Generator().manual_seed(0)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(128, (64, 16), generator=gen)]
        ds = copy.deepcopy(HF_ZERO2_FP32)
        if scheduler == "trainer":  # no DeepSpeed scheduler: the Trainer builds its own torch LambdaLR on the engine
            del ds["scheduler"]
        if kind == "flatgrad":
            ds["flatgrad"] = {"checkpoint_layout": "stock"}
            fds.patch()
        args = TrainingArguments(
            output_dir=os.path.join(root, out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=9, learning_rate=1e-3, warmup_steps=2, max_grad_norm=1.0, logging_steps=1, save_strategy="steps",
            save_steps=3, report_to=[], use_cpu=True, seed=0, data_seed=0, deepspeed=ds, disable_tqdm=True,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": 1e-4},
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        if kind == "flatgrad":
            fds.unpatch()
        engine = trainer.model_wrapped
        return {
            "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
            "lrs": sorted({g["lr"] for g in engine.optimizer.param_groups}),
            "groups": len(engine.optimizer.param_groups),
            "scheduler": type(engine.lr_scheduler).__name__,
            "flatgrad": getattr(engine.optimizer, "flatgrad", None) is not None,
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
        }

    straight = run("stock", "straight", None)  # saves checkpoint-3, -6, -9 on the way
    on = run("flatgrad", "on", os.path.join(root, "straight", "checkpoint-3"))
    off = run("stock", "off", os.path.join(root, "on", "checkpoint-6"))
    shard = os.path.join("checkpoint-6", "global_step6", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    saved = [torch.load(os.path.join(root, k, shard), weights_only=False) for k in ("straight", "on")]
    groups = [sd["optimizer_state_dict"]["single_partition_of_fp32_groups"] for sd in saved]
    fp32 = len(groups[0]) == len(groups[1]) and all(torch.equal(a, b) for a, b in zip(*groups))
    return {"straight": straight, "on": on, "off": off, "fp32 equal": fp32}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scheduler", ["deepspeed", "trainer"])
def test_trainer_round_trip_stock_flatgrad_stock_trains_like_an_uninterrupted_run(tmp_path, scheduler):
    """Through the Trainer, fp32 ZeRO-2: stock trains 9 steps, saving every 3 (the uninterrupted run); flatgrad
    resumes its checkpoint-3 and saves with ``checkpoint_layout: stock``; stock resumes flatgrad's checkpoint-6. Every
    loss logged after a resume equals the uninterrupted run's at the same step, and the final weights are bitwise
    equal; flatgrad's checkpoint-6 holds the same fp32 masters as stock's. The LR schedule is DeepSpeed's WarmupLR
    (the config's), or the Trainer's own cosine schedule, a torch LambdaLR over the engine's param groups (each
    sub-group under flatgrad) whose ``scheduler.pt`` the Trainer saves and loads itself."""
    for rank, out in enumerate(launch(_round_trip_rank, 2, str(tmp_path), scheduler, timeout=580)):
        straight, on, off = out["straight"], out["on"], out["off"]
        assert straight["scheduler"] == ("WarmupLR" if scheduler == "deepspeed" else "LambdaLR"), straight["scheduler"]
        assert straight["groups"] == off["groups"] == 1 < on["groups"], (straight["groups"], on["groups"])
        assert len(on["lrs"]) == 1 and on["lrs"] == straight["lrs"] == off["lrs"], (on["lrs"], straight["lrs"])
        assert on["flatgrad"] and not straight["flatgrad"] and not off["flatgrad"], "flatgrad on only in the middle run"
        for run in (straight, on, off):  # a resumed run's history carries the steps before it, from the checkpoint
            assert sorted(run["losses"]) == list(range(1, 10)), run["losses"]
        for resumed in (on, off):
            for step, loss in resumed["losses"].items():
                assert loss == straight["losses"][step], (rank, step, loss, straight["losses"][step])
            for name, p in resumed["params"].items():
                assert torch.equal(p, straight["params"][name]), (rank, name)
        assert out["fp32 equal"], rank
