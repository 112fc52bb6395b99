"""Check flatgrad on a GPU node in one run: kernels, ZeRO offload, stream order, wire, ZeRO steps, one summary.

Every step runs in its own process with its own timeout (``flatgrad.check.plan.BUDGET``; the default
timeouts add up to at most 480 s, so the default run fits in 8 minutes on one H200), all within one
overall budget (``--budget``; ``--quick`` halves the budget, the timeouts and the work). A step that
fails or times out is recorded and the next one runs. Results go to ``--out`` (default ``$OUT``, else
``./gpu-check-out``): ``summary.txt``, ``summary.json``, ``gpu_check.log`` and the steps' JSON.

The installed package runs every step but the checkout's: ``wheels``, ``build`` and the pytest steps
over ``tests/`` need ``--root CHECKOUT`` and are skipped without it. ``--dry-run`` runs no step and
needs no GPU: each step's module must import and parse its arguments with its own parser (with
``--root``, the checkout's files must exist and compile and its pytest selections collect some test);
it prints every command and the budget table.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Sequence

from .plan import Context, plan
from .runner import dry_run, run_all
from .summary import summary_text

__all__ = ["add_arguments", "run_from_args", "build_parser", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``flatgrad check`` and ``python -m flatgrad.check``."""
    parser.add_argument("--dry-run", action="store_true", help="check every step without running it (any machine)")
    parser.add_argument("--quick", action="store_true", help="half the budget, timeouts and work")
    parser.add_argument("--budget", type=float, help="seconds for all steps together (default 480; --quick 240)")
    parser.add_argument("--out", help="summary, log and JSON go here (default $OUT, else ./gpu-check-out)")
    parser.add_argument("--build-dir", help="build cache (default $FLATGRAD_BUILD_CACHE, else /tmp/flatgrad-gpu-check)")
    parser.add_argument("--root", metavar="CHECKOUT",
                        help="a source checkout: also run its build and its GPU tests (wheels, build, test-*)")
    parser.add_argument("--only", help="comma-separated steps to run (the others are reported as skipped)")
    parser.add_argument("--skip", help="comma-separated steps not to run")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m flatgrad.check``."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check", description=(__doc__ or "").split("\n\n")[0])
    add_arguments(parser)
    return parser


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_from_args(args: argparse.Namespace) -> int:
    """Run (or with ``--dry-run`` check) the steps; 0 when every step passed, 1 otherwise, 2 on bad options."""
    root = os.path.abspath(args.root) if args.root else None
    if root is not None and not os.path.isfile(os.path.join(root, "setup.py")):
        print(f"flatgrad check: --root {root} is not a flatgrad checkout (no setup.py)", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-check-out"))
    build_dir = os.path.abspath(args.build_dir or os.environ.get("FLATGRAD_BUILD_CACHE") or "/tmp/flatgrad-gpu-check")
    ctx = Context(root=root, out=out, build_dir=build_dir, quick=args.quick, site=os.path.join(build_dir, "site"))
    steps = plan(ctx)
    known = [s.name for s in steps]
    chosen = {}
    for option in ("only", "skip"):
        names = [n.strip() for n in (getattr(args, option) or "").split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"flatgrad check: --{option}: unknown step(s) {unknown}; steps: {', '.join(known)}", file=sys.stderr)
            return 2
        chosen[option] = set(names)

    def select(name: str) -> bool:
        return (not chosen["only"] or name in chosen["only"]) and name not in chosen["skip"]

    if args.dry_run:
        return dry_run([s for s in steps if select(s.name)], ctx)
    budget = args.budget if args.budget is not None else (240.0 if args.quick else 480.0)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed check still writes its summary
    doc = run_all(ctx, budget, select)
    print()
    print(summary_text(doc))
    print(f"summary: {os.path.join(out, 'summary.txt')} and summary.json; log: {os.path.join(out, 'gpu_check.log')}")
    return 0 if doc["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flatgrad.check``: parse ``argv`` and run."""
    return run_from_args(build_parser().parse_args(argv))
