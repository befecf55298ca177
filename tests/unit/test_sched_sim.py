"""The simulator's bounds (issue 13, item 7: a bool is not a count, `steps: 6e6` is refused with
the field named, a trace's total phases are bounded), its contention model (item 8: co-located
rollouts slow each other down), and placement by compute load as well as memory."""

import pytest

from rlcu.sched.policy import RESIDENT, PhasePolicy
from rlcu.sched.simulator import TraceError, load_trace, simulate


def trace(**over):
    t = {"devices": {"count": 1, "mem": 80},
         "jobs": [{"name": "a", "steps": 1, "clusters": {"c": 1}, "step": [{"phase": "rollout", "seconds": 14,
                                                                          "mem": 30}]}]}
    t.update(over)
    return t


def job(name, **over):
    j = {"name": name, "steps": 1, "clusters": {"c": 1}, "step": [{"phase": "rollout", "seconds": 14, "mem": 30}]}
    j.update(over)
    return j


@pytest.mark.parametrize("bad,msg", [
    ({"devices": {"count": True}}, "devices.count must be an integer"),
    ({"devices": True}, "devices must be"),
    ({"devices": 2.0}, "devices must be an integer"),
    ({"devices": 10**9}, "devices must be an integer in"),
    ({"jobs": [job("a", steps=6e6)]}, r"jobs\[0\].steps must be an integer in \[1, 1,000,000\], got 6000000.0"),
    ({"jobs": [job("a", steps=2.5)]}, r"jobs\[0\].steps must be an integer"),
    ({"jobs": [job("a", steps=True)]}, r"jobs\[0\].steps must be an integer"),
    ({"jobs": [job("a", steps=600_000), job("b", steps=600_000)]}, r"jobs\[1\].steps: .* 1,200,000 phases"),
    ({"jobs": [job("a", step=[{"phase": "rollout", "seconds": 1, "bw": -1}])]}, r"jobs\[0\].step\[0\].bw"),
])
def test_counts_and_sizes_are_checked(bad, msg):
    with pytest.raises(TraceError, match=msg):
        load_trace(trace(**bad))


def test_the_phase_bound_is_a_parameter():
    t = trace(jobs=[job("a", steps=50), job("b", steps=50)])
    with pytest.raises(TraceError, match="at most 60 "):
        load_trace(t, max_phases=60)
    with pytest.raises(TraceError, match="steps must be an integer in \\[1, 10\\]"):
        load_trace(t, max_phases=10)
    assert len(load_trace(t).jobs[0].phases) == 50


def test_co_located_rollouts_slow_each_other_down():
    alone = simulate(load_trace(trace()))
    assert alone["makespan_s"] == pytest.approx(14.0)
    two = simulate(load_trace(trace(jobs=[job("a"), job("b")])))  # both fit: they share the device
    assert two["makespan_s"] == pytest.approx(14.0 * 1.4)  # memory bandwidth 0.7 + 0.7
    light = simulate(load_trace(trace(jobs=[
        job("a", step=[{"phase": "rollout", "seconds": 14, "mem": 30, "bw": 0.5}]),
        job("b", step=[{"phase": "rollout", "seconds": 14, "mem": 30, "bw": 0.5}])])))
    assert light["makespan_s"] == pytest.approx(14.0)


def test_placement_weighs_compute_load_not_only_free_memory():
    pol = PhasePolicy([80.0, 80.0])
    pol.add_job("train", {"c": {"devices": 1}})
    pol.add_job("roll", {"c": {"devices": 1}})
    pol.request("train", "actor_train", mem=10.0, only=[0])  # a compute-bound phase, little memory
    pol.request("roll", "rollout", mem=20.0, devices=1, only=[1])  # a memory-bound one, more memory
    pol.schedule(0.0)
    assert pol.free(0) > pol.free(1)  # device 0 has more memory free, and the heavier compute
    pol.add_job("new", {"c": {"devices": 1, "resident": 20.0, "peak": 30.0}})
    pol.request("new", "init", mem=1.0)
    dec = pol.schedule(1.0)
    home = [le for le in dec.grants if le.phase == RESIDENT]
    assert home and home[0].devices == (1,)  # beside the rollout, not beside the training
    pol.add_job("float", {"c": {"devices": 1}})
    pol.request("float", "values", mem=5.0)
    (g,) = pol.schedule(2.0).grants
    assert g.devices == (0,)  # now device 1 is the busier: a job homed there (1) and a rollout (0.5)
