"""The lease holder's state machine (rlcu.sched.lease), with a fake service, a fake clock and a
fake memory meter: the order of enter / leave / yield, a lease dropped on an exception, and the
peak measured per phase becoming the next request of that phase. And the GRPO job's hooks on it."""

import itertools

import pytest

from rlcu.sched.client import LeaseInfo, SchedError
from rlcu.sched.hooks import JobHooks
from rlcu.sched.lease import HEADROOM, LeaseHolder, Lessor


class FakeHandle:
    """A JobHandle stand-in that grants at once and logs what it is asked."""

    def __init__(self):
        self.log, self.ids = [], itertools.count(1)
        self.yield_now = self.stopping = self.fail_release = False

    def acquire(self, phase, cluster=None, **kw):
        self.log.append(("acquire", phase, kw.get("mem"), kw.get("work")))
        return LeaseInfo(next(self.ids), phase, cluster, (0,), ("cpu0",), (kw.get("mem") or 0.0,), 0.0)

    def release(self, lease):
        self.log.append(("release", lease.phase))
        if self.fail_release:
            raise SchedError("the service is away", "unavailable")

    def should_yield(self, lease=None):
        return self.yield_now


class FakeMeter:
    """Peaks (GiB) handed out in order, one per phase measured."""

    def __init__(self, peaks):
        self.peaks, self.started = list(peaks), 0

    def start(self):
        self.started += 1

    def stop(self):
        return self.peaks.pop(0)


def holder(h, **kw):
    return LeaseHolder(Lessor(h), "actor", kw.pop("mem", {"rollout": 2.0, "actor_train": 3.0}),
                       clock=itertools.count(100).__next__, **kw)


def test_phases_enter_leave_and_yield_in_order():
    h = FakeHandle()
    events = []
    lh = holder(h, events=events)
    with lh.phase("rollout", work=50.0) as lease:
        assert lease is lh.held and lease.phase == "rollout"
        assert not lh.yield_due()  # not asked
        h.yield_now = True
        assert lh.yield_due()
        lh.yield_and_wait(20.0)
        lh.enter("rollout")  # the phase held: nothing asked
    assert lh.held is None and lh.yields == 1
    lh.enter("actor_train")
    assert not lh.yield_due()  # only the rollout is preemptible
    lh.enter("rollout")  # gives back the lease of the phase before first
    lh.leave()
    lh.leave()  # nothing held: nothing given back
    assert h.log == [("acquire", "rollout", 2.0, 50.0), ("release", "rollout"), ("acquire", "rollout", 2.0, 20.0),
                     ("release", "rollout"), ("acquire", "actor_train", 3.0, None), ("release", "actor_train"),
                     ("acquire", "rollout", 2.0, None), ("release", "rollout")]
    assert [(t, k) for t, k, _ in events[:5]] == [(100, "acquire"), (101, "yield"), (102, "release"),
                                                   (103, "acquire"), (104, "release")]
    assert events[1][2] == {"lease": 1, "work": 20.0}


def test_a_phase_that_raises_drops_its_lease_and_raises_its_own_error():
    h = FakeHandle()
    lh = holder(h)
    with pytest.raises(KeyError, match="boom"):
        with lh.phase("actor_train"):
            h.fail_release = True  # the service is away too: the phase's own error is the one raised
            raise KeyError("boom")
    assert lh.held is None and h.log == [("acquire", "actor_train", 3.0, None), ("release", "actor_train")]
    h.fail_release = False
    with pytest.raises(ValueError):
        with lh.phase("rollout"):
            raise ValueError
    assert lh.held is None and h.log[-1] == ("release", "rollout")


def test_the_peak_measured_per_phase_is_the_next_request():
    h = FakeHandle()
    meter = FakeMeter([1.0, 5.0, 0.5, 4.0, 9.0])
    lh = holder(h, mem={"rollout": 2.0, "actor_train": 3.0, "init": 8.0}, declared={"init": 8.0}, cap=5.0,
                meter=meter)
    for phase in ("rollout", "actor_train", "rollout", "actor_train", "init"):
        with lh.phase(phase):
            pass
    assert lh.measured == {"rollout": 1.0, "actor_train": 5.0, "init": 9.0}  # the largest peak of each phase
    asked = [e[1:3] for e in h.log if e[0] == "acquire"]
    assert asked == [("rollout", 2.0), ("actor_train", 3.0),  # the estimates first
                     ("rollout", pytest.approx(1.0 * HEADROOM)),  # then what was measured, with headroom
                     ("actor_train", 5.0),  # capped at the job's peak (5.0 x 1.1 > 5)
                     ("init", 8.0)]  # a declared phase asks what was declared
    assert lh.request_mem("init") == 8.0 and lh.request_mem("ref_logprobs") is None
    assert meter.started == 5
    # an error measures nothing
    with pytest.raises(RuntimeError):
        with lh.phase("rollout"):
            raise RuntimeError
    assert lh.measured["rollout"] == 1.0 and meter.peaks == []


def test_job_hooks_yield_through_the_holder():
    h = FakeHandle()
    hooks = JobHooks(h, mem={"rollout": 2.0})
    steps = []
    hooks.on_engine_step = steps.append
    assert not hooks.yield_check()  # no lease held
    with hooks.phase("rollout", work=10.0, tokens=10):
        assert not hooks.yield_check()
        h.yield_now = True
        assert hooks.yield_check()
        hooks.on_yield(4)  # as the engine calls it, asleep
        hooks.on_generate_done()  # one process: nothing to wait for
    assert steps == [1, 2, 3] and hooks.engine_steps == 3
    assert hooks.metrics() == {"sched/yields": 1} and hooks.lease.held is None
    assert h.log[1:3] == [("release", "rollout"), ("acquire", "rollout", 2.0, 4.0)]
    assert hooks.stop_reason() is None
    h.stopping = True
    assert "cancelled" in hooks.stop_reason()
