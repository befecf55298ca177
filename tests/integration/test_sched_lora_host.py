"""LoRA jobs on one base under the scheduler (issue 35, rlcu.sched.host): placed together as one
job of the scheduler, one lease at a time for all of them, a request that counts the base once,
rollouts that share leases, and the jobs' adapters those of the same host run unscheduled."""

import pytest
import torch
from support.grpo_job import MEM, ROWS, TOK, config

from rlcu.config import GRPOConfig, _build
from rlcu.data.synthetic import partial_match_reward
from rlcu.sched.client import SchedClient
from rlcu.sched.core import Core
from rlcu.sched.host import host_memory, run_host
from rlcu.sched.job import estimate_memory
from rlcu.sched.server import SchedServer
from rlcu.train.lora_host import LoraHost


@pytest.fixture
def service(tmp_path):
    core = Core([10.0], state=tmp_path / "s.db", heartbeat_timeout=30)
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()
    yield core, SchedClient(srv.address, "tok")
    srv.stop()


def lora_job(out, i: int, r: int = 4) -> GRPOConfig:
    d = config(out / f"job{i}")
    d.update(lora={"r": r, "alpha": 2 * r, "seed": i}, seed=3 + i, kl_coef=0.0)
    return _build(GRPOConfig, d)


def test_host_request_counts_the_base_once(tmp_path):
    cfgs = [lora_job(tmp_path, i) for i in range(3)]
    one = estimate_memory(cfgs[0])
    _, mem = host_memory(cfgs)
    assert one["resident"] < mem["resident"] < 1.5 * one["resident"]  # not three bases
    assert mem["resident"] < 3 * one["resident"]
    assert mem["rollout"] > one["rollout"]  # the shared pool holds every job's step
    assert mem["actor_train"] == pytest.approx(one["actor_train"])  # the updates take turns


def test_same_base_jobs_placed_in_one_host(tmp_path, service):
    core, client = service
    cfgs = [lora_job(tmp_path / "sched", i) for i in range(2)]
    given = dict(MEM)
    host = run_host(cfgs, client=client, name="host", mem=given, datasets=[ROWS] * 2,
                    reward_fns=[[partial_match_reward]] * 2, tokenizers=[TOK] * 2)
    assert [j.status for j in host.jobs] == [0, 0] and all(len(j.history) == 2 for j in host.jobs)
    snap = core.snapshot()
    assert list(snap.jobs) == ["host"] and snap.jobs["host"].state == "done"  # one job of the scheduler
    spans = snap.spans
    assert {s.phase for s in spans} >= {"resident", "init", "rollout", "actor_train"}
    # every shared generate call is one rollout lease (no yields here), for all the jobs together
    assert sum(s.phase == "rollout" for s in spans) == host.engine.generate_calls
    assert snap.used == (0.0,)
    plain = LoraHost([lora_job(tmp_path / "plain", i) for i in range(2)], [ROWS] * 2,
                     [[partial_match_reward]] * 2, tokenizers=[TOK] * 2)
    plain.train()
    for a, b in zip(host.jobs, plain.jobs):
        assert torch.equal(a.trainer.model.lora.flat, b.trainer.model.lora.flat)
