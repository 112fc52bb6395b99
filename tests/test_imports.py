"""The package's shape: no import cycle, no private name imported across packages, layers depend one way.

Every ``import`` in ``flatgrad/`` counts: the ones inside functions (a lazy import still ties two modules together)
and the ones under ``if TYPE_CHECKING:`` (a type named across a circle is a circle in the design, even if it never runs).
"""

from __future__ import annotations

import ast
import pathlib

import flatgrad

_ROOT = pathlib.Path(flatgrad.__file__).resolve().parent

# The layers, lowest first: a module may import its own layer and the ones below it, never one above.
_LAYERS = [
    ("layout",),
    ("kernels",),
    ("comm",),
    ("reducer",),
    ("integrations", "deepspeed"),
    ("planner", "bench", "demo", "testing", "check", "cli", "__main__"),
]


# The compiled extension modules: the kernels load ``_C``, the memory census ``_census``.
_EXTENSIONS = {("flatgrad", "_C"), ("flatgrad", "_census")}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in _ROOT.rglob("*.py"):
        parts = list(path.relative_to(_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, list[str]]]:
    """``(module, imported names)`` for every flatgrad import in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "flatgrad"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flatgrad":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            out += [(m, []) for m in submodules]
            rest = [n for n in names if f"{target}.{n}" not in modules]
            if rest or not submodules:
                out.append((target, rest))
    return out


def _graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for name, path in modules.items():
        for target, names in _imports(name, path, modules):
            if target not in modules or target == name:
                continue
            edges[name].add(target)
            home, theirs = name.split(".")[:2], target.split(".")[:2]
            for n in names:
                if n.startswith("_") and not n.startswith("__") and home != theirs and (target, n) not in _EXTENSIONS:
                    private.append((name, target, n))
    return edges, private


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _parent_is_package(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own submodules (or a submodule its package) is not a cycle."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_cycle():
    edges, _ = _graph()
    edges = {m: {t for t in ts if not _parent_is_package(m, t)} for m, ts in edges.items()}
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_no_private_name_imported_across_packages():
    _, private = _graph()
    assert private == [], "\n".join(f"{m} imports {n} from {t}" for m, t, n in private)


def _layer(module: str) -> int | None:
    parts = module.split(".")[1:]
    if not parts:
        return None
    for level, names in enumerate(_LAYERS):
        if parts[0] in names:
            return level
    return None


def test_layers_depend_one_way():
    edges, _ = _graph()
    upward = []
    for m, targets in edges.items():
        for t in targets:
            lm, lt = _layer(m), _layer(t)
            if lm is not None and lt is not None and lt > lm:
                upward.append(f"{m} (layer {_LAYERS[lm][0]}) imports {t} (layer {_LAYERS[lt][0]})")
    assert upward == [], "\n".join(sorted(upward))


def test_the_checker_counts_imports_under_type_checking(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flatgrad.layout import Layout\n")
    assert _imports("flatgrad.m", module, {"flatgrad.layout": module}) == [("flatgrad.layout", ["Layout"])]


def test_the_checker_sees_a_cycle_and_a_private_import():
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
