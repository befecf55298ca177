"""Environments and tools from plain Python, for multi-turn episodes (issue 36).

An environment is a class made once per episode (`cls()`), whose methods are all optional:

    reset(row) -> str | messages | None   the first observation: a str is the first user message
                                          (after the prompt's system message, if any), a list of
                                          chat messages the whole start, None the row's prompt
    <tool methods>(...)                   every other public method is a tool, its JSON schema from
                                          its signature and docstring (rlcu.tools.schema)
    step(messages) -> str | messages | None   for a turn without tool calls: the user's reply to
                                          the conversation so far, or the messages that follow it
                                          (None: the episode is over)
    reward(messages) -> float             the episode's reward (beside the reward functions)
    done                                  an attribute: True ends the episode after this turn

Plain tool functions work without a class (`tools=[fn, "module:function"]`); `rlcu.tools:python`
is the built-in sandboxed Python tool. A turn without tool calls in an environment without
`step` ends the episode: the model has answered. A verifiers multi-turn environment (an object, or
'verifiers:ENV_ID') runs through its adapter (rlcu.tools.verifiers_env).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from rlcu.rewards.loader import load_object
from rlcu.tools import verifiers_env
from rlcu.tools.schema import ToolSchemaError, json_schema

RESERVED = ("reset", "step", "reward", "done", "close")


class EnvironmentSpecError(ValueError):
    """An environment or tool that cannot be used; the message names it and what is wrong."""


def _tool_methods(cls: type) -> dict[str, Callable]:
    out = {}
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name.startswith("_") or name in RESERVED:
            continue
        out[name] = fn
    return out


def _schema(fn: Callable, where: str, why: str = "") -> dict:
    try:
        return json_schema(fn)
    except ToolSchemaError as e:
        raise EnvironmentSpecError(f"{where}: {e}{why}") from None


class Environment:
    """What a run's episodes are made of: an environment class (a class or 'module:Class'; None:
    tools alone) and plain tools (functions or 'module:function'). `schemas` are the tools' JSON
    schemas as the chat template takes them; `make()` one episode's `EpisodeEnv`."""

    def __init__(self, environment=None, tools=()):
        if isinstance(environment, str) and environment.startswith(verifiers_env.PREFIX):
            environment = verifiers_env.load(environment)
        elif isinstance(environment, str):
            environment = load_object(environment, "environment")
        if verifiers_env.is_verifiers_env(environment):
            environment = verifiers_env.adapt(environment)
        if environment is not None and not inspect.isclass(environment):
            raise EnvironmentSpecError(f"environment must be a class (made once per episode) or 'module:Class', "
                                       f"got {environment!r}")
        self.cls = environment
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for i, t in enumerate(tools or ()):
            fn = load_object(t, f"tools[{i}]") if isinstance(t, str) else t
            if not callable(fn):
                raise EnvironmentSpecError(f"tools[{i}] must be a function or 'module:function', got {t!r}")
            self._add(getattr(fn, "__name__", f"tool{i}"), _schema(fn, f"tools[{i}]"))
            self.functions[self.schemas[-1]["function"]["name"]] = fn
        self.methods = _tool_methods(environment) if environment is not None else {}
        for name, fn in self.methods.items():
            why = " (every public method of an environment is a tool: prefix a helper's name with _)"
            self._add(name, _schema(fn, f"environment {environment.__name__}, method {name}", why))

    def _add(self, name: str, schema: dict) -> None:
        if any(s["function"]["name"] == name for s in self.schemas):
            raise EnvironmentSpecError(f"tools: two tools are named {name!r}; tool names must be unique")
        self.schemas.append(schema)

    def has(self, method: str) -> bool:
        return self.cls is not None and callable(getattr(self.cls, method, None))

    def make(self) -> EpisodeEnv:
        obj = self.cls() if self.cls is not None else None
        tools = dict(self.functions)
        tools.update({name: getattr(obj, name) for name in self.methods})
        return EpisodeEnv(self, obj, tools)


class EpisodeEnv:
    """One episode's environment object (or none) and its tools by name, bound to it."""

    def __init__(self, spec: Environment, obj, tools: dict[str, Callable]):
        self.spec, self.obj, self.tools = spec, obj, tools

    def start(self, row: dict, prompt) -> list[dict]:
        """The episode's first messages: reset(row)'s observation, else the row's prompt."""
        obs = self.obj.reset(row) if self.spec.has("reset") else None
        base = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        if obs is None:
            msgs = base
        elif isinstance(obs, str):
            msgs = [m for m in base[:1] if m.get("role") == "system"] + [{"role": "user", "content": obs}]
        else:
            msgs = list(obs)
        if not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise EnvironmentSpecError(f"the episode's first messages must be a non-empty list of chat messages "
                                       f"({{'role': ..., 'content': ...}}) from reset(row) or the row's prompt, "
                                       f"got {msgs!r}")
        return msgs

    def step(self, messages: list[dict]) -> str | None:
        return self.obj.step(messages) if self.spec.has("step") else None

    @property
    def done(self) -> bool:
        return bool(getattr(self.obj, "done", False))

    def reward(self, messages: list[dict]) -> float | None:
        return float(self.obj.reward(messages)) if self.spec.has("reward") else None
