"""Memory per rank, stock DeepSpeed against flatgrad: ZeRO-1, ZeRO-2 and ZeRO-3, fp32 and bf16, W = 2 and 4.

The question: does flatgrad hold more memory than the stock ZeRO stage a user
chose to save memory? Two figures per rank, for the same model, seed, batches
and ``reduce_bucket_size`` (a quarter of the model by default):

* ``between``: bytes live between optimizer steps (after ``step()``, before the
  next forward), after the last of ``--steps`` steps;
* ``peak``: the most bytes live at once during training (forward, backward with
  the reduction, ``step()``), after the engine is built.

Both count tensor memory from before the model is built (``MemoryCensus``: on
CPU flatgrad's counting allocator, on CUDA the caching allocator's counters),
so they include the model, the optimizer states, the activations, and the
gradient path. Each configuration runs in fresh rank processes.

Targets, as ratios to stock in the same run, with ``bucket`` the
largest ZeRO-1/2 sub-group (or ZeRO-3 bucket) and ``c`` the comm dtype's bytes:

* ZeRO-1/2 between steps: flatgrad <= stock + 2 * bucket * c;
* ZeRO-1/2 peak: flatgrad <= stock peak + 1 bucket (of fp32, the largest
  gradient dtype here: 4 * bucket bytes);
* ZeRO-3 peak: flatgrad <= stock peak + 1 bucket.

The last table projects the gradient path's memory (what differs between
stock and flatgrad; model states and activations are equal) to a 7B model at 8,
64 and 1024 ranks, bf16, from the formulas of ``flatgrad.planner.memory`` (which
``flatgrad plan`` prints too). Example::

    python bench/memory.py                              # everything
    python bench/memory.py --stages 2 --world-sizes 2 --dtypes bf16 --out memory.json
    python bench/memory.py --offload --stages 1 2 3   # CPU optimizer offload: host and device sides apart
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any

import torch

from flatgrad.bench._harness import machine_info, machine_line
from flatgrad.planner.memory import gradient_path_memory
from flatgrad.testing.census import MemoryCensus
from flatgrad.testing.launch import run_ranks

_MODES = ("stock", "flatgrad")


def _config(
    stage: int, dtype: str, world_size: int, bucket: int, gas: int, flatgrad: bool, comm_buffers: int | None,
    reduction: dict | None = None, clip: float = 0.0, offload: str | None = None,
) -> dict:  # fmt: skip
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": offload == "pinned"}
    if stage in (1, 2):
        zero["allgather_bucket_size"] = max(bucket, 10**7)
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = bucket
        zero["stage3_param_persistence_threshold"] = 0
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": gas,
        "train_batch_size": 8 * gas * world_size,
        "steps_per_print": 10**9,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero,
    }
    if offload:
        cfg["zero_force_ds_cpu_optimizer"] = False  # torch's AdamW on the host partitions
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if flatgrad:
        cfg["flatgrad"] = {**({"comm_buffers": comm_buffers} if comm_buffers else {}), **((reduction or {}) if stage in (1, 2) else {})}
    return cfg


def _rank(rank: int, world_size: int, job: dict) -> dict:
    """Build and train one configuration under a census; this rank's figures."""
    from flatgrad.testing.deepspeed_rank import init_deepspeed

    init_deepspeed(rank, world_size, job["device"])
    import deepspeed

    import flatgrad.deepspeed as flatgrad_ds
    from flatgrad.planner import models

    dtype = torch.bfloat16 if job["dtype"] == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(rank)
    width = job["width"]
    batches = [
        (torch.randn(8, width, generator=generator), torch.randn(8, width, generator=generator))
        for _ in range(job["steps"] * job["gas"])
    ]
    gc.collect()
    initialize = flatgrad_ds.initialize if job["mode"] == "flatgrad" else deepspeed.initialize
    with MemoryCensus(job["device"]) as census:
        torch.manual_seed(0)
        model = models.build("mlp", "cpu", d_in=width, hidden=width, d_out=width, layers=job["layers"])
        n_params = sum(p.numel() for p in model.parameters())
        cfg = _config(
            job["stage"], job["dtype"], world_size, job["bucket"], job["gas"], job["mode"] == "flatgrad",
            job["comm_buffers"], job.get("reduction"), job.get("clip", 0.0), job.get("offload"),
        )
        engine = initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        census.mark("built")
        census.reset_peak()
        for x, y in batches:
            loss = engine(x.to(engine.device, dtype), y.to(engine.device, dtype))
            engine.backward(loss)
            engine.step()
            del loss
        census.settle()  # gloo's worker threads free the step's last collective tensors a little later
        census.mark("between steps")
        host = _host_bytes(engine.optimizer) if job.get("offload") else 0
    out = {
        "host_between": host,
        "params": n_params,
        "between": census.at("between steps"),
        "built": census.at("built"),
        "peak": census.peak,
        "largest_bucket": _largest_bucket(engine, job),
        "comm_bytes": 2 if job["dtype"] == "bf16" else 4,
    }
    reduction = getattr(engine.optimizer, "flatgrad", None) if job["stage"] in (1, 2) else None
    out["metadata_bytes"] = 0
    zero3 = getattr(engine.optimizer, "flatgrad", None) if job["stage"] == 3 else None
    if zero3 is not None:
        out["metadata_bytes"] = zero3.metadata_bytes()  # plan tables and step statistics, KBs
    if reduction is not None:
        out["comm_buffer_bytes"] = sum(r.comm_buffer_bytes for r in reduction.reducers)
        # Tables and plans (hundreds of bytes to KBs), named rather than hidden in the allowance.
        out["metadata_bytes"] = reduction.metadata_bytes()
        out["residual_bytes"] = sum(r.residual_bytes for r in reduction.reducers)  # error feedback
    engine.destroy()
    return out


