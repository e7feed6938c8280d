"""The layers' import rules (docs/architecture.md), read from the source with ast: every import statement counts,
those inside functions included (only `if TYPE_CHECKING:` blocks, which never run, are left out).

- spec_batch.core imports no sqlalchemy, alembic, celery, kombu, redis or langchain, and nothing of the layers
  above it (loading, jobs, store, cli, reports) nor workers;
- spec_batch.openai_format (request bodies and response shapes) imports no SQL, queue or langchain, and nothing
  of jobs, store, cli or reports;
- spec_batch.jobs and spec_batch.store import no celery, kombu or langchain, and nothing of the queue
  (spec_batch.workers, or the thin workers/ package kept for `celery -A workers.celery_app`);
- spec_batch.workers (the queue) imports nothing of the CLI or LangChain;
- spec_batch.reports (store's read queries, matplotlib, jinja2) imports no celery, kombu, redis or langchain, and
  nothing of workers, jobs, loading or the CLI;
- spec_batch.core's parts import only their own part and lower ones (kv, structured < shared leaves <
  drafting < heads < batch < front), and no module imports the documented alias paths;
- no import cycles among the project's modules.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("spec_batch", "workers", "langchain_spec")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def project_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, skipping `if TYPE_CHECKING:` bodies."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


@cache
def imports_of(module: str) -> frozenset[str]:
    """Absolute names `module` imports: `from pkg import mod` counts as pkg.mod when that is a project module."""
    path = project_modules()[module]
    is_package = path.name == "__init__.py"
    modules = project_modules()
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            out.add(sub if sub in modules else target)
    return frozenset(out)


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


RULES = [
    (
        "spec_batch.core",
        {
            "sqlalchemy",
            "alembic",
            "celery",
            "kombu",
            "redis",
            "langchain",
            "langchain_core",
            "langchain_spec",
            "workers",
        },
        (
            "spec_batch.loading",
            "spec_batch.jobs",
            "spec_batch.store",
            "spec_batch.cli",
            "spec_batch.reports",
            "spec_batch.openai_format",
            "spec_batch.workers",
            "spec_batch.server",
        ),
    ),
    # the request parser of batch lines and the server: no SQL, no queue, no LangChain
    (
        "spec_batch.openai_format",
        {
            "sqlalchemy",
            "alembic",
            "celery",
            "kombu",
            "redis",
            "langchain",
            "langchain_core",
            "langchain_spec",
            "workers",
        },
        (
            "spec_batch.jobs",
            "spec_batch.store",
            "spec_batch.cli",
            "spec_batch.reports",
            "spec_batch.workers",
            "spec_batch.server",
        ),
    ),
    (
        "spec_batch.jobs",
        {"celery", "kombu", "langchain", "langchain_core", "langchain_spec", "workers"},
        ("spec_batch.cli", "spec_batch.workers", "spec_batch.server"),
    ),
    (
        "spec_batch.store",
        {"celery", "kombu", "langchain", "langchain_core", "langchain_spec", "workers"},
        (
            "spec_batch.jobs",
            "spec_batch.loading",
            "spec_batch.cli",
            "spec_batch.core",
            "spec_batch.workers",
            "spec_batch.server",
        ),
    ),
    (
        "spec_batch.reports",
        {"celery", "kombu", "redis", "langchain", "langchain_core", "langchain_spec", "workers"},
        ("spec_batch.jobs", "spec_batch.loading", "spec_batch.cli", "spec_batch.workers", "spec_batch.server"),
    ),
    (
        "spec_batch.workers",
        {"langchain", "langchain_core", "langchain_spec", "workers"},
        ("spec_batch.cli", "spec_batch.server"),
    ),
    # the HTTP server sits beside the CLI: it may use every layer below, never the CLI or LangChain
    ("spec_batch.server", {"langchain", "langchain_core", "langchain_spec", "workers"}, ("spec_batch.cli",)),
]


@pytest.mark.parametrize("package,forbidden,forbidden_layers", RULES, ids=[r[0] for r in RULES])
def test_layer_imports(package, forbidden, forbidden_layers):
    bad = []
    for module in sorted(project_modules()):
        if not _within(module, package):
            continue
        for name in sorted(imports_of(module)):
            if _top(name) in forbidden or any(_within(name, layer) for layer in forbidden_layers):
                bad.append(f"{module} imports {name}")
    assert not bad, "\n".join(bad)


# The one module per layer through which it reaches transformers' and torch's internals (core may not import
# loading, so each has its own); no other module of spec_batch imports or reads them.
COMPAT = ("spec_batch.core.kv.hf_compat", "spec_batch.loading.compat")
PUBLIC_SUBMODULES = ("transformers.utils",)  # transformers.utils.logging: documented for users


def _private_names(module: str) -> list[str]:
    """transformers' submodules and torch's private names (torch._*, cpp_extension) that `module` imports or reads."""
    found = [
        name
        for name in imports_of(module)
        if (_within(name, "transformers") and name != "transformers" and name not in PUBLIC_SUBMODULES)
        or (_within(name, "torch") and any(p.startswith("_") for p in name.split(".")[1:]))
        or _within(name, "torch.utils.cpp_extension")
    ]
    tree = ast.parse(project_modules()[module].read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        torch_attr = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch"
        if torch_attr and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"torch.{node.attr}")
    return sorted(set(found))


def test_internals_of_transformers_and_torch_go_through_one_compat_module_per_layer():
    bad = [
        f"{module} uses {name}"
        for module in sorted(project_modules())
        if _within(module, "spec_batch") and module not in COMPAT
        for name in _private_names(module)
    ]
    assert not bad, "\n".join(bad)
    assert all(_private_names(module) for module in COMPAT)  # the checker sees what the doors import


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    modules = project_modules()
    graph = {m: {n for n in imports_of(m) if n in modules} for m in modules}
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_function_level_imports(tmp_path):
    """The checker itself: a cycle hidden by an import inside a function is found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b"]]
    src = "def f():\n    from .runner import run\n"
    nodes = list(_import_nodes(ast.parse(src)))
    assert len(nodes) == 1 and nodes[0].module == "runner" and nodes[0].level == 1
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import y\n"
    assert [n.module for n in _import_nodes(ast.parse(typed))] == ["typing"]


