"""ops/decode_qkv.py: the input norm, the QKV GEMM and qkv_prep in one kernel, against its twin
(the unfused ops: rmsnorm, the GEMM, qkv_prep) at odd shapes, split and unsplit, rows without
a cache slot; the fallbacks to the twin. On the CPU through TRITON_INTERPRET=1."""

import pytest
import torch

from rlcu.model.rope import RopeSpec, inv_freq
from rlcu.ops import decode_linear as dl
from rlcu.ops import decode_qkv as dq

pytestmark = pytest.mark.usefixtures("one_thread")
F = {D: inv_freq(RopeSpec(theta=1e6), D) for D in (24, 32)}  # the frequency tables of the heads here
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # fp32: the GEMM's order and qkv_prep's angles (its own 1e-5)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _case(M, K, Hq, Hk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, w = rnd(M, K), rnd((Hq + 2 * Hk) * D, K, scale=K**-0.5)
    nw, qw, kw = 1 + rnd(K, scale=0.1), 1 + rnd(D, scale=0.1), 1 + rnd(D, scale=0.1)
    pos = torch.randint(0, 3000, (M,), generator=g, dtype=torch.int32)
    slots = torch.randperm(4 * M, generator=g)[:M]
    slots[1] = -1  # a row that writes no cache slot
    kc = torch.full((M, 4, Hk, D), 7.0, dtype=dtype)  # 4 M slots, filled: untouched ones must stay 7
    return x, w, nw, qw, kw, pos, slots, kc, kc.clone()


def _both(case, Hq, Hk, D, cfg):
    x, w, nw, qw, kw, pos, slots, kc, vc = case
    kr, vr = kc.clone(), vc.clone()
    ref = dq.decode_qkv_ref(x, w, nw, 1e-6, qw, kw, pos, slots, kr, vr, Hq, Hk, D, F[D])
    out = dq.decode_qkv_triton(x, w, nw, 1e-6, qw, kw, pos, slots, kc, vc, Hq, Hk, D, F[D], cfg)
    return (out, kc, vc), (ref, kr, vr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [None, (16, 0, 32, 3, 4, 1), (32, 0, 16, 2, 4, 1)], ids=["unsplit", "split3", "split2"])
