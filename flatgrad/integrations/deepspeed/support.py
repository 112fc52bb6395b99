"""What flatgrad takes over under DeepSpeed, and what it refuses: one table for every stage, each row naming its key.

A config that hits a row is refused before DeepSpeed starts (``initialize``
raises, the ``FLATGRAD_DEEPSPEED=1`` patch warns and hands it to stock), with an
``UnsupportedConfigError`` that names every refused feature and its config key.
Refusals that depend on the call rather than the config (an LR scheduler bound
to the optimizer, a ZeRO-3 engine without an optimizer) live in ``initialize``.
DeepSpeed's qgZ key is taken over rather than refused (``take_over_qgz``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping

from .config import FlatgradConfig, UnsupportedConfigError, offload_device

__all__ = [
    "QGZ_KEY", "REFUSALS", "Refusal", "check_supported", "config_value", "refusals", "take_over_qgz", "zero_stage",
]  # fmt: skip

# DeepSpeed's ZeRO++ qgZ switch: under ZeRO-3, flatgrad serves it with its own qgz_int8.
QGZ_KEY = "zero_optimization.zero_quantized_gradients"

_MUON_OPTIMIZERS = ("muon", "muonwithauxadam", "muadam", "muadamw", "musgd")
_COMM_DTYPES = ("fp32", "fp16", "bf16", "float32", "float16", "bfloat16")


def config_value(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """The value at the dotted key ``dotted`` of a DeepSpeed config, or ``default``."""
    node: Any = config
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return default
        node = node[key]
    return node


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 when absent; the deprecated ``true`` is 1)."""
    zero = ds_config.get("zero_optimization")
    if zero is None:
        return 0
    if isinstance(zero, bool):
        return int(zero)
    return int(zero.get("stage", 0) if isinstance(zero, Mapping) else 0)


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One feature flatgrad does not take over.

    Attributes:
        key: the DeepSpeed config key that turns it on, named in the error.
        stages: the ZeRO stages it is refused under.
        feature: what it is, for the error.
        why: why flatgrad refuses it, or what to do instead.
        hit: the config's value that triggers the refusal, or ``None`` when the config does not ask for it.
    """

    key: str
    stages: tuple[int, ...]
    feature: str
    why: str
    hit: Callable[[Mapping[str, Any]], Any]

    def message(self, ds_config: Mapping[str, Any]) -> str:
        return f"{self.feature} ('{self.key}' = {self.hit(ds_config)!r}): {self.why}"


def _offload_to(section_key: str, devices: tuple[str, ...]) -> Callable[[Mapping[str, Any]], Any]:
    """The device of the ``offload_*`` section at ``section_key`` when it is one of ``devices``."""

    def hit(ds_config: Mapping[str, Any]) -> str | None:
        device = offload_device(config_value(ds_config, section_key))
        return device if device in devices else None

    return hit


def _stage1_bf16_fp32_accumulation(ds_config: Mapping[str, Any]) -> str | None:
    accum = str(config_value(ds_config, "data_types.grad_accum_dtype", "")).lower()
    if zero_stage(ds_config) == 1 and _enabled(ds_config.get("bf16")) and accum in ("fp32", "float32", "float", "torch.float32"):
        return accum
    return None


def _comm_dtype(ds_config: Mapping[str, Any]) -> str | None:
    value = ds_config.get("communication_data_type")
    return None if value is None or str(value).lower() in _COMM_DTYPES else value


def _truthy(key: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda ds_config: config_value(ds_config, key) or None


def _present(key: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda ds_config: config_value(ds_config, key)


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "zero_optimization.offload_optimizer.device", (1, 2, 3), "NVMe optimizer offload",
        "DeepSpeed swaps the optimizer state through its NVMe swapper, which flatgrad does not serve; "
        "offload to 'cpu' instead", _offload_to("zero_optimization.offload_optimizer", ("nvme",)),
    ),
    Refusal(
        "zero_optimization.offload_param.device", (3,), "NVMe parameter offload",
        "DeepSpeed swaps the parameters through its NVMe swapper, which flatgrad does not serve; offload to 'cpu' instead",
        _offload_to("zero_optimization.offload_param", ("nvme",)),
    ),
    Refusal(
        "zero_optimization.zenflow", (1, 2, 3), "ZenFlow",
        "it selects and transposes gradients in the bucket that flatgrad packs", _present("zero_optimization.zenflow"),
    ),
    Refusal(
        "compile.deepcompile", (1, 2, 3), "DeepCompile", "it installs its own gradient hooks on the same seam",
        _truthy("compile.deepcompile"),
    ),
    Refusal(
        "zero_optimization.parameter_alignment", (1, 2), "per-parameter alignment padding",
        "the sub-group layout is a plain concatenation", _truthy("zero_optimization.parameter_alignment"),
    ),
    Refusal(
        "torch_autocast.enabled", (1, 2), "torch autocast", "it gives parameters their own communication dtypes",
        lambda c: True if _enabled(c.get("torch_autocast")) else None,
    ),
    Refusal(
        "optimizer.type", (1, 2), "a Muon optimizer",
        "it rewrites gradients while DeepSpeed builds the partition, which flatgrad replaces",
        lambda c: t if (t := str(config_value(c, "optimizer.type", "") or "").lower()) in _MUON_OPTIMIZERS else None,
    ),
    Refusal(
        "sequence_parallel_size", (1, 2), "sequence parallelism", "gradients are averaged over another group",
        lambda c: None if c.get("sequence_parallel_size", 1) in (None, 1) else c.get("sequence_parallel_size"),
    ),
    Refusal(
        "data_types.grad_accum_dtype", (1,), "ZeRO-1 with bf16 and fp32 gradient accumulation",
        "DeepSpeed runs its BF16_Optimizer then, not ZeRO; use stage 2, whose partitions accumulate in fp32",
        _stage1_bf16_fp32_accumulation,
    ),
    Refusal(
        "communication_data_type", (1, 2), "this communication dtype", "flatgrad communicates in fp32, fp16 or bf16",
        _comm_dtype,
    ),
    Refusal(
        "zero_optimization.reduce_scatter", (3,), "all-reduce gradient averaging",
        "flatgrad's ZeRO-3 path always reduce-scatters; remove the key",
        lambda c: False if config_value(c, "zero_optimization.reduce_scatter", True) is False else None,
    ),
    Refusal(
        "expert_parallel.enabled", (3,), "AutoEP", "expert gradients are averaged over a different world size",
        _truthy("expert_parallel.enabled"),
    ),
)  # fmt: skip


def refusals(ds_config: Mapping[str, Any]) -> list[str]:
    """Every refused feature of ``ds_config`` (without its ``"flatgrad"`` section) at its stage, as messages."""
    stage = zero_stage(ds_config)
    return [r.message(ds_config) for r in REFUSALS if stage in r.stages and r.hit(ds_config) is not None]


def check_supported(ds_config: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedConfigError`` naming every refused feature and key of ``ds_config``, if any."""
    found = refusals(ds_config)
    if found:
        raise UnsupportedConfigError(
            f"flatgrad's ZeRO-{zero_stage(ds_config)} backend does not support: " + "; ".join(found)
        )


def take_over_qgz(ds_config: dict, config: FlatgradConfig) -> FlatgradConfig:
    """Serve DeepSpeed's qgZ key (``QGZ_KEY``) under ZeRO-3 with flatgrad's ``qgz_int8``, node size from the launcher.

    The key leaves ``ds_config`` (in place), so that DeepSpeed makes no qgZ groups of its own; an explicit
    ``flatgrad.reduction`` wins over it, with one warning. Other stages, a false key, or flatgrad disabled:
    ``config`` and ``ds_config`` unchanged.
    """
    if not config.enabled or zero_stage(ds_config) != 3 or not config_value(ds_config, QGZ_KEY):
        return config
    ds_config["zero_optimization"].pop("zero_quantized_gradients")
    if config.reduction_key is not None:
        warnings.warn(
            f"flatgrad: '{config.reduction_key}' = {config.reduction!r} wins over '{QGZ_KEY}' = true; DeepSpeed's "
            "qgZ is not run",
            stacklevel=3,
        )
        return config
    return dataclasses.replace(config, reduction="qgz_int8", reduction_key=QGZ_KEY)
