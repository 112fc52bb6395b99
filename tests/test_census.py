"""flatgrad.testing.census: the counting CPU allocator lives in its own extension and counts what a block holds."""

from __future__ import annotations

import pytest
import torch

from flatgrad.kernels import compiled
from flatgrad.testing.census import MemoryCensus, cpu_memory_available


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


def test_the_kernel_extension_carries_no_counting_allocator():
    if compiled.devices("cpu")[1]:
        pytest.skip(compiled.devices("cpu")[1])
    assert not hasattr(torch.ops.flatgrad, "cpu_memory_install")


def test_a_missing_census_extension_is_named():
    message = compiled.missing_extension("flatgrad._census", ImportError("no module"))
    assert "flatgrad._census" in message and "flatgrad._C" not in message
