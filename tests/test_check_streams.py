"""flatgrad.check.streams, the check's streams step: what runs without a GPU (arguments, the stand-in
collectives' arithmetic, the two-stage flow with them on CPU tensors); on a GPU machine, the whole step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from flatgrad import Layout, comm
from flatgrad.check import streams
from flatgrad.kernels import reference
from flatgrad.reducer import Bucket, TwoStageReduceScatter, place_ranks


def test_arguments_parse_with_its_own_parser() -> None:
    args = streams.build_parser().parse_args(["--out", "x.json", "--sleep-cycles", "5"])
    assert args.out == "x.json" and args.sleep_cycles == 5
    assert streams.build_parser().parse_args([]).sleep_cycles == streams.SLEEP_CYCLES


@pytest.mark.timeout(200)
def test_the_step_needs_a_cuda_gpu_or_passes_on_one(tmp_path) -> None:
    out = tmp_path / "streams.json"
    result = subprocess.run([sys.executable, "-m", "flatgrad.check.streams", "--out", str(out)], capture_output=True,
                            text=True, timeout=190)  # fmt: skip
    if torch.cuda.is_available():
        assert result.returncode == 0, result.stdout + result.stderr
        doc = json.loads(out.read_text())
        assert doc["ok"] and doc["cases"] == 9, doc
    else:
        assert result.returncode == 2, result.stdout + result.stderr
        assert "needs a CUDA GPU" in result.stderr and not out.exists()


def test_stand_in_reduce_scatter_writes_the_sum_of_the_group_chunks() -> None:
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)
    stand_in = streams.StandInCollectives([0])
    data = torch.arange(12, dtype=torch.float32)
    out = torch.empty(6)
    work = stand_in.collectives().reduce_scatter_tensor(out, data, op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work.is_completed() and work.wait()
    assert torch.equal(out, data[:6] + data[6:]) and stand_in.calls == 1
    in_place = data.clone()
    stand_in.reduce_scatter_tensor(in_place.narrow(0, 6, 6), in_place, group=group)  # the mode's in-place form
    assert torch.equal(in_place[6:], data[:6] + data[6:])
    with pytest.raises(ValueError, match="expected 2 x 5"):
        stand_in.reduce_scatter_tensor(torch.empty(5), data, group=group)


def test_stand_in_all_to_all_sends_this_ranks_chunk_as_every_identical_rank_would() -> None:
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)  # rank 0 of 2
    stand_in = streams.StandInCollectives([0])
    data = torch.arange(8, dtype=torch.float32)
    out = torch.full((8,), -1.0)
    work = stand_in.collectives().all_to_all_single(out, data, group=group, async_op=True)
    assert work.is_completed() and work.wait()
    assert torch.equal(out, torch.cat([data[:4], data[:4]])) and stand_in.calls == 1
    with pytest.raises(ValueError, match="divisible by 2"):
        stand_in.all_to_all_single(torch.empty(7), torch.empty(7), group=group)


def test_two_stage_order_holds_on_cpu_for_every_emulated_rank() -> None:
    entries = streams.two_stage(torch.device("cpu"))
    assert [e["name"] for e in entries] == [f"two-stage rank {r} of 2x2" for r in range(4)]
    assert all(e["ok"] for e in entries), entries


def test_the_two_stage_expectation_fails_when_the_rail_stage_is_left_out() -> None:
    """Unpacking after the node stage alone (the rail stage never started) gives another shard: the check can fail."""
    numels = [37, 4, 300]
    layout = Layout.flat(numels, 4)
    s = layout.shard_numel
    grads = [torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(i)).float()
             for i, n in enumerate(numels)]  # fmt: skip
    packed = torch.zeros(layout.numel)
    reference.pack(grads, layout, packed, 1.0)
    expected = packed.view(4, s).sum(0)
    group = dist.ProcessGroup(dist.HashStore(), 0, 2)
    shards = {}
    for rail in (True, False):
        mode = TwoStageReduceScatter(place_ranks(2, [0, 1, 2, 3], 4, 3))
        mode.node_group = mode.rail_group = group
        params = tuple(torch.nn.Parameter(torch.zeros(n)) for n in numels)
        averaging = comm.Averaging(dist.ReduceOp.SUM, 1.0, 1.0)
        b = Bucket(0, params, layout, 3, comm_dtype=torch.float32, averaging=averaging,
                   method="tensor", backend=None, mode=mode, prescale=1.0, postscale=1.0, streams=None)  # fmt: skip
        stand_in = streams.StandInCollectives([0])
        flight = b.reduce(grads, group, stand_in.collectives(), buffers={"input": torch.empty(layout.numel)})
        if rail:
            flight.wait()
        shard = torch.empty(s)
        flight.unpack(shard, False, False)
        shards[rail] = (shard, stand_in.calls)
    assert torch.equal(shards[True][0], expected) and shards[True][1] == 2
    assert not torch.equal(shards[False][0], expected) and shards[False][1] == 1
