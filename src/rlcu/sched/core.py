"""The scheduler service's logic, free of any transport: jobs, their phase requests and
leases, heartbeats, persistence, metrics. The core owns these books and makes every change
to them safe; what a message may do to them, the verbs, is `core.ops`, an `Operations`
holding the core (ops.py, which says why two classes). The socket server (server.py) and the
Ray actor (ray_backend.py) both wrap one `Core` and feed it messages:

    core.handle({"op": "request", "job": "a", "phase": "rollout", "mem": 30}) -> {"ok": True, ...}

Every message is one operation under one lock and one SQLite transaction. An operation that
fails, for whatever reason, gets {"ok": False, "error": ...} and leaves no trace: its
transaction is rolled back and, if it had changed anything, the state in memory is reloaded
from the database. After every operation that changes the state (and every tick) the
policy's books are audited (audit.py: the pool's invariants plus the core's own: every held
lease has its open span, the metrics tally agrees with the leases; over what changed, so
O(1) amortised; the operations of a group-commit batch, `deferred`: once for the batch,
before the commit that holds them, so before any of their replies leaves); a violation
(InvariantError, never an `assert`: `python -O` keeps it) is fatal: the transaction
is not committed, every later message is refused with code "fatal", and `on_fatal` is called
(`rlcu sched serve` exits non-zero) rather than serve a wrong state. The state folder is
locked (`<db>.lock`) for the life of the core: a second service on it is refused.

Liveness (monotonic clock): any message naming a job refreshes its heartbeat; a running job
silent for longer than `heartbeat_timeout`, or a submitted one whose worker has not attached
within `start_grace_s`, is declared dead by `tick()` and loses its leases and requests. A
rollout lease the policy asked to yield is marked in the job's view (`"yield": true`); when
the job gives it back and asks for rollout again, its request keeps its original age.

Cost. status/metrics read a running `Tally` (metrics.py), never the lease history; ended
leases are kept in memory for the last `keep_spans` and in the database for `history_s`, at
most `history_rows` of them (then
pruned by `tick()`; the tally keeps what they counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sqlite3
import sys
import threading
import time
import traceback
from pathlib import Path

from rlcu.sched import metrics as mx
from rlcu.sched.audit import Audit
from rlcu.sched.journal import Journal
from rlcu.sched.ops import MAX_WAIT_S, Operations, SchedRequestError
from rlcu.sched.pool import InvariantError, PolicyError, Request
from rlcu.sched.recovery import Recovery
from rlcu.sched.store import Job, StateLocked, Store, StoreError, lock_state
from rlcu.sched.views import LIVE, Snapshot, job_view, metrics_of

PRUNE_BATCH = 5000  # ended leases deleted per tick at most (a backlog takes the following ticks)
MUTATING = frozenset({"register", "request", "withdraw", "release", "work", "finish", "cancel"})


class _Batch:
    __slots__ = ("failure",)

    def __init__(self):
        self.failure: dict | None = None


class Core(Recovery):
    def __init__(self, capacity: list[float] | None = None, *, state=None, policy: str = "phase",
                 aging_s: float = 60.0, heartbeat_timeout: float = 30.0, device_names: list[str] | None = None,
                 clock=time.time, mono=time.monotonic, fresh: bool = False, start_grace_s: float | None = None,
                 keep_spans: int = 10_000, history_s: float = 7 * 86400.0, history_rows: int = 1_000_000,
                 on_fatal=None):
        """capacity: memory per device (None: the pool saved in `state`); state: the SQLite file
        (None: in memory); fresh: begin anew even if `state` holds an old or unusable state
        (moved aside, never deleted); start_grace_s: how long a submitted job's worker may take
        to attach (default max(heartbeat_timeout, 300)); on_fatal(message): called once when an
        invariant fails."""
        self.clock, self.mono = clock, mono
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.start_grace_s = float(start_grace_s) if start_grace_s is not None else max(self.heartbeat_timeout, 300.0)
        self.keep_spans, self.history_s, self.history_rows = int(keep_spans), float(history_s), int(history_rows)
        self.on_fatal, self.fatal = on_fatal, None
        self._lock_fd = None
        if state is not None:
            state = Path(state)
            state.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            ran_here = state.with_name(state.name + ".lock").exists()
            self._lock_fd = lock_state(state)
            if ran_here and not state.exists() and not fresh:
                os.close(self._lock_fd)
                raise StoreError(f"{state} is gone, but a scheduler ran on this state folder (its lock file is "
                                 "there): its jobs and leases are lost; refusing to start empty without a word "
                                 "(start with --fresh to begin with an empty state)")
        try:
            self.store = Store(state, fresh=fresh)
            self._init_pool(capacity, state, policy, aging_s, device_names)
            self.cond = threading.Condition(threading.RLock())
            self._unaudited = False  # ops kept without their audit (a deferred batch): audit before commit
            self._deferring = threading.local()  # .tx: inside `deferred()` on this thread, the last op's
            self.versions: Journal[str, int] = Journal()  # job -> its view's version (the audit reads who changed)
            self._auditor = Audit()
            self.closed = False
            self.ops = Operations(self)  # the verbs (ops.py): handle dispatches to them
            self._ops = {}
            for name in dir(self.ops):
                if name.startswith("op_"):
                    fn = getattr(self.ops, name)
                    ps = inspect.signature(fn).parameters
                    self._ops[name[3:]] = (fn, frozenset(ps), [k for k, p in ps.items()
                                                               if p.default is inspect.Parameter.empty])
            try:
                self._load(recovering=True)
            except PolicyError as e:  # a row the books cannot take (an unknown cluster or phase)
                raise StoreError(f"the state in {state} does not fit its pool and jobs ({e}); refusing to serve it "
                                 "(start with --fresh to move it aside and begin anew)") from None
            self._reconcile_tally()
            try:
                self._audit()
            except InvariantError as e:
                raise StoreError(f"the state in {state} fails the scheduler's invariants ({e}); refusing to serve "
                                 "it (start with --fresh to move it aside and begin anew)") from None
            self.store.commit(self._meta())
            self._prune_at = self.mono() + 60.0
        except BaseException as e:
            if getattr(self, "store", None) is not None:
                with contextlib.suppress(Exception):
                    self.store.db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            if isinstance(e, sqlite3.Error):  # (a full disk at start): one line, not a traceback
                raise StoreError(f"{state}: the database failed at start ({type(e).__name__}: {e}); its last "
                                 "committed state is kept") from None
            raise

    # ------------------------------------------------------------------ the books
    def bump(self, job: str) -> None:
        """The job's view changed: its version goes up (a `wait` on the old one returns)."""
        self.versions[job] = self.versions.get(job, 0) + 1

    def remember(self, s: mx.Span) -> None:
        """An ended lease's span, kept in memory among the last keep_spans."""
        self.ended[s.id] = s
        self.history_count += 1
        while len(self.ended) > self.keep_spans:
            self.ended.popitem(last=False)

    def span(self, lease_id: int) -> mx.Span | None:
        """The span of a held lease or of a remembered ended one."""
        return self.held.get(lease_id) or self.ended.get(lease_id)

    def view(self, job: str) -> dict:
        return job_view(self, job)

    def _meta(self) -> dict:
        """What every commit writes beside the operations' rows: the metrics tally, the next id
        (so that ids stay unique when the history they were seen in has been pruned) and the
        metrics clock (a restart goes on from it)."""
        return {"live": {"tally": self.tally.to_dict(), "next_id": self.pol.next_id, "mtime": self.mtime()}}

    def close(self) -> None:
        """Wake every waiter, close the database (the state stays on disk) and free the state folder."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            if self._unaudited and self.fatal is None:
                try:
                    self._audit()
                except InvariantError as e:
                    self._fail(f"{e} (found at close)")
            if self.fatal is not None:  # the database keeps the last good state: nothing more is written
                with contextlib.suppress(Exception):
                    self.store.rollback()
                with contextlib.suppress(Exception):
                    self.store.close()
            else:
                try:
                    self.store.close(self._meta())
                except Exception as e:  # noqa: BLE001  (a full disk at the very end: the last commit stands)
                    print(f"rlcu sched: the database could not commit at close ({type(e).__name__}: {e}); it keeps "
                          "the last committed state", file=sys.stderr, flush=True)
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ------------------------------------------------------------------ dispatch, audit, failure
    def handle(self, msg) -> dict:
        """One message -> one reply; never raises."""
        if not isinstance(msg, dict):
            return {"ok": False, "error": "a message is a JSON object with an 'op'", "code": "protocol"}
        op = msg.get("op")
        entry = self._ops.get(op) if isinstance(op, str) else None
        if entry is None:
            return {"ok": False, "error": f"unknown op {op!r}; ops: {', '.join(sorted(self._ops))}", "code": "protocol"}
        fn, params, required = entry
        args = {k: v for k, v in msg.items() if k != "op"}
        bad = [k for k in args if k not in params]
        if bad:
            err = f"op {op!r} takes no argument {bad[0]!r} (takes: {', '.join(sorted(params)) or 'none'})"
            return {"ok": False, "error": err, "code": "protocol"}
        missing = [k for k in required if k not in args]
        if missing:
            return {"ok": False, "error": f"op {op!r} needs {missing[0]!r}", "code": "protocol"}
        mutating = op in MUTATING
        with self.cond:
            if self.closed:
                return {"ok": False, "error": "the scheduler is shutting down", "code": "unavailable"}
            if self.fatal is not None:
                return self._fatal_reply()
            reply, tx = self._run(op, fn, args, mutating)
        if tx is not None:
            if getattr(self._deferring, "tx", None) is not None:  # the block's end commits it
                self._deferring.tx = max(self._deferring.tx, tx)
            elif not self._durable(tx):
                return self._fatal_reply()
        return reply

    @contextlib.contextmanager
    def deferred(self):
        """Group commit for a batch of messages: what this thread's `handle` calls in the block
        change is committed once, at the block's end, instead of once per call. Their replies
        must not leave before the block ends; then `batch.failure` is None, or the reply every
        one of them must get instead (the commit failed: fatal; or the service closed).

            with core.deferred() as batch:
                replies = [core.handle(m) for m in msgs]
            replies = replies if batch.failure is None else [batch.failure] * len(replies)
        """
        batch = _Batch()
        loc = self._deferring
        outer, loc.tx = getattr(loc, "tx", None), 0
        try:
            yield batch
        finally:
            tx, loc.tx = loc.tx, outer
            if outer is not None:  # nested: the outer block commits
                loc.tx = max(outer, tx)
            elif tx and not self._durable(tx):
                batch.failure = self._fatal_reply() if self.fatal is not None else \
                    {"ok": False, "error": "the scheduler is shutting down", "code": "unavailable"}

    def _run(self, op: str, fn, args: dict, mutating: bool):
        """Run one operation (under the lock): its reply, and the transaction its reply waits
        for (None: what it shows is committed)."""
        tally = self.tally.copy() if mutating else None
        try:
            out = fn(**args)
        except Exception as e:  # noqa: BLE001  (every failure becomes a reply; the state is put back)
            reply = self._failed(op, args, e, mutating, tally)
        else:
            if mutating and not self._keep(defer_audit=getattr(self._deferring, "tx", None) is not None):
                return self._fatal_reply(), None
            reply = {"ok": True, **(out or {})}
        return reply, self.store.tx_no if self.store.in_tx else None

    def _durable(self, tx: int) -> bool:
        """Wait until transaction `tx` is committed (commit it, with every operation kept in it
        since: a group commit). False if the service stopped first."""
        with self.cond:
            if self.store.done_tx >= tx:
                return True
            if self.fatal is not None or self.closed:
                return False
            if self._unaudited:  # a batch's ops (deferred): audited here, before anything of them is committed
                try:
                    self._audit()
                except InvariantError as e:
                    self._fail(f"{e} (after a batch of operations)")
                    return False
            try:
                self.store.commit(self._meta())
            except Exception as e:  # noqa: BLE001  (a full disk, a database gone bad)
                self._fail(f"the database could not commit: {type(e).__name__}: {e}")
                return False
            return True

    def _fatal_reply(self) -> dict:
        return {"ok": False, "error": f"the scheduler stopped on a broken invariant: {self.fatal}", "code": "fatal"}

    def _failed(self, op: str, args: dict, e: Exception, mutating: bool, tally: mx.Tally | None = None) -> dict:
        """The reply to a failed operation, after its writes are undone and, if it had changed
        anything (or failed unexpectedly), the state in memory is reloaded from the database."""
        expected = isinstance(e, (SchedRequestError, PolicyError))
        if isinstance(e, sqlite3.Error):  # a full disk, a database gone bad: stop on the last good state
            self._fail(f"the database failed in op {op!r}: {type(e).__name__}: {e}")
            return self._fatal_reply()
        if mutating or self.store.in_op:
            dirty = self.store.writes > 0 or not expected
            try:
                self.store.rollback_op()
            except Exception as e2:  # noqa: BLE001  (SQLite dropped the transaction: kept ops are lost)
                self._fail(f"undoing the failed {op!r}: {type(e2).__name__}: {e2}")
                return self._fatal_reply()
            if dirty:
                try:
                    self._load(tally=tally)
                    self._audit()
                    self.store.end_op()
                except Exception as e2:  # noqa: BLE001
                    self._fail(f"reloading the state after a failed {op!r} failed: {type(e2).__name__}: {e2}")
                    return self._fatal_reply()
                self.cond.notify_all()
        if expected:
            return {"ok": False, "error": str(e), "code": getattr(e, "code", "invalid")}
        if not isinstance(e, (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError)):
            print(f"rlcu sched: op {op!r} failed (state rolled back):\n{traceback.format_exc()}", file=sys.stderr,
                  flush=True)
        shown = repr(args)
        shown = shown if len(shown) <= 300 else shown[:300] + "..."
        return {"ok": False, "error": f"op {op!r}: bad arguments {shown} ({type(e).__name__}: {e})"[:2000],
                "code": "invalid"}

    def _keep(self, defer_audit: bool = False) -> bool:
        """Audit, then keep the operation's writes for the next commit; False (and fatal) on a
        broken invariant. defer_audit (an op of a `deferred` batch): the audit runs once for
        the whole batch, before the commit that holds it (`_durable`): nothing is committed,
        and no reply leaves, before the state it shows has been audited."""
        if defer_audit:
            self._unaudited = True
        else:
            try:
                self._audit()
            except InvariantError as e:
                self._fail(str(e))
                return False
        self.store.end_op()
        return True

    def _audit(self) -> None:
        """The books balance and the core agrees with the policy (audit.py): held leases and
        open spans match, pending requests have their ask time, the tally's memory per device
        is the leases'. Raises InvariantError. It runs after every change, over what changed
        (O(changes + devices); everything now and then: amortised O(1) a change)."""
        self._auditor.check(self)
        self._unaudited = False

    def _fail(self, why: str) -> None:
        """A broken invariant or a failed commit: commit nothing more, refuse every message,
        tell on_fatal. What the open transaction holds is rolled back whole: no reply of its
        operations has left (each waits for its commit, `_durable`), and whatever is written
        after a failure (a commit that failed may have been rolled back by SQLite already)
        could disagree with the rows, and a restart would refuse it."""
        self.fatal = why
        with contextlib.suppress(Exception):  # the database itself may be what broke
            self.store.rollback()
        print(f"rlcu sched: FATAL: {why}; the service stops (the database keeps the last good state)",
              file=sys.stderr, flush=True)
        self.cond.notify_all()
        if self.on_fatal is not None:
            self.on_fatal(why)

    # ------------------------------------------------------------------ the tick
    def tick(self) -> list[str]:
        """Reclaim the leases of jobs silent past the heartbeat timeout (submitted ones: past
        the start-up grace); rerun the policy (waits age); prune old history. Returns the jobs
        declared dead. Raises only if the state could not be put back after a failure."""
        with self.cond:
            if self.closed or self.fatal is not None:
                return []
            now = self.mono()
            tally = self.tally.copy()
            try:
                dead = [n for n, j in self.jobs.items() if j.state in LIVE and now - j.last_seen >
                        (self.start_grace_s if j.state == "queued" else self.heartbeat_timeout)]
                for n in dead:
                    self.ops.end_job(n, "dead", "reclaimed")
                self.ops.schedule()
                if now >= self._prune_at:  # every minute, or every tick while a backlog is left
                    self._prune_at = now + (0.0 if self._prune() >= PRUNE_BATCH else 60.0)
            except Exception as e:  # noqa: BLE001  (put the state back, say so, and tick again next time)
                print(f"rlcu sched: tick failed (state rolled back):\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)
                self._failed("tick", {}, e, True, tally)
                return []
            if self._keep():
                self._commit_now("a tick")
            if dead:
                self.cond.notify_all()
            return dead

    def prune(self, limit: int | None = None) -> int:
        """Delete up to `limit` ended leases past the retention (older than history_s, or beyond
        the last history_rows ended ones) from the database; the tally keeps their counts."""
        with self.cond:
            if self.closed or self.fatal is not None:
                return 0
            n = self._prune(limit)
            if self._keep():
                self._commit_now("pruning")
            return n

    def _commit_now(self, what: str) -> None:
        """Commit (under the lock); a failure is fatal: the state in memory would be ahead of
        the database, and the next commit would write a tally that disagrees with its rows."""
        try:
            self.store.commit(self._meta())
        except Exception as e:  # noqa: BLE001  (a full disk, a database gone bad)
            self._fail(f"the database could not commit {what}: {type(e).__name__}: {e}")

    def _prune(self, limit: int | None = None) -> int:
        n = self.store.prune(self.clock() - self.history_s, self.history_count - max(self.history_rows, 0),
                             limit or PRUNE_BATCH)
        self.history_count -= n
        return n

    def run_ticks(self, stop: threading.Event, every: float) -> None:
        """The ticker thread's loop: tick every `every` s until `stop`; a failing tick is
        reported (stderr) and the loop goes on; a fatal state ends it."""
        while not stop.wait(every):
            if self.closed or self.fatal is not None:
                return
            try:
                self.tick()
                self.store.checkpoint()  # outside the lock: the fsync holds up no operation
            except Exception:  # noqa: BLE001  (never die silently: say it, and keep reclaiming)
                if self.closed or stop.is_set():
                    return
                print(f"rlcu sched: tick failed (state rolled back):\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)

    def snapshot(self) -> Snapshot:
        """An immutable copy of the state (for status pages, benches and tests)."""
        with self.cond:
            spans = [dataclasses.replace(s) for s in (*self.ended.values(), *self.held.values())]
            return Snapshot(now=self.clock(), pool=dict(self.pool), jobs={n: dataclasses.replace(j) for n, j in
                                                                           self.jobs.items()},
                            spans=tuple(sorted(spans, key=lambda s: s.id)), held=tuple(sorted(self.held)),
                            pending=tuple(sorted(self.pol.pending.values(), key=lambda r: r.id)),
                            used=tuple(self.pol.used), yielding=tuple(sorted(self.pol.yielding)),
                            yields=tuple(self.yields), metrics=metrics_of(self), fatal=self.fatal)


__all__ = ["LIVE", "MAX_WAIT_S", "MUTATING", "Core", "Job", "Request", "SchedRequestError", "Snapshot", "StateLocked",
           "StoreError"]
