"""The audit of the scheduler's books, run after every change to the state (core.py); a
violation raises `InvariantError` (never an `assert`, which `python -O` removes) and the
service stops rather than serve a wrong state.

What holds: no device or its memory is booked twice; every lease is on devices of the pool,
of a known job, with memory >= 0; no job holds a phase twice, or awaits a phase it holds;
every home has its resident lease and the other way round; a yield is asked only of a held
rollout; ids stay below the next one; the per-job indexes and the policy's running
aggregates agree with the books; and, for the core, every held lease has its open span of a
live job, every pending request its ask time, and the metrics tally's memory per device is
the books'.

Cost. `check_invariants` (and `check_core`) walk everything. `Audit.check` looks only at what
changed since the last audit (the keys the books' `Journal`s noted) plus O(devices), against
a shadow of the books it keeps itself (its own sums per device, phase keys, homes), and walks
everything once the changes since the last full audit add up to half the books' size
(amortised O(1) a change), after every reload, and when a journal overflowed.
"""

from __future__ import annotations

import collections
import math

from rlcu.sched.pool import RESIDENT, InvariantError, Lease, Request, _Base
from rlcu.sched.views import LIVE

TOL = 1e-6


def _need(ok: bool, why) -> None:
    if not ok:
        raise InvariantError(why() if callable(why) else why)


def _lease_key(le: Lease) -> tuple[str, str, str]:
    return (le.job, le.phase, le.cluster if le.phase == RESIDENT else "")


def _check_lease(p: _Base, le: Lease, nxt: int) -> None:
    n, devs = len(p.capacity), le.devices
    _need(le.job in p.jobs, lambda: f"lease {le.id} of unknown job {le.job!r}")
    _need(len(set(devs)) == len(devs) == len(le.mem), lambda: f"lease {le.id} repeats a device: {devs}")
    _need(le.id < nxt, lambda: f"lease {le.id} at or past the next id {nxt}")
    for d, m in zip(devs, le.mem):
        _need(isinstance(d, int) and 0 <= d < n and m >= 0 and math.isfinite(m),
              lambda: f"lease {le.id}: device {d} outside the pool of {n}, or memory {m} < 0")


def _check_request(p: _Base, r: Request, nxt: int) -> None:
    _need(r.job in p.jobs, lambda: f"request {r.id} of unknown job {r.job!r}")
    _need(r.id < nxt, lambda: f"request {r.id} at or past the next id {nxt}")


def check_invariants(p: _Base) -> None:
    """Raise InvariantError when the pool's books do not balance (see the module docstring).
    One pass over the leases, the requests and the homes."""
    n, nxt, homes = len(p.capacity), p._next, p.homes
    used = [0.0] * n
    seen: set = set()
    job_leases: dict = {}
    for le in p.leases.values():
        _check_lease(p, le, nxt)
        key = _lease_key(le)
        _need(key not in seen, lambda: f"job {le.job!r} holds phase {le.phase!r} twice")
        seen.add(key)
        if le.phase == RESIDENT:
            _need(homes.get((le.job, le.cluster)) == le.devices,
                  lambda: f"resident lease {le.id} is on {le.devices}, its cluster's home is "
                          f"{homes.get((le.job, le.cluster))}")
        for d, m in zip(le.devices, le.mem):
            used[d] += m
        job_leases.setdefault(le.job, {})[le.id] = le
    for d, (u, cap, book) in enumerate(zip(used, p.capacity, p.used)):
        _need(u <= cap + TOL, lambda: f"device {d} memory double-booked: {u:g} > {cap:g}")
        _need(abs(u - book) <= TOL, lambda: f"device {d}: books say {book:g} used, leases sum to {u:g}")
    job_pending: dict = {}
    for r in p.pending.values():
        _check_request(p, r, nxt)
        _need((r.job, r.phase, "") not in seen, lambda: f"job {r.job!r} awaits phase {r.phase!r} it already holds")
        job_pending.setdefault(r.job, {})[r.id] = r
    for lid in p.yielding:
        _need(lid in p.leases and p.leases[lid].phase == "rollout", f"yield asked of lease {lid}, not a held rollout")
    for job, cluster in homes:
        _need((job, RESIDENT, cluster) in seen, f"cluster {cluster!r} of job {job!r} has a home but no resident lease")
    _need(job_leases == p.job_leases, "the per-job index of leases differs from the leases")
    _need(job_pending == p.job_pending, "the per-job index of pending requests differs from the requests")
    agg = getattr(p, "agg", None)
    if agg is not None:
        _check_aggregates(p, agg)


