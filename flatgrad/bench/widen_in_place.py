"""What does widening a bit16 delivery inside its fp32 host target cost, against a cast from a separate buffer?

A bit16 shard delivered from the GPU into an fp32 host target lands in the
target's first half and is widened there (``widen_in_place``, see [Note: shard
targets] in ``flatgrad/reducer/shards.py``). The baseline is the cast a staging
design would run: ``target.copy_(bf16)`` from a separate bf16 host buffer of the
shard's size; the roofline is one fp32 ``copy_`` of the same elements. All three
take turns in one process (``time_round_robin``); the widening is checked bitwise
against the cast first. Times are the minimum and the median of ``--repeat`` calls.

    python bench/widen_in_place.py --numel 1048576 25165824 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flatgrad.bench._harness import machine_info, machine_line, time_round_robin
from flatgrad.reducer.shards import widen_in_place


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 20, 25_165_824], help="elements of the shard")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    narrow = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(machine_line(machine_info()))
    print("| elements | widen in place (ms) | cast from a separate buffer (ms) | fp32 copy_ (ms) | widen / cast |")
    print("|---|---|---|---|---|")
    for n in args.numel:
        values = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(narrow)
        target, separate, same = torch.empty(n), values.clone(), torch.ones(n)
        target.view(torch.uint8).narrow(0, 0, n * values.element_size()).copy_(values.view(torch.uint8))
        widen_in_place(target, narrow)
        if not torch.equal(target, values.float()):
            raise SystemExit(f"widen_in_place differs from the cast at {n} elements")
        runs = [lambda: widen_in_place(target, narrow), lambda: target.copy_(separate), lambda: target.copy_(same)]
        times = time_round_robin(runs, warmup=1, repeats=args.repeat, cuda=False)
        stats = [(min(t) * 1e3, statistics.median(t) * 1e3) for t in times]
        (wmin, wmed), (cmin, cmed), (rmin, rmed) = stats
        print(f"| {n:,} | {wmin:.2f} / {wmed:.2f} | {cmin:.2f} / {cmed:.2f} | {rmin:.2f} / {rmed:.2f} | "
              f"{wmin / cmin:.2f}x / {wmed / cmed:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
