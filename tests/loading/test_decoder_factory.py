"""Decoders from model names (spec_batch.loading.factory): the per-process cache of models and decoders, and the
oracle that a loaded default model decodes exactly as Hugging Face's own greedy generate does."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from spec_batch import SamplingParams
from spec_batch.errors import InvalidParameterError
from spec_batch.loading import clear_cache, factory, load_decoder, shared_decoder, shared_model


@pytest.fixture(autouse=True)
def _empty_cache():
    clear_cache()
    yield
    clear_cache()


def _in_threads(n: int, work) -> list[Any]:
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return results


# ------------------------------------------------------------------ models


def test_concurrent_first_loads_convert_once_and_share_one_model(tiny_gguf, tmp_path, conversions):
    results = _in_threads(4, lambda: shared_model(tiny_gguf, cache_dir=tmp_path))
    assert len(conversions) == 1
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_shared_model_keys_on_resolved_device_and_dtype(tiny_dir):
    a = shared_model(tiny_dir)
    assert shared_model(str(tiny_dir), device=torch.device("cpu"), dtype="float32") is a
    b = shared_model(tiny_dir, dtype="bfloat16")
    assert b is not a and b.model.dtype == torch.bfloat16 and a.model.dtype == torch.float32
    clear_cache()
    assert shared_model(tiny_dir) is not a


# ------------------------------------------------------------------ decoders


def test_shared_decoder_is_one_per_configuration_over_shared_models(tiny_dir):
    a = shared_decoder(str(tiny_dir), "suffix")
    assert shared_decoder(tiny_dir, device=torch.device("cpu"), dtype="float32", num_draft_tokens=16) is a
    assert a.policy.k_max == 16  # the suffix drafter's own default
    assert (a.target_name, a.draft_name) == (str(tiny_dir), "suffix")
    others = [
        shared_decoder(tiny_dir, "none"),
        shared_decoder(tiny_dir, "ngram", num_draft_tokens=4),
        shared_decoder(tiny_dir, "suffix", num_draft_tokens=8),
        shared_decoder(tiny_dir, "ngram", adaptive=False),
    ]
    assert len({id(d) for d in [a, *others]}) == 5
    assert [d.policy.k_max for d in others] == [0, 4, 8, 8]  # `none` never drafts; ngram's default is the core's
    assert all(d.target is a.target for d in others)  # one loaded target model under all of them
    # a tree width only a head uses is no configuration of its own for the others (and is still checked)
    assert shared_decoder(tiny_dir, "suffix", tree_width=3) is a
    with pytest.raises(InvalidParameterError, match="tree_width must be a whole number"):
        shared_decoder(tiny_dir, "suffix", tree_width=0)
    with_draft = shared_decoder(tiny_dir, tiny_dir)  # a draft model: itself, loaded once as well
    assert with_draft.draft_name == str(tiny_dir) and with_draft.target is a.target
    clear_cache()
    again = shared_decoder(tiny_dir, "ngram")
    assert again is not a and again.target is not a.target


def test_shared_decoder_loads_once_under_concurrency_and_does_not_cache_failures(monkeypatch):
    calls: list[tuple] = []

    def slow_load(*args: Any, **kwargs: Any) -> object:
        calls.append((args, kwargs))
        time.sleep(0.05)  # a wide window for a race
        if args[0] == "broken":
            raise RuntimeError("no such model")
        return object()

    monkeypatch.setattr(factory, "load_decoder", slow_load)
    results = _in_threads(4, lambda: shared_decoder("some-model", "ngram"))
    assert len(calls) == 1 and all(r is results[0] for r in results)
    assert calls[0] == (
        ("some-model", "ngram", torch.device("cpu"), torch.float32),
        {
            "num_draft_tokens": 8,
            "adaptive": True,
            "ngram_min": 1,
            "ngram_max": 3,
            "drafter_options": None,
            "cache_dir": None,
            "trust_remote_code": False,
            "weights": "full",
            "draft_weights": "full",  # resolved, as the spec holds them: the key and the load are one value
            "tree_width": 1,
        },
    )
    for _ in range(2):
        with pytest.raises(RuntimeError, match="no such model"):
            shared_decoder("broken")
    assert len(calls) == 3


def test_shared_decoder_takes_names_only(tiny_llama):
    with pytest.raises(InvalidParameterError, match="target is a LlamaForCausalLM.*build_decoder or load_decoder"):
        shared_decoder(tiny_llama(1))


def test_drafter_options_reach_the_suffix_drafter_and_are_checked(tiny_target, fake_tokenizer):
    from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
    from spec_batch.loading import build_decoder

    def build(draft: str, options: dict) -> Any:
        return build_decoder(
            tiny_target,
            fake_tokenizer,
            target_name="tiny",
            draft=draft,
            device=torch.device("cpu"),
            drafter_options=options,
        )

    drafter = build("suffix", {"max_spec_factor": 3.0, "min_token_prob": 0.2}).drafter_factory()
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.max_spec_factor, drafter.min_token_prob) == (3.0, 0.2)
    with pytest.raises(InvalidParameterError, match=r"unknown drafter_options \['depth'\]"):
        build("suffix", {"depth": 3})
    with pytest.raises(InvalidParameterError, match="max_spec_factor must be > 0, got -1"):
        build("suffix", {"max_spec_factor": -1})
    with pytest.raises(InvalidParameterError, match="options of the 'suffix' drafter, not of 'ngram'"):
        build("ngram", {"max_spec_factor": 2})


def test_draft_weights_of_build_decoder_apply_to_heads_only(tiny_target, fake_tokenizer):
    """build_decoder's models are loaded already: draft_weights there chooses how a head drafts; for any other draft
    only full / auto (any case) pass, and int8 or a name that is no choice at all is refused."""
    from spec_batch.loading import build_decoder

    def build(weights: str | None) -> Any:
        return build_decoder(
            tiny_target,
            fake_tokenizer,
            target_name="tiny",
            draft="suffix",
            device=torch.device("cpu"),
            draft_weights=weights,
        )

    for ok in (None, "auto", "full", "FULL"):
        build(ok)
    with pytest.raises(InvalidParameterError, match="applies here to a head"):
        build("int8")
    with pytest.raises(InvalidParameterError, match="not supported"):
        build("int3")


def test_tree_width_goes_to_a_heads_policy_and_other_drafters_draft_chains(tiny_target, fake_tokenizer):
    from spec_batch.core.heads.head import head_for_target
    from spec_batch.core.heads.head_drafter import HeadDrafter
    from spec_batch.loading import build_decoder
    from spec_batch.loading.heads import HybridHead

    head = head_for_target(tiny_target, torch.arange(0, 64, 2), "tiny")

    def width(draft: Any, tree_width: Any) -> int:
        return build_decoder(
            tiny_target,
            fake_tokenizer,
            target_name="tiny",
            draft=draft,
            device=torch.device("cpu"),
            tree_width=tree_width,
        ).policy.tree_width

    assert width(head, None) == HeadDrafter.default_tree_width and width(head, 3) == 3
    assert width(HybridHead(head), None) == HeadDrafter.default_tree_width and width(HybridHead(head), 2) == 2
    assert width("suffix", 3) == width("suffix", None) == 1
    for bad in (0, -2, 1.5, True, "3"):
        with pytest.raises(InvalidParameterError, match="tree_width must be a whole number"):
            width(head, bad)


# ------------------------------------------------------------------ the oracle on the real default model


@pytest.mark.slow
def test_default_greedy_equals_hf_generate_on_the_same_model(hf_greedy):
    decoder = load_decoder("default", "none")
    assert decoder.target is shared_model("default").model  # the process's one copy of the default model
    ids = decoder.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    [result] = decoder.generate([ids], SamplingParams(max_new_tokens=24))
    expected = hf_greedy(decoder.target, ids, 24, eos_token_id=decoder.tokenizer.eos_token_id)
    assert result.token_ids == expected
    assert result.finish_reason == ("length" if len(expected) == 24 else "stop")
    assert "Paris" in result.text  # and the converted GGUF weights are a sensible model, not only a consistent one


def test_a_heads_default_tree_width_and_the_same_width_named_are_one_shared_decoder(tiny_dir, tmp_path):
    from spec_batch.core.heads.head import EagleHead, HeadConfig
    from spec_batch.core.heads.head_drafter import HeadDrafter
    from spec_batch.loading.heads import save_head

    target = shared_decoder(tiny_dir, "none").target
    path = save_head(EagleHead(HeadConfig.for_target(target.config, 16, str(tiny_dir))), tmp_path / "head")
    default = shared_decoder(tiny_dir, f"head:{path}")
    assert default.policy.tree_width == HeadDrafter.default_tree_width
    assert shared_decoder(tiny_dir, f"head:{path}", tree_width=HeadDrafter.default_tree_width) is default
    chains = shared_decoder(tiny_dir, f"head:{path}", tree_width=1)
    assert chains is not default and chains.policy.tree_width == 1
    hybrid = shared_decoder(tiny_dir, f"hybrid:{path}")  # a hybrid's head rows grow trees too
    assert hybrid.policy.tree_width == HeadDrafter.default_tree_width
    assert shared_decoder(tiny_dir, f"hybrid:{path}", tree_width=HeadDrafter.default_tree_width) is hybrid


# ------------------------------------------------------------------ the decoder spec


def test_a_decoder_spec_is_its_arguments_resolved_and_hashable():
    from spec_batch.loading.factory import DecoderSpec

    spec = DecoderSpec.of("some-model", "suffix")
    assert spec == DecoderSpec.of("some-model", "suffix", device=torch.device("cpu"), dtype="float32")
    assert spec == DecoderSpec.of("some-model", "suffix", num_draft_tokens=16, tree_width=3, weights="FULL")
    assert hash(spec) == hash(DecoderSpec.of("some-model", "suffix", num_draft_tokens=16))
    assert (spec.num_draft_tokens, spec.tree_width, spec.weights, spec.dtype) == (16, 1, "full", torch.float32)
    assert spec.routing == ("some-model", "suffix", "full", "float32")
    assert spec != DecoderSpec.of("some-model", "suffix", drafter_options={"max_spec_factor": 3.0})
    assert spec != DecoderSpec.of("some-model", "suffix", adaptive=False)
    with pytest.raises(AttributeError):
        spec.draft = "ngram"  # type: ignore[misc]
    # a head's drafting weights as it drafts: None and auto are int8 on the CPU, full is another decoder
    head = DecoderSpec.of("some-model", "head:/some/dir")
    assert head.tree_width == 3 and head.draft_weights == "int8"
    assert head == DecoderSpec.of("some-model", "head:/some/dir", draft_weights="auto", tree_width=3)
    assert head != DecoderSpec.of("some-model", "head:/some/dir", draft_weights="full")
    with pytest.raises(InvalidParameterError, match="hashable"):
        DecoderSpec.of("some-model", "suffix", drafter_options={"x": []})


def test_precision_and_an_alias_are_constructor_arguments(tiny_dir, tiny_target, fake_tokenizer):
    from spec_batch.loading import build_decoder

    built = build_decoder(tiny_target, fake_tokenizer, target_name="tiny", draft="ngram", device=torch.device("cpu"))
    assert built.precision is None and built.draft_name == "ngram"
    dec = load_decoder(tiny_dir, "ngram", draft_alias="ngram-as-known")
    assert dec.draft_name == "ngram-as-known" and dec.precision.to_dict()["weights"] == "full"
    assert dec.drafter_factory().name == "ngram"  # the drafter itself keeps its name
    shared = shared_decoder(tiny_dir, "suffix", drafter_options={"min_token_prob": 0.3})
    assert shared.drafter_factory().min_token_prob == 0.3 and shared is not shared_decoder(tiny_dir, "suffix")


def test_an_unknown_draft_names_the_registered_drafters(tiny_dir):
    from spec_batch.errors import UnknownModelError

    with pytest.raises(
        UnknownModelError, match=r"draft 'sufix': no drafter of that name \(\"suffix\", \"ngram\", \"none\""
    ):
        load_decoder(tiny_dir, "sufix")
