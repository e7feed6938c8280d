"""`spec-batch drafters train`: a draft head distilled from the outputs a job history already holds.

The stored requests of the given jobs (their prompts through the target's chat template, their outputs) and,
optionally, prompts from a file (the target answers them first) are the data. 10% of the requests are held
out; the head is trained on the rest (core/heads/head_train.py) and then drafts for the held-out requests through
the real decoder: their accepted length per step is the number stored with the head. The head is stored in
SQL (store/drafters.py) with its facts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..core.heads.head import EagleHead, head_for_target, stored_tensors
from ..core.heads.head_train import TrainReport, choose_vocabulary, collect_states, train_head
from ..core.params import SamplingParams
from ..errors import InvalidParameterError
from ..openai_format.prompts import build_prompt, prompt_list
from ..store.drafters import DraftHead, StoredOutput

if TYPE_CHECKING:
    from ..core.decoder import Decoder  # heads train on its target model, not any DecoderLike

HELDOUT = 0.1
DRAFT_VOCAB = 8192  # FR-Spec: ~8k frequent tokens cover nearly every token of a job's outputs


@dataclass
class TrainOptions:
    draft_vocab: int = DRAFT_VOCAB
    epochs: int = 8
    max_minutes: float | None = None
    seed: int = 0
    measure_tokens: int = 96  # longest output the held-out decode produces per request
    num_draft_tokens: int = 5
    shared_lm_head: bool = True  # the target's LM head rows (frozen, not stored); False: the head's own, trained
    layout: str = (
        "eagle"  # "eagle3": EAGLE-3's head (three target layers, training-time test: core/heads/head_train.py)
    )


@dataclass
class TrainedHead:
    head: EagleHead
    report: TrainReport
    n_train: int
    n_heldout: int
    tokens_trained: int  # positions of the training split (one epoch)
    heldout_accepted_length: float | None  # accepted draft tokens per step on the held-out requests
    heldout_tokens_per_step: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def sequences(decoder: Decoder, outputs: Sequence[StoredOutput]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per stored request: the prompt as the runner built it, the output re-tokenized
    (plus the EOS when it ended the output)."""
    tok = decoder.tokenizer
    eos = sorted(decoder.eos_ids)[:1]
    out = []
    for o in outputs:
        prompt = build_prompt(decoder, o.endpoint, prompt_list(o.endpoint, o.prompt)[0])  # the output is choice 0's
        ids = list(prompt) if isinstance(prompt, list) else tok.encode(prompt)
        out.append((ids, tok.encode(o.output, add_special_tokens=False) + (eos if o.finish_reason == "stop" else [])))
    return out


