"""The service's cost per job does not grow with the number of live jobs: building 10,000
took 418 s, growing with the square of their number (the audit, the policy's placement and
the job views scanned every lease, request and job after every change). Measured without a
clock: the Python calls made (a profile hook counts them) by 100 jobs' operations while the
first 100 jobs are built and while the 600th to 700th are; constant work per operation keeps
the two alike (1.0x), work that grows with the live jobs does not (10x before the fix)."""

import sys

from support.sched_util import ok

from rlcu.sched.core import Core

RES = {"c": {"devices": 1, "resident": 0.01, "peak": 0.05}, "f": {"devices": 1, "peak": 0.05}}


def calls(fn) -> int:
    n = [0]

    def count(frame, event, arg):
        n[0] += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def build(core, lo: int, hi: int) -> None:
    """Jobs lo..hi-1: register, init (places the resident cluster), a rollout held on the
    floating cluster, an actor_train phase taken and given back."""
    for i in range(lo, hi):
        ok(core, op="register", job=f"j{i}", clusters=RES)
        ok(core, op="request", job=f"j{i}", phase="init", cluster="c", mem=0.01)
        ok(core, op="request", job=f"j{i}", phase="rollout", cluster="f", mem=0.01, devices=1)
        v = ok(core, op="request", job=f"j{i}", phase="actor_train", cluster="c", mem=0.01)
        ok(core, op="release", job=f"j{i}", lease=next(le["id"] for le in v["leases"] if le["phase"] == "actor_train"))
        ok(core, op="heartbeat", job=f"j{i}")


def test_the_cost_of_a_job_does_not_grow_with_the_live_jobs(tmp_path):
    core = Core([80.0] * 8, state=tmp_path / "s.db", heartbeat_timeout=1e9)
    early = calls(lambda: build(core, 0, 100))
    build(core, 100, 600)
    late = calls(lambda: build(core, 600, 700))
    assert len(core.pol.leases) == 3 * 700 and not core.pol.pending
    assert late < 2.0 * early, f"{late / early:.1f}x the calls per job with 700 live jobs as with 100"
    core.close()