def _check_aggregates(p, agg) -> None:
    """The policy's running aggregates (load.py) against a set rebuilt from the books."""
    fresh = type(agg)(len(p.capacity))
    for key, devs in p.homes.items():
        fresh.home_in(key[0], devs, p._needs(key[0]))
    for le in p.leases.values():
        c = p.jobs[le.job].get(le.cluster) if le.phase == RESIDENT else None
        fresh.lease_in(le, c.peak if c is not None else 0.0)
    n = len(p.capacity)
    _need(all(abs(a - b) <= TOL for a, b in zip(fresh.res, agg.res)) and
          [fresh.peak(d) for d in range(n)] == [agg.peak(d) for d in range(n)],
          lambda: f"the resident memory per device kept for placement ({agg.res}) is not the leases' ({fresh.res})")
    _need(fresh.base == agg.base and fresh.homed == agg.homed and fresh.trans == agg.trans,
          lambda: f"the compute load per device kept for placement ({agg.base}) is not the books' ({fresh.base})")
    _need([set(r) for r in fresh.rollouts] == [set(r) for r in agg.rollouts],
          "the rollouts per device kept for yields are not the leases'")
    _need(fresh.placed == agg.placed and fresh.needs == agg.needs,
          "the placed jobs' floating needs kept for placement are not the books'")


def check_core(core) -> None:
    """The core agrees with the policy (everything): held leases and open spans match and
    belong to live jobs, pending requests have their ask time, the tally's memory per device
    is the books'."""
    p, held, jobs = core.pol, core.held, core.jobs
    _need(len(held) == len(p.leases), lambda: f"{len(held)} held spans, {len(p.leases)} leases in the policy's books")
    for lid, le in p.leases.items():
        _check_span(core, lid, le)
    _need(len(core.asked) == len(p.pending) and all(r in core.asked for r in p.pending),
          "pending requests and their ask times differ")
    for name in p.jobs:
        _need(name in jobs and jobs[name].state in LIVE, lambda: f"job {name!r} is in the books but not live")
    _check_tally(core)


def _check_span(core, lid: int, le: Lease) -> None:
    s = core.held.get(lid)
    _need(s is not None and s.end is None and s.devices == le.devices and s.mem == le.mem and s.job == le.job,
          lambda: f"lease {lid}: span {s} does not match the policy's {le}")
    j = core.jobs.get(le.job)
    _need(j is not None and j.state in LIVE, lambda: f"lease {lid} held by job {le.job!r}, which is not live")


def _check_tally(core) -> None:
    for d, (a, b) in enumerate(zip(core.tally.used, core.pol.used)):
        _need(abs(a - b) <= TOL, lambda: f"device {d}: the metrics tally has {a:g} in use, the books {b:g}")


