"""Training a draft head (core/heads/head.py) by self-distillation from the target's own outputs, as EAGLE does: the
target runs once over each prompt + output (the hidden states are kept), then the head learns, for every
position t, to predict the target's next hidden state f_{t+1} from (f_t, token t+1) (smooth L1, "feature
regression") and the token after it (cross-entropy over the draft vocabulary). No I/O: the jobs layer
(spec_batch/jobs/head_training.py) reads the history and stores the result.

An EAGLE-3 head (layout "eagle3", arXiv 2503.01840) reads the target's low, middle and high states and predicts
no state: it learns the tokens only, with training-time test. Drafting feeds it its own output at every depth
after the first, so training runs it that way too: TTT_STEPS passes, pass j feeding position u the previous
pass's output at u - 1 and attending as drafting does (the real entries up to u - j, then the chain's own).

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

from .head import EagleHead, HeadOutput, round_to_storage
from .hidden import capture_hidden

CE_WEIGHT = 0.1  # EAGLE's weighting: the regression carries the signal, the token loss aligns the argmax
TTT_STEPS = 3  # EAGLE-3's training-time test: draft depths trained on the head's own outputs (SpecForge trains 7)
TTT_DECAY = 0.8  # depth j's loss weighs TTT_DECAY ** j (EAGLE-3's weighting): the first token matters most
NOISE = 0.05  # uniform noise on input states (x their std): drafting feeds the head its own, imperfect states
MAX_LEN = 1024  # tokens of one sequence the target reads (longer ones are cut; a head needs no long context)


@dataclass
class Example:
    ids: torch.Tensor  # [L] prompt + output tokens
    # [L, W] the target's states the head reads at each position (stored in half precision): the last hidden
    # state (W = H), or an EAGLE-3 head's layers side by side
    states: torch.Tensor


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


def collect_states(
    target,
    sequences: Sequence[Sequence[int]],
    device: torch.device,
    progress: Callable[[int], None] | None = None,
    layers: Sequence[int] | None = None,
) -> list[Example]:
    """One target forward per sequence, keeping its last hidden states (the final norm's output), or with
    `layers` (an EAGLE-3 head's target_layers) those layers' states side by side."""
    out = []
    with torch.inference_mode(), capture_hidden(target, True, layers or None) as captured:
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
    if head.config.layout == "eagle3":
        return _ttt_loss(head, batch)
    ids, feats, want, labels, valid = batch
    if noise:
        scale = feats.std() * noise
        feats = feats + (torch.rand(feats.shape, generator=gen, device=feats.device) - 0.5) * 2 * scale
    out = head(ids, feats, attention_mask=valid)
    mask = valid.bool()
    reg = F.smooth_l1_loss(out.features[mask], want[mask])
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return reg + CE_WEIGHT * ce, out.logits


def _ttt_mask(n: int, step: int, device: torch.device) -> torch.Tensor:
    """[n, (step + 1) * n] bool: at pass `step`, position u sees pass 0's (real) entries up to u - step and pass
    i's entry at u - step + i (i = 1..step: the chain drafted from u - step, itself last), as a draft of depth
    step + 1 sees the row's cache and its own ancestors (core/heads/head_drafter.py)."""
    u = torch.arange(n, device=device)
    mask = torch.zeros(n, (step + 1) * n, dtype=torch.bool, device=device)
    mask[:, :n] = u.unsqueeze(0) <= (u - step).unsqueeze(1)
    for i in range(1, step + 1):
        at = u - step + i
        ok = at >= 0
        mask[u[ok], i * n + at[ok]] = True
    return mask


class _PassCache:
    """The keys and values of every pass so far, side by side (what a pass's attention reads: _ttt_mask)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor, _layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def ttt_passes(head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, steps: int = TTT_STEPS) -> list[HeadOutput]:
    """EAGLE-3's training-time test over right-padded rows: pass 0 reads the target's states (feats); pass j feeds
    position u the previous pass's output at u - 1 with the real token u + 1, attending as a draft of depth j + 1
    from u - j does (_ttt_mask). Pass j's logits at u predict token u + 2, as pass 0's do."""
    b, n = ids.shape
    positions = torch.arange(n, device=ids.device).expand(b, n)
    cache, state, out = _PassCache(), feats, []
    for step in range(min(steps, n)):
        mask = _ttt_mask(n, step, ids.device).expand(b, 1, n, (step + 1) * n)
        out.append(head(ids, state, attention_mask=mask, position_ids=positions, past_key_values=cache, raw=step == 0))
        state = torch.cat([torch.zeros_like(out[-1].features[:, :1]), out[-1].features[:, :-1]], dim=1)
    return out


def _ttt_loss(head: EagleHead, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of every TTT pass (no state regression: an EAGLE-3 head predicts none), pass j weighted
    TTT_DECAY ** j. Returns (loss, pass 0's logits)."""
    ids, feats, _, labels, _ = batch
    passes = ttt_passes(head, ids, feats)
    total = ids.new_zeros((), dtype=torch.float32)
    for step, out in enumerate(passes):
        want = labels.clone()
        want[:, :step] = -100  # a chain of depth step + 1 starts at u - step >= 0
        if (want != -100).any():
            total = total + TTT_DECAY**step * F.cross_entropy(
                out.logits.flatten(0, 1), want.flatten(), ignore_index=-100
            )
    return total, passes[0].logits


def train_head(
    head: EagleHead,
    train: Sequence[Example],
    heldout: Sequence[Example],
    *,
    epochs: int = 8,
    max_seconds: float | None = None,
    seed: int = 0,
    lr: float = 2e-3,
    batch_size: int = 4,
    progress: Callable[[int, float], None] | None = None,
) -> TrainReport:
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
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
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
    return TrainReport(
        steps, tokens, sum(losses) / max(1, len(losses)), heldout_top1(head, heldout, t2d), time.monotonic() - start
    )


def heldout_top1(head: EagleHead, examples: Sequence[Example], t2d: torch.Tensor) -> float | None:
    """How often the head's argmax from the target's real states is the next token (the first draft token's
    greedy acceptance, teacher-forced)."""
    if not examples:
        return None
    device, hits, total = head.device, 0, 0
    with torch.inference_mode():
        for e in examples:
            ids, feats, _, _labels, valid = _batch([e], t2d, device)
            pred = head(ids, feats, attention_mask=valid).logits.argmax(-1)
            real = e.ids[2:].to(device)
            hits += int((head.d2t[pred[0, : len(real)]] == real).sum())
            total += len(real)
    return hits / max(1, total)
