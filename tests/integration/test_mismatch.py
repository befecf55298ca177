"""The train/inference mismatch metrics and the behaviour-policy corrections
(rlcu.train.mismatch): the metrics and the TIS / MIS weights against hand computations, the
corrected loss and its gradient against autograd of the formulas, the first update's
logprobs as the metrics' source, GRPO and PPO runs in each mode (the first update's ratio is
exactly 1 with old_logprobs: recompute), and the config errors."""

from __future__ import annotations

import importlib.util
import json
import math
import types

import pytest
import torch
from support.hf_util import rel_err
from support.trainers import first_is_even, grpo_trainer, ppo_trainer

from rlcu.ops.rl_loss import policy_loss
from rlcu.train import losses
from rlcu.train import rollout as ro
from rlcu.train.mismatch import (
    MISMATCH_KEYS,
    StepCorrection,
    behaviour_weights,
    mismatch_metrics,
    quantile,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CU = torch.tensor([0, 3, 7, 9], dtype=torch.int32)


def _f32(xs):
    return torch.tensor(xs, dtype=torch.float32)


# ---------------------------------------------------------------- metrics by hand
def test_quantile_by_hand():
    x = _f32([5, 1, 4, 2, 3])
    assert float(quantile(x, 0.25)) == 2.0
    assert float(quantile(x, 0.01)) == pytest.approx(1 + 0.04)
    assert float(quantile(x, 0.99)) == pytest.approx(4 + 0.96)
    assert float(quantile(_f32([7]), 0.99)) == 7.0


def test_metrics_by_hand():
    mask = _f32([0, 1, 1, 0, 1, 1, 1, 0, 0])  # the third sequence has no loss token
    eng = _f32([0, -1.0, -2.0, 0, -0.5, -1.5, -3.0, 0, 0])
    tr = _f32([5, -1.0, -1.8, 0, -0.6, -1.5, -2.5, 7, 7])  # off the mask: anything
    m = mismatch_metrics(tr, eng, mask, CU)
    assert list(m) == list(MISMATCH_KEYS)
    # d = lp_train - lp_engine on the loss tokens, from the fp32 values
    t, e = tr.tolist(), eng.tolist()
    d = [t[i] - e[i] for i in (1, 2, 4, 5, 6)]  # ~[0, 0.2, -0.1, 0, 0.5]
    assert m["mismatch/abs_mean"] == pytest.approx(sum(abs(x) for x in d) / 5, rel=1e-12)
    assert m["mismatch/abs_max"] == pytest.approx(0.5, rel=1e-12)
    assert m["mismatch/exact_frac"] == 2 / 5
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 5, rel=1e-12)
    r = sorted(math.exp(x) for x in d)
    assert m["mismatch/ratio_p01"] == pytest.approx(r[0] + 0.04 * (r[1] - r[0]), rel=1e-12)
    assert m["mismatch/ratio_p99"] == pytest.approx(r[3] + 0.96 * (r[4] - r[3]), rel=1e-12)
    assert m["mismatch/seq_abs_sum"] == pytest.approx((abs(d[0] + d[1]) + abs(d[2] + d[3] + d[4])) / 2, rel=1e-12)
    assert mismatch_metrics(tr, eng, torch.zeros(9), CU) == {}
    same = mismatch_metrics(eng, eng, mask, CU)
    assert same["mismatch/exact_frac"] == 1 and same["mismatch/abs_max"] == 0 and same["mismatch/kl_k3"] == 0


# ---------------------------------------------------------------- weights by hand
MASK = _f32([0, 1, 1, 0, 1, 1, 1, 0, 1])
RHO = [1, 3.0, 0.4, 1, 1.5, 0.9, 1.0, 1, 0.25]  # per-token pi_old / mu (1 off the mask)
ENG = _f32([0, -1.0, -2.0, 0, -0.5, -1.5, -3.0, 0, -0.7])
OLD = ENG + torch.log(torch.tensor(RHO, dtype=torch.float64)).float()


