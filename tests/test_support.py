"""flatgrad.integrations.deepspeed.support: every refusal row fires under its stages only, naming its key."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatgrad.integrations.deepspeed.config import UnsupportedConfigError
from flatgrad.integrations.deepspeed.support import REFUSALS, check_supported, refusals, zero_stage

# feature -> (its key, what turns it on, merged into a plain config)
_ON = {
    "NVMe optimizer offload": (
        "zero_optimization.offload_optimizer.device", {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    ),
    "NVMe parameter offload": (
        "zero_optimization.offload_param.device", {"zero_optimization": {"offload_param": {"device": "nvme"}}}
    ),
    "ZenFlow": ("zero_optimization.zenflow", {"zero_optimization": {"zenflow": {"topk_ratio": 0.1}}}),
    "DeepCompile": ("compile.deepcompile", {"compile": {"deepcompile": True}}),
    "per-parameter alignment padding": (
        "zero_optimization.parameter_alignment", {"zero_optimization": {"parameter_alignment": 8}}
    ),
    "torch autocast": ("torch_autocast.enabled", {"torch_autocast": {"enabled": True}}),
    "a Muon optimizer": ("optimizer.type", {"optimizer": {"type": "Muon", "params": {"lr": 0.01}}}),
    "sequence parallelism": ("sequence_parallel_size", {"sequence_parallel_size": 2}),
    "ZeRO-1 with bf16 and fp32 gradient accumulation": (
        "data_types.grad_accum_dtype", {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    ),
    "this communication dtype": ("communication_data_type", {"communication_data_type": "int8"}),
    "all-reduce gradient averaging": (
        "zero_optimization.reduce_scatter", {"zero_optimization": {"reduce_scatter": False}}
    ),
    "AutoEP": ("expert_parallel.enabled", {"expert_parallel": {"enabled": True}}),
}


def _config(stage: int, features) -> dict:
    cfg: dict = {"train_batch_size": 8, "zero_optimization": {"stage": stage}}
    for feature in features:
        for section, value in copy.deepcopy(_ON[feature][1]).items():
            if isinstance(value, dict):
                cfg.setdefault(section, {}).update(value)
            else:
                cfg[section] = value
    return cfg


def test_every_row_has_a_case_here():
    assert sorted(r.feature for r in REFUSALS) == sorted(_ON)
    assert all(_ON[r.feature][0] == r.key for r in REFUSALS)


@pytest.mark.parametrize("row", REFUSALS, ids=lambda r: r.key)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_row_fires_under_its_stages_only_and_names_its_key(row, stage: int):
    cfg = _config(stage, [row.feature])
    if stage not in row.stages:
        assert not [m for m in refusals(cfg) if m.startswith(f"{row.feature} ('{row.key}'")]
        return
    with pytest.raises(UnsupportedConfigError, match=f"'{row.key}'") as info:
        check_supported(cfg)
    assert f"ZeRO-{stage}" in str(info.value)


@settings(max_examples=60, deadline=None)
@given(stage=st.sampled_from([1, 2, 3]), features=st.sets(st.sampled_from(sorted(_ON))))
def test_any_mix_names_every_refused_key(stage: int, features: set):
    cfg = _config(stage, sorted(features))
    expected = {r.key for r in REFUSALS if r.feature in features and stage in r.stages}
    if not expected:
        check_supported(cfg)
        return
    with pytest.raises(UnsupportedConfigError) as info:
        check_supported(cfg)
    for key in expected:
        assert f"'{key}'" in str(info.value)


def test_plain_configs_and_offload_none_pass():
    for stage in (0, 1, 2, 3):
        cfg = _config(stage, [])
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "none"}
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
        check_supported(cfg)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        check_supported(cfg)  # CPU optimizer offload is served at every stage
        del cfg["zero_optimization"]["offload_optimizer"]
        cfg["zero_optimization"]["cpu_offload"] = True
        check_supported(cfg)



def test_zero_stage_reads_every_spelling():
    assert zero_stage({}) == 0
    assert zero_stage({"zero_optimization": True}) == 1
    assert zero_stage({"zero_optimization": {"stage": 3}}) == 3


# DeepSpeed's ZeRO++ keys: qgZ acts on gradients (flatgrad serves it); the others act on parameters (DeepSpeed's).
_ZERO_PP = {"zero_quantized_gradients": True, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
            "zero_quantized_nontrainable_weights": True}  # fmt: skip


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_pp_keys_are_not_refused(stage: int):
    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": stage, **_ZERO_PP}}
    assert refusals(cfg) == []


def test_qgz_key_runs_qgz_int8_under_zero3_and_leaves_the_config_deepspeed_sees():
    import warnings

    from flatgrad.integrations.deepspeed.config import FlatgradConfig
    from flatgrad.integrations.deepspeed.support import QGZ_KEY, take_over_qgz

    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, **_ZERO_PP}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        served = take_over_qgz(cfg, FlatgradConfig.from_dict({}))
    assert (served.reduction, served.reduction_key, served.node_size) == ("qgz_int8", QGZ_KEY, None)
    assert "zero_quantized_gradients" not in cfg["zero_optimization"]
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2 and cfg["zero_optimization"]["zero_quantized_weights"]
    # An explicit reduction wins over the key, with one warning naming both; the key still leaves the config.
    cfg = {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    with pytest.warns(UserWarning, match=r"'flatgrad.reduction' = 'int8' wins over 'zero_optimization.zero_quant"):
        explicit = take_over_qgz(cfg, FlatgradConfig.from_dict({"reduction": "int8"}))
    assert (explicit.reduction, explicit.reduction_key) == ("int8", "flatgrad.reduction") and cfg["zero_optimization"] == {"stage": 3}
    # Other stages, or flatgrad disabled: the key stays DeepSpeed's, the config flatgrad's.
    for stage, section in ((2, {}), (3, {"enabled": False})):
        cfg = {"zero_optimization": {"stage": stage, "zero_quantized_gradients": True}}
        same = FlatgradConfig.from_dict(section)
        assert take_over_qgz(cfg, same) is same and cfg["zero_optimization"]["zero_quantized_gradients"]
