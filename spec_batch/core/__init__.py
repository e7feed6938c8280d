"""The decoding core: token ids in, token ids out. Imports torch and transformers' cache, nothing of the
job, queue or LangChain layers (docs/architecture.md)."""
