"""SFT, GRPO and PPO at 2 ranks (gloo, CPU) end with the weights of one process; a checkpoint
of 2 ranks resumes in one process and one of one process at 2 ranks; only rank 0 writes logs."""

from __future__ import annotations

import json

import pytest
import torch
from support.parallel_util import ok, run_ranks
from support.trainers import first_is_even, grpo_config, ppo_trainer, sft_config, tiny, token_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SFT_SETS = ("optim.lr=3e-2", "optim.max_grad_norm=0.5", "grad_accum=4", "batch_tokens=24", "steps=4",
            "checkpoint.every=2", "checkpoint.keep_last=0")
SFT_TOL = 5e-5
GRPO_KW = dict(steps=3, kl_coef=0.05, micro_batch_tokens=24, dynamic_sampling=True,
               old_logprobs="recompute", behaviour_correction="tis",  # each rank recomputes its own sequences
               optim=dict(lr=3e-2))


def _sft(out, *sets):
    from rlcu.train.sft import SFTTrainer

    tr = SFTTrainer(sft_config(out, *SFT_SETS, *sets), token_rows(24), model=tiny())
    tr.train()
    return tr


def _grpo(out):
    from rlcu.data import synthetic as syn
    from rlcu.train.grpo import GRPOTrainer

    cfg, tok = grpo_config(out, **GRPO_KW)
    tr = GRPOTrainer(cfg, syn.sort_rows(64, "train", min_len=2, max_len=3), [first_is_even], tokenizer=tok)
    return tr, tr.train()


def _ppo(tmp, **kw):
    tr = ppo_trainer(tmp, steps=3, micro_batch_tokens=24, optim=dict(lr=3e-2), critic=dict(optim=dict(lr=3e-2)),
                     checkpoint=dict(every=2, save_at_end=False, keep_last=0, **kw))
    return tr, tr.train()


def _ranks(rank, tmp):
    a = _sft(tmp / "sft2")
    b = _sft(tmp / "sft1", "checkpoint.resume=auto")  # resumes the one-process run's step 2 (1 -> 2)
    g, hist = _grpo(tmp / "grpo2")
    return {"sft": a.model.flat.clone(), "sft_resumed": b.model.flat.clone(), "grpo": g.model.flat.clone(),
            "grpo_hist": hist, "opt": type(a.optimizer).__name__}


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_sft_and_grpo_two_ranks_equal_one_process(tmp_path):
    _sft(tmp_path / "sft1", "steps=2")  # the 1 -> 2 resume's checkpoint
    d, _ = run_ranks(_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    assert r0["opt"] == "ShardedAdamW"
    ref = _sft(tmp_path / "ref")
    assert _rel(ref.model.flat, tiny().flat) > 1e-2
    for k in ("sft", "sft_resumed", "grpo"):
        assert torch.equal(r0[k], r1[k]), k
    # the ranks pack the step's examples into other micro-batches: fp32 sums in another order,
    # which Adam at lr 3e-2 carries to ~1e-5 in 4 steps (summing one process's micro-batches in
    # another order alone moves it 7e-6)
    assert _rel(r0["sft"], ref.model.flat) < SFT_TOL
    assert _rel(r0["sft_resumed"], ref.model.flat) < SFT_TOL
    # 2 -> 1: the 2-rank run's step-2 checkpoint (sharded optimizer state) continued in one process
    ck = tmp_path / "sft2" / "checkpoints"
    assert sorted(p.name for p in (ck / "step-000002" / "optim").iterdir()) == [
        "rank-00000-of-00002.pt", "rank-00001-of-00002.pt"]
    assert not list(ck.glob(".*"))  # no temp or shard folder left behind
    import shutil

    shutil.rmtree(ck / "step-000004")
    c = _sft(tmp_path / "sft2", "checkpoint.resume=auto")
    assert _rel(c.model.flat, ref.model.flat) < SFT_TOL
    # metrics written once, by rank 0: one row per step
    rows = [json.loads(x) for x in (tmp_path / "grpo2" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    g, hist = _grpo(tmp_path / "grpo1")
    assert _rel(g.model.flat, _grpo_init(tmp_path / "init")) > 1e-3
    assert _rel(r0["grpo"], g.model.flat) < 1e-5, _rel(r0["grpo"], g.model.flat)
    for a, b in zip(r0["grpo_hist"], hist):  # the same samples, rewards and global statistics
        assert a["reward"] == b["reward"] and a["completion_len"] == b["completion_len"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        # the recomputed old logprobs cover every sequence on every rank: the metrics are one process's
        assert a["mismatch/abs_mean"] == pytest.approx(b["mismatch/abs_mean"], abs=1e-6)  # both fp32 rounding
        assert a["correction/capped_frac"] == b["correction/capped_frac"]


def _grpo_init(tmp_path):
    from rlcu.data import synthetic as syn
    from rlcu.train.grpo import GRPOTrainer

    cfg, tok = grpo_config(tmp_path, **GRPO_KW)
    return GRPOTrainer(cfg, syn.sort_rows(8, "train", min_len=2, max_len=3), [first_is_even],
                       tokenizer=tok).model.flat.clone()


def test_ppo_two_ranks_equal_one_process_and_resume_in_one(tmp_path):
    """PPO (critic with its sharded optimizer, GAE, whitening, running reward moments over the
    whole batch) at 2 ranks == one process; its step-2 checkpoint (the policy's and the critic's
    optimizer shards) continued in one process ends there too."""
    d, _ = run_ranks(_ppo_ranks, 2, tmp_path, tmp_path, timeout=240)
    r0, r1 = ok(d)
    assert torch.equal(r0[0], r1[0]) and torch.equal(r0[1], r1[1])
    ref, hist = _ppo(tmp_path / "ppo1")
    assert _rel(r0[0], ref.model.flat) < 1e-5, _rel(r0[0], ref.model.flat)
    assert _rel(r0[1], ref.critic.flat) < 1e-5, _rel(r0[1], ref.critic.flat)
    for a, b in zip(r0[2], hist):
        assert a["reward"] == b["reward"] and a["vf_loss"] == pytest.approx(b["vf_loss"], rel=1e-4)
    ck = tmp_path / "ppo2" / "run" / "checkpoints"
    assert (ck / "step-000002" / "critic_optim" / "rank-00001-of-00002.pt").exists()
    import shutil

    shutil.rmtree(ck / "step-000003", ignore_errors=True)
    c, _ = _ppo(tmp_path / "ppo2", resume="auto")
    assert _rel(c.model.flat, ref.model.flat) < 1e-5 and _rel(c.critic.flat, ref.critic.flat) < 1e-5


def _ppo_ranks(rank, tmp):
    p, hist = _ppo(tmp / "ppo2")
    return p.model.flat.clone(), p.critic.flat.clone(), hist
