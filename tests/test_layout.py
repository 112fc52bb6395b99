"""Layouts: pieces, padding, run tables, and agreement with torch._chunk_cat and DeepSpeed's partitions."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatgrad import Layout, Piece
from flatgrad.layout import split_numels

NUMEL = st.one_of(st.integers(0, 3), st.sampled_from([5, 7, 13, 31, 97, 1009]), st.integers(0, 3000))
CASES = dict(
    numels=st.lists(NUMEL, min_size=0, max_size=40),
    world_size=st.integers(1, 16),
    align=st.integers(1, 8),
    kind=st.sampled_from(["flat", "chunked"]),
)


def _coverage(layout: Layout) -> torch.Tensor:
    """For every buffer element: the global index of the tensor element it holds, or -1 for padding."""
    starts = [0]
    for n in layout.numels:
        starts.append(starts[-1] + n)
    cover = torch.full((layout.numel,), -1, dtype=torch.int64)
    for rank in range(layout.world_size):
        for p in layout.pieces(rank):
            begin = rank * layout.shard_numel + p.shard_offset
            src = starts[p.tensor_index] + p.tensor_offset
            assert (cover[begin : begin + p.length] == -1).all(), "two pieces overlap"
            cover[begin : begin + p.length] = torch.arange(src, src + p.length)
    return cover


@settings(max_examples=150, deadline=None)
@given(**CASES)
def test_pieces_cover_every_element_once(numels, world_size, align, kind):
    layout = Layout.make(kind, numels, world_size, align)
    assert layout.numel == world_size * layout.shard_numel
    assert layout.shard_numel % align == 0
    cover = _coverage(layout)
    real = cover[cover >= 0]
    assert sorted(real.tolist()) == list(range(sum(numels)))
    assert layout.numel - real.numel() == layout.numel - layout.numel_unpadded


@settings(max_examples=150, deadline=None)
@given(**CASES, max_len=st.one_of(st.none(), st.integers(1, 64)))
def test_pack_runs_match_pieces(numels, world_size, align, kind, max_len):
    """The run table writes exactly what the pieces say, tiles the buffer once, and respects max_len."""
    layout = Layout.make(kind, numels, world_size, align)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    runs = layout.pack_runs(max_len)
    assert runs.dtype == torch.int64 and runs.shape[1] == 5
    cover = torch.full((layout.numel,), -2, dtype=torch.int64)
    for dst, ti, src, length, valid in runs.tolist():
        assert length > 0 and 0 <= valid <= length
        if max_len is not None:
            assert length <= max_len
        assert (cover[dst : dst + length] == -2).all()
        if valid:
            assert 0 <= ti < len(numels) and src + valid <= numels[ti]
            cover[dst : dst + valid] = torch.arange(starts[ti] + src, starts[ti] + src + valid)
        cover[dst + valid : dst + length] = -1
    assert (cover != -2).all(), "runs leave part of the buffer unwritten"
    assert torch.equal(cover, _coverage(layout))
    assert (runs[:-1, 0] < runs[1:, 0]).all() if runs.shape[0] > 1 else True  # sorted by destination


@settings(max_examples=100, deadline=None)
@given(**CASES, per_piece=st.booleans(), max_len=st.one_of(st.none(), st.integers(1, 64)))
def test_unpack_runs_match_pieces(numels, world_size, align, kind, per_piece, max_len):
    layout = Layout.make(kind, numels, world_size, align)
    for rank in range(layout.world_size):
        pieces = layout.pieces(rank)
        runs = layout.unpack_runs(rank, max_len, per_piece=per_piece)
        got: dict[int, list[tuple[int, int, int]]] = {}
        for src, k, off, length in runs.tolist():
            if max_len is not None:
                assert length <= max_len
            got.setdefault(k, []).append((src, off, length))
        if per_piece:
            assert sorted(got) == list(range(len(pieces)))
            for k, p in enumerate(pieces):
                segs = got[k]
                assert sum(s[2] for s in segs) == p.length
                for src, off, length in segs:
                    assert src - p.shard_offset == off and off + length <= p.length
        else:
            total = sum(s[2] for s in got.get(0, []))
            assert total == layout.shard_numel and set(got) <= {0}


@settings(max_examples=100, deadline=None)
@given(
    numels=st.lists(st.integers(1, 500), min_size=1, max_size=20),
    world_size=st.integers(1, 16),
)
def test_chunked_equals_torch_chunk_cat(numels, world_size):
    """With align=1 the chunked layout is torch._chunk_cat(..., num_chunks=W) flattened."""
    layout = Layout.chunked(numels, world_size)
    tensors = [torch.arange(1, n + 1, dtype=torch.float32) + 1000 * i for i, n in enumerate(numels)]
    expected = torch._chunk_cat(tensors, dim=0, num_chunks=world_size).reshape(-1)
    buffer = torch.zeros(layout.numel)
    cover = _coverage(layout)
    flat = torch.cat(tensors)
    buffer[cover >= 0] = flat[cover[cover >= 0]]
    assert torch.equal(buffer, expected)


@settings(max_examples=100, deadline=None)
@given(numels=st.lists(st.integers(0, 5000), min_size=0, max_size=20), world_size=st.integers(1, 16))
def test_chunked_matches_deepspeed_zero3_partitions(numels, world_size):
    """ZeRO-3 gives rank r elements [r*ceil(n/W), (r+1)*ceil(n/W)) of every parameter, padded."""
    layout = Layout.chunked(numels, world_size)
    for i, n in enumerate(numels):
        partition = math.ceil(n / world_size)
        assert layout.chunk_numels[i] == partition
        for rank in range(world_size):
            start = min(rank * partition, n)
            length = min(partition, n - start)
            mine = [p for p in layout.pieces(rank) if p.tensor_index == i]
            if length > 0:
                assert mine == [Piece(i, start, layout.offsets[i], length)]
            else:
                assert mine == []


@settings(max_examples=100, deadline=None)
@given(
    numels=st.lists(st.integers(0, 5000), min_size=0, max_size=20),
    world_size=st.integers(1, 16),
    alignment_factor=st.sampled_from([1, 2, 4]),
)
def test_flat_matches_deepspeed_zero12_partitions(numels, world_size, alignment_factor):
    """ZeRO-1/2 pad a flat group to a multiple of alignment_factor * W and give each rank an equal slice."""
    layout = Layout.flat(numels, world_size, align=alignment_factor)
    total = sum(numels)
    alignment = alignment_factor * world_size
    padded = total + (alignment - total % alignment) % alignment  # DeepSpeed's align_dense_tensors
    assert layout.numel == padded
    partition_size = padded // world_size
    assert layout.shard_numel == partition_size
    offset = 0
    for i, n in enumerate(numels):
        for rank in range(world_size):
            lo, hi = rank * partition_size, (rank + 1) * partition_size
            a, b = max(lo, offset), min(hi, offset + n)
            mine = [p for p in layout.pieces(rank) if p.tensor_index == i]
            assert mine == ([Piece(i, a - offset, a - lo, b - a)] if a < b else [])
        offset += n


def test_owner_ranges_and_digest():
    layout = Layout.flat([5, 3], 2)
    assert layout.owner_ranges(0) == [(0, 0, 4), (1, 4, 1)]
    assert layout.owner_ranges(1) == [(1, 0, 3)]
    assert layout.digest() == Layout.flat([5, 3], 2).digest()
    assert layout.digest() != Layout.flat([5, 3], 4).digest()
    assert layout.digest() != Layout.chunked([5, 3], 2).digest()
    assert layout.numel_unpadded == 8 and layout.numel == 8


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(numels=[1], world_size=0), "world_size"),
        (dict(numels=[1], world_size=2.0), "world_size"),
        (dict(numels=[1], world_size=True), "world_size"),
        (dict(numels=[1, -3], world_size=2), r"numels\[1\]"),
        (dict(numels=[1, 2.5], world_size=2), r"numels\[1\]"),
        (dict(numels=[1], world_size=2, align=0), "align"),
        (dict(numels="abc", world_size=2), "numels"),
    ],
)
@pytest.mark.parametrize("kind", ["flat", "chunked"])
def test_bad_arguments_name_the_argument(kind, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Layout.make(kind, **kwargs)


def test_bad_rank_and_kind():
    layout = Layout.flat([4], 2)
    for rank in (-1, 2, 1.0):
        with pytest.raises(ValueError, match="rank"):
            layout.pieces(rank)
    with pytest.raises(ValueError, match="kind"):
        Layout.make("ring", [1], 2)


def test_layout_is_frozen_and_hashable():
    layout = Layout.chunked([3, 4], 2)
    with pytest.raises(Exception):
        layout.world_size = 3  # type: ignore[misc]
    assert {layout: 1}[Layout.chunked([3, 4], 2)] == 1
    assert layout.pack_runs(4) is layout.pack_runs(4), "run tables are derived once"


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 100), max_size=30), bucket_numel=st.integers(1, 150))
def test_split_numels_buckets(numels, bucket_numel):
    ranges = split_numels(numels, bucket_numel)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(len(numels)))
    assert all(a < b for a, b in ranges)
    sizes = [sum(numels[a:b]) for a, b in ranges]
    for (a, b), size in zip(ranges, sizes):  # over the target only by one tensor after less than half a bucket
        assert size <= bucket_numel or 2 * (size - numels[b - 1]) < bucket_numel
    for k in range(len(ranges) - 1):  # a bucket closes only when at least half full and the next tensor overflows it
        assert 2 * sizes[k] >= bucket_numel and sizes[k] + numels[ranges[k + 1][0]] > bucket_numel


def test_split_numels_keeps_a_bias_with_its_weight():
    # backward order of Linear(1000, 1000) x 2: bias, weight, bias, weight
    assert split_numels([1000, 10**6, 1000, 10**6], 10**6) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="bucket_numel"):
        split_numels([1], 0)
