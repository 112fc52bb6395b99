"""The wire kernels (see ``wire.py``) in Triton: CUDA tensors, or CPU tensors under the interpreter.

Arithmetic is the reference's ([Note: wire arithmetic contract] in
docs/design.md), launched with ``enable_fp_fusion=False`` so that no
multiply-add becomes an FMA. Three choices keep it bitwise on the interpreter
and on sm_90 alike, where Triton's own conversions differ between them:

* bf16 <-> fp32 uses ``triton_backend``'s integer conversions (see [Note: triton casts]);
* fp32 divisions are ``div_rn`` (IEEE), not Triton's default approximate ``/``;
* int8 rounding is the ``(y + 1.5 * 2**23) - 1.5 * 2**23`` trick (round half to
  even for ``|y| < 2**22``), and fp8 e4m3fn is encoded and decoded with integer
  bit operations (the same trick at the value's quantum), so no backend-specific
  float8 cast is involved.

Every launch enters the tensors' device first (``triton_backend._on_device``):
Triton launches on the current CUDA device, whatever the tensors'.

``_pack_quantize_kernel`` (see [Note: pack-quantize] in docs/design.md)
reads the gradients through the pack run table and ``triton_backend``'s pointer
tables (see [Note: triton pointer tables]) and shares the quantize itself
(``_quantize_store``) with ``_quantize_kernel``, as does ``_requantize_kernel`` (see
[Note: requantize] in docs/design.md), which sums the received segments' dequantized values
(``_dequantize_code``, as ``_dequantize_sum_kernel``) into the block it quantizes.

With stats, each program stores the fp32 sum of squares and the non-finite count
of the values it wrote, and torch sums those partials in program order, as the
regular unpack does (``triton_backend._launch_unpack``): deterministic for a
given shape.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..layout import Layout

from . import _tables
from .triton_backend import (
    _CODES, _MIXED, _from_f32, _jit, _load_f32, _on_device, _pointer_tables, _to_f32, tl, triton,
)  # fmt: skip
from .wire_reference import nblocks, round16, segment_bytes

_KINDS = {"int8": 0, "fp8": 1}
_SUM_BLOCK = 1024
_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}


@_jit
def _rne_int(y):
    """Round to the nearest integer, ties to even, for |y| < 2**22 (fp32 addition rounds to nearest even)."""
    return (y + 12582912.0) - 12582912.0


@_jit
def _fp8_encode(y):
    """fp32 in [-448, 448] -> e4m3fn bits (int32 0..255), rounding to nearest even."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(y)
    exponent = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
    exponent = tl.maximum(exponent, 127 - 6)  # below 2**-6 the quantum is the subnormals' 2**-9
    # 1.5 * 2**(exponent - 127 - 3 + 23): adding and subtracting it rounds a to a multiple of 2**(exponent - 130).
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    rb = r.to(tl.uint32, bitcast=True)
    r_exp = ((rb >> 23) & 0xFF).to(tl.int32)
    normal = ((r_exp - 120) << 3) | ((rb >> 20) & 7).to(tl.int32)
    subnormal = _rne_int(r * 512.0).to(tl.int32)
    code = tl.where(r >= 0.015625, normal, subnormal)
    return code | (sign.to(tl.int32) << 7)


@_jit
def _fp8_decode(code):
    """e4m3fn bits (int32 0..255) -> fp32, exactly (0x7F / 0xFF are NaN)."""
    sign = (code >> 7) & 1
    e = (code >> 3) & 0xF
    m = code & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    subnormal = m.to(tl.float32) * 0.001953125
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(e == 0, subnormal, normal)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@_jit
def _quantize_code(y, KIND: tl.constexpr):
    """``(code int32, its fp32 value)`` of ``y = x / scale``, as ``wire_reference.quantize_codes``.

    NaN is int8 0 and fp8 0x7F; it is replaced by 0 before the clamps (``tl.maximum``
    drops NaN on the GPU, so the lowest code would come out) and the encoding.
    """
    nan = y != y
    y = tl.where(nan, 0.0, y)
    if KIND == 0:
        dq = tl.minimum(tl.maximum(_rne_int(y), -127.0), 127.0)
        code = dq.to(tl.int32)
    else:
        code = tl.where(nan, 0x7F, _fp8_encode(tl.minimum(tl.maximum(y, -448.0), 448.0)))
        dq = _fp8_decode(code)
    return code, dq


