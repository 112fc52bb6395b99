"""The check's ``env`` step: Python, torch, CUDA, NCCL, Triton, DeepSpeed, nvcc and every GPU, as one JSON line.

``python -m flatgrad.check.env``; exit status 1 when torch sees no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
from typing import Any, Sequence

__all__ = ["build_parser", "describe", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (no options)."""
    return argparse.ArgumentParser(prog="python -m flatgrad.check.env", description=(__doc__ or "").splitlines()[0])


def describe() -> dict[str, Any]:
    """What this machine has: versions, GPUs, the driver's clocks (a missing piece is described, not raised)."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        info["gpus"] = [
            {"name": torch.cuda.get_device_name(i), "capability": "%d.%d" % torch.cuda.get_device_capability(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
             "sms": torch.cuda.get_device_properties(i).multi_processor_count}
            for i in range(torch.cuda.device_count())
        ]  # fmt: skip
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # noqa: BLE001 - a CPU-only build has none
            info["nccl"] = f"unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        info["torch"] = f"unavailable: {exc}"
    for name in ("triton", "deepspeed", "flatgrad"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            info[name] = f"unavailable: {type(exc).__name__}: {exc}"
    info["ninja"] = shutil.which("ninja") or "not found: the build step compiles one file at a time"
    nvcc = shutil.which("nvcc")
    if nvcc:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        info["nvcc"] = next((line for line in version.splitlines() if "release" in line), version.strip())
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu", "--format=csv,noheader"]
        info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return info


def main(argv: Sequence[str] | None = None) -> int:
    """Print the JSON line; 1 when no CUDA device is visible."""
    build_parser().parse_args(argv)
    info = describe()
    print(json.dumps(info))
    if not info.get("gpus"):
        print("no CUDA device is visible to torch")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
