"""Each estimator trains: a short GRPO run on the CPU twins per choice (GSPO and GSPO-token's
sequence ratio, RLOO, REINFORCE++ with its KL in the reward and its baseline flavour, Dr.
GRPO's advantage and constant normaliser) raises the reward of the tiny 'start with 7' task
from random weights, and logs its metrics finite. GSPO-token at ratio 1 is the token ratio's
update through the trainer (the model's forward and backward against the fused head sweep);
GSPO runs under PPO's critic, in exact mode (the engine's logprobs bit for bit) and at 2 ranks
as one process. Each run is a few seconds (the 2-rank one ~25 s)."""

from __future__ import annotations

import math

import pytest
import torch
from support.hf_util import rel_err
from support.trainers import first_is_even, first_is_seven, grpo_trainer, ppo_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ESTIMATORS = {
    "gspo": dict(importance_sampling_level="sequence", loss_agg="seq_mean", mu=2, clip_low=3e-3, clip_high=4e-3),
    "gspo_token": dict(importance_sampling_level="sequence_token", loss_agg="seq_mean"),
    "rloo": dict(advantage="rloo"),
    "reinforce++": dict(advantage="reinforce++", kl_coef=0.01),
    "reinforce++_baseline": dict(advantage="reinforce++_baseline", kl_coef=0.01),
    "dr_grpo": dict(scale_rewards=False, loss_agg="seq_mean_token_sum_norm"),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimator_raises_the_reward(tmp_path, name):
    tr = grpo_trainer(tmp_path, rewards=[first_is_seven], steps=6, prompts_per_step=8, group_size=8,
                      max_new_tokens=2, optim=dict(lr=2e-2), **ESTIMATORS[name])
    hist = tr.train()
    first = sum(h["reward"] for h in hist[:2]) / 2
    last = sum(h["reward"] for h in hist[-3:]) / 3
    assert last > first + 0.3, [round(h["reward"], 3) for h in hist]
    for k in ("loss", "pg_loss", "clip_frac", "ratio", "adv_abs", "grad_norm"):
        assert all(math.isfinite(h[k]) for h in hist), k
    if name == "gspo":  # a tight sequence clip with two updates a batch: some sequences clip
        assert any(h["clip_frac"] > 0 for h in hist)
    if name.startswith("reinforce"):
        assert all(math.isfinite(h["kl_penalty"]) and "returns" in h for h in hist)


def test_gspo_token_at_ratio_one_is_the_token_update(tmp_path):
    """old_logprobs: recompute and one update: every ratio is 1, so GSPO-token's gradient is the
    token-level one (KL and entropy included), though its update runs model.forward then
    model.backward where the token loss rides the fused head sweep. (So is GSPO's here: each
    sequence's mean of a gradient that is constant along it.)"""
    kw = dict(rewards=[first_is_even], steps=1, old_logprobs="recompute", kl_coef=0.05, entropy_coef=0.01,
              optim=dict(release_grads=False, max_grad_norm=0.0))  # the step's gradient kept, unclipped
    a = grpo_trainer(tmp_path / "a", **kw)
    b = grpo_trainer(tmp_path / "b", importance_sampling_level="sequence_token", **kw)
    ha, hb = a.train()[0], b.train()[0]
    assert ha["reward"] == hb["reward"] and hb["clip_frac"] == 0
    assert rel_err(b.model.grad_flat, a.model.grad_flat) < 1e-5
    assert hb["loss"] == pytest.approx(ha["loss"], rel=1e-5, abs=1e-7)


def test_gspo_under_ppo(tmp_path):
    tr = ppo_trainer(tmp_path, importance_sampling_level="sequence", loss_agg="seq_mean", mu=2)
    w0 = tr.model.flat.clone()
    hist = tr.train()
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["vf_loss"]) for h in hist)
    assert not torch.equal(tr.model.flat, w0)


EST_DP_KW = dict(steps=2, advantage="reinforce++", kl_coef=0.05, importance_sampling_level="sequence",
                 loss_agg="seq_mean_token_sum_norm", micro_batch_tokens=24, optim=dict(lr=3e-2))


def _est_run(rank, out):
    tr = grpo_trainer(out, rewards=[first_is_even], **EST_DP_KW)
    w0 = tr.model.flat.clone()
    hist = tr.train()
    return w0, tr.model.flat.clone(), hist


def test_estimators_two_ranks_equal_one_process(tmp_path):
    """REINFORCE++ (whitened over the whole batch, its KL reward from each rank's reference
    logprobs summed), GSPO's sequence ratio and Dr. GRPO's normaliser at 2 ranks (gloo) end with
    one process's weights. Two spawned ranks cost ~25 s on 2 loaded cores; one run covers the three."""
    from support.parallel_util import ok, run_ranks

    d, _ = run_ranks(_est_run, 2, tmp_path, tmp_path / "two", timeout=240)
    (init, w0, h0), (_, w1, _) = ok(d)
    _, w, h = _est_run(0, tmp_path / "one")
    assert torch.equal(w0, w1)
    assert rel_err(w - init, w0 - init) < 1e-4 and rel_err(w, init) > 1e-3
    for a, b in zip(h0, h):
        assert a["reward"] == b["reward"] and a["kl_penalty"] == pytest.approx(b["kl_penalty"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)


def test_gspo_in_exact_mode_sees_the_engines_logprobs(tmp_path):
    """Exact mode through the sequence-level pass: its forward's logprobs are the engine's bit for
    bit (the mismatch metric reads them), so the first update's sequence ratios are exactly 1."""
    tr = grpo_trainer(tmp_path, rewards=[first_is_even], steps=1, exact=True, importance_sampling_level="sequence")
    h = tr.train()[0]
    assert h["mismatch/exact_frac"] == 1.0 and h["ratio"] == 1.0 and h["clip_frac"] == 0