@_jit
def _dequantize_code(raw, KIND: tl.constexpr):
    """fp32 of the wire codes ``raw`` (int32 of the int8 loads): int8, or fp8 e4m3fn bits."""
    if KIND == 0:
        return raw.to(tl.float32)
    return _fp8_decode(raw & 0xFF)


@_jit
def _finish(acc, out_ptr, offs, mask, scale, sum_sq_ptr, nonfinite_ptr, ACCUMULATE: tl.constexpr, STATS: tl.constexpr):
    if scale != 1.0:
        acc = acc * scale
    if ACCUMULATE:
        acc = _to_f32(tl.load(out_ptr + offs, mask=mask, other=0)) + acc
    written = _from_f32(acc, out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, written, mask=mask)
    if STATS:
        pid = tl.program_id(0).to(tl.int64)
        w = tl.where(mask, _to_f32(written), 0.0)
        tl.store(sum_sq_ptr + pid, tl.sum(w * w, axis=0))
        nonfinite = (w.to(tl.uint32, bitcast=True) & 0x7F800000) == 0x7F800000
        tl.store(nonfinite_ptr + pid, tl.sum(nonfinite.to(tl.int32), axis=0))


@_jit
def _sum_kernel(
    src_ptr, out_ptr, shard_numel, world_size, scale, sum_sq_ptr, nonfinite_ptr,
    ACCUMULATE: tl.constexpr, STATS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program sums ``BLOCK`` elements of the ``W`` sources in rank order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_numel
    acc = _to_f32(tl.load(src_ptr + offs, mask=mask, other=0))
    source = tl.full([], 0, tl.int64)  # w * shard_numel in i64: an i32 shard_numel would overflow past 2^31
    for w in range(1, world_size):
        source += shard_numel
        acc = acc + _to_f32(tl.load(src_ptr + source + offs, mask=mask, other=0))
    _finish(acc, out_ptr, offs, mask, scale, sum_sq_ptr, nonfinite_ptr, ACCUMULATE, STATS)


@_jit
def _quantize_store(
    x, mask, res_ptr, values_ptr, scales_ptr, elem, in_segment, w, j, seg, scales_at,
    KIND: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    """Quantize block ``j`` of segment ``w`` from its fp32 values ``x`` (masked-off lanes 0) and store it.

    ``elem``: the lanes' element offsets in the packed buffer (they index the residual;
    ``x`` already includes it when ``HAS_RES``); ``in_segment``: their offsets in the segment.
    """
    absmax = tl.max(tl.abs(x), axis=0)
    absmax = tl.where(tl.max((x != x).to(tl.int32), axis=0) > 0, float("nan"), absmax)  # max() may drop NaN
    if KIND == 0:
        scale = tl.math.div_rn(absmax, 127.0)
    else:
        scale = tl.math.div_rn(absmax, 448.0)
    zero = scale == 0.0
    y = tl.math.div_rn(x, tl.where(zero, 1.0, scale))
    y = tl.where(zero, 0.0, y)
    code, dq = _quantize_code(y, KIND)
    tl.store(values_ptr + w * seg + in_segment, code.to(tl.int8), mask=mask)
    tl.store(scales_ptr + (w * seg + scales_at) // 4 + j, scale)
    if HAS_RES:
        tl.store(res_ptr + elem, x - dq * scale, mask=mask)


@_jit
def _quantize_kernel(
    src_ptr, res_ptr, values_ptr, scales_ptr, shard_numel, seg, scales_at, nblocks,
    KIND: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program quantizes one block of one destination's segment."""
    pid = tl.program_id(0).to(tl.int64)
    w = pid // nblocks
    j = pid % nblocks
    in_segment = j * BLOCK + tl.arange(0, BLOCK)
    mask = in_segment < shard_numel
    elem = w * shard_numel + in_segment
    x = _to_f32(tl.load(src_ptr + elem, mask=mask, other=0))
    if HAS_RES:
        x = x + tl.load(res_ptr + elem, mask=mask, other=0.0)
    x = tl.where(mask, x, 0.0)
    _quantize_store(x, mask, res_ptr, values_ptr, scales_ptr, elem, in_segment, w, j, seg, scales_at, KIND, HAS_RES)


@_jit
def _pack_quantize_kernel(
    runs_ptr, num_runs, src_ptrs_ptr, src_codes_ptr, res_ptr, values_ptr, scales_ptr, shard_numel, seg, scales_at,
    nblocks, scale, SRC_CODE: tl.constexpr, KIND: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program packs (fp32, scaled) and quantizes one block of one destination's segment.

    The block's elements ``[p0, p1)`` of the packed buffer are gathered along the pack
    run table (see [Note: run tables]): a binary search finds the run holding ``p0``,
    then the runs are walked until ``p1``. Elements outside every run's valid part
    (padding) or of a missing tensor (address 0) stay 0.
    """
    pid = tl.program_id(0).to(tl.int64)
    w = pid // nblocks
    j = pid % nblocks
    in_segment = j * BLOCK + tl.arange(0, BLOCK)
    mask = in_segment < shard_numel
    elem = w * shard_numel + in_segment
    p0 = w * shard_numel + j * BLOCK
    p1 = p0 + tl.minimum(shard_numel - j * BLOCK, BLOCK)
    # The last run whose dst_offset <= p0 (runs tile the buffer in order; an empty run is skipped over).
    lo = tl.full([], 0, tl.int64)  # a tensor, not a constant: num_runs == 1 is specialised to one
    hi = lo + num_runs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        at_or_before = tl.load(runs_ptr + mid * 5) <= p0
        lo = tl.where(at_or_before, mid, lo)
        hi = tl.where(at_or_before, hi, mid)
    x = tl.zeros([BLOCK], dtype=tl.float32)
    k = lo
    dst_offset = tl.load(runs_ptr + k * 5)
    while dst_offset < p1:
        run = runs_ptr + k * 5
        tensor_index = tl.load(run + 1)
        src_offset = tl.load(run + 2)
        valid = tl.load(run + 4)
        reads = valid > 0  # padding runs touch neither table nor data
        src = tl.load(src_ptrs_ptr + tensor_index, mask=reads, other=0)
        if SRC_CODE == -1:
            code = tl.load(src_codes_ptr + tensor_index, mask=reads, other=0)
        else:
            code = SRC_CODE
        copied = tl.where(src != 0, valid, 0)  # address 0: a missing tensor, zeros
        in_run = mask & (elem >= dst_offset) & (elem < dst_offset + copied)
        value = _load_f32(src, src_offset + (elem - dst_offset), in_run, code)
        if scale != 1.0:
            value = value * scale
        x = tl.where(in_run, value, x)
        k += 1
        dst_offset = tl.load(runs_ptr + k * 5, mask=k < num_runs, other=p1)
    if HAS_RES:
        x = x + tl.load(res_ptr + elem, mask=mask, other=0.0)
    x = tl.where(mask, x, 0.0)
    _quantize_store(x, mask, res_ptr, values_ptr, scales_ptr, elem, in_segment, w, j, seg, scales_at, KIND, HAS_RES)


@_jit
def _dequantize_sum_kernel(
    values_ptr, scales_ptr, out_ptr, shard_numel, seg, scales_at, world_size, scale, sum_sq_ptr, nonfinite_ptr,
    KIND: tl.constexpr, ACCUMULATE: tl.constexpr, STATS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program dequantizes and sums, in rank order, one block of the ``W`` segments."""
    j = tl.program_id(0).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_numel
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    segment = tl.full([], 0, tl.int64)  # w * seg in i64: an i32 seg would overflow once the wire passes 2 GiB
    for w in range(0, world_size):
        raw = tl.load(values_ptr + segment + offs, mask=mask, other=0).to(tl.int32)
        v = _dequantize_code(raw, KIND) * tl.load(scales_ptr + (segment + scales_at) // 4 + j)
        acc = tl.where(w == 0, v, acc + v)
        segment += seg
    _finish(acc, out_ptr, offs, mask, scale, sum_sq_ptr, nonfinite_ptr, ACCUMULATE, STATS)


@_jit
def _requantize_kernel(
    in_values_ptr, in_scales_ptr, res_ptr, values_ptr, scales_ptr, sources, in_seg, in_scales_at, shard_numel, seg,
    scales_at, nblocks, KIND: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program sums, in source order, and quantizes one block of one output segment. See [Note: requantize].

    Its elements ``elem`` of the partial (``segments * shard_numel``) may straddle two input blocks:
    each lane loads the scale of its own, ``elem // BLOCK``.
    """
    pid = tl.program_id(0).to(tl.int64)
    w = pid // nblocks
    j = pid % nblocks
    in_segment = j * BLOCK + tl.arange(0, BLOCK)
    mask = in_segment < shard_numel
    elem = w * shard_numel + in_segment
    in_block = elem // BLOCK
    x = tl.zeros([BLOCK], dtype=tl.float32)
    segment = tl.full([], 0, tl.int64)  # l * in_seg in i64: an i32 in_seg would overflow once the wire passes 2 GiB
    for l in range(0, sources):
        raw = tl.load(in_values_ptr + segment + elem, mask=mask, other=0).to(tl.int32)
        sc = tl.load(in_scales_ptr + (segment + in_scales_at) // 4 + in_block, mask=mask, other=0.0)
        v = _dequantize_code(raw, KIND) * sc
        x = tl.where(l == 0, v, x + v)
        segment += in_seg
    if HAS_RES:
        x = x + tl.load(res_ptr + elem, mask=mask, other=0.0)
    x = tl.where(mask, x, 0.0)
    _quantize_store(x, mask, res_ptr, values_ptr, scales_ptr, elem, in_segment, w, j, seg, scales_at, KIND, HAS_RES)


def _partials(programs: int, stats: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_sq fp32 [programs], nonfinite int32 [programs])``: one allocation, or 1-element dummies without stats."""
    workspace = torch.empty(2 * max(programs, 1) if stats else 2, dtype=torch.int32, device=device)
    half = workspace.numel() // 2
    return workspace[:half].view(torch.float32), workspace[half:]


def _reduce(sum_sq: torch.Tensor, nonfinite: torch.Tensor, programs: int, stats: bool) -> torch.Tensor | None:
    """fp32 ``[sum_sq, nonfinite_count]`` of the per-program partials, summed by torch in a fixed order."""
    if not stats:
        return None
    if programs == 0:
        return torch.zeros(2, dtype=torch.float32, device=sum_sq.device)
    return torch.stack([sum_sq[:programs].sum(), nonfinite[:programs].sum().to(torch.float32)])


class Backend:
    """The ``triton`` wire kernels (launchers: the checks are ``wire.py``'s)."""

    name = "triton"

    def sum_sources(
        self, recv: torch.Tensor, world_size: int, out: torch.Tensor, scale: float, accumulate: bool, stats: bool = False
    ) -> torch.Tensor | None:
        s = out.numel()
        programs = triton.cdiv(s, _SUM_BLOCK)
        sum_sq, nonfinite = _partials(programs, stats, out.device)
        if programs:
            with _on_device(out.device):
                _sum_kernel[(programs,)](
                    recv, out, s, world_size, scale, sum_sq, nonfinite, ACCUMULATE=accumulate, STATS=stats,
                    BLOCK=_SUM_BLOCK, **_OPTIONS,
                )  # fmt: skip
        return _reduce(sum_sq, nonfinite, programs, stats)

    def quantize(
        self, packed: torch.Tensor, world_size: int, block: int, kind: str, wire: torch.Tensor, residual: torch.Tensor | None
    ) -> None:
        s = packed.numel() // world_size
        nb = nblocks(s, block)
        wire = wire[: world_size * segment_bytes(s, block)]
        with _on_device(packed.device):
            _quantize_kernel[(world_size * nb,)](
                packed, residual if residual is not None else packed, wire.view(torch.int8), wire.view(torch.float32),
                s, segment_bytes(s, block), round16(s), nb, KIND=_KINDS[kind], HAS_RES=residual is not None,
                BLOCK=block, **_OPTIONS,
            )  # fmt: skip

    def pack_quantize(
        self, tensors: Sequence[torch.Tensor | None], layout: Layout, scale: float, block: int, kind: str,
        wire: torch.Tensor, residual: torch.Tensor | None,
    ) -> None:  # fmt: skip
        device = wire.device
        s, world_size = layout.shard_numel, layout.world_size
        nb = nblocks(s, block)
        runs = _tables.pack_runs(layout, device, None)  # unsplit: a program walks the runs its block overlaps
        if nb == 0 or runs.shape[0] == 0:
            return
        ptrs, codes = _pointer_tables.get(tensors, device)
        dtypes = {t.dtype for t in tensors if t is not None}
        src_code = _CODES[dtypes.pop()] if len(dtypes) == 1 else (0 if not dtypes else _MIXED)
        wire = wire[: world_size * segment_bytes(s, block)]
        with _on_device(device):
            _pack_quantize_kernel[(world_size * nb,)](
                runs, runs.shape[0], ptrs, codes, residual if residual is not None else wire.view(torch.float32),
                wire.view(torch.int8), wire.view(torch.float32), s, segment_bytes(s, block), round16(s), nb,
                float(scale), SRC_CODE=src_code, KIND=_KINDS[kind], HAS_RES=residual is not None, BLOCK=block,
                **_OPTIONS,
            )  # fmt: skip

    def dequantize_sum(
        self, wire: torch.Tensor, world_size: int, block: int, kind: str, out: torch.Tensor, scale: float,
        accumulate: bool, stats: bool = False,
    ) -> torch.Tensor | None:  # fmt: skip
        s = out.numel()
        programs = nblocks(s, block)
        sum_sq, nonfinite = _partials(programs, stats, out.device)
        wire = wire[: world_size * segment_bytes(s, block)]
        if programs:
            with _on_device(out.device):
                _dequantize_sum_kernel[(programs,)](
                    wire.view(torch.int8), wire.view(torch.float32), out, s, segment_bytes(s, block), round16(s),
                    world_size, scale, sum_sq, nonfinite, KIND=_KINDS[kind], ACCUMULATE=accumulate, STATS=stats,
                    BLOCK=block, **_OPTIONS,
                )  # fmt: skip
        return _reduce(sum_sq, nonfinite, programs, stats)

    def requantize(
        self, wire_in: torch.Tensor, sources: int, block: int, kind: str, wire_out: torch.Tensor, segments: int,
        shard_numel: int, residual: torch.Tensor | None,
    ) -> None:  # fmt: skip
        s, part = shard_numel, segments * shard_numel
        nb = nblocks(s, block)
        if nb == 0:
            return
        wire_in = wire_in[: sources * segment_bytes(part, block)]
        wire_out = wire_out[: segments * segment_bytes(s, block)]
        with _on_device(wire_out.device):
            _requantize_kernel[(segments * nb,)](
                wire_in.view(torch.int8), wire_in.view(torch.float32),
                residual if residual is not None else wire_out.view(torch.float32), wire_out.view(torch.int8),
                wire_out.view(torch.float32), sources, segment_bytes(part, block), round16(part), s,
                segment_bytes(s, block), round16(s), nb, KIND=_KINDS[kind], HAS_RES=residual is not None, BLOCK=block,
                **_OPTIONS,
            )  # fmt: skip


def _flags(accumulate: bool, stats: bool) -> str:
    return "".join(f",{flag}" for flag, on in (("accumulate", accumulate), ("stats", stats)) if on)


def _launch_sizes(block: int) -> dict[str, dict[str, dict[str, int]]]:
    """Integer arguments of representative launches, per kernel: what the launchers pass for a
    typical bucket (sizes that fit in i32, some multiples of 16) and for one rank with one block
    and one run (the values Triton turns into constants)."""
    sizes = {}
    for label, s, world_size, runs in (("i32", 1000, 4, 7), ("ones", block, 1, 1)):
        seg, nb = segment_bytes(s, block), nblocks(s, block)
        sizes[label] = {
            "_sum_kernel": {"shard_numel": s, "world_size": world_size},
            "_quantize_kernel": {"shard_numel": s, "seg": seg, "scales_at": round16(s), "nblocks": nb},
            "_pack_quantize_kernel": {
                "num_runs": runs, "shard_numel": s, "seg": seg, "scales_at": round16(s), "nblocks": nb,
            },  # fmt: skip
            "_dequantize_sum_kernel": {
                "shard_numel": s, "seg": seg, "scales_at": round16(s), "world_size": world_size,
            },  # fmt: skip
            "_requantize_kernel": {  # world_size sources of world_size * s elements, into world_size segments
                "sources": world_size, "in_seg": segment_bytes(world_size * s, block),
                "in_scales_at": round16(world_size * s), "shard_numel": s, "seg": seg, "scales_at": round16(s),
                "nblocks": nb,
            },  # fmt: skip
        }
    return sizes


def kernel_specs(block: int = 256) -> list:
    """Every (kernel, specialisation) the launchers use, at quantization ``block``, for ``.ci/triton_compile.py``.

    Each kernel comes with its sizes declared i64 (what launches once a size passes 2^31), then
    as launched with i32 sizes for every dtype combination (``[...|i32]``), and with the sizes
    Triton makes constants (``[...|ones]``, bf16 only where a kernel has dtype variants); see
    ``KernelSpec.launch``.
    """
    declared = _declared_specs(block)
    sizes = _launch_sizes(block)
    launched = []
    for spec in declared:
        kernel = spec.fn.__name__
        for label, by_kernel in sizes.items():
            dtyped = any(dtype in spec.name for dtype in ("fp32", "bf16", "fp16", "mixed"))
            if label == "ones" and dtyped and "bf16" not in spec.name:
                continue
            launched.append(spec._replace(name=f"{spec.name[:-1]}|{label}]", launch=by_kernel[kernel]))
    return declared + launched


def _declared_specs(block: int) -> list:
    from .triton_backend import KernelSpec

    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    specs = []
    for src in short.values():
        for out in short.values():
            for accumulate, stats in ((False, False), (True, False), (False, True), (True, True)):
                signature = {
                    "src_ptr": f"*{src}", "out_ptr": f"*{out}", "shard_numel": "i64", "world_size": "i32",
                    "scale": "fp32", "sum_sq_ptr": "*fp32", "nonfinite_ptr": "*i32", "ACCUMULATE": "constexpr",
                    "STATS": "constexpr", "BLOCK": "constexpr",
                }  # fmt: skip
                constexprs = {"ACCUMULATE": accumulate, "STATS": stats, "BLOCK": _SUM_BLOCK}
                name = f"_sum_kernel[{src}->{out}{_flags(accumulate, stats)}]"
                specs.append(KernelSpec(name, _sum_kernel, signature, constexprs, dict(_OPTIONS)))
    for kind, code in _KINDS.items():
        for src in short.values():
            for has_res in (False, True):
                signature = {
                    "src_ptr": f"*{src}", "res_ptr": "*fp32" if has_res else f"*{src}", "values_ptr": "*i8",
                    "scales_ptr": "*fp32", "shard_numel": "i64", "seg": "i64", "scales_at": "i64", "nblocks": "i64",
                    "KIND": "constexpr", "HAS_RES": "constexpr", "BLOCK": "constexpr",
                }  # fmt: skip
                constexprs = {"KIND": code, "HAS_RES": has_res, "BLOCK": block}
                name = f"_quantize_kernel[{src}->{kind}{',residual' if has_res else ''}]"
                specs.append(KernelSpec(name, _quantize_kernel, signature, constexprs, dict(_OPTIONS)))
        for src_code, src in ((0, "fp32"), (1, "bf16"), (2, "fp16"), (_MIXED, "mixed")):
            for has_res in (False, True):
                signature = {
                    "runs_ptr": "*i64", "num_runs": "i64", "src_ptrs_ptr": "*i64", "src_codes_ptr": "*i32",
                    "res_ptr": "*fp32", "values_ptr": "*i8", "scales_ptr": "*fp32", "shard_numel": "i64",
                    "seg": "i64", "scales_at": "i64", "nblocks": "i64", "scale": "fp32", "SRC_CODE": "constexpr",
                    "KIND": "constexpr", "HAS_RES": "constexpr", "BLOCK": "constexpr",
                }  # fmt: skip
                constexprs = {"SRC_CODE": src_code, "KIND": code, "HAS_RES": has_res, "BLOCK": block}
                name = f"_pack_quantize_kernel[{src}->{kind}{',residual' if has_res else ''}]"
                specs.append(KernelSpec(name, _pack_quantize_kernel, signature, constexprs, dict(_OPTIONS)))
        for out in short.values():
            for accumulate, stats in ((False, False), (True, False), (False, True), (True, True)):
                signature = {
                    "values_ptr": "*i8", "scales_ptr": "*fp32", "out_ptr": f"*{out}", "shard_numel": "i64",
                    "seg": "i64", "scales_at": "i64", "world_size": "i32", "scale": "fp32", "sum_sq_ptr": "*fp32",
                    "nonfinite_ptr": "*i32", "KIND": "constexpr", "ACCUMULATE": "constexpr", "STATS": "constexpr",
                    "BLOCK": "constexpr",
                }  # fmt: skip
                constexprs = {"KIND": code, "ACCUMULATE": accumulate, "STATS": stats, "BLOCK": block}
                name = f"_dequantize_sum_kernel[{kind}->{out}{_flags(accumulate, stats)}]"
                specs.append(KernelSpec(name, _dequantize_sum_kernel, signature, constexprs, dict(_OPTIONS)))
        for has_res in (False, True):
            signature = {
                "in_values_ptr": "*i8", "in_scales_ptr": "*fp32", "res_ptr": "*fp32", "values_ptr": "*i8",
                "scales_ptr": "*fp32", "sources": "i32", "in_seg": "i64", "in_scales_at": "i64", "shard_numel": "i64",
                "seg": "i64", "scales_at": "i64", "nblocks": "i64", "KIND": "constexpr", "HAS_RES": "constexpr",
                "BLOCK": "constexpr",
            }  # fmt: skip
            constexprs = {"KIND": code, "HAS_RES": has_res, "BLOCK": block}
            name = f"_requantize_kernel[{kind}{',residual' if has_res else ''}]"
            specs.append(KernelSpec(name, _requantize_kernel, signature, constexprs, dict(_OPTIONS)))
    return specs