def test_matches_twin(dtype, cfg):
    """q, and k and v in the cache (the slot -1 row written nowhere), against the unfused ops;
    M = 17 leaves a row tile past the end, K = 80 a K tail."""
    Hq, Hk, D = 4, 2, 32
    case = _case(17, 80, Hq, Hk, D, dtype)
    got, want = _both(case, Hq, Hk, D, cfg)
    for a, b, name in zip(got, want, ("q", "k_cache", "v_cache")):
        assert _rel(a, b) < TOL[dtype], name
    slots = case[6]
    untouched = torch.ones(got[1].numel() // (Hk * D), dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    for c in got[1:]:
        assert c.view(-1, Hk, D)[untouched].eq(7).all()
    assert all(c.eq(0).all() for c in dl._COUNTERS.values())


def test_split_same_bits_as_unsplit_order():
    """Split-K adds its partials in split order: the same bits run after run."""
    case = _case(5, 128, 2, 1, 32, torch.float32, seed=1)
    a = _both(case, 2, 1, 32, (16, 0, 32, 4, 4, 1))[0][0]
    b = _both(case, 2, 1, 32, (16, 0, 32, 4, 4, 1))[0][0]
    assert torch.equal(a, b)


def test_falls_back_to_the_twin(monkeypatch):
    """A table entry of None, a split without counters (more tiles than they hold) and a head
    whose half is not a power-of-two tile all run the unfused ops."""
    calls = []
    ref = dq.decode_qkv_ref
    monkeypatch.setattr(dq, "decode_qkv_ref", lambda *a: calls.append(1) or ref(*a))
    Hq, Hk, D = 4, 2, 32
    case = _case(3, 64, Hq, Hk, D, torch.float32)
    monkeypatch.setattr(dq, "config_for", lambda *a: None)
    dq.decode_qkv_triton(*case[:3], 1e-6, *case[3:], Hq, Hk, D, F[D])
    monkeypatch.setattr(dl, "_MAX_TILES", 2)
    dq.decode_qkv_triton(*case[:3], 1e-6, *case[3:], Hq, Hk, D, F[D], (16, 0, 32, 2, 4, 1))
    case = _case(3, 64, 2, 1, 24, torch.float32)
    dq.decode_qkv_triton(*case[:3], 1e-6, *case[3:], 2, 1, 24, F[24], (16, 0, 32, 1, 4, 1))
    assert len(calls) == 3


def test_checks_shapes():
    Hq, Hk, D = 4, 2, 32
    x, w, nw, *rest = _case(3, 64, Hq, Hk, D, torch.float32)
    with pytest.raises(ValueError, match=r"w \[\(Hq \+ 2 Hk\) D, K\] = \[256, K\]"):
        dq.decode_qkv(x, w[:200], nw, 1e-6, *rest, Hq, Hk, D, F[D])
    with pytest.raises(ValueError, match="norm_w must be"):
        dq.decode_qkv(x, w, nw[:5], 1e-6, *rest, Hq, Hk, D, F[D])
    with pytest.raises(ValueError, match=r"decode_qkv: inv_freq must be a float32 \[16\]"):
        dq.decode_qkv(x, w, nw, 1e-6, *rest, Hq, Hk, D, F[D].double())


@pytest.mark.parametrize("norm,biased", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("cfg", [None, (16, 0, 32, 3, 4, 1)], ids=["unsplit", "split3"])
def test_rope_alone_and_bias_match_twin(norm, biased, cfg):
    """q_w = k_w = None (Llama, Mistral, Qwen2: rope alone) and a q/k/v bias (Qwen2's, in the
    epilogue), split and unsplit, against the unfused ops (rmsnorm, the GEMM, qkv_prep with both)."""
    Hq, Hk, D = 7, 1, 32
    x, w, nw, qw, kw, pos, slots, kc, vc = _case(9, 48, Hq, Hk, D, torch.float32, seed=5)
    qw, kw = (qw, kw) if norm else (None, None)
    bias = torch.randn((Hq + 2 * Hk) * D) if biased else None
    kr, vr = kc.clone(), vc.clone()
    ref = dq.decode_qkv_ref(x, w, nw, 1e-6, qw, kw, pos, slots, kr, vr, Hq, Hk, D, F[D], None, 1.0, bias)
    out = dq.decode_qkv_triton(x, w, nw, 1e-6, qw, kw, pos, slots, kc, vc, Hq, Hk, D, F[D], cfg, 1.0, bias)
    for a, b, name in ((out, ref, "q"), (kc, kr, "k_cache"), (vc, vr, "v_cache")):
        assert _rel(a, b) < TOL[torch.float32], name
    if biased:  # the bias reached every head kind
        k0, v0 = kc.clone(), vc.clone()
        plain = dq.decode_qkv_ref(x, w, nw, 1e-6, qw, kw, pos, slots, k0, v0, Hq, Hk, D, F[D])
        assert _rel(plain, ref) > 1e-2 and _rel(k0, kr) > 1e-2 and _rel(v0, vr) > 1e-2


def test_rope_alone_and_bias_checks():
    Hq, Hk, D = 4, 2, 32
    x, w, nw, qw, kw, *rest = _case(3, 64, Hq, Hk, D, torch.float32)
    with pytest.raises(ValueError, match="q_w and k_w must both be tensors"):
        dq.decode_qkv(x, w, nw, 1e-6, qw, None, *rest, Hq, Hk, D, F[D])
    with pytest.raises(ValueError, match=r"bias must be a contiguous \[\(Hq \+ 2 Hk\) D\] = \[256\]"):
        dq.decode_qkv(x, w, nw, 1e-6, None, None, *rest, Hq, Hk, D, F[D], bias=torch.zeros(128))


def test_yarn_factor_matches_twin():
    """The factor on cos/sin (YaRN's) in the epilogue's rotation, against the unfused ops."""
    Hq, Hk, D = 4, 2, 32
    x, w, nw, qw, kw, pos, slots, kc, vc = _case(5, 48, Hq, Hk, D, torch.float32, seed=7)
    kr, vr = kc.clone(), vc.clone()
    ref = dq.decode_qkv_ref(x, w, nw, 1e-6, qw, kw, pos, slots, kr, vr, Hq, Hk, D, F[D], None, 1.1386)
    out = dq.decode_qkv_triton(x, w, nw, 1e-6, qw, kw, pos, slots, kc, vc, Hq, Hk, D, F[D], None, 1.1386)
    assert all(_rel(a, b) < TOL[torch.float32] for a, b in ((out, ref), (kc, kr), (vc, vr)))
