"""The documented path (docs/architecture.md) of spec_batch.core.drafting.drafters: the same module object."""

import sys

from .drafting import drafters

sys.modules[__name__] = drafters
