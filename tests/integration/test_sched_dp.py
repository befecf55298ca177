"""A scheduled GRPO job across 2 ranks (gloo, CPU) under a real service with 2 CPU slots: its
leases span both devices, it ends with the weights of an unscheduled 2-rank run, a yield
asked by another job (a hog) stops both ranks' engines at the same tick and changes nothing,
and a rank that fails ends the job, finished as failed."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.grpo_job import MEM, ROWS, TOK, config
from support.parallel_util import ok, run_ranks
from support.shapes import SHAPES

from rlcu.data.synthetic import partial_match_reward
from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.server import SchedServer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def service(tmp_path):
    core = Core([10.0, 10.0], state=tmp_path / "s.db", heartbeat_timeout=30, device_names=["cpu0", "cpu1"])
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()
    yield core, srv.address
    srv.stop()


def _scheduled(tmp, addr, name, hog=False, reward=partial_match_reward):
    from rlcu.sched.job import ScheduledGRPO, run_grpo

    kept = []

    class Kept(ScheduledGRPO):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            kept.append(self)
            self.sleeps = 0
            sleep = self.llm.sleep

            def counted(keep_graphs=False):
                self.sleeps += not self.llm.asleep
                sleep(keep_graphs)

            self.llm.sleep = counted
            if hog and self.hooks.main:
                self.on_engine_step = _hog_at(3, addr, self)

    hist = run_grpo(config(tmp / name), addr, name, token="tok", mem=MEM, dataset=ROWS, reward_fns=[reward],
                    tokenizer=TOK, trainer_cls=Kept, poll_s=0.0)
    tr = kept[0]
    return {"flat": tr.model.flat.clone(), "yields": tr.yields, "yield_ticks": list(tr.hooks.yield_ticks),
            "ticks": tr.hooks.ticks, "sleeps": tr.sleeps, "hist_yields": hist[-1]["sched/yields"]}


def _hog_at(step, addr, trainer):
    """At engine step `step` of rank 0, another job asks for more memory than is free on a
    device (2 resident + 4 rollout of 10 are the job's): the rollout must yield."""
    fired = []

    def on_step(n):
        if n != step or fired:
            return
        hog = SchedClient(addr, "tok").job("hog", {"x": 1})
        fired.append(hog)

        def train():
            le = hog.acquire("actor_train", mem=6.0)
            time.sleep(0.2)
            hog.release(le)
            hog.finish()

        threading.Thread(target=train, daemon=True).start()
        end = time.monotonic() + 10
        while not trainer.sched.should_yield() and time.monotonic() < end:
            time.sleep(0.01)

    return on_step


def _ranks(rank, tmp, addr):
    from rlcu.train.grpo import GRPOTrainer

    plain = GRPOTrainer(config(tmp / "plain"), ROWS, [partial_match_reward], tokenizer=TOK)
    plain.train()
    return {"plain": plain.model.flat.clone(), "sched": _scheduled(tmp, addr, "dp"),
            "hog": _scheduled(tmp, addr, "dphog", hog=True)}


def test_two_rank_scheduled_job_equals_unscheduled_and_yields_together(tmp_path, service):
    core, addr = service
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, addr, timeout=240)
    r0, r1 = ok(d)
    assert torch.equal(r0["plain"], r1["plain"])
    for k in ("sched", "hog"):
        assert torch.equal(r0[k]["flat"], r1[k]["flat"]), k
    # no yield: exactly the unscheduled run's weights; the ranks ticked together
    s0, s1 = r0["sched"], r1["sched"]
    assert torch.equal(s0["flat"], r0["plain"])
    assert s0["yields"] == s1["yields"] == 0 and s0["ticks"] == s1["ticks"] > 0
    # the hog's yield: honoured on both ranks at the same tick, each engine slept through it
    h0, h1 = r0["hog"], r1["hog"]
    assert h0["yields"] == h1["yields"] == h0["hist_yields"] == 1
    assert h0["yield_ticks"] == h1["yield_ticks"] and len(h0["yield_ticks"]) == 1
    assert h0["sleeps"] == h1["sleeps"] == 3  # after each of 2 rollouts, and through the yield
    err = float((h0["flat"] - r0["plain"]).norm() / r0["plain"].norm())
    assert err < 1e-5, f"weights differ: rel err {err:.2e}"
    # the trace: every lease of the two jobs spans both devices; the hog ran inside the yield
    spans = list(core.snapshot().spans)
    for job in ("dp", "dphog"):
        mine = [s for s in spans if s.job == job]
        assert mine and all(tuple(s.devices) == (0, 1) for s in mine), [(s.phase, s.devices) for s in mine]
        assert core.snapshot().jobs[job].state == "done"
    phases = [(s.job, s.phase, s.reason) for s in spans if s.phase != "resident" and s.job != "dp"]
    i = phases.index(("dphog", "rollout", "yielded"))
    assert phases[i + 1] == ("hog", "actor_train", "released") and phases[i + 2][:2] == ("dphog", "rollout")
    assert [p for j, p, _ in phases if j == "dphog"] == ["init", "rollout", "rollout", "ref_logprobs",
                                                         "actor_train", "rollout", "ref_logprobs", "actor_train"]
    assert core.ops.op_metrics()["mem_in_use"] == [0.0, 0.0]


