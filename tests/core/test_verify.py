"""Table tests of the pure accept/reject rules (spec_batch.core.verify), with hand-computed distributions,
an exactness check of rejection sampling's marginals on many simulated rows, and the batch glue (verify_input,
verify): shape checks, greedy / one-hot / rejection rows side by side, each row as it would be alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from spec_batch.core.params import SamplingParams
from spec_batch.core.sampling import STREAM_TARGET, exponential_noise
from spec_batch.core.verify import accept_matching, accept_rejection_sampling, verify, verify_input

T = torch.tensor


def _long(rows):
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------- accept_matching (greedy / one-hot drafts)

MATCHING_TABLE = [
    # (name, draft, draft_len, target, accepted, next)
    ("perfect match", [5, 6, 7], 3, [5, 6, 7, 8], 3, 8),
    ("early mismatch", [5, 6, 7], 3, [4, 6, 7, 8], 0, 4),
    ("mid mismatch, later positions agree", [5, 6, 7], 3, [5, 9, 7, 8], 1, 9),
    ("last mismatch", [5, 6, 7], 3, [5, 6, 1, 8], 2, 1),
    ("short draft, padding equals target", [5, 0, 0], 1, [5, 0, 0, 3], 1, 0),
    ("nothing drafted, padding equals target", [0, 0, 0], 0, [0, 0, 0, 3], 0, 0),
]


@pytest.mark.parametrize(
    "name,draft,draft_len,target,want_acc,want_next", MATCHING_TABLE, ids=[r[0] for r in MATCHING_TABLE]
)
def test_accept_matching_table(name, draft, draft_len, target, want_acc, want_next):
    accepted = accept_matching(_long([draft]), _long([draft_len]), _long([target]))
    assert accepted.tolist() == [want_acc]
    assert _long([target])[0, accepted[0]].item() == want_next


def test_accept_matching_mixed_batch_equals_rows_alone():
    drafts = _long([r[1] for r in MATCHING_TABLE])
    lens = _long([r[2] for r in MATCHING_TABLE])
    targets = _long([r[3] for r in MATCHING_TABLE])
    accepted = accept_matching(drafts, lens, targets)
    assert accepted.tolist() == [r[4] for r in MATCHING_TABLE]


def test_accept_matching_empty_draft():
    accepted = accept_matching(torch.zeros(3, 0, dtype=torch.long), _long([0, 0, 0]), _long([[4], [5], [6]]))
    assert accepted.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- accept_rejection_sampling: hand-computed tables

# position 0: target [.4, .3, .2, .1], draft [.1, .6, .1, .2]
#   token 0: ratio 4 (always accepted); token 1: ratio .5; token 3: ratio .5
#   residual max(0, target - draft) = [.3, 0, .1, 0] -> normalized [.75, 0, .25, 0]
#   (softmax of it would be about [.31, .23, .25, .23]: every token possible)
TARGET0 = [0.4, 0.3, 0.2, 0.1]
DRAFT0 = [0.1, 0.6, 0.1, 0.2]
ONES = [1.0, 1.0, 1.0, 1.0]
# this noise picks token 0 from the normalized residual, token 1 from the target itself and 1 or 3 from a softmaxed
# residual: it tells the three apart
SPLIT_NOISE = [1.0, 0.5, 1.0, 0.5]


def _rs1(draft_token, target0, draft0, u, noise0, target1=ONES, noise1=ONES):
    """One row, one draft token. Returns (accepted, next_token)."""
    target = T([[target0, [x / sum(target1) for x in target1]]])  # [1, 2, V]
    acc, nxt = accept_rejection_sampling(
        _long([[draft_token]]), _long([1]), T([[draft0]]), target, T([[u]]), T([[noise0, noise1]])
    )
    return acc.item(), nxt.item()


@pytest.mark.parametrize(
    "name,draft_token,target0,draft0,u,noise0,want_acc,want_next",
    [
        ("ratio > 1 always accepted", 0, TARGET0, DRAFT0, 0.999, ONES, 1, 0),
        ("ratio .5, u below", 1, TARGET0, DRAFT0, 0.49, ONES, 1, 0),
        ("ratio .5, u at the threshold", 1, TARGET0, DRAFT0, 0.5, ONES, 1, 0),
        ("ratio .5, u above: residual, normalized", 1, TARGET0, DRAFT0, 0.51, SPLIT_NOISE, 0, 0),
        ("ratio .5 on token 3, rejected: residual picks 0 not 3", 3, TARGET0, DRAFT0, 0.9, SPLIT_NOISE, 0, 0),
        ("draft prob 0, target > 0: accepted", 0, TARGET0, [0.0, 0.6, 0.2, 0.2], 0.999, ONES, 1, 0),
        ("target prob 0: rejected even with u = 0", 2, [0.5, 0.5, 0.0, 0.0], [0.25] * 4, 0.0, ONES, 0, 0),
        ("target and draft prob 0: rejected", 3, [0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], 0.0, ONES, 0, 0),
    ],
)
def test_rejection_sampling_table(name, draft_token, target0, draft0, u, noise0, want_acc, want_next):
    # bonus distribution (position 1) is one-hot on token 3 so an accepted run is easy to see
    acc, nxt = _rs1(draft_token, target0, draft0, u, noise0, target1=[0.0, 0.0, 0.0, 1.0])
    assert acc == want_acc, name
    if want_acc == 1:
        assert nxt == 3, "after a full accept the bonus comes from the target's next position"
    else:
        assert nxt == want_next, name


def test_rejected_token_is_never_resampled_and_residual_not_softmaxed():
    """Rejecting token 1 at TARGET0/DRAFT0: the token after it is 0 w.p. .75 and 2 w.p. .25, never 1 or 3."""
    n = 20000
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 2, 4).exponential_(generator=gen)
    acc, nxt = accept_rejection_sampling(
        torch.ones(n, 1, dtype=torch.long),
        torch.ones(n, dtype=torch.long),
        T(DRAFT0).expand(n, 1, 4),
        T([TARGET0, ONES]).expand(n, 2, 4) / T([1.0, 4.0]).view(1, 2, 1),
        torch.full((n, 1), 0.99),  # always rejected (ratio .5)
        noise,
    )
    assert (acc == 0).all()
    counts = torch.bincount(nxt, minlength=4)
    assert counts[1] == 0 and counts[3] == 0, counts
    res = stats.chisquare(counts[[0, 2]].numpy(), [0.75 * n, 0.25 * n])
    assert res.pvalue > 1e-3, (counts, res)


def test_zero_residual_falls_back_to_target():
    """draft == target at the rejected position (forced with u > 1): the residual is all zero; sample the target."""
    acc, nxt = _rs1(1, [0.1, 0.7, 0.2, 0.0], [0.1, 0.7, 0.2, 0.0], 1.5, ONES)
    assert acc == 0 and nxt == 1


def test_multi_token_rows():
    V = 4
    target = T(
        [
            [[0.1, 0.6, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]],
        ]
    )  # [1, 4, V]
    draft_probs = T([[[0.1, 0.6, 0.2, 0.1], [0.1, 0.8, 0.05, 0.05], [0.0, 0.0, 0.0, 1.0]]])  # [1, 3, V]
    draft_tokens = _long([[1, 0, 3]])  # ratios: 1, 7, .25
    noise = torch.ones(1, 4, V)
    # u at position 2 above .25: reject the third; residual at 2 = max(0, [.25]*4 - [0,0,0,1]) -> [1/3, 1/3, 1/3, 0]
    noise[0, 2] = T([1.0, 0.5, 1.0, 1.0])  # picks token 1 from the residual
    acc, nxt = accept_rejection_sampling(draft_tokens, _long([3]), draft_probs, target, T([[0.99, 0.99, 0.3]]), noise)
    assert (acc.item(), nxt.item()) == (2, 1)
    # u at position 2 below .25: all accepted, bonus from position 3 (one-hot on 2)
    acc, nxt = accept_rejection_sampling(draft_tokens, _long([3]), draft_probs, target, T([[0.99, 0.99, 0.2]]), noise)
    assert (acc.item(), nxt.item()) == (3, 2)
    # a rejection at position 0 stops there even though later tokens would pass
    target_bad = target.clone()
    target_bad[0, 0] = T([0.9, 0.0, 0.1, 0.0])
    acc, nxt = accept_rejection_sampling(draft_tokens, _long([3]), draft_probs, target_bad, T([[0.0, 0.0, 0.0]]), noise)
    assert acc.item() == 0 and nxt.item() in (0, 2)


def test_empty_draft_samples_the_target():
    target = T([[[0.1, 0.2, 0.3, 0.4]], [[0.4, 0.3, 0.2, 0.1]]])  # [2, 1, V]
    noise = T([[[1.0, 1.0, 1.0, 1.0]], [[1.0, 0.1, 1.0, 1.0]]])
    acc, nxt = accept_rejection_sampling(
        torch.zeros(2, 0, dtype=torch.long), _long([0, 0]), torch.zeros(2, 0, 4), target, torch.zeros(2, 0), noise
    )
    assert acc.tolist() == [0, 0] and nxt.tolist() == [3, 1]


def test_mixed_batch_rows_independent():
    """Rows with drafts of 3, 1, 0 and 2 tokens (padded to 3) give what each gives alone."""
    V = 4
    gen = torch.Generator().manual_seed(5)
    B, k = 4, 3
    target = torch.rand(B, k + 1, V, generator=gen) + 0.05
    target /= target.sum(-1, keepdim=True)
    draft_probs = torch.rand(B, k, V, generator=gen) + 0.05
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    lens = [3, 1, 0, 2]
    draft_tokens = torch.randint(0, V, (B, k), generator=gen)
    for b, n in enumerate(lens):  # padding: placeholder 0 with zero draft probability (what a padded row looks like)
        draft_tokens[b, n:] = 0
        draft_probs[b, n:] = 0.0
    uniforms = torch.rand(B, k, generator=gen)
    noise = torch.empty(B, k + 1, V).exponential_(generator=gen)
    acc, nxt = accept_rejection_sampling(draft_tokens, _long(lens), draft_probs, target, uniforms, noise)
    assert (acc <= _long(lens)).all()
    for b, n in enumerate(lens):
        a1, n1 = accept_rejection_sampling(
            draft_tokens[b : b + 1, :n],
            _long([n]),
            draft_probs[b : b + 1, :n],
            target[b : b + 1, : n + 1],
            uniforms[b : b + 1, :n],
            noise[b : b + 1, : n + 1],
        )
        assert (acc[b].item(), nxt[b].item()) == (a1.item(), n1.item()), b
    # the row that drafted nothing samples the target at position 0, not a residual of padding
    assert acc[2].item() == 0 and nxt[2].item() == int((target[2, 0] / noise[2, 0]).argmax())


# ---------------------------------------------------------------- exactness on many simulated rows


def test_rejection_sampling_marginals_equal_target():
    """Draft tokens drawn from the draft, then verified: each emitted position follows the target exactly.

    Rows are independent simulations (k = 2, V = 6, with zeros on both sides so every guard is exercised).
    The first emitted token ~ target[0]; given it was an accepted draft token, the second ~ target[1];
    given both were accepted, the third (the bonus) ~ target[2]. Chi-square, p > 1e-3, fixed seed.
    """
    n, k, V = 60000, 2, 6
    gen = torch.Generator().manual_seed(11)
    target_rows = T(
        [[0.30, 0.25, 0.20, 0.15, 0.10, 0.00], [0.05, 0.05, 0.10, 0.00, 0.40, 0.40], [0.1, 0.2, 0.3, 0.4, 0.0, 0.0]]
    )
    draft_rows = T([[0.10, 0.10, 0.20, 0.20, 0.10, 0.30], [0.40, 0.30, 0.00, 0.10, 0.10, 0.10]])
    draft_tokens = torch.stack(
        [torch.multinomial(draft_rows[j], n, replacement=True, generator=gen) for j in range(k)], 1
    )
    acc, nxt = accept_rejection_sampling(
        draft_tokens,
        torch.full((n,), k, dtype=torch.long),
        draft_rows.expand(n, k, V),
        target_rows.expand(n, k + 1, V),
        torch.rand(n, k, generator=gen),
        torch.empty(n, k + 1, V).exponential_(generator=gen),
    )
    assert 0 < acc.float().mean() < k  # rejections happen and full accepts happen
    emitted = torch.where(
        torch.arange(k + 1).view(1, -1) < acc.view(-1, 1),
        torch.cat([draft_tokens, draft_tokens[:, :1]], 1),
        nxt.view(-1, 1).expand(-1, k + 1),
    )  # emitted[:, j] is meaningful for j <= acc
    for j in range(k + 1):
        reached = acc >= j
        tokens = emitted[reached, j]
        counts = torch.bincount(tokens, minlength=V).float()
        want = target_rows[j]
        assert counts[want == 0].sum() == 0, (j, counts)
        keep = want > 0
        res = stats.chisquare(counts[keep].numpy(), (want[keep] * counts.sum()).numpy())
        assert res.pvalue > 1e-3, (j, counts, res)


# ---------------------------------------------------------------- the batch glue: verify_input and verify


@dataclass
class Row:
    params: SamplingParams
    seed: int = 0
    n_generated: int = 0


GREEDY = SamplingParams()
CPU = torch.device("cpu")


def test_verify_input_puts_the_last_token_then_the_draft():
    ids, valid = verify_input([5, 7, 9], [[1, 2], [], [3]], placeholder_id=0, device=CPU)
    assert ids.tolist() == [[5, 1, 2], [7, 0, 0], [9, 3, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False], [True, True, False]]
    ids, valid = verify_input([4], [[]], placeholder_id=0, device=CPU)
    assert ids.tolist() == [[4]] and valid.tolist() == [[True]]


def _one_hot_logits(tokens: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Logits whose argmax at row b, position j is tokens[b][j]."""
    logits = torch.zeros(len(tokens), len(tokens[0]), vocab)
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            logits[b, j, t] = 5.0
    return logits


