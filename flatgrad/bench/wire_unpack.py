"""How close is the fused W-source unpack of the reduction modes to a plain copy?

The unpack of ``exact`` (``wire.sum_sources``) and of ``int8`` / ``fp8``
(``wire.dequantize_sum``) reads W received chunks and writes, or reads and
writes, one fp32 shard: its floor is the time a copy needs to move the same
bytes. The baseline beside it, measured in the same run at the same thread
count: ``torch.Tensor.copy_`` of a 64 MiB uint8 buffer gives the copy bandwidth
(bytes read + written per second); a row's ``x roofline`` is (its bytes / that
bandwidth) / its time. Target: >= 0.8. Times are the minimum and the
median of ``repeat`` calls after one warm-up call; the ratio uses both minimums.

``flatgrad bench`` prints these rows after the pack/unpack table;
``bench/wire_unpack.py`` runs them alone::

    python bench/wire_unpack.py --numel 4194304 --world 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
from typing import Sequence

import torch

from ..kernels import wire
from ._harness import min_median

__all__ = ["measure", "format_table", "main"]


def measure(numel: int, world: int, *, block: int = 256, repeat: int = 20, backend: str = "cpu") -> dict:
    """Time every wire unpack (copy and accumulate) on ``world`` sources of ``numel`` elements, and the roofline."""
    if numel < 1 or world < 1 or repeat < 1:
        raise ValueError(f"numel, world and repeat must be >= 1, got {numel}, {world}, {repeat}")
    src = torch.empty(64 << 20, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    copy_min, copy_median = min_median(lambda: dst.copy_(src), repeat)
    bandwidth = 2 * src.numel() / copy_min
    out = torch.randn(numel)
    recv = torch.randn(world * numel).bfloat16()
    rows = []
    for accumulate in (False, True):
        moved = recv.numel() * 2 + numel * 4 * (2 if accumulate else 1)
        t = min_median(lambda: wire.sum_sources(recv, world, out, 1.0 / world, accumulate, backend=backend), repeat)
        rows.append(("exact (bf16)", accumulate, moved, t))
    for kind in wire.KINDS:
        wire_buf = torch.empty(world * wire.segment_bytes(numel, block), dtype=torch.uint8)
        wire.quantize(torch.randn(world * numel), world, block, kind, wire_buf, backend=backend)
        for accumulate in (False, True):
            moved = wire_buf.numel() + numel * 4 * (2 if accumulate else 1)
            t = min_median(
                lambda: wire.dequantize_sum(wire_buf, world, block, kind, out, 1.0 / world, accumulate, backend=backend),
                repeat,
            )
            rows.append((kind, accumulate, moved, t))
    return {
        "numel": numel, "world": world, "block": block, "backend": backend, "threads": torch.get_num_threads(),
        "copy_bandwidth": bandwidth, "copy_bandwidth_median": 2 * src.numel() / copy_median,
        "rows": [
            {"mode": mode, "accumulate": accumulate, "bytes": moved, "seconds": t, "median_seconds": median,
             "vs_roofline": moved / bandwidth / t}
            for mode, accumulate, moved, (t, median) in rows
        ],
    }  # fmt: skip


def format_table(doc: dict) -> str:
    """The rows of ``measure`` as a table, with the roofline's bandwidth on top."""
    lines = [
        f"W-source unpacks of the reduction modes ({doc['backend']} backend, S={doc['numel']}, W={doc['world']}, "
        f"block={doc['block']}, {doc['threads']} threads): copy roofline {doc['copy_bandwidth'] / 1e9:.2f} GB/s "
        f"(read + write; median {doc['copy_bandwidth_median'] / 1e9:.2f}); target x roofline >= 0.8",
        f"{'mode':14} {'accumulate':>10} {'MB moved':>9} {'min ms':>8} {'med ms':>8} {'GB/s':>6} {'x roofline':>10}",
    ]
    for r in doc["rows"]:
        lines.append(
            f"{r['mode']:14} {str(r['accumulate']):>10} {r['bytes'] / 1e6:9.1f} {r['seconds'] * 1e3:8.2f} "
            f"{r['median_seconds'] * 1e3:8.2f} {r['bytes'] / r['seconds'] / 1e9:6.2f} {r['vs_roofline']:10.2f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``bench/wire_unpack.py``)."""
    parser = argparse.ArgumentParser(prog="wire_unpack", description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="shard elements S")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    doc = measure(args.numel, args.world, block=args.block, repeat=args.repeat, backend=args.backend)
    print(format_table(doc))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0
