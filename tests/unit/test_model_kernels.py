"""The whole model through the Triton kernels: on the CPU under TRITON_INTERPRET=1 against HF
(fp32), and on the GPU in bf16 against the fp32 reference twins (marked `gpu`)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from support.hf_util import make_hf_model, rel_err  # noqa: E402

import rlcu  # noqa: E402

pytest.importorskip("triton")


def _batch(lens, V, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (sum(lens),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return tokens.to(device), cu.to(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; the GPU runs the bf16 test")
def test_model_through_kernels_matches_hf(tmp_path, monkeypatch):
    hf, folder = make_hf_model(tmp_path, tied=True, num_hidden_layers=1, hidden_size=64,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=80, vocab_size=131)
    m = rlcu.Qwen3.from_pretrained(folder)
    tokens, cu = _batch([19, 6], 131)
    N = tokens.numel()
    dlp, dent = torch.randn(N), torch.randn(N)
    out = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("RLCU_BACKEND", backend)
        m.zero_grad()
        lp, ent = m.forward(tokens, cu, return_entropy=True)
        m.backward(dlp, dent)
        out[backend] = (lp, ent, m.grad_flat.clone())
    lp_t, ent_t, g_t = out["torch"]
    lp_k, ent_k, g_k = out["triton"]
    assert rel_err(lp_k, lp_t) < 1e-5 and rel_err(ent_k, ent_t) < 1e-5
    views_k, views_t = m.layout.hf_views(g_k), m.layout.hf_views(g_t)
    for name in views_t:
        assert rel_err(views_k[name], views_t[name]) < 1e-4, name
    # and the kernel path against HF directly
    ids = tokens[:19][None]
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(m.logits(ids), ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [True, False])
def test_model_bf16_kernels_vs_fp32_reference(tied):
    cfg = rlcu.Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=tied)
    ref = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.float32, seed=1)
    m = rlcu.Qwen3.from_config(cfg, device="cuda", dtype=torch.bfloat16, seed=1)
    tokens, cu = _batch([1024, 517, 2555], cfg.vocab_size, "cuda")
    N = tokens.numel()
    g = torch.Generator(device="cuda").manual_seed(0)
    dlp = torch.randn(N, device="cuda", generator=g)
    dent = torch.randn(N, device="cuda", generator=g)
    os.environ["RLCU_BACKEND"] = "torch"
    try:
        ref.zero_grad()
        lp_r, ent_r = ref.forward(tokens, cu, return_entropy=True)
        ref.backward(dlp, dent)
    finally:
        del os.environ["RLCU_BACKEND"]
    m.zero_grad()
    lp, ent = m.forward(tokens, cu, return_entropy=True)
    m.backward(dlp, dent)
    assert torch.isfinite(lp).all() and torch.isfinite(m.grad_flat).all()
    assert rel_err(lp, lp_r) < 2e-2, rel_err(lp, lp_r)
    assert rel_err(ent, ent_r) < 2e-2
    for name, gr in ref.grads.items():
        assert rel_err(m.grads[name], gr) < 5e-2, (name, rel_err(m.grads[name], gr))
