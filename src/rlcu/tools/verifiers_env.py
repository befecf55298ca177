"""verifiers environments under rlcu's GRPO (issue 36; the optional extra `rlcu[verifiers]`).

A `verifiers` multi-turn environment (vf.MultiTurnEnv and its subclasses: the API of verifiers
0.2 and of 0.3's `verifiers.legacy`, which 0.3 still serves as `import verifiers as vf`) runs
unchanged: rlcu runs the environment's own `rollout` (init_state, setup_state, its @vf.stop
conditions and max_turns, env_response, its cleanup handlers) and then its rubric's
`score_rollout` and `cleanup`, as verifiers' run_rollout does, with one substitution: the model is
a vf.Client of rlcu's (`_engine_client`) instead of an OpenAI endpoint. Its get_response hands
the prompt messages to rlcu's episode and waits for the model's turn, which rlcu's engine samples:

    rlcu episode (tools/environment.py)      the verifiers rollout, on rlcu's verifiers loop
    reset(row)                               rollout(row) starts; its first get_response gives
                                               the start messages
    step(messages)                           the model's turn answers that get_response; the
                                               next get_response's new messages are the reply,
                                               the rollout's end ends the episode
    reward(messages)                         the rubric's weighted sum (state["reward"])

The rollouts of all episodes run as tasks of one event loop in a daemon thread, so an
environment's asyncio objects live on one loop, and its awaits (sleeps, subprocesses) overlap
across episodes. The environment's tokens are the chat template's rendering of its messages, as
for any rlcu environment (token in, token out). An episode that rlcu ends (its max_turns or
max_episode_tokens) ends the rollout as a prompt too long for the model would (vf's
OverlongPromptError: state["prompt_too_long"], is_truncated) before it is scored. An environment
error (state["error"], or an exception) masks the episode, as any environment's. Not covered:
tool-calling environments (vf.ToolEnv reads the client's structured tool calls; rlcu parses them
from the text only for rlcu's own tools), group-level reward functions (score_group), and a
get_prompt_messages that rewrites earlier turns (an rlcu episode is one growing token sequence;
refused with VerifiersError). verifiers 0.4 replaced this API (verifiers.v1: harnesses and
tasksets, no MultiTurnEnv) and is refused by name.

Configured as `multi_turn.environment: verifiers:ENV_ID` (verifiers.load_environment(ENV_ID), an
installed environment module) or `verifiers:module.path:function` (a function returning one); from
Python, `environment=` takes a verifiers environment object itself. The rows are verifiers'
dataset rows (`prompt` as messages or a string, `answer`, `info`, `task`): env.get_dataset()'s
rows, its system prompt applied, can be rlcu's data as they are.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import queue
import threading
import time
import weakref

PREFIX = "verifiers:"
_WAIT_S = 600.0  # the longest rlcu waits for the environment between two model turns
_INPUT_KEYS = ("prompt", "answer", "task", "info", "example_id")


class VerifiersError(ValueError):
    """A verifiers environment that rlcu cannot run; the message names it and what is missing."""


def is_verifiers_env(obj) -> bool:
    """A verifiers environment object (not a class): it has env_response, rollout and a rubric."""
    return not inspect.isclass(obj) and all(callable(getattr(obj, m, None)) for m in ("env_response", "rollout")) \
        and hasattr(obj, "rubric")


def _vf(what: str):
    """The verifiers package, refused by name when missing or without the MultiTurnEnv API."""
    try:
        import verifiers as vf
    except ImportError:
        raise VerifiersError(f"{what}: the verifiers package is not installed (pip install "
                             f"'rlcu[verifiers]': verifiers 0.2 - 0.3)") from None
    try:
        vf.MultiTurnEnv, vf.Client  # noqa: B018 - 0.3 serves them lazily: touching them loads them
    except AttributeError as e:
        raise VerifiersError(f"{what}: verifiers {getattr(vf, '__version__', '?')} has no MultiTurnEnv or Client "
                             f"(rlcu runs the MultiTurnEnv API of verifiers 0.2 - 0.3; 0.4 moved to verifiers.v1): "
                             f"{e}") from None
    return vf


def load(spec: str):
    """The verifiers environment `spec` names: 'verifiers:ENV_ID' or 'verifiers:module:function'."""
    from rlcu.rewards.loader import load_object

    name = spec[len(PREFIX):]
    if ":" in name:
        env = load_object(name, "environment")()
    else:
        vf = _vf(f"environment {spec!r}")
        if not callable(getattr(vf, "load_environment", None)):
            raise VerifiersError(f"environment {spec!r}: verifiers {getattr(vf, '__version__', '?')} has no "
                                 f"load_environment")
        env = vf.load_environment(name)
    if not is_verifiers_env(env):
        raise VerifiersError(f"environment {spec!r}: got {type(env).__name__}, not a verifiers multi-turn "
                             f"environment (env_response, rollout and a rubric)")
    return env


# ---------------------------------------------------------------- the loop the rollouts run on
_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _the_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="rlcu-verifiers", daemon=True).start()
        return _loop


def _as_dicts(messages) -> list[dict]:
    """verifiers' messages (pydantic models or dicts) as rlcu's chat dicts."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: v for k, v in d.items() if v is not None})
    return out


