"""The fused RL losses: the twin against autograd, the Triton kernel (interpreted on the CPU)
against the twin, at odd sizes with several programs and a ragged tail."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.hf_util import rel_err  # noqa: E402

from rlcu.ops import rl_loss  # noqa: E402
from rlcu.ops.rl_loss import POLICY_STATS, VALUE_STATS, policy_loss, policy_loss_ref, value_loss_ref  # noqa: E402


def _policy_inputs(N=333, seed=0, device="cpu", with_ref=True, with_ent=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, generator=g) * 3
    lp = old + 0.4 * torch.randn(N, generator=g)  # ratios well inside and outside the clip range
    ref = old + 0.3 * torch.randn(N, generator=g) if with_ref else None
    adv = torch.randn(N, generator=g)
    adv[::17] = 0.0
    w = torch.rand(N, generator=g) / N
    w[::5] = 0.0  # masked tokens
    lp[::5] = 50.0  # garbage under the mask must not leak
    ent = torch.rand(N, generator=g) * 2 if with_ent else None
    mv = lambda x: None if x is None else x.to(device)  # noqa: E731
    return mv(lp), mv(old), mv(ref), mv(adv), mv(w), mv(ent)


def _policy_autograd(lp, old, ref, adv, w, ent, cl, ch, beta, ce, is_w=None):
    lp = lp.clone().double().requires_grad_(True)
    ent_t = None if ent is None else ent.clone().double().requires_grad_(True)
    live = w != 0
    lpm = torch.where(live, lp, old.double())
    r = torch.exp(lpm - old.double())
    pg = torch.maximum(-r * adv.double(), -r.clamp(1 - cl, 1 + ch) * adv.double())
    if is_w is not None:  # a constant weight on the surrogate (no gradient through it)
        pg = torch.where(live, is_w.double(), torch.zeros_like(pg)) * pg
    tok = pg
    if ref is not None:
        k = ref.double() - lpm
        tok = tok + beta * (torch.exp(k) - k - 1)
    if ent_t is not None:
        tok = tok - ce * ent_t
    loss = (w.double() * tok).sum()
    loss.backward()
    return loss.detach(), lp.grad, None if ent_t is None else ent_t.grad


@pytest.mark.parametrize("with_ref,with_ent", [(True, True), (False, False), (True, False)])
def test_policy_loss_twin_vs_autograd(with_ref, with_ent):
    lp, old, ref, adv, w, ent = _policy_inputs(with_ref=with_ref, with_ent=with_ent)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, entropy_coef=0.01)
    loss, dlp, dent, stats = policy_loss_ref(lp, old, ref, adv, w, ent, *kw.values())
    L, g_lp, g_ent = _policy_autograd(lp, old, ref, adv, w, ent, *kw.values())
    assert abs(loss.sum().item() - L.item()) <= 1e-5 * abs(L.item()) + 1e-7
    assert rel_err(dlp, g_lp) < 1e-6
    assert torch.all(dlp[::5] == 0) and torch.all(loss[::5] == 0)
    if with_ent:
        assert rel_err(dent, g_ent) < 1e-6
    else:
        assert dent is None
    s = dict(zip(POLICY_STATS, stats.tolist()))
    live = w != 0
    r = torch.exp(lp - old)[live]
    a, wl = adv[live], w[live]
    assert s["weight"] == pytest.approx(wl.sum().item(), rel=1e-5)
    assert s["loss"] == pytest.approx(L.item(), rel=1e-5, abs=1e-8)
    assert s["clip_high"] == pytest.approx(wl[(r > 1.28) & (a > 0)].sum().item(), rel=1e-5, abs=1e-9)
    assert s["clip_low"] == pytest.approx(wl[(r < 0.8) & (a < 0)].sum().item(), rel=1e-5, abs=1e-9)
    assert s["clip_high"] > 0 and s["clip_low"] > 0
    assert s["ratio"] == pytest.approx((wl * r).sum().item(), rel=1e-5)
    assert s["approx_kl"] == pytest.approx((wl * (r - 1 - torch.log(r))).sum().item(), rel=1e-4)
    if with_ref:
        k = (ref - lp)[live]
        assert s["kl"] == pytest.approx((wl * (torch.exp(k) - k - 1)).sum().item(), rel=1e-5)


def _is_weights(N, seed=2):
    g = torch.Generator().manual_seed(seed)
    b = torch.rand(N, generator=g) * 2
    b[::7] = 0.0  # rejected tokens (MIS)
    b[::5] = float("inf")  # garbage under the mask must not leak
    return b


@pytest.mark.parametrize("with_ref,with_ent", [(True, True), (False, False)])
def test_policy_loss_is_weights_vs_autograd(with_ref, with_ent):
    """The behaviour-policy weight b scales the surrogate's loss and gradient, not the KL or
    entropy terms; pg_loss is the corrected term; clip statistics do not see b."""
    lp, old, ref, adv, w, ent = _policy_inputs(with_ref=with_ref, with_ent=with_ent)
    b = _is_weights(lp.numel())
    kw = {"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.05, "entropy_coef": 0.01}
    loss, dlp, dent, stats = policy_loss_ref(lp, old, ref, adv, w, ent, *kw.values(), is_w=b)
    L, g_lp, g_ent = _policy_autograd(lp, old, ref, adv, w, ent, *kw.values(), is_w=b)
    assert torch.isfinite(loss).all() and torch.isfinite(dlp).all()
    assert abs(loss.sum().item() - L.item()) <= 1e-5 * abs(L.item()) + 1e-7
    assert rel_err(dlp, g_lp) < 1e-6
    if with_ent:
        assert rel_err(dent, g_ent) < 1e-6
    s = dict(zip(POLICY_STATS, stats.tolist()))
    s0 = dict(zip(POLICY_STATS, policy_loss_ref(lp, old, ref, adv, w, ent, *kw.values())[3].tolist()))
    for k in ("clip_low", "clip_high", "ratio", "approx_kl", "kl", "entropy", "weight"):
        assert s[k] == s0[k], k
    live = w != 0
    r = torch.exp(lp - old)
    pg = torch.maximum(-r * adv, -r.clamp(0.8, 1.28) * adv)
    assert s["pg_loss"] == pytest.approx((w * b * pg)[live].sum().item(), rel=1e-5)
    assert s["pg_loss"] != pytest.approx(s0["pg_loss"], rel=1e-3)


def test_policy_loss_ratio_one_is_plain_pg():
    """At the first update (lp == old) the gradient is -w A exactly, the loss -sum(w A)."""
    lp, _, _, adv, w, _ = _policy_inputs()
    loss, dlp, _, stats = policy_loss(lp, lp.clone(), None, adv, w)
    assert torch.allclose(dlp, -w * adv)
    assert stats[POLICY_STATS.index("clip_low")] == 0 and stats[POLICY_STATS.index("clip_high")] == 0


def _value_autograd(v, vold, ret, w, c):
    v = v.clone().double().requires_grad_(True)
    vc = vold.double() + (v - vold.double()).clamp(-c, c)
    loss = (w.double() * 0.5 * torch.maximum((v - ret.double()) ** 2, (vc - ret.double()) ** 2)).sum()
    loss.backward()
    return loss.detach(), v.grad


def _value_inputs(N=333, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    vold = torch.randn(N, generator=g)
    v = vold + 0.5 * torch.randn(N, generator=g)
    ret = vold + torch.randn(N, generator=g)
    w = torch.rand(N, generator=g) / N
    w[::7] = 0
    return v.to(device), vold.to(device), ret.to(device), w.to(device)


def test_value_loss_twin_vs_autograd():
    v, vold, ret, w = _value_inputs()
    loss, dv, stats = value_loss_ref(v, vold, ret, w, 0.2)
    L, g = _value_autograd(v, vold, ret, w, 0.2)
    assert loss.sum().item() == pytest.approx(L.item(), rel=1e-5)
    assert rel_err(dv, g) < 1e-6
    s = dict(zip(VALUE_STATS, stats.tolist()))
    assert 0 < s["clip_frac"] < s["weight"]
    # no clipping: plain squared error
    _, dv_inf, _ = value_loss_ref(v, vold, ret, w, float("inf"))
    assert torch.allclose(dv_inf, w * (v - ret))


@pytest.mark.parametrize("with_ref,with_ent,N,block", [(True, True, 333, 128), (False, False, 63, None),
                                                       (True, False, 1, None)])
def test_policy_loss_triton_vs_twin(with_ref, with_ent, N, block):
    lp, old, ref, adv, w, ent = _policy_inputs(N=N, with_ref=with_ref, with_ent=with_ent)
    args = (lp, old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01)
    a = rl_loss.policy_loss_triton(*args, block=block)
    b = policy_loss_ref(*args)
    for x, y in zip(a, b):
        if y is None:
            assert x is None
        else:
            assert rel_err(x, y) < 1e-6


@pytest.mark.parametrize("with_ref,with_ent,N,block", [(True, True, 333, 128), (False, False, 63, None)])
def test_policy_loss_is_weights_triton_vs_twin(with_ref, with_ent, N, block):
    lp, old, ref, adv, w, ent = _policy_inputs(N=N, with_ref=with_ref, with_ent=with_ent)
    b = _is_weights(N)
    args = (lp, old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01)
    a = rl_loss.policy_loss_triton(*args, block=block, is_w=b)
    want = policy_loss_ref(*args, is_w=b)
    for x, y in zip(a, want):
        if y is None:
            assert x is None
        else:
            assert torch.isfinite(x).all() and rel_err(x, y) < 1e-6


def test_value_loss_triton_vs_twin():
    v, vold, ret, w = _value_inputs(N=333)
    a = rl_loss.value_loss_triton(v, vold, ret, w, 0.2, block=64)
    b = value_loss_ref(v, vold, ret, w, 0.2)
    for x, y in zip(a, b):
        assert rel_err(x, y) < 1e-6


def test_dispatch_picks_triton(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    lp, old, ref, adv, w, ent = _policy_inputs(N=63)
    a = policy_loss(lp, old, ref, adv, w, ent, clip_low=0.2, clip_high=0.2, kl_coef=0.1, entropy_coef=0.0)
    b = policy_loss_ref(lp, old, ref, adv, w, ent, 0.2, 0.2, 0.1, 0.0)
    assert rel_err(a[1], b[1]) < 1e-6
    bw = _is_weights(63)
    a = policy_loss(lp, old, ref, adv, w, ent, clip_low=0.2, clip_high=0.2, kl_coef=0.1, is_w=bw)
    b = policy_loss_ref(lp, old, ref, adv, w, ent, 0.2, 0.2, 0.1, 0.0, bw)
    assert rel_err(a[1], b[1]) < 1e-6


def test_shape_errors():
    lp, old, ref, adv, w, ent = _policy_inputs(N=63)
    with pytest.raises(ValueError, match="adv must have shape"):
        rl_loss.policy_loss_triton(lp, old, ref, adv[:10], w, ent, 0.2, 0.2, 0.0, 0.0)
    with pytest.raises(ValueError, match="is_w must have shape"):
        rl_loss.policy_loss_triton(lp, old, ref, adv, w, ent, 0.2, 0.2, 0.0, 0.0, is_w=w[:10])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_policy_loss_gpu(dtype):
    lp, old, ref, adv, w, ent = _policy_inputs(N=100_003, device="cuda")
    lp = lp.to(dtype)  # a bf16 input is read as fp32 in registers
    a = rl_loss.policy_loss_triton(lp, old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01)
    b = policy_loss_ref(lp.float(), old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01)
    for x, y in zip(a, b):
        assert rel_err(x, y) < 1e-5
    bw = _is_weights(100_003).cuda()
    a = rl_loss.policy_loss_triton(lp, old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01, is_w=bw)
    b = policy_loss_ref(lp.float(), old, ref, adv, w, ent, 0.2, 0.28, 0.05, 0.01, bw)
    for x, y in zip(a, b):
        assert torch.isfinite(x).all() and rel_err(x, y) < 1e-5
    v, vold, ret, w = _value_inputs(N=100_003, device="cuda")
    for x, y in zip(rl_loss.value_loss_triton(v, vold, ret, w, 0.2), value_loss_ref(v, vold, ret, w, 0.2)):
        assert rel_err(x, y) < 1e-5


def _gspo_inputs(seed=1):
    """Five packed sequences of odd lengths, prompts (w = 0) and one fully masked sequence;
    per-sequence advantages of both signs; log-ratios wide enough that some sequences clip."""
    g = torch.Generator().manual_seed(seed)
    lens, prompt = [7, 12, 5, 9, 11], [3, 4, 2, 3, 5]
    N = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    old = -torch.rand(N, generator=g) * 3
    lp = old + 0.3 * torch.randn(N, generator=g)
    ref = old + 0.2 * torch.randn(N, generator=g)
    ent = torch.rand(N, generator=g)
    adv_s = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9])
    seq = torch.repeat_interleave(torch.arange(5), torch.tensor(lens))
    pos = torch.arange(N) - cu[:-1].long()[seq]
    mask = (pos >= torch.tensor(prompt)[seq]).float()
    mask[seq == 3] = 0.0  # a masked sample
    w = mask / mask.sum()
    lp[mask == 0] = 40.0  # garbage off the loss's tokens must not leak
    is_w = 0.5 + torch.rand(N, generator=g)
    return lp, old, ref, adv_s[seq], w, cu, ent, is_w, seq


def _gspo_autograd(lp, old, ref, adv, w, ent, is_w, seq, level, cl, ch, beta, ce):
    """GSPO from its definition (double precision, autograd): s = exp(mean log-ratio) per
    sequence; sequence_token's s_t = sg(s) exp(lp_t - sg(lp_t))."""
    lp = lp.clone().double().requires_grad_(True)
    ent_t = ent.clone().double().requires_grad_(True)
    live = w != 0
    lpm = torch.where(live, lp, old.double())
    d = (lpm - old.double()) * live
    n = torch.zeros(5, dtype=torch.float64).index_add_(0, seq, live.double()).clamp_min(1)
    ls = (torch.zeros(5, dtype=torch.float64).index_add_(0, seq, d) / n)[seq]
    s = torch.exp(ls) if level == "sequence" else torch.exp(ls.detach() + lpm - lpm.detach())
    A = adv.double()
    pg = torch.maximum(-s * A, -s.clamp(1 - cl, 1 + ch) * A)
    k = ref.double() - lpm
    tok = is_w.double() * pg + beta * (torch.exp(k) - k - 1) - ce * ent_t
    loss = (w.double() * tok * live).sum()
    loss.backward()
    clipped = (s.detach() > 1 + ch) & (A > 0) | (s.detach() < 1 - cl) & (A < 0)
    return loss.detach(), lp.grad, ent_t.grad, clipped