def _host_bytes(optimizer: Any) -> int:
    """Bytes of the tensors DeepSpeed's optimizer offload keeps on the host, each storage counted once.

    The fp32 master partitions and their gradients, the optimizer state, and stock's
    per-parameter accumulation buffers and bit16 staging buffers; under ZeRO-3 the host grad
    partitions, and flatgrad's pinned staging buffers. On a CPU rank host and device are one
    memory; this is the share that offload places on the host.
    """
    tensors: list[torch.Tensor] = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for master in getattr(optimizer, name, None) or []:
            tensors += [master] + ([master.grad] if master.grad is not None else [])
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    if torch.is_tensor(flat) and flat.device.type == "cpu":
        tensors.append(flat)
    offload = getattr(getattr(optimizer, "flatgrad", None), "offload", None)  # ZeRO-3's staging buffers
    tensors += list(getattr(offload, "staging_buffers", None) or [])
    for state in optimizer.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    tensors += list(getattr(optimizer, "accumulated_grads_in_cpu", {}).values())
    tensors += list(getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", []))
    if torch.is_tensor(getattr(optimizer, "temp_grad_buffer_for_cpu_offload", None)):
        tensors.append(optimizer.temp_grad_buffer_for_cpu_offload)
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _largest_bucket(engine: Any, job: dict) -> int:
    """The largest ZeRO-1/2 sub-group (flatgrad) or ``reduce_bucket_size``, in elements."""
    reduction = getattr(engine.optimizer, "flatgrad", None) if job["stage"] in (1, 2) else None
    if reduction is not None:
        return max(layout.numel for layout in reduction.layouts)
    return job["bucket"]


def _run(args: argparse.Namespace) -> list[dict]:
    rows = []
    n_params = args.layers * (args.width * args.width + args.width) + args.width
    bucket = max(1, int(n_params * args.bucket_fraction))
    for world_size in args.world_sizes:
        for stage in args.stages:
            for dtype in args.dtypes:
                row: dict[str, Any] = {
                    "stage": stage, "dtype": dtype, "world_size": world_size, "bucket": bucket, "offload": args.offload,
                }  # fmt: skip
                for mode in _MODES:
                    job = dict(
                        stage=stage, dtype=dtype, mode=mode, device=args.device, width=args.width,
                        layers=args.layers, bucket=bucket, steps=args.steps, gas=args.gas,
                        comm_buffers=args.comm_buffers, clip=args.clip, offload=args.offload,
                        reduction={"reduction": args.reduction, "error_feedback": args.error_feedback},
                    )  # fmt: skip
                    results = run_ranks(_rank, world_size, job, timeout=600)
                    row[mode] = {
                        key: max(r[key] for r in results) if isinstance(results[0][key], int) else results[0][key]
                        for key in results[0]
                    }
                print(_line(row), flush=True)
                rows.append(row)
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "-"


def _line(row: dict) -> str:
    s, f = row["stock"], row["flatgrad"]
    p = s["params"]
    return (
        f"ZeRO-{row['stage']} {row['dtype']:4} W={row['world_size']}  "
        f"between {s['between'] / p:6.2f} -> {f['between'] / p:6.2f} B/param ({_ratio(f['between'], s['between'])}), "
        f"peak {s['peak'] / p:6.2f} -> {f['peak'] / p:6.2f} B/param ({_ratio(f['peak'], s['peak'])})"
    )


def _targets(row: dict) -> dict[str, Any]:
    """The memory targets for one row: the allowance in bytes, and whether flatgrad is within it."""
    s, f = row["stock"], row["flatgrad"]
    largest = max(f["largest_bucket"], s["largest_bucket"])
    c = f["comm_bytes"]
    out: dict[str, Any] = {}
    meta = f.get("metadata_bytes", 0)
    if row["stage"] in (1, 2):
        out["between_allowance"] = 2 * largest * c
        out["between_ok"] = f["between"] - meta <= s["between"] + out["between_allowance"]
    out["peak_allowance"] = 4 * largest
    out["peak_ok"] = f["peak"] - meta <= s["peak"] + out["peak_allowance"]
    if row.get("offload"):
        # Offload: device side no more than stock's between steps, host side no more than stock's + 1 bucket.
        out["between_allowance"] = 0
        out["between_ok"] = (f["between"] - f["host_between"]) - meta <= s["between"] - s["host_between"]
        out["host_allowance"] = 4 * largest
        out["host_ok"] = f["host_between"] <= s["host_between"] + out["host_allowance"]
    return out


def _table(rows: list[dict]) -> str:
    head = (
        f"{'setup':22} {'params':>8} {'bucket':>8}  {'between MB':>21} {'ratio':>7} {'excess/allowed':>14}  "
        f"{'peak MB':>21} {'ratio':>7} {'excess/allowed':>14}"
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        s, f, t = row["stock"], row["flatgrad"], row["targets"]
        name = f"ZeRO-{row['stage']} {row['dtype']} W={row['world_size']}" + (" off" if row.get("offload") else "")
        between = f"{s['between'] / 1e6:9.2f} -> {f['between'] / 1e6:9.2f}"
        peak = f"{s['peak'] / 1e6:9.2f} -> {f['peak'] / 1e6:9.2f}"
        if row.get("offload"):  # device side between steps: its excess over stock, in MB
            excess = (f["between"] - f["host_between"]) - (s["between"] - s["host_between"])
            b_ex = f"{excess / 1e6:+.2f}MB {'ok' if t['between_ok'] else 'OVER'}"
        elif "between_allowance" in t:
            b_ex = f"{(f['between'] - s['between']) / t['between_allowance']:+.2f} {'ok' if t['between_ok'] else 'OVER'}"
        else:
            b_ex = "-"
        p_ex = f"{(f['peak'] - s['peak']) / t['peak_allowance']:+.2f} {'ok' if t['peak_ok'] else 'OVER'}"
        lines.append(
            f"{name:22} {s['params'] / 1e6:7.2f}M {row['bucket'] / 1e6:7.3f}M  {between:>21} "
            f"{_ratio(f['between'], s['between']):>7} {b_ex:>14}  {peak:>21} {_ratio(f['peak'], s['peak']):>7} {p_ex:>14}"
        )
    for row in rows:
        if row.get("offload"):
            s, f, t = row["stock"], row["flatgrad"], row["targets"]
            lines.append(
                f"  ZeRO-{row['stage']} {row['dtype']} W={row['world_size']} offload ({row['offload']}): host side "
                f"between {s['host_between'] / 1e6:.2f} -> {f['host_between'] / 1e6:.2f} MB, device side "
                f"{(s['between'] - s['host_between']) / 1e6:.2f} -> {(f['between'] - f['host_between']) / 1e6:.2f} MB "
                f"(host {'ok' if t['host_ok'] else 'OVER'}: <= stock + 1 fp32 bucket)"
            )
    lines.append(
        "excess/allowed: (flatgrad - stock) / the target's allowance (between: 2 buckets of comm dtype; "
        "peak: 1 bucket of fp32); <= 1 meets the target, flatgrad's tables and plans "
        "(metadata_bytes(), KBs) not counted in it"
    )
    return "\n".join(lines)


def _projection(bucket: float = 5e8) -> tuple[str, list[dict]]:
    """The gradient path of a 7B model (bf16, bucket 5e8) at 8, 64 and 1024 ranks, in GB per rank."""
    p = 6.74e9
    rows, lines = [], [f"7B projection (P = {p:.3g}, bf16, bucket {bucket:.0e}): gradient-path GB per rank, between / peak"]
    lines.append(f"{'stage':8} {'W':>5}  {'stock':>15}  {'flatgrad':>15}  {'flatgrad - stock (peak)':>24}")
    for stage in (2, 3):
        for w in (8, 64, 1024):
            s = gradient_path_memory(f"stock_zero{stage}", int(p), w, int(bucket), 2, 2)
            f = gradient_path_memory(f"flatgrad_zero{stage}", int(p), w, int(bucket), 2, 2)
            rows.append({"stage": stage, "world_size": w, "stock": s._asdict(), "flatgrad": f._asdict()})
            lines.append(
                f"ZeRO-{stage}   {w:>5}  {s.between / 1e9:6.2f} / {s.peak / 1e9:6.2f}  "
                f"{f.between / 1e9:6.2f} / {f.peak / 1e9:6.2f}  {(f.peak - s.peak) / 1e9:+24.2f}"
            )
    return "\n".join(lines), rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--bucket-fraction", type=float, default=0.25, help="reduce_bucket_size as a fraction of P")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--gas", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--clip", type=float, default=0.0, help="'gradient_clipping' (ZeRO-1/2 then read stock's norm)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--comm-buffers", type=int, default=None, help="flatgrad's 'comm_buffers' (ZeRO-1/2; default: as many as stock's IPG buffers)"
    )
    parser.add_argument("--reduction", default="reduce_scatter", help="flatgrad's 'reduction' (ZeRO-1/2)")
    parser.add_argument("--error-feedback", action="store_true", help="flatgrad's 'error_feedback' (int8/fp8)")
    parser.add_argument(
        "--offload", nargs="?", const="pinned", default=None, choices=["pinned", "pageable"],
        help="CPU optimizer offload (pin_memory true, or false with 'pageable'): host and device sides apart",
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.device == "cpu" else "cuda")
    info = machine_info()
    print(machine_line(info), flush=True)
    rows = _run(args)
    for row in rows:
        row["targets"] = _targets(row)
    print()
    print(_table(rows))
    text, projection = _projection()
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "rows": rows, "projection_7b": projection, "args": vars(args)}, f, indent=1)
    ok = all(r["targets"].get("between_ok", True) and r["targets"]["peak_ok"] and r["targets"].get("host_ok", True)
             for r in rows)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
