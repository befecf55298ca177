"""The scheduler's operations: `Operations` holds a `Core` and implements the service's verbs,
the methods `Core.handle` dispatches to (`op_<name>`, their arguments are the message's
fields), and the changes they share (grants and yields, a lease's end, a job's end). Each
runs under the core's lock inside its own savepoint (core.py): it validates what it was given
before it changes anything, raises `SchedRequestError` / `PolicyError` for a bad request, and
writes every change through the store before it returns the job's new view.

Why two classes, and where the line is. The core owns the books: the state in memory (jobs,
leases and their spans, requests' ask times, versions, the metrics tally), the database they
mirror, how they are loaded (recovery.py: the core's own loading code, kept apart for length,
so a mixin that builds what the core owns), and how a change is made safe (one lock, one
savepoint an operation, the audit, group commit, a fatal stop, the ticks). The operations own
no state (beyond the running operation's): they are what a message may do to the books. As a
mixin (`Core(Operations)`) the verbs read and wrote a dozen attributes that another file
defined, and nothing said which class a method belonged to; as an object that holds its core,
every access names its owner (`c.jobs`), and the core reaches the verbs through one table (and
the tick, reclaiming a dead job, through `end_job` and `schedule`, as an operation would).
"""

from __future__ import annotations

import re
import time

from rlcu.sched import metrics as mx
from rlcu.sched.pool import RESIDENT, Lease
from rlcu.sched.store import Job
from rlcu.sched.views import LIVE, metrics_of, status_of, wall_t0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_WAIT_S = 60.0


class SchedRequestError(ValueError):
    """An invalid request; its message is the reply's error, `code` says what kind:
    invalid, unknown_job, ended (the job is done, cancelled or dead)."""

    def __init__(self, msg: str, code: str = "invalid"):
        super().__init__(msg)
        self.code = code


