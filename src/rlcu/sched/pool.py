"""The pool's books: devices with memory, jobs and their clusters, requests, leases.

A **lease** is a set of devices plus memory on each. Several leases may share a device
while their memory fits (sum <= capacity). A request without `mem` wants whole devices
(mem = capacity). A cluster declared with `resident` memory (weights and optimizer state
that stay on the GPU for the job's life) is placed once, by its first grant; that memory is
then held by a `resident` lease until the job ends, and every later phase of that cluster
runs on those devices. A cluster may also declare `peak`, the most memory any one of its
phases takes, which lets the policy refuse placements that could deadlock.

`_Base` validates requests (a request the pool can never satisfy is refused with a
`PolicyError` that says why), keeps the per-device memory books, and restores state after
a service restart; the policies in policy.py decide; audit.py audits the books.

Cost. The books are `Journal`s (dicts that note the keys each change touched, for the
audit of what changed) with per-job indexes beside them (`job_leases`, `job_pending`), kept
by the few methods that add or remove a lease, a request or a home (`_put_lease`,
`_pop_lease`, `_put_request`, `_pop_request`, `_set_home`, `_del_home`), which also call the
subclass's hooks for its own running aggregates. So nothing here scans every job, lease or
request of the pool: a job's operations cost what that job holds.
"""

from __future__ import annotations

import abc
import dataclasses
import math

from rlcu.sched.journal import Journal

PHASES = ("init", "actor_train", "critic_train", "old_logprobs", "ref_logprobs", "values", "rollout")
RANK = {p: i for i, p in enumerate(PHASES)}
RESIDENT = "resident"  # the phase name of the job-lifetime memory lease of a placed cluster
EPS = 1e-9


class PolicyError(ValueError):
    """A request the pool can never satisfy or that refers to nothing known."""


