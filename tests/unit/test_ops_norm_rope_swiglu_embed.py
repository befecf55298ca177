"""RMSNorm, RoPE, SwiGLU and embedding: each Triton kernel against its reference twin (forward
and every gradient), and each twin's backward against autograd on the twin's forward.

On the CPU the kernels run under TRITON_INTERPRET=1 in fp32 at small odd shapes; the `gpu`
tests run the real Qwen3-0.6B shapes in bf16 against the twins in fp32.
"""

import pytest
import torch
import triton.runtime.interpreter as _interp
from support.hf_util import rel_err

import rlcu.ops.embedding as emb
import rlcu.ops.rmsnorm as rms
import rlcu.ops.rope as rope
import rlcu.ops.swiglu as swi
from rlcu.model.rope import RopeSpec, inv_freq

# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before triton is first imported (triton
# decides at decoration time whether a kernel is interpreted), and patches the interpreter
INTERPRET = isinstance(rms._rmsnorm_fwd_kernel, _interp.InterpretedFunction)

cpu = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before triton is imported")
TOL32 = 2e-5  # fp32 kernel vs fp32 twin (rope's cos/sin differ in the last bits)
TOL16 = 2e-2  # bf16 outputs


def freqs(theta, D, device="cpu"):
    return inv_freq(RopeSpec(theta=theta), D, device)


def _seed(s=0):
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


# ------------------------------------------------------------------ twins vs autograd
def test_rmsnorm_twin_bwd_matches_autograd():
    _seed()
    x = torch.randn(63, 96, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(96, dtype=torch.float64)).requires_grad_()
    dy = torch.randn(63, 96, dtype=torch.float64)
    y, rstd = rms.rmsnorm_fwd_ref(x, w, 1e-6)
    y.backward(dy)
    dx, dw = rms.rmsnorm_bwd_ref(dy, x.detach(), w.detach(), rstd.detach().float())
    assert rel_err(dx, x.grad) < 1e-6 and rel_err(dw, w.grad) < 1e-6


def test_rope_twin_bwd_matches_autograd():
    _seed()
    x = torch.randn(63, 3, 96, dtype=torch.float64, requires_grad=True)
    pos = torch.randint(0, 500, (63,), dtype=torch.int32)
    dy = torch.randn(63, 3, 96, dtype=torch.float64)
    f = freqs(1e4, 96)
    rope.rope_fwd_ref(x, pos, f).backward(dy)
    assert rel_err(rope.rope_bwd_ref(dy, pos, f), x.grad) < 1e-6
    # with a factor on cos and sin (YaRN's) the backward is the transpose, no longer the inverse
    x.grad = None
    rope.rope_fwd_ref(x, pos, f, 1.3).backward(dy)
    assert rel_err(rope.rope_bwd_ref(dy, pos, f, 1.3), x.grad) < 1e-6


def test_swiglu_twin_bwd_matches_autograd():
    _seed()
    gu = torch.randn(63, 160, dtype=torch.float64, requires_grad=True)
    da = torch.randn(63, 80, dtype=torch.float64)
    swi.swiglu_fwd_ref(gu).backward(da)
    assert rel_err(swi.swiglu_bwd_ref(da, gu.detach()), gu.grad) < 1e-6


def test_embedding_twin_bwd_matches_autograd():
    _seed()
    W = torch.randn(333, 96, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 333, (63,))
    ids[:9] = 7  # repeated ids must accumulate
    dx = torch.randn(63, 96, dtype=torch.float64)
    emb.embedding_fwd_ref(ids, W).backward(dx)
    dW = torch.zeros(333, 96, dtype=torch.float64)
    emb.embedding_bwd_ref(dx, ids, dW)
    assert rel_err(dW, W.grad) < 1e-12


# ------------------------------------------------------------------ kernels vs twins (CPU)
@cpu
@pytest.mark.parametrize("N,D,row_stride",
                         [(63, 96, None), (333, 96, None), (189, 24, None), (37, 96, 160), (5, 200, None)])