def _engine_client(vf, bridge: _Bridge):
    """A vf.Client whose model is rlcu's engine, through `bridge` (one episode's)."""
    from verifiers.types import Response, ResponseMessage

    class EngineClient(vf.Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return _as_dicts(messages), {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return await bridge.ask(prompt)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            content, finish = response
            return Response(id=f"rlcu-{next(bridge.ids)}", created=int(time.time()), model="rlcu",
                            message=ResponseMessage(content=content, finish_reason=finish,
                                                    is_truncated=finish == "length"))

        async def close(self):
            return None

    return EngineClient(None)


class _Bridge:
    """One episode's exchange between the rollout (on the loop) and rlcu's engine thread: the
    rollout's asks (prompt messages) come out through `events`; the model's turns go back into
    the asking future."""

    def __init__(self, loop):
        self.loop, self.events, self.pending, self.ids = loop, queue.Queue(), None, itertools.count()

    async def ask(self, prompt: list[dict]):
        self.pending = self.loop.create_future()
        self.events.put(("ask", prompt))
        return await self.pending

    def answer(self, content: str, finish: str = "stop") -> None:
        fut, self.pending = self.pending, None
        self.loop.call_soon_threadsafe(fut.set_result, (content, finish))

    def refuse(self, exc: Exception) -> None:
        fut, self.pending = self.pending, None
        self.loop.call_soon_threadsafe(fut.set_exception, exc)

    def next(self, what: str):
        try:
            return self.events.get(timeout=_WAIT_S)
        except queue.Empty:
            raise VerifiersError(f"the verifiers environment gave nothing for {_WAIT_S:.0f} s {what}") from None


def _input(row: dict, n: int) -> dict:
    inp = {k: row[k] for k in _INPUT_KEYS if row.get(k) is not None}
    if isinstance(inp.get("prompt"), str):  # a chat prompt (verifiers reads a string as a completion prompt)
        inp["prompt"] = [{"role": "user", "content": inp["prompt"]}]
    inp.setdefault("example_id", n)
    return inp


def adapt(env) -> type:
    """An rlcu environment class (made once per episode) that runs the verifiers environment `env`."""
    vf = _vf(f"environment {type(env).__name__}")
    if not isinstance(env, vf.MultiTurnEnv):
        raise VerifiersError(f"{type(env).__name__} is not a verifiers multi-turn environment (a vf.MultiTurnEnv)")
    loop, episodes = _the_loop(), itertools.count()

    async def run(bridge: _Bridge, inp: dict):
        try:
            state = await env.rollout(inp, _engine_client(vf, bridge), "rlcu", {})
            await env.rubric.score_rollout(state)
            await env.rubric.cleanup(state)
            bridge.events.put(("done", state))
        except BaseException as e:  # noqa: BLE001 - the environment's: the episode is masked
            bridge.events.put(("error", e))
            raise

    class VerifiersEpisode:
        def __init__(self):
            self.bridge, self.seen, self.state, self.done = _Bridge(loop), [], None, False

        def reset(self, row):
            task = asyncio.run_coroutine_threadsafe(run(self.bridge, _input(row, next(episodes))), loop)
            weakref.finalize(self, task.cancel)  # an episode rlcu dropped unscored (its run failed)
            self.seen = self._take("before the first model turn")
            if self.seen is None:
                raise VerifiersError(f"{type(env).__name__} ended its rollout before the model's first turn")
            return self.seen

        def _take(self, what: str) -> list[dict] | None:
            """The rollout's next ask (its prompt messages), or None when it ended (scored)."""
            kind, val = self.bridge.next(what)
            if kind == "error":
                raise val
            if kind == "done":
                self.done, self.state = True, val
                if val.get("error") is not None:
                    raise VerifiersError(f"{type(env).__name__}: {val['error']!r}")
                return None
            return val

        def step(self, messages):
            self.bridge.answer(messages[-1].get("content") or "")
            prompt = self._take("after a model turn")
            if prompt is None:
                return None
            n = len(messages)
            if len(prompt) <= n or [m["role"] for m in prompt[:n]] != [m["role"] for m in messages]:
                raise VerifiersError(f"{type(env).__name__}.get_prompt_messages did not extend the conversation "
                                     f"(rlcu's episode is one growing token sequence)")
            self.seen = prompt
            return prompt[n:]

        def reward(self, messages):
            while self.state is None:  # rlcu ended the episode: end the rollout as too long, then scored
                if len(messages) > len(self.seen) and self.bridge.pending is not None:
                    self.bridge.answer(messages[-1].get("content") or "", "length")
                    self.seen = list(messages)
                else:
                    self.bridge.refuse(vf.OverlongPromptError("the episode reached rlcu's limits"))
                self._take("at the episode's end")
            return float(self.state.get("reward") or 0.0)

    VerifiersEpisode.__name__ = VerifiersEpisode.__qualname__ = f"verifiers.{type(env).__name__}"
    return VerifiersEpisode
