"""Tools for multi-turn RL (issue 36): tool schemas from Python functions, tool calls parsed from
each family's chat format and run under a time limit, and the built-in Python execution tool
`run_python`, a sandboxed interpreter with documented limits (sandbox.py, confine.py)."""

from rlcu.tools.sandbox import DEFAULTS, SandboxLimits, SandboxResult, run_python

__all__ = ["DEFAULTS", "SandboxLimits", "SandboxResult", "run_python"]
