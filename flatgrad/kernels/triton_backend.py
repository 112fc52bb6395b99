"""The ``triton`` backend: ``pack`` and ``unpack`` as one Triton launch each.

Three layers per op, as in Liger-Kernel:

1. private ``@triton.jit`` kernels, ``_pack_kernel`` and ``_unpack_kernel``;
2. launchers (``_launch_pack``, ``_launch_unpack``) that fetch the layout's run
   table from ``flatgrad.kernels._tables`` (split so that one program copies one
   run), the pointer table of the call's tensors, and set the grid;
3. launch configuration in ``_config`` (apart from both).

It runs on CUDA tensors, or on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` when this module is imported).

Kernels reach a call's tensors through a table of their ``data_ptr()``
values (and dtype codes), kept in a small LRU so that steady-state calls upload
nothing. See [Note: triton pointer tables] in docs/design.md.

bf16 <-> fp32 conversions are integer bit operations, with FMA fusion off, so
that compiled and interpreted kernels give the reference's bits. See
[Note: triton casts] in docs/design.md.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from typing import NamedTuple, Sequence

import torch

from ..layout import Layout
from . import _tables

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # optional dependency: devices() reports it, importing flatgrad never fails
    triton = tl = None
    _MISSING = f"triton is not installed ({exc}); pip install 'flatgrad[triton]'"
else:
    _MISSING = ""


def _jit(fn):
    """``triton.jit`` when Triton is installed; otherwise the plain function, never launched."""
    return triton.jit(fn) if triton is not None else fn


# Whether the kernels below were built for Triton's interpreter (decided when they are decorated).
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# dtype codes in the pack pointer table; the kernels spell them as literals 0 / 1 / 2.
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MIXED = -1  # SRC_CODE of a pack call whose inputs have several dtypes


# ---------------------------------------------------------------------------------------------
# Layer 1: kernels
# ---------------------------------------------------------------------------------------------


@_jit
def _bf16_to_f32(x):
    """bf16 -> fp32, exactly: the 16 bits become the high half of the fp32 word."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@_jit
def _to_f32(x):
    if x.dtype == tl.bfloat16:
        return _bf16_to_f32(x)
    return x.to(tl.float32)


