"""flatgrad check (and bench/gpu_check.sh over a checkout): the dry run passes here and fails on a broken step;
the runner keeps going and summarises.

The GPU steps themselves cannot run without a GPU; what can rot without one is
checked here: every module, file, test selection and option the check uses
(``--dry-run``, also run by CI, with a checkout and from outside one), and the
runner (timeouts, a failing step followed by the next one, the summary) on
real subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from flatgrad.check import command, plan, runner, summary

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path("bench") / "gpu_check.sh"
IN_PACKAGE = ("env", "backends", "kernels", "zero-offload", "streams", "wire", "zero-step", "qgz", "bench")


def _dry_run(*args: str, root: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """``bench/gpu_check.sh --dry-run`` of the checkout ``root`` (the script passes ``--root`` itself)."""
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", str(root / SCRIPT), "--dry-run", *args], env=env, capture_output=True, text=True,
                          timeout=280)  # fmt: skip


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of this checkout's sources (no build outputs), to break."""
    ignore = shutil.ignore_patterns(".git", "build", "*.so", "__pycache__", ".hypothesis", ".pytest_cache",
                                    "gpu-check-out", ".whl", ".torch_extensions", "*.egg-info")  # fmt: skip
    copy = tmp_path / "tree"
    shutil.copytree(ROOT, copy, ignore=ignore)
    return copy


@pytest.mark.timeout(300)
def test_dry_run_passes_and_prints_every_step() -> None:
    result = _dry_run()
    assert result.returncode == 0, result.stdout + result.stderr
    for name in plan.BUDGET:
        assert f"[ok] {name} " in result.stdout, result.stdout
    assert "-m flatgrad.check.wire --device cuda --backends cuda,triton" in result.stdout
    assert "-m flatgrad.check.zero_offload --device cuda" in result.stdout
    assert "-m flatgrad.check.streams" in result.stdout
    assert "-m flatgrad.check.qgz --device cuda --backends cuda,triton --stock-timeout 15" in result.stdout
    assert "budget (each step's timeout" in result.stdout and "total" in result.stdout
    assert "flatgrad bench --device cuda" in result.stdout
    assert "tests/test_reducer_cuda.py" in result.stdout


@pytest.mark.timeout(180)
def test_dry_run_fails_naming_each_broken_step(tree: pathlib.Path) -> None:
    """Four ways a step rots, one per step; the sound step beside them still passes."""
    (tree / "tests" / "test_cuda.py").unlink()
    bench = tree / "flatgrad" / "bench" / "pack_unpack.py"
    text = bench.read_text()
    assert '"--device", choices=' in text
    bench.write_text(text.replace('"--device", choices=', '"--on", choices='))
    reducer = tree / "tests" / "test_reducer_cuda.py"
    reducer.write_text(reducer.read_text() + "\ndef broken(:\n")
    kernels = tree / "tests" / "test_kernels.py"
    kernels.write_text(kernels.read_text().replace("def test_", "def check_"))
    result = _dry_run("--only", "env,test-cuda,bench,test-reducer,test-kernels", root=tree)
    assert result.returncode == 1, result.stdout
    out = result.stdout
    assert "[ok] env" in out and "4 not" in out, out
    assert "[FAIL] test-cuda" in out and "tests/test_cuda.py does not exist" in out
    assert "[FAIL] bench" in out and "unrecognized arguments: --device cuda" in out
    assert "[FAIL] test-reducer" in out and "tests/test_reducer_cuda.py does not compile" in out
    assert "[FAIL] test-kernels" in out
    assert "pytest --collect-only tests/test_kernels.py -k not cpu collects no test" in out


