"""The fused attention-input prep (q/k RMSNorm + RoPE + KV-cache write): the kernel against its
twin, and the twin against the unfused sequence of ops that the engine's model runner runs.

On the CPU the kernel runs under TRITON_INTERPRET=1 in fp32 at small odd shapes; the `gpu` tests
run Qwen3-0.6B shapes in bf16 against the unfused Triton ops (equal to within one bf16 ulp).
"""

import os
import warnings

import pytest
import torch
from support.hf_util import rel_err

import rlcu.ops.qkv_prep as qp
from rlcu.model.rope import RopeSpec, inv_freq
from rlcu.ops.kv_cache import kv_write
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.rope import rope_fwd

# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU, before triton is first imported
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
cpu = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 set before triton is imported")
gpu = pytest.mark.gpu
EPS, THETA = 1e-6, 1e6


def freqs(D, device="cpu"):
    return inv_freq(RopeSpec(theta=THETA), D, device)


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    warnings.filterwarnings("ignore", "overflow", RuntimeWarning)


def _inputs(N, Hq, Hk, D, dtype=torch.float32, device="cpu", BS=16, seed=0, pad_cols=0):
    """Random qkv rows (a strided view when pad_cols > 0), norm weights, positions not starting
    at 0, distinct cache slots in a shuffled pool with every third slot -1, caches of garbage."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    W = (Hq + 2 * Hk) * D
    qkv = rand(N, W + pad_cols)[:, :W]
    q_w, k_w = (1 + 0.1 * rand(D)).to(dtype), (1 + 0.1 * rand(D)).to(dtype)
    pos = torch.randint(5, 3000, (N,), generator=g, device=device, dtype=torch.int32)
    num_blocks = -(-N // BS) + 2
    slots = torch.randperm(num_blocks * BS, generator=g, device=device)[:N].to(torch.int64)
    slots[::3] = -1
    kc, vc = rand(num_blocks, BS, Hk, D), rand(num_blocks, BS, Hk, D)
    return qkv, q_w, k_w, pos, slots, kc, vc


def _unfused(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, eps, f):
    """The sequence of ops of paged_forward.hidden (before fusion)."""
    N, qs, ks = qkv.shape[0], Hq * D, Hk * D
    q, _ = rmsnorm_fwd(qkv[:, :qs].reshape(N * Hq, D), q_w, eps)
    k, _ = rmsnorm_fwd(qkv[:, qs:qs + ks].reshape(N * Hk, D), k_w, eps)
    v = qkv[:, qs + ks:].view(N, Hk, D)
    q = rope_fwd(q.view(N, Hq, D), pos, f)
    k = rope_fwd(k.view(N, Hk, D), pos, f)
    kv_write(k, v, kc, vc, slots)
    return q


def _both(fn_a, fn_b, args, Hq, Hk, D):
    """Run two implementations on the same inputs with their own copies of the caches."""
    qkv, q_w, k_w, pos, slots, kc, vc = args
    kc_a, vc_a, kc_b, vc_b = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    f = freqs(D, qkv.device)
    qa = fn_a(qkv, q_w, k_w, pos, slots, kc_a, vc_a, Hq, Hk, D, EPS, f)
    qb = fn_b(qkv, q_w, k_w, pos, slots, kc_b, vc_b, Hq, Hk, D, EPS, f)
    return (qa, kc_a, vc_a), (qb, kc_b, vc_b)


# ------------------------------------------------------------------ twin vs the unfused ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_equals_unfused_ops(dtype, monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    Hq, Hk, D = 4, 2, 32
    args = _inputs(33, Hq, Hk, D, dtype)
    a, b = _both(qp.qkv_prep_ref, _unfused, args, Hq, Hk, D)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a[0].shape == (33, Hq, D) and a[0].is_contiguous()


# ------------------------------------------------------------------ kernel vs twin
@cpu
@pytest.mark.parametrize("N,Hq,Hk,D,pad", [(7, 4, 2, 32, 0), (33, 4, 2, 32, 0), (7, 4, 2, 64, 0),
                                           (33, 4, 2, 64, 5), (5, 6, 2, 24, 3), (3, 3, 1, 6, 0),
                                           (300, 4, 2, 32, 3)])  # past "decode": the bulk launch
def test_kernel_matches_twin(N, Hq, Hk, D, pad, triton_backend):
    args = _inputs(N, Hq, Hk, D, pad_cols=pad)
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _both(qp.qkv_prep, qp.qkv_prep_ref, args, Hq, Hk, D)
    assert q.shape == (N, Hq, D) and q.is_contiguous()
    assert rel_err(q, q_ref) < 1e-5
    assert rel_err(kc, kc_ref) < 1e-5
    assert torch.equal(vc, vc_ref)  # v is copied
    # slots that no token writes keep their contents
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    slots = args[4]
    written[slots[slots >= 0]] = True
    keep = ~written
    assert torch.equal(kc.view(-1, Hk, D)[keep], args[5].view(-1, Hk, D)[keep])
    assert torch.equal(vc.view(-1, Hk, D)[keep], args[6].view(-1, Hk, D)[keep])


@cpu
def test_kernel_matches_unfused_kernels(triton_backend):
    """The same rounding points and angle formula as the unfused Triton kernels: under the
    interpreter the only difference is the order of the sum of squares (a few fp32 ulps)."""
    Hq, Hk, D = 4, 2, 64
    args = _inputs(33, Hq, Hk, D, seed=1)
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _both(qp.qkv_prep, _unfused, args, Hq, Hk, D)
    assert rel_err(q, q_ref) < 1e-6 and rel_err(kc, kc_ref) < 1e-6 and torch.equal(vc, vc_ref)


@cpu
def test_kernel_empty_and_no_slots(triton_backend):
    Hq, Hk, D = 4, 2, 32
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(7, Hq, Hk, D)
    kc0, vc0 = kc.clone(), vc.clone()
    q = qp.qkv_prep(qkv[:0], q_w, k_w, pos[:0], slots[:0], kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device))
    assert q.shape == (0, Hq, D)
    slots = torch.full_like(slots, -1)
    q = qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device))
    q_ref = qp.qkv_prep_ref(qkv, q_w, k_w, pos, slots, kc0.clone(), vc0.clone(), Hq, Hk, D, EPS, freqs(D, qkv.device))
    assert rel_err(q, q_ref) < 1e-5 and torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_launch_decode_rows_and_bulk():
    """A decode step's few rows get a program each (the measured H200 configs); many rows, or any
    call with stats, the bulk launch, whose config never follows N: the trainer's and exact
    mode's engine rows run one kernel."""
    assert qp.launch(64, 4096, False) == (1, 8)  # Qwen3-0.6B heads: 16 q, 8 kv, 128
    assert qp.launch(256, 8192, False) == (1, 16)  # 8B: 32 q
    assert qp.launch(64, 16384, False) == qp.launch(64, 16384, True) == (1, 8)  # 32B: 64 q, bulk always
    assert qp.launch(257, 4096, False) == qp.launch(8192, 4096, False) == (4, 8)
    for row in (64, 4096, 8192, 16384):
        assert len({qp.launch(n, row, True) for n in (1, 64, 256, 8192, 1 << 20)}) == 1


