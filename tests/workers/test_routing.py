"""Routing: a job's target and drafter decide its queue; `--model TARGET[:DRAFTER]` names a pair."""
from __future__ import annotations

import pytest

from spec_batch.workers.routing import parse_model_pair, queue_name


def test_queue_names_are_plain_and_distinct():
    assert queue_name("default", "ngram") == "spec-batch.default.ngram"
    assert queue_name("default", "none") == "spec-batch.default.none"
    hub = queue_name("HuggingFaceTB/SmolLM2-360M", "none")
    assert hub.startswith("spec-batch.huggingfacetb_smollm2-360m.none-") and hub.isascii()
    # lossy sanitizing never merges two pairs
    assert queue_name("a/b", "ngram") != queue_name("a_b", "ngram")
    assert queue_name("x.y", "ngram") != queue_name("x", "y.ngram")
    long = queue_name("/models/" + "x" * 300 + ".gguf", "/models/draft.gguf")
    assert len(long) <= 120 and long != queue_name("/models/" + "x" * 299 + ".gguf", "/models/draft.gguf")
    with pytest.raises(ValueError):
        queue_name("", "ngram")


def test_parse_model_pair():
    assert parse_model_pair("default") == ("default", "suffix")
    assert parse_model_pair("default:none") == ("default", "none")
    assert parse_model_pair("./m/big:HuggingFaceTB/SmolLM2-135M") == ("./m/big", "HuggingFaceTB/SmolLM2-135M")
    assert parse_model_pair("default", "none") == ("default", "none")
    for bad in ("", ":ngram", "default:"):
        with pytest.raises(ValueError):
            parse_model_pair(bad)


def test_queue_names_given_by_hand():
    from spec_batch.workers.routing import QueueNameError, check_queue_name

    for good in ("spec-batch.default.ngram", "gpu:0", "A_b-1.2", "q" * 120):
        assert check_queue_name(good) == good
    for bad in ("../../evil queue", "", "a b", "a/b", "q" * 121, "é", "a\nb", "celery;rm"):
        with pytest.raises(QueueNameError, match="is not allowed"):
            check_queue_name(bad)
    for pair in (("default", "ngram"), ("HuggingFaceTB/SmolLM2-360M", "none"), ("/m/" + "x" * 300, "d é")):
        check_queue_name(queue_name(*pair))  # derived names are always valid


def test_submit_file_refuses_a_bad_queue_name(tmp_path):
    from spec_batch.workers.enqueue import submit_file
    from spec_batch.workers.routing import QueueNameError

    with pytest.raises(QueueNameError):
        submit_file(None, tmp_path / "none.jsonl", target="t", drafter="d", queue="../x")
