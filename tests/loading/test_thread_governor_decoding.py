"""A decoder on our forward gets a thread governor (loading/factory.py), and its outputs do not depend on it: steps
whose thread count flips between 1 and 2 give the tokens of steps at one fixed count, greedy and seeded sampling,
speculative and plain."""

from __future__ import annotations

import pytest
import torch

from spec_batch.core import thread_governor
from spec_batch.core.params import SamplingParams
from spec_batch.core.thread_governor import CpuSample, ThreadGovernor
from spec_batch.loading import build_decoder
from spec_batch.loading.kernels import native_ops
from spec_batch.loading.llama_forward import use_own_forward

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 11, 3, 7, 1, 30, 2, 17, 5, 9, 11], [8, 2, 6, 8, 2], [40, 41, 40, 41, 40]]

pytestmark = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built")


class Flipping:
    """Samples in which other processes take a whole CPU in one interval and none in the next."""

    def __init__(self):
        self.n, self.busy, self.ours = 0, 0.0, 0.0

    def __call__(self) -> CpuSample:
        self.n += 1
        self.busy += 1.0 + (1.0 if self.n % 2 else 0.0)
        self.ours += 1.0
        return CpuSample(float(self.n), self.busy, self.ours)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _decode(decoder, params: list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in decoder.generate(PROMPTS, params, batch_size=3)]


@pytest.mark.parametrize("weights", ["w4a8", "full"])
def test_flipping_thread_counts_change_no_token(weights, prepared_llama, fake_tokenizer, two_threads, monkeypatch):
    model = prepared_llama(weights, torch.float32, True, seed=5, layers=2)
    assert use_own_forward(model, "own") == "own"
    monkeypatch.setattr(torch, "set_num_threads", _counting(torch.set_num_threads, counts := []))
    params = [SamplingParams(max_new_tokens=24), SamplingParams(max_new_tokens=24, temperature=0.8, seed=3)] * 2
    params = params[: len(PROMPTS)]
    outputs = {}
    for name, draft in (("suffix", "suffix"), ("plain", "none")):
        torch.set_num_threads(2)  # as the flipping governor did not leave it
        decoder = build_decoder(model, fake_tokenizer, target_name="tiny", draft=draft, device=CPU)
        assert isinstance(decoder.threads, ThreadGovernor) and decoder.threads.most == 2
        fixed = decoder.threads
        decoder.threads = None  # two threads throughout
        outputs[name, "fixed"] = _decode(decoder, params)
        decoder.threads = ThreadGovernor(2, interval=0.0, sample=Flipping())
        outputs[name, "flipping"] = _decode(decoder, params)
        decoder.threads = fixed
    assert outputs["suffix", "flipping"] == outputs["suffix", "fixed"] == outputs["plain", "fixed"]
    assert outputs["plain", "flipping"] == outputs["plain", "fixed"]
    assert counts.count(1) >= 10 and counts.count(2) >= 10  # the count really flipped, step after step


def _counting(set_num_threads, counts: list[int]):
    def counted(n: int) -> None:
        counts.append(n)
        set_num_threads(n)

    return counted


def test_only_our_forward_at_several_threads_gets_a_governor(prepared_llama, fake_tokenizer, monkeypatch):
    # no governor from an earlier test in this process: one that held a thread back (a busy CI machine) would be
    # shared with a decoder built at 1 thread (tests/core/test_thread_governor.py tests that sharing)
    monkeypatch.setattr(thread_governor, "_shared", None)
    model = prepared_llama("full", torch.float32, True, seed=5, layers=1)
    use_own_forward(model, "own")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # nothing to govern
        assert build_decoder(model, fake_tokenizer, target_name="tiny", draft="none", device=CPU).threads is None
        torch.set_num_threads(2)
        assert build_decoder(model, fake_tokenizer, target_name="tiny", draft="none", device=CPU).threads is not None
        monkeypatch.setenv("SPEC_BATCH_ADAPT_THREADS", "0")
        assert build_decoder(model, fake_tokenizer, target_name="tiny", draft="none", device=CPU).threads is None
        monkeypatch.delenv("SPEC_BATCH_ADAPT_THREADS")
        own, model.spec_batch_forward = model.spec_batch_forward, None  # Hugging Face's forward: torch's count
        try:
            assert build_decoder(model, fake_tokenizer, target_name="tiny", draft="none", device=CPU).threads is None
        finally:
            model.spec_batch_forward = own
    finally:
        torch.set_num_threads(before)