def test_errors():
    Hq, Hk, D = 4, 2, 32
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(7, Hq, Hk, D)
    with pytest.raises(ValueError, match="qkv must be"):
        qp.qkv_prep(qkv[:, :-1], q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device))
    with pytest.raises(ValueError, match="head_dim"):
        qp.qkv_prep(torch.randn(7, 42), q_w[:7], k_w[:7], pos, slots, kc[..., :7], vc[..., :7], 4, 1, 7, EPS,
                    freqs(6))
    with pytest.raises(ValueError, match="k_w"):
        qp.qkv_prep(qkv, q_w, k_w[:-1], pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device))
    with pytest.raises(ValueError, match="caches"):
        qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc[..., :16], vc[..., :16], Hq, Hk, D, EPS, freqs(D, qkv.device))
    with pytest.raises(ValueError, match="slots"):
        qp.qkv_prep(qkv, q_w, k_w, pos, slots[:-1], kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device))
    with pytest.raises(ValueError, match=r"inv_freq must be a float32 \[16\]"):
        qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D)[:-1])
    with pytest.raises(ValueError, match="inv_freq must be"):
        qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, 1e6)


# ------------------------------------------------------------------ GPU
def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of bf16 (sign-magnitude bits mapped to a line)."""

    def line(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (line(a) - line(b)).abs()


@gpu
@pytest.mark.parametrize("N", [256, 8192])
def test_gpu_bf16_matches_unfused_ops(N, monkeypatch):
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    Hq, Hk, D = 16, 8, 128  # Qwen3-0.6B
    args = _inputs(N, Hq, Hk, D, torch.bfloat16, "cuda")
    (q, kc, vc), (q_ref, kc_ref, vc_ref) = _both(qp.qkv_prep, _unfused, args, Hq, Hk, D)
    assert torch.equal(vc, vc_ref)
    for a, b in ((q, q_ref), (kc, kc_ref)):
        # the sum of squares is reduced in another order: rstd moves by an fp32 ulp, which
        # flips a bf16 rounding now and then; RoPE then mixes two such values, and where
        # x1 cos - x2 sin cancels, one input ulp is many output ulps: compare in norm
        u = _bf16_ulps(a, b)
        frac, err = float((u > 0).float().mean()), rel_err(a.float(), b.float())
        print(f"N={N}: {frac:.2e} of elements differ, max {int(u.max())} ulps, rel err {err:.2e}")
        assert frac < 0.02 and err < 1e-3, f"{frac:.2e} differ, rel err {err:.2e}"


@gpu
def test_gpu_fp32_matches_twin_and_does_not_recompile(monkeypatch):
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    Hq, Hk, D = 16, 8, 128
    compiled = []
    for N in (1, 63, 1000, 3000):  # two launches (qkv_prep.launch): decode rows, then bulk
        args = _inputs(N, Hq, Hk, D, torch.float32, "cuda", seed=N)
        (q, kc, vc), (q_ref, kc_ref, vc_ref) = _both(qp.qkv_prep, qp.qkv_prep_ref, args, Hq, Hk, D)
        # one frequency table; the angles' cos/sin are the GPU's and torch's
        print(f"N={N}: rel err vs twin q {rel_err(q, q_ref):.2e} k {rel_err(kc, kc_ref):.2e}")
        assert rel_err(q, q_ref) < 1e-4 and rel_err(kc, kc_ref) < 1e-4 and torch.equal(vc, vc_ref)
        _, (q_op, kc_op, _) = _both(qp.qkv_prep, _unfused, args, Hq, Hk, D)
        assert rel_err(q, q_op) < 1e-6 and rel_err(kc, kc_op) < 1e-6
        caches = getattr(qp._qkv_prep_kernel, "device_caches", None)
        if caches:
            compiled.append(sum(len(c[0]) for c in caches.values()))
    if compiled:
        assert compiled[1] == compiled[0] and compiled[3] == compiled[2] == compiled[0] + 1, \
            f"kernel compiled again for a new N: {compiled}"


# ------------------------------------------------------------------ exact mode: the trainer's entry
def _stats_twin(qkv, q_w, k_w, pos, Hq, Hk, D):
    """The unfused ops on all rows, with the rstd rmsnorm returns: what qk_norm_rope stands for."""
    N, qs, ks = qkv.shape[0], Hq * D, Hk * D
    q, rq = rmsnorm_fwd(qkv[:, :qs].reshape(N * Hq, D), q_w, EPS)
    k, rk = rmsnorm_fwd(qkv[:, qs:qs + ks].reshape(N * Hk, D), k_w, EPS)
    f = freqs(D, qkv.device)
    q, k = rope_fwd(q.view(N, Hq, D), pos, f), rope_fwd(k.view(N, Hk, D), pos, f)
    return q, k, qkv[:, qs + ks:].reshape(N, Hk, D), rq, rk


def _check_stats(got, want, tol):
    for name, a, b in zip(("q", "k", "v", "rq", "rk"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if name == "v":
            assert torch.equal(a, b)
        else:
            assert rel_err(a.float(), b.float()) < tol, name


def _rows_alone(qkv, q_w, k_w, pos, Hq, Hk, D, lo, hi):
    """Rows lo:hi given alone (another N, another program and place in it): same bits."""
    full = qp.qk_norm_rope(qkv, q_w, k_w, pos, Hq, Hk, D, EPS, freqs(D, qkv.device))
    part = qp.qk_norm_rope(qkv[lo:hi].clone(), q_w, k_w, pos[lo:hi].clone(), Hq, Hk, D, EPS, freqs(D, qkv.device))
    for name, a, b in zip(("q", "k", "v"), full, part):
        assert torch.equal(a[lo:hi], b), name
    assert torch.equal(full[3].view(-1, Hq)[lo:hi], part[3].view(-1, Hq))
    assert torch.equal(full[4].view(-1, Hk)[lo:hi], part[4].view(-1, Hk))


def test_qk_norm_rope_twin_is_the_unfused_ops(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    Hq, Hk, D = 4, 2, 32
    qkv, q_w, k_w, pos, *_ = _inputs(21, Hq, Hk, D, seed=4)
    got = qp.qk_norm_rope(qkv, q_w, k_w, pos, Hq, Hk, D, EPS, freqs(D, qkv.device))
    for a, b in zip(got, _stats_twin(qkv, q_w, k_w, pos, Hq, Hk, D)):
        assert torch.equal(a, b)


@cpu
@pytest.mark.parametrize("N,Hq,Hk,D", [(33, 4, 2, 32), (9, 3, 1, 6), (17, 6, 2, 24)])
def test_qk_norm_rope_kernel_matches_twin_and_engine(N, Hq, Hk, D, triton_backend):
    """The kernel's q, k, v and stats against the unfused ops; a row's bits do not depend on the
    batch; and the engine's call (`qkv_prep(..., stats=True)` into a paged cache) gives the
    trainer's q and k bit for bit."""
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(N, Hq, Hk, D, seed=N)
    got = qp.qk_norm_rope(qkv, q_w, k_w, pos, Hq, Hk, D, EPS, freqs(D, qkv.device))
    _check_stats(got, _stats_twin(qkv, q_w, k_w, pos, Hq, Hk, D), 1e-5)
    _rows_alone(qkv, q_w, k_w, pos, Hq, Hk, D, 3, 8)
    slots = torch.randperm(kc.shape[0] * kc.shape[1])[:N]  # every token has a slot here
    q, rq, rk = qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device), True)
    assert torch.equal(q, got[0]) and torch.equal(rq, got[3]) and torch.equal(rk, got[4])
    assert torch.equal(kc.view(-1, Hk, D)[slots], got[1]) and torch.equal(vc.view(-1, Hk, D)[slots], got[2])


