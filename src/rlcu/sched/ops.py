"""The scheduler's operations, the methods `Core.handle` dispatches to (`op_<name>`, their
arguments are the message's fields), and the helpers they share. Each runs under the core's
lock inside its own savepoint (core.py): it validates what it was given before it changes
anything, raises `SchedRequestError` / `PolicyError` for a bad request, and writes every
change through the store before it returns the job's new view."""

from __future__ import annotations

import re
import time

from rlcu.sched import metrics as mx
from rlcu.sched.pool import RESIDENT, Lease
from rlcu.sched.store import Job
from rlcu.sched.views import LIVE, job_view, metrics_of, status_of, wall_t0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_WAIT_S = 60.0


class SchedRequestError(ValueError):
    """An invalid request; its message is the reply's error, `code` says what kind:
    invalid, unknown_job, ended (the job is done, cancelled or dead)."""

    def __init__(self, msg: str, code: str = "invalid"):
        super().__init__(msg)
        self.code = code


class Operations:
    """Mixed into `Core` (which owns the state these read and write: jobs, held, ended,
    yield_at, yields, asked, versions, tally, pol, store, clock, mono)."""

    # ------------------------------------------------------------------ helpers
    def _job(self, job, live: bool = True) -> Job:
        if not isinstance(job, str) or job not in self.jobs:
            raise SchedRequestError(f"unknown job {job!r}", "unknown_job")
        j = self.jobs[job]
        if live and j.state not in LIVE:
            raise SchedRequestError(f"job {job!r} is {j.state}", "ended")
        if j.state in LIVE:
            j.last_seen = self.mono()
        return j

    def _bump(self, job: str) -> None:
        self.versions[job] = self.versions.get(job, 0) + 1

    def _remember(self, s: mx.Span) -> None:
        self.ended[s.id] = s
        self.history_count += 1
        while len(self.ended) > self.keep_spans:
            self.ended.popitem(last=False)

    def _close_lease(self, le: Lease, now: float, reason: str) -> mx.Span:
        s = self.held.pop(le.id)
        s.end, s.reason = now, reason
        self.tally.remove(s, self.mtime())
        self.yield_at.pop(le.id, None)
        self.store.end_lease(s)
        self._remember(s)
        return s

    def span(self, lease_id: int) -> mx.Span | None:
        """The span of a held lease or of a remembered ended one."""
        return self.held.get(lease_id) or self.ended.get(lease_id)

    def view(self, job: str) -> dict:
        return job_view(self, job)

    def _end_job(self, job: str, state: str, reason: str) -> None:
        now = self.clock()
        j = self.jobs[job]
        for r in list(self.pol.job_pending.get(job, {}).values()):
            self.store.drop_request(r.id)
            self.asked.pop(r.id, None)
        for le in self.pol.remove_job(job):
            self._close_lease(le, now, reason)
        j.state, j.finished, j.rollout_since = state, now, None
        if state == "done":
            self.tally.job_done(j.born, self.mtime())
        self.store.put_job(j)
        self._bump(job)
        self._schedule()

    def _schedule(self) -> None:
        now = self.clock()
        dec = self.pol.schedule(now)
        if not dec.grants and not dec.yields:
            return
        for le in dec.grants:
            s = mx.Span(le.id, le.job, le.phase, le.cluster, le.devices, le.mem, now)
            self.held[le.id] = s
            self.tally.add(s, self.mtime())
            self.store.put_lease(s, le.request, None)
            if le.request is not None:
                if le.request.id not in self._unsaved:
                    self.store.drop_request(le.request.id)
                j = self.jobs[le.job]
                waited = max(0.0, now - self.asked.pop(le.request.id, now))  # (a wall clock stepped back)
                j.wait_s += waited
                if waited > 1e-3 or j.started is None:  # (a grant at once is not worth a write)
                    j.started = now if j.started is None else j.started
                    self.store.put_job(j)
            self._bump(le.job)
        for lid in dec.yields:
            self.yield_at[lid] = now
            job = self.pol.leases[lid].job
            self.yields.append((now, lid, job))
            self.tally.yields += 1
            self.store.set_yield(lid, now)
            self._bump(job)
        self.cond.notify_all()

    # ------------------------------------------------------------------ operations
    def op_ping(self) -> dict:
        return {"devices": len(self.pool["capacity"]), "policy": self.pool["policy"]}

    def op_register(self, job, clusters, spec: dict | None = None, pid: int | None = None, host: str | None = None,
                    queued: bool = False, attach: bool = False) -> dict:
        """A new job (queued: submitted, its worker not attached yet); attach: the worker of
        a submitted job takes it over (or registers it when it is new)."""
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
        now = self.clock()
        if job in self.jobs:
            j = self.jobs[job]
            if not attach or j.state not in LIVE:
                raise SchedRequestError(f"job {job!r} already exists ({j.state})"
                                        + ("" if j.state in LIVE else ": choose another name"))
            j.state = "stopping" if j.state == "stopping" else "running"  # (a cancel asked before stands)
            j.pid, j.host, j.last_seen = pid, host, self.mono()
        else:
            self.pol.add_job(job, clusters)
            if not self.jobs:  # the metrics' span begins with the first job (as summarize's t0)
                self.tally.restart(self.mtime())
            j = Job(job, clusters, spec or {}, "queued" if queued else "running", now, len(self.jobs),
                    pid=pid, host=host, last_seen=self.mono(), born=self.mtime())
            self.jobs[job] = j
        self.store.put_job(j)
        self._bump(job)
        if self.pol.grants_on_arrival:  # (else a job without requests changes no decision: O(1))
            self._schedule()
        return self.view(job)

    def op_request(self, job, phase, cluster=None, devices=None, mem=None, min_devices=None, work: float = 1.0,
                   only=None) -> dict:
        j = self._job(job)
        since = j.rollout_since if phase == "rollout" else None
        now = self.clock()
        r = self.pol.request(job, phase, cluster, devices=devices, mem=mem, min_devices=min_devices, work=work,
                             now=now, since=since, only=only)
        if since is not None:
            j.rollout_since = None
            self.store.put_job(j)
        self.asked[r.id] = now
        self._unsaved.add(r.id)
        self._schedule()
        if r.id in self.pol.pending:  # not granted at once: it waits, on disk too
            self.store.put_request(r, now)
        self._unsaved.clear()
        return {"request": r.id, **self.view(job)}

    def op_withdraw(self, job, request) -> dict:
        """Drop a pending request (a client that stopped waiting)."""
        self._job(job)
        r = self.pol.pending.get(request) if isinstance(request, int) else None
        if r is None or r.job != job:
            raise SchedRequestError(f"job {job!r} has no pending request {request!r}"[:300])
        self.pol.cancel_request(request)
        self.asked.pop(request, None)
        self.store.drop_request(request)
        self._schedule()
        return self.view(job)

    def op_release(self, job, lease) -> dict:
        j = self._job(job)
        if not isinstance(lease, int) or isinstance(lease, bool) or not 0 < lease < 2**62:
            raise SchedRequestError(f"lease must be a lease id (a positive integer), got {lease!r}"[:300])
        s = self.span(lease) or self.store.lease(lease)
        if s is None:
            raise SchedRequestError(f"unknown lease {lease}")
        if s.job != job:
            raise SchedRequestError(f"lease {lease} belongs to job {s.job!r}, not {job!r}")
        if s.end is not None:
            raise SchedRequestError(f"lease {lease} was already released ({s.reason} at {s.end:.3f})")
        if s.phase == RESIDENT:
            raise SchedRequestError(f"lease {lease} is the resident memory of cluster {s.cluster!r}: it ends with "
                                    "the job (finish it)")
        yielded = lease in self.pol.yielding
        le = self.pol.release(lease)
        if yielded and le.request is not None:
            j.rollout_since = le.request.since
            self.store.put_job(j)
        self._close_lease(le, self.clock(), "yielded" if yielded else "released")
        self._bump(job)
        self._schedule()
        return self.view(job)

    def op_work(self, job, work) -> dict:
        """The remaining work of the job's rollout (weighs its share of spare devices)."""
        self._job(job)
        if not isinstance(work, (int, float)) or isinstance(work, bool) or not 0 <= work < float("inf"):
            raise SchedRequestError(f"work must be a finite number >= 0, got {work!r}"[:300])
        self.pol.set_work(job, float(work))
        for r in self.pol.job_pending.get(job, {}).values():
            self.store.put_request(r, self.asked.get(r.id, self.clock()))
        return {}

    def op_heartbeat(self, job) -> dict:
        self._job(job, live=False)
        return self.view(job)

    def op_wait(self, job, version: int = -1, timeout: float = 10.0) -> dict:
        """Block until the job's view changes from `version` (or timeout); returns the view."""
        self._job(job, live=False)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
            raise SchedRequestError(f"timeout must be a number >= 0, got {timeout!r}"[:300])
        end = time.monotonic() + min(float(timeout), MAX_WAIT_S)
        while (self.versions.get(job, 0) == version and self.jobs[job].state in LIVE and not self.closed
               and self.fatal is None):
            left = end - time.monotonic()
            if left <= 0:
                break
            self.cond.wait(left)
        if self.closed:
            raise SchedRequestError("the scheduler is shutting down", "unavailable")
        if self.fatal is not None:
            raise SchedRequestError(f"the scheduler stopped on a broken invariant: {self.fatal}", "fatal")
        if self.jobs[job].state in LIVE:
            self.jobs[job].last_seen = self.mono()
        return self.view(job)

    def op_finish(self, job, failed: bool = False) -> dict:
        """The job ended (failed: with an error; a job asked to stop: cancelled); its leases
        are released."""
        j = self._job(job)
        self._end_job(job, "failed" if failed else "cancelled" if j.state == "stopping" else "done", "finished")
        return self.view(job)

    def op_cancel(self, job, graceful: bool = False) -> dict:
        """End the job now: its leases are released and its worker learns it at its next call
        (JobEnded). graceful: ask a running job to stop instead; it is `stopping` (live: its
        requests are still granted) while it finishes the step in flight and checkpoints, and
        its `finish` makes it cancelled. A queued job (no worker attached yet) ends at once."""
        j = self._job(job, live=False)
        if j.state not in LIVE:
            raise SchedRequestError(f"job {job!r} is already {j.state}", "ended")
        if graceful and j.state != "queued":
            if j.state != "stopping":
                j.state = "stopping"
                self.store.put_job(j)
                self._bump(job)
        else:
            self._end_job(job, "cancelled", "cancelled")
        self.cond.notify_all()  # a job waiting for a grant sees it now, not at its wait's timeout
        return self.view(job)

    def op_status(self) -> dict:
        return status_of(self)

    def op_metrics(self) -> dict:
        return metrics_of(self)

    def op_trace(self) -> dict:
        """The Chrome trace of the held leases and the remembered ended ones (the last keep_spans)."""
        spans = sorted((*self.ended.values(), *self.held.values()), key=lambda s: s.id)
        return {"trace": mx.chrome_trace(spans, len(self.pool["capacity"]), wall_t0(self),
                                         sorted(self.yields), self.clock())}
