"""How large is each reduction mode's error on real gradients? One reduction, against the fp64 sum.

The question behind it: ``bench/reduction_modes.py`` compares whole training
runs, whose trajectories diverge from a perturbation as small as one fp32
rounding of the initial weights. This script asks what the modes themselves do
to one step's gradient, which is not chaotic.

Setup: the GPT, the data and the initial weights of ``bench/reduction_modes.py``
(fp32, ``--ranks`` gloo processes). For each of ``--batches`` batches every
rank computes its fp32 gradients once; the reference is their mean in fp64
(``all_reduce`` of fp64 copies). Then a ``flatgrad.BucketReducer`` (one bucket
per ``--bucket`` elements, averaging) reduces those same gradients under each
mode, and each rank compares its shards with the reference slice they cover.

Reported (printed, and ``--out``.json): per mode the relative L2 error of the
reduced gradient ``||shard - ref|| / ||ref||`` over all ranks' shards, the same
over the largest 1% of reference elements of each piece, and
the cosine of the error with the reference (0: no bias in the gradient's
direction). The baseline is ``fp32`` (fp32 reduce_scatter), whose error is the
fp32 summation order's.

    python bench/reduction_error.py
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..reducer import registry

MODES = {
    "fp32": {"comm_dtype": torch.float32},
    "bf16_reduce_scatter": {"comm_dtype": torch.bfloat16},
    "exact": {"comm_dtype": torch.bfloat16, "reduction": "exact"},
    "int8": {"comm_dtype": torch.bfloat16, "reduction": "int8"},
    "fp8": {"comm_dtype": torch.bfloat16, "reduction": "fp8"},
    # Two-stage modes over the ranks split into nodes of --node-size (simulated nodes, real process groups).
    "2d_reduce_scatter_fp32": {"comm_dtype": torch.float32, "reduction": "2d_reduce_scatter"},
    "2d_reduce_scatter": {"comm_dtype": torch.bfloat16, "reduction": "2d_reduce_scatter"},
    "hier_int8": {"comm_dtype": torch.bfloat16, "reduction": "hier_int8"},
    "hier_fp8": {"comm_dtype": torch.bfloat16, "reduction": "hier_fp8"},
    "hier_exact": {"comm_dtype": torch.bfloat16, "reduction": "hier_exact"},
    "qgz_int8": {"comm_dtype": torch.bfloat16, "reduction": "qgz_int8"},
    "qgz_int8_fp32": {"comm_dtype": torch.float32, "reduction": "qgz_int8"},  # the wire quantized from an fp32 pack
    "qgz_fp8": {"comm_dtype": torch.bfloat16, "reduction": "qgz_fp8"},
}
# A registered mode without a row of its own above is measured as it comes (bf16 communication).
MODES.update({
    name: {"comm_dtype": torch.bfloat16, "reduction": name} for name in registry.names()
    if name not in {row.get("reduction", "reduce_scatter") for row in MODES.values()}
})  # fmt: skip


def _rank(rank: int, world_size: int, batches: int, bucket: int, modes: list[str], node_size: int) -> dict:
    import torch.distributed as dist

    os.environ.update(LOCAL_WORLD_SIZE=str(node_size), LOCAL_RANK=str(rank % node_size))  # a launcher's nodes
    from flatgrad.bench import reduction_modes as rm  # the training bench's model, data and initialisation
    from flatgrad.planner.models import GPT
    from flatgrad.reducer import BucketReducer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab=rm.VOCAB, n_positions=rm.SEQ, d=rm.D, n_layer=rm.LAYERS, n_head=rm.HEADS)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    params = [p for p in model.parameters() if p.requires_grad][::-1]  # backward order, roughly
    buckets, current, size = [], [], 0
    for p in params:
        if current and size + p.numel() > bucket:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    buckets.append(current)

    sums = {name: {"err2": 0.0, "ref2": 0.0, "dot": 0.0, "top_err2": 0.0, "top_ref2": 0.0} for name in modes}
    for x, y in rm.markov_batches(rank, batches, 4):
        model.zero_grad(set_to_none=True)
        model(x, y).backward()
        grads = {p: p.grad.detach().clone() for p in params}
        ref = {}
        for p in params:  # the reference: the mean of the ranks' fp32 gradients, in fp64
            r = grads[p].double()
            dist.all_reduce(r)
            ref[p] = (r / world_size).flatten()
        for name in modes:
            reducer = BucketReducer(buckets, register_hooks=False, node_size=node_size, **MODES[name])
            for p in params:
                p.grad = grads[p].clone()
                reducer.mark_ready(p)
            reducer.finish()
            for gs in reducer.grad_shards():
                for piece in gs.pieces:
                    got = gs.shard[piece.shard_offset : piece.shard_offset + piece.length].double()
                    want = ref[gs.params[piece.tensor_index]][piece.tensor_offset : piece.tensor_offset + piece.length]
                    err = got - want
                    s = sums[name]
                    s["err2"] += float(err @ err)
                    s["ref2"] += float(want @ want)
                    s["dot"] += float(err @ want)
                    k = max(1, want.numel() // 100)  # this piece's largest 1% of reference elements
                    top = want.abs().topk(k).indices
                    s["top_err2"] += float(err[top] @ err[top])
                    s["top_ref2"] += float(want[top] @ want[top])
            reducer.remove_hooks()
    out = {}
    for name, s in sums.items():
        t = torch.tensor([s["err2"], s["ref2"], s["dot"], s["top_err2"], s["top_ref2"]], dtype=torch.float64)
        dist.all_reduce(t)
        err2, ref2, dot, top_err2, top_ref2 = t.tolist()
        out[name] = {
            "rel_l2_error": (err2 / ref2) ** 0.5,
            "rel_l2_error_top1pct": (top_err2 / top_ref2) ** 0.5,
            "error_cosine_with_ref": dot / ((err2 * ref2) ** 0.5) if err2 > 0 else 0.0,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--bucket", type=int, default=1_000_000, help="elements per bucket")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--node-size", type=int, default=2, help="ranks per (simulated) node of the two-stage modes")
    parser.add_argument("--out", default="reduction_error", help="path prefix of the .json")
    args = parser.parse_args()
    from flatgrad.testing.launch import run_ranks

    modes = args.modes.split(",")
    result = run_ranks(_rank, args.ranks, args.batches, args.bucket, modes, args.node_size, timeout=3600)[0]
    for name, row in result.items():
        print(f"{name:20s} " + "  ".join(f"{k} {v:.3e}" for k, v in row.items()))
    with open(args.out + ".json", "w") as f:
        json.dump({"ranks": args.ranks, "batches": args.batches, "bucket": args.bucket, "modes": result}, f, indent=1)
    print("wrote", os.path.abspath(args.out + ".json"))


if __name__ == "__main__":
    main()
