"""The core's one door to transformers' internals: every private name of transformers the core builds on is
imported here and nowhere else in core/ (core may not import loading/, which has its own door, loading/compat.py).

Tested with the transformers minor version pyproject.toml pins. What a new release may change under us:
- `DynamicLayer`: core/kv/kv_batch.py's SlabLayer subclasses it and overrides LAYER_OVERRIDES; a method renamed
  upstream would be left unused without an error, so tests/loading/test_patches_active.py checks that each still
  exists and that a loaded model's cache holds SlabLayers.
- `Cache`: KVBatch is one, built from SlabLayers.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer

# DynamicLayer's methods SlabLayer overrides (each must still be one of DynamicLayer's)
LAYER_OVERRIDES = ("lazy_initialization", "update", "get_seq_length", "crop", "batch_select_indices")

__all__ = ["LAYER_OVERRIDES", "Cache", "DynamicLayer"]