def test_tis_weights_by_hand():
    b, keep, m = behaviour_weights(OLD, ENG, MASK, CU, "tis", tis_cap=2.0)
    want = [0, 2.0, 0.4, 0, 1.5, 0.9, 1.0, 0, 0.25]
    assert keep is None and torch.allclose(b, _f32(want), rtol=1e-6)
    assert m["correction/capped_frac"] == pytest.approx(1 / 6)
    assert m["correction/weight_mean"] == pytest.approx(sum(want) / 6, rel=1e-6)


def test_mis_token_weights_by_hand():
    b, keep, m = behaviour_weights(OLD, ENG, MASK, CU, "mis_token", mis_low=0.5, mis_high=2.0)
    assert torch.allclose(b, _f32([0, 0, 0, 0, 1.5, 0.9, 1.0, 0, 0]), rtol=1e-6)
    assert keep.tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0]
    assert m["correction/rejected_frac"] == pytest.approx(3 / 6)
    assert m["correction/weight_mean"] == pytest.approx((1.5 + 0.9 + 1.0) / 3, rel=1e-6)


def test_mis_seq_weights_by_hand():
    """The sequence ratio is the product of its tokens' (verl's sequence level), not the
    geometric mean: with bounds [0.5, 1.3], sequence 1 (1.5 * 0.9 * 1.0 = 1.35, geometric mean
    1.105) is rejected."""
    b, keep, m = behaviour_weights(OLD, ENG, MASK, CU, "mis_seq", mis_low=0.5, mis_high=2.0)
    assert torch.allclose(b, _f32([0, 1.2, 1.2, 0, 1.35, 1.35, 1.35, 0, 0]), rtol=1e-5)
    assert keep.tolist() == [0, 1, 1, 0, 1, 1, 1, 0, 0]
    assert m["correction/rejected_seq_frac"] == pytest.approx(1 / 3)
    assert m["correction/rejected_frac"] == pytest.approx(1 / 6)
    b, keep, m = behaviour_weights(OLD, ENG, MASK, CU, "mis_seq", mis_low=0.5, mis_high=1.3)
    assert keep.tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0]
    assert m["correction/rejected_seq_frac"] == pytest.approx(2 / 3)
    assert behaviour_weights(OLD, ENG, MASK, CU, "none") == (None, None, {})
    with pytest.raises(ValueError, match="behaviour_correction must be one of"):
        behaviour_weights(OLD, ENG, MASK, CU, "is")


def test_extreme_ratios_stay_finite():
    eng = _f32([0, -80.0, -0.1, 0, -0.1, -0.1, -0.1, 0, -0.1])
    old = _f32([0, -0.1, -90.0, 0, -0.1, -0.1, -0.1, 0, -0.1])
    for mode in ("tis", "mis_token", "mis_seq"):
        b, _, m = behaviour_weights(old, eng, MASK, CU, mode)
        assert torch.isfinite(b).all() and all(math.isfinite(v) for v in m.values()), mode


