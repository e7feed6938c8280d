"""`spec-batch drafters train | list | show`: draft heads learned from the job history, stored in SQL
(docs/heads.md)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ._common import device_option, open_store_or_exit, resolve_job
from ._group import main


@main.group("drafters")
def drafters() -> None:
    """Learned draft heads: train one from a job's history, list and show them. Use one with --draft head:NAME."""


@drafters.command("train")
@click.argument("name")
@click.option("--job", "jobs", multiple=True, required=True, help="A job whose outputs to learn from (repeatable).")
@click.option(
    "--prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="More prompts (JSONL: batch lines, or {messages} / {prompt}); the target answers them first.",
)
@click.option("--max-minutes", type=click.FloatRange(min=0.1), default=None, help="Stop training after this long.")
@click.option("--epochs", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--draft-vocab",
    type=click.IntRange(min=16),
    default=8192,
    show_default=True,
    help="Tokens the head can propose (the most frequent in the data; FR-Spec).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--own-lm-head",
    is_flag=True,
    help="Train and store the head's own LM head (default: the target's rows, frozen and not stored).",
)
@click.option(
    "--layout",
    type=click.Choice(["eagle", "eagle3"]),
    default="eagle",
    show_default=True,
    help="eagle: EAGLE-1's head on the last hidden state; eagle3: EAGLE-3's, on a low, a middle and a "
    "high layer, trained with training-time test (docs/heads.md).",
)
@device_option
def train(
    name: str,
    jobs: tuple[str, ...],
    prompts: Path | None,
    max_minutes: float | None,
    epochs: int,
    draft_vocab: int,
    seed: int,
    own_lm_head: bool,
    layout: str,
    device: str | None,
) -> None:
    """Distill a head NAME for the jobs' target from their stored prompts and outputs."""
    from tqdm import tqdm

    from ..errors import SpecBatchError
    from ..jobs.head_training import TrainOptions, prompts_file, sequences, stored_row, train_from_pairs
    from ..loading import shared_decoder
    from ..settings import get_settings
    from ..store import drafters as store

    factory = open_store_or_exit(must_exist=True)
    job_ids = [resolve_job(factory, j) for j in jobs]
    with factory() as s:
        targets = set(store.job_targets(s, job_ids).values())
        outputs = store.completed_outputs(s, job_ids)
    if len(targets) != 1:
        raise click.ClickException(f"jobs {job_ids} have targets {sorted(targets)}: a head is trained for one target")
    settings = get_settings()
    try:
        decoder = shared_decoder(
            targets.pop(), "none", device=device or settings.device or "cpu", cache_dir=settings.cache_dir
        )
        pairs = sequences(decoder, outputs) + (prompts_file(decoder, prompts) if prompts else [])
        opts = TrainOptions(
            draft_vocab=draft_vocab,
            epochs=epochs,
            max_minutes=max_minutes,
            seed=seed,
            shared_lm_head=not own_lm_head,
            layout=layout,
        )
        trained = train_from_pairs(decoder, pairs, opts, bar=lambda total, desc: tqdm(total=total, desc=desc))
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc
    row = stored_row(name, trained, job_ids)
    with factory.begin() as s:
        store.save_drafter(s, row)
    shown = "—" if trained.heldout_accepted_length is None else f"{trained.heldout_accepted_length:.2f}"
    click.echo(
        f"head {name!r} for {row.target}: {trained.n_train} requests ({row.tokens_trained} tokens), "
        f"{len(row.weights) / 1e6:.1f} MB; held out {trained.n_heldout}: accepted length {shown} per step "
        f"(top-1 {trained.report.top1 or 0:.0%}). Use it: --draft head:{name}"
    )


@drafters.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_command(as_json: bool) -> None:
    """The stored heads."""
    from ..store import drafters as store

    factory = open_store_or_exit(must_exist=True)
    with factory() as s:
        rows = store.list_drafters(s)
    for r in rows:
        if as_json:
            click.echo(json.dumps(_as_dict(r), default=str))
        else:
            acc = "—" if r.heldout_accepted_length is None else f"{r.heldout_accepted_length:.2f}"
            click.echo(
                f"{r.name}\t{r.target}\t{r.tokens_trained} tokens\taccepted {acc}\t{r.size_bytes / 1e6:.1f} MB"
                f"\t{r.created_at:%Y-%m-%d %H:%M}"
            )
    if not rows and not as_json:
        click.echo("no heads yet: spec-batch drafters train NAME --job JOB")


@drafters.command("show")
@click.argument("name")
def show(name: str) -> None:
    """One head's facts and config (JSON)."""
    from ..store import drafters as store

    factory = open_store_or_exit(must_exist=True)
    with factory() as s:
        row = store.get_drafter(s, name)
        if row is None:
            raise click.ClickException(f"no head named {name!r}; `spec-batch drafters list` shows them")
        click.echo(json.dumps(_as_dict(store.drafter_info(row)), indent=2, default=str))


def _as_dict(info) -> dict:
    from dataclasses import asdict

    return asdict(info)
