"""`spec-batch generate`: decode prompts from the command line or a file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..limits import SEED, TEMPERATURE, TOP_P
from ._common import limit_type, model_options, weights_options
from ._group import main


def read_text_file(path: Path, option: str) -> str:
    """A file argument's text, or a usage error naming the option and saying what is wrong with the file."""
    try:
        return path.read_text(encoding="utf-8")
    except IsADirectoryError:
        raise click.BadParameter(f"{path} is a folder, not a file", param_hint=option) from None
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=option) from None
    except UnicodeDecodeError as e:
        raise click.BadParameter(
            f"{path} is not UTF-8 text (byte {e.start}): give a text file", param_hint=option
        ) from None


def _read_prompts(prompts: tuple[str, ...], file: Path | None) -> list[str]:
    out = list(prompts)
    if file is not None:
        text = sys.stdin.read() if str(file) == "-" else read_text_file(file, "--file")
        out.extend(line for line in text.splitlines() if line.strip())
    if not out:
        raise click.UsageError("give at least one PROMPT or --file F (one prompt per line; - reads stdin)")
    return out


def _response_format(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """--response-format: the batch field's object as JSON, or @FILE holding it; parsed (once) into the
    ResponseFormat that SamplingParams keeps, before any model loads."""
    if value is None:
        return None
    from ..core.structured.response_format import parse_response_format
    from ..errors import InvalidParameterError

    text = read_text_file(Path(value[1:]), "--response-format") if value.startswith("@") else value
    try:
        fmt = parse_response_format(json.loads(text))
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e.msg} at column {e.colno}") from None
    except InvalidParameterError as e:
        raise click.BadParameter(str(e)) from None
    return fmt


@main.command("generate")
@click.argument("prompts", nargs=-1)
@click.option(
    "--file", "file", type=click.Path(path_type=Path, allow_dash=True), help="Prompts, one per line (- for stdin)."
)
@click.option("--chat", is_flag=True, help="Apply the target's chat template (each prompt is one user message).")
@model_options
@click.option(
    "--dtype",
    default=None,
    help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA; int4/int8 weights: bf16).",
)
@weights_options
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature",
    type=limit_type(TEMPERATURE),
    default=0.0,
    show_default=True,
    help="0 = greedy; at most 2 (OpenAI's range).",
)
@click.option("--top-p", type=limit_type(TOP_P), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option(
    "--seed",
    type=limit_type(SEED, integer=True),
    default=None,
    help="Per-request seed (same output whatever the batch): a signed 64-bit integer.",
)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--response-format",
    callback=_response_format,
    metavar="JSON|@FILE",
    help='The output\'s shape, as the batch field: \'{"type": "json_object"}\', a json_schema, regex or choice '
    "object (docs/structured-output.md); @FILE reads it from a file.",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="Longest draft per step.  [default: the drafter's: 16 for suffix, 8 otherwise]",
)
@click.option("--no-adaptive", is_flag=True, help="Always draft --num-draft-tokens (no adaptive draft length).")
@click.option(
    "--json", "as_json", is_flag=True, help="One JSON object per prompt: text, token_ids, finish_reason, stats."
)
def generate(
    prompts: tuple[str, ...],
    file: Path | None,
    chat: bool,
    target: str | None,
    draft: str | None,
    device: str | None,
    dtype: str | None,
    weights: str | None,
    draft_weights: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: tuple[str, ...],
    response_format: Any,
    batch_size: int,
    num_draft_tokens: int | None,
    no_adaptive: bool,
    as_json: bool,
) -> None:
    """Generate text for PROMPT(s) with speculative decoding."""
    from .. import SamplingParams, SpecBatchError, load_decoder
    from ..jobs.heads import resolve_with_settings
    from ..settings import get_settings

    texts = _read_prompts(prompts, file)
    settings = get_settings()
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=list(stop),
            response_format=response_format,
        )
        dec = load_decoder(
            target=target or settings.default_target,
            draft=resolve_with_settings(draft or settings.default_draft, settings),
            device=device or settings.device or "cpu",
            dtype=dtype,
            num_draft_tokens=num_draft_tokens,
            adaptive=not no_adaptive,
            cache_dir=str(settings.cache_dir),
            weights=weights or settings.weights,
            draft_weights=draft_weights or settings.draft_weights,
            tree_width=settings.tree_width,
        )
        inputs = [dec.apply_chat_template([{"role": "user", "content": t}]) for t in texts] if chat else texts
        results = dec.generate(inputs, params, batch_size=batch_size)
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc
    _print_results(results, as_json, dec.precision.to_dict())


def _print_results(results, as_json: bool, precision: dict[str, str]) -> None:
    for res in results:
        if as_json:
            out = res.to_dict()
            out.pop("error")
            out["stats"] = {**out.get("stats", {}), **precision}  # the (weights, dtype) it ran at
            click.echo(json.dumps(out))
        else:
            click.echo(res.text)
            s = res.stats
            rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "-"
            click.echo(
                f"[{res.finish_reason}; {s.output_tokens} tokens in {s.wall_s:.2f}s; "
                f"acceptance {rate}; {s.tokens_per_step or 0:.2f} tokens/step"
                + (f"; {s.forced_tokens} forced]" if s.forced_tokens else "]"),
                err=True,
            )
