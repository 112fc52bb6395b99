"""bench/gpu_check: the dry run passes here and fails on a broken step; the runner keeps going and summarises.

The GPU steps themselves cannot run without a GPU; what can rot without one is
checked here: every file, test selection, option and snippet the script uses
(``--dry-run``, also run by ``.ci/run``), and the runner (timeouts, a failing
step followed by the next one, the summary) on real subprocesses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def _dry_run(*args: str, root: pathlib.Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    if root is not None:
        env["FLATGRAD_GPU_CHECK_ROOT"] = str(root)
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env=env, capture_output=True, text=True,
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
    for name in ("env", "build", "backends", "test-kernels", "test-cuda", "wire", "test-reducer", "zero-step",
                 "bench", "test-triton"):  # fmt: skip
        assert f"[ok] {name} " in result.stdout, result.stdout
    assert "bench/gpu_wire_check.py --device cuda --backends cuda,triton" in result.stdout
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
    assert "[FAIL] test-kernels" in out and "pytest --collect-only tests/test_kernels.py -k not cpu collects no test" in out


def test_unknown_step_names_are_refused() -> None:
    assert gpu_check.main(["--dry-run", "--only", "nonsense"]) == 2


def _python(name: str, source: str, timeout: float) -> "gpu_check.Step":
    return gpu_check.Step(name, "python", (sys.executable, "-c", source), timeout, snippet=source)


@pytest.mark.timeout(120)
def test_runner_keeps_going_kills_hung_steps_and_summarises(tmp_path: pathlib.Path) -> None:
    steps = [
        _python("first", "import json; print('noise'); print(json.dumps({'gpus': []}))", 30),
        _python("broken", "print('something went wrong'); raise SystemExit(3)", 30),
        _python("hangs", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                         "'import time; time.sleep(60)']); print('hanging', flush=True); time.sleep(60)", 2),
        _python("last", "print('{\"fine\": true}')", 30),
    ]  # fmt: skip
    ctx = gpu_check.Context(root=str(ROOT), out=str(tmp_path / "out"), build_dir=str(tmp_path / "build"))
    started = time.monotonic()
    doc = gpu_check.run_all(ctx, 100, lambda name: name != "skipped", make_plan=lambda c: steps)
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
    ctx = gpu_check.Context(root=str(ROOT), out=str(tmp_path), build_dir=str(tmp_path / "build"))
    doc = gpu_check.run_all(ctx, 6, lambda name: True, make_plan=lambda c: steps)
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
    ctx = gpu_check.Context(root=str(tests), out=str(tmp_path / "out"), build_dir=str(tmp_path / "build"))
    steps = [gpu_check._pytest(ctx, "mixed", 60, 30, ("test_some.py",)),
             gpu_check._pytest(ctx, "skipped", 60, 30, ("test_skipped.py",))]  # fmt: skip
    doc = gpu_check.run_all(ctx, 100, lambda name: True, make_plan=lambda c: steps)
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
    figures = gpu_check.bench_figures(str(out), device="cpu")
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
    text = gpu_check.summary_text(doc)
    assert "pack fp32->bf16: (d)" in text and "x(c)" in text and "ALL PASSED" in text


@pytest.mark.timeout(120)
def test_sigterm_stops_the_running_step_and_still_writes_the_summary(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--only", "env,backends",
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
    ctx = gpu_check.Context(root=str(ROOT), out=str(tmp_path), build_dir=str(tmp_path / "build"))
    steps = gpu_check.plan(ctx)
    assert [s.name for s in steps] == list(gpu_check.BUDGET)
    assert {s.name: s.timeout_s for s in steps} == gpu_check.BUDGET
    assert sum(s.timeout_s for s in steps) <= 480 == gpu_check.BUDGET_S
    order = [s.name for s in steps]  # by value: build, kernel correctness, wire, reducer, ZeRO, throughput
    assert order.index("build") < order.index("test-kernels") < order.index("wire") < order.index("test-reducer")
    assert order.index("test-reducer") < order.index("zero-step") < order.index("bench")
    quick = gpu_check.plan(dataclasses.replace(ctx, quick=True))
    assert sum(s.timeout_s for s in quick) <= 240
    table = gpu_check.budget_table(steps)
    assert "wire" in table and f"{sum(gpu_check.BUDGET.values()):6.0f} s of 480 s" in table


@pytest.mark.timeout(200)
def test_dry_run_fails_a_test_selection_that_collects_nothing(tmp_path: pathlib.Path) -> None:
    """A selection collecting no test fails the dry run, also in a module that skips here for want of a GPU
    (there its -k is matched against the test names in the source)."""
    ctx = gpu_check.Context(root=str(ROOT), out=str(tmp_path), build_dir=str(tmp_path / "build"))
    selections = {
        "typo": ("tests/test_kernels.py", "-k", "no_such_test_anywhere"),
        "gpu-typo": ("tests/test_cuda.py", "-k", "no_such_test_anywhere"),
        "gpu-ok": ("tests/test_cuda.py", "-k", "current_stream"),
    }
    found = {}
    for name, selection in selections.items():
        step = gpu_check._pytest(ctx, name, 10, 10, selection)
        found[name] = gpu_check.check_step(step, ctx)
    assert found["typo"] and "collects no test" in found["typo"][0], found
    assert found["gpu-typo"] and "matches no test" in found["gpu-typo"][0], found
    assert found["gpu-ok"] == [], found


@pytest.mark.timeout(300)
def test_wire_check_script_runs_on_cpu() -> None:
    """bench/gpu_wire_check.py, the wire step, on the CPU backend: every mode agrees with the reference."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_wire_check.py"), "--device", "cpu", "--backends", "cpu", "--quick"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["ok"] and figures["backends"]["cpu"]["cases"] >= 40, figures
