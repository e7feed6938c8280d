"""Who may change a job's status, and who may look at one, read from the source with ast (docs/architecture.md,
"The job lifecycle"):

- a job status is assigned only in spec_batch/jobs/lifecycle.py and spec_batch/store/: nowhere else is
  `change_job_status` called, a job row inserted with a `status`, or a job status (a store constant such as
  JOB_IN_PROGRESS, lifecycle.INITIAL, or the literal "in_progress") assigned to a name, an attribute or a
  `status=` argument;
- what a job does when a run ends is lifecycle's decision (`after_run`): nothing else calls its settle_cancel,
  finalize_job, begin_finalizing or complete;
- besides lifecycle and store, only display code names a job status (the CLI's colours and exit codes, the Batch
  object's status in server/batch_objects.py); the rest reads statuses through lifecycle's predicates.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from spec_batch.store import JOB_STATUSES, chunks, models, queries

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("spec_batch", "workers", "langchain_spec")
WRITERS = ("spec_batch/jobs/lifecycle.py", "spec_batch/store/")
READERS = WRITERS + ("spec_batch/cli/", "spec_batch/server/batch_objects.py")
DECISIONS = frozenset({"settle_cancel", "finalize_job", "begin_finalizing", "complete"})  # lifecycle's own


@cache
def status_names() -> frozenset[str]:
    """The store's names for job statuses and sets of them (JOB_IN_PROGRESS, JOB_TERMINAL, ...), and INITIAL."""
    names = {"INITIAL"}
    for module in (models, chunks, queries):
        for name, value in vars(module).items():
            if not name.startswith("JOB_"):
                continue
            values = value if isinstance(value, (tuple, frozenset, set)) else (value,)
            if values and all(isinstance(v, str) and v in JOB_STATUSES for v in values):
                names.add(name)
    return frozenset(names)


def _is_status(node: ast.AST | None, *, literal: bool) -> bool:
    """A job status written out: a store constant, lifecycle.INITIAL, or (`literal`) the string itself. Literals
    count only where a status goes (a `status` name, attribute or argument): "cancelled" is also a row's finish
    reason, which is no job status."""
    if isinstance(node, ast.Name):
        return node.id in status_names()
    if isinstance(node, ast.Attribute):
        return node.attr in status_names()
    return literal and isinstance(node, ast.Constant) and node.value in JOB_STATUSES


def _is_status_target(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "status") or (
        isinstance(node, ast.Attribute) and node.attr == "status"
    )


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _lifecycle_names(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Local names bound to the lifecycle module, and local name -> lifecycle function for `from ... import`."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name == "lifecycle":
                modules.add(local)
            elif module == "lifecycle" or module.endswith(".lifecycle"):
                functions[local] = alias.name
    return modules, functions


def status_writes(source: str) -> list[str]:
    """Where `source` assigns a job status or takes one of lifecycle's decisions (line: what)."""
    tree = ast.parse(source)
    modules, functions = _lifecycle_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if _is_status(node.value, literal=any(_is_status_target(t) for t in targets)):
                found.append(f"{node.lineno}: assigns a job status")
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name == "change_job_status":
            found.append(f"{node.lineno}: changes a job's status in SQL")
        for kw in node.keywords:
            if kw.arg == "status" and (_is_status(kw.value, literal=True) or name in ("insert_job", "Job")):
                found.append(f"{node.lineno}: passes a job status (status=)")
        func = node.func
        decided = (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in modules
            and func.attr in DECISIONS
        ) or (isinstance(func, ast.Name) and functions.get(func.id) in DECISIONS)
        if decided:
            found.append(f"{node.lineno}: decides for lifecycle ({name}: report the run's end to after_run)")
    return found


def status_reads(source: str) -> list[str]:
    """Where `source` names a job status itself (line: name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in status_names():
            found.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in status_names():
            found.append(f"{node.lineno}: {node.attr}")
        elif isinstance(node, ast.alias) and node.name in status_names():
            found.append(f"{getattr(node, 'lineno', '?')}: imports {node.name}")
    return found


def _sources(allowed: tuple[str, ...]):
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(allowed):
                yield rel, path.read_text(encoding="utf-8")


def test_job_status_is_assigned_only_by_lifecycle_and_store():
    offenders = {rel: hits for rel, src in _sources(WRITERS) if (hits := status_writes(src))}
    assert offenders == {}, "job statuses change only through spec_batch.jobs.lifecycle (after_run, start, ...)"


def test_decision_code_reads_statuses_through_lifecycle_predicates():
    offenders = {rel: hits for rel, src in _sources(READERS) if (hits := status_reads(src))}
    assert offenders == {}, "use lifecycle's predicates (is_terminal, is_stopping, is_running, takes_new_work)"


def test_the_rules_catch_what_they_forbid():
    """Each rule finds its violation in a small example (a rule that finds nothing is no rule)."""
    bad = """
from spec_batch.jobs import lifecycle
from spec_batch.jobs.lifecycle import finalize_job
from spec_batch.store.models import JOB_IN_PROGRESS

def enqueue(s, job, job_id):
    lifecycle.start(s, job_id)
    status = JOB_IN_PROGRESS
    job.status = "cancelling"
    queries.insert_job(s, id=job_id, status=lifecycle.INITIAL)
    queries.change_job_status(s, job_id, sources=(), target="failed")
    report(status=JOB_IN_PROGRESS)
    lifecycle.settle_cancel(s, job_id)
    finalize_job(factory, job_id)
"""
    writes = status_writes(bad)
    assert [w.split(":")[0] for w in writes] == ["8", "9", "10", "11", "12", "13", "14"], writes
    assert {r.split(": ")[1] for r in status_reads(bad)} == {"imports JOB_IN_PROGRESS", "JOB_IN_PROGRESS", "INITIAL"}
    fine = """
from spec_batch.jobs import lifecycle

def after(s, factory, job, job_id, status):
    if lifecycle.is_running(job.status):
        lifecycle.after_run(factory, job_id, lifecycle.RunOutcome.FINISHED)
    metrics.labels(status=status)
    raise APIError(409, "x", status="failed_dependency_is_no_job_status")
    CANCELLED = "cancelled"  # a row's finish reason
"""
    assert status_writes(fine) == [] and status_reads(fine) == []
