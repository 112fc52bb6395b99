"""The check's steps: where they run (``Context``), what each runs (``Step``), their budget and order (``plan``)."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sys
from typing import Sequence

__all__ = ["BUDGET", "BUDGET_S", "CHECKOUT_ONLY", "Context", "Step", "budget_table", "plan", "build_key", "pytest_step"]

# Seconds each step may take by default, in running order; ``--quick`` halves them. Sized for one H200, a
# cold build and cold ranks (a spawned rank imports torch and DeepSpeed and makes its NCCL group before its
# first step), so that the whole default run fits in 8 minutes: the sum is at most
# ``BUDGET_S`` (``tests/test_gpu_check.py`` holds it to that). Ordered by what a run cut short must not miss:
# the build, the kernels against the reference, ZeRO offload against stock, the reducer's stream order,
# the wire kernels, the ZeRO-2/3 steps, then the checkout's GPU tests, qgZ against stock's, and throughput.
BUDGET: dict[str, float] = {
    "wheels": 10,
    "env": 10,
    "build": 80,
    "backends": 10,
    "kernels": 40,
    "zero-offload": 80,
    "streams": 30,
    "wire": 25,
    "zero-step": 70,
    "test-reducer": 30,
    "test-cuda": 20,
    "test-kernels": 15,
    "qgz": 30,
    "bench": 20,
    "test-triton": 10,
}
BUDGET_S = 480.0

# The steps that run files of a source checkout (``--root``); the others run modules of the installed package.
CHECKOUT_ONLY = ("wheels", "build", "test-reducer", "test-cuda", "test-kernels", "test-triton")
NEEDS_CHECKOUT = "needs a source checkout (--root)"


@dataclasses.dataclass
class Context:
    """Where and how the steps run.

    Attributes:
        root: a source checkout (``--root``), or None: the installed package alone (the checkout-only
            steps are skipped).
        out: where the summary, the log and the steps' JSON go.
        build_dir: the build cache (also Triton's and torch's extension caches).
        python: the interpreter every step runs under.
        quick: halve the budget, the timeouts and the work.
        arch_list: ``TORCH_CUDA_ARCH_LIST`` for the build (set from the ``env`` step).
        torch_version: part of the build cache key (set from the ``env`` step).
        site: the folder the ``wheels`` step installs into.
        pythonpath: entries put before the inherited ``PYTHONPATH`` for every step.
    """

    root: str | None
    out: str
    build_dir: str
    python: str = sys.executable
    quick: bool = False
    arch_list: str | None = None
    torch_version: str = "unknown"
    site: str = ""
    pythonpath: list[str] = dataclasses.field(default_factory=list)

    @property
    def cwd(self) -> str:
        """Where the steps run: the checkout, else the current directory."""
        return self.root or os.getcwd()

    def env(self, dry_run: bool = False) -> dict[str, str]:
        """The environment of every step (the checkout, when there is one, first on ``PYTHONPATH``)."""
        env = dict(os.environ)
        inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(self.pythonpath + ([self.root] if self.root else []) + inherited)
        env["PYTHONUNBUFFERED"] = "1"
        scripts = [os.path.join(p, "bin") for p in self.pythonpath if os.path.isdir(os.path.join(p, "bin"))]
        if scripts:  # the wheels' console scripts (ninja, which the build needs to compile in parallel)
            env["PATH"] = os.pathsep.join(scripts + [env.get("PATH", "")])
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
        kind: ``module`` (a module of this package), ``bench`` (``flatgrad bench``), ``wheels``, ``build``
            or ``pytest``; says how the dry run checks it and how its figures are read.
        argv: the command, run in ``Context.cwd``.
        timeout_s: seconds before it is killed.
        files: paths in the checkout (globs allowed) that must exist.
        module: the module a ``module`` step runs (its ``build_parser`` parses ``args`` in the dry run).
        args: what a dry run parses: the pytest selection, or the module's or bench's arguments.
        env: extra environment variables.
        checkout: the step runs files of a source checkout (skipped without ``--root``).
        report: the JSON file (under ``Context.out``) the step's figures are read from ("": its last JSON line).
    """

    name: str
    kind: str
    argv: tuple[str, ...]
    timeout_s: float
    files: tuple[str, ...] = ()
    module: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    checkout: bool = False
    report: str = ""


_PYTEST_RUN = ("-q", "-rfEs", "-p", "no:cacheprovider")


def pytest_step(ctx: Context, name: str, timeout: float, per_test: int, selection: tuple[str, ...],
                env: tuple[tuple[str, str], ...] = ()) -> Step:  # fmt: skip
    """A step running ``pytest`` over ``selection`` (paths relative to the checkout), ``per_test`` seconds a test."""
    argv = (ctx.python, "-m", "pytest", *_PYTEST_RUN, "-o", f"timeout={per_test}", *selection)
    files = tuple(a for a in selection if a.endswith(".py"))
    return Step(name, "pytest", argv, timeout, files=files, args=selection, env=env, checkout=True)


