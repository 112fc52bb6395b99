"""flatgrad.integrations.deepspeed.config: the "flatgrad" section, and its renamed keys."""

from __future__ import annotations

import warnings

import pytest

from flatgrad.integrations.deepspeed.config import RENAMED, FlatgradConfig, UnsupportedConfigError, split_config


def test_the_method_key_is_reduce_scatter_method():
    assert FlatgradConfig.from_dict({"reduce_scatter_method": "list"}).reduce_scatter_method == "list"
    with pytest.raises(UnsupportedConfigError, match=r"'flatgrad\.reduce_scatter_method' must be one of"):
        FlatgradConfig.from_dict({"reduce_scatter_method": "ring"})


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_a_former_key_still_works_with_a_warning_naming_the_new_one(old: str, new: str):
    with pytest.warns(DeprecationWarning, match=f"'flatgrad.{new}'"):
        _, cfg = split_config({"train_batch_size": 2, "flatgrad": {old: "tensor"}})
    assert getattr(cfg, new) == "tensor"
    with pytest.raises(UnsupportedConfigError, match=f"keep '{new}' only"):
        FlatgradConfig.from_dict({old: "tensor", new: "list"})


def test_the_new_key_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FlatgradConfig.from_dict({"reduce_scatter_method": "tensor"})


def test_an_unknown_key_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="reduce_scater"):
        FlatgradConfig.from_dict({"reduce_scater": "tensor"})


def test_the_docs_table_lists_every_section_key_with_its_default():
    """docs/deepspeed.md's table of the section is every key of ``FlatgradConfig``, each with its default."""
    import dataclasses
    import json
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "deepspeed.md").read_text()
    table = text.split('## The `"flatgrad"` config section', 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", table, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(FlatgradConfig) if f.name != "reduction_key"}
    assert sorted(rows) == sorted(fields), (sorted(rows), sorted(fields))
    for name, default in fields.items():
        assert json.loads(rows[name]) == default, (name, rows[name], default)


def test_checkpoint_layout_is_flatgrad_or_stock():
    assert FlatgradConfig.from_dict({}).checkpoint_layout == "flatgrad"
    assert FlatgradConfig.from_dict({"checkpoint_layout": "stock"}).checkpoint_layout == "stock"
    with pytest.raises(UnsupportedConfigError, match=r"'flatgrad\.checkpoint_layout' must be one of"):
        FlatgradConfig.from_dict({"checkpoint_layout": "universal"})
