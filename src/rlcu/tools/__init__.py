"""Tools for multi-turn RL (issue 36): tool schemas from Python functions, tool calls parsed from
each family's chat format and run under a time limit, and the built-in Python execution tool
`run_python`, a sandboxed interpreter with documented limits (sandbox.py, confine.py), also the
model-callable tool `python`; environments and tools from plain Python (environment.py) and the
turn of an episode (turns.py: tool calls run, results rendered as the template's tokens)."""

from rlcu.tools.environment import Environment, EnvironmentSpecError
from rlcu.tools.sandbox import DEFAULTS, SandboxLimits, SandboxResult, python, run_python

__all__ = ["DEFAULTS", "Environment", "EnvironmentSpecError", "SandboxLimits", "SandboxResult", "python", "run_python"]
