"""Helpers of the episode tests: family tokenizers (Qwen2.5, a Qwen3-flavoured ChatML, Llama 3.1,
Mistral v0.3) from support.chat_families, a model turn's token ids as the engine would sample them
(the text, then the turn's stop token), and a tiny environment with a tool method."""

from __future__ import annotations

import time

from rlcu.data.tokenizer import Tokenizer
from rlcu.tools.environment import Environment
from rlcu.tools.episode import EpisodeLimits, EpisodeState
from rlcu.tools.render import TurnRenderer
from support.chat_families import llama3_folder, mistral_folder, qwen25_folder
from support.chat_family_templates import QWEN3_LIKE

STOP = {"qwen3": "<|im_end|>", "qwen2": "<|im_end|>", "llama": "<|eot_id|>", "mistral": "</s>"}


def family_tokenizer(family: str, folder) -> Tokenizer:
    if family in ("qwen2", "qwen3"):
        tok = Tokenizer.from_pretrained(qwen25_folder(folder))
        if family == "qwen3":
            tok.chat_template = QWEN3_LIKE
        return tok
    make = {"llama": llama3_folder, "mistral": mistral_folder}[family]
    return Tokenizer.from_pretrained(make(folder))


def turn(tok, family: str, text: str, stop: bool = True) -> list[int]:
    """The model's turn as sampled tokens: `text`, then the family's end-of-turn token."""
    return tok.encode(text) + ([tok.token_to_id(STOP[family])] if stop else [])


class Calculator:
    """A tool environment: add() is its tool; reward() is 1 when the last answer says 5."""

    def __init__(self):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        self.calls += 1
        return a + b

    def slow(self, seconds: float) -> str:
        """Sleep, then say done.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    def reward(self, messages) -> float:
        return 1.0 if "5" in messages[-1]["content"] else 0.0

    def _helper(self):  # not a tool
        return None


def episode(tok, family: str, env=Calculator, tools=(), prompt="What is 2 + 3?", row=None, **limits):
    spec = Environment(env, tools)
    stops = [tok.token_to_id(STOP[family])]
    renderer = TurnRenderer(tok, spec.schemas, stop_ids=stops)
    return EpisodeState(spec.make(), renderer, family, row or {}, [{"role": "user", "content": prompt}],
                        EpisodeLimits(**limits))