@gpu
def test_gpu_qk_norm_rope_engine_rows_equal_trainer_rows(monkeypatch):
    """Qwen3-0.6B heads in bf16: a training batch of 8192 tokens through qk_norm_rope, and 64 of
    its rows through the engine's call into a paged cache (a decode step): the same bits."""
    monkeypatch.delenv("RLCU_BACKEND", raising=False)
    Hq, Hk, D = 16, 8, 128
    qkv, q_w, k_w, pos, _, kc, vc = _inputs(8192, Hq, Hk, D, torch.bfloat16, "cuda", seed=7)
    got = qp.qk_norm_rope(qkv, q_w, k_w, pos, Hq, Hk, D, EPS, freqs(D, qkv.device))
    _check_stats(got, _stats_twin(qkv, q_w, k_w, pos, Hq, Hk, D), 2e-3)
    rows = torch.randperm(8192, device="cuda")[:64]
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device="cuda")[:64]
    q, rq, rk = qp.qkv_prep(qkv[rows], q_w, k_w, pos[rows], slots, kc, vc, Hq, Hk, D, EPS, freqs(D, qkv.device), True)
    assert torch.equal(q, got[0][rows])
    assert torch.equal(kc.view(-1, Hk, D)[slots], got[1][rows])
    assert torch.equal(rq.view(-1, Hq), got[3].view(-1, Hq)[rows])
    _rows_alone(qkv, q_w, k_w, pos, Hq, Hk, D, 1000, 1037)


