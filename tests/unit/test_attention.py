"""Varlen causal GQA attention: Triton kernels vs the twin, and the twin vs autograd of a
naive attention. CPU runs the kernels through TRITON_INTERPRET=1 at small odd shapes."""

import os

import pytest
import torch
from support.hf_util import rel_err

import rlcu.ops.attention as attn

# conftest.py sets TRITON_INTERPRET=1 without a GPU (before triton is imported) and patches
# the interpreter for numpy >= 2.4
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

attention_fwd, attention_bwd = attn.attention_fwd, attn.attention_bwd
attention_fwd_ref, attention_bwd_ref = attn.attention_fwd_ref, attn.attention_bwd_ref

SEQLENS = (1, 17, 0, 63, 40)  # odd lengths, a single token, an empty sequence
PAD = 5  # rows past cu_seqlens[-1]: a padded token budget


def _packed(seqlens, Hq, Hk, D, dtype=torch.float32, device="cpu", pad=0, seed=0):
    """q, k, v as strided views of one fused [N, (Hq + 2 Hk) D] matrix, as the model has them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    N = sum(seqlens) + pad
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, generator=g).to(device, dtype)
    q = qkv[:, : Hq * D].view(N, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(N, Hk, D)
    do = torch.randn(N, Hq, D, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, do, cu, max(seqlens)


def _naive(q, k, v, cu, scale):
    """Attention one sequence at a time, written independently of the twin (for autograd)."""
    outs, lses = [], []
    G = q.shape[1] // k.shape[1]
    for i in range(cu.numel() - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        qs, ks, vs = q[s:e], k[s:e].repeat_interleave(G, 1), v[s:e].repeat_interleave(G, 1)
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        causal = torch.arange(e - s)[:, None] >= torch.arange(e - s)[None, :]
        logits = torch.where(causal, logits, torch.full_like(logits, float("-inf")))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), vs))
        lses.append(torch.logsumexp(logits, -1))
    return torch.cat(outs), torch.cat(lses, 1)


def test_twin_matches_autograd():
    q, k, v, do, cu, T = _packed(SEQLENS, 6, 2, 24, dtype=torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    scale = 24**-0.5
    o_ref, lse_ref = _naive(q, k, v, cu, scale)
    o_ref.backward(do)
    o_ref, lse_ref = o_ref.detach(), lse_ref.detach()
    with torch.no_grad():
        o, lse = attention_fwd_ref(q, k, v, cu, T, scale)
        dq, dk, dv = attention_bwd_ref(do, q, k, v, o, lse, cu, T, scale)
    assert rel_err(o, o_ref) < 1e-6 and rel_err(lse, lse_ref) < 1e-6
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert rel_err(got, want) < 1e-6


@pytest.mark.parametrize("D", [24, 64])
@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through the interpreter (the gpu tests cover the GPU)")
def test_kernel_matches_twin(monkeypatch, D):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    Hq, Hk = 6, 2
    q, k, v, do, cu, T = _packed(SEQLENS, Hq, Hk, D, pad=PAD, seed=D)
    scale = D**-0.5
    o, lse = attention_fwd(q, k, v, cu, T, scale)
    o_ref, lse_ref = attention_fwd_ref(q, k, v, cu, T, scale)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(lse, lse_ref) < 1e-5
    grads = attention_bwd(do, q, k, v, o, lse, cu, T, scale)
    grads_ref = attention_bwd_ref(do, q, k, v, o_ref, lse_ref, cu, T, scale)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert rel_err(got, want) < 1e-5, name
    # rows past the last sequence are zero everywhere
    for t in (o, *grads):
        assert not t[-PAD:].any()
    assert not lse[:, -PAD:].any()


# ------------------------------------------------------------------------------ GPU, bf16
def _gpu_check(monkeypatch, seqlens, Hq, Hk, D, pad=0, dtype=torch.bfloat16):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    q, k, v, do, cu, T = _packed(seqlens, Hq, Hk, D, dtype=dtype, device="cuda", pad=pad)
    scale = D**-0.5
    o, lse = attention_fwd(q, k, v, cu, T, scale)
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, cu, T, scale)
    f = [t.float() for t in (q, k, v, do)]
    o_ref, lse_ref = attention_fwd_ref(*f[:3], cu, T, scale)
    assert rel_err(o, o_ref) < 1e-2 and rel_err(lse, lse_ref) < 1e-3
    # the reference backward on the kernel's own (bf16) o and lse isolates the backward's error
    refs = attention_bwd_ref(f[3], *f[:3], o.float(), lse, cu, T, scale)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert rel_err(got, want) < 1e-2, name
    if pad:
        assert not o[-pad:].any() and not dq[-pad:].any() and not dk[-pad:].any() and not dv[-pad:].any()
    # deterministic: no atomics anywhere
    again = attention_bwd(do, q, k, v, o, lse, cu, T, scale)
    assert all(torch.equal(a, b) for a, b in zip(again, (dq, dk, dv)))


@pytest.mark.gpu
@pytest.mark.parametrize("seqlens", [(4096,), (1000, 17, 1, 2047, 63, 777, 191)])
def test_gpu_qwen3_heads(monkeypatch, seqlens):
    _gpu_check(monkeypatch, seqlens, Hq=16, Hk=8, D=128, pad=3)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 96, 24])
def test_gpu_other_head_dims(monkeypatch, D):
    _gpu_check(monkeypatch, (1024, 333, 1, 1500), Hq=8, Hk=2, D=D)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [128, 256])
def test_gpu_fp32_tf32(monkeypatch, D):
    # fp32 rows are twice as wide in shared memory: the launcher takes smaller tiles
    _gpu_check(monkeypatch, (700, 1, 333), Hq=4, Hk=2, D=D, pad=2, dtype=torch.float32)
