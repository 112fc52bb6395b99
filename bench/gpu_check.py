"""Validate flatgrad on a GPU node in one run: build, GPU tests, pack/unpack bench, ZeRO-2/3 steps, one summary.

Run it through ``bench/gpu_check.sh`` (its header says how to run it on the
device machine). Steps, in order, each in its own process with its own timeout
(``BUDGET``, whose default timeouts add up to at most 480 s: the default run
fits in 8 minutes on one H200, a cold build included), all within one overall
budget (``--budget``; ``--quick`` halves the budget, the timeouts and the
work); a step that fails or times out is recorded and the next one runs. The
order is by what a run cut short must not miss:

* ``wheels``: installs ``.whl/*.whl`` (DeepSpeed and its missing dependencies)
  into a private folder put first on ``PYTHONPATH``; skipped without ``.whl/``.
* ``env``: Python, torch, CUDA, NCCL, Triton, DeepSpeed, nvcc and every GPU.
* ``build``: the extension (C++ and CUDA) for the visible GPUs' archs, cached
  in ``--build-dir`` by a hash of the sources, torch, Python and archs; the
  shared object is copied into ``flatgrad/``.
* ``backends``: ``flatgrad.available_backends()``; fails unless ``cuda`` and
  ``triton`` both run on CUDA tensors.
* ``test-kernels``: ``tests/test_kernels.py`` on the ``cuda`` and ``triton``
  backends against the reference (few hypothesis examples: each new pointer
  alignment compiles a Triton specialization).
* ``test-cuda``: ``tests/test_cuda.py`` (streams, devices, tables, graphs).
* ``wire``: ``bench/gpu_wire_check.py``: every wire mode (exact, int8, fp8;
  quantize, fused pack-quantize, dequantize-sum) on ``cuda`` and ``triton``,
  bitwise against the reference on the GPU.
* ``test-reducer``: ``tests/test_reducer_cuda.py`` (the reducer's stream
  hand-off over NCCL on 1 rank, and on 2 when 2 GPUs are visible).
* ``zero-step``: ``bench/gpu_zero_step.py``: ZeRO-2 and ZeRO-3 steps on every
  visible GPU, stock DeepSpeed against flatgrad, losses and peak memory.
* ``bench``: ``flatgrad bench --device cuda`` on the transformer bucket
  (CUDA timings: calls between events behind a calibrated sleep).
* ``test-triton``: ``tests/test_triton.py`` on CUDA tensors.

A pytest step passes only when some test passed and none failed; its skip
reasons are in the summary.

Under ``--out`` (default ``$OUT``, else ``./gpu-check-out``): ``summary.txt``
and ``summary.json`` (every figure and every failure, rewritten after each
step), ``gpu_check.log`` (every step's output), ``bench.json`` and
``zero_step.json``.

``--dry-run`` runs no step. It checks each one on any machine, GPU or not:
the files it names exist, Python snippets and scripts compile, the pytest
selections collect some test (``pytest --collect-only``; a module skipped for
want of a GPU must say so, and a ``-k`` must match a test name in it), and the
bench, wire and zero-step arguments parse with those commands' own parsers.
It prints every command and the budget table (each step's timeout and their
sum); the exit status is 1 if a check fails or the timeouts exceed the budget. ``FLATGRAD_GPU_CHECK_ROOT`` (or ``--root``) points it at another
checkout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

__all__ = [
    "BUDGET", "BUDGET_S", "Context", "Step", "budget_table", "plan", "check_step", "dry_run", "run_step", "run_all", "bench_figures", "zero_figures",
    "summary_text", "main",
]  # fmt: skip

_HERE = os.path.dirname(os.path.abspath(__file__))

# Printed as one JSON line; the ``env`` step's figures.
ENV_SNIPPET = r"""
import json, platform, shutil, subprocess
info = {"python": platform.python_version(), "platform": platform.platform()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    info["gpus"] = [
        {"name": torch.cuda.get_device_name(i), "capability": "%d.%d" % torch.cuda.get_device_capability(i),
         "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
         "sms": torch.cuda.get_device_properties(i).multi_processor_count}
        for i in range(torch.cuda.device_count())
    ]
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        info["nccl"] = "unavailable: %s" % exc
except Exception as exc:
    info["torch"] = "unavailable: %s" % exc
for name in ("triton", "deepspeed"):
    try:
        info[name] = __import__(name).__version__
    except Exception as exc:
        info[name] = "unavailable: %s: %s" % (type(exc).__name__, exc)
nvcc = shutil.which("nvcc")
if nvcc:
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    info["nvcc"] = next((line for line in version.splitlines() if "release" in line), version.strip())
smi = shutil.which("nvidia-smi")
if smi:
    query = [smi, "--query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu", "--format=csv,noheader"]
    info["nvidia_smi"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
print(json.dumps(info))
if not info.get("gpus"):
    raise SystemExit("no CUDA device is visible to torch")
"""

# Printed as one JSON line; the ``backends`` step's figures.
BACKENDS_SNIPPET = r"""
import json, flatgrad
status = flatgrad.available_backends()
print(json.dumps({n: {"available": s.available, "devices": list(s.devices), "reason": s.reason}
                  for n, s in status.items()}))
missing = [n for n in ("cuda", "triton") if not (status[n].available and "cuda" in status[n].devices)]
if missing:
    raise SystemExit("not running on CUDA tensors: " + ", ".join("%s (%s)" % (n, status[n].reason) for n in missing))
"""


@dataclasses.dataclass
class Context:
    """Where and how the steps run.

    Attributes:
        root: the checkout whose code is checked.
        out: where the summary, the log and the steps' JSON go.
        build_dir: the build cache (also Triton's and torch's extension caches).
        python: the interpreter every step runs under.
        quick: halve the budget, the timeouts and the work.
        arch_list: ``TORCH_CUDA_ARCH_LIST`` for the build (set from the ``env`` step).
        torch_version: part of the build cache key (set from the ``env`` step).
        site: the folder the ``wheels`` step installs into.
        pythonpath: entries put before the inherited ``PYTHONPATH`` for every step.
    """

    root: str
    out: str
    build_dir: str
    python: str = sys.executable
    quick: bool = False
    arch_list: str | None = None
    torch_version: str = "unknown"
    site: str = ""
    pythonpath: list[str] = dataclasses.field(default_factory=list)

    def env(self, dry_run: bool = False) -> dict[str, str]:
        """The environment of every step."""
        env = dict(os.environ)
        inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath + [self.root] + inherited)
        env["PYTHONUNBUFFERED"] = "1"
        if dry_run:
            env.setdefault("DS_ACCELERATOR", "cpu")
        else:
            env["DS_ACCELERATOR"] = "cuda"
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(self.build_dir, "torch_extensions")
            env["TRITON_CACHE_DIR"] = os.path.join(self.build_dir, "triton_cache")
        return env


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check.

    Attributes:
        name: short name (``--only`` / ``--skip`` take it).
        kind: ``python`` (a snippet), ``wheels``, ``build``, ``pytest``, ``bench`` or ``zero-step``;
            says how the dry run checks it and how its figures are read.
        argv: the command, run in the root.
        timeout_s: seconds before it is killed.
        files: paths (relative to the root, globs allowed) that must exist.
        snippet: the Python source of a ``python`` step.
        args: what a dry run parses: the pytest selection, or the bench / zero-step arguments.
        env: extra environment variables.
    """

    name: str
    kind: str
    argv: tuple[str, ...]
    timeout_s: float
    files: tuple[str, ...] = ()
    snippet: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


_PYTEST_RUN = ("-q", "-rfEs", "-p", "no:cacheprovider")


def _pytest(ctx: Context, name: str, timeout: float, per_test: int, selection: tuple[str, ...],
            env: tuple[tuple[str, str], ...] = ()) -> Step:  # fmt: skip
    argv = (ctx.python, "-m", "pytest", *_PYTEST_RUN, "-o", f"timeout={per_test}", *selection)
    files = tuple(a for a in selection if a.endswith(".py"))
    return Step(name, "pytest", argv, timeout, files=files, args=selection, env=env)


# Seconds each step may take by default, in running order; ``--quick`` halves them. Sized for one
# H200 and a cold build, so that the whole default run fits in 8 minutes: the sum is at most
# ``BUDGET_S`` (``tests/test_gpu_check.py`` holds it to that). Ordered by what a short run must
# not miss: the build, kernel correctness, the wire kernels, the reducer's stream hand-off over
# NCCL, the ZeRO-2/3 steps, then throughput.
BUDGET: dict[str, float] = {
    "wheels": 10,
    "env": 10,
    "build": 120,
    "backends": 10,
    "test-kernels": 60,
    "test-cuda": 40,
    "wire": 40,
    "test-reducer": 40,
    "zero-step": 90,
    "bench": 40,
    "test-triton": 20,
}
BUDGET_S = 480.0


def budget_table(steps: Sequence[Step], budget_s: float = BUDGET_S) -> str:
    """The steps' timeouts, one line each, and their sum against ``budget_s``."""
    lines = [f"  {s.name:<13} {s.timeout_s:6.0f} s" for s in steps]
    total = sum(s.timeout_s for s in steps)
    lines.append(f"  {'total':<13} {total:6.0f} s of {budget_s:g} s")
    return "\n".join(lines)


def plan(ctx: Context) -> list[Step]:
    """Every step, in order, for ``ctx`` (``--quick`` halves timeouts and work); timeouts from ``BUDGET``."""
    q = 0.5 if ctx.quick else 1.0
    t = {name: seconds * q for name, seconds in BUDGET.items()}
    py = ctx.python
    wheels = tuple(sorted(glob.glob(os.path.join(ctx.root, ".whl", "*.whl"))))
    pip = (py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
           "--target", ctx.site, *wheels)  # fmt: skip
    build_key = _build_key(ctx)
    build = os.path.join(ctx.build_dir, build_key)
    setup = (py, "setup.py", "-q", "build_ext", "--build-lib", os.path.join(build, "lib"),
             "--build-temp", os.path.join(build, "temp"))  # fmt: skip
    build_env = (("FLATGRAD_BUILD_CUDA", "1"), ("TORCH_CUDA_ARCH_LIST", ctx.arch_list or "9.0"),
                 ("MAX_JOBS", str(os.cpu_count() or 4)))  # fmt: skip
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
        # torch guesses CUDA_HOME from `which nvcc`, which may be a wrapper outside the toolkit.
        build_env += (("CUDA_HOME", "/usr/local/cuda"),)
    bench_args = (
        "bench", "--device", "cuda", "--buckets", "transformer", "--hidden", "1024" if ctx.quick else "2048",
        "--repeats", "5" if ctx.quick else "10", "--warmup", "2" if ctx.quick else "3",
        "--out", os.path.join(ctx.out, "bench.json"),
    )  # fmt: skip
    zero_args = ("--steps", "2" if ctx.quick else "3", "--timeout", str(int(t["zero-step"] / 4 - 2)),
                 "--out", os.path.join(ctx.out, "zero_step.json"))  # fmt: skip
    wire_args = ("--device", "cuda", "--backends", "cuda,triton") + (("--quick",) if ctx.quick else ())
    # Few hypothesis examples: cases that vary pointer alignment make Triton compile a new
    # specialization each, which is what makes this step's time hard to predict.
    examples = (("FLATGRAD_TEST_EXAMPLES", "10" if ctx.quick else "20"),)
    return [
        Step("wheels", "wheels", pip, t["wheels"], files=(".whl/*.whl",) if wheels else ()),
        Step("env", "python", (py, "-c", ENV_SNIPPET), t["env"], snippet=ENV_SNIPPET),
        Step("build", "build", setup, t["build"], files=("setup.py", "csrc/*.cpp", "csrc/cuda/*.cu"), env=build_env),
        Step("backends", "python", (py, "-c", BACKENDS_SNIPPET), t["backends"], snippet=BACKENDS_SNIPPET),
        _pytest(ctx, "test-kernels", t["test-kernels"], 60, ("tests/test_kernels.py", "-k", "not cpu"), env=examples),
        _pytest(ctx, "test-cuda", t["test-cuda"], 30, ("tests/test_cuda.py",)),
        Step("wire", "wire", (py, "bench/gpu_wire_check.py", *wire_args), t["wire"],
             files=("bench/gpu_wire_check.py",), args=wire_args),  # fmt: skip
        _pytest(ctx, "test-reducer", t["test-reducer"], 40, ("tests/test_reducer_cuda.py",)),
        Step("zero-step", "zero-step", (py, "bench/gpu_zero_step.py", *zero_args), t["zero-step"],
             files=("bench/gpu_zero_step.py",), args=zero_args),  # fmt: skip
        Step("bench", "bench", (py, "-m", "flatgrad", *bench_args), t["bench"],
             files=("flatgrad/bench/pack_unpack.py",), args=bench_args),  # fmt: skip
        _pytest(ctx, "test-triton", t["test-triton"], 20, ("tests/test_triton.py", "-k", "not compile_check")),
    ]


def _build_key(ctx: Context) -> str:
    """A hash of what the compiled extension depends on: sources, build script, torch, Python, archs."""
    digest = hashlib.sha256()
    paths = ["setup.py", "pyproject.toml"] + sorted(
        os.path.relpath(p, ctx.root) for p in glob.glob(os.path.join(ctx.root, "csrc", "**", "*"), recursive=True)
    )
    for rel in paths:
        full = os.path.join(ctx.root, rel)
        if os.path.isfile(full):
            digest.update(rel.encode())
            with open(full, "rb") as f:
                digest.update(f.read())
    digest.update(f"{ctx.torch_version}|{sys.version_info[:2]}|{ctx.arch_list}".encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------- dry run


def _run_quiet(argv: Sequence[str], ctx: Context, timeout: float = 120) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, cwd=ctx.root, env=ctx.env(dry_run=True), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"
    return proc.returncode, proc.stdout + proc.stderr


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


_SCRIPT_ARGS = "import runpy, sys; runpy.run_path(sys.argv[1])['build_parser']().parse_args(sys.argv[2:])"
_ARGS_CHECK = {
    "bench": "import sys; from flatgrad.cli import build_parser; build_parser().parse_args(sys.argv[1:])",
    "zero-step": _SCRIPT_ARGS,
    "wire": _SCRIPT_ARGS,
}
_SCRIPTS = {"zero-step": "bench/gpu_zero_step.py", "wire": "bench/gpu_wire_check.py"}


def _keyword_matches_nothing(selection: Sequence[str], root: str) -> str | None:
    """For a selection whose modules skip here (no GPU): a ``-k`` that no test name in them matches, or None.

    pytest cannot collect a skipped module's tests, so their names are read from the source
    (``def test_*``, ``class Test*``) and the expression is evaluated as ``-k`` does (substring
    of a name, case-insensitive).
    """
    if "-k" not in selection:
        return None
    expression = selection[selection.index("-k") + 1]
    names = []
    for arg in selection:
        if arg.endswith(".py") and os.path.isfile(os.path.join(root, arg)):
            with open(os.path.join(root, arg)) as f:
                names += re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+((?:test|Test)\w*)", f.read(), re.MULTILINE)
            names.append(os.path.basename(arg))
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest's internals moved: nothing to check with
        return None
    compiled = Expression.compile(expression)
    for name in names:
        if compiled.evaluate(lambda sub, *_, name=name, **__: sub.lower() in name.lower()):
            return None
    return expression


def check_step(step: Step, ctx: Context) -> list[str]:
    """What is wrong with ``step`` in ``ctx.root`` without running it (empty: nothing found)."""
    problems = []
    for pattern in step.files:
        if not glob.glob(os.path.join(ctx.root, pattern)):
            problems.append(f"{pattern} does not exist")
    if problems:
        return problems
    sources = [p for pattern in step.files for p in glob.glob(os.path.join(ctx.root, pattern)) if p.endswith(".py")]
    if step.kind == "build":
        sources.append(os.path.join(ctx.root, "setup.py"))
    for path in sources:
        try:
            with open(path) as f:
                compile(f.read(), path, "exec")
        except SyntaxError as exc:
            problems.append(f"{os.path.relpath(path, ctx.root)} does not compile: {exc}")
    if step.snippet:
        try:
            compile(step.snippet, f"<{step.name} snippet>", "exec")
        except SyntaxError as exc:
            problems.append(f"the {step.name} snippet does not compile: {exc}")
    if problems:
        return problems
    if step.kind == "pytest":
        rc, output = _run_quiet((ctx.python, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                                 *step.args), ctx)  # fmt: skip
        collected = sum("::" in line for line in output.splitlines())
        module_skip = rc == 5 and any(  # a module skipped here must say which hardware it lacks
            line.startswith("SKIPPED") and re.search(r"cuda|gpu", line, re.IGNORECASE) for line in output.splitlines()
        )
        if rc == 0 and collected == 0 or rc not in (0, 5) or (rc == 5 and not module_skip):
            problems.append(f"pytest --collect-only {' '.join(step.args)} collects no test (exit {rc}):\n"
                            f"{_tail(output)}")  # fmt: skip
        elif module_skip and (unmatched := _keyword_matches_nothing(step.args, ctx.root)) is not None:
            problems.append(f"-k {unmatched!r} matches no test in {' '.join(a for a in step.args if a.endswith('.py'))}")
    elif step.kind in _ARGS_CHECK:
        extra = (_SCRIPTS[step.kind],) if step.kind in _SCRIPTS else ()
        rc, output = _run_quiet((ctx.python, "-c", _ARGS_CHECK[step.kind], *extra, *step.args), ctx)
        if rc != 0:
            problems.append(f"the arguments {' '.join(step.args)} do not parse (exit {rc}):\n{_tail(output)}")
    return problems


def dry_run(steps: Sequence[Step], ctx: Context) -> int:
    """Check every step (in parallel: each check is a subprocess) and print them in order; 0 when all are sound."""
    failed = 0
    print(f"gpu_check dry run of {ctx.root}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        found = list(pool.map(lambda step: check_step(step, ctx), steps))
    for step, problems in zip(steps, found):
        env = " ".join(f"{k}={v}" for k, v in step.env)
        if step.kind == "python":
            command = f"{step.argv[0]} -c <{step.name} snippet>"
        else:
            command = " ".join(_shell_word(a) for a in step.argv)
        failed += bool(problems)
        verdict = "FAIL" if problems else "ok"
        print(f"[{verdict}] {step.name} (timeout {step.timeout_s:g} s): {env + ' ' if env else ''}{command}")
        for problem in problems:
            print("    " + problem.replace("\n", "\n    "))
    print(f"{len(steps) - failed} of {len(steps)} steps sound" + (f"; {failed} not" if failed else ""))
    total, budget = sum(step.timeout_s for step in steps), BUDGET_S * (0.5 if ctx.quick else 1.0)
    print(f"budget (each step's timeout; the run stops starting steps once --budget is spent):\n"
          f"{budget_table(steps, budget)}")  # fmt: skip
    if total > budget:
        print(f"the timeouts add up to {total:g} s, more than the budget")
        failed += 1
    return 1 if failed else 0


def _shell_word(word: str) -> str:
    return word if re.fullmatch(r"[\w@%+=:,./-]+", word) else "'" + word.replace("'", "'\\''") + "'"


# ---------------------------------------------------------------------------- running


def run_step(step: Step, ctx: Context, log_path: str, deadline: float) -> dict[str, Any]:
    """Run ``step`` with its output appended to ``log_path``; its record (status, exit code, time, output)."""
    left = deadline - time.monotonic()
    timeout = min(step.timeout_s, left)
    record: dict[str, Any] = {"name": step.name, "timeout_s": round(timeout, 1), "command": list(step.argv)}
    if left < 5:
        return {**record, "status": "not run", "reason": "the overall budget is spent"}
    env = ctx.env()
    env.update(step.env)
    for i, arg in enumerate(step.argv[:-1]):
        if arg == "--out" and os.path.exists(step.argv[i + 1]):
            os.remove(step.argv[i + 1])  # an earlier run's JSON must not pass for this one's
    with open(log_path, "ab") as log:
        start_offset = log.tell()
        started = time.monotonic()
        proc = None
        try:
            log.write(f"\n===== {step.name} ({datetime.datetime.now():%H:%M:%S}, timeout {timeout:.0f} s)\n".encode())
            log.flush()
            proc = subprocess.Popen(step.argv, cwd=ctx.root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            rc = proc.wait(timeout=timeout)
            status = "passed" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, status = proc.returncode, "timeout"
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see main): stop the step, keep what it wrote
            if proc is not None:
                _kill_group(proc)
            rc, status = (proc.returncode if proc is not None else None), "interrupted"
        wall = time.monotonic() - started
    with open(log_path, "rb") as log:
        log.seek(start_offset)
        output = log.read().decode(errors="replace")
    return {**record, "status": status, "rc": rc, "wall_s": round(wall, 1), "output": output}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's whole process group (its ranks too), SIGKILL what is left after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_json(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def _pytest_figures(output: str) -> dict[str, Any]:
    counts = {}
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", summary[-1]):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {"counts": counts, "skipped": skips[:20], "failures": failures[:20]}


def bench_figures(path: str, device: str = "cuda") -> dict[str, Any]:
    """Per case and backend: GB/s and the ratios to the roofline (d), ``_chunk_cat`` (c) and DeepSpeed (a).

    Read from ``flatgrad bench --out`` JSON, transformer bucket, chunked layout, median times; ``x_deepspeed``
    is taken from the row doing DeepSpeed's work (the 1/W pre-divide) where there is one.
    """
    with open(path) as f:
        doc = json.load(f)
    cases: dict[str, Any] = {}
    for row in doc["results"]:
        if row["device"] != device or row["bucket"] != "transformer":
            continue
        case = cases.setdefault(row["case"], {"backends": {}})
        if row["role"] in ("a", "c", "d"):
            case[{"a": "deepspeed_zero3_gbps", "c": "chunk_cat_gbps", "d": "roofline_gbps"}[row["role"]]] = round(
                row["gbps_median"], 1
            )
        if row["role"] != "flatgrad" or row["layout"] != "chunked":
            continue
        entry = case["backends"].setdefault(row["backend"], {})
        if row["method"] in ("flatgrad.pack", "flatgrad.unpack -> 1 out") and row["scale"] == 1.0:
            entry.update(gbps=round(row["gbps_median"], 1), x_roofline=row["x_roofline_median"],
                         x_chunk_cat=row.get("x_chunk_cat_median"))  # fmt: skip
            entry.setdefault("x_deepspeed", row["x_ds_median"])
        if row["scale"] != 1.0:  # the 1/W pre-divide: the same work as DeepSpeed's cat + div
            entry["x_deepspeed"] = row["x_ds_median"]
    return {"gpu": doc["machine"].get("gpu"), "bucket": doc["buckets"].get("transformer"), "cases": cases}


def zero_figures(path: str) -> dict[str, Any]:
    """The pairs' verdicts and each setup's losses and memory, from ``bench/gpu_zero_step.py --out`` JSON."""
    with open(path) as f:
        doc = json.load(f)
    setups = {
        key: {k: s.get(k) for k in ("ok", "model", "allocated_after_build", "max_memory_allocated", "losses", "error")}
        for key, s in doc["setups"].items()
    }
    return {"world_size": doc["world_size"], "gpu": doc["gpu"], "pairs": doc["pairs"], "setups": setups}


def _figures(step: Step, record: dict, ctx: Context) -> dict[str, Any]:
    """What a finished step measured, read from its output or its JSON (empty when there is none)."""
    output = record.get("output", "")
    try:
        if step.kind in ("python", "wire"):
            return _last_json(output) or {}
        if step.kind == "pytest":
            return _pytest_figures(output)
        if step.kind == "bench":
            return bench_figures(os.path.join(ctx.out, "bench.json"))
        if step.kind == "zero-step":
            return zero_figures(os.path.join(ctx.out, "zero_step.json"))
    except (OSError, KeyError, ValueError, TypeError) as exc:
        return {"unreadable": f"{type(exc).__name__}: {exc}"}
    return {}


def _before(step: Step, ctx: Context) -> dict[str, Any] | None:
    """A record that replaces running ``step``, or None to run it."""
    if step.kind == "wheels" and not step.files:
        return {"name": step.name, "status": "skipped",
                "reason": "no .whl/*.whl: DeepSpeed must already be installed (see bench/gpu_check.sh)"}  # fmt: skip
    if step.kind == "build":
        built = glob.glob(os.path.join(_build_lib(step), "flatgrad", "_C*.so"))
        if built:
            _install_extension(built[0], ctx)
            return {"name": step.name, "status": "passed", "cached": True, "wall_s": 0.0,
                    "so": built[0], "arch_list": dict(step.env)["TORCH_CUDA_ARCH_LIST"]}  # fmt: skip
    return None


def _build_lib(step: Step) -> str:
    return step.argv[step.argv.index("--build-lib") + 1]


def _install_extension(so: str, ctx: Context) -> None:
    shutil.copy2(so, os.path.join(ctx.root, "flatgrad", os.path.basename(so)))


def _after(step: Step, record: dict, ctx: Context) -> None:
    """Carry what a step found into the context of the later steps."""
    if step.kind == "wheels" and record["status"] == "passed":
        ctx.pythonpath.insert(0, ctx.site)
    if step.name == "env":
        info = record.get("figures") or {}
        caps = sorted({g["capability"] for g in info.get("gpus", [])})
        if caps:
            ctx.arch_list = ";".join(caps)
        ctx.torch_version = str(info.get("torch", "unknown"))
    if step.kind == "build" and record["status"] == "passed" and not record.get("cached"):
        built = glob.glob(os.path.join(_build_lib(step), "flatgrad", "_C*.so"))
        if built:
            _install_extension(built[0], ctx)
            record.update(so=built[0], arch_list=dict(step.env)["TORCH_CUDA_ARCH_LIST"], cached=False)
        else:
            record.update(status="failed", reason="the build left no flatgrad/_C*.so")


# ---------------------------------------------------------------------------- summary


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _step_line(r: dict) -> str:
    figures = r.get("figures") or {}
    note = r.get("reason", "")
    if r["name"] == "build" and r["status"] == "passed":
        note = f"{'cached' if r.get('cached') else 'compiled'}, TORCH_CUDA_ARCH_LIST={r.get('arch_list')}"
    elif "counts" in figures:
        note = ", ".join(f"{n} {what}" for what, n in figures["counts"].items()) or "no pytest summary line"
    elif figures.get("pairs"):
        note = ", ".join(f"{p['pair']} losses {'match' if p['losses_match'] else 'DIFFER'}" for p in figures["pairs"])
    elif r["name"] == "env" and figures:
        gpus = figures.get("gpus") or []
        note = (f"{len(gpus)} x {gpus[0]['name'] if gpus else '-'}, torch {figures.get('torch')}, "
                f"deepspeed {figures.get('deepspeed')}")  # fmt: skip
    if not note and r["status"] in ("failed", "timeout", "interrupted"):
        note = next((line.strip() for line in reversed(r.get("tail", "").splitlines()) if line.strip()), "")[:160]
    wall = f"{r['wall_s']:7.1f} s" if "wall_s" in r else " " * 9
    return f"  {r['name']:<13} {r['status']:<8} {wall}  {note}"


def summary_text(doc: dict) -> str:
    """The summary as text: one line per step, the bench ratios, the ZeRO steps, then every failure's tail."""
    lines = [f"flatgrad gpu_check {doc['started']}, {'quick, ' if doc['quick'] else ''}budget {doc['budget_s']:g} s, "
             f"wall {doc['wall_s']:.0f} s: {'ALL PASSED' if doc['ok'] else 'FAILURES'}", ""]  # fmt: skip
    lines += [_step_line(r) for r in doc["steps"]]
    steps = {r["name"]: r for r in doc["steps"]}
    bench = (steps.get("bench") or {}).get("figures") or {}
    if bench.get("cases"):
        numel = (bench.get("bucket") or {}).get("numel", 0)
        lines += ["", f"pack/unpack, transformer bucket ({numel:,} elements), median GB/s and ratios: x(d) to the "
                  "copy roofline, x(c) to torch._chunk_cat, x(a) to DeepSpeed ZeRO-3"]  # fmt: skip
        for case, c in bench["cases"].items():
            lines.append(f"  {case}: (d) {c.get('roofline_gbps')} GB/s, (c) {c.get('chunk_cat_gbps', '-')} GB/s, "
                         f"(a) {c.get('deepspeed_zero3_gbps')} GB/s")  # fmt: skip
            for backend, b in c["backends"].items():
                ratios = "  ".join(f"x({tag}) {_fmt_ratio(b.get(key))}" for tag, key in
                                   (("d", "x_roofline"), ("c", "x_chunk_cat"), ("a", "x_deepspeed")))  # fmt: skip
                lines.append(f"    {backend:<7} {b.get('gbps', '-'):>8} GB/s  {ratios}")
    zero = (steps.get("zero-step") or {}).get("figures") or {}
    if zero.get("setups"):
        where = f"{zero['world_size']} x {zero['gpu'] or 'CPU'}"
        lines += ["", f"ZeRO steps on {where}: peak torch.cuda.max_memory_allocated"]
        for key, s in zero["setups"].items():
            if s["ok"]:
                peak = s["max_memory_allocated"]
                peak_text = f"{peak / 2**20:9.1f} MiB" if peak is not None else "        - MiB"
                lines.append(f"  {key:<15} {s['model']:<9} peak {peak_text}  "
                             f"losses rank 0: {' '.join(f'{x:.6g}' for x in s['losses'][0])}")  # fmt: skip
            else:
                lines.append(f"  {key:<15} FAILED: {(s.get('error') or '').splitlines()[0][:300]}")
        for p in zero["pairs"]:
            if p["max_rel_loss_diff"] is not None:
                lines.append(f"  {p['pair']}: losses {'match' if p['losses_match'] else 'DIFFER'} "
                             f"(max rel diff {p['max_rel_loss_diff']:.2e}), peak memory flatgrad/stock "
                             f"{_fmt_ratio(p['memory_ratio'])}")  # fmt: skip
    for r in doc["steps"]:
        if r["status"] in ("failed", "timeout", "interrupted"):
            lines += ["", f"--- {r['name']} {r['status']} (exit {r.get('rc')}); "
                      f"{r.get('reason') or 'last lines of its output'}:"]
            failures = (r.get("figures") or {}).get("failures") or []
            lines += [f"  {f}" for f in failures]
            lines += ["  " + line for line in r.get("tail", "").splitlines()]
    lines.append("")
    return "\n".join(lines)


def _write_summary(doc: dict, out: str) -> None:
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary_text(doc))


def run_all(ctx: Context, budget_s: float, select: Callable[[str], bool],
            make_plan: Callable[[Context], list[Step]] = plan) -> dict:  # fmt: skip
    """Run the selected steps in order within ``budget_s``; the summary document (also written after each step).

    The plan is made again before every step: the build step depends on what ``env`` found.
    """
    os.makedirs(ctx.out, exist_ok=True)
    log_path = os.path.join(ctx.out, "gpu_check.log")
    open(log_path, "w").close()
    started = time.monotonic()
    deadline = started + budget_s
    doc: dict[str, Any] = {"started": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC",
                           "root": ctx.root, "quick": ctx.quick, "budget_s": budget_s, "steps": [], "ok": False,
                           "wall_s": 0.0}  # fmt: skip
    interrupted = False
    for name in [s.name for s in make_plan(ctx)]:
        step = next(s for s in make_plan(ctx) if s.name == name)
        if not select(name):
            record: dict[str, Any] = {"name": name, "status": "skipped", "reason": "not selected"}
        elif interrupted:
            record = {"name": name, "status": "not run", "reason": "gpu_check was interrupted"}
        else:
            print(f"[{time.monotonic() - started:5.0f} s] {name} ...", flush=True)
            record = _before(step, ctx) or run_step(step, ctx, log_path, deadline)
            if "output" in record:
                record["figures"] = _figures(step, record, ctx)
            _after(step, record, ctx)
            output = record.pop("output", "")
            if record["status"] in ("failed", "timeout", "interrupted"):
                record["tail"] = _tail(output, 30)
            interrupted = record["status"] == "interrupted"
            counts = (record.get("figures") or {}).get("counts")
            if record["status"] in ("passed", "failed") and step.kind == "pytest" and not (counts or {}).get("passed"):
                record.update(status="failed", reason="no test passed (all skipped?)", tail=_tail(output, 30))
            print(_step_line(record), flush=True)
        doc["steps"].append(record)
        doc["wall_s"] = time.monotonic() - started
        doc["ok"] = all(r["status"] in ("passed", "skipped") for r in doc["steps"])
        _write_summary(doc, ctx.out)
    return doc


# ---------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check every step without running it (any machine)")
    parser.add_argument("--quick", action="store_true", help="half the budget, timeouts and work")
    parser.add_argument("--budget", type=float, help="seconds for all steps together (default 480; --quick 240)")
    parser.add_argument("--out", help="summary, log and JSON go here (default $OUT, else ./gpu-check-out)")
    parser.add_argument("--build-dir", help="build cache (default $FLATGRAD_BUILD_CACHE, else /tmp/flatgrad-gpu-check)")
    parser.add_argument("--root", help="the checkout to check (default $FLATGRAD_GPU_CHECK_ROOT, else this one)")
    parser.add_argument("--only", help="comma-separated steps to run (the others are reported as skipped)")
    parser.add_argument("--skip", help="comma-separated steps not to run")
    return parser


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or with ``--dry-run`` check) the steps; 0 when every step passed, 1 otherwise, 2 on bad options."""
    args = build_parser().parse_args(argv)
    root = os.path.abspath(args.root or os.environ.get("FLATGRAD_GPU_CHECK_ROOT") or os.path.dirname(_HERE))
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-check-out"))
    build_dir = os.path.abspath(args.build_dir or os.environ.get("FLATGRAD_BUILD_CACHE") or "/tmp/flatgrad-gpu-check")
    ctx = Context(root=root, out=out, build_dir=build_dir, quick=args.quick, site=os.path.join(build_dir, "site"))
    steps = plan(ctx)
    known = [s.name for s in steps]
    chosen = {}
    for option in ("only", "skip"):
        names = [n.strip() for n in (getattr(args, option) or "").split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"gpu_check: --{option}: unknown step(s) {unknown}; steps: {', '.join(known)}", file=sys.stderr)
            return 2
        chosen[option] = set(names)

    def select(name: str) -> bool:
        return (not chosen["only"] or name in chosen["only"]) and name not in chosen["skip"]

    if args.dry_run:
        return dry_run([s for s in steps if select(s.name)], ctx)
    budget = args.budget if args.budget is not None else (240.0 if args.quick else 480.0)
    signal.signal(signal.SIGTERM, _interrupt)  # a killed check still writes its summary
    doc = run_all(ctx, budget, select)
    print()
    print(summary_text(doc))
    print(f"summary: {os.path.join(out, 'summary.txt')} and summary.json; log: {os.path.join(out, 'gpu_check.log')}")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