@_jit
def _from_f32(x, DTYPE: tl.constexpr):
    """fp32 -> ``DTYPE``, rounding to nearest even. See [Note: triton casts]."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        return tl.where(is_nan, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@_jit
def _load_f32(src, at, mask, code):
    """Elements ``at`` (where ``mask``) of the tensor at address ``src``, dtype ``code`` (``_CODES``), as fp32; else 0."""
    if code == 0:
        value = tl.load(src.to(tl.pointer_type(tl.float32)) + at, mask=mask, other=0.0)
    elif code == 1:
        value = _bf16_to_f32(tl.load(src.to(tl.pointer_type(tl.bfloat16)) + at, mask=mask, other=0))
    else:
        value = tl.load(src.to(tl.pointer_type(tl.float16)) + at, mask=mask, other=0).to(tl.float32)
    return value


@_jit
def _pack_kernel(runs_ptr, src_ptrs_ptr, src_codes_ptr, out_ptr, scale, SRC_CODE: tl.constexpr, BLOCK: tl.constexpr):
    """One program writes one pack run (see [Note: run tables]) of at most ``BLOCK`` elements."""
    run = runs_ptr + tl.program_id(0).to(tl.int64) * 5
    dst_offset = tl.load(run)
    tensor_index = tl.load(run + 1)
    src_offset = tl.load(run + 2)
    length = tl.load(run + 3)
    valid = tl.load(run + 4)
    offs = tl.arange(0, BLOCK)
    reads = valid > 0  # padding runs touch neither table nor data
    src = tl.load(src_ptrs_ptr + tensor_index, mask=reads, other=0)
    if SRC_CODE == -1:
        code = tl.load(src_codes_ptr + tensor_index, mask=reads, other=0)
    else:
        code = SRC_CODE
    copied = tl.where(src != 0, valid, 0)  # address 0: a missing tensor, written as zeros
    in_src = offs < copied
    value = _load_f32(src, src_offset + offs, in_src, code)
    if scale != 1.0:
        value = value * scale
    value = tl.where(in_src, value, 0.0)  # the zero padding stays zero whatever the scale
    tl.store(out_ptr + dst_offset + offs, _from_f32(value, out_ptr.dtype.element_ty), mask=offs < length)


@_jit
def _unpack_kernel(
    runs_ptr,
    shard_ptr,
    out_ptrs_ptr,
    scale,
    sum_sq_ptr,
    nonfinite_ptr,
    OUT_DTYPE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program writes one unpack run of at most ``BLOCK`` elements and, with ``STATS``, its partials."""
    pid = tl.program_id(0).to(tl.int64)
    run = runs_ptr + pid * 4
    src_offset = tl.load(run)
    out_index = tl.load(run + 1)
    out_offset = tl.load(run + 2)
    length = tl.load(run + 3)
    offs = tl.arange(0, BLOCK)
    in_run = offs < length
    value = _to_f32(tl.load(shard_ptr + src_offset + offs, mask=in_run, other=0))
    if scale != 1.0:
        value = value * scale
    out = tl.load(out_ptrs_ptr + out_index).to(tl.pointer_type(OUT_DTYPE)) + out_offset + offs
    if ACCUMULATE:
        value = _to_f32(tl.load(out, mask=in_run, other=0)) + value
    written = _from_f32(value, OUT_DTYPE)
    tl.store(out, written, mask=in_run)
    if STATS:
        w = tl.where(in_run, _to_f32(written), 0.0)
        tl.store(sum_sq_ptr + pid, tl.sum(w * w, axis=0))
        nonfinite = (w.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
        tl.store(nonfinite_ptr + pid, tl.sum(nonfinite.to(tl.int32), axis=0))


# ---------------------------------------------------------------------------------------------
# Layer 3: launch configuration
# ---------------------------------------------------------------------------------------------


class _Config(NamedTuple):
    """How a kernel is launched on one device type.

    Attributes:
        block: elements per program, and so the longest run (``max_len`` of the run tables).
        num_warps: warps per program.
    """

    block: int
    num_warps: int


# Not tuned on a GPU: common choices for a memory-bound copy (16 elements per thread
# on CUDA).
# Under the interpreter a smaller block splits runs more often, which the tests rely on
# to cover run boundaries, at a cost the interpreter's per-program overhead keeps small.
_CONFIGS = {"cuda": _Config(block=4096, num_warps=8), "cpu": _Config(block=1024, num_warps=1)}


def _config(device: torch.device) -> _Config:
    return _CONFIGS[device.type]


# ---------------------------------------------------------------------------------------------
# Layer 2: launchers
# ---------------------------------------------------------------------------------------------

_TABLE_CACHE_SIZE = 128


class _PointerTables:
    """A small LRU of device pointer tables; see [Note: triton pointer tables]."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.uploads = 0  # tables made so far (tests check that repeated calls make none)

    def get(self, tensors: Sequence[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ptrs int64 [T], codes int32 [T])`` on ``device`` for ``tensors`` (``None``: address 0)."""
        ptrs = tuple(0 if t is None else t.data_ptr() for t in tensors)
        codes = tuple(0 if t is None else _CODES[t.dtype] for t in tensors)
        # Keyed by stream too: a table uploaded on one stream is only known complete on that stream.
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        key = (device, stream, ptrs, codes)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry
        entry = self._make(ptrs, codes, device)
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
            self.uploads += 1
        return entry

    @staticmethod
    def _make(ptrs: tuple[int, ...], codes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(ptrs)
        host = torch.empty(12 * max(n, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
        host[: 8 * n].view(torch.int64).copy_(torch.tensor(ptrs, dtype=torch.int64))
        host[8 * n : 12 * n].view(torch.int32).copy_(torch.tensor(codes, dtype=torch.int32))
        table = host.to(device, non_blocking=True) if device.type == "cuda" else host
        return table[: 8 * n].view(torch.int64), table[8 * n : 12 * n].view(torch.int32)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_pointer_tables = _PointerTables(_TABLE_CACHE_SIZE)
_stats_dummies: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device; make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _launch_pack(tensors: Sequence[torch.Tensor | None], layout: Layout, out: torch.Tensor, scale: float) -> None:
    """Fill ``out`` from ``tensors`` (``None``: zeros) in one launch (arguments validated by ``flatgrad.pack``)."""
    device = out.device
    cfg = _config(device)
    runs = _tables.pack_runs(layout, device, cfg.block)
    if runs.shape[0] == 0:
        return
    ptrs, codes = _pointer_tables.get(tensors, device)
    dtypes = {t.dtype for t in tensors if t is not None}
    src_code = _CODES[dtypes.pop()] if len(dtypes) == 1 else (_CODES[out.dtype] if not dtypes else _MIXED)
    with _on_device(device):
        _pack_kernel[(runs.shape[0],)](
            runs, ptrs, codes, out, float(scale), SRC_CODE=src_code, BLOCK=cfg.block,
            num_warps=cfg.num_warps, enable_fp_fusion=False,
        )  # fmt: skip


def _launch_unpack(
    shard: torch.Tensor,
    layout: Layout,
    rank: int,
    outs: Sequence[torch.Tensor],
    per_piece: bool,
    scale: float,
    accumulate: bool,
    stats: bool,
) -> torch.Tensor | None:
    """Write ``rank``'s shard into ``outs`` in one launch; with ``stats`` returns fp32 ``[sum_sq, nonfinite_count]``."""
    device = shard.device
    cfg = _config(device)
    runs = _tables.unpack_runs(layout, rank, per_piece, device, cfg.block)
    num_runs = runs.shape[0]
    if num_runs == 0:
        return torch.zeros(2, dtype=torch.float32, device=device) if stats else None
    ptrs, _ = _pointer_tables.get(outs, device)
    if stats:
        # Per-program partials, reduced below by torch in a fixed order: deterministic.
        workspace = torch.empty(2 * num_runs, dtype=torch.int32, device=device)
        sum_sq, nonfinite = workspace[:num_runs].view(torch.float32), workspace[num_runs:]
    else:
        if device not in _stats_dummies:
            _stats_dummies[device] = (torch.empty(1, dtype=torch.float32, device=device),
                                      torch.empty(1, dtype=torch.int32, device=device))  # fmt: skip
        sum_sq, nonfinite = _stats_dummies[device]
    with _on_device(device):
        _unpack_kernel[(num_runs,)](
            runs, shard, ptrs, float(scale), sum_sq, nonfinite,
            OUT_DTYPE=_tl_dtype(outs[0].dtype), ACCUMULATE=bool(accumulate), STATS=bool(stats), BLOCK=cfg.block,
            num_warps=cfg.num_warps, enable_fp_fusion=False,
        )  # fmt: skip
    if not stats:
        return None
    return torch.stack([sum_sq.sum(), nonfinite.sum().to(torch.float32)])


# ---------------------------------------------------------------------------------------------
# Module protocol (see flatgrad/kernels/_backends.py) and the compile check's view of the kernels
# ---------------------------------------------------------------------------------------------


class _TritonBackend:
    name = "triton"
    pack = staticmethod(_launch_pack)
    unpack = staticmethod(_launch_unpack)


def devices(name: str) -> tuple[list[str], str]:
    """CUDA when Triton and a CUDA device are present; CPU when the kernels were built for the interpreter."""
    if _MISSING:
        return [], _MISSING
    if _INTERPRET:
        return ["cpu"], ""
    if not torch.cuda.is_available():
        return [], "no CUDA device is visible (set TRITON_INTERPRET=1 before importing flatgrad to run on CPU)"
    return ["cuda"], ""


def backend(name: str) -> _TritonBackend:
    return _TritonBackend()


class KernelSpec(NamedTuple):
    """One specialisation the launchers can launch, in the form ``triton.compile`` takes.

    Attributes:
        name: a readable label (kernel and specialisation).
        fn: the ``@triton.jit`` kernel.
        signature: argument name -> Triton type (``"*bf16"``, ``"fp32"``, ``"constexpr"``).
        constexprs: the compile-time arguments.
        options: launch options (``num_warps``, ``enable_fp_fusion``).
        launch: example values of the integer arguments of a launch, or None. With them the
            compile check specialises the kernel as the launcher would for those values (i32 or
            i64, divisibility by 16, 1 as a constant), and the signature's integer types are
            only the declared (i64) form.
    """

    name: str
    fn: object
    signature: dict
    constexprs: dict
    options: dict
    launch: dict | None = None


def kernel_specs(device_type: str = "cuda") -> list[KernelSpec]:
    """Every (kernel, dtype specialisation) the launchers use on ``device_type``, for ``.ci/triton_compile.py``."""
    if _MISSING:
        raise RuntimeError(_MISSING)
    cfg = _CONFIGS[device_type]
    options = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    specs = []
    for out_dtype in _CODES:
        out = short[out_dtype]
        for src_dtype in (*_CODES, None):  # None: inputs of mixed dtypes
            src = short[src_dtype] if src_dtype is not None else "mixed"
            signature = {
                "runs_ptr": "*i64", "src_ptrs_ptr": "*i64", "src_codes_ptr": "*i32", "out_ptr": f"*{out}",
                "scale": "fp32", "SRC_CODE": "constexpr", "BLOCK": "constexpr",
            }  # fmt: skip
            constexprs = {"SRC_CODE": _CODES.get(src_dtype, _MIXED), "BLOCK": cfg.block}
            specs.append(KernelSpec(f"_pack_kernel[{src}->{out}]", _pack_kernel, signature, constexprs, options))
    for shard_dtype in _CODES:
        for out_dtype in _CODES:
            for accumulate in (False, True):
                for stats in (False, True):
                    signature = {
                        "runs_ptr": "*i64", "shard_ptr": f"*{short[shard_dtype]}", "out_ptrs_ptr": "*i64",
                        "scale": "fp32", "sum_sq_ptr": "*fp32", "nonfinite_ptr": "*i32", "OUT_DTYPE": "constexpr",
                        "ACCUMULATE": "constexpr", "STATS": "constexpr", "BLOCK": "constexpr",
                    }  # fmt: skip
                    constexprs = {
                        "OUT_DTYPE": _tl_dtype(out_dtype), "ACCUMULATE": accumulate, "STATS": stats,
                        "BLOCK": cfg.block,
                    }  # fmt: skip
                    flags = "".join(f",{flag}" for flag, on in (("accumulate", accumulate), ("stats", stats)) if on)
                    name = f"_unpack_kernel[{short[shard_dtype]}->{short[out_dtype]}{flags}]"
                    specs.append(KernelSpec(name, _unpack_kernel, signature, constexprs, options))
    return specs
