"""PPO: GAE against a hand computation, reward normalisation, the critic's forward and
backward against HF transformers + autograd, a PPO step that runs and fits the values,
and resume with the critic's state."""

from __future__ import annotations

import math

import pytest
import torch
from support.hf_util import make_hf_model, rel_err
from support.trainers import TINY, ppo_trainer

from rlcu.data import synthetic as syn
from rlcu.train import losses
from rlcu.train.critic import Critic

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8
    lengths = [3, 1, 4]
    g = torch.Generator().manual_seed(0)
    r = torch.randn(sum(lengths), generator=g)
    v = torch.randn(sum(lengths), generator=g)
    adv, ret = losses.gae(r, v, lengths, gamma, lam)
    want_a, want_r, o = [], [], 0
    for L in lengths:
        rs, vs = r[o : o + L].tolist(), v[o : o + L].tolist()
        a, out = 0.0, []
        for t in reversed(range(L)):
            nv = vs[t + 1] if t + 1 < L else 0.0
            a = rs[t] + gamma * nv - vs[t] + gamma * lam * a
            out.append(a)
        out.reverse()
        want_a += out
        want_r += [x + y for x, y in zip(out, vs)]
        o += L
    assert torch.allclose(adv, torch.tensor(want_a), atol=1e-6)
    assert torch.allclose(ret, torch.tensor(want_r), atol=1e-6)
    # lambda = 1, gamma = 1: the advantage is the reward-to-go minus the value
    adv1, ret1 = losses.gae(r, v, lengths, 1.0, 1.0)
    assert torch.allclose(ret1[:3], r[:3].flip(0).cumsum(0).flip(0), atol=1e-6)


def test_running_moments():
    rm = losses.RunningMoments()
    xs = [torch.randn(7), torch.randn(5) * 3 + 1, torch.tensor([2.0, math.nan, -1.0])]
    for x in xs:
        rm.update(x)
    allx = torch.cat([x[~torch.isnan(x)] for x in xs]).double()
    assert rm.mean == pytest.approx(float(allx.mean()), rel=1e-9)
    assert rm.var == pytest.approx(float(allx.var(unbiased=False)), rel=1e-9)
    rm2 = losses.RunningMoments()
    rm2.load_state_dict(rm.state_dict())
    assert rm2.normalise(torch.tensor([1.0])).item() == rm.normalise(torch.tensor([1.0])).item()


def test_critic_matches_hf_autograd(tmp_path):
    from rlcu.model.causal_lm import Qwen3

    hf, folder = make_hf_model(tmp_path, tied=False)
    pol = Qwen3.from_pretrained(folder)
    critic = Critic.from_trunk(pol, head_init_std=0.1, seed=1)
    assert critic.flat.data_ptr() != pol.flat.data_ptr()
    g = torch.Generator().manual_seed(0)
    lens = [7, 11, 5]
    tokens = torch.randint(0, 333, (sum(lens),), generator=g)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    dv = torch.randn(sum(lens), generator=g)
    critic.zero_grad()
    v = critic.forward(tokens, cu)
    critic.backward(dv)
    # oracle: HF's final-normed hidden states, the same head, autograd
    hf.zero_grad()
    w = critic.head_w.detach().clone().requires_grad_(True)
    b = critic.head_b.detach().clone().requires_grad_(True)
    vs = []
    for i in range(len(lens)):
        ids = tokens[cu[i] : cu[i + 1]][None]
        h = hf.model(input_ids=ids).last_hidden_state[0]  # [L, H]
        vs.append(torch.cat([torch.zeros(1), h[:-1] @ w + b]))
    v_ref = torch.cat(vs)
    (v_ref * dv).sum().backward()
    assert rel_err(v, v_ref.detach()) < 1e-5
    assert rel_err(critic.dhead_w, w.grad) < 1e-5 and rel_err(critic.dhead_b, b.grad) < 1e-5
    for name, p in hf.named_parameters():
        if name == "lm_head.weight":
            assert float(critic.trunk.grads[name].abs().max()) == 0.0  # the LM head is unused
            continue
        assert rel_err(critic.trunk.grads[name], p.grad) < 1e-4, name


