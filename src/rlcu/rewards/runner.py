"""Where a reward function runs, and its time limit.

- inline: in the caller's thread, no limit (the built-ins, or reward_timeout_s: null).
- main (the default): in the caller's thread, as TRL runs reward functions, so that what
  needs the main thread (signal-based timeouts such as math-verify's) works. A watchdog
  thread sends the main thread SIGUSR2 when the call is late (and again each second until it
  stops); the handler raises CallInterrupt, a BaseException so that `except Exception` in
  the function does not swallow it. That stops Python code and blocking calls (sleep, I/O,
  locks), not a C extension that never returns to Python (a catastrophic regex): use
  process for those. Called from another thread, or without SIGUSR2, it runs as thread.
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
import signal
import sys
import threading
from collections.abc import Callable

from rlcu.rewards.call import CallPlan, describe, invoke
from rlcu.timed import CallTimeout, call_with_timeout

WORKERS = ("main", "thread", "process")
_STARTUP_S = 300.0  # a worker's imports (torch, the user's module) may be slow on a busy host


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
        return call_with_timeout(lambda: invoke(self.fn, self.plan, batch, const), timeout,
                                 f"reward:{getattr(self.fn, '__name__', 'fn')}", "reward_timeout_s")


class CallInterrupt(BaseException):
    """Raised in the main thread by the watchdog's signal (see the module docstring)."""


_SIG = getattr(signal, "SIGUSR2", None)
_LOCK = threading.Lock()
_ACTIVE = [False]  # a call is running under the watchdog
_PREV: list = []  # the handler before ours (installed once, for good: no restore races)


def _on_signal(signum, frame):
    if _ACTIVE[0]:
        raise CallInterrupt
    if _PREV and callable(_PREV[0]):
        _PREV[0](signum, frame)


class MainThreadRunner(InlineRunner):
    RESEND_S = 1.0

    def call(self, batch: dict, const: dict, timeout: float | None):
        if timeout is None:
            return invoke(self.fn, self.plan, batch, const)
        if _SIG is None or threading.current_thread() is not threading.main_thread():
            return ThreadRunner.call(self, batch, const, timeout)
        if not _PREV:
            _PREV.append(signal.signal(_SIG, _on_signal))
        try:
            return self._watched(batch, const, timeout)
        except CallInterrupt:
            raise CallTimeout(f"timed out after {timeout:g} s (reward_timeout_s); interrupted") from None

    def _watched(self, batch: dict, const: dict, timeout: float):
        main, done = threading.main_thread().ident, threading.Event()

        def watchdog():
            wait = timeout
            while not done.wait(wait):
                with _LOCK:  # no signal is sent once the call is over
                    if not _ACTIVE[0]:
                        return
                    signal.pthread_kill(main, _SIG)
                wait = self.RESEND_S

        dog = threading.Thread(target=watchdog, name="reward-watchdog", daemon=True)
        _ACTIVE[0] = True
        try:
            dog.start()
            return invoke(self.fn, self.plan, batch, const)
        finally:
            while True:  # a signal landing here, before _ACTIVE is cleared, must not skip the clearing
                try:
                    _ACTIVE[0] = False
                    with _LOCK:  # a kill in flight completes; the handler ignores it now
                        pass
                    break
                except CallInterrupt:
                    continue
            done.set()
            if dog.ident is not None:
                dog.join()


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
    if workers not in WORKERS:
        raise ValueError(f"reward_workers must be one of {', '.join(WORKERS)}, got {workers!r}")
    if builtin:
        return InlineRunner(fn)
    if workers == "process":
        return ProcessRunner(fn, spec)
    if timeout is None:
        return InlineRunner(fn)
    return MainThreadRunner(fn) if workers == "main" else ThreadRunner(fn)
