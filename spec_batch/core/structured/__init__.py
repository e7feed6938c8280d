"""Structured output: response_format parsed and checked (response_format), compiled to an llguidance grammar
over the model's tokenizer (grammar_tokenizer, grammar). Imports nothing of the core outside itself."""
