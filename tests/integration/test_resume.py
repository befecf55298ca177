"""Resume is bit-exact for SFT, GRPO and PPO on the CPU: a run resumed from any of its
intermediate checkpoints ends with the weights and optimizer state (and PPO's critic, its
optimizer and the reward statistics) of the uninterrupted run, bit for bit; and a PPO run
killed (SIGKILL) at random moments, also mid-save, and restarted with `--resume auto` until it
is done ends where the uninterrupted run does."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlcu.data import synthetic as syn

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOK = syn.make_tokenizer()
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=32, tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=None,
            vocab_size=TOK.vocab_size, eos_token_id=TOK.eos_token_id)
STEPS = 5


def rl_config(out, resume=None, **kw) -> dict:
    d = dict(model=dict(tiny=dict(TINY), init_seed=3), steps=STEPS, prompts_per_step=3, group_size=2,
             max_new_tokens=4, micro_batch_tokens=24, mu=2, optim=dict(lr=3e-3, schedule="cosine", warmup_steps=2),
             rewards=[{"fn": "rlcu.data.synthetic:partial_match_reward"}], data=dict(eval_size=3), eval_every=2,
             log=dict(out_dir=str(out), progress=False, tensorboard=False, plot=False),
             checkpoint=dict(every=1, keep_last=0, resume=resume), seed=5)
    d.update(kw)
    return d


def state_of(tr) -> dict:
    model = tr.model.flat
    opt = getattr(tr, "opt", None) or tr.optimizer
    out = {"w": model, "m": opt.m, "v": opt.v}
    if hasattr(tr, "critic"):
        out.update(c=tr.critic.flat, cm=tr.critic_opt.m, cv=tr.critic_opt.v)
    return {k: v.detach().clone() for k, v in out.items()}


def _same(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs: max |d| {(a[k] - b[k]).abs().max():.3g}"


def _grpo(out, resume=None):
    from rlcu.train.grpo import GRPOTrainer

    return GRPOTrainer(rl_config(out, resume, kl_coef=0.05, entropy_coef=0.01),
                       syn.sort_rows(24, "train", min_len=2, max_len=3), tokenizer=TOK)


def _ppo(out, resume=None):
    from rlcu.train.ppo import PPOTrainer

    cfg = rl_config(out, resume, group_size=1, critic=dict(warmup_steps=2, optim=dict(lr=3e-3, schedule="cosine")))
    return PPOTrainer(cfg, syn.sort_rows(24, "train", min_len=2, max_len=3), tokenizer=TOK)


def _sft(out, resume=None):
    import rlcu
    from rlcu.train.sft import SFTTrainer

    g = torch.Generator().manual_seed(0)
    rows = [{"prompt_token_ids": torch.randint(0, 15, (3,), generator=g).tolist(),
             "completion_token_ids": torch.randint(0, 15, (int(torch.randint(1, 5, (1,), generator=g)),),
                                                   generator=g).tolist()} for _ in range(14)]
    cfg = {"steps": STEPS, "batch_tokens": 16, "grad_accum": 2, "eval_every": 2, "data": {"eval_size": 2},
           "optim": {"lr": 3e-3, "schedule": "cosine", "warmup_steps": 2, "weight_decay": 0.1},
           "checkpoint": {"every": 1, "keep_last": 0, "resume": resume},
           "log": {"out_dir": str(out), "progress": False, "plot": False, "tensorboard": False}}
    return SFTTrainer(cfg, rows, model=rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), seed=1))


@pytest.mark.parametrize("make", [_sft, _grpo, _ppo], ids=["sft", "grpo", "ppo"])
def test_resume_from_every_checkpoint_is_bit_exact(tmp_path, make):
    a = make(tmp_path / "a")
    a.train()
    want = state_of(a)
    metrics = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for k in range(1, STEPS):
        out = tmp_path / f"r{k}"
        ck = tmp_path / "a" / "checkpoints" / f"step-{k:06d}"
        b = make(out, resume=str(ck))
        b.train()
        assert b.step == STEPS
        _same(want, state_of(b))
        got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        strip = lambda rows: [{k2: v for k2, v in r.items() if "time" not in k2 and not k2.endswith("_per_s")  # noqa: E731
                               and k2 != "step_seconds"} for r in rows if r["step"] > k]
        assert strip(got) == strip(metrics)
    if hasattr(a, "score_stats"):
        assert a.score_stats.state_dict() == b.score_stats.state_dict()


# ---------------------------------------------------------------- killed at random moments
def _cli_run(tmp_path) -> Path:
    TOK.save_pretrained(tmp_path / "tok")
    rows = syn.sort_rows(30, "train", min_len=2, max_len=3)
    for name, part in (("train", rows[:24]), ("eval", rows[24:])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")
    cfg = rl_config(tmp_path / "out", steps=6, group_size=1,
                    critic=dict(warmup_steps=2, optim=dict(lr=3e-3, schedule="cosine")))
    cfg["model"]["tokenizer"] = str(tmp_path / "tok")
    cfg["data"] = {"path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl")}
    cfg["checkpoint"] = {"every": 1, "keep_last": 2}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run.yaml"


def _final(out: Path) -> dict:
    from safetensors.torch import load_file

    ck = sorted((out / "checkpoints").glob("step-*"))[-1]
    d = {f"w.{k}": v for k, v in load_file(str(ck / "model" / "model.safetensors")).items()}
    d["critic"] = torch.load(ck / "critic.pt", weights_only=True)["flat"]
    d["m"] = torch.load(ck / "optim.pt", weights_only=True)["m"]
    return d


def _rows(out: Path) -> int:
    f = out / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_ppo_killed_at_random_moments_resumes_bit_exact(tmp_path):
    """SIGKILL twice, each at a random moment (up to 0.6 s, saves slowed to be hit) after the
    run has logged a given step, then run to the end; every wait is bounded."""
    y = _cli_run(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCU_CHECKPOINT_TEST_SLEEP="0.05",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))

    def run(out, kill_at_rows=None, delay=0.0):
        p = subprocess.Popen([sys.executable, "-m", "rlcu.train.cli", "ppo", str(y), "--set", f"log.out_dir={out}",
                              "--resume", "auto"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
        end = time.monotonic() + 120
        if kill_at_rows is not None:
            while p.poll() is None and time.monotonic() < end and _rows(out) < kill_at_rows:
                time.sleep(0.02)
            time.sleep(delay)
            if p.poll() is None:
                p.kill()
                p.communicate()
                return None, ""
        try:
            _, err = p.communicate(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            pytest.fail("the run did not finish within 120 s")
        return p.returncode, err

    rc, err = run(tmp_path / "ref")
    assert rc == 0, err[-2000:]
    want = _final(tmp_path / "ref")
    rng = random.Random()
    for rows in (2, 4):
        rc, err = run(tmp_path / "k", kill_at_rows=rows, delay=rng.uniform(0.0, 0.6))
        assert rc in (None, 0), err[-2000:]
    rc, err = run(tmp_path / "k")
    assert rc == 0, err[-2000:]
    got = _final(tmp_path / "k")
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k}: max |d| {(want[k].float() - got[k].float()).abs().max():.3g}"
