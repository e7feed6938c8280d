"""The `spec-batch` click group. Each command lives in the module named for its area."""
from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="spec-batch")
def main() -> None:
    """spec-batch: exact speculative decoding, batched, with bulk jobs and their history in SQL."""
