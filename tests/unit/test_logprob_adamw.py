"""Fused LM-head logprob/entropy and AdamW: Triton kernels (through the interpreter on the
CPU) against their twins, and the twins against torch autograd / torch.optim."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported: kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.hf_util import rel_err  # noqa: E402
from support.interp_util import needs_triton as needs_triton_for  # noqa: E402

from rlcu.ops import adamw as adamw_mod  # noqa: E402
from rlcu.ops import logprob as logprob_mod  # noqa: E402
from rlcu.ops.adamw import adamw_step, adamw_step_ref, clip_scale, grad_norm, grad_norm_ref  # noqa: E402
from rlcu.ops.logprob import logprob_bwd, logprob_bwd_ref, logprob_fwd, logprob_fwd_ref  # noqa: E402

needs_triton = needs_triton_for(logprob_mod._logprob_fwd_kernel)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, D, V = 63, 96, 333


def _inputs(seed=0, dtype=torch.float32, device="cpu", n=N, d=D, v=V, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    W = torch.randn(v, d, generator=g) * scale / d**0.5
    tgt = torch.randint(0, v, (n,), generator=g)
    dlp = torch.randn(n, generator=g)
    dent = torch.randn(n, generator=g)
    return (h.to(device, dtype), W.to(device, dtype), tgt.to(device), dlp.to(device),
            dent.to(device))


@pytest.fixture
def triton_small(monkeypatch):
    """Triton backend with a chunk smaller than N and a vocabulary tile smaller than V, so
    that both the row chunking and the online softmax across tiles are exercised."""
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    monkeypatch.setattr(logprob_mod, "CHUNK_ROWS", 16)
    monkeypatch.setattr(logprob_mod, "BV_MAX", 128)


# ---------------------------------------------------------------- logprob: twin vs autograd
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_twin_matches_autograd(temperature):
    h, W, tgt, dlp, dent = _inputs(scale=3.0)
    h.requires_grad_(True)
    W.requires_grad_(True)
    z = (h @ W.t()) / temperature
    logp = z.log_softmax(-1)
    lp_n = logp.gather(1, tgt[:, None])[:, 0]
    ent_n = -(logp.exp() * logp).sum(-1)
    (lp_n * dlp + ent_n * dent).sum().backward()
    lp_n, ent_n, lse_n = lp_n.detach(), ent_n.detach(), z.detach().logsumexp(-1)

    with torch.no_grad():
        lp, ent, lse = logprob_fwd_ref(h, W, tgt, temperature, True, chunk=16)
        dW = torch.full_like(W, 0.5)
        dh = logprob_bwd_ref(dlp, dent, h, W, tgt, lse, dW, temperature, chunk=16)
    assert rel_err(lp, lp_n) < 1e-5
    assert rel_err(ent, ent_n) < 1e-5
    assert rel_err(lse, lse_n) < 1e-5
    assert rel_err(dh, h.grad) < 1e-5
    assert rel_err(dW - 0.5, W.grad) < 1e-5


# ---------------------------------------------------------------- logprob: kernel vs twin
@needs_triton
@pytest.mark.parametrize("with_entropy,temperature", [(False, 1.0), (True, 0.7)])
def test_logprob_kernel_fwd_bwd(triton_small, with_entropy, temperature):
    h, W, tgt, dlp, dent = _inputs(seed=1, scale=3.0)
    tgt = tgt.to(torch.int32) if with_entropy else tgt
    lp, ent, lse = logprob_fwd(h, W, tgt, temperature, with_entropy)
    lp_r, ent_r, lse_r = logprob_fwd_ref(h, W, tgt, temperature, with_entropy)
    assert rel_err(lp, lp_r) < 1e-5
    assert rel_err(lse, lse_r) < 1e-5
    assert (ent is None) == (not with_entropy)
    if with_entropy:
        assert rel_err(ent, ent_r) < 1e-5

    de = dent if with_entropy else None
    dW = torch.full_like(W, 0.25)
    dW_r = dW.clone()
    dh = logprob_bwd(dlp, de, h, W, tgt, lse, dW, temperature)
    dh_r = logprob_bwd_ref(dlp, de, h, W, tgt, lse_r, dW_r, temperature)
    assert rel_err(dh, dh_r) < 1e-5
    assert rel_err(dW - 0.25, dW_r - 0.25) < 1e-5


@needs_triton
def test_logprob_kernel_entropy_only_and_no_dW(triton_small):
    h, W, tgt, _, dent = _inputs(seed=2, scale=3.0)
    _, _, lse = logprob_fwd(h, W, tgt, 1.3, True)
    dh = logprob_bwd(None, dent, h, W, tgt, lse, None, 1.3)
    dh_r = logprob_bwd_ref(None, dent, h, W, tgt, lse, None, 1.3)
    assert rel_err(dh, dh_r) < 1e-5


# ---------------------------------------------------------------- AdamW and the norm
HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _adam_state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    grads = [torch.randn(n, generator=g) for _ in range(4)]
    return p, grads


def test_adamw_twin_matches_torch_optim():
    n = 1000
    p0, grads = _adam_state(n)
    q = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([q], **{"lr": HP["lr"], "betas": (HP["beta1"], HP["beta2"]),
                                    "eps": HP["eps"], "weight_decay": HP["weight_decay"]})
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    p_out = torch.empty(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        q.grad = g * 0.5
        opt.step()
        adamw_step_ref(p, g, m, v, p_out, step=t, grad_scale=0.5, **HP)
    assert rel_err(p, q.detach()) < 1e-6
    assert rel_err(m, opt.state[q]["exp_avg"]) < 1e-6
    assert rel_err(v, opt.state[q]["exp_avg_sq"]) < 1e-6
    assert torch.equal(p_out, p.to(torch.bfloat16))


@needs_triton
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_adamw_kernel_vs_twin(monkeypatch, scale_kind, g_dtype):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    monkeypatch.setattr(adamw_mod, "LAUNCH", {"sr": (256, 4), "plain": (256, 4)})
    n = 1000  # not a multiple of the block
    p0, grads = _adam_state(n, seed=3)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    pr, mr, vr = p0.clone(), torch.zeros(n), torch.zeros(n)
    out, out_r = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        g = g.to(g_dtype)
        s = 0.37 * t
        gs = torch.tensor(s) if scale_kind == "tensor" else s
        adamw_step(p, g, m, v, out, step=t, grad_scale=gs, **HP)
        adamw_step_ref(pr, g, mr, vr, out_r, step=t, grad_scale=s, **HP)
    assert rel_err(p, pr) < 1e-6
    assert rel_err(m, mr) < 1e-6
    assert rel_err(v, vr) < 1e-6
    # the working copy is p in bf16 (the interpreter truncates, so one ulp rather than half)
    assert ((out.float() - p).abs() <= p.abs() * 2**-7).all()

    adamw_step(p, grads[0], m, v, None, step=5, grad_scale=1.0, **HP)  # master is the weights
    adamw_step_ref(pr, grads[0], mr, vr, None, step=5, grad_scale=1.0, **HP)
    assert rel_err(p, pr) < 1e-6


@needs_triton
@pytest.mark.parametrize("n", [1, 1000, 5000])
def test_grad_norm_kernel(monkeypatch, n):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    monkeypatch.setattr(adamw_mod, "NORM_BLOCK", 64)  # 5000 -> 79 -> 2 partial sums -> root
    g = torch.randn(n, generator=torch.Generator().manual_seed(n))
    for x in (g, g.to(torch.bfloat16)):
        out = grad_norm(x)
        assert out.shape == () and out.dtype == torch.float32
        assert rel_err(out, grad_norm_ref(x)) < 1e-6


def test_clip_scale():
    assert float(clip_scale(torch.tensor(10.0), 1.0)) == pytest.approx(0.1, rel=1e-6)
    assert float(clip_scale(torch.tensor(0.5), 1.0)) == 1.0
    s = clip_scale(grad_norm_ref(torch.full((4,), 3.0)), 2.0)  # norm 6
    assert s.shape == () and float(s) == pytest.approx(2 / 6, rel=1e-5)


# ---------------------------------------------------------------- GPU: real shapes, bf16
@gpu
@needs_cuda
@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_gpu_qwen3_shapes(monkeypatch, with_entropy):
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    n, d, v = 8192, 1024, 151936
    h, W, tgt, dlp, dent = _inputs(seed=4, device="cuda", n=n, d=d, v=v, scale=2.0)
    hb, Wb = h.bfloat16(), W.bfloat16()
    hf, Wf = hb.float(), Wb.float()  # the same values, fp32 math
    T = 0.8
    # bf16 logits carry ~2^-9 relative error into p: tolerances as measured for the bf16 twin
    lp, ent, lse = logprob_fwd(hb, Wb, tgt, T, with_entropy)
    lp_r, ent_r, lse_r = logprob_fwd_ref(hf, Wf, tgt, T, with_entropy)
    assert rel_err(lp, lp_r) < 5e-3
    assert rel_err(lse, lse_r) < 5e-3
    if with_entropy:
        assert rel_err(ent, ent_r) < 1e-2
    de = dent if with_entropy else None
    dW = torch.full((v, d), 0.01, device="cuda", dtype=torch.float32)  # accumulated into
    dW_r = torch.zeros_like(dW)
    dh = logprob_bwd(dlp, de, hb, Wb, tgt, lse, dW, T)
    dh_r = logprob_bwd_ref(dlp, de, hf, Wf, tgt, lse_r, dW_r, T)
    assert dh.dtype == torch.bfloat16
    assert rel_err(dh, dh_r) < 3e-2
    assert rel_err(dW - 0.01, dW_r) < 3e-2
    dWb = torch.zeros(v, d, device="cuda", dtype=torch.bfloat16)  # a bf16 accumulator too
    logprob_bwd(dlp, de, hb, Wb, tgt, lse, dWb, T)
    assert rel_err(dWb, dW_r) < 3e-2


@gpu
@needs_cuda
def test_adamw_gpu_600m(monkeypatch):
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    n = 600_000_123
    torch.manual_seed(0)
    p = torch.randn(n, device="cuda")
    pr = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    mr, vr = torch.zeros_like(p), torch.zeros_like(p)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for t in range(1, 3):
        g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        norm = grad_norm(g)
        assert rel_err(norm, grad_norm_ref(g)) < 1e-5
        s = clip_scale(norm, 1.0)
        adamw_step(p, g, m, v, out, step=t, grad_scale=s, **HP)
        adamw_step_ref(pr, g, mr, vr, None, step=t, grad_scale=s, **HP)
        del g
    assert rel_err(p, pr) < 1e-6
    assert rel_err(m, mr) < 1e-6
    assert rel_err(v, vr) < 1e-6
    assert torch.equal(out[-1000:], p[-1000:].bfloat16())
