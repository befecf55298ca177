"""`LeaseHolder`: one job's lease on one cluster, phase by phase. The state machine that the
GRPO job's hooks (rlcu.sched.hooks), the data-parallel job's (rlcu.sched.dp) and the TRL
integration (rlcu.sched.integrations.trl) share; each keeps only what differs (who talks to the
service, when a yield is checked).

    holder = LeaseHolder(Lessor(job), "actor", mem={"rollout": 4.0, ...})
    with holder.phase("rollout", work=n):      # gives back the lease before, asks for this one
        ...
        if holder.yield_due():                 # the service asks the rollout back
            free_what_it_holds()
            holder.yield_and_wait(work=left)   # back, and asked again with the work left

A phase's lease is asked for when the phase is entered and given back when another is entered
or the phase is left; entering the phase already held asks nothing. A phase that ends on an
exception drops its lease (`Lessor.drop`: given back, an error of the service's swallowed), so
the error raised is the one that ended the phase. Only `rollout` is preemptible: a yield gives
its lease back and asks again with the work left, keeping the request's age at the service.

Peak memory. With a meter (`CudaMeter`: the CUDA allocator's peak; tests pass a fake), each
phase's peak above what was allocated when its lease was granted is measured, and the next
request of that phase asks for the largest peak measured x HEADROOM instead of the estimate,
capped at `cap` (the job's registered peak); a phase in `declared` always asks what was declared.
"""

from __future__ import annotations

import contextlib
import time

from rlcu.sched.client import JobHandle, LeaseInfo, SchedError

GiB = float(1 << 30)
PREEMPTIBLE = "rollout"  # the one phase the service may ask back
HEADROOM = 1.1  # a measured peak's margin in the next request of its phase


class Lessor:
    """What a holder asks of the service, here through one process's JobHandle; the ranks of a
    data-parallel job use rlcu.sched.dp.RankZero (rank 0 asks, every rank hears)."""

    def __init__(self, handle: JobHandle):
        self.handle = handle

    def acquire(self, phase: str, cluster: str, **kw) -> LeaseInfo:
        return self.handle.acquire(phase, cluster, **kw)

    def release(self, lease: LeaseInfo) -> None:
        self.handle.release(lease)

    def drop(self, lease: LeaseInfo) -> None:
        """Give back the lease of a phase that ended on an error, raising nothing of the
        service's: that error is the one to see (the service reclaims what it misses)."""
        with contextlib.suppress(SchedError):
            self.handle.release(lease)

    def should_yield(self, lease: LeaseInfo) -> bool:
        return self.handle.should_yield(lease)

    @property
    def stopping(self) -> bool:
        """Whether the service asked the job to stop (a graceful cancel)."""
        return self.handle.stopping


class CudaMeter:
    """One CUDA device's allocator peak over a phase, in GiB above what was allocated at its
    start; at the end the cached blocks go back to the device (left in PyTorch's cache they
    would stay out of every other job's reach)."""

    def __init__(self, device):
        self.device, self.base = device, 0

    def start(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def stop(self) -> float:
        import torch

        peak = (torch.cuda.max_memory_allocated(self.device) - self.base) / GiB
        torch.cuda.empty_cache()
        return peak


class LeaseHolder:
    """The lease a job holds now and the moves between phases (see the module docstring).
    mem: GiB per phase (estimates); declared: phases whose request is fixed; cap: the most one
    request asks; meter: an object with start() and stop() -> GiB, or None; ask: more
    arguments of every acquire (e.g. only=); events: a list the moves are logged into as
    (clock(), kind, detail), kinds acquire, release, yield."""

    def __init__(self, lessor: Lessor, cluster: str, mem: dict | None = None, *, declared: dict | None = None,
                 cap: float | None = None, meter=None, ask: dict | None = None, events: list | None = None,
                 clock=time.time):
        self.lessor, self.cluster, self.mem = lessor, cluster, dict(mem or {})
        self.declared, self.cap, self.meter, self.ask = dict(declared or {}), cap, meter, dict(ask or {})
        self.events, self.clock = events, clock
        self.held: LeaseInfo | None = None
        self.measured: dict[str, float] = {}  # the largest peak measured per phase (GiB)
        self.yields = 0

    def request_mem(self, phase: str) -> float | None:
        """GiB to ask for `phase`: as declared, else the measured peak x HEADROOM, else the
        estimate; at most `cap`."""
        if phase in self.declared:
            return self.declared[phase]
        m = self.measured[phase] * HEADROOM if phase in self.measured else self.mem.get(phase)
        return m if m is None or self.cap is None else min(self.cap, m)

    @contextlib.contextmanager
    def phase(self, name: str, work: float | None = None):
        """The phase's lease around a block: entered, then left, or dropped on an exception."""
        self.enter(name, work)
        try:
            yield self.held
        except BaseException:
            self.drop()
            raise
        self.leave()

    def enter(self, phase: str, work: float | None = None) -> None:
        if self.held is not None and self.held.phase == phase:
            return
        self.leave()
        self.held = self.lessor.acquire(phase, self.cluster, mem=self.request_mem(phase), work=work, **self.ask)
        self._log("acquire", phase=phase, lease=self.held.id)
        if self.meter is not None:
            self.meter.start()

    def leave(self) -> None:
        if self.held is None:
            return
        lease, self.held = self.held, None
        if self.meter is not None:
            self.measured[lease.phase] = max(self.measured.get(lease.phase, 0.0), self.meter.stop())
        self.lessor.release(lease)
        self._log("release", phase=lease.phase, lease=lease.id)

    def drop(self) -> None:
        """Give the lease back after an error (`Lessor.drop`); nothing is measured."""
        lease, self.held = self.held, None
        if lease is not None:
            self.lessor.drop(lease)
            self._log("release", phase=lease.phase, lease=lease.id)

    @property
    def preemptible(self) -> bool:
        """Whether the lease held is the preemptible phase's."""
        return self.held is not None and self.held.phase == PREEMPTIBLE

    def yield_due(self) -> bool:
        """Whether the service asks the preemptible lease back now."""
        return self.preemptible and self.lessor.should_yield(self.held)

    def yield_and_wait(self, work: float) -> None:
        """Give the preemptible lease back and ask again with `work` left (the request keeps
        its age); returns once granted."""
        self.yields += 1
        self._log("yield", lease=self.held.id if self.held is not None else None, work=work)
        self.leave()
        self.enter(PREEMPTIBLE, work=work)

    def _log(self, kind: str, **detail) -> None:
        if self.events is not None:
            self.events.append((self.clock(), kind, detail))
