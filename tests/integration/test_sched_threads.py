"""A scheduled job's CPU threads (rlcu.sched.job, rlcu.threads): from a command line it takes
its CPU slots' share of the machine's cores; from the library it leaves the caller's count."""

from __future__ import annotations

import pytest
import torch
from support.run_util import TINY, TOK

from rlcu import threads as th
from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("keep_threads")  # tests/conftest.py


def test_a_scheduled_job_takes_its_slots_share(tmp_path, monkeypatch):
    """A job on one of two CPU slots of a 4-core machine runs on 2 threads (its command line's
    choice, `threads=True`; the library's run_grpo leaves the caller's threads alone)."""
    from rlcu.sched.client import SchedClient
    from rlcu.sched.core import Core
    from rlcu.sched.job import run_grpo
    from rlcu.sched.server import SchedServer

    core = Core([1.0, 1.0], state=tmp_path / "s.db", device_names=["cpu0", "cpu1"])
    srv = SchedServer(core, f"unix:{tmp_path / 's.sock'}", "tok", tick_s=0.05).start()
    monkeypatch.setattr(th, "available_cores", lambda: 4)
    try:
        cfg = dict(model=dict(tiny=dict(TINY), device="cpu"), steps=1, prompts_per_step=2, group_size=2,
                   max_new_tokens=3, chat_template=False, checkpoint=dict(save_at_end=False),
                   log=dict(out_dir=str(tmp_path / "out"), progress=False, tensorboard=False, plot=False))
        mem = {"resident": 0.1, "init": 0.1, "rollout": 0.1, "ref_logprobs": 0.1, "actor_train": 0.1}
        kw = dict(client=SchedClient(srv.address, "tok"), mem=mem, dataset=syn.sort_rows(8, seed=1),
                  reward_fns=[syn.partial_match_reward], tokenizer=TOK)
        torch.set_num_threads(3)
        run_grpo(cfg, name="lib", **kw)
        assert torch.get_num_threads() == 3  # a library caller's own count
        run_grpo(dict(cfg, log=dict(cfg["log"], overwrite=True)), name="cli", threads=True, **kw)
        assert torch.get_num_threads() == 2
        assert "CPU threads: 2 (auto: 4 cores available x 0.5 (this job's CPU slots of the scheduler's pool))" in \
            (tmp_path / "out" / "log.txt").read_text()
    finally:
        srv.stop()
