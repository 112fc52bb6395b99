"""flatgrad.testing.launch: ranks import the parent's flatgrad, whatever the working directory."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import textwrap

import pytest

import flatgrad

_DRIVER = textwrap.dedent(
    """
    import json

    import flatgrad
    from flatgrad.testing.launch import run_ranks


    def _where(rank, world_size):
        from flatgrad.kernels import compiled

        return flatgrad.__file__, compiled.devices("cpu")[1]


    if __name__ == "__main__":
        print(json.dumps({"parent": flatgrad.__file__, "ranks": run_ranks(_where, 2, timeout=90)}))
    """
)


def _unbuilt_copy(into: pathlib.Path) -> None:
    """A copy of flatgrad's Python sources without the compiled extension: a fresh clone's tree."""
    package = pathlib.Path(flatgrad.__file__).resolve().parent
    shutil.copytree(package, into / "flatgrad", ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    (into / "setup.py").write_text("")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cwd", ["unbuilt source tree", "empty directory"])
def test_ranks_import_the_parents_flatgrad_from_any_working_directory(tmp_path: pathlib.Path, cwd: str):
    work = tmp_path / "cwd"
    work.mkdir()
    if cwd == "unbuilt source tree":
        _unbuilt_copy(work)
    driver = tmp_path / "scripts" / "driver.py"
    driver.parent.mkdir()
    driver.write_text(_DRIVER)
    home = str(pathlib.Path(flatgrad.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([home, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(driver)], cwd=work, env=env, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert os.path.realpath(out["parent"]) == os.path.realpath(flatgrad.__file__)
    for rank, (where, missing) in enumerate(out["ranks"]):
        assert where == out["parent"], f"rank {rank} imported {where}"
        assert missing == "", f"rank {rank}: {missing}"


def test_a_missing_extension_names_the_tree_and_the_command(tmp_path: pathlib.Path):
    _unbuilt_copy(tmp_path)
    code = (
        "import flatgrad; from flatgrad.kernels import compiled; "
        "print(flatgrad.__file__); print(compiled.devices('cpu')[1])"
    )
    # -S: no site hooks, so an editable install's finder cannot hand the unbuilt copy another tree's _C; the
    # site-packages directories come back through PYTHONPATH for torch.
    packages = os.pathsep.join(site.getsitepackages())
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=packages),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    imported, message = proc.stdout.strip().splitlines()
    assert imported == str(tmp_path / "flatgrad" / "__init__.py")
    assert str(tmp_path / "flatgrad") in message
    assert "pip install --no-build-isolation -e ." in message
