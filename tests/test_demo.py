"""``flatgrad demo``: a real 4-rank run (gloo, real DeepSpeed) gives the table, JSON and chart with measured
figures; a failing rank surfaces in the parent with its traceback and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from flatgrad import cli
from flatgrad.demo import report
from flatgrad.demo.setups import SETUPS, by_key
from flatgrad.testing import launch

pytestmark = pytest.mark.multiproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD_SIZE = 4


# --------------------------------------------------------------------------- the demo end to end


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One 2-step run of every setup on 4 ranks; its exit status, stdout and JSON, and the output dir."""
    out = tmp_path_factory.mktemp("demo")
    import contextlib
    import io

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        argv = ["demo", "--world-size", str(WORLD_SIZE), "--steps", "2", "--no-progress", "--out-dir", str(out)]
        status = cli.main(argv)
    doc = json.loads((out / "demo.json").read_text()) if status == 0 else None
    return status, stdout.getvalue(), doc, out


@pytest.mark.timeout(240)
def test_small_run_prints_the_table_and_writes_json_and_chart(small_run):
    status, text, doc, out = small_run
    assert status == 0
    assert [r["key"] for r in doc["rows"]] == [s.key for s in SETUPS]
    assert doc["config"]["world_size"] == WORLD_SIZE and doc["config"]["device"] == "cpu"
    for row in doc["rows"]:
        assert row["label"] in text
        assert row["backward_ms"] > 0 and row["step_ms"] >= row["backward_ms"] > 0
        assert row["sent_mb_per_rank"] > 0
    assert "calls: gradient reductions" in text and "max |dloss|" in text
    png = (out / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert sorted(os.listdir(out / "logs")) == [f"rank{r}.log" for r in range(WORLD_SIZE)]


@pytest.mark.timeout(240)
def test_flatgrad_zero2_issues_one_reduce_scatter_per_multi_rank_sub_group(small_run):
    _, _, doc, _ = small_run
    rows = {r["key"]: r for r in doc["rows"]}
    flat, reduce_mode, allreduce_mode = rows["flatgrad_zero2"], rows["stock_zero2_reduce"], rows["stock_zero2"]
    assert flat["model"] == reduce_mode["model"] == "seed-moe" and flat["n_params"] == 10_026_000
    # Counted calls, not configured ones: one reduce_scatter per sub-group that spans more than one
    # rank; the expert sub-groups (one rank each at W=4, ep_size 4) need no collective.
    assert flat["reductions"] == flat["reductions_multi_rank"] == flat["sub_groups_multi_rank"] > 0
    assert flat["sub_groups"] > flat["sub_groups_multi_rank"]
    assert {c["op"] for c in flat["reduction_calls_rank0"]} == {"reduce_scatter"}
    assert all(c["group"] == list(range(WORLD_SIZE)) for c in flat["reduction_calls_rank0"])
    # Stock's reduce mode: one dist.reduce per rank-run, more calls even on the multi-rank group alone.
    assert {c["op"] for c in reduce_mode["reduction_calls_rank0"]} == {"reduce"}
    assert reduce_mode["reductions_multi_rank"] > flat["reductions"]
    assert reduce_mode["reductions"] > reduce_mode["reductions_multi_rank"]  # it calls on one-rank expert groups too
    assert {c["op"] for c in allreduce_mode["reduction_calls_rank0"]} == {"all_reduce"}
    # Bytes: a reduce_scatter sends (W-1)/W of its buffer, an all_reduce twice that.
    assert flat["sent_mb_per_rank"] < 0.6 * allreduce_mode["sent_mb_per_rank"]


@pytest.mark.timeout(240)
def test_reduction_mode_rows_move_each_bucket_with_one_all_to_all(small_run):
    _, text, doc, _ = small_run
    rows = {r["key"]: r for r in doc["rows"]}
    flat = rows["flatgrad_zero2"]
    assert "flatgrad ZeRO-2, exact" in text and "flatgrad ZeRO-2, int8 + error feedback" in text
    for key in ("flatgrad_zero2_exact", "flatgrad_zero2_int8"):
        row = rows[key]
        # The same buckets, each one all_to_all on the whole group instead of one reduce_scatter; the MoE's own
        # all_to_alls (dispatch and combine in backward) are not counted as reductions.
        assert {c["op"] for c in row["reduction_calls_rank0"]} == {"grad_all_to_all"}
        assert row["reductions"] == row["reductions_multi_rank"] == flat["reductions"] > 0  # one-rank groups: copies
        assert all(c["group"] == list(range(WORLD_SIZE)) for c in row["reduction_calls_rank0"])
        assert row["calls_by_phase_rank0"]["backward"].get("all_to_all", 0) > 0  # the MoE layer's, recorded apart
    # exact (fp32 demo: fp32 wire) sends what the reduce_scatter sends; int8 one byte plus a scale per 256.
    assert rows["flatgrad_zero2_exact"]["sent_mb_per_rank"] == pytest.approx(flat["sent_mb_per_rank"])
    int8 = rows["flatgrad_zero2_int8"]
    assert [c["dtype"] for c in int8["reduction_calls_rank0"]] == ["uint8"] * int8["reductions"]
    assert 0.25 <= int8["sent_mb_per_rank"] / flat["sent_mb_per_rank"] < 0.26
    # exact sums in fp32 in rank order: as close to stock as flatgrad's reduce_scatter; int8 is quantized.
    assert rows["flatgrad_zero2_exact"]["max_loss_diff"] <= 1e-5
    assert int8["max_loss_diff"] <= 1e-3


@pytest.mark.timeout(240)
def test_two_stage_rows_reduce_each_bucket_in_the_node_then_over_the_rail(small_run):
    _, text, doc, _ = small_run
    rows = {r["key"]: r for r in doc["rows"]}
    flat = rows["flatgrad_zero2"]
    node, rail = [0, 1], [0, 2]  # rank 0 of 4 ranks as 2 nodes of 2
    twod, hier = rows["flatgrad_zero2_2d"], rows["flatgrad_zero2_hier_int8"]
    assert "2d_reduce_scatter, 2 nodes" in text and "hier_int8, 2 nodes" in text
    for row in (twod, hier):
        calls = row["reduction_calls_rank0"]
        assert [c["group"] for c in calls].count(node) == [c["group"] for c in calls].count(rail) == flat["reductions"]
        assert {c["op"] for c in calls if c["group"] == node} == {"reduce_scatter"}
    assert {c["op"] for c in twod["reduction_calls_rank0"] if c["group"] == rail} == {"reduce_scatter"}
    assert {(c["op"], c["dtype"]) for c in hier["reduction_calls_rank0"] if c["group"] == rail} == {("grad_all_to_all", "uint8")}
    # fp32 demo: a node sum, then a rail sum, where the flat ring sums in another order; int8 is quantized.
    assert twod["max_loss_diff"] <= 1e-5
    assert hier["max_loss_diff"] <= 1e-3


@pytest.mark.timeout(240)
def test_losses_match_stock(small_run):
    _, text, doc, _ = small_run
    rows = {r["key"]: r for r in doc["rows"]}
    for row in rows.values():
        assert len(row["losses"]) == WORLD_SIZE and all(len(ls) == 2 for ls in row["losses"])
        assert all(ls[0] != ls[1] for ls in row["losses"]), "the weights must change between steps"
    assert rows["stock_zero2"]["losses"] != rows["stock_zero3"]["losses"]  # different models: not compared
    assert rows["flatgrad_zero2"]["max_loss_diff"] <= 1e-5
    # Judged against stock's own spread between its two ZeRO-2 methods, which depends on the machine's gloo.
    spread = rows["stock_zero2_reduce"]["max_loss_diff"]
    for key in ("flatgrad_zero2", "flatgrad_zero2_exact", "flatgrad_zero2_2d", "flatgrad_zero2_offload"):
        assert rows[key]["stock_spread"] == spread and rows[key]["within_stock_spread"], (key, rows[key], spread)
    assert rows["flatgrad_zero3"]["stock_spread"] is None and rows["stock_zero2"]["stock_spread"] is None
    assert "vs stock spread" in text and "the spread" in text
    # ZeRO-Offload: flatgrad's reduction into the host partitions against stock's offload, same calls as without.
    offload = rows["flatgrad_zero2_offload"]
    assert offload["reference"] == "stock_zero2_offload" and offload["max_loss_diff"] <= 1e-5
    assert offload["reductions"] == rows["flatgrad_zero2"]["reductions"]
    assert {c["op"] for c in offload["reduction_calls_rank0"]} == {"reduce_scatter"}
    # flatgrad's ZeRO-3 keeps stock's arithmetic and collective: bitwise equal.
    assert rows["flatgrad_zero3"]["max_loss_diff"] == 0.0
    # DeepSpeed refuses its native MoE under ZeRO-3; the ZeRO-3 rows say so and train the dense model.
    assert "MoE" in doc["zero3_refusal"]
    assert rows["stock_zero3"]["model"] == rows["flatgrad_zero3"]["model"] == "mlp"
    assert "ZeRO-3 rows train a dense model" in text


def test_summary_compares_each_row_with_its_reference():
    """report.summarize on hand-made measurements: loss differences against the reference, agreement checks."""
    setups = by_key(["flatgrad_zero2"])
    assert [s.key for s in setups] == ["stock_zero2", "flatgrad_zero2"]

    def measurements(losses_by_setup, reductions=1):
        call = ("backward", "reduce_scatter", 8, "float32", (0, 1), None)
        steps = lambda losses: [  # noqa: E731
            {"loss": loss, "forward": 0.1, "backward": 0.2, "optimizer": 0.1, "step": 0.4, "calls": [call] * reductions}
            for loss in losses
        ]
        info = {"model": "seed-moe", "n_params": 10}
        memory = {"peak_bytes": 2e6, "held_bytes": 1e6}
        setups = {k: {"info": info, "steps": steps(v), "memory": memory} for k, v in losses_by_setup.items()}
        return {"setups": setups, "zero3_refusal": None}

    per_rank = [
        measurements({"stock_zero2": [1.0, 0.5], "flatgrad_zero2": [1.0, 0.5]}),
        measurements({"stock_zero2": [2.0, 1.0], "flatgrad_zero2": [2.0, 1.25]}),
    ]
    rows = {r["key"]: r for r in report.summarize(setups, per_rank)["rows"]}
    assert rows["flatgrad_zero2"]["max_loss_diff"] == 0.25 and rows["stock_zero2"]["max_loss_diff"] == 0.0
    assert rows["flatgrad_zero2"]["stock_spread"] is None  # no reduce-mode row: no spread to judge by
    assert rows["flatgrad_zero2"]["sent_mb_per_rank"] == pytest.approx(8 * 4 * (1 / 2) / 1e6)  # (W-1)/W of 32 bytes
    assert rows["flatgrad_zero2"]["peak_mb_per_rank"] == 2.0 and rows["flatgrad_zero2"]["peak_x_reference"] == 1.0
    per_rank[1] = measurements({"stock_zero2": [2.0, 1.0], "flatgrad_zero2": [2.0, 1.0]}, reductions=2)
    with pytest.raises(RuntimeError, match="reductions per backward differs"):
        report.summarize(setups, per_rank)


def test_flatgrad_rows_are_judged_against_stocks_own_spread():
    """A flatgrad ZeRO-2 row within stock's spread between its two methods passes on any machine; one above it
    is reported with the multiple; ZeRO-3 rows have no spread to be judged by."""
    setups = by_key(["stock_zero2_reduce", "flatgrad_zero2", "flatgrad_zero2_int8", "flatgrad_zero3"])

    def measurements(losses_by_setup):
        call = ("backward", "reduce_scatter", 8, "float32", (0, 1), None)
        steps = lambda losses: [  # noqa: E731
            {"loss": loss, "forward": 0.1, "backward": 0.2, "optimizer": 0.1, "step": 0.4, "calls": [call]}
            for loss in losses
        ]
        info = {"model": "seed-moe", "n_params": 10, "sub_groups": 2, "sub_groups_multi_rank": 2}
        memory = {"peak_bytes": 2e6, "held_bytes": 1e6}
        return {"setups": {k: {"info": info, "steps": steps(v), "memory": memory} for k, v in losses_by_setup.items()},
                "zero3_refusal": None}  # fmt: skip

    eps = 1.1920928955078125e-07
    losses = {"stock_zero2": [1.0, 0.5], "stock_zero2_reduce": [1.0, 0.5 + eps], "flatgrad_zero2": [1.0, 0.5 + eps],
              "flatgrad_zero2_int8": [1.0, 0.5 + 4 * eps], "stock_zero3": [2.0, 1.0], "flatgrad_zero3": [2.0, 1.0]}
    summary = report.summarize(setups, [measurements(losses), measurements(losses)])
    rows = {r["key"]: r for r in summary["rows"]}
    spread = rows["stock_zero2_reduce"]["max_loss_diff"]
    assert spread > 0 and rows["flatgrad_zero2"]["within_stock_spread"] is True
    assert rows["flatgrad_zero2_int8"]["within_stock_spread"] is False and rows["flatgrad_zero3"]["stock_spread"] is None
    cells = {line.split("  ")[0]: line.split()[-1] for line in report.text_table(summary, 2, "cpu").splitlines()
             if "ZeRO" in line and "  " in line}  # fmt: skip
    assert cells["flatgrad ZeRO-2"] == "within" and cells["stock ZeRO-2, reduce mode"] == "spread"
    assert cells["flatgrad ZeRO-2, int8 + error feedback"] == "4x" and cells["flatgrad ZeRO-3"] == "-"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "6"], "--world-size must be a multiple of 4"),
        (["--setups", "stock_zero2,nope"], "--setups: unknown setup(s) ['nope']"),
        (["--fail-rank", "4"], "--fail-rank 4 is not a rank of world size 4"),
        (["--device", "cuda"], "--device cuda"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(argv, message, capsys, tmp_path):
    import torch

    if argv[:2] == ["--device", "cuda"] and torch.cuda.device_count() >= 4:
        pytest.skip("this machine has 4+ GPUs: --device cuda is valid here")
    assert cli.main(["demo", "--out-dir", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def _session_processes(sid: int) -> list[str]:
    """``pid cmdline`` of every live process in session ``sid``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, ppid, pgrp, session
            found.append(f"{pid} {cmd[:120]}")
    return found


@pytest.mark.timeout(180)
def test_a_failing_rank_surfaces_with_its_traceback_and_no_process_survives(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "flatgrad", "demo", "--fail-rank", "2", "--setups", "flatgrad_zero2", "--steps", "1",
            "--no-progress", "--out-dir", str(tmp_path)]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, stderr
    assert "flatgrad demo: rank 2 failed" in stderr
    assert "RuntimeError: injected failure on rank 2" in stderr and "_inject_failure" in stderr
    assert "Traceback (most recent call last)" in stderr
    assert "flatgrad demo: 4" not in stdout  # no table from a failed run
    assert elapsed < 120  # the blocked ranks were killed, not left to time out
    # The ranks are killed before the command returns; the forkserver and resource tracker
    # follow their parent out within moments. Nothing of the session may remain.
    deadline = time.monotonic() + 15
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(proc.pid) == []


@pytest.mark.timeout(120)
def test_sigterm_to_the_command_stops_every_rank(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "flatgrad", "demo", "--steps", "50", "--no-progress", "--out-dir", str(tmp_path)]
    proc = subprocess.Popen(argv, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        logs = tmp_path / "logs"
        deadline = time.monotonic() + 80
        while time.monotonic() < deadline and proc.poll() is None:
            if logs.is_dir() and len(os.listdir(logs)) == WORLD_SIZE:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        assert len(os.listdir(logs)) == WORLD_SIZE, "the ranks never started"
        time.sleep(2)  # the ranks are inside DeepSpeed now
        proc.send_signal(15)  # the command only, as a scheduler or `kill` would
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 130, stderr
    assert "interrupted; the ranks were stopped" in stderr
    deadline = time.monotonic() + 15
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session_processes(proc.pid) == []


# --------------------------------------------------------------------------- the launcher's message channel


def _chatty(rank: int, world_size: int, n: int) -> int:
    for i in range(n):
        launch.send_message((rank, i))
    dist.barrier()
    return rank * 10


@pytest.mark.timeout(60)
def test_messages_reach_the_parent_in_order_before_the_results():
    got: list[tuple[int, tuple[int, int]]] = []
    results = launch.run_ranks(_chatty, 2, 3, timeout=50, on_message=lambda rank, msg: got.append((rank, msg)))
    assert results == [0, 10]
    for rank in range(2):
        assert [m for r, m in got if r == rank] == [(rank, i) for i in range(3)]


# --------------------------------------------------------------------------- counting at deepspeed.comm


def _recorded(rank: int, world_size: int) -> list:
    import torch

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", DS_ACCELERATOR="cpu",
    )  # fmt: skip
    import deepspeed
    import deepspeed.comm as ds_comm

    from flatgrad import comm
    from flatgrad.testing.collectives import CollectiveRecorder

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build (docs/design.md)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    pair = dist.new_group([1, 2])
    recorder = CollectiveRecorder().install()
    try:
        recorder.phase = "backward"
        t = torch.ones(5)
        ds_comm.all_reduce(t)  # DeepSpeed's timed_op wrapper -> torch.distributed.all_reduce: one call
        if rank in (1, 2):
            ds_comm.reduce(torch.ones(7), 2, group=pair)  # positional dst, a sub-group
        out = torch.empty(3)
        dist.reduce_scatter(out, list(torch.ones(3 * world_size).chunk(world_size)))  # flatgrad's path
        recorder.phase = "step"
        comm.all_gather_in_place([torch.zeros(2 * world_size), torch.zeros(4 * world_size)])  # one coalesced launch
        return [tuple(c) for c in recorder.take()]
    finally:
        recorder.uninstall()


@pytest.mark.timeout(90)
def test_recorder_counts_each_call_once_with_its_group_and_destination():
    results = launch.run_ranks(_recorded, 3, timeout=80)
    for rank, calls in enumerate(results):
        expected = [("backward", "all_reduce", 5, "float32", (0, 1, 2), None, "all_reduce")]
        if rank in (1, 2):
            expected.append(("backward", "reduce", 7, "float32", (1, 2), 2, "reduce"))
        expected.append(("backward", "reduce_scatter", 9, "float32", (0, 1, 2), None, "reduce_scatter"))
        expected.append(("step", "all_gather", 18, "float32", (0, 1, 2), None, "all_gather_into_tensor_coalesced"))
        assert calls == expected, (rank, calls)
