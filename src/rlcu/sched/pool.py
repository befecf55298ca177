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
a service restart; the policies in policy.py decide. `check_invariants` audits the books.
"""

from __future__ import annotations

import abc
import dataclasses
import math

PHASES = ("init", "actor_train", "critic_train", "old_logprobs", "ref_logprobs", "values", "rollout")
RANK = {p: i for i, p in enumerate(PHASES)}
RESIDENT = "resident"  # the phase name of the job-lifetime memory lease of a placed cluster
EPS = 1e-9


class PolicyError(ValueError):
    """A request the pool can never satisfy or that refers to nothing known."""


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
        self.leases: dict[int, Lease] = {}
        self.pending: dict[int, Request] = {}
        self.jobs: dict[str, dict[str, Cluster]] = {}
        self.homes: dict[tuple[str, str], tuple[int, ...]] = {}  # (job, cluster) -> its devices
        self.yielding: dict[int, float] = {}  # lease id -> when told to yield
        self._next = 1

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
        self._job(job)
        for r in [r for r in self.pending.values() if r.job == job]:
            del self.pending[r.id]
        out = [self.release(lid) for lid in sorted(le.id for le in self.leases.values() if le.job == job)]
        for k in [k for k in self.homes if k[0] == job]:
            del self.homes[k]
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
        if any(r.job == job and r.phase == phase for r in self.pending.values()) or \
                any(le.job == job and le.phase == phase for le in self.leases.values()):
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
        for le in self.leases.values():
            if le.job == job and le.phase == RESIDENT and le.cluster != cluster:
                for d, m in zip(le.devices, le.mem):
                    own[d] += m
        fit = [d for d in pool if mem is None or mem + extra + own[d] <= self.capacity[d] + EPS]
        if len(fit) < min_devices:
            most = max(self.capacity[d] for d in pool) - extra
            raise PolicyError(f"phase {phase!r} of job {job!r} wants {mem:g} memory on each of {min_devices} devices; "
                              f"only {len(fit)} devices have that much (largest free capacity {most:g})")
        r = Request(self._id(), job, phase, cluster, devices, mem, min_devices, float(work),
                    now if since is None else since, only)
        self.pending[r.id] = r
        return r

    def cancel_request(self, req_id: int) -> Request:
        if req_id not in self.pending:
            raise PolicyError(f"no pending request {req_id}")
        return self.pending.pop(req_id)

    def set_work(self, job: str, work: float) -> None:
        """Update the remaining work of the job's pending rollout request (if any)."""
        for r in list(self.pending.values()):
            if r.job == job and r.phase == "rollout":
                self.pending[r.id] = dataclasses.replace(r, work=float(work))

    def release(self, lease_id: int) -> Lease:
        if lease_id not in self.leases:
            raise PolicyError(f"no lease {lease_id} is held (unknown, or already released)")
        lease = self.leases.pop(lease_id)
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
        self.leases[lease.id] = lease
        return lease

    # ------------------------------------------------------------------ restore (service restart)
    def adopt(self, lease: Lease) -> None:
        """Put back a lease held before a restart (and the home it implies)."""
        self._known(lease.job, lease.phase, lease.cluster, f"lease {lease.id}")
        for d, m in zip(lease.devices, lease.mem):
            if not 0 <= d < len(self.capacity):
                raise PolicyError(f"lease {lease.id} names device {d} outside the pool")
            self.used[d] += m
        self.leases[lease.id] = lease
        if lease.phase == RESIDENT:
            self.homes[(lease.job, lease.cluster)] = lease.devices
        self._next = max(self._next, lease.id + 1)

    def adopt_request(self, r: Request) -> None:
        self._known(r.job, r.phase, r.cluster, f"request {r.id}")
        self.pending[r.id] = r
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


def check_invariants(p: _Base) -> None:
    """Raise AssertionError when the pool's books do not balance: a device or its memory
    double-booked, a lease outside the pool, a phase held twice, a request for a lease held,
    a home without its resident lease (or the other way), an id at or past the next one.
    One pass over the leases and one over the requests: the service runs it after every change."""
    n, nxt, homes = len(p.capacity), p._next, p.homes
    used = [0.0] * n
    seen = set()
    for le in p.leases.values():
        job, devs = le.job, le.devices
        assert job in p.jobs, f"lease {le.id} of unknown job {job!r}"
        assert len(set(devs)) == len(devs) == len(le.mem), f"lease {le.id} repeats a device: {devs}"
        res = le.phase == RESIDENT
        key = (job, le.phase, le.cluster if res else "")
        assert key not in seen, f"job {job!r} holds phase {le.phase!r} twice"
        seen.add(key)
        assert le.id < nxt, f"lease {le.id} at or past the next id {nxt}"
        if res:
            assert homes.get((job, le.cluster)) == devs, \
                f"resident lease {le.id} is on {devs}, its cluster's home is {homes.get((job, le.cluster))}"
        for d, m in zip(devs, le.mem):
            assert 0 <= d < n and m >= 0, f"lease {le.id}: device {d} outside the pool of {n}, or memory {m} < 0"
            used[d] += m
    for d, (u, cap, book) in enumerate(zip(used, p.capacity, p.used)):
        assert u <= cap + 1e-6, f"device {d} memory double-booked: {u:g} > {cap:g}"
        assert abs(u - book) <= 1e-6, f"device {d}: books say {book:g} used, leases sum to {u:g}"
    for r in p.pending.values():
        assert r.job in p.jobs, f"request {r.id} of unknown job {r.job!r}"
        assert (r.job, r.phase, "") not in seen, f"job {r.job!r} awaits phase {r.phase!r} it already holds"
        assert r.id < nxt, f"request {r.id} at or past the next id {nxt}"
    for lid in p.yielding:
        assert lid in p.leases and p.leases[lid].phase == "rollout", f"yield asked of lease {lid}, not a held rollout"
    for job, cluster in homes:
        assert (job, RESIDENT, cluster) in seen, f"cluster {cluster!r} of job {job!r} has a home but no resident lease"
