"""The mode registry (flatgrad/reducer/registry.py) is the one list of modes: everything that names modes agrees.

A mode served but not priced, priced but not served, accepted by one config and not the other, or missing from
the docs' table fails here.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from flatgrad.integrations.deepspeed.config import FlatgradConfig, UnsupportedConfigError
from flatgrad.planner import cost
from flatgrad.reducer import REDUCTIONS, TWO_STAGE_REDUCTIONS, ReducerConfig, registry
from flatgrad.reducer.topology import place_ranks

_ROOT = pathlib.Path(__file__).resolve().parent.parent
_TABLE = re.compile(r"<!-- modes table[^\n]*-->\n(.*?)<!-- /modes table -->", re.S)


def _table() -> str:
    """The docs' table of modes, as the registry says it."""
    rows = [
        "| mode | class | stages (node, rail) | wire | ZeRO stages | what moves |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in registry.MODES:
        stages = ", ".join(f"{s.collective} ({s.payload})" for s in m.stages)
        zero = ", ".join(str(z) for z in sorted(m.zero_stages))
        rows.append(f"| `{m.name}` | `{m.cls.__name__}` | {stages} | {m.kind or '-'} | {zero} | {m.summary} |")
    return "\n".join(rows) + "\n"


def test_docs_table_of_modes_is_the_registry():
    text = (_ROOT / "docs" / "design.md").read_text()
    found = _TABLE.search(text)
    assert found, "docs/design.md has no '<!-- modes table -->' block"
    assert found.group(1) == _table(), (
        "docs/design.md's table of modes differs from the registry; it should read:\n" + _table()
    )


def test_every_list_of_modes_derives_from_the_registry():
    names = tuple(m.name for m in registry.MODES)
    assert len(set(names)) == len(names)
    assert REDUCTIONS == names == cost.MODES
    assert TWO_STAGE_REDUCTIONS == cost.HIERARCHICAL_MODES == tuple(m.name for m in registry.MODES if m.two_stage)
    assert cost.FLAT_MODES == tuple(m.name for m in registry.MODES if not m.two_stage)
    deepspeed_doc = (_ROOT / "docs" / "deepspeed.md").read_text()
    row = next(line for line in deepspeed_doc.splitlines() if line.startswith("| `reduction` |"))
    assert re.findall(r"`([a-z0-9_]+)`", row.split("|")[3]) == list(names), row


@pytest.mark.parametrize("name", registry.names())
def test_every_served_mode_is_priced_and_every_priced_mode_served(name):
    m = registry.entry(name)
    # Served: ReducerConfig and the DeepSpeed section take it, and the registry builds its class.
    ReducerConfig(reduction=name)
    assert FlatgradConfig.from_dict({"reduction": name}).reduction == name
    topology = place_ranks(4, list(range(16)), 16, 5)  # 4 nodes of 4
    mode = registry.build_mode(name, 16, topology=topology)
    assert type(mode) is m.cls and mode.name == name
    # Priced: the planner gives each of its stages a call, over the node and the rail.
    calls = cost.reduction_calls(name, 16 * 1024, torch.bfloat16, range(16), rank=5, gpus_per_node=4)
    assert len(calls) == len(m.stages)
    assert [c.op for c in calls] == [s.collective for s in m.stages]
    if m.two_stage:
        assert [tuple(c.group) for c in calls] == [(4, 5, 6, 7), (1, 5, 9, 13)]
    assert all((c.dtype == torch.uint8) == (s.payload == "wire") for c, s in zip(calls, m.stages))


@pytest.mark.parametrize("name", registry.names(two_stage=True))
def test_a_two_stage_mode_with_one_stage_left_is_the_flat_mode_of_that_stage(name):
    m = registry.entry(name)
    for node_size, left in ((8, m.stages[0]), (1, m.stages[1])):  # one node of 8; 8 nodes of one rank
        topology = place_ranks(node_size, list(range(8)), 8, 3)
        with pytest.warns(UserWarning, match="has one stage only"):
            mode = registry.build_mode(name, 8, topology=topology)
        assert mode.name == left.flat, (name, node_size)
    assert registry.build_mode(name, 1).name == "reduce_scatter"  # a one-rank group sends nothing


def test_unknown_modes_and_options_name_their_key():
    with pytest.raises(ValueError, match=r"reduction must be one of .*'qgz_fp8'.*got 'hier'"):
        ReducerConfig(reduction="hier")
    with pytest.raises(UnsupportedConfigError, match=r"'flatgrad\.reduction' must be one of"):
        FlatgradConfig.from_dict({"reduction": "int4"})
    with pytest.raises(
        UnsupportedConfigError, match=r"'flatgrad\.error_feedback' needs a quantized 'flatgrad\.reduction'"
    ):
        FlatgradConfig.from_dict({"reduction": "exact", "error_feedback": True})
    with pytest.raises(UnsupportedConfigError, match=r"'flatgrad\.block'"):
        FlatgradConfig.from_dict({"reduction": "int8", "block": 100})
    with pytest.raises(ValueError, match="error_feedback must be True or False"):
        ReducerConfig(reduction="int8", error_feedback=1)


@pytest.mark.parametrize("bench", ["reduction_modes", "reduction_error", "hierarchical"])
def test_every_mode_bench_covers_every_registered_mode(bench):
    """A new mode is benched as soon as it is registered (the tables add a row for any registered mode they do not
    name), and every row names a registered mode."""
    import importlib

    table = importlib.import_module(f"flatgrad.bench.{bench}").MODES
    rows = table.values() if isinstance(table, dict) else [{"reduction": name} for name in table]
    named = [row.get("reduction", "reduce_scatter") for row in rows]
    assert set(named) == set(registry.names()), sorted(set(registry.names()) ^ set(named))