def test_rmsnorm_kernel(N, D, row_stride):
    _seed(N)
    base = torch.randn(N, row_stride or D)
    x = base[:, :D]  # a row-strided view when row_stride > D
    w = 1 + 0.1 * torch.randn(D)
    dy = torch.randn(N, D)
    y, rstd = rms.rmsnorm_fwd_triton(x, w, 1e-6)
    y0, rstd0 = rms.rmsnorm_fwd_ref(x, w, 1e-6)
    assert y.dtype == x.dtype and rstd.dtype == torch.float32
    assert rel_err(y, y0) < TOL32 and rel_err(rstd, rstd0) < TOL32
    dx, dw = rms.rmsnorm_bwd_triton(dy, x, w, rstd)
    dx0, dw0 = rms.rmsnorm_bwd_ref(dy, x, w, rstd0)
    assert dw.shape == (D,) and dw.dtype == torch.float32
    assert rel_err(dx, dx0) < TOL32 and rel_err(dw, dw0) < TOL32


@cpu
def test_rmsnorm_kernel_bf16():
    _seed()
    x, dy = torch.randn(63, 96).bfloat16(), torch.randn(63, 96).bfloat16()
    w = (1 + 0.1 * torch.randn(96)).bfloat16()
    y, rstd = rms.rmsnorm_fwd_triton(x, w, 1e-6)
    dx, dw = rms.rmsnorm_bwd_triton(dy, x, w, rstd)
    y0, rstd0 = rms.rmsnorm_fwd_ref(x.float(), w.float(), 1e-6)
    dx0, dw0 = rms.rmsnorm_bwd_ref(dy.float(), x.float(), w.float(), rstd0)
    assert y.dtype == dx.dtype == torch.bfloat16
    for a, b in ((y, y0), (rstd, rstd0), (dx, dx0), (dw, dw0)):
        assert rel_err(a, b) < TOL16


@cpu
@pytest.mark.parametrize("N,D,strided", [(63, 96, False), (5, 1024, True), (130, 10, False)])
def test_rmsnorm_bwd_adds_the_residual(N, D, strided):
    """The residual branch's gradient is added in the backward's pass, before its one rounding:
    the kernel against the twin, and the twin against the norm's dx plus the residual."""
    _seed(N)
    x, dy, w = torch.randn(N, D), torch.randn(N, D), 1 + 0.1 * torch.randn(D)
    res = torch.randn(N, D + 7)[:, 3 : 3 + D] if strided else torch.randn(N, D)
    _, rstd = rms.rmsnorm_fwd_ref(x, w, 1e-6)
    dx, dw = rms.rmsnorm_bwd_triton(dy, x, w, rstd, res)
    dx0, dw0 = rms.rmsnorm_bwd_ref(dy, x, w, rstd, res)
    plain, _ = rms.rmsnorm_bwd_ref(dy, x, w, rstd)
    assert rel_err(dx, dx0) < TOL32 and rel_err(dw, dw0) < TOL32
    assert rel_err(dx0, plain + res) < 1e-6 and rel_err(dx0, plain) > 0.1
    assert torch.equal(rms.rmsnorm_bwd(dy, x, w, rstd, res)[0], rms.rmsnorm_bwd(dy, x, w, rstd, residual=res)[0])
    # half precision: one rounding of (dx + residual), not two
    xh, dyh, resh = x.half(), dy.half(), res.half()
    dxh, _ = rms.rmsnorm_bwd_triton(dyh, xh, w.half(), rstd, resh)
    want = (rms.rmsnorm_bwd_ref(dyh.float(), xh.float(), w.half().float(), rstd)[0] + resh.float()).half()
    assert dxh.dtype == torch.float16 and rel_err(dxh, want) < 2e-3
    with pytest.raises(ValueError, match="residual has shape"):
        rms.rmsnorm_bwd_triton(dy, x, w, rstd, res[:-1])


@cpu
@pytest.mark.parametrize("N,H,D,strided", [(63, 3, 96, False), (17, 5, 24, True), (9, 2, 10, False)])
def test_rope_kernel(N, H, D, strided):
    _seed(N)
    x = torch.randn(N, H + 2, D)[:, 1 : H + 1] if strided else torch.randn(N, H, D)
    pos = torch.randint(0, 512, (N,), dtype=torch.int32)
    f = freqs(1e6 if strided else 1e4, D)
    for m in (1.0, 1.25):
        assert rel_err(rope.rope_fwd_triton(x, pos, f, m), rope.rope_fwd_ref(x, pos, f, m)) < TOL32
        assert rel_err(rope.rope_bwd_triton(x, pos, f, m), rope.rope_bwd_ref(x, pos, f, m)) < TOL32


