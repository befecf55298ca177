"""The scheduling policy: which job phases get which devices and how much of their memory.

Pure and deterministic: no clock, no I/O, no randomness; time comes in as `now` and every
tie is broken by ids, so the simulator, the service and the Ray actor replay the same
decisions from the same calls.

Leases (devices plus memory on each, see pool.py) may share a device while their memory
fits, so one job's training overlaps other jobs' rollouts on one GPU.

Order. Phases by priority, high to low: init, actor_train, critic_train, old_logprobs,
ref_logprobs, values, rollout. A pending request's score is

    score = rank(phase) - wait / aging_s          (lower first; ties: older, then lower id)

so FIFO holds within a priority and any request, however low, eventually comes first
(aging). One pass per `schedule(now)` walks the pending requests by score:
- a non-rollout request takes exactly its devices, all-or-nothing;
- a rollout takes `min_devices` at once; after the pass the spare capacity is split among
  the rollouts just granted by water-filling on remaining work (the one with the most work
  per device gets the next device), up to each one's `devices`;
- a request that does not fit *reserves* the memory it needs on its target devices (kept
  while they stay valid): later (lower) requests in the pass may only use what it leaves,
  so it is granted once the transient leases there end. Aging and that give: no starvation;
- when a blocked request's target device is short of memory and rollouts of a worse score
  hold some of it, the newest such rollouts are told to **yield** (the job stops its engine
  at a step boundary, keeps what it made, releases the lease and asks again with its
  remaining work, keeping its age).

Placement by memory and compute. Among the devices where a phase (or a job's residents)
fits, the policy prefers the one with the least compute load: the jobs homed there (each
runs its compute-bound phases there for its life) plus the transient phases of floating
jobs on it (a rollout weighs 0.5: decoding is memory-bound; any other phase 1), then the
most free memory. Memory alone would put a new job beside a busy compute-bound one because
that device had a little more memory free.

Placement and deadlock. A job's `resident` clusters are placed together by its first grant
(a small search, least-loaded and emptiest devices first), and only where the residents plus the largest
declared `peak` of anything placed there fit, and every placed job's floating clusters keep
room for their peak. So a placed job's phases always fit once transient leases end. A
request that could fit only after some resident leaves reserves no memory (that would hold
up the jobs whose end it waits for); it *closes* the devices it waits for to new placements
instead, so the residents there can only leave. Closures hold up no job they wait for
(those are placed, and placed jobs never place again), reservations wait only for
transient leases, which always end: no cycle of waits (tests/unit/test_sched_policy.py replays
random memory-tight job mixes against all of this).

Cost. Placement reads running per-device aggregates (load.py) and the books' per-job
indexes, never a scan of every lease or job: planning a request costs O(devices) (a small
search when it places residents), and a pass O(waiting requests x devices).

`FifoPolicy` is the baseline: each job takes all its clusters' devices, whole, for its life,
one job after another in arrival order, and runs its phases inside that allotment.
"""

from __future__ import annotations

import dataclasses
import itertools

from rlcu.sched.audit import check_invariants
from rlcu.sched.load import COMPUTE_WEIGHT, DeviceLoad
from rlcu.sched.pool import (
    EPS,
    PHASES,
    RANK,
    RESIDENT,
    Cluster,
    Decision,
    Lease,
    PolicyError,
    Request,
    _Base,
    parse_clusters,
)

__all__ = ["COMPUTE_WEIGHT", "PHASES", "RANK", "RESIDENT", "Cluster", "Decision", "Lease", "PolicyError", "Request",
           "PhasePolicy", "FifoPolicy", "make_policy", "check_invariants", "parse_clusters"]