def test_verify_greedy_rows():
    drafts = [[1, 2, 3], [1, 2], [], [4, 4, 4]]
    logits = _one_hot_logits([[1, 2, 3, 6], [1, 5, 0, 0], [7, 0, 0, 0], [3, 0, 0, 0]])
    accepted, nxt = verify([Row(GREEDY)] * 4, drafts, None, logits, placeholder_id=0)
    # all accepted + bonus; a recovered token at position 1; nothing drafted: the bonus; rejected at once
    assert (accepted, nxt) == ([3, 1, 0, 0], [6, 5, 7, 3])


@pytest.mark.parametrize(
    "drafts,probs_shape,logits_shape,message",
    [
        ([[1, 2]], None, (1, 2, 8), r"logits \(1, 2, 8\): expected \[1 rows, 3 = longest draft \+ 1, vocab\]"),
        ([[1], []], None, (1, 2, 8), r"logits \(1, 2, 8\): expected \[2 rows"),
        ([[1, 2]], (1, 1, 8), (1, 3, 8), r"draft_probs \(1, 1, 8\): expected \[1 rows, >= 2 draft positions, 8\]"),
        ([[1, 2]], (1, 2, 9), (1, 3, 8), r"draft_probs vocab 9 != target logits vocab 8"),
    ],
)
def test_verify_checks_shapes(drafts, probs_shape, logits_shape, message):
    rows = [Row(GREEDY) for _ in drafts]
    probs = None if probs_shape is None else torch.full(probs_shape, 1.0 / probs_shape[-1])
    with pytest.raises(AssertionError, match=message):
        verify(rows, drafts, probs, torch.zeros(logits_shape), placeholder_id=0)


