"""The scheduler service's logic, free of any transport: jobs, their phase requests and
leases, heartbeats, persistence, metrics. The socket server (server.py) and the Ray actor
(ray_backend.py) both wrap one `Core` and feed it messages:

    core.handle({"op": "request", "job": "a", "phase": "rollout", "mem": 30}) -> {"ok": True, ...}

Every message is one operation under one lock; a state change is written to SQLite before
the reply (so a restarted service recovers every job, pending request and lease), then the
policy runs and the jobs concerned are woken (their `version` changes; `wait` long-polls on
it). An invalid request gets {"ok": False, "error": "..."} and changes nothing.

Liveness: any message naming a job refreshes its heartbeat; a live job silent for longer
than `heartbeat_timeout` is declared dead by `tick()` and loses its leases and requests,
and the others go on. A rollout lease the policy asked to yield is marked in the job's view
(`"yield": true`); when the job gives it back and asks for rollout again, its request keeps
its original age.
"""

from __future__ import annotations

import inspect
import re
import threading
import time

from rlcu.sched import metrics as mx
from rlcu.sched.pool import RESIDENT, Lease, PolicyError
from rlcu.sched.policy import make_policy
from rlcu.sched.store import Store

LIVE = ("queued", "running")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_WAIT_S = 60.0


class SchedRequestError(ValueError):
    """An invalid request; its message is the reply's error, `code` says what kind:
    invalid, unknown_job, ended (the job is done, cancelled or dead)."""

    def __init__(self, msg: str, code: str = "invalid"):
        super().__init__(msg)
        self.code = code