@pytest.mark.parametrize("level", ["sequence", "sequence_token"])
def test_sequence_policy_loss_vs_autograd(level):
    """GSPO's loss, its gradient and its statistics against the definition: the sequence's
    mean log-ratio, one clip per sequence (some clip, low and high), KL, entropy, and the
    behaviour weights on the surrogate; masked tokens and a masked sequence contribute 0."""
    lp, old, ref, adv, w, cu, ent, is_w, seq = _gspo_inputs()
    kw = dict(clip_low=0.03, clip_high=0.04, kl_coef=0.05, entropy_coef=0.01)
    loss, dlp, dent, st = rl_loss.sequence_policy_loss(lp, old, ref, adv, w, cu, ent, level=level, is_w=is_w, **kw)
    L, g_lp, g_ent, clipped = _gspo_autograd(lp, old, ref, adv, w, ent, is_w, seq, level, *kw.values())
    assert abs(loss.sum().item() - L.item()) <= 1e-5 * abs(L.item()) + 1e-7
    assert rel_err(dlp, g_lp) < 1e-5 and rel_err(dent, g_ent) < 1e-6
    assert torch.all(dlp[w == 0] == 0)
    s = dict(zip(POLICY_STATS, st.tolist()))
    assert 0 < s["clip_low"] + s["clip_high"] < s["weight"]  # some sequences clip, not all
    live = w != 0
    assert s["clip_high"] + s["clip_low"] == pytest.approx(float(w[clipped & live].sum()), rel=1e-5)
    if level == "sequence":  # every token of a sequence has the same gradient but for KL and entropy
        g_pg = dlp - w * kw["kl_coef"] * (1 - torch.exp(ref - lp)) * live
        for i in (0, 1, 2, 4):
            x = (g_pg / w.clamp_min(1e-30))[(seq == i) & live]
            assert torch.allclose(x, x[0].expand_as(x), rtol=1e-4)


