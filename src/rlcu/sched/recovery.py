"""Loading the scheduler's state from its database, mixed into `Core`: at the start (a
recovery: the leases of jobs that ended while the service was down are reclaimed, every live
job gets a heartbeat's grace, the saved metrics tally is checked against the leases, the
metrics clock goes on from where it stopped) and after a failed operation (the state in
memory put back as the database has it). Rows are checked as they are read (rows.py)."""

from __future__ import annotations

import collections
import sys

from rlcu.sched import metrics as mx
from rlcu.sched.policy import make_policy
from rlcu.sched.pool import RESIDENT, Lease
from rlcu.sched.store import Job
from rlcu.sched.views import LIVE


class Recovery:
    """Mixed into `Core` (which owns what these set: pool, pol, jobs, held, ended, yield_at,
    yields, asked, tally and the metrics clock)."""

    def _init_pool(self, capacity, state, policy, aging_s, device_names) -> None:
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
                    "aging_s": float(aging_s), "t0": self.clock()}
            make_policy(policy, pool["capacity"], pool["aging_s"])  # refuses a bad pool before anything is saved
            self.store.set_meta("pool", pool)
        self.pool = pool
        self.store.rows.n_devices = len(pool["capacity"])  # lease rows naming another device are refused

    # ------------------------------------------------------------------ loading (start, and after a failed op)
    def _load(self, recovering: bool = False, tally: mx.Tally | None = None) -> None:
        """The state in memory from the database. recovering (at start): leases of jobs no
        longer live are reclaimed, and every live job gets a heartbeat's grace. tally: the
        metrics tally as it was before a failed operation (the database's is the last
        commit's, which the operations kept since then have moved on)."""
        now, seen = self.clock(), self.mono()
        old = getattr(self, "jobs", {})
        self.pol = make_policy(self.pool["policy"], self.pool["capacity"], self.pool["aging_s"])
        self._auditor.reset()  # new books: the next audit walks them all
        self.jobs: dict[str, Job] = {}
        self.held: dict[int, mx.Span] = {}
        self.ended: collections.OrderedDict[int, mx.Span] = collections.OrderedDict()
        self.yield_at: dict[int, float] = {}  # held lease -> when it was asked to yield
        self.yields: collections.deque = collections.deque(maxlen=max(self.keep_spans, 1))  # (t, lease, job)
        self.asked: dict[int, float] = {}  # pending request id -> when asked
        self.history_count = self.store.history_rows()  # ended leases in the database
        for j in self.store.jobs():
            self.jobs[j.name] = j
            j.last_seen = old[j.name].last_seen if j.name in old and not recovering else seen
            if j.state in LIVE:
                self.pol.add_job(j.name, j.clusters)
        live = self.store.get_meta("live") or {}  # what the last commit saved beside the rows
        t = live.get("tally") if tally is None else None
        try:
            self.tally = tally if tally is not None else mx.Tally.from_dict(t) if t is not None else \
                self._tally_from_history()
        except (TypeError, ValueError) as e:
            raise self.store.rows.bad("meta", "key='live'", "value.tally", f"not a metrics tally ({e})") from None
        if recovering:  # the metrics clock goes on from the saved tally's time (see mtime)
            self._m0, self._mbase = seen, max(self.tally.t, live.get("mtime") or 0.0, now)
        mnow = self.mtime()
        for j in self.jobs.values():  # (a restart: its age so far on the wall clock)
            j.born = old[j.name].born if j.name in old and not recovering else mnow - max(0.0, now - j.submitted)
        for s, _req, y in self.store.recent_leases(self.keep_spans):
            self.ended[s.id] = s
            if y is not None:
                self.yields.append((y, s.id, s.job))
        held, reqs = [], []
        for s, req, y in self.store.held_leases():
            if self.jobs.get(s.job) is not None and self.jobs[s.job].state in LIVE:
                self.held[s.id] = s
                held.append(Lease(s.id, s.job, s.phase, s.cluster, s.devices, s.mem, s.start, req))
                if y is not None:
                    self.yield_at[s.id] = y
                    self.yields.append((y, s.id, s.job))
            else:  # its job ended while the service was down (or the row outlived it)
                s.end, s.reason = now, "reclaimed"
                self.tally.remove(s, mnow)
                self.store.end_lease(s)
                self.remember(s)
        for r, asked in self.store.requests():
            if self.jobs.get(r.job) is not None and self.jobs[r.job].state in LIVE:
                reqs.append(r)
                self.asked[r.id] = asked
            else:
                self.store.drop_request(r.id)
        self.pol.restore(held, reqs, dict(self.yield_at), max(self.store.top_id() + 1,
                                                              live.get("next_id", 1)))
        for name in self.jobs:
            self.bump(name)

    def mtime(self) -> float:
        """The metrics clock: the monotonic clock, going on across restarts from the saved
        tally's last time (or the wall clock at the start, if later). Metrics (the tally's
        integrals, uptime, jobs per hour, latencies) run on it, so a wall clock stepped back
        counts no time; the wall clock stays for what is shown (lease and job times)."""
        return self._mbase + (self.mono() - self._m0)

    def _reconcile_tally(self) -> None:
        """The tally's present (memory and phase leases per device) from the held leases, when
        the saved one disagrees: the leases are the books, the tally is derived from them (a
        state saved by an older version after a failed commit had a tally ahead of its rows).
        Its integrals, the past, stay."""
        n = len(self.pool["capacity"])
        used, busy = [0.0] * n, [0] * n
        for s in self.held.values():
            for d, m in zip(s.devices, s.mem):
                used[d] += m
                busy[d] += s.phase != RESIDENT
        t = self.tally
        if len(t.used) == n and t.busy_n == busy and all(abs(a - b) <= 1e-6 for a, b in zip(t.used, used)):
            return
        print(f"rlcu sched: the saved metrics tally had {[round(u, 6) for u in t.used]} in use, the leases "
              f"{[round(u, 6) for u in used]}: taken from the leases", file=sys.stderr, flush=True)
        t.capacity, t.used, t.busy_n = list(self.pool["capacity"]), used, busy
        t.peak = (t.peak + [0.0] * n)[:n]

    def _tally_from_history(self) -> mx.Tally:
        """A tally from the lease rows (a database written before the tally was kept)."""
        t0 = min((j.submitted for j in self.jobs.values()), default=self.pool["t0"])
        tally = mx.Tally(list(self.pool["capacity"]), t0)
        ev = []
        for s, _r, y in self.store.leases():
            a = max(s.start, t0)
            if s.end is None or s.end > a:
                ev.append((a, 1, s))
                if s.end is not None:
                    ev.append((s.end, 0, s))
            tally.yields += y is not None
        for t, kind, s in sorted(ev, key=lambda e: (e[0], e[1], e[2].id)):
            (tally.add if kind else tally.remove)(s, t)
        for j in self.jobs.values():
            if j.state == "done" and j.finished is not None:
                tally.job_done(j.submitted, j.finished)
        return tally
