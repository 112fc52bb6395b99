"""flatgrad's gradient collectives go through ``deepspeed.comm`` under DeepSpeed (integrations/deepspeed/collectives.py).

Real DeepSpeed on gloo, 2 ranks: DeepSpeed's comms logger (``"comms_logger"``
in the config, ``prof_all``) records what flatgrad issues, as it records
stock's; and something that wraps ``deepspeed.comm`` after the engine is built
still sees the calls (they are looked up at every call).
"""

from __future__ import annotations

import pytest
import torch
from _ds import MLP, ds_config, launch, make_batches, train

pytestmark = pytest.mark.multiproc

D_IN, D_OUT = 13, 5
STEPS = 2


def _logged() -> dict[str, int]:
    """Calls per record name in DeepSpeed's comms logger."""
    import deepspeed.comm as ds_comm

    return {name: sum(entry[0] for entry in sizes.values()) for name, sizes in ds_comm.comms_logger.comms_dict.items()}


def _run(kind: str, stage: int, flatgrad: dict, rank: int) -> tuple[dict[str, int], int, int]:
    """(comms-logger calls per name, sub-groups or 0, calls seen by a wrapper installed after the build)."""
    import deepspeed
    import deepspeed.comm as ds_comm

    import flatgrad.deepspeed as fds

    torch.manual_seed(0)
    model = MLP(D_IN, 37, D_OUT)
    cfg = ds_config(stage, bucket=600)
    cfg["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    initialize = deepspeed.initialize
    if kind == "flatgrad":
        cfg["flatgrad"] = flatgrad
        initialize = fds.initialize
    engine = initialize(model=model, model_parameters=list(model.parameters()), config=cfg)[0]
    ds_comm.comms_logger.comms_dict.clear()
    seen = [0]
    names = ("reduce_scatter_fn", "reduce_scatter", "all_to_all_single")
    originals = {name: getattr(ds_comm, name) for name in names}

    def wrap(fn):
        def wrapper(*args, **kwargs):
            seen[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(ds_comm, name, wrap(fn))
    try:
        train(engine, make_batches(rank, STEPS, 2, D_IN, D_OUT))
    finally:
        for name, fn in originals.items():
            setattr(ds_comm, name, fn)
    logged = _logged()
    sub_groups = len(engine.optimizer.bit16_groups) if stage in (1, 2) else 0
    engine.destroy()
    ds_comm.comms_logger.enabled = False
    return logged, sub_groups, seen[0]


def _rank(rank: int, world_size: int) -> dict:
    return {
        "zero2 list": _run("flatgrad", 2, {}, rank),
        "zero2 tensor": _run("flatgrad", 2, {"reduce_scatter_method": "tensor"}, rank),
        "zero2 exact": _run("flatgrad", 2, {"reduction": "exact"}, rank),
        "zero3 stock": _run("stock", 3, {}, rank),
        "zero3 flatgrad": _run("flatgrad", 3, {}, rank),
    }


@pytest.mark.timeout(240)
def test_deepspeeds_comms_logger_and_wrappers_see_flatgrads_collectives():
    for rank, out in enumerate(launch(_rank, 2, timeout=220)):
        for case, name in (("zero2 list", "reduce_scatter"), ("zero2 tensor", "reduce_scatter_tensor"),
                           ("zero2 exact", "all_to_all_single")):  # fmt: skip
            logged, sub_groups, seen = out[case]
            assert sub_groups > 1, (rank, case, out[case])
            # One collective per sub-group and backward, logged under DeepSpeed's name for it.
            assert logged.get(name) == sub_groups * STEPS, (rank, case, logged)
            assert seen == sub_groups * STEPS, (rank, case, seen)
        stock, _, stock_seen = out["zero3 stock"]
        mine, _, mine_seen = out["zero3 flatgrad"]
        # ZeRO-3: the reduce_scatters stock logs, as many, through reduce_scatter_fn as stock's.
        assert stock.get("reduce_scatter_tensor", 0) > 0, (rank, stock)
        assert mine.get("reduce_scatter_tensor") == stock["reduce_scatter_tensor"], (rank, stock, mine)
        assert mine_seen == stock_seen > 0, (rank, stock_seen, mine_seen)
