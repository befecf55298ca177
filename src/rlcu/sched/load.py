"""The phase policy's running per-device aggregates, kept as leases and homes come and go, so
that planning a request costs O(devices) instead of a scan of every lease and job in the pool
(which made building 10,000 live jobs quadratic):

    res[d], peak(d)   resident memory on device d, and the largest declared peak of the
                      clusters resident there (placement keeps room for any one phase)
    load(job)[d]      the compute on d of jobs other than `job`: one per job homed there, plus
                      each transient phase of a job not homed there (rollout 0.5, others 1)
    rollouts[d]       the rollout leases on d (those a blocked phase may ask to yield)
    needs             (peak, devices) of the floating clusters of every placed job

Compute weights are multiples of 0.5, so `base` and `trans` are exact; `res` is a float sum,
reset to 0 when its device holds no resident lease. audit.py rebuilds all of it from the
books and compares (the full audit).
"""

from __future__ import annotations

import collections

from rlcu.sched.pool import RESIDENT, Lease

COMPUTE_WEIGHT = {"rollout": 0.5}  # a phase's share of a device's compute in placement (others: 1)


class DeviceLoad:
    def __init__(self, n: int):
        self.res = [0.0] * n
        self._n_res = [0] * n  # resident leases per device
        self._peaks = [collections.Counter() for _ in range(n)]  # peak -> resident leases declaring it
        self._pmax: list[float | None] = [0.0] * n  # the largest of them (None: to be found again)
        self._res_peak: dict[int, float] = {}  # resident lease -> the peak it counted
        self.homed = [collections.Counter() for _ in range(n)]  # job -> its clusters homed on the device
        self.trans: list[dict[str, float]] = [{} for _ in range(n)]  # job -> its transient leases' weight there
        self.base = [0.0] * n  # load(job) for a job neither homed nor running there
        self.rollouts: list[dict[int, Lease]] = [{} for _ in range(n)]
        self.placed: collections.Counter = collections.Counter()  # job -> its homes
        self.needs: collections.Counter = collections.Counter()  # (peak, devices) -> floating clusters

    # ------------------------------------------------------------------ leases
    def lease_in(self, le: Lease, peak: float) -> None:
        """A lease was added; peak: the declared peak of its cluster (resident leases)."""
        if le.phase == RESIDENT:
            self._res_peak[le.id] = peak
            for d, m in zip(le.devices, le.mem):
                self.res[d] += m
                self._n_res[d] += 1
                self._peaks[d][peak] += 1
                if self._pmax[d] is not None and peak > self._pmax[d]:
                    self._pmax[d] = peak
            return
        w = COMPUTE_WEIGHT.get(le.phase, 1.0)
        for d in le.devices:
            self.trans[d][le.job] = self.trans[d].get(le.job, 0.0) + w
            if le.job not in self.homed[d]:
                self.base[d] += w
            if le.phase == "rollout":
                self.rollouts[d][le.id] = le

    def lease_out(self, le: Lease) -> None:
        if le.phase == RESIDENT:
            peak = self._res_peak.pop(le.id)
            for d, m in zip(le.devices, le.mem):
                self._n_res[d] -= 1
                self.res[d] = self.res[d] - m if self._n_res[d] else 0.0
                c = self._peaks[d]
                c[peak] -= 1
                if not c[peak]:
                    del c[peak]
                    if peak == self._pmax[d]:
                        self._pmax[d] = None
            return
        w = COMPUTE_WEIGHT.get(le.phase, 1.0)
        for d in le.devices:
            left = self.trans[d][le.job] - w
            if left > 0:
                self.trans[d][le.job] = left
            else:
                del self.trans[d][le.job]
            if le.job not in self.homed[d]:
                self.base[d] -= w
            self.rollouts[d].pop(le.id, None)

    # ------------------------------------------------------------------ homes
    def home_in(self, job: str, devices, needs: list[tuple[float, int]]) -> None:
        """A cluster of `job` was homed on `devices`; needs: the job's floating (peak, devices)."""
        if not self.placed[job]:
            self.needs.update(needs)
        self.placed[job] += 1
        for d in devices:
            if not self.homed[d][job]:  # the job's transient phases there no longer count
                self.base[d] += 1.0 - self.trans[d].get(job, 0.0)
            self.homed[d][job] += 1

    def home_out(self, job: str, devices, needs: list[tuple[float, int]]) -> None:
        for d in devices:
            self.homed[d][job] -= 1
            if not self.homed[d][job]:
                del self.homed[d][job]
                self.base[d] += self.trans[d].get(job, 0.0) - 1.0
        self.placed[job] -= 1
        if not self.placed[job]:
            del self.placed[job]
            self.needs.subtract(needs)
            for k in [k for k in needs if self.needs[k] <= 0]:
                del self.needs[k]

    # ------------------------------------------------------------------ reads
    def peak(self, d: int) -> float:
        if self._pmax[d] is None:
            self._pmax[d] = max(self._peaks[d], default=0.0)
        return self._pmax[d]

    def tally(self) -> tuple[list[float], list[float]]:
        """Per device: resident memory held, and the largest peak of the clusters placed there."""
        return list(self.res), [self.peak(d) for d in range(len(self.res))]

    def load(self, job: str) -> list[float]:
        """Per device, the compute load of jobs other than `job` (see the module docstring)."""
        return [b - (1.0 if job in self.homed[d] else self.trans[d].get(job, 0.0)) for d, b in enumerate(self.base)]
