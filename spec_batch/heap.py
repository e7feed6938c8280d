"""A model-serving process's start-up heap, kept out of Python's full garbage collections.

Once the default model is loaded, a process holds ~390,000 objects the collector tracks (torch's, transformers'
and the tokenizer's functions, classes and dicts), alive as long as the process. A full (generation-2) collection
walks every one of them, stopping all threads: 190 ms on a Zen 5 core. A server decoding for 16 clients allocates
enough (the suffix drafter's index nodes, each row's bookkeeping) to set one off every few seconds: four pauses of
175-200 ms in ~32 s of decoding, each landing in some client's step (docs/benchmarks.md, bench_server).
`freeze_heap` moves what is alive into the collector's permanent generation (`gc.freeze`), so later collections
walk only newer objects; vLLM, SGLang and TensorRT-LLM freeze their engines' heaps after start-up the same way.
The price: a frozen object that later becomes garbage inside a reference cycle is never freed, so only processes
that keep their model for life call it (the server, a worker, the CLI's job run), after loading it.
"""

from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collects what is garbage now, then freezes the rest out of later collections (`gc.freeze`)."""
    gc.collect()
    gc.freeze()
