"""`torchrun --nproc-per-node 2 -m rlcu sft CONFIG` on the CPU (gloo): the run ends with one
metrics file and a checkpoint holding both ranks' optimizer shards, whatever grad_accum; a bad
config exits 2 on every rank (bounded), its error printed once; GRPO under the scheduler at 2
ranks is one job on both slots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from support.parallel_util import SRC, torchrun_env, torchrun_sft


def _torchrun(args, tmp_path, timeout=180):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "rlcu", *args], capture_output=True, text=True, timeout=timeout, env=torchrun_env(10),
                          cwd=tmp_path)


def test_torchrun_two_ranks_sft(tmp_path):
    torchrun_sft(tmp_path, 2, steps=2, grad_accum=3)
    pr = _torchrun(["sft", "sft.yaml"], tmp_path)
    assert pr.returncode == 0, pr.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "memory per rank (estimate, 2 ranks)" in (tmp_path / "run" / "log.txt").read_text()
    shards = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / "step-000002" / "optim").iterdir())
    assert shards == ["rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    # a bad option: both ranks exit 2 before anything heavy (torchrun reports the first failure);
    # the error is printed once, not once a rank
    pr = _torchrun(["sft", "sft.yaml", "--set", "grad_accum=0"], tmp_path)
    assert pr.returncode != 0
    assert pr.stderr.count("grad_accum must be >= 1, got 0") == 1, pr.stderr[-3000:]


_REWARDS = "def ok(completions, **kw):\n    return [float(len(c) % 2) for c in completions]\n"


def _grpo_files(tmp_path) -> Path:
    """A tiny GRPO config (tokenizer, prompts and a reward module beside it) on the CPU."""
    from rlcu.data import synthetic as syn

    tok = syn.make_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    rows = syn.sort_rows(16, "train", min_len=2, max_len=3)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dp_rewards.py").write_text(_REWARDS)
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, max_position_embeddings=32, bos_token_id=None,
                vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    cfg = {"model": {"tiny": tiny, "tokenizer": str(tmp_path / "tok"), "device": "cpu"},
           "data": {"path": str(tmp_path / "train.jsonl")}, "rewards": [{"fn": "dp_rewards:ok"}],
           "steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3,
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "tensorboard": False, "plot": False}}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "grpo.yaml"


def _job_on_both_slots(core, name):
    snap = core.snapshot()
    assert snap.jobs[name].state == "done"
    spans = [s for s in snap.spans if s.job == name]
    assert {s.phase for s in spans} >= {"resident", "init", "rollout", "actor_train"}
    assert all(tuple(s.devices) == (0, 1) for s in spans)


def _service(tmp_path):
    from rlcu.sched.core import Core
    from rlcu.sched.server import SchedServer

    core = Core([10.0, 10.0], state=tmp_path / "s.db", device_names=["cpu0", "cpu1"])
    return core, SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()


def _steps(tmp_path):
    return [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_two_ranks_grpo_under_the_scheduler(tmp_path, monkeypatch):
    """`torchrun --nproc-per-node 2 -m rlcu grpo CONFIG --scheduler ADDR`: one job, whose every
    lease spans the two CPU slots, finished as done."""
    _grpo_files(tmp_path)
    core, srv = _service(tmp_path)
    try:
        monkeypatch.setenv("RLCU_SCHED_TOKEN", "tok")
        pr = _torchrun(["grpo", "grpo.yaml", "--scheduler", srv.address, "--job-name", "dpcli"], tmp_path)
        assert pr.returncode == 0, pr.stderr[-3000:]
        _job_on_both_slots(core, "dpcli")
    finally:
        srv.stop()
    assert _steps(tmp_path) == [1, 2]


def test_submit_a_job_of_two_ranks(tmp_path, monkeypatch, capsys):
    """A job file's `ranks: 2`: `rlcu sched submit` registers one job of 2 devices and starts
    its worker under torchrun, whose rank 0 attaches with the job's secret."""
    from rlcu.sched.cli import main

    _grpo_files(tmp_path)
    (tmp_path / "job.yaml").write_text("name: dpsub\ngrpo: grpo.yaml\nranks: 2\n")
    core, srv = _service(tmp_path)
    for k, v in (("PYTHONPATH", SRC), ("OMP_NUM_THREADS", "1"), ("RLCU_DIST_HEARTBEAT_S", "10")):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        assert main(["sched", "submit", str(tmp_path / "job.yaml"), "--addr", srv.address, "--token", "tok"]) == 0
        assert "submitted dpsub" in capsys.readouterr().out
        import time

        end = time.monotonic() + 180
        while core.snapshot().jobs["dpsub"].state in ("queued", "running") and time.monotonic() < end:
            time.sleep(0.2)
        log = (tmp_path / "logs" / "dpsub.log").read_text()
        assert core.snapshot().jobs["dpsub"].state == "done", log[-3000:]
        _job_on_both_slots(core, "dpsub")
    finally:
        srv.stop()
    assert _steps(tmp_path) == [1, 2]
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: grpo.yaml\nranks: 0\n")
    assert main(["sched", "submit", str(bad), "--addr", srv.address, "--token", "tok", "--no-launch"]) == 2
    assert "ranks must be an integer >= 1" in capsys.readouterr().err
