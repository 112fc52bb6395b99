"""flatgrad's qgZ (qgz_int8, qgz_fp8) against DeepSpeed's ZeRO++ qgZ: error and bytes per rank, on the CPU.

The figures of the GPU check's ``qgz`` step (``flatgrad/check/qgz.py``, whose docstring says how the ranks are
simulated and what is compared), on the ``cpu`` wire backend: one bucket of ``--rows x --cols`` elements a
rank reduced over ``L x N`` simulated ranks. flatgrad's error is against the fp64 sum, checked within the wire
format's rounding bound; bytes are each rank's send buffer per stage, flatgrad's from ``wire.segment_bytes``,
stock's from the shapes its ``all_to_all_quant_reduce`` makes. Stock's error needs DeepSpeed's CUDA-only
quantizer op: it is measured by the GPU check only, and printed here as ``GPU-only``.

    python bench/qgz_compare.py
"""

from __future__ import annotations

import argparse

import torch

from flatgrad.check import qgz
from flatgrad.check.summary import stock_text


def table(doc: dict) -> list[str]:
    """The markdown table of ``qgz.run``'s figures: a row per case and reduction."""
    lines = [
        "| case | reduction | node bytes/rank | rail bytes/rank | node + rail / bf16's | max abs error | "
        "relative RMS error | within the wire's rounding bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, case in doc["cases"].items():
        b = case["bytes"]
        bf16 = b["2d_reduce_scatter_bf16"]["node"] + b["2d_reduce_scatter_bf16"]["rail"]
        rows = [(m, case["flatgrad"][m], "yes" if case["flatgrad"][m]["ok"] else "NO") for m in case["flatgrad"]]
        stock = case.get("stock_qgz_int4") or {}
        rows.append(("stock_qgz_int4", stock if stock.get("measured") else None, "-"))
        rows.append(("2d_reduce_scatter_bf16", case["2d_reduce_scatter_bf16"], "-"))
        for mode, err, bound in rows:
            sent = b[mode]
            figures = f"{err['max_abs']:.3g} | {err['rel_rms']:.2e}" if err else "GPU-only | GPU-only"
            lines.append(f"| {label} (W={case['world_size']}) | {mode} | {sent['node']:,} | {sent['rail']:,} | "
                         f"{(sent['node'] + sent['rail']) / bf16:.3f} | {figures} | {bound} |")  # fmt: skip
    return lines


def main() -> int:
    """Run the cases on the CPU and print the table; exit status 1 when flatgrad's part fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="the bucket's rows (the GPU check's size)")
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--local", type=int, default=8, help="L, ranks per node")
    parser.add_argument("--nodes", default="2,4", help="comma-separated N, one case each")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--outliers", type=int, default=4, help="outliers per rank's gradient")
    parser.add_argument("--backend", default="cpu", help="the wire backend checked against the torch reference")
    args = parser.parse_args()
    nodes = [int(n) for n in args.nodes.split(",") if n.strip()]
    doc = qgz.run(torch.device("cpu"), [args.backend], args.local, nodes, args.rows, args.cols, args.block,
                  args.outliers)  # fmt: skip
    print(
        f"{args.rows} x {args.cols} elements a rank, L = {args.local}, block {args.block}, "
        f"{args.outliers} outliers (+-64) a rank in randn; bf16 bucket for flatgrad and 2d_reduce_scatter"
    )
    print("\n".join(table(doc)))
    print(f"stock bytes: node {qgz.STOCK_FORMULA['node']}; rail {qgz.STOCK_FORMULA['rail']}")
    print(stock_text(doc))
    for failure in doc["failures"]:
        print(f"FAIL {failure}")
    return 0 if doc["ok"] else 1
