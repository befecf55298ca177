"""A call under a time limit in a thread of its own: the reward runner's thread workers and the
tools' calls both run user code this way.

Each call gets a fresh daemon thread, never a slot of a fixed pool: a Python thread cannot be
killed, so a call past its limit is abandoned, and in a pool the abandoned ones would hold the
workers and make every later call wait behind them (and time out). Code that may hang for good
belongs in a subprocess (rlcu.tools.sandbox, the rewards' process workers)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class CallTimeout(Exception):
    """The call did not return within the time limit."""


def call_with_timeout(fn: Callable, timeout: float | None, name: str, what: str = "its limit"):
    """fn() in a fresh daemon thread, waited for at most `timeout` seconds (None: no limit); its
    result, or its exception raised here, or CallTimeout naming `what` (the setting that limits it)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise CallTimeout(f"timed out after {timeout:g} s ({what}); its thread is abandoned")
    if "err" in box:
        raise box["err"]
    return box["out"]