class PhasePolicy(_Base):
    """Phase-aware sharing (see the module docstring)."""

    name = "phase"
    grants_on_arrival = False  # a job's first request places it; its arrival changes no decision

    def __init__(self, capacity: list[float], aging_s: float = 60.0):
        super().__init__(capacity, aging_s)
        self.targets: dict[int, dict[int, float]] = {}  # blocked request -> {device: memory} it reserves (sticky)
        self.last_used: dict[tuple[str, str], tuple[int, ...]] = {}  # soft affinity of floating clusters
        self._closed: set[int] = set()  # devices closed to new placements in this pass
        self.agg = DeviceLoad(len(capacity))  # running per-device aggregates (load.py)

    # the aggregates follow every lease and home (the books' writers in pool.py call these)
    def _lease_in(self, le: Lease) -> None:
        c = self.jobs[le.job].get(le.cluster) if le.phase == RESIDENT else None
        self.agg.lease_in(le, c.peak if c is not None else 0.0)

    def _lease_out(self, le: Lease) -> None:
        self.agg.lease_out(le)

    def _home_in(self, key: tuple[str, str], devices: tuple[int, ...]) -> None:
        self.agg.home_in(key[0], devices, self._needs(key[0]))

    def _home_out(self, key: tuple[str, str], devices: tuple[int, ...]) -> None:
        self.agg.home_out(key[0], devices, self._needs(key[0]))

    def _needs(self, job: str) -> list[tuple[float, int]]:
        """(peak, devices) of the job's floating clusters that declare a peak."""
        return [(c.peak, c.devices) for c in self.jobs[job].values() if c.resident == 0 and c.peak > 0]

    def add_job(self, job: str, clusters: dict) -> None:
        super().add_job(job, clusters)
        n = len(self.capacity)
        if self._plan_residents(job, list(self.capacity), [0.0] * n, [0.0] * n, alone=True) is None:
            del self.jobs[job]
            raise PolicyError(f"the resident clusters of job {job!r} (resident + peak memory per device) do not "
                              f"fit together on the pool of {n} devices of {max(self.capacity):g}")

    # ------------------------------------------------------------------ placement
    # A job's resident clusters are placed together, by its first grant, and a device takes a
    # resident only if, beside every resident already there, the residents plus the largest
    # declared peak of anything placed there still fit, and every placed job's floating
    # clusters keep enough devices for their peak: then any one phase fits once the transient
    # leases drain, and placement can neither deadlock nor strand a job (given declared peaks).
    def _tally(self) -> tuple[list[float], list[float]]:
        """Per device: resident memory held, and the largest peak of the clusters placed there."""
        return self.agg.tally()

    def _compute_load(self, job: str) -> list[float]:
        """Per device, the compute load of other jobs: one per job homed there, plus each
        transient phase of a job not homed there (rollout 0.5, others 1)."""
        return self.agg.load(job)

    def _placing(self, job: str) -> bool:
        """Whether the job's next grant places its resident clusters."""
        cls = self.jobs[job]
        return any(c.resident > 0 for c in cls.values()) and not any((job, c) in self.homes for c in cls)

    def _plan_residents(self, job, av, res, peak, r: Request | None = None,
                        alone: bool = False) -> dict[str, list[int]] | None:
        """Homes for all of the job's resident clusters given free memory `av` (updated in
        place), or None; with r, r's phase must fit too (on its cluster's new home, or, if
        that floats, anywhere it may run). A small depth-first search, the emptiest devices
        first (jobs spread), so that a placement is found whenever one exists (within a
        budget of tries). alone: whether the job fits an empty pool by itself (other jobs
        neither load devices nor need room)."""
        cls = self.jobs[job]
        names = sorted((c for c in cls if cls[c].resident > 0), key=lambda c: (-cls[c].resident, c))
        load = [0.0] * len(av) if alone else self._compute_load(job)
        budget = [4096]
        homes: dict[str, list[int]] = {}

        def leaf() -> bool:
            if not self._floating_fit(job, res, alone):
                return False
            if r is None:
                return True
            devs = homes.get(r.cluster, range(len(av)))
            m = lambda d: self.capacity[d] if r.mem is None else r.mem  # noqa: E731
            return sum(1 for d in devs if (r.only is None or d in r.only) and av[d] + EPS >= m(d)) >= r.min_devices

        def place(i: int) -> bool:
            if i == len(names):
                return leaf()
            c = cls[names[i]]
            own = r is not None and names[i] == r.cluster
            m = (r.mem or 0.0) if own else 0.0
            cand = [d for d in range(len(av)) if (not own or r.only is None or d in r.only)
                    and res[d] + c.resident + max(peak[d], c.peak, m) <= self.capacity[d] + EPS
                    and av[d] + EPS >= c.resident]
            cand.sort(key=lambda d: (load[d], -av[d], d))
            for hs in itertools.combinations(cand, c.devices):
                budget[0] -= 1
                if budget[0] < 0:
                    return False
                saved = [(d, res[d], peak[d], av[d]) for d in hs]
                for d in hs:
                    res[d] += c.resident
                    peak[d] = max(peak[d], c.peak)
                    av[d] -= c.resident
                homes[names[i]] = sorted(hs)
                if place(i + 1):
                    return True
                del homes[names[i]]
                for d, x, y, z in saved:
                    res[d], peak[d], av[d] = x, y, z
            return False

        return dict(homes) if place(0) else None

    def _floating_fit(self, job: str, res: list[float], alone: bool = False) -> bool:
        """Whether, beside the residents `res`, every placed job's (and `job`'s) floating
        clusters still have enough devices for their declared peak: placing residents must not
        strand a placed job's other phases. (One check per distinct (peak, devices).)"""
        needs = set(self._needs(job)) if alone or job not in self.agg.placed else set()
        most: dict[float, int] = {}  # peak -> the most devices a cluster of that peak needs
        for pk, n in needs | (set() if alone else set(self.agg.needs)):
            most[pk] = max(most.get(pk, 0), n)
        for pk, n in most.items():
            if sum(cap - x + EPS >= pk for cap, x in zip(self.capacity, res)) < n:
                return False
        return True

    def _plan(self, r: Request, avail: list[float], ideal: bool = False):
        """What granting r now takes: (homes to place, r's devices, {device: memory}), or None.
        ideal: as if every transient lease had ended (residents and closures stay): can r fit
        by waiting for transient leases alone?"""
        placing = self._placing(r.job)
        av, homes = avail, {}  # (read only, unless placing: then a copy)
        if ideal or placing:
            res, peak = self._tally()
            av = [c - x for c, x in zip(self.capacity, res)] if ideal else list(avail)
        if placing:  # closed devices take no new residents (see _reserve)
            av = [-1.0 if d in self._closed else a for d, a in enumerate(av)]
            homes = self._plan_residents(r.job, av, res, peak, r)
            if homes is None:
                return None
        home = homes.get(r.cluster) or self.homes.get((r.job, r.cluster))
        devs = home or range(len(self.capacity))
        m = lambda d: self.capacity[d] if r.mem is None else r.mem  # noqa: E731
        ok = [d for d in devs if (r.only is None or d in r.only) and av[d] + EPS >= m(d)]
        if len(ok) < r.min_devices:  # (a blocked request costs O(devices), before the load is read)
            return None
        fav = set(self.last_used.get((r.job, r.cluster), ()))
        load = self._compute_load(r.job)
        ok.sort(key=lambda d: (load[d], d not in fav, -av[d], d))
        mine = sorted(ok[: r.min_devices])
        need = {d: m(d) for d in mine}
        for name, hs in homes.items():
            for d in hs:
                need[d] = need.get(d, 0.0) + self.jobs[r.job][name].resident
        return homes, mine, need

    def _place(self, r: Request, plan, avail: list[float], now: float, dec: Decision) -> Lease:
        homes, mine, need = plan
        for name, hs in sorted(homes.items()):
            c = self.jobs[r.job][name]
            self._set_home((r.job, name), tuple(hs))
            dec.grants.append(self._grant(r.job, RESIDENT, name, hs, dict.fromkeys(hs, c.resident), now))
        lease = self._grant(r.job, r.phase, r.cluster, mine,
                            {d: self.capacity[d] if r.mem is None else r.mem for d in mine}, now, r)
        for d, x in need.items():
            avail[d] -= x
        self._pop_request(r.id)
        self.targets.pop(r.id, None)
        if not self.jobs[r.job][r.cluster].resident:
            self.last_used[(r.job, r.cluster)] = lease.devices
        dec.grants.append(lease)
        return lease

    def _reserve(self, r: Request, avail: list[float], now: float, dec: Decision) -> None:
        """r does not fit now: hold the memory it needs on its target devices against later
        requests in this pass, and ask rollouts in its way to yield. A request that cannot fit
        until some resident leaves reserves no memory (it would hold up the very jobs whose
        end it waits for); it closes the devices it waits for to new placements instead, so
        that their residents can only leave (a closure holds up no job it waits for: those
        are placed already, and placed jobs never place again). A placing request that
        reserves also closes its targets: a lower placement there could strand it."""
        ideal = self._plan(r, avail, ideal=True)
        if ideal is None:
            self.targets.pop(r.id, None)
            want = self._plan_empty(r)
            self._closed.update(want if want is not None else range(len(self.capacity)))
            return
        tgt = self.targets.get(r.id)
        if tgt is None or any(d not in ideal[2] for d in tgt) or len(tgt) != len(ideal[2]):
            tgt = self.targets[r.id] = dict(ideal[2])
        if self._placing(r.job):  # no lower placement may take the room its residents will need
            self._closed.update(tgt)
        if r.phase != "rollout":
            self._ask_yields(r, tgt, avail, now, dec)
        for d, x in tgt.items():
            avail[d] -= x

    def _plan_empty(self, r: Request) -> list[int] | None:
        """The devices r would use on a pool with no other job's memory on it."""
        n = len(self.capacity)
        av, res, peak = list(self.capacity), [0.0] * n, [0.0] * n
        for le in self.job_leases.get(r.job, {}).values():  # the job's own residents stay
            if le.phase == RESIDENT:
                for d, m in zip(le.devices, le.mem):
                    av[d] -= m
                    res[d] += m
        homes = self._plan_residents(r.job, av, res, peak, r) if self._placing(r.job) else {}
        if homes is None:
            return None
        home = homes.get(r.cluster) or self.homes.get((r.job, r.cluster))
        devs = [d for d in (home or range(n)) if r.only is None or d in r.only]
        ok = sorted((d for d in devs if av[d] + EPS >= (self.capacity[d] if r.mem is None else r.mem)),
                    key=lambda d: (-av[d], d))
        return sorted(set(ok[: r.min_devices]) | {d for hs in homes.values() for d in hs})

    def _ask_yields(self, r: Request, tgt: dict[int, float], avail, now: float, dec: Decision) -> None:
        s = self.score(r, now)
        for d, need in sorted(tgt.items()):
            short = need - avail[d]
            on_d = self.agg.rollouts[d].values()  # (only rollouts are ever asked to yield)
            short -= sum(le.mem[le.devices.index(d)] for le in on_d if le.id in self.yielding)
            cands = [le for le in on_d if le.id not in self.yielding
                     and le.request is not None and self.score(le.request, now) > s]
            cands.sort(key=lambda le: (-le.start, -le.id))  # the newest first
            for le in cands:
                if short <= EPS:
                    break
                short -= le.mem[le.devices.index(d)]
                self.yielding[le.id] = now
                dec.yields.append(le.id)

    def schedule(self, now: float) -> Decision:
        dec = Decision()
        avail = [self.free(d) for d in range(len(self.capacity))]
        self._closed = set()
        for rid in [rid for rid in self.targets if rid not in self.pending]:
            del self.targets[rid]
        rollouts: list[Lease] = []
        for r in sorted(self.pending.values(), key=lambda r: self._key(r, now)):
            plan = self._plan(r, avail)
            if plan is None:
                self._reserve(r, avail, now, dec)
                continue
            lease = self._place(r, plan, avail, now, dec)
            if r.phase == "rollout" and r.devices > r.min_devices:
                rollouts.append(lease)
        self._grow(rollouts, avail, dec)
        return dec

    def _grow(self, rollouts: list[Lease], avail: list[float], dec: Decision) -> None:
        """Water-fill the spare devices over the rollouts granted in this pass: the one with
        the most remaining work per device gets the next device, up to its `devices`."""
        while True:
            best = None
            for i, le in enumerate(rollouts):
                r = le.request
                if len(le.devices) >= r.devices:
                    continue
                home = self.homes.get((r.job, r.cluster))
                devs = [d for d in (home or range(len(self.capacity))) if d not in le.devices
                        and (r.only is None or d in r.only)
                        and avail[d] + EPS >= (self.capacity[d] if r.mem is None else r.mem)]
                if not devs:
                    continue
                load = self._compute_load(r.job)
                d = min(devs, key=lambda d: (load[d], -avail[d], d))
                key = (-r.work / len(le.devices), r.since, le.id)
                if best is None or key < best[0]:
                    best = (key, i, d)
            if best is None:
                return
            _, i, d = best
            le = rollouts[i]
            m = self.capacity[d] if le.request.mem is None else le.request.mem
            mem = {**dict(zip(le.devices, le.mem)), d: m}
            devs = tuple(sorted(mem))
            grown = dataclasses.replace(le, devices=devs, mem=tuple(mem[x] for x in devs))
            self.used[d] += m
            avail[d] -= m
            self._put_lease(grown)
            rollouts[i] = grown
            dec.grants[next(j for j, g in enumerate(dec.grants) if g.id == le.id)] = grown
            if not self.jobs[le.job][le.cluster].resident:
                self.last_used[(le.job, le.cluster)] = devs


