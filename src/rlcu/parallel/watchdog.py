"""Every rank's watchdog: a rank that raises or dies ends the whole job within a bounded time,
with a message naming the rank and its error, instead of leaving the others blocked in a
collective until the process group's timeout (or forever).

A daemon thread per rank talks to the rendezvous store (keys under rlcu/watchdog/):
    hb/<r>    a counter rank r's thread bumps every `interval` seconds (its heartbeat)
    err/<r>   the error of a rank that failed (set by `report`, from the rank itself, or by
              the rank that saw it stop beating); nerr counts them
    done/<r>  rank r finished cleanly (its heartbeat may stop); ndone counts them
Each thread watches the next rank's heartbeat (a ring, so the store sees O(N) calls a tick)
and every tick reads nerr: on another rank's error it prints "rank R failed: ..." and ends
its process at once (os._exit: the main thread may be inside a collective that cannot be
interrupted). A peer whose heartbeat has not moved for `timeout_s` is declared dead; a store
that cannot be reached for `timeout_s` means its host is gone (rank 0 without torchrun's
agent). So a failure ends every rank within about timeout_s + interval.

A rank also watches its launcher (the parent process: torchrun's agent). torchrun starts each
rank in a session of its own, so a `kill -9` of torchrun reaches no rank, and their collectives
(peer to peer) go on without it: they would train, log and checkpoint into the run folder until
the store's bound, racing a restart into the same folder. A rank whose parent is gone (its
parent pid changed: it was reparented) ends at the next tick through os._exit, writing nothing
more: no checkpoint of the step in flight (that is SIGTERM's graceful stop, for a launcher that
is still there), and a sharded checkpoint checks once more before it commits. Polling, not
prctl(PR_SET_PDEATHSIG): a signal reaches the main thread only between two collectives, and
the trainer reads SIGTERM as "finish the step and checkpoint". torchrun with one rank makes no
process group (so no Watchdog): `watch_launcher` runs the same check alone.
"""

from __future__ import annotations

import os
import sys
import threading
import time

EXIT_CODE = 17  # a rank ended by its watchdog because another rank failed
_AT_DIE: list = []  # fn(msg) called before the watchdog ends the process (e.g. tell a scheduler)


def at_die(fn):
    """Call fn(msg) when this rank's watchdog ends the process (another rank failed); fn must
    return within a few seconds. Returns a function that removes it again."""
    _AT_DIE.append(fn)
    return lambda: fn in _AT_DIE and _AT_DIE.remove(fn)