# ---------------------------------------------------------------- the corrected loss vs autograd
def _formula_loss(lp, old, eng, adv, mask, mode, beta, ref):
    """The corrected objective written from its definition, differentiated by autograd:
    sum_i w_i (b_i max(-r A, -clip(r) A) + beta k3), b_i from its formula (no gradient),
    w_i over the kept tokens (the token aggregation)."""
    live = mask > 0
    logr = (old - eng).double()
    if mode == "tis":
        b, kept = torch.exp(logr).clamp(max=2.0), live
    elif mode == "mis_token":
        rho = torch.exp(logr)
        kept = live & (rho >= 0.5) & (rho <= 2.0)
        b = rho
    else:
        ids = torch.repeat_interleave(torch.arange(3), (CU[1:] - CU[:-1]).long())
        s = torch.zeros(3, dtype=torch.float64).index_add_(0, ids, torch.where(live, logr, torch.zeros_like(logr)))
        rho = torch.exp(s)[ids]
        kept = live & (rho >= 0.5) & (rho <= 2.0)
        b = rho
    w = kept.double() / kept.sum()
    x = lp.clone().double().requires_grad_(True)
    xm = torch.where(kept, x, old.double())
    r = torch.exp(xm - old.double())
    pg = torch.maximum(-r * adv.double(), -r.clamp(0.8, 1.2) * adv.double())
    k = ref.double() - xm
    loss = (w * (torch.where(kept, b, torch.zeros_like(b)) * pg + beta * (torch.exp(k) - k - 1))).sum()
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("mode", ["tis", "mis_token", "mis_seq"])
def test_corrected_loss_and_gradient_vs_autograd(mode):
    g = torch.Generator().manual_seed(6)
    eng = -torch.rand(9, generator=g) * 2
    old = eng + 0.9 * torch.randn(9, generator=g)  # ratios well inside and outside the bounds
    lp = old + 0.3 * torch.randn(9, generator=g)
    ref = old + 0.2 * torch.randn(9, generator=g)
    adv = torch.randn(9, generator=g)
    b, keep, _ = behaviour_weights(old, eng, MASK, CU, mode, tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    pmask = MASK if keep is None else MASK * keep
    w = losses.token_weights(CU, pmask, "token")
    loss, dlp, _, _ = policy_loss(lp, old, ref, adv, w, clip_low=0.2, clip_high=0.2, kl_coef=0.1, is_w=b)
    L, grad = _formula_loss(lp, old, eng, adv, MASK, mode, 0.1, ref)
    assert loss.sum().item() == pytest.approx(L.item(), rel=1e-5, abs=1e-7)
    assert rel_err(dlp, grad) < 1e-5
    if mode == "tis":
        assert 0 < float((b == 2.0).sum()) < float(MASK.sum())  # the case caps some tokens, not all
    else:
        assert 0 < float(keep.sum()) < float(MASK.sum())  # the case rejects some tokens, not all


# ---------------------------------------------------------------- StepCorrection on a hand batch
class _TableModel:
    """A stand-in policy whose logprob of token t is table[t] (0 at each sequence's first token)."""

    def __init__(self, table):
        self.table = table

    def forward(self, tokens, cu_seqlens, *, temperature=1.0, grad=True, return_entropy=False):
        lp = self.table[tokens]
        lp[cu_seqlens[:-1].long()] = 0.0
        return lp


def _cfg(**kw):
    d = {"old_logprobs": "recompute", "behaviour_correction": "none", "tis_cap": 2.0, "mis_low": 0.5,
         "mis_high": 2.0, "temperature": 1.0, "micro_batch_tokens": 4, "group_size": 1}
    d.update(kw)
    return types.SimpleNamespace(**d)


def _hand_batch():
    s = [ro.Sample(0, [1], [2, 3], [-1.0, -2.0], "stop", {}), ro.Sample(0, [1], [4, 5, 6], [-0.5, -1.5, -3.0],
                                                                      "stop", {}),
         ro.Sample(1, [1], [7], [-0.7], "stop", {})]
    return ro.pack(s, torch.tensor([True, True, False]))


def test_step_correction_recompute_and_policy_batch():
    table = torch.zeros(8)
    table[2:8] = _f32([-1.0, -1.0, -0.2, -1.5, -4.0, -0.1])  # ratios 1, e^1, e^0.3, 1, e^-1 on the kept tokens
    batch = _hand_batch()
    engine = batch.old_lp.clone()
    sc = StepCorrection(_cfg(behaviour_correction="mis_token"), _TableModel(table), batch)
    assert torch.equal(sc.engine_lp, engine)
    assert torch.equal(batch.old_lp, _f32([0, -1.0, -1.0, 0, -0.2, -1.5, -4.0, 0, -0.1]))  # the trainer's, 0 on prompts
    m = sc.metrics()
    assert m["mismatch/exact_frac"] == pytest.approx(2 / 5)  # tokens 2 (-1 == -1) and 5 (-1.5 == -1.5)
    assert m["mismatch/abs_max"] == pytest.approx(1.0, rel=1e-6)
    pb = sc.policy_batch()
    assert pb.mask.tolist() == [0, 1, 0, 0, 1, 1, 0, 0, 0]  # e^1 and e^-1 rejected; sample 3 was masked
    assert batch.mask.tolist() == [0, 1, 1, 0, 1, 1, 1, 0, 0]  # the batch's own mask is untouched
    assert torch.allclose(pb.fields["is_w"], _f32([0, 1, 0, 0, math.exp(0.3), 1, 0, 0, 0]), rtol=1e-5)
    w = losses.token_weights(pb.cu_seqlens, pb.mask, "token", n_tokens=float(pb.mask.sum()))
    assert float(w.sum()) == pytest.approx(1.0) and float(w[2]) == 0  # rejected tokens leave the normaliser
    assert StepCorrection(_cfg(), _TableModel(table), _hand_batch()).policy_batch().fields.get("is_w") is None


def test_step_correction_rejects_correction_without_recompute():
    with pytest.raises(ValueError, match="needs old_logprobs: recompute"):
        StepCorrection(_cfg(old_logprobs="engine", behaviour_correction="tis"), None, _hand_batch())


# ---------------------------------------------------------------- trainers
def _noisy_engine(tr, sd=0.3):
    """The engine's logprobs perturbed (a stand-in for a mismatched engine)."""
    orig = tr.rollout
    g = torch.Generator().manual_seed(11)

    def rollout(*a, **k):
        ss = orig(*a, **k)
        for s in ss:
            s.logprobs = [x + sd * float(torch.randn((), generator=g)) for x in s.logprobs]
        return ss

    tr.rollout = rollout


def _spy_updates(tr):
    outs = []
    orig = tr._policy_update

    def spy(*a, **k):
        out = orig(*a, **k)
        outs.append(out)
        return out

    tr._policy_update = spy
    return outs


def test_first_update_gives_the_trainer_logprobs(tmp_path):
    """old_logprobs: engine: the metrics come from the first update's forward_backward, and
    equal those of a separate forward of the same (theta_old) weights."""
    tr = grpo_trainer(tmp_path, rewards=[first_is_even], micro_batch_tokens=40)
    ss = tr._engine_phase(lambda: tr.rollout(tr.rows[:4], 4, seed=3))
    tr.score(ss)
    adv, _ = losses.group_advantages(torch.tensor([s.reward for s in ss]), 4)
    batch = ro.pack(ss, device=tr.device)
    batch.fields["adv"] = batch.per_token(adv) * batch.mask
    batch.old_lp = batch.old_lp + 0.05 * torch.randn(batch.num_tokens) * batch.mask
    lp0 = tr.model.forward(batch.tokens, batch.cu_seqlens, grad=False)
    want = mismatch_metrics(lp0, batch.old_lp, batch.mask, batch.cu_seqlens)
    sc = StepCorrection(tr.cfg, tr.model, batch)
    assert sc.metrics() == {}  # nothing measured before the first update
    assert len(batch.micro_batches(40)) > 1
    tr._policy_update(sc.policy_batch(), 0, 1, "token", 0.0, record=sc.record)
    got = sc.metrics()
    for k in MISMATCH_KEYS:
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert got["mismatch/exact_frac"] < 0.5


MODES = [("engine", "none"), ("recompute", "none"), ("recompute", "tis"), ("recompute", "mis_token"),
         ("recompute", "mis_seq")]


@pytest.mark.parametrize("old_logprobs,correction", MODES)
def test_grpo_modes_run_and_log(tmp_path, old_logprobs, correction):
    tr = grpo_trainer(tmp_path, rewards=[first_is_even], steps=2, mu=2, old_logprobs=old_logprobs,
                      behaviour_correction=correction, mis_low=0.7, mis_high=1.4, tis_cap=1.2,
                      log={"tensorboard": True})
    _noisy_engine(tr)
    outs = _spy_updates(tr)
    hist = tr.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for h, row in zip(hist, rows):
        for k in MISMATCH_KEYS:
            assert math.isfinite(row[k]) and row[k] == h[k], k
        assert row["mismatch/abs_mean"] > 0.1 and row["mismatch/exact_frac"] < 0.5  # the noise is seen
        assert row["mismatch/ratio_p01"] < 1 < row["mismatch/ratio_p99"]
        if correction == "tis":
            assert 0 < row["correction/capped_frac"] < 1
        elif correction != "none":
            assert 0 < row["correction/rejected_frac"] < 1
    if importlib.util.find_spec("tensorboard") is not None:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "run"))
        acc.Reload()
        tb = {(e.step, k): e.value for k in MISMATCH_KEYS for e in acc.Scalars(k)}
        for row in rows:
            for k in MISMATCH_KEYS:
                assert tb[(row["step"], k)] == pytest.approx(row[k], rel=1e-6, abs=1e-12), k
    assert len(outs) == 4
    first = outs[0]  # mu index 0 of step 1
    if old_logprobs == "recompute":
        assert first["clip_frac"] == 0 and first["ratio"] == 1.0 and first["approx_kl"] == 0.0
    else:
        assert first["clip_frac"] > 0 and first["approx_kl"] > 1e-3


