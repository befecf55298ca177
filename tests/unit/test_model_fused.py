"""Qwen3.forward_backward (the LM head's gradient taken in its forward sweep) against
forward then backward, on a tiny model, fp32, CPU. Skipped until the model has the method."""

import pytest
import torch
from support.hf_util import rel_err

import rlcu
from rlcu.ops import logprob as logprob_mod

pytestmark = pytest.mark.skipif(not hasattr(rlcu.Qwen3, "forward_backward"),
                                reason="Qwen3.forward_backward is not there yet")

TINY = {"vocab_size": 333, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512}
LENS = [31, 17, 1, 6, 9]  # a one-token sequence has no head row at all


def _model(tied: bool, seed=0):
    m = rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY, tie_word_embeddings=tied), seed=seed,
                               init_std=0.1)
    with torch.no_grad():  # every norm matters
        for name, v in m.w.items():
            if name.endswith("norm"):
                v.copy_(1 + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(len(name))))
    return m


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY["vocab_size"], (sum(LENS),), generator=g)
    cu = torch.tensor([0] + torch.tensor(LENS).cumsum(0).tolist(), dtype=torch.int32)
    return tokens, cu


class TokenLoss:
    """Per-token clipped surrogate with weights (PPO/GRPO) and an entropy term nonlinear in
    ent, as a function of token positions:
        dlp_i = -w_i r_i A_i where the clip is not active (r_i = exp(lp_i - old_i)), else 0
        dent_i = -c w_i tanh(ent_i)."""

    def __init__(self, N, lp0, c_ent, seed=0, eps=0.2):
        g = torch.Generator().manual_seed(seed + 7)
        self.old = lp0 + 0.3 * torch.randn(N, generator=g)
        self.adv = torch.randn(N, generator=g)
        self.w = torch.rand(N, generator=g)
        self.c_ent, self.eps, self.seen = c_ent, eps, []

    def __call__(self, lp, ent, idx):
        self.seen.append(idx.clone())
        r = torch.exp(lp - self.old[idx])
        a = -r * self.adv[idx]
        b = -r.clamp(1 - self.eps, 1 + self.eps) * self.adv[idx]
        dlp = torch.where(b > a, torch.zeros_like(a), a) * self.w[idx]
        dent = None if not self.c_ent else -self.c_ent * self.w[idx] * torch.tanh(ent)
        return dlp, dent


CASES = ([(tied, True, ent, c) for tied in (False, True) for ent, c in ((False, 0.0), (True, 0.0), (True, 0.4))]
         + [(True, ckpt, True, 0.4) for ckpt in ("attention", False)])


@pytest.mark.parametrize("tied,ckpt,return_entropy,c_ent", CASES)
def test_forward_backward_equals_forward_then_backward(monkeypatch, tied, ckpt, return_entropy, c_ent):
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    monkeypatch.setattr(logprob_mod, "_CHUNK", 16)  # the head runs in several chunks
    m = _model(tied)
    m.gradient_checkpointing = ckpt
    tokens, cu = _packed()
    N, T = tokens.numel(), 0.8
    with torch.no_grad():
        lp0 = m.forward(tokens, cu, temperature=T, grad=False)
    loss = TokenLoss(N, lp0, c_ent)

    # the separate path: forward, the same per-token function on every position, backward
    m.zero_grad()
    out = m.forward(tokens, cu, temperature=T, return_entropy=return_entropy)
    lp_s, ent_s = out if return_entropy else (out, None)
    dlp, dent = loss(lp_s, ent_s, torch.arange(N))
    m.backward(dlp, dent)
    g_s = m.grad_flat.clone()

    m.zero_grad()
    loss.seen.clear()
    out = m.forward_backward(tokens, cu, loss, temperature=T, return_entropy=return_entropy)
    lp, ent = out if return_entropy else (out, None)

    first = cu[:-1].long()
    head = torch.ones(N, dtype=torch.bool)
    head[first] = False
    seen = torch.cat(loss.seen)
    assert torch.equal(seen, head.nonzero()[:, 0])  # every predicted token once, in order
    assert len(loss.seen) == -(-int(head.sum()) // 16)
    assert torch.all(lp[first] == 0)
    assert rel_err(lp, lp_s) < 1e-5
    if return_entropy:
        assert torch.all(ent[first] == 0)
        assert rel_err(ent, ent_s) < 1e-5
    else:
        assert not isinstance(out, tuple)
    assert rel_err(m.grad_flat, g_s) < 1e-5
    views = m.layout.hf_views(g_s)
    for name, gv in m.grads.items():  # each tensor, not only the whole
        assert rel_err(gv, views[name]) < 1e-4, name
    with pytest.raises(RuntimeError):  # nothing is left for a backward()
        m.backward(dlp, dent)


def test_forward_backward_accumulates(monkeypatch):
    """Two calls add up, as two forward/backward pairs do (micro-batches)."""
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    m = _model(False, seed=1)
    tokens, cu = _packed(seed=1)
    N = tokens.numel()

    def sft(lp, ent, idx):
        return torch.full_like(lp, -1.0 / N), None

    m.zero_grad()
    m.forward_backward(tokens, cu, sft)
    m.forward_backward(tokens, cu, sft)
    g2 = m.grad_flat.clone()
    m.zero_grad()
    m.forward(tokens, cu)
    m.backward(torch.full((N,), -2.0 / N))
    assert rel_err(g2, m.grad_flat) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_forward_backward_gpu_bf16(monkeypatch, tied):
    """The Triton path in bf16 (a head of several chunks): the same kernels and GEMMs as
    forward then backward, so equal up to bf16 rounding."""
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    monkeypatch.setattr(logprob_mod, "CHUNK_ROWS", 512)
    cfg = rlcu.Qwen3Config(**{**TINY, "vocab_size": 4099, "hidden_size": 256, "intermediate_size": 512,
                              "num_attention_heads": 4, "head_dim": 64, "max_position_embeddings": 1024},
                           tie_word_embeddings=tied)
    m = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=2, init_std=0.05)
    g = torch.Generator().manual_seed(2)
    lens = [700, 1, 300, 513]
    tokens = torch.randint(0, cfg.vocab_size, (sum(lens),), generator=g).cuda()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    N = tokens.numel()
    with torch.no_grad():
        lp0 = m.forward(tokens, cu, grad=False).cpu()
    loss = TokenLoss(N, lp0, 0.3, seed=2)
    loss.old, loss.adv, loss.w = loss.old.cuda(), loss.adv.cuda(), loss.w.cuda()

    m.zero_grad()
    lp_s, ent_s = m.forward(tokens, cu, return_entropy=True)
    m.backward(*loss(lp_s, ent_s, torch.arange(N, device="cuda")))
    g_s = m.grad_flat.clone()
    m.zero_grad()
    lp, ent = m.forward_backward(tokens, cu, loss, return_entropy=True)
    assert rel_err(lp, lp_s) < 1e-5
    assert rel_err(ent, ent_s) < 1e-5
    assert rel_err(m.grad_flat, g_s) < 1e-2
