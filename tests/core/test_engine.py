"""The engine (spec_batch/core/engine.py): one decoder shared by callers that come and go.

- exactness: greedy output through the engine == Decoder.generate == Hugging Face's plain greedy output, for
  rows admitted together, for rows that join a running batch mid-decode and for concurrent callers;
- steps are shared: requests from different callers decode in the same steps;
- a cancelled row (a stream closed early) leaves the batch and the others go on unchanged;
- a group's should_stop stops its rows only; as_decoder() is Decoder.generate's signature (on_result,
  return_errors, should_stop) and proxies the decoder's attributes;
- stop() lets in-flight requests finish, then refuses new ones.
"""

from __future__ import annotations

import queue
import threading

import pytest

from spec_batch import InvalidParameterError, SamplingParams
from spec_batch.core.engine import Engine, EngineClosed

PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3],
    [7, 8, 9],
    [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 1],
    [3],
    [10, 20, 30, 40, 50, 60, 10, 20, 30, 40, 50, 60, 10, 20],
]
N_NEW = 20
GREEDY = SamplingParams(max_new_tokens=N_NEW)


@pytest.fixture(scope="module")
def refs(tiny_target, hf_greedy):
    return [hf_greedy(tiny_target, p, N_NEW) for p in PROMPTS]


@pytest.fixture(scope="module", params=["none", "ngram", "model", "head"])
def decoder(request, tiny_decoder, tiny_draft, tiny_target):
    if request.param == "head":  # a learned head: rows joining mid-batch hand it their prompts' hidden states
        import torch

        from spec_batch.core.heads.head import head_for_target

        torch.manual_seed(0)
        return tiny_decoder(head_for_target(tiny_target, torch.arange(0, 64, 2), "tiny"), adaptive=False)
    return tiny_decoder(tiny_draft if request.param == "model" else request.param)


@pytest.fixture
def engine(decoder):
    eng = Engine(decoder, max_batch=4)
    eng.start()
    yield eng
    eng.stop()


def test_generate_equals_decoder_and_hf(engine, decoder, refs):
    got = engine.generate(PROMPTS, GREEDY, batch_size=3)
    assert [r.token_ids for r in got] == refs
    assert [r.token_ids for r in decoder.generate(PROMPTS, GREEDY, batch_size=3)] == refs
    assert all(r.finish_reason == "length" and r.stats.output_tokens == N_NEW for r in got)


def test_rows_joining_mid_batch_are_exact_and_share_steps(engine, tiny_target, hf_greedy, refs):
    long_ref = hf_greedy(tiny_target, PROMPTS[0], 120)
    first_step, joined = threading.Event(), threading.Event()
    updates: dict[int, queue.SimpleQueue] = {i: queue.SimpleQueue() for i in range(len(PROMPTS))}

    def long_sink(update):
        updates[0].put(update)
        if not first_step.is_set():  # hold the engine after the long row's first step until the others queue
            first_step.set()
            joined.wait(10)

    engine.submit(engine.prepare(PROMPTS[0], SamplingParams(max_new_tokens=120)), long_sink)
    first_step.wait(10)
    for i in range(1, len(PROMPTS)):
        engine.submit(engine.prepare(PROMPTS[i], GREEDY, i), updates[i].put)
    joined.set()
    finals = [_drain(updates[i]) for i in range(len(PROMPTS))]
    assert finals[0][1].token_ids == long_ref
    assert [t for c in finals[0][0] for t in c.token_ids] == long_ref  # the streamed chunks add up
    assert [f[1].token_ids for f in finals[1:]] == refs[1:]
    assert engine.most_rows == 4  # the long row decoded beside three that joined (max_batch 4)


def _drain(updates: queue.SimpleQueue):
    chunks = []
    while True:
        update = updates.get(timeout=30)
        chunks.append(update.chunk)
        if update.result is not None:
            return chunks, update.result


