"""Drafters without learned heads: the kind registry (drafter_registry), the Drafter protocol and the none / ngram /
draft-model drafters (drafters), the one draft-chain loop (chain_draft), draft trees (tree) and the suffix drafter
over a job's memory (suffix_index; native_suffix_index, its C++ form; job_memory, suffix_drafter)."""
