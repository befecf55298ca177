"""acc_wgrad, the weight-gradient accumulation of every matmul layer and the fused LM head:
the CPU fallback, the support probe, and on the GPU cuBLAS's in-place fp32 accumulation of
a bf16 product (no bf16 rounding of the product) with real errors left to surface."""

import pytest
import torch

from rlcu.ops import _matmul
from rlcu.ops._matmul import acc_wgrad, mixed_addmm_supported

BF16, F32 = torch.bfloat16, torch.float32


def _operands(device, n=96, m=48, k=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, k, generator=gen)
    dy = torch.randn(n, m, generator=gen).to(BF16)
    x = torch.randn(n, k, generator=gen).to(BF16)
    return g.to(device), dy.to(device), x.to(device)


def test_cpu_fallback_adds_the_product():
    g, dy, x = _operands("cpu")
    want = g + (dy.t() @ x).float()
    acc_wgrad(g, dy, x)
    assert torch.equal(g, want)
    g32 = g.clone()
    acc_wgrad(g32, dy.float(), x.float())  # same dtype: addmm_ in place
    torch.testing.assert_close(g32, g + dy.float().t() @ x.float())


def test_probe_failure_is_cached_and_reported(monkeypatch):
    calls = []

    def no_overload(*a, **kw):
        calls.append(kw)
        raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")

    monkeypatch.setattr(_matmul, "_MIXED_ADDMM", {})
    monkeypatch.setattr(torch, "addmm", no_overload)
    dev = torch.device("cpu")
    assert mixed_addmm_supported(dev, BF16, F32) is False
    assert mixed_addmm_supported(dev, BF16, F32) is False
    assert len(calls) == 1  # probed once per (device, dtypes)


@pytest.mark.gpu
def test_gpu_bf16_product_accumulates_in_fp32():
    """The fused path is taken (the probe says so on this torch) and is closer to the exact
    sum than the fallback's bf16-rounded product; a real error (bad shape) is raised, not
    taken for a missing overload."""
    g, dy, x = _operands("cuda", n=512, m=256, k=192)
    exact = g.double() + dy.double().t() @ x.double()
    assert mixed_addmm_supported(g.device, BF16, F32)
    fused = g.clone()
    acc_wgrad(fused, dy, x)
    rounded = g + (dy.t() @ x).float()

    def err(a):
        return float((a.double() - exact).norm() / exact.norm())

    assert err(fused) < 1e-5, err(fused)
    assert err(rounded) > 10 * err(fused), (err(rounded), err(fused))
    with pytest.raises(RuntimeError):
        acc_wgrad(torch.zeros(255, 192, device="cuda"), dy, x)
    assert mixed_addmm_supported(g.device, BF16, F32)
