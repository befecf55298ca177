"""verifiers environments under rlcu's GRPO (issue 36; the optional extra `rlcu[verifiers]`).

A `verifiers` multi-turn environment (vf.MultiTurnEnv and its subclasses, the 0.1 - 0.3 API)
runs unchanged as an rlcu environment class (tools/environment.py's protocol), made per episode:

    verifiers                                   rlcu
    state = {prompt, answer, info, task, ...}   reset(row): a fresh state from the row (the
      + setup_state(state)                        dataset's fields), the row's prompt as the start
    is_completed(messages, state)               step(messages): after each model turn; true ends
      (0.3: is_completed(state))                  the episode, else env_response's messages are
    env_response(messages, state)                 the reply (user or tool messages, rendered by
      -> (message(s), state)                      the chat template: token in, token out as for
      (0.3: -> messages; final_env_response)      any environment)
    max_turns                                   the episode ends at that many model turns
    rubric: funcs + weights (a group's          reward(messages): the weighted sum, each function
      flattened), each called with the names it   given what its signature names
      takes of prompt, completion, answer,
      state, task, info, parser

Methods may be plain or `async` (verifiers 0.1.3 made them coroutines); coroutines are run to
completion in the episode's own thread. verifiers 0.4 replaced this API (verifiers.v1: harnesses
and tasksets, no MultiTurnEnv; its 0.3 API needs `verifiers[all]`); a verifiers without
load_environment is refused by name.

Configured as `multi_turn.environment: verifiers:ENV_ID` (verifiers.load_environment(ENV_ID), an
installed environment module) or `verifiers:module.path:function` (a function returning one); from
Python, `environment=` takes a verifiers environment object itself.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

PREFIX = "verifiers:"
_REWARD_ARGS = ("prompt", "completion", "answer", "state", "task", "info", "parser")


class VerifiersError(ValueError):
    """A verifiers environment that rlcu cannot run; the message names it and what is missing."""


def is_verifiers_env(obj) -> bool:
    return not inspect.isclass(obj) and callable(getattr(obj, "env_response", None)) and \
        callable(getattr(obj, "is_completed", None))


def _run(value):
    """A method's result, a coroutine run to completion (in this thread, which runs no loop)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def load(spec: str):
    """The verifiers environment `spec` names: 'verifiers:ENV_ID' or 'verifiers:module:function'."""
    from rlcu.rewards.loader import load_object

    name = spec[len(PREFIX):]
    if ":" in name:
        env = load_object(name, "environment")()
    else:
        try:
            import verifiers as vf
        except ImportError:
            raise VerifiersError(f"environment {spec!r}: the verifiers package is not installed "
                                 f"(pip install 'rlcu[verifiers]')") from None
        if not callable(getattr(vf, "load_environment", None)):
            raise VerifiersError(f"environment {spec!r}: verifiers {getattr(vf, '__version__', '?')} has no "
                                 f"load_environment (rlcu runs the MultiTurnEnv API of verifiers 0.1 - 0.3)")
        env = vf.load_environment(name)
    if not is_verifiers_env(env):
        raise VerifiersError(f"environment {spec!r}: got {type(env).__name__}, not a verifiers multi-turn "
                             f"environment (env_response and is_completed)")
    return env


def _rubric(env) -> list[tuple[Callable, float]]:
    """(function, weight) of the environment's rubric, a rubric group's flattened (0-weight metrics
    drop out of the sum by their weight)."""
    out, todo = [], [getattr(env, "rubric", None)]
    while todo:
        r = todo.pop(0)
        if r is None:
            continue
        if getattr(r, "rubrics", None):
            todo += list(r.rubrics)
            continue
        funcs = list(getattr(r, "funcs", None) or getattr(r, "reward_funcs", None) or [])
        weights = list(getattr(r, "weights", None) or getattr(r, "reward_weights", None) or [1.0] * len(funcs))
        if len(weights) != len(funcs):
            raise VerifiersError(f"{type(env).__name__}.rubric has {len(funcs)} functions and {len(weights)} "
                                 f"weights")
        out += list(zip(funcs, map(float, weights)))
    return out


def _call(fn: Callable, kw: dict):
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return fn(**kw)
    return fn(**{k: v for k, v in kw.items() if k in params})


def adapt(env) -> type:
    """An rlcu environment class (made once per episode) that runs the verifiers environment `env`."""
    if not is_verifiers_env(env):
        raise VerifiersError(f"{type(env).__name__} is not a verifiers multi-turn environment (it needs "
                             f"env_response(messages, state) and is_completed(messages, state))")
    rubric = _rubric(env)
    max_turns = getattr(env, "max_turns", None)

    class VerifiersEpisode:
        def __init__(self):
            self.state: dict = {}
            self.done = False
            self.n_start = 0

        def reset(self, row):
            prompt = row.get("prompt")
            msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
            self.n_start = len(msgs)
            self.state = {"prompt": msgs, "completion": [], "answer": row.get("answer", ""),
                          "task": row.get("task", "default"), "info": row.get("info") or {}, "responses": [],
                          "trajectory": [], "turn": 0}
            if callable(getattr(env, "setup_state", None)):
                self.state = _run(env.setup_state(self.state)) or self.state
            return None

        def step(self, messages):
            st = self.state
            st["turn"] += 1
            st["responses"].append(messages[-1])
            st["trajectory"].append({"completion": [messages[-1]]})
            st["completion"] = list(messages[self.n_start:])
            if _run(_call(env.is_completed, {"messages": messages, "state": st})) or \
                    (max_turns is not None and 0 < max_turns <= st["turn"]):
                self.done = True
                return None
            out = _run(env.env_response(messages, st))
            reply, new_state = out if isinstance(out, tuple) else (out, st)  # 0.1 - 0.2: (messages, state)
            self.state = new_state if isinstance(new_state, dict) else st
            if self.state.get("final_env_response") is not None:  # 0.3: the environment ended it
                self.done = True
                return None
            return [reply] if isinstance(reply, dict) else list(reply)

        def reward(self, messages):
            kw = {"prompt": messages[: self.n_start], "completion": messages[self.n_start:],
                  "answer": self.state.get("answer", ""), "state": self.state, "task": self.state.get("task"),
                  "info": self.state.get("info", {}), "parser": getattr(env, "parser", None)}
            return sum(w * float(_run(_call(fn, kw))) for fn, w in rubric)

    VerifiersEpisode.__name__ = VerifiersEpisode.__qualname__ = f"verifiers.{type(env).__name__}"
    return VerifiersEpisode