def _end(rank: int, msg: str) -> None:
    print(f"rlcu: rank {rank} stops: {msg}", file=sys.stderr, flush=True)
    for fn in list(_AT_DIE):
        try:
            fn(msg)
        except Exception as e:  # the process ends anyway
            print(f"rlcu: rank {rank}: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def _launcher_gone(pid: int) -> str:
    return (f"its launcher (pid {pid}, e.g. torchrun) is gone: stopping at once, without checkpointing "
            f"the step in flight (resume from the last checkpoint)")


def watch_launcher(interval_s: float = 1.0) -> None:
    """The launcher check alone, in a daemon thread: for torchrun with one rank, which makes no
    process group and so no Watchdog, but whose launcher may die all the same."""
    parent = os.getppid()

    def run():
        while os.getppid() == parent:
            time.sleep(interval_s)
        _end(0, _launcher_gone(parent))

    threading.Thread(target=run, name="rlcu-launcher-watch", daemon=True).start()


class Watchdog:
    def __init__(self, store, rank: int, size: int, timeout_s: float, interval_s: float | None = None):
        self.store, self.rank, self.size, self.timeout_s = store, rank, size, float(timeout_s)
        self.interval_s = interval_s if interval_s is not None else min(1.0, self.timeout_s / 10)
        self._stop = threading.Event()
        self._reported = False
        self._thread = threading.Thread(target=self._run, name=f"rlcu-watchdog-{rank}", daemon=True)
        self.peer = (rank + 1) % size
        self.parent = os.getppid()  # the launcher (torchrun's agent); see the module docstring

    def start(self) -> None:
        self.store.add(f"hb/{self.rank}", 1)
        self._thread.start()

    def report(self, msg: str) -> None:
        """This rank failed with `msg`: tell the others (once)."""
        if self._reported:
            return
        self._reported = True
        try:
            self.store.set(f"err/{self.rank}", msg[:4000])
            self.store.add("nerr", 1)
        except Exception:  # the store is gone too: the others find out by its absence
            pass

    def wait_for_peer_failure(self) -> None:
        """Block up to the heartbeat bound while the thread looks for another rank's failure
        (it ends the process when it finds one); return if it finds none."""
        deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.interval_s / 2)

    def finish(self, wait_s: float | None = None) -> None:
        """This rank is done: mark it, wait (bounded) until every rank is, stop the thread."""
        deadline = time.monotonic() + (wait_s if wait_s is not None else self.timeout_s * 10)
        try:
            self.store.add(f"done/{self.rank}", 1)
            self._wait_count("ndone", 1, deadline)
        finally:
            self._stop.set()
            self._thread.join(timeout=5 * self.interval_s + 1)
        # the store may live in rank 0's process: it leaves after every other rank has let go
        try:
            self._wait_count("nleft", 1, time.monotonic() + 30 if self.rank == 0 else 0)
        except Exception:
            pass

    def _wait_count(self, key: str, inc: int, deadline: float) -> None:
        n = self.store.add(key, inc)
        while n < self.size and time.monotonic() < deadline:
            time.sleep(self.interval_s / 4)
            n = self.store.add(key, 0)

    def check_parent(self) -> None:
        """End this process now if its launcher is gone (the thread calls it every tick; a
        checkpoint calls it before it commits, so none is written after the launcher died)."""
        if os.getppid() != self.parent:
            self._die(_launcher_gone(self.parent))

    # ---------------------------------------------------------------- the thread
    def _die(self, msg: str) -> None:
        _end(self.rank, msg)

    def _other_error(self) -> str | None:
        if self.store.add("nerr", 0) <= 0:
            return None
        for r in range(self.size):
            if r != self.rank and self.store.check([f"err/{r}"]):
                return f"rank {r} failed: {self.store.get(f'err/{r}').decode(errors='replace')}"
        return None

    def _run(self) -> None:
        last_hb, last_change = None, time.monotonic()
        store_ok = time.monotonic()
        while not self._stop.wait(self.interval_s):
            self.check_parent()  # before the store, which may have lived in the launcher
            try:
                self.store.add(f"hb/{self.rank}", 1)
                err = self._other_error()
                if err is not None and not self._stop.is_set() and not self._reported:
                    self._die(err)  # (a rank that failed itself is ending already, with its own status)
                hb = self.store.add(f"hb/{self.peer}", 0)
                now = time.monotonic()
                store_ok = now
                if hb != last_hb:
                    last_hb, last_change = hb, now
                elif now - last_change > self.timeout_s and not self.store.check([f"done/{self.peer}"]):
                    msg = (f"no heartbeat for {now - last_change:.0f} s (killed, or its process is stuck "
                           f"outside Python; RLCU_DIST_HEARTBEAT_S={self.timeout_s:g})")
                    try:
                        self.store.set(f"err/{self.peer}", msg)
                        self.store.add("nerr", 1)
                    except Exception:
                        pass
                    self._die(f"rank {self.peer} failed: {msg}")
            except Exception as e:  # the store's host is gone
                if self._stop.is_set():
                    return
                if time.monotonic() - store_ok > self.timeout_s:
                    self._die(f"the rendezvous store has been unreachable for {self.timeout_s:g} s "
                              f"({type(e).__name__}: {e}): its host (rank 0, or torchrun's agent) is gone")
