"""The learned head drafter (core/heads/head.py, core/heads/head_drafter.py) on tiny random models: its outputs are exactly the
target's (greedy token for token against `none` and Hugging Face at batch 1 and 8, sampling by chi-square with the
head's own reduced-vocabulary distributions, under a grammar too), its cache rolls back with the target's, and
a head made for another target is refused."""

from __future__ import annotations

import pytest
import torch
from test_decoder import N_NEW, PROMPTS, _chisquare, _exact_sequence_probs, check_stats

from spec_batch import SamplingParams
from spec_batch.core.heads.head import EagleHead, HeadConfig, head_for_target, init_from_target, round_to_storage
from spec_batch.core.heads.head_drafter import HeadDrafter
from spec_batch.errors import IncompatibleModelsError
from spec_batch.loading import build_decoder
from spec_batch.loading.heads import load_head, save_head
from spec_batch.loading.quant_linear import Int8Linear

CPU = torch.device("cpu")


def random_head(target, draft_vocab: int, seed: int = 0, name: str = "tiny") -> EagleHead:
    """A head for target over `draft_vocab` evenly spaced token ids (a reduced vocabulary that is not a prefix),
    started from the target's LM head rows as training starts it."""
    torch.manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    d2t = torch.arange(0, vocab, max(1, vocab // draft_vocab))[:draft_vocab]
    head = EagleHead(HeadConfig.for_target(target.config, len(d2t), name))
    init_from_target(head, target, d2t)
    return head.eval()


@pytest.fixture(scope="module")
def head_decoders(tiny_target, fake_tokenizer):
    head = random_head(tiny_target, 48)

    def make(**kw):
        return build_decoder(
            tiny_target, fake_tokenizer, target_name="tiny", draft=head, device=CPU, num_draft_tokens=4, **kw
        )

    return {
        "head": make(),
        "head-fixed": make(adaptive=False),
        "head-full": make(draft_weights="full"),
        "none": make().without_speculation(),
    }


@pytest.fixture(scope="module")
def greedy_refs(tiny_target, hf_greedy):
    return [hf_greedy(tiny_target, p, N_NEW) for p in PROMPTS]


@pytest.mark.parametrize("name", ["head", "head-fixed", "head-full"])
@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_greedy_head_equals_none_and_hf(head_decoders, greedy_refs, name, batch_size):
    params = SamplingParams(max_new_tokens=N_NEW)
    results = head_decoders[name].generate(PROMPTS * 2, params, batch_size=batch_size)  # more rows than a batch
    plain = head_decoders["none"].generate(PROMPTS * 2, params, batch_size=batch_size)
    for prompt, ref, res, base in zip(PROMPTS * 2, greedy_refs * 2, results, plain):
        assert res.token_ids == ref == base.token_ids
        check_stats(res, len(prompt))
    if name == "head-fixed":
        assert sum(r.stats.draft_tokens for r in results) > 0 and sum(r.stats.accepted_tokens for r in results) > 0


@pytest.mark.parametrize("weights", ["full", "int8"])
def test_every_draft_reads_exactly_the_accepted_states(tiny_target, fake_tokenizer, weights):
    """Each step's first draft distribution equals that of one uncached pass of the drafting head (int8: the
    quantized copy) over the row's real pairs (the target's hidden state at t from a plain forward over the row's
    tokens, token t+1): the cache holds every accepted position's real state, and no predicted entry of a rejected
    (or accepted) draft survives a step. Batch 3 with rows joining and leaving, a 1-token prompt (no state until
    its first step) among them; sampled rows (greedy rows draft argmaxes and carry no distributions)."""
    head = random_head(tiny_target, 32, seed=5)
    dec = build_decoder(
        tiny_target,
        fake_tokenizer,
        target_name="tiny",
        draft=head,
        device=CPU,
        num_draft_tokens=4,
        adaptive=False,
        draft_weights=weights,
    )
    seen: list[tuple[list[int], torch.Tensor]] = []
    drafting: list[EagleHead] = []
    real = HeadDrafter.propose

    def spy(self, rows, k):
        draft = real(self, rows, k)
        drafting.append(self.head)
        seen.extend((list(r.tokens), draft.probs[b, 0]) for b, r in enumerate(rows) if k[b] > 0)
        return draft

    HeadDrafter.propose = spy
    try:
        dec.generate(
            PROMPTS,
            [SamplingParams(max_new_tokens=10, temperature=1.0, seed=i) for i in range(len(PROMPTS))],
            batch_size=3,
        )
    finally:
        HeadDrafter.propose = real
    assert len(seen) > 10
    (used,) = set(drafting)
    assert (used is head) == (weights == "full")
    assert any(isinstance(m, Int8Linear) for m in used.modules()) == (weights == "int8")
    with torch.inference_mode():
        for tokens, probs in seen:
            ids = torch.tensor([tokens])
            states = tiny_target(input_ids=ids, output_hidden_states=True).hidden_states[-1]  # [1, L, H] post-norm
            out = used(ids[:, 1:], states[:, :-1])  # pairs (state t, token t+1), one causal pass
            want = torch.full((64,), float("-inf")).index_copy_(0, head.d2t, out.logits[0, -1]).softmax(-1)
            torch.testing.assert_close(probs, want, atol=1e-5, rtol=1e-4)


def test_greedy_rows_draft_the_heads_argmax_without_distributions(tiny_target, fake_tokenizer):
    """A batch of greedy rows without bias, penalties or grammar drafts the head's argmax over its own vocabulary,
    mapped to the target's ids, and carries no distributions (the verifier compares argmaxes)."""
    head = random_head(tiny_target, 32, seed=5)
    dec = build_decoder(
        tiny_target,
        fake_tokenizer,
        target_name="tiny",
        draft=head,
        device=CPU,
        num_draft_tokens=1,
        adaptive=False,
        draft_weights="full",
    )
    seen: list[tuple[list[int], int, torch.Tensor | None]] = []
    real = HeadDrafter.propose

    def spy(self, rows, k):
        draft = real(self, rows, k)
        seen.extend((list(r.tokens), draft.tokens[b][0], draft.probs) for b, r in enumerate(rows) if draft.tokens[b])
        return draft

    HeadDrafter.propose = spy
    try:
        dec.generate(PROMPTS, SamplingParams(max_new_tokens=8), batch_size=3)
    finally:
        HeadDrafter.propose = real
    assert len(seen) > 10
    with torch.inference_mode():
        for tokens, drafted, probs in seen:
            assert probs is None
            ids = torch.tensor([tokens])
            states = tiny_target(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            logits = head(ids[:, 1:], states[:, :-1]).logits[0, -1]
            assert drafted == int(head.d2t[logits.argmax()]) and drafted in head.d2t.tolist()


@pytest.fixture(scope="module")
def sharp_target(tiny_llama):
    return tiny_llama(11, vocab=8, layers=2, lm_head_scale=10.0)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)], ids=["t1", "t0.8"])