@pytest.mark.timeout(300)
def test_dry_run_from_the_installed_package_outside_any_checkout(tmp_path: pathlib.Path) -> None:
    """``python -m flatgrad.check --dry-run`` in a folder outside the checkout, no --root: every in-package step
    is checked (its module imports, its arguments parse), the checkout's steps are listed as skipped."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "flatgrad.check", "--dry-run"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=280)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "dry run of the installed package" in out
    for name in IN_PACKAGE:
        assert f"[ok] {name} " in out, out
    for name in plan.CHECKOUT_ONLY:
        assert f"[skipped] {name} (timeout {plan.BUDGET[name]:g} s): needs a source checkout (--root)" in out, out
    assert f"{len(IN_PACKAGE)} of {len(IN_PACKAGE)} steps sound; {len(plan.CHECKOUT_ONLY)} skipped" in out
    assert f"  total            {sum(plan.BUDGET.values()):.0f} s of 480 s" in out, out
    assert not (tmp_path / "gpu-check-out").exists()  # a dry run writes nothing


@pytest.mark.timeout(120)
def test_flatgrad_check_subcommand_dry_run() -> None:
    result = subprocess.run([sys.executable, "-m", "flatgrad", "check", "--dry-run", "--only", "streams,zero-offload"],
                            capture_output=True, text=True, timeout=110)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ok] streams " in result.stdout and "[ok] zero-offload " in result.stdout
    assert "2 of 2 steps sound" in result.stdout


def test_unknown_step_names_are_refused() -> None:
    assert command.main(["--dry-run", "--only", "nonsense"]) == 2


def test_a_root_that_is_no_checkout_is_refused(tmp_path: pathlib.Path) -> None:
    assert command.main(["--dry-run", "--root", str(tmp_path)]) == 2


@pytest.mark.timeout(120)
def test_dry_run_fails_a_module_step_whose_arguments_do_not_parse(tmp_path: pathlib.Path) -> None:
    ctx = plan.Context(root=None, out=str(tmp_path), build_dir=str(tmp_path / "build"))
    bad = plan.Step("kernels", "module", (), 10, module="flatgrad.check.kernels", args=("--on", "cuda"))
    missing = plan.Step("gone", "module", (), 10, module="flatgrad.check.no_such_step")
    good = plan.Step("streams", "module", (), 10, module="flatgrad.check.streams", args=("--out", "x.json"))
    found = {s.name: runner.check_step(s, ctx) for s in (bad, missing, good)}
    assert found["kernels"] and "unrecognized arguments: --on cuda" in found["kernels"][0], found
    assert found["gone"] and "No module named 'flatgrad.check.no_such_step'" in found["gone"][0], found
    assert found["streams"] == [], found


def test_checkout_steps_are_skipped_without_a_checkout(tmp_path: pathlib.Path) -> None:
    ctx = plan.Context(root=None, out=str(tmp_path / "out"), build_dir=str(tmp_path / "build"))
    steps = [plan.pytest_step(ctx, "test-cuda", 10, 10, ("tests/test_cuda.py",)), _python("after", "print(1)", 30)]
    doc = runner.run_all(ctx, 100, lambda name: True, make_plan=lambda c: steps)
    first, after = doc["steps"]
    assert first == {"name": "test-cuda", "status": "skipped", "reason": "needs a source checkout (--root)"}
    assert after["status"] == "passed" and doc["ok"]


def _python(name: str, source: str, timeout: float) -> plan.Step:
    return plan.Step(name, "module", (sys.executable, "-c", source), timeout)


@pytest.mark.timeout(120)
def test_runner_keeps_going_kills_hung_steps_and_summarises(tmp_path: pathlib.Path) -> None:
    steps = [
        _python("first", "import json; print('noise'); print(json.dumps({'gpus': []}))", 30),
        _python("broken", "print('something went wrong'); raise SystemExit(3)", 30),
        _python("hangs", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                         "'import time; time.sleep(60)']); print('hanging', flush=True); time.sleep(60)", 2),
        _python("last", "print('{\"fine\": true}')", 30),
    ]  # fmt: skip
    ctx = plan.Context(root=str(ROOT), out=str(tmp_path / "out"), build_dir=str(tmp_path / "build"))
    started = time.monotonic()
    doc = runner.run_all(ctx, 100, lambda name: name != "skipped", make_plan=lambda c: steps)
    assert time.monotonic() - started < 40, "the hung step (and its child) must be killed at its timeout"
    status = {r["name"]: r["status"] for r in doc["steps"]}
    assert status == {"first": "passed", "broken": "failed", "hangs": "timeout", "last": "passed"}
    assert not doc["ok"]
    records = {r["name"]: r for r in doc["steps"]}
    assert records["broken"]["rc"] == 3 and "something went wrong" in records["broken"]["tail"]
    assert records["last"]["figures"] == {"fine": True}
    text = (tmp_path / "out" / "summary.txt").read_text()
    assert "FAILURES" in text and "--- broken failed (exit 3)" in text and "--- hangs timeout" in text
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"][1]["status"] == "failed"
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "===== hangs" in log and "hanging" in log


@pytest.mark.timeout(60)
def test_runner_stops_starting_steps_when_the_budget_is_spent(tmp_path: pathlib.Path) -> None:
    steps = [_python("slow", "import time; time.sleep(30)", 30), _python("after", "print(1)", 30)]
    ctx = plan.Context(root=str(ROOT), out=str(tmp_path), build_dir=str(tmp_path / "build"))
    doc = runner.run_all(ctx, 6, lambda name: True, make_plan=lambda c: steps)
    assert [r["status"] for r in doc["steps"]] == ["timeout", "not run"]
    assert "budget" in doc["steps"][1]["reason"]


@pytest.mark.timeout(120)
def test_pytest_step_counts_and_an_all_skipped_run_is_a_failure(tmp_path: pathlib.Path) -> None:
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_some.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "@pytest.mark.skip(reason='needs a CUDA GPU')\ndef test_gpu():\n    pass\n"
        "def test_bad():\n    assert 1 == 2\n"
    )
    (tests / "test_skipped.py").write_text("import pytest\npytest.skip('no CUDA device', allow_module_level=True)\n")
    ctx = plan.Context(root=str(tests), out=str(tmp_path / "out"), build_dir=str(tmp_path / "build"))
    steps = [plan.pytest_step(ctx, "mixed", 60, 30, ("test_some.py",)),
             plan.pytest_step(ctx, "skipped", 60, 30, ("test_skipped.py",))]  # fmt: skip
    doc = runner.run_all(ctx, 100, lambda name: True, make_plan=lambda c: steps)
    mixed, skipped = doc["steps"]
    assert mixed["status"] == "failed"
    assert mixed["figures"]["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert any("needs a CUDA GPU" in line for line in mixed["figures"]["skipped"])
    assert any("test_bad" in line for line in mixed["figures"]["failures"])
    assert skipped["status"] == "failed" and "no test passed" in skipped["reason"]


@pytest.mark.timeout(180)
def test_bench_figures_and_summary_from_a_real_bench_run(tmp_path: pathlib.Path) -> None:
    """The figures the summary shows, read from a real ``flatgrad bench`` run on CPU (the GPU run has the same JSON)."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "flatgrad", "bench", "--quick", "--device", "cpu", "--buckets", "transformer",
                    "--backends", "torch", "--out", str(out)], check=True, capture_output=True, cwd=ROOT,
                   timeout=170)  # fmt: skip
    figures = summary.bench_figures(str(out), device="cpu")
    assert set(figures["cases"]) == {"pack bf16->bf16", "pack fp32->bf16", "unpack bf16->fp32 +="}
    pack = figures["cases"]["pack bf16->bf16"]
    assert pack["roofline_gbps"] > 0 and pack["chunk_cat_gbps"] > 0 and pack["deepspeed_zero3_gbps"] > 0
    torch_row = pack["backends"]["torch"]
    assert torch_row["gbps"] > 0 and torch_row["x_roofline"] > 0 and torch_row["x_chunk_cat"] > 0
    assert torch_row["x_deepspeed"] > 0
    unpack = figures["cases"]["unpack bf16->fp32 +="]["backends"]["torch"]
    assert unpack["x_chunk_cat"] is None and unpack["x_roofline"] > 0
    doc = {"started": "now", "quick": True, "budget_s": 240, "wall_s": 1.0, "ok": True,
           "steps": [{"name": "bench", "status": "passed", "wall_s": 1.0, "figures": figures}]}  # fmt: skip
    text = summary.summary_text(doc)
    assert "pack fp32->bf16: (d)" in text and "x(c)" in text and "ALL PASSED" in text


