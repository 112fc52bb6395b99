"""Does a reduction mode change training? Loss curves of ZeRO-2 under each ``flatgrad.reduction``.

The question: ``exact`` (bf16 wire, all_to_all, fixed-order fp32 sum) and
``int8`` / ``fp8`` (blockwise-quantized wire, with error feedback) against the
baseline beside them, fp32 communication through a reduce_scatter, and a bf16
reduce_scatter.

Setup: a GPT-2-style model (``flatgrad.plan.models.GPT``, vocab 4096, d 256,
5 layers: about 5M parameters), fp32 parameters, AdamW, ZeRO-2 through
``flatgrad.deepspeed.initialize`` with ``"flatgrad": {"reduction": ...}``, on
``--ranks`` real gloo processes (CPU). Data are fixed: each rank draws its
batches from a fixed first-order Markov chain over the first ``ACTIVE`` tokens
(seeded; 4 successors per token, so the loss floor is ln 4 = 1.39), so
the loss has something to learn and every mode sees the same tokens. Every mode
starts from the same weights.

Reported (``--out``.json, and ``--out``.png with the curves when matplotlib is
there): per mode the losses of every step (rank 0's), the final loss (mean of
the last 10 steps, to see past one batch's noise) and its relative difference
to fp32 communication, and the wire bytes per rank per step. Targets (issue
12): ``exact`` within 0.1% of fp32, ``int8`` with error feedback within 1%.

    python bench/reduction_modes.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

VOCAB, D, LAYERS, HEADS, SEQ = 4096, 256, 5, 4, 32
ACTIVE = 512  # tokens the data use: few enough that a few hundred steps learn their bigrams

MODES = {
    "fp32": {"comm_dtype": "fp32"},
    "bf16_reduce_scatter": {"comm_dtype": "bf16"},
    "exact": {"comm_dtype": "bf16", "reduction": "exact"},
    "int8_ef": {"comm_dtype": "bf16", "reduction": "int8", "error_feedback": True},
    "fp8_ef": {"comm_dtype": "bf16", "reduction": "fp8", "error_feedback": True},
}


def _batches(rank: int, steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    successors = torch.randint(0, ACTIVE, (ACTIVE, 4), generator=gen)  # each token has 4 successors
    gen.manual_seed(1 + rank)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, ACTIVE, (batch,), generator=gen)
        for t in range(SEQ):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _rank(rank: int, world_size: int, steps: int, batch: int, modes: list[str]) -> dict:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu",
    )  # fmt: skip
    import logging

    import deepspeed

    import flatgrad.deepspeed as fds
    from flatgrad.plan.models import GPT

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no 50 s JIT build of the shm op
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    batches = _batches(rank, steps, batch)
    out = {}
    for name in modes:
        torch.manual_seed(0)
        model = GPT(vocab=VOCAB, n_positions=SEQ, d=D, n_layer=LAYERS, n_head=HEADS)
        with torch.no_grad():  # GPT-2's initialisation (the tied N(0, 1) embedding would start at loss ~100)
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": batch * world_size,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1_000_000},
            "flatgrad": dict(MODES[name]),
        }
        engine, *_ = fds.initialize(model=model, config=config, model_parameters=model.parameters())
        losses = []
        start = time.perf_counter()
        for x, y in batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        reducers = engine.optimizer._flatgrad.reducers
        out[name] = {
            "losses": losses,
            "seconds": time.perf_counter() - start,
            "params": sum(p.numel() for p in model.parameters()),
            "wire_bytes": _wire_bytes(reducers, MODES[name]),
        }
    return out


def _wire_bytes(reducers: list, mode: dict) -> int | None:
    """Bytes this rank sends per step: (W - 1) / W of each bucket's buffer (none travels to itself)."""
    from flatgrad.kernels import wire

    total = 0
    for reducer in reducers:
        w = reducer.world_size
        for layout in reducer.layouts:
            if mode.get("reduction") in wire.KINDS:
                nbytes = w * wire.segment_bytes(layout.shard_numel, mode.get("block", 256))
            else:
                nbytes = layout.numel * (4 if mode["comm_dtype"] == "fp32" else 2)
            total += nbytes * (w - 1) // w
    return total or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default="reduction_modes")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from flatgrad.demo.launch import run_ranks

    modes = args.modes.split(",")
    started = time.time()
    result = run_ranks(_rank, args.ranks, args.steps, args.batch, modes, timeout=24 * 3600)[0]
    base = result.get("fp32")
    summary = {}
    for name, r in result.items():
        final = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        row = {"final_loss": final, "seconds": round(r["seconds"], 1), "wire_bytes_per_rank": r["wire_bytes"]}
        if base is not None:
            base_final = sum(base["losses"][-10:]) / len(base["losses"][-10:])
            row["rel_diff_vs_fp32"] = (final - base_final) / base_final
            if r["wire_bytes"] and result.get("bf16_reduce_scatter", {}).get("wire_bytes"):
                row["bytes_vs_bf16"] = r["wire_bytes"] / result["bf16_reduce_scatter"]["wire_bytes"]
        summary[name] = row
        print(name, json.dumps(row))
    record = {
        "steps": args.steps, "ranks": args.ranks, "batch": args.batch, "seq": SEQ,
        "params": next(iter(result.values()))["params"], "wall_seconds": round(time.time() - started, 1),
        "summary": summary, "losses": {k: v["losses"] for k, v in result.items()},
    }  # fmt: skip
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, losses in record["losses"].items():
        ax.plot(losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0)")
    ax.set_title(f"ZeRO-2, {record['params'] / 1e6:.1f}M-param GPT, {args.ranks} ranks: reduction modes")
    ax.legend()
    fig.savefig(args.out + ".png", dpi=100)


if __name__ == "__main__":
    main()
