"""One episode's turns: the callback the engine calls when a model turn ends
(LLM.run_episodes' `on_turn`), which parses the turn, runs its tool calls (or the environment's
`step`) and returns the environment's tokens, or None when the episode is over.

- The turn's text is decoded with its special tokens (Mistral's [TOOL_CALLS], Llama's
  <|python_tag|> are special) less its final stop token, and parsed in the family's format
  (rlcu.tools.calls). A call the model got wrong, a tool that raises or runs past
  `tool_timeout_s` comes back to the model as an error in the tool message, never an exception.
- The turn's calls run concurrently, each in a thread of its own under the time limit
  (rlcu.timed), so an episode waits for its slowest call only.
- The environment's tokens are the chat template's suffix after the turn (rlcu.tools.render).
- Limits: a turn cut at max_new_tokens ends the episode (`truncated = "length"`), as do
  `max_turns` model turns (`"max_turns"`) and environment tokens that would leave no room in
  `max_tokens` (the episode's tokens after its start; `"length"`).
- An environment method that raises (step, done) ends the episode with `error` set; the trainer
  masks it. The conversation (`messages`) is what the model saw and said, TRL's message form:
  assistant turns with `tool_calls`, tool results with `name` and `tool_call_id`.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

from rlcu.rewards.call import describe
from rlcu.tools.calls import ParsedCalls, ToolCall, ToolCallError, call_tool, parse_tool_calls
from rlcu.tools.environment import EpisodeEnv
from rlcu.tools.render import TurnRenderer


@dataclasses.dataclass
class EpisodeStats:
    turns: int = 0  # model turns
    tool_calls: int = 0
    tool_errors: int = 0  # malformed calls, tools that raised or timed out
    tool_time_s: float = 0.0  # wall time waiting for tools
    truncated: str | None = None  # "max_turns" or "length"
    error: str | None = None  # an environment method raised: the episode is masked


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int | None = None
    max_tokens: int | None = None  # the episode's tokens after its start, model's and environment's
    tool_timeout_s: float = 30.0


def _call_id(turn: int, j: int) -> str:
    """Nine alphanumeric characters (Mistral's templates refuse other ids)."""
    return f"{turn:04d}{j:05d}"


class EpisodeState:
    """An episode of `env` started from `row` (its prompt `prompt`), rendered by `renderer` in
    `family`'s tool-call format. `start_ids` are its first tokens; `on_turn` its callback."""

    def __init__(self, env: EpisodeEnv, renderer: TurnRenderer, family: str, row: dict, prompt,
                 limits: EpisodeLimits = EpisodeLimits()):
        self.env, self.renderer, self.family, self.limits = env, renderer, family, limits
        self.messages = env.start(row, prompt)
        self.n_start = len(self.messages)
        self.start_ids = renderer.start_ids(self.messages)
        self.n_tokens = 0
        self.stats = EpisodeStats()

    @property
    def prompt_messages(self) -> list[dict]:
        return self.messages[: self.n_start]

    @property
    def completion_messages(self) -> list[dict]:
        return self.messages[self.n_start:]

    def on_turn(self, turn_ids: list[int], finish_reason: str | None) -> list[int] | None:
        try:
            return self._turn(list(turn_ids), finish_reason)
        except Exception as e:  # noqa: BLE001 - the environment's code: this episode ends, the run goes on
            self.stats.error = describe(e)
            return None

    # ---------------------------------------------------------------- a turn
    def _parse(self, turn_ids: list[int]) -> ParsedCalls:
        stop = self.renderer.stop_ids
        body = turn_ids[:-1] if turn_ids and turn_ids[-1] in stop else turn_ids
        text = self.renderer.tokenizer.decode(body, skip_special_tokens=False)
        if not self.env.tools:
            return ParsedCalls(text.strip())
        return parse_tool_calls(text, self.family, self.renderer.tools)

    def _turn(self, turn_ids: list[int], finish_reason: str | None) -> list[int] | None:
        st = self.stats
        st.turns += 1
        self.n_tokens += len(turn_ids)
        parsed = self._parse(turn_ids)
        history = list(self.messages)
        assistant = {"role": "assistant", "content": parsed.content}
        ids = [_call_id(st.turns, j) for j in range(len(parsed.calls))]
        if parsed.calls:
            assistant["tool_calls"] = [
                {"type": "function", "id": i, "function": {"name": c.name or "unknown",
                                                           "arguments": getattr(c, "arguments", {})}}
                for i, c in zip(ids, parsed.calls)]
        self.messages.append(assistant)
        if finish_reason == "length":
            st.truncated = "length"
            return None
        if parsed.calls:
            new = self._run_calls(parsed.calls, ids)
        else:
            reply = self.env.step(self.messages)
            if reply is None:
                return None
            new = reply if isinstance(reply, list) else [{"role": "user", "content": str(reply)}]
        if self.env.done:
            return None
        if self.limits.max_turns is not None and st.turns >= self.limits.max_turns:
            st.truncated = "max_turns"
            return None
        env_ids = self.renderer.env_ids(history, new, turn_ids[-1] if turn_ids else None)
        if self.limits.max_tokens is not None and self.n_tokens + len(env_ids) >= self.limits.max_tokens:
            st.truncated = "length"  # no room left for a model token after them
            return None
        self.n_tokens += len(env_ids)
        self.messages += new
        return env_ids

    def _run_calls(self, calls: list[ToolCall | ToolCallError], ids: list[str]) -> list[dict]:
        """The turn's calls, concurrently, as tool messages in the calls' order."""
        t0 = time.perf_counter()

        def one(call):
            fn = self.env.tools.get(call.name) if isinstance(call, ToolCall) else None
            if isinstance(call, ToolCall) and fn is None:
                return ToolCallError(f"unknown tool {call.name!r}; the tools are {', '.join(self.env.tools)}",
                                     call.raw, call.name)
            return call_tool(fn, call, self.limits.tool_timeout_s)

        with ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="rlcu-tool") as pool:
            results = list(pool.map(one, calls))
        self.stats.tool_time_s += time.perf_counter() - t0
        self.stats.tool_calls += len(calls)
        out = []
        for call, cid, r in zip(calls, ids, results):
            if isinstance(r, ToolCallError):
                self.stats.tool_errors += 1
                r = f"Error: {r.message}"
            out.append({"role": "tool", "name": call.name or "unknown", "tool_call_id": cid, "content": r})
        return out