def test_concurrent_callers_equal_sequential(engine, refs):
    results: dict[int, list[int]] = {}

    def call(i: int) -> None:
        results[i] = engine.generate([PROMPTS[i]], GREEDY)[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == refs
    assert engine.most_rows > 1


def test_cancelled_stream_frees_its_row(engine, refs):
    abandoned = engine.stream(PROMPTS[2], SamplingParams(max_new_tokens=200))
    next(abandoned)
    others = []
    thread = threading.Thread(target=lambda: others.extend(engine.generate(PROMPTS[:2], GREEDY)))
    thread.start()
    abandoned.close()  # the client went away
    thread.join()
    assert [r.token_ids for r in others] == refs[:2]
    engine.stop()  # returns: nothing is left decoding (the abandoned row did not run to 200 tokens)
    assert engine.waiting == 0


def test_should_stop_stops_its_group_only(engine, refs):
    stop_now = threading.Event()
    other: list = []
    thread = threading.Thread(target=lambda: other.extend(engine.generate(PROMPTS[3:], GREEDY)))
    seen = []

    def on_result(i, res):
        seen.append(i)

    stop_now.set()
    got = engine.generate(PROMPTS[:3], GREEDY, on_result=on_result, should_stop=stop_now.is_set)
    thread.start()
    thread.join()
    assert all(r.finish_reason == "cancelled" for r in got) and sorted(seen) == [0, 1, 2]
    assert [r.token_ids for r in other] == refs[3:]


def test_should_stop_error_reaches_the_caller(engine):
    def broken() -> bool:
        raise RuntimeError("database gone")

    with pytest.raises(RuntimeError, match="database gone"):
        engine.generate(PROMPTS[:2], GREEDY, should_stop=broken)


def test_as_decoder_has_generates_signature(engine, decoder, refs):
    dec = engine.as_decoder()
    assert dec.tokenizer is decoder.tokenizer and dec.target_name == decoder.target_name
    got = {}
    too_long = SamplingParams(max_new_tokens=10**6)
    results = dec.generate(
        PROMPTS[:2] + [PROMPTS[2]],
        [GREEDY, GREEDY, too_long],
        batch_size=2,
        return_errors=True,
        on_result=lambda i, r: got.setdefault(i, r),
        should_stop=None,
        memory=None,
    )
    assert [r.token_ids for r in results[:2]] == refs[:2]
    assert results[2].finish_reason == "error" and "context" in results[2].error
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(InvalidParameterError):
        dec.generate("a string", GREEDY)


def test_stop_finishes_in_flight_then_refuses(decoder, refs):
    eng = Engine(decoder, max_batch=2)
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(eng.generate(PROMPTS, GREEDY)))
    thread.start()
    while eng.steps == 0:
        threading.Event().wait(0.01)
    eng.stop()
    thread.join()
    assert [r.token_ids for r in out] == refs  # every request, waiting ones too, finished
    with pytest.raises(EngineClosed):
        eng.submit(eng.prepare(PROMPTS[0], GREEDY), lambda u: None)


def test_seeded_sampling_equals_decoder(engine, decoder):
    params = [
        SamplingParams(max_new_tokens=N_NEW, temperature=0.9, top_p=0.9, seed=11 + i) for i in range(len(PROMPTS))
    ]
    alone = decoder.generate(PROMPTS, params, batch_size=2)
    shared = engine.generate(PROMPTS, params, batch_size=4)
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]


def test_online_requests_are_admitted_before_waiting_bulk_rows(decoder):
    from spec_batch.core.engine_batch import Group, Ticket

    eng = Engine(decoder, max_batch=2)  # not started: _admit is checked alone
    bulk, online = Group(limit=8, background=True), Group()
    request = eng.prepare(PROMPTS[0], GREEDY)
    tickets = [Ticket(request, lambda u: None, g) for g in (bulk, bulk, bulk, online)]
    eng._waiting.extend(tickets)
    assert eng._admit(running=0) == [tickets[3], tickets[0]]
    assert list(eng._waiting) == tickets[1:3] and bulk.active == 1 and online.active == 1
