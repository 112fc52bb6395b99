"""Compile every Triton kernel of flatgrad's ``triton`` backend to sm_90, without a GPU.

The wire kernels of the reduction modes (``wire_triton.kernel_specs()``) are included,
each with its sizes declared i64 and as the launcher specialises them for i32 sizes
(divisibility hints, 1 as a constant; see ``launched``), so the variants that launch
are compiled, not only the i64 declarations.

Each (kernel, dtype specialisation) the launchers can launch, as listed by
``flatgrad.kernels.triton_backend.kernel_specs()``, goes through
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with the launch options,
in a fresh Triton cache so that nothing is skipped. The output is then checked
against the arithmetic contract (bitwise agreement with the reference):

* PTX: every fp32 add / sub / mul carries ``.rn`` (ptxas never contracts those
  into an FMA), no ``fma`` and no flush-to-zero (``.ftz``) arithmetic;
* SASS (when Triton's bundled ``nvdisasm`` is present): no ``FFMA``, except in a
  kernel whose PTX has ``div.rn.f32`` (ptxas builds that IEEE division from FFMAs).

Before that, a self-check compiles a toy ``a * b + c`` kernel with and without
FP fusion and makes sure these rules flag the first and pass the second, so a
Triton that changes its output cannot turn the check into a no-op.

Prints one line per kernel with its PTX and cubin sizes; exits non-zero on any failure.
Run from anywhere: ``python .ci/triton_compile.py [--match SUBSTRING ...]`` (it uses
this checkout's flatgrad; ``--match`` keeps only kernels whose label contains one of
the substrings, for quick local runs; CI compiles all of them).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

# The kernels must be real JIT functions, not interpreter ones, whatever the caller's environment.
os.environ.pop("TRITON_INTERPRET", None)
_CACHE = tempfile.mkdtemp(prefix="flatgrad-triton-cache-")
os.environ["TRITON_CACHE_DIR"] = _CACHE
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from flatgrad.kernels import triton_backend, wire_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
_PTX_RULES = {
    "an fp32 add/sub/mul without .rn (ptxas may fuse it into an FMA)": re.compile(r"\b(?:add|sub|mul)\.f32\b"),
    "an FMA": re.compile(r"\bfma\."),
    "flush-to-zero arithmetic": re.compile(r"\.ftz\b"),
}
_SASS_RULES = {"an FFMA": re.compile(r"\bFFMA\b")}


def _nvdisasm() -> str | None:
    try:
        path = triton.knobs.nvidia.nvdisasm.path
    except Exception:  # older Triton or no bundled tool: the PTX rules still apply
        return None
    return path if path and os.path.exists(path) else None


def sass_of(cubin: bytes, nvdisasm: str) -> str:
    """Disassemble a cubin with ``nvdisasm``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout


def contract_violations(ptx: str, sass: str | None) -> list[str]:
    """What in a kernel's PTX / SASS would break bitwise agreement with the reference."""
    found = [what for what, rule in _PTX_RULES.items() if rule.search(ptx)]
    # ptxas expands an IEEE division (div.rn.f32, the wire kernels' div_rn) into an FFMA
    # sequence that is correctly rounded as a whole; the PTX rules above still hold for the rest.
    if sass is not None and "div.rn.f32" not in ptx:
        found += [what for what, rule in _SASS_RULES.items() if rule.search(sass)]
    return found


def launched(spec: triton_backend.KernelSpec) -> tuple[dict, dict, dict]:
    """``(signature, constexprs, attrs)`` of ``spec`` as the launcher specialises it.

    With ``spec.launch`` (example integer arguments), each of them goes through Triton's own
    launch-time rule (``native_specialize_impl``, the one ``JITFunction.run`` applies): i32 or
    i64, ``tt.divisibility=16`` for a multiple of 16, 1 as a constant. Pointers get the
    divisibility a fresh (16-byte aligned) allocation gets.
    """
    signature, constexprs, attrs = dict(spec.signature), dict(spec.constexprs), {}
    if spec.launch is None:
        return signature, constexprs, attrs
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    names = list(signature)
    for name, value in spec.launch.items():
        kind, attr = native_specialize_impl(CUDABackend, value, False, True, True)
        if kind == "constexpr":
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = kind
        if attr == "D":
            attrs[(names.index(name),)] = CUDABackend.parse_attr(attr)
    for name, kind in signature.items():
        if kind.startswith("*"):
            attrs[(names.index(name),)] = CUDABackend.parse_attr("D")
    return signature, constexprs, attrs


def compile_spec(spec: triton_backend.KernelSpec):
    """``triton.compile`` one specialisation for sm_90."""
    signature, constexprs, attrs = launched(spec)
    source = triton.compiler.ASTSource(fn=spec.fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=spec.options)


@triton.jit
def _fusable_kernel(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a, b, c = tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)
    tl.store(out_ptr + offs, a * b + c)


def self_check(nvdisasm: str | None) -> list[str]:
    """Problems with the rules themselves: they must flag a fused ``a * b + c`` and pass an unfused one."""
    problems = []
    signature = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "out_ptr": "*fp32", "BLOCK": "constexpr"}
    for fusion in (True, False):
        spec = triton_backend.KernelSpec("fusable", _fusable_kernel, signature, {"BLOCK": 128},
                                         {"num_warps": 1, "enable_fp_fusion": fusion})  # fmt: skip
        compiled = compile_spec(spec)
        sass = sass_of(compiled.asm["cubin"], nvdisasm) if nvdisasm else None
        flagged = bool(contract_violations(compiled.asm["ptx"], sass))
        if flagged != fusion:
            problems.append(f"a*b+c with enable_fp_fusion={fusion} was {'' if flagged else 'not '}flagged")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", action="append", default=[], help="only kernels whose label contains this")
    args = parser.parse_args(argv)
    every = triton_backend.kernel_specs("cuda") + wire_triton.kernel_specs()
    specs = [s for s in every if not args.match or any(m in s.name for m in args.match)]
    if not specs:
        print(f"no kernel matches {args.match}")
        return 1
    nvdisasm = _nvdisasm()
    print(f"triton {triton.__version__}: compiling {len(specs)} kernels for sm_90"
          f" (SASS check: {'nvdisasm' if nvdisasm else 'skipped, no nvdisasm'})")  # fmt: skip
    problems = self_check(nvdisasm)
    if problems:
        print(f"FAIL self-check of the contract rules: {'; '.join(problems)}")
        return 1
    print("ok   self-check: the contract rules flag a fused a*b+c and pass an unfused one")
    failures = []
    start = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        try:
            compiled = compile_spec(spec)
            ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
            bad = contract_violations(ptx, sass_of(cubin, nvdisasm) if nvdisasm else None)
        except Exception as exc:  # report every kernel, then fail
            failures.append(spec.name)
            print(f"FAIL {spec.name}: {type(exc).__name__}: {exc}")
            continue
        if bad:
            failures.append(spec.name)
            print(f"FAIL {spec.name}: contains {'; '.join(bad)}")
            continue
        print(f"ok   {spec.name}: ptx {len(ptx)} B, cubin {len(cubin)} B, {time.perf_counter() - t0:.1f} s")
    total = time.perf_counter() - start
    if failures:
        print(f"{len(failures)} of {len(specs)} kernels failed ({total:.0f} s): {', '.join(failures)}")
        return 1
    print(f"all {len(specs)} kernels compiled for sm_90 ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    try:
        code = main()
    finally:
        shutil.rmtree(_CACHE, ignore_errors=True)
    sys.exit(code)