def test_ppo_step_runs_and_fits_values(tmp_path):
    from rlcu.train import rollout as ro

    tr = ppo_trainer(tmp_path)
    hist = tr.train()
    assert len(hist) == 2
    for h in hist:
        for k in ("reward", "vf_loss", "loss", "kl_penalty", "explained_var", "entropy", "clip_frac"):
            assert k in h and math.isfinite(h[k]), (k, h.get(k))
    # one fixed batch: repeated critic updates drive its value loss down
    samples = tr._engine_phase(lambda: tr.rollout(tr.rows[:4], 2, seed=9))
    tr.score(samples)
    batch = ro.pack(samples, device=tr.device)
    batch.fields["ref_lp"] = ro.batch_logprobs(tr.ref, batch, 1.0, 64)
    batch.fields["values"] = tr._values(batch)
    scores = torch.tensor([s.reward for s in samples])
    tr.advantages(batch, scores)
    vf = [tr._critic_update(batch, 0, 1)["vf_loss"] for _ in range(12)]
    assert vf[-1] < 0.5 * vf[0], vf


def test_ppo_bf16_mode_with_bf16_gradients(tmp_path):
    """Policy and critic in the bf16 mode (no master, bf16 moments and gradients): the critic's
    buffer (its trunk's gradients a view of it) is bf16, and both models' weights move."""
    bf16 = dict(master_weights=False, state_dtype="bfloat16", grad_dtype="bfloat16", release_grads=False)
    tr = ppo_trainer(tmp_path, steps=1, model=dict(dtype="bfloat16"),
                     optim=dict(lr=3e-3, **bf16), critic=dict(optim=dict(lr=3e-3, **bf16)))
    w0, c0 = tr.model.flat.clone(), tr.critic.flat.clone()
    h = tr.train()[0]
    assert all(math.isfinite(h[k]) for k in ("loss", "vf_loss", "grad_norm"))
    assert tr.model.grad_flat.dtype == torch.bfloat16 and tr.critic.grad_flat.dtype == torch.bfloat16
    assert tr.critic.trunk.grad_flat.data_ptr() == tr.critic.grad_flat.data_ptr()
    assert (tr.model.flat != w0).any() and (tr.critic.flat != c0).any()


def test_ppo_resume_restores_critic(tmp_path):
    kw = dict(steps=3, checkpoint=dict(every=1, save_at_end=True))
    a = ppo_trainer(tmp_path / "a", **kw)
    ha = a.train()
    b = ppo_trainer(tmp_path / "b", **{**kw, "steps": 1})
    b.train()
    c = ppo_trainer(tmp_path / "b", **{**kw, "checkpoint": dict(every=1, save_at_end=True, resume="auto")})
    hc = c.train()
    strip = lambda hs: [{k: v for k, v in h.items() if not k.startswith("time/")} for h in hs]  # noqa: E731
    assert strip(ha) == strip(hc)
    assert torch.equal(a.critic.flat, c.critic.flat) and torch.equal(a.model.flat, c.model.flat)
    assert a.score_stats.state_dict() == c.score_stats.state_dict()


@pytest.mark.gpu
def test_ppo_on_gpu_kernels(tmp_path):
    tr = ppo_trainer(tmp_path, steps=3, model=dict(tiny=dict(TINY, vocab_size=syn.make_tokenizer().vocab_size,
                                                             eos_token_id=syn.make_tokenizer().eos_token_id),
                                                   device="cuda", dtype="bfloat16"))
    assert tr.critic.flat.is_cuda and tr.critic.flat.dtype == torch.bfloat16
    hist = tr.train()
    for h in hist:
        for k in ("vf_loss", "loss", "explained_var", "kl_penalty"):
            assert math.isfinite(h[k]), (k, h)
