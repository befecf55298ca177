"""The metrics run on the monotonic clock: a wall clock stepped back (NTP, a VM resumed) made
`uptime_s` negative and `jobs_per_hour` 3.6e15; now it counts no time, on one run and across
a restart (whose monotonic clock begins anew). The wall clock stays for what is shown."""

import pytest
from support.sched_util import SPEC, Clock, ok

from rlcu.sched.core import Core


def test_a_wall_clock_stepped_back_counts_no_time(tmp_path):
    wall, mono = Clock(1_000_000.0), Clock(50.0)
    core = Core([8.0], state=tmp_path / "s.db", clock=wall, mono=mono)
    ok(core, op="register", job="a", clusters=SPEC)
    ok(core, op="request", job="a", phase="values", mem=4)
    wall.t -= 3600.0  # stepped back an hour
    mono.t += 10.0
    ok(core, op="finish", job="a")
    wall.t += 5.0
    mono.t += 90.0
    m = ok(core, op="metrics")
    assert m["uptime_s"] == pytest.approx(100.0) and m["jobs_per_hour"] == pytest.approx(36.0)
    assert m["mean_latency_s"] == pytest.approx(10.0) and m["gpu_idle_frac"] == pytest.approx(0.9)
    assert m["t0"] == pytest.approx(wall.t - 100.0)  # for display: the wall clock less the uptime
    row = ok(core, op="status")["jobs"][0]
    assert row["age_s"] >= 0.0 and row["wait_s"] >= 0.0
    core.close()
    again = Core(None, state=tmp_path / "s.db", clock=wall, mono=Clock(7.0))  # a new boot's monotonic clock
    again.mono.t += 20.0
    m = ok(again, op="metrics")
    assert m["uptime_s"] == pytest.approx(120.0) and m["jobs_per_hour"] == pytest.approx(30.0)
    again.close()
