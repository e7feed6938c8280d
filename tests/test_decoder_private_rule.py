"""No private member of `Decoder` is used outside its module (issue 36): the engine, the server, jobs, bench scripts
and tests go through its public seams, so the decoder's insides can change without them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECODER = ROOT / "spec_batch" / "core" / "decoder.py"
TREES = ("spec_batch", "langchain_spec", "workers", "bench", "tests")


def _private_members() -> set[str]:
    """The Decoder's own private names: its _methods and the self._attributes it sets or reads."""
    tree = ast.parse(DECODER.read_text())
    decoder = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Decoder")
    names = set()
    for node in ast.walk(decoder):
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _uses(path: Path, names: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in names
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def test_the_decoders_private_members_are_its_own():
    names = _private_members()
    assert "_drafter_factory" in names  # the rule reads the class it guards
    found = [
        use
        for tree in TREES
        for path in sorted((ROOT / tree).rglob("*.py"))
        if path != DECODER and ".venv" not in path.parts
        for use in _uses(path, names)
    ]
    assert found == [], "\n".join(found)