def _fails_on_rank1(prompts, completions, **kw):
    from rlcu.parallel.comm import report_failure, world

    if world().rank == 1:  # rank 1 reports its failure but its process lives on a while, so that
        report_failure(RuntimeError("stuck"))  # rank 0 waits in a collective that does not fail
        time.sleep(4)
        raise KeyboardInterrupt  # not caught by the reward machinery: rank 1 dies mid-step
    return partial_match_reward(prompts, completions, **kw)


def _failing(rank, tmp, addr, name):
    return _scheduled(tmp, addr, name, reward=_fails_on_rank1)


def test_a_failed_rank_ends_the_job_as_failed(tmp_path, service):
    """Rank 1 fails mid-step while rank 0 waits for it in a collective: rank 0's watchdog ends
    it, and the job is finished as failed at once (not after the heartbeat timeout). (A rank 0
    whose collective fails instead raises, and run_grpo finishes the job as failed.)"""
    core, addr = service
    t0 = time.monotonic()
    d, codes = run_ranks(_failing, 2, tmp_path, tmp_path, addr, "dpfail", timeout=120)
    assert d[1] is not None and d[1][0] == "error" and "KeyboardInterrupt" in d[1][1]
    from rlcu.parallel.watchdog import EXIT_CODE

    assert codes[0] == EXIT_CODE, codes  # rank 0 ended by its watchdog, after telling the scheduler
    assert time.monotonic() - t0 < 60
    assert core.snapshot().jobs["dpfail"].state == "failed"
    assert core.ops.op_metrics()["mem_in_use"] == [0.0, 0.0]


# ------------------------------------------------------------------ the tick protocol, engine-free
class _Handle:
    """Rank 0's JobHandle stand-in: grants at once, logs, asks a yield (or ends the job) at a tick."""

    stopping = False  # a graceful cancel (rlcu sched cancel) sets it

    def __init__(self, yield_at=None, end_at=None, slow_s=0.0):
        self.n, self.log, self.yield_at, self.end_at, self.slow_s = 0, [], yield_at, end_at, slow_s

    def acquire(self, phase, cluster=None, **kw):
        from rlcu.sched.client import LeaseInfo

        if self.log:  # the re-grant after the yield comes late
            time.sleep(self.slow_s)
        self.log.append(("acquire", phase, kw.get("work"), kw.get("devices"), kw.get("min_devices")))
        return LeaseInfo(len(self.log), phase, cluster, (0, 1), ("cpu0", "cpu1"), (1.0, 1.0), 0.0)

    def release(self, lease):
        self.log.append(("release", lease.phase))

    def should_yield(self, lease=None):
        from rlcu.sched.protocol import JobEnded

        self.n += 1
        if self.n == self.end_at:
            raise JobEnded("job 'x' is cancelled", "ended")
        return self.n == self.yield_at


