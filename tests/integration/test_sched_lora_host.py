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


def test_a_job_submitted_later_joins_the_running_host(tmp_path, monkeypatch):
    """Two processes: `rlcu grpo a.yaml --scheduler ADDR` starts a host (nothing runs on its base
    yet) and steps job a; job b, submitted from this process while a steps (submit_lora), finds
    the host in the scheduler's status by its base's key, joins it over the host's join channel
    (the token's proofs), runs its steps there and gets its exit status back; the scheduler sees
    one job (the host), whose phases grew by b's share; b's adapter equals b run alone, bit for
    bit (exact mode). The host is then cancelled (a stops after its step). About 10 s on an idle
    machine, most of it the second process's start-up (its imports): what a test of two processes
    costs."""
    import json
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file
    from support.trainers import TINY

    from rlcu.data import synthetic as syn
    from rlcu.sched.host import submit_lora
    from rlcu.sched.job import grpo_config
    from rlcu.train.grpo import GRPOTrainer

    tok = syn.make_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(16, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")

    def write(name, steps, seed, here=tmp_path):  # b's paths relative to this process's directory
        cfg = {"model": {"tiny": dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id),
                         "tokenizer": str(here / "tok")},
               "data": {"path": str(here / "train.jsonl")}, "steps": steps, "prompts_per_step": 2,
               "group_size": 2, "max_new_tokens": 3, "exact": True, "seed": seed,
               "rewards": [{"fn": "rlcu.data.synthetic:partial_match_reward"}], "lora": {"r": 4, "seed": seed},
               "log": {"out_dir": str(here / name), "progress": False, "plot": False, "tensorboard": False}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        return str(tmp_path / f"{name}.yaml")

    a, b = write("a", 400, 1), write("b", 2, 2, here=Path("."))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()  # the host's directory: b's relative paths are not its
    core = Core([1000.0], state=tmp_path / "s.db", heartbeat_timeout=30)
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()
    env = dict(os.environ, RLCU_SCHED_TOKEN="tok", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "rlcu", "grpo", a, "--scheduler", srv.address, "--job-name", "a"],
                            env=env, cwd=tmp_path / "elsewhere", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        client = SchedClient(srv.address, "tok")
        deadline = time.monotonic() + 120
        while not ((tmp_path / "a" / "metrics.jsonl").is_file() and (tmp_path / "a" / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        (host,) = list(core.snapshot().jobs)  # a's host: one job of the scheduler
        asked = dict(core.snapshot().jobs[host].spec)
        assert asked["kind"] == "lora-host" and asked["join"].startswith("unix:")
        status, err = submit_lora(b, client=client, name="b")
        assert (status, err) == (0, None)
        assert list(core.snapshot().jobs) == [host]  # b ran in a's host, not a host of its own
        assert proc.poll() is None  # a still steps
        rollouts = [sp.mem[0] for sp in core.snapshot().spans if sp.phase == "rollout"]
        assert rollouts[-1] > rollouts[0]  # the host's leases grew by b's share when it joined
        client.cancel(host, graceful=True)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.stop()
    assert "rlcu grpo [b]" not in out, out  # b's steps went well
    assert proc.returncode == 3, out  # a: cancelled after its step, as a scheduled job's status
    cfg = grpo_config(b, [f"log.out_dir={tmp_path / 'alone'}"])
    GRPOTrainer(cfg).train()
    got, want = (load_file(tmp_path / d / "adapter" / "adapter_model.safetensors") for d in ("b", "alone"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in got)


def test_join_channel_proofs_and_answers(tmp_path):
    """rlcu.sched.join against a stand-in host: a joiner without the scheduler's token is refused
    before its config is read (and learns nothing: the host's proof fails on its side); a host
    with no room (admit) or one that has ended (HostClosed) answers that the job runs elsewhere
    (None); a taken job's status comes back when its on_end fires."""
    import threading

    from rlcu.sched.client import SchedError
    from rlcu.sched.join import JoinServer, join
    from rlcu.train.lora_host import HostClosed

    class Host:
        def __init__(self):
            self.taken, self.closed = [], False

        def join(self, cfg, name=None, source=None, on_end=None):
            if self.closed:
                raise HostClosed("ended")
            job = type("Job", (), {"name": name, "status": 0, "error": None})()
            self.taken.append(cfg)
            threading.Timer(0.05, on_end, args=(job,)).start()
            return job

    from rlcu.config import config_to_dict

    cfg = config_to_dict(lora_job(tmp_path, 0))
    host, srv = Host(), JoinServer("tok").start()
    try:
        srv.bind(host)
        with pytest.raises(SchedError, match="did not prove"):
            join(srv.address, "wrong", cfg, name="x")
        import json
        import socket

        with socket.socket(socket.AF_UNIX) as raw:  # one that goes on regardless, with a made-up proof
            raw.connect(str(srv.path))
            f = raw.makefile("rwb")
            f.write(b'{"nonce": "' + b"ab" * 16 + b'"}\n')
            f.flush()
            f.readline()
            f.write(json.dumps({"proof": "0" * 64, "config": cfg, "name": "x"}).encode() + b"\n")
            f.flush()
            assert json.loads(f.readline()) == {"error": "auth"}
        assert host.taken == []
        assert join(srv.address, "tok", cfg, name="b") == (0, None) and len(host.taken) == 1
        srv.admit = lambda c: False
        assert join(srv.address, "tok", cfg, name="c") is None
        srv.admit, host.closed = None, True
        assert join(srv.address, "tok", cfg, name="d") is None and len(host.taken) == 1
    finally:
        srv.close()
    assert join(srv.address, "tok", cfg) is None  # gone: run elsewhere