def test_sequence_policy_loss_at_ratio_one_is_token_level():
    """At lp == old every ratio is 1 (nothing clips): GSPO-token's gradient is the token loss's
    and GSPO's is each sequence's mean of it."""
    lp, old, ref, adv, w, cu, ent, is_w, seq = _gspo_inputs()
    lp = old.clone()
    kw = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.05, entropy_coef=0.01, is_w=is_w)
    tok = policy_loss(lp, old, ref, adv, w, ent, **kw)
    st = rl_loss.sequence_policy_loss(lp, old, ref, adv, w, cu, ent, level="sequence_token", **kw)
    assert rel_err(st[1], tok[1]) < 1e-6 and rel_err(st[0], tok[0]) < 1e-6
    with pytest.raises(ValueError, match="sequence or sequence_token"):
        rl_loss.sequence_policy_loss(lp, old, ref, adv, w, cu, ent, level="token")


def test_sequence_policy_loss_triton_vs_twin(monkeypatch):
    """GSPO through the Triton kernel (interpreted on the CPU) equals it through the twin."""
    lp, old, ref, adv, w, cu, ent, is_w, seq = _gspo_inputs(seed=2)
    kw = dict(level="sequence", clip_low=0.03, clip_high=0.04, kl_coef=0.05, entropy_coef=0.01, is_w=is_w)
    b = rl_loss.sequence_policy_loss(lp, old, ref, adv, w, cu, ent, **kw)
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    a = rl_loss.sequence_policy_loss(lp, old, ref, adv, w, cu, ent, **kw)
    for x, y in zip(a, b):
        assert rel_err(x, y) < 1e-6
