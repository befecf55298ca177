"""Data: the tokenizer and chat template, prompt sets, the built-in synthetic tasks."""

from rlcu.data.tokenizer import ChatTemplateError, Tokenizer, make_word_tokenizer  # noqa: F401
