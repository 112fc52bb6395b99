"""How close is the fused W-source unpack to a plain copy? (cpu backend)

The question: the unpack of the reduction modes (``wire.sum_sources`` for
``exact``, ``wire.dequantize_sum`` for ``int8`` / ``fp8``) reads W chunks and
writes (or reads and writes) one fp32 shard. Its floor is the time a copy
needs to move the same bytes. The baseline beside it: ``torch.Tensor.copy_``
of a uint8 buffer, measured in the same run at the same thread count, gives
the copy bandwidth (bytes read + written per second); a row's ``vs roofline``
is (its bytes / that bandwidth) / its time. Target (issue 12): >= 0.8.

Times are the minimum and the median of ``--repeat`` calls (the machine is shared); the
ratio uses the minimum of both the row and the copy.

    python bench/wire_unpack.py --numel 4194304 --world 4 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flatgrad.kernels import wire


def _times(fn, repeat: int) -> tuple[float, float]:
    """``(min, median)`` seconds of ``repeat`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="shard elements S")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    s, w, block = args.numel, args.world, args.block
    src = torch.empty(64 << 20, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    copy_min, copy_median = _times(lambda: dst.copy_(src), args.repeat)
    bandwidth = 2 * src.numel() / copy_min
    rows = []
    out = torch.randn(s)
    recv = torch.randn(w * s).bfloat16()
    for accumulate in (False, True):
        moved = recv.numel() * 2 + s * 4 * (2 if accumulate else 1)
        t = _times(lambda: wire.sum_sources(recv, w, out, 1.0 / w, accumulate, backend=args.backend), args.repeat)
        rows.append(("exact (bf16)", accumulate, moved, t))
    for kind in wire.KINDS:
        wire_buf = torch.empty(w * wire.segment_bytes(s, block), dtype=torch.uint8)
        wire.quantize(torch.randn(w * s), w, block, kind, wire_buf, backend=args.backend)
        for accumulate in (False, True):
            moved = wire_buf.numel() + s * 4 * (2 if accumulate else 1)
            t = _times(
                lambda: wire.dequantize_sum(wire_buf, w, block, kind, out, 1.0 / w, accumulate, backend=args.backend),
                args.repeat,
            )
            rows.append((kind, accumulate, moved, t))
    print(
        f"copy bandwidth {bandwidth / 1e9:.2f} GB/s (read + write; median {2 * src.numel() / copy_median / 1e9:.2f}), "
        f"S={s}, W={w}, block={block}, threads={args.threads}"
    )
    print(f"{'mode':14} {'accumulate':>10} {'MB moved':>9} {'min ms':>8} {'med ms':>8} {'GB/s':>6} {'vs roofline':>11}")
    record = []
    for mode, accumulate, moved, (t, median) in rows:
        ratio = moved / bandwidth / t
        print(
            f"{mode:14} {str(accumulate):>10} {moved / 1e6:9.1f} {t * 1e3:8.2f} {median * 1e3:8.2f} "
            f"{moved / t / 1e9:6.2f} {ratio:11.2f}"
        )
        record.append(
            {"mode": mode, "accumulate": accumulate, "bytes": moved, "seconds": t, "median_seconds": median,
             "vs_roofline": ratio}
        )  # fmt: skip
    print(json.dumps({"copy_bandwidth": bandwidth, "rows": record}))


if __name__ == "__main__":
    main()
