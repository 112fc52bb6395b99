"""The check's runner: the dry run (``check_step``, ``dry_run``) and the run (``run_step``, ``run_all``).

Each step runs in its own process, in its own session, with its own timeout,
all within one overall budget; a step that fails or times out is recorded and
the next one runs, and the summary is rewritten after each step.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import glob
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any, Callable, Sequence

from .plan import BUDGET_S, NEEDS_CHECKOUT, Context, Step, budget_table, plan
from .summary import figures, step_line, write_summary

__all__ = ["check_step", "dry_run", "run_step", "run_all"]


def _run_quiet(argv: Sequence[str], ctx: Context, timeout: float = 120) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, cwd=ctx.cwd, env=ctx.env(dry_run=True), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"
    return proc.returncode, proc.stdout + proc.stderr


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# How the dry run parses a step's arguments: with the module's own ``build_parser``, or the ``flatgrad`` CLI's.
_MODULE_ARGS = (
    "import importlib, sys; importlib.import_module(sys.argv[1]).build_parser().parse_args(sys.argv[2:])"
)
_BENCH_ARGS = "import sys; from flatgrad.cli import build_parser; build_parser().parse_args(sys.argv[1:])"


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
    """What is wrong with ``step`` without running it (empty: nothing found).

    Checkout steps: the files they name exist and compile, and a pytest selection collects some
    test. Module steps: the module imports and its ``build_parser`` parses the step's arguments.
    """
    if step.checkout:
        if not ctx.root:
            return []
        problems = _check_files(step, ctx.root)
        if problems or step.kind != "pytest":
            return problems
        rc, output = _run_quiet((ctx.python, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                                 *step.args), ctx)  # fmt: skip
        collected = sum("::" in line for line in output.splitlines())
        module_skip = rc == 5 and any(  # a module skipped here must say which hardware it lacks
            line.startswith("SKIPPED") and re.search(r"cuda|gpu", line, re.IGNORECASE) for line in output.splitlines()
        )
        if rc == 0 and collected == 0 or rc not in (0, 5) or (rc == 5 and not module_skip):
            return [f"pytest --collect-only {' '.join(step.args)} collects no test (exit {rc}):\n{_tail(output)}"]
        if module_skip and (unmatched := _keyword_matches_nothing(step.args, ctx.root)) is not None:
            return [f"-k {unmatched!r} matches no test in {' '.join(a for a in step.args if a.endswith('.py'))}"]
        return []
    if step.kind == "module":
        argv: tuple[str, ...] = (ctx.python, "-c", _MODULE_ARGS, step.module, *step.args)
    elif step.kind == "bench":
        argv = (ctx.python, "-c", _BENCH_ARGS, *step.args)
    else:
        return [f"unknown step kind {step.kind!r}"]
    rc, output = _run_quiet(argv, ctx)
    if rc != 0:
        what = f"{step.module} {' '.join(step.args)}" if step.module else " ".join(step.args)
        return [f"the arguments do not parse or the module does not import: {what} (exit {rc}):\n{_tail(output)}"]
    return []


def _check_files(step: Step, root: str) -> list[str]:
    """A checkout step's files: they exist, and its Python files compile."""
    problems = [f"{pattern} does not exist" for pattern in step.files if not glob.glob(os.path.join(root, pattern))]
    if problems:
        return problems
    sources = [p for pattern in step.files for p in glob.glob(os.path.join(root, pattern)) if p.endswith(".py")]
    if step.kind == "build":
        sources.append(os.path.join(root, "setup.py"))
    for path in sources:
        try:
            with open(path) as f:
                compile(f.read(), path, "exec")
        except SyntaxError as exc:
            problems.append(f"{os.path.relpath(path, root)} does not compile: {exc}")
    return problems


def dry_run(steps: Sequence[Step], ctx: Context) -> int:
    """Check every step (in parallel: each check is a subprocess) and print them in order; 0 when all are sound.

    Without a checkout the checkout-only steps are listed as skipped. The budget table covers every
    step of the plan given.
    """
    failed = skipped = 0
    print(f"flatgrad check dry run of {ctx.root or 'the installed package (no --root: checkout-only steps skipped)'}",
          flush=True)  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        found = list(pool.map(lambda step: check_step(step, ctx), steps))
    for step, problems in zip(steps, found):
        env = " ".join(f"{k}={v}" for k, v in step.env)
        command = " ".join(_shell_word(a) for a in step.argv)
        if step.checkout and not ctx.root:
            skipped += 1
            print(f"[skipped] {step.name} (timeout {step.timeout_s:g} s): {NEEDS_CHECKOUT}")
            continue
        failed += bool(problems)
        verdict = "FAIL" if problems else "ok"
        print(f"[{verdict}] {step.name} (timeout {step.timeout_s:g} s): {env + ' ' if env else ''}{command}")
        for problem in problems:
            print("    " + problem.replace("\n", "\n    "))
    checked = len(steps) - skipped
    print(f"{checked - failed} of {checked} steps sound" + (f"; {failed} not" if failed else "")
          + (f"; {skipped} skipped ({NEEDS_CHECKOUT})" if skipped else ""))  # fmt: skip
    total, budget = sum(step.timeout_s for step in steps), BUDGET_S * (0.5 if ctx.quick else 1.0)
    print(f"budget (each step's timeout; the run stops starting steps once --budget is spent):\n"
          f"{budget_table(steps, budget)}")  # fmt: skip
    if total > budget:
        print(f"the timeouts add up to {total:g} s, more than the budget")
        failed += 1
    return 1 if failed else 0


def _shell_word(word: str) -> str:
    return word if re.fullmatch(r"[\w@%+=:,./-]+", word) else "'" + word.replace("'", "'\\''") + "'"


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
            proc = subprocess.Popen(step.argv, cwd=ctx.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
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


def _before(step: Step, ctx: Context) -> dict[str, Any] | None:
    """A record that replaces running ``step``, or None to run it."""
    if step.checkout and not ctx.root:
        return {"name": step.name, "status": "skipped", "reason": NEEDS_CHECKOUT}
    if step.kind == "wheels" and not step.files:
        reason = "no .whl/*.whl: DeepSpeed must already be installed (see bench/gpu_check.sh in a checkout)"
        return {"name": step.name, "status": "skipped", "reason": reason}
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
    shutil.copy2(so, os.path.join(ctx.root or "", "flatgrad", os.path.basename(so)))


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
            record = {"name": name, "status": "not run", "reason": "the check was interrupted"}
        else:
            print(f"[{time.monotonic() - started:5.0f} s] {name} ...", flush=True)
            record = _before(step, ctx) or run_step(step, ctx, log_path, deadline)
            if "output" in record:
                record["figures"] = figures(step, record, ctx)
            _after(step, record, ctx)
            output = record.pop("output", "")
            if record["status"] in ("failed", "timeout", "interrupted"):
                record["tail"] = _tail(output, 30)
            interrupted = record["status"] == "interrupted"
            counts = (record.get("figures") or {}).get("counts")
            if record["status"] in ("passed", "failed") and step.kind == "pytest" and not (counts or {}).get("passed"):
                record.update(status="failed", reason="no test passed (all skipped?)", tail=_tail(output, 30))
            print(step_line(record), flush=True)
        doc["steps"].append(record)
        doc["wall_s"] = time.monotonic() - started
        doc["ok"] = all(r["status"] in ("passed", "skipped") for r in doc["steps"])
        write_summary(doc, ctx.out)
    return doc
