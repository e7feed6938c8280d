"""The documented path (docs/structured-output.md) of spec_batch.core.structured.response_format: the same module."""

import sys

from .structured import response_format

sys.modules[__name__] = response_format