class _Engine:
    """An engine of `steps` steps that yields as LLM.generate does (sleep, on_yield(left), wake)
    and calls on_done at its end."""

    def __init__(self, steps):
        self.steps, self.asleep, self.sleeps = steps, False, 0

    def sleep(self, keep_graphs=False):
        self.sleeps += 1
        self.asleep = True

    def wake(self):
        self.asleep = False

    def generate(self, prompts, sp=None, *, yield_check=None, on_yield=None, on_done=None, **kw):
        for left in range(self.steps, 0, -1):
            if yield_check():
                self.sleep()
                on_yield(left)
                self.wake()
        on_done()
        return [self.steps]


def _protocol(rank):
    from rlcu.parallel.comm import all_gather_objects
    from rlcu.sched.dp import DistJobHooks
    from rlcu.sched.protocol import JobEnded

    out = {}
    for case, kw in (("yield", dict(yield_at=4, slow_s=4.0)), ("end", dict(end_at=3))):
        h = _Handle(**kw) if rank == 0 else None
        hooks = DistJobHooks(h, "actor", {"rollout": 1.0})
        llm = _Engine(5 if rank == 0 else 2)  # rank 1 is done after 2 steps, then drains
        hooks.attach(llm)
        try:
            with hooks.phase("rollout", work=100.0):
                llm.generate([], yield_check=hooks.yield_check, on_yield=hooks.on_yield,
                             on_done=hooks.on_generate_done)
                after = all_gather_objects(rank)  # the collective after the generate pairs up
        except JobEnded as e:
            after = f"ended: {e}"
        hooks.close()
        out[case] = dict(ticks=hooks.ticks, yield_ticks=hooks.yield_ticks, yields=hooks.yields,
                         sleeps=llm.sleeps, after=after, log=h.log if h else None)
    h = _Handle() if rank == 0 else None
    hooks = DistJobHooks(h, "actor", {})
    out["stop"] = [hooks.stop_reason()]  # every rank asks before each step; rank 0's view answers
    if h is not None:
        h.stopping = True
    out["stop"].append(hooks.stop_reason())
    hooks.close()
    return out


def test_tick_protocol_yields_every_rank_even_one_done(tmp_path):
    """Engines of different lengths: a yield while rank 1's generate is done reaches both
    ranks; a re-grant that takes longer than the collectives' timeout (3 s here) is waited
    for; a job the scheduler ends raises on every rank."""
    d, _ = run_ranks(_protocol, 2, tmp_path, timeout=60, env={"RLCU_DIST_TIMEOUT_S": "3"})
    r0, r1 = ok(d)
    y0, y1 = r0["yield"], r1["yield"]
    # ticks 1-2 both generate, 3-5 rank 1 drains; the yield at tick 4 reaches both (rank 1 idle)
    assert y0["ticks"] == y1["ticks"] == 6 and y0["yield_ticks"] == y1["yield_ticks"] == [4]
    assert y0["yields"] == y1["yields"] == 1 and y0["sleeps"] == y1["sleeps"] == 1
    assert y0["after"] == y1["after"] == [0, 1]
    assert y0["log"] == [("acquire", "rollout", 100.0, 2, 2), ("release", "rollout"),
                         ("acquire", "rollout", 2.0, 2, 2), ("release", "rollout")]  # the work left, summed
    # the scheduler ends the job at tick 3: every rank raises JobEnded, with rank 0's message
    e0, e1 = r0["end"], r1["end"]
    assert e0["after"] == e1["after"] == "ended: job 'x' is cancelled"
    # a graceful cancel, seen by rank 0, stops every rank after the same step
    assert r0["stop"] == r1["stop"] == [None, "cancelled by the scheduler (rlcu sched cancel)"]


