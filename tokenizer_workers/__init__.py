"""Tokenizer worker processes: request validation, chat templates, tokenization, incremental detokenization."""
