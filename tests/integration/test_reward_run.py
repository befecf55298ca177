"""A run whose reward function raises on every sample stops with exit status 1 and one line
naming the function and its first error (it used to mask every step and exit 0), and a
reward module beside the config imports without PYTHONPATH."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from support.trainers import TINY

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


_MOD = '''
def ok(completions, **kw):
    return [1.0] * len(completions)
def broken(completions, **kw):
    raise RuntimeError("grader offline")
'''


def test_failing_reward_stops_the_run(tmp_path, monkeypatch, capsys):
    from rlcu.rewards import loader
    from rlcu.train.cli import main

    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "run_rewards.py").write_text(_MOD)
    tok = syn.make_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    rows = syn.sort_rows(16, "train", min_len=2, max_len=3)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"tiny": dict(TINY, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id),
                     "tokenizer": str(tmp_path / "tok")},
           "data": {"path": str(tmp_path / "train.jsonl")},
           "rewards": [{"fn": "run_rewards:ok"}, {"fn": "run_rewards:broken"}],
           "reward_max_failed_steps": 2, "steps": 6, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 3,
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "tensorboard": False, "plot": False}}
    (exp / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(loader, "_DIRS", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    try:
        assert main(["grpo", str(exp / "grpo.yaml")]) == 1
    finally:
        sys.modules.pop("run_rewards", None)
    last = capsys.readouterr().err.strip().splitlines()[-1]  # the run log goes to stderr before it
    assert last.startswith("rlcu grpo: reward 'broken' failed on every sample for 2 steps in a row")
    assert "RuntimeError: grader offline" in last and "run_rewards.py" in last
    steps = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the second failing step raised
    # the steps done are kept for a resume once the function is fixed, and log.txt says why the run stopped
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir()] == ["step-000001"]
    assert "reward 'broken' failed on every sample for 2 steps in a row" in (tmp_path / "out" / "log.txt").read_text()
