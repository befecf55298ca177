"""The estimators' glue against hand computation (rlcu.train.losses): RLOO's leave-one-out
advantages, REINFORCE++'s returns with the KL in the reward and their whitening (with and
without the group baseline), Dr. GRPO's constant-normaliser token weights, and the config's
refusals of combinations that mean nothing."""

from __future__ import annotations

import math

import pytest
import torch

from rlcu.config import ConfigError, GRPOConfig, _build
from rlcu.train import losses


def test_rloo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, math.nan, 0.0, 0.5, math.nan, math.nan, math.nan])
    adv = losses.rloo_advantages(r, 4)
    want = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 2 - 2, 4 - 1, 0, 0 - 3, 0, 0, 0, 0]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)


def test_reinforce_pp_by_hand():
    """Two sequences (prompt tokens mask 0, an environment token mask 0 inside the second):
    r_t = -beta kl_t, the score on the last loss token, returns summed backwards, whitened
    over the loss's tokens; the baseline flavour's scores come in group-centred."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1, 0, 1, 1], dtype=torch.float32)
    kl = torch.tensor([9, 0.1, -0.2, 0.3, 9, 9, 0.5, 9, 0.0, 0.2])  # off-mask values must not leak
    beta = 0.5
    adv, m = losses.reinforce_pp_advantages(torch.tensor([1.0, -2.0]), cu, mask, kl, beta)
    # sequence 0: r = [-.05, .1, -.15 + 1]; sequence 1 (tokens 6, 8, 9): r = [-.25, 0, -.1 - 2]
    ret = torch.tensor([0.9, 0.95, 0.85, -2.35, -2.1, -2.1])
    want = (ret - ret.mean()) / (ret.std() + 1e-8)
    live = mask > 0
    assert torch.allclose(adv[live], want, atol=1e-5)
    assert torch.all(adv[~live] == 0)
    assert m["returns"] == pytest.approx(float(ret.mean()), abs=1e-6)
    assert m["kl_penalty"] == pytest.approx((0.2 + 0.7) / 2, abs=1e-6)
    # without a reference: the returns are the score on every loss token of its sequence
    adv0, _ = losses.reinforce_pp_advantages(torch.tensor([1.0, -2.0]), cu, mask, None, beta)
    assert torch.allclose(adv0[1:4], adv0[1].expand(3)) and adv0[1] > 0 > adv0[6]


def test_dr_grpo_token_weights():
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32)
    w = losses.token_weights(cu, mask, "seq_mean_token_sum_norm", horizon=6)
    assert torch.allclose(w, mask / (2 * 6))  # 2 sequences with loss tokens, L = 6, no length division
    w = losses.token_weights(cu, mask, "seq_mean_token_sum_norm", n_seqs=8, horizon=6)  # a micro-batch
    assert torch.allclose(w, mask / (8 * 6))
    with pytest.raises(ValueError, match="horizon"):
        losses.token_weights(cu, mask, "seq_mean_token_sum_norm")


def _cfg(**kw):
    return _build(GRPOConfig, dict(model=dict(tiny={}), **kw))


def test_estimator_config():
    c = _cfg()
    assert c.advantage == "grpo" and c.scales_rewards and not c.kl_in_reward  # the default: GRPO as before
    assert not _cfg(scale_rewards=False).scales_rewards
    assert not _cfg(advantage="rloo").scales_rewards
    assert _cfg(advantage="reinforce++", group_size=1, kl_coef=0.01).kl_in_reward
    with pytest.raises(ConfigError, match="scale_rewards"):
        _cfg(advantage="rloo", scale_rewards=True)
    with pytest.raises(ConfigError, match="group_size"):
        _cfg(advantage="rloo", group_size=1)
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        _cfg(advantage="reinforce++", group_size=1, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="advantage"):
        _cfg(advantage="gae")
    with pytest.raises(ConfigError, match="importance_sampling_level"):
        _cfg(importance_sampling_level="seq")
