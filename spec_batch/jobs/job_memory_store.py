"""Job memories for the suffix drafter: one JobMemory per job, shared by the job's runs, so one request's draft
can come from the job's other outputs. Warmed from the job's completed outputs in SQL (the most recent N
tokens) when a process picks up a job already partly done; a worker keeps a few jobs' memories (LRU) and drops
a job's when the job ends. A memory only changes drafts, never an output.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.decoder_like import DecoderLike
from ..core.drafting.job_memory import JobMemory
from ..store import queries


def uses_job_memory(decoder: DecoderLike) -> bool:
    """Whether the decoder's drafter drafts from a job memory (only then is one worth warming)."""
    return bool(getattr(decoder, "uses_memory", False))


def warm_memory(session_factory: sessionmaker[Session], job_id: str, tokenizer: Any, max_tokens: int) -> JobMemory:
    """A memory holding the job's most recent completed outputs (re-tokenized: SQL keeps the text)."""
    memory = JobMemory(max_tokens=max_tokens)
    with session_factory() as s:
        outputs = queries.recent_outputs(s, job_id, max_tokens)
    for text in reversed(outputs):  # oldest first: the cap then drops the oldest
        memory.add(tokenizer.encode(text, add_special_tokens=False))
    return memory


class JobMemories:
    """A worker process's memories, one per job, the least recently used job dropped beyond max_jobs."""

    def __init__(self, max_jobs: int, max_tokens: int):
        self.max_jobs, self.max_tokens = max_jobs, max_tokens
        self._memories: OrderedDict[str, JobMemory] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, session_factory: sessionmaker[Session], job_id: str, tokenizer: Any) -> JobMemory:
        with self._lock:
            memory = self._memories.get(job_id)
            if memory is not None:
                self._memories.move_to_end(job_id)
                return memory
        memory = warm_memory(session_factory, job_id, tokenizer, self.max_tokens)
        with self._lock:
            memory = self._memories.setdefault(job_id, memory)  # a concurrent warm of the same job: keep one
            self._memories.move_to_end(job_id)
            while len(self._memories) > self.max_jobs:
                self._memories.popitem(last=False)
            return memory

    def drop(self, job_id: str) -> None:
        """The job ended: its memory goes."""
        with self._lock:
            self._memories.pop(job_id, None)

    def __contains__(self, job_id: str) -> bool:
        return job_id in self._memories
