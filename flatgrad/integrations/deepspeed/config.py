"""The ``"flatgrad"`` section of a DeepSpeed config, and the DeepSpeed version gate.

DeepSpeed never sees the section: ``split_config`` returns the config without
it. Unknown keys are refused, so a typo never silently falls back to stock.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import warnings
from typing import Any, Mapping

from ...reducer import registry

SECTION = "flatgrad"
SUPPORTED_DEEPSPEED = ((0, 19, 2), (0, 20, 0))  # [min, max): the seams in docs/design.md exist in 0.19.2+

_COMM_DTYPES = ("fp32", "bf16", "fp16")
_METHODS = ("auto", "tensor", "list")
_LAYOUTS = ("flatgrad", "stock")


class UnsupportedConfigError(ValueError):
    """A DeepSpeed config or feature that flatgrad does not handle; names the feature and key."""


@dataclasses.dataclass(frozen=True)
class FlatgradConfig:
    """Options of the ``"flatgrad"`` section.

    Attributes:
        enabled: route gradient reduction through flatgrad (False: stock DeepSpeed).
        backend: force a kernel backend (``cuda``, ``triton``, ``cpu``, ``torch``); None chooses.
        comm_dtype: dtype of the reduce_scatter buffer (``fp32``, ``bf16``, ``fp16``); None uses
            what stock DeepSpeed communicates in (the gradients' dtype, or
            ``communication_data_type``).
        bucket_numel: ZeRO-1/2 sub-group size, ZeRO-3 bucket size, in elements; None uses
            ``reduce_bucket_size``.
        reduce_scatter_method: how the reduce_scatter is called: ``auto`` (``reduce_scatter_tensor``
            on NCCL, the list form on gloo; under ZeRO-3 always the tensor form, the collective stock
            ZeRO-3 issues, which keeps results bitwise equal to stock), ``tensor`` or ``list``. The
            former key ``reduce_scatter`` still works, with a deprecation warning.
        comm_buffers: ZeRO-1/2: how many bucket-sized comm buffers all sub-groups share during a
            backward; None (the default) takes as many as stock's IPG buffers: 2 with
            ``zero_optimization.overlap_comm`` (a pack overlaps the previous collective), else 1
            (they serialise, and one bucket of memory is saved).
        reduction: a mode of ``flatgrad.reducer.registry.MODES`` (``reduce_scatter`` by default); the
            registry says which ZeRO stages serve each (docs/design.md, "Reduction modes", has the table).
        block: the quantized modes (those with a wire kind): elements per fp32 scale, a power of two in [32, 4096].
        error_feedback: the quantized reductions: carry each rank's quantization error into its next step.
        node_size: two-stage reductions: ranks per node; None (the default) takes the launcher's
            ``LOCAL_WORLD_SIZE``, else the world size. It must divide the world size and equal
            ``LOCAL_WORLD_SIZE`` where that is set (checked on every rank when the reducers are built).
        checkpoint_layout: how ZeRO-1/2's ``engine.save_checkpoint`` lays out the optimizer shards: ``flatgrad``
            (the default: the bucket-sized sub-groups as they are, no extra communication) or ``stock`` (stock
            DeepSpeed's layout of the unsplit param groups, re-partitioned at save by one ``all_to_all`` per state
            tensor, which stock DeepSpeed loads, and flatgrad too). ZeRO-3's checkpoints are stock's layout either way.
        announce: print the take-over line (stage, sub-groups, buckets, method) on rank 0's stderr;
            ``FLATGRAD_QUIET=1`` silences it too.
        reduction_key: not a section key: the config key that chose ``reduction``, named in the take-over
            line and in errors (``flatgrad.reduction`` when the section sets it, DeepSpeed's
            ``zero_optimization.zero_quantized_gradients`` when that key engaged ``qgz_int8``; ``None``: the default).
    """

    enabled: bool = True
    backend: str | None = None
    comm_dtype: str | None = None
    bucket_numel: int | None = None
    reduce_scatter_method: str = "auto"
    comm_buffers: int | None = None
    reduction: str = "reduce_scatter"
    block: int = 256
    error_feedback: bool = False
    node_size: int | None = None
    checkpoint_layout: str = "flatgrad"
    announce: bool = True
    reduction_key: str | None = None

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> "FlatgradConfig":
        """Validate a ``"flatgrad"`` section; every error names the key."""
        section = _renamed(dict(section or {}))
        known = {f.name for f in dataclasses.fields(cls)} - {"reduction_key"}
        unknown = sorted(set(section) - known)
        if unknown:
            raise UnsupportedConfigError(f"unknown key(s) {unknown} in the '{SECTION}' config section; known: {sorted(known)}")
        numel = section.get("bucket_numel")
        if isinstance(numel, float) and numel.is_integer():  # JSON configs write sizes as 5e8
            section["bucket_numel"] = int(numel)
        cfg = cls(**section, reduction_key=f"{SECTION}.reduction" if "reduction" in section else None)
        if not isinstance(cfg.enabled, bool):
            raise UnsupportedConfigError(f"'{SECTION}.enabled' must be true or false, got {cfg.enabled!r}")
        if cfg.backend is not None:
            from ...kernels import BACKENDS

            if cfg.backend not in BACKENDS:
                raise UnsupportedConfigError(f"'{SECTION}.backend' must be one of {BACKENDS}, got {cfg.backend!r}")
        if cfg.comm_dtype is not None and cfg.comm_dtype not in _COMM_DTYPES:
            raise UnsupportedConfigError(f"'{SECTION}.comm_dtype' must be one of {_COMM_DTYPES}, got {cfg.comm_dtype!r}")
        if cfg.bucket_numel is not None and (
            isinstance(cfg.bucket_numel, bool) or not isinstance(cfg.bucket_numel, int) or cfg.bucket_numel < 1
        ):
            raise UnsupportedConfigError(f"'{SECTION}.bucket_numel' must be a positive int, got {cfg.bucket_numel!r}")
        if cfg.comm_buffers is not None and (
            isinstance(cfg.comm_buffers, bool) or not isinstance(cfg.comm_buffers, int) or cfg.comm_buffers < 1
        ):
            raise UnsupportedConfigError(
                f"'{SECTION}.comm_buffers' must be an int >= 1, got {cfg.comm_buffers!r}"
            )
        if cfg.reduce_scatter_method not in _METHODS:
            raise UnsupportedConfigError(
                f"'{SECTION}.reduce_scatter_method' must be one of {_METHODS}, got {cfg.reduce_scatter_method!r}"
            )
        try:
            registry.check_options(cfg.reduction, cfg.block, cfg.error_feedback, key=lambda field: f"'{SECTION}.{field}'")
        except ValueError as exc:
            raise UnsupportedConfigError(str(exc)) from exc
        if cfg.node_size is not None and (
            isinstance(cfg.node_size, bool) or not isinstance(cfg.node_size, int) or cfg.node_size < 1
        ):
            raise UnsupportedConfigError(f"'{SECTION}.node_size' must be a positive int, got {cfg.node_size!r}")
        if cfg.checkpoint_layout not in _LAYOUTS:
            raise UnsupportedConfigError(
                f"'{SECTION}.checkpoint_layout' must be one of {_LAYOUTS}, got {cfg.checkpoint_layout!r}"
            )
        if not isinstance(cfg.announce, bool):
            raise UnsupportedConfigError(f"'{SECTION}.announce' must be true or false, got {cfg.announce!r}")
        return cfg

    def torch_comm_dtype(self):
        """``comm_dtype`` as a torch dtype, or None."""
        from ...kernels import DTYPE_NAMES

        return None if self.comm_dtype is None else DTYPE_NAMES[self.comm_dtype]


# former key -> its name now; the former one is read, with a warning, for one release
RENAMED = {"reduce_scatter": "reduce_scatter_method"}


def _renamed(section: dict) -> dict:
    """``section`` with former key names replaced by their new ones, each with a ``DeprecationWarning``."""
    for old, new in RENAMED.items():
        if old not in section:
            continue
        if new in section:
            raise UnsupportedConfigError(f"'{SECTION}.{old}' and '{SECTION}.{new}' are the same key; keep '{new}' only")
        warnings.warn(
            f"'{SECTION}.{old}' is renamed '{SECTION}.{new}' (it selects how the reduce_scatter is called, not the "
            "reduction); the old name will stop working in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        section[new] = section.pop(old)
    return section


def load_config(config: str | os.PathLike | Mapping[str, Any] | None) -> dict:
    """A DeepSpeed config (dict or JSON path) as a fresh dict."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise UnsupportedConfigError(f"config must be a dict or a JSON path, got {type(config).__name__}")


