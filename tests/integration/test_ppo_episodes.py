"""Multi-turn PPO (issue 36) on the CPU twins: GAE over an episode's model tokens only, against a
hand computation on a 3-turn trajectory (the environment's tokens skipped: no advantage, no
return, no loss), the multi_turn section in PPO configs, and one multi-turn PPO step end to end
through the engine's run_episodes."""

import math

import pytest
import torch
from support.episode_trainer import ppo_trainer
from support.trainers import TINY

from rlcu.config import ConfigError, PPOConfig, _build
from rlcu.train import rollout as ro

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def words_said(completions, **_):
    return [float(sum(len(m["content"].split()) for m in c if m["role"] == "assistant")) for c in completions]


def hand_gae(r: list[float], v: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    a, adv = 0.0, []
    for t in reversed(range(len(r))):
        nv = v[t + 1] if t + 1 < len(r) else 0.0
        a = r[t] + gamma * nv - v[t] + gamma * lam * a
        adv.append(a)
    adv.reverse()
    return adv, [x + y for x, y in zip(adv, v)]


def test_gae_runs_over_a_3_turn_trajectorys_model_tokens_only(tmp_path):
    """Turns of 2, 2 and 3 model tokens between replies of 3 and 2 environment tokens: the 7 model
    tokens are GAE's 7 time steps (V of the token after a reply: the state after it), the score
    lands on the last one, the KL penalty on each; environment tokens get 0 advantage and return.
    A sample kept out of the loss gets neither."""
    tr, _ = ppo_trainer(tmp_path, whiten_advantages=False, gamma=0.9, lam=0.8, kl_coef=0.5)
    mm = [1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    P, C = 4, len(mm)
    g = torch.Generator().manual_seed(0)
    lp = [x if m else 0.0 for x, m in zip((-torch.rand(C, generator=g)).tolist(), mm)]
    s = ro.Sample(0, [5] * P, list(range(6, 6 + C)), lp, "stop", {}, model_mask=mm)
    b = ro.pack([s, s], torch.tensor([True, False]))
    N = b.num_tokens
    b.fields["values"] = torch.randn(N, generator=g)
    b.fields["ref_lp"] = -torch.rand(N, generator=g)
    tr.advantages(b, torch.tensor([2.0, 5.0]))
    pos = [P + t for t, m in enumerate(mm) if m]  # the model tokens' positions in the packed stream
    kl = [b.old_lp[i].item() - b.fields["ref_lp"][i].item() for i in pos]
    r = [-0.5 * k for k in kl]
    r[-1] += 2.0
    want_a, want_r = hand_gae(r, [b.fields["values"][i].item() for i in pos], 0.9, 0.8)
    adv, ret = b.fields["adv"], b.fields["returns"]
    assert adv[pos].tolist() == pytest.approx(want_a, abs=1e-5)
    assert ret[pos].tolist() == pytest.approx(want_r, abs=1e-5)
    others = [i for i in range(N) if i not in pos]  # the prompt, the environment's tokens, the masked sample
    assert not adv[others].any() and not ret[others].any()
    # an environment token is not a time step: without it the same model tokens give the same numbers
    flat = ro.Sample(0, [5] * P, [6 + t for t, m in enumerate(mm) if m], [lp[t] for t in range(C) if mm[t]], "stop", {})
    b2 = ro.pack([flat], torch.tensor([True]))
    keep = [i for i in range(P)] + pos
    b2.fields["values"], b2.fields["ref_lp"] = b.fields["values"][keep], b.fields["ref_lp"][keep]
    tr.advantages(b2, torch.tensor([2.0]))
    assert torch.equal(b2.fields["adv"][P:], adv[pos]) and torch.equal(b2.fields["returns"][P:], ret[pos])


def test_multi_turn_in_ppo_configs(tmp_path):
    base = dict(model=dict(tiny=dict(TINY, vocab_size=40)), log=dict(out_dir=str(tmp_path)))
    cfg = _build(PPOConfig, {**base, "multi_turn": {"environment": "rlcu.tools.lookup:Lookup", "max_turns": 3}})
    assert cfg.multi_turn.enabled and cfg.multi_turn.max_turns == 3 and cfg.sequence_new_tokens() == 1024
    cases = [({"multi_turn": {"environment": "no_colon"}}, "multi_turn.environment must be 'module.path:Class'"),
             ({"multi_turn": {"max_turns": 0}}, "multi_turn.max_turns must be >= 1"),
             ({"rewards": []}, "rewards is empty: give a reward function, or a multi_turn.environment"),
             ({"multi_turn": {"tools": ["rlcu.tools:python"]}, "chat_template": False},
              "multi_turn needs chat_template: true")]
    for extra, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            _build(PPOConfig, {**base, **extra})


def test_one_multi_turn_ppo_step_runs_end_to_end(tmp_path):
    tr, _ = ppo_trainer(tmp_path, rewards=[words_said])
    pol, crit = tr.model.flat.detach().clone(), tr.critic.flat.detach().clone()
    seen = []
    orig = tr.advantages
    tr.advantages = lambda batch, scores: (seen.append(batch), orig(batch, scores))[1]
    m = tr.train()[-1]
    assert m["episodes/turns_max"] >= 2 and 1 <= m["episodes/turns"] <= 3
    assert math.isfinite(m["loss"]) and math.isfinite(m["vf_loss"])
    assert not torch.equal(pol, tr.model.flat) and not torch.equal(crit, tr.critic.flat)
    b = seen[0]
    env = b.mask == 0  # the prompts' and the environment's tokens (every episode was scored)
    assert env.sum() > sum(b.prompt_lens)  # some episode had an environment reply
    assert not b.fields["adv"][env].any() and not b.fields["returns"][env].any()
