"""SIGTERM / SIGINT during training (a cluster's preemption is a SIGTERM): the first signal
only sets a flag, so the step in flight finishes and the loop checkpoints, logs and stops
(the command line then exits with 128 + the signal's number); a second signal exits at once
with that status, writing one line to stderr. Handlers are installed only in the main
thread (elsewhere, e.g. a scheduler's job thread, the guard does nothing) and the previous
ones are restored on exit."""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalGuard:
    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"rlcu: second signal ({name}): exiting now without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(2, f"rlcu: received {name}: finishing the step in flight, then checkpointing "
                    f"(send it again to exit at once)\n".encode())

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