def split_config(config: str | os.PathLike | Mapping[str, Any] | None) -> tuple[dict, FlatgradConfig]:
    """``(deepspeed_config_without_flatgrad_section, FlatgradConfig)``."""
    ds_config = load_config(config)
    section = ds_config.pop(SECTION, None)
    if section is not None and not isinstance(section, Mapping):
        raise UnsupportedConfigError(f"the '{SECTION}' config section must be a dict, got {type(section).__name__}")
    return ds_config, FlatgradConfig.from_dict(section)


def offload_device(section: Any) -> str:
    """The device an ``offload_*`` config section names, lower case (``"none"`` without one).

    DeepSpeed's own code and tests write it as a string or as ``OffloadDeviceEnum``,
    whose ``str()`` is not the device name.
    """
    if not isinstance(section, Mapping):
        return "none"
    device = section.get("device", "none") or "none"
    return str(getattr(device, "value", device)).lower()


def deepspeed_version() -> tuple[int, int, int]:
    """The installed DeepSpeed version as a tuple (raises if DeepSpeed is missing)."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError("flatgrad.deepspeed needs DeepSpeed: pip install deepspeed==0.19.8") from exc
    parts = []
    for token in deepspeed.__version__.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in token if ch.isdigit())
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def check_deepspeed_version() -> None:
    """Refuse DeepSpeed versions whose seams flatgrad has not been checked against."""
    version = deepspeed_version()
    low, high = SUPPORTED_DEEPSPEED
    if not low <= version < high:
        raise UnsupportedConfigError(
            f"flatgrad.deepspeed supports DeepSpeed >= {'.'.join(map(str, low))} and < {'.'.join(map(str, high))}; "
            f"found {'.'.join(map(str, version))}. The seams it replaces (see docs/design.md) are version-specific."
        )
