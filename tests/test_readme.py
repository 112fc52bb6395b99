"""README.md: its minimal example runs as written, under torchrun on 2 CPU ranks, and says once that flatgrad took over."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import flatgrad

_README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_TAKE_OVER = re.compile(r"^flatgrad: ZeRO-\d gradient reduction taken over: ", re.M)


def _example(name: str) -> str:
    """The script between ``<!-- example: NAME -->`` and ``<!-- /example -->``, without its code fence."""
    text = _README.read_text()
    found = re.search(rf"<!-- example: {re.escape(name)} -->\n```python\n(.*?)```\n<!-- /example -->", text, re.S)
    assert found, f"README.md has no `<!-- example: {name} -->` block with a python code fence"
    return found.group(1)


def test_the_example_is_short():
    assert len(_example("train.py").strip().splitlines()) <= 30


def _torchrun(script: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    home = str(pathlib.Path(flatgrad.__file__).resolve().parent.parent)
    environ = {k: v for k, v in os.environ.items() if k != "FLATGRAD_QUIET"}
    environ.update(DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([home, os.environ.get("PYTHONPATH", "")]), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script.name]
    return subprocess.run(cmd, cwd=script.parent, env=environ, capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
def test_the_example_trains_and_prints_one_take_over_line(tmp_path: pathlib.Path):
    script = tmp_path / "train.py"
    script.write_text(_example("train.py"))
    proc = _torchrun(script)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = _TAKE_OVER.findall(proc.stderr)
    assert len(lines) == 1, f"{len(lines)} take-over lines on stderr:\n{proc.stderr[-4000:]}"
    assert "passing this config to stock DeepSpeed" not in proc.stderr

    quiet = _torchrun(script, FLATGRAD_QUIET="1")
    assert quiet.returncode == 0, quiet.stderr[-4000:]
    assert not _TAKE_OVER.search(quiet.stderr), quiet.stderr[-4000:]
