"""Data: the tokenizer and chat template, prompt sets, the built-in synthetic tasks."""

from rlcu.data.chat_template import ChatTemplateError  # noqa: F401
from rlcu.data.tokenizer import Tokenizer, make_word_tokenizer  # noqa: F401