def test_progress_line_shows_the_mismatch(capsys):
    from rlcu.train.logging import RunLogger

    line = RunLogger._short({"a": 1.0, "b": 2.0, "c": 3, "d": 4.0, "e": 5.0, "f": 6.0, "mismatch/abs_mean": 0.0123,
                             "mismatch/exact_frac": 0.5, "mismatch/kl_k3": 1e-5})
    assert line.split("  ")[:5] == ["a 1", "b 2", "c 3", "d 4", "e 5"]
    assert "mismatch/abs_mean 0.0123" in line and "mismatch/exact_frac 0.5" in line and "kl_k3" not in line


def test_ppo_recompute_corrects_the_kl_reward(tmp_path):
    """PPO's KL reward reads the old logprobs: with old_logprobs: recompute they are the
    trainer's, so at step 1 (policy == reference) the KL penalty is exactly 0, whatever the
    engine returned; with the engine's (noisy) logprobs it is not."""
    pens = {}
    for mode, corr in (("engine", "none"), ("recompute", "tis")):
        tr = ppo_trainer(tmp_path / mode, steps=1, kl_coef=0.1, old_logprobs=mode, behaviour_correction=corr)
        _noisy_engine(tr)
        h = tr.train()[0]
        pens[mode] = h["kl_penalty"]
        assert all(math.isfinite(h[k]) for k in MISMATCH_KEYS)
    assert pens["recompute"] == 0.0 and abs(pens["engine"]) > 1e-3


