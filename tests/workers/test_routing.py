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


def test_the_precision_is_part_of_the_queue_name_and_full_at_the_default_dtype_keeps_todays_names():
    assert queue_name("default", "suffix", None, None) == queue_name("default", "suffix", "full", None)
    assert queue_name("default", "suffix", "full", None) == "spec-batch.default.suffix"
    assert queue_name("default", "suffix", "int4", "bfloat16") == "spec-batch.default.suffix.int4-bfloat16"
    names = {
        queue_name("default", "suffix", w, d)
        for w, d in [
            (None, None),
            ("int4", "bfloat16"),
            ("int8", "bfloat16"),
            ("full", "bfloat16"),
            ("full", "float32"),
        ]
    }
    assert len(names) == 5  # chunks of one job never reach a worker of another precision
    hub = "HuggingFaceTB/SmolLM2-360M"
    assert queue_name(hub, "none", "full", None) == queue_name(hub, "none")  # today's digest kept
    assert queue_name(hub, "none", "int4", "bfloat16") != queue_name(hub, "none")


def test_parse_model_pair_keeps_a_self_draft_whole():
    assert parse_model_pair("default:self:int4") == ("default", "self:int4")
    assert parse_model_pair("./m/x.gguf:self") == ("./m/x.gguf", "self")


def test_a_worker_for_a_head_listens_where_submit_publishes():
    """Drafter names carry colons (head:NAME, hybrid:/dir, self:int4): `worker --model` splits at the first one,
    so its queue is the one `submit` derives from the job's (target, drafter)."""
    for target, drafter in (
        ("default", "head:notices"),
        ("default", "hybrid:notices"),
        ("default", "head:/heads/a:b"),
        ("default", "self:int4"),
        ("./m/big", "HuggingFaceTB/SmolLM2-135M"),
    ):
        assert parse_model_pair(f"{target}:{drafter}") == (target, drafter)
        assert queue_name(*parse_model_pair(f"{target}:{drafter}")) == queue_name(target, drafter)
    assert queue_name("default", "head:notices") != queue_name("default:head", "notices")
