"""The OpenAI batch format, in and out: a thin module over batch_input (lines -> requests and errors) and
batch_output (rows -> output and error lines), kept so existing imports of spec_batch.jobs.batchfile work."""

from .batch_input import *  # noqa: F403
from .batch_input import __all__ as _input_names
from .batch_output import INTERNAL_ERROR, error_line, errors_path_for, iter_jsonl, output_line, usage, write_jsonl

__all__ = [
    *_input_names,
    "INTERNAL_ERROR",
    "error_line",
    "errors_path_for",
    "iter_jsonl",
    "output_line",
    "usage",
    "write_jsonl",
]
