"""The check's ``backends`` step: ``flatgrad.available_backends()`` as one JSON line.

``python -m flatgrad.check.backends``; exit status 1 unless ``cuda`` and ``triton`` both run on CUDA tensors.
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line (no options)."""
    return argparse.ArgumentParser(prog="python -m flatgrad.check.backends",
                                   description=(__doc__ or "").splitlines()[0])  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Print every backend's status; 1 when ``cuda`` or ``triton`` cannot run on CUDA tensors."""
    build_parser().parse_args(argv)
    import flatgrad

    status = flatgrad.available_backends()
    print(json.dumps({n: {"available": s.available, "devices": list(s.devices), "reason": s.reason}
                      for n, s in status.items()}))  # fmt: skip
    missing = [n for n in ("cuda", "triton") if not (status[n].available and "cuda" in status[n].devices)]
    if missing:
        print("not running on CUDA tensors: " + ", ".join(f"{n} ({status[n].reason})" for n in missing))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
