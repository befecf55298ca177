"""The environment's tokens after a model turn: what the chat template writes between the end of
the assistant's message and the start of the next one (tool results or a user reply, then the
next assistant header), as token ids.

A trajectory is the engine's sampled tokens plus these, never the model's text tokenised again.
Templates are not always prefix-stable (Qwen3's drops the reasoning of past assistant turns once a
newer user query follows, and writes an empty <think> block into the last one), so the suffix is
not "render(all) minus render(history)". Instead the conversation is rendered with the current
assistant message replaced by a marker, and the suffix is the text after the marker: the
template's close of the assistant message, the new messages and the generation prompt. When the
model's turn ended with a stop token that the close begins with (Qwen's <|im_end|>, Llama's
<|eot_id|>, Mistral's </s>), that part is the model's own and is left out; a turn cut off without
one (or ended by another stop token) gets the template's close from the environment.
"""

from __future__ import annotations

MARK = "RLCU_TURN_END_MARK"


class RenderError(ValueError):
    """The chat template cannot render the environment's turn; the message says what it did."""


class TurnRenderer:
    """Renders a run's environment turns with `tokenizer`'s chat template, the tools' schemas
    (`tools`, as the prompt was rendered with) and the template's variables (`template_kwargs`,
    e.g. enable_thinking=False); `stop_ids` are the tokens that end a model turn."""

    def __init__(self, tokenizer, tools: list | None = None, template_kwargs: dict | None = None,
                 stop_ids=()):
        self.tokenizer, self.tools = tokenizer, list(tools) if tools else None
        self.template_kwargs = dict(template_kwargs or {})
        self.stop_ids = set(stop_ids)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tools=self.tools, **self.template_kwargs)

    def start_ids(self, messages: list[dict]) -> list[int]:
        """The episode's first tokens: its start messages and the assistant header."""
        return self.tokenizer.encode(self.render(messages))

    def env_text(self, history: list[dict], new: list[dict], last_token: int | None) -> str:
        """The text after the model's turn: `history` is the conversation before that turn,
        `new` the environment's messages after it; `last_token` the turn's last sampled token."""
        text = self.render([*history, {"role": "assistant", "content": MARK}, *new])
        if text.count(MARK) != 1:
            raise RenderError(f"the chat template wrote the assistant placeholder {text.count(MARK)} times "
                              f"(expected once): it cannot render an environment turn after this conversation")
        after = text[text.index(MARK) + len(MARK):]
        if last_token is not None and last_token in self.stop_ids:
            own = self.tokenizer.decode([last_token], skip_special_tokens=False)
            if own and after.startswith(own):
                after = after[len(own):]
        return after

    def env_ids(self, history: list[dict], new: list[dict], last_token: int | None) -> list[int]:
        return self.tokenizer.encode(self.env_text(history, new, last_token))
