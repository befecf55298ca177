"""ops/lora.py, the grouped LoRA shrink and expand: the kernels (on the CPU through TRITON_INTERPRET=1)
and the twin against a plain float64 reference at odd shapes (T not a multiple of the row tile, K
and the slices odd multiples of 8, r in {8, 16, 64}, 1 or 3 adapters, rows without adapter mixed
in); the rounding of y (the twin's bits where the sums are exact); batch invariance bit for bit
(a row alone, in a shorter batch, among other adapters, in another order); the argument checks.
The `gpu` tests: the decode tiles against prefill's on the device, and a CUDA graph's replay."""

import pytest
import torch

from rlcu.ops import lora
from rlcu.ops.lora import (
    lora_apply,
    lora_apply_triton,
    lora_expand,
    lora_expand_ref,
    lora_expand_triton,
    lora_shrink,
    lora_shrink_ref,
    lora_shrink_triton,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BF = torch.bfloat16
SHRINK = {"kernel": lora_shrink_triton, "twin": lora_shrink_ref}
EXPAND = {"kernel": lora_expand_triton, "twin": lora_expand_ref}
# (r, slices' widths): a plain module's one slice, gate_up's two, qkv's three (odd multiples of 8)
CASES = [(8, (40, 24, 24)), (16, (56, 40)), (64, (24,))]


def _slices(widths):
    bounds = torch.tensor((0,) + widths).cumsum(0).tolist()
    return tuple(zip(bounds[:-1], bounds[1:]))


def _case(T, K, r, widths, n, seed=0, dtype=BF):
    g = torch.Generator().manual_seed(seed)
    S, N = len(widths), sum(widths)
    x = torch.randn(T, K, generator=g).to(dtype)
    a = (torch.randn(n, S * r, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(n, N, r, generator=g).to(dtype)
    idx = torch.randint(-1, n, (T,), generator=g, dtype=torch.int32)
    idx[:3] = torch.tensor([-1, n - 1, 0], dtype=torch.int32)  # both ends and a row without adapter, always
    scale = torch.rand(n, generator=g) + 0.25
    y = torch.randn(T, N, generator=g).to(dtype)
    return x, a, b, idx, scale, y, _slices(widths)


def _ref_h(x, a, idx):
    h = torch.einsum("tk,trk->tr", x.double(), a[idx.clamp(min=0).long()].double())
    return torch.where(idx[:, None] >= 0, h, 0.0)


def _ref_y(h, b, idx, y, scale, slices):
    """y + scale h b^T in float64 (not rounded)."""
    r, out = b.shape[2], y.double().clone()
    bi, si = b[idx.clamp(min=0).long()].double(), scale[idx.clamp(min=0).long()].double()
    for j, (c0, c1) in enumerate(slices):
        upd = torch.einsum("tk,tck->tc", h[:, j * r:(j + 1) * r].double(), bi[:, c0:c1])
        out[:, c0:c1] += torch.where(idx[:, None] >= 0, si[:, None] * upd, 0.0)
    return out


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("impl", ["kernel", "twin"])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("r,widths", CASES)
def test_shrink_and_expand_match_reference(impl, n, r, widths):
    x, a, b, idx, scale, y, slices = _case(37, 200, r, widths, n)
    h = SHRINK[impl](x, a, idx)
    assert h.dtype == torch.float32 and h.shape == (37, len(widths) * r)
    assert _rel(h, _ref_h(x, a, idx)) < 1e-6  # exact products, fp32 sums
    assert torch.equal(h[idx < 0], torch.zeros_like(h[idx < 0]))
    # y in fp32 shows the update's own error (h to ~16 bits in a bf16 product); in bf16 its rounding
    want = _ref_y(h, b, idx, y.float(), scale, slices)
    y32 = EXPAND[impl](h, b, idx, y.float().clone(), scale, slices)
    assert _rel(y32 - y.float(), want - y.double()) < 1e-4
    y16 = y.clone()
    assert EXPAND[impl](h, b, idx, y16, scale, slices) is y16  # in place
    assert torch.equal(y16[idx < 0], y[idx < 0])  # rows without adapter untouched
    assert _rel(y16, want) < 4e-3
    # one rounding of the update into y: half a bf16 step from the exact sum at most, beside the
    # update's own error (h to ~16 bits, fp32 sums), which may exceed it where y + update cancels
    step = (want.abs().clamp_min(1e-30).log2().floor() - 7).exp2()
    mag = _ref_y(h.abs(), b.abs(), idx, torch.zeros_like(want), scale, slices)  # sum of |terms|
    assert ((y16.double() - want).abs() <= 0.5 * step + 1e-4 * mag).all()


def _exact_case(T, K, r, widths, n, seed=1):
    """Small integers (and h with a low half): every product and sum exact in fp32, in any order."""
    g = torch.Generator().manual_seed(seed)
    S, N = len(widths), sum(widths)
    x = torch.randint(-4, 5, (T, K), generator=g).to(BF)
    a = torch.randint(-4, 5, (n, S * r, K), generator=g).to(BF)
    h = torch.randint(-512, 512, (T, S * r), generator=g) + torch.randint(0, 64, (T, S * r), generator=g) / 64
    b = torch.randint(-8, 9, (n, N, r), generator=g).to(BF)
    idx = torch.randint(-1, n, (T,), generator=g, dtype=torch.int32)
    y = torch.randn(T, N, generator=g).to(BF)
    return x, a, h.float(), b, idx, torch.tensor([0.3, 1.7, 0.011])[:n], y, _slices(widths)


@pytest.mark.parametrize("r,widths", CASES[:2])
def test_rounding_is_the_twins_bits(r, widths):
    """Where the sums are exact, the kernel's h and y are the twin's bit for bit: the same products,
    hi/lo split of h, scale product, add and round to nearest even into bf16 y."""
    x, a, h, b, idx, scale, y, slices = _exact_case(29, 72, r, widths, 3)
    assert torch.equal(lora_shrink_triton(x, a, idx), lora_shrink_ref(x, a, idx))
    assert (h != h.to(BF).float()).any()  # the low half is used
    yk = lora_expand_triton(h, b, idx, y.clone(), scale, slices)
    yt = lora_expand_ref(h, b, idx, y.clone(), scale, slices)
    assert torch.equal(yk, yt)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_row_alone_equals_row_in_batch(impl):
    """A row's h and y bits do not depend on T, the other rows, their adapters or the row order:
    alone, in a prefix, in a batch whose other rows use other adapters, and in grouped order."""
    r, widths = 8, (40, 24, 24)
    x, a, b, idx, scale, y, slices = _case(37, 136, r, widths, 3, seed=4)
    shrink, expand = SHRINK[impl], EXPAND[impl]
    h = shrink(x, a, idx)
    yb = expand(h, b, idx, y.clone(), scale, slices)
    for t in (0, 1, 2, 17, 36):
        s = slice(t, t + 1)
        assert torch.equal(shrink(x[s], a, idx[s]), h[s]), t
        assert torch.equal(expand(h[s], b, idx[s], y[s].clone(), scale, slices), yb[s]), t
    assert torch.equal(shrink(x[:21], a, idx[:21]), h[:21])
    other = torch.where(idx >= 0, (idx + 1) % 3, idx)
    other[5] = idx[5]
    assert torch.equal(shrink(x, a, other)[5], h[5])
    assert torch.equal(expand(h, b, other, y.clone(), scale, slices)[5], yb[5])
    order = idx.argsort(stable=True).to(torch.int32)
    assert torch.equal(shrink(x, a, idx, order), h)
    assert torch.equal(expand(h, b, idx, y.clone(), scale, slices, order), yb)


def test_trainer_call_idx_all_zero_is_the_engines_row():
    """The trainer's call (one adapter, idx all 0, many rows) gives the engine's bits for a row
    that sits among rows of other adapters."""
    x, a, b, idx, scale, y, slices = _case(40, 136, 16, (56, 40), 3, seed=5)
    zero = torch.zeros(40, dtype=torch.int32)
    h0 = lora_shrink_triton(x, a, zero)
    y0 = lora_expand_triton(h0, b, zero, y.clone(), scale, slices)
    rows = (idx == 0).nonzero().flatten()
    h = lora_shrink_triton(x, a, idx)
    assert torch.equal(h[rows], h0[rows])
    assert torch.equal(lora_expand_triton(h, b, idx, y.clone(), scale, slices)[rows], y0[rows])


def test_fp32_operands_and_dispatch(monkeypatch):
    """The CPU model's fp32 path through both backends; the public op picks the twin on CPU
    tensors and the kernel with RLCU_BACKEND=triton."""
    x, a, b, idx, scale, y, slices = _case(19, 48, 8, (24, 16), 3, seed=6, dtype=torch.float32)
    h = lora_shrink(x, a, idx)
    assert torch.equal(h, lora_shrink_ref(x, a, idx))
    want = _ref_y(h, b, idx, y, scale, slices)
    assert _rel(lora_expand(h, b, idx, y.clone(), scale, slices), want) < 1e-6
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    assert _rel(lora_shrink(x, a, idx), _ref_h(x, a, idx)) < 1e-6
    assert _rel(lora_expand(h, b, idx, y.clone(), scale, slices), want) < 1e-6
    assert lora_shrink(x[:0], a, idx[:0]).shape == (0, 16)


def test_apply_is_shrink_then_expand_bit_for_bit(monkeypatch):
    """lora_apply, shrink then expand with the split partials added by the expand (K = 200: four
    splits under the interpreter), or by the reduce past fuse_max_t rows: the two ops' bits, in
    any row order; the twin path the twins'; the checks of both ops."""
    x, a, b, idx, scale, y, slices = _case(37, 200, 16, (56, 40), 3, seed=9)
    order = idx.argsort(stable=True).to(torch.int32)
    want = lora_expand_triton(lora_shrink_triton(x, a, idx), b, idx, y.clone(), scale, slices)
    for fuse in (256, 8):
        monkeypatch.setitem(lora._INTERPRET, "fuse_max_t", fuse)
        yk = y.clone()
        assert lora_apply_triton(x, a, b, idx, yk, scale, slices) is yk
        assert torch.equal(yk, want), fuse
        assert torch.equal(lora_apply_triton(x, a, b, idx, y.clone(), scale, slices, order), want), fuse
    twin = lora_expand_ref(lora_shrink_ref(x, a, idx), b, idx, y.clone(), scale, slices)
    assert torch.equal(lora_apply(x, a, b, idx, y.clone(), scale, slices), twin)
    with pytest.raises(ValueError, match="need h"):
        lora_apply(x, a, b, idx, y, scale, ((0, 40),))
    with pytest.raises(ValueError, match="idx must be int32"):
        lora_apply(x, a, b, idx.long(), y, scale, slices)


def test_checks_name_the_argument():
    x, a, b, idx, scale, y, slices = _case(9, 32, 8, (24, 16), 2)
    h = lora_shrink_ref(x, a, idx)
    with pytest.raises(ValueError, match="idx must be int32"):
        lora_shrink(x, a, idx.long())
    with pytest.raises(ValueError, match=r"a \[n, R, K\]"):
        lora_shrink(x, a[:, :, :16], idx)
    with pytest.raises(TypeError, match="share a dtype"):
        lora_shrink(x.float(), a, idx)
    with pytest.raises(ValueError, match="order must be"):
        lora_shrink(x, a, idx, torch.arange(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="need h"):
        lora_expand(h, b, idx, y, scale, ((0, 40),))
    with pytest.raises(ValueError, match="column ranges"):
        lora_expand(h, b, idx, y, scale, ((0, 24), (24, 41)))
    with pytest.raises(ValueError, match="scale must be"):
        lora_expand(h, b, idx, y, scale[:1], slices)
    with pytest.raises(ValueError, match="h must be fp32"):
        lora_expand(h.to(BF), b, idx, y, scale, slices)


@pytest.mark.gpu
def test_gpu_decode_tiles_give_prefill_bits():
    """On the device, at Qwen3-8B's gate_up shape: a row's bits in a 1-row call (decode's tiles)
    and a 4096-row call of mixed adapters (prefill's tiles) are the same, and match the reference."""
    x, a, b, idx, scale, y, slices = (t.cuda() if isinstance(t, torch.Tensor) else t
                                      for t in _case(4096, 4096, 64, (12288, 12288), 3, seed=7))
    h = lora_shrink(x, a, idx)
    yb = lora_expand(h, b, idx, y.clone(), scale, slices)
    assert _rel(h, _ref_h(x, a, idx)) < 1e-5
    for t in (0, 1, 2, 1000, 4095):
        s = slice(t, t + 1)
        assert torch.equal(lora_shrink(x[s], a, idx[s]), h[s]), t
        assert torch.equal(lora_expand(h[s], b, idx[s], y[s].clone(), scale, slices), yb[s]), t
    for T in (7, 64, 256, 300):
        assert torch.equal(lora_shrink(x[:T], a, idx[:T]), h[:T]), T
        assert torch.equal(lora_expand(h[:T], b, idx[:T], y[:T].clone(), scale, slices), yb[:T]), T


@pytest.mark.gpu
def test_gpu_graph_replay_follows_new_ids():
    """Captured once in a CUDA graph (no host sync), a replay with other adapter ids written into
    idx gives the eager call's bits."""
    x, a, b, idx, scale, y, slices = (t.cuda() if isinstance(t, torch.Tensor) else t
                                      for t in _case(64, 1024, 16, (1024, 256, 256), 3, seed=8))
    yg = y.clone()

    def step():
        yg.copy_(y)
        return lora_expand(lora_shrink(x, a, idx), b, idx, yg, scale, slices)

    step()  # compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in range(3):
        idx.copy_(torch.randint(-1, 3, (64,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        want = lora_expand(lora_shrink(x, a, idx), b, idx, y.clone(), scale, slices)
        assert torch.equal(yg, want), seed
