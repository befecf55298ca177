"""`JobHooks`: the trainer's phase hooks (rlcu.train.core.Hooks) on a scheduler lease. Each
phase the trainer enters gives back the lease of the one before and asks for its own with the
memory it needs; the rollout is preemptible: the engine asks `yield_check` between two steps
and, on a yield, `on_yield` gives the lease back and waits for the re-grant. The lease moves are
a `LeaseHolder`'s (rlcu.sched.lease); the data-parallel job's hooks (rlcu.sched.dp) extend these
with the ranks' collective ticks.
"""

from __future__ import annotations

from rlcu.sched.client import STOP_REASON, JobHandle
from rlcu.sched.lease import LeaseHolder, Lessor
from rlcu.train.core import Hooks

CLUSTER = "actor"  # the job's one cluster: its weights and optimizer state stay resident there


class JobHooks(Hooks):
    """`sched`: the job's JobHandle; `mem`: GiB per phase (and `resident`) on its device;
    `lessor`: who asks the service (default: `sched` itself, rlcu.sched.lease.Lessor)."""

    preemptible = True

    def __init__(self, sched: JobHandle | None, cluster: str = CLUSTER, mem: dict | None = None, *,
                 lessor: Lessor | None = None):
        self.sched = sched
        self.lease = LeaseHolder(lessor if lessor is not None else Lessor(sched), cluster, mem)
        self.mem = self.lease.mem  # (the holder's own dict)
        self.engine_steps = 0
        self.on_engine_step = None  # called with the step count at each yield check (tests)

    @property
    def yields(self) -> int:
        return self.lease.yields

    def phase(self, name: str, work: float | None = None, **info):
        return self.lease.phase(name, work)

    def _count_step(self) -> None:
        self.engine_steps += 1
        if self.on_engine_step is not None:
            self.on_engine_step(self.engine_steps)

    def yield_check(self) -> bool:
        self._count_step()
        return self.lease.yield_due()

    def on_yield(self, tokens_left: int) -> None:
        self.lease.yield_and_wait(float(tokens_left))

    def metrics(self) -> dict:
        return {"sched/yields": self.yields}

    def stop_reason(self) -> str | None:
        return STOP_REASON if self.lease.lessor.stopping else None