def test_config_fields_and_errors():
    from rlcu.config import ConfigError, GRPOConfig, PPOConfig, _build

    c = GRPOConfig()
    assert (c.old_logprobs, c.behaviour_correction, c.tis_cap, c.mis_low, c.mis_high) == ("engine", "none", 2.0,
                                                                                           0.5, 2.0)
    with pytest.raises(ConfigError, match="behaviour_correction tis needs old_logprobs: recompute"):
        _build(GRPOConfig, {"behaviour_correction": "tis"})
    with pytest.raises(ConfigError, match="mis_low must be < mis_high"):
        _build(PPOConfig, {"old_logprobs": "recompute", "behaviour_correction": "mis_seq", "mis_low": 2.0})
    with pytest.raises(ConfigError, match="old_logprobs must be one of"):
        _build(GRPOConfig, {"old_logprobs": "trainer"})


@pytest.mark.gpu
def test_grpo_recompute_on_gpu(tmp_path):
    """bf16 on the GPU kernels: the recompute pass (Qwen3.forward) and the first update's
    forward_backward give the same bits, so the first ratio is exactly 1; the default mode's
    mismatch is measured every step."""
    for mode in ("engine", "recompute"):
        tr = grpo_trainer(tmp_path / mode, rewards=[first_is_even], steps=2, mu=2, old_logprobs=mode,
                          behaviour_correction="tis" if mode == "recompute" else "none",
                          model={"device": "cuda", "dtype": "bfloat16"}, optim={"lr": 1e-2})
        outs = _spy_updates(tr)
        hist = tr.train()
        for h in hist:
            assert all(math.isfinite(h[k]) for k in MISMATCH_KEYS), h
            assert h["mismatch/abs_max"] < 0.5
        if mode == "recompute":
            assert outs[0]["clip_frac"] == 0 and outs[0]["ratio"] == 1.0 and outs[0]["approx_kl"] == 0.0
