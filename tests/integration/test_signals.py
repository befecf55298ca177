"""SIGTERM / SIGINT on a real `rlcu grpo` process (a tiny model on the CPU): the first signal
lets the step in flight finish, then a checkpoint is written and logged and the process exits
with 128 + the signal; the run resumes from that checkpoint. A second signal exits at once,
writing nothing. The reward function marks when a step is in flight and is slow, so the
signal lands mid-step; every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlcu.data import synthetic as syn

SLOW_REWARD = '''
import os, time
from pathlib import Path

def reward(prompts, completions, **_):
    Path(os.environ["MARK"]).write_text("in flight")
    time.sleep(float(os.environ.get("SLOW", "0.5")))
    return [0.5 * (i % 2) for i in range(len(completions))]
'''


def _setup(tmp_path) -> Path:
    tok = syn.make_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    with open(tmp_path / "train.jsonl", "w") as f:
        for r in syn.sort_rows(16, "train", min_len=2, max_len=3):
            f.write(json.dumps(r) + "\n")
    tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, max_position_embeddings=32, tie_word_embeddings=True, rope_theta=10000.0,
                bos_token_id=None, vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id)
    cfg = {"model": {"tiny": tiny, "tokenizer": str(tmp_path / "tok")}, "data": {"path": str(tmp_path / "train.jsonl")},
           "rewards": [{"fn": "slowreward:reward"}], "steps": 1000, "prompts_per_step": 2, "group_size": 2,
           "max_new_tokens": 3, "optim": {"lr": 1e-3},
           "log": {"out_dir": str(tmp_path / "out"), "progress": False, "tensorboard": False, "plot": False}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run.yaml"


def _start(tmp_path, y, *extra, slow="0.5"):
    env = dict(os.environ, MARK=str(tmp_path / "mark"), SLOW=slow, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")]))
    (tmp_path / "mark").unlink(missing_ok=True)
    return subprocess.Popen([sys.executable, "-m", "rlcu.train.cli", "grpo", str(y), *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_in_flight(tmp_path, proc, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while not (tmp_path / "mark").exists():
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"the run never started a step: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def _finish(proc, timeout=60.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the run did not stop within {timeout} s: {err[-2000:]}")
    return proc.returncode, err


def test_sigterm_finishes_the_step_checkpoints_and_resumes(tmp_path):
    y = _setup(tmp_path)
    proc = _start(tmp_path, y)
    _wait_in_flight(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)  # mid-step: the reward function is sleeping
    rc, err = _finish(proc)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "stopped by SIGTERM after step" in err
    ck = sorted((tmp_path / "out" / "checkpoints").glob("step-*"))
    assert len(ck) == 1
    n = int(ck[0].name.split("-")[1])
    assert n >= 1
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == n  # the step in flight finished and was logged
    log = (tmp_path / "out" / "log.txt").read_text()
    assert f"received SIGTERM during step {n}" in log and f"checkpoint: {ck[0]}" in log
    # the run goes on from it
    proc = _start(tmp_path, y, "--resume", "auto", "--set", f"steps={n + 1}", slow="0")
    rc, err = _finish(proc)
    assert rc == 0, err[-2000:]
    assert f"resumed from {ck[0]} at step {n}" in (tmp_path / "out" / "log.txt").read_text()


def test_second_sigint_exits_at_once(tmp_path):
    y = _setup(tmp_path)
    proc = _start(tmp_path, y, slow="30")
    _wait_in_flight(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc, timeout=20)
    assert rc == 128 + signal.SIGINT and time.monotonic() - t0 < 10, err[-2000:]
    assert "second signal (SIGINT): exiting now" in err
    assert not list((tmp_path / "out" / "checkpoints").glob("step-*"))