def _module(ctx: Context, name: str, module: str, timeout: float, args: tuple[str, ...], report: str = "") -> Step:
    argv = (ctx.python, "-m", module, *args)
    return Step(name, "module", argv, timeout, module=module, args=args, report=report)


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
    py, root = ctx.python, ctx.root or ""
    out = ctx.out
    wheels = tuple(sorted(glob.glob(os.path.join(root, ".whl", "*.whl")))) if root else ()
    pip = (py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
           "--target", ctx.site, *wheels)  # fmt: skip
    build = os.path.join(ctx.build_dir, build_key(ctx))
    setup = (py, "setup.py", "-q", "build_ext", "--build-lib", os.path.join(build, "lib"),
             "--build-temp", os.path.join(build, "temp"))  # fmt: skip
    build_env = (("FLATGRAD_BUILD_CUDA", "1"), ("TORCH_CUDA_ARCH_LIST", ctx.arch_list or "9.0"),
                 ("MAX_JOBS", str(os.cpu_count() or 4)))  # fmt: skip
    if not os.environ.get("CUDA_HOME") and os.path.exists("/usr/local/cuda/bin/nvcc"):
        # torch guesses CUDA_HOME from `which nvcc`, which may be a wrapper outside the toolkit.
        build_env += (("CUDA_HOME", "/usr/local/cuda"),)
    qgz_env = tuple((k, v) for k, v in build_env if k in ("TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "MAX_JOBS"))
    quick = ("--quick",) if ctx.quick else ()
    bench_args = (
        "bench", "--device", "cuda", "--buckets", "transformer", "--hidden", "1024" if ctx.quick else "2048",
        "--repeats", "5" if ctx.quick else "10", "--warmup", "2" if ctx.quick else "3",
        "--out", os.path.join(out, "bench.json"),
    )  # fmt: skip
    # zero-step spawns its ranks once and builds its four setups in them, as zero-offload does its configs.
    zero_args = ("--steps", "2" if ctx.quick else "3", "--timeout", str(int(t["zero-step"] - 5)),
                 "--out", os.path.join(out, "zero_step.json"))  # fmt: skip
    offload_args = ("--device", "cuda", "--timeout", str(int(t["zero-offload"] - 5)),
                    "--out", os.path.join(out, "zero_offload.json"), *quick)  # fmt: skip
    streams_args = ("--out", os.path.join(out, "streams.json"))
    kernel_args = ("--device", "cuda", "--backends", "cuda,triton", *quick)
    wire_args = ("--device", "cuda", "--backends", "cuda,triton", *quick)
    # qgz: flatgrad's part first; what is left of its share goes to loading stock's quantizer op, whose cold JIT
    # build needs more (`python -m flatgrad.check.qgz --stock-timeout 300` once on the node caches it).
    qgz_args = ("--device", "cuda", "--backends", "cuda,triton", "--stock-timeout", str(max(5, int(t["qgz"] - 15))),
                "--out", os.path.join(out, "qgz.json"), *quick)  # fmt: skip
    # Few hypothesis examples: cases that vary pointer alignment make Triton compile a new
    # specialization each, which is what makes this step's time hard to predict.
    examples = (("FLATGRAD_TEST_EXAMPLES", "5" if ctx.quick else "10"),)
    return [
        Step("wheels", "wheels", pip, t["wheels"], files=(".whl/*.whl",) if wheels else (), checkout=True),
        _module(ctx, "env", "flatgrad.check.env", t["env"], ()),
        Step("build", "build", setup, t["build"], files=("setup.py", "csrc/*.cpp", "csrc/cuda/*.cu"), env=build_env,
             checkout=True),  # fmt: skip
        _module(ctx, "backends", "flatgrad.check.backends", t["backends"], ()),
        _module(ctx, "kernels", "flatgrad.check.kernels", t["kernels"], kernel_args),
        _module(ctx, "zero-offload", "flatgrad.check.zero_offload", t["zero-offload"], offload_args,
                report="zero_offload.json"),  # fmt: skip
        _module(ctx, "streams", "flatgrad.check.streams", t["streams"], streams_args),
        _module(ctx, "wire", "flatgrad.check.wire", t["wire"], wire_args),
        _module(ctx, "zero-step", "flatgrad.check.zero_step", t["zero-step"], zero_args, report="zero_step.json"),
        pytest_step(ctx, "test-reducer", t["test-reducer"], 30, ("tests/test_reducer_cuda.py",)),
        pytest_step(ctx, "test-cuda", t["test-cuda"], 20, ("tests/test_cuda.py",)),
        pytest_step(ctx, "test-kernels", t["test-kernels"], 15, ("tests/test_kernels.py", "-k", "not cpu"),
                    env=examples),  # fmt: skip
        dataclasses.replace(_module(ctx, "qgz", "flatgrad.check.qgz", t["qgz"], qgz_args, report="qgz.json"),
                            env=qgz_env),  # fmt: skip
        Step("bench", "bench", (py, "-m", "flatgrad", *bench_args), t["bench"], args=bench_args),
        pytest_step(ctx, "test-triton", t["test-triton"], 10, ("tests/test_triton.py", "-k", "not compile_check")),
    ]


def build_key(ctx: Context) -> str:
    """A hash of what the compiled extension depends on: sources, build script, torch, Python, archs."""
    digest = hashlib.sha256()
    if ctx.root:
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
