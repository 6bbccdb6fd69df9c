"""Tests of tokenizers against transformers, detokenizer, chat templates and their limits, reasoning."""
