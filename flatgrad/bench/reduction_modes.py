"""Does a reduction mode change training? Loss curves of ZeRO-2 under each ``flatgrad.reduction``.

The question: ``exact`` (bf16 wire, all_to_all, fixed-order fp32 sum) and
``int8`` / ``fp8`` (blockwise-quantized wire, with error feedback) against the
baseline beside them, fp32 communication through a reduce_scatter, and a bf16
reduce_scatter.

Setup: a GPT-2-style model (``flatgrad.planner.models.GPT``, vocab 4096, d 256,
5 layers: about 5M parameters), fp32 parameters, AdamW, ZeRO-2 through
``flatgrad.deepspeed.initialize`` with ``"flatgrad": {"reduction": ...}``, on
``--ranks`` real gloo processes (CPU). Data are fixed: each rank draws its
batches from a fixed first-order Markov chain over the first ``ACTIVE`` tokens
(seeded; 4 successors per token, so the loss floor is ln 4 = 1.39), so
the loss has something to learn and every mode sees the same tokens. Every mode
starts from the same weights.

Reported (``--out``.json, and ``--out``.png with the curves when matplotlib is
there; the script prints both paths): per mode the losses of every step (rank
0's), the final loss (mean of the last 10 steps, to see past one batch's
noise) and its relative difference to fp32 communication, and the wire bytes
per rank per step. Targets: ``exact`` within 0.1% of fp32, ``int8``
with error feedback within 1%.

Two more measures beside the final loss, because a 0.1% target sits near the
run-to-run noise of a chaotic training trajectory:

* ``last50``: the mean training loss of the last 50 steps (5x the batches).
* ``eval``: the loss on ``EVAL_BATCHES`` fixed held-out batches (the same
  tokens for every mode, never trained on), evaluated every ``--eval-every``
  steps and at the end. It removes the batch-to-batch noise of the training
  loss; what is left is the difference between the trained weights.

And the noise floor the gaps must be read against: ``fp32_perturbed`` is fp32
communication from initial weights multiplied by ``1 + PERTURB * N(0, 1)``
(about one fp32 rounding per weight), and ``fp32_seed1`` is fp32 communication
from another initialisation seed. Neither changes the arithmetic of the
reduction, so their gap to ``fp32`` is chaos, not error.

    python bench/reduction_modes.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ..reducer import registry

VOCAB, D, LAYERS, HEADS, SEQ = 4096, 256, 5, 4, 32
ACTIVE = 512  # tokens the data use: few enough that a few hundred steps learn their bigrams

EVAL_BATCHES, EVAL_BATCH = 8, 32  # held-out: 256 sequences, 8192 target tokens
PERTURB = 1e-7  # relative perturbation of the initial weights for ``fp32_perturbed`` (fp32 eps is 1.2e-7)

MODES = {
    "fp32": {"comm_dtype": "fp32"},
    "bf16_reduce_scatter": {"comm_dtype": "bf16"},
    "exact": {"comm_dtype": "bf16", "reduction": "exact"},
    "int8_ef": {"comm_dtype": "bf16", "reduction": "int8", "error_feedback": True},
    "fp8_ef": {"comm_dtype": "bf16", "reduction": "fp8", "error_feedback": True},
    # Two-stage modes, on the ranks split into nodes of --node-size (simulated nodes, real process groups).
    "2d_reduce_scatter": {"comm_dtype": "bf16", "reduction": "2d_reduce_scatter"},
    "hier_int8": {"comm_dtype": "bf16", "reduction": "hier_int8"},
    "hier_int8_ef": {"comm_dtype": "bf16", "reduction": "hier_int8", "error_feedback": True},
    "hier_exact": {"comm_dtype": "bf16", "reduction": "hier_exact"},
    "qgz_int8": {"comm_dtype": "bf16", "reduction": "qgz_int8"},
    "qgz_int8_ef": {"comm_dtype": "bf16", "reduction": "qgz_int8", "error_feedback": True},
    "hier_fp8_ef": {"comm_dtype": "bf16", "reduction": "hier_fp8", "error_feedback": True},
    "qgz_fp8_ef": {"comm_dtype": "bf16", "reduction": "qgz_fp8", "error_feedback": True},
    # The noise floor: fp32 communication again, from a slightly different start.
    "fp32_perturbed": {"comm_dtype": "fp32"},
    "fp32_seed1": {"comm_dtype": "fp32"},
}
# A registered mode without a row of its own above is benched as it comes (bf16 communication).
MODES.update({
    name: {"comm_dtype": "bf16", "reduction": name} for name in registry.names()
    if name not in {row.get("reduction", "reduce_scatter") for row in MODES.values()}
})  # fmt: skip
# How a mode's initial weights differ from the others': (init seed, relative perturbation).
INIT = {"fp32_perturbed": (0, PERTURB), "fp32_seed1": (1, 0.0)}


def markov_batches(rank: int, steps: int, batch: int, seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of the Markov chain; rank r's stream is seeded ``1 + r`` unless ``seed`` is given."""
    gen = torch.Generator().manual_seed(0)
    successors = torch.randint(0, ACTIVE, (ACTIVE, 4), generator=gen)  # each token has 4 successors
    gen.manual_seed(1 + rank if seed is None else seed)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, ACTIVE, (batch,), generator=gen)
        for t in range(SEQ):
            pick = torch.randint(0, 4, (batch,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _eval_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean loss over the held-out batches (no dropout in the model, so train/eval mode does not matter)."""
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in batches) / len(batches)


def _rank(
    rank: int, world_size: int, steps: int, batch: int, modes: list[str], eval_every: int, out_path: str, init_seed: int,
    node_size: int,
) -> dict:
    os.environ.update(  # what a launcher on nodes of node_size ranks tells each rank
        RANK=str(rank), LOCAL_RANK=str(rank % node_size), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(node_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu",
    )  # fmt: skip
    import logging

    import deepspeed

    import flatgrad.deepspeed as fds
    from flatgrad.planner.models import GPT

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.set_num_threads(1)
    batches = markov_batches(rank, steps, batch)
    held_out = markov_batches(0, EVAL_BATCHES, EVAL_BATCH, seed=10_000)  # a stream no rank trains on
    out = {}
    for name in modes:
        seed, perturb = INIT.get(name, (0, 0.0))
        torch.manual_seed(init_seed + seed)
        model = GPT(vocab=VOCAB, n_positions=SEQ, d=D, n_layer=LAYERS, n_head=HEADS)
        with torch.no_grad():  # GPT-2's initialisation (the tied N(0, 1) embedding would start at loss ~100)
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
            if perturb:
                gen = torch.Generator().manual_seed(12345 + init_seed)  # the same perturbation on every rank
                for p in model.parameters():
                    p.mul_(1 + perturb * torch.randn(p.shape, generator=gen))
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": batch * world_size,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 1_000_000},
            "flatgrad": dict(MODES[name], node_size=node_size),
        }
        engine, *_ = fds.initialize(model=model, config=config, model_parameters=model.parameters())
        losses, evals = [], {}
        start = time.perf_counter()
        for step, (x, y) in enumerate(batches, 1):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if step % eval_every == 0 or step == len(batches):
                evals[step] = _eval_loss(engine.module, held_out)
        reducers = engine.optimizer.flatgrad.reducers
        out[name] = {
            "losses": losses,
            "evals": evals,
            "seconds": time.perf_counter() - start,
            "params": sum(p.numel() for p in model.parameters()),
            "wire_bytes": _wire_bytes(reducers, MODES[name]),
        }
        if rank == 0:  # the modes done so far, in case a long run is cut short
            with open(out_path + ".partial.json", "w") as f:
                json.dump(out, f)
    return out


def _wire_bytes(reducers: list, mode: dict) -> int | None:
    """Bytes this rank sends per step: (W - 1) / W of each bucket's buffer (none travels to itself)."""
    from flatgrad.kernels import wire

    total = 0
    if mode.get("reduction", "").startswith(("2d_", "hier_")):
        return None  # two stages: bench/hierarchical.py counts their bytes per stage
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
    parser.add_argument("--init-seed", type=int, default=0,
                        help="seed of the initial weights (every mode's; fp32_seed1 uses it + 1); the data stay fixed")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--node-size", type=int, default=2,
                        help="ranks per (simulated) node: the two-stage modes' node groups (default 2)")
    parser.add_argument("--out", default="reduction_modes", help="path prefix of the .json and .png")
    parser.add_argument("--combine", nargs="+", metavar="JSON",
                        help="run nothing: print each mode's gap to fp32 in runs from several --init-seed values "
                             "(their .json), per run and as mean and spread, against the noise floor")
    args = parser.parse_args()
    if args.combine:
        _combine(args.combine)
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from flatgrad.testing.launch import run_ranks

    modes = args.modes.split(",")
    started = time.time()
    run_args = (args.steps, args.batch, modes, args.eval_every, args.out, args.init_seed, args.node_size)
    result = run_ranks(_rank, args.ranks, *run_args, timeout=24 * 3600)[0]
    summary = {name: _measures(r) for name, r in result.items()}
    base = summary.get("fp32")
    for name, row in summary.items():
        r = result[name]
        row.update(seconds=round(r["seconds"], 1), wire_bytes_per_rank=r["wire_bytes"])
        if base is not None:
            for measure in ("final_loss", "last50_loss", "eval_loss"):
                gap = (row[measure] - base[measure]) / base[measure]
                row[f"rel_diff_vs_fp32_{measure.removesuffix('_loss')}"] = gap
            if r["wire_bytes"] and result.get("bf16_reduce_scatter", {}).get("wire_bytes"):
                row["bytes_vs_bf16"] = r["wire_bytes"] / result["bf16_reduce_scatter"]["wire_bytes"]
        print(name, json.dumps(row))
    record = {
        "steps": args.steps, "ranks": args.ranks, "batch": args.batch, "seq": SEQ, "init_seed": args.init_seed,
        "params": next(iter(result.values()))["params"], "wall_seconds": round(time.time() - started, 1),
        "summary": summary, "losses": {k: v["losses"] for k, v in result.items()},
        "evals": {k: v["evals"] for k, v in result.items()},
    }  # fmt: skip
    with open(args.out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print("wrote", os.path.abspath(args.out + ".json"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no PNG")
        return
    fig, (ax, ax_eval) = plt.subplots(1, 2, figsize=(13, 5))
    for name, losses in record["losses"].items():
        ax.plot(losses, label=name, linewidth=1)
        steps = sorted(int(k) for k in record["evals"][name])
        base_eval = record["evals"].get("fp32", {})
        if all(k in base_eval for k in steps):  # relative gap of the held-out loss to fp32's, per evaluation
            gaps = [100 * (record["evals"][name][k] - base_eval[k]) / base_eval[k] for k in steps]
            ax_eval.plot(steps, gaps, marker="o", label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (rank 0)")
    ax.set_title(f"ZeRO-2, {record['params'] / 1e6:.1f}M-param GPT, {args.ranks} ranks: reduction modes")
    ax.legend()
    ax_eval.axhspan(-0.1, 0.1, color="0.9", label="exact's target (+-0.1%)")
    ax_eval.set_xlabel("step")
    ax_eval.set_ylabel("held-out loss vs fp32 (%)")
    ax_eval.set_title("held-out loss gap to fp32 communication")
    ax_eval.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)
    print("wrote", os.path.abspath(args.out + ".png"))


def _combine(paths: list[str]) -> None:
    """Per mode and measure: the relative gap to the same run's fp32, for each run, then mean and sample sd.

    The noise floor is the gap of ``fp32_perturbed`` (and ``fp32_seed1``): a mode whose gaps lie within the
    spread of the floor's is indistinguishable from fp32 communication by this bench.
    """
    import statistics

    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    measures = ("final", "last50", "eval")
    gaps: dict[str, dict[str, list[float]]] = {}
    for record in records:
        for name, row in record["summary"].items():
            for m in measures:
                gaps.setdefault(name, {}).setdefault(m, []).append(100 * row[f"rel_diff_vs_fp32_{m}"])
    seeds = [r.get("init_seed", 0) for r in records]
    print(f"gap to fp32 (%), runs with init seeds {seeds}: per run; mean +- sd; mean |gap|")
    for name, by_measure in gaps.items():
        cells = []
        for m in measures:
            values = by_measure[m]
            sd = statistics.stdev(values) if len(values) > 1 else float("nan")
            mean_abs = statistics.fmean(abs(v) for v in values)
            cells.append(f"{m} [{', '.join(f'{v:+.2f}' for v in values)}] {statistics.fmean(values):+.2f} +- {sd:.2f}"
                         f"; |{mean_abs:.2f}|")  # fmt: skip
        print(f"{name:20s} " + " | ".join(cells))
    print("first step whose training loss differs from the same run's fp32 by more than 0.1%, per run:")
    for name in gaps:
        firsts = []
        for record in records:
            losses, base = record["losses"].get(name), record["losses"]["fp32"]
            firsts.append(None if losses is None else _first_departure(losses, base, 1e-3))
        print(f"{name:20s} {firsts}")


def _first_departure(losses: list[float], base: list[float], rel: float) -> int | None:
    """The first step whose loss differs from ``base``'s by more than ``rel`` of it (None: never)."""
    return next((i for i, (a, b) in enumerate(zip(losses, base)) if abs(a - b) > rel * abs(b)), None)


def _measures(r: dict) -> dict:
    """The three loss measures of one run: mean of the last 10 and last 50 steps, and the last held-out loss."""
    losses = r["losses"]
    return {
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "last50_loss": sum(losses[-50:]) / len(losses[-50:]),
        "eval_loss": r["evals"][max(r["evals"])],
    }


if __name__ == "__main__":
    main()