def test_sampled_sequences_follow_the_target_distribution(sharp_target, fake_tokenizer, kw):
    """Rejection sampling with the head's own distribution (6 of 8 tokens: q = 0 on the others, which only the
    residual can produce) gives the target's sequence distribution."""
    head = random_head(sharp_target, 6, seed=1, name="sharp")
    with torch.no_grad():
        head.lm_head.weight.mul_(3.0)  # a confident head: drafts that are often wrong
    dec = build_decoder(
        sharp_target, fake_tokenizer, target_name="sharp", draft=head, device=CPU, num_draft_tokens=3, adaptive=False
    )
    prompt, n, n_tokens = [1, 2, 3], 3000, 3
    params = [SamplingParams(max_new_tokens=n_tokens, seed=20_000 + i, **kw) for i in range(n)]
    results = dec.generate([prompt] * n, params, batch_size=256)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    exact = _exact_sequence_probs(
        sharp_target, prompt, n_tokens, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0)
    )
    assert not {s for s in counts if exact[s] == 0}
    assert _chisquare(counts, exact, n).pvalue > 1e-3
    drafted, accepted = sum(r.stats.draft_tokens for r in results), sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted, "the test needs both accepted and rejected draft tokens"
    outside = {t for s in counts for t in s if t not in set(head.d2t.tolist())}
    assert outside, "tokens outside the draft vocabulary must still be produced (by the residual)"


