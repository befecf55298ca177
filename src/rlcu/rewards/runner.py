"""Where a reward function runs, and its time limit.

- inline: in the caller's thread, no limit (the built-ins, or reward_timeout_s: null).
- thread: each call in a fresh daemon thread, waited for at most `timeout_s`. A late call
  is abandoned: a Python thread cannot be stopped, so a function that never returns keeps
  its thread (and, if it spins, a share of the CPU) until the process ends; the run goes
  on, and stops after `reward_max_failed_steps` such steps.
- process: a worker process per function (spawned, so it shares nothing with the trainer's
  CUDA context), which loads the function by name and serves calls over a pipe. A late or
  crashed worker is killed and a fresh one started for the next call. The function must be
  importable by name ('module:function' or a module-level function); its arguments and
  return value travel pickled.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import sys
import threading
from collections.abc import Callable

from rlcu.rewards.call import CallPlan, describe, invoke

_STARTUP_S = 300.0  # a worker's imports (torch, the user's module) may be slow on a busy host


class CallTimeout(Exception):
    """The call did not return within the time limit."""


class RemoteError(Exception):
    """An exception raised by the function in a worker (its description as the message)."""


class InlineRunner:
    def __init__(self, fn: Callable):
        self.fn, self.plan = fn, CallPlan(fn)

    def call(self, batch: dict, const: dict, timeout: float | None):
        return invoke(self.fn, self.plan, batch, const)

    def close(self) -> None:
        pass


class ThreadRunner(InlineRunner):
    def call(self, batch: dict, const: dict, timeout: float | None):
        box: dict = {}

        def run():
            try:
                box["out"] = invoke(self.fn, self.plan, batch, const)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["err"] = e

        t = threading.Thread(target=run, name=f"reward:{getattr(self.fn, '__name__', 'fn')}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise CallTimeout(f"timed out after {timeout:g} s (reward_timeout_s); its thread is abandoned")
        if "err" in box:
            raise box["err"]
        return box["out"]


def _worker_main(conn, payload: bytes, path: list[str]) -> None:
    """The worker process: load the function, then answer calls until told to stop."""
    for p in reversed(path):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        spec = pickle.loads(payload)
        if isinstance(spec, str):
            from rlcu.rewards.loader import load_reward

            fn = load_reward(spec)
        else:
            fn = spec
        plan = CallPlan(fn)
        conn.send(("ready", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("err", f"could not load the function in its worker process: {describe(e)}"))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        try:
            out = invoke(fn, plan, *msg)
            try:
                conn.send(("ok", out))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                conn.send(("err", f"returned a value that cannot be sent back from its worker process: {e}"))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            conn.send(("err", describe(e)))


class ProcessRunner:
    def __init__(self, fn: Callable, spec: str | None = None):
        """spec: 'module:function' to load in the worker (else fn is pickled by reference)."""
        self.plan = CallPlan(fn)
        target = spec if spec is not None else fn
        try:
            self.payload = pickle.dumps(target)
            if spec is None:
                pickle.loads(self.payload)
        except Exception as e:  # noqa: BLE001 - any pickling failure means the same
            raise ValueError(f"reward_workers=process needs a function importable by name ('module:function' or "
                             f"a module-level function); {fn!r} is not ({type(e).__name__}: {e}); use "
                             f"reward_workers=thread for it") from None
        self.proc = self.conn = None
        self.ready = False
        self.start()

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, self.payload, list(sys.path)), daemon=True,
                                name="rlcu-reward-worker")
        self.proc.start()
        child.close()
        self.ready = False

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.conn.close()
        self.proc = self.conn = None

    def _recv(self, timeout: float | None, what: str):
        if not self.conn.poll(timeout):
            self._kill()
            raise CallTimeout(f"timed out after {timeout:g} s ({what}); its worker process was killed")
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode if self.proc is not None else None
            self._kill()
            raise RemoteError(f"its worker process died (exit code {code})") from None

    def call(self, batch: dict, const: dict, timeout: float | None):
        if self.proc is None or not self.proc.is_alive():
            self._kill()
            self.start()
        if not self.ready:
            kind, msg = self._recv(_STARTUP_S, "starting its worker process")
            if kind == "err":
                self._kill()
                raise RemoteError(msg)
            self.ready = True
        const = {k: v for k, v in const.items() if k not in ("log_extra", "log_metric")}
        self.conn.send((batch, const))
        kind, out = self._recv(timeout, "reward_timeout_s")
        if kind == "err":
            raise RemoteError(out)
        return out

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(2)
        self._kill()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the pipe may be gone
            pass


def make_runner(fn: Callable, spec: str | None, builtin: bool, workers: str, timeout: float | None):
    if workers not in ("thread", "process"):
        raise ValueError(f"reward_workers must be thread or process, got {workers!r}")
    if builtin:
        return InlineRunner(fn)
    if workers == "process":
        return ProcessRunner(fn, spec)
    return InlineRunner(fn) if timeout is None else ThreadRunner(fn)
