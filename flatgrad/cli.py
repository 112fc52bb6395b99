"""The ``flatgrad`` command: ``flatgrad demo``, ``flatgrad bench``, ``flatgrad plan`` and ``flatgrad check``.

A subcommand is a module with ``add_arguments(parser)`` and
``run_from_args(args) -> int`` (exit status) whose docstring's first paragraph
describes it; adding one is one entry in ``_COMMANDS``. This is the top layer:
it may import everything below it.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Sequence

__all__ = ["build_parser", "main", "positive_int"]

# name -> (module, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "flatgrad.demo.command",
        "train the seed MoE model on W ranks under stock DeepSpeed and flatgrad ZeRO-2/3, side by side",
    ),
    "bench": (
        "flatgrad.bench.pack_unpack",
        "pack/unpack throughput against DeepSpeed ZeRO-3, narrow().copy_, torch._chunk_cat and a copy_ roofline",
    ),
    "plan": (
        "flatgrad.planner.command",
        "per-backward collective schedules of stock DeepSpeed and flatgrad at any world size, without GPUs",
    ),
    "check": (
        "flatgrad.check.command",
        "validate flatgrad on a GPU node in one budgeted run (--dry-run: any machine, no GPU)",
    ),
}


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, also written as ``5e8``."""
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``flatgrad`` argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="flatgrad",
        description="One fused pack, one reduce_scatter and one fused unpack per gradient bucket.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in _COMMANDS.items():
        module = importlib.import_module(module_name)
        command = subparsers.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).split("\n\n")[0],
        )
        module.add_arguments(command)
        command.set_defaults(func=module.run_from_args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