class Audit:
    """The core's audit after each change (see the module docstring). The jobs whose state
    the core changed are those whose view it bumped (`core.versions`, a Journal)."""

    FULL_EVERY = 2  # a full audit once changes * FULL_EVERY >= the books' size

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Walk everything at the next check (a reload: new books)."""
        self.full_due, self.changes = True, 0

    def check(self, core) -> None:
        p = core.pol
        taken = [p.leases.take(), p.pending.take(), p.homes.take(), p.yielding.take(), p.jobs.take(),
                 core.versions.take()]
        size = len(p.leases) + len(p.pending) + len(p.jobs) + len(p.homes)
        if any(t is None for t in taken):
            self.full_due = True
        else:
            self.changes += sum(map(len, taken))
        if self.full_due or self.changes * self.FULL_EVERY >= size:
            check_invariants(p)
            check_core(core)
            self._shadow(p)
            return
        tl, tr, th, ty, tj, jobs_touched = taken
        held_keys = self._leases(core, tl)  # (every change applied to the shadow first: then the checks
        pend_keys = self._requests(core, tr)  # across leases and requests see the books as they are now)
        for key in held_keys:
            _need(self.held_keys[key] <= 1, lambda: f"job {key[0]!r} holds phase {key[1]!r} twice")
        for job, phase in pend_keys | {k[:2] for k in held_keys if not k[2]}:
            _need(not (self.held_keys[(job, phase, "")] and self.pend_keys[(job, phase)]),
                  lambda: f"job {job!r} awaits phase {phase!r} it already holds")
        for key in th | self._homes_touched:
            _need(p.homes.get(key) == self.resident.get(key),
                  lambda: f"cluster {key[1]!r} of job {key[0]!r}: home {p.homes.get(key)}, resident lease on "
                          f"{self.resident.get(key)}")
        for lid in ty | tl:
            _need(lid not in p.yielding or (lid in p.leases and p.leases[lid].phase == "rollout"),
                  f"yield asked of lease {lid}, not a held rollout")
        for name in tj | jobs_touched | self._jobs_of_changes:
            live = name in core.jobs and core.jobs[name].state in LIVE
            _need(name in p.jobs or self.refs[name] == 0, f"job {name!r} left the books with leases or requests")
            _need(live == (name in p.jobs), lambda: f"job {name!r} is {'' if live else 'not '}live, "
                                                    f"{'' if name in p.jobs else 'not '}in the books")
        _need(p._next >= self.next_id, lambda: f"the next id went back from {self.next_id} to {p._next}")
        self.next_id = p._next
        for d, (u, cap, book) in enumerate(zip(self.used, p.capacity, p.used)):
            _need(u <= cap + TOL, lambda: f"device {d} memory double-booked: {u:g} > {cap:g}")
            _need(abs(u - book) <= TOL, lambda: f"device {d}: books say {book:g} used, leases sum to {u:g}")
        _need(len(core.held) == len(p.leases), lambda: f"{len(core.held)} held spans, {len(p.leases)} leases in the "
                                                       "policy's books")
        _need(len(core.asked) == len(p.pending), "pending requests and their ask times differ")
        _check_tally(core)

    # ------------------------------------------------------------------ the shadow of the books
    def _shadow(self, p: _Base) -> None:
        """The audit's own record of the books, as of a full audit."""
        self.full_due, self.changes, self.next_id = False, 0, p._next
        self.lease_rec: dict[int, Lease] = dict(p.leases)
        self.req_rec: dict[int, Request] = dict(p.pending)
        self.used = [0.0] * len(p.capacity)
        self.held_keys: collections.Counter = collections.Counter()
        self.pend_keys: collections.Counter = collections.Counter()
        self.refs: collections.Counter = collections.Counter()  # job -> its leases and requests
        self.resident: dict[tuple[str, str], tuple[int, ...]] = {}
        for le in self.lease_rec.values():
            self._count(le, 1)
        for r in self.req_rec.values():
            self.pend_keys[(r.job, r.phase)] += 1
            self.refs[r.job] += 1
        self._homes_touched: set = set()
        self._jobs_of_changes: set = set()

    def _count(self, le: Lease, sign: int) -> None:
        for d, m in zip(le.devices, le.mem):
            self.used[d] += sign * m
        self.held_keys[_lease_key(le)] += sign
        self.refs[le.job] += sign
        if le.phase == RESIDENT:
            key = (le.job, le.cluster)
            if sign > 0:
                self.resident[key] = le.devices
            elif self.resident.get(key) == le.devices:
                del self.resident[key]

    def _leases(self, core, touched: set) -> set:
        """Apply the touched leases to the shadow, each checked; their phase keys."""
        p, nxt = core.pol, core.pol._next
        self._homes_touched, self._jobs_of_changes = set(), set()
        keys = set()
        for lid in touched:
            old, new = self.lease_rec.pop(lid, None), p.leases.get(lid)
            for le, sign in ((old, -1), (new, 1)):
                if le is None:
                    continue
                if sign > 0:
                    _check_lease(p, le, nxt)
                    self.lease_rec[lid] = le
                    _check_span(core, lid, le)
                    _need(p.job_leases.get(le.job, {}).get(lid) is le, f"lease {lid} is not in its job's index")
                elif new is None or new.job != old.job:
                    _need(lid not in p.job_leases.get(old.job, {}), f"lease {lid}, gone, is in its job's index")
                self._count(le, sign)
                keys.add(_lease_key(le))
                self._jobs_of_changes.add(le.job)
                if le.phase == RESIDENT:
                    self._homes_touched.add((le.job, le.cluster))
            if new is None:
                _need(lid not in core.held, lambda: f"span {lid} is held, but the policy holds no lease {lid}")
        return keys

    def _requests(self, core, touched: set) -> set:
        """Apply the touched requests to the shadow, each checked; their (job, phase)."""
        p, nxt, keys = core.pol, core.pol._next, set()
        for rid in touched:
            old, new = self.req_rec.pop(rid, None), p.pending.get(rid)
            if old is not None:
                self.pend_keys[(old.job, old.phase)] -= 1
                keys.add((old.job, old.phase))
                self.refs[old.job] -= 1
                self._jobs_of_changes.add(old.job)
                if new is None or new.job != old.job:
                    _need(rid not in p.job_pending.get(old.job, {}), f"request {rid}, gone, is in its job's index")
            if new is not None:
                _check_request(p, new, nxt)
                self.req_rec[rid] = new
                self.pend_keys[(new.job, new.phase)] += 1
                keys.add((new.job, new.phase))
                self.refs[new.job] += 1
                self._jobs_of_changes.add(new.job)
                _need(p.job_pending.get(new.job, {}).get(rid) is new, f"request {rid} is not in its job's index")
            _need((rid in p.pending) == (rid in core.asked), lambda: f"request {rid}: pending and its ask time differ")
        return keys
