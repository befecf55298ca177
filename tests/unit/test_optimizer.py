"""FlatAdamW against torch.optim.AdamW (+ clip_grad_norm_), non-finite skipping and abort,
bf16 working weights with an fp32 master, state round trip; the lr schedule."""

import math

import pytest
import torch

from rlcu.config import OptimConfig
from rlcu.errors import NonFiniteError
from rlcu.optim import FlatAdamW
from rlcu.train.schedule import lr_at

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Flat:
    """The optimizer's view of a model: .flat, .grad_flat, .layout."""

    def __init__(self, n=333, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.flat = torch.randn(n, generator=g).to(dtype)
        self.grad_flat = torch.zeros(n)
        self.layout = None


def _grads(n, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (10 if i % 2 else 0.1) for i in range(steps)]


@pytest.mark.parametrize("max_norm, wd", [(1.0, 0.0), (0.0, 0.1), (5.0, 0.01)])
def test_matches_torch_adamw(max_norm, wd):
    cfg = OptimConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, max_grad_norm=max_norm)
    m = Flat()
    opt = FlatAdamW(m, cfg)
    p = m.flat.clone().requires_grad_(True)
    ref = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for i, g in enumerate(_grads(333, 4)):
        lr = 1e-2 * (i + 1) / 4
        m.grad_flat.copy_(g)
        info = opt.step(lr, loss=1.0)
        p.grad = g.clone()
        n = torch.nn.utils.clip_grad_norm_([p], max_norm) if max_norm > 0 else g.norm()
        for pg in ref.param_groups:
            pg["lr"] = lr
        ref.step()
        assert info["skipped"] == 0 and math.isclose(info["grad_norm"], float(g.norm()), rel_tol=1e-5)
        if max_norm > 0:
            assert math.isclose(info["clip_scale"], min(1.0, max_norm / (float(n) + 1e-6)), rel_tol=1e-5)
    err = float((m.flat - p.detach()).norm() / p.detach().norm())
    assert err < 1e-6, err
    assert opt.master is m.flat  # fp32 model: the master is the model's own buffer


def test_bf16_working_weights_follow_master():
    m = Flat(dtype=torch.bfloat16)
    opt = FlatAdamW(m, OptimConfig(lr=1e-2))
    assert opt.master.dtype == torch.float32 and opt.master is not m.flat
    for g in _grads(333, 3):
        m.grad_flat.copy_(g)
        opt.step(1e-2)
    assert torch.equal(m.flat, opt.master.to(torch.bfloat16))
    sd = opt.state_dict()
    assert "master" in sd
    m2 = Flat(dtype=torch.bfloat16, seed=5)
    opt2 = FlatAdamW(m2, OptimConfig(lr=1e-2))
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.master, opt.master) and torch.equal(m2.flat, m.flat)
    assert torch.equal(opt2.m, opt.m) and torch.equal(opt2.v, opt.v) and opt2.step_count == 3


def test_nonfinite_skips_then_aborts():
    m = Flat()
    opt = FlatAdamW(m, OptimConfig(lr=1e-2, max_nonfinite_in_row=3))
    m.grad_flat.normal_()
    opt.step(1e-2)
    before = (m.flat.clone(), opt.m.clone(), opt.v.clone())
    m.grad_flat[7] = float("nan")
    info = opt.step(1e-2)
    assert info["skipped"] == 1 and info["nonfinite_in_row"] == 1 and math.isnan(info["grad_norm"])
    m.grad_flat.normal_()
    info = opt.step(1e-2, loss=float("inf"))  # a non-finite loss skips too
    assert info["skipped"] == 1 and info["nonfinite_in_row"] == 2
    for a, b in zip(before, (m.flat, opt.m, opt.v)):
        assert torch.equal(a, b)  # skipped steps change nothing
    assert opt.step_count == 1
    info = opt.step(1e-2, loss=torch.tensor(0.5))  # a good step resets the count
    assert info["skipped"] == 0 and opt.nonfinite_in_row == 0 and opt.step_count == 2
    m.grad_flat.fill_(float("inf"))
    opt.step(1e-2)
    opt.step(1e-2)
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row had a non-finite gradient norm") as e:
        opt.step(1e-2)
    assert e.value.info["skipped"] == 1 and opt.skipped_total == 5


def test_state_shape_mismatch():
    opt = FlatAdamW(Flat(), OptimConfig())
    sd = FlatAdamW(Flat(n=64), OptimConfig()).state_dict()
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(sd)


def test_schedule():
    c = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    lrs = [lr_at(s, c, 14) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and all(a > b for a, b in zip(lrs[4:], lrs[5:]))
    assert math.isclose(lr_at(9, c, 14), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert math.isclose(lr_at(14, c, 14), 0.1)
    k = OptimConfig(lr=0.5, warmup_steps=2)
    assert [lr_at(s, k, 10) for s in range(4)] == [0.25, 0.5, 0.5, 0.5]
    assert lr_at(0, OptimConfig(lr=0.3), 1) == 0.3
