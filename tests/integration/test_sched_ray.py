"""The scheduler as a Ray actor on a local Ray cluster with CPU slots (skipped without Ray):
the same policy and protocol, driven from the driver and from a job running as a Ray actor."""

import time

import pytest

ray = pytest.importorskip("ray")

from rlcu.sched.client import JobEnded, SchedClient, SchedError  # noqa: E402
from rlcu.sched.ray_backend import RayTransport, start_actor  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             namespace="rlcu")
    actor = start_actor([80.0, 80.0], ["cpu0", "cpu1"], name="rlcu-sched-test", heartbeat_timeout=2.0, tick_s=0.1)
    yield actor
    ray.get(actor.stop.remote())
    ray.kill(actor)
    ray.shutdown()


@ray.remote(num_cpus=0)
class Job:
    """A job as a Ray actor: it finds the scheduler by name."""

    def run(self, name):
        from rlcu.sched.client import SchedClient

        j = SchedClient("ray:rlcu-sched-test").job(name, {"actor": {"devices": 1, "resident": 10, "peak": 60}},
                                                   heartbeat_s=0.2, poll_s=0.0)
        with j.phase("init", mem=1):
            pass
        le = j.acquire("rollout", mem=60)
        while not j.should_yield(le):  # hold the rollout until a higher phase needs the memory
            time.sleep(0.02)
        j.release(le)
        with j.phase("actor_train", mem=40):
            pass
        j.finish()
        return "done"


def test_policy_as_ray_actor(cluster):
    c = SchedClient(transport=RayTransport(cluster))
    assert c.ping()["devices"] == 2
    remote = Job.remote()
    done = remote.run.remote("in-actor")
    # wait for the actor's rollout to be placed, then make it yield from the driver
    end = time.monotonic() + 60
    while not any("in-actor:rollout" in d["leases"] for d in c.status()["devices"]):
        assert time.monotonic() < end, "the job actor never got its rollout"
        if ray.wait([done], timeout=0.05)[0]:
            ray.get(done)  # it failed: raise its error here
    dev = next(d["index"] for d in c.status()["devices"] if "in-actor:rollout" in d["leases"])
    me = c.job("driver", {"x": 1}, heartbeat_s=0.2)
    le = me.acquire("actor_train", mem=50, only=[dev])  # 80 - 10 - 60 = 10 free: the rollout yields
    me.release(le)
    assert ray.get(done, timeout=60) == "done"
    me.finish()
    m = c.metrics()
    assert m["yields"] == 1 and m["jobs_done"] == 2 and m["mem_in_use"] == [0.0, 0.0]
    with pytest.raises(SchedError, match="pid must be a process id"):  # the same guards as the socket service
        c.call("register", job="bad", clusters={"x": 1}, pid=2 ** 70)
    c.call("register", job="z", clusters={"x": 1})
    with pytest.raises(SchedError, match="needs the job's secret"):
        SchedClient(transport=RayTransport(cluster)).call("heartbeat", job="z")
    with pytest.raises(SchedError, match="outside the pool"):
        c.call("request", job="z", phase="rollout", only=[9])
    c.call("cancel", job="z")


def test_ray_address_and_dead_job(cluster):
    c = SchedClient("ray:rlcu-sched-test")
    j = c.job("silent", {"x": 2}, heartbeat_s=0.1)
    le = j.acquire("actor_train")
    j.close()  # no more heartbeats
    other = c.job("other", {"x": 2}, heartbeat_s=0.2)
    got = other.acquire("actor_train", timeout=10)  # after the 2 s timeout the silent job is reclaimed
    with pytest.raises(JobEnded):
        j.release(le)
    other.release(got)
    other.finish()
