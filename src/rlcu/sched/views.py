"""What the service shows of its state: a job's view (the reply to its calls), the status
page, the metrics, and `Snapshot`, an immutable copy of the whole state for benches and
tests (so that nothing outside the core reads or holds its live structures).

Every function here reads the core under its lock. A job's view costs what that job holds
(the policy's per-job indexes), the metrics O(devices), the status page O(leases + requests +
jobs): the lease history is summed up in the core's `Tally`, never scanned.
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
    # (the policy's per-job indexes are in id order: ids grow, and restore() puts them back sorted)
    leases = [_lease_view(core, le) for le in core.pol.job_leases.get(job, {}).values()]
    pending = [{"id": r.id, "phase": r.phase, "cluster": r.cluster, "since": r.since, "asked": core.asked.get(r.id)}
               for r in core.pol.job_pending.get(job, {}).values()]
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
               jobs_live=len(core.pol.jobs), yields=t.yields)  # (the policy's books hold the live jobs)
    return out


def status_of(core) -> dict:
    """Every device and every job: O(leases + requests + jobs), a few dicts a job."""
    now, names, pol = core.clock(), core.pool["names"], core.pol
    by_dev: list[list[str]] = [[] for _ in names]
    for le in pol.leases.values():  # (id order: ids grow, and restore() puts them back sorted)
        tag = f"{le.job}:{le.phase}"
        for d in le.devices:
            by_dev[d].append(tag)
    devs = [{"index": d, "name": names[d], "capacity": cap, "used": pol.used[d], "leases": by_dev[d]}
            for d, cap in enumerate(core.pool["capacity"])]
    rows = [_status_row(core, j, now) for j in sorted(core.jobs.values(), key=lambda j: j.seq)]
    return {"now": now, "policy": core.pool["policy"], "devices": devs, "jobs": rows, "metrics": metrics_of(core)}


def _status_row(core, j: Job, now: float) -> dict:
    held, pend = core.pol.job_leases.get(j.name), core.pol.job_pending.get(j.name)
    row = {"job": j.name, "state": j.state, "pid": j.pid, "phases": [], "devices": [], "mem": 0, "waiting": [],
           "wait_s": j.wait_s, "age_s": max(0.0, (j.finished or now) - j.submitted)}  # (wall clock: display)
    if held:
        names, yielding = core.pool["names"], core.pol.yielding
        row["phases"] = [le.phase + ("(yield)" if le.id in yielding else "") for le in held.values()
                         if le.phase != RESIDENT]
        row["devices"] = sorted({names[d] for le in held.values() for d in le.devices})
        row["mem"] = sum(sum(le.mem) for le in held.values())
    spec = j.spec or {}
    if spec.get("kind") == "lora-host" and spec.get("join"):  # where a LoRA job on its base joins (sched/join.py)
        row["host"] = {"base": spec.get("base"), "join": spec["join"]}
    if pend:
        waits = [max(0.0, now - core.asked.get(r.id, now)) for r in pend.values()]
        row["waiting"] = [{"phase": r.phase, "for_s": w} for r, w in zip(pend.values(), waits)]
        row["wait_s"] = j.wait_s + sum(waits)
    return row