class InvariantError(RuntimeError):
    """The books do not balance (audit.py). Raised by code, never by `assert`, so that
    `python -O` cannot switch the audit off: the service stops rather than serve it."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    devices: int  # device count
    resident: float = 0.0  # memory per device held from placement to the job's end (0: cluster floats)
    peak: float = 0.0  # the most memory one of its phases takes per device (0: not declared)


@dataclasses.dataclass(frozen=True)
class Request:
    id: int
    job: str
    phase: str
    cluster: str
    devices: int  # exactly this many (rollout: at most)
    mem: float | None  # per device; None: whole devices
    min_devices: int  # rollout: at least this many (others: == devices)
    work: float  # rollout: remaining work, any unit (the spare-capacity split weighs by it)
    since: float  # when first asked (a yielded rollout keeps it: its age survives)
    only: tuple[int, ...] | None = None  # the devices it may use (None: any of its cluster's)


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int
    job: str
    phase: str
    cluster: str
    devices: tuple[int, ...]
    mem: tuple[float, ...]  # per device, aligned with devices
    start: float
    request: Request | None = None  # what it granted (None for resident leases)


@dataclasses.dataclass
class Decision:
    grants: list[Lease] = dataclasses.field(default_factory=list)
    yields: list[int] = dataclasses.field(default_factory=list)  # lease ids told to yield


def parse_clusters(clusters: dict) -> dict[str, Cluster]:
    """{"actor": 2} or {"actor": {"devices": 2, "resident": 3.5, "peak": 20}} -> {name: Cluster}."""
    if not isinstance(clusters, dict) or not clusters:
        raise PolicyError(f"clusters must be a non-empty mapping of name -> device count, got {clusters!r}")
    out = {}
    for name, c in clusters.items():
        if isinstance(c, dict):
            bad = set(c) - {"devices", "resident", "peak"}
            if bad:
                raise PolicyError(f"cluster {name!r}: unknown key {sorted(bad)[0]!r} "
                                  "(allowed: devices, resident, peak)")
            n, res, peak = c.get("devices", 1), c.get("resident", 0.0), c.get("peak", 0.0)
        else:
            n, res, peak = c, 0.0, 0.0
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise PolicyError(f"cluster {name!r}: devices must be an integer >= 1, got {n!r}")
        for what, v in (("resident", res), ("peak", peak)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or not math.isfinite(v):
                raise PolicyError(f"cluster {name!r}: {what} memory must be a number >= 0, got {v!r}")
        out[str(name)] = Cluster(n, float(res), float(peak))
    return out


class _Base(abc.ABC):
    """Pool and job bookkeeping shared by both policies."""

    name = "base"
    grants_on_arrival = True  # whether adding a job may grant by itself (FIFO: its allotment)

    def __init__(self, capacity: list[float], aging_s: float = 60.0):
        if not capacity:
            raise PolicyError("the pool has no devices")
        if any(not (c > 0 and math.isfinite(c)) for c in capacity):
            raise PolicyError(f"device memory capacities must be finite and > 0, got {capacity}")
        if not aging_s > 0:
            raise PolicyError(f"aging_s must be > 0, got {aging_s}")
        self.capacity = [float(c) for c in capacity]
        self.aging_s = float(aging_s)
        self.used = [0.0] * len(capacity)
        self.leases: Journal[int, Lease] = Journal()
        self.pending: Journal[int, Request] = Journal()
        self.jobs: Journal[str, dict[str, Cluster]] = Journal()
        self.homes: Journal[tuple[str, str], tuple[int, ...]] = Journal()  # (job, cluster) -> its devices
        self.yielding: Journal[int, float] = Journal()  # lease id -> when told to yield
        self.job_leases: dict[str, dict[int, Lease]] = {}  # job -> its leases (id order)
        self.job_pending: dict[str, dict[int, Request]] = {}  # job -> its pending requests (id order)
        self._next = 1

    # ------------------------------------------------------------------ the books' only writers
    def _put_lease(self, le: Lease) -> None:
        """Add a lease, or replace the one of its id (a rollout grown)."""
        old = self.leases.get(le.id)
        if old is not None:
            self._lease_out(old)
        self.leases[le.id] = le
        self.job_leases.setdefault(le.job, {})[le.id] = le
        self._lease_in(le)

    def _pop_lease(self, lease_id: int) -> Lease:
        le = _pop_indexed(self.leases, self.job_leases, lease_id)
        self._lease_out(le)
        return le

    def _put_request(self, r: Request) -> None:
        self.pending[r.id] = r
        self.job_pending.setdefault(r.job, {})[r.id] = r

    def _pop_request(self, req_id: int) -> Request:
        return _pop_indexed(self.pending, self.job_pending, req_id)

    def _set_home(self, key: tuple[str, str], devices: tuple[int, ...]) -> None:
        if key in self.homes:
            self._del_home(key)
        self.homes[key] = devices
        self._home_in(key, devices)

    def _del_home(self, key: tuple[str, str]) -> None:
        self._home_out(key, self.homes.pop(key))

    # hooks for the subclass's running aggregates (PhasePolicy's); FIFO keeps none
    def _lease_in(self, le: Lease) -> None:  # noqa: B027
        pass

    def _lease_out(self, le: Lease) -> None:  # noqa: B027
        pass

    def _home_in(self, key: tuple[str, str], devices: tuple[int, ...]) -> None:  # noqa: B027
        pass

    def _home_out(self, key: tuple[str, str], devices: tuple[int, ...]) -> None:  # noqa: B027
        pass

    # ------------------------------------------------------------------ ids, jobs
    def _id(self) -> int:
        i = self._next
        self._next += 1
        return i

    def add_job(self, job: str, clusters: dict) -> None:
        if job in self.jobs:
            raise PolicyError(f"job {job!r} already exists")
        cl = parse_clusters(clusters)
        for name, c in cl.items():
            if c.devices > len(self.capacity):
                raise PolicyError(f"cluster {name!r} of job {job!r} wants {c.devices} devices; the pool has "
                                  f"{len(self.capacity)}")
            if c.resident + c.peak > max(self.capacity) + EPS:
                raise PolicyError(f"cluster {name!r} of job {job!r} keeps {c.resident:g} resident memory per device "
                                  f"(+ {c.peak:g} peak); the largest device has {max(self.capacity):g}")
        self.jobs[job] = cl

    def remove_job(self, job: str) -> list[Lease]:
        """Forget a job: its requests are dropped, its leases (resident too) released."""
        cls = self._job(job)
        for rid in list(self.job_pending.get(job, ())):
            self._pop_request(rid)
        out = [self.release(lid) for lid in sorted(self.job_leases.get(job, ()))]
        for k in [(job, c) for c in cls if (job, c) in self.homes]:
            self._del_home(k)
        del self.jobs[job]
        return out

    def _job(self, job: str) -> dict[str, Cluster]:
        if job not in self.jobs:
            raise PolicyError(f"unknown job {job!r}")
        return self.jobs[job]

    # ------------------------------------------------------------------ requests, leases
    def request(self, job: str, phase: str, cluster: str | None = None, *, devices: int | None = None,
                mem: float | None = None, min_devices: int | None = None, work: float = 1.0, now: float = 0.0,
                since: float | None = None, only: list[int] | None = None) -> Request:
        """Queue a phase request; raises PolicyError when it can never be satisfied.
        devices: how many (default: the cluster's size; a floating rollout: the whole pool);
        mem: per device (None: whole devices); min_devices: rollout's least; work: rollout's
        remaining work; since: its first request time (kept across yields); only: the
        devices it may use."""
        cls = self._job(job)
        if phase not in RANK:
            raise PolicyError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        if cluster is None:
            if len(cls) != 1:
                raise PolicyError(f"job {job!r} has clusters {sorted(cls)}: name the cluster of phase {phase!r}")
            cluster = next(iter(cls))
        if cluster not in cls:
            raise PolicyError(f"job {job!r} has no cluster {cluster!r} (clusters: {', '.join(sorted(cls))})")
        if any(r.phase == phase for r in self.job_pending.get(job, {}).values()) or \
                any(le.phase == phase for le in self.job_leases.get(job, {}).values()):
            raise PolicyError(f"job {job!r} already holds or awaits phase {phase!r}: release it first")
        c = cls[cluster]
        home = self.homes.get((job, cluster))
        if only is not None:
            only = list(only) if isinstance(only, (list, tuple)) else [only]
            n = len(self.capacity)
            bad = [d for d in only if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d < n]
            if bad:
                raise PolicyError(f"device {bad[0]!r} is outside the pool (devices 0..{n - 1})")
            if not only:
                raise PolicyError("only= names no device")
            only = tuple(sorted(set(only)))
            if home and not set(only) <= set(home):
                raise PolicyError(f"cluster {cluster!r} of job {job!r} lives on devices {list(home)}; "
                                  f"it cannot run on {[d for d in only if d not in home]}")
        pool = only or home or tuple(range(len(self.capacity)))
        n_pool = len(pool)
        if devices is None:
            devices = (len(home) if home else (n_pool if phase == "rollout" and not c.resident else c.devices))
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise PolicyError(f"devices must be an integer >= 1, got {devices!r}")
        if devices > n_pool:
            where = (f"only= allows {n_pool}" if only else f"cluster {cluster!r} is placed on {n_pool}" if home
                     else f"the pool has {n_pool}")
            raise PolicyError(f"phase {phase!r} of job {job!r} wants {devices} devices; {where}")
        if min_devices is None:
            min_devices = 1 if phase == "rollout" else devices
        if phase != "rollout" and min_devices != devices:
            raise PolicyError(f"only rollout is elastic: phase {phase!r} takes exactly its devices")
        if not 1 <= min_devices <= devices:
            raise PolicyError(f"min_devices must be in [1, {devices}], got {min_devices}")
        if mem is not None:
            if not isinstance(mem, (int, float)) or isinstance(mem, bool) or not (mem >= 0 and math.isfinite(mem)):
                raise PolicyError(f"mem must be a number >= 0, got {mem!r}")
            mem = float(mem)
        elif c.resident:
            raise PolicyError(f"cluster {cluster!r} keeps resident memory, so its phases must give mem "
                              "(whole devices would include the resident part)")
        if c.peak and (mem is None or mem > c.peak + EPS):
            raise PolicyError(f"phase {phase!r} of job {job!r} wants {'whole devices' if mem is None else f'{mem:g}'} "
                              f"memory, more than the declared peak {c.peak:g} of cluster {cluster!r}")
        if not (isinstance(work, (int, float)) and work >= 0 and math.isfinite(work)):
            raise PolicyError(f"work must be a finite number >= 0, got {work!r}")
        extra = 0.0 if home else c.resident
        own = [0.0] * len(self.capacity)  # the job's own residents never leave while it waits
        for le in self.job_leases.get(job, {}).values():
            if le.phase == RESIDENT and le.cluster != cluster:
                for d, m in zip(le.devices, le.mem):
                    own[d] += m
        fit = [d for d in pool if mem is None or mem + extra + own[d] <= self.capacity[d] + EPS]
        if len(fit) < min_devices:
            most = max(self.capacity[d] for d in pool) - extra
            raise PolicyError(f"phase {phase!r} of job {job!r} wants {mem:g} memory on each of {min_devices} devices; "
                              f"only {len(fit)} devices have that much (largest free capacity {most:g})")
        r = Request(self._id(), job, phase, cluster, devices, mem, min_devices, float(work),
                    now if since is None else since, only)
        self._put_request(r)
        return r

    def cancel_request(self, req_id: int) -> Request:
        if req_id not in self.pending:
            raise PolicyError(f"no pending request {req_id}")
        return self._pop_request(req_id)

    def set_work(self, job: str, work: float) -> None:
        """Update the remaining work of the job's pending rollout request (if any)."""
        for r in list(self.job_pending.get(job, {}).values()):
            if r.phase == "rollout":
                self._put_request(dataclasses.replace(r, work=float(work)))

    def release(self, lease_id: int) -> Lease:
        if lease_id not in self.leases:
            raise PolicyError(f"no lease {lease_id} is held (unknown, or already released)")
        lease = self._pop_lease(lease_id)
        for d, m in zip(lease.devices, lease.mem):
            self.used[d] = max(0.0, self.used[d] - m)
            if self.used[d] < EPS:
                self.used[d] = 0.0
        self.yielding.pop(lease_id, None)
        return lease

    def _grant(self, job, phase, cluster, devices, mem, now, request=None) -> Lease:
        devices = tuple(sorted(devices))
        lease = Lease(self._id(), job, phase, cluster, devices, tuple(mem[d] for d in devices), now, request)
        for d, m in zip(lease.devices, lease.mem):
            self.used[d] += m
        self._put_lease(lease)
        return lease

    # ------------------------------------------------------------------ restore (service restart)
    def adopt(self, lease: Lease) -> None:
        """Put back a lease held before a restart (and the home it implies)."""
        self._known(lease.job, lease.phase, lease.cluster, f"lease {lease.id}")
        for d, m in zip(lease.devices, lease.mem):
            if not 0 <= d < len(self.capacity):
                raise PolicyError(f"lease {lease.id} names device {d} outside the pool")
            self.used[d] += m
        if lease.phase == RESIDENT:  # (its home first: the aggregates count the lease as homed)
            self._set_home((lease.job, lease.cluster), lease.devices)
        self._put_lease(lease)
        self._next = max(self._next, lease.id + 1)

    def adopt_request(self, r: Request) -> None:
        self._known(r.job, r.phase, r.cluster, f"request {r.id}")
        self._put_request(r)
        self._next = max(self._next, r.id + 1)

    def _known(self, job: str, phase: str, cluster: str, what: str) -> None:
        cls = self._job(job)
        if phase != RESIDENT and phase not in RANK:
            raise PolicyError(f"{what} of job {job!r} is for phase {phase!r}; phases: {', '.join(PHASES)}")
        if cluster not in cls:
            raise PolicyError(f"{what} of job {job!r} is on cluster {cluster!r}; the job has {', '.join(sorted(cls))}")

    def restore(self, leases: list[Lease], requests: list[Request], yielding: dict[int, float] | None = None,
                next_id: int = 1) -> None:
        """Put the books back after a service restart: the held leases (and the homes their
        resident leases imply), the pending requests, the yields asked (lease id -> when), and
        the next id to hand out (ids of ended leases are never reused). The jobs must have
        been added first."""
        for le in sorted(leases, key=lambda le: le.id):
            self.adopt(le)
        for r in sorted(requests, key=lambda r: r.id):
            self.adopt_request(r)
        for lid, t in (yielding or {}).items():
            if lid not in self.leases or self.leases[lid].phase != "rollout":
                raise PolicyError(f"a yield was asked of lease {lid}, which is not a held rollout")
            self.yielding[lid] = t
        self._next = max(self._next, int(next_id))

    @property
    def next_id(self) -> int:
        """The id the next request or lease gets."""
        return self._next

    # ------------------------------------------------------------------ views
    def free(self, d: int) -> float:
        return self.capacity[d] - self.used[d]

    def score(self, r: Request, now: float) -> float:
        return RANK[r.phase] - max(0.0, now - r.since) / self.aging_s

    def _key(self, r: Request, now: float):
        return (self.score(r, now), r.since, r.id)

    @abc.abstractmethod
    def schedule(self, now: float) -> Decision:
        """The subclass's decision for this instant."""


def _pop_indexed(items: dict, by_job: dict, key):
    """Remove items[key] and its entry in the per-job index (the job's entry too once empty)."""
    x = items.pop(key)
    mine = by_job[x.job]
    del mine[key]
    if not mine:
        del by_job[x.job]
    return x
