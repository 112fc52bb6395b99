"""The check's ``zero-offload`` step: ZeRO-2/3 with CPU optimizer offload, stock DeepSpeed against flatgrad.

One rank (NCCL on ``--device cuda``, gloo on ``--device cpu``), spawned once: imports and the process
group are paid once, and the engines are built one after another in it. Each config trains stock
(``deepspeed.initialize``) and flatgrad (``flatgrad.deepspeed.initialize``) from the same weights on the
same batches, 3 steps of ``gradient_accumulation_steps: 2``, torch's AdamW on the host partitions
(``torch_adam``; DeepSpeed's CPU Adam would have to be compiled first):

* ZeRO-2, ``offload_optimizer: {device: cpu, pin_memory: true}`` and ``pin_memory: false``, with
  ``gradient_clipping: 1.0``, on a dense model (``flatgrad.demo.setups.DENSE``) and on the seed MoE
  model (``ep_size: 1``);
* ZeRO-3, ``offload_optimizer: {device: cpu}``, flatgrad with ``"backend": "cuda"`` and ``"triton"``
  (``"cpu"`` on ``--device cpu``): on a GPU the unpack of the segment staged on the host must pick a
  backend that runs there by itself.

Each config passes when flatgrad took over (the engine's optimizer carries ``flatgrad`` under every ZeRO
stage) and every micro-step's loss matches stock's within ``1e-6``
relative (fp32) or ``1e-2`` (bf16). Reported per config and engine: the losses and, on CUDA, the peak
``torch.cuda.max_memory_allocated``; an exception is a failed config, and the next one runs. Results
arrive config by config, so a run cut short keeps the configs it finished. Writes ``--out`` JSON and
prints one JSON line; exit status 1 when a config failed.

``python -m flatgrad.check.zero_offload [--device cuda|cpu] [--configs NAMES] [--quick] [--out FILE]``
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Sequence

__all__ = ["RTOL", "configs", "max_rel_diff", "verdict", "build_parser", "rank_main", "run", "main"]

RTOL = {"fp32": 1e-6, "bf16": 1e-2}
_WIDTH = 1000  # the demo models' input and output width
_STEPS, _GAS = 3, 2


def configs(device: str, quick: bool = False) -> list[dict[str, Any]]:
    """The configs, by name: stage, model, dtype, pinning (None: DeepSpeed's default), ZeRO-3's kernel backend.

    In running order, the ones that most need a GPU first (a step cut short keeps them): ZeRO-3's staged
    transfer with a forced GPU backend, then ZeRO-2 offload with clipping, dense and MoE, pinned and pageable,
    then the bf16 cases.
    """
    zero3 = [("cuda", "fp32"), ("triton", "fp32")] if device == "cuda" else [("cpu", "fp32")]
    zero2 = [(model, pin, "fp32") for model in ("dense", "moe") for pin in (True, False)]
    if not quick:
        zero2.append(("dense", True, "bf16"))
        zero3_bf16 = [(zero3[0][0], "bf16")]
    else:
        zero3_bf16 = []
    found = [dict(name=f"zero3-{backend}-dense-{dtype}", stage=3, model="dense", dtype=dtype, pin=None,
                  backend=backend) for backend, dtype in zero3]  # fmt: skip
    found += [dict(name=f"zero2-{'pinned' if pin else 'pageable'}-{model}-{dtype}", stage=2, model=model, dtype=dtype,
                   pin=pin, backend=None) for model, pin, dtype in zero2]  # fmt: skip
    found += [dict(name=f"zero3-{backend}-dense-{dtype}", stage=3, model="dense", dtype=dtype, pin=None,
                   backend=backend) for backend, dtype in zero3_bf16]  # fmt: skip
    return found


def _ds_config(config: dict, flat: bool, options: dict) -> dict:
    offload: dict[str, Any] = {"device": "cpu"}
    if config["pin"] is not None:
        offload["pin_memory"] = config["pin"]
    zero: dict[str, Any] = {"stage": config["stage"], "reduce_bucket_size": options["bucket"],
                            "offload_optimizer": offload}  # fmt: skip
    if config["stage"] == 2:
        zero["allgather_bucket_size"] = max(options["bucket"], 10**8)
    else:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned, small ones too
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": options["micro_batch"],
        "gradient_accumulation_steps": _GAS,
        "train_batch_size": options["micro_batch"] * _GAS,
        "steps_per_print": 10**9,
        "gradient_clipping": 1.0,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": options["lr"], "weight_decay": 0.01, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW on the host partitions
        "zero_optimization": zero,
    }
    if config["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if flat:
        cfg["flatgrad"] = {"backend": config["backend"]} if config["backend"] else {}
    return cfg


def _took_over(engine: Any, stage: int) -> bool:
    reduction = getattr(engine.optimizer, "flatgrad", None)
    return reduction is not None and (stage == 3 or bool(reduction.offload))


def _train(config: dict, flat: bool, options: dict) -> dict:
    """One engine: build, 3 steps of 2 micro-steps; its losses, whether flatgrad took over, its peak memory."""
    import deepspeed
    import torch

    import flatgrad.deepspeed as flatgrad_ds
    from flatgrad.demo.setups import DENSE, build_model, make_batches
    from flatgrad.kernels import DTYPE_NAMES

    cuda = options["device"] == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    spec = DENSE if config["model"] == "dense" else ("seed-moe", {"ep_size": 1})
    model = build_model(spec, options["seed"])
    initialize = flatgrad_ds.initialize if flat else deepspeed.initialize
    engine = initialize(model=model, model_parameters=model.parameters(), config=_ds_config(config, flat, options))[0]
    dtype = DTYPE_NAMES[config["dtype"]]
    losses = []
    try:
        batches = make_batches(0, _STEPS * _GAS, options["micro_batch"], _WIDTH, options["seed"])
        for micro, batch in enumerate(batches):
            torch.manual_seed(options["seed"] + 7919 * (micro + 1))  # the same gate noise for both engines
            x, y = (t.to(engine.device, dtype) for t in batch)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach().float()))
        if cuda:
            torch.cuda.synchronize()
        return {"losses": losses, "took_over": _took_over(engine, config["stage"]) if flat else None,
                "peak": torch.cuda.max_memory_allocated() if cuda else None}  # fmt: skip
    finally:
        engine.destroy()
        del engine, model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def max_rel_diff(stock: list[float], mine: list[float]) -> float:
    """The largest ``|mine - stock| / |stock|`` over the micro-steps (inf where a loss is not finite or missing)."""
    if len(stock) != len(mine) or not stock:
        return math.inf
    worst = 0.0
    for a, b in zip(stock, mine):
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.inf
        worst = max(worst, abs(b - a) / max(abs(a), 1e-30))
    return worst


def verdict(config: dict, results: dict[str, Any]) -> dict:
    """A config's entry: both engines' losses and peaks, the largest relative difference, ``ok``."""
    rtol = RTOL[config["dtype"]]
    entry: dict[str, Any] = {**config, "rtol": rtol, "losses": {}, "peak": {}, "error": None}
    errors = [f"{kind}: {r['error']}" for kind, r in results.items() if "error" in r]
    for kind, r in results.items():
        entry["losses"][kind] = r.get("losses")
        entry["peak"][kind] = r.get("peak")
    entry["took_over"] = results.get("flatgrad", {}).get("took_over")
    if errors:
        entry.update(error="\n".join(errors), max_rel_diff=None, ok=False)
        return entry
    diff = max_rel_diff(results["stock"]["losses"], results["flatgrad"]["losses"])
    entry.update(max_rel_diff=diff, ok=diff <= rtol and bool(entry["took_over"]))
    if not entry["took_over"]:
        entry["error"] = "flatgrad did not take over the engine's gradient reduction"
    return entry


def rank_main(rank: int, world_size: int, chosen: list[dict], options: dict) -> list[dict]:
    """The spawned rank: every config's two engines in turn, each result also sent as it is done."""
    from flatgrad.testing.deepspeed_rank import init_deepspeed
    from flatgrad.testing.launch import send_message

    init_deepspeed(rank, world_size, options["device"])
    entries = []
    for config in chosen:
        results: dict[str, Any] = {}
        for kind in ("stock", "flatgrad"):
            started = time.perf_counter()
            try:
                results[kind] = _train(config, kind == "flatgrad", options)
            except Exception as exc:  # noqa: BLE001 - a failed engine is a result; the next config runs
                lines = traceback.format_exc().rstrip().splitlines()
                results[kind] = {"error": f"{type(exc).__name__}: {exc}\n" + "\n".join(lines[-12:])}
            results[kind]["wall_s"] = round(time.perf_counter() - started, 1)
        entry = verdict(config, results)
        entry["wall_s"] = {kind: r["wall_s"] for kind, r in results.items()}
        send_message(entry)
        entries.append(entry)
    return entries


def run(args: argparse.Namespace) -> dict:
    """Spawn the rank, collect the configs' entries as they arrive; the JSON document (failures recorded)."""
    import torch

    from flatgrad.testing import launch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read by DeepSpeed when the spawned rank imports it
    chosen = configs(args.device, args.quick)
    if args.configs:
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = sorted(set(names) - {c["name"] for c in chosen})
        if unknown:
            raise RuntimeError(f"--configs: unknown {unknown}; known: {[c['name'] for c in chosen]}")
        chosen = [c for c in chosen if c["name"] in names]
    options = {"device": args.device, "micro_batch": args.micro_batch, "bucket": args.bucket, "lr": args.lr,
               "seed": args.seed}  # fmt: skip
    doc: dict[str, Any] = {"check": "zero_offload", "device": args.device,
                           "gpu": torch.cuda.get_device_name(0) if cuda else None, "options": options,
                           "configs": [], "ok": False}  # fmt: skip

    def arrived(rank: int, entry: dict) -> None:
        doc["configs"].append(entry)
        print(f"zero_offload: {entry['name']}: {'ok' if entry['ok'] else 'FAILED'}"
              f" (max rel diff {entry['max_rel_diff']}, flatgrad took over: {entry['took_over']})", flush=True)
        if entry["error"]:
            print("    " + entry["error"].replace("\n", "\n    "), flush=True)

    try:
        launch.run_ranks(rank_main, 1, chosen, options, backend="nccl" if cuda else "gloo", start_method="spawn",
                         timeout=args.timeout, pg_timeout=timedelta(seconds=min(args.timeout, 120.0)), preload=[],
                         on_message=arrived)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the configs not reached are failures, the finished ones stand
        done = {c["name"] for c in doc["configs"]}
        for config in chosen:
            if config["name"] not in done:
                doc["configs"].append({**config, "ok": False, "max_rel_diff": None, "took_over": None,
                                       "error": f"not finished: {type(exc).__name__}: {exc}"})  # fmt: skip
    doc["ok"] = bool(doc["configs"]) and all(c["ok"] for c in doc["configs"])
    return doc


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable without DeepSpeed or a GPU)."""
    parser = argparse.ArgumentParser(prog="python -m flatgrad.check.zero_offload",
                                     description=(__doc__ or "").splitlines()[0])  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: one NCCL rank on GPU 0 (default); cpu: one gloo rank, no memory figures")
    parser.add_argument("--configs", help="comma-separated config names (default: all; an unknown one lists them)")
    parser.add_argument("--quick", action="store_true", help="fp32 configs only")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per micro-step (default 4)")
    parser.add_argument("--bucket", type=int, default=500_000, help="reduce_bucket_size in elements (default 5e5)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and gate noise derive from it")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run (default 300)")
    parser.add_argument("--out", help="write the JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run, write the JSON, print its line; exit status 1 when a config failed, 2 when it cannot run here."""
    args = build_parser().parse_args(argv)
    try:
        doc = run(args)
    except RuntimeError as exc:
        print(f"zero_offload: {exc}", file=sys.stderr)
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps({"ok": doc["ok"], "configs": {c["name"]: c["ok"] for c in doc["configs"]}}))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