class Core:
    def __init__(self, capacity: list[float] | None = None, *, state=None, policy: str = "phase",
                 aging_s: float = 60.0, heartbeat_timeout: float = 30.0, device_names: list[str] | None = None,
                 clock=time.time):
        self.clock = clock
        self.store = Store(state)
        self.heartbeat_timeout = float(heartbeat_timeout)
        pool = self.store.get_meta("pool")
        if pool is not None:
            if capacity is not None and [float(c) for c in capacity] != pool["capacity"]:
                raise ValueError(f"the state in {state} belongs to a pool of {pool['capacity']}, not {list(capacity)}: "
                                 "start without devices to reuse it, or use another state folder")
            if policy != pool["policy"] and capacity is not None:
                raise ValueError(f"the state in {state} was made by policy {pool['policy']!r}, not {policy!r}")
        elif capacity is None:
            raise ValueError("a new scheduler needs its devices (their memory capacities)")
        else:
            names = list(device_names) if device_names else [f"slot{i}" for i in range(len(capacity))]
            if len(names) != len(capacity):
                raise ValueError(f"{len(names)} device names for {len(capacity)} devices")
            pool = {"capacity": [float(c) for c in capacity], "names": names, "policy": policy,
                    "aging_s": float(aging_s), "t0": clock()}
            self.store.set_meta("pool", pool)
        self.pool = pool
        self.pol = make_policy(pool["policy"], pool["capacity"], pool["aging_s"])
        self.cond = threading.Condition(threading.RLock())
        self.jobs: dict[str, dict] = {}
        self.spans: dict[int, mx.Span] = {}
        self.yield_at: dict[int, float] = {}
        self.asked: dict[int, float] = {}  # pending request id -> when asked
        self.rollout_since: dict[str, float] = {}  # job -> age of its yielded rollout
        self.versions: dict[str, int] = {}
        self.closed = False
        self._recover()
        self._ops = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        now = self.clock()
        for j in self.store.jobs():
            self.jobs[j["name"]] = j
            if j["state"] in LIVE:
                self.pol.add_job(j["name"], j["clusters"])
                j["last_seen"] = now  # a grace period: the job's next heartbeat finds the new service
        top = 0
        with self.store.tx():
            for s, req, y in self.store.leases():
                self.spans[s.id] = s
                top = max(top, s.id, req.id if req else 0)
                if s.end is not None:
                    continue
                if self.jobs.get(s.job, {}).get("state") in LIVE:
                    self.pol.adopt(Lease(s.id, s.job, s.phase, s.cluster, s.devices, s.mem, s.start, req))
                    if y is not None:
                        self.pol.yielding[s.id] = self.yield_at[s.id] = y
                else:
                    s.end, s.reason = now, "reclaimed"
                    self.store.put_lease(s, req, y)
            for r, asked in self.store.requests():
                top = max(top, r.id)
                if self.jobs.get(r.job, {}).get("state") in LIVE:
                    self.pol.adopt_request(r)
                    self.asked[r.id] = asked
                else:
                    self.store.drop_request(r.id)
            for j in self.jobs.values():
                self.store.put_job(j)
        self.pol._next = max(self.pol._next, top + 1)

    def close(self) -> None:
        """Wake every waiter and close the database (the state stays on disk)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            self.store.close()

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg) -> dict:
        """One message -> one reply; never raises for a bad request."""
        if not isinstance(msg, dict):
            return {"ok": False, "error": "a message is a JSON object with an 'op'", "code": "protocol"}
        op = msg.get("op")
        fn = self._ops.get(op) if isinstance(op, str) else None
        if fn is None:
            return {"ok": False, "error": f"unknown op {op!r}; ops: {', '.join(sorted(self._ops))}", "code": "protocol"}
        args = {k: v for k, v in msg.items() if k != "op"}
        params = inspect.signature(fn).parameters
        bad = [k for k in args if k not in params]
        if bad:
            err = f"op {op!r} takes no argument {bad[0]!r} (takes: {', '.join(params) or 'none'})"
            return {"ok": False, "error": err, "code": "protocol"}
        missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
        if missing:
            return {"ok": False, "error": f"op {op!r} needs {missing[0]!r}", "code": "protocol"}
        try:
            with self.cond:
                if self.closed:
                    return {"ok": False, "error": "the scheduler is shutting down", "code": "unavailable"}
                out = fn(**args)
            return {"ok": True, **(out or {})}
        except (SchedRequestError, PolicyError) as e:
            return {"ok": False, "error": str(e), "code": getattr(e, "code", "invalid")}
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # an argument of the wrong type
            return {"ok": False, "error": f"op {op!r}: bad arguments {args!r} ({type(e).__name__}: {e})",
                    "code": "invalid"}

    # ------------------------------------------------------------------ helpers
    def _job(self, job, live: bool = True) -> dict:
        if not isinstance(job, str) or job not in self.jobs:
            raise SchedRequestError(f"unknown job {job!r}", "unknown_job")
        j = self.jobs[job]
        if live and j["state"] not in LIVE:
            raise SchedRequestError(f"job {job!r} is {j['state']}", "ended")
        if j["state"] in LIVE:
            j["last_seen"] = self.clock()
        return j

    def _bump(self, job: str) -> None:
        self.versions[job] = self.versions.get(job, 0) + 1

    def _lease_view(self, s: mx.Span) -> dict:
        le = self.pol.leases.get(s.id)
        req = le.request.id if le is not None and le.request is not None else None
        return {"id": s.id, "request": req, "phase": s.phase, "cluster": s.cluster, "devices": list(s.devices),
                "names": [self.pool["names"][d] for d in s.devices], "mem": list(s.mem), "start": s.start,
                "yield": s.id in self.pol.yielding}

    def view(self, job: str) -> dict:
        j = self.jobs[job]
        leases = [self._lease_view(self.spans[lid]) for lid, le in sorted(self.pol.leases.items()) if le.job == job]
        pending = [{"id": r.id, "phase": r.phase, "cluster": r.cluster, "since": r.since, "asked": self.asked.get(r.id)}
                   for r in sorted(self.pol.pending.values(), key=lambda r: r.id) if r.job == job]
        return {"job": job, "state": j["state"], "version": self.versions.get(job, 0), "leases": leases,
                "pending": pending}

    def _end_job(self, job: str, state: str, reason: str) -> None:
        now = self.clock()
        j = self.jobs[job]
        with self.store.tx():
            for r in [r for r in self.pol.pending.values() if r.job == job]:
                self.store.drop_request(r.id)
                self.asked.pop(r.id, None)
            for le in self.pol.remove_job(job):
                s = self.spans[le.id]
                s.end, s.reason = now, reason
                self.store.put_lease(s, le.request, self.yield_at.get(le.id))
            j["state"], j["finished"] = state, now
            self.store.put_job(j)
        self.rollout_since.pop(job, None)
        self._bump(job)
        self._schedule()

    def _schedule(self) -> None:
        now = self.clock()
        dec = self.pol.schedule(now)
        if not dec.grants and not dec.yields:
            return
        with self.store.tx():
            for le in dec.grants:
                s = mx.Span(le.id, le.job, le.phase, le.cluster, le.devices, le.mem, now)
                self.spans[le.id] = s
                self.store.put_lease(s, le.request, None)
                if le.request is not None:
                    self.store.drop_request(le.request.id)
                    j = self.jobs[le.job]
                    j["wait_s"] += now - self.asked.pop(le.request.id, now)
                    if j["started"] is None:
                        j["started"] = now
                    self.store.put_job(j)
                self._bump(le.job)
            for lid in dec.yields:
                self.yield_at[lid] = now
                le = self.pol.leases[lid]
                self.store.put_lease(self.spans[lid], le.request, now)
                self._bump(le.job)
        self.cond.notify_all()

    def tick(self) -> list[str]:
        """Reclaim the leases of jobs silent past the heartbeat timeout; rerun the policy
        (waits age). Returns the jobs declared dead."""
        with self.cond:
            now = self.clock()
            dead = [n for n, j in self.jobs.items()
                    if j["state"] in LIVE and now - j["last_seen"] > self.heartbeat_timeout]
            for n in dead:
                self._end_job(n, "dead", "reclaimed")
            self._schedule()
            if dead:
                self.cond.notify_all()
            return dead

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
        now = self.clock()
        if job in self.jobs:
            j = self.jobs[job]
            if not attach or j["state"] not in LIVE:
                raise SchedRequestError(f"job {job!r} already exists ({j['state']})"
                                        + ("" if j["state"] in LIVE else ": choose another name"))
            j.update(state="running", pid=pid, host=host, last_seen=now)
        else:
            self.pol.add_job(job, clusters)
            j = {"name": job, "clusters": clusters, "spec": spec or {}, "state": "queued" if queued else "running",
                 "submitted": now, "started": None, "finished": None, "last_seen": now, "pid": pid, "host": host,
                 "wait_s": 0.0, "seq": len(self.jobs)}
            self.jobs[job] = j
        self.store.put_job(j)
        self._bump(job)
        self._schedule()
        return self.view(job)

    def op_request(self, job, phase, cluster=None, devices=None, mem=None, min_devices=None, work: float = 1.0,
                   only=None) -> dict:
        self._job(job)
        since = self.rollout_since.pop(job, None) if phase == "rollout" else None
        r = self.pol.request(job, phase, cluster, devices=devices, mem=mem, min_devices=min_devices, work=work,
                             now=self.clock(), since=since, only=only)
        self.asked[r.id] = self.clock()
        self.store.put_request(r, self.asked[r.id])
        self._schedule()
        return {"request": r.id, **self.view(job)}

    def op_withdraw(self, job, request) -> dict:
        """Drop a pending request (a client that stopped waiting)."""
        self._job(job)
        r = self.pol.pending.get(request)
        if r is None or r.job != job:
            raise SchedRequestError(f"job {job!r} has no pending request {request!r}")
        self.pol.cancel_request(request)
        self.asked.pop(request, None)
        self.store.drop_request(request)
        self._schedule()
        return self.view(job)

    def op_release(self, job, lease) -> dict:
        self._job(job)
        if not isinstance(lease, int) or isinstance(lease, bool):
            raise SchedRequestError(f"lease must be a lease id (an integer), got {lease!r}")
        s = self.spans.get(lease)
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
            self.rollout_since[job] = le.request.since
        s.end, s.reason = self.clock(), "yielded" if yielded else "released"
        self.store.put_lease(s, le.request, self.yield_at.get(lease))
        self._bump(job)
        self._schedule()
        return self.view(job)

    def op_work(self, job, work) -> dict:
        """The remaining work of the job's rollout (weighs its share of spare devices)."""
        self._job(job)
        if not isinstance(work, (int, float)) or isinstance(work, bool) or work < 0:
            raise SchedRequestError(f"work must be a number >= 0, got {work!r}")
        self.pol.set_work(job, float(work))
        for r in self.pol.pending.values():
            if r.job == job:
                self.store.put_request(r, self.asked.get(r.id, self.clock()))
        return {}

    def op_heartbeat(self, job) -> dict:
        self._job(job, live=False)
        return self.view(job)

    def op_wait(self, job, version: int = -1, timeout: float = 10.0) -> dict:
        """Block until the job's view changes from `version` (or timeout); returns the view."""
        self._job(job, live=False)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise SchedRequestError(f"timeout must be a number >= 0, got {timeout!r}")
        end = time.monotonic() + min(float(timeout), MAX_WAIT_S)
        while self.versions.get(job, 0) == version and self.jobs[job]["state"] in LIVE and not self.closed:
            left = end - time.monotonic()
            if left <= 0:
                break
            self.cond.wait(left)
        if self.jobs[job]["state"] in LIVE:
            self.jobs[job]["last_seen"] = self.clock()
        return self.view(job)

    def op_finish(self, job, failed: bool = False) -> dict:
        """The job ended (failed: with an error); its leases are released."""
        self._job(job)
        self._end_job(job, "failed" if failed else "done", "finished")
        return self.view(job)

    def op_cancel(self, job) -> dict:
        j = self._job(job, live=False)
        if j["state"] not in LIVE:
            raise SchedRequestError(f"job {job!r} is already {j['state']}", "ended")
        self._end_job(job, "cancelled", "cancelled")
        return self.view(job)

    def op_status(self) -> dict:
        now = self.clock()
        devs = []
        for d, cap in enumerate(self.pool["capacity"]):
            on = [le for le in self.pol.leases.values() if d in le.devices]
            devs.append({"index": d, "name": self.pool["names"][d], "capacity": cap, "used": self.pol.used[d],
                         "leases": [f"{le.job}:{le.phase}" for le in sorted(on, key=lambda le: le.id)]})
        rows = []
        for j in sorted(self.jobs.values(), key=lambda j: j["seq"]):
            held = [le for le in self.pol.leases.values() if le.job == j["name"]]
            pend = [r for r in self.pol.pending.values() if r.job == j["name"]]
            rows.append({
                "job": j["name"], "state": j["state"], "pid": j["pid"],
                "phases": [le.phase + ("(yield)" if le.id in self.pol.yielding else "")
                           for le in sorted(held, key=lambda le: le.id) if le.phase != RESIDENT],
                "devices": sorted({self.pool["names"][d] for le in held for d in le.devices}),
                "mem": sum(sum(le.mem) for le in held),
                "waiting": [{"phase": r.phase, "for_s": now - self.asked.get(r.id, now)} for r in pend],
                "wait_s": j["wait_s"] + sum(now - self.asked.get(r.id, now) for r in pend),
                "age_s": (j["finished"] or now) - j["submitted"]})
        return {"now": now, "policy": self.pool["policy"], "devices": devs, "jobs": rows, "metrics": self.op_metrics()}

    def op_metrics(self) -> dict:
        now = self.clock()
        jobs = [{"name": j["name"], "arrival": j["submitted"],
                 "finish": j["finished"] if j["state"] == "done" else None} for j in self.jobs.values()]
        t0 = min([j["submitted"] for j in self.jobs.values()], default=self.pool["t0"])
        out = mx.summarize(list(self.spans.values()), self.pool["capacity"], jobs, t0, now)
        out.pop("makespan_s")
        free = [c - u for c, u in zip(self.pool["capacity"], self.pol.used)]
        tot = sum(max(f, 0.0) for f in free)
        out.update(uptime_s=now - t0, mem_in_use=list(self.pol.used),
                   frag_now=1.0 - max(free) / tot if tot > 1e-12 else 0.0,
                   jobs_live=sum(j["state"] in LIVE for j in self.jobs.values()), yields=len(self.yield_at))
        return out

    def op_trace(self) -> dict:
        now = self.clock()
        t0 = min([j["submitted"] for j in self.jobs.values()], default=self.pool["t0"])
        ys = [(t, lid, self.spans[lid].job) for lid, t in sorted(self.yield_at.items())]
        return {"trace": mx.chrome_trace(list(self.spans.values()), len(self.pool["capacity"]), t0, ys, now)}
