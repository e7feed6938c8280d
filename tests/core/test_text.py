"""Output text: incremental detokenization equals the full decode (byte-level BPE, sentencepiece with byte
fallback, the real default tokenizer), stop strings cut at the earliest one with the fewest tokens, EOS, and
the text held back while streaming."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from spec_batch import SamplingParams
from spec_batch.core.text import IncrementalDetokenizer, OutputText, eos_ids

CORPUS = [
    "Café naïve résumé façade über straße, ça va? 你好世界 emoji 🎉🎊 and the quick brown fox 日本語 ok",
    "tokens split multi-byte characters: é ü ß 中文 🎉; stop here. The end",
] * 20
TEXTS = ["Café 日本語 🎉 x", "straße 你好世界!! 🎊🎉 the end", "ü", "  two  spaces ", "中文🎉中文"]


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Llama 3 / SmolLM style): multi-byte characters split over tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@pytest.fixture(scope="module")
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama 2 style: "▁" for spaces, byte-fallback tokens <0xNN>, one leading space stripped when decoding."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<eos>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(
        [c.replace("日本語", "") for c in CORPUS], trainers.BpeTrainer(vocab_size=400, special_tokens=specials)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _full(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _incremental(tokenizer, ids) -> tuple[str, list[str]]:
    """The final text, and the text after each push."""
    detok = IncrementalDetokenizer(tokenizer)
    seen = []
    for t in ids:
        detok.push(t)
        seen.append(detok.text)
    detok.flush()
    return detok.text, seen


def _check_exact(tokenizer, ids) -> None:
    final, seen = _incremental(tokenizer, ids)
    assert final == _full(tokenizer, ids), ids
    for n, text in enumerate(seen, start=1):
        # what is shown after n tokens is a prefix of their full decode, held back only while that ends with a
        # split character
        full = _full(tokenizer, ids[:n])
        assert full.startswith(text), (ids[:n], text, full)
        held = full[len(text) :]
        assert held == "" or held.endswith("\ufffd"), (ids[:n], text, full)


def _random_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(len(tokenizer)) for _ in range(n)]


def _check_tokenizer(tokenizer) -> None:
    for text in TEXTS:
        _check_exact(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    rng = random.Random(0)
    for _ in range(200):  # random ids: stray bytes, invalid sequences, special tokens in the middle
        _check_exact(tokenizer, _random_ids(tokenizer, rng, rng.randrange(1, 30)))


def test_incremental_equals_full_decode_byte_level_bpe(byte_bpe):
    ids = byte_bpe.encode("日本語 🎉", add_special_tokens=False)
    assert len(ids) > len("日本語 🎉"), "the test needs characters split over several tokens"
    _check_tokenizer(byte_bpe)


def test_incremental_equals_full_decode_sentencepiece_like(sentencepiece_like):
    ids = sentencepiece_like.encode("日本語 x", add_special_tokens=False)
    assert sum(sentencepiece_like.convert_ids_to_tokens(i).startswith("<0x") for i in ids) == 9  # byte fallback
    _check_tokenizer(sentencepiece_like)


def test_incremental_equals_full_decode_fake_tokenizer(fake_tokenizer):
    _check_exact(fake_tokenizer, [3, 14, 15, 92, 65])


def test_split_character_appears_once_complete(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe)
    ids = byte_bpe.encode("a🎉", add_special_tokens=False)
    for t in ids[:-1]:
        detok.push(t)
    assert detok.text == "a"  # the emoji's bytes are not complete yet: nothing shown
    detok.push(ids[-1])
    assert detok.text == "a🎉"


def test_flush_shows_an_incomplete_character_as_the_decoder_does(byte_bpe):
    ids = byte_bpe.encode("a🎉", add_special_tokens=False)[:-1]
    final, _ = _incremental(byte_bpe, ids)
    assert final == _full(byte_bpe, ids) and final.startswith("a") and final.endswith("\ufffd")


def test_decodes_short_windows_only(fake_tokenizer):
    """Each push decodes a window of a few tokens, never the whole output."""
    sizes = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return fake_tokenizer.decode(ids)

    detok = IncrementalDetokenizer(Counting())
    for t in range(500):
        detok.push(t)
    assert detok.text == " ".join(map(str, range(500)))
    assert max(sizes) <= 2 and len(sizes) <= 2 * 500


# ---------------------------------------------------------------- stop strings and EOS


def _feed(out: OutputText, ids) -> int:
    """Adds ids until the output ends; returns how many were added (the one that ended it included)."""
    for n, t in enumerate(ids, start=1):
        if out.add(t):
            return n
    out.close()
    return len(ids)


def _fewest(tokenizer, ids, stop) -> int:
    return next(n for n in range(1, len(ids) + 1) if stop in _full(tokenizer, ids[:n]))


@pytest.mark.parametrize("stop", ["日本", "🎉", "é 日", "x", "本語 🎉 x"])
def test_stop_string_cut_and_fewest_tokens(byte_bpe, stop):
    ids = byte_bpe.encode("Café 日本語 🎉 x and more", add_special_tokens=False)
    out = OutputText(byte_bpe, [stop], eos_ids=set())
    n = _feed(out, ids)
    full = _full(byte_bpe, ids)
    assert n == _fewest(byte_bpe, ids, stop)
    assert out.text == full[: full.find(stop)]
    assert not out.ended_by_eos


def test_earliest_stop_string_wins(fake_tokenizer):
    out = OutputText(fake_tokenizer, ["9 9", "4 5", "3 4 5"], eos_ids=set())
    assert _feed(out, [1, 2, 3, 4, 5, 6]) == 5  # "4 5" and "3 4 5" both complete at token 5; "3 4 5" begins first
    assert out.text == "1 2 "


def test_stop_string_that_completes_first_ends_the_output(fake_tokenizer):
    """The output ends at the first token that completes any stop string, as plain decoding would (whatever the
    number of tokens a step adds)."""
    out = OutputText(fake_tokenizer, ["2 3 4 5", "3"], eos_ids=set())
    assert _feed(out, [1, 2, 3, 4, 5]) == 3
    assert out.text == "1 2 "


def test_stop_string_spanning_earlier_text(fake_tokenizer):
    out = OutputText(fake_tokenizer, ["11 12 13"], eos_ids=set())
    assert _feed(out, [10, 11, 12, 13, 14]) == 4
    assert out.text == "10 "


def test_eos_ends_without_text(fake_tokenizer):
    out = OutputText(fake_tokenizer, ["7 7"], eos_ids={9})
    assert _feed(out, [1, 2, 9, 7, 7]) == 3
    out.close()
    assert out.text == "1 2" and out.ended_by_eos


def test_stream_holds_back_a_possible_stop_string(fake_tokenizer):
    out = OutputText(fake_tokenizer, ["abc"], eos_ids=set())  # 3 characters: the last 2 are held back
    chunks = []
    for t in [10, 11, 12]:
        out.add(t)
        chunks.append(out.stream_chunk(finished=False))
    assert chunks == ["", "10 ", "11 "]  # texts "10", "10 11", "10 11 12" less their last 2 characters
    out.close()
    assert out.stream_chunk(finished=True) == "12"
    assert "".join(chunks) + "12" == out.text


def test_eos_ids_from_model_and_tokenizer(fake_tokenizer_cls):
    class Config:
        eos_token_id = [5, 6]

    class Model:
        generation_config = Config()

    assert eos_ids(Model(), fake_tokenizer_cls(eos_token_id=7)) == {5, 6, 7}
    assert eos_ids(object(), fake_tokenizer_cls()) == set()


# ---------------------------------------------------------------- the real default tokenizer (slow)


@pytest.mark.slow
def test_default_tokenizer_incremental_equals_full_decode(default_decoder):
    tok = default_decoder.tokenizer
    ids = tok.encode("日本語 🎉", add_special_tokens=False)
    assert len(ids) > 4, "the default tokenizer should split these characters over byte tokens"
    _check_tokenizer(tok)
    for stop in ["本", "🎉 x", "é"]:
        ids = tok.encode("Café 日本語 🎉 x", add_special_tokens=False)
        out = OutputText(tok, [stop], default_decoder.eos_ids)
        n = _feed(out, ids)
        full = _full(tok, ids)
        assert n == _fewest(tok, ids, stop) and out.text == full[: full.find(stop)]


@pytest.mark.slow
def test_default_model_text_equals_full_decode(default_decoder):
    """generate()'s text is the full decode of its token ids; with a stop string, the full decode cut before it,
    and the ids are the fewest whose text contains it."""
    dec = default_decoder
    tok = dec.tokenizer
    prompts = [
        dec.apply_chat_template([{"role": "user", "content": text}])
        for text in (
            "Write the word 'café' in French and 'hello' in Japanese.",
            "Reply with three emoji.",
            "Count to five.",
        )
    ]
    results = dec.generate(prompts, SamplingParams(max_new_tokens=40), batch_size=3)
    texts = [r.text for r in results]
    assert any(any(ord(c) > 127 for c in t) for t in texts), f"no multi-byte character in {texts}"
    for r in results:
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
    for r, prompt in zip(results, prompts):
        # a stop string of 3 characters of the output, from its first multi-byte character if it has one
        start = next((i for i, c in enumerate(r.text) if ord(c) > 127), 5)
        stop = r.text[start : start + 3]
        if not stop:
            continue
        cut = dec.generate([prompt], SamplingParams(max_new_tokens=40, stop=[stop]))[0]
        full = tok.decode(cut.token_ids, skip_special_tokens=True)
        assert cut.finish_reason == "stop"
        assert cut.text == full[: full.find(stop)] == r.text[: r.text.find(stop)]
        assert cut.token_ids == r.token_ids[: _fewest(tok, r.token_ids, stop)]
