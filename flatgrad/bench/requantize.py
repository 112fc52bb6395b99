"""Is the fused requantize faster than the dequantize_sum + quantize it replaces? (cpu backend by default)

Between the two stages of ``qgz_int8`` / ``qgz_fp8`` one ``wire.requantize`` takes
the L received wire segments to the N segments of the rail wire, with no fp32 node
partial (see [Note: requantize] in ``flatgrad/kernels/wire_reference.py``). The
baseline is the composition it equals bitwise: ``wire.dequantize_sum`` into an fp32
partial of ``N * S`` elements, then ``wire.quantize`` of it. Both run on the same
received wire in one process, taking turns (``time_round_robin``), and must write
the same bytes (checked first).

Times are the minimum and the median of ``--repeat`` calls each, after one warm-up; the ratio uses both.

    python bench/requantize.py --numel 4194304 --sources 4 --segments 4 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flatgrad.bench._harness import machine_info, machine_line, time_round_robin
from flatgrad.kernels import wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements of the node partial, N * S")
    parser.add_argument("--sources", type=int, default=4, help="L, the node peers whose segments are summed")
    parser.add_argument("--segments", type=int, default=4, help="N, the rail peers the sum is quantized for")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--kind", choices=wire.KINDS, default="int8")
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sources, n, block, kind = args.sources, args.segments, args.block, args.kind
    s = args.numel // n
    part = n * s
    gen = torch.Generator().manual_seed(0)
    wire_in = torch.empty(sources * wire.segment_bytes(part, block), dtype=torch.uint8)
    wire.quantize(torch.randn(sources * part, generator=gen), sources, block, kind, wire_in, backend=args.backend)
    kernels = wire.wire_kernels(args.backend)
    partial = torch.empty(part)
    outs = [torch.zeros(n * wire.segment_bytes(s, block), dtype=torch.uint8) for _ in range(2)]
    residuals = [torch.zeros(part) if args.error_feedback else None for _ in range(2)]

    def two_kernels() -> None:
        kernels.dequantize_sum(wire_in, sources, block, kind, partial, 1.0, False, False)
        kernels.quantize(partial, n, block, kind, outs[0], residuals[0])

    def fused() -> None:
        kernels.requantize(wire_in, sources, block, kind, outs[1], n, s, residuals[1])

    two_kernels()
    fused()
    same_residual = residuals[0] is None or torch.equal(residuals[0], residuals[1])
    if not torch.equal(outs[0], outs[1]) or not same_residual:
        raise SystemExit("requantize and dequantize_sum + quantize wrote different wires or residuals")
    baseline, ours = time_round_robin([two_kernels, fused], warmup=1, repeats=args.repeat, cuda=False)
    (b_min, b_med), (f_min, f_med) = [(min(t), statistics.median(t)) for t in (baseline, ours)]
    print(machine_line(machine_info()))
    print(
        f"L={sources} sources of N*S={part} elements into N={n} segments of S={s}, block={block}, {kind}, "
        f"error feedback {args.error_feedback}, threads={args.threads}, backend {args.backend}"
    )
    print(f"{'path':36} {'min ms':>8} {'med ms':>8}")
    print(f"{'dequantize_sum + quantize (baseline)':36} {b_min * 1e3:8.2f} {b_med * 1e3:8.2f}")
    print(f"{'fused requantize':36} {f_min * 1e3:8.2f} {f_med * 1e3:8.2f}")
    print(f"fused / baseline: min {f_min / b_min:.2f}, median {f_med / b_med:.2f}")


if __name__ == "__main__":
    main()