# ------------------------------------------------------------------ rope alone, the q/k/v bias
def _bias_twin(qkv, bias, pos, Hq, Hk, D, q_w=None, k_w=None):
    """(q, k, v) of the unfused ops: qkv + bias (fp32, rounded once), then norm where q_w is
    given, rope; what the families' layers compute."""
    N, qs, ks = qkv.shape[0], Hq * D, Hk * D
    x = qkv if bias is None else (qkv.float() + bias.float()).to(qkv.dtype)
    q, k = x[:, :qs].reshape(N * Hq, D), x[:, qs:qs + ks].reshape(N * Hk, D)
    if q_w is not None:
        q, k = rmsnorm_fwd(q, q_w, EPS)[0], rmsnorm_fwd(k, k_w, EPS)[0]
    f = freqs(D, qkv.device)
    return rope_fwd(q.view(N, Hq, D), pos, f), rope_fwd(k.view(N, Hk, D), pos, f), x[:, qs + ks:].reshape(N, Hk, D)


@cpu
@pytest.mark.parametrize("N,Hq,Hk,D", [(19, 7, 1, 20), (33, 4, 2, 32), (5, 3, 3, 6)])
@pytest.mark.parametrize("norm,biased", [(False, False), (False, True), (True, True)])
def test_kernel_rope_alone_and_bias(N, Hq, Hk, D, norm, biased, triton_backend):
    """q_w = k_w = None (Llama, Mistral, Qwen2) and a q/k/v bias (Qwen2), both launches (a few rows
    and stats' bulk), against the twin and the unfused ops; rows without a slot write nowhere."""
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(N, Hq, Hk, D, seed=N, pad_cols=3)
    q_w, k_w = (q_w, k_w) if norm else (None, None)
    bias = torch.randn((Hq + 2 * Hk) * D) if biased else None
    f = freqs(D)
    for stats in (False, True):
        kc_a, vc_a, kc_b, vc_b = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        got = qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc_a, vc_a, Hq, Hk, D, EPS, f, stats, bias=bias)
        want = qp.qkv_prep_ref(qkv, q_w, k_w, pos, slots, kc_b, vc_b, Hq, Hk, D, EPS, f, stats, bias=bias)
        q, q_ref = (got[0], want[0]) if stats else (got, want)
        assert rel_err(q, q_ref) < 1e-5 and rel_err(kc_a, kc_b) < 1e-5 and torch.equal(vc_a, vc_b)
        if stats and not norm:
            assert got[1:] == want[1:] == (None, None)
    q_op, k_op, v_op = _bias_twin(qkv, bias, pos, Hq, Hk, D, q_w, k_w)
    has = slots >= 0
    assert rel_err(q_ref, q_op) < 1e-6 and torch.equal(vc_b.view(-1, Hk, D)[slots[has]], v_op[has])
    assert rel_err(kc_b.view(-1, Hk, D)[slots[has]], k_op[has]) < 1e-6