def test_save_load_round_trip_and_refusal(tiny_target, tiny_llama, tmp_path, fake_tokenizer):
    head = random_head(tiny_target, 32, seed=2)
    loaded = load_head(save_head(head, tmp_path / "h"))
    assert loaded.config.target == "tiny" and torch.equal(loaded.d2t, head.d2t)
    round_to_storage(head)  # weights are stored in bfloat16: what comes back is the head rounded to it
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert not any("embed" in k for k in loaded.state_dict())  # the target's embedding is never stored
    other_vocab = tiny_llama(1, vocab=80, layers=2)
    with pytest.raises(IncompatibleModelsError, match="vocabulary"):
        build_decoder(other_vocab, fake_tokenizer, target_name="tiny", draft=loaded, device=CPU)
    with pytest.raises(IncompatibleModelsError, match="trained on another target"):
        build_decoder(tiny_target, fake_tokenizer, target_name="other", draft=loaded, device=CPU)


def test_a_trained_heads_lm_head_is_the_targets_rows_and_is_not_stored(
    tiny_target, fake_tokenizer, tmp_path, hf_greedy
):
    """head_for_target's default: the target's LM head rows of the draft vocabulary, frozen, read from the target
    (rebuilt at the head's dtype), never saved; the saved head is the decoder layer and fc in bfloat16."""
    d2t = torch.arange(0, 64, 3)
    head = head_for_target(tiny_target, d2t, "tiny")
    assert head.lm_head is None and not any(k.startswith("lm_head") for k in head.state_dict())
    assert not any(p is head._lm_head().weight for p in head.parameters())  # frozen: not the head's parameter
    target_rows = tiny_target.get_output_embeddings().weight[d2t]
    assert torch.equal(head._lm_head().weight, target_rows) and not head._lm_head().weight.requires_grad
    assert head.to(torch.bfloat16)._lm_head().weight.dtype == torch.bfloat16
    head.float()
    path = save_head(head, tmp_path / "shared")
    from safetensors.torch import load_file

    stored = load_file(str(path / "model.safetensors"))
    assert not any(k.startswith("lm_head") for k in stored)
    assert {v.dtype for v in stored.values()} == {torch.bfloat16, torch.long}  # d2t stays an index
    loaded = load_head(path)
    assert loaded.config.shared_lm_head and loaded.lm_head is None
    dec = build_decoder(tiny_target, fake_tokenizer, target_name="tiny", draft=loaded, device=CPU, adaptive=False)
    results = dec.generate(PROMPTS, SamplingParams(max_new_tokens=N_NEW), batch_size=2)
    assert [r.token_ids for r in results] == [hf_greedy(tiny_target, p, N_NEW) for p in PROMPTS]
    assert sum(r.stats.draft_tokens for r in results) > 0


# ---------------------------------------------------------------- under a grammar


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_constrained_equals_hf_with_the_mask(tiny_target, byte_tokenizer, batch_size):
    import test_grammar_decoding as g

    dec = build_decoder(
        tiny_target,
        byte_tokenizer,
        target_name="tiny",
        draft=random_head(tiny_target, 40),
        device=CPU,
        num_draft_tokens=4,
        adaptive=False,
    )
    prompts = [p for _ in g.FORMATS for p in g.PROMPTS]
    params = [SamplingParams(max_new_tokens=g.N_NEW, response_format=f) for f in g.FORMATS.values() for _ in g.PROMPTS]
    results = dec.generate(prompts, params, batch_size=batch_size)
    for res, p, prompt in zip(results, params, prompts):
        assert res.token_ids == g.hf_constrained_greedy(tiny_target, byte_tokenizer, prompt, g.N_NEW, p.response_format)
    assert sum(r.stats.draft_tokens - r.stats.forced_tokens for r in results) > 0


def test_sampled_choices_follow_the_masked_distribution(tiny_llama, byte_tokenizer):
    import test_grammar_decoding as g

    target = tiny_llama(21, vocab=64, layers=2, lm_head_scale=4.0)
    head = random_head(target, 48, seed=4)
    dec = build_decoder(
        target, byte_tokenizer, target_name="tiny", draft=head, device=CPU, num_draft_tokens=4, adaptive=False
    )
    prompt, n = [45, 56, 46, 5], 2000
    params = [
        SamplingParams(max_new_tokens=8, seed=70_000 + i, response_format=g.CHOICE, temperature=1.0) for i in range(n)
    ]
    results = dec.generate([prompt] * n, params, batch_size=128)
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    exact = g.exact_paths(target, byte_tokenizer, prompt, g.CHOICE, 1.0, 0, 1.0)
    assert not set(counts) - set(exact)
    assert _chisquare(counts, exact, n).pvalue > 1e-3
    drafted, accepted = sum(r.stats.draft_tokens for r in results), sum(r.stats.accepted_tokens for r in results)
    assert 0 < accepted < drafted


