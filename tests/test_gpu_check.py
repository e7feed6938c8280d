"""bench/gpu_check.py, the prepared accelerator check, run here on the CPU with a tiny model of its vocabulary."""

from __future__ import annotations

import torch

from bench import gpu_check


def test_prompts_repeat_a_passage_of_their_own():
    for p in gpu_check.prompts(4, seed=3, vocab=64):
        tail = p[-5:]
        assert any(p[i : i + 5] == tail for i in range(1, len(p) - 5))  # the drafters find the tail earlier on
        assert all(3 <= t < 64 for t in p[1:])


def test_exactness_report_counts_the_outputs_equal_to_none_and_to_hugging_face(tiny_llama):
    model = tiny_llama(7, vocab=64, layers=2, lm_head_scale=8.0)
    ps = gpu_check.prompts(3, seed=0, vocab=64)
    report = gpu_check.check_exactness(model, torch.device("cpu"), ps, max_new=12)
    assert set(report) == {
        f"{d} b{b}" for d in ("none", "ngram", "suffix", "head", "head tree", "head3 tree") for b in (1, 8)
    }
    for counts in report.values():
        assert counts == {"same as none at this batch": 3, "same as HF b1": 3, "prompts": 3}


def test_the_int4_check_quantizes_the_model_and_finds_speculation_exact_on_it(tiny_llama):
    """The int4 part, on the CPU's int4 kernel: a model 32 wide quantizes with group 32."""
    model = tiny_llama(7, vocab=64, layers=2, lm_head_scale=8.0)
    ps = gpu_check.prompts(3, seed=0, vocab=64)
    report = gpu_check.check_int4(model, torch.device("cpu"), ps, max_new=8, rounds=1)
    assert report["exact"] and report["layer relative error"] < 0.02
    assert set(report["exactness"]) == {
        f"{d} b{b}" for d in ("none", "ngram", "suffix", "head", "head tree", "head3 tree") for b in (1, 8)
    }