@cpu
def test_kernel_rope_alone_is_rope_kernel_bits(triton_backend):
    """Without a norm the kernel rotates as rope.py's kernel does: the same bits (one cos_sin)."""
    N, Hq, Hk, D = 21, 5, 1, 20
    qkv, _, _, pos, slots, kc, vc = _inputs(N, Hq, Hk, D, seed=2)
    f = freqs(D)
    q = qp.qkv_prep(qkv, None, None, pos, slots, kc, vc, Hq, Hk, D, EPS, f, mscale=1.3)
    assert torch.equal(q, rope_fwd(qkv[:, :Hq * D].reshape(N, Hq, D), pos, f, 1.3))


@cpu
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope_bias_engine_rows_equal_trainer_rows(norm, triton_backend):
    """The trainer's qk_norm_rope and the engine's qkv_prep(stats=True) with a bias, with and
    without the norm: the same bits (one kernel); rows alone give the bits they give in the batch."""
    N, Hq, Hk, D = 17, 7, 1, 20
    qkv, q_w, k_w, pos, _, kc, vc = _inputs(N, Hq, Hk, D, seed=9)
    q_w, k_w = (q_w, k_w) if norm else (None, None)
    bias, f = torch.randn((Hq + 2 * Hk) * D), freqs(D)
    got = qp.qk_norm_rope(qkv, q_w, k_w, pos, Hq, Hk, D, EPS, f, bias=bias)
    want = _bias_twin(qkv, bias, pos, Hq, Hk, D, q_w, k_w)
    for a, b in zip(got[:3], want):
        assert rel_err(a, b) < 1e-5
    assert (got[3] is None) == (not norm)
    slots = torch.randperm(kc.shape[0] * kc.shape[1])[:N]
    q = qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, EPS, f, True, bias=bias)[0]
    assert torch.equal(q, got[0]) and torch.equal(kc.view(-1, Hk, D)[slots], got[1])
    assert torch.equal(vc.view(-1, Hk, D)[slots], got[2])
    part = qp.qk_norm_rope(qkv[4:9].clone(), q_w, k_w, pos[4:9].clone(), Hq, Hk, D, EPS, f, bias=bias)
    assert all(torch.equal(a[4:9], b) for a, b in zip(got[:3], part[:3]))


