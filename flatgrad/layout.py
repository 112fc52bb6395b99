"""Rank-aligned padded flat layouts and the copy-run tables derived from them.

A layout maps a list of tensors (given by their numels) onto one flat buffer of
``world_size * shard_numel`` elements, where rank ``r`` owns the contiguous
segment ``[r * shard_numel, (r + 1) * shard_numel)``. Two layouts exist:

* ``flat``: the tensors are concatenated and the whole is zero-padded to a
  multiple of ``world_size * align``. A tensor may straddle ranks. This is the
  flat partition DeepSpeed ZeRO-1/2 gives every rank of a param group.
* ``chunked``: every tensor is split into ``world_size`` chunks of
  ``ceil(numel / world_size)`` elements (rounded up to ``align``), zero-padded;
  segment ``r`` is the concatenation of every tensor's chunk ``r``. With
  ``align=1`` this is ``torch._chunk_cat(..., num_chunks=world_size)`` and
  DeepSpeed ZeRO-3's per-parameter partitioning.

Kernels never walk a layout: they read its run tables (``pack_runs``,
``unpack_runs``), derived once and cached, so that one run is one unit of
parallel work. See [Note: run tables] in docs/design.md.

A two-stage reduction needs every rank's segment where its two splits leave
it; ``reordered`` moves the pack's runs there once, at plan time, so the
kernels are unchanged. See [Note: segment order] in docs/design.md.

This module knows nothing of torch.distributed, DeepSpeed or kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import NamedTuple, Sequence

import torch

__all__ = ["Layout", "Piece", "PACK_RUN_FIELDS", "UNPACK_RUN_FIELDS", "split_numels"]

PACK_RUN_FIELDS = ("dst_offset", "tensor_index", "src_offset", "length", "valid")
UNPACK_RUN_FIELDS = ("src_offset", "out_index", "out_offset", "length")

_KINDS = ("flat", "chunked")


class Piece(NamedTuple):
    """One contiguous piece of a tensor that lies in one rank's shard."""

    tensor_index: int
    tensor_offset: int
    shard_offset: int
    length: int


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


