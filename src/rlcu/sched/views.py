"""What the service shows of its state: a job's view (the reply to its calls), the status
page, the metrics, and `Snapshot`, an immutable copy of the whole state for benches and
tests (so that nothing outside the core reads or holds its live structures).

Every function here reads the core under its lock and costs O(live leases + requests + jobs
+ devices): the lease history is summed up in the core's `Tally`, never scanned.
"""

from __future__ import annotations

import dataclasses

from rlcu.sched import metrics as mx
from rlcu.sched.pool import RESIDENT, Request
from rlcu.sched.store import Job

LIVE = ("queued", "running", "stopping")  # stopping: asked to stop (a graceful cancel), not yet finished


@dataclasses.dataclass(frozen=True)
class Snapshot:
    now: float
    pool: dict  # capacity, names, policy, aging_s, t0
    jobs: dict[str, Job]  # copies
    spans: tuple[mx.Span, ...]  # held leases and the remembered ended ones, by id (copies)
    held: tuple[int, ...]  # ids of the held leases
    pending: tuple[Request, ...]
    used: tuple[float, ...]  # memory in use per device
    yielding: tuple[int, ...]  # held leases asked to yield
    yields: tuple[tuple[float, int, str], ...]  # (when, lease, job) of the remembered yield requests
    metrics: dict  # what op_metrics answers
    fatal: str | None = None

    def trace(self) -> dict:
        """Chrome/Perfetto trace of the spans."""
        return mx.chrome_trace(list(self.spans), len(self.pool["capacity"]), self.metrics["t0"],
                               sorted(self.yields), self.now)


def _lease_view(core, le) -> dict:
    s = core.held[le.id]
    return {"id": s.id, "request": le.request.id if le.request is not None else None, "phase": s.phase,
            "cluster": s.cluster, "devices": list(s.devices), "names": [core.pool["names"][d] for d in s.devices],
            "mem": list(s.mem), "start": s.start, "yield": s.id in core.pol.yielding}


def job_view(core, job: str) -> dict:
    j = core.jobs[job]
    # (the policy's dicts are in id order: ids grow, and restore() puts them back sorted)
    leases = [_lease_view(core, le) for le in core.pol.leases.values() if le.job == job]
    pending = [{"id": r.id, "phase": r.phase, "cluster": r.cluster, "since": r.since, "asked": core.asked.get(r.id)}
               for r in core.pol.pending.values() if r.job == job]
    return {"job": job, "state": j.state, "version": core.versions.get(job, 0), "leases": leases, "pending": pending}


def wall_t0(core) -> float:
    """When the metrics began on the wall clock, for display (a trace's origin): the wall clock
    now less the uptime, so that a trace's times and `uptime_s` agree after a clock step."""
    return core.clock() - (core.mtime() - core.tally.t0)


def metrics_of(core) -> dict:
    now = core.mtime()  # the metrics clock (monotonic): a wall clock stepped back counts no time
    t = core.tally
    out = t.result(now)
    free = [c - u for c, u in zip(core.pool["capacity"], core.pol.used)]
    tot = sum(max(f, 0.0) for f in free)
    out.update(t0=core.clock() - (now - t.t0), uptime_s=now - t.t0, mem_in_use=list(core.pol.used),
               frag_now=1.0 - max(free) / tot if tot > 1e-12 else 0.0,
               jobs_live=sum(j.state in LIVE for j in core.jobs.values()), yields=t.yields)
    return out


def status_of(core) -> dict:
    now = core.clock()
    names = core.pool["names"]
    by_dev: dict[int, list] = {}
    by_job: dict[str, list] = {}
    for lid in sorted(core.pol.leases):
        le = core.pol.leases[lid]
        by_job.setdefault(le.job, []).append(le)
        for d in le.devices:
            by_dev.setdefault(d, []).append(le)
    waits: dict[str, list] = {}
    for r in core.pol.pending.values():
        waits.setdefault(r.job, []).append(r)
    devs = [{"index": d, "name": names[d], "capacity": cap, "used": core.pol.used[d],
             "leases": [f"{le.job}:{le.phase}" for le in by_dev.get(d, [])]}
            for d, cap in enumerate(core.pool["capacity"])]
    rows = []
    for j in sorted(core.jobs.values(), key=lambda j: j.seq):
        held, pend = by_job.get(j.name, []), waits.get(j.name, [])
        rows.append({
            "job": j.name, "state": j.state, "pid": j.pid,
            "phases": [le.phase + ("(yield)" if le.id in core.pol.yielding else "") for le in held
                       if le.phase != RESIDENT],
            "devices": sorted({names[d] for le in held for d in le.devices}),
            "mem": sum(sum(le.mem) for le in held),
            "waiting": [{"phase": r.phase, "for_s": max(0.0, now - core.asked.get(r.id, now))} for r in pend],
            "wait_s": j.wait_s + sum(max(0.0, now - core.asked.get(r.id, now)) for r in pend),
            "age_s": max(0.0, (j.finished or now) - j.submitted)})  # (wall clock: display; never < 0)
    return {"now": now, "policy": core.pool["policy"], "devices": devs, "jobs": rows, "metrics": metrics_of(core)}