def test_memory_per_rank_estimate_shards_the_optimizer():
    """A job of N ranks registers what one rank holds: Qwen3-14B in the default precision does
    not fit one H200's 139 GiB resident, but its 8-rank job does, with room for its phases."""
    from rlcu.config import GRPOConfig
    from rlcu.sched.job import estimate_memory, job_memory

    cfg = GRPOConfig(model={"tiny": SHAPES["14b"], "dtype": "bfloat16"}, kl_coef=0.0, prompts_per_step=32,
                     group_size=8, max_new_tokens=1024, micro_batch_tokens=16384)
    one, eight = estimate_memory(cfg), estimate_memory(cfg, world_size=8)
    assert one["resident"] > 139 > eight["resident"] + max(eight["rollout"], eight["actor_train"])
    assert eight["rollout"] < one["rollout"] / 4  # a rank's block of the prompts
    clusters, mem = job_memory(cfg, devices=8)
    assert clusters["actor"]["devices"] == 8 and clusters["actor"]["resident"] == eight["resident"]


def test_pin_devices_maps_the_ranks_gpus_onto_the_pool():
    from types import SimpleNamespace

    from rlcu.sched.client import SchedError
    from rlcu.sched.dp import pin_devices

    def handle(*names):
        devs = [{"index": i, "name": n} for i, n in enumerate(names)]
        return SimpleNamespace(client=SimpleNamespace(status=lambda: {"devices": devs}))

    def no_status():
        raise SchedError("bad or missing token", "auth")

    assert pin_devices(None, [("h", "cpu"), ("h", "cpu")]) is None  # CPU ranks take the slots granted
    assert pin_devices(handle("cpu0", "cpu1"), [("h", "cuda:0"), ("h", "cuda:1")]) is None
    assert pin_devices(handle("cuda:0", "cuda:1", "cuda:2", "cuda:3"), [("h", "cuda:3"), ("h", "cuda:2")]) == [2, 3]
    two_nodes = handle("a/cuda:0", "a/cuda:1", "b/cuda:0", "b/cuda:1")
    assert pin_devices(two_nodes, [("b", "cuda:0"), ("b", "cuda:1"), ("a", "cuda:1")]) == [1, 2, 3]
    with pytest.raises(SchedError, match=r"\['c/cuda:0'\] are not devices of the scheduler's pool"):
        pin_devices(two_nodes, [("a", "cuda:0"), ("c", "cuda:0")])
    # a worker with only its job's secret cannot read the pool: unpinned (each rank checks its grant)
    assert pin_devices(SimpleNamespace(client=SimpleNamespace(status=no_status)), [("h", "cuda:0")]) is None


def test_a_grant_without_the_ranks_gpu_is_refused(monkeypatch):
    from rlcu.sched import dp
    from rlcu.sched.client import LeaseInfo, SchedError

    h = dp.RankZero(None, rank=1, size=2)
    monkeypatch.setattr(dp, "_my_device", lambda: "cuda:1")
    h.check(LeaseInfo(7, "rollout", "actor", (0, 1), ("n/cuda:0", "n/cuda:1"), (1.0, 1.0), 0.0))
    with pytest.raises(SchedError, match=r"rank 1: lease 7 \(rollout\) holds \['cuda:2', 'cuda:3'\], not this "):
        h.check(LeaseInfo(7, "rollout", "actor", (2, 3), ("cuda:2", "cuda:3"), (1.0, 1.0), 0.0))
    with pytest.raises(SchedError, match="spans 1 devices; the job has 2 ranks"):
        h.check(LeaseInfo(8, "init", "actor", (1,), ("cuda:1",), (1.0,), 0.0))