@cpu
def test_rope_kernel_inverts():
    _seed()
    x = torch.randn(31, 4, 64)
    pos = torch.arange(31, dtype=torch.int32) * 37
    f = freqs(1e6, 64)
    y = rope.rope_fwd_triton(x, pos, f)
    assert rel_err(rope.rope_bwd_triton(y, pos, f), x) < 1e-6


@cpu
@pytest.mark.parametrize("N,I", [(63, 80), (3, 1100)])
def test_swiglu_kernel(N, I):
    _seed(N)
    gu, da = torch.randn(N, 2 * I) * 3, torch.randn(N, I)
    assert rel_err(swi.swiglu_fwd_triton(gu), swi.swiglu_fwd_ref(gu)) < TOL32
    assert rel_err(swi.swiglu_bwd_triton(da, gu), swi.swiglu_bwd_ref(da, gu)) < TOL32
    wide = torch.randn(N, 2 * I + 6)[:, 3 : 3 + 2 * I]  # row-strided gu
    assert rel_err(swi.swiglu_fwd_triton(wide), swi.swiglu_fwd_ref(wide)) < TOL32
    assert rel_err(swi.swiglu_bwd_triton(da, wide), swi.swiglu_bwd_ref(da, wide)) < TOL32


@cpu
def test_swiglu_kernel_bf16():
    _seed()
    gu, da = torch.randn(63, 160).bfloat16(), torch.randn(63, 80).bfloat16()
    a, dgu = swi.swiglu_fwd_triton(gu), swi.swiglu_bwd_triton(da, gu)
    assert a.dtype == dgu.dtype == torch.bfloat16
    assert rel_err(a, swi.swiglu_fwd_ref(gu.float())) < TOL16
    assert rel_err(dgu, swi.swiglu_bwd_ref(da.float(), gu.float())) < TOL16


@cpu
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embedding_kernel(ids_dtype):
    _seed()
    V, D, N = 333, 96, 63
    W = torch.randn(V + 4, D + 8)[2 : V + 2, :D]  # a row-strided view, as in the flat buffer
    ids = torch.randint(0, V, (N,), dtype=ids_dtype)
    ids[:9] = 7
    ids[-1] = V - 1
    assert torch.equal(emb.embedding_fwd_triton(ids, W), emb.embedding_fwd_ref(ids, W))
    dx = torch.randn(N, D)
    dW = torch.randn(V, D)
    dW0 = dW.clone()
    emb.embedding_bwd_triton(dx, ids, dW)  # accumulates into what is there
    emb.embedding_bwd_ref(dx, ids, dW0)
    assert rel_err(dW, dW0) < 1e-6



@cpu
def test_embedding_backward_is_deterministic(monkeypatch):
    """The backward's bits do not depend on the order its programs run in (on a GPU, any): run
    again with every launch's programs in reverse order (the interpreter patched), onto a dW that
    already holds something (a tied head's gradient) and with many repeated ids over several
    tiles and rounds. Atomic adds, which land in program order here, fail this."""
    _seed()
    V, D, N = 37, 20, 900
    ids = torch.randint(0, V, (N,))
    ids[::7] = 5  # a long run, across tiles
    dx = torch.randn(N, D)
    base = torch.randn(V, D)
    fwd = base.clone()
    emb.embedding_bwd_triton(dx, ids, fwd)
    b = _interp.interpreter_builder
    orig = b.set_grid_idx
    monkeypatch.setattr(b, "set_grid_idx", lambda x, y, z: orig(*(g - 1 - i for g, i in zip(b.grid_dim, (x, y, z)))))
    rev = base.clone()
    emb.embedding_bwd_triton(dx, ids, rev)
    assert torch.equal(fwd, rev)
    ref = base.clone()
    emb.embedding_bwd_ref(dx, ids, ref)
    assert rel_err(fwd, ref) < 1e-6


# ------------------------------------------------------------------ dispatch
def _all_ops(x, w, dy, xr, pos, gu, da, ids, W, dW, suffix):
    """Every forward and backward of the four ops, through the public op (suffix "") or the
    twin (suffix "_ref"); embedding's backward accumulates into dW."""
    f = lambda m, name: getattr(m, name + suffix)  # noqa: E731
    y, rstd = f(rms, "rmsnorm_fwd")(x, w, 1e-6)
    f(emb, "embedding_bwd")(gu[:, :24], ids, dW)
    return [y, rstd, *f(rms, "rmsnorm_bwd")(dy, x, w, rstd), f(rope, "rope_fwd")(xr, pos, freqs(1e4, 24)),
            f(rope, "rope_bwd")(xr, pos, freqs(1e4, 24)), f(swi, "swiglu_fwd")(gu), f(swi, "swiglu_bwd")(da, gu),
            f(emb, "embedding_fwd")(ids, W), dW]


@cpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_public_ops_dispatch(monkeypatch, backend):
    """RLCU_BACKEND=triton reaches the kernels (the twins are made to fail) and the torch
    backend the twins; both give the twins' numbers."""
    _seed()
    args = dict(x=torch.randn(21, 24), w=1 + 0.1 * torch.randn(24), dy=torch.randn(21, 24),
                xr=torch.randn(7, 3, 24), pos=torch.arange(7, dtype=torch.int32), gu=torch.randn(9, 48),
                da=torch.randn(9, 24), ids=torch.randint(0, 50, (9,)), W=torch.randn(50, 24))
    want = _all_ops(**args, dW=torch.zeros(50, 24), suffix="_ref")
    monkeypatch.setenv("RLCU_BACKEND", backend)
    if backend == "triton":
        def boom(*a, **k):
            raise AssertionError("a twin ran")

        for m in (rms, rope, swi, emb):
            for name in dir(m):
                if name.endswith("_ref"):
                    monkeypatch.setattr(m, name, boom)
    got = _all_ops(**args, dW=torch.zeros(50, 24), suffix="")
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < TOL32, i


@cpu
def test_launcher_checks():
    with pytest.raises(ValueError, match="w must have shape"):
        rms.rmsnorm_fwd_triton(torch.randn(4, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="must be even"):
        rope.rope_fwd_triton(torch.randn(4, 2, 7), torch.zeros(4, dtype=torch.int32), freqs(1e4, 6))
    with pytest.raises(ValueError, match=r"inv_freq must be a float32 \[4\] tensor"):
        rope.rope_fwd(torch.randn(4, 2, 8), torch.zeros(4, dtype=torch.int32), freqs(1e4, 10))
    with pytest.raises(ValueError, match="odd width"):
        swi.swiglu_fwd_triton(torch.randn(4, 7))
    with pytest.raises(TypeError, match="fp32"):
        emb.embedding_bwd_triton(torch.randn(3, 8), torch.zeros(3, dtype=torch.long),
                                 torch.zeros(5, 8, dtype=torch.bfloat16))


# ------------------------------------------------------------------ GPU: real shapes, bf16
gpu = pytest.mark.gpu
N_GPU = 4096 * 2


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


@gpu
@pytest.mark.parametrize("rows,D", [(N_GPU, 1024), (N_GPU * 16, 128), (N_GPU // 8, 5120)])
def test_gpu_rmsnorm(rows, D):
    torch.manual_seed(0)
    x, dy, w = _bf16(rows, D), _bf16(rows, D), (1 + 0.1 * torch.randn(D, device="cuda")).bfloat16()
    y, rstd = rms.rmsnorm_fwd(x, w, 1e-6)
    dx, dw = rms.rmsnorm_bwd(dy, x, w, rstd)
    y0, rstd0 = rms.rmsnorm_fwd_ref(x.float(), w.float(), 1e-6)
    dx0, dw0 = rms.rmsnorm_bwd_ref(dy.float(), x.float(), w.float(), rstd0)
    assert y.dtype == dx.dtype == torch.bfloat16 and rstd.dtype == dw.dtype == torch.float32
    assert rel_err(y, y0) < TOL16 and rel_err(rstd, rstd0) < 1e-5
    assert rel_err(dx, dx0) < TOL16 and rel_err(dw, dw0) < 1e-3
    # the fixed-order dw reduction is deterministic
    assert torch.equal(rms.rmsnorm_bwd(dy, x, w, rstd)[1], dw)
    # with the residual branch's gradient added in the same pass (the decoder layers' form)
    res = _bf16(rows, D)
    dxr, dwr = rms.rmsnorm_bwd(dy, x, w, rstd, res)
    assert rel_err(dxr, dx0 + res.float()) < TOL16 and torch.equal(dwr, dw)
    # a row-strided view (a slice of a wider activation) gives the same numbers
    wide = _bf16(rows, D + 64)
    wide[:, 32 : 32 + D] = x
    yv, _ = rms.rmsnorm_fwd(wide[:, 32 : 32 + D], w, 1e-6)
    assert torch.equal(yv, y)


@gpu
@pytest.mark.parametrize("H", [16, 8])
def test_gpu_rope(H):
    torch.manual_seed(0)
    cu = torch.arange(0, N_GPU + 1, 1024, device="cuda", dtype=torch.int32)
    pos = rope.positions_from_cu_seqlens(cu, N_GPU)
    x = _bf16(N_GPU, H, 128)
    f = freqs(1e6, 128, "cuda")
    assert rel_err(rope.rope_fwd(x, pos, f), rope.rope_fwd_ref(x.float(), pos, f)) < TOL16
    assert rel_err(rope.rope_bwd(x, pos, f), rope.rope_bwd_ref(x.float(), pos, f)) < TOL16


@gpu
def test_gpu_rope_long_positions_fp32():
    """Angles of positions up to 40k: the kernel is as close to fp64 truth as the twin is."""
    torch.manual_seed(0)
    x = torch.randn(4096, 2, 128, device="cuda")
    pos = torch.randint(0, 40960, (4096,), device="cuda", dtype=torch.int32)
    inv_freq = 1e6 ** -(torch.arange(0, 128, 2, device="cuda", dtype=torch.float64) / 128)
    ang = pos.double()[:, None, None] * inv_freq  # [N, 1, 64], fp64 throughout
    x1, x2 = x.double()[..., :64], x.double()[..., 64:]
    truth = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
    f = freqs(1e6, 128, "cuda")
    err_k = rel_err(rope.rope_fwd(x, pos, f), truth)
    err_t = rel_err(rope.rope_fwd_ref(x, pos, f), truth)
    assert err_k < max(4 * err_t, 1e-5)


@gpu
def test_gpu_swiglu():
    torch.manual_seed(0)
    I = 3072
    gu, da = _bf16(N_GPU, 2 * I, scale=2.0), _bf16(N_GPU, I)
    a, dgu = swi.swiglu_fwd(gu), swi.swiglu_bwd(da, gu)
    assert a.dtype == dgu.dtype == torch.bfloat16
    assert rel_err(a, swi.swiglu_fwd_ref(gu.float())) < TOL16
    assert rel_err(dgu, swi.swiglu_bwd_ref(da.float(), gu.float())) < TOL16


@gpu
@pytest.mark.parametrize("D", [1024, 96])
def test_gpu_embedding(D):
    torch.manual_seed(0)
    V = 151936
    W = _bf16(V, D)
    ids = torch.randint(0, V, (N_GPU,), device="cuda")
    ids[:64] = 11  # repeats
    ids[-1] = V - 1
    assert torch.equal(emb.embedding_fwd(ids, W), W[ids])
    dx = _bf16(N_GPU, D)
    dW = torch.randn(V, D, device="cuda")  # accumulates into what is there
    dW0 = dW.clone()
    emb.embedding_bwd(dx, ids, dW)
    emb.embedding_bwd_ref(dx.float(), ids, dW0)
    assert rel_err(dW, dW0) < 1e-6
    # a row-strided fp32 view (a slice of the flat gradient buffer)
    flat = torch.zeros(V * (D + 64) + 4, device="cuda")
    dWv = flat[4 : 4 + V * (D + 64)].view(V, D + 64)[:, :D]
    emb.embedding_bwd(dx, ids, dWv)
    dW0 = torch.zeros(V, D, device="cuda")
    emb.embedding_bwd_ref(dx.float(), ids, dW0)
    assert rel_err(dWv, dW0) < 1e-6 and float(flat[:4].abs().sum()) == 0.0
    assert float(flat[4 : 4 + V * (D + 64)].view(V, D + 64)[:, D:].abs().sum()) == 0.0


@gpu
def test_gpu_embedding_backward_is_deterministic():
    """The same backward three times onto the same nonzero dW (a tied head's gradient), many
    repeated ids over many tiles: the same bits (atomics did not give them)."""
    torch.manual_seed(0)
    V, D = 151936, 1024
    ids = torch.randint(0, V, (N_GPU,), device="cuda")
    ids[::5] = 11  # a run over many tiles and rounds
    dx = _bf16(N_GPU, D)
    base = torch.randn(V, D, device="cuda")
    outs = []
    for _ in range(3):
        dW = base.clone()
        emb.embedding_bwd(dx, ids, dW)
        outs.append(dW)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    ref = base.clone()
    emb.embedding_bwd_ref(dx.float(), ids, ref)
    assert rel_err(outs[0], ref) < 1e-6
