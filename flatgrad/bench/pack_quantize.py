"""Is the fused pack-quantize at least as fast as the pack + quantize it replaces? (cpu backend by default)

The question: the int8/fp8 modes' pack side is one ``wire.PackQuantizePlan``
from the gradients to the wire (see [Note: pack-quantize] in
``flatgrad/kernels/wire_reference.py``). The baseline beside it is the two-op
path it replaces, a ``PackPlan`` into a comm-dtype (bf16) buffer, then
``wire.quantize`` of that buffer, on the same gradients in the same run.

Times are the minimum and the median of ``--repeat`` calls, after one warm-up (the machine is shared).

    python bench/pack_quantize.py --numel 4194304 --params 8 --world 2 --threads 1
"""

from __future__ import annotations

import argparse

import torch

from flatgrad.bench._harness import min_median
from flatgrad.kernels import DTYPE_NAMES, PackPlan, wire
from flatgrad.layout import Layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements of all the gradients together")
    parser.add_argument("--params", type=int, default=8, help="gradients (of about numel / params elements)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--kind", choices=wire.KINDS, default="int8")
    parser.add_argument("--grad-dtype", choices=sorted(DTYPE_NAMES), default="fp32")
    parser.add_argument("--comm-dtype", choices=sorted(DTYPE_NAMES), default="bf16", help="the baseline's buffer")
    parser.add_argument("--error-feedback", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    numels = [args.numel // args.params + k for k in range(args.params)]  # uneven: runs cross block boundaries
    layout = Layout.make("flat", numels, args.world, 1)
    grads = [torch.randn(n, generator=gen).to(DTYPE_NAMES[args.grad_dtype]) for n in numels]
    residual = torch.zeros(layout.numel) if args.error_feedback else None
    block, kind, w = args.block, args.kind, args.world

    pack = PackPlan(layout, grads, dtype=DTYPE_NAMES[args.comm_dtype], backend=args.backend)
    buffer = torch.empty(layout.numel, dtype=DTYPE_NAMES[args.comm_dtype])
    kernels = wire.wire_kernels(pack.backend)
    fused = wire.PackQuantizePlan(layout, grads, block=block, kind=kind, backend=args.backend)
    wire_buf = torch.empty(fused.wire_bytes, dtype=torch.uint8)

    def two_ops() -> None:
        pack(grads, buffer, scale=0.5)
        kernels.quantize(buffer, w, block, kind, wire_buf, residual)

    rows = [
        (f"pack {args.comm_dtype} + quantize (baseline)", min_median(two_ops, args.repeat)),
        ("fused pack-quantize", min_median(lambda: fused(grads, wire_buf, residual, scale=0.5), args.repeat)),
    ]
    print(
        f"{layout.numel} elements ({args.params} {args.grad_dtype} gradients), W={w}, block={block}, {kind}, "
        f"error feedback {args.error_feedback}, threads={args.threads}, backend {fused.backend}"
    )
    print(f"{'path':32} {'min ms':>8} {'med ms':>8}")
    for name, (t, median) in rows:
        print(f"{name:32} {t * 1e3:8.2f} {median * 1e3:8.2f}")


if __name__ == "__main__":
    main()
