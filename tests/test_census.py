"""flatgrad.testing.census: the counting CPU allocator lives in its own extension and counts what a block holds."""

from __future__ import annotations

import pytest
import torch

from flatgrad.kernels import compiled
from flatgrad.testing.census import MemoryCensus, cpu_memory_available, describe


@pytest.mark.skipif(bool(cpu_memory_available()), reason=cpu_memory_available() or "census available")
def test_the_census_counts_a_tensor_while_it_lives_and_its_peak():
    with MemoryCensus("cpu") as census:
        held = torch.empty(1 << 20, dtype=torch.uint8)
        census.mark("held")
        del held
        census.mark("freed")
    assert census.at("held") == 1 << 20
    assert census.at("freed") == 0
    assert census.peak >= 1 << 20


@pytest.mark.skipif(bool(cpu_memory_available()), reason=cpu_memory_available() or "census available")
def test_blocks_born_between_marks_are_listed_and_named_by_their_tensors():
    """What is live, not only how much: the blocks born between two marks, each named by the tensor holding it."""
    with MemoryCensus("cpu") as census:
        kept = torch.empty(1000, dtype=torch.float32)
        census.mark("start", blocks=True)
        held, gone = torch.empty(7, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.uint8)
        del gone
        census.mark("end", blocks=True)
        born = census.born("end", "start")
        named = describe(born)
    assert list(born.values()) == [14], born
    assert named == ["14 B: (7,) bfloat16"], named
    assert kept.untyped_storage().data_ptr() in census.blocks["start"] and held.numel() == 7
    with pytest.raises(ValueError, match="counting CPU allocator"):
        MemoryCensus("cuda").mark("x", blocks=True)


def test_the_kernel_extension_carries_no_counting_allocator():
    if compiled.devices("cpu")[1]:
        pytest.skip(compiled.devices("cpu")[1])
    assert not hasattr(torch.ops.flatgrad, "cpu_memory_install")


def test_a_missing_census_extension_is_named():
    message = compiled.missing_extension("flatgrad._census", ImportError("no module"))
    assert "flatgrad._census" in message and "flatgrad._C" not in message


def _late_frees_rank(rank: int, world_size: int) -> list[int]:
    """200 gloo all_reduces of a 7-element fp32 tensor, each released right after the call: the live bytes after
    ``settle`` each time, relative to before the tensor was made."""
    import torch.distributed as dist

    after = []
    with MemoryCensus("cpu") as census:
        for _ in range(200):
            base = census.now()[0]
            t = torch.ones(7)
            dist.all_reduce(t)
            del t
            after.append(census.settle() - base)
    return after


@pytest.mark.timeout(120)
@pytest.mark.skipif(bool(cpu_memory_available()), reason=cpu_memory_available() or "census available")
def test_settle_waits_until_gloo_has_freed_a_finished_collectives_tensors():
    """gloo's worker thread drops a finished collective's tensors shortly after the call returns; ``settle`` waits
    for that, so a mark after it counts what the program holds: every tensor released is freed by then."""
    from flatgrad.testing.launch import run_ranks

    for after in run_ranks(_late_frees_rank, 2, timeout=100):
        assert after == [0] * 200, [a for a in after if a]