@pytest.mark.timeout(120)
def test_sigterm_stops_the_running_step_and_still_writes_the_summary(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "flatgrad.check", "--only", "env,backends",
                             "--out", str(out), "--build-dir", str(tmp_path / "build")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out / "gpu_check.log").exists() or "===== env" not in (out / "gpu_check.log").read_text():
        assert time.monotonic() < deadline and proc.poll() is None, "the env step never started"
        time.sleep(0.05)
    proc.terminate()
    assert proc.wait(timeout=60) == 1
    steps = {r["name"]: r for r in json.loads((out / "summary.json").read_text())["steps"]}
    assert steps["env"]["status"] == "interrupted"
    assert steps["backends"]["status"] == "not run" and "interrupted" in steps["backends"]["reason"]
    assert "--- env interrupted" in (out / "summary.txt").read_text()


def test_budget_table_sums_every_default_timeout_within_480_s(tmp_path: pathlib.Path) -> None:
    """Every step's default timeout comes from BUDGET, in order, and together they fit the 8-minute run."""
    for root in (str(ROOT), None):
        ctx = plan.Context(root=root, out=str(tmp_path), build_dir=str(tmp_path / "build"))
        steps = plan.plan(ctx)
        assert [s.name for s in steps] == list(plan.BUDGET)
        assert {s.name: s.timeout_s for s in steps} == plan.BUDGET
        assert sum(s.timeout_s for s in steps) <= 480 == plan.BUDGET_S
        assert [s.name for s in steps if s.checkout] == list(plan.CHECKOUT_ONLY)
    order = [s.name for s in steps]  # by what a run cut short must not miss
    for before, after in zip(("wheels", "env", "build", "backends", "kernels", "zero-offload", "streams", "wire"),
                             ("env", "build", "backends", "kernels", "zero-offload", "streams", "wire", "zero-step")):
        assert order.index(before) < order.index(after), order
    assert order.index("zero-step") < min(order.index(n) for n in ("test-reducer", "test-cuda", "bench", "test-triton"))
    # A spawned rank's cold start (torch, DeepSpeed, NCCL) takes 25-40 s before its first step.
    assert min(plan.BUDGET[n] for n in ("zero-offload", "zero-step")) >= 60
    quick = plan.plan(dataclasses.replace(ctx, quick=True))
    assert sum(s.timeout_s for s in quick) <= 240
    table = plan.budget_table(steps)
    assert "zero-offload" in table and f"{sum(plan.BUDGET.values()):6.0f} s of 480 s" in table