def prompts_file(decoder: Decoder, path: Path, max_new_tokens: int = 256) -> list[tuple[list[int], list[int]]]:
    """Prompts from a JSONL file (a batch line's body, or {"messages": ...} / {"prompt": ...}), answered by the
    target (greedy): more of the target's own outputs to learn from."""
    prompts: list[Any] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            body = obj.get("body", obj)
            prompts.append(decoder.apply_chat_template(body["messages"]) if "messages" in body else body["prompt"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidParameterError(f"{path}:{n}: expected a JSON object with messages or prompt ({exc})") from exc
    results = decoder.without_speculation().generate(
        prompts, SamplingParams(max_new_tokens=max_new_tokens), batch_size=8
    )
    ids = [list(p) if isinstance(p, list) else decoder.tokenizer.encode(p) for p in prompts]
    return [
        (i, r.token_ids + ([sorted(decoder.eos_ids)[0]] if r.finish_reason == "stop" and decoder.eos_ids else []))
        for i, r in zip(ids, results)
    ]


def split(data: list[Any], seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held out): a seeded shuffle, 10% held out (at least one request when there are two or more)."""
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(HELDOUT * len(data))) if len(data) >= 2 else 0
    return [data[i] for i in order[n_held:]], [data[i] for i in order[:n_held]]


def train_from_pairs(
    decoder: Decoder,
    pairs: list[tuple[list[int], list[int]]],
    opts: TrainOptions,
    bar: Callable[[int, str], Any] | None = None,
) -> TrainedHead:
    """Trains a head for decoder's target on (prompt, output) pairs; bar(total, description) makes a progress
    bar (tqdm-like: update(n), set_postfix_str, close)."""
    if len(pairs) < 2:
        raise InvalidParameterError(f"training a head needs at least 2 completed requests, got {len(pairs)}")
    torch.manual_seed(opts.seed)
    target, device = decoder.target, decoder.device
    train, held = split(pairs, opts.seed)
    seqs = [p + o for p, o in train]
    d2t = choose_vocabulary(seqs, opts.draft_vocab, decoder.eos_ids, decoder.vocab_size)
    head = head_for_target(target, d2t, decoder.target_name, opts.shared_lm_head, opts.layout)
    progress = bar(len(pairs), "target states") if bar else None
    examples = collect_states(
        target,
        [p + o for p, o in train + held],
        device,
        progress.update if progress else None,
        layers=head.config.target_layers,
    )
    if progress:
        progress.close()
    budget = None if opts.max_minutes is None else opts.max_minutes * 60.0
    steps_total = opts.epochs * -(-len(train) // 4)
    progress = bar(steps_total, "training") if bar else None

    def on_step(_step: int, loss: float) -> None:
        if progress:
            progress.update(1)
            progress.set_postfix_str(f"loss {loss:.3f}")

    report = train_head(
        head,
        examples[: len(train)],
        examples[len(train) :],
        epochs=opts.epochs,
        max_seconds=budget,
        seed=opts.seed,
        progress=on_step,
    )
    if progress:
        progress.close()
    accepted, per_step = heldout_acceptance(decoder, head, held, opts)
    return TrainedHead(head, report, len(train), len(held), sum(len(s) - 1 for s in seqs), accepted, per_step)


def heldout_acceptance(
    decoder: Decoder, head: EagleHead, held: list[tuple[list[int], list[int]]], opts: TrainOptions
) -> tuple[float | None, float | None]:
    """The head drafting for the held-out prompts in the real decoder (greedy, fixed draft length): accepted
    draft tokens per step, and tokens per step."""
    if not held:
        return None, None
    from ..loading import build_decoder

    dec = build_decoder(
        decoder.target,
        decoder.tokenizer,
        target_name=decoder.target_name,
        draft=head,
        device=decoder.device,
        num_draft_tokens=opts.num_draft_tokens,
        adaptive=False,
    )
    params = [SamplingParams(max_new_tokens=max(1, min(len(o), opts.measure_tokens))) for _, o in held]
    results = dec.generate([p for p, _ in held], params, batch_size=8)
    steps = sum(r.stats.target_forwards for r in results)
    accepted = sum(r.stats.accepted_tokens for r in results)
    out_tokens = sum(r.stats.output_tokens for r in results)
    return (accepted / steps, out_tokens / steps) if steps else (None, None)


def stored_row(name: str, trained: TrainedHead, jobs: list[str]) -> DraftHead:
    """The `drafters` row: config.json (with the training facts in meta) and the safetensors bytes."""
    from safetensors.torch import save

    head = trained.head
    head.config.meta = {
        "tokens_trained": trained.tokens_trained,
        "train_requests": trained.n_train,
        "heldout_requests": trained.n_heldout,
        "heldout_accepted_length": trained.heldout_accepted_length,
        "heldout_tokens_per_step": trained.heldout_tokens_per_step,
        "heldout_top1": trained.report.top1,
        "steps": trained.report.steps,
        "loss": trained.report.loss,
        "source_jobs": jobs,
    }
    weights = save(stored_tensors(head))
    return DraftHead(
        name=name,
        kind="head",
        target=head.config.target,
        source_jobs=jobs,
        tokens_trained=trained.tokens_trained,
        heldout_accepted_length=trained.heldout_accepted_length,
        config=head.config.to_json(),
        weights=weights,
        sha256=hashlib.sha256(weights).hexdigest(),
    )