class Operations:
    """The verbs of one `Core` (`core`, whose books they change); see the module docstring."""

    def __init__(self, core):
        self.core = core
        self._unsaved: set[int] = set()  # requests of the running op not written yet (granted at once: never)

    # ------------------------------------------------------------------ the changes verbs share
    def _job(self, job, live: bool = True) -> Job:
        c = self.core
        if not isinstance(job, str) or job not in c.jobs:
            raise SchedRequestError(f"unknown job {job!r}", "unknown_job")
        j = c.jobs[job]
        if live and j.state not in LIVE:
            raise SchedRequestError(f"job {job!r} is {j.state}", "ended")
        if j.state in LIVE:
            j.last_seen = c.mono()
        return j

    def close_lease(self, le: Lease, now: float, reason: str) -> mx.Span:
        c = self.core
        s = c.held.pop(le.id)
        s.end, s.reason = now, reason
        c.tally.remove(s, c.mtime())
        c.yield_at.pop(le.id, None)
        c.store.end_lease(s)
        c.remember(s)
        return s

    def end_job(self, job: str, state: str, reason: str) -> None:
        c = self.core
        now = c.clock()
        j = c.jobs[job]
        for r in list(c.pol.job_pending.get(job, {}).values()):
            c.store.drop_request(r.id)
            c.asked.pop(r.id, None)
        for le in c.pol.remove_job(job):
            self.close_lease(le, now, reason)
        j.state, j.finished, j.rollout_since = state, now, None
        if state == "done":
            c.tally.job_done(j.born, c.mtime())
        c.store.put_job(j)
        c.bump(job)
        self.schedule()

    def schedule(self) -> None:
        c = self.core
        now = c.clock()
        dec = c.pol.schedule(now)
        if not dec.grants and not dec.yields:
            return
        for le in dec.grants:
            s = mx.Span(le.id, le.job, le.phase, le.cluster, le.devices, le.mem, now)
            c.held[le.id] = s
            c.tally.add(s, c.mtime())
            c.store.put_lease(s, le.request, None)
            if le.request is not None:
                if le.request.id not in self._unsaved:
                    c.store.drop_request(le.request.id)
                j = c.jobs[le.job]
                waited = max(0.0, now - c.asked.pop(le.request.id, now))  # (a wall clock stepped back)
                j.wait_s += waited
                if waited > 1e-3 or j.started is None:  # (a grant at once is not worth a write)
                    j.started = now if j.started is None else j.started
                    c.store.put_job(j)
            c.bump(le.job)
        for lid in dec.yields:
            c.yield_at[lid] = now
            job = c.pol.leases[lid].job
            c.yields.append((now, lid, job))
            c.tally.yields += 1
            c.store.set_yield(lid, now)
            c.bump(job)
        c.cond.notify_all()

    # ------------------------------------------------------------------ operations
    def op_ping(self) -> dict:
        c = self.core
        return {"devices": len(c.pool["capacity"]), "policy": c.pool["policy"]}

    def op_register(self, job, clusters, spec: dict | None = None, pid: int | None = None, host: str | None = None,
                    queued: bool = False, attach: bool = False) -> dict:
        """A new job (queued: submitted, its worker not attached yet); attach: the worker of
        a submitted job takes it over (or registers it when it is new)."""
        c = self.core
        if not isinstance(job, str) or not _NAME.match(job):
            raise SchedRequestError(f"job name {job!r} must be 1-128 characters of letters, digits, '.', '_', '-'")
        if spec is not None and not isinstance(spec, dict):
            raise SchedRequestError(f"spec must be a mapping, got {type(spec).__name__}")
        if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < 2**31):
            raise SchedRequestError(f"pid must be a process id (an integer in [0, 2**31)), got {pid!r}"[:300])
        if host is not None and (not isinstance(host, str) or len(host) > 255):
            raise SchedRequestError(f"host must be a host name (a string of at most 255 characters), got "
                                    f"{type(host).__name__}")
        for what, v in (("queued", queued), ("attach", attach)):
            if not isinstance(v, bool):
                raise SchedRequestError(f"{what} must be true or false, got {v!r}"[:300])
        now = c.clock()
        if job in c.jobs:
            j = c.jobs[job]
            if not attach or j.state not in LIVE:
                raise SchedRequestError(f"job {job!r} already exists ({j.state})"
                                        + ("" if j.state in LIVE else ": choose another name"))
            j.state = "stopping" if j.state == "stopping" else "running"  # (a cancel asked before stands)
            j.pid, j.host, j.last_seen = pid, host, c.mono()
        else:
            c.pol.add_job(job, clusters)
            if not c.jobs:  # the metrics' span begins with the first job (as summarize's t0)
                c.tally.restart(c.mtime())
            j = Job(job, clusters, spec or {}, "queued" if queued else "running", now, len(c.jobs),
                    pid=pid, host=host, last_seen=c.mono(), born=c.mtime())
            c.jobs[job] = j
        c.store.put_job(j)
        c.bump(job)
        if c.pol.grants_on_arrival:  # (else a job without requests changes no decision: O(1))
            self.schedule()
        return c.view(job)

    def op_request(self, job, phase, cluster=None, devices=None, mem=None, min_devices=None, work: float = 1.0,
                   only=None) -> dict:
        c = self.core
        j = self._job(job)
        since = j.rollout_since if phase == "rollout" else None
        now = c.clock()
        r = c.pol.request(job, phase, cluster, devices=devices, mem=mem, min_devices=min_devices, work=work,
                          now=now, since=since, only=only)
        if since is not None:
            j.rollout_since = None
            c.store.put_job(j)
        c.asked[r.id] = now
        self._unsaved.add(r.id)
        try:
            self.schedule()
            if r.id in c.pol.pending:  # not granted at once: it waits, on disk too
                c.store.put_request(r, now)
        finally:
            self._unsaved.clear()
        return {"request": r.id, **c.view(job)}

    def op_withdraw(self, job, request) -> dict:
        """Drop a pending request (a client that stopped waiting)."""
        c = self.core
        self._job(job)
        r = c.pol.pending.get(request) if isinstance(request, int) else None
        if r is None or r.job != job:
            raise SchedRequestError(f"job {job!r} has no pending request {request!r}"[:300])
        c.pol.cancel_request(request)
        c.asked.pop(request, None)
        c.store.drop_request(request)
        self.schedule()
        return c.view(job)

    def op_release(self, job, lease) -> dict:
        c = self.core
        j = self._job(job)
        if not isinstance(lease, int) or isinstance(lease, bool) or not 0 < lease < 2**62:
            raise SchedRequestError(f"lease must be a lease id (a positive integer), got {lease!r}"[:300])
        s = c.span(lease) or c.store.lease(lease)
        if s is None:
            raise SchedRequestError(f"unknown lease {lease}")
        if s.job != job:
            raise SchedRequestError(f"lease {lease} belongs to job {s.job!r}, not {job!r}")
        if s.end is not None:
            raise SchedRequestError(f"lease {lease} was already released ({s.reason} at {s.end:.3f})")
        if s.phase == RESIDENT:
            raise SchedRequestError(f"lease {lease} is the resident memory of cluster {s.cluster!r}: it ends with "
                                    "the job (finish it)")
        yielded = lease in c.pol.yielding
        le = c.pol.release(lease)
        if yielded and le.request is not None:
            j.rollout_since = le.request.since
            c.store.put_job(j)
        self.close_lease(le, c.clock(), "yielded" if yielded else "released")
        c.bump(job)
        self.schedule()
        return c.view(job)

    def op_work(self, job, work) -> dict:
        """The remaining work of the job's rollout (weighs its share of spare devices)."""
        c = self.core
        self._job(job)
        if not isinstance(work, (int, float)) or isinstance(work, bool) or not 0 <= work < float("inf"):
            raise SchedRequestError(f"work must be a finite number >= 0, got {work!r}"[:300])
        c.pol.set_work(job, float(work))
        for r in c.pol.job_pending.get(job, {}).values():
            c.store.put_request(r, c.asked.get(r.id, c.clock()))
        return {}

    def op_heartbeat(self, job) -> dict:
        c = self.core
        self._job(job, live=False)
        return c.view(job)

    def op_wait(self, job, version: int = -1, timeout: float = 10.0) -> dict:
        """Block until the job's view changes from `version` (or timeout); returns the view."""
        c = self.core
        self._job(job, live=False)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
            raise SchedRequestError(f"timeout must be a number >= 0, got {timeout!r}"[:300])
        end = time.monotonic() + min(float(timeout), MAX_WAIT_S)
        while (c.versions.get(job, 0) == version and c.jobs[job].state in LIVE and not c.closed
               and c.fatal is None):
            left = end - time.monotonic()
            if left <= 0:
                break
            c.cond.wait(left)
        if c.closed:
            raise SchedRequestError("the scheduler is shutting down", "unavailable")
        if c.fatal is not None:
            raise SchedRequestError(f"the scheduler stopped on a broken invariant: {c.fatal}", "fatal")
        if c.jobs[job].state in LIVE:
            c.jobs[job].last_seen = c.mono()
        return c.view(job)

    def op_finish(self, job, failed: bool = False) -> dict:
        """The job ended (failed: with an error; a job asked to stop: cancelled); its leases
        are released."""
        c = self.core
        j = self._job(job)
        self.end_job(job, "failed" if failed else "cancelled" if j.state == "stopping" else "done", "finished")
        return c.view(job)

    def op_cancel(self, job, graceful: bool = False) -> dict:
        """End the job now: its leases are released and its worker learns it at its next call
        (JobEnded). graceful: ask a running job to stop instead; it is `stopping` (live: its
        requests are still granted) while it finishes the step in flight and checkpoints, and
        its `finish` makes it cancelled. A queued job (no worker attached yet) ends at once."""
        c = self.core
        j = self._job(job, live=False)
        if j.state not in LIVE:
            raise SchedRequestError(f"job {job!r} is already {j.state}", "ended")
        if graceful and j.state != "queued":
            if j.state != "stopping":
                j.state = "stopping"
                c.store.put_job(j)
                c.bump(job)
        else:
            self.end_job(job, "cancelled", "cancelled")
        c.cond.notify_all()  # a job waiting for a grant sees it now, not at its wait's timeout
        return c.view(job)

    def op_status(self) -> dict:
        return status_of(self.core)

    def op_metrics(self) -> dict:
        return metrics_of(self.core)

    def op_trace(self) -> dict:
        """The Chrome trace of the held leases and the remembered ended ones (the last keep_spans)."""
        c = self.core
        spans = sorted((*c.ended.values(), *c.held.values()), key=lambda s: s.id)
        return {"trace": mx.chrome_trace(spans, len(c.pool["capacity"]), wall_t0(c),
                                         sorted(c.yields), c.clock())}