def test_rope_alone_and_bias_errors():
    Hq, Hk, D = 4, 2, 32
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(7, Hq, Hk, D)
    with pytest.raises(ValueError, match="q_w and k_w must both be tensors"):
        qp.qkv_prep(qkv, q_w, None, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D))
    with pytest.raises(ValueError, match=r"bias must be \[\(Hq \+ 2 Hk\) D\] = \[256\]"):
        qp.qkv_prep(qkv, None, None, pos, slots, kc, vc, Hq, Hk, D, EPS, freqs(D), bias=torch.zeros(255))


@cpu
@pytest.mark.parametrize("norm", [False, True])
def test_kernel_yarn_table_and_factor(norm, triton_backend):
    """A YaRN table and its factor on cos/sin (Qwen's long-context form) through the kernel, both
    launches, against the twin; the factor scales q and k, never v."""
    from rlcu.model.rope import mscale

    N, Hq, Hk, D = 13, 7, 1, 20
    spec = RopeSpec.from_hf({"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                 "original_max_position_embeddings": 32768}})
    f, m = inv_freq(spec, D), mscale(spec)
    qkv, q_w, k_w, pos, slots, kc, vc = _inputs(N, Hq, Hk, D, seed=3)
    q_w, k_w = (q_w, k_w) if norm else (None, None)
    for stats in (False, True):
        kc_a, vc_a, kc_b, vc_b = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        got = qp.qkv_prep(qkv, q_w, k_w, pos, slots, kc_a, vc_a, Hq, Hk, D, EPS, f, stats, mscale=m)
        want = qp.qkv_prep_ref(qkv, q_w, k_w, pos, slots, kc_b, vc_b, Hq, Hk, D, EPS, f, stats, mscale=m)
        q, q_ref = (got[0], want[0]) if stats else (got, want)
        assert rel_err(q, q_ref) < 1e-5 and rel_err(kc_a, kc_b) < 1e-5 and torch.equal(vc_a, vc_b)
    plain = qp.qkv_prep_ref(qkv, q_w, k_w, pos, slots, kc.clone(), vc.clone(), Hq, Hk, D, EPS, f)
    assert rel_err(q_ref, plain * m) < 1e-6
