"""The batch's KV cache: per-row lengths, rollback and compaction over transformers' cache layers (kv_batch),
which positions of a forward are real (padding), and the core's one door to transformers' internals (hf_compat)."""