@dataclasses.dataclass(frozen=True)
class Layout:
    """A static, rank-aligned layout of ``len(numels)`` tensors over ``world_size`` ranks.

    Attributes:
        kind: ``"flat"`` or ``"chunked"``.
        numels: element count of every tensor, in buffer order.
        world_size: number of ranks (segments) in the buffer.
        align: alignment in elements (see ``flat`` and ``chunked``).
        shard_numel: ``S``, the elements every rank owns (padding included).
        offsets: flat: where each tensor starts in the buffer; chunked: where
            each tensor's chunk starts inside every segment.
        chunk_numels: chunked only: each tensor's chunk size (padding included);
            for flat layouts, empty.
        positions: where each rank's segment lies in the buffer, in segments (empty: rank ``r``'s
            at ``r``). Only the pack's buffer is reordered; a shard is the same. See
            [Note: segment order].
    """

    kind: str
    numels: tuple[int, ...]
    world_size: int
    align: int
    shard_numel: int
    offsets: tuple[int, ...]
    chunk_numels: tuple[int, ...]
    positions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.positions and sorted(self.positions) != list(range(self.world_size)):
            raise ValueError(f"positions must be a permutation of range({self.world_size}), got {self.positions}")
        # Tables are cached per layout on every call; hash the (possibly long) numels once.
        object.__setattr__(self, "_hash", hash((self.kind, self.numels, self.world_size, self.align, self.positions)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @staticmethod
    def _validate(numels: Sequence[int], world_size: int, align: int) -> tuple[tuple[int, ...], int, int]:
        world_size = _check_int("world_size", world_size, 1)
        align = _check_int("align", align, 1)
        if isinstance(numels, (str, bytes)) or not isinstance(numels, Sequence):
            raise ValueError(f"numels must be a sequence of ints, got {type(numels).__name__}")
        checked = tuple(_check_int(f"numels[{i}]", n, 0) for i, n in enumerate(numels))
        return checked, world_size, align

    @classmethod
    def flat(cls, numels: Sequence[int], world_size: int, align: int = 1) -> "Layout":
        """Concatenate, then zero-pad the total to a multiple of ``world_size * align``."""
        numels, world_size, align = cls._validate(numels, world_size, align)
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += n
        padded = _round_up(total, world_size * align)
        return cls("flat", numels, world_size, align, padded // world_size, tuple(offsets), ())

    @classmethod
    def chunked(cls, numels: Sequence[int], world_size: int, align: int = 1) -> "Layout":
        """Split every tensor into ``world_size`` chunks of ``ceil(n / W)`` (rounded up to ``align``)."""
        numels, world_size, align = cls._validate(numels, world_size, align)
        chunks = tuple(_round_up(_ceil_div(n, world_size), align) for n in numels)
        offsets, total = [], 0
        for c in chunks:
            offsets.append(total)
            total += c
        return cls("chunked", numels, world_size, align, total, tuple(offsets), chunks)

    @classmethod
    def make(cls, kind: str, numels: Sequence[int], world_size: int, align: int = 1) -> "Layout":
        """Build a layout by kind name (``"flat"`` or ``"chunked"``)."""
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        return getattr(cls, kind)(numels, world_size, align)

    def reordered(self, positions: Sequence[int]) -> "Layout":
        """This layout with rank ``r``'s segment at position ``positions[r]`` of the buffer. See [Note: segment order]."""
        positions = tuple(_check_int(f"positions[{r}]", p, 0) for r, p in enumerate(positions))
        if len(positions) != self.world_size:
            raise ValueError(f"positions must have one entry per rank ({self.world_size}), got {len(positions)}")
        if positions == tuple(range(self.world_size)):
            positions = ()
        return dataclasses.replace(self, positions=positions)

    def position(self, rank: int) -> int:
        """Where ``rank``'s segment lies in the buffer, in segments."""
        return self.positions[rank] if self.positions else rank

    @property
    def numel(self) -> int:
        """Elements in the whole buffer: ``world_size * shard_numel``."""
        return self.world_size * self.shard_numel

    @property
    def numel_unpadded(self) -> int:
        """Elements of real data: the sum of ``numels``."""
        return sum(self.numels)

    @property
    def num_tensors(self) -> int:
        return len(self.numels)

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty pieces of real data in ``rank``'s shard, in shard order."""
        return list(self._pieces(self._check_rank(rank)))

    @functools.lru_cache(maxsize=4096)
    def _pieces(self, rank: int) -> tuple[Piece, ...]:
        out = []
        if self.kind == "flat":
            lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
            for i, (start, n) in enumerate(zip(self.offsets, self.numels)):
                a, b = max(lo, start), min(hi, start + n)
                if a < b:
                    out.append(Piece(i, a - start, a - lo, b - a))
        else:
            for i, (col, c, n) in enumerate(zip(self.offsets, self.chunk_numels, self.numels)):
                begin = rank * c
                length = min(c, n - begin)
                if length > 0:
                    out.append(Piece(i, begin, col, length))
        return tuple(out)

    def owner_ranges(self, tensor_index: int) -> list[tuple[int, int, int]]:
        """``(rank, tensor_offset, length)`` for every rank holding part of a tensor."""
        return [
            (r, p.tensor_offset, p.length)
            for r in range(self.world_size)
            for p in self._pieces(r)
            if p.tensor_index == tensor_index
        ]

    @functools.lru_cache(maxsize=256)
    def pack_runs(self, max_len: int | None = None) -> torch.Tensor:
        """The pack run table, int64 ``[R, 5]`` on CPU. See [Note: run tables]."""
        if self.kind == "flat":
            rows = [(o, i, 0, n, n) for i, (o, n) in enumerate(zip(self.offsets, self.numels)) if n > 0]
            total = self.numel_unpadded
            if self.numel > total:
                rows.append((total, -1, 0, self.numel - total, 0))
            table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)
        else:
            w = self.world_size
            n = torch.tensor(self.numels, dtype=torch.int64)
            c = torch.tensor(self.chunk_numels, dtype=torch.int64)
            col = torch.tensor(self.offsets, dtype=torch.int64)
            r = torch.arange(w, dtype=torch.int64).unsqueeze(1)  # [W, 1] against [T]
            src = r * c
            table = torch.stack(
                [
                    r * self.shard_numel + col,
                    torch.arange(len(self.numels), dtype=torch.int64).expand(w, -1),
                    src,
                    c.expand(w, -1),
                    (n - src).clamp(min=0).minimum(c),
                ],
                dim=-1,
            ).reshape(-1, 5)
            table = table[table[:, 3] > 0]
            padding = table[:, 4] == 0  # all-padding chunks read nothing
            table[padding, 1] = -1
            table[padding, 2] = 0
        if self.positions:
            table = self._reorder_runs(table)
        return _split_runs(table, max_len, length_col=3, valid_col=4, offset_cols=(0, 2))

    def _reorder_runs(self, table: torch.Tensor) -> torch.Tensor:
        """Pack runs cut at segment boundaries and moved to their segments' positions, in buffer order."""
        s = self.shard_numel
        rows = []
        for dst, t, src, length, valid in table.tolist():
            while length > 0:
                segment, offset = divmod(dst, s)
                n = min(length, s - offset)
                v = min(valid, n)
                rows.append((self.positions[segment] * s + offset, t if v else -1, src if v else 0, n, v))
                dst, src, length, valid = dst + n, src + n, length - n, valid - v
        rows.sort()
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 5)

    def unpack_runs(self, rank: int, max_len: int | None = None, *, per_piece: bool = True) -> torch.Tensor:
        """The unpack run table of ``rank``, int64 ``[R, 4]`` on CPU. See [Note: run tables].

        ``per_piece=True`` targets one output tensor per ``pieces(rank)`` entry;
        ``per_piece=False`` targets one 1-D output of ``shard_numel`` elements.
        """
        return self._unpack_runs(self._check_rank(rank), max_len, per_piece)

    @functools.lru_cache(maxsize=1024)
    def _unpack_runs(self, rank: int, max_len: int | None, per_piece: bool) -> torch.Tensor:
        if per_piece:
            rows = [(p.shard_offset, k, 0, p.length) for k, p in enumerate(self._pieces(rank))]
        else:
            rows = [(0, 0, 0, self.shard_numel)] if self.shard_numel else []
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        return _split_runs(table, max_len, length_col=3, valid_col=None, offset_cols=(0, 2))

    def digest(self) -> str:
        """A short hash of everything that defines the layout, for cross-rank agreement."""
        text = f"{self.kind}|{self.world_size}|{self.align}|{','.join(map(str, self.numels))}"
        if self.positions:
            text += f"|{','.join(map(str, self.positions))}"
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def split_numels(numels: Sequence[int], bucket_numel: int) -> list[tuple[int, int]]:
    """Cut a sequence of tensors into buckets of about ``bucket_numel`` elements; ``(start, stop)`` index ranges.

    A bucket closes before a tensor that would overflow it, but only once it is
    at least half full: a small tensor (a bias) ahead of a large one joins it
    rather than becoming a collective of its own. So every bucket but the last
    holds at least ``bucket_numel / 2`` elements, and a bucket over
    ``bucket_numel`` is one large tensor plus less than half a bucket.
    """
    bucket_numel = _check_int("bucket_numel", bucket_numel, 1)
    ranges: list[tuple[int, int]] = []
    start, numel = 0, 0
    for i, n in enumerate(numels):
        n = _check_int(f"numels[{i}]", n, 0)
        if i > start and numel + n > bucket_numel and 2 * numel >= bucket_numel:
            ranges.append((start, i))
            start, numel = i, 0
        numel += n
    if len(numels) > start:
        ranges.append((start, len(numels)))
    return ranges


def _split_runs(
    table: torch.Tensor, max_len: int | None, *, length_col: int, valid_col: int | None, offset_cols: tuple[int, ...]
) -> torch.Tensor:
    """Split every run longer than ``max_len`` into consecutive runs of at most ``max_len``."""
    if max_len is None or table.shape[0] == 0:
        return table.contiguous()
    max_len = _check_int("max_len", max_len, 1)
    length = table[:, length_col]
    count = (length + max_len - 1) // max_len
    row = torch.repeat_interleave(torch.arange(table.shape[0]), count)
    # Position of each split run inside its parent run.
    first = torch.cumsum(count, 0) - count
    start = (torch.arange(row.numel()) - first[row]) * max_len
    out = table[row].clone()
    for col in offset_cols:
        out[:, col] += start
    out[:, length_col] = (length[row] - start).clamp(max=max_len)
    if valid_col is not None:
        out[:, valid_col] = (table[row, valid_col] - start).clamp(min=0, max=max_len).minimum(out[:, length_col])
    return out.contiguous()
