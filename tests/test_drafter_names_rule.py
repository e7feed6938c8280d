"""No drafter is chosen by its name outside the registry (spec_batch/core/drafting/drafter_registry.py): read from the
source with ast, no comparison (==, !=, in, not in) in spec_batch/ or workers/ has a drafter kind's name as an
operand, alone or in a literal tuple, list or set. "none" is also a value of OpenAI's tool_choice and of settings,
so it counts only where the other side names a draft (an identifier containing "draft"). Defaults such as
`draft="suffix"` are no comparison and stay allowed."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "spec_batch" / "core" / "drafter_registry.py"
ALWAYS = {"suffix", "ngram"}  # drafter names and nothing else
ABOUT_DRAFTS = {"none"}  # a drafter name where compared with a draft


def _names(node: ast.AST) -> set[str]:
    """The drafter names a comparison operand holds: a string constant, or those of a literal collection."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _mentions_draft(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else ""
        if "draft" in name.lower():
            return True
    return False


def name_comparisons(source: str) -> list[int]:
    """Line numbers of the comparisons with a drafter's name in source."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, operand in enumerate(operands):
            found = _names(operand)
            others = operands[:i] + operands[i + 1 :]
            if found & ALWAYS or (found & ABOUT_DRAFTS and any(_mentions_draft(o) for o in others)):
                lines.append(node.lineno)
                break
    return sorted(lines)


def test_the_rule_finds_the_comparisons_it_forbids():
    old = (
        'if draft == "suffix": pass\n'
        'k = n if draft_name != "none" else 0\n'
        'ok = spec in ("suffix", "ngram", "none")\n'
        'tools = plan.choice != "none"\n'
        'd = dict(draft="suffix")\n'
    )
    assert name_comparisons(old) == [1, 2, 3]


def test_no_drafter_name_is_compared_outside_the_registry():
    found = []
    for package in ("spec_batch", "workers"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REGISTRY:
                continue
            found += [f"{path.relative_to(REPO)}:{n}" for n in name_comparisons(path.read_text())]
    assert found == [], "choose by the registry (DRAFTERS.get(name), a kind's fields), not by a drafter's name"