class FifoPolicy(_Base):
    """Exclusive FIFO: a job gets whole devices for all its clusters for its life, in arrival order."""

    name = "fifo"

    def __init__(self, capacity: list[float], aging_s: float = 60.0):
        super().__init__(capacity, aging_s)
        self.queue: dict[str, None] = {}  # jobs waiting for an allotment, in arrival order (an ordered set)

    def add_job(self, job: str, clusters: dict) -> None:
        super().add_job(job, clusters)
        if sum(c.devices for c in self.jobs[job].values()) > len(self.capacity):
            del self.jobs[job]
            raise PolicyError(f"job {job!r} needs {sum(c.devices for c in parse_clusters(clusters).values())} "
                              f"devices for its clusters; the pool has {len(self.capacity)}")
        self.queue[job] = None

    def remove_job(self, job: str) -> list[Lease]:
        self.queue.pop(job, None)
        return super().remove_job(job)

    def adopt(self, lease: Lease) -> None:
        super().adopt(lease)
        if lease.phase == RESIDENT:
            self.queue.pop(lease.job, None)

    def schedule(self, now: float) -> Decision:
        dec = Decision()
        while self.queue:  # strict FIFO: the head waits for whole free devices, nobody passes it
            job = next(iter(self.queue))
            idle = [d for d in range(len(self.capacity)) if self.used[d] < EPS]
            need = sum(c.devices for c in self.jobs[job].values())
            if len(idle) < need:
                break
            del self.queue[job]
            for name in sorted(self.jobs[job]):
                devs, idle = idle[: self.jobs[job][name].devices], idle[self.jobs[job][name].devices:]
                dec.grants.append(self._grant(job, RESIDENT, name, devs, {d: self.capacity[d] for d in devs}, now))
                self._set_home((job, name), tuple(devs))
        for r in sorted(self.pending.values(), key=lambda r: self._key(r, now)):
            home = self.homes.get((r.job, r.cluster))
            if home is None:
                continue
            busy = {d for le in self.job_leases.get(r.job, {}).values() if le.phase != RESIDENT for d in le.devices}
            if busy & set(home):
                continue  # the job's own earlier phase on these devices has not ended
            self._pop_request(r.id)
            dec.grants.append(self._grant(r.job, r.phase, r.cluster, home, {d: 0.0 for d in home}, now, r))
        return dec


def make_policy(name: str, capacity: list[float], aging_s: float = 60.0) -> _Base:
    if name == "phase":
        return PhasePolicy(capacity, aging_s)
    if name == "fifo":
        return FifoPolicy(capacity, aging_s)
    raise PolicyError(f"unknown policy {name!r}; choose fifo or phase")