def test_commands_that_only_read_or_queue_do_not_import_torch():
    """`spec-batch submit/status/cancel/jobs/report` and the enqueue path load in about a second: torch and
    transformers (8-10 s to import on a small CPU) come in only where a model is loaded."""
    import subprocess
    import sys

    code = (
        "import sys, spec_batch, spec_batch.cli, spec_batch.jobs, spec_batch.loading, spec_batch.workers.enqueue;"
        "spec_batch.SamplingParams(max_new_tokens=4); spec_batch.loading.validate_messages;"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # from `def` to its last line


def test_no_module_or_function_is_too_long():
    """A module over 400 lines or a function over 60 is split along its jobs (tests, bench and migrations
    are outside these packages)."""
    too_long = []
    for module, path in project_modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert too_long == []


# The core's own layers (docs/architecture.md, "The core's parts"), lowest first: a core module imports core
# modules of its own part or of a lower layer only, so the parts form no cycle. The shared leaves are the flat
# modules every part reads (parameters, sampling, verification, results, the policy); the front drives a batch.
CORE_LEAVES = (
    "params",
    "inputs",
    "outputs",
    "text",
    "argmax",
    "sampling",
    "verify",
    "logprobs",
    "logits_processing",
    "policy",
    "acceptance",
    "lookup_pacing",
    "step_costs",
    "realized_rates",
    "calibration",
    "thread_governor",
)
CORE_FRONT = ("decoder", "decoder_like", "engine", "engine_batch")
CORE_ALIASES = ("drafters", "response_format")  # documented paths of moved modules, for users only
CORE_LAYERS = (
    ("kv", "structured"),
    ("leaves",),
    ("drafting",),
    ("heads",),
    ("batch",),
    ("front",),
    ("aliases",),
)


def _core_part(module: str) -> str:
    """The part of spec_batch.core a module belongs to: its subpackage, or leaves / front / aliases."""
    name = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    for part, members in (("leaves", CORE_LEAVES), ("front", CORE_FRONT), ("aliases", CORE_ALIASES)):
        if module.count(".") == 2 and name in members:
            return part
    assert (REPO / "spec_batch" / "core" / name).is_dir(), f"{module}: place it in CORE_LEAVES or CORE_FRONT"
    return name


def _core_rank(part: str) -> int:
    return next(i for i, parts in enumerate(CORE_LAYERS) if part in parts)


def test_the_core_parts_import_only_lower_layers():
    bad = []
    for module in sorted(project_modules()):
        if not _within(module, "spec_batch.core") or module == "spec_batch.core":
            continue
        part = _core_part(module)
        for name in sorted(imports_of(module)):
            if not _within(name, "spec_batch.core") or name == "spec_batch.core":
                continue
            other = _core_part(name)
            if other != part and _core_rank(other) >= _core_rank(part):
                bad.append(f"{module} ({part}) imports {name} ({other})")
    assert not bad, "\n".join(bad)


def test_only_users_import_the_documented_aliases():
    aliases = {f"spec_batch.core.{a}" for a in CORE_ALIASES}
    bad = [
        f"{module} imports {name}"
        for module in sorted(project_modules())
        if module not in aliases
        for name in imports_of(module)
        if name in aliases
    ]
    assert not bad, "\n".join(bad)
