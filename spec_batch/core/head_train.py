"""Training a draft head (core/head.py) by self-distillation from the target's own outputs, as EAGLE does: the
target runs once over each prompt + output (the hidden states are kept), then the head learns, for every
position t, to predict the target's next hidden state f_{t+1} from (f_t, token t+1) (smooth L1, "feature
regression") and the token after it (cross-entropy over the draft vocabulary). No I/O: the jobs layer
(spec_batch/jobs/head_training.py) reads the history and stores the result.

The draft vocabulary (FR-Spec, arXiv 2502.14856) is the training data's most frequent tokens plus the EOS ids:
the head's LM head then costs a fraction of the target's, and a token outside it is simply never drafted
(rejection sampling stays exact: q = 0 there).
"""
from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .head import EagleHead, round_to_storage
from .hidden import capture_hidden

CE_WEIGHT = 0.1  # EAGLE's weighting: the regression carries the signal, the token loss aligns the argmax
NOISE = 0.05  # uniform noise on input states (x their std): drafting feeds the head its own, imperfect states
MAX_LEN = 1024  # tokens of one sequence the target reads (longer ones are cut; a head needs no long context)


@dataclass
class Example:
    ids: torch.Tensor  # [L] prompt + output tokens
    states: torch.Tensor  # [L, H] the target's last hidden state at each position (stored in half precision)


@dataclass
class TrainReport:
    steps: int
    tokens: int  # positions trained on, over all epochs
    loss: float  # the last epoch's mean
    top1: float | None  # held-out: how often the head's argmax from the target's real state is the next token
    seconds: float


def choose_vocabulary(sequences: Iterable[Sequence[int]], size: int, always: Iterable[int], vocab: int) -> torch.Tensor:
    """d2t: the `size` most frequent tokens (ties: lower id first) plus `always` (EOS), sorted by id."""
    counts = Counter(t for seq in sequences for t in seq)
    keep = set(t for t in always if 0 <= t < vocab)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= size:
            break
        keep.add(tok)
    return torch.tensor(sorted(keep), dtype=torch.long)


def collect_states(target, sequences: Sequence[Sequence[int]], device: torch.device,
                   progress: Callable[[int], None] | None = None) -> list[Example]:
    """One target forward per sequence, keeping its last hidden states (the final norm's output)."""
    out = []
    with torch.inference_mode(), capture_hidden(target, True) as captured:
        for seq in sequences:
            ids = torch.tensor([list(seq)[:MAX_LEN]], dtype=torch.long, device=device)
            target(input_ids=ids, logits_to_keep=1)
            out.append(Example(ids[0].cpu(), captured.pop()[0].to("cpu", torch.float16)))
            if progress is not None:
                progress(1)
    return out


def _batch(examples: Sequence[Example], t2d: torch.Tensor, device: torch.device):
    """Right-padded training tensors: inputs (token t+1, state t), targets (state t+1, draft id of token t+2)."""
    n = max(len(e.ids) for e in examples) - 1
    hidden = examples[0].states.shape[1]
    ids = torch.zeros(len(examples), n, dtype=torch.long)
    feats = torch.zeros(len(examples), n, hidden)
    want = torch.zeros(len(examples), n, hidden)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    valid = torch.zeros(len(examples), n, dtype=torch.long)
    for b, e in enumerate(examples):
        m = len(e.ids) - 1
        ids[b, :m], feats[b, :m], want[b, :m] = e.ids[1:], e.states[:-1].float(), e.states[1:].float()
        labels[b, : m - 1] = t2d[e.ids[2:]]
        valid[b, :m] = 1
    return tuple(x.to(device) for x in (ids, feats, want, labels, valid))


def _loss(head: EagleHead, batch, noise: float, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    ids, feats, want, labels, valid = batch
    if noise:
        scale = feats.std() * noise
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device) - 0.5) * 2 * scale
    out = head(ids, feats, attention_mask=valid)
    mask = valid.bool()
    reg = F.smooth_l1_loss(out.features[mask], want[mask])
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return reg + CE_WEIGHT * ce, out.logits


def train_head(head: EagleHead, train: Sequence[Example], heldout: Sequence[Example], *, epochs: int = 8,
               max_seconds: float | None = None, seed: int = 0, lr: float = 2e-3, batch_size: int = 4,
               progress: Callable[[int, float], None] | None = None) -> TrainReport:
    """Trains head in place (its d2t fixed), on the device of its parameters, then rounds it to the precision it is
    stored in; deterministic for a seed (CPU).
    lr: 2e-3 taught the default model's head best of 5e-4, 2e-3 and 5e-3 on 58 templated notices (held-out top-1).
    progress(steps done, loss) after each step. Stops after `epochs` or `max_seconds`."""
    device = head.device
    t2d = torch.full((head.config.vocab_size,), -100, dtype=torch.long)
    t2d[head.d2t.cpu()] = torch.arange(len(head.d2t))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = epochs * math.ceil(len(train) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    start, steps, tokens, losses = time.monotonic(), 0, 0, [0.0]
    head.train()
    for _ in range(epochs):
        order = torch.randperm(len(train), generator=gen).tolist()
        losses = []
        for i in range(0, len(order), batch_size):
            batch = _batch([train[j] for j in order[i : i + batch_size]], t2d, device)
            loss, _ = _loss(head, batch, NOISE, noise_gen)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            steps, tokens = steps + 1, tokens + int(batch[4].sum())
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(steps, losses[-1])
            if max_seconds is not None and time.monotonic() - start > max_seconds:
                break
        if max_seconds is not None and time.monotonic() - start > max_seconds:
            break
    head.eval()
    round_to_storage(head)  # what is measured from here on (held-out top-1, accepted length) is the stored head
    return TrainReport(steps, tokens, sum(losses) / max(1, len(losses)), heldout_top1(head, heldout, t2d),
                       time.monotonic() - start)


def heldout_top1(head: EagleHead, examples: Sequence[Example], t2d: torch.Tensor) -> float | None:
    """How often the head's argmax from the target's real states is the next token (the first draft token's
    greedy acceptance, teacher-forced)."""
    if not examples:
        return None
    device, hits, total = head.device, 0, 0
    with torch.inference_mode():
        for e in examples:
            ids, feats, _, labels, valid = _batch([e], t2d, device)
            pred = head(ids, feats, attention_mask=valid).logits.argmax(-1)
            real = e.ids[2:].to(device)
            hits += int((head.d2t[pred[0, : len(real)]] == real).sum())
            total += len(real)
    return hits / max(1, total)