def test_verify_one_hot_sampled_row_uses_the_keyed_noise():
    """A sampled row with a one-hot draft: the target's token at each position is the exponential race with the
    noise keyed by (seed, n_generated + position); the draft is accepted while it equals those tokens."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 8, generator=gen)
    row = Row(SamplingParams(temperature=1.0, seed=9), seed=9, n_generated=5)
    probs = logits.softmax(-1)[0]
    race = [int((probs[j] / exponential_noise(9, 5 + j, STREAM_TARGET, 8, CPU)).argmax()) for j in range(4)]
    draft = race[:2] + [(race[2] + 1) % 8]  # two tokens agree, the third does not
    accepted, nxt = verify([row], [draft], None, logits, placeholder_id=0)
    assert (accepted, nxt) == ([2], [race[2]])


def test_verify_mixed_batch_equals_each_row_alone():
    """Greedy rows, one-hot sampled rows and rejection-sampled rows (a drafter with distributions) in one batch,
    drafts of different lengths: each row gets what it gets alone (randomness is keyed by seed and position)."""
    V = 8
    gen = torch.Generator().manual_seed(7)
    sampled = SamplingParams(temperature=0.9, top_k=6, seed=1)
    rows = [
        Row(GREEDY),
        Row(sampled, seed=11, n_generated=3),
        Row(sampled, seed=12),
        Row(GREEDY),
        Row(sampled, seed=13),
    ]
    drafts = [[1, 2, 3], [4, 5], [], [6], [7, 0, 1]]
    k = 3
    logits = torch.randn(len(rows), k + 1, V, generator=gen) * 3
    draft_probs = torch.rand(len(rows), k, V, generator=gen) + 0.01
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    for with_probs in (None, draft_probs):
        accepted, nxt = verify(rows, drafts, with_probs, logits, placeholder_id=0)
        for b, (row, d) in enumerate(zip(rows, drafts)):
            alone_probs = None if with_probs is None else with_probs[b : b + 1, : len(d)]
            alone = verify([row], [d], alone_probs, logits[b : b + 1, : len(d) + 1], placeholder_id=0)
            assert (accepted[b], nxt[b]) == (alone[0][0], alone[1][0]), (b, with_probs is None)
            assert accepted[b] <= len(d)
