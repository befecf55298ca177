"""`rlcu sched cancel` is a graceful stop: the job learns it at its next call to the service,
finishes the step in flight, checkpoints, logs and exits (status 3), as SIGTERM does to a plain
run; `--now` ends it at once, losing the steps since its last checkpoint. End to end on the CPU:
the scheduler service on a Unix socket, its command line, and a tiny GRPO job."""

from __future__ import annotations

import json
import time

import pytest

from rlcu.data.synthetic import make_tokenizer, partial_match_reward, sort_rows
from rlcu.sched.cli import main as sched_main
from rlcu.sched.client import JobEnded, SchedClient, SchedError
from rlcu.sched.core import Core
from rlcu.sched.job import run_grpo_exit_code
from rlcu.sched.server import SchedServer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
TOKEN = "t0ken"
TOK = make_tokenizer()
ROWS = sort_rows(16, seed=1)
MEM = {"resident": 0.2, "init": 0.1, "rollout": 0.3, "ref_logprobs": 0.2, "actor_train": 0.3}


@pytest.fixture
def service(tmp_path):
    core = Core([1.0], state=tmp_path / "s.db", heartbeat_timeout=30, device_names=["cpu0"])
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", TOKEN, tick_s=0.05).start()
    (tmp_path / "token").write_text(TOKEN)
    yield core, srv, SchedClient(srv.address, TOKEN, retry_s=5.0)
    srv.stop()


def _cancel(srv, tmp_path, job, *flags) -> int:
    return sched_main(["sched", "cancel", job, *flags, "--addr", srv.address, "--token-file", str(tmp_path / "token")])


def test_graceful_cancel_keeps_the_job_live_until_it_finishes(tmp_path, service, capsys):
    core, srv, c = service
    a = c.job("a", {"c": 1}, heartbeat_s=0.1, poll_s=0.0)
    la = a.acquire("rollout")
    assert _cancel(srv, tmp_path, "a") == 0
    assert "a: stopping: it stops after the step in flight and a checkpoint" in capsys.readouterr().out
    assert not a.should_yield(la) and a.stopping  # its next call tells it; its lease is still held
    a.release(la)
    with a.phase("actor_train"):  # the rest of the step in flight is still granted
        pass
    assert c.status()["jobs"][0]["state"] == "stopping"
    # a resent graceful cancel (its first reply lost in a restart) finds it done
    r = c.transport.call({"op": "cancel", "job": "a", "graceful": True, "id": "x-1", "retry": True}, 5.0)
    assert r["ok"] and r.get("reconciled") and r["state"] == "stopping"
    a.finish()  # the job says it is done: it was cancelled
    assert c.status()["jobs"][0]["state"] == "cancelled"
    # a job not attached yet has nothing to stop: it ends at once
    c.submit("q", {"c": 1})
    assert _cancel(srv, tmp_path, "q") == 0 and c.status()["jobs"][1]["state"] == "cancelled"
    # --now on a stopping job ends it at once
    b = c.job("b", {"c": 1}, heartbeat_s=0.1, poll_s=0.0)
    lb = b.acquire("rollout")
    c.cancel("b", graceful=True)
    assert _cancel(srv, tmp_path, "b", "--now") == 0
    with pytest.raises(JobEnded, match="cancelled"):
        b.should_yield(lb)
    b.close()
    with pytest.raises(SchedError, match="graceful must be true or false"):
        c.call("cancel", job="b", graceful="yes")


def _config(out, steps=40):
    return {"model": {"tiny": {"vocab_size": TOK.vocab_size, "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "head_dim": 16, "max_position_embeddings": 32, "eos_token_id": TOK.eos_token_id,
                               "bos_token_id": None}, "device": "cpu", "dtype": "float32"},
            "steps": steps, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "chat_template": False,
            "optim": {"lr": 1e-2}, "log": {"out_dir": str(out), "tensorboard": False, "plot": False,
                                          "progress": False},
            "checkpoint": {"every": 3, "keep_last": 0}}


@pytest.mark.parametrize("now", [False, True])
def test_cancel_of_a_training_job(tmp_path, service, capsys, now):
    """Cancelled in the rollout of step 5 (checkpoints every 3 steps): the graceful stop
    finishes step 5 and checkpoints it; --now loses steps 4 and 5 (the last checkpoint is 3)."""
    core, srv, c = service
    calls = []

    def reward(prompts, completions, **kw):
        calls.append(time.monotonic())
        if len(calls) == 5:
            assert _cancel(srv, tmp_path, "cj", *(["--now"] if now else [])) == 0
        return partial_match_reward(prompts, completions, **kw)

    t0 = time.monotonic()
    rc = run_grpo_exit_code("rlcu sched job", _config(tmp_path / "run"), client=c, name="cj", mem=MEM,
                            dataset=ROWS, reward_fns=[reward], tokenizer=TOK, heartbeat_s=0.2)
    assert time.monotonic() - t0 < 60
    assert rc == 3 and core.snapshot().jobs["cj"].state == "cancelled"
    err = capsys.readouterr().err
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    log = (tmp_path / "run" / "log.txt").read_text()
    if now:
        assert "the scheduler ended the job: job 'cj' is cancelled" in err
        assert ckpts == ["step-000003"] and len(calls) == 5
    else:
        assert err.splitlines()[-1].startswith("rlcu sched job: cancelled by the scheduler (rlcu sched cancel): "
                                               "stopped after step 5; checkpoint: ")
        assert ckpts == ["step-000003", "step-000005"] and len(calls) == 5
        state = json.loads((tmp_path / "run" / "checkpoints" / "step-000005" / "trainer_state.json").read_text())
        assert state["step"] == 5
        assert "cancelled by the scheduler (rlcu sched cancel) during step 5: the step finished; checkpointing" in log
    assert core.snapshot().used == (0.0,)