# ---------------------------------------------------------------- hybrid: suffix where confident, the head elsewhere


def _hybrid(target, tokenizer, threshold: float = 0.5, **kw):
    from spec_batch.loading.heads import HybridHead

    return build_decoder(
        target,
        tokenizer,
        target_name="tiny",
        draft=HybridHead(random_head(target, 48), threshold),
        device=CPU,
        num_draft_tokens=4,
        adaptive=False,
        **kw,
    )


@pytest.mark.parametrize("batch_size", [1, 8])
def test_hybrid_greedy_equals_hf(tiny_target, fake_tokenizer, greedy_refs, batch_size):
    drafters = []
    real = _hybrid(tiny_target, fake_tokenizer)
    dec = real.with_drafter(lambda: drafters.append(real.drafter_factory()) or drafters[-1])
    results = dec.generate(PROMPTS * 2, SamplingParams(max_new_tokens=N_NEW), batch_size=batch_size)
    assert [r.token_ids for r in results] == greedy_refs * 2
    assert sum(d.suffix_steps for d in drafters) > 0 and sum(d.head_steps for d in drafters) > 0  # both drafted


@pytest.mark.parametrize("width", [1, 3])
def test_hybrid_trees_mix_copied_chains_and_head_trees_and_equal_hf(tiny_target, fake_tokenizer, greedy_refs, width):
    """At batch 2 with trees allowed for 2 rows, one row may copy (its suffix chain as a tree) while the other
    drafts the head's tree, in one verify step; width 1: chains (HybridDrafter.propose), as at larger batches."""
    drafters = []
    real = _hybrid(tiny_target, fake_tokenizer, tree_width=width)
    dec = real.with_drafter(lambda: drafters.append(real.drafter_factory()) or drafters[-1])
    dec.policy.tree_batch = 2
    results = dec.generate(PROMPTS * 2, SamplingParams(max_new_tokens=N_NEW), batch_size=2)
    assert [r.token_ids for r in results] == greedy_refs * 2
    assert sum(d.suffix_steps for d in drafters) > 0 and sum(d.head_steps for d in drafters) > 0  # both drafted
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_hybrid_sampling_follows_the_target_distribution(sharp_target, fake_tokenizer):
    """Rows switch between one-hot suffix drafts and the head's distributions; sampled sequences stay exact."""
    from spec_batch.loading.heads import HybridHead

    dec = build_decoder(
        sharp_target,
        fake_tokenizer,
        target_name="sharp",
        device=CPU,
        num_draft_tokens=3,
        draft=HybridHead(random_head(sharp_target, 6, seed=1, name="sharp"), 0.3),
        adaptive=False,
    )
    prompt, n = [1, 2, 3, 1, 2, 3, 1, 2], 3000
    results = dec.generate(
        [prompt] * n,
        [SamplingParams(max_new_tokens=3, seed=30_000 + i, temperature=1.0) for i in range(n)],
        batch_size=256,
    )
    counts: dict[tuple[int, ...], int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    exact = _exact_sequence_probs(sharp_target, prompt, 3, 1.0, 0, 1.0)
    assert _chisquare(counts, exact, n).pvalue > 1e-3
    assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.draft_tokens for r in results)


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("batch_size", [1, 2])
def test_greedy_tree_equals_none_and_hf(tiny_target, fake_tokenizer, head_decoders, greedy_refs, width, batch_size):
    decoder = build_decoder(
        tiny_target,
        fake_tokenizer,
        target_name="tiny",
        draft=random_head(tiny_target, 48),
        device=CPU,
        num_draft_tokens=4,
        adaptive=False,
        tree_width=width,
    )
    decoder.policy.tree_batch = batch_size
    params = SamplingParams(max_new_tokens=N_NEW)
    results = decoder.generate(PROMPTS * 2, params, batch_size=batch_size)
    for prompt, ref, res in zip(PROMPTS * 2, greedy_refs * 2, results):
        assert res.token_ids == ref
        check_stats(res, len(prompt))
    assert sum(r.stats.draft_tokens for r in results) > 0 and sum(r.stats.accepted_tokens for r in results) > 0