@pytest.mark.timeout(200)
def test_dry_run_fails_a_test_selection_that_collects_nothing(tmp_path: pathlib.Path) -> None:
    """A selection collecting no test fails the dry run, also in a module that skips here for want of a GPU
    (there its -k is matched against the test names in the source)."""
    ctx = plan.Context(root=str(ROOT), out=str(tmp_path), build_dir=str(tmp_path / "build"))
    selections = {
        "typo": ("tests/test_kernels.py", "-k", "no_such_test_anywhere"),
        "gpu-typo": ("tests/test_cuda.py", "-k", "no_such_test_anywhere"),
        "gpu-ok": ("tests/test_cuda.py", "-k", "current_stream"),
    }
    found = {}
    for name, selection in selections.items():
        step = plan.pytest_step(ctx, name, 10, 10, selection)
        found[name] = runner.check_step(step, ctx)
    assert found["typo"] and "collects no test" in found["typo"][0], found
    assert found["gpu-typo"] and "matches no test" in found["gpu-typo"][0], found
    assert found["gpu-ok"] == [], found


@pytest.mark.timeout(300)
def test_wire_step_runs_on_cpu() -> None:
    """flatgrad.check.wire, the wire step, on the CPU backend: every mode agrees with the reference."""
    result = subprocess.run(
        [sys.executable, "-m", "flatgrad.check.wire", "--device", "cpu", "--backends", "cpu", "--quick"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ok"] and figures["backends"]["cpu"]["cases"] >= 40, figures
