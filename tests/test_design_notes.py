"""docs/design.md: every design note lives once, in its own ``### [Note: name]`` section there.

Code cites a note by name and says in a few lines why it is shaped so; the note itself (the facts, caveats and
numbers) is written only in docs/design.md. So no reference may name a missing section, no code file may hold a
note block (a line that is only the note's bracketed name, followed by its body), and no section is written twice.
"""

from __future__ import annotations

import pathlib
import re


_REPO = pathlib.Path(__file__).resolve().parent.parent
_DESIGN = _REPO / "docs" / "design.md"
_SELF = pathlib.Path(__file__).resolve()

_CODE_DIRS = ("flatgrad", "bench", "tests", "csrc")
_TEXT_SUFFIXES = {".py", ".pyi", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".sh", ".md", ".toml", ".txt"}

_HEADING = re.compile(r"^### \[Note: ([^\]\n]+)\]\s*$", re.M)
# A reference may wrap: the name's words are then split by a newline and, in a comment, its leader.
_REFERENCE = re.compile(r"\[Note:\s+([^\]\[]+?)\]")
_WRAP = re.compile(r"\s*\n\s*(?:#|//|\*)?\s*")
# A block starts with a line that is only the note's name (in a comment, after its leader), then its body.
_BLOCK = re.compile(r"^[ \t]*(?:#|//|\*)?[ \t]*\[Note: ([^\]\n]+)\][ \t]*\n[ \t]*(?:#|//|\*)?[ \t]*\S", re.M)
_ANCHOR = re.compile(r"\]\(#(note-[^)\s]+)\)")


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(_REPO).as_posix()


def _text_files(*tops: str) -> list[pathlib.Path]:
    files = []
    for top in tops:
        root = _REPO / top
        candidates = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in candidates:
            if path.suffix not in _TEXT_SUFFIXES or not path.is_file() or "__pycache__" in path.parts:
                continue
            if path.resolve() != _SELF:  # this file names the notation, not a note
                files.append(path)
    return files


def _code_files() -> list[pathlib.Path]:
    return [p for p in _text_files(*_CODE_DIRS) if p.suffix != ".md"]


def _sections() -> list[str]:
    return _HEADING.findall(_DESIGN.read_text())


def _references(text: str) -> list[str]:
    return [" ".join(_WRAP.sub(" ", name).split()) for name in _REFERENCE.findall(text)]


def _blocks(path: pathlib.Path) -> list[str]:
    return _BLOCK.findall(path.read_text(errors="replace"))


def _anchor(name: str) -> str:
    """GitHub's anchor of the heading ``[Note: name]``."""
    return re.sub(r"[^\w\- ]", "", f"note: {name}".lower()).replace(" ", "-")


def test_every_note_heading_is_unique():
    seen: dict[str, int] = {}
    for name in _sections():
        seen[name] = seen.get(name, 0) + 1
    assert not {n: k for n, k in seen.items() if k > 1}, "docs/design.md writes these notes more than once"


def test_every_reference_names_a_section_of_design_md():
    sections = set(_sections())
    dangling = []
    for path in _text_files(*_CODE_DIRS, "README.md", "docs"):
        for name in _references(path.read_text(errors="replace")):
            if name not in sections:
                dangling.append(f"{_rel(path)}: [Note: {name}]")
    assert not dangling, "references to notes docs/design.md has no `### [Note: ...]` section for:\n" + "\n".join(
        dangling
    )


def test_every_note_link_in_the_docs_names_a_section():
    anchors = {_anchor(name) for name in _sections()}
    dangling = []
    for path in _text_files("README.md", "docs"):
        dangling += [f"{_rel(path)}: #{a}" for a in _ANCHOR.findall(path.read_text()) if a not in anchors]
    assert not dangling, "links to note sections that do not exist:\n" + "\n".join(dangling)


def test_no_code_file_holds_a_note_block():
    written_twice = [
        f"{_rel(path)}: [Note: {name}]"
        for path in _code_files()
        for name in _blocks(path)
    ]
    assert not written_twice, (
        "note blocks in code (move the note into its docs/design.md section and leave a few lines ending "
        '"See [Note: name] in docs/design.md."):\n' + "\n".join(written_twice)
    )


def test_the_block_pattern_finds_blocks_and_not_references():
    block = '"""What.\n\n[Note: x y]\nThe body.\n"""\n    // [Note: z]\n    // its body\n# [Note: w]\n# body\n'
    assert _BLOCK.findall(block) == ["x y", "z", "w"]
    refs = "See [Note: x y] in docs/design.md.\n(see [Note: a\n    b]) and // [Note: c\n// d]\n[Note: e].\n"
    assert not _BLOCK.findall(refs)
    assert _references(refs) == ["x y", "a b", "c d", "e"]
